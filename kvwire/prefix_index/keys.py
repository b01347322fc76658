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

The chain is linear in ``F``, so all keys of a prompt come out of one
cumulative sum: ``C_b = q**b * (q * C_{-1} + sum_{i<=b} F_i * q**-i)`` (``q`` is
odd, hence invertible mod 2**64). A key *is* the chaining state, so a chain
continues from a parent's key and position alone. The position enters each
block non-linearly, which defeats the Thue-Morse collisions that plain
polynomial hashes mod 2**64 suffer. Keys are a routing hint, not a security
boundary: a collision can at worst misroute a request.
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

from kvwire.wire import TokenIds

__all__ = ["KeyScheme", "as_token_array", "block_keys", "key_scheme"]

U64 = npt.NDArray[np.uint64]

_MASK = 0xFFFF_FFFF_FFFF_FFFF
_F1 = 0xFF51_AFD7_ED55_8CCD
_F2 = 0xC4CE_B9FE_1A85_EC53
_NF1 = np.uint64(_F1)
_NF2 = np.uint64(_F2)
_S33 = np.uint64(33)
_S32 = np.uint64(32)
_GOLDEN = 0x9E37_79B9_7F4A_7C15
_EINSUM_MIN_BLOCKS = 4096
_POS_TABLE_MAX = 1 << 22
_encode = msgspec.msgpack.Encoder().encode
_U32_OK = array.array("I").itemsize == 4


def fmix64(x: int) -> int:
    """murmur3's 64-bit finaliser: a bijection on [0, 2**64)."""
    x ^= x >> 33
    x = (x * _F1) & _MASK
    x ^= x >> 33
    x = (x * _F2) & _MASK
    return x ^ (x >> 33)


def _fmix_array(x: U64) -> None:
    """:func:`fmix64`, in place, on every element."""
    t = x >> _S33
    x ^= t
    x *= _NF1
    np.right_shift(x, _S33, out=t)
    x ^= t
    x *= _NF2
    np.right_shift(x, _S33, out=t)
    x ^= t


def _mix_array(x: U64) -> None:
    """One xorshift-multiply round, in place: cheap, non-linear, bijective."""
    t = x >> _S32
    x ^= t
    x *= _NF1


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


def _powers(base: int, n: int) -> U64:
    """``base**i mod 2**64`` for i in [0, n)."""
    out = np.empty(max(n, 1), dtype=np.uint64)
    out[0] = 1
    filled = 1
    step = base & _MASK
    while filled < n:
        take = min(filled, n - filled)
        np.multiply(out[:take], np.uint64(step), out=out[filled : filled + take])
        filled += take
        step = (step * step) & _MASK
    return out[:n]


class KeyScheme:
    """The key function for one (seed, block size); see the module docstring."""

    def __init__(self, seed: int, block_size: int) -> None:
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        self.seed = seed & _MASK
        self.block_size = block_size
        words = _splitmix(self.seed ^ 0x6B76_7769_7265_6B65)
        self._q = words[0] | 1
        self._q_inv = pow(self._q, -1, 1 << 64)
        self._pos_k = words[1]
        self._root_k = words[2]
        self._detached_k = words[3]
        self._malformed_k = words[4]
        self._hkey = words[5].to_bytes(8, "little") + words[6].to_bytes(8, "little")
        wstate = words[7]
        weights = []
        for _ in range(block_size):
            wstate = (wstate * 0x5851_F42D_4C95_7F2D + 0x1405_7B7E_F767_814F) & _MASK
            weights.append(fmix64(wstate) | 1)
        self._w_u64: U64 = np.array(weights, dtype=np.uint64)
        self._w_i64 = self._w_u64.view(np.int64)
        self._qpow: U64 = _powers(self._q, 256)
        self._qinv: U64 = _powers(self._q_inv, 256)
        self._pos: U64 = self._pos_salts(0, 1024)
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

    def detached(self, parent_hash: int) -> int:
        """Chaining state under a parent the index never saw (unmatchable)."""
        return fmix64(self._detached_k ^ (parent_hash & _MASK))

    def malformed(self, hashes: U64) -> U64:
        """Keys for blocks whose tokens are missing or mis-sized (unmatchable)."""
        x = hashes ^ np.uint64(self._malformed_k)
        _fmix_array(x)
        return x

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

    def _pos_salts(self, start: int, n: int) -> U64:
        p = np.arange(start + 1, start + n + 1, dtype=np.uint64)
        p *= np.uint64(_GOLDEN)
        p ^= np.uint64(self._pos_k)
        _fmix_array(p)
        return p

    def _grow(self, n: int, end: int) -> None:
        if n > self._qpow.shape[0]:
            size = max(n, 2 * self._qpow.shape[0])
            self._qpow = _powers(self._q, size)
            self._qinv = _powers(self._q_inv, size)
        if self._pos.shape[0] < end <= _POS_TABLE_MAX:
            self._pos = self._pos_salts(0, min(max(end, 2 * self._pos.shape[0]), _POS_TABLE_MAX))

    def chain(
        self,
        tokens: npt.NDArray[Any],
        start: int,
        position: int = 0,
        extra: U64 | None = None,
    ) -> U64:
        """Keys of the full blocks of ``tokens`` after chaining state ``start``.

        ``tokens`` is a 1-D integer array holding a whole number of blocks;
        ``position`` is the absolute block position of its first block.
        """
        b = self.block_size
        n = tokens.shape[0] // b
        if n == 0:
            return np.zeros(0, dtype=np.uint64)
        t2 = tokens[: n * b].reshape(n, b)
        w = self._w_u64 if tokens.dtype == np.uint64 else self._w_i64
        mixed = np.einsum("ij,j->i", t2, w) if n >= _EINSUM_MIN_BLOCKS else t2 @ w
        x: U64 = mixed.view(np.uint64)
        end = position + n
        if end > self._pos.shape[0] or n > self._qpow.shape[0]:
            self._grow(n, end)
        if end <= self._pos.shape[0]:
            x ^= self._pos[position:end]
        else:
            x ^= self._pos_salts(position, n)
        if extra is not None:
            x ^= extra
        _mix_array(x)
        x *= self._qinv[:n]
        x[0] = (int(x[0]) + self._q * start) & _MASK
        np.add.accumulate(x, out=x)
        x *= self._qpow[:n]
        return x


@functools.lru_cache(maxsize=64)
def key_scheme(seed: int, block_size: int) -> KeyScheme:
    """The shared :class:`KeyScheme` for ``(seed, block_size)``."""
    return KeyScheme(seed, block_size)


def as_token_array(tokens: Any) -> npt.NDArray[Any]:
    """A 1-D integer numpy view of ``tokens`` (list, numpy array or torch tensor).

    torch is never imported here: a tensor is recognised by its type's module
    and converted with its own ``.numpy()``.
    """
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
    arr = as_token_array(tokens)
    n = arr.shape[0] // block_size
    extra = scheme.extra_hashes(extra_keys, n)
    start = scheme.root(lora_name, cache_salt) if parent_key is None else parent_key & _MASK
    return scheme.chain(arr, start, position, extra)
