"""The native check a payload stream relies on, held against decode_batch.

``check_batch`` may decline any payload (None: the stream decodes it), but
what it accepts ``decode_batch`` must accept under the same limits, and it
must read the same number of events, rank and clear from it. It must also
accept the batches engines send, or the fast path is never taken.
"""

from __future__ import annotations

import contextlib
from typing import Any

import msgspec
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvwire.subscriber._recv import check_batch
from kvwire.wire import (
    DEFAULT_LIMITS,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    DecodeLimits,
    KVEvent,
    KVEventBatch,
    WireError,
    decode_batch,
    encode_batch,
)
from tests.budget import examples

U64 = st.integers(0, 2**64 - 1)
I64 = st.integers(-(2**63), 2**63 - 1)
HASH = st.one_of(U64, I64)
SMALL = st.integers(0, 70_000)


def limits_args(limits: DecodeLimits) -> tuple[int, int, int, int]:
    return limits.max_events, limits.max_blocks, limits.max_block_size, limits.max_tokens


@st.composite
def stored(draw: st.DrawFn) -> BlockStored:
    n = draw(st.integers(0, 5))
    bs = draw(st.integers(1, 6))
    return BlockStored(
        block_hashes=draw(st.lists(HASH, min_size=n, max_size=n)),
        parent_block_hash=draw(st.one_of(st.none(), HASH)),
        token_ids=draw(st.lists(SMALL, min_size=0, max_size=n * bs + 2)),
        block_size=bs,
        lora_id=draw(st.one_of(st.none(), st.integers(0, 9))),
        medium=draw(st.sampled_from([None, "GPU", "CPU_TIER1", "disk"])),
        group_idx=draw(st.one_of(st.none(), st.integers(-3, 3))),
        kv_cache_spec_kind=draw(st.sampled_from([None, "full_attention"])),
        kv_cache_spec_sliding_window=draw(st.one_of(st.none(), st.integers(0, 4096))),
    )


@st.composite
def removed(draw: st.DrawFn) -> BlockRemoved:
    return BlockRemoved(
        block_hashes=draw(st.lists(HASH, max_size=5)),
        medium=draw(st.sampled_from([None, "GPU", "CPU_TIER1"])),
        group_idx=draw(st.one_of(st.none(), st.integers(0, 3))),
    )


EVENTS: st.SearchStrategy[KVEvent] = st.one_of(
    stored(), removed(), st.just(AllBlocksCleared())
)
RANK = st.one_of(st.none(), st.integers(-5, 2**64 - 1))


@st.composite
def batches(draw: st.DrawFn) -> KVEventBatch:
    ts = draw(st.floats(allow_nan=False))
    return KVEventBatch(ts, draw(st.lists(EVENTS, max_size=6)), draw(RANK))


def facts(batch: KVEventBatch) -> tuple[int, int | None, bool]:
    cleared = any(type(e) is AllBlocksCleared for e in batch.events)
    return len(batch.events), batch.data_parallel_rank, cleared


@st.composite
def odd_payloads(draw: st.DrawFn) -> bytes:
    """Hand-built envelopes and events in forms encode_batch never writes."""
    value: Any = draw(
        st.recursive(
            st.one_of(
                st.none(),
                st.booleans(),
                st.integers(-(2**63), 2**64 - 1),
                st.floats(),
                st.text(max_size=4),
                st.binary(max_size=4),
                st.sampled_from(["BlockStored", "BlockRemoved", "AllBlocksCleared", "type"]),
            ),
            lambda inner: st.lists(inner, max_size=5)
            | st.dictionaries(
                st.sampled_from(
                    [
                        "type",
                        "block_hashes",
                        "parent_block_hash",
                        "token_ids",
                        "block_size",
                        "medium",
                        "lora_name",
                        "extra_keys",
                        "group_idx",
                        "locality",
                        "other",
                    ]
                ),
                inner,
                max_size=6,
            ),
            max_leaves=20,
        )
    )
    events = draw(st.lists(st.just(value), min_size=1, max_size=2))
    envelope: list[Any] = [draw(st.one_of(st.floats(), st.integers(-9, 9))), events]
    if draw(st.booleans()):
        envelope.append(draw(st.one_of(st.none(), st.integers(-1, 3), st.text(max_size=2))))
    return msgspec.msgpack.encode(envelope)


