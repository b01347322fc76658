"""Bounds shared by every rank of a subscriber: replay sockets, and first contacts.

A rank's first contact is a replay of its publisher's history, and a replay
needs a socket; thousands at once would only queue for replay sockets (and
file descriptors) and time out. Both are bounded by ``max_replays``, and a
rank that finds the bound reached waits in line, oldest first.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from kvwire.subscriber.link import RankLink

__all__ = ["CONTACT_S", "FirstContacts", "ReplaySlots"]

log = logging.getLogger("kvwire.subscriber")

CONTACT_S = 5.0
"""A first contact holds its slot at most this long (its publisher may be down)."""


class ReplaySlots:
    """Replay sockets open at once: at most ``limit``, fewer while the process is out of files."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.open = 0
        self._cap = limit  # lowered while the process is out of files
        self._waiting: deque[RankLink] = deque()

    def take(self) -> bool:
        """Count one more socket, if one may open now."""
        if self.open >= self._cap:
            return False
        self.open += 1
        return True

    def refused(self) -> None:
        """The socket could not open (out of files): hold further ones to those open."""
        self.open -= 1
        self._cap = max(1, self.open)

    def wait(self, link: RankLink) -> None:
        self._waiting.append(link)

    def release(self) -> None:
        """A replay socket closed: send the oldest request that waited for one."""
        self.open -= 1
        if self._cap < self.limit:
            self._cap += 1
        waiting = self._waiting
        for _ in range(len(waiting)):  # a refused socket puts its rank back in line
            if self.open >= self._cap:
                break
            waiting.popleft().send_queued()


class FirstContacts:
    """Ranks connecting for the first time: at most ``limit`` at once, the others in line."""

    def __init__(self, limit: int, clock: Callable[[], float] = time.monotonic) -> None:
        self._limit = limit
        self._clock = clock
        self._active = 0
        self._waiting: deque[RankLink] = deque()
        self.running = True

    def add(self, links: list[RankLink]) -> None:
        self._waiting.extend(links)
        self.more()

    def more(self) -> None:
        """Connect waiting ranks while fewer than the limit are making first contact."""
        waiting = self._waiting
        while waiting and self._active < self._limit and self.running:
            link = waiting.popleft()
            if link.closed:
                continue
            if not link.connect():  # out of files: again later (a timer, a settled rank)
                waiting.appendleft(link)
                return
            link.connecting_since = self._clock()
            self._active += 1
            link.schedule()

    def done(self, link: RankLink) -> None:
        """The rank's first contact is over (or taking too long): let another one start."""
        if link.connecting_since is not None:
            link.connecting_since = None
            self._active -= 1
            self.more()
