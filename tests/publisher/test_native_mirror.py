"""The mirror's native reader (``_mirror.c``) against the decoded path and a model.

Every payload goes to three places: a mirror reading it in C
(``apply_payload``), a mirror fed the decoded events (the general path), and
the model of what the rank holds. Snapshots taken mid-stream, served while
the stream goes on, must rebuild the model's state as of their start.
"""

from __future__ import annotations

import random
from typing import Any

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvwire.publisher._mirror import Core
from kvwire.publisher.mirror import NOT_SENT, Mirror, SnapshotCursor
from kvwire.wire import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEventBatch,
    decode_batch,
    encode_batch,
)
from kvwire.wire.codec import StoredParts

from .test_snapshot import Model, drain, random_batches, rebuild


def _vary(rng: random.Random, batch: KVEventBatch) -> KVEventBatch:
    """Some stores with extra keys or a group (extra keys: the reader hands those back)."""
    events: list[Any] = []
    for e in batch.events:
        if type(e) is BlockStored and rng.random() < 0.2:
            extra = [["k", i] for i in range(len(e.block_hashes))] if rng.random() < 0.5 else None
            e = msgspec.structs.replace(e, extra_keys=extra, group_idx=rng.choice([None, 0, -3]))
        events.append(e)
    return KVEventBatch(batch.ts, events, batch.data_parallel_rank)


@settings(max_examples=60, deadline=None)
@given(
    seed=st.integers(0, 2**32 - 1),
    n=st.integers(1, 250),
    dialect=st.sampled_from(["map", "array"]),
    chunk=st.integers(1, 9),
    data=st.data(),
)
def test_native_and_decoded_mirrors_agree_with_the_model(
    seed: int, n: int, dialect: Any, chunk: int, data: st.DataObject
) -> None:
    rng = random.Random(seed)
    batches = [_vary(rng, b) for b in random_batches(rng, n)]
    starts = sorted(data.draw(st.lists(st.integers(0, n), max_size=3), label="snapshots at"))
    feeds = data.draw(st.booleans(), label="fed as feeds")
    native, decoded, model = Mirror(), Mirror(), Model()
    serving: list[tuple[Any, list[bytes], Any]] = []  # (cursor, chunks so far, expected state)
    pending: list[tuple[int, Any]] = []  # a feed being gathered
    for seq, batch in enumerate(batches):
        if starts and starts[0] == seq:
            native.apply_feed(pending)  # a snapshot starts after what was encoded
            pending = []
        while starts and starts[0] == seq:
            starts.pop(0)
            expected = model.state()
            for mirror in (native, decoded):
                serving.append((mirror.snapshot(0, chunk_blocks=chunk), [], expected))
        payload = encode_batch(batch, dialect=dialect)
        if feeds:
            pending.append((seq, payload))
            if rng.random() < 0.2:
                native.apply_feed(pending)
                pending = []
        else:
            native.apply_payload(seq, payload)
        decoded.apply(seq, decode_batch(payload))
        model.apply(decode_batch(payload))
        if pending:
            continue
        for cursor, chunks, _ in serving:  # a chunk of each snapshot between live batches
            if (c := cursor.next_chunk()) is not None:
                chunks.append(c)
        assert native.count_blocks() == decoded.count_blocks() == len(model.held)
    native.apply_feed(pending)
    assert native.count_blocks() == len(model.held)
    for cursor, chunks, expected in serving:
        chunks += drain(cursor)
        assert rebuild(chunks).state() == expected
    assert native.snapshots_in_progress == 0
    assert rebuild(drain(native.snapshot(0, chunk_blocks=chunk))).state() == model.state()
    assert native.distrust_reason is None


def test_the_reader_takes_both_dialects_and_hands_back_the_rest_unchanged() -> None:
    plain = KVEventBatch(
        1.0,
        [
            BlockStored([1, 2, (1 << 64) - 1], None, [1, 2, 3, 4, 5, 6], 2, lora_name="a"),
            BlockRemoved([2], medium=None),
            BlockStored([5], 1, [7, -5, 300_000], 3, medium=None, group_idx=4),
        ],
        0,
    )
    for dialect in ("map", "array"):
        core = Core()
        assert core.apply_payload(encode_batch(plain, dialect=dialect)) is True
        assert core.count() == 4
        stored = [
            (c.hash_list(0, len(c)), c.parent, c.medium, c.lora, c.group) for c in core.chains()
        ]
        assert stored == [
            ([1, 2, (1 << 64) - 1], None, "GPU", "a", None),
            ([5], 1, None, None, 4),
        ]
        assert msgspec.msgpack.decode(core.chains()[1].tokens) == [7, -5, 300_000]
    # Outside the reader's subset: nothing changes, False.
    core = Core()
    core.apply_payload(encode_batch(KVEventBatch(0.0, [BlockStored([9], None, [1], 1)], 0)))
    for other in (
        KVEventBatch(0.0, [BlockRemoved([9]), AllBlocksCleared()], 0),
        KVEventBatch(0.0, [BlockRemoved([9]), BlockStored([3], None, [1], 1, extra_keys=[1])], 0),
    ):
        assert core.apply_payload(encode_batch(other)) is False
        assert core.count() == 1


