"""RankStream across publisher lives: old-life messages read after a restart was seen,
restarts that keep their epoch, and a horizon above the publisher's next seq.

A restart seen on the replay socket must move the epoch, its topic and the position
together, or a late live message of the old life reads as the next batch. A horizon
no recovery can reach (a seq seen under the followed epoch that the publisher no
longer has) must not turn into a loop of snapshots and replays that floods the engine.
"""

from __future__ import annotations

import itertools

import pytest

from kvwire.subscriber import RankState, RequestReplay, RequestSnapshot, StreamConfig
from kvwire.wire import (
    epoch_topic,
    format_epoch,
    replay_end_frames,
    replay_item_frames,
    snapshot_end_frames,
)
from tests.subscriber.sim import Harness, PublisherKind
from tests.subscriber.test_stream_faults import CFG, Rank, chunk, epoch, first_contact, store


def test_a_restart_seen_in_a_replay_reply_retires_the_old_lifes_topic() -> None:
    """Life A's batch 1 arrives after life B's history was replayed: it is not B's batch 1."""
    a, b = epoch(1), epoch(2)
    r = Rank()
    first_contact(r, a)
    r.live(a, 0, store(0, 100), 0.1)
    r.live(a, 2, store(2, 102), 0.2)  # 1 missing: a gap replay from the anchor 0
    assert r.last.start_seq == 0
    r.reply(replay_item_frames(b, 0, store(0, 200)), 0.3)  # the replay socket reaches life B
    assert r.s.counters.restarts == 1 and r.last.start_seq == 0  # B's history asked
    r.reply(replay_item_frames(b, 0, store(0, 200)), 0.4)
    r.reply(replay_end_frames(b), 0.4)
    assert r.s.state is RankState.SYNCED and r.blocks == {200}
    r.live(a, 1, store(1, 101), 0.5)  # late, from life A: never applied
    assert r.blocks == {200} and r.s.expected_seq == 1
    assert r.s.counters.old_life == 1 and r.s.counters.restarts == 1
    r.live(b, 1, store(1, 201), 0.6)  # B goes on, on the fast path
    assert r.s.state is RankState.SYNCED and r.blocks == {200, 201}


def test_without_replay_a_late_message_of_the_old_life_is_a_restart_never_a_mix() -> None:
    """Seen live, an epoch change retires nothing (only a reply shows which life is current):
    the old life's late batch is a restart back to it, then the new life's next one is too."""
    a, b = epoch(1), epoch(2)
    r = Rank(StreamConfig(replay=False))
    r.run(r.s.connected(0.0))
    r.live(a, 0, store(0, 100), 0.1)
    r.live(b, 0, store(0, 200), 0.2)
    assert r.blocks == {200} and r.s.state is RankState.SYNCED
    r.live(a, 1, store(1, 101), 0.3)
    assert r.blocks == {101} and r.s.state is RankState.PARTIAL  # 0 of "life A" was not seen
    r.live(b, 1, store(1, 201), 0.4)
    assert r.blocks == {201} and r.s.state is RankState.PARTIAL
    assert r.s.counters.restarts == 3 and r.s.counters.old_life == 0


def _run_for(h: Harness, seconds: float, step: float = 0.001) -> None:
    """Everything the network and publisher do, promptly, for ``seconds`` of sim time."""
    end = h.now + seconds
    while h.now < end:
        h.deliver_live(len(h.pipe))
        h.serve(len(h.requests))
        h.deliver_replies(len(h.replies))
        h.tick(step)


