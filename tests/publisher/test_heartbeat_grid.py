"""A publisher's heartbeats fall on the wall-clock grid of its interval (of half of it
right after a batch), and only when idle."""

from __future__ import annotations

import math
import statistics
import time
from typing import Any

import zmq

from kvwire.publisher import EventPublisher, PublisherConfig
from kvwire.wire import KVEventBatch, decode_batch

from .conftest import connect_sub, recv_live, wait_for


def test_idle_publishers_heartbeat_together_on_the_grid(
    ipc_dir: str, zctx: zmq.Context[Any]
) -> None:
    beat = 0.25
    with (
        EventPublisher(f"ipc://{ipc_dir}/p", config=PublisherConfig(heartbeat_s=beat)) as a,
        EventPublisher(f"ipc://{ipc_dir}/q", config=PublisherConfig(heartbeat_s=beat)) as b,
    ):
        subs = [connect_sub(zctx, pub)[0] for pub in (a, b)]
        phases = []
        for sub in subs:
            for i in range(4):
                msg = recv_live(sub)
                batch = decode_batch(msg.payload)
                assert batch.events == []  # nothing but heartbeats is published
                # The batch's timestamp is read as the sender decides to send. The first
                # heartbeat follows connect_sub's pings, on the half-interval grid; the
                # idle ones after it on the interval's.
                phases.append(math.remainder(batch.ts, beat / 2 if i == 0 else beat))
        # Late by the poll's millisecond and the thread's wake-up; never early, never
        # half an interval off (a shared, loaded host: the median, with room).
        assert all(p > -0.005 for p in phases), phases
        assert statistics.median(phases) < 0.05, phases


def test_a_publisher_sending_often_does_not_heartbeat(ipc_dir: str, zctx: zmq.Context[Any]) -> None:
    beat = 0.5
    with EventPublisher(
        f"ipc://{ipc_dir}/p", config=PublisherConfig(heartbeat_s=beat, send_coalesce_s=0)
    ) as pub:
        connect_sub(zctx, pub)
        before = pub.stats().heartbeats
        end = time.monotonic() + 4 * beat
        while time.monotonic() < end:  # a batch every 0.2 intervals: never idle for 0.5
            pub.publish(KVEventBatch(time.time(), [], 0))
            time.sleep(0.2 * beat)
        wait_for(lambda: pub.stats().queue_depth == 0, what="batches sent")
        assert pub.stats().heartbeats == before
