"""The native sender: GIL-free encoding of collector batches, byte-identical to msgspec's.

The sender thread encodes a collector's batch of lists and tuples of exact ints
without the GIL; anything else is prepared with the GIL (``CollectedBatch.encode``)
for the same writer. Both must put msgspec's bytes for the equivalent
``KVEventBatch`` on the wire, and a steady stream of list batches must never make
the sender take the GIL.
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np
import pytest
import zmq
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvwire.publisher import CollectedBatch, EventCollector, EventPublisher, PublisherConfig, Record
from kvwire.publisher._sender import CLEARED, REMOVED, STORED, Sender
from kvwire.wire import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEvent,
    KVEventBatch,
    decode_batch,
    encode_batch,
)

from .conftest import connect_sub, recv_live, wait_for

BS = 2
U64 = (1 << 64) - 1


def native(dialect: str) -> Sender:
    """A sender that is never started: only its encoder is used."""
    return Sender(
        topic=b"", dialect=dialect, rank=0, max_queue=1, buffer_steps=1, coalesce_s=0.0,
        heartbeat_s=0.0, mirror=False, mirror_backlog=1, batch_type=CollectedBatch,
        encode=lambda b: None,
    )  # fmt: skip


class Index(int):
    """An int subclass: valid, but only Python encodes it."""


# Hashes: small, chained, signed and unsigned edges, and ones needing conversion.
hash_values = st.one_of(
    st.integers(0, 300),
    st.sampled_from([-1, -(1 << 63), (1 << 63) - 1, 1 << 63, U64, 2**31, -(2**31) - 1]),
    st.integers(-(1 << 63), U64),
)
token_values = st.one_of(
    st.integers(0, 200_000),
    st.integers(-(1 << 63), U64),
    st.sampled_from([0, 127, 128, 255, 256, 65535, 65536, -32, -33, -129, U64]),
)
names = st.sampled_from([None, "GPU", "CPU", "x" * 40, "y" * 300])
groups = st.sampled_from([None, 0, 1, 7, 1 << 40, -3])


@st.composite
def records(draw: Any) -> list[Record]:
    out: list[Record] = []
    last: int | None = None
    for _ in range(draw(st.integers(0, 8))):
        kind = draw(st.sampled_from(["store", "store", "chain", "remove", "clear"]))
        if kind == "clear":
            out.append(Record(CLEARED))
            continue
        n = draw(st.integers(1, 5))
        hs: Any = draw(st.lists(hash_values, min_size=n, max_size=n))
        if draw(st.booleans()):
            hs = tuple(hs)
        if kind == "remove":
            out.append(Record(REMOVED, block_hashes=hs, medium=draw(names), group_idx=draw(groups)))
            continue
        if kind == "chain" and last is not None:
            other = (
                last - (1 << 64) if last > (1 << 63) - 1 else last + (1 << 64) if last < 0 else last
            )
            parent: int | None = last if draw(st.booleans()) else other  # the other form
        else:
            parent = draw(st.one_of(st.none(), hash_values))
        toks: Any = draw(st.lists(token_values, min_size=n * BS, max_size=n * BS))
        if draw(st.booleans()):
            toks = tuple(toks)
        lora, medium = draw(names), draw(st.sampled_from(["GPU", "GPU", None, "CPU"]))
        out.append(stored(hs, parent, toks, lora_name=lora, medium=medium,
                          group_idx=draw(st.sampled_from([None, None, 1]))))  # fmt: skip
        last = hs[-1]
    return out


def stored(hs: Any, parent: Any, toks: Any, **fields: Any) -> Record:
    return Record(STORED, block_hashes=hs, parent_hash=parent, token_ids=toks, **fields)


def _wire(h: Any, signed: bool) -> int:
    v = int(h) & U64
    return v - (1 << 64) if signed and v >> 63 else v


def expected(batch: CollectedBatch) -> KVEventBatch:
    """The oracle: the batch's events as msgspec's structs, coalesced (a store continuing
    the previous one's chain joins its event, as does a removal after one of the same
    medium and group), hashes in the batch's form."""
    sg, recs = batch.signed, batch.records
    events: list[KVEvent] = []
    i = 0
    while i < len(recs):
        r = recs[i]
        i += 1
        if r.kind == CLEARED:
            events.append(AllBlocksCleared())
            continue
        hs = [_wire(h, sg) for h in r.block_hashes]
        if r.kind == REMOVED:
            while i < len(recs) and recs[i].kind == REMOVED and (
                recs[i].medium, recs[i].group_idx) == (r.medium, r.group_idx):  # fmt: skip
                hs += [_wire(h, sg) for h in recs[i].block_hashes]
                i += 1
            events.append(BlockRemoved(hs, medium=r.medium, group_idx=r.group_idx))
            continue
        toks = [int(t) for t in r.token_ids]
        extra = None if r.extra_keys is None else list(r.extra_keys)
        while i < len(recs):
            n = recs[i]
            if (
                n.kind != STORED
                or n.parent_hash is None
                or (n.lora_name, n.medium, n.group_idx) != (r.lora_name, r.medium, r.group_idx)
                or (n.extra_keys is None) != (extra is None)
                or _wire(n.parent_hash, sg) != hs[-1]
            ):
                break
            hs += [_wire(h, sg) for h in n.block_hashes]
            toks += [int(t) for t in n.token_ids]
            if extra is not None:
                extra += n.extra_keys
            i += 1
        parent = None if r.parent_hash is None else _wire(r.parent_hash, sg)
        events.append(BlockStored(
            hs, parent, toks, batch.block_size, medium=r.medium, lora_name=r.lora_name,
            extra_keys=extra, group_idx=r.group_idx,
        ))  # fmt: skip
    return KVEventBatch(batch.ts, events, batch.rank)


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    recs=records(),
    signed=st.booleans(),
    ts=st.floats(allow_nan=False),
    rank=st.integers(0, 1 << 40),
)
def test_native_encoding_is_msgspecs_byte_for_byte(
    recs: list[Record], signed: bool, ts: float, rank: int
) -> None:
    """Without the GIL (the sender thread) and with it (CollectedBatch.encode): msgspec's
    bytes for the same events, both dialects."""
    batch = CollectedBatch(ts, recs, rank, BS, signed)
    for dialect in ("map", "array"):
        got = native(dialect).encode_native(batch)
        assert got is not None, "a batch of exact ints is encoded natively"
        assert got == batch.encode(dialect)  # type: ignore[arg-type]
        assert got == encode_batch(expected(batch), dialect=dialect)  # type: ignore[arg-type]


