"""RankStream rule by rule, fed plain frames: fixtures, gaps, replays, restarts, time."""

from __future__ import annotations

from typing import Any

import pytest

from kvwire.subscriber import (
    Action,
    Apply,
    BlockSetSink,
    ClearRank,
    LossPolicy,
    RankState,
    RankStream,
    RequestReplay,
    StateChanged,
    StreamConfig,
)
from kvwire.wire import (
    AllBlocksCleared,
    BlockStored,
    KVEventBatch,
    decode_batch,
    encode_batch,
    pack_seq,
    parse_live,
    replay_end_frames,
    replay_item_frames,
)
from tests.conftest import hex_frames

TOPIC = b"kv"


def batch(seq: int, life: int = 0, *, clear: bool = False, rank: int | None = 0) -> bytes:
    events: list[Any] = [
        BlockStored(
            block_hashes=[life * 1000 + seq],
            parent_block_hash=None,
            token_ids=[1] * 4,
            block_size=4,
        )
    ]
    if clear:
        events.insert(0, AllBlocksCleared())
    return encode_batch(KVEventBatch(float(life * 1000 + seq), events, rank))


def live(seq: int, life: int = 0, **kw: Any) -> list[bytes]:
    return [TOPIC, pack_seq(seq), batch(seq, life, **kw)]


def reply(seq: int, life: int = 0, **kw: Any) -> list[bytes]:
    return replay_item_frames(TOPIC, seq, batch(seq, life, **kw))


def applied(actions: list[Action]) -> list[int]:
    return [a.seq for a in actions if isinstance(a, Apply)]


def requests(actions: list[Action]) -> list[RequestReplay]:
    return [a for a in actions if isinstance(a, RequestReplay)]


def clears(actions: list[Action]) -> list[str]:
    return [a.reason for a in actions if isinstance(a, ClearRank)]


CFG = StreamConfig(
    replay_timeout=1.0, replay_retries=2, backoff_initial=0.1, backoff_max=0.4, idle_probe=5.0
)


def synced_stream(n: int, config: StreamConfig = CFG) -> RankStream:
    """A stream that made first contact (empty history) and applied batches 0..n-1 live."""
    s = RankStream(0, config)
    (req,) = requests(s.connected(0.0))
    assert req.start_seq == 0
    s.replay_reply(replay_end_frames(), req.token, 0.0)
    for seq in range(n):
        assert applied(s.live(live(seq), 0.0)) == [seq]
    assert s.state is RankState.SYNCED
    return s


# --- fixtures ---------------------------------------------------------------------------


def test_every_fixture_streams_through_live_and_replay(wire_fixture: dict[str, Any]) -> None:
    """Live frames of a capture, minus some; the capture's replay reply fills the hole."""
    start = wire_fixture["replay_request_start_seq"]
    messages = [hex_frames(m) for m in wire_fixture["live"]]
    sink = BlockSetSink()
    got: list[tuple[int, KVEventBatch]] = []

    def run(actions: list[Action]) -> None:
        for a in actions:
            if isinstance(a, Apply):
                got.append((a.seq, a.batch))
                sink.apply("w", 0, a.batch)
            elif isinstance(a, ClearRank):
                sink.clear("w", 0)

    s = RankStream(0, CFG)
    first = requests(s.connected(0.0))[0]
    s.replay_reply(replay_end_frames(), first.token, 0.0)  # nothing buffered yet
    for m in messages[:start]:
        run(s.live(m, 0.0))
    # Batches start.. are lost on the way, then the last one arrives: a gap.
    actions = s.live(messages[-1], 0.1)
    (req,) = requests(actions)
    assert s.state is RankState.SYNCING and s.held == 1
    assert req.start_seq == start - 1  # anchored on the last batch applied
    anchor = [b"", *hex_frames([m for m in wire_fixture["live"][start - 1]])]
    run(s.replay_reply(anchor, req.token, 0.2))
    for m in wire_fixture["replay_reply_via_dealer"]:
        run(s.replay_reply(hex_frames(m), req.token, 0.2))

    assert [seq for seq, _ in got] == [b["seq"] for b in wire_fixture["expected_batches"]]
    for (seq, b), m in zip(got, messages, strict=True):
        assert b == decode_batch(parse_live(m).payload), seq
    assert s.state is RankState.SYNCED
    assert sink.blocks("w", 0) == set(wire_fixture["expected_final_blocks"])
    c = s.counters
    assert (c.gaps, c.decode_errors, c.seqs_lost, c.replays_succeeded) == (1, 0, 0, 2)


