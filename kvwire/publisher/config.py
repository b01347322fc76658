"""``PublisherConfig``: every setting of an :class:`~kvwire.publisher.EventPublisher`, with its
default and its range, written once.

The publisher, the engine integrations (``KVWIRE_*`` variables, through
``msgspec.convert``) and the reference engine's flags all build this struct.
Its ranges are ``msgspec.Meta`` constraints: a value outside one is refused
when the config is read (decoded, converted) or built, with ``ValueError``
(``msgspec.ValidationError`` when decoding) naming the field, the value and
what is allowed.
"""

from __future__ import annotations

from typing import Annotated, Literal

import msgspec
from msgspec import Meta

from kvwire.settings import Positive, Seconds, check_fields
from kvwire.wire.framing import SNAPSHOT_CHUNK_BLOCKS
from kvwire.wire.heartbeat import DEFAULT_INTERVAL_S

__all__ = [
    "MAX_SEND_COALESCE_S",
    "HeartbeatSeconds",
    "Hwm",
    "Positive",
    "PublisherConfig",
    "SendCoalesceSeconds",
]

Hwm = Annotated[int, Meta(ge=1, le=2**31 - 1)]
"""A ZeroMQ high-water mark: libzmq takes an ``int``, and 0 (no limit) is not offered."""

MAX_SEND_COALESCE_S = 60
"""The longest ``send_coalesce_s`` (its ``KVWIRE_COALESCE_MS`` form is bounded by it too)."""

SendCoalesceSeconds = Annotated[float, Meta(ge=0, le=MAX_SEND_COALESCE_S)]
"""How long the sender may hold a queued batch (0: send at once)."""

HeartbeatSeconds = Annotated[float, Meta(ge=0.001, le=3600)]
"""A heartbeat interval: at least the epoch's 1 ms resolution, at most an hour."""


class PublisherConfig(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """How an :class:`~kvwire.publisher.EventPublisher` queues, sends, keeps and serves batches.

    Queue and socket:

    - ``max_queue_size``: batches that may wait for the sender thread; beyond
      that ``publish()`` drops the batch (counted, a visible seq gap) instead
      of blocking the engine.
    - ``hwm``: the PUB socket's per-subscriber send high-water mark; a
      subscriber that falls that far behind loses messages inside ZeroMQ and
      sees a seq gap.
    - ``send_coalesce_s``: the sender sends the oldest queued batch this long
      after its ``publish()``, with every batch published meanwhile, so that
      batches close together share one send round (0: at once). The
      subscriber's read pause is a different setting.
    - ``topic``, ``dialect``: the topic frame's prefix and the batch encoding
      (``"map"`` events, or vLLM's ``"array"``).

    Replay (with a replay endpoint):

    - ``buffer_steps``: batches kept for replay.
    - ``max_replay_batches``: the most batches one replay request is
      answered with (``None``: the whole buffer, as the engines do), served
      in chunks between live sends, at most ``max_replay_jobs`` at once, each
      cut off after ``replay_stall_s`` seconds in which its client took
      nothing (its connection is then shut down, whatever its pipe holds).
    - ``max_replay_bytes``: the most bytes of replies (replays and snapshots)
      handed to ZeroMQ and not yet taken by their clients, across all clients
      (a message counts per client, although the buffers are shared); each
      reply may hold ``max_replay_bytes / max_replay_jobs`` of it, and one
      message, however large, may go when nothing else is in flight.

    kvwire's additions, each switchable so that an engine integration can
    stay byte-identical to the engine's own publisher:

    - ``epoch``: a random 64-bit id per instance, appended to every topic
      frame (live, replay, snapshot) as
      ``\\x00sgl-kv-epoch=kvw1.<hex>[.hb<ms>][.snap]``.
    - ``heartbeat_s``: the interval of the wall-clock grid on which the sender
      publishes an empty batch on the next seq when nothing went out in the
      last half interval; after a batch, on the grid of half the interval
      (:mod:`kvwire.wire.heartbeat`). A trailing drop shows within 0.75
      intervals, and a fleet's heartbeats arrive together (``None``: never).
      The epoch announces it to subscribers under the same name.
    - ``snapshot``: with a replay endpoint, keep a mirror of the rank's cache
      and serve snapshots of it in chunks of at most ``snapshot_chunk_blocks``
      blocks. Batches dropped on a full queue are still mirrored (up to
      ``mirror_backlog`` of them held for that, apart from the queue), so a
      snapshot repairs the gap they leave.
    """

    max_queue_size: Positive = 100_000
    hwm: Hwm = 100_000
    send_coalesce_s: SendCoalesceSeconds = 0.002
    topic: str = ""
    dialect: Literal["map", "array"] = "map"
    buffer_steps: Positive = 10_000
    max_replay_batches: Positive | None = None
    max_replay_jobs: Positive = 64
    replay_stall_s: Seconds = 2.0
    max_replay_bytes: Positive = 64 * 2**20
    epoch: bool = True
    heartbeat_s: HeartbeatSeconds | None = DEFAULT_INTERVAL_S
    snapshot: bool = True
    snapshot_chunk_blocks: Positive = SNAPSHOT_CHUNK_BLOCKS
    mirror_backlog: Positive = 100_000

    def __post_init__(self) -> None:
        check_fields(self)

    @property
    def replay_batches(self) -> int:
        """The most batches one replay request is answered with (``max_replay_batches``
        or, unset, the whole buffer)."""
        return self.max_replay_batches or self.buffer_steps
