"""A :class:`~kvwire.subscriber.RankStream`'s replay and snapshot requests, their replies,
retries and backoff. Functions of the stream, which keeps the state, and
:class:`Requests`, the stream's request half: the replay or snapshot out (at most
one, with its token and deadlines), whether an abandoned one may still be
answered, the retries of a failing replay and the backoff of failing recoveries
(snapshots are never abandoned, only spaced). It decides nothing about the phase.

- An anchored replay (reconnect, idle probe) proves continuity only by
  showing the anchor byte for byte; one whose anchor left the buffer leaves
  the rank PARTIAL under any epoch (a configured epoch survives a restart).
- An empty reply proves nothing: none at or after what was asked although a
  later seq was seen leaves the rank PARTIAL, never SYNCED behind live. (A
  publisher without epoch is first asked for its whole buffer: a buffer
  always holds the latest batch, so one that lies below the anchor proves a
  restart.)
- A snapshot proves the publisher's next seq when served: seqs seen at or
  above it before it was asked are not this publisher's any more, and the
  horizon comes down. Every snapshot counts toward the backoff
  (``backoff_initial`` doubling up to ``snapshot_backoff_max``) until the rank
  is SYNCED, applied or not, so a recovery that does not end in sequence
  never loops at network speed; one is asked for as long as the view is not
  exact. A count announced in chunk 0 becomes a :class:`Reserve` first.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import TYPE_CHECKING

from kvwire.subscriber import batches
from kvwire.subscriber.actions import ClearRank, RequestReplay, RequestSnapshot, Reserve
from kvwire.subscriber.phases import Event, Phase
from kvwire.subscriber.state import RankState, StreamConfig
from kvwire.wire import (
    ReplayEnd,
    ReplayItem,
    ReplayReply,
    SnapshotChunk,
    SnapshotEnd,
    SnapshotRefused,
    parse_replay_reply,
    split_topic,
)
from kvwire.wire.framing import Frame

if TYPE_CHECKING:
    from kvwire.subscriber.batches import Judged
    from kvwire.subscriber.stream import RankStream


class _Request:
    """What every request out has: its token, its deadlines, the horizon when sent."""

    __slots__ = ("deadline", "hard_deadline", "horizon_at_send", "token")
    _overall = "replay_deadline"  # the StreamConfig field bounding the whole reply

    def __init__(self, token: int, now: float, config: StreamConfig, horizon: int) -> None:
        self.token = token
        self.horizon_at_send = horizon
        self.begin(now, config)

    def begin(self, now: float, config: StreamConfig) -> None:
        """Sent at ``now``: the overall deadline and the first message's run from here."""
        self.hard_deadline = now + getattr(config, self._overall)
        self.heard(now, config)

    def heard(self, now: float, config: StreamConfig) -> None:
        """A message of the reply arrived at ``now``: the next is due ``replay_timeout`` on."""
        self.deadline = min(now + config.replay_timeout, self.hard_deadline)


class Replay(_Request):
    """One outstanding replay request and what its reply showed so far."""

    __slots__ = (
        "anchor_payload",
        "anchored",
        "claim",
        "first",
        "identify",
        "kind",
        "last_seq",
        "progressed",
        "start",
        "undecodable",
        "verified",
    )

    def __init__(
        self,
        token: int,
        kind: Phase,
        start: int,
        anchor_payload: Frame | None,
        now: float,
        config: StreamConfig,
        horizon: int,
    ) -> None:
        super().__init__(token, now, config, horizon)
        self.kind = kind
        self.start = start
        self.anchored = anchor_payload is not None
        self.anchor_payload = anchor_payload
        self.first = True  # no item at or above start seen yet
        self.progressed = False  # applied at least one batch
        self.verified = False  # the anchor matched
        self.last_seq = -1  # the highest seq in the reply so far
        self.undecodable = -1  # a seq whose buffered copy does not decode
        self.claim = RankState.SYNCED  # what an exact rank reads while this probe is out
        self.identify = -1  # asking the whole buffer after an empty reply from this anchor


def _backoff(initial: float, cap: float, failures: int) -> float:
    """The wait after ``failures`` (>= 1) in a row: ``initial`` doubling, at most ``cap``."""
    return min(cap, initial * 2.0 ** min(failures - 1, 64))


class Snapshot(_Request):
    """One outstanding snapshot request and the chunks read so far."""

    __slots__ = ("blocks", "chunks", "next_seq")
    _overall = "snapshot_deadline"

    def __init__(self, token: int, now: float, config: StreamConfig, horizon: int) -> None:
        super().__init__(token, now, config, horizon)
        self.next_seq = -1
        self.chunks: list[tuple[Judged, Frame]] = []
        self.blocks: int | None = None  # the rank's block count, as chunk 0 announced it


