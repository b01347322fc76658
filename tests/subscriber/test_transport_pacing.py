"""Requests paced across a fleet: bounded in flight, never timed out while waiting their turn.

Also the byte bound of the receive path (a SUB's mark from ``max_message_size``,
held batches counted against the rank's share) and the stream's ``Reserve``
carried out to the sink.
"""

from __future__ import annotations

import functools
import threading
import time
from typing import Any

import msgspec
import pytest

from kvwire.publisher import EventPublisher, PublisherConfig
from kvwire.subscriber import BlockSetSink, RankState, RankStream, StreamConfig, Subscriber
from kvwire.subscriber.config import QUEUE_SLACK, REPLY_BLOCKS, SubscriberConfig
from kvwire.subscriber.recovery import Requests
from kvwire.subscriber.stream import Phase
from kvwire.wire import KVEventBatch
from tests.subscriber.helpers import EPHEMERAL, Engine, bound_source, fast, rank_status
from tests.waiting import wait_for


def _sent(pub: EventPublisher) -> bool:
    return pub.queue_depth == 0 and pub.stats().mirror_pending == 0


def _connected(sub: Subscriber) -> bool:
    return sub.status()[0].connected


class SlowSink(BlockSetSink):
    """A router that applies slowly: requests queue far longer than a replay timeout."""

    def apply(self, worker_id: str, rank: int, batch: KVEventBatch) -> None:
        time.sleep(0.002)
        super().apply(worker_id, rank, batch)


def test_snapshots_are_paced_and_none_times_out_while_waiting() -> None:
    """16 ranks of two engines, each needing a snapshot on first contact (its history is
    far older than its replay buffer), at most 3 requests in flight and 2 per engine,
    through a router so slow that a rank's turn comes seconds after it asked (a replay
    timeout is 0.2 s). None times out, each snapshot is served once, all end exact."""
    config = PublisherConfig(buffer_steps=4, snapshot_chunk_blocks=64)
    engines: list[list[tuple[EventPublisher, Engine]]] = []
    try:
        for e in range(2):
            ranks = []
            for r in range(8):
                pub = EventPublisher(EPHEMERAL, EPHEMERAL, config, rank=r).start()
                model = Engine(seed=100 * e + r, rank=r)
                model.publish(pub, 30, blocks=40)  # 1,200 blocks: about 19 chunks
                ranks.append((pub, model))
            engines.append(ranks)
        for ranks in engines:
            for pub, _ in ranks:
                wait_for(functools.partial(_sent, pub), 10, "the history sent and mirrored")
        sink = SlowSink()
        stream = msgspec.structs.replace(fast().stream, replay_timeout=0.2, idle_probe=None)
        sub_config = fast(stream=stream, max_requests=3, max_requests_per_source=2)
        sources = [bound_source(f"e{e}", [p for p, _ in ranks]) for e, ranks in enumerate(engines)]
        with Subscriber(sources, sink, config=sub_config) as sub:

            def all_exact() -> bool:
                return all(s.state is RankState.SYNCED for s in sub.status()) and all(
                    sink.blocks(f"e{e}", r) == model.truth
                    for e, ranks in enumerate(engines)
                    for r, (_, model) in enumerate(ranks)
                )

            wait_for(all_exact, 60, "every rank exact")
            env = sub._env
            assert env is not None
            assert env.replays.peak <= 3 and env.replays.source_peak <= 2
            assert env.replays.waited > 0, "no request waited: the test shows nothing"
            for st in sub.status():
                c = st.counters
                assert c.replay_timeouts == 0, st
                assert c.snapshots_failed == 0, st
                assert c.snapshots_requested == 1 and c.snapshots_applied == 1, st
        for ranks in engines:
            for pub, _ in ranks:
                assert pub.stats().snapshots_served == 1
    finally:
        for ranks in engines:
            for pub, _ in ranks:
                pub.close()


