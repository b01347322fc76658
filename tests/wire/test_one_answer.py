"""decode_batch gives one answer for any payload, whichever of its paths reads it.

The typed path (structs built from the native reader's view, msgspec for
rarer fields) runs only for payloads the native reader
(``kvwire/_native/scan.h``) vouches for; everything else is read by the
general path. These are the payloads on which the two once disagreed.
"""

from __future__ import annotations

from typing import Any

import msgspec
import pytest

from kvwire.prefix_index import PrefixIndex
from kvwire.publisher._mirror import Core
from kvwire.subscriber._recv import check_batch
from kvwire.wire import (
    DEFAULT_LIMITS,
    BlockStored,
    KVEventBatch,
    WireError,
    _scan,
    decode_batch,
    encode_batch,
)
from kvwire.wire.codec import _decode_generic, _decode_typed

enc = msgspec.msgpack.encode
LIMITS = (DEFAULT_LIMITS.max_events, DEFAULT_LIMITS.max_blocks, DEFAULT_LIMITS.max_block_size, DEFAULT_LIMITS.max_tokens)

# A map BlockStored without parent_block_hash.
MISSING_PARENT = bytes.fromhex(
    "92cb00000000000000009184a474797065ab426c6f636b53746f726564ac626c6f636b5f68617368657390"
    "a9746f6b656e5f69647390aa626c6f636b5f73697a6501"
)
# {type: BlockRemoved, block_hashes: [1], type: AllBlocksCleared}
DUPLICATE_TYPE = bytes.fromhex(
    "93cb3ff00000000000009183a474797065ac426c6f636b52656d6f766564ac626c6f636b5f686173686573"
    "9101a474797065b0416c6c426c6f636b73436c656172656400"
)
# token_ids: [nil]
NIL_TOKEN = bytes.fromhex(
    "92cb00000000000000009185a474797065ab426c6f636b53746f726564ac626c6f636b5f68617368657390"
    "b1706172656e745f626c6f636b5f68617368c0a9746f6b656e5f69647391c0aa626c6f636b5f73697a6501"
)


def map_event(pairs: list[tuple[Any, Any]]) -> bytes:
    out = bytes([0x80 | len(pairs)])
    for k, v in pairs:
        out += enc(k) + enc(v)
    return out


def batch_of(*events: bytes) -> bytes:
    return bytes([0x93]) + enc(1.0) + bytes([0x90 | len(events)]) + b"".join(events) + enc(0)


STORE = [("type", "BlockStored"), ("block_hashes", [1, 2]), ("parent_block_hash", None),
         ("token_ids", [1, 2, 3, 4]), ("block_size", 2)]  # fmt: skip


def refused_everywhere(payload: bytes) -> None:
    """WireError from decode_batch and from its general path; no native reader takes it."""
    with pytest.raises(WireError):
        decode_batch(payload)
    with pytest.raises(WireError):
        _decode_generic(payload, DEFAULT_LIMITS)
    assert _decode_typed(payload, DEFAULT_LIMITS) is None
    assert _scan.check(payload, DEFAULT_LIMITS) is None
    assert check_batch(payload, *LIMITS) is None
    assert Core().apply_payload(payload) is False
    idx = PrefixIndex(2)
    idx.apply("w", 0, KVEventBatch(0.0, [], 0))
    with pytest.raises(WireError):
        idx.apply_payload("w", 0, payload)
    assert idx.blocks("w", 0) == set()


def test_a_store_without_parent_block_hash_is_refused() -> None:
    refused_everywhere(MISSING_PARENT)
    with pytest.raises(WireError, match="parent_block_hash"):
        decode_batch(MISSING_PARENT)


def test_a_key_given_twice_is_refused_the_tag_included() -> None:
    refused_everywhere(DUPLICATE_TYPE)
    with pytest.raises(WireError, match="twice"):
        decode_batch(DUPLICATE_TYPE)
    twice = [
        [*STORE, ("block_hashes", [3, 4])],
        [*STORE, ("type", "BlockStored")],
        [*STORE, ("medium", "CPU"), ("medium", "GPU")],
        [*STORE, ("future_field", 1), ("future_field", 2)],
    ]
    for pairs in twice:
        refused_everywhere(batch_of(map_event(pairs)))
    envelope = b"\x83" + enc("ts") + enc(1.0) + enc("events") + enc([]) + enc("ts") + enc(2.0)
    refused_everywhere(envelope)