class Requests:
    """The request out, its successors' freshness, retries and recovery backoff."""

    __slots__ = (
        "active",
        "fresh",
        "last_probe_at",
        "recoveries",
        "recovery_after",
        "resume",
        "retries",
        "retry_at",
        "token",
    )

    def __init__(self, resume: Phase) -> None:
        self.active: Replay | Snapshot | None = None
        self.fresh = False  # an abandoned request may still be answered
        self.token = 0
        self.retries = 0  # of the replay being retried
        self.retry_at = 0.0  # when BACKOFF asks again ...
        self.resume = resume  # ... and what
        # Snapshots asked since the rank was last SYNCED (or connected, or restarted):
        # one that was applied but did not end in sequence counts like a failed one.
        self.recoveries = 0
        self.recovery_after = 0.0  # no snapshot is asked before (the last one's backoff)
        self.last_probe_at = 0.0

    def replay(
        self,
        kind: Phase,
        start: int,
        anchor_payload: Frame | None,
        now: float,
        config: StreamConfig,
        horizon: int,
    ) -> tuple[Replay, RequestReplay]:
        """A replay from ``start`` (anchored: ``anchor_payload`` is the batch there)."""
        self.token += 1
        r = Replay(self.token, kind, start, anchor_payload, now, config, horizon)
        self.active = r
        fresh, self.fresh = self.fresh, False
        return r, RequestReplay(start, self.token, fresh)

    def snapshot(self, now: float, config: StreamConfig, horizon: int) -> RequestSnapshot:
        """A snapshot; it counts toward the recovery backoff until the rank is SYNCED."""
        self.token += 1
        self.active = Snapshot(self.token, now, config, horizon)
        fresh, self.fresh = self.fresh, False
        self.recoveries += 1
        return RequestSnapshot(self.token, fresh)

    def snapshot_ended(self, now: float, config: StreamConfig) -> None:
        """A snapshot failed, or was applied: the next one waits its backoff (never
        abandoned: a publisher that can serve one is asked again, less and less often)."""
        delay = _backoff(config.backoff_initial, config.snapshot_backoff_max, self.recoveries)
        self.recovery_after = now + delay

    def snapshot_allowed(self, now: float) -> bool:
        """Whether another snapshot may be asked now (its backoff has passed)."""
        return now >= self.recovery_after

    def waiting(self, token: int) -> bool:
        """Request ``token`` waits for its turn to be sent: no deadline runs meanwhile."""
        r = self.active
        if r is None or r.token != token:
            return False
        r.deadline = r.hard_deadline = math.inf
        return True

    def sent(self, token: int, now: float, config: StreamConfig) -> bool:
        """Request ``token`` was sent at ``now`` (after waiting): its deadlines start here."""
        r = self.active
        if r is None or r.token != token:
            return False
        r.begin(now, config)
        return True

    def recovered(self) -> None:
        """The rank is exact and in sequence: the recovery backoff starts over."""
        self.recoveries = 0
        self.recovery_after = 0.0

    def abandon(self) -> None:
        """Stop waiting for the request out; a later one goes on a fresh socket."""
        if self.active is not None:
            self.active = None
            self.fresh = True

    def drop(self) -> None:
        """Forget whatever was asked (a bug met an input): the next request goes fresh."""
        self.active = None
        self.fresh = True

    def answered(self) -> None:
        """The request out was answered in full: nothing more of it can come."""
        self.active = None

    def backoff(self, now: float, config: StreamConfig, resume: Phase) -> bool:
        """One more retry of a failing replay, asked at :attr:`retry_at`; False: no more."""
        self.retries += 1
        if self.retries > config.replay_retries:
            return False
        self.retry_at = now + _backoff(config.backoff_initial, config.backoff_max, self.retries)
        self.resume = resume
        return True


_ASK = {
    Phase.STARTING: Event.ASK_START,
    Phase.REPLAYING: Event.ASK_GAP,
    Phase.PROBING: Event.ASK_PROBE,
}  # the event that asking a replay of each kind is


