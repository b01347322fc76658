"""EventCollector: coalescing, input types, caps, hash formats, byte identity."""

from __future__ import annotations

import random
import subprocess
import sys
from typing import Any

import msgspec
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvwire.publisher import CollectedBatch, EventCollector, PendingBatch
from kvwire.wire import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEvent,
    KVEventBatch,
    decode_batch,
    encode_batch,
)

U64 = (1 << 64) - 1


class Capture:
    """A publisher stand-in that keeps what it is given."""

    rank = 5

    def __init__(self, accept: bool = True) -> None:
        self.batches: list[Any] = []
        self.accept = accept

    def publish(self, batch: KVEventBatch | PendingBatch) -> bool:
        self.batches.append(batch)
        return self.accept

    def only(self) -> CollectedBatch:
        assert len(self.batches) == 1
        b = self.batches.pop()
        assert isinstance(b, CollectedBatch)
        return b


def raw_events(payload: bytes) -> list[Any]:
    """The events as generic msgpack (no normalisation), to see the wire's int forms."""
    events: list[Any] = msgspec.msgpack.decode(payload)[1]
    return events


# --- coalescing and order ---------------------------------------------------------


def test_chained_stores_and_consecutive_removals_coalesce_in_engine_order() -> None:
    cap = Capture()
    col = EventCollector(cap, 2)
    col.stored([1, 2], None, [10, 11, 12, 13])
    col.stored([3], 2, [14, 15])  # continues the chain: same event
    col.stored([9], 7, [1, 1])  # another parent: new event
    col.removed([4])
    col.removed([5, 6])  # consecutive removals: one event
    col.stored([8], 9, [2, 2])  # after a removal: new event even though it chains
    col.cleared()
    col.removed([7])
    assert col.flush() is True
    batch = cap.only()
    payload = batch.encode("map")
    got = decode_batch(payload)
    expected = KVEventBatch(
        batch.ts,
        [
            BlockStored([1, 2, 3], None, [10, 11, 12, 13, 14, 15], 2, None, "GPU", None),
            BlockStored([9], 7, [1, 1], 2, None, "GPU", None),
            BlockRemoved([4, 5, 6]),
            BlockStored([8], 9, [2, 2], 2, None, "GPU", None),
            AllBlocksCleared(),
            BlockRemoved([7]),
        ],
        5,
    )
    assert got == expected
    assert payload == encode_batch(expected)
    assert batch.encode("array") == encode_batch(expected, dialect="array")
    assert batch.to_batch() == expected


def test_differing_attributes_do_not_coalesce() -> None:
    cap = Capture()
    col = EventCollector(cap, 1)
    col.stored([1], None, [1], lora_name="a")
    col.stored([2], 1, [2], lora_name="b")
    col.stored([3], 2, [3], lora_name="b", medium="CPU")
    col.stored([4], 3, [4], lora_name="b", medium="CPU", group_idx=1)
    col.removed([1], medium="CPU")
    col.removed([2])
    col.flush()
    events = cap.only().to_batch().events
    assert [type(e).__name__ for e in events] == ["BlockStored"] * 4 + ["BlockRemoved"] * 2


def test_extra_keys_follow_their_blocks_through_coalescing() -> None:
    cap = Capture()
    col = EventCollector(cap, 1)
    col.stored([1, 2], None, [1, 2], extra_keys=[["s"], None])
    col.stored([3], 2, [3], extra_keys=[["t"]])
    col.stored([4], 3, [4])  # no extra keys where the event has them: a new event
    col.flush()
    events = cap.only().to_batch().events
    assert isinstance(events[0], BlockStored) and events[0].extra_keys == [["s"], None, ["t"]]
    assert isinstance(events[1], BlockStored) and events[1].block_hashes == [4]
    with pytest.raises(ValueError, match="extra_keys"):
        col.stored([1], None, [1], extra_keys=[1, 2])


def test_empty_iteration_sends_nothing_and_flush_reports_refusal() -> None:
    cap = Capture(accept=False)
    col = EventCollector(cap, 4)
    assert col.flush() is False
    col.stored([], None, [])
    col.removed([])
    assert col.flush() is False and cap.batches == []
    col.removed([1])
    assert col.flush() is False  # the publisher refused it
    assert len(cap.batches) == 1
    assert col.stats().batches == 1


