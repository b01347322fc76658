"""The publisher's mirror and its snapshots: exact, parents first, consistent, bounded."""

from __future__ import annotations

import random
import time
from typing import Any

import pytest
import zmq

from kvwire.prefix_index import PrefixIndex
from kvwire.publisher import EventCollector, EventPublisher, PublisherConfig
from kvwire.publisher.mirror import Mirror
from kvwire.wire import (
    AllBlocksCleared,
    BlockRemoved,
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

from .conftest import connect_sub, recv_live, wait_for

BS = 4
Copy = tuple[int | None, tuple[int, ...], str | None, str | None]  # parent, tokens, lora, group


class Model:
    """What a rank holds: every copy of every (medium, hash), with its content."""

    def __init__(self) -> None:
        self.held: dict[tuple[str | None, int], list[Copy]] = {}

    def apply(self, batch: KVEventBatch) -> None:
        for e in batch.events:
            if isinstance(e, BlockStored):
                toks = list(e.token_ids)
                parent = e.parent_block_hash
                for i, h in enumerate(e.block_hashes):
                    copy = (
                        parent,
                        tuple(toks[i * BS : (i + 1) * BS]),
                        e.lora_name,
                        str(e.group_idx),
                    )
                    self.held.setdefault((e.medium, h), []).append(copy)
                    parent = h
            elif isinstance(e, BlockRemoved):
                for h in e.block_hashes:
                    copies = self.held.get((e.medium, h))
                    if copies:
                        copies.pop()
                        if not copies:
                            del self.held[(e.medium, h)]
            else:
                self.held.clear()

    def state(self) -> dict[tuple[str | None, int], list[Copy]]:
        return {k: sorted(v, key=repr) for k, v in self.held.items()}


def random_batches(rng: random.Random, n: int, clears: bool = True) -> list[KVEventBatch]:
    """Stores (chains, copies of held blocks), removals (any block), rare clears.

    A copy repeats its block's parent and content, as an engine's does: its
    hash covers both.
    """
    out: list[KVEventBatch] = []
    held: list[tuple[str, int]] = []
    content: dict[tuple[str, int], tuple[int | None, list[int], str | None]] = {}
    next_hash = 1
    for _ in range(n):
        events: list[Any] = []
        for _ in range(rng.randint(1, 3)):
            r = rng.random()
            medium = rng.choice(["GPU", "GPU", "CPU"])
            if held and r < 0.1:  # another copy of a held block
                medium, h = rng.choice(held)
                parent, toks, lora = content[(medium, h)]
                events.append(BlockStored([h], parent, toks, BS, medium=medium, lora_name=lora))
                held.append((medium, h))
            elif r < 0.55 or not held:
                k = rng.randint(1, 6)
                hashes = list(range(next_hash, next_hash + k))
                next_hash += k
                parent = rng.choice(held)[1] if held and rng.random() < 0.6 else None
                toks = [rng.randrange(70_000) for _ in range(k * BS)]
                lora = rng.choice([None, None, "a"])
                events.append(BlockStored(hashes, parent, toks, BS, medium=medium, lora_name=lora))
                for i, h in enumerate(hashes):
                    content[(medium, h)] = (
                        parent if i == 0 else hashes[i - 1],
                        toks[i * BS : (i + 1) * BS],
                        lora,
                    )
                    held.append((medium, h))
            elif r < 0.97 or not clears:
                gone = rng.sample(held, min(len(held), rng.randint(1, 5)))
                for m, h in gone:
                    held.remove((m, h))
                    events.append(BlockRemoved([h], medium=m))
            else:
                held.clear()
                events.append(AllBlocksCleared())
        out.append(KVEventBatch(float(len(out)), events, 0))
    return out


def feed(mirror: Mirror, model: Model, batches: list[KVEventBatch], first: int) -> None:
    for i, b in enumerate(batches):
        decoded = decode_batch(encode_batch(b))  # the mirror sees what subscribers decode
        mirror.apply(first + i, decoded)
        model.apply(decoded)


def rebuild(chunks: list[bytes]) -> Model:
    """Apply snapshot chunks, checking that every parent held comes before its child."""
    model = Model()
    for payload in chunks:
        batch = decode_batch(payload)
        for e in batch.events:
            assert isinstance(e, BlockStored)
        model.apply(batch)
    return model


def drain(cursor: Any) -> list[bytes]:
    out = []
    while (chunk := cursor.next_chunk()) is not None:
        out.append(chunk)
    return out


@pytest.mark.parametrize("seed", range(6))
def test_snapshot_equals_the_state_its_events_describe(seed: int) -> None:
    rng = random.Random(seed)
    mirror, model = Mirror(), Model()
    feed(mirror, model, random_batches(rng, 300), 0)
    assert mirror.distrust_reason is None
    chunks = drain(mirror.snapshot(0, chunk_blocks=7))
    assert rebuild(chunks).state() == model.state()
    assert mirror.count_blocks() == len(model.held)
    for payload in chunks:
        assert sum(len(e.block_hashes) for e in decode_batch(payload).events) <= 7


@pytest.mark.parametrize("seed", range(6))
def test_parents_come_before_children_across_the_snapshot(seed: int) -> None:
    rng = random.Random(100 + seed)
    mirror, model = Mirror(), Model()
    feed(mirror, model, random_batches(rng, 200), 0)
    seen: set[tuple[str | None, int]] = set()
    for payload in drain(mirror.snapshot(0, chunk_blocks=5)):
        for e in decode_batch(payload).events:
            assert isinstance(e, BlockStored)
            parent = e.parent_block_hash
            if parent is not None and (e.medium, parent) in model.held:
                assert (e.medium, parent) in seen, "a child came before its held parent"
            seen.update((e.medium, h) for h in e.block_hashes)


@pytest.mark.parametrize("seed", range(6))
def test_snapshot_is_consistent_while_live_batches_change_the_mirror(seed: int) -> None:
    rng = random.Random(200 + seed)
    batches = random_batches(rng, 400)
    mirror, model = Mirror(), Model()
    feed(mirror, model, batches[:250], 0)
    expected = model.state()
    cursor = mirror.snapshot(0, chunk_blocks=3)
    assert cursor.next_seq == 250
    chunks = []
    for i, b in enumerate(batches[250:]):  # a live batch between every chunk
        if (chunk := cursor.next_chunk()) is not None:
            chunks.append(chunk)
        feed(mirror, model, [b], 250 + i)
    chunks += drain(cursor)
    assert rebuild(chunks).state() == expected
    assert mirror.snapshots_in_progress == 0
    assert rebuild(drain(mirror.snapshot(0))).state() == model.state()  # and now the new state


def test_a_large_mirror_grows_its_table_and_reuses_deleted_slots() -> None:
    rng = random.Random(99)
    mirror, model = Mirror(), Model()
    batches = random_batches(rng, 4000, clears=False)  # thousands held, stored, removed
    feed(mirror, model, batches, 0)
    assert mirror.count_blocks() == len(model.held) > 1000
    assert rebuild(drain(mirror.snapshot(0, chunk_blocks=64))).state() == model.state()


def test_a_seq_gap_makes_the_mirror_untrusted_until_a_clear() -> None:
    mirror, model = Mirror(), Model()
    feed(mirror, model, [KVEventBatch(0.0, [BlockStored([1], None, [1, 2, 3, 4], BS)], 0)], 0)
    feed(mirror, model, [KVEventBatch(0.0, [BlockRemoved([9])], 0)], 2)  # seq 1 never seen
    assert mirror.distrust_reason is not None and "1..1" in mirror.distrust_reason
    feed(mirror, model, [KVEventBatch(0.0, [AllBlocksCleared()], 0)], 3)
    assert mirror.distrust_reason is None and mirror.count_blocks() == 0


class _Keep:
    """A publisher that keeps the last batch flushed."""

    rank = 0
    batch: Any = None

    def publish(self, batch: Any) -> bool:
        self.batch = batch
        return True


# --- over sockets ------------------------------------------------------------------


def recv_until(sub: zmq.Socket[bytes], seq: int) -> None:
    """Read live messages up to ``seq`` (late pings from joining may come first)."""
    while recv_live(sub).seq < seq:
        pass


def request_snapshot(ctx: zmq.Context[Any], endpoint: str) -> list[Any]:
    sock: zmq.Socket[bytes] = ctx.socket(zmq.DEALER)
    sock.connect(endpoint)
    sock.send_multipart(snapshot_request_frames())
    out = []
    while True:
        assert sock.poll(10_000), "snapshot reply stalled"
        reply = parse_replay_reply(sock.recv_multipart())
        out.append(reply)
        if isinstance(reply, (SnapshotEnd, SnapshotRefused)):
            sock.close(linger=0)
            return out


def test_snapshot_over_the_replay_socket_rebuilds_the_index(
    ipc_dir: str, zctx: zmq.Context[Any]
) -> None:
    rng = random.Random(7)
    live = PrefixIndex(block_size=16)
    with EventPublisher(
        f"ipc://{ipc_dir}/p",
        f"ipc://{ipc_dir}/r",
        PublisherConfig(heartbeat_s=None, snapshot_chunk_blocks=64),
    ) as pub:
        sub, first = connect_sub(zctx, pub)
        collector = EventCollector(pub, block_size=16)
        prompts = []
        chains = []
        next_hash = 1
        for _ in range(40):
            k = rng.randint(1, 30)
            toks = [rng.randrange(100_000) for _ in range(k * 16)]
            hashes = list(range(next_hash, next_hash + k))
            parent = None
            if chains and chains[-1] and rng.random() < 0.4:  # extend the last chain
                prev = chains.pop()
                parent = prev[-1]
                prompts.append(prompts[-1][: len(prev) * 16] + toks)
                chains.append(prev + hashes)
            else:
                prompts.append(toks)
                chains.append(hashes)
            collector.stored(list(hashes), parent, toks)
            next_hash += k
            if rng.random() < 0.3:  # evict a tail, as engines do (children first)
                victim = rng.choice(chains)
                if victim:
                    collector.removed([victim.pop()])
            collector.flush()
        last = first + 39
        while (msg := recv_live(sub)).seq <= last:
            live.apply("w", 0, decode_batch(msg.payload))
            if msg.seq == last:
                break
        replies = request_snapshot(zctx, pub.bound_replay_endpoint or "")
    end = replies[-1]
    assert isinstance(end, SnapshotEnd) and end.next_seq == last + 1
    chunks = replies[:-1]
    assert [c.number for c in chunks] == list(range(end.chunks))
    rebuilt = PrefixIndex(block_size=16)
    for c in chunks:
        assert isinstance(c, SnapshotChunk) and c.next_seq == end.next_seq
        rebuilt.apply("w", 0, decode_batch(c.payload))
    assert rebuilt.blocks("w", 0) == live.blocks("w", 0)
    for toks in prompts:
        assert rebuilt.match(toks) == live.match(toks)
    assert rebuilt.stats().orphan_stores == live.stats().orphan_stores


def test_a_batch_dropped_on_a_full_queue_is_still_in_the_snapshot(
    ipc_dir: str, zctx: zmq.Context[Any]
) -> None:
    with EventPublisher(
        f"ipc://{ipc_dir}/p",
        f"ipc://{ipc_dir}/r",
        PublisherConfig(heartbeat_s=None, max_queue_size=1, send_coalesce_s=0.2),
    ) as pub:  # fmt: skip
        sub, _ = connect_sub(zctx, pub)  # its pings overflow the queue of one
        wait_for(lambda: pub.queue_depth == 0, what="pings sent")
        assert pub.publish(KVEventBatch(time.time(), [AllBlocksCleared()], 0))  # a known state
        recv_until(sub, pub.last_seq)
        assert pub.publish(KVEventBatch(time.time(), [BlockStored([1], None, [1] * 16, 16)], 0))
        recv_until(sub, pub.last_seq)
        assert pub.publish(KVEventBatch(time.time(), [BlockStored([2], 1, [2] * 16, 16)], 0))
        assert not pub.publish(KVEventBatch(time.time(), [BlockStored([3], 2, [3] * 16, 16)], 0))
        dropped = pub.last_seq
        recv_until(sub, dropped - 1)
        pub.publish(KVEventBatch(time.time(), [BlockRemoved([1])], 0))
        assert recv_live(sub).seq == dropped + 1  # subscribers see the gap
        replies = request_snapshot(zctx, pub.bound_replay_endpoint or "")
        end = replies[-1]
        assert isinstance(end, SnapshotEnd) and end.next_seq == dropped + 2
        rebuilt = PrefixIndex(block_size=16)
        for chunk in replies[:-1]:
            rebuilt.apply("w", 0, decode_batch(chunk.payload))
        assert rebuilt.blocks("w", 0) == {2, 3}  # the dropped store included
        assert pub.stats().dropped_queue_full >= 1


def test_snapshot_is_refused_after_a_drop_it_never_learnt_until_a_clear(
    ipc_dir: str, zctx: zmq.Context[Any]
) -> None:
    with EventPublisher(
        f"ipc://{ipc_dir}/p",
        f"ipc://{ipc_dir}/r",
        PublisherConfig(heartbeat_s=None, max_queue_size=1, send_coalesce_s=0.2, mirror_backlog=1),
    ) as pub:  # fmt: skip
        sub, _ = connect_sub(zctx, pub)  # its pings overflow the queue of one
        wait_for(lambda: pub.queue_depth == 0, what="pings sent")
        assert pub.publish(KVEventBatch(time.time(), [AllBlocksCleared()], 0))  # a known state
        recv_until(sub, pub.last_seq)
        assert pub.publish(KVEventBatch(time.time(), [BlockStored([1], None, [1] * 16, 16)], 0))
        recv_until(sub, pub.last_seq)
        assert pub.publish(KVEventBatch(time.time(), [BlockStored([2], 1, [2] * 16, 16)], 0))
        # Dropped twice: the first is kept for the mirror (its backlog holds one), the
        # second is lost to it too.
        assert not pub.publish(KVEventBatch(time.time(), [BlockRemoved([1])], 0))
        assert not pub.publish(KVEventBatch(time.time(), [BlockRemoved([2])], 0))
        recv_until(sub, pub.last_seq - 2)
        pub.publish(KVEventBatch(time.time(), [BlockRemoved([9])], 0))  # the sender sees the gap
        recv_until(sub, pub.last_seq)
        refused = request_snapshot(zctx, pub.bound_replay_endpoint or "")
        assert len(refused) == 1 and isinstance(refused[0], SnapshotRefused)
        assert "dropped" in refused[0].reason
        pub.publish(KVEventBatch(time.time(), [AllBlocksCleared()], 0))
        recv_until(sub, pub.last_seq)
        served = request_snapshot(zctx, pub.bound_replay_endpoint or "")
        # The empty state: chunk 0 alone, announcing no blocks.
        assert isinstance(served[-1], SnapshotEnd) and served[-1].chunks == 1
        assert isinstance(served[0], SnapshotChunk) and served[0].blocks == 0
        wait_for(lambda: pub.stats().snapshots_refused == 1, what="refusal counted")
        wait_for(lambda: pub.stats().snapshots_served == 1, what="snapshot counted")
