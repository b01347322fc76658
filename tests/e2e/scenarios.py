"""The fault scenarios, each run against loopback processes and against containers.

Every scenario keeps traffic running while the fault happens, ends the fault,
quiesces, and checks convergence (see :mod:`tests.e2e.harness`).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

from kvwire.subscriber import RankState

from .harness import (
    Engine,
    EngineSpec,
    Router,
    applied,
    cluster,
    converge,
    quiesce,
    report,
    wait_for,
)

MakeEngine = Callable[[EngineSpec], Engine]
TWO_ENGINES = [EngineSpec("engine-a", drive_seed=1), EngineSpec("engine-b", drive_seed=2)]


def _seq(router: Router, engine: Engine) -> int:
    st = router.status()
    return min(st[(engine.worker_id, r)].expected_seq for r in range(engine.spec.ranks))


def _traffic(router: Router, engine: Engine, batches: int, timeout: float = 30.0) -> None:
    """Wait until ``batches`` more batches of every rank of ``engine`` were applied."""
    wait_for(applied(router, engine, _seq(router, engine) + batches), timeout, f"traffic on {engine.worker_id}")


def _engine_published(engine: Engine, batches: int, timeout: float = 30.0) -> None:
    def check() -> bool:
        return all(engine.client().truth(r).last_seq + 1 >= batches for r in range(engine.spec.ranks))

    wait_for(check, timeout, f"{engine.worker_id} to publish {batches} batches")


def _finish(name: str, router: Router, engines: list[Engine], fault_end: float) -> dict[tuple[str, int], RankState]:
    quiesce(engines)
    results = converge(router, engines, fault_end)
    report(name, results)
    return {(c.worker_id, c.rank): c.state for c in results}


def _all_synced(states: dict[tuple[str, int], RankState]) -> None:
    assert all(s is RankState.SYNCED for s in states.values()), states


def _repaired_by_snapshot(router: Router, engine: Engine, ranks: range) -> None:
    """Seqs were lost for good on ``ranks``, and a snapshot made them exact again."""
    st = router.status()
    for r in ranks:
        counters = st[(engine.worker_id, r)].counters
        assert counters.seqs_lost > 0 and counters.snapshots_applied >= 1, counters


def kill_and_restart(make: MakeEngine) -> None:
    with cluster(make, TWO_ENGINES) as (engines, router):
        a, b = engines
        _traffic(router, a, 15)
        a.kill()
        _traffic(router, b, 10)
        a.restart()
        fault_end = time.monotonic()
        _engine_published(a, 10)
        states = _finish("kill", router, engines, fault_end)
        _all_synced(states)
        st = router.status()
        assert all(st[(a.worker_id, r)].counters.restarts >= 1 for r in range(a.spec.ranks))


def pause_and_resume(make: MakeEngine) -> None:
    with cluster(make, TWO_ENGINES) as (engines, router):
        a, b = engines
        _traffic(router, a, 15)
        a.pause()
        _traffic(router, b, 30)
        a.resume()
        fault_end = time.monotonic()
        _traffic(router, a, 5)
        _all_synced(_finish("pause", router, engines, fault_end))


def disconnect_and_reconnect(make: MakeEngine) -> None:
    with cluster(make, TWO_ENGINES) as (engines, router):
        a, b = engines
        _traffic(router, a, 15)
        a.disconnect()
        _traffic(router, b, 30)
        a.reconnect()
        fault_end = time.monotonic()
        _all_synced(_finish("disconnect", router, engines, fault_end))


def queue_overflow(make: MakeEngine) -> None:
    with cluster(make, TWO_ENGINES) as (engines, router):
        a, _ = engines
        _traffic(router, a, 10)
        client = a.client()
        client.set_publisher(0, max_queue_size=1)
        client.drive(4000, seed=7, hold=2)

        def dropped() -> bool:
            return client.stats().ranks[0].publisher["dropped_queue_full"] > 0

        wait_for(dropped, 30, "the publisher queue to overflow")
        client.set_publisher(0, max_queue_size=100_000)
        client.drive(60, seed=8, hold=3)
        fault_end = time.monotonic()
        # Dropped batches were never published, so no replay has them; the
        # publisher's mirror learnt them, and its snapshot repairs the rank.
        _all_synced(_finish("queue-overflow", router, engines, fault_end))
        _repaired_by_snapshot(router, a, range(1))


def drop_last_batch_and_go_idle(make: MakeEngine) -> None:
    """The engine's last batch is dropped (queue full), then it publishes nothing."""
    with cluster(make, TWO_ENGINES) as (engines, router):
        a, _ = engines
        _traffic(router, a, 10)
        client = a.client()
        client.drive(0)
        # A queue of one and a sender that waits 0.3 s after each wake-up: of two
        # batches in a row, the second finds the first still queued and is dropped.
        client.set_publisher(0, max_queue_size=1, coalesce_s=0.3)
        wait_for(lambda: client.stats().ranks[0].publisher["queue_depth"] == 0, 10, "an idle sender")
        dropped_before = client.stats().ranks[0].publisher["dropped_queue_full"]
        client.submit(0, f"last-{time.monotonic_ns()}", list(range(7, 7 + 3 * 16)))
        client.reset(0)  # an AllBlocksCleared that never leaves the engine
        assert client.stats().ranks[0].publisher["dropped_queue_full"] == dropped_before + 1
        client.set_publisher(0, max_queue_size=100_000, coalesce_s=0.002)  # publishes nothing
        fault_end = time.monotonic()
        assert client.truth(0).hashes == []
        _all_synced(_finish("drop-last-batch", router, engines, fault_end))
        _repaired_by_snapshot(router, a, range(1))


