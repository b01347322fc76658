"""A router flooded with large batches: its memory peak, and what it keeps after.

16 ranks (kvwire ``EventPublisher``s, four per publisher process, on tcp
loopback) send about 1 MB batches (18,000 blocks of 16 tokens, the same blocks
again and again; ``--blocks 30600`` for about 1.7 MB) as fast as their senders go for ``--seconds``, into one
``Subscriber`` (its own process, the router) whose sink is a ``PrefixIndex``.
The router's RSS is printed at three points: its baseline (every rank SYNCED,
before the flood), its peak (``ru_maxrss``) and after the drain (every rank
settled at its publisher's last seq, then one second). Two settings side by
side, each in a fresh router process, alternated run by run:

- ``unbounded``: ``hwm=100_000`` messages per rank and no byte budget, the
  settings before ``receive_budget_bytes``;
- ``defaults``: ``SubscriberConfig()``.

Also printed: whether the index ended exact (every rank holds its 18,000
blocks, SYNCED) and the gaps and replays the bound cost.

Run: ``.venv/bin/python benchmarks/receive_flood.py [--runs N] [--seconds S] [--blocks B]
[--settings defaults]``.
Figures are medians over the runs.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import resource
import statistics
import subprocess
import sys
import time
from typing import Any

RANKS_PER_PROCESS = 4
BLOCKS = 18_000
BLOCK_SIZE = 16
UNBOUNDED = 1 << 62


def _batch(rank: int, base: int) -> Any:
    from kvwire.wire import BlockStored, KVEventBatch

    hashes = list(range(base + 1, base + 1 + BLOCKS))
    tokens = [(h * 31 + i) % 50_000 for h in hashes for i in range(BLOCK_SIZE)]
    stored = BlockStored(
        block_hashes=hashes, parent_block_hash=None, token_ids=tokens, block_size=BLOCK_SIZE
    )
    return KVEventBatch(time.time(), [stored], rank)


class Encoded:
    """A batch encoded once and sent again and again: the publisher's speed is its sender's."""

    def __init__(self, batch: Any) -> None:
        self.batch = batch
        self.payload: bytes | None = None

    def encode(self, dialect: Any) -> bytes:
        if self.payload is None:
            from kvwire.wire import encode_batch

            self.payload = encode_batch(self.batch, dialect=dialect)
        return self.payload


def publishers(index: int) -> None:
    """One publisher process: RANKS_PER_PROCESS ranks, flooding between "go" and the deadline."""
    from kvwire.publisher import EventPublisher, PublisherConfig

    # A publisher queue of 256 batches: what the router does not take is dropped there
    # (a gap for the router to repair) rather than queued for ever.
    config = PublisherConfig(buffer_steps=64, max_queue_size=1024, hwm=256)
    pubs = [
        EventPublisher("tcp://127.0.0.1:*", "tcp://127.0.0.1:*", config, rank=r).start()
        for r in range(RANKS_PER_PROCESS)
    ]
    batches = [Encoded(_batch(r, (index * RANKS_PER_PROCESS + r) << 32)) for r in range(len(pubs))]
    for pub, batch in zip(pubs, batches, strict=True):
        pub.publish(batch)  # the blocks the router must hold, before the flood
    print(json.dumps([[p.bound_endpoint, p.bound_replay_endpoint] for p in pubs]), flush=True)
    seconds = float(sys.stdin.readline())
    deadline = time.monotonic() + seconds
    sent = 0
    while time.monotonic() < deadline:
        idle = True
        for pub, batch in zip(pubs, batches, strict=True):
            if pub.queue_depth < 8:  # as fast as the sender goes, never a dropped seq
                pub.publish(batch)
                sent += 1
                idle = False
        if idle:
            time.sleep(0.0002)
    print(json.dumps({"sent": sent, "last": [p.last_seq for p in pubs]}), flush=True)
    sys.stdin.readline()  # serve replays until the router is done
    for pub in pubs:
        pub.close()


def _rss_mb() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    raise RuntimeError("no VmRSS")


def wait_for(cond: Any, timeout: float, what: str, progress: Any = None) -> None:
    deadline = time.monotonic() + timeout
    shown = time.monotonic()
    while not cond():
        now = time.monotonic()
        if now > deadline:
            raise TimeoutError(f"timed out waiting for {what}")
        if progress is not None and now - shown > 5:
            shown = now
            print(f"waiting for {what}: {progress()}", file=sys.stderr, flush=True)
        time.sleep(0.02)


def router(setting: str, seconds: float, ranks: int) -> None:
    """One router process: follow the publishers, flood them, print what memory did."""
    from kvwire.prefix_index import PrefixIndex
    from kvwire.subscriber import EngineSource, RankState, Subscriber, SubscriberConfig

    if setting == "unbounded":
        config = SubscriberConfig(hwm=100_000, receive_budget_bytes=UNBOUNDED)
    else:
        config = SubscriberConfig()
    procs = [
        subprocess.Popen(
            [
                *(sys.executable, __file__, "--role", "publishers", "--index", str(i)),
                *("--blocks", str(BLOCKS)),
            ],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        for i in range(ranks // RANKS_PER_PROCESS)
    ]
    try:
        sources = []
        for i, proc in enumerate(procs):
            assert proc.stdout is not None
            eps = json.loads(proc.stdout.readline())
            sources.append(EngineSource.from_rank_endpoints(f"w{i}", [tuple(e) for e in eps]))
        index = PrefixIndex(BLOCK_SIZE)
        with Subscriber(sources, index, config=config) as sub:

            def all_synced() -> bool:
                st = sub.status()
                return len(st) == ranks and all(s.state is RankState.SYNCED for s in st)

            wait_for(all_synced, 60, "every rank SYNCED before the flood")
            wait_for(
                lambda: all(
                    index.rank_blocks(f"w{i}", r) == BLOCKS
                    for i in range(len(procs))
                    for r in range(RANKS_PER_PROCESS)
                ),
                60,
                "the first batches",
            )
            time.sleep(0.5)
            baseline = _rss_mb()
            start = time.monotonic()
            for proc in procs:
                assert proc.stdin is not None
                proc.stdin.write(f"{seconds}\n")
                proc.stdin.flush()
            lasts: dict[tuple[str, int], int] = {}
            sent = 0
            for i, proc in enumerate(procs):
                assert proc.stdout is not None
                done = json.loads(proc.stdout.readline())
                sent += done["sent"]
                for r, last in enumerate(done["last"]):
                    lasts[(f"w{i}", r)] = last

            def drained() -> bool:
                return all(
                    s.expected_seq > lasts[(s.worker_id, s.rank)]  # heartbeats follow
                    and s.state is not RankState.SYNCING
                    and not s.replay_pending
                    and s.held == 0
                    for s in sub.status()
                )

            def behind() -> str:
                st = sub.status()
                left = sum(max(0, lasts[(s.worker_id, s.rank)] + 1 - s.expected_seq) for s in st)
                states = sorted({s.state.value for s in st})
                return f"{left} batches behind, states {states}, rss {_rss_mb():.0f} MB"

            wait_for(drained, 300, "the router to drain the flood", behind)
            drain_s = time.monotonic() - start - seconds
            time.sleep(1.0)
            after = _rss_mb()
            peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
            statuses = sub.status()
            exact = all(s.state is RankState.SYNCED for s in statuses) and all(
                index.rank_blocks(s.worker_id, s.rank) == BLOCKS for s in statuses
            )
            counters = [s.counters for s in statuses]
            print(
                json.dumps(
                    {
                        "setting": setting,
                        "baseline": baseline,
                        "peak": peak,
                        "after": after,
                        "sent": sent,
                        "applied": sum(c.batches for c in counters),
                        "gaps": sum(c.gaps for c in counters),
                        "replayed": sum(c.replayed for c in counters),
                        "resyncs": sum(c.resyncs for c in counters),
                        "drain_s": drain_s,
                        "exact": exact,
                    }
                ),
                flush=True,
            )
    finally:
        for proc in procs:
            if proc.stdin is not None and not proc.stdin.closed:
                with_suppressed(proc.stdin.write, "\n")
                with_suppressed(proc.stdin.close)
        for proc in procs:
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()


def with_suppressed(fn: Any, *args: Any) -> None:
    with contextlib.suppress(BrokenPipeError, OSError, ValueError):
        fn(*args)


def main() -> None:
    global BLOCKS
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--role", choices=["main", "router", "publishers"], default="main")
    ap.add_argument("--setting", choices=["unbounded", "defaults"], default="defaults")
    ap.add_argument("--index", type=int, default=0)
    ap.add_argument("--ranks", type=int, default=16)
    ap.add_argument("--seconds", type=float, default=10.0)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--blocks", type=int, default=18_000, help="blocks a batch (18,000: ~1 MB)")
    ap.add_argument(
        "--settings",
        nargs="+",
        choices=["unbounded", "defaults"],
        default=["unbounded", "defaults"],
    )
    args = ap.parse_args()
    BLOCKS = args.blocks
    if args.role == "publishers":
        publishers(args.index)
        return
    if args.role == "router":
        router(args.setting, args.seconds, args.ranks)
        return
    results: dict[str, list[dict[str, Any]]] = {s: [] for s in args.settings}
    for run in range(args.runs):
        order = list(args.settings) if run % 2 == 0 else list(reversed(args.settings))
        for setting in order:
            out = subprocess.run(
                [
                    *(sys.executable, __file__, "--role", "router", "--setting", setting),
                    *("--seconds", str(args.seconds), "--ranks", str(args.ranks)),
                    *("--blocks", str(BLOCKS)),
                ],
                stdout=subprocess.PIPE,
                text=True,
                check=True,
            )
            res = json.loads(out.stdout.strip().splitlines()[-1])
            results[setting].append(res)
            print(f"run {run + 1} {setting}: {res}", flush=True)
    print(
        f"\n{args.ranks} ranks x {BLOCKS:,}-block batches for {args.seconds:g} s, "
        f"medians of {args.runs} run(s); RSS in MB"
    )
    print(
        f"{'setting':<10} {'baseline':>9} {'peak':>7} {'+peak':>7} {'after':>7} {'+after':>7} "
        f"{'sent':>6} {'gaps':>6} {'replayed':>8} {'drain s':>7} exact"
    )
    for setting, runs in results.items():

        def med(key: str, runs: list[dict[str, Any]] = runs) -> float:
            return float(statistics.median(r[key] for r in runs))

        print(
            f"{setting:<10} {med('baseline'):>9.0f} {med('peak'):>7.0f} "
            f"{med('peak') - med('baseline'):>+7.0f} {med('after'):>7.0f} "
            f"{med('after') - med('baseline'):>+7.0f} {med('sent'):>6.0f} {med('gaps'):>6.0f} "
            f"{med('replayed'):>8.0f} {med('drain_s'):>7.1f} {all(r['exact'] for r in runs)}"
        )


if __name__ == "__main__":
    main()
