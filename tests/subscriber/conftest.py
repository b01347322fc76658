"""Fixtures shared by the subscriber's socket-level tests."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import zmq


@pytest.fixture
def pair() -> Iterator[tuple[zmq.Socket[bytes], zmq.Socket[bytes]]]:
    """Two connected inproc PAIR sockets without limits: a sender and the socket under test."""
    ctx = zmq.Context()
    a: zmq.Socket[bytes] = ctx.socket(zmq.PAIR)
    b: zmq.Socket[bytes] = ctx.socket(zmq.PAIR)
    for s in (a, b):
        s.setsockopt(zmq.SNDHWM, 0)
        s.setsockopt(zmq.RCVHWM, 0)
        s.setsockopt(zmq.LINGER, 0)
    a.bind("inproc://pair")
    b.connect("inproc://pair")
    yield a, b
    a.close()
    b.close()
    ctx.term()
