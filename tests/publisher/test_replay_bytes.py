"""Issue 24 items 4 and 6 on the publisher: replies bounded in bytes in flight, snapshot chunks
shared by every client, clients that do not read dropped, the block count announced."""

from __future__ import annotations

import random
import time
from collections.abc import Iterator
from typing import Any

import pytest
import zmq

from kvwire.publisher import EventPublisher, PublisherConfig
from kvwire.publisher._sender import holders
from kvwire.publisher.replay import ReplayServer, _SnapshotJob
from kvwire.subscriber import BlockSetSink, RankState, Subscriber
from kvwire.wire import (
    BlockStored,
    KVEventBatch,
    SnapshotChunk,
    SnapshotEnd,
    SnapshotRefused,
    decode_batch,
    encode_batch,
    parse_replay_reply,
    snapshot_request_frames,
)
from kvwire.wire.framing import announced_blocks, snapshot_chunk_frames
from tests.subscriber.helpers import FAST, Engine, bound_source

from .conftest import EPHEMERAL, wait_for

BS = 16
BLOCKS = 100_000  # about 6 MB as a snapshot: more than loopback's kernel buffers take unread
CHAIN = 64
CHUNK_BLOCKS = 1024  # about 60 KB a chunk: 98 chunks


def fill(pub: EventPublisher, blocks: int = BLOCKS, seed: int = 0) -> set[int]:
    """Store ``blocks`` blocks in chains of ``CHAIN``; returns their hashes."""
    rng = random.Random(seed)
    held: set[int] = set()
    for start in range(0, blocks, CHAIN):
        hashes = [rng.getrandbits(63) for _ in range(min(CHAIN, blocks - start))]
        first = rng.randrange(1_000, 50_000)
        tokens = list(range(first, first + len(hashes) * BS))
        assert pub.publish(KVEventBatch(0.0, [BlockStored(hashes, None, tokens, BS)], 0))
        held.update(hashes)
    n = pub.last_seq + 1
    wait_for(lambda: pub.stats().published == n, what="history sent")
    return held


def non_reader(ctx: zmq.Context[Any], endpoint: str) -> zmq.Socket[bytes]:
    """A DEALER that asks for a snapshot and never reads (its own queue and buffer tiny)."""
    sock: zmq.Socket[bytes] = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.RCVHWM, 1)
    sock.setsockopt(zmq.RCVBUF, 4096)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(endpoint)
    sock.send_multipart(snapshot_request_frames())
    return sock


def read_snapshot(
    ctx: zmq.Context[Any], endpoint: str, timeout_s: float = 20.0
) -> tuple[set[int], list[SnapshotChunk], SnapshotEnd]:
    sock: zmq.Socket[bytes] = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(endpoint)
    sock.send_multipart(snapshot_request_frames())
    chunks: list[SnapshotChunk] = []
    held: set[int] = set()
    end = time.monotonic() + timeout_s
    try:
        while True:
            left = end - time.monotonic()
            assert left > 0 and sock.poll(int(left * 1000)), "the reading client was not served"
            reply = parse_replay_reply(sock.recv_multipart())
            assert not isinstance(reply, SnapshotRefused), reply.reason
            if isinstance(reply, SnapshotEnd):
                return held, chunks, reply
            assert isinstance(reply, SnapshotChunk)
            assert reply.number == len(chunks)
            chunks.append(reply)
            for e in decode_batch(reply.payload).events:
                assert isinstance(e, BlockStored)
                held.update(e.block_hashes)
    finally:
        sock.close()


def server(pub: EventPublisher) -> ReplayServer:
    replay = pub._replay
    assert replay is not None
    return replay


@pytest.fixture
def bounded() -> Iterator[EventPublisher]:
    config = PublisherConfig(
        heartbeat_s=None,
        snapshot_chunk_blocks=CHUNK_BLOCKS,
        max_replay_bytes=256 * 1024,
        max_replay_jobs=16,  # 16 KiB a job: one chunk at a time
        replay_stall_s=0.5,
    )
    with EventPublisher(EPHEMERAL, EPHEMERAL, config) as pub:
        yield pub


