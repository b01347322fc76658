"""The replay ROUTER's native sends (``sender/serve.c``): a replay range straight from the
sender's ring, shared payloads, and their bytes in flight as libzmq lets go of them.

Each test drives its own ROUTER with a ``Replies`` on a running publisher's sender (the
ring it reads), so what a client receives is compared with the wire helpers' frames.
"""

from __future__ import annotations

import itertools
import os
import select
from collections.abc import Iterator
from typing import Any

import pytest
import zmq

from kvwire._native import libzmq_path
from kvwire.publisher import EventPublisher, PublisherConfig
from kvwire.publisher._sender import Replies, Sender, holders, payload_of
from kvwire.publisher.batch import CollectedBatch
from kvwire.wire import pack_seq, replay_item_frames

from .conftest import EPHEMERAL, wait_for

TOPIC = b"kv@test"
_names = itertools.count()
BATCH = 1000  # bytes of each published payload (exact bytes are sent as they are)


def payload(i: int) -> bytes:
    """A distinct payload per seq (the sender sends exact bytes as it is given them)."""
    return i.to_bytes(8, "big") * (BATCH // 8)


@pytest.fixture
def pub() -> Iterator[EventPublisher]:
    config = PublisherConfig(heartbeat_s=None, buffer_steps=32, snapshot=False)
    with EventPublisher(EPHEMERAL, config=config) as p:
        for i in range(40):
            p.publish(payload(i))
        wait_for(lambda: p.replayable_seqs()[-1:] == [p.last_seq], what="batches in the ring")
        yield p


class Pair:
    """A ROUTER with its Replies, and a DEALER client connected to it."""

    def __init__(self, ctx: zmq.Context[Any], pub: EventPublisher, small: bool = False) -> None:
        self.router = ctx.socket(zmq.ROUTER)
        self.router.setsockopt(zmq.ROUTER_MANDATORY, 1)
        if small:  # a client that does not read fills its pipe soon
            self.router.setsockopt(zmq.SNDHWM, 2)
        self.router.setsockopt(zmq.LINGER, 0)
        # inproc: a message stays in the pipe until the client reads it (no kernel buffer
        # takes it first), so what is in flight is exactly what the client has not read.
        address = f"inproc://replies-{next(_names)}"
        self.router.bind(address)
        self.replies = Replies(pub._sender, self.router.underlying, libzmq_path())
        self.dealer = ctx.socket(zmq.DEALER)
        if small:
            self.dealer.setsockopt(zmq.RCVHWM, 1)
        self.dealer.setsockopt(zmq.LINGER, 0)
        self.dealer.connect(address)
        self.dealer.send(b"hello")
        assert self.router.poll(5000)
        self.identity = self.router.recv_multipart()[0]

    def read(self, n: int) -> list[list[bytes]]:
        got = []
        for _ in range(n):
            assert self.dealer.poll(5000), "a reply message did not arrive"
            got.append(self.dealer.recv_multipart())
        return got

    def close(self) -> None:
        self.dealer.close(0)
        self.router.close(0)


@pytest.fixture
def pair(zctx: zmq.Context[Any], pub: EventPublisher) -> Iterator[Pair]:
    p = Pair(zctx, pub)
    yield p
    p.close()


def test_a_range_is_sent_as_the_wire_helpers_frame_it_from_the_ring(
    pub: EventPublisher, pair: Pair
) -> None:
    account = pair.replies.account()
    first = pub.last_seq + 1 - 10
    rc, sent, nbytes, found, next_seq = pair.replies.send_range(
        account, pair.identity, TOPIC, first, 64, 1 << 30, 1 << 30
    )
    assert (rc, sent, found, next_seq) == (0, 10, 10, first + 10)
    assert nbytes == 10 * BATCH
    got = pair.read(10)
    want = [replay_item_frames(TOPIC, s, payload(s)) for s in range(first, first + 10)]
    assert got == want
    # Each ring payload went zero-copy: the ring's buffers, not copies, were in the pipe.
    wait_for(lambda: account.in_flight == 0, what="every payload taken")
    assert account.taken == nbytes == pair.replies.taken
    assert pair.replies.in_flight == 0 and pair.replies.peak >= BATCH


def test_a_range_asked_from_before_the_ring_starts_at_its_oldest_and_stops_at_n(
    pub: EventPublisher, pair: Pair
) -> None:
    oldest = pub.replayable_seqs()[0]
    _, sent, _, found, next_seq = pair.replies.send_range(
        pair.replies.account(), pair.identity, TOPIC, 0, 3, 1 << 30, 1 << 30
    )
    assert (sent, found, next_seq) == (3, 3, oldest + 3)
    assert [int.from_bytes(f[2], "big") for f in pair.read(3)] == [oldest, oldest + 1, oldest + 2]
    # Past the newest: nothing found, nothing sent.
    assert pair.replies.send_range(
        pair.replies.account(), pair.identity, TOPIC, pub.last_seq + 1, 8, 1 << 30, 1 << 30
    )[1:4] == (0, 0, 0)


def test_the_byte_bounds_hold_and_one_message_always_goes_alone(
    pub: EventPublisher, zctx: zmq.Context[Any]
) -> None:
    # A client that does not read yet: what is sent stays in flight.
    pair = Pair(zctx, pub)
    try:
        replies = pair.replies
        a, b = replies.account(), replies.account()
        first = pub.last_seq + 1 - 8
        # A job's share fits two payloads and a half: two go, the third waits.
        rc, sent, _, found, _ = replies.send_range(
            a, pair.identity, TOPIC, first, 8, int(2.5 * BATCH), 1 << 30
        )
        assert (rc, sent, found) == (0, 2, 8)
        # A share smaller than one payload still lets one through, alone (nothing in flight).
        rc, sent, *_ = replies.send_range(b, pair.identity, TOPIC, first, 8, 10, 1 << 30)
        assert (rc, sent) == (0, 1)
        # The total bound counts every job's: with 3 in flight, a total of 3.5 takes no more.
        assert (
            replies.send_range(b, pair.identity, TOPIC, first, 8, 1 << 30, int(3.5 * BATCH))[1] == 0
        )
        assert (
            replies.send(b, pair.identity, (b"",), payload_of(b"x" * BATCH), 1 << 30, 3 * BATCH)
            == -1
        )
        assert replies.peak == replies.in_flight == 3 * BATCH
        pair.read(3)
        wait_for(lambda: replies.in_flight == 0, what="taken once read")
        assert (a.in_flight, b.in_flight, a.taken, b.taken) == (0, 0, 2 * BATCH, BATCH)
    finally:
        pair.close()


def test_a_full_pipe_and_an_unknown_peer_are_errors_before_anything_is_sent(
    pub: EventPublisher, zctx: zmq.Context[Any]
) -> None:
    pair = Pair(zctx, pub, small=True)
    try:
        replies = pair.replies
        account = replies.account()
        sent = 0
        rc = 0
        for _ in range(100):  # until the pipe is full
            rc, n, *_ = replies.send_range(
                account, pair.identity, TOPIC, pub.last_seq, 1, 1 << 40, 1 << 40
            )
            sent += n
            if rc:
                break
        assert rc == zmq.EAGAIN and n == 0 and sent > 0
        assert replies.in_flight == account.in_flight == sent * BATCH
        chunk = payload_of(b"c" * 64)
        assert replies.send(account, pair.identity, (b"",), chunk, 1 << 40, 1 << 40) == zmq.EAGAIN
        assert replies.send(account, b"nobody", (b"",), chunk, 1 << 40, 1 << 40) == zmq.EHOSTUNREACH
        assert holders(chunk) == 1  # nothing kept by a send that failed
        assert replies.in_flight == sent * BATCH
    finally:
        pair.close()
    # Its pipe torn down, libzmq lets go of every message: nothing is left counted.
    wait_for(lambda: replies.in_flight == 0, what="the dropped pipe's messages released")
    assert account.taken == sent * BATCH


def test_a_shared_payload_is_one_buffer_in_every_pipe_and_outlives_its_senders(
    pub: EventPublisher, zctx: zmq.Context[Any]
) -> None:
    pairs = [Pair(zctx, pub) for _ in range(3)]
    chunk = payload_of(b"snapshot chunk" * 100)
    assert bytes(chunk) == b"snapshot chunk" * 100 and len(chunk) == 1400
    accounts = []
    try:
        for p in pairs:
            account = p.replies.account()
            accounts.append(account)
            head = (b"", b"kvwire-snapshot", TOPIC, pack_seq(7), pack_seq(1))
            assert p.replies.send(account, p.identity, head, chunk, 1 << 30, 1 << 30) == 0
        # Each client's copy came from that one buffer (or is still referenced by libzmq).
        for p in pairs:
            assert p.read(1) == [[b"", b"kvwire-snapshot", TOPIC, pack_seq(7), pack_seq(1),
                                  bytes(chunk)]]  # fmt: skip
        wait_for(lambda: holders(chunk) == 1, what="every pipe let go of the chunk")
    finally:
        for p in pairs:
            p.close()
    del pairs
    assert [a.taken for a in accounts] == [1400] * 3


def test_arm_wakes_the_service_descriptor_when_a_client_takes_something(
    pub: EventPublisher, zctx: zmq.Context[Any]
) -> None:
    # A sender of its own, never started: no service thread reads its descriptor.
    sender = Sender(
        topic=TOPIC, dialect="map", rank=0, max_queue=8, buffer_steps=8, coalesce_s=0.0,
        heartbeat_s=0.0, mirror=False, mirror_backlog=1, batch_type=CollectedBatch,
        encode=lambda batch: None,
    )  # fmt: skip
    pair = Pair(zctx, pub)
    try:
        replies = Replies(sender, pair.router.underlying, libzmq_path())
        poller = select.poll()
        poller.register(sender.service_fd, select.POLLIN)
        account = replies.account()
        chunk = payload_of(b"c" * 100)
        replies.arm()
        assert replies.send(account, pair.identity, (b"",), chunk, 1 << 30, 1 << 30) == 0
        pair.read(1)
        assert poller.poll(5000), "no wake-up once the client took the message"
        sender.clear_wake()
        # Not armed: a take wakes nobody.
        assert replies.send(account, pair.identity, (b"",), chunk, 1 << 30, 1 << 30) == 0
        pair.read(1)
        wait_for(lambda: account.in_flight == 0, what="taken")
        assert not poller.poll(50)
    finally:
        pair.close()


def test_bad_arguments_are_type_errors() -> None:
    with pytest.raises(TypeError):
        Replies(object(), 1, libzmq_path())  # type: ignore[arg-type]
    with pytest.raises(TypeError):
        holders(b"bytes")  # type: ignore[arg-type]
    with pytest.raises(TypeError):
        payload_of(12)


def test_close_releases_the_wake_descriptor_while_messages_are_still_in_flight(
    pub: EventPublisher, zctx: zmq.Context[Any]
) -> None:
    pair = Pair(zctx, pub)
    try:
        replies = pair.replies
        fds = len(os.listdir("/proc/self/fd"))
        account = replies.account()
        replies.arm()
        chunk = payload_of(b"c" * 100)
        assert replies.send(account, pair.identity, (b"",), chunk, 1 << 30, 1 << 30) == 0
        replies.close()  # the publisher closes: a message is still in the client's pipe
        replies.close()
        assert len(os.listdir("/proc/self/fd")) == fds - 1  # its duplicate of the eventfd
        pair.read(1)  # taken after the close: counted, and no wake-up written anywhere
        wait_for(lambda: account.in_flight == 0, what="taken")
        assert replies.taken == 100
    finally:
        pair.close()
