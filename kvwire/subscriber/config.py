"""How a :class:`~kvwire.subscriber.Subscriber` is tuned: one struct, each default written once.

``Subscriber(sources, sink, config=SubscriberConfig(...))``. A struct, so that
a router reading its settings from a file or the environment builds it with
``msgspec.convert`` and gets the same checks as a caller constructing it (each
field's range is its annotation: :func:`kvwire.settings.check_fields`).
A name shared with the publisher's settings means the same there: ``hwm`` is
the ZeroMQ high-water mark of this side's socket (the SUB's receive queue, as
the publisher's is its PUB's send queue).

Memory is bounded in bytes as well as messages: ZeroMQ's high-water marks
count messages, so each rank's are set from its share of
``receive_budget_bytes`` and the size of the batches it is receiving
(:meth:`SubscriberConfig.rank_hwm`). A batch past the mark is dropped by
ZeroMQ (or left to the publisher's own queue), which the rank sees as a gap
and repairs by replay: never a wrong view.
"""

from __future__ import annotations

from typing import Annotated

import msgspec
from msgspec import Meta

from kvwire.security import ClientKeys
from kvwire.settings import Positive, Seconds, check_fields
from kvwire.subscriber.state import StreamConfig
from kvwire.wire.framing import SNAPSHOT_CHUNK_BLOCKS

__all__ = ["QUEUE_SLACK", "SubscriberConfig"]

QUEUE_SLACK = 2
"""Messages a receiving socket holds beyond its high-water mark: the one libzmq is
decoding and the one waiting for room in the full queue."""


