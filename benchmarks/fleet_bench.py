"""A router following a fleet: thousands of ranks in one Subscriber process, and router replicas.

The script starts the engines itself on loopback: ``--engines`` processes of
``--ranks-per-engine`` kvwire ``EventPublisher`` ranks each (one ZeroMQ
context per process), every rank publishing a small batch (two stored blocks,
sometimes a removal) ``--rate`` times per second, spread evenly. Each engine
keeps the truth (the blocks each rank holds). The router is this process: one
``Subscriber`` (background thread) with a ``BlockSetSink``.

Figures (targets from the fleet-scale issue), in order:

1. every rank SYNCED after ``start()`` (target: 1,024 ranks within 10 s);
2. router CPU at ``--rate`` (target <= 10% of a core at 1 batch per rank per
   second) and with every rank idle (target <= 2%), over ``--window`` s;
3. exact: after a pause every rank's view equals its engine's truth;
4. one engine killed and restarted on the same ports (fresh seqs, empty
   cache): time from its first new batch until all its ranks are SYNCED and
   exact (target <= 2 s);
5. memory per followed rank (router RSS growth / ranks).

``--history B`` gives every rank B blocks (in batches of 1,000) before the router
starts, with a replay buffer of 8 batches: first contact needs a snapshot of each
rank (kvwire publishers serve them). The cold start then prints, besides the
time to SYNCED, the engines' CPU while it ran and the snapshots asked, failed and
timed out, and the most requests in flight (``--cold-start-only`` stops after the
exactness check).

``--replicas N`` instead measures router replicas: N router processes (this
script, ``--router-child``) follow the same engines; the engines' CPU per
batch is measured with 0..N subscribers connected and each router must end
exact.

Run: ``.venv/bin/python benchmarks/fleet_bench.py`` (1,024 ranks),
``--engines 8 --ranks-per-engine 512`` (4,096), ``--replicas 4``.
"""

from __future__ import annotations

import argparse
import json
import random
import resource
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import zmq
from _fleet import MASK, ROOT, Child, cpu_s, free_base, rss_bytes, wait_for

from kvwire.publisher import EventPublisher, PublisherConfig
from kvwire.subscriber import (
    BlockSetSink,
    EngineSource,
    RankState,
    Subscriber,
    SubscriberConfig,
)
from kvwire.wire import (
    BlockRemoved,
    BlockStored,
    KVEvent,
    KVEventBatch,
)
from kvwire.wire.heartbeat import DEFAULT_INTERVAL_S, TRAILING_GAP

PROBE_RATE = SubscriberConfig().probe_rate


# --- engines (child processes) --------------------------------------------------------


class RankModel:
    """One rank's cache: small batches, the blocks it holds."""

    def __init__(self, seed: int, rank: int) -> None:
        self.rng = random.Random(seed * 100_003 + rank)
        self.rank = rank
        self.next_block = (seed * 100_003 + rank) * 1_000_000_000 + 1
        self.truth: set[int] = set()
        self.recent: list[int] = []

    def batch(self) -> KVEventBatch:
        events: list[KVEvent] = []
        recent = [h for h in self.recent if h in self.truth]
        if recent and self.rng.random() < 0.4:
            victim = [self.rng.choice(recent)]
            events.append(BlockRemoved(block_hashes=victim))
            self.truth.difference_update(victim)
        hashes = [self.next_block, self.next_block + 1]
        self.next_block += 2
        self.truth.update(hashes)
        self.recent = hashes
        tokens = [(h * 31 + i) % 50_000 for h in hashes for i in range(16)]
        events.append(
            BlockStored(
                block_hashes=hashes, parent_block_hash=None, token_ids=tokens, block_size=16
            )
        )
        return KVEventBatch(time.time(), events, self.rank)

    def history(self, blocks: int) -> KVEventBatch:
        """``blocks`` stored blocks in one batch, before the router starts."""
        hashes = list(range(self.next_block, self.next_block + blocks))
        self.next_block += blocks
        self.truth.update(hashes)
        tokens = [(h * 31 + i) % 50_000 for h in hashes for i in range(16)]
        stored = BlockStored(
            block_hashes=hashes, parent_block_hash=None, token_ids=tokens, block_size=16
        )
        return KVEventBatch(time.time(), [stored], self.rank)

    def digest(self) -> list[int]:
        return [len(self.truth), sum(self.truth) & MASK]