@settings(max_examples=100, deadline=None)
@given(recs=records(), signed=st.booleans())
def test_what_the_sender_leaves_to_the_gil_has_the_same_bytes(
    recs: list[Record], signed: bool
) -> None:
    """Int subclasses and arrays are prepared with the GIL: the same bytes as the lists."""
    batch = CollectedBatch(1.25, recs, 3, BS, signed)
    want = native("map").encode_native(batch)
    changed, arrays = [], []
    for r in recs:
        if r.kind == STORED:
            hs = [Index(h) for h in r.block_hashes]
            toks = np.array(r.token_ids, dtype=object).tolist()
            changed.append(stored(hs, r.parent_hash, toks, lora_name=r.lora_name,
                                  medium=r.medium, group_idx=r.group_idx))  # fmt: skip
            arr = np.array([h & U64 for h in r.block_hashes], dtype=np.uint64)
            small = all(0 <= t < 1 << 32 for t in r.token_ids)
            arrays.append(stored(arr, r.parent_hash, np.array(r.token_ids, dtype=np.uint32)
                                 if small else list(r.token_ids), lora_name=r.lora_name,
                                 medium=r.medium, group_idx=r.group_idx))  # fmt: skip
        elif r.kind == REMOVED:
            hs = [Index(h) for h in r.block_hashes]
            changed.append(Record(REMOVED, block_hashes=hs, medium=r.medium, group_idx=r.group_idx))
            arr = np.array([h & U64 for h in r.block_hashes], dtype=np.uint64)
            arrays.append(Record(REMOVED, block_hashes=arr, medium=r.medium, group_idx=r.group_idx))
        else:
            changed.append(r)
            arrays.append(r)
    for other in (CollectedBatch(1.25, changed, 3, BS, signed),
                  CollectedBatch(1.25, arrays, 3, BS, signed)):  # fmt: skip
        if any(r.kind != CLEARED for r in recs):
            assert native("map").encode_native(other) is None
        assert other.encode("map") == want


