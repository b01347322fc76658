"""Coalescing and bursts: a nap of the sender ends when a chunk of batches is queued.

The sender sends the oldest queued batch ``coalesce_s`` after its publish(), with what
was published meanwhile; a burst does not wait for that: 64 batches queued wake it, so
that a burst goes out as it comes and the batches queued (their copied ints) stay few.
Fewer batches keep waiting; close() ends the nap and sends them.
"""

from __future__ import annotations

import time
from typing import Any

import zmq

from kvwire.publisher import EventCollector, EventPublisher, PublisherConfig

from .conftest import connect_sub, recv_live, wait_for

BS = 4
CHUNK = 64  # the sender's chunk (kvwire/publisher/sender/sender.c)


def publish(col: EventCollector, i: int) -> None:
    col.stored([i + 1], None, [i] * BS)
    assert col.flush()


def test_a_burst_of_a_chunk_is_sent_before_the_coalescing_delay(
    ipc_dir: str, zctx: zmq.Context[Any]
) -> None:
    with EventPublisher(
        f"ipc://{ipc_dir}/p", config=PublisherConfig(heartbeat_s=None, snapshot=False)
    ) as pub:
        sub, first = connect_sub(zctx, pub)
        pub.send_coalesce_s = 30.0
        col = EventCollector(pub, BS)
        publish(col, 0)  # the sender now naps until 30 s after this one
        wait_for(lambda: pub._sender.stats()["queue_depth"] == 1, what="one queued")
        assert not sub.poll(300), "a lone batch waits its coalescing delay"
        for i in range(1, CHUNK):
            publish(col, i)
        got = [recv_live(sub, timeout_ms=10_000).seq for _ in range(CHUNK)]
        assert got == list(range(first, first + CHUNK))


def test_close_ends_the_nap_and_sends_what_waits(ipc_dir: str, zctx: zmq.Context[Any]) -> None:
    pub = EventPublisher(
        f"ipc://{ipc_dir}/p", config=PublisherConfig(heartbeat_s=None, snapshot=False)
    ).start()
    sub, first = connect_sub(zctx, pub)
    pub.send_coalesce_s = 30.0
    col = EventCollector(pub, BS)
    for i in range(10):
        publish(col, i)
    assert not sub.poll(300), "they wait their coalescing delay"
    t0 = time.monotonic()
    assert pub.close(timeout=10.0)
    assert time.monotonic() - t0 < 5.0
    assert [recv_live(sub).seq for _ in range(10)] == list(range(first, first + 10))
