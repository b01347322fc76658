"""Fixtures shared by the subscriber's socket-level tests."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import zmq

from tests.subscriber.helpers import inproc_pair


@pytest.fixture
def pair() -> Iterator[tuple[zmq.Socket[bytes], zmq.Socket[bytes]]]:
    """Two connected inproc PAIR sockets without limits: a sender and the socket under test."""
    with inproc_pair() as sockets:
        yield sockets
