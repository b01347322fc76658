"""Readiness and time for every rank's link, on the running asyncio loop.

The one place where a subscriber waits: which sockets have something to read,
and which deadlines are due, all on the loop it runs on (``add_reader`` and
``call_later``); nothing here blocks or polls on its own.

**Readiness.** The ranks whose sockets signalled are read in *rounds*: each
(:meth:`RankLink.service <kvwire.subscriber.link.RankLink.service>`) reads its
sockets to the end, so that they signal again on the next arrival, then
``after_round`` runs (a buffering sink's flush). What is ready when the loop
wakes is read in one round, so a fleet's batches arriving together cost one
wake-up; a rank with more queued than one burst is read again next round.

On Linux the descriptors sit in one epoll set of the reactor's, and the loop
watches that set through a *gate*, a second epoll set holding only the first:
a wake-up costs in proportion to the ranks that have something to read, and
the loop's selector holds one entry however many ranks are followed. While
rounds keep finding batches, the reactor switches the set off in the gate
(``EPOLL_CTL_MOD``, one system call) and reads on a timer every
:data:`PACE_S`; after a round that finds nothing it switches it back on, and
the next arrival wakes the loop at once. A busy fleet's batches thus share
wake-ups (one every 2 ms rather than one per batch) with no blocking call in
the loop. (Taking the set out of the loop's selector and adding it back would
do the same, but adding an epoll set to another makes the kernel walk every
descriptor in it: about 170 us at 1,024 ranks, twice the subscriber's CPU in
all.) Elsewhere each descriptor is the loop's own reader, whose callback
processes the socket's commands (``ZMQ_EVENTS``) and marks the rank.

**Time.** Each rank has at most one loop timer, at its next deadline (replay
timeouts, retries, idle probes, reconnects; re-read at least every
:data:`MAX_TIMER_S`): an earlier deadline replaces it, a later one waits for it
to fire and be re-read. A rank in sequence with a heartbeating publisher whose
only deadline is the silence that live messages keep moving holds no timer: a
*sweep*, once a heartbeat interval, reads those ranks' deadlines and gives a
timer only to a rank whose silence falls due before the next sweep. Live
messages thus cost no timer work.
"""

from __future__ import annotations

import asyncio
import contextlib
import select
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, cast

import zmq

if TYPE_CHECKING:
    from kvwire.subscriber.link import RankLink as Link

__all__ = ["MAX_TIMER_S", "PACE_S", "Reactor", "watches_descriptors"]

MAX_TIMER_S = 5.0
"""A rank's deadline is re-read at least this often."""

PACE_S = 0.002
"""While rounds keep finding batches, the next round is this long after the last
(Linux): a batch waits at most this long, and a fleet's batches share wake-ups."""

_clock = time.monotonic
_POLLIN = zmq.POLLIN
_EVENTS = zmq.EVENTS


def watches_descriptors(loop: asyncio.AbstractEventLoop) -> bool:
    """Whether ``loop`` can watch file descriptors (``add_reader``), which the reactor needs:
    selector loops and uvloop can; Windows' proactor loop keeps asyncio's abstract method."""
    impl = getattr(type(loop), "add_reader", None)
    return impl is not None and impl is not asyncio.AbstractEventLoop.add_reader