@settings(max_examples=200, deadline=None)
@given(cut=st.integers(0, 10_000), junk=st.binary(max_size=64))
def test_damaged_payloads_change_nothing(cut: int, junk: bytes) -> None:
    payload = encode_batch(random_batches(random.Random(cut), 1, clears=False)[0])
    core = Core()
    core.store([77], None, b"\x91\x01", 1, "GPU", None, None, None)
    for bad in (payload[: cut % len(payload)], junk, payload + b"\xc0"):
        assert core.apply_payload(bad) is False
        assert core.count() == 1 and [c.hash_list(0, 1) for c in core.chains()] == [[77]]


def test_a_mirror_fed_a_payload_that_does_not_decode_distrusts_itself() -> None:
    mirror = Mirror()
    mirror.apply_payload(0, b"\x93\xcb")
    assert mirror.distrust_reason is not None and "did not decode" in mirror.distrust_reason


def test_a_large_feed_is_read_as_its_payloads_one_by_one() -> None:
    """Large enough for the first pass to run without the GIL; with entries C hands back."""
    rng = random.Random(5)
    batches = random_batches(rng, 1000) + random_batches(rng, 500, clears=False)
    feed: list[tuple[int, Any]] = []
    for seq, b in enumerate(batches):
        feed.append((seq, encode_batch(_vary(rng, b), dialect="array" if seq % 3 else "map")))
    last_clear = max(
        i for i, b in enumerate(batches) if any(type(e) is AllBlocksCleared for e in b.events)
    )
    assert last_clear < 1400
    feed[1420] = (1420, None)  # did not encode
    del feed[1450]  # a seq the mirror never sees
    assert sum(len(p) for _, p in feed if p is not None) > 1 << 16
    by_feed, one_by_one, model = Mirror(), Mirror(), Model()
    by_feed.apply_feed(feed)
    for seq, payload in feed:
        if payload is None:
            one_by_one.skip(seq, NOT_SENT)
        else:
            one_by_one.apply_payload(seq, payload)
            model.apply(decode_batch(payload))
    assert by_feed.next_seq == one_by_one.next_seq == 1500
    assert by_feed.distrust_reason == one_by_one.distrust_reason
    assert by_feed.distrust_reason is not None and "1420" in by_feed.distrust_reason
    assert by_feed.count_blocks() == one_by_one.count_blocks() == len(model.held) > 0
    state = rebuild(drain(one_by_one.snapshot(0))).state()
    assert rebuild(drain(by_feed.snapshot(0))).state() == state



def _tokens(blocks: int) -> bytes:
    return msgspec.msgpack.encode(list(range(4 * blocks)))


def test_simple_parts_takes_whole_parentless_chains_as_the_walk_would_and_stops_at_the_rest() -> None:
    """``Core.simple_parts``, the walk's common case in C: a chain with no parent that held
    all its blocks when the snapshot began goes out whole, as ``_part`` makes it; a chain
    with a parent, one with a hole, one already taken or one longer than the room is the
    Python walk's (passed over when taken, else the call stops there)."""
    core = Core()
    core.store([1, 2], None, _tokens(2), 4, "GPU", None, None, None)
    core.store([3, 4], None, _tokens(2), 4, "GPU", "lora", [["x"], ["y"]], 2)
    core.store([5], 4, _tokens(1), 4, "GPU", None, None, None)  # a parent
    core.store([6, 7], None, _tokens(2), 4, "CPU", None, None, None)
    core.store([8, 9, 10], None, _tokens(3), 4, "GPU", None, None, None)
    core.remove("GPU", [9])  # a hole
    chains = core.chains()
    undo: dict[Any, Any] = {}
    done: set[Any] = set()
    args = (StoredParts, msgspec.Raw)
    parts, i, blocks = core.simple_parts(chains, 0, 100, undo, done, *args)
    assert (i, blocks) == (2, 4)  # stops at the chain with a parent
    assert parts == [SnapshotCursor._part(c, 0, len(c)) for c in chains[:2]]
    assert done == {(chains[0], 0), (chains[1], 0)}
    # Passed over once taken; a chain with a hole is the walk's.
    done.add((chains[3], 0))
    assert core.simple_parts(chains, 3, 100, undo, done, *args) == ([], 4, 0)
    # Stops before a chain longer than the room left.
    assert core.simple_parts(chains, 0, 1, undo, set(), *args) == ([], 0, 0)
    # The state at the snapshot's start: a block removed since is still the chain's.
    undo[("GPU", 9)] = (chains[4],)
    parts, i, blocks = core.simple_parts(chains, 4, 100, undo, set(), *args)
    assert (i, blocks) == (5, 3) and parts == [SnapshotCursor._part(chains[4], 0, 3)]
    with pytest.raises(TypeError):
        core.simple_parts(chains, 0, 1, [], done, *args)  # type: ignore[arg-type]
    with pytest.raises(TypeError):
        core.simple_parts([1], 0, 9, {}, set(), *args)  # type: ignore[list-item]