def test_a_waiting_request_has_no_deadline_until_it_is_sent() -> None:
    """The stream side of pacing: asked, waiting (no deadline), sent (deadlines from then)."""
    config = StreamConfig(replay_timeout=1.0, snapshot_deadline=30.0)
    req = Requests(Phase.REPLAYING)
    action = req.snapshot(0.0, config, 0)
    assert req.active is not None and req.active.deadline == 1.0
    assert req.waiting(action.token)
    assert req.active.deadline == float("inf") and req.active.hard_deadline == float("inf")
    assert not req.waiting(action.token + 1)  # not the request out
    assert req.sent(action.token, 50.0, config)
    assert req.active.deadline == 51.0 and req.active.hard_deadline == 80.0
    s = RankStream(0, config)
    assert s.tick(1e9) == []  # nothing asked, nothing due
    s.request_waiting(99)  # no such request: nothing changes
    assert s.next_deadline() is None


def test_request_limit_is_derived_from_what_the_router_applies() -> None:
    c = SubscriberConfig()
    limit = c.request_limit()
    assert 1 <= limit <= c.max_replays
    assert limit == int(c.stream.replay_timeout * 0.25 * 1_000_000 / REPLY_BLOCKS)
    assert c.source_request_limit() == limit // 4
    assert SubscriberConfig(max_requests=500).request_limit() == c.max_replays
    assert SubscriberConfig(max_requests_per_source=1000).source_request_limit() == limit
    # Replies are read faster than a slower timeout needs: more may be in flight.
    slow = SubscriberConfig(stream=StreamConfig(replay_timeout=2.0))
    assert slow.request_limit() == min(c.max_replays, 2 * limit)
    with pytest.raises(ValueError):
        SubscriberConfig(max_requests=0)
    with pytest.raises(ValueError):
        SubscriberConfig(max_requests_per_source=0)
    # The reply size it assumes is the publisher's snapshot chunk.
    assert PublisherConfig().snapshot_chunk_blocks == REPLY_BLOCKS


# --- the byte bound -------------------------------------------------------------------


def _marks(sub: Subscriber) -> list[Any]:
    links = [link for ranks in sub._links.values() for link in ranks]
    assert links
    return links


def test_a_flood_stays_within_the_receive_budget() -> None:
    """Four ranks flooded with ~200 KB batches into a router that stalls (its sink
    blocks) then drains: the SUB's mark, from max_message_size before any batch is
    seen, keeps each rank's queue within its share from the first message; what the
    flood cannot put in the queues waits at the publishers or is lost there and
    replayed. Accounting: marks and held bytes, checked while stalled."""
    budget = 4 << 20
    pub_config = PublisherConfig(hwm=8, buffer_steps=4096, snapshot=False)
    pubs = [EventPublisher(EPHEMERAL, EPHEMERAL, pub_config).start() for _ in range(4)]
    gate = threading.Event()
    gate.set()

    class Gated(BlockSetSink):
        def apply(self, worker_id: str, rank: int, batch: KVEventBatch) -> None:
            gate.wait(30)
            super().apply(worker_id, rank, batch)

    sink = Gated()
    config = fast(receive_budget_bytes=budget, max_message_size=8 << 20)
    try:
        models = [Engine(seed=50 + i) for i in range(4)]
        sources = [bound_source(f"w{i}", [p]) for i, p in enumerate(pubs)]
        with Subscriber(sources, sink, config=config) as sub:
            wait_for(lambda: all(s.connected for s in sub.status()), 10, "connections")
            share = config.rank_share(4)
            for link in _marks(sub):
                # Opened before any batch: the mark that fits max_message_size.
                assert link.sub_hwm == config.rank_hwm(4, config.max_message_size)
            gate.clear()
            try:
                for pub, model in zip(pubs, models, strict=True):
                    model.publish(pub, 1)
                for _ in range(3):
                    for pub, model in zip(pubs, models, strict=True):
                        model.publish(pub, 30, blocks=3000)  # ~60 KB each
                wait_for(lambda: all(p.queue_depth == 0 for p in pubs), 10, "the flood sent")
                for link in _marks(sub):
                    queued = (link.sub_hwm + QUEUE_SLACK) * max(link.batch_bytes, 1)
                    assert queued <= max(share, (1 + QUEUE_SLACK) * link.batch_bytes)
                    assert link.stream.held_bytes <= share
            finally:
                gate.set()  # a failure above is reported, not a loop stuck in the sink

            def done() -> bool:
                return all(s.state is RankState.SYNCED for s in sub.status()) and all(
                    sink.blocks(f"w{i}", 0) == model.truth for i, model in enumerate(models)
                )

            wait_for(done, 60, "the flood repaired")
            for i, model in enumerate(models):
                assert sink.blocks(f"w{i}", 0) == model.truth
                st = rank_status(sub.status(), f"w{i}", 0)
                assert st.counters.resyncs == 0, st
    finally:
        for pub in pubs:
            pub.close()


