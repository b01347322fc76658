"""A :class:`~kvwire.subscriber.RankStream`'s batches: judged against the position, applied,
held while a gap is filled, drained. Functions of the stream, which keeps the state.

- In order: the expected seq is applied; a later one is held (bounded) while
  a replay fills the hole. A hole no replay fills is lost: the rank is
  cleared and PARTIAL (``loss_policy``), or, from a publisher that serves
  snapshots (epoch ``.snap``), a snapshot makes it exact again, as does a
  later ``AllBlocksCleared``.
- Payloads: with ``payloads=True`` a batch the native check vouches for (it
  reads just its event count, rank and whether it clears, and vouches that
  ``decode_batch`` accepts it) is applied as :class:`ApplyPayload`; any other
  is decoded and applied as :class:`Apply`. Both are judged before the stream
  moves, under the same rules and counters.
- Limits: a jump past ``max_seq_jump`` is a broken stream, not that many lost
  seqs; a frame that does not parse or decode is counted and its seq treated
  as lost.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from kvwire.subscriber import recovery
from kvwire.subscriber.actions import Apply, ApplyPayload
from kvwire.subscriber.phases import Event, Phase
from kvwire.subscriber.state import RankState
from kvwire.wire import AllBlocksCleared, KVEventBatch, decode_batch, split_topic
from kvwire.wire.framing import Frame

if TYPE_CHECKING:
    from kvwire.subscriber.stream import RankStream

Facts = tuple[int, int | None, bool]
"""What the stream reads of a batch: its events, its data_parallel_rank, whether it clears."""
Judged = KVEventBatch | Facts
"""A payload judged well formed: decoded, or vouched for by the native check."""


def _native_check() -> Callable[[Frame, int, int, int, int], Facts | None] | None:
    try:
        from kvwire.subscriber._recv import check_batch
    except ImportError:  # not built: every payload is decoded
        return None
    return check_batch


CHECK = _native_check()


def has_clear(judged: Judged) -> bool:
    if type(judged) is tuple:
        return judged[2]
    return any(type(e) is AllBlocksCleared for e in judged.events)  # type: ignore[union-attr]


def events(judged: Judged) -> int:
    return judged[0] if type(judged) is tuple else len(judged.events)  # type: ignore[union-attr]


def judge(s: RankStream, payload: Frame) -> Judged | None:
    """What the stream reads of a payload, or None (counted) if it does not decode."""
    check = s._check
    if check is not None:
        try:
            facts = check(payload, *s._check_limits)
        except Exception:  # only out of memory: decode it
            facts = None
        if facts is not None:
            return facts
    try:
        return decode_batch(payload, s._limits)
    except Exception:  # WireError, or anything a hostile payload provokes
        s.counters.decode_errors += 1
        return None


def apply_action(seq: int, judged: Judged, payload: Frame) -> Apply | ApplyPayload:
    if type(judged) is tuple:
        return ApplyPayload(seq, payload)
    return Apply(seq, judged)  # type: ignore[arg-type]


def apply(s: RankStream, seq: int, batch: Judged, payload: Frame, replayed: bool) -> None:
    s._out.append(apply_action(seq, batch, payload))
    s._clean = False
    c = s.counters
    c.batches += 1
    c.events += events(batch)
    r = batch[1] if type(batch) is tuple else batch.data_parallel_rank  # type: ignore[union-attr]
    if r is not None and r != s.rank and s.rank is not None:
        c.rank_mismatches += 1
    t = s._seq
    if replayed:
        c.replayed += 1
        t.replayed(seq, payload)
    t.advance(seq, payload)
    if not s._exact and has_clear(batch):
        s._exact = True
        s._req.recovered()
        s._reason = f"AllBlocksCleared at seq {seq}: the view is exact again"


def drain_held(s: RankStream) -> None:
    t = s._seq
    held = t.held
    while held and not s._holding():
        seq = held.peekitem(0)[0]
        if seq > t.expected:
            return
        batch, payload = held.popitem(0)[1]
        if seq == t.expected:
            apply(s, seq, batch, payload, replayed=False)


def skip_to(s: RankStream, target: int, why: str, *, drain: bool = True) -> None:
    """Give up on every seq below ``target`` not yet applied, then go on from there.

    Callers pass a ``target`` at or below the first held batch, except a
    replay that showed the publisher no longer has what is below it: held
    live copies there cannot be confirmed and are dropped with the rest.
    """
    skipped = s._seq.skip_to(target)
    if skipped:
        if skipped > s.config.max_seq_jump:
            s.counters.seq_jumps += 1  # not a count of anything real
        else:
            s.counters.seqs_lost += skipped
        s._lose_view(why)
    if drain:
        drain_held(s)


def follow_held(s: RankStream, why: str) -> None:
    """A loss given up on: follow live from the first batch held (else the horizon)."""
    s._move(Event.FOLLOW)
    skip_to(s, s._seq.lowest_held(), why)


def live_first(s: RankStream, topic: bytes, seq: int, payload: Frame) -> None:
    """A live batch before the connection event: the data beat it."""
    s._on_connect()
    on_live(s, topic, seq, payload)


def on_live(s: RankStream, topic: bytes, seq: int, payload: Frame) -> None:
    c = s.counters
    t = s._seq
    if topic != s._topic and not _live_topic(s, topic):
        return
    batch = judge(s, payload)
    if seq < t.expected:
        if batch is None or _behind(s, seq, payload):
            return  # a bad frame never decides a restart
    elif seq - t.horizon > s.config.max_seq_jump:
        if batch is None:
            return
        _break(s, seq, f"live seq jumped from {t.horizon - 1} to {seq}")

    # From here seq >= expected, in the current (possibly just restarted) stream.
    if seq > t.horizon:
        c.gaps += 1
    t.last_live = seq  # even a bad payload had its place in the ordered stream
    t.see(seq)
    _resume_following(s)
    t.live_copy(seq, payload)  # replayed copies up to seq are no longer awaited
    if batch is None:
        if not s.config.replay:
            skip_to(s, seq + 1, f"batch {seq} undecodable and no replay endpoint")
    elif seq == t.expected and not s._holding():
        apply(s, seq, batch, payload, replayed=False)
        drain_held(s)
    else:
        t.held[seq] = (batch, payload)
        if not s.config.replay:
            skip_to(s, seq, f"batches {t.expected}..{seq - 1} lost, no replay endpoint")
        elif len(t.held) > s.config.max_held or t.held.nbytes > s.config.max_held_bytes:
            _held_overflow(s)
    recovery.ensure_request(s)


def _live_topic(s: RankStream, topic: bytes) -> bool:
    """A live message on a topic other than the followed one: False, it is dropped."""
    epoch = split_topic(topic)[1]
    if epoch is not None and epoch in s._retired:
        # A life the replay socket showed was left behind (a half-open
        # connection, a proxy between).
        s.counters.old_life += 1
        return False
    if epoch is not None and s._epoch is not None and epoch != s._epoch:
        why = f"publisher epoch changed from {s._epoch!r} to {epoch!r}"
        s._restart(why, 0, (topic, epoch))
    else:
        s._adopt((topic, epoch))
    return True


def _behind(s: RankStream, seq: int, payload: Frame) -> bool:
    """A good live batch below the expected seq: True when that is all it was (the
    live copy of a replayed batch, or a late one); False when it restarted or broke
    the stream, which goes on from it."""
    t = s._seq
    if seq <= t.last_live:
        _restart_or_break(s, seq, f"live seq went back from {t.last_live} to {seq}")
        return False
    same = t.live_copy(seq, payload)
    if same is not None:
        if not same:
            _restart_or_break(s, seq, f"live batch {seq} differs from its replayed copy")
            return False
        s.counters.duplicates += 1
    elif t.is_lost(seq):
        s.counters.late += 1
    else:
        _restart_or_break(s, seq, f"live seq {seq} below expected {t.expected}")
        return False
    t.last_live = seq
    _resume_following(s)
    return True


def _resume_following(s: RankStream) -> None:
    """A live batch shows where the stream is: waiting for one, or silence, ends."""
    if s._phase is Phase.AWAIT_LIVE or s._phase is Phase.STALE:
        s._move(Event.FOLLOW)
    elif isinstance(s._req.active, recovery.Replay):
        s._req.active.claim = RankState.SYNCED  # a probe of a stale rank


def _held_overflow(s: RankStream) -> None:
    s.counters.held_overflows += 1
    why = f"held buffer full ({s.config.max_held} batches, {s.config.max_held_bytes} bytes)"
    if isinstance(s._req.active, recovery.Snapshot):
        recovery.snapshot_failed(s, why)
    elif s._holding():
        # Still unverified after a (re)connect: as good as a failed replay.
        s._req.abandon()
        recovery.give_up(s, why, Phase.STARTING)
    else:
        s._req.abandon()
        follow_held(s, why)


def _restart_or_break(s: RankStream, seq: int, why: str) -> None:
    if s._epoch is None:
        s._restart(f"{why}: publisher restarted", 0, None)
    else:
        _break(s, seq, f"{why} under the same epoch")


def _break(s: RankStream, seq: int, why: str) -> None:
    """A seq no restart explains: clear, then follow the stream from ``seq``."""
    s.counters.seq_jumps += 1
    s._req.abandon()
    s._seq.jump(seq)
    s._move(Event.FOLLOW)
    s._lose_view(why)
