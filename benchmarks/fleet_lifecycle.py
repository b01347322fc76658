"""A router's life with a fleet: cold starts, warm restarts, clones, replicas, checkpoints.

The script starts the engines itself on loopback and prints one table, each
case side by side: time until every rank is SYNCED, whether the view is exact
(every rank's blocks in the router's ``PrefixIndex`` == the blocks its engine
holds, checked after a pause), the PARTIAL ranks left, router and engines' CPU,
and the engines' live delay p99 where the case asks for it. Traffic goes on
through every case (one batch per rank per second by default).

Engines (child processes, one thread of traffic each), of two kinds:

- ``kvwire``: one ``EventPublisher`` per rank (snapshots and heartbeats on);
- ``stock``: a simulator of the engines' own publishers (vLLM 0.33's
  ``ZmqEventPublisher``): per rank a PUB sending ``[topic, seq, payload]`` and
  a ROUTER replay buffer answering ``[b"", topic, seq, payload]``... then the
  END marker; no snapshot, no epoch, no heartbeat. One thread polls every
  rank's sockets, so one process serves up to 1,024 ranks.

Each rank holds ``--blocks`` blocks of 16 tokens in content-chained runs of
``--run`` blocks; the replay buffers (``--buffer`` batches) are far shorter
than that history. Every engine keeps the truth as block ranges and reports
each rank's (count, sum, xor) of block hashes at a pause.

Cases (``--cases``):

1. cold start, kvwire publishers: all SYNCED and exact (target 20 s);
2. cold start, stock publishers: the PARTIAL ranks it leaves (no snapshot);
3. warm restart from the router's checkpoint after ``--down`` s down
   (target: SYNCED and exact 3 s after start), both kinds;
4. clone from a running replica (target 3 s), both kinds; engines' extra CPU;
5. 4 replicas started at once: the engines' live delay p99 (target 10 ms), batches
   only, with the floor (the same four routers synced, merely following) and the
   catch-up's cost over it apart (``live_floor.py`` measures the floor alone);
6. fresh router, ``--case6-procs`` stock simulator processes x 1,024 ranks
   (target: SYNCED and exact within 10 s);
7. a checkpoint written by a running router: duration, size, and the router's
   own event delay p99 around it.

Cases 3, 4 and 7 need ``SubscriberConfig(checkpoint=..., clone_from=...)``,
``Subscriber.checkpoint()`` and ``Subscriber.serve_view()``; where those are
missing the row says "not available".

Run: ``.venv/bin/python benchmarks/fleet_lifecycle.py`` (1,024 ranks x 20,000
blocks), ``--quick`` (64 ranks x 2,000 blocks), ``--busy`` (a CPU hog on one
core throughout).
"""

from __future__ import annotations

import argparse
import contextlib
import inspect
import json
import logging
import os
import resource
import select
import struct
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter, deque
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import numpy as np
import zmq
from _fleet import MASK, Child, cpu_s, free_base, percentile, rss_bytes, wait_for

from kvwire.prefix_index import PrefixIndex
from kvwire.publisher import EventPublisher, PublisherConfig
from kvwire.subscriber import EngineSource, RankState, Subscriber, SubscriberConfig
from kvwire.wire import END_SEQ, DecodeLimits, Dialect
from kvwire.wire.codec import RemovedParts, StoredParts, encode_parts, pack_int_array

BLOCK_SIZE = 16
TOKEN_MUL = np.uint64(2654435761)
TOKEN_STEP = np.arange(BLOCK_SIZE, dtype=np.uint64) * np.uint64(40503)
VOCAB = np.uint64(50_000)


class _Log:
    """Where the children's logs go: a file, so that the table stays readable."""

    file: IO[Any] | None = None


LOG = _Log()


# --- what each rank holds -------------------------------------------------------------


def _xor_upto(n: int) -> int:
    """0 ^ 1 ^ ... ^ n (0 for n < 0)."""
    if n < 0:
        return 0
    return (n, 1, n + 1, 0)[n % 4]


class RankModel:
    """One rank's cache as ranges of consecutive block hashes, one range per chain.

    Stores add chains of ``run`` blocks (parent: none); evictions take blocks
    from the tail of the oldest chain, leaves first, as an LRU cache does. The
    truth is the ranges, so a digest costs one step per chain, not per block.
    """

    def __init__(self, engine: int, rank: int, life: int, run: int) -> None:
        self.rank = rank
        self.run = run
        self.next = ((engine + 1) << 52) | (rank << 40) | ((life & 15) << 36)
        self.chains: deque[list[int]] = deque()  # [first hash, length]
        self.held = 0

    def _store(self) -> StoredParts:
        first = self.next
        self.next += self.run
        self.chains.append([first, self.run])
        self.held += self.run
        hashes = np.arange(first, first + self.run, dtype=np.uint64)
        tokens = (hashes[:, None] * TOKEN_MUL + TOKEN_STEP) % VOCAB
        return StoredParts(
            pack_int_array(hashes, hashes="unsigned"),
            None,
            pack_int_array(tokens.ravel()),
            BLOCK_SIZE,
            None,
            "GPU",
            None,
        )

    def _evict(self, n: int) -> RemovedParts | None:
        gone: list[np.ndarray[Any, np.dtype[np.uint64]]] = []
        while n > 0 and self.chains:
            chain = self.chains[0]
            k = min(n, chain[1])
            end = chain[0] + chain[1]
            gone.append(np.arange(end - k, end, dtype=np.uint64))
            chain[1] -= k
            if not chain[1]:
                self.chains.popleft()
            self.held -= k
            n -= k
        if not gone:
            return None
        return RemovedParts(pack_int_array(np.concatenate(gone), hashes="unsigned"), "GPU")

    def payload(self, runs: int, keep: int) -> bytes:
        """One batch storing ``runs`` chains, evicting down to ``keep`` blocks first."""
        events: list[Any] = []
        excess = self.held + runs * self.run - keep
        removed = self._evict(excess) if excess > 0 else None
        if removed is not None:
            events.append(removed)
        events.extend(self._store() for _ in range(runs))
        return encode_parts(time.time(), events, self.rank)

    def digest(self) -> list[int]:
        """[count, sum mod 2**64, xor] of the block hashes held."""
        total = 0
        x = 0
        for first, n in self.chains:
            total += (2 * first + n - 1) * n // 2
            x ^= _xor_upto(first + n - 1) ^ _xor_upto(first - 1)
        return [self.held, total & MASK, x]


def digest_of(blocks: set[int]) -> list[int]:
    """[count, sum mod 2**64, xor] of a set of block hashes."""
    if not blocks:
        return [0, 0, 0]
    a = np.fromiter(blocks, dtype=np.uint64, count=len(blocks))
    return [len(blocks), int(a.sum(dtype=np.uint64)), int(np.bitwise_xor.reduce(a))]


# --- engines (child processes) --------------------------------------------------------


