"""What every link of one subscriber shares, handed to each as one object.

The settings, the context and how sockets are made in it, the reactor, the
output, the rate-limited log and the bounds shared by all ranks (requests in
flight, first contacts, the receive budget's share) live here once, so that a
link, its replay channel and the subscriber read them from the same place.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import zmq

from kvwire.ratelog import RateLimitedLog
from kvwire.security import ClientKeys, secure_client
from kvwire.subscriber.config import SubscriberConfig
from kvwire.subscriber.delivery import Delivery
from kvwire.subscriber.memory import TrimAfter
from kvwire.subscriber.reactor import Reactor
from kvwire.subscriber.receive import Receive
from kvwire.subscriber.slots import FirstContacts, ReplaySlots

if TYPE_CHECKING:
    from kvwire.subscriber.link import RankLink

__all__ = ["RECONNECT_MAX_S", "RECONNECT_MIN_S", "LinkEnv"]

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
