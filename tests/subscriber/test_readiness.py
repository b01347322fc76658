"""Readiness: waiting for the ranks to be SYNCED (threads and coroutines), and the recovery gauges."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Iterator

import prometheus_client
import pytest
import zmq
from prometheus_client.parser import text_string_to_metric_families

from kvwire.publisher import EventPublisher
from kvwire.subscriber import (
    BlockSetSink,
    EngineSource,
    RankState,
    StreamConfig,
    Subscriber,
    SyncProgress,
)
from kvwire.subscriber.metrics import register_metrics
from kvwire.subscriber.readiness import ranks_needed
from tests.subscriber.helpers import FAST, Engine, ipc_endpoints, streams
from tests.waiting import await_for, wait_for

SHORT = 0.3  # a wait that must time out: long enough to see a rank sync if it could


@pytest.fixture
def endpoints() -> Iterator[tuple[str, str]]:
    with ipc_endpoints() as eps:
        yield eps


def _publisher(endpoints: tuple[str, str], rank: int) -> EventPublisher:
    """A started publisher of rank ``rank`` with one batch stored."""
    pub = EventPublisher(*endpoints, rank=rank).start()
    Engine(seed=rank, rank=rank).publish(pub, 1)
    return pub


def _states(sub: Subscriber) -> list[RankState]:
    return [s.state for s in sub.status()]


def test_wait_synced_returns_only_once_every_rank_is_synced(endpoints: tuple[str, str]) -> None:
    source = EngineSource("w", *endpoints, ranks=2)
    pubs: list[EventPublisher] = []
    got: list[tuple[bool, list[RankState]]] = []
    with Subscriber([source], BlockSetSink(), config=FAST) as sub:
        waiter = threading.Thread(target=lambda: got.append((sub.wait_synced(), _states(sub))))
        waiter.start()
        try:
            assert not sub.is_synced(0.5)
            # Rank 0's publisher starts after the subscriber; rank 1's is held back.
            pubs.append(_publisher(endpoints, 0))
            assert sub.wait_synced(0.5, timeout=30)
            assert sub.is_synced(0.5) and not sub.is_synced()
            assert sub.wait_synced(1.0, timeout=SHORT) is False
            assert not got, "wait_synced() returned with a rank not SYNCED"
            pubs.append(_publisher(endpoints, 1))
            waiter.join(30)
            assert got == [(True, [RankState.SYNCED, RankState.SYNCED])]
            assert sub.is_synced() and sub.progress().synced == 2
        finally:
            waiter.join(30)
            for p in pubs:
                p.close(timeout=1)


def test_wait_synced_times_out_when_a_rank_never_syncs(endpoints: tuple[str, str]) -> None:
    with Subscriber([EngineSource("w", *endpoints)], BlockSetSink(), config=FAST) as sub:
        started = time.monotonic()
        assert sub.wait_synced(timeout=SHORT) is False
        assert time.monotonic() - started >= SHORT
        assert sub.progress() == SyncProgress(
            ranks=1, synced=0, syncing=1, partial=0, stale=0, replaying=0, snapshotting=0
        )


def test_wait_synced_returns_false_once_the_subscriber_stops(endpoints: tuple[str, str]) -> None:
    got: list[bool] = []
    sub = Subscriber([EngineSource("w", *endpoints)], BlockSetSink(), config=FAST).start()
    waiter = threading.Thread(target=lambda: got.append(sub.wait_synced(timeout=60)))
    waiter.start()
    sub.stop()
    waiter.join(30)
    assert got == [False]
    assert sub.wait_synced(timeout=60) is False  # at once: nothing will sync any more


def test_synced_on_the_subscribers_loop(endpoints: tuple[str, str]) -> None:
    async def main() -> None:
        async with Subscriber([EngineSource("w", *endpoints)], BlockSetSink(), config=FAST) as sub:
            with pytest.raises(TimeoutError):
                await sub.synced(timeout=SHORT)
            waiting = asyncio.get_running_loop().create_task(sub.synced(timeout=30))
            with pytest.raises(RuntimeError, match="await synced"):
                sub.wait_synced(timeout=1)  # would block the very loop that must sync it
            assert not waiting.done()
            pub = _publisher(endpoints, 0)
            try:
                await waiting
                assert _states(sub) == [RankState.SYNCED]
            finally:
                pub.close(timeout=1)

    asyncio.run(main())


def test_synced_from_another_loop_and_when_the_subscriber_stops(
    endpoints: tuple[str, str],
) -> None:
    sources = [EngineSource("a", *endpoints), EngineSource("b", endpoints[0] + "b")]
    with Subscriber(sources, BlockSetSink(), config=FAST) as sub:
        pub = _publisher(endpoints, 0)
        try:
            asyncio.run(sub.synced(0.5, timeout=30))  # the caller's loop, woken by the subscriber's
            assert sub.rank_state("a", 0) is RankState.SYNCED
            with pytest.raises(TimeoutError):
                asyncio.run(sub.synced(timeout=SHORT))  # "b" never comes

            async def stopped() -> None:
                waiting = asyncio.get_running_loop().create_task(sub.synced(timeout=60))
                await await_for(lambda: sub.progress().synced == 1, what="the waiter to start")
                await asyncio.to_thread(sub.stop)
                with pytest.raises(RuntimeError, match="stopped"):
                    await waiting

            asyncio.run(stopped())
        finally:
            pub.close(timeout=1)


def test_fraction_is_checked() -> None:
    sub = Subscriber([EngineSource("w", "tcp://127.0.0.1:1")], BlockSetSink())
    for bad in (0, 0.0, -0.5, 1.01, float("nan"), float("inf")):
        with pytest.raises(ValueError, match=r"fraction must be in \(0, 1\]"):
            sub.is_synced(bad)
        with pytest.raises(ValueError):
            sub.wait_synced(bad, timeout=0)
        with pytest.raises(ValueError):
            asyncio.run(sub.synced(bad, timeout=0))
    for wrong in ("1", True, None):
        with pytest.raises(TypeError):
            sub.is_synced(wrong)  # type: ignore[arg-type]
    assert not sub.is_synced(1e-9)  # not started: its one rank is not SYNCED
    assert Subscriber([], BlockSetSink()).is_synced()  # no rank is missing


def test_ranks_needed_is_the_least_whole_number_of_ranks() -> None:
    assert ranks_needed(0.07, 100) == 7  # 0.07 * 100 == 7.000000000000001
    assert ranks_needed(0.5, 3) == 2 and ranks_needed(1.0, 0) == 0
    for n in range(1, 200):
        for k in range(1, n + 1):
            assert ranks_needed(k / n, n) == k, (k, n)
            assert ranks_needed(k / n - 1e-6, n) == k, (k, n)


def test_recovery_gauges(endpoints: tuple[str, str]) -> None:
    """Ranks per state, and a start replay still to come while the publisher does not answer."""
    registry = prometheus_client.CollectorRegistry()
    ctx = zmq.Context()
    live_ep, replay_ep = endpoints[0] + "-mute", endpoints[1] + "-mute"
    live: zmq.Socket[bytes] = ctx.socket(zmq.PUB)
    mute: zmq.Socket[bytes] = ctx.socket(zmq.ROUTER)  # takes replay requests, answers none
    live.bind(live_ep)
    mute.bind(replay_ep)
    pub = _publisher(endpoints, 0)
    sources = [
        EngineSource("ok", *endpoints),
        EngineSource("mute", live_ep, replay_ep),
        EngineSource("down", endpoints[0] + "-down"),
    ]
    config = streams(StreamConfig(replay_timeout=60, replay_deadline=60))
    try:
        with Subscriber(sources, BlockSetSink(), config=config) as sub:
            register_metrics(sub, registry)
            wait_for(
                lambda: sub.progress().replaying == 1 and sub.progress().synced == 1,
                what="rank ok SYNCED and rank mute waiting for its start replay",
            )
            text = prometheus_client.generate_latest(registry).decode()
    finally:
        pub.close(timeout=1)
        live.close(linger=0)
        mute.close(linger=0)
        ctx.term()
    families = {f.name: f for f in text_string_to_metric_families(text)}
    ranks = {s.labels["state"]: s.value for s in families["kvwire_subscriber_ranks"].samples}
    assert ranks == {"synced": 1.0, "syncing": 2.0, "partial": 0.0, "stale": 0.0}
    recoveries = {
        s.labels["kind"]: s.value for s in families["kvwire_subscriber_recoveries"].samples
    }
    assert recoveries == {"replay": 1.0, "snapshot": 0.0}
    pending = {
        s.labels["worker"]: s.value for s in families["kvwire_subscriber_replay_pending"].samples
    }
    assert pending["mute"] == 1.0 and pending["down"] == 0.0  # ("ok" may be probing)