def test_held_batches_count_against_the_share() -> None:
    """While a rank holds batches, reading its SUB stops once they and its queue fill
    its share, and goes on when they are applied."""
    budget = 2 << 20
    config = fast(receive_budget_bytes=budget)
    pub_config = PublisherConfig(buffer_steps=4096, snapshot=False)
    with EventPublisher(EPHEMERAL, EPHEMERAL, pub_config) as pub:
        model = Engine(seed=9)
        sink = BlockSetSink()
        with Subscriber([bound_source("w", [pub])], sink, config=config) as sub:
            wait_for(lambda: sub.status()[0].connected, 10, "connection")
            model.publish(pub, 1)
            wait_for(lambda: sub.status()[0].expected_seq == 1, 10, "first batch")
            (link,) = _marks(sub)
            share = config.rank_share(1)
            link.batch_bytes = 100_000
            link.sized = True
            link.share = share
            # A stream holding bytes near its share leaves no room to read.
            room_free = link._live_room()
            assert room_free == link.chunk
            link.stream._seq.held.nbytes = share  # as if a gap held this much
            assert link._live_room() < 1
            link.stream._seq.held.nbytes = 0
            assert link._live_room() == link.chunk


def test_reserve_is_carried_out_to_a_sink_that_has_it() -> None:
    """The stream's ``Reserve(blocks)``: a sink's ``reserve(worker_id, rank, blocks)``
    is called in order with the other actions; a sink without one is left alone, and
    one that raises is noted, not fatal."""
    from kvwire.subscriber.actions import Reserve as Stand

    calls: list[tuple[str, int, int] | str] = []

    class Reserving(BlockSetSink):
        fail = False

        def reserve(self, worker_id: str, rank: int, blocks: int) -> None:
            if self.fail:
                raise RuntimeError("no room")
            calls.append((worker_id, rank, blocks))

        def clear(self, worker_id: str, rank: int) -> None:
            calls.append("clear")
            super().clear(worker_id, rank)

    from kvwire.subscriber.actions import ClearRank

    with EventPublisher(EPHEMERAL, EPHEMERAL, PublisherConfig()) as pub:
        for sink in (Reserving(), BlockSetSink()):
            with Subscriber([bound_source("w", [pub])], sink, config=fast()) as sub:
                wait_for(functools.partial(_connected, sub), 10, "connection")
                (link,) = _marks(sub)
                done = threading.Event()

                def carry(lk: Any = link, ev: threading.Event = done) -> None:
                    lk.carry_out([ClearRank("test"), Stand(blocks=20_000)])
                    ev.set()

                loop = sub._loop
                assert loop is not None
                loop.call_soon_threadsafe(carry)
                assert done.wait(10)
                if isinstance(sink, Reserving):
                    assert calls == ["clear", ("w", 0, 20_000)]
                    sink.fail = True
                    done.clear()
                    loop.call_soon_threadsafe(carry)
                    assert done.wait(10)  # raised inside: noted, the loop goes on
                    wait_for(functools.partial(_connected, sub), 10, "still running")