def test_every_fixture_replays_a_late_joiners_history(wire_fixture: dict[str, Any]) -> None:
    """A subscriber that joins after the capture: history from the reply, PARTIAL if it starts late."""
    s = RankStream(0, CFG)
    (req,) = requests(s.connected(0.0))
    out: list[Action] = []
    for m in wire_fixture["replay_reply_via_dealer"]:
        out += s.replay_reply(hex_frames(m), req.token, 0.0)
    start = wire_fixture["replay_request_start_seq"]
    assert applied(out) == [b["seq"] for b in wire_fixture["expected_batches"] if b["seq"] >= start]
    assert not clears(out), "nothing was applied, so there is nothing to clear"
    assert s.counters.seqs_lost == start
    states = [a.new for a in out if isinstance(a, StateChanged)]
    # Incomplete from the start, until the engine's AllBlocksCleared made it exact.
    assert states[0] is RankState.PARTIAL and states[-1] is RankState.SYNCED
    sink = BlockSetSink()
    for a in out:
        if isinstance(a, Apply):
            sink.apply("w", 0, a.batch)
    assert sink.blocks("w", 0) == set(wire_fixture["expected_final_blocks"])


# --- live ----------------------------------------------------------------------------------


def test_in_order_live_batches_apply_one_each() -> None:
    s = synced_stream(0)
    for seq in range(5):
        actions = s.live(live(seq), 1.0)
        assert len(actions) == 1 and isinstance(actions[0], Apply) and actions[0].seq == seq
    assert s.expected_seq == 5
    assert s.counters.batches == 5 and s.counters.events == 5


def test_gap_is_repaired_in_order_and_replayed_below_expected_is_ignored() -> None:
    s = synced_stream(3)
    actions = s.live(live(5), 1.0)
    (req,) = requests(actions)
    assert req.start_seq == 2 and not req.fresh
    assert applied(s.live(live(6), 1.0)) == []
    out: list[Action] = []
    for seq in range(2, 8):
        out += s.replay_reply(reply(seq), req.token, 1.1)
    out += s.replay_reply(replay_end_frames(), req.token, 1.1)
    assert applied(out) == [3, 4, 5, 6, 7]
    assert s.state is RankState.SYNCED and s.held == 0
    # The live copy of 7 arrives late: a duplicate, not a restart.
    assert s.live(live(7), 1.2) == []
    assert s.counters.duplicates == 1 and s.counters.restarts == 0
    assert applied(s.live(live(8), 1.3)) == [8]


def test_replay_starting_above_expected_clears_and_marks_partial() -> None:
    s = synced_stream(3)
    (req,) = requests(s.live(live(9), 1.0))
    out = s.replay_reply(reply(6), req.token, 1.1)  # anchor 2 and 3..5 evicted
    for seq in range(7, 10):
        out += s.replay_reply(reply(seq), req.token, 1.1)
    out += s.replay_reply(replay_end_frames(), req.token, 1.1)
    assert clears(out) and applied(out) == [6, 7, 8, 9]
    assert s.state is RankState.PARTIAL
    assert s.counters.seqs_lost == 3 and s.counters.resyncs == 1


def test_keep_policy_marks_partial_without_clearing() -> None:
    s = synced_stream(3, StreamConfig(loss_policy=LossPolicy.KEEP))
    (req,) = requests(s.live(live(9), 1.0))
    out = s.replay_reply(reply(9), req.token, 1.1) + s.replay_reply(
        replay_end_frames(), req.token, 1.1
    )
    assert not clears(out) and applied(out) == [9]
    assert s.state is RankState.PARTIAL