# --- the reference model, any input type -------------------------------------------

INPUTS = ["list", "tuple", "u64", "i64", "torch"]


def as_input(values: list[int], kind: str, signed_ok: bool = True) -> Any:
    if kind == "list":
        return list(values)
    if kind == "tuple":
        return tuple(values)
    if kind == "u64":
        return np.array([v & U64 for v in values], dtype=np.uint64)
    if kind == "i64":
        return np.array([v - (1 << 64) if v >= 1 << 63 else v for v in values], dtype=np.int64)
    torch = pytest.importorskip("torch")
    return torch.tensor([v - (1 << 64) if v >= 1 << 63 else v for v in values], dtype=torch.int64)


@st.composite
def iterations(draw: st.DrawFn) -> tuple[int, list[tuple[Any, ...]]]:
    bs = draw(st.integers(1, 3))
    ops: list[tuple[Any, ...]] = []
    last: int | None = None
    for _ in range(draw(st.integers(1, 8))):
        kind = draw(st.sampled_from(["store", "store", "remove", "clear"]))
        if kind == "store":
            n = draw(st.integers(1, 40))
            hashes = draw(st.lists(st.integers(0, U64), min_size=n, max_size=n))
            parent = (
                last
                if last is not None and draw(st.booleans())
                else draw(st.none() | st.integers(0, U64))
            )
            tokens = draw(st.lists(st.integers(0, 300_000), min_size=n * bs, max_size=n * bs))
            lora = draw(st.sampled_from([None, None, "a"]))
            ops.append(("store", hashes, parent, tokens, lora, draw(st.sampled_from(INPUTS))))
            last = hashes[-1]
        elif kind == "remove":
            hashes = draw(st.lists(st.integers(0, U64), min_size=1, max_size=30))
            ops.append(("remove", hashes, draw(st.sampled_from(INPUTS))))
            last = None
        else:
            ops.append(("clear",))
            last = None
    return bs, ops


def model(ops: list[tuple[Any, ...]], bs: int) -> list[KVEvent]:
    events: list[KVEvent] = []
    for op in ops:
        prev = events[-1] if events else None
        if op[0] == "store":
            _, hashes, parent, tokens, lora, _ = op
            if (
                isinstance(prev, BlockStored)
                and parent is not None
                and prev.lora_name == lora
                and prev.block_hashes[-1] == parent
            ):
                events[-1] = BlockStored(
                    prev.block_hashes + hashes, prev.parent_block_hash,
                    prev.token_ids + tokens, bs, None, "GPU", lora,
                )  # fmt: skip
            else:
                events.append(BlockStored(hashes, parent, tokens, bs, None, "GPU", lora))
        elif op[0] == "remove":
            if isinstance(prev, BlockRemoved):
                events[-1] = BlockRemoved(prev.block_hashes + op[1])
            else:
                events.append(BlockRemoved(op[1]))
        else:
            events.append(AllBlocksCleared())
    return events


def feed(col: EventCollector, ops: list[tuple[Any, ...]]) -> None:
    for op in ops:
        if op[0] == "store":
            _, hashes, parent, tokens, lora, kind = op
            col.stored(as_input(hashes, kind), parent, as_input(tokens, kind), lora_name=lora)
        elif op[0] == "remove":
            col.removed(as_input(op[1], op[2]))
        else:
            col.cleared()


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(iterations(), st.sampled_from(["unsigned", "signed"]))
def test_any_inputs_match_the_model_and_encode_batch(
    case: tuple[int, list[tuple[Any, ...]]], hash_format: Any
) -> None:
    bs, ops = case
    cap = Capture()
    col = EventCollector(cap, bs, hash_format=hash_format)
    feed(col, ops)
    col.flush()
    batch = cap.only()
    expected = KVEventBatch(batch.ts, model(ops, bs), 5)
    payload = batch.encode("map")
    assert decode_batch(payload) == expected
    if hash_format == "unsigned":
        assert payload == encode_batch(expected)  # vLLM's bytes, whatever the input type
    for e in raw_events(payload):
        hashes = e.get("block_hashes", [])
        if hash_format == "signed":
            assert all(-(1 << 63) <= h < 1 << 63 for h in hashes)
        else:
            assert all(h >= 0 for h in hashes)