@pytest.mark.parametrize("heartbeat", [None, 0.5])
def test_a_same_epoch_restart_does_not_flood_the_publisher(heartbeat: float | None) -> None:
    """The stream saw batches 0..4; the publisher restarts under its epoch and is at 1.

    The reconnect replay from the anchor comes back empty although batch 4 was
    seen: the view is lost and a snapshot asked. The snapshot proves the
    publisher's next seq is 1, so 1..4 are not this publisher's any more: the
    horizon comes down to it and the replay that follows settles the rank.
    """
    kind = PublisherKind(epoch=True, snapshot=True, heartbeat=heartbeat)
    h = Harness(CFG, kind=kind)
    h.connect()
    h.settle()
    for _ in range(5):
        h.publish("store", "deliver")
    _run_for(h, 0.1)
    assert h.stream.expected_seq == h.pub.seq >= 5 and h.stream.state is RankState.SYNCED
    h.restart(same_epoch=True)
    h.publish("store", "deliver")  # dropped: the subscriber is not connected yet
    h.connect()
    c = h.stream.counters
    before = (c.snapshots_requested, c.replays_requested + c.probes)
    _run_for(h, 2.0)
    snapshots = c.snapshots_requested - before[0]
    replays = c.replays_requested + c.probes - before[1]
    assert snapshots <= 2 and replays <= 6, (snapshots, replays, h.stream.reason)
    h.settle()
    h.check_settled()
    # Idle without heartbeats, kvwire's publisher cannot prove its tail: STALE, exact as of
    # the last batch; with heartbeats, SYNCED.
    assert h.stream.state is (RankState.SYNCED if heartbeat else RankState.STALE)
    assert h.sink.blocks == h.pub.truth


def test_every_recovery_that_does_not_end_following_counts_toward_the_backoff() -> None:
    """Each snapshot applies, but the replay after it never holds what live shows: the
    snapshots are spaced by the backoff, doubling up to ``snapshot_backoff_max``."""
    topic = epoch(1, snap=True)
    cfg = StreamConfig(
        backoff_initial=0.1, backoff_max=0.4, snapshot_backoff_max=0.4, idle_probe=None
    )
    r = Rank(cfg)
    first_contact(r, topic)
    r.live(topic, 0, store(0), 0.0)
    r.live(topic, 2, store(2), 0.0)  # 1 lost ...
    r.reply(replay_end_frames(topic), 0.0)  # ... for good: PARTIAL, a snapshot asked
    asked: list[float] = []
    now = 0.0
    while now < 2.0:
        if isinstance(r.last, RequestSnapshot) and r.s.replay_pending:
            asked.append(now)
            e = r.s.expected_seq
            r.live(topic, e + 2, store(e + 2), now)  # published while the snapshot is served
            r.reply(chunk(topic, e, 0, 1), now)
            r.reply(snapshot_end_frames(topic, e, 1), now)
            assert isinstance(r.last, RequestReplay) and r.last.start_seq == e
            r.reply(replay_end_frames(topic), now)  # the buffer does not hold e + 1
        now = round(now + 0.01, 2)
        r.tick(now)
    assert r.s.counters.snapshots_applied == len(asked) == 7, asked  # 0 .1 .3 .7 1.1 1.5 1.9
    spacing = [b - a for a, b in itertools.pairwise(asked)]
    assert [round(x, 1) for x in spacing] == [0.1, 0.2, 0.4, 0.4, 0.4, 0.4], spacing
    assert r.s.state is RankState.PARTIAL


def test_a_retired_life_the_replay_socket_shows_again_is_followed_again() -> None:
    """Retiring is the replay socket's word, and it may take it back: a reply from a
    process still bound under life A (a proxy that reached B first) makes A current."""
    a, b = epoch(1), epoch(2)
    r = Rank()
    first_contact(r, a)
    r.live(a, 0, store(0, 100), 0.1)
    r.live(a, 2, store(2, 102), 0.2)
    r.reply(replay_item_frames(b, 0, store(0, 200)), 0.3)  # A retired
    r.reply(replay_end_frames(b), 0.4)  # B's history: empty
    r.live(a, 3, store(3, 103), 0.5)
    assert r.s.counters.old_life == 1 and r.blocks == set()
    r.run(r.s.disconnected(0.6))
    r.run(r.s.connected(0.7))
    # A after all (its replay socket names the topic its own way): a restart back.
    a_reply = epoch_topic(b"kv-replay", format_epoch(1, heartbeat_s=None, snapshot=False))
    r.reply(replay_item_frames(a_reply, 0, store(0, 100)), 0.8)
    assert r.s.counters.restarts == 2
    for seq in range(4):
        r.reply(replay_item_frames(a_reply, seq, store(seq, 100 + seq)), 0.9)
    r.reply(replay_end_frames(a_reply), 0.9)
    r.live(a, 4, store(4, 104), 1.0)  # A's live topic: followed, not dropped
    assert r.s.state is RankState.SYNCED and r.blocks == {100, 101, 102, 103, 104}
    assert r.s.counters.old_life == 1
