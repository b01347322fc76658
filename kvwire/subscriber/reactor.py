"""Readiness and time for every rank's link, on the running asyncio loop.

The one place where a subscriber waits. Every socket's ZeroMQ file descriptor
is watched with the loop's ``add_reader`` (epoll on Linux, kqueue on macOS,
whatever selector the loop has elsewhere), and every deadline is a loop timer
(``call_later``); nothing here blocks or polls.

**Readiness.** A ZeroMQ descriptor signals that the socket has commands to
process, and stays readable until they are: the watcher processes them at once
(``ZMQ_EVENTS``, which also says whether a message waits) and marks the rank,
so the loop does not spin on it, and the socket signals again only once it has
been read to the end. Marked ranks are read in *rounds*: a round reads every
marked rank (:meth:`Link.service`), then calls ``after_round`` (a buffering
sink's flush). A round follows the previous one by at least ``coalesce_s``, so
a fleet of ranks sending a batch each now and then is read a handful at a time
rather than one wake-up per batch; a batch waits at most that long. A rank with
more queued than one burst asks for the next round itself (its socket will not
signal what it already holds).

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
import time
from collections.abc import Callable
from typing import Any, Protocol, cast

import zmq

__all__ = ["MAX_TIMER_S", "Link", "Reactor"]

MAX_TIMER_S = 5.0
"""A rank's deadline is re-read at least this often."""

_POLLIN = zmq.POLLIN
_EVENTS = zmq.EVENTS


class Link(Protocol):
    """What the reactor needs of a rank: a way to read it, its deadlines, its timer."""

    closed: bool
    timer: asyncio.TimerHandle | None
    timer_at: float | None

    def service(self, monitor: bool) -> bool:
        """Read what the rank's sockets hold (``monitor``: its monitor signalled);
        whether more is queued than one burst."""

    def on_timer(self, now: float) -> None:
        """A deadline of the rank may have passed."""

    def deadline(self, now: float) -> float | None:
        """The rank's next deadline (``None``: none)."""

    def silence(self) -> tuple[float, float] | None:
        """(when the silence falls due, the heartbeat interval) if the rank's only
        deadline is a silence that live messages move (it can then be swept instead
        of timed), else ``None``."""

    def silence_deadline(self) -> float | None:
        """When the rank's silence falls due (``None``: it is no longer only silent)."""


class Reactor:
    """Watches the links' sockets and keeps their timers on ``loop``; see the module."""

    def __init__(
        self,
        loop: asyncio.AbstractEventLoop,
        coalesce_s: float,
        after_round: Callable[[], None],
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._loop = loop
        self._coalesce_s = coalesce_s
        self._after_round = after_round
        self._clock = clock
        self._running = True
        self._watched: set[int] = set()
        self._marked: dict[Link, bool] = {}  # rank -> whether its monitor signalled
        self._round: asyncio.Handle | None = None
        self._round_soon = False  # the round is the loop's next callback, not a timer
        self._quiet_until = 0.0  # the next round may start no earlier
        self._swept: dict[Link, None] = {}  # ranks whose only deadline is a silence
        self._sweep_s = MAX_TIMER_S
        self._sweep_at = 0.0
        self._sweep_handle: asyncio.TimerHandle | None = None
        self._ticks: list[asyncio.TimerHandle] = []

    # --- readiness -----------------------------------------------------------------------

    def watch(self, sock: zmq.Socket[bytes], link: Link, monitor: bool = False) -> int:
        """Mark ``link`` (``monitor``: as having connection events) when ``sock`` has a
        message; the descriptor, for :meth:`unwatch`."""
        fd = cast(int, sock.getsockopt(zmq.FD))
        self._loop.add_reader(fd, self._signalled, sock, link, monitor)
        self._watched.add(fd)
        return fd

    def unwatch(self, fd: int) -> None:
        if fd in self._watched:
            self._watched.discard(fd)
            self._loop.remove_reader(fd)

    def _signalled(self, sock: zmq.Socket[bytes], link: Link, monitor: bool) -> None:
        # Processing the socket's commands clears its descriptor: no spin until it is read.
        if not cast(int, sock.getsockopt(_EVENTS)) & _POLLIN:
            return
        marked = self._marked
        if monitor:
            marked[link] = True
        elif link not in marked:
            marked[link] = False
        if self._round is None and self._running:
            delay = self._quiet_until - self._clock()
            if delay > 0:
                self._round = self._loop.call_later(delay, self._read)
            else:
                self._round_soon = True
                self._round = self._loop.call_soon(self._read)

    def again(self, link: Link) -> None:
        """Read ``link`` at once, in the loop's next round, although its sockets will not
        signal (more is queued than one burst, or the iterator's reader caught up)."""
        if link not in self._marked:
            self._marked[link] = False
        if self._round_soon or not self._running:
            return
        if self._round is not None:
            self._round.cancel()
        self._round_soon = True
        self._round = self._loop.call_soon(self._read)

    def _read(self) -> None:
        """One round: every marked rank, in the order they signalled."""
        self._round = None
        self._round_soon = False
        marked, self._marked = self._marked, {}
        more: list[Link] = []
        for link, monitor in marked.items():
            if not link.closed and link.service(monitor):
                more.append(link)
        self._after_round()
        self._quiet_until = self._clock() + self._coalesce_s
        for link in more:
            if not link.closed:
                self.again(link)

    # --- time ----------------------------------------------------------------------------

    def schedule(self, link: Link, now: float | None = None) -> None:
        """Set the rank's timer to its next deadline, or leave it to the sweeps when
        that is only a silence that live messages keep moving."""
        if link.closed or not self._running:
            return
        if now is None:
            now = self._clock()
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
        now = self._clock()
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
        now = self._clock()
        self._arm_sweep(now)
        horizon = self._sweep_at
        due = [
            link for link in self._swept if (at := link.silence_deadline()) is None or at <= horizon
        ]
        for link in due:
            del self._swept[link]
            self.schedule(link, now)

    def every(self, interval: float, callback: Callable[[], Any]) -> None:
        """Call ``callback`` every ``interval`` seconds while the reactor runs."""

        def tick() -> None:
            callback()
            self._ticks[index] = self._loop.call_later(interval, tick)

        index = len(self._ticks)
        self._ticks.append(self._loop.call_later(interval, tick))

    def close(self) -> None:
        """Stop every reader and timer (the links close their own sockets)."""
        self._running = False
        for fd in list(self._watched):
            self.unwatch(fd)
        for handle in (self._round, self._sweep_handle, *self._ticks):
            if handle is not None:
                handle.cancel()
        self._ticks.clear()
        self._round = self._sweep_handle = None
        self._marked.clear()
        self._swept.clear()
