"""Epochs on every topic frame, and heartbeats that make a trailing drop a visible gap."""

from __future__ import annotations

import select
import time
from typing import Any

import zmq

from kvwire._native import libzmq_path
from kvwire.publisher import EventPublisher, PublisherConfig
from kvwire.publisher._sender import Sender
from kvwire.publisher.batch import CollectedBatch
from kvwire.wire import (
    END_SEQ,
    BlockRemoved,
    BlockStored,
    KVEventBatch,
    SnapshotEnd,
    decode_batch,
    parse_epoch,
    parse_replay_reply,
    replay_request_frames,
    snapshot_request_frames,
    split_topic,
)

from .conftest import connect_sub, recv_live, wait_for


def store(h: int, parent: int | None = None) -> KVEventBatch:
    return KVEventBatch(time.time(), [BlockStored([h], parent, [h, h + 1], 2)], 0)


def dealer(ctx: zmq.Context[Any], endpoint: str) -> zmq.Socket[bytes]:
    sock: zmq.Socket[bytes] = ctx.socket(zmq.DEALER)
    sock.connect(endpoint)
    return sock


def test_every_topic_frame_carries_the_instances_epoch(
    ipc_dir: str, zctx: zmq.Context[Any]
) -> None:
    with (
        EventPublisher(
            f"ipc://{ipc_dir}/p",
            f"ipc://{ipc_dir}/r",
            PublisherConfig(topic="kv", heartbeat_s=0.25),
        ) as a,
        EventPublisher(
            f"ipc://{ipc_dir}/q", config=PublisherConfig(topic="kv", heartbeat_s=None)
        ) as b,
    ):
        assert a.epoch is not None and b.epoch is not None
        assert a.epoch != b.epoch  # one random id per instance
        assert parse_epoch(a.epoch).heartbeat_s == 0.25 and parse_epoch(a.epoch).snapshot
        assert parse_epoch(b.epoch).heartbeat_s is None and not parse_epoch(b.epoch).snapshot
        sub, _ = connect_sub(zctx, a)
        a.publish(store(1))
        assert split_topic(recv_live(sub).topic) == (b"kv", a.epoch)
        replay = dealer(zctx, a.bound_replay_endpoint or "")
        replay.send_multipart(replay_request_frames(0))
        frames = []
        while True:
            assert replay.poll(5000)
            frames.append(replay.recv_multipart())
            if frames[-1][2] == END_SEQ:
                break
        assert all(split_topic(f[1]) == (b"kv", a.epoch) for f in frames)  # items and END
        replay.send_multipart(snapshot_request_frames())
        while True:
            assert replay.poll(5000)
            msg = replay.recv_multipart()
            assert split_topic(msg[2]) == (b"kv", a.epoch)
            if isinstance(parse_replay_reply(msg), SnapshotEnd):
                break


def test_without_epoch_frames_are_the_engines(ipc_dir: str, zctx: zmq.Context[Any]) -> None:
    with EventPublisher(
        f"ipc://{ipc_dir}/p",
        f"ipc://{ipc_dir}/r",
        PublisherConfig(topic="kv", epoch=False, heartbeat_s=None, snapshot=False),
    ) as pub:  # fmt: skip
        assert pub.epoch is None
        sub, first = connect_sub(zctx, pub)
        pub.publish(store(1))
        assert recv_live(sub).topic == b"kv"
        replay = dealer(zctx, pub.bound_replay_endpoint or "")
        replay.send_multipart(replay_request_frames(first))
        assert replay.poll(5000) and replay.recv_multipart()[1] == b"kv"
        assert replay.poll(5000) and replay.recv_multipart() == [b"", b"", END_SEQ, b""]
        # No snapshot service: the request reads as a start seq past the buffer.
        replay.send_multipart(snapshot_request_frames())
        assert replay.poll(5000) and replay.recv_multipart() == [b"", b"", END_SEQ, b""]