def engine_main(args: argparse.Namespace) -> None:
    ranks = args.ranks_per_engine
    ctx: zmq.Context[Any] = zmq.Context(io_threads=1)
    ctx.set(zmq.MAX_SOCKETS, 4 * ranks + 64)
    pubs = [
        EventPublisher(
            f"tcp://127.0.0.1:{args.port}",
            f"tcp://127.0.0.1:{args.replay_port}",
            PublisherConfig(
                heartbeat_s=args.heartbeat or None,
                buffer_steps=8 if args.history else PublisherConfig().buffer_steps,
            ),
            rank=r,
            context=ctx,
        ).start()
        for r in range(ranks)
    ]
    models = [RankModel(args.seed * 10 + args.life, r) for r in range(ranks)]
    for p, m in zip(pubs, models, strict=True):
        left = args.history
        while left > 0:
            p.publish(m.history(min(1000, left)))
            left -= 1000
    deadline = time.monotonic() + 300
    while args.history and time.monotonic() < deadline:
        if not any(p.queue_depth or p.stats().mirror_pending for p in pubs):
            break
        time.sleep(0.05)
    lock = threading.Lock()
    running = threading.Event()
    stop = threading.Event()

    def out(**kw: Any) -> None:
        print(json.dumps(kw), flush=True)

    def publish_loop() -> None:
        step = 1.0 / (args.rate * ranks)
        next_t = time.monotonic()
        r = 0
        while not stop.is_set():
            if not running.wait(0.1):
                next_t = time.monotonic()
                continue
            with lock:
                if running.is_set():
                    pubs[r].publish(models[r].batch())
            r = (r + 1) % ranks
            next_t += step
            delay = next_t - time.monotonic()
            if delay > 0:
                time.sleep(delay)
            elif delay < -1.0:
                next_t = time.monotonic()  # fell behind: do not burst to catch up

    def drained() -> None:
        deadline = time.monotonic() + 10
        while any(p.queue_depth for p in pubs) and time.monotonic() < deadline:
            time.sleep(0.005)

    def cpu() -> float:
        ru = resource.getrusage(resource.RUSAGE_SELF)
        return ru.ru_utime + ru.ru_stime

    sender = threading.Thread(target=publish_loop, daemon=True)
    sender.start()
    out(ready=True)
    for line in sys.stdin:
        cmd = line.split()
        if not cmd:
            continue
        if cmd[0] == "run":
            running.set()
            out(ok=True)
        elif cmd[0] == "pause":
            with lock:
                running.clear()
            drained()
            out(seqs=[p.last_seq + 1 for p in pubs], digests=[m.digest() for m in models])
        elif cmd[0] == "burst":
            t0 = time.monotonic()
            with lock:
                for p, m in zip(pubs, models, strict=True):
                    p.publish(m.batch())
            drained()
            out(t0=t0, seqs=[p.last_seq + 1 for p in pubs], digests=[m.digest() for m in models])
        elif cmd[0] == "cpu":
            out(cpu=cpu(), batches=sum(p.last_seq + 1 for p in pubs))
        elif cmd[0] == "quit":
            break
    stop.set()
    for p in pubs:
        p.close(timeout=1.0)
    ctx.term()


