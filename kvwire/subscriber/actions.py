"""What a :class:`~kvwire.subscriber.RankStream` asks its transport to do.

Each input to a stream returns a list of these, in the order they must be
carried out. They are small frozen structs, cheap to make on the hot path.
"""

from __future__ import annotations

from typing import TypeAlias

import msgspec

from kvwire.subscriber.state import RankState
from kvwire.wire import KVEventBatch

__all__ = [
    "Action",
    "Apply",
    "ApplyPayload",
    "ClearRank",
    "Reconnect",
    "RequestReplay",
    "RequestSnapshot",
    "Reserve",
    "StateChanged",
]


class Apply(msgspec.Struct, frozen=True, gc=False):
    """Apply ``batch`` (the publisher's batch ``seq``) to the rank's state downstream.

    Batches come in seq order. An ``AllBlocksCleared`` inside a batch clears
    the rank at its place among the batch's events: sinks handle it in order.
    """

    seq: int
    batch: KVEventBatch


class ApplyPayload(msgspec.Struct, frozen=True, gc=False):
    """Apply the batch whose msgpack bytes are ``payload`` (the publisher's ``seq``).

    What :class:`Apply` does, for a sink that reads payloads itself
    (:class:`~kvwire.subscriber.PayloadSink`): the stream has checked that
    ``decode_batch(payload, limits)`` accepts it, with its config's limits,
    and read what sequencing needs of it, without decoding it.
    """

    seq: int
    payload: bytes | bytearray | memoryview


class ClearRank(msgspec.Struct, frozen=True, gc=False):
    """Drop everything known about the rank (a restart, or an unrecoverable loss)."""

    reason: str


class RequestReplay(msgspec.Struct, frozen=True, gc=False):
    """Ask the publisher's replay socket for every buffered batch from ``start_seq``.

    A request supersedes every earlier one. With ``fresh`` the earlier one may
    still be answered, so the transport must send this on a new replay socket
    (closing the old one) so that no late reply can be read. Replies are fed
    back with ``token``.
    """

    start_seq: int
    token: int
    fresh: bool


class RequestSnapshot(msgspec.Struct, frozen=True, gc=False):
    """Ask a kvwire publisher's replay socket for a snapshot of the rank's state.

    Sent like :class:`RequestReplay` (same socket, same ``fresh`` rule, replies
    fed back with ``token``), as :func:`kvwire.wire.snapshot_request_frames`.
    """

    token: int
    fresh: bool


class Reserve(msgspec.Struct, frozen=True, gc=False):
    """The rank is about to be rebuilt with about ``blocks`` blocks: size its tables now.

    Between a snapshot's :class:`ClearRank` and its first Apply, when chunk 0
    announced a count, so the sink grows its tables once. A hint (bounded by the
    snapshot's bytes) for the sink's optional ``reserve(worker_id, rank, blocks)``.
    """

    blocks: int


class Reconnect(msgspec.Struct, frozen=True, gc=False):
    """Drop the live connection and connect again: a heartbeating publisher went
    silent, and its TCP connection may be stalled behind a retransmission timer
    that backed off during an outage; a fresh one shows at once where it is."""

    reason: str


class StateChanged(msgspec.Struct, frozen=True, gc=False):
    """The rank's state changed, and why."""

    old: RankState
    new: RankState
    reason: str


Action: TypeAlias = (
    Apply
    | ApplyPayload
    | ClearRank
    | Reconnect
    | RequestReplay
    | RequestSnapshot
    | Reserve
    | StateChanged
)
