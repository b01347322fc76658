"""Round trips in both dialects and the errors bad payloads raise."""

from __future__ import annotations

from typing import Any

import msgspec
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvwire.wire import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEventBatch,
    WireError,
    decode_batch,
    encode_batch,
    normalise_hash,
)

U64 = st.integers(min_value=0, max_value=2**64 - 1)
TOKENS = st.integers(min_value=0, max_value=2**31 - 1)
MEDIUM = st.sampled_from(["GPU", "CPU", "STORAGE", None])


@st.composite
def stored(draw: st.DrawFn) -> BlockStored:
    n = draw(st.integers(min_value=1, max_value=6))
    size = draw(st.integers(min_value=1, max_value=8))
    return BlockStored(
        block_hashes=draw(st.lists(U64, min_size=n, max_size=n)),
        parent_block_hash=draw(st.none() | U64),
        token_ids=draw(st.lists(TOKENS, min_size=n * size, max_size=n * size)),
        block_size=size,
        lora_id=draw(st.none() | st.integers(0, 1000)),
        medium=draw(MEDIUM),
        lora_name=draw(st.none() | st.text(max_size=8)),
        extra_keys=draw(st.none() | st.lists(st.none() | st.text(max_size=4), min_size=n, max_size=n)),
        group_idx=draw(st.none() | st.integers(0, 3)),
    )


removed = st.builds(BlockRemoved, block_hashes=st.lists(U64, max_size=8), medium=MEDIUM)
events = st.lists(st.one_of(stored(), removed, st.just(AllBlocksCleared())), max_size=6)
batches = st.builds(
    KVEventBatch,
    ts=st.floats(allow_nan=False, allow_infinity=False),
    events=events,
    data_parallel_rank=st.none() | st.integers(0, 1024),
)


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(batches, st.sampled_from(["map", "array"]))
def test_round_trip(batch: KVEventBatch, dialect: Any) -> None:
    assert decode_batch(encode_batch(batch, dialect=dialect)) == batch


@settings(max_examples=100, deadline=None)
@given(st.lists(st.integers(min_value=-(2**63), max_value=2**63 - 1), min_size=1, max_size=8))
def test_signed_hashes_normalise_to_unsigned(hashes: list[int]) -> None:
    raw = msgspec.msgpack.encode(
        [1.0, [{"type": "BlockRemoved", "block_hashes": hashes, "medium": "GPU"}], 0]
    )
    (event,) = decode_batch(raw).events
    assert isinstance(event, BlockRemoved)
    assert event.block_hashes == [h & (2**64 - 1) for h in hashes]


@settings(max_examples=100, deadline=None)
@given(st.lists(st.binary(min_size=1, max_size=32), min_size=1, max_size=4), st.binary(min_size=8, max_size=32))
def test_bytes_hashes_take_last_eight_bytes(hashes: list[bytes], parent: bytes) -> None:
    raw = msgspec.msgpack.encode(
        [
            1.0,
            [
                {
                    "type": "BlockStored",
                    "block_hashes": hashes,
                    "parent_block_hash": parent,
                    "token_ids": [1] * len(hashes),
                    "block_size": 1,
                }
            ],
        ]
    )
    (event,) = decode_batch(raw).events
    assert isinstance(event, BlockStored)
    assert event.block_hashes == [int.from_bytes(h[-8:], "big") for h in hashes]
    assert event.parent_block_hash == int.from_bytes(parent[-8:], "big")


def test_unknown_fields_and_trailing_envelope_elements_are_ignored() -> None:
    raw = msgspec.msgpack.encode(
        [
            2.5,
            [{"type": "BlockRemoved", "block_hashes": [7], "medium": "CPU", "brand_new": {"x": 1}}],
            3,
            "future",
            [1, 2],
        ]
    )
    assert decode_batch(raw) == KVEventBatch(2.5, [BlockRemoved([7], medium="CPU")], 3)