@pytest.mark.parametrize(
    ("record", "events"),
    [
        (stored([1], None, [1, 2], medium="GPU", extra_keys=[("k",)]),  # extra_keys
         [BlockStored([1], None, [1, 2], BS, extra_keys=[["k"]])]),
        (stored([True], None, [1, 2], medium="GPU"),  # bool is an int subclass
         [BlockStored([1], None, [1, 2], BS)]),
        (stored([1], None, [1, 2], lora_name="lörà", medium="GPU"),  # not ASCII
         [BlockStored([1], None, [1, 2], BS, lora_name="lörà")]),
        (Record(REMOVED, block_hashes=np.array([1], dtype=np.uint64), medium="GPU"),  # an array
         [BlockRemoved([1])]),
    ],
)  # fmt: skip
def test_records_only_the_gil_prepares(record: Record, events: list[KVEvent]) -> None:
    batch = CollectedBatch(0.0, [record], 0, BS, False)
    assert native("map").encode_native(batch) is None
    assert batch.encode("map") == encode_batch(KVEventBatch(0.0, events, 0))


@pytest.mark.parametrize(
    ("record", "error"),
    [
        (stored([1 << 64], None, [1, 2]), "block hash 18446744073709551616 does not fit"),
        (stored([1], None, [1, 2, 3]), "changed before the batch was encoded"),
        (stored(["a"], None, [1, 2]), "block hash 'a' is not an int"),
        (stored([1], 1.5, [1, 2]), "block hash 1.5 is not an int"),
        (stored([1], None, [1, -(1 << 64)]), "token id -18446744073709551616 does not fit"),
        (stored([1], None, np.array([[1, 2]])), "token id must be a 1-D integer array"),
        (Record(REMOVED, block_hashes=[]), "no block hashes"),
    ],
)
def test_bad_records_raise_naming_the_value(record: Record, error: str) -> None:
    with pytest.raises(ValueError, match=error):
        CollectedBatch(0.0, [record], 0, BS, False).encode("map")


def test_records_are_named_and_checked() -> None:
    r = stored([1], 7, [1, 2], medium="CPU", group_idx=3)
    assert (r.kind, r.block_hashes, r.parent_hash, r.token_ids) == (STORED, [1], 7, [1, 2])
    assert (r.lora_name, r.medium, r.extra_keys, r.group_idx) == (None, "CPU", None, 3)
    assert "STORED" in repr(r)
    assert Record(REMOVED, block_hashes=[1]).token_ids is None
    with pytest.raises(TypeError, match="needs block_hashes and token_ids"):
        Record(STORED, block_hashes=[1])
    with pytest.raises(TypeError, match="has no token_ids"):
        Record(REMOVED, block_hashes=[1], token_ids=[1])
    with pytest.raises(ValueError, match="kind must be"):
        Record(3)
    with pytest.raises(TypeError, match="records must be Records"):
        CollectedBatch(0.0, [(2,)], 0, BS, False).encode("map")  # type: ignore[list-item]


