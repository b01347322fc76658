"""Replay-socket abuse: clients that ask for snapshots and never read (issue 24, item 4).

A publisher process holds a mirror of ``--blocks`` blocks (default 200,000, in chains of 64,
16 tokens each) and publishes a small live batch every 2 ms throughout. For ``--seconds``
(default 10) another process opens ``--rate`` (default 20) new DEALERs a second, each asking
for a snapshot and never reading (receive queue of one message, 4 KiB socket buffer); they
stay connected until the abuse ends, then all close. A third process subscribes to the live
stream and records each batch's delay from ``publish()`` to receipt. Halfway through, a
well-behaved client asks for a snapshot and reads it whole.

Printed per case, side by side: the publisher's RSS before, at its peak and 3 s after the
clients closed; the live delay p50/p99/max before and during the abuse; the reading client's
snapshot time; the service thread's longest slice and its total, in its own CPU time (what it
holds the GIL for, whatever else a shared host runs); and the service's counters. Cases: ``bounded`` (the default
``max_replay_bytes``), ``unbounded`` (``max_replay_bytes`` = 2**62: the same code without the
byte bound), and, with ``--baseline PATH`` (a checkout of the code before the bound, built in
place), that code: the old behaviour.

Target (issue 24): the live delay p99 <= 10 ms during the abuse, memory returns after it.

Run: ``python benchmarks/replay_abuse.py [--baseline /path/to/old/checkout] [--repeats 1]``.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import statistics
import sys
import threading
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parents[1]
BLOCK_TOKENS = 16
CHAIN = 64
LIVE_EVERY_S = 0.002
TARGET_P99_MS = 10.0
SETTLE_AFTER_S = 3.0


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096


def publisher_proc(tree: str, max_bytes: int | None, blocks: int, conn: Any) -> None:
    """The engine's process: a publisher with a big mirror, live batches, RSS sampled."""
    sys.path.insert(0, tree)
    import numpy as np

    from kvwire.publisher import EventPublisher, PublisherConfig
    from kvwire.wire import BlockStored, KVEventBatch

    extra = {} if max_bytes is None else {"max_replay_bytes": max_bytes}
    config = PublisherConfig(
        heartbeat_s=None, max_queue_size=1_000_000, buffer_steps=10_000, **extra
    )
    from kvwire.publisher import replay as replay_module

    # The service thread's slices, in its own CPU time (what it holds the GIL for, whatever
    # else the host runs): the longest, and the total.
    slices = [0.0, 0.0]
    serve = replay_module.ReplayServer.serve

    def timed(self: Any) -> bool:
        t0 = time.thread_time()
        moved = bool(serve(self))
        spent = time.thread_time() - t0
        slices[0] = max(slices[0], spent)
        slices[1] += spent
        return moved

    replay_module.ReplayServer.serve = timed  # type: ignore[method-assign]
    rng = np.random.default_rng(0)
    pub = EventPublisher("tcp://127.0.0.1:*", "tcp://127.0.0.1:*", config).start()
    for start in range(0, blocks, CHAIN):
        n = min(CHAIN, blocks - start)
        hashes = rng.integers(1, 2**63, n).tolist()
        tokens = rng.integers(0, 32_000, n * BLOCK_TOKENS).tolist()
        pub.publish(KVEventBatch(0.0, [BlockStored(hashes, None, tokens, BLOCK_TOKENS)], 0))
    while pub.stats().published < pub.last_seq + 1 or pub.stats().mirror_pending:
        time.sleep(0.01)
    stop = threading.Event()
    samples: list[tuple[float, int]] = []

    def engine() -> None:
        i = 0
        while not stop.is_set():
            h = 2**62 + i
            toks = [(i + k) % 32_000 for k in range(BLOCK_TOKENS)]
            pub.publish(KVEventBatch(time.time(), [BlockStored([h], None, toks, BLOCK_TOKENS)], 0))
            i += 1
            time.sleep(LIVE_EVERY_S)

    def sampler() -> None:
        while not stop.is_set():
            samples.append((time.time(), _rss()))
            time.sleep(0.05)

    threads = [threading.Thread(target=engine), threading.Thread(target=sampler)]
    for t in threads:
        t.start()
    conn.send((pub.bound_endpoint, pub.bound_replay_endpoint))
    conn.recv()  # "go": the abuse starts
    slices[:] = [0.0, 0.0]
    conn.recv()  # "stop"
    stop.set()
    for t in threads:
        t.join()
    stats = pub.stats().as_dict()
    replay = pub._replay
    stats["peak_bytes_in_flight"] = getattr(replay, "peak_bytes_in_flight", -1)
    stats["longest_slice_ms"] = round(slices[0] * 1000, 2)
    stats["service_cpu_s"] = round(slices[1], 2)
    conn.send((samples, stats))
    pub.close(timeout=1)