def test_non_readers_stay_within_the_byte_bound_and_are_dropped(
    bounded: EventPublisher, zctx: zmq.Context[Any]
) -> None:
    pub = bounded
    fill(pub)
    replay = server(pub)
    endpoint = pub.bound_replay_endpoint or ""
    hostile = [non_reader(zctx, endpoint) for _ in range(12)]
    seen = 0
    wait_for(lambda: replay.jobs == 12, what="every request taken")
    # Each job holds its own client's connection (to shut it down), none another's.
    peers = [j.conn.getpeername() for j in replay._jobs.values() if j.conn is not None]
    assert len(peers) == 12 and len(set(peers)) == 12
    end = time.monotonic() + 2.0
    while time.monotonic() < end:  # sampled from outside too, not only the server's own peak
        seen = max(seen, replay.bytes_in_flight)
        time.sleep(0.005)
    # Chunks are far smaller than the bound, so it holds exactly.
    assert 0 < replay.peak_bytes_in_flight <= pub.config.max_replay_bytes
    assert seen <= replay.peak_bytes_in_flight
    # A pipe that took a whole snapshot is no served snapshot: they were dropped, not served.
    wait_for(lambda: pub.stats().replay_disconnects >= 12, what="every non-reader dropped")
    stats = pub.stats()
    assert stats.snapshots_served == 0 and stats.replay_dropped >= 12
    # Their pipes went with their connections: nothing of theirs is left in flight.
    wait_for(
        lambda: pub.stats().replay_bytes_in_flight == 0 and not replay.busy, what="pipes freed"
    )
    for s in hostile:
        s.close()