def test_a_steady_stream_of_list_batches_never_takes_the_gil(
    ipc_dir: str, zctx: zmq.Context[Any]
) -> None:
    with EventPublisher(
        f"ipc://{ipc_dir}/p", config=PublisherConfig(heartbeat_s=None, snapshot=False)
    ) as pub:
        sub, first = connect_sub(zctx, pub)  # its pings are KVEventBatch: Python encodes them
        before = pub.stats()
        col = EventCollector(pub, BS)
        n = 300
        for i in range(n):
            col.stored([2 * i + 10, 2 * i + 11], None, [i, i, i, i])
            col.removed([i])
            assert col.flush()
            if i % 50 == 0:
                time.sleep(0.005)  # idle wake-ups too, not one backlog
        got = [recv_live(sub) for _ in range(n)]
        assert [m.seq for m in got] == list(range(first, first + n))
        assert decode_batch(got[7].payload).events[0].block_hashes == [24, 25]  # type: ignore[union-attr]
        wait_for(lambda: pub.stats().published == first + n, what="all sent")
        after = pub.stats()
        assert after.native_encoded - before.native_encoded == n
        assert after.gil_encoded == before.gil_encoded
        assert after.sender_gil_takes == before.sender_gil_takes  # not once
        # Anything else is encoded by Python, in seq order with the rest.
        pub.publish(KVEventBatch(1.0, [], None))
        col.removed([5])
        col.flush()
        a, b = recv_live(sub), recv_live(sub)
        assert (a.seq, b.seq) == (first + n, first + n + 1)
        assert decode_batch(a.payload).data_parallel_rank == 0 and decode_batch(b.payload).events
        wait_for(lambda: pub.stats().published == first + n + 2, what="all sent")
        last = pub.stats()
        assert last.gil_encoded == after.gil_encoded + 1
        assert last.sender_gil_takes == after.sender_gil_takes + 1
        assert last.native_encoded == after.native_encoded + 1


def test_replayed_payloads_are_the_live_ones(ipc_dir: str, zctx: zmq.Context[Any]) -> None:
    from kvwire.wire import ReplayEnd, parse_replay_reply, replay_request_frames

    with EventPublisher(
        f"ipc://{ipc_dir}/p",
        f"ipc://{ipc_dir}/r",
        PublisherConfig(heartbeat_s=None, buffer_steps=50),
    ) as pub:
        sub, _ = connect_sub(zctx, pub)
        col = EventCollector(pub, BS)
        live = []
        for i in range(80):
            col.stored([i + 1], i or None, [i, i])
            col.flush()
            live.append(recv_live(sub))
        dealer: zmq.Socket[bytes] = zctx.socket(zmq.DEALER)
        dealer.connect(pub.bound_replay_endpoint or "")
        dealer.send_multipart(replay_request_frames(0))
        replayed = []
        while True:
            assert dealer.poll(5000)
            reply = parse_replay_reply(dealer.recv_multipart())
            if isinstance(reply, ReplayEnd):
                break
            replayed.append(reply)
        dealer.close(linger=0)
        # The ring keeps the last 50: exactly the live messages' seqs and bytes.
        tail = live[-50:]
        assert [r.seq for r in replayed] == [m.seq for m in tail]
        assert [bytes(r.payload) for r in replayed] == [bytes(m.payload) for m in tail]


@pytest.mark.parametrize("dialect", ["map", "array"])
def test_heartbeats_are_pythons_empty_batch_byte_for_byte(
    dialect: str, ipc_dir: str, zctx: zmq.Context[Any]
) -> None:
    from kvwire.wire import encode_batch

    with EventPublisher(
        f"ipc://{ipc_dir}/p", config=PublisherConfig(heartbeat_s=0.05, dialect=dialect), rank=5
    ) as pub:  # fmt: skip
        sub, first = connect_sub(zctx, pub)
        beat = recv_live(sub)  # nothing else is published: a heartbeat
        assert beat.seq >= first - 1  # (one may have gone out while the pings drained)
        ts = decode_batch(beat.payload).ts
        assert abs(ts - time.time()) < 5
        expected = encode_batch(KVEventBatch(ts, [], 5), dialect=dialect)  # type: ignore[arg-type]
        assert bytes(beat.payload) == expected
        wait_for(lambda: pub.stats().heartbeats >= 1, what="the heartbeat counted")