@pytest.mark.parametrize("tokens", [[None], [5, True, 9, 12], [1.5, 2], ["a", "b"], [[1], 2]])
def test_token_ids_that_are_not_ints_are_refused(tokens: list[Any]) -> None:
    refused_everywhere(batch_of(map_event([*STORE[:3], ("token_ids", tokens), STORE[4]])))
    positional = enc(["BlockStored", [1, 2], None, tokens, 2])
    refused_everywhere(batch_of(positional))
    refused_everywhere(NIL_TOKEN)


def test_non_string_keys_are_refused() -> None:
    refused_everywhere(batch_of(map_event([*STORE, (7, "seven")])))


def test_unknown_fields_are_skipped_by_every_path() -> None:
    payload = batch_of(map_event([*STORE, ("future_field", "x"), ("other", [1, 2])]))
    (event,) = decode_batch(payload).events
    assert event == _decode_generic(payload, DEFAULT_LIMITS).events[0] == BlockStored([1, 2], None, [1, 2, 3, 4], 2)
    assert check_batch(payload, *LIMITS) == (1, 0, False)


def test_the_map_form_envelope_is_read_by_every_path() -> None:
    """vLLM's EventBatch at the commits where it was not array_like: {ts, events, data_parallel_rank}."""
    batch = KVEventBatch(2.5, [BlockStored([1, 2], None, [1, 2, 3, 4], 2)], 3)
    array_form = encode_batch(batch)
    inner = msgspec.msgpack.Decoder(list[msgspec.Raw]).decode(array_form)[1]
    for keys in (["ts", "events", "data_parallel_rank"], ["data_parallel_rank", "events", "ts"], ["ts", "events"]):
        values = {"ts": enc(2.5), "events": bytes(inner), "data_parallel_rank": enc(3)}
        payload = bytes([0x80 | len(keys)]) + b"".join(enc(k) + values[k] for k in keys)
        want = batch if "data_parallel_rank" in keys else KVEventBatch(2.5, batch.events, None)
        assert decode_batch(payload) == want
        assert _decode_generic(payload, DEFAULT_LIMITS) == want
        assert _decode_typed(payload, DEFAULT_LIMITS) == want
        assert check_batch(payload, *LIMITS) == (1, want.data_parallel_rank, False)
        core = Core()
        assert core.apply_payload(payload) is True
        assert [(list(c.hash_list(0, len(c))), c.block_size) for c in core.chains()] == [([1, 2], 2)]
        idx = PrefixIndex(2)
        idx.apply("w", 0, KVEventBatch(0.0, [], 0))
        assert idx._core.apply_payload(0, payload, DEFAULT_LIMITS) is True
        assert idx.blocks("w", 0) == {1, 2}
    with pytest.raises(WireError, match="lacks events"):
        decode_batch(b"\x81" + enc("ts") + enc(1.0))


def test_stores_with_no_blocks_mirror_natively() -> None:
    """Every store with block_hashes: [] on a fresh mirror (once a memcpy from NULL)."""
    core = Core()
    payload = bytes.fromhex("92cb00000000000000009195ab426c6f636b53746f72656490c09001")
    assert core.apply_payload(payload) is True
    assert core.chains() == [] and core.count() == 0
    assert decode_batch(payload).events == [BlockStored([], None, [], 1)]


