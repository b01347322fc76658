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
        states = _finish("queue-overflow", router, engines, fault_end)
        # Dropped batches were never published: the loss cannot be replayed.
        assert states[(a.worker_id, 0)] is RankState.PARTIAL, states
        assert router.status()[(a.worker_id, 0)].counters.seqs_lost > 0


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
        a, b = engines
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
        states = _finish("long-partition", router, engines, fault_end)
        for r in range(b.spec.ranks):
            assert states[(b.worker_id, r)] is RankState.SYNCED, states
        return_states = [states[(a.worker_id, r)] for r in range(a.spec.ranks)]
        lost = [router.status()[(a.worker_id, r)].counters.seqs_lost for r in range(a.spec.ranks)]
        # Every rank of the partitioned engine either lost history (PARTIAL) or, where the
        # transport held everything back, caught up exactly; which one is up to TCP.
        for state, n in zip(return_states, lost, strict=True):
            assert (state is RankState.PARTIAL) == (n > 0), (return_states, lost)


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
    "late_subscriber": late_subscriber,
    "partition_beyond_replay_buffer": partition_beyond_replay_buffer,
    "reset_rank": reset_rank,
}
