"""A publisher's heartbeats fall on the wall-clock grid of its interval (of half of it
right after a batch), and only when idle."""

from __future__ import annotations

import math
import statistics
import time
from typing import Any

import zmq

from kvwire.publisher import EventPublisher, PublisherConfig
from kvwire.wire import BlockRemoved, KVEventBatch, decode_batch

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
        for sub, pub in zip(subs, (a, b), strict=True):
            for i in range(4):
                msg = recv_live(sub)
                batch = decode_batch(msg.payload)
                assert batch.events == []  # nothing but heartbeats is published
                # The batch's timestamp is read as the sender decides to send. The idle
                # heartbeats fall on the interval's grid; the first one read may be the one
                # after connect_sub's pings (unless its drain took it), on the half-interval
                # grid shifted by the publisher's own phase.
                idle = math.remainder(batch.ts, beat)
                after = math.remainder(batch.ts - pub.heartbeat_phase * beat / 2, beat / 2)
                phases.append(min(idle, after, key=abs) if i == 0 else idle)
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


def test_busy_publishers_heartbeat_after_a_batch_each_at_its_own_phase(
    ipc_dir: str, zctx: zmq.Context[Any]
) -> None:
    """The first heartbeat after a batch falls on the half-interval grid shifted by the
    publisher's phase, which its identity draws: publishers differ, and none waits longer."""
    beat = 0.4
    step = beat / 2
    pubs = [
        EventPublisher(
            f"ipc://{ipc_dir}/p{i}",
            config=PublisherConfig(heartbeat_s=beat, send_coalesce_s=0),
            rank=i,
        )
        for i in range(4)
    ]
    try:
        for p in pubs:
            p.start()
        assert len({p.heartbeat_phase for p in pubs}) == 4
        assert all(0 <= p.heartbeat_phase < 1 for p in pubs)
        subs = [connect_sub(zctx, p)[0] for p in pubs]
        late = []
        for pub, sub in zip(pubs, subs, strict=True):
            for h in range(3):
                pub.publish(KVEventBatch(time.time(), [BlockRemoved([h], None)], pub.rank))
                while not decode_batch(recv_live(sub).payload).events:
                    pass  # heartbeats before the batch
                after = decode_batch(recv_live(sub, timeout_ms=5000).payload)
                assert after.events == []
                late.append(math.remainder(after.ts - pub.heartbeat_phase * step, step))
        # On the shifted grid: late by the poll and wake-up only, never early, never off by
        # a share of the step (a loaded host: the median, with room).
        assert all(p > -0.005 for p in late), late
        assert statistics.median(late) < 0.03, late
    finally:
        for p in pubs:
            p.close()
