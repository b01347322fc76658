"""The per-rank sequencing state machine: sans-I/O, fed frames and time, returns actions.

One :class:`RankStream` follows one publisher socket (one engine, one rank).
It owns no socket and reads no clock: the transport feeds it live messages,
replay reply messages, connection events and the current time, and carries
out the :mod:`~kvwire.subscriber.actions` it returns. Every rule is
testable with plain lists of frames.

The rules (the subscriber issue and WIRE.md):

- A live batch at the expected seq is applied. A later one opens a gap: it is
  held (in seq order, bounded) while a replay fills the hole. Replayed batches
  below the expected seq are ignored; a held batch is applied when the replay
  reaches its seq and the two copies match.
- A hole the replay cannot fill (the reply starts above what was asked, no
  replay endpoint, retries with backoff exhausted, held buffer full) is lost
  for good: by default the rank is cleared and marked PARTIAL, then the
  stream goes on. An ``AllBlocksCleared`` later makes the view exact again.
- PUB/SUB never duplicates or reorders, so a live seq that goes back is a
  restarted publisher: the rank is cleared and the new stream is followed
  from 0, its buffered history replayed. (The live copy of a batch that was
  already replayed is recognised by its payload and skipped.)
- Replays are anchored on the last batch applied: the reply must start with
  the publisher's copy of it, byte for byte. A different copy, or an empty
  reply although a batch at or after the start was seen, means a new
  publisher even when no seq said so (a reconnect to a restarted engine that
  already published past us, or one that is idle); an anchor gone from the
  buffer leaves the continuity unprovable, which counts as a loss.
- First contact subscribes first (the transport connects the SUB before
  reporting the connection), then replays from 0; a reconnect replays from
  the anchor, and live batches are held until that reply answers. An idle
  rank is probed now and then, since an idle engine sends nothing that would
  reveal a lost last batch or a silent restart.
- A frame that cannot be parsed or decoded is counted and treated as a lost
  seq; it never raises and never decides a restart.

The transport must feed a connection event before any replay reply it reads
later, and the live batches received before a disconnect before the
disconnect itself (:class:`~kvwire.subscriber.Subscriber` does both).
Without a replay endpoint a restarted publisher is recognised only by a seq
going back or SGLang's topic epoch: one whose first batches were missed and
whose next seq happens to equal ours cannot be told from the old one.
"""

from __future__ import annotations

import collections
from collections.abc import Sequence

import msgspec
from sortedcontainers import SortedDict

from kvwire.subscriber.actions import Action, Apply, ClearRank, RequestReplay, StateChanged
from kvwire.subscriber.state import LossPolicy, RankCounters, RankState, RankStatus, StreamConfig
from kvwire.wire import (
    AllBlocksCleared,
    KVEventBatch,
    ReplayEnd,
    ReplayItem,
    WireError,
    decode_batch,
    parse_replay_reply,
)

__all__ = ["RankStream"]

Frame = bytes | bytearray | memoryview

_EPOCH_MARK = b"\x00sgl-kv-epoch="
_LOST_RANGES_KEPT = 64


def _epoch(topic: bytes) -> bytes | None:
    """SGLang's publisher epoch, appended to the topic when its snapshot service is on."""
    at = topic.find(_EPOCH_MARK)
    return None if at < 0 else topic[at + len(_EPOCH_MARK) :]


def _has_clear(batch: KVEventBatch) -> bool:
    return any(type(e) is AllBlocksCleared for e in batch.events)


def _payload_hash(payload: Frame) -> int:
    return hash(bytes(payload))


class _Replay:
    """One outstanding replay request."""

    __slots__ = (
        "anchor_payload",
        "anchored",
        "deadline",
        "first",
        "horizon_at_send",
        "last_seq",
        "probe",
        "progressed",
        "start",
        "token",
        "undecodable",
        "verified",
    )

    def __init__(
        self,
        token: int,
        start: int,
        anchor_payload: Frame | None,
        probe: bool,
        deadline: float,
        horizon: int,
    ) -> None:
        self.token = token
        self.start = start
        self.anchored = anchor_payload is not None
        self.anchor_payload = anchor_payload
        self.probe = probe
        self.deadline = deadline
        self.horizon_at_send = horizon
        self.first = True  # no item at or above start seen yet
        self.progressed = False  # applied at least one batch
        self.verified = False  # the anchor matched
        self.last_seq = -1  # the highest seq in the reply so far
        self.undecodable = -1  # a seq whose buffered copy does not decode


