"""Helpers for publisher tests: endpoints, waiting with deadlines, a warmed-up SUB."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import zmq

from kvwire.publisher import EventPublisher
from kvwire.wire import AllBlocksCleared, KVEventBatch, parse_live

EPHEMERAL = "tcp://127.0.0.1:*"
"""Bind address for test publishers on tcp: an ephemeral port, reported as ``bound_endpoint``."""


def wait_for(predicate: Callable[[], bool], timeout: float = 10.0, what: str = "condition") -> None:
    """Poll ``predicate`` until it holds; fail the test at the deadline."""
    end = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > end:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.002)


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
    while sub.poll(50):
        sub.recv_multipart()
    return sub, pub.last_seq + 1


def recv_live(sub: zmq.Socket[bytes], timeout_ms: int = 5000) -> Any:
    assert sub.poll(timeout_ms), "no live message arrived"
    return parse_live(sub.recv_multipart())
