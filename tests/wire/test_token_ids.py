"""Token ids stay packed until read, and read back exactly."""

from __future__ import annotations

import msgspec
import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvwire.wire import (
    BlockStored,
    KVEventBatch,
    TokenIds,
    WireError,
    decode_batch,
    enc_hook,
    encode_batch,
)


def _stored_with(tokens: object) -> bytes:
    return msgspec.msgpack.encode(
        [1.0, [{"type": "BlockStored", "block_hashes": [1], "parent_block_hash": None, "token_ids": tokens, "block_size": 2}], 0]
    )


@given(st.lists(st.integers(min_value=0, max_value=2**32 - 1), max_size=300))
def test_decoded_tokens_read_back_exactly(tokens: list[int]) -> None:
    (event,) = decode_batch(_stored_with(tokens)).events
    assert isinstance(event, BlockStored)
    ids = event.token_ids
    assert isinstance(ids, TokenIds)
    assert len(ids) == len(tokens)  # from the array header
    assert ids == tokens and list(ids) == tokens and ids.tolist() == tokens
    if tokens:
        assert ids[0] == tokens[0] and ids[-1] == tokens[-1] and ids[1:3] == tokens[1:3]


def test_length_of_long_arrays_comes_from_the_header() -> None:
    for n in (15, 16, 65_535, 65_536):
        (event,) = decode_batch(_stored_with([7] * n)).events
        assert isinstance(event, BlockStored)
        assert len(event.token_ids) == n


@pytest.mark.parametrize("tokens", [[1, "x"], [None], [5, True, 9, 12], [1.0, 2]])
def test_non_int_tokens_fail_the_batch(tokens: list[object]) -> None:
    with pytest.raises(WireError, match="token_ids"):
        decode_batch(_stored_with(tokens))


def test_tokens_that_are_not_an_array_fail_the_batch() -> None:
    with pytest.raises(WireError, match="token_ids"):
        decode_batch(_stored_with("abcd"))


def test_re_encoding_a_decoded_batch_sends_the_tokens_as_received() -> None:
    batch = KVEventBatch(3.0, [BlockStored([5, 6], None, [1, 2, 300, 70_000], 2)], 1)
    payload = encode_batch(batch)
    decoded = decode_batch(payload)
    assert encode_batch(decoded) == payload
    assert decoded == batch


def test_enc_hook_makes_decoded_events_plain_data() -> None:
    (event,) = decode_batch(_stored_with([4, 5])).events
    assert msgspec.to_builtins(event, enc_hook=enc_hook)["token_ids"] == [4, 5]
    assert msgspec.json.decode(msgspec.json.encode(event, enc_hook=enc_hook))["token_ids"] == [4, 5]
