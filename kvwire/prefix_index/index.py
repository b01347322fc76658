"""The prefix index: which (worker, rank) holds how much of a prompt's prefix.

It is a sink for the subscriber: ``apply(worker_id, rank, batch)`` and
``clear(worker_id, rank)``; ``apply_payload(worker_id, rank, payload)`` takes a
batch's msgpack bytes instead and applies them without decoding them into
Python objects. Engine block hashes stay opaque ids; the index
computes its own chained content keys from each store's token ids (see
:mod:`kvwire.prefix_index.keys`), so a router matches prompts with the same
function and never needs the engine's hash.

The tables live in native code (``_core.Index``), each event applied as it
arrives, token bytes read straight from the decoded payload:

- per (worker, rank): engine hash -> (our key, position, one store count per
  tier). Counts make removals reference counted: an engine may store one hash
  twice and remove one copy (a count stops at 65,535 copies of one hash in one
  tier). Dropping a rank walks only its own table.
- one shared table: our key -> a bitmask of the ranks holding it (one bit per
  rank, 64 ranks a word; per tier once a non-GPU medium shows up). A match
  ANDs the masks along the prompt's keys. Eight consecutive blocks of a chain
  live side by side in it, so a prompt's walk reads a few cache lines per
  eight blocks.

A store whose parent hash the rank never reported (a late join, a partial
replay) starts a detached chain: its keys derive from the unknown parent, so
they can be removed and extended but never match a prompt.
"""

from __future__ import annotations

import contextlib
import heapq
import threading
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

import numpy as np
import numpy.typing as npt

from kvwire.prefix_index._core import (
    CAP_BLOCKS,
    CAP_BYTES,
    MALFORMED,
    ORPHAN,
    OVER_CAP,
    VIEW_VERSION,
    Index,
    Matches,
)
from kvwire.prefix_index.keys import KEY_SCHEME_VERSION, KeyScheme, key_scheme, token_source
from kvwire.wire import (
    DEFAULT_LIMITS,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    DecodeLimits,
    KVEventBatch,
    TokenIds,
    WireError,
    decode_batch,
    normalise_hash,
)

__all__ = [
    "CPU",
    "GPU",
    "STORAGE",
    "IndexStats",
    "Matches",
    "PrefixIndex",
    "RankKey",
    "TierDepths",
    "tier_of",
]

U64 = npt.NDArray[np.uint64]
RankKey = tuple[str, int]

# A match's result is a read-only mapping that builds what is read of it.
Mapping.register(Matches)

GPU = 0
CPU = 1
STORAGE = 2
_MASK = 0xFFFF_FFFF_FFFF_FFFF


def tier_of(medium: str | None) -> int:
    """The tier of a medium name: GPU, CPU (CPU, CPU_PINNED) or STORAGE (the rest).

    No medium means GPU, the default of every engine.
    """
    if medium is None:
        return GPU
    tier = _TIER_OF.get(medium)
    if tier is None:
        tier = _tier_of_name(medium)
        if len(_TIER_OF) < 256:
            _TIER_OF[medium] = tier
    return tier


_TIER_OF: dict[str, int] = {}


def _tier_of_name(medium: str) -> int:
    m = medium.upper()
    if "GPU" in m or m in ("HBM", "DEVICE", "CUDA"):
        return GPU
    if "CPU" in m or m in ("HOST", "DRAM"):
        return CPU
    return STORAGE


for _medium in ("GPU", "CPU", "CPU_PINNED", "STORAGE", "DISK", "EXTERNAL"):
    tier_of(_medium)  # the engines' media, known to apply_payload from the start


class TierDepths(NamedTuple):
    """How a holder's matched prefix splits over tiers, in blocks.

    Engines load a prefix from the fastest tier first: ``gpu`` is the longest
    prefix held on GPU, ``cpu`` how far GPU-or-CPU copies extend it, and
    ``storage`` the rest of the match, found only on slower media.
    """

    gpu: int
    cpu: int
    storage: int

    @property
    def total(self) -> int:
        """Matched blocks in any tier."""
        return self.gpu + self.cpu + self.storage