@settings(max_examples=500, deadline=None)
@given(
    last_sent=st.floats(0, 1e6),
    interval=st.sampled_from([0.001, 0.05, 0.25, 1.0, 2.5, 3600.0]),
    since=st.floats(0, 10),
    wall=st.floats(1e9, 2e9),
    after_batch=st.booleans(),
    phase=st.one_of(st.just(0.0), st.floats(0.0, 1.0, exclude_max=True)),
)
def test_the_senders_heartbeat_rule_is_the_shared_one(
    last_sent: float, interval: float, since: float, wall: float, after_batch: bool, phase: float
) -> None:
    from kvwire.publisher._sender import heartbeat_due
    from kvwire.wire.heartbeat import heartbeat_at

    now = last_sent + since * interval
    assert heartbeat_due(last_sent, interval, now, wall, after_batch) == heartbeat_at(
        last_sent, interval, now, wall, after_batch
    )
    assert heartbeat_due(last_sent, interval, now, wall, after_batch, phase) == heartbeat_at(
        last_sent, interval, now, wall, after_batch, phase
    )


# --- the native collector: hooks into C memory, batches straight onto the sender's queue ----


class Keep:
    """A publisher stand-in: the collector's Python path, building CollectedBatch."""

    rank = 0

    def __init__(self) -> None:
        self.batches: list[Any] = []

    def publish(self, batch: Any) -> bool:
        self.batches.append(batch)
        return True


DEFAULTS = {"lora_name": None, "medium": "GPU", "group_idx": None}


@st.composite
def hook_calls(draw: Any) -> list[tuple[Any, ...]]:
    """One iteration's hook calls, made of ``records()``: keywords at their default given
    or left out."""
    calls: list[tuple[Any, ...]] = []
    for rec in draw(records().filter(bool)):
        if rec.kind == STORED:
            name, args = "stored", (rec.block_hashes, rec.parent_hash, rec.token_ids)
            kw = {"lora_name": rec.lora_name, "medium": rec.medium, "group_idx": rec.group_idx}
        elif rec.kind == REMOVED:
            name, args = "removed", (rec.block_hashes,)
            kw = {"medium": rec.medium, "group_idx": rec.group_idx}
        else:
            name, args, kw = "cleared", (), {}
        kw = {k: v for k, v in kw.items() if v != DEFAULTS[k] or draw(st.booleans())}
        calls.append((name, args, kw))
    return calls


def play(col: EventCollector, calls: list[tuple[Any, ...]]) -> bool:
    for name, args, kw in calls:
        getattr(col, name)(*args, **kw)
    return col.flush()


def test_the_native_collectors_bytes_are_collected_batch_encode(
    ipc_dir: str, zctx: zmq.Context[Any]
) -> None:
    """Records kept in C and queued on the sender as they are: msgspec's bytes for the
    Python path's CollectedBatch, both dialects and hash forms, caps and counters too."""
    dialects = ("map", "array")
    pubs = [
        EventPublisher(
            f"ipc://{ipc_dir}/{d}",
            config=PublisherConfig(heartbeat_s=None, snapshot=False, dialect=d),
        ).start()
        for d in dialects
    ]
    try:
        subs = [connect_sub(zctx, p)[0] for p in pubs]
        before = [p.stats() for p in pubs]
        sent = 0

        @settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
        @given(
            calls=hook_calls(),
            signed=st.booleans(),
            cap=st.one_of(st.none(), st.integers(0, 12)),
        )
        def check(calls: list[tuple[Any, ...]], signed: bool, cap: int | None) -> None:
            nonlocal sent
            form: Any = "signed" if signed else "unsigned"
            ref = Keep()
            expected_col = EventCollector(
                ref, BS, hash_format=form, max_stored_blocks_per_iteration=cap
            )
            cols = [
                EventCollector(p, BS, hash_format=form, max_stored_blocks_per_iteration=cap)
                for p in pubs
            ]
            published = play(expected_col, calls)
            assert [play(col, calls) for col in cols] == [published] * 2
            assert [col.stats() for col in cols] == [expected_col.stats()] * 2
            if not published:  # every store capped away and nothing else: no batch
                return
            sent += 1
            want = ref.batches[0]
            for sub, dialect in zip(subs, dialects, strict=True):
                got = recv_live(sub)
                want.ts = decode_batch(got.payload).ts
                assert bytes(got.payload) == want.encode(dialect)
                assert bytes(got.payload) == encode_batch(expected(want), dialect=dialect)  # type: ignore[arg-type]

        check()
        for p, b in zip(pubs, before, strict=True):
            wait_for(lambda p=p, b=b: p.stats().published - b.published == sent, what="all sent")
            s = p.stats()
            assert (s.native_encoded - b.native_encoded, s.gil_encoded) == (sent, b.gil_encoded)
            assert s.sender_gil_takes == b.sender_gil_takes
    finally:
        for p in pubs:
            p.close()