class SubscriberConfig(msgspec.Struct, frozen=True, kw_only=True):
    """Settings of a :class:`~kvwire.subscriber.Subscriber`; times are in seconds."""

    stream: StreamConfig = StreamConfig()
    """Every rank's sequencing (:class:`RankStream`); its ``replay`` flag is set per
    source from whether the source has a replay endpoint."""
    hwm: Positive = 100_000
    """Live messages each rank's SUB socket queues unread at most; past it ZeroMQ drops
    them, which the rank sees as a gap (repaired by replay). Large batches lower the
    mark further (``receive_budget_bytes``)."""
    receive_budget_bytes: Positive = 256 << 20
    """Payload bytes the receive path of all ranks together may hold: the SUB and
    replay sockets' queues and the burst being applied. Each rank's share is this
    over ``ranks + min(ranks, max_replays) + 1`` (a live queue per rank, a replay
    queue per open replay socket, one burst), and its sockets' high-water marks are
    set from the share and the size of the batches it receives (:meth:`rank_hwm`);
    the rank reads at most its share in one go (:meth:`read_chunk`)."""
    max_message_size: Positive = 64 << 20
    """ZeroMQ's size limit on every receiving socket (SUB and replay DEALER), in
    bytes: libzmq drops a larger message with its connection, which the rank sees as
    a lost seq."""
    max_replays: Positive = 128
    """Replay sockets open at once (further requests wait for one to close), and
    ranks making first contact at once (the others connect as those settle, or after
    5 s)."""
    probe_rate: Annotated[float, Meta(gt=0)] = 16.0
    """Idle probes of all ranks together, per second: each rank's
    ``stream.idle_probe`` interval is stretched to ``ranks / probe_rate`` when that
    is longer, so probing a large fleet at rest costs a bounded amount."""
    backlog: Positive = 10_000
    """Items the async iterator (a Subscriber without a sink) holds before reading
    stops; the publishers' high-water marks then turn the excess into gaps."""

    # --- a view that outlives the process: checkpoints and peer clones (docs/scaling.md) ---
    checkpoint: str | None = None
    """A checkpoint file (:mod:`kvwire.subscriber.checkpoint`): loaded at start when
    valid (each rank resumes from its position and replays only what it missed),
    written on a clean stop and every ``checkpoint_every`` seconds. Needs a
    :class:`~kvwire.subscriber.ViewSink`."""
    checkpoint_every: Seconds | None = None
    """Seconds between periodic checkpoint writes (None: only on stop and when asked)."""
    clone_from: str | None = None
    """A peer router's clone endpoint (``Subscriber.serve_view``): at start, before the
    engines are connected, its view is copied and each rank resumes from the peer's
    position; where the clone is refused, the checkpoint (if any) is loaded, else the
    router starts cold."""
    clone_keys: ClientKeys | None = None
    """CURVE keys to reach a clone endpoint that has server keys (``kvwire.security``)."""
    clone_timeout: Seconds = 10.0
    """Seconds a clone may go without receiving anything before it is refused."""
    clone_max_bytes: Positive = 4 << 30
    """The most bytes a clone receives: a larger view is refused."""

    def __post_init__(self) -> None:
        check_fields(self)
        if self.checkpoint_every is not None and self.checkpoint is None:
            raise ValueError("checkpoint_every needs a checkpoint path")

    def rank_share(self, ranks: int) -> int:
        """Bytes one rank's queues may hold when ``ranks`` ranks are followed."""
        ranks = max(1, ranks)
        return self.receive_budget_bytes // (ranks + min(ranks, self.max_replays) + 1)

    def rank_hwm(self, ranks: int, batch_bytes: int) -> int:
        """The high-water mark of a rank's SUB (and replay) socket, in messages.

        ``batch_bytes``: the size of the rank's recent batches. The socket then holds
        at most ``(mark + QUEUE_SLACK) * batch_bytes`` within the rank's share, or one
        message (and the slack) where a single batch is larger than the share; never
        more than ``hwm``.
        """
        fit = self.rank_share(ranks) // max(1, batch_bytes) - QUEUE_SLACK
        return max(1, min(self.hwm, fit))

    def read_chunk(self, ranks: int, batch_bytes: int, most: int) -> int:
        """Messages of ``batch_bytes`` read from one rank in one go: its share, ``most`` at most."""
        return max(1, min(most, self.rank_share(ranks) // max(1, batch_bytes)))

    # --- pacing: replay and snapshot requests in flight ---------------------------------------

    max_requests: Positive | None = None
    """Replay and snapshot requests in flight at once across all ranks (each holds a
    replay socket, so never more than ``max_replays``); the others wait their turn,
    oldest first, and a request's deadlines run from when it is sent. ``None``: it
    starts at :meth:`request_limit`, what the router can apply, and follows the
    rounds of reading as measured, up to :meth:`request_ceiling`; a number fixes it."""
    max_requests_per_source: Positive | None = None
    """The same for the ranks of one source (one engine process serves them all).
    ``None``: a quarter of :meth:`request_limit` (:meth:`source_request_limit`)."""

    def request_limit(self) -> int:
        """Requests in flight at once: ``max_requests``, or what the router can apply.

        In-flight requests share the router's one reading thread: a round of reading
        gives each one reply message, at most a snapshot chunk of
        :data:`REPLY_BLOCKS` blocks, applied at about :data:`APPLY_BLOCKS_PER_S`. The
        round must stay well within a request's inactivity deadline
        (``stream.replay_timeout``; :data:`ROUND_SHARE` of it) and the publisher's
        patience with a client that does not read, or requests time out because
        others are ahead of them: ``replay_timeout * ROUND_SHARE * APPLY_BLOCKS_PER_S
        / REPLY_BLOCKS`` (61 at the defaults). More in flight would not go faster:
        the router's apply speed is the bound.
        """
        if self.max_requests is not None:
            return min(self.max_requests, self.max_replays)
        fit = self.round_s() * APPLY_BLOCKS_PER_S / REPLY_BLOCKS
        return max(1, min(self.max_replays, int(fit)))

    def request_ceiling(self) -> int:
        """The most requests in flight the pacing may grow to: :meth:`request_limit` is
        where it starts, and it follows the router's rounds of reading from there (up
        while they take under a quarter of :meth:`round_s` and requests wait, down when
        one takes longer than :meth:`round_s`). ``max_requests`` fixes it."""
        if self.max_requests is not None:
            return self.request_limit()
        return self.max_replays

    def round_s(self) -> float:
        """The longest a round of reading over every request in flight may take:
        :data:`ROUND_SHARE` of ``stream.replay_timeout``."""
        return self.stream.replay_timeout * ROUND_SHARE

    def source_request_limit(self) -> int:
        """Requests in flight at once to one source: ``max_requests_per_source``, or a
        quarter of :meth:`request_limit`.

        Serving a chunk costs an engine about half what applying it costs the router
        (snapshots: 0.54 us a block served against about 1 us applied), so a source
        with a quarter of the router's requests spends at most about 14% of a core
        serving them, however many of its ranks ask, and at least four engines share
        the router's turns when they all ask.
        """
        if self.max_requests_per_source is not None:
            return min(self.max_requests_per_source, self.request_limit())
        return max(1, self.request_limit() // SOURCE_SHARE)


APPLY_BLOCKS_PER_S = 1_000_000
"""Blocks a router applies per second from snapshots, rounded down for a busy host (a
cold start measured 20.5 M blocks in 14.8 s, 1.4 M/s, on the 2-core machine of
``benchmarks/README.md``)."""
REPLY_BLOCKS = SNAPSHOT_CHUNK_BLOCKS
"""The largest reply message, in blocks: a kvwire publisher's snapshot chunk
(``PublisherConfig.snapshot_chunk_blocks``; a replayed batch is smaller)."""
ROUND_SHARE = 0.25
"""The part of ``replay_timeout`` one round over every in-flight request may take."""
SOURCE_SHARE = 4
"""One source gets at most this fraction (1 / SOURCE_SHARE) of the requests in flight."""
