"""The sender's memory: payloads carved from reused slabs, copied ints likewise, token ids
written by the u32 writer.

Payloads are carved one after the other from 1 MiB slabs that are reused once every
payload in them is released; the ints the hooks copy come from slabs of their own. A
payload still held (the replay ring, a replay reply, the mirror's feed, libzmq) must keep
its bytes whatever is carved meanwhile, even after its publisher is gone.
"""

from __future__ import annotations

import gc
import random
from typing import Any

import zmq

from kvwire.publisher import EventCollector, EventPublisher, PublisherConfig
from kvwire.wire import BlockStored, KVEventBatch, decode_batch, encode_batch

from .conftest import connect_sub, recv_live, wait_for

BS = 16


def chain(rng: random.Random, blocks: int) -> tuple[list[int], int, list[int]]:
    hashes = [rng.getrandbits(64) for _ in range(blocks)]
    return hashes, rng.getrandbits(64), [rng.randrange(200_000) for _ in range(blocks * BS)]


def publish(col: EventCollector, rng: random.Random, blocks: int) -> None:
    col.stored(*chain(rng, blocks))
    col.removed([rng.getrandbits(64) for _ in range(blocks)])
    assert col.flush()


def test_held_payloads_keep_their_bytes_while_slabs_are_reused(
    ipc_dir: str, zctx: zmq.Context[Any]
) -> None:
    """A replayed payload pins its slab: the ring moves on, its slab's neighbours are
    released and their slabs reused, the held bytes stay those sent."""
    rng = random.Random(1)
    with EventPublisher(
        f"ipc://{ipc_dir}/p",
        config=PublisherConfig(heartbeat_s=None, snapshot=False, buffer_steps=8),
    ) as pub:
        sub, first = connect_sub(zctx, pub)
        col = EventCollector(pub, BS)
        publish(col, rng, 256)  # about 21 KB: some 48 to a slab
        live = bytes(recv_live(sub).payload)
        [(seq, held)] = pub._sender.replay_range(first, 1)
        assert seq == first and bytes(held) == live
        for _ in range(600):  # a dozen slabs' worth, through a ring of 8
            publish(col, rng, 256)
            recv_live(sub)
        (made, mapped), _ = pub._sender.slabs()
        assert bytes(held) == live
        assert 3 <= made < 12, "slabs were reused, not one mapped per 48 batches"
        assert mapped <= made
        # The ring holds the last 8 batches, each sent as it is replayed.
        ring = pub._sender.replay_range(0, 64)
        assert [s for s, _ in ring] == list(range(first + 593, first + 601))
    del ring


def test_a_payload_outlives_its_publisher(ipc_dir: str, zctx: zmq.Context[Any]) -> None:
    rng = random.Random(2)
    pub = EventPublisher(
        f"ipc://{ipc_dir}/p", config=PublisherConfig(heartbeat_s=None, snapshot=False)
    ).start()
    sub, first = connect_sub(zctx, pub)
    col = EventCollector(pub, BS)
    publish(col, rng, 64)
    live = bytes(recv_live(sub).payload)
    [(_, held)] = pub._sender.replay_range(first, 1)
    pub.close()
    sub.close(linger=0)
    del pub, col
    gc.collect()
    assert bytes(held) == live  # its slab outlived the sender's pools


def test_a_steady_stream_maps_no_new_slabs(ipc_dir: str, zctx: zmq.Context[Any]) -> None:
    """Once the ring is full, each new payload and each copy of the hooks' ints lands in a
    reused slab: neither pool maps another."""
    rng = random.Random(3)
    with EventPublisher(
        f"ipc://{ipc_dir}/p",
        config=PublisherConfig(heartbeat_s=None, snapshot=False, buffer_steps=50),
    ) as pub:
        sub, _ = connect_sub(zctx, pub)
        col = EventCollector(pub, BS)

        def run(n: int) -> None:
            for _ in range(n):
                publish(col, rng, 256)
                recv_live(sub)  # one batch in flight at a time: the working set stays put

        run(300)
        warm = pub._sender.slabs()
        run(600)
        assert pub._sender.slabs() == warm
        assert warm[0][0] >= 2 and warm[1][0] >= 1  # both pools in use


def test_a_payload_too_large_for_a_slab_is_sent_and_replayed(
    ipc_dir: str, zctx: zmq.Context[Any]
) -> None:
    """Payloads beyond a quarter slab are allocated on their own: sent and kept alike."""
    rng = random.Random(4)
    with EventPublisher(
        f"ipc://{ipc_dir}/p", config=PublisherConfig(heartbeat_s=None, snapshot=False)
    ) as pub:
        sub, _ = connect_sub(zctx, pub)
        col = EventCollector(pub, BS)
        before = pub._sender.slabs()[0]
        hashes, parent, tokens = chain(rng, 4096)  # about 300 KB
        col.stored(hashes, parent, tokens)
        assert col.flush()
        got = recv_live(sub)
        batch = decode_batch(got.payload)
        [event] = batch.events
        assert list(event.token_ids) == tokens and list(event.block_hashes) == hashes
        [(_, held)] = pub._sender.replay_range(got.seq, 1)
        assert bytes(held) == bytes(got.payload)
        assert pub._sender.slabs()[0] == before  # not from a slab


def test_token_ids_at_every_width_boundary_are_msgspecs_bytes(
    ipc_dir: str, zctx: zmq.Context[Any]
) -> None:
    """The hooks' copied token ids go through the u32 writer: every width boundary
    (fixint, uint8, uint16, uint32) gives msgspec's bytes."""
    edges = sorted({v for k in range(33) for v in (2**k - 1, 2**k, 2**k + 1) if v < 2**32})
    tokens = edges + [0] * (-len(edges) % BS)
    hashes = list(range(1, len(tokens) // BS + 1))
    with EventPublisher(
        f"ipc://{ipc_dir}/p", config=PublisherConfig(heartbeat_s=None, snapshot=False)
    ) as pub:
        sub, _ = connect_sub(zctx, pub)
        col = EventCollector(pub, BS)
        col.stored(hashes, None, tokens)
        assert col.flush()
        got = recv_live(sub)
        ts = decode_batch(got.payload).ts
        event = BlockStored(hashes, None, tokens, BS)
        assert bytes(got.payload) == encode_batch(KVEventBatch(ts, [event], 0))
        # (counted once the chunk is sent: after the subscriber may have it)
        wait_for(lambda: pub.stats().native_encoded >= 1, what="counted as native")
