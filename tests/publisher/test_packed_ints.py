"""The codec's publisher fast path: natively packed int arrays and batches built from parts."""

from __future__ import annotations

import array
from typing import Any

import msgspec
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvwire.wire import AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch, encode_batch
from kvwire.wire._pack import snapshot
from kvwire.wire.codec import (
    RemovedParts,
    StoredParts,
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
def test_packing_is_msgspecs_bytes_from_lists_and_every_array_type(values: list[int]) -> None:
    want = enc.encode(values)
    assert bytes(pack_int_array(values)) == want
    assert bytes(pack_int_array(tuple(values))) == want
    arr = np.array(values, dtype=np.int64)
    assert bytes(pack_int_array(arr)) == want
    assert bytes(pack_int_array(array.array("q", values))) == want
    assert bytes(pack_int_array(np.repeat(arr, 2)[::2])) == want  # strided
    for dt in (np.int8, np.int16, np.int32, np.uint8, np.uint16, np.uint32):
        info = np.iinfo(dt)
        small = [v for v in values if info.min <= v <= info.max]
        assert bytes(pack_int_array(np.array(small, dtype=dt))) == enc.encode(small)


@settings(max_examples=200, deadline=None)
@given(uint64s)
def test_hashes_convert_to_either_wire_form(values: list[int]) -> None:
    unsigned = np.array(values, dtype=np.uint64)
    signed = unsigned.view(np.int64)
    for src in (values, unsigned, signed, signed.tolist()):
        assert bytes(pack_int_array(src, hashes="unsigned")) == enc.encode(unsigned.tolist())
        assert bytes(pack_int_array(src, hashes="signed")) == enc.encode(signed.tolist())
    assert bytes(pack_int_array(unsigned)) == enc.encode(values)


@pytest.mark.parametrize("n", [0, 1, 15, 16, 65535, 65536])
def test_array_headers_match(n: int) -> None:
    values = [2**40 + i for i in range(n)]
    assert bytes(pack_int_array(np.array(values, dtype=np.uint64))) == enc.encode(values)
    assert bytes(pack_int_array(values)) == enc.encode(values)


@pytest.mark.parametrize(
    ("values", "message"),
    [
        ([1, "2"], "token id '2' is not an int"),
        ([1, 2.0], "token id 2.0 is not an int"),
        ([2**64], "does not fit in 64 bits"),
        ([-(2**63) - 1], "does not fit in 64 bits"),
        (np.array([1.5]), "must be a 1-D integer array; got buffer format 'd'"),
        (np.zeros((2, 2), dtype=np.int64), "must be a 1-D integer array; got 2 dimensions"),
        (np.array([1, 2], dtype=">i4"), "big-endian"),
    ],
)
def test_values_that_are_not_64_bit_ints_are_refused_by_name(values: Any, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        pack_int_array(values, what="token id")


def test_snapshots_are_private_typed_copies() -> None:
    arr = np.arange(10, dtype=np.int32) * 1000
    snap = snapshot(arr[::2], "token ids")
    arr[:] = -1
    assert snap.tolist() == [0, 2000, 4000, 6000, 8000] and snap.format == "i"
    assert bytes(pack_int_array(snap)) == enc.encode(snap.tolist())
    assert snapshot(np.array([2**64 - 1], dtype=np.uint64), "h").tolist() == [2**64 - 1]
    for bad in (np.array([1.0]), np.array([True]), np.zeros((1, 1), dtype=np.int8), [1, 2]):
        with pytest.raises(TypeError, match="must be a 1-D integer array"):
            snapshot(bad, "block hashes")


def test_numpy_scalars_and_other_index_types_pack_as_ints() -> None:
    values = [np.int64(5), np.uint64(2**64 - 1), True, 7]
    assert bytes(pack_int_array(values)) == enc.encode([5, 2**64 - 1, 1, 7])
    with pytest.raises(TypeError, match="list, a tuple or an integer array"):
        pack_int_array({1, 2})


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
