"""The parts a RankStream is made of: its position (SeqTracker) and its requests (Requests)."""

from __future__ import annotations

from kvwire.subscriber import RequestReplay, RequestSnapshot, StreamConfig
from kvwire.subscriber.recovery import Requests
from kvwire.subscriber.seq import SeqTracker
from kvwire.subscriber.stream import Phase

CFG = StreamConfig(
    backoff_initial=0.1, backoff_max=0.3, replay_retries=2, snapshot_backoff_max=0.8
)


def test_advance_moves_anchor_expected_and_horizon_together() -> None:
    t = SeqTracker(8)
    t.advance(0, b"a")
    assert (t.anchor_seq, t.anchor_payload, t.expected, t.horizon) == (0, b"a", 1, 1)
    t.see(5)
    t.advance(1, b"b")
    assert (t.expected, t.horizon, t.gap) == (2, 6, True)  # a horizon never comes down here


def test_skip_to_drops_what_is_held_below_and_remembers_the_loss() -> None:
    t = SeqTracker(8)
    t.held[3] = (None, b"xyz")
    t.held[6] = (None, b"q")
    assert t.skip_to(5) == 5 and t.expected == 5 and t.horizon == 5
    assert list(t.held) == [6] and t.held.nbytes == 1
    assert t.is_lost(4) and not t.is_lost(5)
    assert t.skip_to(5) == 0  # nothing below the expected seq is skipped twice
    assert t.lowest_held() == 6


def test_a_snapshot_lowers_a_horizon_seen_before_it_was_asked() -> None:
    """Seqs 1..4 were seen, then the snapshot says the publisher's next seq is 1."""
    t = SeqTracker(8)
    for seq in range(5):
        t.advance(seq, b"%d" % seq)
        t.last_live = seq
    t.held[7] = (None, b"h")  # seen before the snapshot was asked (horizon 8)
    t.rebase(1, known_before=8)
    assert (t.expected, t.horizon, t.last_live, len(t.held)) == (1, 1, 0, 0)
    assert t.anchor_seq == -1 and t.is_lost(0) and not t.is_lost(1)


def test_a_snapshot_keeps_what_was_seen_after_it_was_asked() -> None:
    t = SeqTracker(8)
    t.see(2)  # horizon 3 when the snapshot is asked
    t.held[5] = (None, b"h")  # published while it was served
    t.see(5)
    t.rebase(4, known_before=3)
    assert (t.expected, t.horizon, list(t.held)) == (4, 6, [5])


def test_a_fresh_request_follows_an_abandoned_one() -> None:
    req = Requests(Phase.REPLAYING)
    r, first = req.replay(Phase.REPLAYING, 3, None, 0.0, CFG, 5)
    assert first == RequestReplay(3, 1, False) and req.active is r and r.horizon_at_send == 5
    req.abandon()
    _, second = req.replay(Phase.PROBING, 4, b"anchor", 0.0, CFG, 5)
    assert second == RequestReplay(4, 2, True)
    req.answered()
    assert req.active is None and req.snapshot(0.0, CFG, 5) == RequestSnapshot(3, False)


def test_replay_retries_back_off_and_run_out() -> None:
    req = Requests(Phase.REPLAYING)
    assert req.backoff(1.0, CFG, Phase.STARTING) and req.retry_at == 1.1
    assert req.resume is Phase.STARTING
    assert req.backoff(2.0, CFG, Phase.REPLAYING) and req.retry_at == 2.2
    assert not req.backoff(3.0, CFG, Phase.REPLAYING)


def test_every_snapshot_counts_until_the_rank_is_synced() -> None:
    req = Requests(Phase.REPLAYING)
    assert req.snapshot_allowed(0.0)
    req.snapshot(0.0, CFG, 0)
    req.snapshot_ended(0.5, CFG)  # applied, but the rank did not end in sequence
    assert not req.snapshot_allowed(0.55) and req.snapshot_allowed(0.6)
    req.snapshot(0.6, CFG, 0)
    req.snapshot_ended(0.7, CFG)  # the wait doubles ...
    assert not req.snapshot_allowed(0.85) and req.snapshot_allowed(0.9)
    for _ in range(10_000):  # ... up to snapshot_backoff_max, and never runs out
        req.snapshot(0.0, CFG, 0)
        req.snapshot_ended(10.0, CFG)
    assert not req.snapshot_allowed(10.75) and req.snapshot_allowed(10.8)
    req.recovered()
    req.snapshot(11.0, CFG, 0)
    req.snapshot_ended(11.0, CFG)  # the backoff starts over
    assert req.snapshot_allowed(11.1)
