"""The per-rank sequencing state machine: sans-I/O, fed frames and time, returns actions.

One :class:`RankStream` follows one publisher socket (one engine, one rank). It
owns no socket and reads no clock: the transport feeds it live messages,
replay replies, connection events and the time, and carries out the
:mod:`~kvwire.subscriber.actions` it returns, so every rule is testable with
lists of frames. The wire is ``docs/wire.md``.

The state is a :class:`~kvwire.subscriber.phases.Phase` (moved only by
:data:`~kvwire.subscriber.phases.EVENTS`; each input handled by the method
:data:`~kvwire.subscriber.phases.HANDLERS` names), the position
(:class:`~kvwire.subscriber.seq.SeqTracker`), what was asked
(:class:`~kvwire.subscriber.requests.Requests`), the publisher life followed
(epoch and topic, changed with the position in ``_adopt`` only) and whether
the view is *exact*. The state a router reads, and whether the fast path
applies, are derived once per input (``_finish``).

Rules
-----

- In order: the expected seq is applied; a later one is held (bounded) while
  a replay fills the hole. A hole no replay fills is lost: the rank is
  cleared and PARTIAL (``loss_policy``), or, from a publisher that serves
  snapshots (epoch ``.snap``), a snapshot makes it exact again, as does a
  later ``AllBlocksCleared``.
- Restarts: a changed epoch (``docs/wire.md`` section 6) on a live message or
  a reply is one. Without an epoch, a live seq that goes back or a replayed
  anchor (the last batch applied) that differs byte for byte is the guess;
  under an unchanged epoch either is a broken stream (cleared, followed). A
  new epoch shown by a reply retires the old one: its late live messages are
  dropped (``old_life``). One seen only live retires nothing (a late message
  of a life never followed reads the same; the replay settles it).
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
- Silence: a heartbeating publisher (epoch ``.hb``) sends the next seq at
  least every 1.5 intervals (``kvwire.wire.heartbeat``): 2.5 silent intervals
  ask a fresh connection (once a silence), 3.5 make the rank STALE. Without
  heartbeats the rank is probed after ``idle_probe``: the engines' publishers
  assign a seq as they send, so a probe proves the tail; kvwire's (epoch
  ``kvw1.``) reserve one before queueing, so a batch dropped at the end of a
  burst leaves no trace and the rank is STALE until a live batch. Without
  replay and heartbeats silence makes it STALE too.
- Payloads: with ``payloads=True`` a batch the native check vouches for (it
  reads just its event count, rank and whether it clears, and vouches that
  ``decode_batch`` accepts it) is applied as :class:`ApplyPayload`; any other
  is decoded and applied as :class:`Apply`. Both are judged before the stream
  moves, under the same rules and counters.
- Limits: a request has an overall deadline however its frames trickle; a
  jump past ``max_seq_jump`` is a broken stream, not that many lost seqs; a
  frame that does not parse or decode is counted and its seq treated as
  lost. No input raises; the actions queued before a bug are returned.

The transport feeds a connection event before any reply it reads later, and
the live batches read before a disconnect before the disconnect.

Not detectable: a publisher without epoch or replay endpoint that restarted
while its first batches were missed, with new seqs that continue the old
ones; nor a late live message of an old life with the new life's topic (no
epoch, or the same one), which reads as the next batch or one to wait for.
"""

from __future__ import annotations

import collections
from collections.abc import Callable, Sequence

import msgspec

from kvwire.subscriber.actions import (
    Action,
    Apply,
    ApplyPayload,
    ClearRank,
    Reconnect,
    Reserve,
    StateChanged,
)
from kvwire.subscriber.phases import EVENTS, HANDLERS, TRANSITIONS, Event, Input, Phase
from kvwire.subscriber.requests import Replay, Requests, Snapshot
from kvwire.subscriber.seq import SeqTracker, StreamPosition
from kvwire.subscriber.state import LossPolicy, RankCounters, RankState, RankStatus, StreamConfig
from kvwire.wire import (
    AllBlocksCleared,
    Epoch,
    KVEventBatch,
    ReplayEnd,
    ReplayItem,
    ReplayReply,
    SnapshotChunk,
    SnapshotEnd,
    SnapshotRefused,
    decode_batch,
    parse_epoch,
    parse_replay_reply,
    split_topic,
)
from kvwire.wire.framing import KVWIRE_EPOCH
from kvwire.wire.heartbeat import MAX_SILENCE

__all__ = ["EVENTS", "HANDLERS", "TRANSITIONS", "Event", "Input", "Phase", "RankStream"]

Frame = bytes | bytearray | memoryview
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


_CHECK = _native_check()

_RETIRED_EPOCHS = 8  # publisher lives left behind whose late live messages are dropped
# Silence (in heartbeat intervals) after which a fresh connection is tried (once a
# silence), and after which the rank is STALE: one and two intervals past the longest
# a healthy heartbeating publisher is silent (kvwire.wire.heartbeat).
_RECONNECT_HEARTBEATS = MAX_SILENCE + 1
_STALE_HEARTBEATS = MAX_SILENCE + 2


_ASK = {
    Phase.STARTING: Event.ASK_START,
    Phase.REPLAYING: Event.ASK_GAP,
    Phase.PROBING: Event.ASK_PROBE,
}  # the event that asking a replay of each kind is
_SYNCED_PHASES = frozenset({Phase.FOLLOWING, Phase.PROBING})
_IDLE_PHASES = frozenset({Phase.FOLLOWING, Phase.STALE, Phase.AWAIT_LIVE})  # probes are made


def _has_clear(judged: Judged) -> bool:
    if type(judged) is tuple:
        return judged[2]
    return any(type(e) is AllBlocksCleared for e in judged.events)  # type: ignore[union-attr]


def _events(judged: Judged) -> int:
    return judged[0] if type(judged) is tuple else len(judged.events)  # type: ignore[union-attr]