def test_a_reader_gets_the_whole_snapshot_while_non_readers_are_dropped(
    bounded: EventPublisher, zctx: zmq.Context[Any]
) -> None:
    pub = bounded
    truth = fill(pub)
    replay = server(pub)
    endpoint = pub.bound_replay_endpoint or ""
    hostile = [non_reader(zctx, endpoint) for _ in range(8)]
    wait_for(lambda: replay.jobs >= 8, what="non-readers served")
    held, chunks, end = read_snapshot(zctx, endpoint)
    assert held == truth
    # Chunk 0 announces the count, alone (an empty batch); the blocks follow.
    assert end.chunks == len(chunks) == 1 + -(-BLOCKS // CHUNK_BLOCKS)
    assert chunks[0].blocks == BLOCKS == pub.stats().mirrored_blocks
    assert decode_batch(chunks[0].payload).events == []
    assert all(c.blocks is None for c in chunks[1:])
    wait_for(lambda: pub.stats().snapshots_served >= 1, what="the reader's snapshot counted")
    wait_for(lambda: pub.stats().replay_disconnects >= 8, what="non-readers dropped")
    # One snapshot was built; every client was sent from its chunks.
    stats = pub.stats()
    assert stats.snapshots_built == 1
    # The reader was sent every chunk, each non-reader at least chunks 0 and 1 (then it stalled).
    assert replay.bytes_sent >= replay.snapshot_bytes_built + 8 * len(chunks[1].payload)
    for s in hostile:
        s.close()


def test_every_job_sends_the_same_chunk_objects(
    bounded: EventPublisher, zctx: zmq.Context[Any]
) -> None:
    pub = bounded
    fill(pub)
    replay = server(pub)
    endpoint = pub.bound_replay_endpoint or ""
    hostile = [non_reader(zctx, endpoint) for _ in range(4)]
    # Chunk 0 is tiny and goes into the kernel's buffer; chunk 1 (60 KB) then stays in each pipe.
    wait_for(
        lambda: (
            sum(isinstance(j, _SnapshotJob) and j.index >= 2 for j in replay._jobs.values()) == 4
        ),
        what="every job sent chunk 1",
    )
    snaps = {id(j.snap): j.snap for j in replay._jobs.values() if isinstance(j, _SnapshotJob)}
    assert len(snaps) == 1, "the jobs do not share one snapshot"
    (snap,) = snaps.values()
    assert replay.snapshot_bytes_built == sum(len(c) for c in snap.chunks)
    assert replay.bytes_sent >= 4 * len(snap.chunks[1])
    # What the four pipes hold is that very buffer: libzmq references it once per client
    # (the snapshot's own Payload is the fifth holder), and no copy of it exists.
    assert holders(snap.chunks[1]) == 1 + 4
    for s in hostile:
        s.close()


def test_a_stale_shared_snapshot_is_not_joined() -> None:
    """A request joins the shared snapshot only while the buffer covers what followed it."""
    config = PublisherConfig(heartbeat_s=None, buffer_steps=20, replay_stall_s=30)
    with EventPublisher(EPHEMERAL, EPHEMERAL, config) as pub, zmq.Context() as ctx:
        fill(pub, blocks=2_000)
        replay = server(pub)
        endpoint = pub.bound_replay_endpoint or ""
        a = non_reader(ctx, endpoint)
        wait_for(lambda: replay.snapshots_built == 1, what="first snapshot")
        Engine(seed=1).publish(pub, 11)  # past buffer_steps // 2
        wait_for(lambda: pub.stats().queue_depth == 0, what="sent")
        b = non_reader(ctx, endpoint)
        wait_for(lambda: replay.snapshots_built == 2, what="a fresh snapshot for the late request")
        a.close()
        b.close()


def test_the_announced_count_rides_in_chunk_0_and_old_frames_still_parse() -> None:
    payload = encode_batch(
        KVEventBatch(1.0, [BlockStored([1, 2], None, list(range(2 * BS)), BS)], 3)
    )
    for blocks in (0, 7, 2**40):
        frames = snapshot_chunk_frames(b"t", 5, 0, payload, blocks)
        assert len(frames) == 6  # the layout older parsers take
        chunk = parse_replay_reply(frames)
        assert isinstance(chunk, SnapshotChunk) and chunk.blocks == blocks
        # Older subscribers decode the payload as before: the fourth element is ignored.
        assert decode_batch(chunk.payload) == decode_batch(payload)
    old = parse_replay_reply(snapshot_chunk_frames(b"t", 5, 0, payload))
    assert isinstance(old, SnapshotChunk) and old.blocks is None and old.payload == payload
    later = parse_replay_reply(snapshot_chunk_frames(b"t", 5, 1, payload))
    assert isinstance(later, SnapshotChunk) and later.blocks is None
    with pytest.raises(Exception, match="only chunk 0"):
        snapshot_chunk_frames(b"t", 5, 1, payload, 3)
    bad = b"\x94" + payload[1:] + b"\xa1x"  # a str where the count goes
    with pytest.raises(Exception, match="bad block count"):
        parse_replay_reply([b"", b"kvwire-snapshot", b"t", bytes(8), bytes(8), bad])
    assert announced_blocks(b"\x94" + payload[1:] + b"\xc0") is None  # nil: none announced


def test_a_subscriber_rebuilds_a_rank_from_a_snapshot_that_announces_its_count(
    zctx: zmq.Context[Any],
) -> None:
    """The current subscriber, past a replay buffer too short, is exact from such a snapshot."""
    config = PublisherConfig(heartbeat_s=0.2, buffer_steps=8)
    with EventPublisher(EPHEMERAL, EPHEMERAL, config) as pub:
        engine = Engine(seed=5)
        engine.publish(pub, 60, blocks=4)
        wait_for(lambda: pub.stats().queue_depth == 0, what="history sent")
        sink = BlockSetSink()
        with Subscriber([bound_source("w", [pub])], sink, config=FAST) as sub:
            wait_for(
                lambda: (
                    sub.status()[0].state is RankState.SYNCED
                    and sink.blocks("w", 0) == frozenset(engine.truth)
                ),
                what="exact from the snapshot",
                timeout=20,
            )
            assert sub.status()[0].counters.snapshots_applied >= 1
        # Served, although the subscriber asked for the replay before its last bytes were known taken.
        assert pub.stats().snapshots_built >= 1 and pub.stats().snapshots_served >= 1