class RankStream:
    """Sequencing, gap repair and restart detection for one publisher rank.

    ``rank`` is the rank the endpoint belongs to; batches whose envelope names
    another are applied (the endpoint decides) and counted. Every method
    takes ``now`` (seconds, monotonic) and returns the actions to carry out,
    in order; none raises on bad input.
    """

    def __init__(self, rank: int | None = None, config: StreamConfig | None = None) -> None:
        self.rank = rank
        self.config = config if config is not None else StreamConfig()
        self.counters = RankCounters()
        self._clear_on_loss = self.config.loss_policy is LossPolicy.CLEAR
        self._out: list[Action] = []
        self._expected = 0
        self._held: SortedDict = SortedDict()  # seq -> (batch, payload)
        self._horizon = 0  # one past the highest seq known to exist
        self._last_live = -1
        self._topic: bytes | None = None
        self._anchor_seq = -1
        self._anchor_payload: Frame = b""
        self._window: collections.deque[tuple[int, int]] = collections.deque(
            maxlen=self.config.dedup_window
        )
        self._lost: collections.deque[tuple[int, int]] = collections.deque(maxlen=_LOST_RANGES_KEPT)
        self._complete = True
        self._connected = False
        self._ever_connected = False
        self._pending_start = False  # a (re)connect replay has not answered yet
        self._clean = True  # nothing applied since the last clear
        self._await_live = False  # only the next live batch can tell where we are
        self._active: _Replay | None = None
        self._dirty = False  # an abandoned request may still be answered
        self._token = 0
        self._retries = 0
        self._retry_at: float | None = None
        self._last_live_at = 0.0
        self._last_probe_at = 0.0
        self._state = RankState.SYNCING
        self._reason = "waiting for first contact"
        self._fast = False

    # --- reading ----------------------------------------------------------------

    @property
    def state(self) -> RankState:
        return self._state

    @property
    def reason(self) -> str:
        """Why the rank is in its current state."""
        return self._reason

    @property
    def expected_seq(self) -> int:
        """The next seq to apply."""
        return self._expected

    @property
    def held(self) -> int:
        """Later batches held while a gap is filled."""
        return len(self._held)

    @property
    def is_connected(self) -> bool:
        return self._connected

    @property
    def replay_pending(self) -> bool:
        return self._active is not None or self._retry_at is not None

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
            connected=self._connected,
            expected_seq=self._expected,
            held=len(self._held),
            replay_pending=self.replay_pending,
            counters=msgspec.structs.replace(self.counters),
        )

    def next_deadline(self) -> float | None:
        """The earliest time :meth:`tick` has something to do (None: nothing timed)."""
        times: list[float] = []
        if self._active is not None:
            times.append(self._active.deadline)
        if self._retry_at is not None:
            times.append(self._retry_at)
        probe = self._probe_due_at()
        if probe is not None:
            times.append(probe)
        return min(times) if times else None

    # --- inputs -----------------------------------------------------------------

    def live(self, frames: Sequence[Frame], now: float) -> list[Action]:
        """A message from the SUB socket: ``[topic, seq, payload]``."""
        self._last_live_at = now
        if len(frames) != 3 or len(frames[1]) != 8:
            self.counters.decode_errors += 1  # no seq to go by: the next batch shows the hole
            return []
        topic, seq_frame, payload = frames
        seq = int.from_bytes(seq_frame, "big")
        if self._fast and seq == self._expected and topic == self._topic:
            try:
                batch = decode_batch(payload)
            except WireError:
                pass
            else:
                # The common case: the next batch, nothing pending, view complete.
                c = self.counters
                c.batches += 1
                c.events += len(batch.events)
                r = batch.data_parallel_rank
                if r is not None and r != self.rank and self.rank is not None:
                    c.rank_mismatches += 1
                if self._window:
                    self._window.clear()
                self._clean = False
                self._last_live = seq
                self._anchor_seq = seq
                self._anchor_payload = payload
                self._expected = self._horizon = seq + 1
                return [Apply(seq, batch)]
        return self._live_slow(bytes(topic), seq, payload, now)

    def replay_reply(self, frames: Sequence[Frame], token: int, now: float) -> list[Action]:
        """A message read from the replay socket, with the token of its request."""
        self._begin()
        r = self._active
        if r is None or token != r.token:
            self.counters.stale_replies += 1
            return self._finish(now)
        r.deadline = now + self.config.replay_timeout
        try:
            msg = parse_replay_reply(frames)
        except WireError:
            self.counters.decode_errors += 1
            return self._finish(now)
        if isinstance(msg, ReplayEnd):
            self._replay_end(r, now)
        elif isinstance(msg, ReplayItem):
            self._replay_item(r, msg.seq, msg.payload, now)
        else:  # a snapshot reply to a request this stream never makes
            self.counters.decode_errors += 1
        self._ensure_replay(now)
        return self._finish(now)

    def connected(self, now: float) -> list[Action]:
        """The SUB socket (re)connected to the publisher (its subscription is on its way)."""
        self._begin()
        if not self._connected:
            self._on_connect(now)
        return self._finish(now)

    def disconnected(self, now: float) -> list[Action]:
        """The SUB socket lost its connection: batches sent meanwhile are lost."""
        self._begin()
        if self._connected:
            self._connected = False
            self._reason = "disconnected from the publisher"
        return self._finish(now)

    def tick(self, now: float) -> list[Action]:
        """Time passed: replay timeouts, retries with backoff, idle probes."""
        r = self._active
        if (r is None or now < r.deadline) and (self._retry_at is None or now < self._retry_at):
            probe = self._probe_due_at()
            if probe is None or now < probe:
                return []
        self._begin()
        if r is not None and now >= r.deadline:
            self._replay_timed_out(r, now)
        if self._retry_at is not None and now >= self._retry_at:
            self._retry_at = None
            self._request(now)
        probe = self._probe_due_at()
        if probe is not None and now >= probe:
            self._request(now, probe=True)
        self._ensure_replay(now)
        return self._finish(now)

    def sink_failed(self, now: float, reason: str) -> list[Action]:
        """The sink raised while applying a batch: its view of the rank is suspect."""
        self._begin()
        self.counters.sink_errors += 1
        self._lose_view(f"sink failed: {reason}")
        return self._finish(now)

    # --- live ---------------------------------------------------------------------

    def _live_slow(self, topic: bytes, seq: int, payload: Frame, now: float) -> list[Action]:
        self._begin()
        c = self.counters
        if not self._connected:
            self._on_connect(now)  # the data beat the connection event
        if topic != self._topic:
            if self._topic is not None:
                old, new = _epoch(self._topic), _epoch(topic)
                if old is not None and new is not None and old != new:
                    self._restart(f"publisher epoch changed from {old!r} to {new!r}", 0)
            self._topic = topic
        try:
            batch: KVEventBatch | None = decode_batch(payload)
        except WireError:
            c.decode_errors += 1
            batch = None

        if seq < self._expected:
            if batch is None:
                return self._finish(now)  # a bad frame never decides a restart
            if seq <= self._last_live:
                self._restart(
                    f"live seq went back from {self._last_live} to {seq}: publisher restarted", 0
                )
            else:
                window = self._window
                while window and window[0][0] < seq:
                    window.popleft()
                if window and window[0][0] == seq:
                    _, digest = window.popleft()
                    if digest == _payload_hash(payload):
                        c.duplicates += 1
                        self._last_live = seq
                        return self._finish(now)
                    self._restart(
                        f"live batch {seq} differs from its replayed copy: publisher restarted", 0
                    )
                elif self._in_lost_range(seq):
                    c.late += 1
                    self._last_live = seq
                    return self._finish(now)
                else:
                    self._restart(
                        f"live seq {seq} below expected {self._expected}: publisher restarted", 0
                    )

        # From here seq >= expected, in the current (possibly just restarted) stream.
        if seq > self._horizon:
            c.gaps += 1
        self._last_live = seq  # even a bad payload had its place in the ordered stream
        if seq + 1 > self._horizon:
            self._horizon = seq + 1
        if self._await_live and batch is not None:
            self._await_live = False
        if self._window:
            window = self._window
            while window and window[0][0] <= seq:
                window.popleft()
        if batch is None:
            if not self.config.replay:
                self._skip_to(seq + 1, f"batch {seq} undecodable and no replay endpoint")
        elif seq == self._expected and not self._pending_start:
            self._apply(seq, batch, payload, replayed=False)
            self._drain()
        else:
            self._held[seq] = (batch, payload)
            if not self.config.replay:
                self._skip_to(seq, f"batches {self._expected}..{seq - 1} lost, no replay endpoint")
            elif len(self._held) > self.config.max_held:
                c.held_overflows += 1
                if self._pending_start:
                    # Still unverified after a (re)connect: as good as a failed replay.
                    self._abandon()
                    self._give_up(f"held buffer full ({self.config.max_held} batches)")
                else:
                    self._abandon()
                    first = self._held.peekitem(0)[0]
                    self._skip_to(first, f"held buffer full ({self.config.max_held} batches)")
        self._ensure_replay(now)
        return self._finish(now)

    def _in_lost_range(self, seq: int) -> bool:
        return any(lo <= seq < hi for lo, hi in self._lost)

    # --- replay -------------------------------------------------------------------

    def _replay_item(self, r: _Replay, seq: int, payload: bytes, now: float) -> None:
        c = self.counters
        if seq < r.start:
            return  # not what was asked; a correct publisher never sends it
        first, r.first = r.first, False
        if seq > r.last_seq:
            r.last_seq = seq
        if first and r.anchored and seq == r.start:
            if bytes(payload) == bytes(r.anchor_payload or b""):
                r.verified = True
                return  # same publisher: the stream goes on
            self._restart(
                f"replayed batch {seq} differs from the one applied: publisher restarted", seq + 1
            )
            self._pending_start = True
            return  # _ensure_replay asks the new publisher for its history
        if first and r.anchored:
            # The anchor is gone from the buffer: whether this is still the
            # publisher whose batches were applied cannot be told.
            self._lose_view(f"replay from {r.start} no longer holds the last batch applied")
        if seq + 1 > self._horizon:
            self._horizon = seq + 1
        if seq < self._expected:
            return
        if seq > self._expected:
            if first or r.undecodable == self._expected:
                # The publisher's buffer does not hold what we need: it is gone.
                self._skip_to(
                    seq,
                    f"replay has no batch {self._expected}..{seq - 1} (not buffered)",
                    drain=False,
                )
            else:
                # A hole inside a reply may be the replay socket dropping frames
                # (high-water mark): ask again from exactly what is missing.
                self._abandon()
                self._request(now, anchored=False)
                return
        held = self._held.get(seq)
        if held is not None and bytes(held[1]) != bytes(payload):
            # Live and replay sockets reach two different lives of the publisher.
            self._restart(
                f"replayed batch {seq} differs from its live copy: publisher restarted", 0
            )
            self._pending_start = True
            return
        try:
            batch = decode_batch(payload)
        except WireError:
            c.decode_errors += 1
            r.undecodable = seq  # seq == expected here (a live copy would have differed)
            return
        r.progressed = True
        if held is not None:
            del self._held[seq]
        self._apply(seq, batch, payload, replayed=True)

    def _replay_end(self, r: _Replay, now: float) -> None:
        c = self.counters
        self._active = None
        if r.first and r.horizon_at_send > r.start:
            # A publisher always buffers its latest batch, and we had seen one at
            # or after ``start`` before asking: having none, this is a new publisher.
            self._restart(f"replay from {r.start} came back empty: publisher restarted", 0)
            self._pending_start = True
            return
        self._pending_start = False
        if self._expected < self._horizon:
            if r.undecodable == self._expected:
                target = self._held.peekitem(0)[0] if self._held else self._horizon
                self._skip_to(target, f"buffered batch {self._expected} does not decode")
                return
            if r.progressed:
                self._retries = 0
                return  # _ensure_replay asks again from the new position
            if r.verified:
                # Only the anchor fitted in the reply (a small per-request cap).
                self._request(now, anchored=False)
                return
            if self._horizon > r.horizon_at_send and self._retries < self.config.replay_retries:
                self._retries += 1  # the gap grew after the request went out: ask at once
                return
            self._retry_or_give_up(now, f"replay from {r.start} stopped before {self._expected}")
            return
        self._retries = 0
        self._await_live = False  # the reply showed where the publisher is
        if r.probe:
            if r.progressed:
                c.gaps += 1  # the lost tail of an idle stream, now filled
                c.replays_succeeded += 1
        else:
            c.replays_succeeded += 1
        if r.progressed:
            # A per-request cap may have cut the reply short: look for more.
            self._request(now, probe=True)
        elif r.verified and r.start < r.last_seq < self._expected:
            # The cap ran out on batches already given up on: ask past them.
            self._request(now, probe=True, anchored=False)

    def _replay_timed_out(self, r: _Replay, now: float) -> None:
        self.counters.replay_timeouts += 1
        self._abandon()
        if r.probe:
            return
        self._retry_or_give_up(now, f"replay from {r.start} timed out")

    def _retry_or_give_up(self, now: float, why: str) -> None:
        cfg = self.config
        self._retries += 1
        if self._retries <= cfg.replay_retries:
            delay = min(cfg.backoff_max, cfg.backoff_initial * 2 ** (self._retries - 1))
            self._retry_at = now + delay
            self._reason = f"{why}; retry {self._retries} of {cfg.replay_retries}"
            return
        self._give_up(f"{why}; gave up after {cfg.replay_retries} retries")

    def _give_up(self, why: str) -> None:
        """The replay failed for good: lose what it was to fill, then go on."""
        self.counters.replays_failed += 1
        self._retries = 0
        self._retry_at = None
        if self._pending_start:
            self._pending_start = False
            if self._anchor_seq >= 0:
                # After a reconnect: whether the publisher restarted cannot be told.
                self._lose_view(f"{why}; the publisher may have restarted")
        if self._expected < self._horizon:
            target = self._held.peekitem(0)[0] if self._held else self._horizon
            self._skip_to(target, why)
        elif self._complete:
            self._await_live = True
            self._reason = f"{why}; waiting for the next live batch"

    def _request(self, now: float, *, probe: bool = False, anchored: bool | None = None) -> None:
        if anchored is None:
            anchored = self._anchor_seq >= 0
        start = self._anchor_seq if anchored else self._expected
        self._token += 1
        self._active = _Replay(
            self._token,
            start,
            self._anchor_payload if anchored else None,
            probe,
            now + self.config.replay_timeout,
            self._horizon,
        )
        self._out.append(RequestReplay(start, self._token, self._dirty))
        self._dirty = False
        if probe:
            self._last_probe_at = now
            self.counters.probes += 1
        else:
            self.counters.replays_requested += 1

    def _abandon(self) -> None:
        if self._active is not None:
            self._active = None
            self._dirty = True

    def _ensure_replay(self, now: float) -> None:
        if not self.config.replay or not self._connected:
            return
        if self._active is not None and not self._active.probe:
            return
        if self._retry_at is not None:
            return
        if self._pending_start or self._expected < self._horizon:
            if self._active is not None:  # a probe is out; it covers the gap too
                return
            self._request(now)

    def _probe_due_at(self) -> float | None:
        idle = self.config.idle_probe
        if (
            idle is None
            or not self.config.replay
            or not self._connected
            or self._active is not None
            or self._retry_at is not None
            or self._pending_start
            or self._expected < self._horizon
        ):
            return None
        return max(self._last_live_at, self._last_probe_at) + idle

    # --- applying, losing, restarting --------------------------------------------------

    def _apply(self, seq: int, batch: KVEventBatch, payload: Frame, replayed: bool) -> None:
        self._out.append(Apply(seq, batch))
        self._clean = False
        c = self.counters
        c.batches += 1
        c.events += len(batch.events)
        r = batch.data_parallel_rank
        if r is not None and r != self.rank and self.rank is not None:
            c.rank_mismatches += 1
        if replayed:
            c.replayed += 1
            if seq > self._last_live:
                self._window.append((seq, _payload_hash(payload)))
        self._anchor_seq = seq
        self._anchor_payload = payload
        self._expected = seq + 1
        if seq + 1 > self._horizon:
            self._horizon = seq + 1
        if not self._complete and _has_clear(batch):
            self._complete = True
            self._reason = f"AllBlocksCleared at seq {seq}: the view is exact again"

    def _drain(self) -> None:
        held = self._held
        while held:
            seq = held.peekitem(0)[0]
            if seq > self._expected:
                return
            batch, payload = held.popitem(0)[1]
            if seq == self._expected:
                self._apply(seq, batch, payload, replayed=False)

    def _skip_to(self, target: int, why: str, *, drain: bool = True) -> None:
        """Give up on every seq below ``target`` not yet applied, then go on from there.

        Callers pass a ``target`` at or below the first held batch, except a
        replay that showed the publisher no longer has what is below it: held
        live copies there cannot be confirmed and are dropped with the rest.
        """
        start = self._expected
        if target > start:
            held = self._held
            for seq in list(held.irange(start, target - 1)):
                del held[seq]
            self.counters.seqs_lost += target - start
            self._lost.append((start, target))
            self._expected = target
            if target > self._horizon:
                self._horizon = target
            self._lose_view(why)
        if drain:
            self._drain()

    def _lose_view(self, why: str) -> None:
        was_complete, self._complete = self._complete, False
        if self._clear_on_loss:
            self._reason = f"{why}: cleared"
            if not self._clean:
                self.counters.resyncs += 1
                self._clean = True
                self._out.append(ClearRank(why))
        else:
            if was_complete:
                self.counters.resyncs += 1
            self._reason = f"{why}: kept what was applied"

    def _restart(self, why: str, known_horizon: int) -> None:
        """The publisher restarted: its engine's cache is empty, follow its new stream."""
        self.counters.restarts += 1
        self._out.append(ClearRank(why))
        self._clean = True
        self._reason = why
        self._expected = 0
        self._held.clear()
        self._horizon = known_horizon
        self._last_live = -1
        self._anchor_seq = -1
        self._anchor_payload = b""
        self._window.clear()
        self._lost.clear()
        self._complete = True
        self._pending_start = False
        self._await_live = False
        self._abandon()
        self._retry_at = None
        self._retries = 0

    def _on_connect(self, now: float) -> None:
        self._connected = True
        self._last_live_at = now
        self._last_probe_at = now
        if self._ever_connected:
            self.counters.reconnects += 1
            self._reason = "reconnected: checking what the outage lost"
        else:
            self._ever_connected = True
            self._reason = "first contact: replaying the publisher's history"
        if self.config.replay:
            # What the old connection showed (held batches, seqs seen) comes back
            # with the replay if the publisher is the same, and must not be used
            # if it is not.
            self._held.clear()
            self._horizon = self._expected
            self._abandon()
            self._retry_at = None
            self._retries = 0
            self._pending_start = True
            self._await_live = False
            self._request(now)
        else:
            self._await_live = True
            if self._reason.startswith("first"):
                self._reason = "first contact: waiting for the first batch"

    # --- bookkeeping ----------------------------------------------------------------

    def _begin(self) -> list[Action]:
        out: list[Action] = []
        self._out = out
        return out

    def _finish(self, now: float) -> list[Action]:
        out = self._out
        if not self._complete:
            new = RankState.PARTIAL
        elif (
            not self._connected
            or self._pending_start
            or self._await_live
            or self._expected < self._horizon
            or self._retry_at is not None
            or (self._active is not None and not self._active.probe)
        ):
            new = RankState.SYNCING
        else:
            new = RankState.SYNCED
        if new is not self._state:
            old, self._state = self._state, new
            if new is RankState.SYNCED:
                self._reason = "in sequence"
            out.append(StateChanged(old, new, self._reason))
        self._fast = (
            self._complete
            and self._connected
            and not self._pending_start
            and not self._held
            and not self._await_live
            and self._horizon <= self._expected
        )
        return out