def late_subscriber(make: MakeEngine) -> None:
    with cluster(make, TWO_ENGINES, start_router=False) as (engines, router):
        for e in engines:
            _engine_published(e, 40)
        router.start()
        fault_end = time.monotonic()
        _all_synced(_finish("late-subscriber", router, engines, fault_end))
        st = router.status()
        assert all(s.counters.replayed > 0 for s in st.values()), st


def partition_beyond_replay_buffer(make: MakeEngine) -> None:
    specs = [
        EngineSpec("engine-a", drive_seed=1, buffer_steps=20, hwm=5, drive_rate=120),
        EngineSpec("engine-b", drive_seed=2),
    ]
    with cluster(make, specs) as (engines, router):
        a, _ = engines
        # The partition's length is the fault itself; the control endpoint is cut
        # off too (in containers it shares the network), so it is sized from the
        # publishing rate measured just before.
        t0, s0 = time.monotonic(), a.client().truth(0).last_seq
        _traffic(router, a, 10)
        before = [a.client().truth(r).last_seq for r in range(a.spec.ranks)]
        rate = max((before[0] - s0) / (time.monotonic() - t0), 1.0)
        a.disconnect()
        threading.Event().wait(min(3 * a.spec.buffer_steps / rate + 0.5, 20.0))
        a.reconnect()
        fault_end = time.monotonic()
        after = [a.client().truth(r).last_seq for r in range(a.spec.ranks)]
        assert all(n - b > a.spec.buffer_steps for b, n in zip(before, after, strict=True)), (before, after)
        # What the replay buffer no longer holds, a snapshot brings back: every
        # rank ends exact, whether it lost history or TCP held it all back.
        _all_synced(_finish("long-partition", router, engines, fault_end))
        st = router.status()
        for r in range(a.spec.ranks):
            counters = st[(a.worker_id, r)].counters
            assert counters.seqs_lost == 0 or counters.snapshots_applied >= 1, counters


def reset_rank(make: MakeEngine) -> None:
    with cluster(make, TWO_ENGINES) as (engines, router):
        a, _ = engines
        _traffic(router, a, 15)
        a.client().reset(1)
        fault_end = time.monotonic()
        _traffic(router, a, 5)
        _all_synced(_finish("reset", router, engines, fault_end))


SCENARIOS: dict[str, Callable[[MakeEngine], None]] = {
    "kill_and_restart": kill_and_restart,
    "pause_and_resume": pause_and_resume,
    "disconnect_and_reconnect": disconnect_and_reconnect,
    "queue_overflow": queue_overflow,
    "drop_last_batch_and_go_idle": drop_last_batch_and_go_idle,
    "late_subscriber": late_subscriber,
    "partition_beyond_replay_buffer": partition_beyond_replay_buffer,
    "reset_rank": reset_rank,
}