def test_old_sglang_metadata_map_in_positional_event() -> None:
    raw = msgspec.msgpack.encode(
        [1.0, [["BlockStored", [5], None, [1, 2], 2, None, "GPU", {"cache_salt": "s1"}]]]
    )
    (event,) = decode_batch(raw).events
    assert isinstance(event, BlockStored)
    assert event.cache_salt == "s1"
    assert event.lora_name is None


BAD_PAYLOADS = {
    "not msgpack": (b"\xc1", "not valid msgpack"),
    "envelope not array": (msgspec.msgpack.encode("batch"), "envelope must be an array"),
    "envelope map without events": (msgspec.msgpack.encode({"ts": 1}), "envelope map lacks events"),
    "envelope too short": (msgspec.msgpack.encode([1.0]), "envelope must be an array"),
    "ts not number": (msgspec.msgpack.encode(["x", []]), "timestamp"),
    "events not array": (msgspec.msgpack.encode([1.0, {}]), "events must be an array"),
    "rank not int": (msgspec.msgpack.encode([1.0, [], "r"]), "rank"),
    "unknown event": (msgspec.msgpack.encode([1.0, [{"type": "Nope"}]]), "unknown type 'Nope'"),
    "untagged event": (msgspec.msgpack.encode([1.0, [42]]), "neither a map nor a tagged array"),
    "hash not int": (
        msgspec.msgpack.encode([1.0, [{"type": "BlockRemoved", "block_hashes": ["h"]}]]),
        "block hash must be an int or bytes",
    ),
    "hashes not list": (
        msgspec.msgpack.encode([1.0, [{"type": "BlockRemoved", "block_hashes": 5}]]),
        "block_hashes must be an array",
    ),
    "missing tokens": (
        msgspec.msgpack.encode(
            [1.0, [{"type": "BlockStored", "block_hashes": [1], "parent_block_hash": None, "block_size": 1}]]
        ),
        "token_ids",
    ),
    "empty bytes hash": (
        msgspec.msgpack.encode([1.0, [{"type": "BlockRemoved", "block_hashes": [b""]}]]),
        "empty byte string",
    ),
    "truncated": (encode_batch(KVEventBatch(1.0, [BlockRemoved([1, 2, 3])], 0))[:-3], "msgpack"),
}


@pytest.mark.parametrize("name", sorted(BAD_PAYLOADS))
def test_bad_payloads_raise_wire_error_naming_the_problem(name: str) -> None:
    payload, fragment = BAD_PAYLOADS[name]
    with pytest.raises(WireError, match=fragment):
        decode_batch(payload)


def test_second_bad_event_fails_the_whole_batch() -> None:
    raw = msgspec.msgpack.encode(
        [1.0, [{"type": "BlockRemoved", "block_hashes": [1]}, {"type": "BlockRemoved", "block_hashes": [None]}]]
    )
    with pytest.raises(WireError, match="event 1"):
        decode_batch(raw)


def test_normalise_hash_rejects_out_of_range() -> None:
    with pytest.raises(WireError, match="64 bits"):
        normalise_hash(2**64)
    assert normalise_hash(-1) == 2**64 - 1


def test_unknown_dialect_is_rejected() -> None:
    with pytest.raises(ValueError, match="unknown dialect"):
        encode_batch(KVEventBatch(0.0, []), dialect="json")  # type: ignore[arg-type]


def test_event_fields_are_declared_once() -> None:
    """The map mirrors and the positional dialect follow the public structs' declaration."""
    from kvwire.wire import codec

    assert codec.StoredParts.__struct_fields__ == BlockStored.__struct_fields__
    assert codec.RemovedParts.__struct_fields__ == BlockRemoved.__struct_fields__
    # The generic path reads a positional event by its struct's own field order.
    assert codec._EVENT_TYPES["BlockStored"] is BlockStored
    # The older positional layout is a prefix of the same fields.
    e = BlockStored([1, 2], 7, [5] * 8, 4, None, "CPU", "lora", [["k"], None], 3, "full", 64)
    raw = msgspec.msgpack.decode(encode_batch(KVEventBatch(0.0, [e], 0), dialect="array"))
    assert raw[1][0] == ["BlockStored", *msgspec.structs.astuple(e)[:11]]
