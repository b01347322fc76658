"""One rank's link: its sockets, its :class:`RankStream`, and the stream's actions carried out.

A rank has a SUB socket for live batches and its monitor (connection events);
its replay DEALER (:class:`ReplayChannel`) exists only
while a replay or snapshot request is out, so a rank at rest holds three
sockets (one TCP connection). The :class:`~kvwire.subscriber.reactor.Reactor`
says when to read (:meth:`RankLink.service`) and when a deadline may have
passed (:meth:`RankLink.on_timer`); the link reads its sockets in one order,
always: connection events first (draining the SUB before a disconnect, so the
old connection's batches come before it), then live batches, then replay
replies. That order is what RankStream relies on: a replay reply is never read
before a disconnect that came before it, and a connection event comes before
the live batches and replies that follow it.

While the subscriber loads a checkpoint or a clone, a rank that view may hold is
*on hold* (:meth:`RankLink.hold`): it connects and asks its replay as soon as
its position is known, and reads and sequences what comes, but what it would
give the sink (and its state changes) waits in order until :meth:`RankLink.release`,
after the view is imported; :meth:`RankLink.close` drops it where the view is refused.

A ready socket is read to the end in one call (:mod:`kvwire.subscriber.receive`,
native where it can be), and the heartbeats at the head of a SUB in sequence
are only counted there (:func:`~kvwire.subscriber.receive.Receive.drain_beats`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from typing import Any

import zmq
from zmq.utils.monitor import parse_monitor_message

from kvwire.subscriber.actions import (
    Action,
    Apply,
    ApplyPayload,
    ClearRank,
    Reconnect,
    RequestReplay,
    RequestSnapshot,
    Reserve,
    StateChanged,
)
from kvwire.subscriber.config import QUEUE_SLACK
from kvwire.subscriber.env import CONTACT_S, RECONNECT_MAX_S, RECONNECT_MIN_S, LinkEnv
from kvwire.subscriber.reactor import PACE_S
from kvwire.subscriber.source import EngineSource, RankEndpoints
from kvwire.subscriber.state import RankState
from kvwire.subscriber.stream import RankStream
from kvwire.wire import replay_request_frames, snapshot_request_frames

__all__ = ["RankLink", "ReplayChannel"]

_MONITOR_EVENTS = zmq.EVENT_HANDSHAKE_SUCCEEDED | zmq.EVENT_DISCONNECTED
BURST = 256
"""Live messages read from one rank before the others get a turn."""
_LIVE_FRAMES = 3  # [topic, seq, payload]; a longer message is read as () and counted
_MONITOR_FRAMES = 2  # [event and value, endpoint]
_DRAIN_BEFORE_DISCONNECT = 1_000_000
_FIRST_BATCH_BYTES = 64 << 10  # a rank's batch size until its first batch is read
_REOPEN_RATIO = 8  # a SUB is reopened when its derived mark is this many times its own
_RATE_WINDOW_S = 0.1  # a rank's live message rate is measured over this long, at least
_QUIET_S = 1.0  # a SUB is reopened only with live messages that follow this long a silence
_REPLY_FRAMES = 6  # the longest replay reply (a snapshot chunk)
_REPLAY_HWM = 1024  # replay reply messages queued unread per rank, at most
_REPLY_TURN_BYTES = 256 << 10  # reply bytes one turn reads: about one snapshot chunk


_HELD = frozenset({Apply, ApplyPayload, ClearRank, Reserve})
"""What a rank on hold keeps for the sink until its view is imported."""
_HELD_COST = 256  # bytes counted for a held action without a payload (a decoded batch, a clear)


def _sample(messages: list[tuple[bytes, ...]]) -> int:
    """The larger payload of the first and last message read: a batch size, in O(1)."""
    first, last = messages[0], messages[-1]
    return max(len(first[-1]) if first else 0, len(last[-1]) if last else 0)


class RankLink:
    """One rank of one source: its stream, its sockets and its timer; see the module."""

    __slots__ = (
        "batch_bytes",
        "chunk",
        "closed",
        "connecting_since",
        "endpoints",
        "env",
        "fit_ranks",
        "held_out",
        "held_out_bytes",
        "hwm",
        "keys",
        "live_blocked",
        "monitor",
        "monitor_fd",
        "quiet_before",
        "rank",
        "rate_read",
        "rate_since",
        "read_at",
        "reconnect_at",
        "reconnect_delay",
        "reopen_due",
        "replay",
        "restated",
        "share",
        "sized",
        "stream",
        "sub",
        "sub_fd",
        "sub_hwm",
        "subject",
        "timer",
        "timer_at",
        "topic",
        "worker_id",
    )

    def __init__(
        self, source: EngineSource, endpoints: RankEndpoints, stream: RankStream, env: LinkEnv
    ) -> None:
        self.worker_id = source.worker_id
        self.keys = source.keys
        self.topic = source.topic.encode()
        self.rank = endpoints.rank
        self.endpoints = endpoints
        self.stream = stream
        self.env = env
        self.subject = f"worker {self.worker_id} rank {self.rank}"
        self.sub: zmq.Socket[bytes] | None = None
        self.sub_fd = -1
        self.monitor: zmq.Socket[bytes] | None = None
        self.monitor_fd = -1
        self.replay = ReplayChannel(self)
        self.timer: asyncio.TimerHandle | None = None
        self.timer_at: float | None = None
        self.closed = False
        self.connecting_since: float | None = None  # holds a first-contact slot
        self.reconnect_at: float | None = None  # when to connect the SUB again ourselves
        self.reconnect_delay = 0.0  # grows while connections fail before their handshake
        env.ranks += 1
        config = env.config
        self.batch_bytes = _FIRST_BATCH_BYTES  # recent batch size, from what was read
        self.sized = False  # batch_bytes is still a guess
        self.fit_ranks = env.ranks
        self.share = config.rank_share(env.ranks)
        self.hwm = config.rank_hwm(env.ranks, self.batch_bytes)  # for the next socket made
        self.sub_hwm = 0  # the open SUB's mark
        self.reopen_due = False  # the open SUB's mark no longer fits: reopen it
        self.rate_read = 0  # live messages read since rate_since
        self.read_at = 0.0  # when live messages were last read
        self.quiet_before = 0.0  # the silence before the latest ones
        self.rate_since = 0.0
        self.live_blocked = False  # live reading waits for held batches to go
        self.chunk = config.read_chunk(env.ranks, self.batch_bytes, BURST)
        self.held_out: list[Action] | None = None  # on hold: the sink's actions, in order
        self.held_out_bytes = 0
        self.restated = False  # on hold: the state changed meanwhile
        # A PrefixIndex makes a followed rank's room while its tables are empty (first
        # seen as its snapshot arrives, 1,024 ranks cost 16 s more to apply).
        env.delivery.hint(self, "add_rank")

    def note(self, kind: str, message: str, exc_info: Any = None) -> None:
        """A problem of this rank, logged at most once an interval per kind for all ranks."""
        self.env.log.note(kind, message, self.subject, exc_info=exc_info)

    # --- on hold while a view loads ------------------------------------------------------

    @property
    def on_hold(self) -> bool:
        return self.held_out is not None

    def hold(self) -> None:
        """Keep what this rank gives the sink (batches, clears, hints) and its state
        changes until :meth:`release`: the view it applies on is still being imported."""
        if self.held_out is None:
            self.held_out = []
            self.held_out_bytes = 0

    def release(self) -> None:
        """The rank's view is in the sink: give it what was held, in order, then read on."""
        held, self.held_out = self.held_out, None
        if held is None or self.closed:
            return
        self.held_out_bytes = 0
        if held:
            self.carry_out(held)
            self.env.delivery.flush_later(self)
        if self.restated:
            self.restated = False
            self.env.on_state(self)
        self.env.reactor.again(self, monitor=True)  # what waited unread while the hold was full
        self.schedule()

    def _hold_full(self) -> bool:
        """On hold, with the rank's share of the receive budget held: read on after it."""
        return self.held_out is not None and self.held_out_bytes > self.share

    # --- sockets -------------------------------------------------------------------------

    def connect(self) -> bool:
        """Open the SUB and its monitor and connect; False when they cannot open yet."""
        try:
            self._open_sub()
        except Exception as exc:  # out of files: the caller tries again later
            self._close_sub()
            self.note("not-connected", f"not connected yet: {exc}")
            return False
        return True

    def _open_sub(self) -> None:
        config = self.env.config
        # Until its batches are seen, a rank's may be as large as max_message_size: the
        # mark that keeps those within its share holds the bound from the first message.
        first = config.rank_hwm(self.env.ranks, config.max_message_size)
        mark = self.hwm if self.sized else first
        sub = self.env.socket(zmq.SUB, self.keys)
        sub.setsockopt(zmq.RCVHWM, mark)
        self.sub_hwm = mark
        sub.setsockopt(zmq.TCP_KEEPALIVE, 1)  # how a dead publisher is noticed
        sub.setsockopt(zmq.TCP_KEEPALIVE_IDLE, 10)
        sub.setsockopt(zmq.TCP_KEEPALIVE_INTVL, 2)
        sub.setsockopt(zmq.TCP_KEEPALIVE_CNT, 3)
        sub.setsockopt(zmq.SUBSCRIBE, self.topic)
        self.sub = sub
        monitor = sub.get_monitor_socket(_MONITOR_EVENTS)
        self.monitor = monitor
        # A fresh inproc pipe does not signal its first message: one read (of nothing,
        # before the SUB connects) makes it signal from then on.
        self.env.receive.drain(monitor, 1, _MONITOR_FRAMES)
        sub.connect(self.endpoints.endpoint)
        reactor = self.env.reactor
        self.monitor_fd = reactor.watch(monitor, self, monitor=True)
        self.sub_fd = reactor.watch(sub, self)

    def _close_sub(self) -> None:
        reactor = self.env.reactor
        for fd in (self.sub_fd, self.monitor_fd):
            if fd >= 0:
                reactor.unwatch(fd)
        self.sub_fd = self.monitor_fd = -1
        if self.sub is not None:
            with contextlib.suppress(zmq.ZMQError):
                self.sub.disable_monitor()
        for sock in (self.monitor, self.sub):
            if sock is not None:
                sock.close(linger=0)
        self.sub = self.monitor = None

    def close(self) -> None:
        """Close every socket; the rank is done."""
        if not self.closed:
            self.env.ranks -= 1
        self.closed = True
        self.env.reactor.forget(self)
        self.env.delivery.forget(self)
        self.env.contacts.done(self)
        self.replay.close()
        self._close_sub()

    def _reconnect(self) -> None:
        self.reconnect_at = None
        sub = self.sub
        if sub is None:
            if not self.closed and self.connecting_since is None and self.sub_hwm:
                self._reopen_sub()  # a reopen that could not open its socket: again
            return
        with contextlib.suppress(zmq.ZMQError):
            sub.disconnect(self.endpoints.endpoint)
        sub.connect(self.endpoints.endpoint)

    def _fit(self, sample: int) -> None:
        """Follow the rank's batch size (``sample``: one just read) and keep its sockets'
        marks and its read chunk within its share of the receive budget.

        The estimate rises at once and falls by halves. The mark applies to the
        sockets made after it (see below), so an open SUB keeps the mark it was made with.
        """
        est = self.batch_bytes
        env = self.env
        if est >> 1 <= sample <= est and self.fit_ranks == env.ranks and self.sized:
            return
        est = sample if sample > est or not self.sized else max(sample, est >> 1, 1)
        self.sized = True
        self.batch_bytes = est
        self.fit_ranks = ranks = env.ranks
        config = env.config
        self.share = config.rank_share(ranks)
        self.chunk = config.read_chunk(ranks, est, BURST)
        mark = config.rank_hwm(ranks, est)
        # Taken by the next socket made (a replay socket, a reopened SUB), never set on an
        # open one: libzmq 4.3.5's I/O thread crashed (SIGSEGV, about one run in three of
        # the 200 MB oversized-payload test) when RCVHWM changed under a message in flight.
        self.hwm = mark
        open_mark = self.sub_hwm
        if self.sub is not None and mark < open_mark:
            # Larger batches: the open SUB may hold more than twice the rank's share.
            self.reopen_due = (open_mark + QUEUE_SLACK) * est > 2 * self.share

    def _misfit(self, read: int, now: float) -> None:
        """A drain read ``read`` live messages: a SUB whose messages come fast enough to
        fill half its mark every paced round (:data:`PACE_S`), with a mark far below what
        their size allows, is reopened with that mark (its first one throttles the rank).
        A rank at an engine's step rate, far slower, keeps its SUB. The reopen waits for
        messages that follow a second of silence (:meth:`_may_reopen`): a reconnect in the
        middle of a flood would hold the flood's batches while its replay catches up, past
        ``max_held``."""
        if read:
            self.quiet_before = now - self.read_at
            self.read_at = now
        self.rate_read += read
        elapsed = now - self.rate_since
        if elapsed < _RATE_WINDOW_S:
            return
        rate = self.rate_read / elapsed
        self.rate_read = 0
        self.rate_since = now
        open_mark = self.sub_hwm
        if 2 * rate * PACE_S >= open_mark and self.hwm >= _REOPEN_RATIO * open_mark:
            self.reopen_due = True

    def _may_reopen(self) -> bool:
        """Never without a replay endpoint (what the old socket held would be lost); not
        while a recovery is out or waiting (a reopen would abandon a snapshot being
        served), unless the open mark breaks the byte bound."""
        if not self.stream.config.replay:
            return False
        if self.sub_hwm > self.hwm:
            return True  # batches that grew: the bound first
        if self.quiet_before < _QUIET_S:
            return False  # within a flood, or too soon to tell
        return not self.stream.replay_pending and self.replay.queued is None

    def _reopen_sub(self) -> None:
        """Reopen the SUB with the mark its batch size asks for: to the stream, a
        reconnect (what the old socket still held is replayed). The mark of an open
        socket is never changed (see :meth:`_fit`)."""
        self.reopen_due = False
        if self.closed:
            return
        self.env.reopens += 1
        if self.sub is not None:
            self._close_sub()
            self.carry_out(self.stream.disconnected(time.monotonic()))
        self.reconnect_delay = 0.0
        if not self.connect():  # out of files: again shortly
            self.reconnect_at = time.monotonic() + RECONNECT_MAX_S
        self.schedule()

    def _live_room(self) -> int:
        """Live messages the rank may read now: while its stream holds batches, those
        and the SUB's queue (its mark and slack, of the rank's batch size) share the
        rank's share of the receive budget; reading waits once they fill it."""
        held = self.stream.held_bytes
        if not held:
            return self.chunk
        est = self.batch_bytes
        return (self.share - held) // est - (self.sub_hwm + QUEUE_SLACK)

    def _resume_live(self) -> None:
        """Held batches went: read the SUB again (it will not signal what it holds)."""
        if self.live_blocked and self._live_room() > 0 and not self.closed:
            self.live_blocked = False
            self.env.reactor.again(self)

    # --- reading -------------------------------------------------------------------------

    def service(self, monitor: bool) -> bool:
        """Everything the sockets hold, in order: connection events, live, replies.

        ``monitor``: its monitor signalled. Otherwise the monitor is not read: it was
        read to the end before, so nothing waits there unless it signals (an event
        arriving meanwhile is read in the next round, before the fresh connection it
        announces can deliver: libzmq reconnects 100 ms after a disconnect at the
        earliest). Returns whether more live messages may be queued than one burst
        (the socket will not signal them again).
        """
        delivery = self.env.delivery
        if delivery.paused:
            delivery.defer(self)  # read on when the iterator's reader catches up
            return False
        burst = 0
        try:
            if monitor and self.monitor is not None:
                self._on_monitor()
            if self._hold_full():
                return False  # read on at release (the sockets keep what comes, bounded)
            if self.sub is not None:
                burst = self._drain_live(BURST)
            if self.replay.dealer is not None:
                self.replay.read()
                self.schedule()
            if self.reopen_due and self._may_reopen():
                self._reopen_sub()
            self._resume_live()
        except Exception:
            # A bug, not bad input (RankStream never raises on input): keep going.
            self.note("loop-error", "subscriber loop error", exc_info=True)
        return burst >= BURST and not self.closed

    def _on_monitor(self) -> None:
        monitor = self.monitor
        assert monitor is not None
        drain = self.env.receive.drain
        # Read to the end: the monitor signals again only once it has been found empty.
        events: list[tuple[bytes, ...]] = []
        while len(batch := drain(monitor, BURST, _MONITOR_FRAMES)) == BURST:
            events += batch
        events += batch
        for msg in events:
            if self.monitor is not monitor:
                return  # the rank was removed by what it delivered
            if len(msg) != _MONITOR_FRAMES:
                continue  # not libzmq's: nothing to go by
            event = parse_monitor_message(list(msg))["event"]
            if event == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                self.reconnect_delay = 0.0
                self.reconnect_at = None
                self.env.contacts.done(self)  # connected: its replay waits in ReplaySlots
                self.carry_out(self.stream.connected(time.monotonic()))
            elif event == zmq.EVENT_DISCONNECTED:
                # The old connection's batches belong before the disconnect.
                if self.sub is not None:
                    self._drain_live(_DRAIN_BEFORE_DISCONNECT, bounded=False)
                self.carry_out(self.stream.disconnected(time.monotonic()))
                # libzmq does not reconnect after a protocol error (a message over
                # max_message_size, a refused handshake): connect again ourselves, at
                # once after a connection that worked, then backing off.
                delay = self.reconnect_delay
                self.reconnect_delay = min(RECONNECT_MAX_S, max(RECONNECT_MIN_S, 2 * delay))
                self.reconnect_at = time.monotonic() + delay
                if delay == 0:
                    self._reconnect()
            else:
                continue
            self.schedule()

    def _drain_live(self, budget: int, bounded: bool = True) -> int:
        """Read up to ``budget`` live messages into the stream; how many were read.

        With a sink, the heartbeats in sequence at the head of the socket are
        counted by the drain and taken by the stream in one call (they change
        nothing a sink holds); everything else goes through ``live``. ``bounded``:
        stop while held batches fill the rank's share (:meth:`_live_room`).
        """
        sub = self.sub
        assert sub is not None
        stream = self.stream
        live = stream.live
        env = self.env
        receive = env.receive
        drain, drain_beats = receive.drain, receive.drain_beats
        delivery = env.delivery
        # On hold, every action goes through carry_out, which keeps the sink's ones.
        sink = delivery.sink if self.held_out is None else None
        payload_sink = delivery.payload_sink
        limits = stream.config.decode_limits
        worker_id, rank = self.worker_id, self.rank
        clock = time.monotonic
        n = 0
        trim = env.trim
        while n < budget:
            chunk = min(self.chunk, budget - n)
            if bounded and stream.held_bytes:
                room = self._live_room()
                if room < 1:
                    self.live_blocked = True  # _resume_live reads on once they go
                    break
                chunk = min(chunk, room)
            key = stream.beat_key() if sink is not None else None
            if key is None:
                beats, last, messages = 0, None, drain(sub, chunk, _LIVE_FRAMES)
            else:
                beats, last, messages = drain_beats(sub, chunk, *key)
            if not beats and not messages:
                trim.idle()
                break
            now = clock()
            self._misfit(beats + len(messages), now)
            if messages:
                self._fit(_sample(messages))
                trim.pending += len(messages) * self.batch_bytes
            if last is not None:
                stream.beats(beats, last, now)
                n += beats
            for frames in messages:
                n += 1
                actions = live(frames, now)
                kind = type(actions[0]) if len(actions) == 1 and sink is not None else None
                if kind is ApplyPayload:
                    assert payload_sink is not None  # only a PayloadSink's streams make them
                    try:
                        payload_sink.apply_payload(worker_id, rank, actions[0].payload, limits)  # type: ignore[union-attr]
                    except Exception as exc:
                        self.sink_failed(exc)
                elif kind is Apply:
                    assert sink is not None
                    try:
                        sink.apply(worker_id, rank, actions[0].batch)  # type: ignore[union-attr]
                    except Exception as exc:
                        self.sink_failed(exc)
                elif actions:
                    self.carry_out(actions)
                if self.sub is not sub:
                    return n  # the rank was removed by what it delivered
            if messages:
                delivery.flush_later(self)
            if beats + len(messages) < chunk:
                trim.idle()
                break  # the socket is empty
        return n

    # --- time ----------------------------------------------------------------------------

    def schedule(self) -> None:
        """The rank's deadlines may have changed: tell the reactor."""
        self.env.reactor.schedule(self)

    def deadline(self, now: float) -> float | None:
        if self._hold_full():
            return self.reconnect_at  # the stream's deadlines wait for what is unread
        deadline = self.stream.next_deadline()
        at = self.reconnect_at
        if at is not None and (deadline is None or at < deadline):
            return at
        return deadline

    def silence(self) -> tuple[float, float] | None:
        if self.reconnect_at is not None or self.connecting_since is not None:
            return None
        stream = self.stream
        quiet = stream.silence_deadline()
        if quiet is None:
            return None
        epoch = stream.epoch
        assert epoch is not None and epoch.heartbeat_s is not None
        return quiet, epoch.heartbeat_s

    def on_timer(self, now: float) -> None:
        if self.replay.dealer is not None and not self.env.delivery.paused:
            # A reply waiting unread is the router's delay, not the publisher's silence:
            # read it before a deadline is judged.
            if self.service(True):
                self.env.reactor.again(self)
            now = time.monotonic()
        if self.connecting_since is not None and now - self.connecting_since > CONTACT_S:
            self.env.contacts.done(self)  # its publisher may be down: others go on meanwhile
        if self.reconnect_at is not None and now >= self.reconnect_at:
            self._reconnect()
        if self._hold_full():
            return  # replies left unread are the router's delay: judged once they are read
        try:
            actions = self.stream.tick(now)
            if actions:
                self.carry_out(actions)
            if not self.closed:
                self.replay.release()
                self._resume_live()
        except Exception:
            self.note("timer-error", "subscriber timer error", exc_info=True)

    # --- carrying out actions --------------------------------------------------------------

    def carry_out(self, actions: list[Action]) -> None:
        """Do what the stream asked, in order."""
        timed = False  # anything but an Apply may have moved the rank's deadline
        delivery = self.env.delivery
        held = self.held_out
        for action in actions:
            kind = type(action)
            if held is not None and kind in _HELD:
                held.append(action)
                payload = getattr(action, "payload", None)
                self.held_out_bytes += len(payload) if payload is not None else _HELD_COST
                continue
            if kind is Apply:
                delivery.apply(self, action)  # type: ignore[arg-type]
                continue
            if kind is ApplyPayload:
                delivery.apply_payload(self, action)  # type: ignore[arg-type]
                continue
            timed = True
            if kind is ClearRank:
                delivery.clear(self, action.reason)  # type: ignore[union-attr]
            elif kind is RequestReplay or kind is RequestSnapshot:
                self.replay.request(action)  # type: ignore[arg-type]
            elif kind is Reconnect:
                self._reconnect()
            elif kind is Reserve:
                assert isinstance(action, Reserve)
                # A sink sizes its tables for the blocks a snapshot or replay announced.
                delivery.hint(self, "reserve", action.blocks)
            elif kind is StateChanged:
                assert isinstance(action, StateChanged)
                if self.connecting_since is not None and action.new is not RankState.SYNCING:
                    self.env.contacts.done(self)
                if held is not None:
                    self.restated = True  # readiness hears of it at release
                else:
                    self.env.on_state(self)
                self.env.log.note(
                    f"state {action.old.value} -> {action.new.value}",
                    f"{action.old.value} -> {action.new.value} ({action.reason})",
                    self.subject,
                    level=logging.INFO,
                )
        if timed:
            self.schedule()

    def sink_failed(self, exc: Exception) -> None:
        """The sink raised on this rank's batch: the stream decides what the view is worth."""
        self.note("sink-apply", f"sink.apply raised {exc!r}", exc_info=exc)
        self.carry_out(self.stream.sink_failed(time.monotonic(), repr(exc)))