class RankStream:
    """Sequencing, gap repair, restart detection and snapshots for one publisher rank.

    ``rank`` is the rank the endpoint belongs to; batches whose envelope names
    another are applied (the endpoint decides) and counted. Every method
    takes ``now`` (seconds, monotonic) and returns the actions to carry out,
    in order; none raises on bad input. ``payloads=True``: a batch the native
    check vouches for is applied as :class:`ApplyPayload` (its bytes, for a
    :class:`~kvwire.subscriber.PayloadSink`), any other as :class:`Apply`.
    """

    def __init__(
        self, rank: int | None = None, config: StreamConfig | None = None, *, payloads: bool = False
    ) -> None:
        self.rank = rank
        self.config = config if config is not None else StreamConfig()
        self.counters = RankCounters()
        self._out: list[Action] = []
        self._now = 0.0
        self._phase = Phase.DISCONNECTED
        self._seq = SeqTracker(self.config.dedup_window)
        self._req = Requests(Phase.REPLAYING)
        self._exact = True  # nothing lost since the view was last whole
        self._clean = True  # nothing applied since the last clear
        self._ever_connected = False
        self._limits = lim = self.config.decode_limits
        self._check = _CHECK if payloads else None
        self._check_limits = (lim.max_events, lim.max_blocks, lim.max_block_size, lim.max_tokens)
        # The publisher life followed: its topic and epoch (None: it sends none), and the
        # epochs of lives the replay socket showed were left behind.
        self._topic: bytes | None = None
        self._epoch: bytes | None = None
        self._epoch_info = Epoch(b"")
        self._retired: collections.deque[bytes] = collections.deque(maxlen=_RETIRED_EPOCHS)
        self._last_live_at = 0.0
        self._reconnected_after = -1.0  # the silence (by its start) a reconnect was asked for
        self._state = RankState.SYNCING
        self._reason = "waiting for first contact"
        self._fast = False  # SYNCED, in sequence, nothing held: live() may take its fast path
        self._due: float | None = None  # next_deadline() as of the last slow input

    # --- reading ----------------------------------------------------------------

    @property
    def state(self) -> RankState:
        return self._state

    @property
    def phase(self) -> Phase:
        """Where the stream is (see the module's table)."""
        return self._phase

    @property
    def reason(self) -> str:
        """Why the rank is in its current state."""
        return self._reason

    @property
    def expected_seq(self) -> int:
        """The next seq to apply."""
        return self._seq.expected

    @property
    def held(self) -> int:
        """Later batches held while a gap is filled."""
        return len(self._seq.held)

    @property
    def held_bytes(self) -> int:
        """Payload bytes of the :attr:`held` batches."""
        return self._seq.held.nbytes

    @property
    def is_connected(self) -> bool:
        return self._phase is not Phase.DISCONNECTED

    @property
    def replay_pending(self) -> bool:
        """A replay (a probe included) or snapshot is out, or one is due after a backoff."""
        return self._req.active is not None or self._phase is Phase.BACKOFF

    @property
    def epoch(self) -> Epoch | None:
        """The publisher's epoch as last seen (None: it sends none)."""
        return self._epoch_info if self._epoch is not None else None

    def status(
        self, worker_id: str, rank: int, endpoint: str, replay_endpoint: str | None
    ) -> RankStatus:
        """A snapshot of state, position and counters."""
        return RankStatus(
            worker_id=worker_id,
            rank=rank,
            endpoint=endpoint,
            replay_endpoint=replay_endpoint,
            state=self._state,
            reason=self._reason,
            connected=self.is_connected,
            expected_seq=self._seq.expected,
            held=len(self._seq.held),
            replay_pending=self.replay_pending,
            counters=msgspec.structs.replace(self.counters),
        )

    def silence_deadline(self) -> float | None:
        """:meth:`next_deadline` while that is only a heartbeating publisher's silence.

        In sequence with nothing asked, the only deadlines are the silence ones,
        which every live message moves: a transport following many ranks may
        check them now and then (well before they fall due) rather than keep a
        timer per rank. None in any other case.
        """
        if not self._fast or self._req.active is not None or self._epoch_info.heartbeat_s is None:
            return None
        due = self._reconnect_due_at()
        return due if due is not None else self._stale_due_at()

    def next_deadline(self) -> float | None:
        """The earliest time :meth:`tick` has something to do (None: nothing timed)."""
        due = self.silence_deadline()
        if due is not None:
            return due
        active = self._req.active
        due = active.deadline if active is not None else None
        for t in (
            self._req.retry_at if self._phase is Phase.BACKOFF else None,
            self._probe_due_at(),
            self._stale_due_at(),
            self._snapshot_due_at(),
            self._reconnect_due_at(),
        ):
            if t is not None and (due is None or t < due):
                due = t
        return due

    # --- inputs -----------------------------------------------------------------

    def live(self, frames: Sequence[Frame], now: float) -> list[Action]:
        """A message from the SUB socket: ``[topic, seq, payload]``."""
        self._last_live_at = now
        try:
            topic, seq_frame, payload = frames
        except ValueError:
            seq_frame = b""
        if len(seq_frame) != 8:
            self.counters.decode_errors += 1  # no seq to go by: the next batch shows the hole
            return []
        seq = int.from_bytes(seq_frame, "big")
        t = self._seq
        if self._fast and seq == t.expected and topic == self._topic:
            # The common case: the next batch, nothing pending, view exact.
            action: Apply | ApplyPayload
            try:
                check = self._check
                facts = None if check is None else check(payload, *self._check_limits)
                if facts is not None:
                    n, r, _ = facts
                    action = ApplyPayload(seq, payload)
                else:
                    batch = decode_batch(payload, self._limits)
                    n, r = len(batch.events), batch.data_parallel_rank
                    action = Apply(seq, batch)
            except Exception:  # counted on the slow path
                pass
            else:
                c = self.counters
                c.batches += 1
                c.events += n
                if r != self.rank and r is not None and self.rank is not None:
                    c.rank_mismatches += 1
                self._clean = False
                t.follow(seq, payload)
                return [action]
        return self._step(now, Input.LIVE, bytes(topic), seq, payload)

    def beat_key(self) -> tuple[bytes, int, int] | None:
        """What the next heartbeats must carry to be taken by :meth:`beats`, or None.

        ``(topic, expected seq, rank or -1 for any)``: while the stream is in
        sequence with nothing pending, a heartbeat (an empty batch of this rank
        on the next seq and topic) changes nothing but the position, so a
        reader may count a run of them instead of passing each to :meth:`live`
        (:func:`kvwire.subscriber.receive.drain_beats`).
        """
        topic, rank = self._topic, self.rank
        if not self._fast or topic is None or (rank is not None and rank < 0):
            return None
        return topic, self._seq.expected, -1 if rank is None else rank

    def beats(self, count: int, payload: bytes, now: float) -> None:
        """``count`` heartbeats matching :meth:`beat_key` arrived, the last one ``payload``.

        The same state as ``count`` :meth:`live` calls with them, whose only
        actions would be Apply of empty batches: none are returned (a sink has
        nothing to do with an empty batch).
        """
        if count < 1 or not self._fast:
            raise ValueError("beats() takes the heartbeats beat_key() allowed, just read")
        self._last_live_at = now
        self.counters.batches += count
        self._clean = False
        self._seq.follow(self._seq.expected + count - 1, payload)

    def replay_reply(self, frames: Sequence[Frame], token: int, now: float) -> list[Action]:
        """A message read from the replay socket, with the token of its request."""
        return self._step(now, Input.REPLY, frames, token)

    def connected(self, now: float) -> list[Action]:
        """The SUB socket (re)connected to the publisher (its subscription is on its way)."""
        return self._step(now, Input.CONNECT)

    def disconnected(self, now: float) -> list[Action]:
        """The SUB socket lost its connection: batches sent meanwhile are lost."""
        return self._step(now, Input.DISCONNECT)

    def tick(self, now: float) -> list[Action]:
        """Time passed: replay timeouts and deadlines, retries, idle probes, heartbeats."""
        due = self._due  # never later than next_deadline(): live batches only delay it
        if due is None or now < due:
            return []
        if self._fast:  # live batches moved it (silence deadlines): nothing else is due
            due = self._due = self.next_deadline()
            if due is None or now < due:
                return []
        return self._step(now, Input.TICK)

    def request_waiting(self, token: int) -> None:
        """The transport holds request ``token`` until its turn (requests are paced):
        it cannot time out meanwhile; :meth:`request_sent` starts its deadlines."""
        if self._req.waiting(token):
            self._due = self.next_deadline()

    def request_sent(self, token: int, now: float) -> None:
        """The transport sent request ``token``, which waited its turn, at ``now``."""
        if self._req.sent(token, now, self.config):
            self._due = self.next_deadline()

    def sink_failed(self, now: float, reason: str) -> list[Action]:
        """The sink raised while applying a batch: its view of the rank is suspect."""
        return self._step(now, Input.SINK_FAILED, reason)

    def position(self) -> StreamPosition | None:
        """Where the stream is, for a checkpoint or a clone; None unless the view is exact
        and in sequence with nothing held (SYNCED, as the fast path needs).

        A rank without a position is left out and starts cold. Take it at the
        same instant as the sink's contents for the rank.
        """
        t = self._seq
        if not self._fast or (t.anchor_seq < 0 < t.expected and self._epoch is None):
            return None  # (a position no replay could anchor, from a publisher without epoch)
        return StreamPosition(
            topic=self._topic or b"",
            epoch=self._epoch,
            next_seq=t.expected,
            anchor_seq=t.anchor_seq,
            anchor=bytes(t.anchor_payload) if t.anchor_seq >= 0 else b"",
        )

    def resume(self, pos: StreamPosition) -> None:
        """Start from ``pos`` (another stream's :meth:`position`), before the first connect,
        the sink loaded as of ``pos``. The first connect is then a reconnect: its
        anchored replay proves the publisher the same and fills the gap, or clears."""
        if self._phase is not Phase.DISCONNECTED or self._ever_connected:
            raise ValueError("resume() is only valid before the stream's first connect")
        self._adopt((pos.topic, pos.epoch), start=pos)
        self._clean = False  # the sink holds the rank's contents: a loss clears them
        self._reason = f"resumed at seq {pos.next_seq}: waiting for the connection"

    # --- phases -------------------------------------------------------------------

    def _step(self, now: float, inp: Input, *args: object) -> list[Action]:
        """Hand ``inp`` to its handler in the current phase (:data:`HANDLERS`); the
        actions queued before an unexpected error are kept."""
        self._out = []
        self._now = now
        try:
            getattr(self, HANDLERS[self._phase][inp])(*args)
        except Exception as exc:
            self._internal_error(exc)
        return self._finish()

    def _nothing(self) -> None:
        """An input with nothing to do in this phase."""

    def _on_disconnect(self) -> None:
        self._req.abandon()
        self._move(Event.DISCONNECT)
        self._reason = "disconnected from the publisher"

    def _on_sink_failed(self, reason: str) -> None:
        self.counters.sink_errors += 1
        self._lose_view(f"sink failed: {reason}")
        self._ensure_request()

    def _move(self, event: Event) -> None:
        """The only writer of the phase: where :data:`EVENTS` says ``event`` leads."""
        to = EVENTS[self._phase].get(event)
        if to is None:
            raise AssertionError(f"no event {event.name} in phase {self._phase.name}")
        self._phase = to

    def _holding(self) -> bool:
        """Whether a live batch at the expected seq must wait (continuity unproven)."""
        p = self._phase
        return (
            p is Phase.STARTING
            or p is Phase.SNAPSHOTTING
            or (p is Phase.BACKOFF and self._req.resume is Phase.STARTING)
        )

    def _settle(self) -> None:
        """Nothing is asked any more: FOLLOWING, or STALE where the tail is unproven
        (kvwire's publishers reserve a seq before queueing, so a batch dropped after
        the last one leaves no trace; the engines' assign it as they send)."""
        idle = self.config.idle_probe if self.config.idle_probe is not None else 1.0
        if (
            self._epoch is not None
            and self._epoch.startswith(KVWIRE_EPOCH)
            and self._epoch_info.heartbeat_s is None
            and self._now - self._last_live_at >= idle
        ):
            self._go_stale(
                f"idle since batch {self._seq.expected - 1}: this publisher does not heartbeat, "
                "and a batch it dropped after that one would leave no trace"
            )
        else:
            self._move(Event.FOLLOW)

    def _go_stale(self, why: str) -> None:
        if self._phase is not Phase.STALE:
            self.counters.stale += 1
        self._move(Event.GO_STALE)
        self._reason = why

    # --- publisher lives ----------------------------------------------------------

    def _adopt(
        self,
        life: tuple[bytes, bytes | None] | None,
        *,
        retire: bool = False,
        start: int | StreamPosition | None = None,
    ) -> None:
        """Follow the life that sends ``life`` (topic, epoch): the one place the epoch,
        its topic and the position change. ``start``: a new life's known horizon, a
        position resumed from, or None (the same life). ``retire``: a reply showed the
        new epoch, so the old one's late live messages are dropped."""
        if life is not None:
            topic, epoch = life
            self._topic = topic
            if epoch is not None and epoch != self._epoch:
                if retire and self._epoch is not None and self._epoch not in self._retired:
                    self._retired.append(self._epoch)
                if epoch in self._retired:
                    self._retired.remove(epoch)  # the replay socket says it is current after all
                self._epoch = epoch
                self._epoch_info = parse_epoch(epoch)
        if isinstance(start, StreamPosition):
            self._seq.resume(start)
        elif start is not None:
            self._seq.new_life(start)

    def _restart(
        self,
        why: str,
        known_horizon: int,
        life: tuple[bytes, bytes] | None,
        *,
        ask: bool = True,
        retire: bool = False,
    ) -> None:
        """The publisher restarted: its engine's cache is empty, follow its new stream.

        ``life``: the new life's topic and epoch, where it shows them (``retire``:
        see :meth:`_adopt`). The position starts over with it. ``ask=False``: the
        reply being read already is the new life's history.
        """
        self.counters.restarts += 1
        self._out.append(ClearRank(why))
        self._clean = True
        self._reason = why
        self._adopt(life, retire=retire, start=known_horizon)
        self._exact = True
        self._req.recovered()
        self._req.retries = 0
        if not ask:
            return
        self._req.abandon()
        if self.config.replay:
            self._ask_replay(Phase.STARTING, anchored=False)  # the new life's history
        else:
            self._move(Event.FOLLOW)

    # --- live ---------------------------------------------------------------------

    def _live_first(self, topic: bytes, seq: int, payload: Frame) -> None:
        """A live batch before the connection event: the data beat it."""
        self._on_connect()
        self._on_live(topic, seq, payload)

    def _on_live(self, topic: bytes, seq: int, payload: Frame) -> None:
        c = self.counters
        t = self._seq
        if topic != self._topic and not self._live_topic(topic):
            return
        batch = self._judge(payload)
        if seq < t.expected:
            if batch is None or self._behind(seq, payload):
                return  # a bad frame never decides a restart
        elif seq - t.horizon > self.config.max_seq_jump:
            if batch is None:
                return
            self._break(seq, f"live seq jumped from {t.horizon - 1} to {seq}")

        # From here seq >= expected, in the current (possibly just restarted) stream.
        if seq > t.horizon:
            c.gaps += 1
        t.last_live = seq  # even a bad payload had its place in the ordered stream
        t.see(seq)
        self._resume_following()
        t.live_copy(seq, payload)  # replayed copies up to seq are no longer awaited
        if batch is None:
            if not self.config.replay:
                self._skip_to(seq + 1, f"batch {seq} undecodable and no replay endpoint")
        elif seq == t.expected and not self._holding():
            self._apply(seq, batch, payload, replayed=False)
            self._drain()
        else:
            t.held[seq] = (batch, payload)
            if not self.config.replay:
                self._skip_to(seq, f"batches {t.expected}..{seq - 1} lost, no replay endpoint")
            elif len(t.held) > self.config.max_held or t.held.nbytes > self.config.max_held_bytes:
                self._held_overflow()
        self._ensure_request()

    def _live_topic(self, topic: bytes) -> bool:
        """A live message on a topic other than the followed one: False, it is dropped."""
        epoch = split_topic(topic)[1]
        if epoch is not None and epoch in self._retired:
            # A life the replay socket showed was left behind (a half-open
            # connection, a proxy between).
            self.counters.old_life += 1
            return False
        if epoch is not None and self._epoch is not None and epoch != self._epoch:
            why = f"publisher epoch changed from {self._epoch!r} to {epoch!r}"
            self._restart(why, 0, (topic, epoch))
        else:
            self._adopt((topic, epoch))
        return True

    def _behind(self, seq: int, payload: Frame) -> bool:
        """A good live batch below the expected seq: True when that is all it was (the
        live copy of a replayed batch, or a late one); False when it restarted or broke
        the stream, which goes on from it."""
        t = self._seq
        if seq <= t.last_live:
            self._restart_or_break(seq, f"live seq went back from {t.last_live} to {seq}")
            return False
        same = t.live_copy(seq, payload)
        if same is not None:
            if not same:
                self._restart_or_break(seq, f"live batch {seq} differs from its replayed copy")
                return False
            self.counters.duplicates += 1
        elif t.is_lost(seq):
            self.counters.late += 1
        else:
            self._restart_or_break(seq, f"live seq {seq} below expected {t.expected}")
            return False
        t.last_live = seq
        self._resume_following()
        return True

    def _resume_following(self) -> None:
        """A live batch shows where the stream is: waiting for one, or silence, ends."""
        if self._phase is Phase.AWAIT_LIVE or self._phase is Phase.STALE:
            self._move(Event.FOLLOW)
        elif isinstance(self._req.active, Replay):
            self._req.active.claim = RankState.SYNCED  # a probe of a stale rank

    def _held_overflow(self) -> None:
        self.counters.held_overflows += 1
        why = (
            f"held buffer full ({self.config.max_held} batches, {self.config.max_held_bytes} bytes)"
        )
        if isinstance(self._req.active, Snapshot):
            self._snapshot_failed(why)
        elif self._holding():
            # Still unverified after a (re)connect: as good as a failed replay.
            self._req.abandon()
            self._give_up(why, Phase.STARTING)
        else:
            self._req.abandon()
            self._follow_held(why)

    def _restart_or_break(self, seq: int, why: str) -> None:
        if self._epoch is None:
            self._restart(f"{why}: publisher restarted", 0, None)
        else:
            self._break(seq, f"{why} under the same epoch")

    def _break(self, seq: int, why: str) -> None:
        """A seq no restart explains: clear, then follow the stream from ``seq``."""
        self.counters.seq_jumps += 1
        self._req.abandon()
        self._seq.jump(seq)
        self._move(Event.FOLLOW)
        self._lose_view(why)

    # --- replies ------------------------------------------------------------------

    def _no_request(self, frames: Sequence[Frame], token: int) -> None:
        """A reply while nothing is asked: of a request since abandoned."""
        assert self._req.active is None, "a request out in a phase that asks nothing"
        self.counters.stale_replies += 1

    def _replay_reply(self, frames: Sequence[Frame], token: int) -> None:
        got = self._reply(frames, token)
        if got is not None:
            r, msg, same_epoch = got
            assert isinstance(r, Replay)
            if isinstance(msg, ReplayItem):
                self._replay_item(r, msg.seq, msg.payload, same_epoch)
            elif isinstance(msg, ReplayEnd):
                self._replay_end(r)
            else:  # a snapshot message answering a replay request
                self.counters.decode_errors += 1
            self._ensure_request()

    def _reply(
        self, frames: Sequence[Frame], token: int
    ) -> tuple[Replay | Snapshot, ReplayReply, bool] | None:
        """The request a reply answers, the reply, and whether it shows the epoch
        followed; None when that is all it was (stale, unreadable, a restart)."""
        c = self.counters
        r = self._req.active
        if r is None or token != r.token:
            c.stale_replies += 1
            return None
        r.heard(self._now, self.config)
        try:
            msg = parse_replay_reply(frames)
        except Exception:
            c.decode_errors += 1
            return None
        topic = msg.topic
        epoch = split_topic(topic)[1] if topic is not None else None
        if epoch is None:
            return r, msg, False
        if self._epoch is not None and epoch != self._epoch:
            why = f"replay socket answers for epoch {epoch!r}, not {self._epoch!r}"
            self._restart(why, 0, (topic, epoch), retire=True)  # type: ignore[arg-type]
            return None
        if self._epoch is None:
            # Adopted, but what was applied before came without one: unproven.
            self._adopt((topic, epoch))  # type: ignore[arg-type]
            return r, msg, False
        return r, msg, True

    def _replay_item(self, r: Replay, seq: int, payload: bytes, same_epoch: bool) -> None:
        if seq < r.start:
            return  # not what was asked; a correct publisher never sends it
        if seq > r.last_seq:
            r.last_seq = seq
        first, r.first = r.first, False
        if first and not self._first_item(r, seq, payload, same_epoch):
            return
        t = self._seq
        t.see(seq)
        if seq < t.expected:
            return
        if seq > t.expected:
            if first or r.undecodable == t.expected:
                # The publisher's buffer does not hold what we need: it is gone.
                self._skip_to(
                    seq,
                    f"replay has no batch {t.expected}..{seq - 1} (not buffered)",
                    drain=False,
                )
            else:
                # A hole inside a reply may be the replay socket dropping frames
                # (high-water mark): ask again from exactly what is missing.
                self._req.abandon()
                self._ask_replay(Phase.REPLAYING, anchored=False)
                return
        held = t.held.get(seq)
        if held is not None and bytes(held[1]) != bytes(payload):
            if same_epoch:
                self._lose_view(f"replayed batch {seq} differs from its live copy")
            else:
                # Live and replay sockets reach two different lives of the publisher.
                self._restart(
                    f"replayed batch {seq} differs from its live copy: publisher restarted", 0, None
                )
                return
        batch = self._judge(payload)
        if batch is None:
            r.undecodable = seq  # seq == expected here
            return
        r.progressed = True
        if held is not None:
            del t.held[seq]
        self._apply(seq, batch, payload, replayed=True)

    def _first_item(self, r: Replay, seq: int, payload: bytes, same_epoch: bool) -> bool:
        """What the first item a reply has at or above what was asked proves; False
        when that is all it was for (the anchor, or the end of this reply's use)."""
        if r.identify >= 0:
            if seq >= r.identify:
                # Not what a restart shows, nor what the same publisher would.
                self._req.abandon()
                self._lose_view(f"replay from {r.identify} came back empty, yet {seq} exists")
                self._go_on(self._reason, Phase.STARTING)
                return False
            self._restart(
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
                self._lose_view(f"replayed batch {seq} differs from the one applied")
            else:
                self._restart(
                    f"replayed batch {seq} differs from the one applied: publisher restarted",
                    seq + 1,
                    None,
                )
            return False
        # The anchor is gone from the buffer: whether this is still the publisher
        # whose batches were applied cannot be told (under the same epoch too: a
        # publisher whose epoch is configured restarts under it).
        self._lose_view(f"replay from {r.start} no longer holds the last batch applied")
        return True

    def _replay_end(self, r: Replay) -> None:
        c = self.counters
        t = self._seq
        req = self._req
        req.answered()
        kind = r.kind
        if r.first and r.horizon_at_send > r.start:
            # Batch horizon-1 >= start was seen, yet the reply holds nothing from
            # start on: a restarted publisher, or a buffer that cannot help.
            # Either way it proves nothing.
            why = f"replay from {r.start} came back empty although batch {r.horizon_at_send - 1} exists"
            if (
                self._epoch is None
                and r.anchored
                and (kind is Phase.STARTING or kind is Phase.PROBING)
            ):
                # A buffer always holds the publisher's latest batch: if it holds
                # any, below our anchor, the publisher restarted. Ask for all of it.
                self._ask_replay(Phase.STARTING, anchored=False, start=0)
                assert isinstance(req.active, Replay)
                req.active.identify = r.start
                self._reason = f"{why}: asking for the whole buffer"
                return
            c.replays_failed += 1
            req.retries = 0
            self._lose_view(why)
            self._go_on(why, kind)
            return
        if t.gap:
            if r.undecodable == t.expected:
                self._follow_held(f"buffered batch {t.expected} does not decode")
                return
            if r.progressed:
                req.retries = 0
                self._ask_replay(Phase.REPLAYING, anchored=None)
                return
            if r.verified:
                # Only the anchor fitted in the reply (a small per-request cap).
                self._ask_replay(Phase.REPLAYING, anchored=False)
                return
            if t.horizon > r.horizon_at_send and req.retries < self.config.replay_retries:
                req.retries += 1  # the gap grew after the request went out: ask at once
                self._ask_replay(kind if kind is not Phase.PROBING else Phase.REPLAYING, None)
                return
            self._retry_or_give_up(f"replay from {r.start} stopped before {t.expected}", kind)
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
            self._ask_replay(Phase.PROBING, anchored=None)
        elif r.verified and r.start < r.last_seq < t.expected:
            # The cap ran out on batches already given up on: ask past them.
            self._ask_replay(Phase.PROBING, anchored=False)
        else:
            self._settle()

    def _retry_or_give_up(self, why: str, kind: Phase) -> None:
        cfg = self.config
        resume = Phase.STARTING if kind is Phase.STARTING else Phase.REPLAYING
        if self._req.backoff(self._now, cfg, resume):
            self._move(Event.RETRY_LATER)
            self._reason = f"{why}; retry {self._req.retries} of {cfg.replay_retries}"
            return
        self._give_up(f"{why}; gave up after {cfg.replay_retries} retries", kind)

    def _give_up(self, why: str, kind: Phase) -> None:
        """The replay failed for good: lose what it was to fill, then go on."""
        self.counters.replays_failed += 1
        self._req.retries = 0
        if kind is Phase.STARTING and self._seq.anchor_seq >= 0:
            # After a reconnect: whether the publisher restarted cannot be told.
            self._lose_view(f"{why}; the publisher may have restarted")
        self._go_on(why, kind)

    def _go_on(self, why: str, kind: Phase) -> None:
        """After a failed replay: follow live from the first batch still held, or
        wait for the next one when a start replay could not show the position."""
        if self._seq.gap:
            self._follow_held(why)
        elif kind is Phase.STARTING:
            self._move(Event.WAIT_LIVE)
            self._reason = f"{why}; waiting for the next live batch"
        else:
            self._move(Event.FOLLOW)

    # --- snapshots ----------------------------------------------------------------

    def _snapshot_reply(self, frames: Sequence[Frame], token: int) -> None:
        got = self._reply(frames, token)
        if got is None:
            return
        r, msg, _ = got
        assert isinstance(r, Snapshot)
        if isinstance(msg, SnapshotChunk):
            if r.next_seq < 0:
                r.next_seq = msg.next_seq
                r.blocks = msg.blocks  # chunk 0's announcement, if any
            if msg.next_seq != r.next_seq:
                self._snapshot_failed(f"chunks as of seqs {r.next_seq} and {msg.next_seq}")
            elif msg.number != len(r.chunks):
                self._snapshot_failed(f"chunk {len(r.chunks)} missing (got {msg.number})")
            elif len(r.chunks) >= self.config.max_snapshot_chunks:
                self._snapshot_failed(f"more than {self.config.max_snapshot_chunks} chunks")
            else:
                batch = self._judge(msg.payload)
                if batch is None:
                    self._snapshot_failed(f"chunk {msg.number} does not decode")
                else:
                    r.chunks.append((batch, msg.payload))
        elif isinstance(msg, SnapshotEnd):
            if r.next_seq >= 0 and msg.next_seq != r.next_seq:
                self._snapshot_failed(f"end as of seq {msg.next_seq}, chunks as of {r.next_seq}")
            elif msg.chunks != len(r.chunks):
                self._snapshot_failed(f"{msg.chunks} chunks announced, {len(r.chunks)} received")
            else:
                self._apply_snapshot(r, msg.next_seq)
        elif isinstance(msg, SnapshotRefused):
            self._snapshot_failed(f"refused: {msg.reason[:200]}")
        elif isinstance(msg, ReplayEnd):
            self._snapshot_failed("the publisher answered with an empty replay")
        else:
            self.counters.decode_errors += 1
        self._ensure_request()

    def _apply_snapshot(self, r: Snapshot, next_seq: int) -> None:
        c = self.counters
        self._req.answered()
        self._req.snapshot_ended(self._now, self.config)
        c.snapshots_applied += 1
        why = f"snapshot as of seq {next_seq}"
        self._out.append(ClearRank(why))
        self._clean = True
        if r.blocks:
            # A hint to size the sink's tables, trusted no further than the bytes
            # received (a block takes at least two: its hash and a token).
            self._out.append(Reserve(min(r.blocks, sum(len(p) for _, p in r.chunks) // 2)))
        for batch, payload in r.chunks:
            self._out.append(self._apply_action(next_seq - 1, batch, payload))
            c.events += _events(batch)
            self._clean = False
        self._seq.rebase(next_seq, r.horizon_at_send)
        self._exact = True
        self._reason = f"{why}: exact again, replaying what followed"
        # Whatever was published while the snapshot was served: from the buffer.
        self._ask_replay(Phase.REPLAYING, anchored=False)

    def _snapshot_due_at(self) -> float | None:
        """When a failed snapshot is asked again (only where nothing else is asked)."""
        if self._phase not in _IDLE_PHASES or not self._wants_snapshot():
            return None
        return self._req.recovery_after

    def _wants_snapshot(self) -> bool:
        """The view is lost and the publisher can rebuild it."""
        cfg = self.config
        return not self._exact and cfg.snapshot and cfg.replay and self._epoch_info.snapshot

    def _snapshot_failed(self, why: str) -> None:
        self.counters.snapshots_failed += 1
        self._req.abandon()
        self._req.snapshot_ended(self._now, self.config)
        why = self._reason = f"snapshot failed: {why}"
        self._follow_held(why)
        if self._exact:
            self._lose_view(why)

    # --- time -------------------------------------------------------------------------

    def _tick_request(self) -> None:
        """A request is out: has it timed out? Then the phase it leads to has its timers."""
        r = self._req.active
        if r is not None and self._now >= r.deadline:
            self._timed_out(r)
            getattr(self, HANDLERS[self._phase][Input.TICK])()
        else:
            self._ensure_request()

    def _tick_backoff(self) -> None:
        if self._now >= self._req.retry_at:
            self._ask_replay(self._req.resume, anchored=None)
        self._ensure_request()

    def _tick_idle(self) -> None:
        """Nothing is out: an idle probe, a fresh connection, or STALE, when due."""
        now = self._now
        due = self._probe_due_at()
        if due is not None and now >= due:
            self._ask_replay(Phase.PROBING, anchored=None)
        due = self._reconnect_due_at()
        if due is not None and now >= due:
            self._reconnected_after = self._last_live_at
            self.counters.silent_reconnects += 1
            self._out.append(
                Reconnect(f"no message for {_RECONNECT_HEARTBEATS} heartbeat intervals")
            )
        due = self._stale_due_at()
        if due is not None and now >= due:
            hb = self._epoch_info.heartbeat_s
            self._go_stale(
                f"no message for {_STALE_HEARTBEATS} heartbeat intervals ({hb} s)"
                if hb is not None
                else "idle, and nothing can ask the publisher what the silence hid"
            )
        self._ensure_request()

    def _timed_out(self, r: Replay | Snapshot) -> None:
        self.counters.replay_timeouts += 1
        overall = self._now >= r.hard_deadline
        self._req.abandon()
        if isinstance(r, Snapshot):
            self._snapshot_failed("overall deadline passed" if overall else "timed out")
        elif r.kind is Phase.PROBING:
            self._settle()
        elif overall:
            self._give_up(
                f"replay from {r.start} unfinished after {self.config.replay_deadline} s", r.kind
            )
        else:
            self._retry_or_give_up(f"replay from {r.start} timed out", r.kind)

    def _probe_due_at(self) -> float | None:
        idle = self.config.idle_probe
        if (
            idle is None
            or not self.config.replay
            or self._epoch_info.heartbeat_s is not None
            or self._phase not in _IDLE_PHASES
            or self._seq.gap
        ):
            return None
        return max(self._last_live_at, self._req.last_probe_at) + idle

    def _reconnect_due_at(self) -> float | None:
        """When a heartbeating publisher's silence asks for a fresh connection (once a silence)."""
        hb = self._epoch_info.heartbeat_s
        if (
            hb is None
            or self._phase not in _IDLE_PHASES
            or self._reconnected_after == self._last_live_at
        ):
            return None
        return self._last_live_at + _RECONNECT_HEARTBEATS * hb

    def _stale_due_at(self) -> float | None:
        """When silence makes a rank STALE (nothing can prove it current)."""
        if self._phase is not Phase.FOLLOWING and self._phase is not Phase.AWAIT_LIVE:
            return None
        hb = self._epoch_info.heartbeat_s
        if hb is not None:
            return self._last_live_at + _STALE_HEARTBEATS * hb
        if not self.config.replay and self.config.idle_probe is not None:
            return self._last_live_at + self.config.idle_probe
        return None

    # --- requests -----------------------------------------------------------------------

    def _ask_replay(self, kind: Phase, anchored: bool | None, start: int | None = None) -> None:
        """Send a replay request; ``anchored=None``: anchored when a batch was applied.

        An unanchored request starts at the expected seq, or ``start``.
        """
        t = self._seq
        if anchored is None:
            anchored = t.anchor_seq >= 0
        if start is None or anchored:
            start = t.anchor_seq if anchored else t.expected
        req = self._req
        r, action = req.replay(
            kind,
            start,
            t.anchor_payload if anchored else None,
            self._now,
            self.config,
            t.horizon,
        )
        self._out.append(action)
        if kind is Phase.PROBING:
            # A probe proves nothing before it ends: the rank reads what it did.
            if self._phase is Phase.STALE:
                r.claim = RankState.STALE
            elif self._phase is Phase.AWAIT_LIVE:
                r.claim = RankState.SYNCING
            req.last_probe_at = self._now
            self.counters.probes += 1
        else:
            self.counters.replays_requested += 1
        self._move(_ASK[kind])

    def _ensure_request(self) -> None:
        """After each input: ask what the stream needs, if nothing is out."""
        if not self.config.replay:
            return
        phase = self._phase
        if phase is Phase.DISCONNECTED or phase is Phase.BACKOFF:
            return
        req = self._req
        active = req.active
        if active is not None and (
            isinstance(active, Snapshot) or active.kind is not Phase.PROBING
        ):
            return
        if self._wants_snapshot() and req.snapshot_allowed(self._now):
            req.abandon()
            self._out.append(req.snapshot(self._now, self.config, self._seq.horizon))
            self.counters.snapshots_requested += 1
            self._move(Event.ASK_SNAPSHOT)
            self._reason = f"{self._reason}; asking for a snapshot"
        elif self._seq.gap:
            if active is not None:  # the probe out covers the gap too
                active.kind = Phase.REPLAYING
                self._move(Event.ASK_GAP)
            else:
                self._ask_replay(Phase.REPLAYING, anchored=None)

    # --- applying, losing ------------------------------------------------------------

    def _judge(self, payload: Frame) -> Judged | None:
        """What the stream reads of a payload, or None (counted) if it does not decode."""
        check = self._check
        if check is not None:
            try:
                facts = check(payload, *self._check_limits)
            except Exception:  # only out of memory: decode it
                facts = None
            if facts is not None:
                return facts
        try:
            return decode_batch(payload, self._limits)
        except Exception:  # WireError, or anything a hostile payload provokes
            self.counters.decode_errors += 1
            return None

    @staticmethod
    def _apply_action(seq: int, judged: Judged, payload: Frame) -> Apply | ApplyPayload:
        if type(judged) is tuple:
            return ApplyPayload(seq, payload)
        return Apply(seq, judged)  # type: ignore[arg-type]

    def _apply(self, seq: int, batch: Judged, payload: Frame, replayed: bool) -> None:
        self._out.append(self._apply_action(seq, batch, payload))
        self._clean = False
        c = self.counters
        c.batches += 1
        c.events += _events(batch)
        r = batch[1] if type(batch) is tuple else batch.data_parallel_rank  # type: ignore[union-attr]
        if r is not None and r != self.rank and self.rank is not None:
            c.rank_mismatches += 1
        t = self._seq
        if replayed:
            c.replayed += 1
            t.replayed(seq, payload)
        t.advance(seq, payload)
        if not self._exact and _has_clear(batch):
            self._exact = True
            self._req.recovered()
            self._reason = f"AllBlocksCleared at seq {seq}: the view is exact again"

    def _drain(self) -> None:
        t = self._seq
        held = t.held
        while held and not self._holding():
            seq = held.peekitem(0)[0]
            if seq > t.expected:
                return
            batch, payload = held.popitem(0)[1]
            if seq == t.expected:
                self._apply(seq, batch, payload, replayed=False)

    def _skip_to(self, target: int, why: str, *, drain: bool = True) -> None:
        """Give up on every seq below ``target`` not yet applied, then go on from there.

        Callers pass a ``target`` at or below the first held batch, except a
        replay that showed the publisher no longer has what is below it: held
        live copies there cannot be confirmed and are dropped with the rest.
        """
        skipped = self._seq.skip_to(target)
        if skipped:
            if skipped > self.config.max_seq_jump:
                self.counters.seq_jumps += 1  # not a count of anything real
            else:
                self.counters.seqs_lost += skipped
            self._lose_view(why)
        if drain:
            self._drain()

    def _follow_held(self, why: str) -> None:
        """A loss given up on: follow live from the first batch held (else the horizon)."""
        self._move(Event.FOLLOW)
        self._skip_to(self._seq.lowest_held(), why)

    def _lose_view(self, why: str) -> None:
        was_exact, self._exact = self._exact, False
        if self.config.loss_policy is LossPolicy.CLEAR:
            self._reason = f"{why}: cleared"
            if not self._clean:
                self.counters.resyncs += 1
                self._clean = True
                self._out.append(ClearRank(why))
        else:
            if was_exact:
                self.counters.resyncs += 1
            self._reason = f"{why}: kept what was applied"

    def _on_connect(self) -> None:
        now = self._now
        self._last_live_at = now
        req = self._req
        req.last_probe_at = now
        req.recovered()
        first = not self._ever_connected
        self._ever_connected = True
        if not first:
            self.counters.reconnects += 1
        if self.config.replay:
            # What the old connection showed (held batches, seqs seen) comes back
            # with the replay if the publisher is the same, and must not be used
            # if it is not.
            self._seq.forget_ahead()
            req.abandon()
            req.retries = 0
            self._move(Event.CONNECT)
            self._ask_replay(Phase.STARTING, anchored=None)
            self._reason = (
                "reconnected: checking what the outage lost"
                if not first
                else "resumed: checking what was missed since"
                if self._seq.expected or self._seq.anchor_seq >= 0
                else "first contact: replaying the publisher's history"
            )
        else:
            self._move(Event.CONNECT_LIVE)
            self._reason = (
                "reconnected: waiting for the next batch"
                if not first or self._seq.expected
                else "first contact: waiting for the first batch"
            )

    # --- bookkeeping ----------------------------------------------------------------

    def _internal_error(self, exc: Exception) -> None:
        """A bug met an input: keep what was queued, clear, and start over from live."""
        self.counters.internal_errors += 1
        self._req.drop()
        self._seq.forget_ahead()
        self._seq.forget_anchor()
        if self._phase is not Phase.DISCONNECTED:
            self._move(Event.RESET)
        self._lose_view(f"internal error {type(exc).__name__}: {exc}")

    def _finish(self) -> list[Action]:
        out = self._out
        phase = self._phase
        active = self._req.active
        claim = active.claim if isinstance(active, Replay) else RankState.SYNCED
        if phase is Phase.STALE or (phase is Phase.PROBING and claim is RankState.STALE):
            new = RankState.STALE
        elif not self._exact:
            new = RankState.PARTIAL
        elif phase is Phase.FOLLOWING or phase is Phase.PROBING:
            new = claim
        else:
            new = RankState.SYNCING
        if new is not self._state:
            old, self._state = self._state, new
            if new is RankState.SYNCED:
                self._reason = "in sequence"
                self._req.recovered()
            out.append(StateChanged(old, new, self._reason))
        t = self._seq
        self._fast = (
            new is RankState.SYNCED
            and phase in _SYNCED_PHASES
            and not t.held
            and t.horizon <= t.expected
        )
        self._due = self.next_deadline()
        return out