def ask_replay(s: RankStream, kind: Phase, anchored: bool | None, start: int | None = None) -> None:
    """Send a replay request; ``anchored=None``: anchored when a batch was applied.

    An unanchored request starts at the expected seq, or ``start``.
    """
    t = s._seq
    if anchored is None:
        anchored = t.anchor_seq >= 0
    if start is None or anchored:
        start = t.anchor_seq if anchored else t.expected
    req = s._req
    r, action = req.replay(
        kind, start, t.anchor_payload if anchored else None, s._now, s.config, t.horizon
    )
    s._out.append(action)
    if kind is Phase.PROBING:
        # A probe proves nothing before it ends: the rank reads what it did.
        if s._phase is Phase.STALE:
            r.claim = RankState.STALE
        elif s._phase is Phase.AWAIT_LIVE:
            r.claim = RankState.SYNCING
        req.last_probe_at = s._now
        s.counters.probes += 1
    else:
        s.counters.replays_requested += 1
    s._move(_ASK[kind])


def ensure_request(s: RankStream) -> None:
    """After each input: ask what the stream needs, if nothing is out."""
    if not s.config.replay:
        return
    phase = s._phase
    if phase is Phase.DISCONNECTED or phase is Phase.BACKOFF:
        return
    req = s._req
    active = req.active
    if active is not None and (isinstance(active, Snapshot) or active.kind is not Phase.PROBING):
        return
    if wants_snapshot(s) and req.snapshot_allowed(s._now):
        req.abandon()
        s._out.append(req.snapshot(s._now, s.config, s._seq.horizon))
        s.counters.snapshots_requested += 1
        s._move(Event.ASK_SNAPSHOT)
        s._reason = f"{s._reason}; asking for a snapshot"
    elif s._seq.gap:
        if active is not None:  # the probe out covers the gap too
            active.kind = Phase.REPLAYING
            s._move(Event.ASK_GAP)
        else:
            ask_replay(s, Phase.REPLAYING, anchored=None)


def no_request(s: RankStream, frames: Sequence[Frame], token: int) -> None:
    """A reply while nothing is asked: of a request since abandoned."""
    assert s._req.active is None, "a request out in a phase that asks nothing"
    s.counters.stale_replies += 1


def replay_reply(s: RankStream, frames: Sequence[Frame], token: int) -> None:
    got = _reply(s, frames, token)
    if got is not None:
        r, msg, same_epoch = got
        assert isinstance(r, Replay)
        if isinstance(msg, ReplayItem):
            _replay_item(s, r, msg.seq, msg.payload, same_epoch)
        elif isinstance(msg, ReplayEnd):
            _replay_end(s, r)
        else:  # a snapshot message answering a replay request
            s.counters.decode_errors += 1
        ensure_request(s)


def _reply(
    s: RankStream, frames: Sequence[Frame], token: int
) -> tuple[Replay | Snapshot, ReplayReply, bool] | None:
    """The request a reply answers, the reply, and whether it shows the epoch
    followed; None when that is all it was (stale, unreadable, a restart)."""
    c = s.counters
    r = s._req.active
    if r is None or token != r.token:
        c.stale_replies += 1
        return None
    r.heard(s._now, s.config)
    try:
        msg = parse_replay_reply(frames)
    except Exception:
        c.decode_errors += 1
        return None
    topic = msg.topic
    epoch = split_topic(topic)[1] if topic is not None else None
    if epoch is None:
        return r, msg, False
    if s._epoch is not None and epoch != s._epoch:
        why = f"replay socket answers for epoch {epoch!r}, not {s._epoch!r}"
        s._restart(why, 0, (topic, epoch), retire=True)  # type: ignore[arg-type]
        return None
    if s._epoch is None:
        # Adopted, but what was applied before came without one: unproven.
        s._adopt((topic, epoch))  # type: ignore[arg-type]
        return r, msg, False
    return r, msg, True


def _replay_item(s: RankStream, r: Replay, seq: int, payload: bytes, same_epoch: bool) -> None:
    if seq < r.start:
        return  # not what was asked; a correct publisher never sends it
    if seq > r.last_seq:
        r.last_seq = seq
    first, r.first = r.first, False
    if first and not _first_item(s, r, seq, payload, same_epoch):
        return
    t = s._seq
    t.see(seq)
    if seq < t.expected:
        return
    if seq > t.expected:
        if first or r.undecodable == t.expected:
            # The publisher's buffer does not hold what we need: it is gone.
            batches.skip_to(
                s, seq, f"replay has no batch {t.expected}..{seq - 1} (not buffered)", drain=False
            )
        else:
            # A hole inside a reply may be the replay socket dropping frames
            # (high-water mark): ask again from exactly what is missing.
            s._req.abandon()
            ask_replay(s, Phase.REPLAYING, anchored=False)
            return
    held = t.held.get(seq)
    if held is not None and bytes(held[1]) != bytes(payload):
        if same_epoch:
            s._lose_view(f"replayed batch {seq} differs from its live copy")
        else:
            # Live and replay sockets reach two different lives of the publisher.
            s._restart(
                f"replayed batch {seq} differs from its live copy: publisher restarted", 0, None
            )
            return
    batch = batches.judge(s, payload)
    if batch is None:
        r.undecodable = seq  # seq == expected here
        return
    r.progressed = True
    if held is not None:
        del t.held[seq]
    batches.apply(s, seq, batch, payload, replayed=True)


