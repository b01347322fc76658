"""Frame layouts: live messages, replay requests and both reply layouts."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvwire.wire import (
    END_SEQ,
    ReplayEnd,
    ReplayItem,
    WireError,
    pack_seq,
    parse_live,
    parse_replay_reply,
    parse_replay_request,
    replay_end_frames,
    replay_item_frames,
    replay_request_frames,
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
    assert parse_replay_reply(replay_end_frames()) == ReplayEnd()
    assert parse_replay_reply([b"", END_SEQ, b""]) == ReplayEnd()
    # An empty topic is still the current layout, not an end marker.
    assert parse_replay_reply([b"", b"", pack_seq(0), b"p"]) == ReplayItem(b"", 0, b"p")


@pytest.mark.parametrize(
    "frames", [[], [b"x", b"t", pack_seq(1), b"p"], [b"", b"p"], [b"", b"t", b"s", b"p", b"q"]]
)
def test_malformed_replay_replies_raise(frames: list[bytes]) -> None:
    with pytest.raises(WireError):
        parse_replay_reply(frames)