class Reactor:
    """Watches the links' sockets and keeps their timers on ``loop``; see the module."""

    def __init__(self, loop: asyncio.AbstractEventLoop, after_round: Callable[[], None]) -> None:
        self._loop = loop
        self._after_round = after_round
        self._running = True
        self._watched: dict[int, tuple[Link, bool]] = {}  # fd -> (rank, is its monitor)
        self._epoll: Any = None  # Linux: the sockets' set
        self._gate: Any = None  # Linux: a set holding only that one, the loop's reader
        self._paused = False  # the gate holds the sockets' set with no events
        self._held = False  # not listening: the output cannot take more
        if hasattr(select, "epoll"):  # elsewhere each socket is the loop's own reader
            self._epoll = select.epoll()
            self._gate = select.epoll()
            self._gate.register(self._epoll.fileno(), select.EPOLLIN)
            loop.add_reader(self._gate.fileno(), self._read)
        self._marked: dict[Link, bool] = {}  # rank -> whether its monitor signalled
        self._round: asyncio.Handle | None = None  # a round due without a signal
        self._round_soon = False  # ... in the loop's next iteration (not paced)
        self._swept: dict[Link, None] = {}  # ranks whose only deadline is a silence
        self._sweep_s = MAX_TIMER_S
        self._sweep_at = 0.0
        self._sweep_handle: asyncio.TimerHandle | None = None
        self.on_round: Callable[[float], object] | None = None
        """Told how long each round of reading took (the request pacing's measure)."""

    # --- readiness -----------------------------------------------------------------------

    def watch(self, sock: zmq.Socket[bytes], link: Link, monitor: bool = False) -> int:
        """Mark ``link`` (``monitor``: as having connection events) when ``sock`` signals;
        the descriptor, for :meth:`unwatch`."""
        fd = cast(int, sock.getsockopt(zmq.FD))
        if self._epoll is not None:
            self._epoll.register(fd, select.EPOLLIN)
        else:
            self._loop.add_reader(fd, self._signalled, sock, link, monitor)
        self._watched[fd] = (link, monitor)
        return fd

    def unwatch(self, fd: int) -> None:
        if self._watched.pop(fd, None) is None:
            return
        if self._epoll is not None:
            with contextlib.suppress(OSError):
                self._epoll.unregister(fd)
        else:
            self._loop.remove_reader(fd)

    def _signalled(self, sock: zmq.Socket[bytes], link: Link, monitor: bool) -> None:
        """One socket signalled (nothing nests): mark its rank for this round."""
        # Processing the socket's commands clears its descriptor: no spin until it is read.
        if not cast(int, sock.getsockopt(_EVENTS)) & _POLLIN:
            return
        self._mark(link, monitor)

    def again(self, link: Link, monitor: bool = False) -> None:
        """Read ``link`` (``monitor``: its monitor too) in the loop's next round although
        its sockets will not signal (more is queued than one burst, or the iterator's
        reader caught up)."""
        self._mark(link, monitor)

    def hold(self) -> None:
        """Stop listening until :meth:`release`: the output cannot take more now.

        The sockets' set is level-triggered: unread sockets would wake the loop at once
        again. (Where each socket is the loop's reader, a signal taken is not given
        again, so nothing needs holding; the ranks read meanwhile defer themselves.)
        """
        if self._held:
            return
        self._held = True
        if self._gate is not None:
            self._switch(False)

    def release(self) -> None:
        if not self._held or not self._running:
            return
        self._held = False
        if self._gate is not None:
            self._switch(True)

    def _switch(self, on: bool) -> None:
        """Turn the sockets' set on or off in the gate (Linux)."""
        if on == self._paused:
            self._gate.modify(self._epoll.fileno(), select.EPOLLIN if on else 0)
            self._paused = not on

    def _mark(self, link: Link, monitor: bool) -> None:
        self._marked[link] = monitor or self._marked.get(link, False)
        if not self._round_soon and self._running:
            if self._round is not None:
                self._round.cancel()  # a paced round: this one cannot wait for it
            self._round = self._loop.call_soon(self._read)
            self._round_soon = True

    def _paced(self) -> None:
        self._round = None
        self._read()

    def _read(self) -> None:
        """One round: every rank whose sockets signalled, and those left unfinished."""
        if self._round is not None:
            self._round.cancel()  # this round reads what it was for
            self._round = None
        self._round_soon = False
        began = _clock()
        marked, self._marked = self._marked, {}
        ready = self._epoll.poll(0) if self._epoll is not None else ()  # (or readers marked)
        watched = self._watched
        for fd, _ in ready:
            entry = watched.get(fd)
            if entry is not None:
                link, monitor = entry
                marked[link] = monitor or marked.get(link, False)
        more: list[Link] = []
        for link, monitor in marked.items():
            if not link.closed and link.service(monitor):
                more.append(link)
        self._after_round()
        if self.on_round is not None:
            self.on_round(_clock() - began)
        for link in more:
            if not link.closed:
                self.again(link)
        if self._gate is not None and self._running:
            self._pace(bool(marked))

    def _pace(self, busy: bool) -> None:
        """While rounds find something, read every :data:`PACE_S` on a timer with the
        sockets' set switched off in the gate; after a round that finds nothing, listen."""
        if self._held:
            return  # switched off until released
        if busy:
            self._switch(False)
            if self._round is None:
                self._round = self._loop.call_later(PACE_S, self._paced)
        else:
            self._switch(True)

    # --- time ----------------------------------------------------------------------------

    def schedule(self, link: Link, now: float | None = None) -> None:
        """Set the rank's timer to its next deadline, or leave it to the sweeps when
        that is only a silence that live messages keep moving."""
        if link.closed or not self._running:
            return
        if now is None:
            now = _clock()
        silence = link.silence()
        if silence is not None and self._sweep_later(link, *silence, now):
            return
        self._swept.pop(link, None)
        deadline = link.deadline(now)
        cap = now + MAX_TIMER_S
        at = cap if deadline is None or deadline > cap else deadline
        if link.timer is not None:
            if link.timer_at is not None and link.timer_at <= at:
                return  # an earlier wake-up is already due; it re-reads the deadline
            link.timer.cancel()
        link.timer_at = at
        link.timer = self._loop.call_later(max(0.0, at - now), self._fire, link)

    def forget(self, link: Link) -> None:
        """The rank is closed: no timer, no sweep, no round."""
        self._swept.pop(link, None)
        self._marked.pop(link, None)
        if link.timer is not None:
            link.timer.cancel()
            link.timer = link.timer_at = None

    def _fire(self, link: Link) -> None:
        link.timer = link.timer_at = None
        if link.closed:
            return
        now = _clock()
        link.on_timer(now)
        self.schedule(link, now)
        self._after_round()

    def _sweep_later(self, link: Link, deadline: float, period: float, now: float) -> bool:
        """Leave the rank's silence to the sweeps, unless it falls due before the next one.

        Sweeps run every heartbeat interval (the shortest among the swept ranks, at
        most :data:`MAX_TIMER_S`): a rank heard from meanwhile has had its deadline
        moved past the following sweep and costs no timer; one whose silence falls
        due before the following sweep gets a timer at its exact deadline.
        """
        period = min(period, MAX_TIMER_S)
        if self._sweep_handle is None:
            self._sweep_s = period
            self._arm_sweep(now)
        elif period < self._sweep_s:
            self._sweep_s = period
            if self._sweep_at > now + period:
                self._arm_sweep(now)
        if deadline <= self._sweep_at:
            return False
        if link.timer is not None:  # superseded
            link.timer.cancel()
            link.timer = link.timer_at = None
        self._swept[link] = None
        return True

    def _arm_sweep(self, now: float) -> None:
        if self._sweep_handle is not None:
            self._sweep_handle.cancel()
        self._sweep_at = now + self._sweep_s
        self._sweep_handle = self._loop.call_later(self._sweep_s, self._sweep)

    def _sweep(self) -> None:
        """The swept ranks whose silence falls due before the next sweep get a timer.

        Only the stream's own deadline is read, so live messages cost the sweep
        nothing. Every way out of sequence passes through :meth:`schedule`, which
        takes the rank off the sweep (one found out of it anyway is timed here).
        """
        self._sweep_handle = None
        if not self._swept or not self._running:
            return
        now = _clock()
        self._arm_sweep(now)
        horizon = self._sweep_at
        due = [
            link for link in self._swept if (at := link.stream.silence_deadline()) is None or at <= horizon
        ]
        for link in due:
            del self._swept[link]
            self.schedule(link, now)

    def close(self) -> None:
        """Stop every reader and timer (the links close their own sockets)."""
        for fd in list(self._watched):
            self.unwatch(fd)
        self._running = False
        if self._gate is not None:
            self._loop.remove_reader(self._gate.fileno())
            self._gate.close()
            self._epoll.close()
        for handle in (self._round, self._sweep_handle):
            if handle is not None:
                handle.cancel()
        self._round = self._sweep_handle = None
        self._marked.clear()
        self._swept.clear()