def test_without_replay_a_gap_is_lost_at_once() -> None:
    s = RankStream(0, StreamConfig(replay=False))
    assert requests(s.connected(0.0)) == []
    assert applied(s.live(live(0), 0.0)) == [0]
    out = s.live(live(4), 0.1)
    assert clears(out) and applied(out) == [4] and s.state is RankState.PARTIAL
    assert s.counters.seqs_lost == 3


def test_first_contact_without_replay_decides_on_the_first_batch() -> None:
    s = RankStream(0, StreamConfig(replay=False))
    s.connected(0.0)
    assert s.state is RankState.SYNCING
    s.live(live(0), 0.0)
    assert s.state is RankState.SYNCED
    late = RankStream(0, StreamConfig(replay=False))
    late.connected(0.0)
    late.live(live(7), 0.0)
    assert late.state is RankState.PARTIAL


def test_all_blocks_cleared_makes_a_partial_rank_exact_again() -> None:
    s = RankStream(0, StreamConfig(replay=False))
    s.connected(0.0)
    s.live(live(3), 0.0)
    assert s.state is RankState.PARTIAL
    out = s.live(live(4, clear=True), 0.1)
    assert applied(out) == [4]
    assert [a.new for a in out if isinstance(a, StateChanged)] == [RankState.SYNCED]


def test_held_buffer_overflow_is_a_loss() -> None:
    s = synced_stream(1, StreamConfig(max_held=3))
    out: list[Action] = []
    for seq in range(3, 8):
        out += s.live(live(seq), 1.0)
    assert clears(out) and applied(out) == [3, 4, 5, 6, 7]
    assert s.counters.held_overflows == 1 and s.state is RankState.PARTIAL


def test_held_buffer_is_bounded_in_bytes_too() -> None:
    size = len(live(3)[2])
    s = synced_stream(1, StreamConfig(max_held_bytes=3 * size))
    out: list[Action] = []
    for seq in range(3, 6):
        out += s.live(live(seq), 1.0)
    assert not clears(out) and s.held == 3  # at the bound: still waiting for the replay
    out = s.live(live(6), 1.0)
    assert clears(out) and applied(out) == [3, 4, 5, 6]
    assert s.counters.held_overflows == 1 and s.state is RankState.PARTIAL and s.held == 0


def test_decode_limits_come_from_the_config() -> None:
    from kvwire.wire.codec import DecodeLimits

    s = synced_stream(1, StreamConfig(decode_limits=DecodeLimits(max_block_size=4)))
    big = KVEventBatch(1.0, [BlockStored([9], None, [1] * 8, 8)], 0)
    s.live([TOPIC, pack_seq(1), encode_batch(big)], 1.0)
    assert s.counters.decode_errors == 1 and s.expected_seq == 1


# --- restarts -------------------------------------------------------------------------------


def test_live_seq_going_back_is_a_restart_and_history_is_replayed() -> None:
    s = synced_stream(5)
    out = s.live(live(2, life=1), 1.0)
    assert clears(out) and s.counters.restarts == 1
    (req,) = requests(out)
    assert req.start_seq == 0 and req.fresh is False
    out = []
    for seq in range(3):
        out += s.replay_reply(reply(seq, life=1), req.token, 1.1)
    out += s.replay_reply(replay_end_frames(), req.token, 1.1)
    assert applied(out) == [0, 1, 2]
    assert s.state is RankState.SYNCED


def test_restarted_publisher_whose_history_is_gone_is_partial() -> None:
    s = synced_stream(5)
    (req,) = requests(s.live(live(3, life=1), 1.0))
    out = s.replay_reply(reply(2, life=1), req.token, 1.1)
    out += s.replay_reply(reply(3, life=1), req.token, 1.1)
    out += s.replay_reply(replay_end_frames(), req.token, 1.1)
    assert applied(out) == [2, 3] and s.state is RankState.PARTIAL