class Encoded:
    """A batch already encoded: handed to ``EventPublisher.publish`` as a pending batch."""

    __slots__ = ("payload",)

    def __init__(self, payload: bytes) -> None:
        self.payload = payload

    def encode(self, dialect: Dialect) -> bytes:
        return self.payload


class KvwireRank:
    """A rank published by kvwire's ``EventPublisher`` (snapshots, heartbeats, epoch)."""

    pending = False
    """Hand batches over as Python pending batches (``--pending``), which the sender thread
    encodes with the GIL taken, instead of as encoded bytes, which it copies without."""

    def __init__(
        self, ctx: zmq.Context[Any], port: int, replay_port: int, rank: int, buffer: int
    ) -> None:
        self.pub = EventPublisher(
            f"tcp://127.0.0.1:{port}",
            f"tcp://127.0.0.1:{replay_port}",
            PublisherConfig(buffer_steps=buffer, snapshot=True),
            rank=rank,
            context=ctx,
        ).start()

    def publish(self, payload: bytes) -> None:
        self.pub.publish(Encoded(payload) if self.pending else payload)

    @property
    def next_seq(self) -> int:
        return self.pub.last_seq + 1

    def busy(self) -> bool:
        return self.pub.queue_depth > 0 or self.pub.stats().mirror_pending > 0

    def close(self) -> None:
        self.pub.close(timeout=1.0)


class StockRank:
    """A rank published as vLLM 0.33's ``ZmqEventPublisher`` does, on the caller's thread.

    Live ``[topic, seq, payload]`` on a PUB; the last ``buffer`` batches kept for
    replay; a request ``[b"", start_seq]`` on the ROUTER is answered with every
    buffered batch from ``start_seq`` as ``[b"", topic, seq, payload]``, then
    ``[b"", b"", END_SEQ, b""]``. Older seqs are silently not there.
    """

    def __init__(
        self, ctx: zmq.Context[Any], port: int, replay_port: int, rank: int, buffer: int
    ) -> None:
        port += rank
        replay_port += rank
        self.pub = ctx.socket(zmq.PUB)
        self.pub.setsockopt(zmq.SNDHWM, 100_000)
        self.pub.setsockopt(zmq.LINGER, 0)
        self.pub.bind(f"tcp://127.0.0.1:{port}")
        self.router = ctx.socket(zmq.ROUTER)
        self.router.setsockopt(zmq.LINGER, 0)
        self.router.bind(f"tcp://127.0.0.1:{replay_port}")
        self.buffer: deque[tuple[int, bytes, bytes]] = deque(maxlen=buffer)
        self.seq = 0
        self.replays = 0

    def publish(self, payload: bytes) -> None:
        seq = self.seq.to_bytes(8, "big")
        self.pub.send_multipart((b"", seq, payload), copy=False)
        self.buffer.append((self.seq, seq, payload))
        self.seq += 1

    def serve(self) -> None:
        while True:
            try:
                frames = self.router.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            if len(frames) != 3:
                continue  # vLLM logs "Invalid replay request" and answers nothing
            client, _, start = frames
            first = int.from_bytes(start, "big")
            self.replays += 1
            for seq, seq_bytes, payload in self.buffer:
                if seq >= first:
                    self.router.send_multipart((client, b"", b"", seq_bytes, payload), copy=False)
            self.router.send_multipart((client, b"", b"", END_SEQ, b""), copy=False)

    @property
    def next_seq(self) -> int:
        return self.seq

    def busy(self) -> bool:
        return False

    def close(self) -> None:
        self.pub.close(0)
        self.router.close(0)


