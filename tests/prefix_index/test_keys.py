"""Block keys: chaining, namespaces, input types."""

from __future__ import annotations

import struct

import msgspec
import numpy as np
import pytest
import torch

from kvwire.prefix_index import block_keys
from kvwire.prefix_index.keys import _splitmix, as_token_array, fmix64, key_scheme
from kvwire.wire import TokenIds

rng = np.random.default_rng(11)
TOKENS = rng.integers(0, 150_000, 16 * 40 + 7).astype(np.int64)


def test_partial_last_block_gets_no_key() -> None:
    assert block_keys(TOKENS, 16).shape == (40,)
    assert block_keys(TOKENS[:15], 16).shape == (0,)
    assert block_keys([], 16).shape == (0,)


def test_every_input_type_gives_the_same_keys() -> None:
    ref = block_keys(TOKENS, 16, seed=3)
    for tokens in (
        TOKENS.tolist(),
        TOKENS.astype(np.int32),
        TOKENS.astype(np.uint32),
        TOKENS.astype(np.uint64),
        torch.tensor(TOKENS),
        torch.tensor(TOKENS, dtype=torch.int32),
        tuple(TOKENS.tolist()),
    ):
        assert (block_keys(tokens, 16, seed=3) == ref).all(), type(tokens)


def test_key_is_the_whole_prefix() -> None:
    keys = block_keys(TOKENS, 16)
    other = TOKENS.copy()
    other[5 * 16 + 3] += 1  # change one token of block 5
    k2 = block_keys(other, 16)
    assert (k2[:5] == keys[:5]).all()
    assert not (k2[5:] == keys[5:]).any()


def test_chain_continues_from_a_parent_key() -> None:
    keys = block_keys(TOKENS, 16, lora_name="x", extra_keys=[None] * 40)
    for cut in (1, 7, 39):
        rest = block_keys(
            TOKENS[cut * 16 :], 16, parent_key=int(keys[cut - 1]), position=cut
        )
        assert (rest == keys[cut:]).all()


def test_position_matters() -> None:
    # The same blocks after the same chaining state at another position differ.
    keys = block_keys(TOKENS, 16)
    a = block_keys(TOKENS[16:32], 16, parent_key=int(keys[0]), position=1)
    b = block_keys(TOKENS[16:32], 16, parent_key=int(keys[0]), position=2)
    assert a[0] != b[0]


def test_namespaces_and_extra_keys_separate_keys() -> None:
    base = block_keys(TOKENS, 16, seed=1)
    variants = [
        block_keys(TOKENS, 16, seed=2),
        block_keys(TOKENS, 16, seed=1, lora_name="adapter"),
        block_keys(TOKENS, 16, seed=1, cache_salt="salt"),
        block_keys(TOKENS, 16, seed=1, extra_keys=[("mm", 7, 0)] + [None] * 39),
    ]
    for v in variants:
        assert not np.isin(v, base).any()
    # None extra keys are the same as no extra keys; later blocks' extras
    # leave earlier keys alone.
    assert (block_keys(TOKENS, 16, seed=1, extra_keys=[None] * 40) == base).all()
    late = block_keys(TOKENS, 16, seed=1, extra_keys=[None] * 10 + ["x"] * 30)
    assert (late[:10] == base[:10]).all() and not (late[10:] == base[10:]).any()
    # Tuples and lists are the same extra key (they are on the wire).
    t = block_keys(TOKENS, 16, extra_keys=[("a", 1)] * 40)
    assert (t == block_keys(TOKENS, 16, extra_keys=[["a", 1]] * 40)).all()


def test_bad_input_is_rejected() -> None:
    with pytest.raises(ValueError):
        block_keys(TOKENS.reshape(-1, 1), 16)
    with pytest.raises(TypeError):
        block_keys(TOKENS.astype(np.float64), 16)
    with pytest.raises(ValueError):
        block_keys(TOKENS, 0)
    with pytest.raises(ValueError):
        block_keys(TOKENS, 16, extra_keys=[None] * 3)
    with pytest.raises(ValueError):
        block_keys(TOKENS, 16, position=-1)


def test_negative_and_huge_tokens_wrap_mod_2_64() -> None:
    a = as_token_array([-1, 5])
    assert a.dtype.kind == "i"
    assert (block_keys([-1] * 16, 16) == block_keys([2**64 - 1] * 16, 16)).all()


def reference_keys(tokens: list[int], bs: int, seed: int, start: int, position: int) -> list[int]:
    """The module docstring's formula, in plain Python ints."""
    scheme = key_scheme(seed, bs)
    mask = (1 << 64) - 1
    words = _splitmix(seed ^ 0x6B76_7769_7265_6B65)
    q, pos_k = words[0] | 1, words[1]
    out, state = [], start
    for b in range(len(tokens) // bs):
        mixed = sum(t * w for t, w in zip(tokens[b * bs : (b + 1) * bs], scheme.weights, strict=True))
        x = (mixed & mask) ^ fmix64((((position + b + 1) * 0x9E37_79B9_7F4A_7C15) & mask) ^ pos_k)
        x = ((x ^ (x >> 32)) * 0xFF51_AFD7_ED55_8CCD) & mask
        state = (state * q + x) & mask
        out.append(state)
    return out


def test_keys_follow_the_documented_formula() -> None:
    toks = [int(t) for t in rng.integers(-(2**40), 2**40, 16 * 9)] + [2**63 + 5] * 16
    for seed in (0, 7, 2**64 - 1):
        root = key_scheme(seed, 16).root("lora")
        got = block_keys(toks, 16, seed=seed, lora_name="lora")
        assert got.tolist() == reference_keys(toks, 16, seed, root, 0)
        parent = 0xDEAD_BEEF_0123_4567
        got = block_keys(toks, 16, seed=seed, parent_key=parent, position=1000)
        assert got.tolist() == reference_keys(toks, 16, seed, parent, 1000)


def test_long_prompts_agree_with_their_prefixes() -> None:
    big = rng.integers(0, 50_000, 16 * 10_000).astype(np.int64)
    keys = block_keys(big, 16)
    head = block_keys(big[: 16 * 100], 16)
    assert (keys[:100] == head).all()
    assert key_scheme(0, 16) is key_scheme(0, 16)


def test_msgpack_token_bytes_give_the_same_keys_in_every_int_form() -> None:
    """A decoded event's TokenIds is keyed from its bytes: every msgpack integer
    form, minimal or not, reads as its value."""
    values = [0, 1, 127, 128, 255, 256, 65535, 65536, 2**32 - 1, 2**32, 2**63 - 1,
              -1, -32, -33, -128, -129, -32768, -32769, -(2**31), -(2**31) - 1, -(2**63)]  # fmt: skip
    values += [int(t) for t in rng.integers(0, 200_000, 16 * 4 - len(values) % 16 + 16)]
    values = values[: len(values) // 16 * 16]
    want = block_keys(values, 16)
    assert (block_keys(TokenIds(msgspec.Raw(msgspec.msgpack.encode(values))), 16) == want).all()
    # Every value in its widest form, as another encoder may send it.
    wide = bytearray(b"\xdd" + struct.pack(">I", len(values)))
    for v in values:
        wide += b"\xd3" + struct.pack(">q", v) if v < 0 else b"\xcf" + struct.pack(">Q", v)
    assert (block_keys(TokenIds(msgspec.Raw(bytes(wide))), 16) == want).all()
