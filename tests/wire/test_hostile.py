"""Hostile payloads: every decode failure is a WireError, and the limits hold."""

from __future__ import annotations

import contextlib
import subprocess
import sys
import textwrap

import msgspec
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvwire.wire import (
    BlockRemoved,
    BlockStored,
    KVEventBatch,
    TokenIds,
    WireError,
    decode_batch,
    encode_batch,
)
from kvwire.wire.codec import DEFAULT_LIMITS, DecodeLimits, pack_int_array
from tests.budget import examples

ENVELOPE = b"\x93\xcb" + b"\0" * 8  # [0.0, ...


def nested(depth: int = 50_000) -> bytes:
    """Arrays in arrays, deeper than any CPython's C recursion limit (3.13 decodes 5,000)."""
    return b"\x91" * depth + b"\xc0"


def stored_map(**fields: object) -> bytes:
    ev = {"type": "BlockStored", "block_hashes": [1], "parent_block_hash": None,
          "token_ids": [1, 2], "block_size": 2}  # fmt: skip
    ev.update(fields)
    return msgspec.msgpack.encode([0.0, [ev], 0])


@pytest.mark.parametrize(
    "payload",
    [
        nested(),  # the envelope itself
        ENVELOPE + nested(),  # the events array
        # inside a field the typed path decodes as Any
        ENVELOPE + b"\x91\x82\xa4type\xabBlockStored\xa8locality" + nested() + b"\xc0",
        # a positional event (generic path)
        ENVELOPE + b"\x91\x92\xabBlockStored" + nested() + b"\xc0",
        # extra_keys of a map event: list[Any]
        stored_map(extra_keys=[0]).replace(b"\x91\x00", b"\x91" + nested()),
    ],
    ids=["envelope", "events", "any-field", "positional", "extra-keys"],
)
def test_deep_nesting_is_a_wire_error(payload: bytes) -> None:
    with pytest.raises(WireError, match="nests too deeply"):
        decode_batch(payload)


def test_limits_bound_events_blocks_block_size_and_tokens() -> None:
    small = DecodeLimits(max_events=2, max_blocks=3, max_block_size=4, max_tokens=8)
    ok = KVEventBatch(0.0, [BlockStored([1, 2, 3], None, list(range(6)), 2)], 0)
    for dialect in ("map", "array"):
        assert decode_batch(encode_batch(ok, dialect=dialect), small) == ok  # type: ignore[arg-type]
        cases = {
            "events": KVEventBatch(0.0, [BlockRemoved([1])] * 3, 0),
            "blocks": KVEventBatch(0.0, [BlockRemoved([1, 2, 3, 4])], 0),
            "block_size": KVEventBatch(0.0, [BlockStored([1], None, list(range(5)), 5)], 0),
            "block_size 0": KVEventBatch(0.0, [BlockStored([1], None, [], 0)], 0),
            "tokens": KVEventBatch(0.0, [BlockStored([1, 2, 3], None, list(range(9)), 3)], 0),
        }
        for what, batch in cases.items():
            with pytest.raises(WireError):
                decode_batch(encode_batch(batch, dialect=dialect), small)  # type: ignore[arg-type]
            # The defaults are far wider than these.
            decode_batch(encode_batch(batch, dialect=dialect)) if what != "block_size 0" else None  # type: ignore[arg-type]


def test_default_limits_refuse_absurd_block_sizes() -> None:
    for size in (10**6, 2**40, -1):
        with pytest.raises(WireError, match="block_size"):
            decode_batch(stored_map(block_size=size))
    assert DEFAULT_LIMITS.max_block_size >= 1024


def test_token_ids_that_are_not_an_array_or_not_ints_are_wire_errors() -> None:
    with pytest.raises(WireError):
        len(TokenIds(msgspec.Raw(b"")))
    with pytest.raises(WireError):
        TokenIds(msgspec.Raw(b"\x92\xa1a")).tolist()  # truncated
    with pytest.raises(WireError):
        decode_batch(stored_map(token_ids=["a", "b"])).events[0].token_ids.tolist()  # type: ignore[union-attr]


VALID = [
    encode_batch(KVEventBatch(1.0, [BlockStored([1, 2], 7, [1, 2, 3, 4], 2), BlockRemoved([5])], 0),
                 dialect=d)
    for d in ("map", "array")
]


@settings(max_examples=examples(400), deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.sampled_from(VALID), st.lists(st.tuples(st.integers(0, 10**6), st.integers(0, 255)),
                                        min_size=1, max_size=6))  # fmt: skip
def test_mutated_payloads_decode_or_raise_wire_error(base: bytes, edits: list[tuple[int, int]]) -> None:
    b = bytearray(base)
    for pos, value in edits:
        b[pos % len(b)] = value
    try:
        batch = decode_batch(bytes(b))
    except WireError:
        return
    for e in batch.events:
        if isinstance(e, BlockStored):
            with contextlib.suppress(WireError):
                list(e.token_ids)


values = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**63), 2**64 - 1) | st.floats() | st.text(max_size=4)
    | st.binary(max_size=4) | st.sampled_from(["BlockStored", "BlockRemoved", "AllBlocksCleared"]),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(
        st.sampled_from(["type", "block_hashes", "parent_block_hash", "token_ids", "block_size",
                         "medium", "extra_keys", "lora_name"]), inner, max_size=5),
    max_leaves=20,
)  # fmt: skip


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(values, st.lists(values, max_size=3), values)
def test_generated_envelopes_decode_or_raise_wire_error(ts: object, evs: list[object], rank: object) -> None:
    with contextlib.suppress(WireError):
        decode_batch(msgspec.msgpack.encode([ts, evs, rank]))


def test_pack_survives_index_methods_that_mutate_the_list() -> None:
    """Items whose __index__ empties the list: a clean error, never a crash."""
    code = textwrap.dedent(
        """
        from kvwire.wire.codec import pack_int_array
        victim = []
        keep = []
        class Evil:
            def __index__(self):
                victim.clear()  # frees the items still to be read...
                keep.extend(object() for _ in range(200_000))  # ...and reuses their memory
                keep.extend([None] * 100_000)
                return 1
        victim.extend([Evil(), *[10**6 + i for i in range(100_000)]])
        try:
            pack_int_array(victim)
        except RuntimeError as exc:
            print("refused:", exc)
        victim2 = []
        class Shrink:
            def __index__(self):
                del victim2[1:]
                return 2
        victim2.extend([1, Shrink(), 3, 4])
        try:
            pack_int_array(victim2)
        except RuntimeError as exc:
            print("refused:", exc)
        """
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.count("changed size") == 2


def test_pack_keeps_index_types_that_leave_the_list_alone() -> None:
    class Two:
        def __index__(self) -> int:
            return 2

    assert bytes(pack_int_array([1, Two(), 3])) == msgspec.msgpack.encode([1, 2, 3])
