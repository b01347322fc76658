"""Bounds shared by every rank of a subscriber: requests in flight, and first contacts.

A rank's first contact is a replay of its publisher's history, a lost view a
snapshot; thousands asked at once would only share the router's reading (and
the engines' serving) so thinly that they time out, each then served again from
its start. Requests in flight are bounded per subscriber and per source
(:meth:`SubscriberConfig.request_limit <kvwire.subscriber.config.SubscriberConfig.request_limit>`);
a request that finds the bound reached waits its turn, oldest first, and its
deadlines start only when it is sent; the limit follows the router's rounds of
reading (:meth:`ReplaySlots.round`). Connections being made are bounded by
``max_replays`` (:class:`FirstContacts`): a rank frees its place when its
handshake succeeds, and its replay then waits its turn here.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from kvwire.subscriber.channel import ReplayChannel
    from kvwire.subscriber.link import RankLink

__all__ = ["CONTACT_S", "FirstContacts", "ReplaySlots"]

log = logging.getLogger("kvwire.subscriber")

CONTACT_S = 5.0
"""A connection being made holds its place at most this long (its publisher may be down)."""


class ReplaySlots:
    """Requests in flight, each holding a replay socket: at most ``limit`` at once (fewer
    while the process is out of files) and ``per_source`` to one source; the others
    wait their turn, oldest first among the sources that have room.

    A rank keeps its slot while its stream has a request out or due (a replay that
    follows a snapshot goes on in the same slot) and gives it back when its replay
    socket closes.

    ``most`` (above ``limit``) and ``round_s`` (the subscriber's
    :meth:`SubscriberConfig.round_s <kvwire.subscriber.config.SubscriberConfig.round_s>`;
    both given, or the limit stays fixed): the limit follows what the router reads in time
    (:meth:`round`): a round of reading slower than ``round_s`` takes a quarter off
    it, and while requests wait and rounds take under a quarter of ``round_s`` it
    grows by one a round, up to ``most``. Small replies (an engine's short buffer)
    then go out many at once; snapshot chunks as many as the router applies in time.
    """

    def __init__(
        self,
        limit: int,
        per_source: int | None = None,
        *,
        most: int | None = None,
        round_s: float = 0.0,
    ) -> None:
        self.limit = limit
        self.per_source = limit if per_source is None else max(1, min(per_source, limit))
        self.most = limit if most is None else max(limit, most)
        self.adaptive = self.most > limit and round_s > 0
        self.round_s = round_s
        self.open = 0
        self.peak = 0  # the most in flight at once
        self.source_peak = 0  # the most in flight at once to one source
        self.waited = 0  # requests that waited for their turn
        self.lowest = limit  # the lowest limit the rounds' times led to
        self._cap = limit  # lowered while the process is out of files
        self._by_source: dict[str, int] = {}
        self._waiting: dict[str, deque[tuple[int, ReplayChannel]]] = {}
        self._ticket = 0

    def round(self, seconds: float) -> None:
        """A round of reading took ``seconds``: follow it with the limit (see the class)."""
        if not self.adaptive:
            return
        if seconds > self.round_s:
            lower = max(1, self.limit - max(1, self.limit // 4))
            if lower < self.limit:
                self.limit = lower
                self._cap = min(self._cap, lower)
                self.lowest = min(self.lowest, lower)
        elif seconds < self.round_s / 4 and self._waiting and self.open >= self._cap:
            if self.limit < self.most:
                self.limit += 1
            if self._cap < self.limit:
                self._cap += 1
                self._grant()

    def take(self, link: ReplayChannel) -> bool:
        """Count one more request of ``link``, if one may go out now."""
        source = link.worker_id
        held = self._by_source.get(source, 0)
        if self.open >= self._cap or held >= self.per_source:
            return False
        self.open += 1
        self._by_source[source] = held + 1
        self.peak = max(self.peak, self.open)
        self.source_peak = max(self.source_peak, held + 1)
        return True

    def _give(self, link: ReplayChannel) -> None:
        self.open -= 1
        source = link.worker_id
        left = self._by_source[source] - 1
        if left:
            self._by_source[source] = left
        else:
            del self._by_source[source]

    def refused(self, link: ReplayChannel) -> None:
        """The socket could not open (out of files): hold further ones to those open."""
        self._give(link)
        self._cap = max(1, self.open)

    def wait(self, link: ReplayChannel) -> None:
        """``link`` has a request waiting for its turn (:meth:`ReplayChannel.send_queued`)."""
        self._ticket += 1
        self.waited += 1
        self._waiting.setdefault(link.worker_id, deque()).append((self._ticket, link))

    def release(self, link: ReplayChannel) -> None:
        """A request's socket closed: send the oldest waiting ones that may go now."""
        self._give(link)
        if self._cap < self.limit:
            self._cap += 1
        self._grant()

    def _grant(self) -> None:
        waiting = self._waiting
        while self.open < self._cap and waiting:
            best: tuple[int, str] | None = None
            for source in list(waiting):
                queue = waiting[source]
                while queue and (queue[0][1].closed or queue[0][1].queued is None):
                    queue.popleft()  # closed, or its request went out another way
                if not queue:
                    del waiting[source]
                elif self._by_source.get(source, 0) < self.per_source and (
                    best is None or queue[0][0] < best[0]
                ):
                    best = (queue[0][0], source)
            if best is None:
                return
            link = waiting[best[1]].popleft()[1]
            if not waiting[best[1]]:
                del waiting[best[1]]
            link.send_queued()  # a refused socket puts its rank back in line, lowers the cap


class FirstContacts:
    """Ranks connecting for the first time: at most ``limit`` at once, the others in line;
    a rank's place is freed by its handshake, its first state change, or ``CONTACT_S``."""

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
