"""The receive drain: every message ready on a socket in one call, native and through pyzmq."""

from __future__ import annotations

import random
import select
import time
from collections.abc import Callable
from typing import Any

import pytest
import zmq
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvwire.subscriber import (
    BlockSetSink,
    EngineSource,
    StreamConfig,
    Subscriber,
    SubscriberConfig,
    receive,
)
from kvwire.wire import BlockStored, KVEventBatch, encode_batch, pack_seq
from tests.waiting import wait_for

Drain = Callable[[zmq.Socket[Any], int, int], list[tuple[bytes, ...]]]

DRAINS: list[Any] = [
    pytest.param(receive._drain_py, id="pyzmq"),
    pytest.param(
        receive.drain,
        id="native",
        marks=pytest.mark.skipif(not receive.NATIVE, reason="libzmq not reachable"),
    ),
]


def test_the_native_drain_is_in_use_here() -> None:
    """Linux with pyzmq's shared libzmq: the fallback must not hide a broken build."""
    assert receive.NATIVE


def _all(
    drain: Drain, sock: zmq.Socket[bytes], cap: int, max_frames: int
) -> list[tuple[bytes, ...]]:
    out: list[tuple[bytes, ...]] = []
    while batch := drain(sock, cap, max_frames):
        assert len(batch) <= cap
        out += batch
    return out


messages = st.lists(
    st.lists(st.binary(max_size=300), min_size=1, max_size=8), min_size=0, max_size=60
)


