"""Frame layouts: live messages, replay requests and both reply layouts."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvwire.wire import (
    END_SEQ,
    Epoch,
    ReplayEnd,
    ReplayItem,
    ReplayRequest,
    SnapshotChunk,
    SnapshotEnd,
    SnapshotRefused,
    SnapshotRequest,
    WireError,
    epoch_topic,
    format_epoch,
    pack_seq,
    parse_epoch,
    parse_live,
    parse_replay_reply,
    parse_replay_request,
    parse_request,
    replay_end_frames,
    replay_item_frames,
    replay_request_frames,
    snapshot_chunk_frames,
    snapshot_end_frames,
    snapshot_refused_frames,
    snapshot_request_frames,
    split_topic,
    unpack_seq,
)


@given(st.integers(min_value=0, max_value=2**64 - 2))
def test_seq_round_trip_is_big_endian(seq: int) -> None:
    frame = pack_seq(seq)
    assert frame == seq.to_bytes(8, "big")
    assert unpack_seq(frame) == seq


@pytest.mark.parametrize("seq", [-1, 2**64 - 1, 2**64])
def test_pack_seq_rejects_out_of_range(seq: int) -> None:
    with pytest.raises(WireError, match="outside"):
        pack_seq(seq)


@pytest.mark.parametrize("frame", [b"", b"\x00" * 7, b"\x00" * 9])
def test_unpack_seq_rejects_wrong_length(frame: bytes) -> None:
    with pytest.raises(WireError, match="8 bytes"):
        unpack_seq(frame)


def test_parse_live() -> None:
    msg = parse_live([b"kv", pack_seq(9), b"payload"])
    assert (msg.topic, msg.seq, msg.payload) == (b"kv", 9, b"payload")
    with pytest.raises(WireError, match="3 frames"):
        parse_live([b"kv", pack_seq(9)])


def test_replay_request_as_router_sees_it() -> None:
    frames = [b"peer-id", *replay_request_frames(42)]
    assert parse_replay_request(frames) == (b"peer-id", 42)


@pytest.mark.parametrize(
    "frames",
    [
        [b"id", pack_seq(1)],  # no delimiter
        [b"id", b"x", pack_seq(1)],  # non-empty delimiter
        [b"id", b"", b"\x01"],  # short seq
        [b"id", b"", END_SEQ],  # end marker as a start
        [b"id", b"", pack_seq(1), b"extra"],
    ],
)
def test_malformed_replay_requests_raise(frames: list[bytes]) -> None:
    with pytest.raises(WireError):
        parse_replay_request(frames)


def test_replay_reply_layouts() -> None:
    assert parse_replay_reply(replay_item_frames(b"t", 5, b"p")) == ReplayItem(b"t", 5, b"p")
    assert parse_replay_reply([b"", pack_seq(5), b"p"]) == ReplayItem(None, 5, b"p")
    assert parse_replay_reply(replay_end_frames()) == ReplayEnd(b"")
    assert parse_replay_reply(replay_end_frames(b"t")) == ReplayEnd(b"t")
    assert parse_replay_reply([b"", END_SEQ, b""]) == ReplayEnd(None)
    # An empty topic is still the current layout, not an end marker.
    assert parse_replay_reply([b"", b"", pack_seq(0), b"p"]) == ReplayItem(b"", 0, b"p")


@pytest.mark.parametrize(
    "frames", [[], [b"x", b"t", pack_seq(1), b"p"], [b"", b"p"], [b"", b"t", b"s", b"p", b"q"]]
)
def test_malformed_replay_replies_raise(frames: list[bytes]) -> None:
    with pytest.raises(WireError):
        parse_replay_reply(frames)


@given(
    st.integers(min_value=0, max_value=2**64 - 1),
    st.one_of(st.none(), st.integers(min_value=1, max_value=3_600_000)),
    st.booleans(),
)
def test_kvwire_epoch_round_trip(instance: int, heartbeat_ms: int | None, snapshot: bool) -> None:
    heartbeat = None if heartbeat_ms is None else heartbeat_ms / 1000
    epoch = format_epoch(instance, heartbeat_s=heartbeat, snapshot=snapshot)
    assert parse_epoch(epoch) == Epoch(epoch, heartbeat, snapshot)
    topic = epoch_topic(b"kv", epoch)
    assert topic.startswith(b"kv")  # a prefix subscription to the topic still matches
    assert split_topic(topic) == (b"kv", epoch)


@pytest.mark.parametrize(
    "epoch",
    [
        b"1700000000",  # an engine's own epoch: opaque
        b"kvw1.xyz.hb1000.snap",  # not 16 hex digits
        b"kvw1.0123456789abcdef" + b".hb1" * 40,  # too long to be ours
    ],
)
def test_foreign_epochs_promise_nothing(epoch: bytes) -> None:
    assert parse_epoch(epoch) == Epoch(epoch, None, False)


def test_kvwire_epoch_ignores_unknown_or_absurd_flags() -> None:
    epoch = b"kvw1.0123456789abcdef.hb0.hb99999999.future.snap"
    assert parse_epoch(epoch) == Epoch(epoch, None, True)


def test_topic_without_epoch() -> None:
    assert split_topic(b"kv") == (b"kv", None)
    assert epoch_topic(b"kv", None) == b"kv"


def test_snapshot_request_is_told_from_a_replay_request() -> None:
    identity = b"\x00id"
    assert parse_request([identity, *snapshot_request_frames()]) == SnapshotRequest(identity)
    assert parse_request([identity, *replay_request_frames(7)]) == ReplayRequest(identity, 7)
    with pytest.raises(WireError):
        parse_request([identity, b"", b"kvwire-snapshoT"])


def test_engines_read_a_snapshot_request_as_a_start_past_their_buffer() -> None:
    # Engines' publishers do int.from_bytes(frame, "big") on the third frame and
    # replay every buffered seq >= it: nothing, then END.
    (_, mark) = snapshot_request_frames()
    assert int.from_bytes(mark, "big") > 2**64


def test_snapshot_reply_layouts() -> None:
    topic = epoch_topic(b"", b"kvw1.0123456789abcdef.snap")
    assert parse_replay_reply(snapshot_chunk_frames(topic, 9, 0, b"p")) == SnapshotChunk(
        topic, 9, 0, b"p"
    )
    assert parse_replay_reply(snapshot_end_frames(topic, 9, 3)) == SnapshotEnd(topic, 9, 3)
    assert parse_replay_reply(snapshot_refused_frames(topic, "mirror lost batch 4")) == (
        SnapshotRefused(topic, "mirror lost batch 4")
    )


@pytest.mark.parametrize(
    "frames",
    [
        [b"", b"kvwire-snapshot", b"t", END_SEQ, pack_seq(1), b"why"],  # half a refusal
        [b"", b"kvwire-snapshot", b"t", b"short", pack_seq(0), b"p"],
        [b"", b"kvwire-snapshot", b"t", pack_seq(1), END_SEQ, b"short"],
    ],
)
def test_malformed_snapshot_replies_raise(frames: list[bytes]) -> None:
    with pytest.raises(WireError):
        parse_replay_reply(frames)
