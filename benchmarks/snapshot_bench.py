"""Snapshot service: serve-and-apply time, the mirror's memory, live delay while serving.

Workload: a rank holding ``--blocks`` blocks (default 1,000,000) of 16 tokens,
stored as chains of ``--chain`` blocks with random 64-bit hashes and token ids
below ``--vocab``. Printed, medians over ``--repeats`` runs where timed:

- the mirror's memory (tracemalloc: what the mirror allocated; and the process
  RSS growth) against the bytes of the msgpack events it mirrors;
- the service thread's cost of mirroring a batch (its payload read into the
  mirror's tables) per block;
- a snapshot requested by a raw DEALER in another process that decodes every
  chunk and applies it into a ``PrefixIndex``: time from request to the last
  chunk applied, blocks rebuilt (must equal the mirror's);
- live batches published every 2 ms throughout, received by a SUB in a third
  process: delay from ``publish()`` to receipt, while the snapshot is served
  against the same run's delay with no snapshot in progress (the baseline).

Targets (issue 11): <= 5 s for 1 M blocks served and applied; mirror memory
<= 2x the event bytes; live batches delayed by <= 10 ms while serving.

Run: ``python benchmarks/snapshot_bench.py`` (``--quick``: 200k blocks, one run).
"""

from __future__ import annotations

import argparse
import gc
import multiprocessing as mp
import random
import statistics
import sys
import threading
import time
import tracemalloc
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import zmq

from kvwire.prefix_index import PrefixIndex
from kvwire.publisher import EventPublisher, PublisherConfig
from kvwire.publisher.mirror import Mirror
from kvwire.wire import (
    BlockStored,
    KVEventBatch,
    SnapshotChunk,
    SnapshotEnd,
    SnapshotRefused,
    decode_batch,
    encode_batch,
    parse_live,
    parse_replay_reply,
    snapshot_request_frames,
)

BLOCK_TOKENS = 16
TARGET_S = 5.0
TARGET_MEMORY_RATIO = 2.0
TARGET_DELAY_MS = 10.0
LIVE_EVERY_S = 0.002


def make_batches(blocks: int, chain: int, vocab: int, seed: int = 0) -> list[KVEventBatch]:
    rng = random.Random(seed)
    out = []
    for start in range(0, blocks, chain):
        n = min(chain, blocks - start)
        hashes = [rng.getrandbits(64) for _ in range(n)]
        tokens = [rng.randrange(vocab) for _ in range(n * BLOCK_TOKENS)]
        out.append(KVEventBatch(0.0, [BlockStored(hashes, None, tokens, BLOCK_TOKENS)], 0))
    return out


def rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096


def measure_mirror(payloads: list[bytes]) -> dict[str, float]:
    """The mirror fed exactly what the sender feeds it, measured three ways."""
    gc.collect()
    rss0 = rss()
    tracemalloc.start()
    mirror = Mirror()
    for seq, payload in enumerate(payloads):
        mirror.apply_payload(seq, payload)
    blocks = mirror.count_blocks()
    traced, _ = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    grown = rss() - rss0
    del mirror
    gc.collect()
    costs = []
    for _ in range(3):  # timed without tracemalloc
        m = Mirror()
        t0 = time.perf_counter()
        for seq, payload in enumerate(payloads):
            m.apply_payload(seq, payload)
        costs.append((time.perf_counter() - t0) * 1e6 / blocks)
        del m
        gc.collect()
    return {
        "traced": traced,
        "rss": grown,
        "blocks": blocks,
        "us_per_block": statistics.median(costs),
    }


# --- the other processes ----------------------------------------------------------------


def snapshot_client(endpoint: str, conn: Any) -> None:
    """A raw DEALER: ask for a snapshot, decode and apply every chunk into a PrefixIndex."""
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.RCVHWM, 0)
    sock.connect(endpoint)
    index = PrefixIndex(block_size=BLOCK_TOKENS)
    conn.send("ready")
    conn.recv()
    t0 = time.time()
    sock.send_multipart(snapshot_request_frames())
    chunks = 0
    result: tuple[Any, ...] = ("timeout",)
    while sock.poll(30_000):
        reply = parse_replay_reply(sock.recv_multipart(copy=True))
        if isinstance(reply, SnapshotChunk):
            if reply.number != chunks:
                result = ("missing chunk", chunks, reply.number)
                break
            index.apply("w", 0, decode_batch(reply.payload))
            chunks += 1
        elif isinstance(reply, SnapshotEnd):
            t1 = time.time()
            rebuilt = len(index.blocks("w", 0))
            result = ("ok", t0, t1, reply.chunks == chunks, rebuilt, chunks, reply.next_seq)
            break
        elif isinstance(reply, SnapshotRefused):
            result = ("refused", reply.reason)
            break
    conn.send(result)
    sock.close(linger=0)
    ctx.term()


def live_probe(endpoint: str, conn: Any) -> None:
    """A SUB recording, per live batch, when it was published and how late it arrived."""
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


# --- one served snapshot ---------------------------------------------------------------


