"""The one native reader (kvwire/_native/scan.h) against the Python definitions it reads by."""

from __future__ import annotations

import msgspec
from hypothesis import given, settings
from hypothesis import strategies as st

from kvwire.prefix_index import PrefixIndex
from kvwire.publisher._mirror import Core
from kvwire.wire import (
    DEFAULT_LIMITS,
    BlockRemoved,
    BlockStored,
    KVEventBatch,
    WireError,
    _scan,
    decode_batch,
    encode_batch,
)
from tests.budget import examples


def test_its_field_table_is_the_event_structs_fields() -> None:
    stored, removed = _scan.fields()
    assert stored == BlockStored.__struct_fields__
    assert removed == BlockRemoved.__struct_fields__


def store(block_size: int, n_tokens: int) -> bytes:
    return encode_batch(KVEventBatch(0.0, [BlockStored([1], None, [1] * n_tokens, block_size)], 0))


def test_every_native_reader_bounds_by_decode_limits() -> None:
    """The mirror (DEFAULT_LIMITS, read at import) and the index take what decode_batch takes, no more."""
    top = DEFAULT_LIMITS.max_block_size
    assert PrefixIndex(16).max_block_size == top
    inside, outside = store(top, top), store(top + 1, top + 1)
    decode_batch(inside)
    assert Core().apply_payload(inside) is True
    assert _scan.check(inside, DEFAULT_LIMITS) == (1, 0, False)
    assert Core().apply_payload(outside) is False
    assert _scan.check(outside, DEFAULT_LIMITS) is None
    many = msgspec.msgpack.encode([0.0, [["AllBlocksCleared"]] * (DEFAULT_LIMITS.max_events + 1), 0])
    assert _scan.check(many, DEFAULT_LIMITS) is None
    assert _scan.check(many, DEFAULT_LIMITS.__class__(max_events=DEFAULT_LIMITS.max_events + 1)) is not None


def test_the_view_is_what_decode_batch_reads() -> None:
    batch = KVEventBatch(
        1.0,
        [BlockStored([2**64 - 1, 5], 7, [1, 2, 3, 4], 2, medium="CPU", lora_name="a", group_idx=-1),
         BlockRemoved([9], medium=None)],
        4,
    )  # fmt: skip
    view = _scan.view(encode_batch(batch), DEFAULT_LIMITS)
    assert view is not None
    (k1, h1, p1, t1, bs1, m1, l1, g1, x1), (k2, h2, _, t2, _, m2, _, g2, x2) = view
    # extras: 16, a lora name given
    assert (k1, h1, p1, bs1, m1, l1, g1, x1) == ("BlockStored", [2**64 - 1, 5], 7, 2, "CPU", "a", -1, 16)
    assert t1 is not None and msgspec.msgpack.decode(t1) == [1, 2, 3, 4]
    assert (k2, h2, t2, m2, g2, x2) == ("BlockRemoved", [9], None, None, None, 0)


@settings(max_examples=examples(200), deadline=None)
@given(
    st.lists(st.integers(256, 65535), max_size=80),
    st.integers(0, 80),
    st.sampled_from([None, True, 1.5, 7, 2**40, "x"]),
)
def test_uint16_token_runs_are_checked_to_the_last_id(tokens: list[int], at: int, planted: object) -> None:
    """The check skips sixteen uint16 ids at once: a non-int anywhere among them is still seen."""
    ids: list[object] = list(tokens)
    if ids:
        ids[at % len(ids)] = planted
    event = {"type": "BlockStored", "block_hashes": [1], "parent_block_hash": None, "token_ids": ids}
    payload = msgspec.msgpack.encode([0.0, [{**event, "block_size": 1}], 0])
    accepted = all(type(t) is int for t in ids)
    assert (_scan.check(payload, DEFAULT_LIMITS) is not None) == accepted
    try:
        decode_batch(payload)
    except WireError:
        assert not accepted
    else:
        assert accepted
    assert _scan.check(payload[:-3], DEFAULT_LIMITS) is None
