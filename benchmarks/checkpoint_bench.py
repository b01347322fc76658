"""Checkpoint write, warm restart and clone of a router following real publishers on loopback.

``RANKS`` publishers (stock wire: no epoch, heartbeat or snapshot; a replay buffer that
holds their history) each store ``BLOCKS`` blocks; a router (a PrefixIndex) follows them
until exact, then:

- writes a checkpoint while a probe publisher sends a batch every 2 ms: the write's
  duration and size, and the probe batches' delay (publish to sink) p50/p99/max during
  the write against the same before it;
- stops (writing its checkpoint), the engines send a tail of batches, and a new router
  starts from the checkpoint: time until every rank is SYNCED and exact;
- a replica clones the running router: time until every rank is SYNCED and exact;
- a cold router replays every rank's whole buffer, for comparison.

Run: ``.venv/bin/python benchmarks/checkpoint_bench.py [--ranks 64] [--blocks 20000]``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import threading
import time
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from kvwire.prefix_index import PrefixIndex
from kvwire.publisher import EventPublisher, PublisherConfig
from kvwire.subscriber import (
    EngineSource,
    RankState,
    StreamConfig,
    Subscriber,
    SubscriberConfig,
)
from kvwire.wire import decode_batch
from tests.subscriber.helpers import Engine

EP = "tcp://127.0.0.1:*"


class TimedIndex(PrefixIndex):
    """A PrefixIndex that records the delay of the probe worker's batches (publish to apply)."""

    def __init__(self) -> None:
        super().__init__(4)
        self.delays: list[tuple[float, float]] = []  # (applied at, delay s)

    def apply_payload(self, worker_id: str, rank: int, payload: Any, limits: Any = None) -> None:
        if worker_id == "probe":
            now = time.time()
            self.delays.append((now, now - decode_batch(bytes(payload)).ts))
        super().apply_payload(worker_id, rank, payload, limits)


def pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))]


def exact(sub: Subscriber, index: PrefixIndex, truth: list[set[int]], worker: str = "w") -> bool:
    statuses = [st for st in sub.status() if st.worker_id == worker]
    if len(statuses) != len(truth):
        return False
    for st in statuses:
        if True:
            if st.state is not RankState.SYNCED or st.replay_pending:
                return False
            if index.blocks(worker, st.rank) != truth[st.rank]:
                return False
    return True


def wait(pred: Any, timeout: float, what: str) -> float:
    start = time.monotonic()
    while not pred():
        if time.monotonic() - start > timeout:
            raise SystemExit(f"timed out waiting for {what}")
        time.sleep(0.005)
    return time.monotonic() - start


class Engines:
    """The publishers, in a process of their own (their threads would take the router's GIL)."""

    def __init__(self, ranks: int, config: PublisherConfig) -> None:
        import multiprocessing as mp

        ctx = mp.get_context("fork")
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=_engines_main, args=(child, ranks, config), daemon=True)
        self.proc.start()
        self.endpoints, self.probe = self.conn.recv()

    def call(self, *cmd: Any) -> Any:
        self.conn.send(cmd)
        return self.conn.recv()

    def close(self) -> None:
        self.call("close")
        self.proc.join(10)