class ReplayChannel:
    """One rank's replay socket, its request slot and the request waiting for one.

    The socket exists only while the stream has a request out or due, and holds
    one of the subscriber's request slots (:class:`~kvwire.subscriber.env.ReplaySlots`)
    meanwhile; a request that finds no slot (or no file to open a socket with)
    waits its turn here, its deadlines started only when it is sent. Its replies
    are read a bounded share at a time, so that the ranks recovering share the
    router's rounds.
    """

    __slots__ = ("dealer", "fd", "link", "queued", "slot", "token", "worker_id")

    def __init__(self, link: RankLink) -> None:
        self.link = link
        self.worker_id = link.worker_id  # (what ReplaySlots counts per source)
        self.dealer: zmq.Socket[bytes] | None = None
        self.fd = -1
        self.token = 0  # of the request out: replies to an older one are not taken
        self.slot = False  # holds one of the requests in flight
        self.queued: tuple[list[bytes], int] | None = None  # a request waiting for a socket

    @property
    def closed(self) -> bool:
        return self.link.closed

    def request(self, action: RequestReplay | RequestSnapshot) -> None:
        """Send what the stream asked, or queue it for its turn."""
        if isinstance(action, RequestReplay):
            frames = replay_request_frames(action.start_seq)
        else:
            frames = snapshot_request_frames()
        self._send(frames, action.token, action.fresh)

    def _open(self) -> bool:
        """A replay socket, in the rank's request slot (taken here if it holds none)."""
        link = self.link
        env = link.env
        if not self.slot:
            if not env.replays.take(self):
                return False
            self.slot = True
        assert link.endpoints.replay_endpoint is not None
        try:
            dealer = env.socket(zmq.DEALER, link.keys)
        except Exception as exc:  # out of sockets or files: wait for one to close
            self.slot = False
            env.replays.refused(self)
            link.note(
                "replay-socket", f"replay socket not opened ({exc}): waiting for one to close"
            )
            return False
        self.dealer = dealer
        # Bounded: a reply flows as fast as it is read (the publisher waits on a full
        # pipe), and a hostile replay socket cannot queue more than this in the router.
        dealer.setsockopt(zmq.RCVHWM, min(link.hwm, _REPLAY_HWM))
        dealer.connect(link.endpoints.replay_endpoint)
        self.fd = env.reactor.watch(dealer, link)
        return True

    def _close(self, keep_slot: bool = False) -> None:
        """Close the replay socket; its request slot goes too, unless ``keep_slot``."""
        dealer = self.dealer
        env = self.link.env
        if dealer is not None:
            self.dealer = None
            env.reactor.unwatch(self.fd)
            self.fd = -1
            dealer.close(linger=0)
        if self.slot and not keep_slot:
            self.slot = False
            env.replays.release(self)

    def release(self) -> None:
        """Close the replay socket once the stream waits for no reply."""
        if self.dealer is not None and not self.link.stream.replay_pending:
            self._close()

    def close(self) -> None:
        """The rank is done: nothing waits, nothing is sent."""
        self.queued = None
        self._close()

    def _send(self, frames: list[bytes], token: int, fresh: bool) -> bool:
        """Send a request, or queue it for its turn (False); ``fresh`` needs a new socket
        (no late replies). A rank holding a request slot keeps it."""
        self.token = token
        if fresh or self.dealer is None:
            self._close(keep_slot=True)
            if not self._open():
                # Wait for a turn (the bounds on requests in flight, or out of files);
                # the stream's deadlines for it start when it is sent.
                if self.queued is None:
                    self.link.env.replays.wait(self)
                self.queued = (frames, token)
                self.link.stream.request_waiting(token)
                return False
            self.queued = None
        dealer = self.dealer
        assert dealer is not None
        try:
            dealer.send_multipart(frames, zmq.NOBLOCK)
        except zmq.ZMQError as exc:  # the request times out and is retried
            self.link.note("replay-not-sent", f"replay request not sent: {exc}")
        return True

    def send_queued(self) -> None:
        """The rank's turn: send the request that waited for it (if still wanted)."""
        request, self.queued = self.queued, None
        link = self.link
        if request is None or link.closed or self.dealer is not None:
            return
        if not link.stream.replay_pending:
            return  # given up meanwhile (a disconnect): the next one asks anew
        frames, token = request
        if self._send(frames, token, fresh=False):
            link.stream.request_sent(token, time.monotonic())
            link.schedule()

    def read(self) -> None:
        """Read the replies queued, about one snapshot chunk's bytes a turn (at most a
        read chunk): the requests in flight share the router's rounds (``request_limit``)."""
        link = self.link
        applied = False
        dealer = self.dealer
        drain = link.env.receive.drain
        left = max(1, min(link.chunk, _REPLY_TURN_BYTES // link.batch_bytes))
        while dealer is not None and self.dealer is dealer:
            chunk = min(link.chunk, left)
            if chunk < 1:
                link.env.reactor.again(link)  # more may wait: the socket will not signal it
                break
            messages = drain(dealer, chunk, _REPLY_FRAMES)
            left -= len(messages)
            if messages:
                link._fit(_sample(messages))
            for frames in messages:
                actions = link.stream.replay_reply(frames, self.token, time.monotonic())
                applied = applied or bool(actions)
                link.carry_out(actions)
                if self.dealer is not dealer:
                    break  # a fresh replay socket replaced this one: read it on its own signal
            if len(messages) < chunk:
                break
        if not link.closed:
            self.release()
            if applied:
                link.env.delivery.flush_later(link)
