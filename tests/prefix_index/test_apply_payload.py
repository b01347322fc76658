"""PrefixIndex.apply_payload: the fused native path leaves exactly what decode + apply leave."""

from __future__ import annotations

import random
from typing import Any

import msgspec
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvwire.prefix_index import PrefixIndex
from kvwire.wire import (
    DEFAULT_LIMITS,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    DecodeLimits,
    KVEventBatch,
    WireError,
    decode_batch,
    encode_batch,
)
from tests.budget import examples

from .test_index_model import BS, Driver, ops

MEDIA = [None, "GPU", "CPU", "CPU_PINNED", "DISK", "HBM", "tape"]


class CountingCore:
    """The native tables, counting the payloads their fused path took."""

    def __init__(self, core: Any) -> None:
        self.core = core
        self.native = 0
        self.general = 0

    def apply_payload(self, *args: Any) -> Any:
        done = self.core.apply_payload(*args)
        if not done:
            self.general += 1
        else:
            self.native += 1
        return done

    def __getattr__(self, name: str) -> Any:
        return getattr(self.core, name)


def apply_both(ref: PrefixIndex, idx: PrefixIndex, payload: bytes, limits: DecodeLimits) -> None:
    """decode + apply into ref and apply_payload into idx, or both refuse it."""
    try:
        batch = decode_batch(payload, limits)
    except WireError:
        with pytest.raises(WireError):
            idx.apply_payload("w", 0, payload, limits)
    else:
        ref.apply("w", 0, batch)
        idx.apply_payload("w", 0, payload, limits)


def fused_index(*args: Any, **kw: Any) -> tuple[PrefixIndex, CountingCore]:
    idx = PrefixIndex(*args, **kw)
    counting = CountingCore(idx._core)
    idx._core = counting  # type: ignore[assignment]
    return idx, counting


def assert_same(a: PrefixIndex, b: PrefixIndex, prompts: list[list[int]]) -> None:
    """Same state: counters, table sizes, every rank's blocks and cap state, matches."""
    assert a.stats() == b.stats()
    assert a.ranks() == b.ranks()
    for name in a.ranks():
        assert a.blocks(*name) == b.blocks(*name), name
        assert a.over_cap(*name) == b.over_cap(*name), name
    for p in prompts:
        assert a.match_tiers(p) == b.match_tiers(p)


class PayloadDriver(Driver):
    """The model test's driver, with a second index fed the encoded batches."""

    def __init__(self, dialects: list[str]) -> None:
        super().__init__()
        self.fused, self.counting = fused_index(BS, seed=7)
        self.dialects = dialects
        self.sent = 0

    def send(self, w: str, r: int, events: list[Any]) -> None:
        dialect: Any = self.dialects[self.sent % len(self.dialects)]
        self.sent += 1
        payload = encode_batch(KVEventBatch(0.0, events, r), dialect=dialect)
        # What the wire carries (the array dialect stops before cache_salt).
        super().send(w, r, decode_batch(payload).events)
        self.fused.apply_payload(w, r, payload)

    def run(self, op: tuple[Any, ...]) -> None:
        super().run(op)
        w = ["w0", "w1", "w2"][op[1]]
        if op[0] == "sink_clear":
            self.fused.clear(w, op[2])
        elif op[0] == "remove_worker":
            self.fused.remove_worker(w)

    def check(self) -> None:
        super().check()
        assert_same(self.index, self.fused, [p[0] for p in self.all_probes()])


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ops, st.sampled_from([["map"], ["array"], ["map", "array"]]))
def test_fused_apply_equals_decode_and_apply(
    op_list: list[tuple[Any, ...]], dialects: list[str]
) -> None:
    """Both dialects, every event form the model test makes: the same index, the model's answers."""
    d = PayloadDriver(dialects)
    for op in op_list:
        d.run(op)
    d.check()
    d.remove_everything()
    d.check()


