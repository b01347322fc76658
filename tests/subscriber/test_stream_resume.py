"""RankStream.position() and resume(): a router that restarts from a checkpoint, or a
replica cloned from a peer, goes on from where the view was exact.

The resumed stream's first connect is a reconnect: an anchored replay proves the
publisher is the one whose batches built the view (the anchor byte for byte) and
fills the gap; every other case follows the reconnect rules, clearing as they do.
"""

from __future__ import annotations

import msgspec
import pytest

from kvwire.subscriber import (
    RankState,
    RequestReplay,
    RequestSnapshot,
    StreamConfig,
    StreamPosition,
)
from kvwire.subscriber.stream import Phase
from kvwire.wire import decode_batch, pack_seq, replay_end_frames, replay_item_frames
from tests.subscriber.sim import Harness, PublisherKind
from tests.subscriber.test_stream_faults import CFG, TOPIC, Rank, epoch, first_contact, store


def _followed(topic: bytes, n: int) -> Rank:
    """A rank that followed batches 0..n-1 of ``topic`` and is SYNCED."""
    r = Rank()
    first_contact(r, topic)
    for seq in range(n):
        r.live(topic, seq, store(seq), 0.1 + seq / 100)
    assert r.s.state is RankState.SYNCED
    return r


def _resumed(old: Rank, config: StreamConfig = CFG) -> Rank:
    """A new rank started from ``old``'s position, its sink loaded with ``old``'s view."""
    pos = old.s.position()
    assert pos is not None
    pos = msgspec.msgpack.decode(msgspec.msgpack.encode(pos), type=StreamPosition)  # a file
    r = Rank(config)
    r.s.resume(pos)
    for h in old.blocks:
        r.sink.apply("w", 0, decode_batch(store(0, h)))
    assert r.blocks == old.blocks
    return r


@pytest.mark.parametrize("topic", [TOPIC, epoch(1)], ids=["no-epoch", "epoch"])
def test_a_resumed_stream_replays_the_gap_from_its_anchor_and_is_synced(topic: bytes) -> None:
    old = _followed(topic, 3)  # 0, 1, 2 applied; the router stops
    pos = old.s.position()
    assert pos is not None and (pos.next_seq, pos.anchor_seq) == (3, 2)
    assert pos.anchor == store(2) and pos.topic == topic
    r = _resumed(old)
    assert r.s.state is RankState.SYNCING and r.s.expected_seq == 3
    r.run(r.s.connected(10.0))
    assert isinstance(r.last, RequestReplay) and r.last.start_seq == 2  # anchored
    for seq in range(2, 6):  # the buffer still holds the anchor: 3..5 were missed
        r.reply(replay_item_frames(topic, seq, store(seq)), 10.1)
    r.reply(replay_end_frames(topic), 10.1)
    assert r.last.start_seq == 5  # a probe past a per-request cap, from the new anchor
    r.reply(replay_item_frames(topic, 5, store(5)), 10.1)
    r.reply(replay_end_frames(topic), 10.1)
    assert r.s.state is RankState.SYNCED and r.s.phase is Phase.FOLLOWING
    assert r.applied == [3, 4, 5] and r.clears == []
    assert r.blocks == {0, 1, 2, 3, 4, 5}
    r.live(topic, 6, store(6), 10.2)  # and live goes on from there
    assert r.applied == [3, 4, 5, 6] and r.s.state is RankState.SYNCED
    assert r.s.counters.reconnects == 0 and r.s.counters.resyncs == 0


@pytest.mark.parametrize("snap", [False, True], ids=["partial", "snapshot"])
def test_a_resumed_stream_whose_anchor_left_the_buffer_is_partial_or_asks_a_snapshot(
    snap: bool,
) -> None:
    topic = epoch(1, snap=snap)
    old = _followed(topic, 3)
    r = _resumed(old)
    r.run(r.s.connected(10.0))
    assert r.last.start_seq == 2
    for seq in range(5, 8):  # 2 (the anchor), 3 and 4 are gone from the buffer
        r.reply(replay_item_frames(topic, seq, store(seq)), 10.1)
    r.reply(replay_end_frames(topic), 10.1)
    assert r.clears, "the loaded view was kept although its continuity is unproven"
    if snap:
        assert isinstance(r.last, RequestSnapshot)
        assert r.s.phase is Phase.SNAPSHOTTING
    else:
        assert r.s.state is RankState.PARTIAL
        assert r.blocks == {5, 6, 7} and r.s.expected_seq == 8


