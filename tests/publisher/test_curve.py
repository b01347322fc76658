"""CURVE on the publisher: only allow-listed clients read live batches or replay, rotation live."""

from __future__ import annotations

import shutil
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import zmq

from kvwire import security
from kvwire.publisher import EventPublisher, PublisherConfig
from kvwire.security import ClientKeys, ServerKeys, secure_client
from kvwire.wire import (
    BlockStored,
    KVEventBatch,
    ReplayEnd,
    ReplayItem,
    parse_live,
    parse_replay_reply,
    replay_request_frames,
)


@pytest.fixture
def ctx() -> Iterator[zmq.Context[Any]]:
    c: zmq.Context[Any] = zmq.Context()
    yield c
    c.destroy(linger=0)


def client(curve_keys: dict[str, Path], name: str) -> ClientKeys:
    return ClientKeys(curve_keys["server"], curve_keys[f"{name}_secret"])


def sub(ctx: zmq.Context[Any], endpoint: str, ck: ClientKeys | None) -> zmq.Socket[bytes]:
    sock: zmq.Socket[bytes] = ctx.socket(zmq.SUB)
    sock.setsockopt(zmq.LINGER, 0)
    if ck is not None:
        secure_client(sock, ck)
    sock.setsockopt(zmq.SUBSCRIBE, b"")
    sock.connect(endpoint)
    return sock


def replay(ctx: zmq.Context[Any], endpoint: str, ck: ClientKeys | None, wait_s: float) -> list[Any]:
    sock: zmq.Socket[bytes] = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    if ck is not None:
        secure_client(sock, ck)
    sock.connect(endpoint)
    out: list[Any] = []
    try:
        # Not blocking: a client the server refused before this send has no pipe left
        # (libzmq ends the session on a refused handshake), and a blocking send waits forever.
        sock.send_multipart(replay_request_frames(0), zmq.NOBLOCK)
    except zmq.Again:
        sock.close(linger=0)
        return out  # refused already
    try:
        while sock.poll(int(wait_s * 1000)):
            out.append(parse_replay_reply(sock.recv_multipart()))
            if isinstance(out[-1], ReplayEnd):
                break
    finally:
        sock.close(linger=0)
    return out


def batch(i: int) -> KVEventBatch:
    return KVEventBatch(float(i), [BlockStored([i + 1], None, [i] * 16, 16)], 0)


def published_until_received(
    pub: EventPublisher, socks: list[zmq.Socket[bytes]], deadline_s: float
) -> list[list[int]]:
    """Publish until the first socket gets a batch (or the deadline); what each one got."""
    got: list[list[int]] = [[] for _ in socks]
    end = time.monotonic() + deadline_s
    while time.monotonic() < end and not got[0]:
        pub.publish(batch(0))
        for i, s in enumerate(socks):
            while s.poll(20):
                got[i].append(parse_live(s.recv_multipart()).seq)
    for i, s in enumerate(socks[1:], 1):
        while s.poll(100):
            got[i].append(parse_live(s.recv_multipart()).seq)
    return got


def test_only_allow_listed_clients_read_or_replay(
    curve_keys: dict[str, Path], ctx: zmq.Context[Any]
) -> None:
    server_keys = ServerKeys(curve_keys["server_secret"], curve_keys["allow"])
    with EventPublisher(
        "tcp://127.0.0.1:*",
        "tcp://127.0.0.1:*",
        PublisherConfig(heartbeat_s=None),
        server_keys=server_keys,
    ) as pub:
        live, rep = pub.bound_endpoint, pub.bound_replay_endpoint or ""
        alice = sub(ctx, live, client(curve_keys, "alice"))
        nokeys = sub(ctx, live, None)
        mallory = sub(ctx, live, client(curve_keys, "mallory"))
        got = published_until_received(pub, [alice, nokeys, mallory], deadline_s=10)
        assert got[0], "the allowed client received nothing"
        assert got[1] == [] and got[2] == []
        for i in range(5):
            pub.publish(batch(i))
        seqs = []
        while alice.poll(1000):
            seqs.append(parse_live(alice.recv_multipart()).seq)
            if seqs[-1] == pub.last_seq:
                break
        assert seqs[-1] == pub.last_seq  # everything, in order
        assert seqs == sorted(seqs)
        replayed = replay(ctx, rep, client(curve_keys, "alice"), wait_s=5)
        assert isinstance(replayed[-1], ReplayEnd)
        assert [r.seq for r in replayed if isinstance(r, ReplayItem)] == list(
            range(pub.last_seq + 1)
        )
        assert replay(ctx, rep, None, wait_s=1) == []
        assert replay(ctx, rep, client(curve_keys, "mallory"), wait_s=1) == []
        assert pub.stats().replay_served == 1
        owned = id(pub._ctx)
        assert owned in security._auths  # the ZAP handler of the publisher's own context
    assert owned not in security._auths  # released before the context was terminated


def test_rotating_the_allow_list_admits_a_new_client_without_a_restart(
    curve_keys: dict[str, Path], ctx: zmq.Context[Any]
) -> None:
    server_keys = ServerKeys(curve_keys["server_secret"], curve_keys["allow"])
    with EventPublisher(
        "tcp://127.0.0.1:*",
        "tcp://127.0.0.1:*",
        PublisherConfig(heartbeat_s=None),
        server_keys=server_keys,
    ) as pub:
        rep = pub.bound_replay_endpoint or ""
        pub.publish(batch(0))
        assert replay(ctx, rep, client(curve_keys, "bob"), wait_s=1) == []
        shutil.copy(curve_keys["bob"], curve_keys["allow"] / "bob.key")
        assert isinstance(replay(ctx, rep, client(curve_keys, "bob"), wait_s=5)[-1], ReplayEnd)
        bob = sub(ctx, pub.bound_endpoint, client(curve_keys, "bob"))
        assert published_until_received(pub, [bob], deadline_s=10)[0]