def test_fused_path_is_taken_for_what_engines_send() -> None:
    """After a rank's first batch, plain stores, removals and clears of both dialects go native."""
    idx, counting = fused_index(4)
    ref = PrefixIndex(4)
    hashes = list(range(1, 9))
    batches = [
        KVEventBatch(1.0, [BlockStored(hashes[:4], None, list(range(16)), 4)], 0),
        KVEventBatch(2.0, [BlockStored(hashes[4:], 4, list(range(16, 32)), 4, medium="CPU")], 0),
        KVEventBatch(
            3.0,
            [
                BlockRemoved([2**64 - 1, 8], medium=None),
                BlockStored([2**63 + 5], 3, list(range(4)), 4, group_idx=1),
            ],
            None,
        ),
        KVEventBatch(4.0, [AllBlocksCleared(), BlockStored([7], None, list(range(4)), 4)], 0),
    ]
    for dialect in ("map", "array"):
        for b in batches:
            payload = encode_batch(b, dialect=dialect)  # type: ignore[arg-type]
            idx.apply_payload("w", 0, payload)
            ref.apply("w", 0, decode_batch(payload))
            assert_same(ref, idx, [list(range(32))])
    assert counting.general == 0  # the rank's first batch goes the general way, before the core
    assert counting.native == 2 * len(batches) - 1
    # TensorRT-LLM's signed hashes: masked as decode_batch masks them.
    signed = msgspec.msgpack.encode(
        [0.0, [{"type": "BlockStored", "block_hashes": [-3], "parent_block_hash": -1,
                "token_ids": [1, 2, 3, 4], "block_size": 4}], 0]
    )  # fmt: skip
    idx.apply_payload("w", 0, signed)
    ref.apply("w", 0, decode_batch(signed))
    assert_same(ref, idx, [])
    assert 2**64 - 3 in idx.blocks("w", 0)


stored_event = st.builds(
    BlockStored,
    block_hashes=st.lists(st.integers(0, 12), max_size=5),
    parent_block_hash=st.one_of(st.none(), st.integers(0, 14)),
    token_ids=st.lists(st.integers(-3, 70_000), max_size=22),
    block_size=st.sampled_from([4, 4, 4, 2, 5000]),
    medium=st.sampled_from(MEDIA),
    group_idx=st.sampled_from([None, None, 0, 1, 2**64 - 1]),
    lora_name=st.sampled_from([None, None, None, "l"]),
)
removed_event = st.builds(
    BlockRemoved,
    block_hashes=st.lists(st.integers(0, 14), max_size=5),
    medium=st.sampled_from(MEDIA),
    group_idx=st.sampled_from([None, 0, 3]),
)
event = st.one_of(stored_event, stored_event, removed_event, st.just(AllBlocksCleared()))


def aligned(ev: Any) -> Any:
    """Mostly whole blocks of tokens, as engines send."""
    if type(ev) is BlockStored and ev.block_size == 4 and random.random() < 0.8:
        toks = (list(ev.token_ids) * 40)[: 4 * len(ev.block_hashes)] or [0] * (
            4 * len(ev.block_hashes)
        )
        return msgspec.structs.replace(ev, token_ids=toks)
    return ev


@settings(max_examples=examples(200), deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    st.lists(st.tuples(st.integers(0, 2), st.lists(event, max_size=6)), min_size=1, max_size=12),
    st.sampled_from(["map", "array"]),
    st.sampled_from([None, 6, 20]),
    st.integers(0, 2**32),
)
def test_fused_apply_of_many_event_batches(
    batches: list[tuple[int, list[Any]]], dialect: Any, cap: int | None, seed: int
) -> None:
    """Batches of several events (stores refused at a rank's cap, clears, ignored groups)."""
    random.seed(seed)
    ref = PrefixIndex(4, max_blocks_per_rank=cap)
    idx, _ = fused_index(4, max_blocks_per_rank=cap)
    for rank, events in batches:
        payload = encode_batch(
            KVEventBatch(0.5, [aligned(e) for e in events], rank), dialect=dialect
        )
        ref.apply("w", rank, decode_batch(payload))
        idx.apply_payload("w", rank, payload)
    assert_same(ref, idx, [list(range(n)) for n in range(0, 24, 4)])


def mutate(payload: bytes, rnd: random.Random) -> bytes:
    b = bytearray(payload)
    for _ in range(rnd.randrange(1, 4)):
        op = rnd.randrange(4)
        i = rnd.randrange(len(b)) if b else 0
        if op == 0 and b:
            b[i] = rnd.randrange(256)
        elif op == 1:
            del b[i:]
        elif op == 2:
            b[i:i] = bytes([rnd.choice([0xC0, 0xDC, 0xDD, 0xCF, 0xD3, 0x91, 0xA4, 0xFF])])
        else:
            b[i : i + 1] = b""
    return bytes(b)


@settings(max_examples=examples(300), deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(st.lists(event, min_size=1, max_size=4), min_size=1, max_size=6),
       st.sampled_from(["map", "array"]), st.integers(0, 2**32))  # fmt: skip
