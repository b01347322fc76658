"""What every link of one subscriber shares, handed to each as one object, and its bounds.

The settings, the context and how sockets are made in it, the reactor, the
output, the rate-limited log and the bounds shared by all ranks (requests in
flight, first contacts, the receive budget's share) live here once, so that a
link, its replay channel and the subscriber read them from the same place.

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

What following many ranks costs the process: per followed rank a SUB socket and
the two ends of its monitor are three ZeroMQ sockets, each with a mailbox file
descriptor, plus the TCP connection; a replay DEALER, open only while a request
is out, adds two descriptors. Checked up front (a clear
:class:`ResourceLimitError`) rather than discovered as a socket that fails to
open at rank 900.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable
from types import ModuleType
from typing import TYPE_CHECKING, Any

import zmq

from kvwire.ratelog import RateLimitedLog
from kvwire.security import ClientKeys, secure_client
from kvwire.subscriber.config import SubscriberConfig
from kvwire.subscriber.delivery import Delivery
from kvwire.subscriber.memory import TrimAfter
from kvwire.subscriber.reactor import Reactor
from kvwire.subscriber.receive import Receive

resource: ModuleType | None
try:
    import resource
except ImportError:  # not a Unix: no soft limit to raise
    resource = None

if TYPE_CHECKING:
    from kvwire.subscriber.link import RankLink, ReplayChannel

__all__ = [
    "CONTACT_S", "RECONNECT_MAX_S", "RECONNECT_MIN_S", "FirstContacts", "LinkEnv",
    "ReplaySlots", "ResourceLimitError", "check_sockets", "ensure_capacity",
]  # fmt: skip

log = logging.getLogger("kvwire.subscriber")

CONTACT_S = 5.0
"""A connection being made holds its place at most this long (its publisher may be down)."""
RECONNECT_MIN_S = 0.1  # a socket's own reconnect interval, and its maximum
RECONNECT_MAX_S = 1.0


def _ignore(link: RankLink) -> None:
    pass


class LinkEnv:
    """What every link of one subscriber shares: settings, context, reactor, output, bounds."""

    __slots__ = (
        "config",
        "contacts",
        "ctx",
        "delivery",
        "log",
        "on_state",
        "ranks",
        "reactor",
        "receive",
        "reopens",
        "replays",
        "trim",
    )

    def __init__(
        self,
        config: SubscriberConfig,
        ctx: zmq.Context[Any],
        reactor: Reactor,
        delivery: Delivery,
        receive: Receive,
        log: RateLimitedLog,
    ) -> None:
        self.config = config
        self.ctx = ctx
        self.reactor = reactor
        self.delivery = delivery
        self.receive = receive
        self.log = log
        self.replays = ReplaySlots(
            config.request_limit(),
            config.source_request_limit(),
            most=config.request_ceiling(),
            round_s=config.round_s(),
        )
        reactor.on_round = self.replays.round
        self.contacts = FirstContacts(config.max_replays)
        self.on_state: Callable[[RankLink], object] = _ignore
        """Called on the loop after a rank's state changed (the subscriber's readiness)."""
        self.ranks = 0  # links open: what each rank's share of the receive budget divides by
        self.trim = TrimAfter(config.receive_budget_bytes)
        self.reopens = 0  # SUBs reopened for a mark their batch size no longer fits

    def socket(self, kind: int, keys: ClientKeys | None) -> zmq.Socket[bytes]:
        """A socket of ``kind`` to a publisher, with the subscriber's limits (and ``keys``)."""
        sock: zmq.Socket[bytes] = zmq.Socket(self.ctx, kind)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.MAXMSGSIZE, self.config.max_message_size)
        sock.setsockopt(zmq.RECONNECT_IVL, int(RECONNECT_MIN_S * 1000))
        sock.setsockopt(zmq.RECONNECT_IVL_MAX, int(RECONNECT_MAX_S * 1000))
        if keys is not None:
            try:
                secure_client(sock, keys)
            except BaseException:
                sock.close(linger=0)
                raise
        return sock


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


SOCKETS_PER_RANK = 3
FDS_PER_RANK = 4
FDS_PER_REPLAY = 2  # a replay DEALER's mailbox and its connection
_FD_MARGIN = 256  # the rest of the process: Python, logs, the sink, libzmq's own
_SOCKET_MARGIN = 64


class ResourceLimitError(RuntimeError):
    """The process or ZeroMQ context cannot open the sockets the sources need."""


def ensure_capacity(ranks: int, max_replays: int) -> None:
    """Raise the open-file soft limit to what ``ranks`` need, or say which limit is short."""
    if resource is None:
        return
    replays = min(ranks, max_replays)
    need = ranks * FDS_PER_RANK + replays * FDS_PER_REPLAY + _FD_MARGIN
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY or soft >= need:
        return
    if hard != resource.RLIM_INFINITY and hard < need:
        raise ResourceLimitError(
            f"following {ranks} ranks needs about {need} open files "
            f"({FDS_PER_RANK} per rank, {FDS_PER_REPLAY} per replay socket, "
            f"max_replays={max_replays}), but this process may open at most {hard} "
            "(RLIMIT_NOFILE hard limit): raise it (ulimit -Hn as root, LimitNOFILE= in a "
            "systemd unit, docker run --ulimit nofile=N:N) or split the sources across "
            "subscriber processes"
        )
    resource.setrlimit(resource.RLIMIT_NOFILE, (need, hard))
    log.info("raised the open-file soft limit from %d to %d for %d ranks", soft, need, ranks)


def check_sockets(ctx: zmq.Context[Any], ranks: int, max_replays: int) -> None:
    """Refuse a context that cannot open the sockets ``ranks`` need."""
    need = ranks * SOCKETS_PER_RANK + min(ranks, max_replays) + _SOCKET_MARGIN
    have = ctx.get(zmq.MAX_SOCKETS)
    if have < need:
        raise ResourceLimitError(
            f"following {ranks} ranks needs about {need} ZeroMQ sockets "
            f"({SOCKETS_PER_RANK} per rank, max_replays={max_replays}), but the "
            f"given context allows {have}: set context.MAX_SOCKETS = {need} (or more) "
            "before it opens any socket, or let the Subscriber make its own context"
        )