def test_what_the_native_collector_leaves_to_python_has_the_same_bytes(
    ipc_dir: str, zctx: zmq.Context[Any]
) -> None:
    """Array captures, extra_keys and int subclasses travel as C records too; the sender
    prepares them with the GIL. A value no 64-bit int is a counted gap."""
    with EventPublisher(
        f"ipc://{ipc_dir}/p", config=PublisherConfig(heartbeat_s=None, snapshot=False)
    ) as pub:
        sub, first = connect_sub(zctx, pub)
        before = pub.stats()
        ref = Keep()
        for col in (EventCollector(pub, BS), EventCollector(ref, BS)):
            col.stored(np.array([7, 8], dtype=np.uint64), None, np.arange(4))
            col.stored([Index(9)], 8, [1, 2], extra_keys=[("k",)])
            col.removed((Index(3), 4))
            assert col.flush()
            col.stored([1 << 64], None, [1, 2])  # not a 64-bit hash: Python refuses it
            assert col.flush()
            col.removed([5])
            assert col.flush()
        got = recv_live(sub)
        assert got.seq == first
        want = ref.batches[0]
        want.ts = decode_batch(got.payload).ts
        assert bytes(got.payload) == want.encode("map") == encode_batch(expected(want))
        last = recv_live(sub)
        assert last.seq == first + 2  # the refused batch is a gap
        assert decode_batch(last.payload).events[0].block_hashes == [5]  # type: ignore[union-attr]
        wait_for(lambda: pub.stats().published - before.published == 2, what="all sent")
        s = pub.stats()
        assert s.dropped_encode_error - before.dropped_encode_error == 1
        assert (s.gil_encoded - before.gil_encoded, s.native_encoded - before.native_encoded) == (2, 1)


def test_the_native_collector_drops_on_a_full_queue_as_publish_does(ipc_dir: str) -> None:
    pub = EventPublisher(
        f"ipc://{ipc_dir}/p",
        config=PublisherConfig(heartbeat_s=None, snapshot=False, max_queue_size=2),
    )
    col = EventCollector(pub, BS)  # never started: batches stay queued
    flushed = []
    for i in range(3):
        col.removed([i])
        flushed.append(col.flush())
    assert flushed == [True, True, False]
    s = pub.stats()
    assert (s.dropped_queue_full, s.last_seq, s.queue_depth) == (1, 2, 2)
    assert col.stats().batches == 3
    pub.close()
    col.removed([9])
    assert col.flush() is False and pub.stats().dropped_closed == 1


def test_a_replaced_publish_sees_every_batch() -> None:
    pub = EventPublisher(
        "ipc:///tmp/kvwire-unused", config=PublisherConfig(heartbeat_s=None, snapshot=False)
    )
    seen: list[Any] = []
    pub.publish = lambda b: seen.append(b) or True  # type: ignore[method-assign,assignment,func-returns-value]
    col = EventCollector(pub, BS)
    col.removed([1])
    assert col.flush()
    assert len(seen) == 1 and isinstance(seen[0], CollectedBatch)
    assert seen[0].to_batch().events[0].block_hashes == [1]
    pub.close()