def test_a_resumed_stream_that_meets_a_new_epoch_clears_and_takes_the_new_history() -> None:
    a, b = epoch(1), epoch(2)
    old = _followed(a, 3)
    r = _resumed(old)
    r.run(r.s.connected(10.0))
    r.reply(replay_item_frames(b, 0, store(0, 500)), 10.1)  # the publisher restarted
    assert r.s.counters.restarts == 1 and r.clears and r.blocks == set()
    assert isinstance(r.last, RequestReplay) and r.last.start_seq == 0
    r.reply(replay_item_frames(b, 0, store(0, 500)), 10.2)
    r.reply(replay_item_frames(b, 1, store(1, 501)), 10.2)
    r.reply(replay_end_frames(b), 10.2)
    assert r.s.state is RankState.SYNCED and r.blocks == {500, 501}
    r.live(a, 3, store(3), 10.3)  # a late message of the old life: never applied
    assert r.blocks == {500, 501} and r.s.counters.old_life == 1


def test_a_resumed_stream_without_replay_endpoint_follows_the_reconnect_rules() -> None:
    cfg = StreamConfig(replay=False)
    old = Rank(cfg)
    old.run(old.s.connected(0.0))
    for seq in range(3):
        old.live(TOPIC, seq, store(seq), 0.1)
    r = _resumed(old, cfg)
    r.run(r.s.connected(1.0))
    assert r.s.phase is Phase.AWAIT_LIVE
    r.live(TOPIC, 3, store(3), 1.1)  # the next batch: nothing was missed
    assert r.s.state is RankState.SYNCED and r.blocks == {0, 1, 2, 3} and r.clears == []
    r2 = _resumed(old, cfg)
    r2.run(r2.s.connected(1.0))
    r2.live(TOPIC, 5, store(5), 1.1)  # 3 and 4 were missed
    assert r2.s.state is RankState.PARTIAL and r2.clears and r2.blocks == {5}


def test_resume_is_refused_once_the_stream_was_connected() -> None:
    pos = StreamPosition(topic=TOPIC, epoch=None, next_seq=3, anchor_seq=2, anchor=store(2))
    r = Rank()
    r.s.resume(pos)  # before the first connect: fine
    r.run(r.s.connected(0.0))
    with pytest.raises(ValueError, match="first connect"):
        r.s.resume(pos)
    r.run(r.s.disconnected(1.0))
    with pytest.raises(ValueError, match="first connect"):
        r.s.resume(pos)  # disconnected again, but it was connected
    early = Rank()
    early.run(early.s.live([TOPIC, pack_seq(0), store(0)], 0.0))  # data before the event
    with pytest.raises(ValueError):
        early.s.resume(pos)
    with pytest.raises(ValueError):
        StreamPosition(topic=TOPIC, epoch=None, next_seq=3, anchor_seq=3, anchor=b"")


def test_a_rank_has_a_position_only_while_exact_and_in_sequence() -> None:
    r = Rank()
    assert r.s.position() is None  # never connected
    first_contact(r, TOPIC)
    r.live(TOPIC, 0, store(0), 0.1)
    assert r.s.position() is not None
    r.live(TOPIC, 2, store(2), 0.2)  # 1 missing: held, a replay out
    assert r.s.position() is None
    r.reply(replay_item_frames(TOPIC, 0, store(0)), 0.3)
    r.reply(replay_item_frames(TOPIC, 1, store(1)), 0.3)
    r.reply(replay_item_frames(TOPIC, 2, store(2)), 0.3)
    r.reply(replay_end_frames(TOPIC), 0.3)
    assert r.s.state is RankState.SYNCED
    pos = r.s.position()
    assert pos is not None and pos.next_seq == 3
    r.run(r.s.disconnected(0.4))
    assert r.s.position() is None


@pytest.mark.parametrize(
    "kind",
    [PublisherKind(), PublisherKind(epoch=True, heartbeat=0.5, snapshot=True)],
    ids=["engine", "kvwire"],
)
def test_a_router_resumed_from_a_checkpoint_applies_the_same_sequence_as_one_that_never_stopped(
    kind: PublisherKind,
) -> None:
    """The log of applies since the last clear runs unbroken across the resume."""
    h = Harness(CFG, buffer_steps=50, seed=7, kind=kind)
    h.connect()
    h.settle()
    for _ in range(5):
        h.publish("store", "deliver")
    h.settle()
    assert h.stream.state is RankState.SYNCED
    h.resume()  # a checkpoint, then a new router
    for fate in ["deliver", "lose", "deliver", "deliver", "lose"]:
        h.publish("store", fate)  # some while it was down
    h.settle()
    h.check_settled()
    assert h.stream.state is RankState.SYNCED
    assert [s for s, _ in h.sink.since_clear] == list(range(h.pub.seq))
    assert h.sink.clears == []