def engine_child(spec: dict[str, Any]) -> None:
    """Engines of one process: a single thread runs traffic, preload and (stock) replays."""
    _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    kind = spec["kind"]
    KvwireRank.pending = bool(spec.get("pending"))
    engines = spec["engines"]  # [worker_id, port, replay_port, ranks, index]
    total = sum(e[3] for e in engines)
    ctx: zmq.Context[Any] = zmq.Context(io_threads=1)
    ctx.set(zmq.MAX_SOCKETS, 4 * total + 64)
    ranks: list[KvwireRank | StockRank] = []
    models: list[RankModel] = []
    names: list[tuple[str, int]] = []
    for worker, port, replay_port, n, index in engines:
        for r in range(n):
            make = KvwireRank if kind == "kvwire" else StockRank
            ranks.append(make(ctx, port, replay_port, r, spec["buffer"]))
            models.append(RankModel(index, r, spec["life"], spec["run"]))
            names.append((worker, r))
    keep = spec["blocks"]
    preload_runs = spec["preload_runs"]
    step = 1.0 / (spec["rate"] * total)

    def out(**kw: Any) -> None:
        sys.stdout.write(json.dumps(kw) + "\n")
        sys.stdout.flush()

    # One epoll set over stdin and every ROUTER's ZeroMQ descriptor: zmq_poll over a
    # thousand sockets costs about 0.5 ms a call, epoll nothing while they are idle.
    # The descriptors signal edges, so each wake-up drains its socket, and a sweep
    # once a second covers an edge consumed by a send.
    stdin = sys.stdin.fileno()
    poller = select.epoll()
    poller.register(stdin, select.EPOLLIN)
    by_fd: dict[int, StockRank] = {}
    for rank in ranks:
        if isinstance(rank, StockRank):
            fd = rank.router.getsockopt(zmq.FD)
            poller.register(fd, select.EPOLLIN)
            by_fd[fd] = rank
    swept = time.monotonic()
    running = False
    preload: deque[int] | None = None
    pending = b""
    next_t = time.monotonic()
    cursor = 0
    quit_ = False

    def drained() -> None:
        deadline = time.monotonic() + 30
        while any(r.busy() for r in ranks) and time.monotonic() < deadline:
            time.sleep(0.005)

    def report() -> dict[str, Any]:
        per: dict[str, dict[str, list[Any]]] = {}
        for (worker, _), rank, model in zip(names, ranks, models, strict=True):
            entry = per.setdefault(worker, {"seqs": [], "digests": []})
            entry["seqs"].append(rank.next_seq)
            entry["digests"].append(model.digest())
        return per

    def counters() -> dict[str, Any]:
        snapshots = replays = built = refused = gil = 0
        for rank in ranks:
            if isinstance(rank, KvwireRank):
                st = rank.pub.stats()
                snapshots += st.snapshots_served
                replays += st.replay_served
                built += st.snapshots_built
                refused += st.snapshots_refused
                gil += st.sender_gil_takes
            else:
                replays += rank.replays
        return {
            "cpu": cpu_s(),
            "snapshots": snapshots,
            "replays": replays,
            "rss": rss_bytes(),
            "built": built,
            "refused": refused,
            "gil": gil,
        }

    def command(line: str) -> None:
        nonlocal running, preload, next_t, quit_
        cmd = line.strip()
        if cmd == "preload":
            # Each rank's history, in batches of ``preload_runs`` chains, ranks round-robin.
            need = -(-keep // (spec["run"] * preload_runs))
            preload = deque(i for _ in range(need) for i in range(len(ranks)))
        elif cmd == "run":
            running = True
            next_t = time.monotonic()
            out(ok=True)
        elif cmd == "pause":
            running = False
            drained()
            out(pause=report())
        elif cmd == "cpu":
            out(**counters())
        elif cmd == "quit":
            quit_ = True

    while not quit_:
        now = time.monotonic()
        if preload:
            timeout = 0
        elif running:
            timeout = max(5, int(1000 * (next_t - now)))
        else:
            timeout = 100
        for fd, _ in poller.poll(timeout / 1000):
            if fd == stdin:
                chunk = os.read(stdin, 65536)
                if not chunk:
                    quit_ = True
                    break
                pending += chunk
                while b"\n" in pending:
                    line, _, pending = pending.partition(b"\n")
                    command(line.decode())
            else:
                by_fd[fd].serve()
        if by_fd and time.monotonic() - swept > 1.0:
            swept = time.monotonic()
            for rank in by_fd.values():
                rank.serve()
        if preload:
            for _ in range(min(256, len(preload))):
                i = preload.popleft()
                ranks[i].publish(models[i].payload(preload_runs, keep))
            if not preload:
                preload = None
                drained()
                out(preloaded=sum(m.held for m in models))
        if running:
            now = time.monotonic()
            while next_t <= now:
                ranks[cursor].publish(models[cursor].payload(1, keep))
                cursor = (cursor + 1) % len(ranks)
                next_t += step
            if now - next_t > 1.0:
                next_t = now  # fell behind: do not burst to catch up
    for rank in ranks:
        rank.close()
    ctx.term()


class Fleet:
    """Engine processes of one kind, each serving ``engines_per_proc`` engines of ranks."""

    def __init__(
        self,
        kind: str,
        procs: int,
        engines_per_proc: int,
        ranks_per_engine: int,
        args: argparse.Namespace,
        *,
        blocks: int,
        buffer: int,
        preload_runs: int,
        tag: str,
        taken: set[int],
    ) -> None:
        """``taken``: the ports the run has handed out (its other fleets', its routers'
        endpoints); this fleet's are added."""
        self.kind = kind
        self.ranks_per_engine = ranks_per_engine
        self.layout: list[list[list[Any]]] = []
        index = 0
        for _ in range(procs):
            engines = []
            for _ in range(engines_per_proc):
                base = free_base(2 * ranks_per_engine, taken)
                engines.append(
                    [f"{tag}-{index}", base, base + ranks_per_engine, ranks_per_engine, index]
                )
                index += 1
            self.layout.append(engines)
        self.children: list[Child] = []
        for p, engines in enumerate(self.layout):
            spec = {
                "kind": kind,
                "engines": engines,
                "blocks": blocks,
                "run": args.run,
                "preload_runs": preload_runs,
                "buffer": buffer,
                "rate": args.rate,
                "life": 0,
                "pending": args.pending,
            }
            child = Child(f"{tag} engines {p}")
            child.spawn([sys.executable, __file__, "--engine-child", json.dumps(spec)], LOG.file)
            self.children.append(child)
        try:  # each child answers once its sockets are bound; one that failed says so here
            self.counters()
        except Exception:
            self.close()
            raise

    @property
    def ranks(self) -> int:
        return sum(e[3] for engines in self.layout for e in engines)

    def sources(self) -> list[list[Any]]:
        return [
            [w, f"tcp://127.0.0.1:{port}", f"tcp://127.0.0.1:{rport}", n]
            for engines in self.layout
            for w, port, rport, n, _ in engines
        ]

    def live_endpoints(self, most: int) -> list[str]:
        """Live endpoints of up to ``most`` ranks spread over the fleet (for the delay probe).

        An engine process's traffic thread goes round its ranks once a second, every
        process from about the same instant: a stride within each process, shifted from
        one process to the next, gives every probed rank's batch a moment of its own.
        """
        procs = [
            [f"tcp://127.0.0.1:{port + r}" for _, port, _, n, _ in engines for r in range(n)]
            for engines in self.layout
        ]
        take = max(1, -(-most // len(procs)))
        out: list[str] = []
        for p, eps in enumerate(procs):
            stride = max(1, len(eps) // take)
            out.extend(eps[p * stride // len(procs) :: stride][:take])
        return out[:most]

    def ask_all(self, command: str) -> list[dict[str, Any]]:
        for c in self.children:
            c.send(command)
        return [c.reply() for c in self.children]

    def preload(self) -> int:
        return sum(r["preloaded"] for r in self.ask_all("preload"))

    def pause(self) -> dict[str, Any]:
        merged: dict[str, Any] = {}
        for r in self.ask_all("pause"):
            merged.update(r["pause"])
        return merged

    def counters(self) -> dict[str, float]:
        replies = self.ask_all("cpu")
        keys = ("cpu", "snapshots", "replays", "rss", "built", "refused", "gil")
        return {k: sum(r.get(k, 0) for r in replies) for k in keys}

    def close(self) -> None:
        for c in self.children:
            c.close()


# --- the engines' live delay, seen from a plain SUB ---------------------------------------


class DelayProbe:
    """Reads a sample of ranks' live streams; records receive time - the batch's ts.

    Batches and heartbeats (empty batches) are recorded apart: every busy rank's
    heartbeat after a batch falls on a shared wall-clock grid (``docs/wire.md``
    section 5), so mixed in they would weigh one instant of the second as much as
    all the batches. The ranks probed are chosen so that their batches come at as
    many distinct moments of the second as there are ranks (``Fleet.live_endpoints``).
    """

    def __init__(self, endpoints: list[str]) -> None:
        self.ctx: zmq.Context[Any] = zmq.Context()
        self.socks = []
        for ep in endpoints:
            s = self.ctx.socket(zmq.SUB)
            s.setsockopt(zmq.SUBSCRIBE, b"")
            s.setsockopt(zmq.LINGER, 0)
            s.connect(ep)
            self.socks.append(s)
        self.samples: list[float] = []  # batches
        self.beats: list[float] = []  # heartbeats
        self.recording = False
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, name="delay-probe", daemon=True)
        self.thread.start()

    def _run(self) -> None:
        poller = zmq.Poller()
        for s in self.socks:
            poller.register(s, zmq.POLLIN)
        while not self.stop.is_set():
            for sock, _ in poller.poll(100):
                while True:
                    try:
                        frames = sock.recv_multipart(zmq.NOBLOCK)
                    except zmq.Again:
                        break
                    self._take(time.time(), frames[-1])

    def _take(self, now: float, payload: bytes) -> None:
        # [ts (float 64), events, rank]: 0x90 at 10 is an empty events array.
        if self.recording and len(payload) >= 11 and payload[1] == 0xCB:
            ts = struct.unpack_from(">d", payload, 2)[0]
            self._record(ts, now - ts, payload[10] == 0x90)

    def _record(self, ts: float, delay: float, beat: bool) -> None:
        (self.beats if beat else self.samples).append(delay)

    def start(self) -> None:
        self.samples = []
        self.beats = []
        self.recording = True

    def p99_ms(self) -> float | None:
        """The batches' delay p99 since :meth:`start`; stops recording."""
        self.recording = False
        p = percentile(self.samples, 0.99)
        return None if p is None else 1000 * p

    def window(self, seconds: float) -> str:
        """Record for ``seconds``: see :meth:`summary`."""
        self.start()
        time.sleep(seconds)
        return self.summary()

    @staticmethod
    def _stats(got: list[float]) -> str:
        if not got:
            return "none"
        p50, p99 = percentile(got, 0.5), percentile(got, 0.99)
        assert p50 is not None and p99 is not None
        return f"{1000 * p50:.1f}/{1000 * p99:.1f}/{1000 * max(got):.1f} ms ({len(got)})"

    def summary(self) -> str:
        """What was recorded since :meth:`start`, batches then heartbeats:
        "p50/p99/max ms (samples), heartbeats p50/p99/max ms (samples)"; stops recording."""
        self.recording = False
        return f"{self._stats(list(self.samples))}, heartbeats {self._stats(list(self.beats))}"

    def close(self) -> None:
        self.stop.set()
        self.thread.join(5)
        for s in self.socks:
            s.close(0)
        self.ctx.term()


# --- routers (child processes) --------------------------------------------------------


class TimedIndex(PrefixIndex):
    """A ``PrefixIndex`` that can sample each applied batch's delay (apply time - ts)."""

    timing = False
    delays: list[float]

    def apply_payload(
        self,
        worker_id: str,
        rank: int,
        payload: bytes | bytearray | memoryview,
        limits: DecodeLimits | None = None,
    ) -> None:
        if limits is None:
            super().apply_payload(worker_id, rank, payload)
        else:
            super().apply_payload(worker_id, rank, payload, limits)
        if self.timing and len(payload) >= 10 and payload[1] == 0xCB:
            self.delays.append(time.time() - struct.unpack_from(">d", payload, 2)[0])


def features() -> dict[str, bool]:
    """Which of the recovery features this tree has."""
    fields = set(SubscriberConfig.__struct_fields__)
    params = set(inspect.signature(Subscriber.__init__).parameters)
    have = fields | params
    return {
        "checkpoint": "checkpoint" in have and hasattr(Subscriber, "checkpoint"),
        "clone": "clone_from" in have and hasattr(Subscriber, "serve_view"),
    }


def make_subscriber(
    sources: list[EngineSource], sink: PrefixIndex, options: dict[str, Any]
) -> Subscriber:
    """A Subscriber with ``options`` given where this tree takes them (config or keyword)."""
    fields = set(SubscriberConfig.__struct_fields__)
    in_config = {k: v for k, v in options.items() if k in fields}
    rest = {k: v for k, v in options.items() if k not in fields}
    config = SubscriberConfig(**in_config)
    return Subscriber(sources, sink, config=config, **rest)


_COUNTED = (
    "replays_requested",
    "replay_timeouts",
    "snapshots_requested",
    "snapshots_applied",
    "snapshots_failed",
    "reconnects",
    "gaps",
    "resyncs",
)


def _counters(sub: Subscriber) -> dict[str, int]:
    """The ranks' recovery counters summed, and the pacing's own (where this tree has them)."""
    total = dict.fromkeys(_COUNTED, 0)
    for st in sub.status():
        for name in _COUNTED:
            total[name] += getattr(st.counters, name)
    env = getattr(sub, "_env", None)
    if env is not None:
        total["reopens"] = getattr(env, "reopens", 0)
        slots = getattr(env, "replays", None)
        if slots is not None:
            total["requests_peak"] = slots.peak
            total["requests_waited"] = slots.waited
            total["requests_limit"] = slots.limit  # (where it follows the rounds: now)
    return total


def _profile_thread() -> Any:
    """With ``KVWIRE_ROUTER_PROFILE=FILE``: a cProfile of the subscriber's thread (its
    start-up, until SYNCED), written to FILE (``{name}`` in it: the router's name and fleet,
    e.g. ``router-3-kv``); else None."""
    if not os.environ.get("KVWIRE_ROUTER_PROFILE"):
        return None
    import cProfile

    profiler = cProfile.Profile()
    main = Subscriber._thread_main

    def profiled(self: Subscriber) -> None:
        profiler.enable()
        main(self)

    Subscriber._thread_main = profiled  # type: ignore[method-assign]
    return profiler


def _dump_profile(sub: Subscriber, profiler: Any, name: str) -> None:
    """Stop the profile on the subscriber's own thread (cProfile is per thread), write it."""
    done = threading.Event()

    def stop() -> None:
        profiler.disable()
        done.set()

    loop = sub._loop
    assert loop is not None
    loop.call_soon_threadsafe(stop)
    done.wait(10)
    profiler.dump_stats(os.environ["KVWIRE_ROUTER_PROFILE"].replace("{name}", name))


def router_child(spec: dict[str, Any]) -> None:
    """One router: follows the sources, answers the orchestrator's commands on stdout."""
    logging.basicConfig(
        level=logging.WARNING, format=f"%(asctime)s router {os.getpid()} %(message)s"
    )
    sources = [EngineSource(w, ep, rep, ranks=n) for w, ep, rep, n in spec["sources"]]
    keys = [(s.worker_id, r) for s in sources for r in range(s.ranks)]
    if spec.get("nice"):
        os.nice(spec["nice"])
    index = TimedIndex(BLOCK_SIZE)
    index.delays = []
    options = {k: spec[k] for k in ("checkpoint", "checkpoint_every", "clone_from") if spec.get(k)}

    def out(**kw: Any) -> None:
        sys.stdout.write(json.dumps(kw) + "\n")
        sys.stdout.flush()

    rss0 = rss_bytes()
    c0 = cpu_s()
    profiler = _profile_thread()
    t0 = time.monotonic()
    sub = make_subscriber(sources, index, options).start(timeout=60)
    if spec.get("serve_view"):
        sub.serve_view(spec["serve_view"])
    deadline = t0 + spec["timeout"]
    settled = None
    shown = t0
    loaded = None  # when the start-up's view (checkpoint or clone) was in, since t0
    first = None  # when the first rank was SYNCED
    restoring = bool(options.get("checkpoint") or options.get("clone_from"))
    while time.monotonic() < deadline:
        if restoring and loaded is None and sub.restore_progress().done:
            loaded = time.monotonic() - t0
        if first is None and sub.is_synced(1 / len(keys)):
            first = time.monotonic() - t0
        if sub.is_synced():
            break
        if spec.get("settle") and time.monotonic() - t0 > 1.0:
            p = sub.progress()
            if p.syncing == 0 and p.replaying == 0 and p.snapshotting == 0:
                settled = time.monotonic() - t0
                break
        if time.monotonic() - shown >= 0.5:  # the start-up's timeline, in the log
            shown = time.monotonic()
            imported = sub.restore_progress().ranks_imported if restoring else 0
            logging.warning(
                "t=%.1f cpu=%.1f imported=%d %s", shown - t0, cpu_s() - c0, imported, sub.progress()
            )
        time.sleep(0.01)
    took = time.monotonic() - t0
    if profiler is not None:
        fleet_tag = spec["sources"][0][0].split("-")[0] if spec["sources"] else ""
        _dump_profile(sub, profiler, f"{spec.get('name', 'router')}-{fleet_tag}")
    p = sub.progress()
    why = Counter(
        f"{st.state.value}: {st.reason}" for st in sub.status() if st.state is not RankState.SYNCED
    )
    out(
        why=why.most_common(3),
        synced=took if p.synced == p.ranks else None,
        settled=settled,
        cpu=cpu_s() - c0,
        rss_mb=(rss_bytes() - rss0) / 2**20,
        index_mb=index.stats().memory_bytes / 2**20,
        synced_ranks=p.synced,
        partial=p.partial,
        syncing=p.syncing,
        stale=p.stale,
        counters=_counters(sub),
        restored_s=None if sub.restored is None else sub.restored.seconds,
        turn_s=getattr(sub.restored, "turn_s", None),
        loaded_at=loaded,
        first_synced=first,
    )

    def exact(pauses: dict[str, Any]) -> tuple[bool, int, float]:
        """Whether every rank is SYNCED at the pause and holds its truth; the ranks that
        are not; the share of the truth's blocks the index holds."""
        by_rank = {(s.worker_id, s.rank): s for s in sub.status()}
        bad = held = truth = 0
        for w, r in keys:
            st = by_rank.get((w, r))
            seq = pauses[w]["seqs"][r]
            want = pauses[w]["digests"][r]
            got = digest_of(index.blocks(w, r))
            held += got[0]
            truth += want[0]
            if (
                st is None
                or st.state is not RankState.SYNCED
                or st.expected_seq < seq
                or got != want
            ):
                bad += 1
        return bad == 0, bad, held / max(1, truth)

    for line in sys.stdin:
        cmd, _, rest = line.strip().partition(" ")
        if cmd == "check":
            wait, _, rest = rest.partition(" ")
            pauses = json.loads(rest)
            found: list[Any] = [len(keys), 0.0]

            def check(pauses: dict[str, Any] = pauses, found: list[Any] = found) -> bool:
                ok, found[0], found[1] = exact(pauses)
                return ok

            took_exact = wait_for(check, float(wait), 0.2)
            out(exact=took_exact is not None, bad=found[0], coverage=found[1])
        elif cmd == "cpu":
            out(cpu=cpu_s(), t=time.monotonic(), rss_mb=(rss_bytes() - rss0) / 2**20)
        elif cmd == "checkpoint":
            window = float(rest or 1.0)
            index.delays = []
            index.timing = True
            time.sleep(window)
            base = percentile(index.delays, 0.99)
            index.delays = []
            w0 = time.monotonic()
            sub.checkpoint()
            wrote = time.monotonic() - w0
            time.sleep(window)
            index.timing = False
            during = percentile(index.delays, 0.99)
            size = os.path.getsize(spec["checkpoint"]) if spec.get("checkpoint") else None
            out(
                duration=wrote,
                size=size,
                base_p99_ms=None if base is None else 1000 * base,
                p99_ms=None if during is None else 1000 * during,
            )
        elif cmd == "quit":
            t = time.monotonic()
            sub.stop(timeout=60)
            out(stopped=time.monotonic() - t)
            return
    sub.stop(timeout=60)


class Router(Child):
    """A router process; ``result`` is its first answer (SYNCED or not, CPU, RSS)."""

    def __init__(self, name: str, fleet: Fleet, timeout: float, **options: Any) -> None:
        super().__init__(name)
        spec = {"sources": fleet.sources(), "timeout": timeout, "name": name, **options}
        self.spawn([sys.executable, __file__, "--router-child", json.dumps(spec)], LOG.file)
        self.result: dict[str, Any] = {}

    def wait(self) -> dict[str, Any]:
        self.result = self.reply()
        return self.result

    def stop(self) -> None:
        with contextlib.suppress(RuntimeError, BrokenPipeError, OSError):
            self.ask("quit")
        self.close(60)


# --- the cases -------------------------------------------------------------------------


@dataclass
class Row:
    case: str
    publishers: str
    ranks: int
    synced: str = "-"
    exact: str = "-"
    partial: str = "-"
    router_cpu: str = "-"
    engines_cpu: str = "-"
    delay: str = "-"
    note: str = ""


def reasons(*results: dict[str, Any]) -> str:
    """The commonest reasons ranks were not SYNCED (over every router given), if any."""
    why: Counter[str] = Counter()
    for result in results:
        for text, n in result.get("why", ()):
            why[text] += n
    if not why:
        return ""
    return "; not SYNCED: " + ", ".join(f"{n} x {text}" for text, n in why.most_common(3))


def asked(result: dict[str, Any]) -> str:
    """What the router asked the engines during its start-up (its counters), if it said."""
    c = result.get("counters")
    if not c:
        return ""
    text = (
        f"; router asked {c['snapshots_requested']:,} snapshots ({c['snapshots_failed']} failed), "
        f"{c['replays_requested']:,} replays, {c['replay_timeouts']} timeouts"
    )
    if "reopens" in c:
        text += f", {c['reopens']} SUBs reopened"
    if "requests_peak" in c:
        text += f", at most {c['requests_peak']} requests in flight"
    return text


def timeline(result: dict[str, Any]) -> str:
    """When, since the router's start, its view was in and its first rank SYNCED, and how
    long the load waited for the loop's turns (the loop connecting and replaying)."""
    loaded, first = result.get("loaded_at"), result.get("first_synced")
    if loaded is None and first is None:
        return ""
    turns = result.get("turn_s")
    waited = "" if turns is None else f", {fmt_s(turns)} of the load the loop's turns"
    return f" (in at {fmt_s(loaded)}, first rank SYNCED at {fmt_s(first)}{waited})"


def fmt_s(x: float | None, unit: str = " s") -> str:
    return "-" if x is None else f"{x:.2f}{unit}"


def verdict(took: float | None, target: float | None) -> str:
    if took is None:
        return "NOT all"
    if target is None:
        return f"{took:.2f} s"
    return f"{took:.2f} s ({'meets' if took <= target else 'MISSES'} <= {target:g})"


class Bench:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.rows: list[Row] = []
        self.have = features()
        self.tmp = Path(tempfile.mkdtemp(prefix="kvwire-lifecycle-"))
        self.taken: set[int] = set()
        self.coverage = 0.0

    def endpoint(self) -> str:
        return f"tcp://127.0.0.1:{free_base(1, self.taken)}"

    def log(self, text: str) -> None:
        print(f"[{time.strftime('%H:%M:%S')}] {text}", flush=True)

    def check(self, router: Router, fleet: Fleet, wait: float = 30.0) -> str:
        """Pause the traffic, ask whether the router's view equals the truth, resume."""
        pauses = fleet.pause()
        answer = router.ask(f"check {wait:g} " + json.dumps(pauses))
        fleet.ask_all("run")
        self.coverage = answer["coverage"]
        return "yes" if answer["exact"] else f"NO ({answer['bad']} ranks)"

    def engine_rate(self, fleet: Fleet, window: float) -> float:
        """The engines' CPU per second of traffic with the routers that are connected now."""
        a = fleet.counters()
        time.sleep(window)
        b = fleet.counters()
        return (b["cpu"] - a["cpu"]) / window

    def start_fleet(self, kind: str, *, tag: str, router_first: bool = False) -> Fleet:
        a = self.args
        # kvwire: a process per engine; stock: one simulator process serves every engine
        procs, per_proc = (a.engines, 1) if kind == "kvwire" else (1, a.engines)
        fleet = Fleet(
            kind,
            procs,
            per_proc,
            a.ranks_per_engine,
            a,
            blocks=a.blocks,
            buffer=a.buffer,
            preload_runs=a.preload_runs,
            tag=tag,
            taken=self.taken,
        )
        return fleet

    # kvwire publishers: cases 1, 7, 4, 3, 5
    def kvwire_cases(self) -> None:
        a = self.args
        cases = a.cases
        if not cases & {1, 3, 4, 5, 7} or "kvwire" not in a.kinds:
            return
        fleet = self.start_fleet("kvwire", tag="kv")
        probe = DelayProbe(fleet.live_endpoints(64))
        try:
            t = time.monotonic()
            held = fleet.preload()
            self.log(
                f"kvwire fleet: {fleet.ranks} ranks hold {held:,} blocks "
                f"({time.monotonic() - t:.1f} s to build; engines' RSS "
                f"{fleet.counters()['rss'] / 2**30:.2f} GiB)"
            )
            fleet.ask_all("run")
            idle_rate = self.engine_rate(fleet, a.window)
            self.log(f"engines' CPU with no router: {100 * idle_rate:.1f}% of a core")
            ckpt = str(self.tmp / "kv.ckpt")
            opts: dict[str, Any] = {}
            if self.have["checkpoint"]:
                opts["checkpoint"] = ckpt
            if self.have["clone"]:
                opts["serve_view"] = self.endpoint()
            # 1. cold start (snapshots)
            c0 = fleet.counters()
            probe.start()
            r1 = Router("router-1", fleet, a.timeout, **opts)
            res = r1.wait()
            delay = probe.p99_ms()
            c1 = fleet.counters()
            row = Row("1 cold start", "kvwire", fleet.ranks)
            row.synced = verdict(res["synced"], 20)
            row.partial = str(res["partial"])
            row.router_cpu = fmt_s(res["cpu"])
            row.engines_cpu = fmt_s(c1["cpu"] - c0["cpu"])
            row.delay = fmt_s(delay, " ms")
            row.note = (
                f"{c1['snapshots'] - c0['snapshots']:.0f} snapshots served; "
                f"router RSS +{res['rss_mb']:.0f} MB (index {res['index_mb']:.0f} MB)"
            ) + asked(res) + reasons(res)
            row.exact = self.check(r1, fleet)
            if 1 in cases:
                self.rows.append(row)
                self.log(f"case 1: {row}")
            # 7. checkpoint write
            if 7 in cases:
                row = Row("7 checkpoint write", "kvwire", fleet.ranks)
                if not self.have["checkpoint"]:
                    row.note = "not available (no Subscriber.checkpoint)"
                else:
                    ans = r1.ask(f"checkpoint {a.window / 2:g}")
                    row.synced = "-"
                    row.delay = (
                        f"router {fmt_s(ans['p99_ms'], ' ms')} "
                        f"(before: {fmt_s(ans['base_p99_ms'], ' ms')})"
                    )
                    size = ans["size"]
                    row.note = f"wrote in {ans['duration']:.2f} s, " + (
                        f"{size / 2**20:.1f} MiB" if size is not None else "size unknown"
                    )
                self.rows.append(row)
                self.log(f"case 7: {row}")
            # 4. clone from the running replica
            if 4 in cases:
                self.rows.append(self.clone_case(fleet, opts, "kvwire", r1))
            # 3. warm restart from the checkpoint
            if 3 in cases:
                row, restarted = self.restart_case(fleet, r1, ckpt, "kvwire")
                self.rows.append(row)
                if restarted is not None:
                    r1 = restarted
            r1.stop()
            # 5. four replicas at once
            if 5 in cases:
                self.rows.append(self.replicas_case(fleet, probe))
        finally:
            probe.close()
            fleet.close()

    def clone_case(
        self, fleet: Fleet, opts: dict[str, Any], kind: str, server: Router | None = None
    ) -> Row:
        a = self.args
        row = Row("4 clone from a replica", kind, fleet.ranks)
        if not self.have["clone"]:
            row.note = "not available (no Subscriber.serve_view / clone_from)"
            self.log(f"case 4 ({kind}): {row}")
            return row
        rate = self.engine_rate(fleet, a.window)  # with the source router connected
        s0 = server.ask("cpu") if server is not None else None
        c0 = fleet.counters()
        t0 = time.monotonic()
        r4 = Router("router-4", fleet, a.timeout, clone_from=opts["serve_view"])
        res = r4.wait()
        elapsed = time.monotonic() - t0
        c1 = fleet.counters()
        served = ""
        if server is not None and s0 is not None:
            # The serving router's CPU meanwhile: following the fleet, and making the pieces.
            s1 = server.ask("cpu")
            served = f"; the serving router {s1['cpu'] - s0['cpu']:.2f} s CPU meanwhile"
        row.synced = verdict(res["synced"], 3)
        row.partial = str(res["partial"])
        row.router_cpu = fmt_s(res["cpu"])
        extra = (c1["cpu"] - c0["cpu"]) - rate * elapsed
        row.engines_cpu = f"{c1['cpu'] - c0['cpu']:.2f} s ({extra:+.2f} s)"
        row.note = (
            f"view loaded in {fmt_s(res.get('restored_s'))}{timeline(res)}; "
            f"{c1['snapshots'] - c0['snapshots']:.0f} snapshots, "
            f"{c1['replays'] - c0['replays']:.0f} replays served{served}"
        ) + asked(res) + reasons(res)
        row.exact = self.check(r4, fleet)
        r4.stop()
        self.log(f"case 4 ({kind}): {row}")
        return row

    def restart_case(
        self, fleet: Fleet, router: Router | None, ckpt: str, kind: str
    ) -> tuple[Row, Router | None]:
        a = self.args
        row = Row(f"3 warm restart ({a.down:g} s down)", kind, fleet.ranks)
        if not self.have["checkpoint"] or router is None:
            row.note = "not available (no SubscriberConfig.checkpoint)"
            self.log(f"case 3 ({kind}): {row}")
            return row, router
        t = time.monotonic()
        router.stop()  # a clean stop writes the checkpoint
        stopped = time.monotonic() - t
        size = os.path.getsize(ckpt) if os.path.exists(ckpt) else None
        time.sleep(a.down)  # traffic goes on meanwhile
        c0 = fleet.counters()
        r3 = Router("router-3", fleet, a.timeout, checkpoint=ckpt)
        res = r3.wait()
        c1 = fleet.counters()
        row.synced = verdict(res["synced"], 3)
        row.partial = str(res["partial"])
        row.router_cpu = fmt_s(res["cpu"])
        row.engines_cpu = fmt_s(c1["cpu"] - c0["cpu"])
        row.note = (
            f"stopped in {stopped:.1f} s (final checkpoint "
            + (f"{size / 2**20:.1f} MiB); " if size is not None else "missing); ")
            + f"view loaded in {fmt_s(res.get('restored_s'))}{timeline(res)}; "
            + f"{c1['snapshots'] - c0['snapshots']:.0f} snapshots served"
            + asked(res)
            + reasons(res)
        )
        row.exact = self.check(r3, fleet)
        self.log(f"case 3 ({kind}): {row}")
        return row, r3

    def delay_floor(self, probe: DelayProbe, seconds: float) -> str:
        """The probe's delay with the engines serving nothing: quiet, then with four
        processes spinning (as four routers applying would), so that what the scheduler
        costs on this host is told apart from what serving costs in the engines."""
        quiet = probe.window(seconds)
        hogs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(4)]
        try:
            time.sleep(0.5)
            busy = probe.window(seconds)
        finally:
            for h in hogs:
                h.kill()
                h.wait()
        return f"quiet {quiet}, 4 CPU hogs {busy}"

    def replicas_case(self, fleet: Fleet, probe: DelayProbe) -> Row:
        a = self.args
        nice = f" (routers at nice {a.router_nice})" if a.router_nice else ""
        row = Row("5 four replicas at once" + nice, "kvwire", fleet.ranks)
        seconds = max(a.window, 8.0)
        floor = self.delay_floor(probe, seconds)
        self.log(f"case 5 live delay p50/p99/max, engines serving nothing: {floor}")
        c0 = fleet.counters()
        probe.start()
        routers = [Router(f"replica-{i}", fleet, a.timeout, nice=a.router_nice) for i in range(4)]
        try:
            results = [r.wait() for r in routers]
            catching_up = probe.summary()
            delay = percentile(probe.samples, 0.99)
            delay = None if delay is None else 1000 * delay
            c1 = fleet.counters()
            steady = probe.window(seconds)
            floor_p99 = percentile(probe.samples, 0.99)
            cost = (
                "-"
                if delay is None or floor_p99 is None
                else f"{delay - 1000 * floor_p99:+.1f} ms"
            )
            self.log(
                f"case 5 live delay p50/p99/max: catching up {catching_up}; "
                f"then 4 routers synced (the floor) {steady}; catching up costs the batches' "
                f"p99 {cost} over that floor; engines: {c1['built'] - c0['built']:.0f} "
                f"snapshots built, {c1['refused'] - c0['refused']:.0f} refused, "
                f"sender GIL takes {c1['gil'] - c0['gil']:.0f}; routers' RSS "
                + ", ".join(f"+{r['rss_mb']:.0f} MB" for r in results)
            )
            took = [r["synced"] for r in results]
            row.synced = (
                f"{max(took):.2f} s (slowest)" if all(t is not None for t in took) else "NOT all"
            )
            row.partial = str(sum(r["partial"] for r in results))
            row.router_cpu = f"{sum(r['cpu'] for r in results):.2f} s (4 routers)"
            row.engines_cpu = fmt_s(c1["cpu"] - c0["cpu"])
            row.delay = (
                f"{fmt_s(delay, ' ms')} ("
                + ("meets" if delay is not None and delay <= 10 else "MISSES")
                + " <= 10)"
            )
            row.note = (
                f"{c1['snapshots'] - c0['snapshots']:.0f} snapshots served "
                f"({c1['built'] - c0['built']:.0f} built); batches' delay p50/p99/max while "
                f"catching up {catching_up}; floor (4 synced) {steady}, catch-up cost {cost} "
                f"p99; no router: {floor}"
            ) + reasons(*results)
            pauses = fleet.pause()
            # One router at a time: four checking at once, each holding 20.5 M blocks,
            # took the 23 GB host out of memory (routers of 5-10 GB while checking).
            verdicts = [r.ask("check 30 " + json.dumps(pauses)) for r in routers]
            fleet.ask_all("run")
            good = sum(1 for v in verdicts if v["exact"])
            row.exact = "yes" if good == len(routers) else f"NO ({good}/{len(routers)})"
        finally:
            for r in routers:
                r.stop()
        self.log(f"case 5: {row}")
        return row

    # stock publishers: cases 2, 4, 3
    def stock_cases(self) -> None:
        a = self.args
        cases = a.cases
        if not cases & {2, 3, 4} or "stock" not in a.kinds:
            return
        fleet = self.start_fleet("stock", tag="vllm")
        opts: dict[str, Any] = {}
        ckpt = str(self.tmp / "stock.ckpt")
        if self.have["checkpoint"]:
            opts["checkpoint"] = ckpt
        if self.have["clone"]:
            opts["serve_view"] = self.endpoint()
        reference: Router | None = None
        try:
            if (
                a.reference
                or (3 in cases and self.have["checkpoint"])
                or (4 in cases and self.have["clone"])
            ):
                # A router that follows the fleet from its first batch: the only way to an
                # exact view of stock publishers' history, and the source of cases 3 and 4.
                reference = Router("router-0", fleet, a.timeout, **opts)
                reference.wait()
            t = time.monotonic()
            held = fleet.preload()
            fleet.ask_all("run")
            self.log(
                f"stock fleet: {fleet.ranks} ranks hold {held:,} blocks "
                f"({time.monotonic() - t:.1f} s to build)"
            )
            if reference is not None:
                self.log(f"reference router exact: {self.check(reference, fleet)}")
            if 2 in cases:
                c0 = fleet.counters()
                r2 = Router("router-2", fleet, a.timeout, settle=True)
                res = r2.wait()
                c1 = fleet.counters()
                row = Row("2 cold start", "stock", fleet.ranks)
                row.synced = verdict(res["synced"], None)
                row.partial = str(res["partial"])
                row.router_cpu = fmt_s(res["cpu"])
                row.engines_cpu = fmt_s(c1["cpu"] - c0["cpu"])
                settled = res["settled"]
                row.note = (
                    f"settled in {settled:.2f} s: " if settled is not None else ""
                ) + f"{res['synced_ranks']} SYNCED, {res['partial']} PARTIAL (no snapshot)"
                row.exact = self.check(r2, fleet, wait=2.0)
                row.note += f"; the index holds {100 * self.coverage:.1f}% of the blocks"
                r2.stop()
                self.rows.append(row)
                self.log(f"case 2: {row}")
            if 4 in cases:
                self.rows.append(self.clone_case(fleet, opts, "stock", reference))
            if 3 in cases:
                row, reference = self.restart_case(fleet, reference, ckpt, "stock")
                self.rows.append(row)
        finally:
            if reference is not None:
                reference.stop()
            fleet.close()

    def fresh_4096(self) -> None:
        a = self.args
        if 6 not in a.cases:
            return
        per_proc = a.case6_ranks // a.ranks_per_engine
        fleet = Fleet(
            "stock",
            a.case6_procs,
            per_proc,
            a.ranks_per_engine,
            a,
            blocks=a.run * a.case6_batches,
            buffer=a.case6_buffer,
            preload_runs=1,
            tag="big",
            taken=self.taken,
        )
        try:
            held = fleet.preload()
            fleet.ask_all("run")
            self.log(f"case 6 fleet: {fleet.ranks} stock ranks hold {held:,} blocks")
            c0 = fleet.counters()
            r6 = Router("router-6", fleet, a.timeout)
            res = r6.wait()
            c1 = fleet.counters()
            row = Row("6 fresh router", "stock", fleet.ranks)
            row.synced = verdict(res["synced"], 10)
            row.partial = str(res["partial"])
            row.router_cpu = fmt_s(res["cpu"])
            row.engines_cpu = fmt_s(c1["cpu"] - c0["cpu"])
            x = r6.ask("cpu")
            time.sleep(a.window)
            y = r6.ask("cpu")
            share = (y["cpu"] - x["cpu"]) / (y["t"] - x["t"])
            row.note = (
                f"then {100 * share:.1f}% of a core at {fleet.ranks * a.rate:.0f} batches/s; "
                f"RSS +{y['rss_mb']:.0f} MB"
            ) + asked(res) + reasons(res)
            row.exact = self.check(r6, fleet)
            r6.stop()
            self.rows.append(row)
            self.log(f"case 6: {row}")
        finally:
            fleet.close()

    def table(self) -> None:
        head = [
            "case",
            "publishers",
            "ranks",
            "all SYNCED",
            "exact",
            "PARTIAL",
            "router CPU",
            "engines' CPU",
            "live delay p99",
            "note",
        ]
        body = [
            [
                r.case,
                r.publishers,
                f"{r.ranks:,}",
                r.synced,
                r.exact,
                r.partial,
                r.router_cpu,
                r.engines_cpu,
                r.delay,
                r.note,
            ]
            for r in sorted(self.rows, key=lambda r: r.case)
        ]
        widths = [max(len(str(x)) for x in col) for col in zip(head, *body, strict=True)]
        line = " | ".join(h.ljust(w) for h, w in zip(head, widths, strict=True))
        print()
        print(line)
        print("-+-".join("-" * w for w in widths))
        for b in body:
            print(" | ".join(str(x).ljust(w) for x, w in zip(b, widths, strict=True)))


def main() -> None:
    doc = __doc__ or ""
    parser = argparse.ArgumentParser(description=doc.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="64 ranks x 2,000 blocks")
    parser.add_argument("--engines", type=int, default=8, help="engines (kvwire: processes)")
    parser.add_argument("--ranks-per-engine", type=int, default=128)
    parser.add_argument("--blocks", type=int, default=20_000, help="blocks each rank holds")
    parser.add_argument("--run", type=int, default=16, help="blocks per content-chained run")
    parser.add_argument("--preload-runs", type=int, default=10, help="runs per history batch")
    parser.add_argument("--buffer", type=int, default=64, help="replay buffer, batches")
    parser.add_argument("--rate", type=float, default=1.0, help="batches per rank per second")
    parser.add_argument("--down", type=float, default=10.0, help="case 3: seconds down")
    parser.add_argument("--window", type=float, default=4.0, help="CPU windows, seconds")
    parser.add_argument("--timeout", type=float, default=60.0, help="longest wait for SYNCED")
    parser.add_argument("--case6-procs", type=int, default=4)
    parser.add_argument("--case6-ranks", type=int, default=1024, help="ranks per process")
    parser.add_argument("--case6-batches", type=int, default=8, help="history batches a rank")
    parser.add_argument("--case6-buffer", type=int, default=1000)
    parser.add_argument("--cases", default="1,2,3,4,5,6,7")
    parser.add_argument(
        "--kinds", default="kvwire,stock", help="publishers of cases 1-5 and 7: kvwire, stock"
    )
    parser.add_argument(
        "--reference",
        action="store_true",
        help="stock fleet: follow it from its first batch with a router checked exact "
        "(always, where cases 3 or 4 run)",
    )
    parser.add_argument("--json", help="also write the rows to this file, as JSON")
    parser.add_argument("--busy", action="store_true", help="a CPU hog on one core throughout")
    parser.add_argument(
        "--router-nice",
        type=int,
        default=0,
        help="case 5's routers at this niceness: as if on hosts of their own, the engines' "
        "threads first (a diagnostic: what the engines' serving costs, apart from sharing cores)",
    )
    parser.add_argument(
        "--pending",
        action="store_true",
        help="kvwire engines hand batches over as Python objects the sender encodes with the "
        "GIL (as before), not as encoded bytes",
    )
    parser.add_argument("--engine-child", help=argparse.SUPPRESS)
    parser.add_argument("--router-child", help=argparse.SUPPRESS)
    if parser.parse_known_args()[0].quick:  # smaller defaults; explicit options still win
        parser.set_defaults(
            engines=2,
            ranks_per_engine=32,
            blocks=2_000,
            preload_runs=1,
            down=3.0,
            window=2.0,
            timeout=30.0,
            case6_ranks=64,
        )
    args = parser.parse_args()
    if args.engine_child:
        engine_child(json.loads(args.engine_child))
        return
    if args.router_child:
        router_child(json.loads(args.router_child))
        return
    args.cases = {int(c) for c in args.cases.split(",") if c}
    args.kinds = {k for k in args.kinds.split(",") if k}
    bench = Bench(args)
    have = ", ".join(k for k, v in bench.have.items() if v) or "none"
    ranks = args.engines * args.ranks_per_engine
    print(
        f"fleet lifecycle: {ranks} ranks ({args.engines} engines x {args.ranks_per_engine}) x "
        f"{args.blocks:,} blocks of {BLOCK_SIZE} tokens, chains of {args.run}, replay buffers "
        f"{args.buffer} batches, {args.rate:g} batch/rank/s throughout; recovery features: "
        f"{have}" + ("; a CPU hog on one core" if args.busy else ""),
        flush=True,
    )
    log_path = bench.tmp / "children.log"
    LOG.file = open(log_path, "w")  # noqa: SIM115 (open for the whole run)
    hogger = None
    if args.busy:
        hogger = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        bench.kvwire_cases()
        bench.stock_cases()
        bench.fresh_4096()
    finally:
        if hogger is not None:
            hogger.kill()
            hogger.wait()
        bench.table()
        LOG.file.close()
        for ckpt in bench.tmp.glob("*.ckpt*"):
            ckpt.unlink()
        lines = log_path.read_text().splitlines()
        print(f"\nthe engines' and routers' logs: {log_path} ({len(lines)} lines)")
        if args.json:
            rows = [{k: v for k, v in vars(r).items() if k != "extra"} for r in bench.rows]
            Path(args.json).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