def test_a_sub_throttled_by_its_first_mark_is_reopened_with_a_higher_one() -> None:
    """Opened at the mark of max_message_size (one message), a SUB whose small batches
    come faster than that mark carries is reopened with the mark their size allows: a
    reconnect to the stream, after which the rank is exact again, nothing lost for good.
    Bursts go on until the router reads them fast enough to show it (a loaded machine
    reads slower), each one applied whole."""
    pub_config = PublisherConfig(buffer_steps=100_000, snapshot=False)
    with EventPublisher(EPHEMERAL, EPHEMERAL, pub_config) as pub:
        model = Engine(seed=21)
        sink = BlockSetSink()
        with Subscriber([bound_source("w", [pub])], sink, config=fast()) as sub:
            wait_for(functools.partial(_connected, sub), 10, "connection")
            (link,) = _marks(sub)
            assert link.sub_hwm == 1
            env = sub._env
            assert env is not None

            def exact() -> bool:
                st = sub.status()[0]
                return st.state is RankState.SYNCED and sink.blocks("w", 0) == model.truth

            for _ in range(5):
                model.publish(pub, 20_000)
                wait_for(exact, 60, "the burst applied")
                if link.reopen_due or env.reopens:
                    break
            assert link.reopen_due or env.reopens, "the rate never showed"
            # Reopened with the first message after a quiet second (a heartbeat), no
            # recovery being out; then exact again. The count goes up as the reopen
            # starts and the new SUB's mark is set once it is open: the wait is for the
            # mark, then for the replay of what the old SUB held.
            def settled() -> bool:
                reopened = env.reopens >= 1 and link.sub_hwm > 1
                return reopened and exact() and not sub.status()[0].replay_pending

            wait_for(settled, 30, "reopened with a higher mark, exact")
            st = sub.status()[0]
            assert st.counters.resyncs == 0 and st.counters.seqs_lost == 0, st


def test_the_reopen_decision_follows_the_live_rate() -> None:
    """The rule itself, with the clock given: a rate that half-fills the open mark every
    paced round asks for a reopen; an engine's step rate does not."""
    with (
        EventPublisher(EPHEMERAL, EPHEMERAL, PublisherConfig()) as pub,
        Subscriber([bound_source("w", [pub])], BlockSetSink(), config=fast()) as sub,
    ):
        wait_for(
            lambda: sub.status()[0].state is RankState.SYNCED and not sub.status()[0].replay_pending,
            10,
            "first contact over",
        )
        (link,) = _marks(sub)
        results: list[bool] = []
        done = threading.Event()

        def decide() -> None:
            link.hwm = 100_000  # small batches: a mark far above the open one
            link.rate_since, link.rate_read, link.reopen_due = 100.0, 0, False
            link.read_at = 100.0
            link._misfit(50, 101.0)  # 50 a second: a busy engine's steps
            results.append(link.reopen_due)
            link._misfit(800, 101.2)  # 4,000 a second: throttled at one message
            results.extend([link.reopen_due, link._may_reopen()])  # not in the middle of it
            link._misfit(1, 103.5)  # after a silence: now
            results.append(link._may_reopen())
            link.reopen_due = False
            done.set()

        loop = sub._loop
        assert loop is not None
        loop.call_soon_threadsafe(decide)
        assert done.wait(10)
        assert results == [False, True, False, True]


# --- the limit follows the router's rounds ------------------------------------------------


class _Waiter:
    """A rank with a request waiting for its turn (what ReplaySlots reads of a RankLink)."""

    def __init__(self, slots: Any, source: str) -> None:
        self.slots = slots
        self.worker_id = source
        self.closed = False
        self.queued: tuple[list[bytes], int] | None = None
        self.sent = False

    def ask(self) -> None:
        if not self.slots.take(self):
            self.queued = ([], 0)
            self.slots.wait(self)
        else:
            self.sent = True

    def send_queued(self) -> None:
        self.queued = None
        assert self.slots.take(self)
        self.sent = True