def test_a_dropped_final_batch_is_a_visible_gap_within_one_heartbeat(
    ipc_dir: str, zctx: zmq.Context[Any]
) -> None:
    """Issue 11 case 1, from the publisher's side."""
    beat = 0.3
    with EventPublisher(
        f"ipc://{ipc_dir}/p",
        f"ipc://{ipc_dir}/r",
        PublisherConfig(max_queue_size=1, send_coalesce_s=0.3, heartbeat_s=beat),
    ) as pub:  # fmt: skip
        sub, _ = connect_sub(zctx, pub)
        assert pub.publish(store(1))
        msg = recv_live(sub)
        stored_seq = msg.seq
        assert pub.publish(store(2, 1))  # queued: the sender is coalescing
        assert not pub.publish(KVEventBatch(time.time(), [BlockRemoved([1, 2])], 0))  # dropped
        t0 = time.monotonic()
        assert recv_live(sub).seq == stored_seq + 1
        heartbeat = recv_live(sub, timeout_ms=5000)
        waited = time.monotonic() - t0
        assert heartbeat.seq == stored_seq + 3  # seq + 2 was dropped: a visible gap
        empty = decode_batch(heartbeat.payload)
        assert empty.events == [] and empty.data_parallel_rank == 0
        # Coalescing, then one heartbeat (slack for a busy shared host; an engine that never
        # publishes again would otherwise show nothing at all).
        assert waited < 0.3 + beat + 2.0
        wait_for(lambda: pub.stats().heartbeats >= 1, what="heartbeat counted")
        # The heartbeat is buffered for replay like any batch.
        replay = dealer(zctx, pub.bound_replay_endpoint or "")
        replay.send_multipart(replay_request_frames(stored_seq + 2))
        assert replay.poll(5000)
        item = parse_replay_reply(replay.recv_multipart())
        assert item.seq == stored_seq + 3  # type: ignore[union-attr]


def test_no_heartbeat_when_switched_off(ipc_dir: str, zctx: zmq.Context[Any]) -> None:
    with (
        EventPublisher(f"ipc://{ipc_dir}/p", config=PublisherConfig(heartbeat_s=None)) as off,
        EventPublisher(f"ipc://{ipc_dir}/q", config=PublisherConfig(heartbeat_s=0.05)) as on,
    ):
        sub_off, _ = connect_sub(zctx, off)
        sub_on, _ = connect_sub(zctx, on)
        assert decode_batch(recv_live(sub_on, 2000).payload).events == []
        assert not sub_off.poll(300)
        assert off.stats().heartbeats == 0


def test_a_heartbeat_leaves_the_mirror_asleep_and_a_batch_wakes_it_once_sent(
    zctx: zmq.Context[Any],
) -> None:
    """A heartbeat has nothing to mirror: it neither wakes the thread that applies the feed
    nor counts as pending; a batch wakes it once the batch is on the wire."""
    pub = zctx.socket(zmq.PUB)
    pub.bind("inproc://mirror-asleep")
    sender = Sender(
        topic=b"kv", dialect="map", rank=0, max_queue=8, buffer_steps=8, coalesce_s=0.0,
        heartbeat_s=0.05, mirror=True, mirror_backlog=1, batch_type=CollectedBatch,
        encode=lambda batch: None,
    )  # fmt: skip
    sender.start(pub.underlying, libzmq_path())
    try:
        service = select.poll()
        service.register(sender.service_fd, select.POLLIN)
        sender.arm_feed()  # as the service thread does when the feed is empty
        wait_for(lambda: sender.stats()["heartbeats"] >= 3, what="heartbeats")
        assert not service.poll(0), "a heartbeat woke the mirror"
        assert sender.stats()["mirror_feed"] == 0  # PublisherStats.mirror_pending
        assert sender.publish(b"\x93\xcb" + bytes(8) + b"\x90\x00")  # a batch (bytes)
        assert service.poll(5000), "no wake-up for a batch"
        counts = sender.stats()
        assert counts["published"] == counts["heartbeats"] + 1  # sent before the wake-up
        assert counts["mirror_feed"] == 1
        feed = sender.take_feed()
        first = feed[0][0]
        assert [seq for seq, _ in feed] == list(range(first, first + len(feed)))  # beats kept
        assert sender.stats()["mirror_feed"] == 0
    finally:
        sender.close(5.0)
        sender.join()
        pub.close(0)