class Engine(Child):
    """Handle on one engine process."""

    def __init__(self, index: int, port: int, replay_port: int, args: argparse.Namespace) -> None:
        super().__init__(f"engine-{index}")
        self.index = index
        self.port = port
        self.replay_port = replay_port
        self.args = args
        self.worker_id = self.name
        self.life = 0

    def launch(self) -> None:
        a = self.args
        self.spawn(
            [
                sys.executable,
                __file__,
                "--engine-child",
                "--port",
                str(self.port),
                "--replay-port",
                str(self.replay_port),
                "--ranks-per-engine",
                str(a.ranks_per_engine),
                "--rate",
                str(a.rate),
                "--seed",
                str(self.index),
                "--life",
                str(self.life),
                "--heartbeat",
                str(a.heartbeat),
                "--history",
                str(a.history),
            ]
        )

    def source(self) -> EngineSource:
        return EngineSource(
            self.worker_id,
            f"tcp://127.0.0.1:{self.port}",
            f"tcp://127.0.0.1:{self.replay_port}",
            ranks=self.args.ranks_per_engine,
        )


def start_engines(args: argparse.Namespace) -> list[Engine]:
    taken: set[int] = set()
    engines = []
    for i in range(args.engines):
        base = free_base(2 * args.ranks_per_engine, taken)
        engines.append(Engine(i, base, base + args.ranks_per_engine, args))
    for e in engines:
        e.launch()
    for e in engines:
        e.ask("")  # ready
    return engines


# --- router side ---------------------------------------------------------------------


def all_synced(sub: Subscriber, keys: list[tuple[str, int]]) -> bool:
    state = sub.rank_state
    return all(state(w, r) is RankState.SYNCED for w, r in keys)


def exact(
    sub: Subscriber, sink: BlockSetSink, worker: str, seqs: list[int], digests: list[list[int]]
) -> bool:
    by_rank = {s.rank: s for s in sub.status() if s.worker_id == worker}
    for r, (seq, digest) in enumerate(zip(seqs, digests, strict=True)):
        st = by_rank.get(r)
        # Heartbeats (empty batches) go on after the pause: seqs may pass it.
        if st is None or st.state is not RankState.SYNCED or st.expected_seq < seq:
            return False
        blocks = sink.blocks(worker, r)
        if [len(blocks), sum(blocks) & MASK] != digest:
            return False
    return True


def measure_cpu(window: float) -> float:
    """Share of one core this process used over ``window`` s (the main thread sleeps)."""
    return measure_split(window, None)[0]


def measure_split(window: float, thread: threading.Thread | None) -> tuple[float, float]:
    """Shares of one core over ``window`` s: this process, and ``thread`` alone (0 without)."""
    clock = None
    if thread is not None and thread.ident is not None:
        clock = time.pthread_getcpuclockid(thread.ident)
    c0, t0 = cpu_s(), time.monotonic()
    th0 = time.clock_gettime(clock) if clock is not None else 0.0
    time.sleep(window)
    th1 = time.clock_gettime(clock) if clock is not None else 0.0
    dt = time.monotonic() - t0
    return (cpu_s() - c0) / dt, (th1 - th0) / dt


