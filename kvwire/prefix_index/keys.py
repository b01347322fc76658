"""Block keys the router computes itself from token ids.

An engine's block hashes depend on its hash function, its seed and details it
does not publish, so the index never tries to reproduce them. It computes its
own key per full block instead: a chained 64-bit content key, so block ``i``'s
key stands for the whole prefix up to and including block ``i``.

For block ``b`` (absolute position ``p``) with tokens ``t[b, 0..B-1]``::

    L_b = sum_j t[b, j] * w_j                    (seeded odd weights, mod 2**64)
    F_b = mix(L_b ^ pos(p) ^ extra_b)            (mix(x) = (x ^ x >> 32) * odd)
    C_b = C_{b-1} * q + F_b                      (q odd, mod 2**64)
    key_b = C_b,   C_{-1} = root(seed, lora_name, cache_salt)

with ``pos(p) = fmix64((p + 1) * golden ^ k_pos)``. Tokens enter as 64-bit
two's complement, so a list, any integer array and the msgpack bytes of a
decoded event give the same keys. A key *is* the chaining state, so a chain
continues from a parent's key and position alone. The position enters each
block non-linearly, which defeats the Thue-Morse collisions that plain
polynomial hashes mod 2**64 suffer. Keys are a routing hint, not a security
boundary: a collision can at worst misroute a request.

The loop over blocks runs natively (``_core.KeyChain``): about a nanosecond
per token, where numpy's per-call overhead would dominate a prompt.
"""

from __future__ import annotations

import array
import functools
import hashlib
from collections.abc import Sequence
from typing import Any

import msgspec
import numpy as np
import numpy.typing as npt

from kvwire.prefix_index._core import KeyChain
from kvwire.wire import TokenIds

__all__ = [
    "KEY_SCHEME_VERSION",
    "KeyScheme",
    "as_token_array",
    "block_keys",
    "key_scheme",
    "token_source",
]

KEY_SCHEME_VERSION = 1
"""The key function's version (the formula above and its constants): keys of another
version never equal these, so a saved view of another version is refused."""

U64 = npt.NDArray[np.uint64]

_MASK = 0xFFFF_FFFF_FFFF_FFFF
_F1 = 0xFF51_AFD7_ED55_8CCD
_F2 = 0xC4CE_B9FE_1A85_EC53
_GOLDEN = 0x9E37_79B9_7F4A_7C15
_encode = msgspec.msgpack.Encoder().encode
_U32_OK = array.array("I").itemsize == 4


def fmix64(x: int) -> int:
    """murmur3's 64-bit finaliser: a bijection on [0, 2**64)."""
    x ^= x >> 33
    x = (x * _F1) & _MASK
    x ^= x >> 33
    x = (x * _F2) & _MASK
    return x ^ (x >> 33)


def _splitmix(seed: int) -> list[int]:
    """64 pseudo-random 64-bit words from ``seed`` (splitmix64)."""
    out = []
    state = seed & _MASK
    for _ in range(64):
        state = (state + _GOLDEN) & _MASK
        z = state
        z = ((z ^ (z >> 30)) * 0xBF58_476D_1CE4_E5B9) & _MASK
        z = ((z ^ (z >> 27)) * 0x94D0_49BB_1331_11EB) & _MASK
        out.append(z ^ (z >> 31))
    return out


class KeyScheme:
    """The key function for one (seed, block size); see the module docstring.

    The per-block loop runs natively (:attr:`native`); this class derives its
    constants from the seed and owns the namespaces (roots, extra keys).
    """

    def __init__(self, seed: int, block_size: int) -> None:
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        self.seed = seed & _MASK
        self.block_size = block_size
        words = _splitmix(self.seed ^ 0x6B76_7769_7265_6B65)
        self._q = words[0] | 1
        self._root_k = words[2]
        self._hkey = words[5].to_bytes(8, "little") + words[6].to_bytes(8, "little")
        wstate = words[7]
        weights = []
        for _ in range(block_size):
            wstate = (wstate * 0x5851_F42D_4C95_7F2D + 0x1405_7B7E_F767_814F) & _MASK
            weights.append(fmix64(wstate) | 1)
        self.weights: tuple[int, ...] = tuple(weights)
        self.native = KeyChain(weights, self._q, words[1], words[3], words[4])
        self._roots: dict[tuple[str | None, type, Any], int] = {}

    # --- per-chain starting points --------------------------------------------

    def root(self, lora_name: str | None = None, cache_salt: Any = None) -> int:
        """Chaining state before block 0 of a sequence in this namespace."""
        cacheable = cache_salt is None or type(cache_salt) in (str, bytes, int)
        ns = (lora_name, type(cache_salt), cache_salt)
        if cacheable:
            cached = self._roots.get(ns)
            if cached is not None:
                return cached
        base = self._root_k
        if lora_name is not None or cache_salt is not None:
            base ^= self.digest(["ns", lora_name, cache_salt])
        state = fmix64(base)
        if cacheable and len(self._roots) < 1024:
            self._roots[ns] = state
        return state

    def digest(self, value: Any) -> int:
        """Seeded 64-bit digest of any msgpack-encodable value."""
        h = hashlib.blake2b(_encode(value), digest_size=8, key=self._hkey)
        return int.from_bytes(h.digest(), "little")

    def extra_hashes(self, extra_keys: Sequence[Any] | None, n_blocks: int) -> U64 | None:
        """One digest per block (0 for None), or None when no block has extra keys."""
        if extra_keys is None:
            return None
        if len(extra_keys) < n_blocks:
            raise ValueError(
                f"extra_keys has {len(extra_keys)} entries for {n_blocks} full blocks"
            )
        out = None
        for i in range(n_blocks):
            e = extra_keys[i]
            if e is not None:
                if out is None:
                    out = np.zeros(n_blocks, dtype=np.uint64)
                out[i] = self.digest(e)
        return out

    # --- the chain ------------------------------------------------------------

    def chain(
        self, tokens: Any, start: int, position: int = 0, extra_keys: Sequence[Any] | None = None
    ) -> U64:
        """Keys of the full blocks of ``tokens`` after chaining state ``start``.

        ``tokens`` is anything :func:`token_source` takes; ``position`` is the
        absolute block position of its first block; ``extra_keys`` as :func:`block_keys`.
        """
        src, packed, n_tokens = token_source(tokens)
        n = n_tokens // self.block_size
        out = np.empty(n, dtype=np.uint64)
        extra = self.extra_hashes(extra_keys, n)
        self.native.keys_into(src, packed, start & _MASK, position, extra, out)
        return out


