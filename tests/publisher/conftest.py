"""Helpers for publisher tests: endpoints, a warmed-up SUB (and the suite's one wait helper)."""

from __future__ import annotations

import time
from typing import Any

import zmq

from kvwire.publisher import EventPublisher
from kvwire.wire import AllBlocksCleared, KVEventBatch, parse_live
from tests.waiting import wait_for

__all__ = ["EPHEMERAL", "PING", "connect_sub", "recv_live", "wait_for"]

EPHEMERAL = "tcp://127.0.0.1:*"
"""Bind address for test publishers on tcp: an ephemeral port, reported as ``bound_endpoint``."""


PING = KVEventBatch(0.0, [AllBlocksCleared()], 0)


def connect_sub(
    ctx: zmq.Context[Any], pub: EventPublisher, topic: bytes = b"", **opts: int
) -> tuple[zmq.Socket[bytes], int]:
    """A SUB socket that has provably joined: publish pings until one arrives.

    Returns the socket, drained, and the seq the next published batch gets.
    """
    sub: zmq.Socket[bytes] = ctx.socket(zmq.SUB)
    for opt, value in opts.items():
        sub.setsockopt(getattr(zmq, opt), value)
    sub.setsockopt(zmq.SUBSCRIBE, topic)
    sub.connect(pub.bound_endpoint)
    end = time.monotonic() + 10
    while True:
        pub.publish(PING)
        if sub.poll(20):
            break
        if time.monotonic() > end:
            raise AssertionError("subscriber never received a ping")
    wait_for(lambda: pub.stats().queue_depth == 0, what="pings sent")
    # Drain what the pings left, for a bounded time: a publisher heartbeating every
    # 50 ms would otherwise keep the socket readable (and this loop going) for ever.
    end = time.monotonic() + 1.0
    while sub.poll(50) and time.monotonic() < end:
        sub.recv_multipart()
    return sub, pub.last_seq + 1


def recv_live(sub: zmq.Socket[bytes], timeout_ms: int = 5000) -> Any:
    assert sub.poll(timeout_ms), "no live message arrived"
    return parse_live(sub.recv_multipart())