def _first_item(s: RankStream, r: Replay, seq: int, payload: bytes, same_epoch: bool) -> bool:
    """What the first item a reply has at or above what was asked proves; False
    when that is all it was for (the anchor, or the end of this reply's use)."""
    if r.identify >= 0:
        if seq >= r.identify:
            # Not what a restart shows, nor what the same publisher would.
            s._req.abandon()
            s._lose_view(f"replay from {r.identify} came back empty, yet {seq} exists")
            _go_on(s, s._reason, Phase.STARTING)
            return False
        s._restart(
            f"replay from {r.identify} came back empty and the buffer ends below it: "
            "publisher restarted",
            0,
            None,
            ask=False,
        )
        r.identify = -1
        r.horizon_at_send = 0
    if not r.anchored:
        return True
    if seq == r.start:
        if bytes(payload) == bytes(r.anchor_payload or b""):
            r.verified = True  # same publisher: the stream goes on
        elif same_epoch:
            s._lose_view(f"replayed batch {seq} differs from the one applied")
        else:
            s._restart(
                f"replayed batch {seq} differs from the one applied: publisher restarted",
                seq + 1,
                None,
            )
        return False
    # The anchor is gone from the buffer: whether this is still the publisher
    # whose batches were applied cannot be told (under the same epoch too: a
    # publisher whose epoch is configured restarts under it).
    s._lose_view(f"replay from {r.start} no longer holds the last batch applied")
    return True


def _replay_end(s: RankStream, r: Replay) -> None:
    c = s.counters
    t = s._seq
    req = s._req
    req.answered()
    kind = r.kind
    if r.first and r.horizon_at_send > r.start:
        # Batch horizon-1 >= start was seen, yet the reply holds nothing from
        # start on: a restarted publisher, or a buffer that cannot help.
        # Either way it proves nothing.
        why = f"replay from {r.start} came back empty although batch {r.horizon_at_send - 1} exists"
        if s._epoch is None and r.anchored and (kind is Phase.STARTING or kind is Phase.PROBING):
            # A buffer always holds the publisher's latest batch: if it holds
            # any, below our anchor, the publisher restarted. Ask for all of it.
            ask_replay(s, Phase.STARTING, anchored=False, start=0)
            assert isinstance(req.active, Replay)
            req.active.identify = r.start
            s._reason = f"{why}: asking for the whole buffer"
            return
        c.replays_failed += 1
        req.retries = 0
        s._lose_view(why)
        _go_on(s, why, kind)
        return
    if t.gap:
        if r.undecodable == t.expected:
            batches.follow_held(s, f"buffered batch {t.expected} does not decode")
            return
        if r.progressed:
            req.retries = 0
            ask_replay(s, Phase.REPLAYING, anchored=None)
            return
        if r.verified:
            # Only the anchor fitted in the reply (a small per-request cap).
            ask_replay(s, Phase.REPLAYING, anchored=False)
            return
        if t.horizon > r.horizon_at_send and req.retries < s.config.replay_retries:
            req.retries += 1  # the gap grew after the request went out: ask at once
            ask_replay(s, kind if kind is not Phase.PROBING else Phase.REPLAYING, None)
            return
        retry_or_give_up(s, f"replay from {r.start} stopped before {t.expected}", kind)
        return
    req.retries = 0
    if kind is Phase.PROBING:
        if r.progressed:
            c.gaps += 1  # the lost tail of an idle stream, now filled
            c.replays_succeeded += 1
    else:
        c.replays_succeeded += 1
    if r.progressed:
        # A per-request cap may have cut the reply short: look for more.
        ask_replay(s, Phase.PROBING, anchored=None)
    elif r.verified and r.start < r.last_seq < t.expected:
        # The cap ran out on batches already given up on: ask past them.
        ask_replay(s, Phase.PROBING, anchored=False)
    else:
        s._settle()