@functools.lru_cache(maxsize=64)
def key_scheme(seed: int, block_size: int) -> KeyScheme:
    """The shared :class:`KeyScheme` for ``(seed, block_size)``."""
    return KeyScheme(seed, block_size)


def token_source(tokens: Any) -> tuple[Any, bool, int]:
    """``(source, packed, count)``: token ids in a form the native chain reads.

    A decoded event's :class:`~kvwire.wire.TokenIds` stays in its msgpack
    bytes (``packed``); lists and tuples are read item by item; anything else
    becomes a 1-D native-endian contiguous integer array (torch tensors via
    their own ``.numpy()``, torch never imported here).
    """
    t = type(tokens)
    if t is TokenIds:
        return tokens.raw, True, len(tokens)
    if t is list or t is tuple:
        return tokens, False, len(tokens)
    arr = as_token_array(tokens)
    if not arr.flags.c_contiguous or not arr.dtype.isnative:
        arr = np.ascontiguousarray(arr, dtype=arr.dtype.newbyteorder("="))
    return arr, False, arr.shape[0]


def as_token_array(tokens: Any) -> npt.NDArray[Any]:
    """A 1-D integer numpy view of ``tokens`` (list, numpy array or torch tensor)."""
    if type(tokens) is TokenIds:
        tokens = tokens.tolist()
    if type(tokens) is list:
        # array.array converts a list of ints several times faster than numpy;
        # token ids fit 32 bits, anything else takes the slower paths.
        try:
            if not _U32_OK:
                raise OverflowError
            arr: npt.NDArray[Any] = np.frombuffer(array.array("I", tokens), dtype=np.uint32)
        except (OverflowError, TypeError):
            try:
                arr = np.frombuffer(array.array("Q", tokens), dtype=np.uint64)
            except (OverflowError, TypeError):
                arr = np.asarray(tokens)
    elif isinstance(tokens, np.ndarray):
        arr = tokens
    elif type(tokens).__module__.split(".")[0] == "torch":
        arr = tokens.detach().cpu().numpy()
    else:
        arr = np.asarray(tokens)
    if arr.ndim != 1:
        raise ValueError(f"tokens must be 1-D, got shape {arr.shape}")
    if arr.dtype.kind not in "iu":
        if arr.shape[0] == 0:
            return np.zeros(0, dtype=np.int64)
        raise TypeError(f"tokens must be integers, got dtype {arr.dtype}")
    return arr


def block_keys(
    tokens: Any,
    block_size: int,
    *,
    seed: int = 0,
    lora_name: str | None = None,
    extra_keys: Sequence[Any] | None = None,
    parent_key: int | None = None,
    position: int = 0,
    cache_salt: Any = None,
) -> U64:
    """The chained 64-bit key of every full block of ``tokens``.

    ``tokens`` may be a list, a numpy array or a torch tensor; a partial last
    block gets no key. ``lora_name`` and ``cache_salt`` choose the namespace of
    a sequence's root; ``extra_keys`` holds one entry per block (None for none),
    matching what the engine reports in its events. To continue a chain, pass
    the last key as ``parent_key`` and the continuing block's position; the
    namespace then comes from the parent. ``seed`` must match the index's.
    """
    if position < 0:
        raise ValueError(f"position must be >= 0, got {position}")
    scheme = key_scheme(seed & _MASK, block_size)
    start = scheme.root(lora_name, cache_salt) if parent_key is None else parent_key
    return scheme.chain(tokens, start, position, extra_keys)