def fleet(args: argparse.Namespace) -> None:
    ranks = args.engines * args.ranks_per_engine
    print(
        f"fleet: {args.engines} engine processes x {args.ranks_per_engine} ranks = {ranks} ranks, "
        f"{args.rate} batch/rank/s, heartbeats "
        + (f"every {args.heartbeat:g} s" if args.heartbeat else "off")
        + "; router: one Subscriber + BlockSetSink in this process"
    )
    engines = start_engines(args)
    try:
        for e in engines:
            e.ask("run")
        keys = [(e.worker_id, r) for e in engines for r in range(args.ranks_per_engine)]
        sink = BlockSetSink()
        rss0 = rss_bytes()
        engines_cpu0 = sum(e.ask("cpu")["cpu"] for e in engines)
        t0 = time.monotonic()
        sub = Subscriber([e.source() for e in engines], sink).start(timeout=30)
        started = time.monotonic() - t0
        synced = wait_for(lambda: all_synced(sub, keys), 120, 0.05)
        if synced is not None:
            synced += started
        rss1 = rss_bytes()
        if synced is None:
            statuses = sub.status()
            counts: dict[str, int] = {}
            for st in statuses:
                counts[st.state.value] = counts.get(st.state.value, 0) + 1
            print(f"NOT all SYNCED after 120 s: {counts}")
            for st in [s for s in statuses if s.state is not RankState.SYNCED][:3]:
                print(f"  e.g. {st.worker_id} rank {st.rank}: {st.state.value} ({st.reason})")
        else:
            verdict = "meets" if synced <= 10 else "MISSES"
            print(f"all {ranks} ranks SYNCED {synced:.2f} s after start()  ({verdict} <= 10 s)")
        if args.history:
            engines_cpu = sum(e.ask("cpu")["cpu"] for e in engines) - engines_cpu0
            c = [st.counters for st in sub.status()]
            env = sub._env
            slots = env.replays if env is not None else None
            peak = (getattr(slots, "peak", 0), getattr(slots, "source_peak", 0))
            print(
                f"cold start of {ranks} ranks x {args.history:,} blocks: engines' CPU "
                f"{engines_cpu:.1f} s; snapshots asked {sum(x.snapshots_requested for x in c)}, "
                f"applied {sum(x.snapshots_applied for x in c)}, failed "
                f"{sum(x.snapshots_failed for x in c)}; request timeouts "
                f"{sum(x.replay_timeouts for x in c)}; most in flight {peak[0]} "
                f"({peak[1]} to one engine); reconnects {sum(x.reconnects for x in c)} "
                f"(SUBs reopened {getattr(env, 'reopens', 0)}), "
                f"resyncs {sum(x.resyncs for x in c)}, held overflows "
                f"{sum(x.held_overflows for x in c)}, restarts {sum(x.restarts for x in c)}"
            )
        print(
            f"router memory: +{(rss1 - rss0) / 2**20:.0f} MiB for {ranks} ranks ="
            f" {(rss1 - rss0) / ranks / 1024:.0f} KiB per rank (sockets, streams, sink contents)"
        )
        def pause_and_check() -> float | None:
            """Pause every engine; how long until the router holds exactly their caches."""
            pauses = [e.ask("pause") for e in engines]
            return wait_for(
                lambda: all(
                    exact(sub, sink, e.worker_id, p["seqs"], p["digests"])
                    for e, p in zip(engines, pauses, strict=True)
                ),
                30,
                0.1,
            )

        if args.cold_start_only:
            ok = pause_and_check()
            print("every rank exact" if ok is not None else "NOT exact 30 s after the pause")
            sub.stop(timeout=30)
            return
        time.sleep(1.0)  # let the first replays settle before measuring
        busy = [measure_cpu(args.window) for _ in range(args.repeats)]
        b = statistics.median(busy)
        print(
            f"router CPU at {args.rate} batch/rank/s ({ranks * args.rate:.0f} batches/s): "
            f"{100 * b:.1f}% of a core (median of {args.repeats} x {args.window:.0f} s; "
            f"{'meets' if b <= 0.10 else 'MISSES'} <= 10%)"
        )
        t_pause = time.monotonic()
        ok = pause_and_check()
        print(
            "every rank exact after the pause"
            if ok is not None
            else "NOT exact 30 s after the pause",
            f"({time.monotonic() - t_pause:.2f} s)",
        )
        # Idle ranks are probed once per interval, counted from their last batch:
        # measure once the first round of probes is under way. Publishers that
        # heartbeat are never probed; their first heartbeat after a batch comes sooner
        # than the idle ones (within TRAILING_GAP intervals): measure once it has gone.
        interval = max(1.0, ranks / PROBE_RATE)
        wait = TRAILING_GAP * args.heartbeat if args.heartbeat else min(interval, args.idle_settle)
        settle = wait - (time.monotonic() - t_pause)
        if settle > 0:
            if not args.heartbeat:
                print(f"(waiting {settle:.0f} s for the idle probes to start)")
            time.sleep(settle)
        reader = next((t for t in threading.enumerate() if t.name == "kvwire-subscriber"), None)
        splits = [measure_split(args.window, reader) for _ in range(args.repeats)]
        i = statistics.median(s[0] for s in splits)
        own = statistics.median(s[1] for s in splits)
        probes = sum(s.counters.probes for s in sub.status())
        what = (
            f"{ranks / args.heartbeat:.0f} heartbeats/s"
            if args.heartbeat
            else f"{probes} idle probes so far, each rank probed every {interval:.0f} s"
        )
        print(
            f"router CPU with every rank idle: {100 * i:.2f}% of a core "
            f"({'meets' if i <= 0.02 else 'MISSES'} <= 2%; {what}; the subscriber's thread "
            f"{100 * own:.2f}%, libzmq's I/O thread and the rest {100 * (i - own):.2f}%)"
        )
        # One engine restarted: fresh seqs, empty cache, same ports.
        victim = engines[0]
        victim.kill()
        victim.life += 1
        victim.launch()
        victim.ask("")
        burst = victim.ask("burst")
        resumed = burst["t0"]
        ok = wait_for(
            lambda: exact(sub, sink, victim.worker_id, burst["seqs"], burst["digests"]), 30, 0.02
        )
        after = time.monotonic() - resumed
        restarts = sum(
            1 for s in sub.status() if s.worker_id == victim.worker_id and s.counters.restarts
        )
        if ok is None:
            print("restarted engine NOT exact within 30 s")
        else:
            print(
                f"engine of {args.ranks_per_engine} ranks restarted: exact {after:.2f} s after its "
                f"traffic resumed ({'meets' if after <= 2 else 'MISSES'} <= 2 s; "
                f"{restarts} ranks saw the restart)"
            )
        sub.stop(timeout=30)
    finally:
        for e in engines:
            e.close()