def test_reconnect_to_a_restarted_publisher_is_caught_by_the_anchor() -> None:
    """The new life already published past our position: seqs alone would not show it."""
    s = synced_stream(3)
    s.disconnected(1.0)
    assert s.state is RankState.SYNCING
    (req,) = requests(s.connected(1.5))
    assert req.start_seq == 2 and req.fresh is False
    out = s.replay_reply(reply(2, life=1), req.token, 1.6)  # same seq, other content
    assert clears(out) and s.counters.restarts == 1
    (history,) = requests(out)
    assert history.start_seq == 0 and history.fresh  # the old reply may still be coming
    out = []
    for seq in range(6):
        out += s.replay_reply(reply(seq, life=1), history.token, 1.7)
    out += s.replay_reply(replay_end_frames(), history.token, 1.7)
    assert applied(out) == list(range(6)) and s.state is RankState.SYNCED
    # The abandoned request's frames are ignored.
    assert s.replay_reply(reply(3), req.token, 1.8) == []
    assert s.counters.stale_replies == 1


def test_reconnect_with_an_empty_reply_asks_for_the_whole_buffer() -> None:
    """A buffer always holds the latest batch: one that ends below the anchor is a new life."""
    s = synced_stream(3)
    s.disconnected(1.0)
    (req,) = requests(s.connected(1.5))
    out = s.replay_reply(replay_end_frames(), req.token, 1.6)
    (whole,) = requests(out)
    assert whole.start_seq == 0 and not clears(out) and s.state is RankState.SYNCING
    out = s.replay_reply(reply(0, life=1), whole.token, 1.7)
    out += s.replay_reply(reply(1, life=1), whole.token, 1.7)
    out += s.replay_reply(replay_end_frames(), whole.token, 1.7)
    assert clears(out) and s.counters.restarts == 1 and applied(out) == [0, 1]
    assert s.state is RankState.SYNCED and s.expected_seq == 2


def test_reconnect_with_only_empty_replies_proves_nothing_and_ends_partial() -> None:
    """A restarted idle publisher or a useless buffer: empty replies cannot tell which."""
    s = synced_stream(3)
    s.disconnected(1.0)
    (req,) = requests(s.connected(1.5))
    (whole,) = requests(s.replay_reply(replay_end_frames(), req.token, 1.6))
    out = s.replay_reply(replay_end_frames(), whole.token, 1.6)
    assert clears(out) and s.counters.restarts == 0 and requests(out) == []
    assert s.state is RankState.PARTIAL and s.expected_seq == 3
    # The next live batch tells: its seq went back, so the publisher restarted.
    out = s.live(live(0, life=1), 2.0)
    assert s.counters.restarts == 1
    (history,) = requests(out)
    out = s.replay_reply(reply(0, life=1), history.token, 2.1)
    out += s.replay_reply(replay_end_frames(), history.token, 2.1)
    assert applied(out) == [0] and s.state is RankState.SYNCED


def test_reconnect_to_the_same_publisher_keeps_the_view() -> None:
    s = synced_stream(3)
    s.disconnected(1.0)
    (req,) = requests(s.connected(1.5))
    out = s.replay_reply(reply(2), req.token, 1.6)
    out += s.replay_reply(reply(3), req.token, 1.6)  # published during the outage
    out += s.replay_reply(replay_end_frames(), req.token, 1.6)
    assert not clears(out) and applied(out) == [3]
    assert s.state is RankState.SYNCED and s.counters.reconnects == 1


def test_sglang_epoch_change_in_the_topic_is_a_restart() -> None:
    s = RankStream(0, StreamConfig(replay=False))
    s.connected(0.0)
    t1, t2 = b"kv\x00sgl-kv-epoch=1", b"kv\x00sgl-kv-epoch=2"
    for seq in range(3):
        s.live([t1, pack_seq(seq), batch(seq)], 0.0)
    out = s.live([t2, pack_seq(3), batch(3, life=1)], 0.1)
    assert clears(out) and s.counters.restarts == 1
    assert s.state is RankState.PARTIAL  # the new life's 0..2 are unknown