def test_hostile_payloads_are_refused_or_applied_as_decode_batch_does(
    batches: list[list[Any]], dialect: Any, seed: int
) -> None:
    """Damaged payloads: WireError with nothing applied exactly when decode_batch refuses them."""
    limits = DecodeLimits(max_events=3, max_blocks=4, max_block_size=4096, max_tokens=18)
    check_hostile(batches, dialect, seed, 4, limits, [list(range(8))])


def check_hostile(
    batches: list[list[Any]],
    dialect: Any,
    seed: int,
    block_size: int,
    limits: DecodeLimits,
    prompts: list[list[int]] | None = None,
) -> None:
    """Each batch and two damaged copies, into a reference index by decode_batch + apply
    and into a fused one by apply_payload: the same refusals and the same index after each
    (``prompts``: those matched; default, the stored blocks' tokens)."""
    rnd = random.Random(seed)
    ref = PrefixIndex(block_size)
    idx, _ = fused_index(block_size)
    warm = encode_batch(KVEventBatch(0.0, [], 0))
    ref.apply("w", 0, decode_batch(warm))
    idx.apply_payload("w", 0, warm)
    for events in batches:
        payload = encode_batch(KVEventBatch(0.0, events, 0), dialect=dialect)
        for p in (payload, mutate(payload, rnd), mutate(payload, rnd)):
            apply_both(ref, idx, p, limits)
            stored = [list(e.token_ids) for e in events if type(e) is BlockStored]
            assert_same(ref, idx, prompts if prompts is not None else stored)


@given(st.binary(max_size=200))
@settings(max_examples=300, deadline=None)
def test_random_bytes_never_crash_or_change_the_index(data: bytes) -> None:
    idx, _ = fused_index(4)
    idx.apply_payload(
        "w", 0, encode_batch(KVEventBatch(0.0, [BlockStored([1], None, [1, 2, 3, 4], 4)], 0))
    )
    before = idx.stats()
    try:
        batch = decode_batch(data)
    except WireError:
        with pytest.raises(WireError):
            idx.apply_payload("w", 0, data)
        assert idx.stats() == before
    else:
        ref = PrefixIndex(4)
        ref.apply("w", 0, KVEventBatch(0.0, [BlockStored([1], None, [1, 2, 3, 4], 4)], 0))
        ref.apply("w", 0, batch)
        idx.apply_payload("w", 0, data)
        assert_same(ref, idx, [[1, 2, 3, 4]])


def test_payload_forms_and_groups_outside_the_native_path() -> None:
    """Buffers of every kind, and an index whose groups are not plain ints, give the same state."""
    payload = encode_batch(KVEventBatch(0.0, [BlockStored([1, 2], None, list(range(8)), 4)], 0))
    for form in (payload, bytearray(payload), memoryview(payload)):
        idx, counting = fused_index(4)
        idx.apply_payload("w", 0, encode_batch(KVEventBatch(0.0, [], 0)))
        idx.apply_payload("w", 0, form)
        assert idx.match(list(range(8))) == {("w", 0): 2}
        assert counting.native == 1
    odd, counting = fused_index(4, groups=("x", None))
    odd.apply_payload("w", 0, payload)
    odd.apply_payload("w", 0, payload)
    assert counting.native == 0 and odd.match(list(range(8))) == {("w", 0): 2}
    with pytest.raises(WireError):
        odd.apply_payload("w", 0, b"\x93")