def test_numpy_arrays_of_any_width_order_and_stride_are_byte_identical_to_lists() -> None:
    rng = np.random.default_rng(1)
    hashes = rng.integers(0, 2**63, 600, dtype=np.int64).astype(np.uint64) + np.uint64(2**63)
    tokens = rng.integers(0, 150_000, 600 * 16, dtype=np.int64)
    outs = []
    for h, t in (
        (hashes.tolist(), tokens.tolist()),
        (hashes, tokens),
        (hashes, tokens.astype(np.int32)),
        (hashes.astype(">u8"), tokens.astype(">i4")),
        (np.repeat(hashes, 2)[::2], np.repeat(tokens, 3)[1::3]),
    ):
        cap = Capture()
        col = EventCollector(cap, 16)
        col.stored(h, None, t)
        col.removed(hashes[:600])
        col.flush()
        b = cap.only()
        b.ts = 1.0
        outs.append(b.encode("map"))
    assert all(out == outs[0] for out in outs)


# --- hash formats ------------------------------------------------------------------


def test_signed_format_sends_int64_and_decodes_unsigned() -> None:
    cap = Capture()
    col = EventCollector(cap, 1, hash_format="signed")
    col.stored([2**64 - 1, 5], 2**63, [1, 2])
    col.removed(np.array([2**63 + 1], dtype=np.uint64))
    col.flush()
    payload = cap.only().encode("map")
    raw = raw_events(payload)
    assert raw[0]["block_hashes"] == [-1, 5] and raw[0]["parent_block_hash"] == -(2**63)
    assert raw[1]["block_hashes"] == [-(2**63) + 1]
    events = decode_batch(payload).events
    assert isinstance(events[0], BlockStored)
    assert events[0].block_hashes == [2**64 - 1, 5] and events[0].parent_block_hash == 2**63


def test_unsigned_format_masks_signed_input() -> None:
    cap = Capture()
    col = EventCollector(cap, 1)
    col.stored([-1, 3], -2, [1, 2])
    col.flush()
    raw = raw_events(cap.only().encode("map"))
    assert raw[0]["block_hashes"] == [2**64 - 1, 3] and raw[0]["parent_block_hash"] == 2**64 - 2


def test_signed_parent_chain_still_coalesces() -> None:
    cap = Capture()
    col = EventCollector(cap, 1, hash_format="signed")
    col.stored([2**63 + 1], None, [1])
    col.stored([7], -(2**63) + 1, [2])  # the same hash, given signed
    col.flush()
    events = cap.only().to_batch().events
    assert len(events) == 1 and isinstance(events[0], BlockStored)
    assert events[0].block_hashes == [2**63 + 1, 7]


# --- validation ------------------------------------------------------------------------


def test_partial_blocks_and_bad_inputs_are_clear_errors() -> None:
    col = EventCollector(Capture(), 4)
    with pytest.raises(ValueError, match="only full blocks"):
        col.stored([1, 2], None, [1, 2, 3, 4, 5])
    with pytest.raises(TypeError, match="1-D integer"):
        col.stored(np.zeros((1, 1), dtype=np.int64), None, np.zeros(4, dtype=np.int64))
    with pytest.raises(TypeError, match="1-D integer"):
        col.removed(np.array([1.5]))
    with pytest.raises(TypeError, match="list, tuple"):
        col.removed({1, 2})
    with pytest.raises(ValueError, match="block_size"):
        EventCollector(Capture(), 0)
    with pytest.raises(ValueError, match="hash_format"):
        EventCollector(Capture(), 4, hash_format="hex")  # type: ignore[arg-type]


def test_values_that_are_not_64_bit_ints_fail_the_encode() -> None:
    for bad in ([2**64], ["x"]):
        cap = Capture()
        col = EventCollector(cap, 1)
        col.stored(bad, None, [1])
        col.flush()
        with pytest.raises(ValueError):
            cap.only().encode("map")


def test_numpy_scalars_in_lists_are_converted() -> None:
    cap = Capture()
    col = EventCollector(cap, 2)
    col.stored([np.uint64(2**63 + 3)], None, [np.int32(4), 5])
    col.flush()
    events = cap.only().to_batch().events
    assert events == [BlockStored([2**63 + 3], None, [4, 5], 2, None, "GPU", None)]