# --- bad input ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "frames",
    [
        [TOPIC, pack_seq(3)],
        [TOPIC, b"\x00\x01", b"x"],
        [TOPIC, pack_seq(3), b"\xc1not msgpack"],
        [TOPIC, pack_seq(3), encode_batch(KVEventBatch(0.0, [], 0))[:-1] + b"\x91"],
        [],
    ],
)
def test_malformed_live_frames_are_counted_and_never_raise(frames: list[bytes]) -> None:
    s = synced_stream(3)
    out = s.live(frames, 1.0)
    assert applied(out) == [] and not clears(out)
    assert s.counters.decode_errors == 1
    assert s.expected_seq == 3


def test_a_malformed_batch_is_a_lost_seq_that_the_replay_fills() -> None:
    s = synced_stream(3)
    out = s.live([TOPIC, pack_seq(3), b"\xc1"], 1.0)
    (req,) = requests(out)
    out = []
    for seq in (2, 3):
        out += s.replay_reply(reply(seq), req.token, 1.1)
    out += s.replay_reply(replay_end_frames(), req.token, 1.1)
    assert applied(out) == [3] and s.state is RankState.SYNCED


def test_a_malformed_batch_below_expected_never_decides_a_restart() -> None:
    s = synced_stream(5)
    assert s.live([TOPIC, pack_seq(1), b"\xc1"], 1.0) == []
    assert s.counters.restarts == 0 and s.state is RankState.SYNCED


def test_malformed_and_stale_replay_frames_are_ignored() -> None:
    s = synced_stream(3)
    (req,) = requests(s.live(live(5), 1.0))
    assert s.replay_reply([b"", b"\x00"], req.token, 1.1) == []
    assert s.replay_reply([b"x", b"", pack_seq(1), b""], req.token, 1.1) == []
    assert s.replay_reply(reply(3), req.token + 7, 1.1) == []
    assert s.counters.decode_errors == 2 and s.counters.stale_replies == 1


def test_rank_mismatch_is_counted_and_the_batch_applied() -> None:
    s = synced_stream(2)
    assert applied(s.live(live(2, rank=3), 1.0)) == [2]
    assert applied(s.live(live(3, rank=None), 1.0)) == [3]
    assert s.counters.rank_mismatches == 1


def test_sink_failure_clears_and_marks_partial() -> None:
    s = synced_stream(2)
    out = s.sink_failed(1.0, "boom")
    assert clears(out) and s.state is RankState.PARTIAL and s.counters.sink_errors == 1


# --- time ------------------------------------------------------------------------------------


def test_replay_timeouts_retry_with_backoff_then_give_up() -> None:
    s = synced_stream(3)
    assert len(requests(s.live(live(6), 10.0))) == 1
    assert s.next_deadline() == pytest.approx(11.0)
    assert s.tick(10.9) == []
    retries: list[float] = []
    now = 11.0
    out = s.tick(now)
    for _ in range(2):
        assert requests(out) == []
        when = s.next_deadline()
        assert when is not None
        retries.append(when - now)
        now = when
        (again,) = requests(s.tick(now))
        assert again.fresh and again.start_seq == 2
        now += 1.0
        out = s.tick(now)
    assert retries == [pytest.approx(0.1), pytest.approx(0.2)]
    assert clears(out) and applied(out) == [6]
    assert s.state is RankState.PARTIAL
    c = s.counters
    # First contact, the gap, two retries.
    assert (c.replay_timeouts, c.replays_failed, c.replays_requested) == (3, 1, 4)