@st.composite
def mutated(draw: st.DrawFn, payloads: st.SearchStrategy[bytes]) -> bytes:
    p = draw(payloads)
    for _ in range(draw(st.integers(0, 3))):
        if not p:
            break
        at = draw(st.integers(0, len(p) - 1))
        how = draw(st.sampled_from(["set", "drop", "insert", "cut"]))
        b = bytes([draw(st.integers(0, 255))])
        if how == "set":
            p = p[:at] + b + p[at + 1 :]
        elif how == "drop":
            p = p[:at] + p[at + 1 :]
        elif how == "insert":
            p = p[:at] + b + p[at:]
        else:
            p = p[:at]
    return p


ENCODED = st.builds(
    lambda b, dialect: encode_batch(b, dialect=dialect), batches(), st.sampled_from(["map", "array"])
)
LIMITS = st.one_of(
    st.just(DEFAULT_LIMITS),
    st.builds(
        DecodeLimits,
        max_events=st.integers(0, 8),
        max_blocks=st.integers(0, 6),
        max_block_size=st.integers(1, 8),
        max_tokens=st.integers(0, 40),
    ),
)
PROPERTY = settings(
    max_examples=examples(1000), deadline=None, suppress_health_check=[HealthCheck.too_slow]
)


@PROPERTY
@given(payload=mutated(st.one_of(ENCODED, odd_payloads())), limits=LIMITS)
def test_what_the_check_accepts_decode_batch_accepts_and_reads_alike(
    payload: bytes, limits: DecodeLimits
) -> None:
    got = check_batch(payload, *limits_args(limits))
    if got is None:
        return
    try:
        batch = decode_batch(payload, limits)
    except WireError as exc:
        raise AssertionError(f"check accepted what decode_batch refuses: {exc}") from None
    assert got == facts(batch)


@settings(PROPERTY, max_examples=examples(300))
@given(batch=batches(), dialect=st.sampled_from(["map", "array"]))
def test_the_batches_engines_send_are_read_natively(batch: KVEventBatch, dialect: str) -> None:
    payload = encode_batch(batch, dialect=dialect)  # type: ignore[arg-type]
    assert check_batch(payload, *limits_args(DEFAULT_LIMITS)) == facts(batch)
    assert check_batch(bytearray(payload), *limits_args(DEFAULT_LIMITS)) == facts(batch)
    assert check_batch(memoryview(payload), *limits_args(DEFAULT_LIMITS)) == facts(batch)


def store(**kw: Any) -> BlockStored:
    fields: dict[str, Any] = {
        "block_hashes": [1, 2],
        "parent_block_hash": None,
        "token_ids": list(range(8)),
        "block_size": 4,
    }
    return BlockStored(**{**fields, **kw})


@pytest.mark.parametrize(
    ("limits", "refused"),
    [
        (DecodeLimits(max_events=1), True),
        (DecodeLimits(max_blocks=1), True),
        (DecodeLimits(max_block_size=3), True),
        (DecodeLimits(max_tokens=7), True),
        (DecodeLimits(max_events=2, max_blocks=2, max_block_size=4, max_tokens=8), False),
    ],
)
def test_every_limit_of_decode_batch_is_checked(limits: DecodeLimits, refused: bool) -> None:
    payload = encode_batch(KVEventBatch(0.0, [store(), AllBlocksCleared()], 1))
    with pytest.raises(WireError) if refused else contextlib.nullcontext():
        decode_batch(payload, limits)
    got = check_batch(payload, *limits_args(limits))
    assert got is None if refused else got == (2, 1, True)


def test_forms_it_does_not_read_are_left_to_decode_batch() -> None:
    args = limits_args(DEFAULT_LIMITS)
    # Well formed, read only by decode_batch: a lora name, bytes hashes, an int timestamp.
    lora = encode_batch(KVEventBatch(0.0, [store(lora_name="adapter")], None))
    raw_hashes = msgspec.msgpack.encode(
        [0.0, [{"type": "BlockRemoved", "block_hashes": [b"\x01" * 8]}], None]
    )
    int_ts = msgspec.msgpack.encode([0, [], None])
    for payload in (lora, raw_hashes, int_ts):
        decode_batch(payload)
        assert check_batch(payload, *args) is None
    # Malformed: trailing bytes, a second tag, block size 0, not bytes at all.
    good = encode_batch(KVEventBatch(0.0, [store()], None))
    for payload in (good + b"\x00", encode_batch(KVEventBatch(0.0, [store(block_size=0)], None))):
        with pytest.raises(WireError):
            decode_batch(payload)
        assert check_batch(payload, *args) is None
    assert check_batch("not bytes", *args) is None  # type: ignore[arg-type]
    assert check_batch(good, -1, 1, 1, 1) is None  # a limit it cannot read
    with pytest.raises(TypeError):
        check_batch(good)  # type: ignore[call-arg]
