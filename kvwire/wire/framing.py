"""ZeroMQ frame layouts: live PUB messages and the replay request/reply protocol.

Live:          ``[topic, seq, payload]``
Replay ask:    ``[b"", start_seq]`` from a DEALER (a REQ adds the ``b""`` itself)
Replay reply:  ``[b"", topic, seq, payload]`` (current) or ``[b"", seq, payload]``
               (older), closed by ``[b"", topic?, END_SEQ, b""]`` / ``[b"", END_SEQ, b""]``.

kvwire's own publishers add, without changing what those frames mean to anyone else:

Epoch:         ``topic + b"\x00sgl-kv-epoch=" + epoch`` on every live message and reply
               (SGLang's convention: prefix subscriptions still match).
Snapshot ask:  ``[b"", b"kvwire-snapshot"]`` on the replay socket. Engines' own
               publishers read it as a start seq past anything buffered and answer END.
Snapshot:      ``[b"", b"kvwire-snapshot", topic, next_seq, number, payload]`` chunks, closed by
               ``[b"", b"kvwire-snapshot", topic, next_seq, END_SEQ, chunk_count]``, or refused
               with ``[b"", b"kvwire-snapshot", topic, END_SEQ, END_SEQ, reason]``.

``seq`` (and ``number``, ``chunk_count``) is always 8 bytes, big-endian, unsigned. Chunk 0's
payload may announce the rank's block count as a fourth envelope element (``[ts, events, rank,
blocks]``), which every batch decoder already ignores; kvwire's publisher sends it as an empty
batch of its own (``[ts, [], rank, blocks]``). See ``docs/wire.md``.
"""

from __future__ import annotations

import struct
from collections.abc import Sequence
from typing import Annotated, NamedTuple

import msgspec

from kvwire.wire.events import WireError