def test_idle_rank_probes_and_finds_a_lost_last_batch() -> None:
    s = synced_stream(3)
    assert s.next_deadline() == pytest.approx(5.0)
    (probe,) = requests(s.tick(5.0))
    assert probe.start_seq == 2 and s.state is RankState.SYNCED
    out = s.replay_reply(reply(2), probe.token, 5.1)
    out += s.replay_reply(reply(3), probe.token, 5.1)
    out += s.replay_reply(replay_end_frames(), probe.token, 5.1)
    assert applied(out) == [3]
    assert s.counters.probes >= 1 and s.counters.gaps == 1


def test_idle_probe_of_a_restarted_publisher_clears() -> None:
    s = synced_stream(3)
    (probe,) = requests(s.tick(5.0))
    out = s.replay_reply(reply(2, life=1), probe.token, 5.1)
    assert clears(out) and s.counters.restarts == 1


def test_status_is_a_snapshot() -> None:
    s = synced_stream(2)
    st = s.status("w", 0, "tcp://127.0.0.1:1", None)
    s.live(live(2), 1.0)
    assert st.counters.batches == 2 and s.counters.batches == 3
    assert st.state is RankState.SYNCED and st.expected_seq == 2


@pytest.mark.parametrize(
    "kwargs",
    [
        {"max_held": 0},
        {"max_held_bytes": 0},
        {"replay_timeout": 0},
        {"replay_retries": -1},
        {"backoff_initial": 2.0, "backoff_max": 1.0},
        {"idle_probe": 0.0},
        {"dedup_window": 0},
    ],
)
def test_config_rejects_nonsense(kwargs: dict[str, Any]) -> None:
    with pytest.raises(ValueError):
        StreamConfig(**kwargs)


# --- races a transport can produce -------------------------------------------------------


def test_a_hole_inside_a_reply_is_asked_again_not_lost() -> None:
    """A replay socket may drop frames mid-reply (high-water mark): ask again from the hole."""
    s = synced_stream(3)
    (req,) = requests(s.live(live(8), 1.0))
    out = s.replay_reply(reply(2), req.token, 1.1) + s.replay_reply(reply(3), req.token, 1.1)
    (again,) = requests(s.replay_reply(reply(6), req.token, 1.1))  # 4 and 5 went missing
    assert again.start_seq == 4 and again.fresh
    for seq in range(4, 9):
        out += s.replay_reply(reply(seq), again.token, 1.2)
    out += s.replay_reply(replay_end_frames(), again.token, 1.2)
    assert applied(out) == [3, 4, 5, 6, 7, 8]
    assert s.state is RankState.SYNCED and s.counters.seqs_lost == 0


def test_a_held_live_batch_that_differs_from_its_replayed_copy_is_a_restart() -> None:
    """Live and replay sockets can briefly reach two lives of a restarting publisher."""
    s = synced_stream(3)
    (req,) = requests(s.live(live(5), 1.0))
    out = s.replay_reply(reply(2), req.token, 1.1)
    out += s.replay_reply(reply(3), req.token, 1.1)
    out += s.replay_reply(reply(4), req.token, 1.1)
    out += s.replay_reply(reply(5, life=1), req.token, 1.1)
    assert applied(out) == [3, 4]
    assert clears(out) and s.counters.restarts == 1
    (history,) = requests(out)
    assert history.start_seq == 0 and history.fresh


def test_what_the_old_connection_showed_is_dropped_on_reconnect() -> None:
    """Held batches and seen seqs of the old connection say nothing about a new publisher."""
    s = RankStream(0, CFG)
    (first,) = requests(s.connected(0.0))
    s.live(live(3), 0.1)
    s.live(live(4), 0.1)  # held: first contact has not answered
    s.disconnected(0.2)
    (req,) = requests(s.connected(0.5))
    assert s.held == 0 and req.fresh
    out = s.replay_reply(reply(0, life=1), req.token, 0.6)
    out += s.replay_reply(replay_end_frames(), req.token, 0.6)
    assert applied(out) == [0]
    assert s.state is RankState.SYNCED and s.expected_seq == 1
    assert s.replay_reply(replay_end_frames(), first.token, 0.7) == []