def test_counters_and_cap_across_paths_and_limits_objects() -> None:
    """The core's counters and over-cap marks plus the general path's equal decode + apply,
    whichever path each payload took and whichever limits object came with it."""
    ref = PrefixIndex(4, max_blocks_per_rank=3)
    idx, counting = fused_index(4, max_blocks_per_rank=3)
    tight = DecodeLimits(max_blocks=2)
    odd = DecodeLimits(max_events=1 << 70)  # a bound the native path does not read

    def stored(hashes: list[int], parent: int | None = None, **kw: Any) -> BlockStored:
        return BlockStored(hashes, parent, list(range(4 * len(hashes))), 4, **kw)

    steps: list[tuple[list[Any], DecodeLimits]] = [
        ([stored([1])], DEFAULT_LIMITS),  # the rank's first batch: general
        ([stored([2], parent=99), BlockRemoved([77])], DEFAULT_LIMITS),  # orphan, unknown: native
        ([stored([3, 4, 5])], DEFAULT_LIMITS),  # refused at the cap: native
        ([stored([6, 7, 8])], tight),  # refused by the limits: nothing applied
        ([stored([6], group_idx=5), BlockRemoved([78])], odd),  # ignored, unknown: general
        ([stored([9, 10, 11], lora_name="a")], DEFAULT_LIMITS),  # refused at the cap: general
        ([AllBlocksCleared(), stored([12], parent=98)], DEFAULT_LIMITS),  # clear, orphan: native
        ([stored([13, 14, 15], extra_keys=[[1]] * 3)], DEFAULT_LIMITS),  # refused: general
        ([BlockRemoved([79]), stored([1], group_idx=5)], tight),  # unknown, ignored: native
    ]
    for events, limits in steps:
        payload = encode_batch(KVEventBatch(0.0, events, 0))
        apply_both(ref, idx, payload, limits)
        assert_same(ref, idx, [list(range(n)) for n in range(0, 16, 4)])
    st_ = idx.stats()
    assert (st_.orphan_stores, st_.unknown_removals, st_.ignored_events) == (2, 3, 2)
    assert (st_.refused_stores, st_.ranks_over_cap) == (3, 1)
    assert (counting.native, counting.general) == (4, 4)  # (the first batch never reaches the core)


# Token ids of every msgpack width; 16-token blocks (what engines use) of uint16 ids
# only are read without a branch per id, any other block id by id.
token_id = st.one_of(
    st.integers(128, 65_535), st.integers(128, 65_535), st.integers(0, 127), st.integers(128, 255),
    st.integers(65_536, 2**32 - 1), st.integers(2**32, 2**64 - 1), st.integers(-(2**63), -1),
)  # fmt: skip
block_tokens = st.one_of(
    st.lists(st.integers(256, 65_535), min_size=16, max_size=16),
    st.lists(token_id, min_size=16, max_size=16),
)


@st.composite
def chained_batches(draw: Any) -> list[list[Any]]:
    """Batches of stores chained on earlier blocks (of this batch or before), removals, clears."""
    stored: list[int] = []
    batches = []
    for _ in range(draw(st.integers(1, 5))):
        events: list[Any] = []
        for _ in range(draw(st.integers(1, 12))):
            kind = draw(st.sampled_from(["store", "store", "store", "remove", "clear"]))
            if kind == "clear":
                events.append(AllBlocksCleared())
            elif kind == "remove" and stored:
                events.append(BlockRemoved(draw(st.lists(st.sampled_from(stored), max_size=3))))
            else:
                n = draw(st.integers(0, 3))
                hashes = [draw(st.integers(1, 2**64 - 1)) for _ in range(n)]
                parent = draw(st.one_of(st.none(), st.sampled_from(stored or [7]), st.just(3)))
                tokens = [t for _ in range(n) for t in draw(block_tokens)]
                if draw(st.integers(0, 9)) == 0:
                    tokens = tokens[: draw(st.integers(0, len(tokens)))] + draw(
                        st.lists(token_id, max_size=20)
                    )
                events.append(BlockStored(hashes, parent, tokens, 16))
                stored += hashes
        batches.append(events)
    return batches


@settings(max_examples=examples(200), deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(chained_batches(), st.sampled_from(["map", "array"]))
def test_fused_apply_of_16_token_blocks_of_every_id_width(
    batches: list[list[Any]], dialect: Any
) -> None:
    """Block keys from ids of every width, chains within and across batches: as decode + apply."""
    ref = PrefixIndex(16)
    idx, counting = fused_index(16)
    prompts = []
    for events in [[], *batches]:
        payload = encode_batch(KVEventBatch(0.0, events, 0), dialect=dialect)
        ref.apply("w", 0, decode_batch(payload))
        idx.apply_payload("w", 0, payload)
        prompts += [list(e.token_ids) for e in events if type(e) is BlockStored]
    assert counting.native == len(batches)
    assert_same(ref, idx, prompts)


@settings(max_examples=examples(300), deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(chained_batches(), st.sampled_from(["map", "array"]), st.integers(0, 2**32))
def test_hostile_16_token_payloads(batches: list[list[Any]], dialect: Any, seed: int) -> None:
    """Damaged payloads of 16-token blocks: refused or applied exactly as decode_batch does."""
    check_hostile(batches, dialect, seed, 16, DEFAULT_LIMITS)
