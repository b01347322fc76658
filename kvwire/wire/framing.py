"""ZeroMQ frame layouts: live PUB messages and the replay request/reply protocol.

Live:          ``[topic, seq, payload]``
Replay ask:    ``[b"", start_seq]`` from a DEALER (a REQ adds the ``b""`` itself)
Replay reply:  ``[b"", topic, seq, payload]`` (current) or ``[b"", seq, payload]``
               (older), closed by ``[b"", b"", END_SEQ, b""]`` / ``[b"", END_SEQ, b""]``.

``seq`` is always 8 bytes, big-endian, unsigned.
"""

from __future__ import annotations

import struct
from collections.abc import Sequence
from typing import NamedTuple

from kvwire.wire.errors import WireError

__all__ = [
    "END_SEQ",
    "LiveMessage",
    "ReplayEnd",
    "ReplayItem",
    "pack_seq",
    "parse_live",
    "parse_replay_reply",
    "parse_replay_request",
    "replay_end_frames",
    "replay_item_frames",
    "replay_request_frames",
    "unpack_seq",
]

END_SEQ = b"\xff" * 8
"""The seq frame that closes a replay reply (-1 as a signed int64)."""

_SEQ = struct.Struct(">Q")
_MAX_SEQ = (1 << 64) - 2  # END_SEQ's value is reserved

Frame = bytes | bytearray | memoryview


def pack_seq(seq: int) -> bytes:
    """Encode a sequence number as its 8-byte big-endian frame."""
    if not 0 <= seq <= _MAX_SEQ:
        raise WireError(f"seq {seq} is outside 0..2**64-2")
    return _SEQ.pack(seq)


def unpack_seq(frame: Frame) -> int:
    """Decode an 8-byte big-endian seq frame."""
    if len(frame) != 8:
        raise WireError(f"seq frame must be 8 bytes, got {len(frame)}")
    return int(_SEQ.unpack(frame)[0])


class LiveMessage(NamedTuple):
    """One PUB message: a batch's topic, sequence number and payload."""

    topic: bytes
    seq: int
    payload: bytes


def parse_live(frames: Sequence[Frame]) -> LiveMessage:
    """Split a live multipart message; raises :class:`WireError` if it is not one."""
    if len(frames) != 3:
        raise WireError(f"live message must have 3 frames [topic, seq, payload], got {len(frames)}")
    topic, seq, payload = frames
    return LiveMessage(bytes(topic), unpack_seq(seq), bytes(payload))


def replay_request_frames(start_seq: int) -> list[bytes]:
    """What a DEALER sends to ask for every buffered batch from ``start_seq`` on."""
    return [b"", pack_seq(start_seq)]


def parse_replay_request(frames: Sequence[Frame]) -> tuple[bytes, int]:
    """Read a request as a ROUTER receives it: ``[identity, b"", start_seq]``.

    Returns ``(identity, start_seq)``; anything else raises :class:`WireError`
    (the server counts and ignores it without a reply).
    """
    if len(frames) != 3 or len(frames[1]) != 0:
        raise WireError(
            f"replay request must be [identity, b'', seq] as a ROUTER sees it, got {len(frames)} frames"
        )
    seq_frame = frames[2]
    if bytes(seq_frame) == END_SEQ:
        raise WireError("replay request start seq is the END_SEQ marker")
    return bytes(frames[0]), unpack_seq(seq_frame)


def replay_item_frames(topic: bytes, seq: int, payload: bytes) -> list[bytes]:
    """One buffered batch in a replay reply (current layout, with the topic)."""
    return [b"", topic, pack_seq(seq), payload]


def replay_end_frames() -> list[bytes]:
    """The marker that closes a replay reply."""
    return [b"", b"", END_SEQ, b""]


class ReplayItem(NamedTuple):
    """A replayed batch. ``topic`` is ``None`` for the older layout that has none."""

    topic: bytes | None
    seq: int
    payload: bytes


class ReplayEnd(NamedTuple):
    """The end of a replay reply."""


def parse_replay_reply(frames: Sequence[Frame]) -> ReplayItem | ReplayEnd:
    """Read one reply message as a DEALER receives it, in either layout."""
    if not frames or len(frames[0]) != 0:
        raise WireError("replay reply must start with the empty delimiter frame")
    if len(frames) == 4:
        _, topic, seq, payload = frames
        topic_b: bytes | None = bytes(topic)
    elif len(frames) == 3:
        _, seq, payload = frames
        topic_b = None
    else:
        raise WireError(f"replay reply must have 3 or 4 frames, got {len(frames)}")
    if bytes(seq) == END_SEQ:
        return ReplayEnd()
    return ReplayItem(topic_b, unpack_seq(seq), bytes(payload))