@pytest.mark.parametrize("drain", DRAINS)
@settings(
    max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(sent=messages, cap=st.integers(1, 20), max_frames=st.integers(1, 6))
def test_returns_exactly_what_was_sent_in_order(
    pair: tuple[zmq.Socket[bytes], zmq.Socket[bytes]],
    drain: Drain,
    sent: list[list[bytes]],
    cap: int,
    max_frames: int,
) -> None:
    a, b = pair  # empty again after each example: the fixture is shared by them
    for m in sent:
        a.send_multipart(m)
    expected = [tuple(m) if len(m) <= max_frames else () for m in sent]
    got: list[tuple[bytes, ...]] = []
    deadline = time.monotonic() + 5
    while len(got) < len(expected) and time.monotonic() < deadline:
        got += _all(drain, b, cap, max_frames)
    assert got == expected
    assert drain(b, cap, max_frames) == []


@pytest.mark.parametrize("drain", DRAINS)
def test_a_message_of_too_many_frames_is_returned_empty_and_the_next_one_whole(
    pair: tuple[zmq.Socket[bytes], zmq.Socket[bytes]], drain: Drain
) -> None:
    a, b = pair
    a.send_multipart([b"x"] * 1000)
    a.send_multipart([b"t", b"12345678", b"p" * 100_000])
    assert _all(drain, b, 10, 3) == [(), (b"t", b"12345678", b"p" * 100_000)]


@pytest.mark.parametrize("drain", DRAINS)
def test_the_cap_leaves_the_rest_for_the_next_call(
    pair: tuple[zmq.Socket[bytes], zmq.Socket[bytes]], drain: Drain
) -> None:
    a, b = pair
    for i in range(10):
        a.send(bytes([i]))
    assert drain(b, 4, 1) == [(bytes([i]),) for i in range(4)]
    assert drain(b, 0, 1) == []
    assert drain(b, 100, 1) == [(bytes([i]),) for i in range(4, 10)]


@pytest.mark.parametrize("drain", DRAINS)
def test_bad_arguments_and_closed_sockets_raise(
    pair: tuple[zmq.Socket[bytes], zmq.Socket[bytes]], drain: Drain
) -> None:
    _, b = pair
    with pytest.raises(ValueError):
        drain(b, -1, 3)
    with pytest.raises(ValueError):
        drain(b, 1, 0)
    b.close()
    with pytest.raises((ValueError, zmq.ZMQError)):
        drain(b, 1, 3)


@pytest.mark.parametrize("drain", DRAINS)
def test_drained_to_the_end_the_descriptor_signals_the_next_arrival(
    pair: tuple[zmq.Socket[bytes], zmq.Socket[bytes]], drain: Drain
) -> None:
    """The edge-triggered ZMQ_FD: found empty once, the socket signals the next message."""
    a, b = pair
    fd = b.getsockopt(zmq.FD)
    poller = select.poll()
    poller.register(fd, select.POLLIN)
    for round_ in range(20):
        assert drain(b, 10, 1) == []
        while poller.poll(0):  # let libzmq take in the signal it owes
            if drain(b, 10, 1):
                raise AssertionError("nothing was sent yet")
            break
        a.send(bytes([round_]))
        assert poller.poll(5000), f"no signal for message {round_}"
        assert drain(b, 10, 1) == [(bytes([round_]),)]


@pytest.mark.parametrize("drain", DRAINS)
def test_a_message_over_the_size_limit_is_dropped_by_libzmq_and_later_ones_arrive(
    drain: Drain,
) -> None:
    ctx = zmq.Context()
    try:
        pull: zmq.Socket[bytes] = ctx.socket(zmq.PULL)
        pull.setsockopt(zmq.MAXMSGSIZE, 1000)
        pull.setsockopt(zmq.LINGER, 0)
        port = pull.bind_to_random_port("tcp://127.0.0.1")
        push: zmq.Socket[bytes] = ctx.socket(zmq.PUSH)
        push.setsockopt(zmq.LINGER, 0)
        push.setsockopt(zmq.RECONNECT_IVL, 10)
        push.connect(f"tcp://127.0.0.1:{port}")
        push.send_multipart([b"a", b"x" * 5000])  # over the limit: the connection goes
        got: list[tuple[bytes, ...]] = []
        deadline = time.monotonic() + 10
        while not got and time.monotonic() < deadline:
            push.send_multipart([b"a", b"small"], zmq.NOBLOCK)
            time.sleep(0.01)
            got = drain(pull, 100, 2)
        assert got and all(m == (b"a", b"small") for m in got)
    finally:
        ctx.destroy(linger=0)


def _join(sub: Subscriber, pub: zmq.Socket[bytes], payload: Callable[[int], bytes]) -> int:
    """Publish until the subscriber applies a batch (a PUB drops what precedes the
    subscription); returns the next seq."""
    seq = 0
    deadline = time.monotonic() + 10
    while not sub.status()[0].counters.batches:
        assert time.monotonic() < deadline, "never joined"
        pub.send_multipart([b"", pack_seq(seq), payload(seq)])
        seq += 1
        time.sleep(0.01)
    wait_for(lambda: sub.status()[0].expected_seq == seq, 5, "the joining batches")
    return seq


def test_a_live_message_of_too_many_frames_is_counted_and_skipped_the_rank_stays_exact() -> None:
    ctx = zmq.Context()
    pub: zmq.Socket[bytes] = ctx.socket(zmq.PUB)
    pub.setsockopt(zmq.LINGER, 0)
    port = pub.bind_to_random_port("tcp://127.0.0.1")
    sink = BlockSetSink()
    cfg = SubscriberConfig(stream=StreamConfig(replay=False, idle_probe=None))

    def batch(h: int) -> bytes:
        return encode_batch(KVEventBatch(0.0, [BlockStored([h], None, [1, 2], 2)], 0))

    try:
        with Subscriber([EngineSource("w", f"tcp://127.0.0.1:{port}")], sink, config=cfg) as sub:
            seq = _join(sub, pub, lambda seq: batch(seq + 1))
            (before,) = sub.status()
            expected = set(sink.blocks("w", 0)) | {seq + 1}
            pub.send_multipart([b"", pack_seq(seq), b"junk", b"more", b"frames"])
            pub.send_multipart([b"", pack_seq(seq), batch(seq + 1)])  # the same seq, intact
            wait_for(lambda: sink.blocks("w", 0) == expected, 10, "the intact batch")
            (after,) = sub.status()
            assert after.counters.decode_errors == 1
            assert after.state is before.state and after.expected_seq == seq + 1
            assert after.counters.seqs_lost == before.counters.seqs_lost
    finally:
        pub.close()
        ctx.term()


def test_many_random_messages_through_a_subscriber_arrive_whole() -> None:
    """Payloads of random sizes, through tcp and the native drain, each applied once."""
    rng = random.Random(5)
    ctx = zmq.Context()
    pub: zmq.Socket[bytes] = ctx.socket(zmq.PUB)
    pub.setsockopt(zmq.LINGER, 0)
    pub.setsockopt(zmq.SNDHWM, 0)
    port = pub.bind_to_random_port("tcp://127.0.0.1")
    sink = BlockSetSink()
    cfg = SubscriberConfig(stream=StreamConfig(replay=False, idle_probe=None))
    try:
        with Subscriber([EngineSource("w", f"tcp://127.0.0.1:{port}")], sink, config=cfg) as sub:
            seq = _join(sub, pub, lambda seq: encode_batch(KVEventBatch(0.0, [], 0)))
            (before,) = sub.status()
            truth: set[int] = set()
            for _ in range(3000):
                hashes = [seq * 1000 + i for i in range(1, rng.randrange(2, 40))]
                truth.update(hashes)
                ev = BlockStored(
                    hashes, None, [rng.randrange(50_000) for _ in hashes for _ in "ab"], 2
                )
                pub.send_multipart([b"", pack_seq(seq), encode_batch(KVEventBatch(0.0, [ev], 0))])
                seq += 1
            wait_for(lambda: sink.blocks("w", 0) == truth, 20, "every batch")
            (st_,) = sub.status()
            assert st_.expected_seq == seq and st_.counters.decode_errors == 0
            assert st_.counters.batches - before.counters.batches == 3000
            assert st_.counters.seqs_lost == before.counters.seqs_lost
    finally:
        pub.close()
        ctx.term()