def test_list_iterations_create_no_python_objects(ipc_dir: str) -> None:
    """The hooks and flush() on lists keep no Python object per iteration: a backlog of
    queued batches is C memory only (the Python path's would hold a CollectedBatch, a
    records list and its Records each)."""
    import tracemalloc

    hs, toks, parent, gone = [11, 12], [1, 2, 3, 4], 1 << 62, [5, 6]
    n = 2000

    def grown(col: EventCollector) -> int:
        stored, removed, cleared, flush = col.stored, col.removed, col.cleared, col.flush
        for _ in range(10):  # warm-up: the record array reaches its size
            stored(hs, parent, toks)
            removed(gone, medium="CPU")
            cleared()
            flush()
        tracemalloc.start()
        try:
            start = tracemalloc.get_traced_memory()[0]
            for _ in range(n):
                stored(hs, parent, toks)
                removed(gone, medium="CPU")
                cleared()
                flush()
            return tracemalloc.get_traced_memory()[0] - start
        finally:
            tracemalloc.stop()

    pub = EventPublisher(
        f"ipc://{ipc_dir}/p",
        config=PublisherConfig(heartbeat_s=None, snapshot=False, max_queue_size=2 * n),
    )  # never started: every batch stays queued
    try:
        native_growth = grown(EventCollector(pub, BS))
        assert pub.stats().queue_depth == n + 10
    finally:
        pub.close()
    python_growth = grown(EventCollector(Keep(), BS))  # the measure sees objects kept
    assert python_growth > 100 * n
    assert native_growth < 2000, f"{native_growth} bytes of Python objects for {n} iterations"


def test_kvwire_dialects_are_layouts_of_the_wire_structs() -> None:
    """The writer's formats for collector batches come from kvwire.wire's structs by the
    rule the engines' formats use (the adapter reads an engine's structs with it too)."""
    from kvwire.publisher.batch import struct_layout, wire_format
    from kvwire.wire.codec import POSITIONAL_FIELDS

    for cls in POSITIONAL_FIELDS:
        layout = struct_layout(cls)
        assert layout is not None and layout[0] is cls and layout[1] == "type"
    stored = struct_layout(next(iter(POSITIONAL_FIELDS)), 3)
    assert stored is not None and stored[1] is None  # positional: no tag field
    assert [f[0] for f in stored[3]] == ["block_hashes", "parent_block_hash", "token_ids"]
    assert wire_format("map") is wire_format("map")
    with pytest.raises(ValueError, match="unknown dialect"):
        wire_format("xml")  # type: ignore[arg-type]
    # A format for records writes no engine batch.
    assert wire_format("map").encode(KVEventBatch(0.0, [], 0)) is None


def test_encoded_bytes_go_as_they_are_without_the_gil(ipc_dir: str, zctx: zmq.Context[Any]) -> None:
    """A payload already encoded is sent byte for byte, copied by the sender thread without
    the GIL (a relay's live path then waits on no Python thread), and mirrored like any."""
    with EventPublisher(
        f"ipc://{ipc_dir}/p", f"ipc://{ipc_dir}/r", PublisherConfig(heartbeat_s=None)
    ) as pub:
        sub, first = connect_sub(zctx, pub)
        before = pub.stats()
        payloads = [
            encode_batch(
                KVEventBatch(float(i), [BlockStored([100 + i], None, [i] * BS, BS, None)], 0)
            )
            for i in range(50)
        ]
        for p in payloads:
            assert pub.publish(p)
        got = [recv_live(sub) for _ in payloads]
        assert [m.seq for m in got] == list(range(first, first + len(payloads)))
        assert [bytes(m.payload) for m in got] == payloads
        wait_for(lambda: pub.stats().published == first + len(payloads), what="all sent")
        after = pub.stats()
        assert after.native_encoded - before.native_encoded == len(payloads)
        assert after.gil_encoded == before.gil_encoded
        assert after.sender_gil_takes == before.sender_gil_takes
        wait_for(lambda: pub.stats().mirrored_blocks == len(payloads), what="mirrored")
        # Bytes the mirror cannot read make it refuse snapshots, never a wrong one.
        assert pub.publish(b"\x93not a batch")
        assert bytes(recv_live(sub).payload) == b"\x93not a batch"
        wait_for(lambda: pub.stats().mirror_pending == 0, what="mirrored")
        assert pub._mirror is not None and pub._mirror.distrust_reason is not None