def retry_or_give_up(s: RankStream, why: str, kind: Phase) -> None:
    cfg = s.config
    resume = Phase.STARTING if kind is Phase.STARTING else Phase.REPLAYING
    if s._req.backoff(s._now, cfg, resume):
        s._move(Event.RETRY_LATER)
        s._reason = f"{why}; retry {s._req.retries} of {cfg.replay_retries}"
        return
    give_up(s, f"{why}; gave up after {cfg.replay_retries} retries", kind)


def give_up(s: RankStream, why: str, kind: Phase) -> None:
    """The replay failed for good: lose what it was to fill, then go on."""
    s.counters.replays_failed += 1
    s._req.retries = 0
    if kind is Phase.STARTING and s._seq.anchor_seq >= 0:
        # After a reconnect: whether the publisher restarted cannot be told.
        s._lose_view(f"{why}; the publisher may have restarted")
    _go_on(s, why, kind)


def _go_on(s: RankStream, why: str, kind: Phase) -> None:
    """After a failed replay: follow live from the first batch still held, or
    wait for the next one when a start replay could not show the position."""
    if s._seq.gap:
        batches.follow_held(s, why)
    elif kind is Phase.STARTING:
        s._move(Event.WAIT_LIVE)
        s._reason = f"{why}; waiting for the next live batch"
    else:
        s._move(Event.FOLLOW)


def snapshot_reply(s: RankStream, frames: Sequence[Frame], token: int) -> None:
    got = _reply(s, frames, token)
    if got is None:
        return
    r, msg, _ = got
    assert isinstance(r, Snapshot)
    if isinstance(msg, SnapshotChunk):
        if r.next_seq < 0:
            r.next_seq = msg.next_seq
            r.blocks = msg.blocks  # chunk 0's announcement, if any
        if msg.next_seq != r.next_seq:
            snapshot_failed(s, f"chunks as of seqs {r.next_seq} and {msg.next_seq}")
        elif msg.number != len(r.chunks):
            snapshot_failed(s, f"chunk {len(r.chunks)} missing (got {msg.number})")
        elif len(r.chunks) >= s.config.max_snapshot_chunks:
            snapshot_failed(s, f"more than {s.config.max_snapshot_chunks} chunks")
        else:
            batch = batches.judge(s, msg.payload)
            if batch is None:
                snapshot_failed(s, f"chunk {msg.number} does not decode")
            else:
                r.chunks.append((batch, msg.payload))
    elif isinstance(msg, SnapshotEnd):
        if r.next_seq >= 0 and msg.next_seq != r.next_seq:
            snapshot_failed(s, f"end as of seq {msg.next_seq}, chunks as of {r.next_seq}")
        elif msg.chunks != len(r.chunks):
            snapshot_failed(s, f"{msg.chunks} chunks announced, {len(r.chunks)} received")
        else:
            _apply_snapshot(s, r, msg.next_seq)
    elif isinstance(msg, SnapshotRefused):
        snapshot_failed(s, f"refused: {msg.reason[:200]}")
    elif isinstance(msg, ReplayEnd):
        snapshot_failed(s, "the publisher answered with an empty replay")
    else:
        s.counters.decode_errors += 1
    ensure_request(s)


def _apply_snapshot(s: RankStream, r: Snapshot, next_seq: int) -> None:
    c = s.counters
    s._req.answered()
    s._req.snapshot_ended(s._now, s.config)
    c.snapshots_applied += 1
    why = f"snapshot as of seq {next_seq}"
    s._out.append(ClearRank(why))
    s._clean = True
    if r.blocks:
        # A hint to size the sink's tables, trusted no further than the bytes
        # received (a block takes at least two: its hash and a token).
        s._out.append(Reserve(min(r.blocks, sum(len(p) for _, p in r.chunks) // 2)))
    for batch, payload in r.chunks:
        s._out.append(batches.apply_action(next_seq - 1, batch, payload))
        c.events += batches.events(batch)
        s._clean = False
    s._seq.rebase(next_seq, r.horizon_at_send)
    s._exact = True
    s._reason = f"{why}: exact again, replaying what followed"
    # Whatever was published while the snapshot was served: from the buffer.
    ask_replay(s, Phase.REPLAYING, anchored=False)


def wants_snapshot(s: RankStream) -> bool:
    """The view is lost and the publisher can rebuild it."""
    cfg = s.config
    return not s._exact and cfg.snapshot and cfg.replay and s._epoch_info.snapshot


def snapshot_failed(s: RankStream, why: str) -> None:
    s.counters.snapshots_failed += 1
    s._req.abandon()
    s._req.snapshot_ended(s._now, s.config)
    why = s._reason = f"snapshot failed: {why}"
    batches.follow_held(s, why)
    if s._exact:
        s._lose_view(why)