def probe_proc(endpoint: str, conn: Any) -> None:
    """A SUB recording (publish time, delay ms) per live batch."""
    sys.path.insert(0, str(HERE))
    import zmq

    from kvwire.wire import decode_batch, parse_live

    ctx = zmq.Context()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.connect(endpoint)
    sub.recv_multipart()
    conn.send("ready")
    samples: list[tuple[float, float]] = []
    while not conn.poll(0):
        if sub.poll(100):
            msg = parse_live(sub.recv_multipart())
            now = time.time()
            ts = decode_batch(msg.payload).ts
            if ts > 0:
                samples.append((ts, (now - ts) * 1000))
    conn.send(samples)
    sub.close(linger=0)
    ctx.term()


def abuser_proc(endpoint: str, rate: float, seconds: float, conn: Any) -> None:
    """Opens ``rate`` non-reading snapshot clients a second; closes them all when told."""
    import zmq

    ctx = zmq.Context()
    socks = []
    conn.recv()  # "go"
    t0 = time.monotonic()
    while time.monotonic() - t0 < seconds:
        due = int((time.monotonic() - t0) * rate) + 1
        while len(socks) < due:
            s = ctx.socket(zmq.DEALER)
            s.setsockopt(zmq.RCVHWM, 1)
            s.setsockopt(zmq.RCVBUF, 4096)
            s.setsockopt(zmq.LINGER, 0)
            s.connect(endpoint)
            s.send_multipart([b"", b"kvwire-snapshot"])
            socks.append(s)
        time.sleep(0.005)
    conn.send(len(socks))
    conn.recv()  # "close"
    for s in socks:
        s.close(linger=0)
    ctx.term()
    conn.send("closed")


def reader(endpoint: str) -> tuple[str, float]:
    """A well-behaved client: a whole snapshot, read as it comes."""
    sys.path.insert(0, str(HERE))
    import zmq

    from kvwire.wire import SnapshotChunk, SnapshotEnd, parse_replay_reply

    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(endpoint)
    t0 = time.monotonic()
    sock.send_multipart([b"", b"kvwire-snapshot"])
    chunks = 0
    result = "timeout"
    while sock.poll(30_000):
        reply = parse_replay_reply(sock.recv_multipart())
        if isinstance(reply, SnapshotChunk):
            chunks += 1
            continue
        result = (
            "ok"
            if isinstance(reply, SnapshotEnd) and reply.chunks == chunks
            else type(reply).__name__
        )
        break
    sock.close()
    ctx.term()
    return result, time.monotonic() - t0


def pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    s = sorted(values)
    return s[min(len(s) - 1, int(q * len(s)))]