def test_the_request_limit_follows_the_rounds_of_reading() -> None:
    """Fast rounds with requests waiting raise the limit one a round (up to ``most``),
    each rise sending the oldest waiting request; a slow round takes a quarter off, and
    the requests out then finish before others go. A fixed limit never moves."""
    from kvwire.subscriber.env import ReplaySlots

    slots = ReplaySlots(4, 100, most=6, round_s=0.25)
    ranks = [_Waiter(slots, f"s{i % 3}") for i in range(10)]
    for r in ranks:
        r.ask()
    assert sum(r.sent for r in ranks) == 4 and slots.open == 4
    slots.round(0.2)  # neither fast nor slow: nothing moves
    assert slots.limit == 4
    slots.round(0.01)
    assert slots.limit == 5 and sum(r.sent for r in ranks) == 5
    for _ in range(5):
        slots.round(0.01)
    assert slots.limit == 6 and sum(r.sent for r in ranks) == 6  # at most ``most``
    slots.round(0.5)  # too slow: a quarter off, nothing more goes out
    assert slots.limit == 5 and slots.lowest == 4  # (it started at 4)
    for r in ranks[:2]:
        slots.release(r)  # 6 -> 4 open: one more may go (5)
    assert slots.open == 5 and sum(r.sent for r in ranks) == 7
    for _ in range(20):
        slots.round(1.0)
    assert slots.limit == 1  # never below one
    fixed = ReplaySlots(4, 100)
    assert not fixed.adaptive
    fixed.round(0.0)
    fixed.round(10.0)
    assert fixed.limit == 4
    # From the settings: max_requests fixes it, the default grows to max_replays.
    assert SubscriberConfig().request_ceiling() == SubscriberConfig().max_replays
    assert SubscriberConfig(max_requests=8).request_ceiling() == 8
    assert SubscriberConfig().round_s() == 0.25


def test_ranks_connect_while_earlier_ones_wait_for_their_replay() -> None:
    """First contacts bound the connections being made, not the replays: a rank whose
    replay is stuck (its engine takes the request and never answers) does not hold the
    next ranks' connections back (they used to wait for it to settle, or for 5 s)."""
    import zmq

    from kvwire.subscriber import EngineSource

    ctx = zmq.Context.instance()
    pub = ctx.socket(zmq.PUB)
    mute = ctx.socket(zmq.ROUTER)  # reads requests, answers none
    pub.bind("tcp://127.0.0.1:*")
    mute.bind("tcp://127.0.0.1:*")
    stuck = EngineSource(
        "stuck",
        pub.getsockopt_string(zmq.LAST_ENDPOINT),
        mute.getsockopt_string(zmq.LAST_ENDPOINT),
    )
    pubs = [EventPublisher(EPHEMERAL, EPHEMERAL, PublisherConfig()).start() for _ in range(3)]
    config = SubscriberConfig(max_replays=1, stream=StreamConfig(replay_timeout=30.0))
    try:
        sources = [stuck, bound_source("good", pubs)]
        with Subscriber(sources, BlockSetSink(), config=config) as sub:
            wait_for(lambda: all(s.connected for s in sub.status()), 4, "every rank connected")
            first = rank_status(sub.status(), "stuck", 0)
            assert first.replay_pending and first.state is RankState.SYNCING, first
    finally:
        for p in pubs:
            p.close()
        pub.close(0)
        mute.close(0)


def test_every_rank_is_announced_to_the_index_before_its_first_event() -> None:
    """A PrefixIndex learns each followed rank when its link opens (``add_rank``), so its
    holder sets widen while its tables are empty, not under a growing table as snapshots
    arrive; a sink without ``add_rank`` is left alone."""
    from kvwire.prefix_index import PrefixIndex

    pubs = [EventPublisher(EPHEMERAL, EPHEMERAL, PublisherConfig()).start() for _ in range(3)]
    try:
        index = PrefixIndex(4)
        assert index.stats().ranks == 0
        with Subscriber([bound_source("w", pubs)], index, config=fast()) as sub:
            wait_for(lambda: index.stats().ranks == 3, 10, "every rank announced")
            assert all(st.counters.batches == 0 for st in sub.status())  # nothing sent yet
            assert index.stats().blocks == 0
        with Subscriber([bound_source("w", pubs)], BlockSetSink(), config=fast()) as sub:
            wait_for(lambda: all(s.connected for s in sub.status()), 10, "connected")
    finally:
        for p in pubs:
            p.close()