# --- replicas ------------------------------------------------------------------------


def router_child(args: argparse.Namespace) -> None:
    """One router replica: follows the engines given as JSON, answers on stdout."""
    specs = json.loads(args.router_child)
    sources = [EngineSource(w, ep, rep, ranks=n) for w, ep, rep, n in specs]
    keys = [(s.worker_id, r) for s in sources for r in range(s.ranks)]
    sink = BlockSetSink()
    sub = Subscriber(sources, sink).start(timeout=30)
    took = wait_for(lambda: all_synced(sub, keys), 120, 0.05)
    print(json.dumps({"synced": took}), flush=True)
    for line in sys.stdin:
        cmd, _, rest = line.partition(" ")
        if cmd.strip() == "check":
            pauses: list[tuple[str, dict[str, Any]]] = json.loads(rest)

            def all_exact(pauses: list[tuple[str, dict[str, Any]]] = pauses) -> bool:
                return all(exact(sub, sink, w, p["seqs"], p["digests"]) for w, p in pauses)

            ok = wait_for(all_exact, 30, 0.1)
            print(json.dumps({"exact": ok is not None}), flush=True)
        elif cmd.strip() == "quit":
            break
    sub.stop(timeout=30)


def replicas(args: argparse.Namespace) -> None:
    ranks = args.engines * args.ranks_per_engine
    rate = args.rate
    print(
        f"replicas: {args.replicas} router processes follow {args.engines} engines x "
        f"{args.ranks_per_engine} ranks at {rate} batch/rank/s ({ranks * rate:.0f} batches/s)"
    )
    engines = start_engines(args)
    routers: list[subprocess.Popen[str]] = []
    try:
        for e in engines:
            e.ask("run")
        specs = json.dumps(
            [
                (e.worker_id, f"tcp://127.0.0.1:{e.port}", f"tcp://127.0.0.1:{e.replay_port}",
                 args.ranks_per_engine)
                for e in engines
            ]
        )

        def engine_cost() -> tuple[float, float]:
            """Engines' CPU (s) and batches over one window."""
            a = [e.ask("cpu") for e in engines]
            time.sleep(args.window)
            b = [e.ask("cpu") for e in engines]
            cpu = sum(y["cpu"] - x["cpu"] for x, y in zip(a, b, strict=True))
            batches = sum(y["batches"] - x["batches"] for x, y in zip(a, b, strict=True))
            return cpu, batches

        costs: list[float] = []
        for k in range(args.replicas + 1):
            if k:
                proc = subprocess.Popen(
                    [sys.executable, __file__, "--router-child", specs],
                    stdin=subprocess.PIPE,
                    stdout=subprocess.PIPE,
                    text=True,
                    cwd=ROOT,
                )
                routers.append(proc)
                assert proc.stdout is not None
                took = json.loads(proc.stdout.readline())["synced"]
                print(
                    f"router {k}: all {ranks} ranks SYNCED {took:.2f} s after start"
                    if took is not None
                    else f"router {k}: NOT all {ranks} ranks SYNCED after 120 s"
                )
            samples = []
            for _ in range(args.repeats):
                cpu, batches = engine_cost()
                samples.append(1e6 * cpu / max(batches, 1))
            costs.append(statistics.median(samples))
            print(
                f"  {k} subscriber(s): engines' CPU {costs[-1]:.1f} us per batch published"
                f" (median of {args.repeats} x {args.window:.0f} s)"
            )
        extra = [(costs[k] - costs[0]) / k for k in range(1, len(costs))]
        print(
            "engines' cost per extra subscriber: "
            + ", ".join(f"{x:+.1f} us/batch" for x in extra)
            + f" (with 1..{args.replicas}); median {statistics.median(extra):+.1f} us per batch"
        )
        pauses = [(e.worker_id, e.ask("pause")) for e in engines]
        payload = json.dumps(pauses)
        for proc in routers:
            assert proc.stdin is not None
            proc.stdin.write(f"check {payload}\n")
            proc.stdin.flush()
        verdicts = []
        for proc in routers:
            assert proc.stdout is not None
            verdicts.append(json.loads(proc.stdout.readline())["exact"])
        print(
            f"{sum(verdicts)} of {len(routers)} routers exact after the pause"
            + ("" if all(verdicts) else "  (FAILED)")
        )
    finally:
        for proc in routers:
            if proc.stdin is not None:
                try:
                    proc.stdin.write("quit\n")
                    proc.stdin.close()
                except (BrokenPipeError, ValueError):
                    pass
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
        for e in engines:
            e.close()


