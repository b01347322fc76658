"""The per-rank sequencing state machine: sans-I/O, fed frames and time, returns actions.

One :class:`RankStream` follows one publisher socket (one engine, one rank). It
owns no socket and reads no clock: the transport feeds it live messages,
replay replies, connection events and the time, and carries out the
:mod:`~kvwire.subscriber.actions` it returns, so every rule is testable with
lists of frames. The wire is ``docs/wire.md``.

The state is a :class:`~kvwire.subscriber.phases.Phase` (moved only by
:data:`~kvwire.subscriber.phases.EVENTS`, in ``_move``; each input handled by the
method :data:`~kvwire.subscriber.phases.HANDLERS` names), the position
(:class:`~kvwire.subscriber.seq.SeqTracker`), what was asked
(:class:`~kvwire.subscriber.recovery.Requests`), the publisher life followed
(epoch and topic, changed with the position in ``_adopt`` only) and whether
the view is *exact*. The state a router reads, and whether the fast path
applies, are derived once per input (``_finish``). The rules live with their
concern (:mod:`~kvwire.subscriber.batches`, :mod:`~kvwire.subscriber.recovery`,
:mod:`~kvwire.subscriber.timers`), publisher lives here:

- Restarts: a changed epoch (``docs/wire.md`` section 6) on a live message or
  a reply is one. Without an epoch, a live seq that goes back or a replayed
  anchor (the last batch applied) that differs byte for byte is the guess;
  under an unchanged epoch either is a broken stream (cleared, followed). A
  new epoch shown by a reply retires the old one: its late live messages are
  dropped (``old_life``). One seen only live retires nothing (a late message
  of a life never followed reads the same; the replay settles it).
- No input raises; the actions queued before a bug are returned.

The transport feeds a connection event before any reply it reads later, and
the live batches read before a disconnect before the disconnect.

Not detectable: a publisher without epoch or replay endpoint that restarted
while its first batches were missed, with new seqs that continue the old
ones; nor a late live message of an old life with the new life's topic (no
epoch, or the same one), which reads as the next batch or one to wait for.
"""

from __future__ import annotations

import collections
from collections.abc import Sequence

import msgspec

from kvwire.subscriber import batches, recovery, timers
from kvwire.subscriber.actions import Action, Apply, ApplyPayload, ClearRank, StateChanged
from kvwire.subscriber.phases import EVENTS, HANDLERS, TRANSITIONS, Event, Input, Phase
from kvwire.subscriber.recovery import Replay, Requests
from kvwire.subscriber.seq import SeqTracker, StreamPosition
from kvwire.subscriber.state import LossPolicy, RankCounters, RankState, RankStatus, StreamConfig
from kvwire.wire import Epoch, decode_batch, parse_epoch
from kvwire.wire.framing import KVWIRE_EPOCH, Frame

__all__ = ["EVENTS", "HANDLERS", "TRANSITIONS", "Event", "Input", "Phase", "RankStream"]

_RETIRED_EPOCHS = 8  # publisher lives left behind whose late live messages are dropped
_SYNCED_PHASES = frozenset({Phase.FOLLOWING, Phase.PROBING})


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
        self._check = batches.CHECK if payloads else None
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
        due = timers.reconnect_due_at(self)
        return due if due is not None else timers.stale_due_at(self)

    def next_deadline(self) -> float | None:
        """The earliest time :meth:`tick` has something to do (None: nothing timed)."""
        due = self.silence_deadline()
        if due is not None:
            return due
        active = self._req.active
        due = active.deadline if active is not None else None
        for t in (
            self._req.retry_at if self._phase is Phase.BACKOFF else None,
            timers.probe_due_at(self),
            timers.stale_due_at(self),
            timers.snapshot_due_at(self),
            timers.reconnect_due_at(self),
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

    # The handlers HANDLERS names that live with their concern.
    _live_first = batches.live_first
    _on_live = batches.on_live
    _replay_reply = recovery.replay_reply
    _snapshot_reply = recovery.snapshot_reply
    _no_request = recovery.no_request
    _tick_request = timers.tick_request
    _tick_backoff = timers.tick_backoff
    _tick_idle = timers.tick_idle

    def _nothing(self) -> None:
        """An input with nothing to do in this phase."""

    def _on_disconnect(self) -> None:
        self._req.abandon()
        self._move(Event.DISCONNECT)
        self._reason = "disconnected from the publisher"

    def _on_sink_failed(self, reason: str) -> None:
        self.counters.sink_errors += 1
        self._lose_view(f"sink failed: {reason}")
        recovery.ensure_request(self)

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
            recovery.ask_replay(self, Phase.STARTING, anchored=False)  # the new life's history
        else:
            self._move(Event.FOLLOW)

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
            recovery.ask_replay(self, Phase.STARTING, anchored=None)
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