def test_lists_changed_before_encoding_are_detected() -> None:
    cap = Capture()
    col = EventCollector(cap, 2)
    tokens = [np.int32(1), 2]  # not all exact ints: kept by reference
    col.stored([7], None, tokens)
    col.flush()
    tokens.append(3)  # the engine kept writing to the list it passed
    with pytest.raises(ValueError, match="changed"):
        cap.only().encode("map")


def test_lists_of_ints_are_read_during_the_call() -> None:
    cap = Capture()
    col = EventCollector(cap, 2)
    hashes, tokens, gone = [2**64 - 1, -5], [1, 2, 3, 2**32 - 1], [9, 2**63]
    refs = [sys.getrefcount(x) for x in (hashes, tokens, gone)]
    col.stored(hashes, -7, tokens)
    col.removed(gone)
    # The collector holds no reference to the lists: the engine frees them itself.
    assert [sys.getrefcount(x) for x in (hashes, tokens, gone)] == refs
    hashes[0] = 1
    tokens.append(4)
    gone.clear()
    col.flush()
    assert cap.only().to_batch().events == [
        BlockStored([2**64 - 1, 2**64 - 5], 2**64 - 7, [1, 2, 3, 2**32 - 1], 2, None, "GPU", None),
        BlockRemoved([9, 2**63], "GPU", None),
    ]


# Ints the hooks read inline (zero, one to three 30-bit digits, up to 2**64 - 1), ones they
# leave to the general reader (negative) and ones no list is copied with, each placed first,
# in the middle and last of lists shorter than, as long as and longer than the distance the
# reads prefetch ahead (64 items).
LENGTHS = [1, 2, 63, 64, 65, 128, 129, 300]
HASH_EDGES = [0, 1, 2**30 - 1, 2**30, 2**60 - 1, 2**60, 2**63 - 1, 2**63, U64, -1, -(2**30),
              -(2**60), -(2**63)]  # fmt: skip
TOKEN_EDGES = [0, 1, 2**30 - 1, 2**30, 2**31, 2**32 - 1]


class Index(int):
    """An int subclass: valid, but never read inline."""


