"""What an engine process pays to serve snapshots and tail replays, this tree against another.

One engine process holds ``--ranks`` kvwire ``EventPublisher`` ranks (snapshots on), each
preloaded with ``--blocks`` blocks of 16 tokens in content-chained runs (the workload of
``fleet_lifecycle.py``, whose ``RankModel`` it uses), with live traffic of ``--rate``
batches per rank per second throughout. This process is the client: a DEALER per rank.

Printed per tree, medians over ``--repeats`` rounds (the engine's CPU with the live
traffic's own rate, measured in a window before, taken out):

- snapshot: every rank asked at once, every chunk read; the engine's CPU per block served,
  and the wall time until the last rank's end marker;
- replay: every rank asked at once for its last ``--tail`` batches (as a warm restart or a
  clone does), every reply read to its end marker, ``--replay-rounds`` times in a row; the
  engine's CPU per request, and the wall time of a round;
- the live stream's delay p99 while serving: publish to receipt on a SUB of every rank, read
  by a probe process of its own (so that this one's reading of the replies delays nothing).

``--before PATH``: also run the engine on the tree at PATH (with ``PATH/.venv/bin/python``),
alternated with this one, so that both see the same host. The host may be shared: the
figures are CPU seconds of the engine process, not wall time.

Run: ``.venv/bin/python benchmarks/serve_bench.py --before ../kvwire-before`` (``--quick``: 16 ranks
x 5,000 blocks, one round).
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import statistics
import struct
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

ROOT = Path(__file__).resolve().parents[1]


# --- the engine (a child process, on the tree it was given) -----------------------------


def engine_child(spec: dict[str, Any]) -> None:
    sys.path.insert(0, spec["tree"])
    # kvwire from that tree, before fleet_lifecycle puts this one's first on sys.path
    kvwire = importlib.import_module("kvwire")
    import zmq
    from _fleet import cpu_s
    from fleet_lifecycle import RankModel

    from kvwire.publisher import EventPublisher, PublisherConfig

    ctx: zmq.Context[Any] = zmq.Context(io_threads=1)
    ctx.set(zmq.MAX_SOCKETS, 4 * spec["ranks"] + 64)
    config = PublisherConfig(buffer_steps=spec["buffer"], snapshot=True)
    pubs = [
        EventPublisher(
            f"tcp://127.0.0.1:{spec['port']}",
            f"tcp://127.0.0.1:{spec['replay_port']}",
            config,
            rank=r,
            context=ctx,
        ).start()
        for r in range(spec["ranks"])
    ]
    models = [RankModel(0, r, 0, spec["run"]) for r in range(spec["ranks"])]
    keep = spec["blocks"]
    runs = 10
    for _ in range(-(-keep // (spec["run"] * runs))):
        for pub, model in zip(pubs, models, strict=True):
            pub.publish(model.payload(runs, keep))
    # the buffers hold live-sized batches (one run each) before anything is measured
    for _ in range(spec["buffer"]):
        for pub, model in zip(pubs, models, strict=True):
            pub.publish(model.payload(1, keep))

    def idle() -> bool:
        return all(p.queue_depth == 0 and p.stats().mirror_pending == 0 for p in pubs)

    while not idle():
        time.sleep(0.01)
    out = sys.stdout
    out.write(json.dumps({"ready": [p.last_seq + 1 for p in pubs], "kvwire": kvwire.__file__}))
    out.write("\n")
    out.flush()
    step = 1.0 / (spec["rate"] * spec["ranks"])
    next_t = time.monotonic()
    cursor = 0
    import select

    stdin = sys.stdin.fileno()
    buf = b""
    while True:
        now = time.monotonic()
        ready, _, _ = select.select([stdin], [], [], max(0.0, next_t - now))
        if ready:
            chunk = os.read(stdin, 4096)
            if not chunk:
                break
            buf += chunk
            quit_ = False
            while b"\n" in buf:
                line, _, buf = buf.partition(b"\n")
                if line == b"cpu":
                    st = [p.stats() for p in pubs]
                    out.write(
                        json.dumps(
                            {
                                "cpu": cpu_s(),
                                "t": time.monotonic(),
                                "seqs": [p.last_seq + 1 for p in pubs],
                                "snapshots": sum(s.snapshots_served for s in st),
                                "replays": sum(s.replay_served for s in st),
                            }
                        )
                        + "\n"
                    )
                    out.flush()
                elif line == b"quit":
                    quit_ = True
            if quit_:
                break
        now = time.monotonic()
        while next_t <= now:
            pubs[cursor].publish(models[cursor].payload(1, keep))
            cursor = (cursor + 1) % len(pubs)
            next_t += step
        if now - next_t > 1.0:
            next_t = now
    for pub in pubs:
        pub.close(timeout=1.0)
    ctx.term()


# --- the live delay probe (a child process) ------------------------------------------------


def probe_child(spec: dict[str, Any]) -> None:
    """SUBs on every rank; ``start`` clears the delays, ``stop`` answers their p99 (ms)."""
    import zmq

    ctx: zmq.Context[Any] = zmq.Context()
    poller = zmq.Poller()
    for r in range(spec["ranks"]):
        s = ctx.socket(zmq.SUB)
        s.setsockopt(zmq.LINGER, 0)
        s.setsockopt(zmq.SUBSCRIBE, b"")
        s.connect(f"tcp://127.0.0.1:{spec['port'] + r}")
        poller.register(s, zmq.POLLIN)
    stdin = sys.stdin.fileno()
    poller.register(stdin, zmq.POLLIN)
    delays: list[float] = []
    buf = b""
    while True:
        for sock, _ in poller.poll(1000):
            if sock == stdin:
                chunk = os.read(stdin, 4096)
                if not chunk:
                    return
                buf += chunk
                while b"\n" in buf:
                    line, _, buf = buf.partition(b"\n")
                    if line == b"start":
                        delays = []
                        print(json.dumps({"ok": True}), flush=True)
                    elif line == b"stop":
                        delays.sort()
                        p99 = delays[int(0.99 * (len(delays) - 1))] * 1e3 if delays else None
                        print(json.dumps({"p99": p99, "n": len(delays)}), flush=True)
                continue
            while True:
                try:
                    frames = sock.recv_multipart(zmq.NOBLOCK)
                except zmq.Again:
                    break
                delays.append(time.time() - _ts(frames[2]))


# --- the client (this process) -----------------------------------------------------------


class Engine:
    def __init__(self, tree: Path, args: argparse.Namespace, port: int) -> None:
        from _fleet import Child

        python = sys.executable if tree == ROOT else str(tree / ".venv/bin/python")
        spec = {
            "tree": str(tree),
            "ranks": args.ranks,
            "blocks": args.blocks,
            "run": args.run,
            "buffer": args.buffer,
            "rate": args.rate,
            "port": port,
            "replay_port": port + args.ranks,
        }
        self.port = port
        self.child = Child(f"engine ({tree})")
        self.child.spawn([python, __file__, "--engine-child", json.dumps(spec)])
        ready = self.child.reply()
        self.seqs: list[int] = ready["ready"]
        if not ready["kvwire"].startswith(str(tree)):
            raise RuntimeError(f"the engine for {tree} imported {ready['kvwire']}")

        self.probe = Child(f"probe ({tree})")
        self.probe.spawn([sys.executable, __file__, "--probe-child", json.dumps(spec)])

    def cpu(self) -> dict[str, Any]:
        return self.child.ask("cpu")

    def close(self) -> None:
        self.child.send("quit")
        assert self.child.proc is not None and self.probe.proc is not None
        self.child.proc.wait(30)
        self.probe.proc.stdin.close()  # type: ignore[union-attr]
        self.probe.proc.wait(30)


def _ts(payload: bytes) -> float:
    """The batch's timestamp: the envelope's first element, a msgpack float64."""
    assert payload[1] == 0xCB
    return float(struct.unpack(">d", payload[2:10])[0])


def serve_round(
    engine: Engine, args: argparse.Namespace, kind: str, base: dict[str, Any], rate: float
) -> dict[str, float]:
    """Every rank asked at once (snapshot or tail replay), every reply read to its end."""
    import zmq

    from kvwire.wire import (
        ReplayEnd,
        SnapshotEnd,
        SnapshotRefused,
        parse_replay_reply,
        replay_request_frames,
        snapshot_request_frames,
    )

    ctx: zmq.Context[Any] = zmq.Context.instance()
    poller = zmq.Poller()
    dealers = []
    for r in range(args.ranks):
        d = ctx.socket(zmq.DEALER)
        d.setsockopt(zmq.LINGER, 0)
        d.setsockopt(zmq.RCVHWM, 0)
        d.connect(f"tcp://127.0.0.1:{engine.port + args.ranks + r}")
        dealers.append(d)
        poller.register(d, zmq.POLLIN)
    time.sleep(0.5)  # connections up before the clock starts
    seqs = engine.cpu()["seqs"]
    index = {id(d): r for r, d in enumerate(dealers)}
    engine.probe.ask("start")
    blocks = 0
    messages = 0
    rounds = 1 if kind == "snapshot" else args.replay_rounds
    start_cpu = engine.cpu()
    t0 = time.monotonic()
    for _ in range(rounds):
        for r, d in enumerate(dealers):
            if kind == "snapshot":
                d.send_multipart(snapshot_request_frames())
            else:
                d.send_multipart(replay_request_frames(max(0, seqs[r] - args.tail)))
        open_ = set(range(args.ranks))
        deadline = time.monotonic() + 120
        while open_ and time.monotonic() < deadline:
            for sock, _ in poller.poll(1000):
                r = index[id(sock)]
                while True:
                    try:
                        frames = sock.recv_multipart(zmq.NOBLOCK, copy=False)
                    except zmq.Again:
                        break
                    messages += 1
                    reply = parse_replay_reply([f.buffer for f in frames])
                    if isinstance(reply, SnapshotRefused):
                        raise RuntimeError(f"rank {r}: snapshot refused: {reply.reason}")
                    if isinstance(reply, ReplayEnd | SnapshotEnd):
                        open_.discard(r)
        if open_:
            raise RuntimeError(f"{len(open_)} ranks not served within 120 s")
    took = (time.monotonic() - t0) / rounds
    end_cpu = engine.cpu()
    probe = engine.probe.ask("stop")
    p99 = probe["p99"] or float("nan")
    for sock in dealers:
        sock.close(0)
    cpu = end_cpu["cpu"] - start_cpu["cpu"] - rate * (end_cpu["t"] - start_cpu["t"])
    if kind == "snapshot":
        blocks = args.ranks * args.blocks
        served = end_cpu["snapshots"] - start_cpu["snapshots"]
        unit = cpu / blocks * 1e6
    else:
        served = end_cpu["replays"] - start_cpu["replays"]
        unit = cpu / (args.ranks * rounds) * 1e3
    return {
        "unit": unit,
        "cpu": cpu,
        "wall": took,
        "served": served,
        "messages": messages,
        "p99": p99,
        "samples": probe["n"],
    }


def measure(tree: Path, args: argparse.Namespace, port: int) -> dict[str, list[dict[str, float]]]:
    engine = Engine(tree, args, port)
    try:
        a = engine.cpu()
        time.sleep(args.window)
        b = engine.cpu()
        rate = (b["cpu"] - a["cpu"]) / (b["t"] - a["t"])
        rows: dict[str, list[dict[str, float]]] = {"snapshot": [], "replay": []}
        for _ in range(args.repeats):
            for kind in ("snapshot", "replay"):
                rows[kind].append(serve_round(engine, args, kind, b, rate))
                time.sleep(1.5)  # a snapshot's log and flights settle; the next is fresh
        rows["live"] = [{"cpu_per_s": rate}]
        return rows
    finally:
        engine.close()


def main() -> None:
    doc = __doc__ or ""
    parser = argparse.ArgumentParser(description=doc.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=64)
    parser.add_argument("--blocks", type=int, default=20_000)
    parser.add_argument("--run", type=int, default=16)
    parser.add_argument("--buffer", type=int, default=64, help="replay buffer, batches")
    parser.add_argument("--tail", type=int, default=20, help="batches a replay asks for")
    parser.add_argument("--replay-rounds", type=int, default=10, help="replay rounds a window")
    parser.add_argument("--rate", type=float, default=1.0, help="live batches per rank per s")
    parser.add_argument("--window", type=float, default=3.0, help="live-only CPU window, s")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--before", type=Path, help="a built checkout of the tree before")
    parser.add_argument("--quick", action="store_true", help="16 ranks x 5,000 blocks, 1 round")
    parser.add_argument("--engine-child", help=argparse.SUPPRESS)
    parser.add_argument("--probe-child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.engine_child:
        engine_child(json.loads(args.engine_child))
        return
    if args.probe_child:
        probe_child(json.loads(args.probe_child))
        return
    if args.quick:
        args.ranks, args.blocks, args.repeats, args.window = 16, 5_000, 1, 1.5
    from _fleet import free_base

    trees = [("after", ROOT)] + ([("before", args.before.resolve())] if args.before else [])
    print(
        f"serve bench: {args.ranks} ranks x {args.blocks:,} blocks in one engine process, "
        f"replays of the last {args.tail} batches, {args.rate:g} live batch/rank/s; "
        f"trees: {', '.join(f'{n} {p}' for n, p in trees)}",
        flush=True,
    )
    results: dict[str, dict[str, list[dict[str, float]]]] = {}
    for name, tree in reversed(trees) if args.before else trees:
        port = free_base(2 * args.ranks, set())
        results[name] = measure(tree, args, port)
    med = statistics.median
    print()
    header = ["figure"] + [n for n, _ in trees]
    table = []
    for label, kind, key, fmt in (
        ("snapshot: engine CPU per block (us)", "snapshot", "unit", "{:.3f}"),
        ("snapshot: wall, all ranks (s)", "snapshot", "wall", "{:.2f}"),
        ("snapshot: live delay p99 while serving (ms)", "snapshot", "p99", "{:.1f}"),
        ("snapshot: live batches in that window", "snapshot", "samples", "{:.0f}"),
        ("replay: engine CPU per request (ms)", "replay", "unit", "{:.3f}"),
        ("replay: wall, one round of all ranks (s)", "replay", "wall", "{:.3f}"),
        ("replay: live delay p99 while serving (ms)", "replay", "p99", "{:.1f}"),
        ("replay: live batches in that window", "replay", "samples", "{:.0f}"),
        ("live traffic alone: engine CPU (s per s)", "live", "cpu_per_s", "{:.3f}"),
    ):
        table.append(
            [label] + [fmt.format(med(r[key] for r in results[n][kind])) for n, _ in trees]
        )
    widths = [max(len(str(row[i])) for row in [header, *table]) for i in range(len(header))]
    for row in [header, *table]:
        print(" | ".join(str(x).ljust(w) for x, w in zip(row, widths, strict=True)))


if __name__ == "__main__":
    main()
