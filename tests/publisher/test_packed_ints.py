"""The codec's publisher fast path: packed int arrays and batches built from parts."""

from __future__ import annotations

from typing import Any

import msgspec
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvwire.wire import AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch, encode_batch
from kvwire.wire.codec import (
    RemovedParts,
    StoredParts,
    concat_int_arrays,
    encode_parts,
    pack_int_array,
)

enc = msgspec.msgpack.Encoder()
dec = msgspec.msgpack.Decoder()

# Values clustered around every msgpack width boundary.
EDGES = [0, 127, 128, 255, 256, 65535, 65536, 2**32 - 1, 2**32, 2**63 - 1]
NEG_EDGES = [-1, -32, -33, -128, -129, -32768, -32769, -(2**31), -(2**31) - 1, -(2**63)]
near = st.sampled_from(EDGES + NEG_EDGES).flatmap(
    lambda e: st.integers(max(-(2**63), e - 2), min(2**63 - 1, e + 2))
)
int64s = st.lists(near | st.integers(-(2**63), 2**63 - 1), max_size=40)
uint64s = st.lists(st.sampled_from([*EDGES, 2**64 - 1]) | st.integers(0, 2**64 - 1), max_size=40)


@settings(max_examples=300, deadline=None)
@given(int64s)
def test_minimal_packing_is_msgspecs_bytes_or_declined(values: list[int]) -> None:
    arr = np.array(values, dtype=np.int64)
    packed = pack_int_array(arr)
    if packed is not None:
        assert bytes(packed) == enc.encode(values)
    fixed = pack_int_array(arr, minimal=False)
    assert fixed is not None
    assert dec.decode(bytes(fixed)) == values


@settings(max_examples=200, deadline=None)
@given(uint64s)
def test_unsigned_arrays(values: list[int]) -> None:
    arr = np.array(values, dtype=np.uint64)
    packed = pack_int_array(arr)
    if packed is not None:
        assert bytes(packed) == enc.encode(values)
    fixed = pack_int_array(arr, minimal=False)
    assert fixed is not None and dec.decode(bytes(fixed)) == values


@pytest.mark.parametrize(
    "values",
    [
        [0, 5, 127],
        [128, 200, 255],
        [256, 1000, 65535],
        [65536, 2**31, 2**32 - 1],
        [2**32, 2**60],
        [-1, -20, -32],
        [-33, -100, -128],
        [-129, -30000],
        [-(2**31), -40000],
        [-(2**62), -(2**31) - 1],
        [2**40, -(2**40), 2**33, -(2**63)],  # signed 64-bit hashes, both signs
        list(range(40)),
        list(range(70000, 70000 + 20)),
    ],
)
def test_one_width_arrays_take_the_fast_path(values: list[int]) -> None:
    packed = pack_int_array(np.array(values, dtype=np.int64))
    assert packed is not None
    assert bytes(packed) == enc.encode(values)


def test_mixed_widths_decline_in_minimal_mode_and_pack_in_fixed_mode() -> None:
    values = [5, 300, 70000]
    assert pack_int_array(np.array(values)) is None
    fixed = pack_int_array(np.array(values), minimal=False)
    assert fixed is not None
    assert bytes(fixed)[1] == 0xCE  # one uint32 width for all three
    assert dec.decode(bytes(fixed)) == values
    assert bytes(pack_int_array(np.array([], dtype=np.int64)) or b"") == b"\x90"


@pytest.mark.parametrize("n", [0, 1, 15, 16, 65535, 65536])
def test_array_headers_match(n: int) -> None:
    values = [2**40 + i for i in range(n)]
    packed = pack_int_array(np.array(values, dtype=np.uint64))
    assert packed is not None and bytes(packed) == enc.encode(values)


@settings(max_examples=100, deadline=None)
@given(st.lists(st.lists(st.integers(0, 2**64 - 1), max_size=6), min_size=1, max_size=5), st.data())
def test_concat_mixes_lists_and_packed(parts: list[list[int]], data: st.DataObject) -> None:
    pieces: list[Any] = []
    for p in parts:
        as_raw = data.draw(st.booleans())
        pieces.append(msgspec.Raw(enc.encode(p)) if as_raw else p)
    joined = concat_int_arrays(pieces)
    flat = [v for p in parts for v in p]
    assert enc.encode(joined) == enc.encode(flat)


def test_encode_parts_equals_encode_batch_in_both_dialects() -> None:
    hashes = [2**63 + 5, 2**33, 2**40]
    tokens = list(range(12))
    batch = KVEventBatch(
        12.5,
        [
            BlockStored(hashes, 99, tokens, 4, None, "GPU", "lora-a", None, None),
            BlockRemoved([1, 2], "CPU", 3),
            AllBlocksCleared(),
            BlockStored([5], None, [1, 2, 3, 4], 4, None, "GPU", None, [["x"]], 1),
        ],
        2,
    )
    for packed in (False, True):
        h: Any = pack_int_array(np.array(hashes, dtype=np.uint64)) if packed else hashes
        t: Any = msgspec.Raw(enc.encode(tokens)) if packed else tokens
        parts = [
            StoredParts(h, 99, t, 4, None, "GPU", "lora-a"),
            RemovedParts([1, 2], "CPU", 3),
            AllBlocksCleared(),
            StoredParts([5], None, [1, 2, 3, 4], 4, None, "GPU", None, [["x"]], 1),
        ]
        for dialect in ("map", "array"):
            assert encode_parts(12.5, parts, 2, dialect=dialect) == encode_batch(
                batch, dialect=dialect
            )
    with pytest.raises(ValueError, match="dialect"):
        encode_parts(0.0, [], None, dialect="xml")  # type: ignore[arg-type]
