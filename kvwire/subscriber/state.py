"""What a rank's view is worth (its state), how it is tuned, and what it counted."""

from __future__ import annotations

import enum
from typing import Annotated

import msgspec
from msgspec import Meta

from kvwire.settings import Positive, Seconds, check_fields
from kvwire.wire.codec import DEFAULT_LIMITS, DecodeLimits

__all__ = ["LossPolicy", "RankCounters", "RankState", "RankStatus", "StreamConfig"]



class RankState(enum.Enum):
    """How far a router can trust what it was told about one rank.

    ``SYNCED``: every batch of the publisher's current stream since the view
    was last exact has been applied, in order. ``SYNCING``: the position is
    being (re)established (first contact, a gap being replayed, a reconnect,
    a disconnect). ``PARTIAL``: something was lost for good; by default the
    rank was cleared, so it holds less than the engine but nothing stale.
    ``STALE``: the view was exact at the last position the publisher proved,
    but nothing proves it is still current: a publisher that heartbeats fell
    silent for three intervals, or an idle publisher that cannot be asked (no
    replay endpoint, no heartbeats) or whose replay cannot rule out a batch
    dropped after its seq was reserved (kvwire's, heartbeats off). It may
    hold blocks the engine has since dropped; the next message settles it.
    """

    SYNCING = "syncing"
    SYNCED = "synced"
    PARTIAL = "partial"
    STALE = "stale"


class LossPolicy(enum.Enum):
    """What an unrecoverable loss does to the rank's state downstream."""

    CLEAR = "clear"
    """Clear the rank, then continue: incomplete, but never a stale block."""
    KEEP = "keep"
    """Keep what was applied and continue: more blocks, some possibly stale."""


class StreamConfig(msgspec.Struct, frozen=True, kw_only=True):
    """Tuning of one rank's sequencing; times are in seconds.

    The defaults make a rank converge well within two seconds of a fault
    ending on a loopback or LAN link. Each field's range is its annotation,
    checked however the struct is made (:func:`kvwire.settings.check_fields`).
    """

    replay: bool = True
    """Whether the publisher has a replay endpoint (otherwise every gap is a loss)."""
    max_held: Positive = 10_000
    """Later batches held while a gap is replayed; beyond this the gap is a loss."""
    max_held_bytes: Positive = 256 << 20
    """The same bound in payload bytes, so held batches cannot grow memory without
    bound whatever their size."""
    decode_limits: DecodeLimits = DEFAULT_LIMITS
    """What a batch may ask of the consumer (events, blocks, block size, tokens);
    a batch beyond them is a decode error (see :class:`kvwire.wire.codec.DecodeLimits`)."""
    replay_timeout: Seconds = 1.0
    """A replay that goes this long without a reply frame has timed out."""
    replay_retries: Annotated[int, Meta(ge=0)] = 3
    """Retries after a timeout (or a reply that stops short) before giving up."""
    backoff_initial: Seconds = 0.05
    backoff_max: Seconds = 1.0
    idle_probe: Seconds | None = 1.0
    """After this long without a live batch, ask the replay socket what was missed
    (a lost last batch, a silent restart); publishers that heartbeat are not
    probed. Where nothing can be asked (no replay endpoint, no heartbeats) the
    same silence makes the rank STALE. ``None`` disables both."""
    loss_policy: LossPolicy = LossPolicy.CLEAR
    replay_deadline: Seconds = 10.0
    """Overall limit on one replay request, however its frames trickle in: past it
    the replay has failed (no retry: a publisher that trickles will do it again)."""
    snapshot: bool = True
    """Ask a publisher whose epoch advertises snapshots (``.snap``) for one when
    the view is lost, instead of staying PARTIAL."""
    snapshot_backoff_max: Seconds = 30.0
    """The longest wait between two snapshots of a rank that is not exact. A snapshot
    that failed (refused, timed out, incomplete) or did not end in sequence is asked
    again, the wait doubling from ``backoff_initial`` up to this, for as long as the
    publisher advertises them: the rank follows live (PARTIAL) meanwhile."""
    snapshot_deadline: Seconds = 30.0
    """Overall limit on one snapshot request; past it the snapshot has failed."""
    max_snapshot_chunks: Positive = 1_000_000
    """Chunks one snapshot may have; more is a failed snapshot."""
    max_seq_jump: Positive = 1 << 32
    """A live seq more than this past the highest known is not a loss of that many
    batches but a broken stream: the rank is cleared and follows the new seq."""
    dedup_window: Positive = 65_536
    """Replayed batches remembered (seq and payload hash) until their live copy
    arrives, to tell that copy from a restarted publisher's batch."""

    def __post_init__(self) -> None:
        check_fields(self)
        if not self.backoff_initial <= min(self.backoff_max, self.snapshot_backoff_max):
            raise ValueError(
                "need backoff_initial <= backoff_max and snapshot_backoff_max, got "
                f"{self.backoff_initial}, {self.backoff_max} and {self.snapshot_backoff_max}"
            )