def serve_once(batches: list[KVEventBatch], blocks: int) -> dict[str, Any]:
    mpctx = mp.get_context("spawn")
    with EventPublisher(
        "tcp://127.0.0.1:*",
        "tcp://127.0.0.1:*",
        PublisherConfig(heartbeat_s=None, max_queue_size=len(batches) + 100_000, buffer_steps=1000),
    ) as pub:  # fmt: skip
        for b in batches:
            pub.publish(b)
        while pub.stats().published < len(batches):
            time.sleep(0.01)
        probe_conn, child = mpctx.Pipe()
        probe = mpctx.Process(target=live_probe, args=(pub.bound_endpoint, child), daemon=True)
        probe.start()
        while not probe_conn.poll(0.01):
            pub.publish(KVEventBatch(0.0, [], 0))  # slow joiner
        probe_conn.recv()
        client_conn, child = mpctx.Pipe()
        client = mpctx.Process(
            target=snapshot_client, args=(pub.bound_replay_endpoint, child), daemon=True
        )
        client.start()
        client_conn.recv()

        stop = threading.Event()
        rng = random.Random(1)

        live_seqs: list[int] = []

        def engine() -> None:  # small live stores throughout
            while not stop.is_set():
                h = rng.getrandbits(64)
                toks = [rng.randrange(32_000) for _ in range(BLOCK_TOKENS)]
                pub.publish(
                    KVEventBatch(time.time(), [BlockStored([h], None, toks, BLOCK_TOKENS)], 0)
                )
                live_seqs.append(pub.last_seq)  # the only publishing thread meanwhile
                time.sleep(LIVE_EVERY_S)

        live = threading.Thread(target=engine)
        live.start()
        time.sleep(1.0)  # the baseline: live batches, no snapshot
        client_conn.send("go")
        result = client_conn.recv()
        time.sleep(0.5)
        stop.set()
        live.join()
        time.sleep(0.2)
        probe_conn.send("stop")
        samples = probe_conn.recv()
        client.join(10)
        probe.join(10)
        stats = pub.stats()
    if result[0] != "ok":
        raise RuntimeError(f"snapshot failed: {result}")
    _, t0, t1, complete, rebuilt, chunks, next_seq = result
    # The snapshot holds the bulk and every live store below its next_seq.
    expected = blocks + sum(1 for seq in live_seqs if seq < next_seq)
    during = [d for ts, d in samples if t0 <= ts <= t1]
    before = [d for ts, d in samples if ts < t0]
    return {
        "seconds": t1 - t0,
        "complete": complete,
        "rebuilt": rebuilt,
        "chunks": chunks,
        "expected": expected,
        "during": during,
        "before": before,
        "served": stats.snapshots_served,
    }


def pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    s = sorted(values)
    return s[min(len(s) - 1, int(q * len(s)))]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--blocks", type=int, default=1_000_000)
    ap.add_argument("--chain", type=int, default=64, help="blocks per stored event")
    ap.add_argument("--vocab", type=int, default=128_000, help="token ids are below this")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--quick", action="store_true")
    args = ap.parse_args()
    if args.quick:
        args.blocks, args.repeats = 200_000, 1
    batches = make_batches(args.blocks, args.chain, args.vocab)
    payloads = [encode_batch(b) for b in batches]
    event_bytes = sum(len(p) for p in payloads)
    print(
        f"snapshot benchmark: {args.blocks:,} blocks of {BLOCK_TOKENS} tokens, chains of "
        f"{args.chain}, token ids < {args.vocab:,}; {args.repeats} run(s), medians"
    )
    mem = measure_mirror(payloads)
    print(
        f"events mirrored: {event_bytes / 2**20:.1f} MB ({event_bytes / args.blocks:.1f} B/block)"
    )
    print(
        f"mirror memory:   {mem['traced'] / 2**20:.1f} MB traced = "
        f"{mem['traced'] / event_bytes:.2f}x the event bytes (target <= {TARGET_MEMORY_RATIO:g}x); "
        f"RSS growth {mem['rss'] / 2**20:.1f} MB = {mem['rss'] / event_bytes:.2f}x"
    )
    print(
        f"mirroring cost:  {mem['us_per_block']:.3f} us/block on the service thread (payload read into the tables)"
    )
    runs = [serve_once(batches, args.blocks) for _ in range(args.repeats)]
    secs = statistics.median(r["seconds"] for r in runs)
    ok = all(r["complete"] and r["rebuilt"] == r["expected"] for r in runs)
    print(
        f"served + applied into a PrefixIndex: {secs:.2f} s (target <= {TARGET_S:g} s), "
        f"{runs[0]['chunks']} chunks, rebuilt {runs[0]['rebuilt']:,} of {runs[0]['expected']:,} "
        "blocks (the bulk and the live stores below next_seq): "
        f"{'exact' if ok else 'WRONG'}"
    )
    for label, key in (("no snapshot (baseline)", "before"), ("while serving", "during")):
        p50 = statistics.median(pct(r[key], 0.5) for r in runs)
        p99 = statistics.median(pct(r[key], 0.99) for r in runs)
        worst = statistics.median(max(r[key], default=float("nan")) for r in runs)
        n = statistics.median(len(r[key]) for r in runs)
        print(
            f"live delay, {label:>22}: p50 {p50:.2f} ms  p99 {p99:.2f} ms  max {worst:.2f} ms "
            f"({n:.0f} batches; target <= {TARGET_DELAY_MS:g} ms while serving)"
        )


if __name__ == "__main__":
    main()