__all__ = [
    "END_SEQ",
    "EPOCH_MARK",
    "SNAPSHOT_MARK",
    "Epoch",
    "LiveMessage",
    "ReplayEnd",
    "ReplayItem",
    "ReplayReply",
    "ReplayRequest",
    "SnapshotChunk",
    "SnapshotEnd",
    "SnapshotRefused",
    "SnapshotRequest",
    "announce_blocks",
    "announced_blocks",
    "epoch_topic",
    "format_epoch",
    "pack_seq",
    "parse_epoch",
    "parse_live",
    "parse_replay_reply",
    "parse_replay_request",
    "parse_request",
    "replay_end_frames",
    "replay_item_frames",
    "replay_request_frames",
    "snapshot_chunk_frames",
    "snapshot_end_frames",
    "snapshot_refused_frames",
    "snapshot_request_frames",
    "split_topic",
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


def replay_end_frames(topic: bytes = b"") -> list[bytes]:
    """The marker that closes a replay reply (kvwire publishers put their epoch topic in it)."""
    return [b"", topic, END_SEQ, b""]


class ReplayItem(NamedTuple):
    """A replayed batch. ``topic`` is ``None`` for the older layout that has none."""

    topic: bytes | None
    seq: int
    payload: bytes


class ReplayEnd(NamedTuple):
    """The end of a replay reply; ``topic`` as the publisher sent it (engines: empty)."""

    topic: bytes | None = None


# --- publisher epochs -----------------------------------------------------------

EPOCH_MARK = b"\x00sgl-kv-epoch="
"""What separates a topic from the publisher's epoch (SGLang's convention)."""

KVWIRE_EPOCH = b"kvw1."
"""How kvwire's own publishers' epochs begin (they reserve a seq before queueing)."""
_EPOCH_ID_LEN = 16  # hex digits of a random 64-bit id
_MAX_EPOCH_LEN = 64
_MAX_HEARTBEAT_MS = 3_600_000


class Epoch(NamedTuple):
    """What a publisher's epoch tells a subscriber.

    ``value`` identifies one publisher instance: a different value is a
    restart. kvwire's own publishers also say whether they heartbeat (and how
    often) and whether their replay socket serves snapshots; any other epoch
    (SGLang's) gives neither promise.
    """

    value: bytes
    heartbeat_s: float | None = None
    snapshot: bool = False


def format_epoch(instance: int, *, heartbeat_s: float | None, snapshot: bool) -> bytes:
    """A kvwire publisher's epoch: ``kvw1.<16 hex>[.hb<ms>][.snap]``."""
    if not 0 <= instance < 1 << 64:
        raise WireError(f"epoch instance {instance} is not a 64-bit unsigned int")
    out = KVWIRE_EPOCH + b"%016x" % instance
    if heartbeat_s is not None:
        ms = round(heartbeat_s * 1000)
        if not 1 <= ms <= _MAX_HEARTBEAT_MS:
            raise WireError(f"heartbeat {heartbeat_s} s is outside 1 ms..1 h")
        out += b".hb%d" % ms
    if snapshot:
        out += b".snap"
    return out


def parse_epoch(epoch: bytes) -> Epoch:
    """Read an epoch; anything not in kvwire's form is an opaque epoch (no promises)."""
    if len(epoch) > _MAX_EPOCH_LEN or not epoch.startswith(KVWIRE_EPOCH):
        return Epoch(epoch)
    parts = epoch[len(KVWIRE_EPOCH) :].split(b".")
    ident = parts[0]
    if len(ident) != _EPOCH_ID_LEN or not all(c in b"0123456789abcdef" for c in ident):
        return Epoch(epoch)
    heartbeat: float | None = None
    snapshot = False
    for part in parts[1:]:
        if part == b"snap":
            snapshot = True
        elif part.startswith(b"hb") and part[2:].isdigit() and len(part) <= 10:
            ms = int(part[2:])
            if 1 <= ms <= _MAX_HEARTBEAT_MS:
                heartbeat = ms / 1000
    return Epoch(epoch, heartbeat, snapshot)


def epoch_topic(topic: bytes, epoch: bytes | None) -> bytes:
    """The topic frame a publisher sends: its topic, then its epoch if it has one."""
    return topic if epoch is None else topic + EPOCH_MARK + epoch


def split_topic(topic: bytes) -> tuple[bytes, bytes | None]:
    """``(topic, epoch)`` of a received topic frame; ``None`` when it carries no epoch."""
    at = topic.find(EPOCH_MARK)
    if at < 0:
        return topic, None
    return topic[:at], topic[at + len(EPOCH_MARK) :]


# --- snapshots ----------------------------------------------------------------------

SNAPSHOT_MARK = b"kvwire-snapshot"
"""The second frame of every snapshot request and reply message."""
SNAPSHOT_CHUNK_BLOCKS = 4096
"""Blocks in one snapshot chunk by default: the largest reply message a router reads."""


def snapshot_request_frames() -> list[bytes]:
    """What a DEALER sends to ask a kvwire publisher's replay socket for a snapshot."""
    return [b"", SNAPSHOT_MARK]


class SnapshotRequest(NamedTuple):
    """A snapshot request as the publisher's ROUTER read it."""

    identity: bytes


class ReplayRequest(NamedTuple):
    """A replay request as the publisher's ROUTER read it."""

    identity: bytes
    start_seq: int


def parse_request(frames: Sequence[Frame]) -> ReplayRequest | SnapshotRequest:
    """Read what a ROUTER received on a replay socket: a replay or a snapshot request."""
    if len(frames) == 3 and len(frames[1]) == 0 and bytes(frames[2]) == SNAPSHOT_MARK:
        return SnapshotRequest(bytes(frames[0]))
    identity, start = parse_replay_request(frames)
    return ReplayRequest(identity, start)


def snapshot_chunk_frames(
    topic: bytes, next_seq: int, number: int, payload: bytes, blocks: int | None = None
) -> list[bytes]:
    """Chunk ``number`` (from 0) of a snapshot of the state before batch ``next_seq``.

    ``payload`` is an ordinary batch payload whose ``BlockStored`` events
    rebuild the state; across the chunks of one snapshot a parent always
    comes before its children. ``blocks``, on chunk 0 only: the rank's block
    count, announced so that a router can size its tables before applying
    (:func:`announce_blocks`).
    """
    if blocks is not None:
        if number != 0:
            raise WireError(f"only chunk 0 announces a block count, not chunk {number}")
        payload = announce_blocks(payload, blocks)
    return [b"", SNAPSHOT_MARK, topic, pack_seq(next_seq), pack_seq(number), payload]


_ENVELOPE3 = 0x93  # a fixarray of 3: [ts, events, rank], as both dialects write it
_MAX_BLOCKS = (1 << 63) - 1
_envelope_items = msgspec.msgpack.Decoder(list[msgspec.Raw])
_announced = msgspec.msgpack.Decoder(Annotated[int, msgspec.Meta(ge=0, le=_MAX_BLOCKS)] | None)


def announce_blocks(payload: bytes, blocks: int) -> bytes:
    """``payload`` (a ``[ts, events, rank]`` envelope) with ``blocks`` appended as a
    fourth element. Why there: every batch decoder (kvwire's older ones, the
    engines') ignores trailing envelope elements, whereas a seventh frame would
    make kvwire's older parsers drop chunk 0 and fail the snapshot."""
    if not 0 <= blocks <= _MAX_BLOCKS:
        raise WireError(f"announced block count {blocks} is outside 0..2**63-1")
    if not payload or payload[0] != _ENVELOPE3:
        raise WireError("a block count is announced only on a [ts, events, rank] envelope")
    return b"\x94" + payload[1:] + msgspec.msgpack.encode(blocks)


def announced_blocks(payload: Frame) -> int | None:
    """The block count chunk 0's envelope announces (its fourth element), or ``None``
    when it has none (older publishers); raises :class:`WireError` if malformed."""
    view = memoryview(payload)
    if not view or view[0] == _ENVELOPE3:  # the common case, no walk over the events
        return None
    try:
        items = _envelope_items.decode(view)
    except (msgspec.DecodeError, msgspec.ValidationError):
        return None  # not an array envelope: left to the batch decoder to judge
    if len(items) < 4:
        return None
    try:
        return _announced.decode(items[3])
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise WireError(f"snapshot chunk 0 announces a bad block count: {exc}") from None


def snapshot_end_frames(topic: bytes, next_seq: int, chunks: int) -> list[bytes]:
    """Closes a snapshot that was sent whole: ``chunks`` chunks, then go on at ``next_seq``."""
    return [b"", SNAPSHOT_MARK, topic, pack_seq(next_seq), END_SEQ, pack_seq(chunks)]


def snapshot_refused_frames(topic: bytes, reason: str) -> list[bytes]:
    """The publisher cannot serve a trustworthy snapshot (say why)."""
    return [b"", SNAPSHOT_MARK, topic, END_SEQ, END_SEQ, reason.encode()[:1024]]


class SnapshotChunk(NamedTuple):
    """One chunk of a snapshot reply."""

    topic: bytes
    next_seq: int
    number: int
    """The chunk's place in the snapshot, from 0 (a missing number is a broken snapshot)."""
    payload: bytes
    blocks: int | None = None
    """Chunk 0 only: the block count the publisher announces for the whole snapshot
    (a hint to size tables, never trusted beyond a receiver's own limits); ``None``
    when absent (older publishers, later chunks)."""


class SnapshotEnd(NamedTuple):
    """A snapshot reply is complete after ``chunks`` chunks; continue from ``next_seq``."""

    topic: bytes
    next_seq: int
    chunks: int


class SnapshotRefused(NamedTuple):
    """The publisher refused the snapshot (its state cannot be trusted, or it is busy)."""

    topic: bytes
    reason: str


ReplayReply = ReplayItem | ReplayEnd | SnapshotChunk | SnapshotEnd | SnapshotRefused


def parse_replay_reply(frames: Sequence[Frame]) -> ReplayReply:
    """Read one reply message as a DEALER receives it: either replay layout, or a snapshot."""
    if not frames or len(frames[0]) != 0:
        raise WireError("replay reply must start with the empty delimiter frame")
    if len(frames) == 6 and bytes(frames[1]) == SNAPSHOT_MARK:
        return _parse_snapshot(frames)
    if len(frames) == 4:
        _, topic, seq, payload = frames
        topic_b: bytes | None = bytes(topic)
    elif len(frames) == 3:
        _, seq, payload = frames
        topic_b = None
    else:
        raise WireError(f"replay reply must have 3 or 4 frames, got {len(frames)}")
    if bytes(seq) == END_SEQ:
        return ReplayEnd(topic_b)
    return ReplayItem(topic_b, unpack_seq(seq), bytes(payload))


def _parse_snapshot(frames: Sequence[Frame]) -> SnapshotChunk | SnapshotEnd | SnapshotRefused:
    _, _, topic, seq, index, last = frames
    topic_b = bytes(topic)
    if bytes(seq) == END_SEQ:
        if bytes(index) != END_SEQ:
            raise WireError("snapshot refusal must carry END_SEQ in both seq frames")
        return SnapshotRefused(topic_b, bytes(last).decode("utf-8", "replace"))
    next_seq = unpack_seq(seq)
    if bytes(index) == END_SEQ:
        return SnapshotEnd(topic_b, next_seq, unpack_seq(last))
    number = unpack_seq(index)
    blocks = announced_blocks(last) if number == 0 else None
    return SnapshotChunk(topic_b, next_seq, number, bytes(last), blocks)
