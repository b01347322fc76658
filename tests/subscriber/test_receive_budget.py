"""The receive path bounded in bytes: the derived marks, and a tiny bound that still ends exact."""

from __future__ import annotations

import threading

import msgspec
import pytest

from kvwire.publisher import EventPublisher, PublisherConfig
from kvwire.subscriber import BlockSetSink, RankState, Subscriber, SubscriberConfig
from kvwire.subscriber.config import QUEUE_SLACK
from kvwire.wire import KVEventBatch
from tests.subscriber.helpers import EPHEMERAL, Engine, bound_source, fast, rank_status, settled
from tests.waiting import wait_for


@pytest.mark.parametrize("budget", [1, 1 << 20, 256 << 20, 4 << 30])
@pytest.mark.parametrize("ranks", [1, 16, 1024, 4096])
@pytest.mark.parametrize("batch_bytes", [1, 2_000, 64 << 10, 1 << 20, 1_700_000, 64 << 20])
def test_the_derived_marks_keep_every_rank_within_its_share(
    budget: int, ranks: int, batch_bytes: int
) -> None:
    config = SubscriberConfig(receive_budget_bytes=budget)
    share = config.rank_share(ranks)
    # The shares of every live queue, every open replay queue and one burst fit the budget.
    assert share * (ranks + min(ranks, config.max_replays) + 1) <= budget
    mark = config.rank_hwm(ranks, batch_bytes)
    assert 1 <= mark <= config.hwm
    # A socket holds its mark and the slack: within the share, unless one batch is all it
    # may hold (then the mark is the floor, 1).
    assert (mark + QUEUE_SLACK) * batch_bytes <= share or mark == 1
    # The mark is the largest that fits: one more would exceed the share (or the message cap).
    assert mark == config.hwm or (mark + 1 + QUEUE_SLACK) * batch_bytes > share
    chunk = config.read_chunk(ranks, batch_bytes, 256)
    assert 1 <= chunk <= 256
    assert chunk * batch_bytes <= share or chunk == 1


def test_small_batches_keep_the_message_mark() -> None:
    """The byte bound only lowers the mark for large batches: small ones keep ``hwm``."""
    config = SubscriberConfig(hwm=1000)
    assert config.rank_hwm(16, 200) == 1000
    assert config.rank_hwm(16, 1_700_000) < 10
    assert config.rank_hwm(16, 1_700_000) < config.rank_hwm(16, 200_000)


def test_the_budget_is_a_setting_with_the_same_checks_from_data() -> None:
    config = msgspec.convert({"receive_budget_bytes": 1 << 20}, SubscriberConfig)
    assert config.receive_budget_bytes == 1 << 20
    with pytest.raises(ValueError, match="receive_budget_bytes=0 is refused: expected an integer >= 1"):
        SubscriberConfig(receive_budget_bytes=0)
    with pytest.raises(msgspec.ValidationError, match="receive_budget_bytes"):
        msgspec.convert({"receive_budget_bytes": 0}, SubscriberConfig)


class HeldSink(BlockSetSink):
    """A sink whose first apply after ``hold`` waits until ``release``: the router stops reading."""

    def __init__(self) -> None:
        super().__init__()
        self.armed = False
        self.holding = threading.Event()
        self.released = threading.Event()

    def apply(self, worker_id: str, rank: int, batch: KVEventBatch) -> None:
        if self.armed:
            self.armed = False
            self.holding.set()
            self.released.wait(30)
        super().apply(worker_id, rank, batch)


def test_a_tiny_receive_bound_ends_exact_after_a_burst() -> None:
    """A router that may hold almost nothing, stalled while a burst of large batches comes.

    Its socket holds one batch; the publisher's queue (4 messages) drops the rest of
    the burst: gaps, which the rank repairs by replay. Nothing is silently lost.
    """
    config = PublisherConfig(hwm=4, buffer_steps=1024, snapshot=False)
    with EventPublisher(EPHEMERAL, EPHEMERAL, config) as pub:
        engine = Engine(seed=7)
        sink = HeldSink()
        sub_config = fast(receive_budget_bytes=1)
        assert sub_config.rank_hwm(1, 1) == 1
        with Subscriber([bound_source("w", [pub])], sink, config=sub_config) as sub:
            engine.publish(pub, 3)
            wait_for(lambda: settled(sub.status(), "w", 0, 3), 10, "the first batches")
            sink.armed = True
            engine.publish(pub, 1)
            assert sink.holding.wait(10), "the router never applied the held batch"
            # ~64 KB a batch, 400 of them: far more than the sockets' buffers hold.
            engine.publish(pub, 400, blocks=3000)
            wait_for(lambda: pub.queue_depth == 0, 30, "the burst to be sent")
            sink.released.set()
            # At or past 404: a heartbeat may take the next seq before the predicate is read.
            wait_for(
                lambda: (
                    rank_status(sub.status(), "w", 0).expected_seq >= 404
                    and rank_status(sub.status(), "w", 0).state is RankState.SYNCED
                    and sink.blocks("w", 0) == engine.truth
                ),
                60,
                "the burst to be repaired",
            )
            st = rank_status(sub.status(), "w", 0)
            assert st.state is RankState.SYNCED, st
            assert st.counters.gaps >= 1, st.counters  # the bound did drop live batches
            assert st.counters.replayed >= 1, st.counters
            assert st.counters.resyncs == 0, st.counters
            assert sink.blocks("w", 0) == engine.truth