def main() -> None:
    doc = __doc__ or ""
    parser = argparse.ArgumentParser(description=doc.splitlines()[0])
    parser.add_argument("--engines", type=int, default=8)
    parser.add_argument("--ranks-per-engine", type=int, default=128)
    parser.add_argument("--rate", type=float, default=1.0, help="batches per rank per second")
    parser.add_argument("--window", type=float, default=10.0, help="CPU window, seconds")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--replicas", type=int, default=0)
    parser.add_argument(
        "--heartbeat",
        type=float,
        default=DEFAULT_INTERVAL_S,
        help="publishers' heartbeat interval, s (0: none; default: the publishers' own)",
    )
    parser.add_argument(
        "--idle-settle", type=float, default=120.0, help="longest wait for idle probes to start"
    )
    parser.add_argument(
        "--history", type=int, default=0, help="blocks each rank holds before the router starts"
    )
    parser.add_argument("--cold-start-only", action="store_true")
    parser.add_argument("--engine-child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--router-child", help=argparse.SUPPRESS)
    parser.add_argument("--port", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--replay-port", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--seed", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--life", type=int, default=0, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.engine_child:
        engine_main(args)
    elif args.router_child:
        router_child(args)
    elif args.replicas:
        replicas(args)
    else:
        fleet(args)


if __name__ == "__main__":
    main()