@pytest.mark.parametrize("n", LENGTHS)
def test_every_int_form_is_read_exactly_anywhere_in_a_list(n: int) -> None:
    cap = Capture()
    col = EventCollector(cap, 1)
    rng = random.Random(n)
    for at in sorted({0, n // 2, n - 1}):
        for k, h in enumerate(HASH_EDGES):
            hashes = [rng.getrandbits(64) for _ in range(n)]
            tokens = [rng.randrange(200_000) for _ in range(n)]
            gone = [rng.getrandbits(64) - (1 << 63) for _ in range(n)]
            hashes[at] = gone[at] = h
            tokens[at] = TOKEN_EDGES[k % len(TOKEN_EDGES)]
            refs = [sys.getrefcount(x) for x in (hashes, tokens, gone)]
            col.stored(hashes, None, tokens)
            col.removed(gone)
            assert [sys.getrefcount(x) for x in (hashes, tokens, gone)] == refs  # copied
            col.flush()
            assert cap.only().to_batch().events == [
                BlockStored([x & U64 for x in hashes], None, tokens, 1, None, "GPU", None),
                BlockRemoved([x & U64 for x in gone], "GPU", None),
            ]


@pytest.mark.parametrize("n", LENGTHS)
def test_one_int_out_of_range_anywhere_keeps_the_list_by_reference(n: int) -> None:
    cap = Capture()
    col = EventCollector(cap, 1)
    for at in sorted({0, n // 2, n - 1}):
        for bad_hash, bad_token in [(1 << 64, -1), (-(1 << 63) - 1, 1 << 32), (True, True),
                                    (Index(5), Index(5)), (1 << 90, 1 << 64)]:  # fmt: skip
            hashes, tokens = list(range(n)), list(range(n))
            hashes[at], tokens[at] = bad_hash, bad_token
            refs = [sys.getrefcount(x) for x in (hashes, tokens)]
            col.stored(hashes, None, list(range(n)))
            col.stored(list(range(n)), None, tokens)
            assert [sys.getrefcount(x) for x in (hashes, tokens)] == [r + 1 for r in refs]
            col.flush()
            records = cap.only().records
            assert records[0].block_hashes is hashes and records[1].token_ids is tokens
            assert records[0].token_ids == records[1].block_hashes == list(range(n))  # copied


def test_token_ids_outside_32_bits_are_kept_by_reference() -> None:
    cap = Capture()
    col = EventCollector(cap, 2)
    tokens = [-1, 2**32]
    before = sys.getrefcount(tokens)
    col.stored([5], None, tokens)
    assert sys.getrefcount(tokens) == before + 1
    col.flush()
    assert cap.only().to_batch().events == [
        BlockStored([5], None, [-1, 2**32], 2, None, "GPU", None)
    ]


def test_arrays_are_copied_at_the_call() -> None:
    cap = Capture()
    col = EventCollector(cap, 2)
    hashes = np.array([11], dtype=np.uint64)
    tokens = np.array([1, 2], dtype=np.int64)
    col.stored(hashes, None, tokens)
    hashes[0] = 99
    tokens[:] = 0
    col.flush()
    assert cap.only().to_batch().events == [BlockStored([11], None, [1, 2], 2, None, "GPU", None)]


# --- the per-iteration cap -------------------------------------------------------------


def test_store_cap_keeps_leading_blocks_and_never_drops_removals() -> None:
    cap = Capture()
    col = EventCollector(cap, 1, max_stored_blocks_per_iteration=4)
    col.stored([1, 2, 3], None, [1, 2, 3])
    col.removed([50])
    col.stored(np.array([4, 5, 6], dtype=np.uint64), 3, np.array([4, 5, 6]))  # 1 of 3 fits
    col.stored([7], 6, [7])  # nothing fits
    col.removed(list(range(100, 130)))
    col.cleared()
    col.flush()
    events = cap.only().to_batch().events
    assert events == [
        BlockStored([1, 2, 3], None, [1, 2, 3], 1, None, "GPU", None),
        BlockRemoved([50]),
        BlockStored([4], 3, [4], 1, None, "GPU", None),
        BlockRemoved(list(range(100, 130))),
        AllBlocksCleared(),
    ]
    stats = col.stats()
    assert (stats.dropped_stored_blocks, stats.dropped_store_calls) == (3, 2)
    col.stored([8, 9], None, [8, 9])  # a new iteration: the cap starts over
    col.flush()
    assert cap.only().to_batch().events == [BlockStored([8, 9], None, [8, 9], 1, None, "GPU", None)]


# --- torch -----------------------------------------------------------------------------


def test_torch_cpu_tensors() -> None:
    torch = pytest.importorskip("torch")
    cap = Capture()
    col = EventCollector(cap, 2)
    hashes = torch.tensor([3, -1], dtype=torch.int64)
    tokens = torch.arange(4, dtype=torch.int32)
    col.stored(hashes, None, tokens)
    hashes[0] = 0  # copied at the call
    col.removed(torch.tensor([9]))
    col.flush()
    assert cap.only().to_batch().events == [
        BlockStored([3, 2**64 - 1], None, [0, 1, 2, 3], 2, None, "GPU", None),
        BlockRemoved([9]),
    ]
    with pytest.raises(TypeError, match="integer tensor"):
        col.removed(torch.tensor([1.0]))


@pytest.mark.gpu
def test_cuda_tensors_are_copied_without_synchronising() -> None:
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device: the CUDA input path needs one")
    cap = Capture()
    col = EventCollector(cap, 16)
    hashes = torch.arange(2**40, 2**40 + 600, dtype=torch.int64, device="cuda")
    tokens = torch.randint(0, 150_000, (600 * 16,), dtype=torch.int64, device="cuda")
    expected_tokens = tokens.cpu().tolist()
    col.stored(hashes, None, tokens)
    col.removed(hashes[:5])
    hashes.zero_()  # later GPU work on the same memory must not leak into the batch
    col.flush()
    events = cap.only().to_batch().events
    assert events == [
        BlockStored(list(range(2**40, 2**40 + 600)), None, expected_tokens, 16, None, "GPU", None),
        BlockRemoved(list(range(2**40, 2**40 + 5))),
    ]


def test_publisher_package_imports_without_torch() -> None:
    code = (
        "import sys; sys.modules['torch'] = None\n"
        "import kvwire.publisher as p\n"
        "import kvwire.reference as ref\n"
        "import numpy as np\n"
        "class C:\n"
        "    rank = 0\n"
        "    def publish(self, b): self.b = b; return True\n"
        "c = C(); col = p.EventCollector(c, 1); col.stored(np.array([1]), None, [2]); col.flush()\n"
        "assert c.b.to_batch().events[0].block_hashes == [1]\n"
        "try:\n"
        "    ref.PagedKVCache(4, 1)\n"
        "except ImportError as e:\n"
        "    assert 'engine' in str(e)\n"
        "else:\n"
        "    raise SystemExit('PagedKVCache worked without torch')\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stderr


# --- the native hooks' arguments ----------------------------------------------------------


def test_hooks_take_keywords_and_refuse_bad_arguments_as_python_would() -> None:
    cap = Capture()
    col = EventCollector(cap, 1)
    col.stored(token_ids=[5], parent_hash=None, block_hashes=[1], medium="CPU", group_idx=2)
    col.removed(block_hashes=(2,), medium=None)
    col.flush()
    assert cap.only().to_batch().events == [
        BlockStored([1], None, [5], 1, None, "CPU", None, group_idx=2),
        BlockRemoved([2], None),
    ]
    with pytest.raises(TypeError, match="missing required argument 'token_ids'"):
        col.stored([1], None)  # type: ignore[call-arg]
    with pytest.raises(TypeError, match="unexpected keyword argument 'colour'"):
        col.removed([1], colour="red")  # type: ignore[call-arg]
    with pytest.raises(TypeError, match="multiple values for argument 'parent_hash'"):
        col.stored([1], None, [1], parent_hash=3)  # type: ignore[misc]
    with pytest.raises(TypeError, match="takes 1 positional arguments but 2"):
        col.removed([1], "GPU")  # type: ignore[misc]
    with pytest.raises(TypeError, match="has no len"):
        col.stored(5, None, [])
    assert col.flush() is False  # nothing was recorded by the failed calls
    with pytest.raises(AttributeError):
        col.block_size = 2  # type: ignore[misc]
    assert (col.block_size, col.hash_format, col.max_stored_blocks_per_iteration) == (
        1, "unsigned", None,
    )  # fmt: skip
    assert col.publisher is cap


def test_a_failed_capture_keeps_the_cap_count_as_python_did() -> None:
    cap = Capture()
    col = EventCollector(cap, 1, max_stored_blocks_per_iteration=2)
    with pytest.raises(TypeError, match="list, tuple"):
        col.stored({1}, None, [1])
    col.stored([2, 3], None, [2, 3])  # the failed call counted its block: one of two fits
    col.flush()
    assert cap.only().to_batch().events == [BlockStored([2], None, [2], 1, None, "GPU", None)]
    assert col.stats().dropped_stored_blocks == 1


def test_the_publisher_package_has_no_import_circle() -> None:
    """Every import between kvwire.publisher's modules (at any depth in a module) goes one
    way: the collector uses the publisher, the batch type is its own module."""
    import ast
    from pathlib import Path

    import kvwire.publisher

    here = Path(kvwire.publisher.__file__).parent
    names = {p.stem for p in here.glob("*.py") if p.stem != "__init__"}
    graph: dict[str, set[str]] = {}
    for name in names:
        deps: set[str] = set()
        for node in ast.walk(ast.parse((here / f"{name}.py").read_text())):
            if isinstance(node, ast.ImportFrom):
                mod = node.module or ""
                if node.level == 1:
                    mod = f"kvwire.publisher.{mod}" if mod else "kvwire.publisher"
                if mod.startswith("kvwire.publisher."):
                    deps.add(mod.split(".")[2])
                elif mod == "kvwire.publisher":
                    deps |= {a.name for a in node.names if a.name in names}
        graph[name] = deps & names

    def reaches(start: str, goal: str, seen: set[str]) -> bool:
        return any(d == goal or (d not in seen and reaches(d, goal, seen | {d}))
                   for d in graph[start])  # fmt: skip

    assert "publisher" in graph["collector"]
    assert [n for n in sorted(names) if reaches(n, n, set())] == []