def test_an_unknown_field_is_skipped_unread_by_every_path() -> None:
    """Its value is never decoded (as msgspec skips unknown fields): invalid UTF-8 there is no error."""
    bad_utf8 = b"\xa2\xff\xfe"
    event = bytearray(map_event(STORE))
    event[0] += 1
    payload = batch_of(bytes(event) + enc("future_field") + bad_utf8)
    want = [BlockStored([1, 2], None, [1, 2, 3, 4], 2)]
    assert decode_batch(payload).events == _decode_generic(payload, DEFAULT_LIMITS).events == want
    idx = PrefixIndex(2)
    idx.apply_payload("w", 0, payload)
    assert idx.blocks("w", 0) == {1, 2}
    with pytest.raises(WireError):  # a field that is read: refused
        decode_batch(batch_of(map_event([*STORE, ("medium", "x")]).replace(b"\xa1x", bad_utf8)))


SIGNED = [-1, -(1 << 63), 5]  # int64 hashes, the TensorRT-LLM/SGLang form
RARE = [
    [],  # every field in the reader's view: the structs are built from it
    [("lora_id", 3)],  # fields the view does not hold: msgspec reads the batch
    [("extra_keys", ["a", 1])],
    [("kv_cache_spec_kind", "full_attention"), ("kv_cache_spec_sliding_window", 8)],
    [("lookahead_token_ids", [1, 2])],
    [("cache_salt", "s")],
]


@pytest.mark.parametrize("rare", RARE)
@pytest.mark.parametrize("positional", [False, True])
def test_the_typed_path_reads_as_the_general_path_does(rare: list[tuple[str, Any]], positional: bool) -> None:
    """Both ways the typed path builds its structs, map and positional events, signed hashes,
    media given, nil and absent: the same events as the general path, re-encoded alike."""
    fields = BlockStored.__struct_fields__
    signed = [("block_hashes", SIGNED), ("parent_block_hash", -7), ("token_ids", [1, 2, 3, 4, 5, 6])]
    nil_medium = [("block_hashes", [1 << 63]), ("parent_block_hash", None), ("token_ids", [9, 9])]
    plain = [("block_hashes", [4]), ("parent_block_hash", 1 << 63), ("token_ids", [0, 300])]
    stores: list[list[tuple[str, Any]]] = [
        [*signed, ("block_size", 2), ("medium", "CPU"), *rare],
        [*nil_medium, ("block_size", 2), ("medium", None), ("lora_name", "l"), ("group_idx", -2)],
        [*plain, ("block_size", 2)],
    ]
    removed = [("block_hashes", [-3, 4]), ("medium", "GPU"), ("group_idx", 1)]
    events = []
    for store in stores:
        if positional:
            named = dict(store)
            last = max(fields.index(k) for k in named)
            events.append(enc(["BlockStored", *(named.get(f) for f in fields[: last + 1])]))
        else:
            events.append(map_event([("type", "BlockStored"), *store]))
    if positional:
        events += [enc(["BlockRemoved", [-3, 4], "GPU", 1]), enc(["AllBlocksCleared"])]
    else:
        events += [map_event([("type", "BlockRemoved"), *removed]), map_event([("type", "AllBlocksCleared")])]
    payload = batch_of(*events)
    assert _scan.check(payload, DEFAULT_LIMITS) is not None
    typed = _decode_typed(payload, DEFAULT_LIMITS)
    want = _decode_generic(payload, DEFAULT_LIMITS)
    assert typed == want == decode_batch(payload)
    assert typed.events[0].block_hashes == [(1 << 64) - 1, 1 << 63, 5]
    assert typed.events[0].parent_block_hash == (1 << 64) - 7
    assert typed.events[3].block_hashes == [(1 << 64) - 3, 4]
    # omit_defaults leaves out a default medium by identity: equal strings are not enough
    assert encode_batch(typed) == encode_batch(want)
    assert [encode_batch(KVEventBatch(0.0, [e])) for e in typed.events] == [
        encode_batch(KVEventBatch(0.0, [e])) for e in want.events
    ]


def test_a_batch_of_both_event_forms_is_read_alike() -> None:
    payload = batch_of(map_event(STORE), enc(["BlockRemoved", [1]]))
    assert decode_batch(payload) == _decode_generic(payload, DEFAULT_LIMITS)
    payload = batch_of(map_event([*STORE, ("lora_id", 1)]), enc(["BlockRemoved", [1]]))
    assert decode_batch(payload) == _decode_generic(payload, DEFAULT_LIMITS)