@dataclass(frozen=True)
class IndexStats:
    """Counters and sizes of a :class:`PrefixIndex`.

    ``blocks`` counts distinct keys, ``holders`` (block, rank) pairs and
    ``detached`` those on detached chains; they and ``memory_bytes`` (the
    index's tables) return to zero when everything is removed.
    ``refused_stores`` counts stores (and imports) refused at a rank's block
    cap or at the index's memory budget (``refused_over_budget`` of them at
    the budget), and ``ranks_over_cap`` the ranks whose view is incomplete
    because of one.
    """

    blocks: int
    holders: int
    ranks: int
    detached: int
    orphan_stores: int
    unknown_removals: int
    ignored_events: int
    malformed_stores: int
    memory_bytes: int
    refused_stores: int = 0
    ranks_over_cap: int = 0
    refused_over_budget: int = 0


class PrefixIndex:
    """Which (worker, rank) holds the longest prefix of a prompt; an event sink.

    ``block_size`` and ``seed`` fix the key function (routers computing keys
    themselves must use the same). ``groups`` lists the KV-cache group indices
    whose events count (``None`` is what engines without groups send); events
    of other groups are ignored and counted. Events apply as they arrive, so
    a query sees every batch applied before it. Thread-safe.

    Bounds against hostile or broken engines, both counted when hit:

    - ``max_block_size`` (default ``DEFAULT_LIMITS.max_block_size``, the bound
      decoding applies; engines use 16 to 1,024): a store
      whose ``block_size`` is outside ``1..max_block_size`` is malformed: its
      blocks are held under unmatchable keys (removals still balance), and no
      per-token work is done for it.
    - ``max_blocks_per_rank`` (default 2**21, about 70-140 MB of tables for
      the rank; ``None``: no bound): a store that would take a rank past it is
      refused whole and the rank is marked over cap (:meth:`over_cap`) until
      it is cleared. Its view then lacks blocks it may hold but never claims
      one it does not: a router treats it like a PARTIAL rank.
    - ``max_bytes`` (default ``None``: no bound): a budget for the whole
      index's tables (``IndexStats.memory_bytes``, which counts their arrays,
      not the few objects around them). A store whose table growth would take
      the index past it is refused whole and its rank marked over cap, as at
      ``max_blocks_per_rank`` (:meth:`cap_reason` says which); stores that
      need no growth still apply, so the tables stay within the budget and
      no view is silently wrong. The shared table doubles as it grows: the
      rank whose store meets a doubling is the one refused. Capacity hints
      (``expected_blocks_per_rank``, :meth:`reserve`) count against it.

    ``expected_blocks_per_rank`` (default 0: none) is a capacity hint, e.g. an
    engine's number of KV-cache blocks (vLLM's ``num_gpu_blocks``): each rank's
    table, and the shared table for that many blocks on every rank, are sized
    for it when first used and never shrink under it, so a fresh index does
    not pay for growing them (a fifth to a third of the cost of a store into a
    fresh index). It costs that memory up front (70-140 B a block a rank);
    a rank may still hold more. At most ``max_blocks_per_rank`` and 2**24.
    :meth:`reserve` gives one rank such a hint later (a snapshot's block count).

    A rank's view travels as bytes (router checkpoints, peer clones):
    :meth:`export_rank` and :meth:`import_rank`, refused by an index whose
    :meth:`view_format` differs.
    """

    def __init__(
        self,
        block_size: int,
        *,
        seed: int = 0,
        groups: Collection[int | None] = (0, None),
        max_block_size: int = DEFAULT_LIMITS.max_block_size,
        max_blocks_per_rank: int | None = 1 << 21,
        expected_blocks_per_rank: int = 0,
        max_bytes: int | None = None,
    ) -> None:
        if not 1 <= block_size <= max_block_size:
            raise ValueError(f"block_size must be in 1..{max_block_size}, got {block_size}")
        if max_blocks_per_rank is not None and max_blocks_per_rank < 1:
            raise ValueError(f"max_blocks_per_rank must be >= 1, got {max_blocks_per_rank}")
        if max_bytes is not None and max_bytes < 1:
            raise ValueError(f"max_bytes must be >= 1 (None: no bound), got {max_bytes}")
        if expected_blocks_per_rank < 0:
            raise ValueError(f"expected_blocks_per_rank must be >= 0, got {expected_blocks_per_rank}")
        if max_blocks_per_rank is not None:
            expected_blocks_per_rank = min(expected_blocks_per_rank, max_blocks_per_rank)
        self.block_size = block_size
        self.max_block_size = max_block_size
        self.max_blocks_per_rank = max_blocks_per_rank
        self.max_bytes = max_bytes
        self.seed = seed & _MASK
        self._scheme: KeyScheme = key_scheme(self.seed, block_size)
        self._root = self._scheme.root()
        self._groups = frozenset(groups)
        self._lock = threading.Lock()
        self._core = Index(
            max_blocks_per_rank or 0,
            expected_blocks_per_rank=expected_blocks_per_rank,
            max_bytes=max_bytes or 0,
        )
        self._sids: dict[RankKey, int] = {}
        # reserve() hints of ranks not seen yet: taken when the rank is.
        self._hints: dict[RankKey, int] = {}
        # Rank slot -> name (None: free), what the native match reports by.
        self._names: list[RankKey | None] = []
        self._free_sids: list[int] = []
        self._workers: dict[str, set[int]] = {}
        # apply_payload's native path compares groups in C: ints and None only.
        native_groups = all(g is None or type(g) is int for g in self._groups)
        # The native calls' per-index arguments, given once (the core counts
        # its own payloads and marks ranks over cap; stats() adds these).
        self._core.configure(
            self._scheme.native, self._root, max_block_size,
            self._groups if native_groups else None, _TIER_OF, self._names,
        )  # fmt: skip
        # What the general path (apply) counted.
        self._orphan_stores = 0
        self._unknown_removals = 0
        self._ignored = 0
        self._malformed = 0
        self._refused = 0

    # --- the sink --------------------------------------------------------------

    def apply(self, worker_id: str, rank: int, batch: KVEventBatch) -> None:
        """Apply one batch of events from ``(worker_id, rank)``, in order."""
        with self._lock:
            sid = self._sids.get((worker_id, rank))
            if sid is None:
                sid = self._add_rank(worker_id, rank)
            groups = self._groups
            for ev in batch.events:
                if isinstance(ev, BlockStored):
                    if ev.group_idx not in groups:
                        self._ignored += 1
                    elif ev.block_hashes:
                        self._store(sid, ev)
                elif isinstance(ev, BlockRemoved):
                    if ev.group_idx not in groups:
                        self._ignored += 1
                    elif ev.block_hashes:
                        self._remove(sid, ev)
                elif isinstance(ev, AllBlocksCleared):
                    self._core.clear_rank(sid)

    def apply_payload(
        self,
        worker_id: str,
        rank: int,
        payload: bytes | bytearray | memoryview,
        limits: DecodeLimits = DEFAULT_LIMITS,
    ) -> None:
        """``apply(worker_id, rank, decode_batch(payload, limits))``, in one native pass.

        The batches engines send go from their msgpack straight into the
        tables, with no Python object per event or block; any other payload
        (rarer dialect forms, a rank's first batch) takes the general path.
        Either way the index ends as ``apply`` leaves it, and a payload
        ``decode_batch`` refuses raises its :class:`WireError` with nothing
        applied.
        """
        with self._lock:
            sid = self._sids.get((worker_id, rank))
            if sid is not None and self._core.apply_payload(sid, payload, limits):
                return
        self.apply(worker_id, rank, decode_batch(payload, limits))

    def clear(self, worker_id: str, rank: int) -> None:
        """Forget every block of one rank (its state is about to be rebuilt)."""
        with self._lock:
            sid = self._sids.get((worker_id, rank))
            if sid is not None:
                self._core.clear_rank(sid)

    def remove_worker(self, worker_id: str) -> None:
        """Forget a worker and all its ranks."""
        with self._lock:
            for hinted in [k for k in self._hints if k[0] == worker_id]:
                del self._hints[hinted]
            for sid in sorted(self._workers.pop(worker_id, ())):
                self._core.forget_rank(sid)
                name = self._names[sid]
                assert name is not None
                del self._sids[name]
                self._names[sid] = None
                heapq.heappush(self._free_sids, sid)

    def add_rank(self, worker_id: str, rank: int) -> None:
        """Make room for ``(worker_id, rank)`` before its first event (nothing if known).

        A router announces the ranks it follows before they send (the Subscriber
        does): each key's holder set widens every 64 ranks, copying the shared
        table, which costs nothing while it is empty and about 16 s of CPU when
        1,024 ranks are first seen one after another as their snapshots arrive.
        """
        with self._lock:
            if (worker_id, rank) not in self._sids:
                self._add_rank(worker_id, rank)

    def reserve(self, worker_id: str, rank: int, blocks: int) -> None:
        """A capacity hint: ``(worker_id, rank)`` is about to hold about ``blocks``.

        What a snapshot (or a checkpoint, a clone, a replay) announces before
        its events: the rank's table, and the shared table's share, are sized
        for that many blocks at its next store, so a fresh rank's load runs at
        the presized speed of ``expected_blocks_per_rank`` instead of growing
        its tables a doubling at a time. The rank's table keeps at least that
        size (over clears too) until its next hint or its removal. A hint for
        a rank not seen yet waits for its first event; one the memory budget
        has no room for is dropped (a hint, never a refusal).
        """
        if blocks < 0:
            raise ValueError(f"blocks must be >= 0, got {blocks}")
        with self._lock:
            sid = self._sids.get((worker_id, rank))
            if sid is None:
                self._hints[(worker_id, rank)] = blocks
            else:
                self._core.reserve(sid, blocks)

    # --- a rank's view as bytes ------------------------------------------------

    def view_format(self) -> bytes:
        """What :meth:`export_rank`'s bytes mean: the view's kind and layout, and the
        key parameters (block size, seed, groups, key scheme). A view is only
        meaningful to an index whose format is equal: a loader compares them."""
        groups = sorted(self._groups, key=lambda g: (g is not None, repr(g)))
        return (
            f"kvwire.PrefixIndex rank view {VIEW_VERSION}; keys {KEY_SCHEME_VERSION}; "
            f"block_size {self.block_size}; seed {self.seed}; groups {groups!r}"
        ).encode()

    def export_rank(self, worker_id: str, rank: int) -> bytes:
        """Everything the index holds for ``(worker_id, rank)``, as bytes, in one native pass.

        Per engine hash: its key, position and store count per tier; and the
        rank's over-cap mark. An unknown rank gives an empty view. 32 B a
        block and a 24 B header, little-endian, checksummed (layout in
        ``_core.c``); :meth:`import_rank` reads it.
        """
        with self._lock:
            return self._core.export_rank(self._sids.get((worker_id, rank)))

    def import_rank(self, worker_id: str, rank: int, view: bytes | bytearray | memoryview) -> None:
        """Replace what ``(worker_id, rank)`` holds with an :meth:`export_rank` view.

        The index then answers, and later events apply, exactly as if the
        events behind the view had been applied here (its lifetime counters
        apart: they count events this index saw). The view is checked whole
        first: a truncated, corrupt or foreign one, or one past
        ``max_blocks_per_rank``, raises ``ValueError`` with the index as it
        was. The caller must have compared :meth:`view_format` (a view of
        another block size or seed reads as valid and matches nothing). One
        that would take the index past ``max_bytes`` leaves the rank empty
        and over cap, like a refused store.
        """
        try:
            self.import_ranks([(worker_id, rank, view)])
        except ValueError as exc:
            raise ValueError(exc.args[0]) from None

    def import_ranks(
        self, views: Sequence[tuple[str, int, bytes | bytearray | memoryview]]
    ) -> None:
        """:meth:`import_rank` of many ranks in one native pass (a checkpoint, a clone).

        Every view is checked before the index changes: a bad one raises
        ``ValueError(why, i)`` (``views[i]``) with nothing imported. The
        shared table is sized once for them all and their keys go in in the
        order of their homes, so a whole router's view loads at memory speed,
        not a cache miss a block. With ``max_bytes`` a view past the budget
        leaves its rank empty and over cap, as :meth:`import_rank` does, and
        a ``MemoryError`` clears the ranks of the call again.
        """
        with self._lock:
            sids: list[int] = []
            new: list[RankKey] = []
            seen: set[RankKey] = set()
            # The slots new ranks will take, named only once their views are in
            # (the order _add_rank takes them in: the free ones lowest first).
            free = sorted(self._free_sids)
            end = len(self._names)
            for i, (worker_id, rank, _) in enumerate(views):
                name = (worker_id, rank)
                if name in seen:
                    raise ValueError(f"two views of worker {worker_id} rank {rank}", i)
                seen.add(name)
                sid = self._sids.get(name)
                if sid is None:
                    new.append(name)
                    if free:
                        sid = free.pop(0)
                    else:
                        sid, end = end, end + 1
                sids.append(sid)
            try:
                self._core.import_ranks(sids, [view for _, _, view in views])
            except MemoryError:
                for sid in sids:  # (a budget's one-at-a-time import may have begun)
                    with contextlib.suppress(IndexError):
                        self._core.clear_rank(sid)
                raise
            for worker_id, rank in new:
                self._add_rank(worker_id, rank)

    # --- queries ---------------------------------------------------------------

    def keys(
        self,
        tokens: Any,
        *,
        lora_name: str | None = None,
        extra_keys: Sequence[Any] | None = None,
        cache_salt: Any = None,
    ) -> U64:
        """This index's key of each full block of ``tokens`` (see :func:`block_keys`)."""
        return self._scheme.chain(tokens, self._scheme.root(lora_name, cache_salt), 0, extra_keys)

    def match(
        self,
        tokens: Any,
        *,
        lora_name: str | None = None,
        extra_keys: Sequence[Any] | None = None,
        cache_salt: Any = None,
    ) -> Matches[RankKey, int]:
        """Matched blocks per (worker, rank): the longest prefix it holds from block 0.

        Ranks holding nothing of the prompt are left out. A partial last block
        is not counted. Keys are computed as the match goes (one native call):
        a list's items past the end of the longest match are not read.

        The result is a read-only :class:`Matches` mapping (equal to the dict of
        the same items), a snapshot of the walk: it builds only what is read of
        it (``len``, ``best(n)`` and ``max_depth`` build nothing), so a router
        reading a few holders does not pay for every holder of a popular prefix.
        """
        if type(tokens) is list and lora_name is None and extra_keys is None and cache_salt is None:
            # The common call, a tokenizer's list: straight to the native walk.
            with self._lock:
                return self._core.match_list(tokens)
        return self._match_tokens(tokens, lora_name, extra_keys, cache_salt, None)

    def match_tiers(
        self,
        tokens: Any,
        *,
        lora_name: str | None = None,
        extra_keys: Sequence[Any] | None = None,
        cache_salt: Any = None,
    ) -> Matches[RankKey, TierDepths]:
        """Like :meth:`match`, split by tier (see :class:`TierDepths`)."""
        return self._match_tokens(tokens, lora_name, extra_keys, cache_salt, TierDepths)

    def _match_tokens(
        self,
        tokens: Any,
        lora_name: str | None,
        extra_keys: Sequence[Any] | None,
        cache_salt: Any,
        tiers_type: type[TierDepths] | None,
    ) -> Matches[RankKey, Any]:
        scheme = self._scheme
        src, packed, n_tokens = token_source(tokens)
        extra = None
        if extra_keys is not None:
            extra = scheme.extra_hashes(extra_keys, n_tokens // self.block_size)
        start = self._root
        if lora_name is not None or cache_salt is not None:
            start = scheme.root(lora_name, cache_salt)
        with self._lock:
            return self._core.match_tokens(
                scheme.native, src, packed, start, extra, self._names, tiers_type
            )

    def match_keys(self, keys: U64) -> Matches[RankKey, int]:
        """:meth:`match` for keys computed already (with this index's seed), the
        prompt's from its first block (as :meth:`keys` and :func:`block_keys` give them)."""
        with self._lock:
            try:  # a contiguous 64-bit array goes straight in (the common call: one frame)
                return self._core.match(keys, self._names, None)
            except (TypeError, ValueError, BufferError):
                pass
        return self._match_keys(keys, None)

    def match_keys_tiers(self, keys: U64) -> Matches[RankKey, TierDepths]:
        """:meth:`match_tiers` for keys computed already."""
        return self._match_keys(keys, TierDepths)

    def _match_keys(self, keys: Any, tiers_type: type[TierDepths] | None) -> Matches[RankKey, Any]:
        with self._lock:
            try:  # a contiguous 64-bit array goes straight in
                return self._core.match(keys, self._names, tiers_type)
            except (TypeError, ValueError, BufferError):
                pass
        keys = np.ascontiguousarray(keys, dtype=np.uint64)
        with self._lock:
            return self._core.match(keys, self._names, tiers_type)

    def blocks(self, worker_id: str, rank: int) -> set[int]:
        """The engine hashes this index believes ``(worker_id, rank)`` holds."""
        with self._lock:
            sid = self._sids.get((worker_id, rank))
            return set() if sid is None else set(self._core.blocks(sid))

    def ranks(self) -> list[RankKey]:
        """Every (worker, rank) the index has had events from and not removed."""
        with self._lock:
            return list(self._sids)

    def has_rank(self, worker_id: str, rank: int) -> bool:
        """Whether events from ``(worker_id, rank)`` have been applied."""
        return (worker_id, rank) in self._sids

    def rank_blocks(self, worker_id: str, rank: int) -> int:
        """How many engine hashes ``(worker_id, rank)`` holds (0 when unknown); O(1)."""
        with self._lock:
            sid = self._sids.get((worker_id, rank))
            return 0 if sid is None else self._core.rank_stats(sid)[0]

    def over_cap(self, worker_id: str, rank: int) -> bool:
        """Whether a store of this rank was refused at ``max_blocks_per_rank`` or
        ``max_bytes`` since its last clear: its view is incomplete (never wrong in
        what it claims)."""
        sid = self._sids.get((worker_id, rank))
        return sid is not None and self._core.rank_stats(sid)[2] != 0

    def cap_reason(self, worker_id: str, rank: int) -> str | None:
        """Why the rank is over cap: ``"max_blocks_per_rank"``, ``"max_bytes"`` or
        both (comma-separated); ``None`` when it is not."""
        sid = self._sids.get((worker_id, rank))
        mark = 0 if sid is None else self._core.rank_stats(sid)[2]
        why = [n for bit, n in ((CAP_BLOCKS, "max_blocks_per_rank"), (CAP_BYTES, "max_bytes")) if mark & bit]
        return ", ".join(why) or None

    def stats(self) -> IndexStats:
        """Current sizes and lifetime counters."""
        with self._lock:
            per_rank = [self._core.rank_stats(sid) for sid in self._sids.values()]
            orphans, unknown, ignored, malformed, refused, over_budget = self._core.counters
            return IndexStats(
                blocks=self._core.nodes,
                holders=sum(entries for entries, _, _ in per_rank),
                ranks=len(per_rank),
                detached=sum(detached for _, detached, _ in per_rank),
                orphan_stores=self._orphan_stores + orphans,
                unknown_removals=self._unknown_removals + unknown,
                ignored_events=self._ignored + ignored,
                malformed_stores=self._malformed + malformed,
                memory_bytes=self._core.memory,
                refused_stores=self._refused + refused,
                ranks_over_cap=sum(1 for _, _, over in per_rank if over),
                refused_over_budget=over_budget,
            )

    # --- applying events ---------------------------------------------------------

    def _add_rank(self, worker_id: str, rank: int) -> int:
        name = (worker_id, rank)
        if self._free_sids:
            sid = heapq.heappop(self._free_sids)
            self._names[sid] = name
        else:
            sid = len(self._names)
            self._names.append(name)
        self._core.ensure_rank(sid)
        self._sids[name] = sid
        self._workers.setdefault(worker_id, set()).add(sid)
        hint = self._hints.pop(name, None)
        if hint is not None:
            self._core.reserve(sid, hint)
        return sid

    def _store(self, sid: int, ev: BlockStored) -> None:
        """One store: the native side resolves the parent and keys the blocks.

        Tokens it cannot use (missing, mis-sized, not integers, too few extra
        keys, a block size outside ``1..max_block_size``) make unmatchable keys
        from the hashes alone, counted as malformed. Blocks of another size
        than the index's could never match a prompt keyed at its size: they
        are kept under such keys too, without any per-token work (a hostile
        engine varying its block size costs the index nothing more).
        """
        scheme = self._scheme
        bs = ev.block_size
        usable = bs == self.block_size
        other_size = not usable and type(bs) is int and 1 <= bs <= self.max_block_size
        tokens: Any = ev.token_ids
        packed = type(tokens) is TokenIds
        if packed:
            tokens = tokens.raw
        elif usable and type(tokens) is not list:
            try:
                tokens, packed, _ = token_source(tokens)
            except (TypeError, ValueError):
                usable = False
        parent = ev.parent_block_hash
        start = scheme.root(ev.lora_name, ev.cache_salt) if parent is None and usable else 0
        extra = None
        if ev.extra_keys is not None and usable:
            try:
                extra = scheme.extra_hashes(ev.extra_keys, len(ev.block_hashes))
            except (TypeError, ValueError):
                usable = False
        hashes: Sequence[int] = ev.block_hashes
        tier = tier_of(ev.medium)
        args = (tokens if usable else None, packed, start, extra, tier)
        try:
            flags = self._core.store(sid, scheme.native, hashes, parent, *args)
        except TypeError:
            # Hashes in another form (digest bytes, numpy ints): normalise, retry.
            try:
                hashes = [normalise_hash(h) for h in hashes]
                parent = None if parent is None else normalise_hash(parent)
            except WireError:
                self._malformed += 1
                return
            flags = self._core.store(sid, scheme.native, hashes, parent, *args)
        if flags & OVER_CAP:  # the core marked the rank over cap
            self._refused += 1
            return
        if flags & ORPHAN:
            self._orphan_stores += 1
        if flags & MALFORMED and not other_size:
            self._malformed += 1

    def _remove(self, sid: int, ev: BlockRemoved) -> None:
        tier = tier_of(ev.medium)
        try:
            unknown = self._core.remove(sid, ev.block_hashes, tier)
        except TypeError:
            try:
                hashes = [normalise_hash(h) for h in ev.block_hashes]
            except WireError:
                self._malformed += 1
                return
            unknown = self._core.remove(sid, hashes, tier)
        self._unknown_removals += unknown