def run_case(tree: str, max_bytes: int | None, args: argparse.Namespace) -> dict[str, Any]:
    mpctx = mp.get_context("spawn")
    pconn, child = mpctx.Pipe()
    pub = mpctx.Process(target=publisher_proc, args=(tree, max_bytes, args.blocks, child))
    pub.start()
    live_ep, replay_ep = pconn.recv()
    qconn, child = mpctx.Pipe()
    probe = mpctx.Process(target=probe_proc, args=(live_ep, child), daemon=True)
    probe.start()
    qconn.recv()
    aconn, child = mpctx.Pipe()
    abuser = mpctx.Process(target=abuser_proc, args=(replay_ep, args.rate, args.seconds, child))
    abuser.start()
    time.sleep(2.0)  # the baseline: live batches, no abuse
    t_start = time.time()
    pconn.send("go")
    aconn.send("go")
    time.sleep(args.seconds / 2)
    read = reader(replay_ep)
    clients = aconn.recv()
    t_end = time.time()
    aconn.send("close")
    aconn.recv()
    t_closed = time.time()
    time.sleep(SETTLE_AFTER_S)
    qconn.send("stop")
    delays = qconn.recv()
    pconn.send("stop")
    rss, stats = pconn.recv()
    pub.join(10)
    probe.join(10)
    abuser.join(10)
    load = os.getloadavg()[0]
    before = [d for ts, d in delays if ts < t_start]
    during = [d for ts, d in delays if t_start <= ts <= t_end]
    return {
        "rss_before": max(r for t, r in rss if t < t_start),
        "rss_peak": max(r for t, r in rss),
        "rss_after": rss[-1][1],
        "closed_for": rss[-1][0] - t_closed,
        "before": before,
        "during": during,
        "read": read,
        "clients": clients,
        "stats": stats,
        "load": load,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--blocks", type=int, default=200_000)
    ap.add_argument("--rate", type=float, default=20.0, help="new non-reading clients a second")
    ap.add_argument("--seconds", type=float, default=10.0)
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument(
        "--baseline", help="a checkout of the code before the byte bound, built in place"
    )
    ap.add_argument("--cases", default="bounded,unbounded,baseline")
    args = ap.parse_args()
    sys.path.insert(0, str(HERE))
    from kvwire.publisher import PublisherConfig

    cases: list[tuple[str, str, int | None]] = []
    for name in args.cases.split(","):
        if name == "bounded":
            cases.append((name, str(HERE), PublisherConfig().max_replay_bytes))
        elif name == "unbounded":
            cases.append((name, str(HERE), 2**62))
        elif name == "baseline" and args.baseline:
            cases.append(("before (baseline)", args.baseline, None))
    print(
        f"replay abuse: {args.blocks:,}-block mirror, {args.rate:g} new non-reading snapshot "
        f"clients/s for {args.seconds:g} s, live batch every {LIVE_EVERY_S * 1000:g} ms; "
        f"{args.repeats} run(s) a case, alternated, medians"
    )
    # Cases alternate run by run, so that a shared host's load falls on each alike.
    results: dict[str, list[dict[str, Any]]] = {name: [] for name, _, _ in cases}
    for _ in range(args.repeats):
        for name, tree, max_bytes in cases:
            results[name].append(run_case(tree, max_bytes, args))
    rows = []
    for name, _, max_bytes in cases:
        runs = results[name]

        def med(f: Any, runs: list[dict[str, Any]] = runs) -> float:
            return statistics.median(f(r) for r in runs)

        s = runs[0]["stats"]
        rows.append(
            (
                name,
                f"{max_bytes / 2**20:g} MiB" if max_bytes and max_bytes < 2**50 else "none",
                med(lambda r: r["rss_before"]) / 2**20,
                med(lambda r: r["rss_peak"]) / 2**20,
                med(lambda r: r["rss_after"]) / 2**20,
                med(lambda r: pct(r["before"], 0.99)),
                med(lambda r: pct(r["during"], 0.5)),
                med(lambda r: pct(r["during"], 0.99)),
                med(lambda r: max(r["during"], default=float("nan"))),
                f"ok {sum(r['read'][0] == 'ok' for r in runs)}/{len(runs)}, "
                f"{med(lambda r: r['read'][1]):.2f} s",
                med(lambda r: r["stats"]["longest_slice_ms"]),
                med(lambda r: r["stats"]["service_cpu_s"]),
                f"built {s.get('snapshots_built', '?')}, served {s['snapshots_served']}, "
                f"refused {s['snapshots_refused']}, dropped {s['replay_dropped']}, "
                f"disconnected {s.get('replay_disconnects', '?')}, "
                f"peak in flight {s['peak_bytes_in_flight'] / 2**20:.1f} MiB"
                if s["peak_bytes_in_flight"] >= 0
                else f"served {s['snapshots_served']}, refused {s['snapshots_refused']}, "
                f"dropped {s['replay_dropped']}",
            )
        )
    head = (
        "case", "bound", "RSS before", "peak", "after", "live p99 before", "during p50", "p99",
        "max", "reader", "longest slice", "service CPU", "service (first run)",
    )  # fmt: skip
    print(" | ".join(head))
    for r in rows:
        print(
            f"{r[0]} | {r[1]} | {r[2]:.0f} MB | {r[3]:.0f} MB | {r[4]:.0f} MB | {r[5]:.1f} ms | "
            f"{r[6]:.1f} ms | {r[7]:.1f} ms | {r[8]:.1f} ms | {r[9]} | {r[10]:.1f} ms | "
            f"{r[11]:.2f} s | {r[12]}"
        )
    loads = sorted(r["load"] for runs in results.values() for r in runs)
    print(
        f"(1-minute load average after each run: {loads[0]:.1f} to {loads[-1]:.1f}, {os.cpu_count()} CPUs)"
    )
    print(
        f"(target: live p99 <= {TARGET_P99_MS:g} ms during the abuse; 'after' is {SETTLE_AFTER_S:g} s after the clients closed)"
    )


if __name__ == "__main__":
    main()