def _engines_main(conn: Any, ranks: int, config: PublisherConfig) -> None:
    pubs = [EventPublisher(EP, EP, config, rank=r).start() for r in range(ranks)]
    probe_pub = EventPublisher(EP, EP, config).start()
    engines = [Engine(seed=r, rank=r) for r in range(ranks)]
    eps = [(p.bound_endpoint, p.bound_replay_endpoint) for p in pubs]
    conn.send((eps, (probe_pub.bound_endpoint, probe_pub.bound_replay_endpoint)))
    stop_probe = threading.Event()
    probe_engine = Engine(seed=999)

    def probing() -> None:
        while not stop_probe.is_set():
            probe_pub.publish(probe_engine.batch(blocks=1))
            time.sleep(0.002)

    prober: threading.Thread | None = None
    while True:
        cmd, *rest = conn.recv()
        if cmd == "publish":
            n, blocks = rest
            for eng, pub in zip(engines, pubs, strict=True):
                eng.publish(pub, n, blocks=blocks)
            conn.send([set(e.truth) for e in engines])
        elif cmd == "probe":
            if rest[0]:
                stop_probe.clear()
                prober = threading.Thread(target=probing, daemon=True)
                prober.start()
            elif prober is not None:
                stop_probe.set()
                prober.join()
            conn.send(None)
        else:
            for p in [*pubs, probe_pub]:
                p.close(timeout=1.0)
            conn.send(None)
            return


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--ranks", type=int, default=64)
    ap.add_argument("--blocks", type=int, default=20_000)
    ap.add_argument("--batch-blocks", type=int, default=500)
    ap.add_argument("--tail", type=int, default=20, help="batches per rank while no router runs")
    args = ap.parse_args()
    batches = args.blocks // args.batch_blocks
    config = PublisherConfig(
        epoch=False, heartbeat_s=None, snapshot=False, buffer_steps=batches + args.tail + 10
    )
    fleet = Engines(args.ranks, config)
    source = EngineSource.from_rank_endpoints("w", fleet.endpoints)
    probe = EngineSource.from_rank_endpoints("probe", [fleet.probe])
    tmp = tempfile.mkdtemp(prefix="kvw-ckpt-")
    path = os.path.join(tmp, "router.ckpt")
    sub_config = SubscriberConfig(stream=StreamConfig(idle_probe=None), checkpoint=path)
    print(f"{args.ranks} ranks x {args.blocks} blocks ({batches} batches of {args.batch_blocks})")

    truth = fleet.call("publish", batches, args.batch_blocks)
    index = TimedIndex()
    sub = Subscriber([source, probe], index, config=sub_config).start()
    took = wait(lambda: exact(sub, index, truth), 300, "the cold router exact")
    print(f"cold start (replays every rank's whole history): exact in {took:.2f} s")

    fleet.call("probe", True)
    time.sleep(1.0)
    before_from = time.time()
    time.sleep(1.0)
    start = time.time()
    info = sub.checkpoint(path)
    end = time.time()
    time.sleep(0.2)
    fleet.call("probe", False)
    before = [d for t, d in index.delays if before_from <= t < start]
    during = [d for t, d in index.delays if start <= t <= end]
    print(
        f"checkpoint write: {info.nbytes / 1e6:.1f} MB, {info.ranks} ranks, {info.seconds:.3f} s "
        f"({info.nbytes / 1e6 / max(info.seconds, 1e-9):.0f} MB/s)"
    )
    ms = 1000.0
    print(
        f"probe batch delay before the write: p50 {pct(before, 0.5) * ms:.2f} ms, "
        f"p99 {pct(before, 0.99) * ms:.2f} ms, max {max(before, default=0) * ms:.2f} ms "
        f"({len(before)} batches)"
    )
    print(
        f"probe batch delay during the write: p50 {pct(during, 0.5) * ms:.2f} ms, "
        f"p99 {pct(during, 0.99) * ms:.2f} ms, max {max(during, default=0) * ms:.2f} ms "
        f"({len(during)} batches)"
    )

    # A replica clones the running router.
    endpoint = sub.serve_view()
    replica_index = TimedIndex()
    t0 = time.monotonic()
    replica = Subscriber(
        [source],
        replica_index,
        config=SubscriberConfig(stream=StreamConfig(idle_probe=None), clone_from=endpoint),
    ).start()
    wait(lambda: exact(replica, replica_index, truth), 300, "the replica exact")
    restored = replica.restored
    assert restored is not None
    print(
        f"clone from a running router: exact in {time.monotonic() - t0:.2f} s "
        f"({restored.nbytes / 1e6:.1f} MB copied in {restored.seconds:.2f} s)"
    )
    replica.stop(timeout=60)

    # Warm restart: stop (checkpoint on stop), the engines go on, a new router loads it.
    t0 = time.monotonic()
    sub.stop(timeout=120)
    print(f"stop with its checkpoint: {time.monotonic() - t0:.2f} s")
    truth = fleet.call("publish", args.tail, args.batch_blocks // 10)
    warm_index = TimedIndex()
    t0 = time.monotonic()
    warm = Subscriber([source, probe], warm_index, config=sub_config).start()
    wait(lambda: exact(warm, warm_index, truth), 300, "the warm router exact")
    restored = warm.restored
    assert restored is not None
    replayed = statistics.median(
        st.counters.replayed for st in warm.status() if st.worker_id == "w"
    )
    print(
        f"warm restart from the checkpoint ({args.tail} batches missed per rank): exact in "
        f"{time.monotonic() - t0:.2f} s (load {restored.seconds:.2f} s; median batches replayed "
        f"per rank {replayed:.0f})"
    )
    warm.stop(timeout=120)
    fleet.close()


if __name__ == "__main__":
    main()
