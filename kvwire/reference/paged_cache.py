"""A reference paged KV cache on torch that reports every change through a collector.

It works like the engines' own prefix caches: a pool of fixed-size blocks in one
tensor on a torch device (CUDA when present, else CPU), block hashes chained
over token ids, prefix reuse with reference counts, eviction of the least
recently used unreferenced cached block when a block is needed, and a reset
that drops everything. Admitting a request reuses its cached prefix, allocates
blocks for the rest, writes their keys and values into the pool and registers
the blocks that are full. Every change is reported, in order, to an
:class:`~kvwire.publisher.EventCollector`, and :meth:`PagedKVCache.held_hashes`
is the truth that a consumer replaying those events must reproduce.

torch is imported when a cache is created (the ``engine`` extra), so importing
:mod:`kvwire.publisher` does not need it. Not thread-safe: one engine thread
drives one cache.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import numpy.typing as npt

if TYPE_CHECKING:
    from kvwire.publisher.collector import EventCollector

__all__ = ["AdmitResult", "CacheFullError", "PagedKVCache", "block_hashes"]

_EMBED_ROWS = 1024


class CacheFullError(RuntimeError):
    """Not enough free or evictable blocks; the cache was left unchanged."""


@dataclass(frozen=True)
class AdmitResult:
    """What admitting a request did."""

    request_id: str
    block_ids: tuple[int, ...]
    """Physical blocks holding the request's tokens, in order (the last may be partial)."""
    prompt_blocks: int
    """Full blocks in the prompt."""
    cached_blocks: int
    """Leading full blocks reused from the prefix cache (their K/V not recomputed)."""
    new_blocks: int
    """Blocks allocated and written."""
    evicted_blocks: int
    """Cached blocks evicted to make room."""


def _root(seed: int) -> bytes:
    return hashlib.sha256(b"kvwire-root" + seed.to_bytes(8, "big", signed=True)).digest()[-8:]


def block_hashes(
    token_ids: Sequence[int] | npt.NDArray[np.integer[Any]],
    block_size: int,
    *,
    lora_name: str | None = None,
    seed: int = 0,
) -> list[int]:
    """The chained hashes of the full blocks of ``token_ids``, as :class:`PagedKVCache` computes them.

    Block ``i``'s hash covers its parent's hash, the LoRA name and its tokens:
    unsigned 64-bit, the last 8 bytes of a SHA-256 digest (as vLLM does), so
    equal prefixes hash equally on every rank and process.
    """
    tokens = np.asarray(token_ids, dtype="<i8")
    full = tokens.shape[0] // block_size
    return _chain(_root(seed), tokens, 0, full, block_size, _lora_bytes(lora_name))


def _lora_bytes(lora_name: str | None) -> bytes:
    return b"" if lora_name is None else b"\x00lora=" + lora_name.encode()


def _chain(
    parent: bytes, tokens: npt.NDArray[np.int64], start: int, stop: int, bs: int, lora: bytes
) -> list[int]:
    out: list[int] = []
    raw = tokens.tobytes()
    for i in range(start, stop):
        digest = hashlib.sha256(parent + lora + raw[i * bs * 8 : (i + 1) * bs * 8]).digest()
        parent = digest[-8:]
        out.append(int.from_bytes(parent, "big"))
    return out


class _Request:
    __slots__ = ("block_ids", "hashes", "lora", "lora_name", "tokens")

    def __init__(self, tokens: list[int], lora_name: str | None) -> None:
        self.tokens = tokens
        self.lora_name = lora_name
        self.lora = _lora_bytes(lora_name)
        self.block_ids: list[int] = []
        self.hashes: list[int] = []  # of its full blocks, in order