class RankCounters(msgspec.Struct, kw_only=True):
    """Monotonic counters of one rank (a snapshot when read through status)."""

    batches: int = 0
    """Batches applied."""
    replayed: int = 0
    """Of those, batches applied from a replay (the live copy was lost or late)."""
    events: int = 0
    """Events in the batches applied."""
    gaps: int = 0
    """Holes found in the stream (live seq jumps, lost trailing batches)."""
    seqs_lost: int = 0
    """Sequence numbers given up on (never applied); a jump past ``max_seq_jump``
    is counted in ``seq_jumps`` instead."""
    seq_jumps: int = 0
    """Live seqs that broke the stream without a restart to explain them (a jump
    past ``max_seq_jump``, a seq going back under the same epoch)."""
    replays_requested: int = 0
    replays_succeeded: int = 0
    """Replays that filled what they were asked for."""
    replays_failed: int = 0
    """Replays given up on after their retries."""
    replay_timeouts: int = 0
    probes: int = 0
    """Replays asked while idle, to find lost trailing batches or a silent restart."""
    snapshots_requested: int = 0
    snapshots_applied: int = 0
    snapshots_failed: int = 0
    """Snapshots refused, incomplete, of another epoch, undecodable or too slow."""
    stale: int = 0
    """Times the rank went STALE."""
    resyncs: int = 0
    """Unrecoverable losses: the rank was cleared (or kept, by policy) and went on."""
    restarts: int = 0
    """Publisher restarts detected."""
    reconnects: int = 0
    silent_reconnects: int = 0
    """Fresh connections asked for because a heartbeating publisher went silent."""
    decode_errors: int = 0
    """Frames that could not be parsed or decoded (each counted, then treated as lost)."""
    rank_mismatches: int = 0
    """Batches whose envelope names a rank other than the endpoint's."""
    duplicates: int = 0
    """Live copies of batches already applied from a replay."""
    late: int = 0
    """Live batches that arrived after their seq was given up on."""
    old_life: int = 0
    """Live messages of a publisher life the replay socket showed was left behind,
    dropped: a half-open connection or a proxy delivering late."""
    stale_replies: int = 0
    """Replay frames answering a request that was since abandoned."""
    held_overflows: int = 0
    sink_errors: int = 0
    """Times the sink raised while applying or clearing this rank."""
    internal_errors: int = 0
    """Unexpected exceptions inside the stream (bugs): the rank was cleared and
    went on, and the actions queued before were still returned."""


class RankStatus(msgspec.Struct, frozen=True, kw_only=True):
    """One rank's state, position and counters at a point in time."""

    worker_id: str
    rank: int
    endpoint: str
    replay_endpoint: str | None
    state: RankState
    reason: str
    """Why the rank is in its state (the last transition's cause)."""
    connected: bool
    expected_seq: int
    """The next seq to apply."""
    held: int
    """Later batches held while a gap is replayed."""
    replay_pending: bool
    counters: RankCounters