class PagedKVCache:
    """A paged KV cache with prefix caching, reporting changes to ``collector``.

    The pool is ``num_blocks`` blocks of ``block_size`` tokens, shaped
    ``(num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim)`` on
    ``device`` (default: CUDA when available, else CPU). Keys and values are a
    deterministic function of each token, so a reused block can be checked
    against a fresh computation. With ``collector=None`` nothing is reported.
    The caller flushes the collector once per engine iteration.
    """

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        collector: EventCollector | None = None,
        *,
        device: Any = None,
        num_layers: int = 2,
        num_kv_heads: int = 2,
        head_dim: int = 16,
        dtype: Any = None,
        hash_seed: int = 0,
    ) -> None:
        try:
            import torch
        except ImportError as exc:  # pragma: no cover - depends on the environment
            raise ImportError(
                "PagedKVCache needs torch: install kvwire with the 'engine' extra"
            ) from exc
        if num_blocks < 1 or block_size < 1:
            raise ValueError(
                f"num_blocks and block_size must be >= 1, got {num_blocks}, {block_size}"
            )
        if collector is not None and collector.block_size != block_size:
            raise ValueError(
                f"collector block_size {collector.block_size} differs from the cache's {block_size}"
            )
        self._torch = torch
        if device is None:
            device = "cuda" if torch.cuda.is_available() else "cpu"
        self.device = torch.device(device)
        if dtype is None:
            dtype = torch.float16 if self.device.type == "cuda" else torch.float32
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.collector = collector
        self.hash_seed = hash_seed
        self._root = _root(hash_seed)
        shape = (num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim)
        self.kv = torch.zeros(shape, dtype=dtype, device=self.device)
        gen = torch.Generator(device="cpu").manual_seed(hash_seed)
        embed = torch.randn((_EMBED_ROWS, num_kv_heads, head_dim), generator=gen)
        self._embed = embed.to(device=self.device, dtype=dtype)
        self._layer_scale = torch.arange(1, num_layers + 1, dtype=dtype, device=self.device)
        self._refs = [0] * num_blocks
        self._hash_of: list[int | None] = [None] * num_blocks
        self._block_of: dict[int, int] = {}
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self._requests: dict[str, _Request] = {}

    # --- queries -----------------------------------------------------------------

    def held_hashes(self) -> set[int]:
        """The block hashes the cache holds: what a replay of its events must yield."""
        return set(self._block_of)

    def probe(self, token_ids: Sequence[int], *, lora_name: str | None = None) -> int:
        """How many leading full blocks of ``token_ids`` are cached (no side effects)."""
        hits = 0
        for h in block_hashes(token_ids, self.block_size, lora_name=lora_name, seed=self.hash_seed):
            if h not in self._block_of:
                break
            hits += 1
        return hits

    @property
    def free_blocks(self) -> int:
        """Blocks not referenced by any request (free, or cached and evictable)."""
        return len(self._free)

    @property
    def held_blocks(self) -> int:
        """Blocks registered in the prefix cache."""
        return len(self._block_of)

    @property
    def active_requests(self) -> int:
        return len(self._requests)

    def read_kv(self, request_id: str) -> Any:
        """Keys and values of an admitted request's tokens: ``(layers, 2, tokens, heads, dim)``."""
        req = self._requests[request_id]
        return self.kv.flatten(2, 3)[:, :, self._slots(req.block_ids, 0, len(req.tokens))]

    def expected_kv(self, token_ids: Sequence[int]) -> Any:
        """The keys and values the cache writes for ``token_ids`` (for checking reuse)."""
        return self._compute_kv(list(token_ids))

    # --- changes -----------------------------------------------------------------

    def admit(
        self, request_id: str, token_ids: Sequence[int], *, lora_name: str | None = None
    ) -> AdmitResult:
        """Reuse the cached prefix of ``token_ids``, allocate and write the rest.

        Raises :class:`CacheFullError` (changing nothing) when the blocks it
        needs are neither free nor evictable.
        """
        if request_id in self._requests:
            raise ValueError(f"request {request_id!r} is already admitted")
        tokens = [int(t) for t in token_ids]
        if not tokens:
            raise ValueError(f"request {request_id!r} has no tokens")
        bs = self.block_size
        req = _Request(tokens, lora_name)
        full = len(tokens) // bs
        hashes = _chain(self._root, np.asarray(tokens, dtype="<i8"), 0, full, bs, req.lora)
        hits: list[int] = []
        for h in hashes:
            block = self._block_of.get(h)
            if block is None:
                break
            hits.append(block)
        needed = -(-len(tokens) // bs) - len(hits)
        reusable = sum(1 for b in hits if self._refs[b] == 0)
        if needed > len(self._free) - reusable:
            raise CacheFullError(
                f"request {request_id!r} needs {needed} blocks; {len(self._free) - reusable} "
                f"free or evictable of {self.num_blocks}"
            )
        for b in hits:
            if self._refs[b] == 0:
                del self._free[b]
            self._refs[b] += 1
        cached = len(hits)
        req.block_ids = hits
        evicted = self._allocate(req, needed)
        self._write(req, cached * bs, len(tokens))
        req.hashes = hashes
        self._register(req, cached, full)
        self._requests[request_id] = req
        return AdmitResult(request_id, tuple(req.block_ids), full, cached, needed, evicted)

    def extend(self, request_id: str, token_ids: Sequence[int]) -> int:
        """Append decoded tokens; registers blocks they fill. Returns how many.

        Raises :class:`CacheFullError` (changing nothing) when out of blocks.
        """
        req = self._requests[request_id]
        new = [int(t) for t in token_ids]
        if not new:
            return 0
        bs = self.block_size
        start = len(req.tokens)
        total = start + len(new)
        needed = -(-total // bs) - len(req.block_ids)
        if needed > len(self._free):
            raise CacheFullError(
                f"request {request_id!r} needs {needed} more blocks; {len(self._free)} free or evictable"
            )
        req.tokens.extend(new)
        self._allocate(req, needed)
        self._write(req, start, total)
        done = len(req.hashes)
        full = total // bs
        parent = self._root if done == 0 else req.hashes[-1].to_bytes(8, "big")
        req.hashes.extend(
            _chain(parent, np.asarray(req.tokens, dtype="<i8"), done, full, bs, req.lora)
        )
        return self._register(req, done, full)

    def release(self, request_id: str) -> None:
        """The request finished: its blocks become free (unregistered) or evictable (cached)."""
        req = self._requests.pop(request_id)
        for b in reversed(req.block_ids):
            self._refs[b] -= 1
            if self._refs[b] == 0:
                self._free[b] = None
                if self._hash_of[b] is None:
                    self._free.move_to_end(b, last=False)  # nothing cached: reuse first

    def reset(self) -> None:
        """Drop every request and every cached block (reported as ``AllBlocksCleared``)."""
        self._requests.clear()
        self._refs = [0] * self.num_blocks
        self._hash_of = [None] * self.num_blocks
        self._block_of.clear()
        self._free = OrderedDict.fromkeys(range(self.num_blocks))
        if self.collector is not None:
            self.collector.cleared()

    # --- internals -----------------------------------------------------------------

    def _allocate(self, req: _Request, count: int) -> int:
        """Take ``count`` blocks, least recently used first, evicting cached ones."""
        evicted: list[int] = []
        for _ in range(count):
            b, _ = self._free.popitem(last=False)
            h = self._hash_of[b]
            if h is not None:
                del self._block_of[h]
                self._hash_of[b] = None
                evicted.append(h)
            self._refs[b] = 1
            req.block_ids.append(b)
        if evicted and self.collector is not None:
            self.collector.removed(evicted)
        return len(evicted)

    def _register(self, req: _Request, start: int, stop: int) -> int:
        """Cache full blocks ``start..stop`` of ``req`` and report them as chains."""
        bs = self.block_size
        registered = 0
        run_start = -1
        for i in range(start, stop + 1):
            fresh = False
            if i < stop:
                h = req.hashes[i]
                if h not in self._block_of:  # another block may already hold this content
                    b = req.block_ids[i]
                    self._block_of[h] = b
                    self._hash_of[b] = h
                    fresh = True
                    registered += 1
            if fresh and run_start < 0:
                run_start = i
            elif not fresh and run_start >= 0:
                if self.collector is not None:
                    self.collector.stored(
                        req.hashes[run_start:i],
                        req.hashes[run_start - 1] if run_start > 0 else None,
                        req.tokens[run_start * bs : i * bs],
                        lora_name=req.lora_name,
                    )
                run_start = -1
        return registered

    def _slots(self, block_ids: list[int], start: int, stop: int) -> Any:
        torch = self._torch
        bs = self.block_size
        pos = torch.arange(start, stop)
        blocks = torch.tensor(block_ids, dtype=torch.long)[pos // bs]
        return (blocks * bs + pos % bs).to(self.device)

    def _compute_kv(self, tokens: list[int]) -> Any:
        torch = self._torch
        ids = torch.tensor(tokens, dtype=torch.long).remainder_(_EMBED_ROWS).to(self.device)
        keys = self._embed[ids]  # (tokens, heads, dim)
        scale = self._layer_scale.view(-1, 1, 1, 1)
        return torch.stack((keys.unsqueeze(0) * scale, keys.unsqueeze(0) * -scale), dim=1)

    def _write(self, req: _Request, start: int, stop: int) -> None:
        """Compute and store K/V for token positions ``start..stop`` of ``req``."""
        if start >= stop:
            return
        values = self._compute_kv(req.tokens[start:stop])
        self.kv.flatten(2, 3)[:, :, self._slots(req.block_ids, start, stop)] = values
