"""The prefix index: which (worker, rank) holds how much of a prompt's prefix.

It is a sink for the subscriber: ``apply(worker_id, rank, batch)`` and
``clear(worker_id, rank)``. Engine block hashes stay opaque ids; the index
computes its own chained content keys from each store's token ids (see
:mod:`kvwire.prefix_index.keys`), so a router matches prompts with the same
function and never needs the engine's hash.

Storage, all in flat numpy tables (:class:`~kvwire.prefix_index.table.U64Table`):

- per (worker, rank): engine hash -> (our key, one store count per tier).
  Counts make removals reference counted: an engine may store one hash twice
  and remove one copy. Dropping a rank walks only its own table.
- one shared node table: our key -> a bitmask of the ranks holding it (one bit
  per rank, 64 ranks a word), per-tier masks once any non-GPU medium shows
  up, the block's position, and a holder count that frees the node at zero.

A store whose parent hash the rank never reported (a late join, a partial
replay) starts a detached chain: its keys derive from the unknown parent, so
they can be removed and extended but never match a prompt.

Events are applied in bulk: consecutive stores (or removals) of one rank go
through the tables as one array operation. ``coalesce_blocks`` lets events
from many batches gather first; every query, ``clear`` and ``flush()`` applies
what is pending, so readers always see every event applied before them.
"""

from __future__ import annotations

import array
import heapq
import threading
from collections.abc import Collection, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

import numpy as np
import numpy.typing as npt

from kvwire.prefix_index.keys import KeyScheme, as_token_array, key_scheme
from kvwire.prefix_index.table import U64Table, all_, any_, sorted_, where_
from kvwire.wire import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEvent,
    KVEventBatch,
    WireError,
    normalise_hash,
)

__all__ = [
    "CPU",
    "GPU",
    "STORAGE",
    "IndexStats",
    "PrefixIndex",
    "RankKey",
    "TierDepths",
    "tier_of",
]

U64 = npt.NDArray[np.uint64]
I64 = npt.NDArray[np.int64]
I32 = npt.NDArray[np.int32]
U8 = npt.NDArray[np.uint8]
RankKey = tuple[str, int]

GPU = 0
CPU = 1
STORAGE = 2
_TIERS = (GPU, CPU, STORAGE)
_COUNT_COLS = ("c0", "c1", "c2")
_TIER_PREFIX = ("gpu", "cpu", "sto")
_MASK = 0xFFFF_FFFF_FFFF_FFFF
_AR32 = np.arange(1 << 16, dtype=np.int32)
_DEPTH_LIMIT = (1 << 31) - (1 << 20)


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
    index's arrays) return to zero when everything is removed.
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


class _Rank:
    """One (worker, rank): its engine-hash table and bookkeeping."""

    __slots__ = ("bit", "detached", "multi", "name", "sid", "table", "word")

    def __init__(self, name: RankKey, sid: int, tiers: bool) -> None:
        self.name = name
        self.sid = sid
        self.word = sid >> 6
        self.bit = np.uint64(1 << (sid & 63))
        cols: dict[str, Any] = {"key": np.uint64, "c0": np.uint32}
        if tiers:
            cols.update(c1=np.uint32, c2=np.uint32)
        self.table = U64Table(cols)
        # Keys that more than one engine hash of this rank maps to:
        # key -> [entries, entries on GPU, on CPU, on storage].
        self.multi: dict[int, list[int]] = {}
        self.detached = 0


class _Stores(NamedTuple):
    """A run of stores, flattened: one row per listed block."""

    hashes: U64
    keys: U64
    depths: I32
    tiers: U8 | None  # None: every block in ``tier``
    tier: int
    detached: int


def _u64(hashes: Sequence[int]) -> tuple[U64, Sequence[int]]:
    """Engine hashes as a uint64 array, and as normalised ints."""
    try:
        return np.frombuffer(array.array("Q", hashes), dtype=np.uint64), hashes
    except (OverflowError, TypeError):
        norm = [normalise_hash(h) for h in hashes]
        return np.array(norm, dtype=np.uint64), norm


def _bits(x: int) -> list[int]:
    out = []
    while x:
        low = x & -x
        out.append(low.bit_length() - 1)
        x ^= low
    return out


class PrefixIndex:
    """Which (worker, rank) holds the longest prefix of a prompt; an event sink.

    ``block_size`` and ``seed`` fix the key function (routers computing keys
    themselves must use the same). ``groups`` lists the KV-cache group indices
    whose events count (``None`` is what engines without groups send); events
    of other groups are ignored and counted. ``coalesce_blocks``: gather
    events until this many blocks are pending before applying them (0: apply
    each batch at once); queries always apply pending events first.
    Thread-safe.
    """

    def __init__(
        self,
        block_size: int,
        *,
        seed: int = 0,
        groups: Collection[int | None] = (0, None),
        coalesce_blocks: int = 16384,
    ) -> None:
        self.block_size = block_size
        self.seed = seed & _MASK
        self._scheme: KeyScheme = key_scheme(self.seed, block_size)
        self._groups = frozenset(groups)
        self._coalesce = coalesce_blocks
        self._lock = threading.Lock()
        self._nodes = U64Table({"nh": np.uint32, "depth": np.int32, "any0": np.uint64})
        self._words = 1
        self._tiers = False
        self._ranks: dict[RankKey, _Rank] = {}
        self._by_sid: list[_Rank | None] = []
        self._free_sids: list[int] = []
        self._workers: dict[str, set[int]] = {}
        self._pending: list[tuple[_Rank, KVEvent]] = []
        self._pending_blocks = 0
        self._orphan_stores = 0
        self._unknown_removals = 0
        self._ignored = 0
        self._malformed = 0

    # --- the sink --------------------------------------------------------------

    def apply(self, worker_id: str, rank: int, batch: KVEventBatch) -> None:
        """Apply one batch of events from ``(worker_id, rank)``, in order."""
        with self._lock:
            r = self._rank(worker_id, rank)
            groups = self._groups
            pending = self._pending
            for ev in batch.events:
                if isinstance(ev, BlockStored | BlockRemoved):
                    if ev.group_idx not in groups:
                        self._ignored += 1
                    elif ev.block_hashes:
                        pending.append((r, ev))
                        self._pending_blocks += len(ev.block_hashes)
                elif isinstance(ev, AllBlocksCleared):
                    pending.append((r, ev))
            if self._pending_blocks >= self._coalesce:
                self._flush()

    def flush(self) -> None:
        """Apply every pending event now (queries do this themselves)."""
        with self._lock:
            self._flush()

    def clear(self, worker_id: str, rank: int) -> None:
        """Forget every block of one rank (its state is about to be rebuilt)."""
        with self._lock:
            self._flush()
            r = self._ranks.get((worker_id, rank))
            if r is not None:
                self._clear_rank(r)

    def remove_worker(self, worker_id: str) -> None:
        """Forget a worker and all its ranks."""
        with self._lock:
            self._flush()
            for sid in sorted(self._workers.pop(worker_id, ())):
                r = self._by_sid[sid]
                assert r is not None
                self._clear_rank(r)
                del self._ranks[r.name]
                self._by_sid[sid] = None
                heapq.heappush(self._free_sids, sid)

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
        scheme = self._scheme
        arr = as_token_array(tokens)
        extra = None
        if extra_keys is not None:
            extra = scheme.extra_hashes(extra_keys, arr.shape[0] // self.block_size)
        return scheme.chain(arr, scheme.root(lora_name, cache_salt), 0, extra)

    def match(
        self,
        tokens: Any,
        *,
        lora_name: str | None = None,
        extra_keys: Sequence[Any] | None = None,
        cache_salt: Any = None,
    ) -> dict[RankKey, int]:
        """Matched blocks per (worker, rank): the longest prefix it holds from block 0.

        Ranks holding nothing of the prompt are left out. A partial last block
        is not counted.
        """
        keys = self.keys(tokens, lora_name=lora_name, extra_keys=extra_keys, cache_salt=cache_salt)
        return self.match_keys(keys)

    def match_tiers(
        self,
        tokens: Any,
        *,
        lora_name: str | None = None,
        extra_keys: Sequence[Any] | None = None,
        cache_salt: Any = None,
    ) -> dict[RankKey, TierDepths]:
        """Like :meth:`match`, split by tier (see :class:`TierDepths`)."""
        keys = self.keys(tokens, lora_name=lora_name, extra_keys=extra_keys, cache_salt=cache_salt)
        return self.match_keys_tiers(keys)

    def match_keys(self, keys: U64) -> dict[RankKey, int]:
        """:meth:`match` for keys computed already (with this index's seed)."""
        out: dict[RankKey, int] = {}
        with self._lock:
            if self._pending:
                self._flush()
            nodes = self._nodes
            rows = nodes.find_prefix(keys)
            if rows.shape[0] == 0:
                return out
            cols = nodes.cols
            by_sid = self._by_sid
            for w in range(self._words):
                acc = np.bitwise_and.accumulate(cols[f"any{w}"][rows])
                for sid, depth in _depths(acc, w << 6):
                    r = by_sid[sid]
                    if r is not None:
                        out[r.name] = depth
        return out

    def match_keys_tiers(self, keys: U64) -> dict[RankKey, TierDepths]:
        """:meth:`match_tiers` for keys computed already."""
        with self._lock:
            if self._pending:
                self._flush()
            nodes = self._nodes
            rows = nodes.find_prefix(keys)
            if rows.shape[0] == 0:
                return {}
            cols = nodes.cols
            total: dict[int, int] = {}
            gpu: dict[int, int] = {}
            fast: dict[int, int] = {}
            for w in range(self._words):
                anyw = cols[f"any{w}"][rows]
                total.update(_depths(np.bitwise_and.accumulate(anyw), w << 6))
                if self._tiers:
                    g = cols[f"gpu{w}"][rows]
                    gc = g | cols[f"cpu{w}"][rows]
                    gpu.update(_depths(np.bitwise_and.accumulate(g), w << 6))
                    fast.update(_depths(np.bitwise_and.accumulate(gc), w << 6))
            out: dict[RankKey, TierDepths] = {}
            for sid, depth in total.items():
                r = self._by_sid[sid]
                if r is None:
                    continue
                if self._tiers:
                    g_d = gpu.get(sid, 0)
                    f_d = fast.get(sid, 0)
                    out[r.name] = TierDepths(g_d, f_d - g_d, depth - f_d)
                else:
                    out[r.name] = TierDepths(depth, 0, 0)
            return out

    def blocks(self, worker_id: str, rank: int) -> set[int]:
        """The engine hashes this index believes ``(worker_id, rank)`` holds."""
        with self._lock:
            self._flush()
            r = self._ranks.get((worker_id, rank))
            if r is None or r.table.count == 0:
                return set()
            t = r.table
            return set(t.keys[t.positions()].tolist())

    def ranks(self) -> list[RankKey]:
        """Every (worker, rank) the index has had events from and not removed."""
        with self._lock:
            return list(self._ranks)

    def has_rank(self, worker_id: str, rank: int) -> bool:
        """Whether events from ``(worker_id, rank)`` have been applied."""
        return (worker_id, rank) in self._ranks

    def stats(self) -> IndexStats:
        """Current sizes and lifetime counters."""
        with self._lock:
            self._flush()
            ranks = list(self._ranks.values())
            return IndexStats(
                blocks=self._nodes.count,
                holders=sum(r.table.count for r in ranks),
                ranks=len(ranks),
                detached=sum(r.detached for r in ranks),
                orphan_stores=self._orphan_stores,
                unknown_removals=self._unknown_removals,
                ignored_events=self._ignored,
                malformed_stores=self._malformed,
                memory_bytes=self._nodes.nbytes() + sum(r.table.nbytes() for r in ranks),
            )

    # --- ranks -------------------------------------------------------------------

    def _rank(self, worker_id: str, rank: int) -> _Rank:
        key = (worker_id, rank)
        r = self._ranks.get(key)
        if r is not None:
            return r
        if self._free_sids:
            sid = heapq.heappop(self._free_sids)
        else:
            sid = len(self._by_sid)
            self._by_sid.append(None)
        while (sid >> 6) >= self._words:
            self._add_word()
        r = _Rank(key, sid, self._tiers)
        self._ranks[key] = r
        self._by_sid[sid] = r
        self._workers.setdefault(worker_id, set()).add(sid)
        return r

    def _add_word(self) -> None:
        w = self._words
        self._nodes.add_column(f"any{w}", np.uint64)
        if self._tiers:
            for p in _TIER_PREFIX:
                self._nodes.add_column(f"{p}{w}", np.uint64)
        self._words += 1

    def _enable_tiers(self) -> None:
        """First non-GPU medium: track per-tier holder masks from now on."""
        nodes = self._nodes
        for w in range(self._words):
            for p in _TIER_PREFIX:
                nodes.add_column(f"{p}{w}", np.uint64)
            nodes.cols[f"gpu{w}"][:] = nodes.cols[f"any{w}"]
        for r in self._ranks.values():
            r.table.add_column("c1", np.uint32)
            r.table.add_column("c2", np.uint32)
        self._tiers = True

    # --- applying events ---------------------------------------------------------

    def _flush(self) -> None:
        """Apply the pending events: per rank, in order, runs of a kind at once.

        Ranks only share the node table, whose final state does not depend on
        the order in which ranks update it, so grouping by rank is exact.
        """
        pending = self._pending
        if not pending:
            return
        self._pending = []
        self._pending_blocks = 0
        first = pending[0][0]
        if all(r is first for r, _ in pending):
            self._apply_rank(first, [ev for _, ev in pending])
            return
        by_rank: dict[int, tuple[_Rank, list[KVEvent]]] = {}
        for r, ev in pending:
            got = by_rank.get(r.sid)
            if got is None:
                by_rank[r.sid] = (r, [ev])
            else:
                got[1].append(ev)
        for r, evs in by_rank.values():
            self._apply_rank(r, evs)

    def _apply_rank(self, r: _Rank, events: list[KVEvent]) -> None:
        i = 0
        n = len(events)
        while i < n:
            kind = type(events[i])
            j = i + 1
            while j < n and type(events[j]) is kind:
                j += 1
            if kind is BlockStored:
                self._store_run(r, events[i:j])
            elif kind is BlockRemoved:
                self._remove_run(r, events[i:j])
            else:
                self._clear_rank(r)
            i = j

    def _store_run(self, r: _Rank, events: list[KVEvent]) -> None:
        parts = self._stores_of(r, events)
        if parts is not None:
            self._add(r, parts)

    def _stores_of(self, r: _Rank, events: list[KVEvent]) -> _Stores | None:
        """Keys of every block of a run of stores, resolving each parent in order.

        A parent is looked up in the rank's table first (the key it had when
        first stored wins), then among earlier stores of this run.
        """
        t = r.table
        node_cols = self._nodes.cols
        needed: set[int] = set()
        if len(events) > 1:
            for ev in events[1:]:
                if isinstance(ev, BlockStored) and ev.parent_block_hash is not None:
                    needed.add(ev.parent_block_hash & _MASK)
        local: dict[int, tuple[int, int]] = {}
        hashes_l: list[U64] = []
        keys_l: list[U64] = []
        depth_l: list[I32] = []
        tiers: list[int] = []
        sizes: list[int] = []
        detached_blocks = 0
        for ev in events:
            assert isinstance(ev, BlockStored)
            try:
                eh, hashes = _u64(ev.block_hashes)
            except WireError:
                self._malformed += 1
                continue
            n = eh.shape[0]
            tier = tier_of(ev.medium)
            if tier != GPU and not self._tiers:
                self._enable_tiers()
                node_cols = self._nodes.cols
            bs = ev.block_size
            scheme = self._scheme
            if bs != self.block_size and bs >= 1:
                scheme = key_scheme(self.seed, bs)
            parent = ev.parent_block_hash
            detached = False
            d0 = 0
            if parent is None:
                start = scheme.root(ev.lora_name, ev.cache_salt)
            else:
                parent &= _MASK
                prow = t.lookup_one(parent)
                nrow = self._nodes.lookup_one(int(t.cols["key"][prow])) if prow >= 0 else -1
                if nrow >= 0:
                    start = int(t.cols["key"][prow])
                    dd = int(node_cols["depth"][nrow])
                else:
                    got = local.get(parent)
                    if got is None:
                        detached = True
                        start = scheme.detached(parent)
                        self._orphan_stores += 1
                        dd = -1
                    else:
                        start, dd = got
                if dd < 0:
                    detached = True
                    d0 = ~dd + 1
                else:
                    d0 = dd + 1
            keys: U64 | None = None
            if bs >= 1 and len(ev.token_ids) == n * bs and d0 + n < _DEPTH_LIMIT:
                try:
                    extra = None
                    if ev.extra_keys is not None:
                        extra = scheme.extra_hashes(ev.extra_keys, n)
                    keys = scheme.chain(as_token_array(ev.token_ids), start, d0, extra)
                except (ValueError, TypeError, OverflowError):
                    keys = None
            if keys is None:
                # Unmatchable keys from the hashes alone, all at position 0 so
                # that a key always comes with the same position.
                self._malformed += 1
                keys = scheme.malformed(eh)
                detached = True
                depth = np.zeros(n, dtype=np.int32)
            elif n <= _AR32.shape[0]:
                depth = _AR32[:n] + np.int32(d0)
            else:
                depth = np.arange(d0, d0 + n, dtype=np.int32)
            if detached:
                np.invert(depth, out=depth)
                detached_blocks += n
            if needed:
                for h in needed.intersection(hashes):
                    if h not in local:
                        j = list(hashes).index(h)
                        local[h] = (int(keys[j]), int(depth[j]))
            hashes_l.append(eh)
            keys_l.append(keys)
            depth_l.append(depth)
            tiers.append(tier)
            sizes.append(n)
        if not hashes_l:
            return None
        if len(hashes_l) == 1:
            return _Stores(hashes_l[0], keys_l[0], depth_l[0], None, tiers[0], detached_blocks)
        tier_arr = None
        if any(x != tiers[0] for x in tiers):
            tier_arr = np.repeat(np.array(tiers, dtype=np.uint8), sizes)
        return _Stores(
            np.concatenate(hashes_l),
            np.concatenate(keys_l),
            np.concatenate(depth_l),
            tier_arr,
            tiers[0],
            detached_blocks,
        )

    def _presence(self, r: _Rank, rows: I64) -> U8:
        """Per entry, a bit per tier it is held in."""
        cols = r.table.cols
        p: U8 = (cols["c0"][rows] > 0).view(np.uint8)
        if self._tiers:
            p = p | ((cols["c1"][rows] > 0).view(np.uint8) << np.uint8(1))
            p |= (cols["c2"][rows] > 0).view(np.uint8) << np.uint8(2)
        return p

    def _add(self, r: _Rank, s: _Stores) -> None:
        """Count one more copy of every listed block in its tier."""
        t = r.table
        pos, new = t.upsert(s.hashes)
        cols = t.cols
        if s.tiers is None and all_(new):
            # Every block is new to this rank (the common case).
            cols["key"][pos] = s.keys
            cols[_COUNT_COLS[s.tier]][pos] = 1
            r.detached += s.detached
            if r.multi:
                n = pos.shape[0]
                pa = np.full(n, 1 << s.tier, dtype=np.uint8)
                self._node_update(r, s.keys, np.zeros(n, dtype=np.uint8), pa, s.depths)
            else:
                self._node_appear(r, s.keys, s.depths, np.uint8(1 << s.tier))
            return
        cols["key"][pos[new]] = s.keys[new]
        if s.detached:
            r.detached += int(np.count_nonzero(s.depths[new] < 0))
        # One row per entry: its first listing (whose key the entry keeps).
        uniq, first = np.unique(pos, return_index=True)
        pb = self._presence(r, uniq)
        if s.tiers is None:
            np.add.at(cols[_COUNT_COLS[s.tier]], pos, 1)
        else:
            for tier in _TIERS:
                sel = s.tiers == tier
                if any_(sel):
                    np.add.at(cols[_COUNT_COLS[tier]], pos[sel], 1)
        pa = self._presence(r, uniq)
        changed = pb != pa
        if any_(changed):
            rows = uniq[changed]
            self._node_update(
                r, cols["key"][rows], pb[changed], pa[changed], s.depths[first[changed]]
            )

    def _remove_run(self, r: _Rank, events: list[KVEvent]) -> None:
        """Count one copy fewer of every listed hash, in the listed tier."""
        hashes_l: list[U64] = []
        tiers: list[int] = []
        sizes: list[int] = []
        for ev in events:
            assert isinstance(ev, BlockRemoved)
            try:
                eh, _ = _u64(ev.block_hashes)
            except WireError:
                self._malformed += 1
                continue
            hashes_l.append(eh)
            tiers.append(tier_of(ev.medium))
            sizes.append(eh.shape[0])
        if not hashes_l:
            return
        total = sum(sizes)
        t = r.table
        if t.count == 0:
            self._unknown_removals += total
            return
        eh = hashes_l[0] if len(hashes_l) == 1 else np.concatenate(hashes_l)
        pos = t.lookup(eh)
        found = pos >= 0
        if len(set(tiers)) == 1:
            by_tier = [(tiers[0], pos[found])]
        else:
            tier_arr = np.repeat(np.array(tiers, dtype=np.uint8), sizes)[found]
            by_tier = [(x, pos[found][tier_arr == x]) for x in sorted(set(tiers))]
        touched = pos[found]
        uniq = np.unique(touched)
        pb = self._presence(r, uniq)
        cols = t.cols
        done = 0
        for tier, rows in by_tier:
            if tier != GPU and not self._tiers:
                continue
            u, times = np.unique(rows, return_counts=True)
            cnt = cols[_COUNT_COLS[tier]]
            cur = cnt[u]
            dec = np.minimum(cur, times.astype(cur.dtype))
            cnt[u] = cur - dec
            done += int(dec.sum())
        self._unknown_removals += total - done
        pa = self._presence(r, uniq)
        changed = pb != pa
        if not any_(changed):
            return
        rows = uniq[changed]
        pa_c = pa[changed]
        keys = cols["key"][rows]
        gone = rows[pa_c == 0]
        if gone.shape[0] and r.detached:
            npos = self._nodes.lookup(cols["key"][gone])
            r.detached -= int(np.count_nonzero(self._nodes.cols["depth"][npos] < 0))
        self._node_update(r, keys, pb[changed], pa_c, None)
        t.delete(gone)

    def _clear_rank(self, r: _Rank) -> None:
        """Drop every entry of one rank: work in proportion to its entries."""
        t = r.table
        if t.count == 0:
            return
        keys = t.cols["key"][t.positions()]
        if r.multi:
            tracked = np.array(list(r.multi), dtype=np.uint64)
            keys = keys[~np.isin(keys, tracked)]
            keys = np.concatenate([keys, tracked])
            r.multi.clear()
        self._node_vanish(r, keys)
        r.detached = 0
        t.clear()

    # --- node masks ----------------------------------------------------------------

    def _node_update(
        self, r: _Rank, keys: U64, pb: U8, pa: U8, depths: I32 | None
    ) -> None:
        """Entries of ``r`` with these keys went from tier bits ``pb`` to ``pa``.

        ``depths`` (positions, for entries that appear) may be None when none
        appears. Keys of entries no other entry of ``r`` shares are distinct.
        """
        n = keys.shape[0]
        if n == 0:
            return
        if r.multi:
            multi = r.multi
            klist = keys.tolist()
            tracked = []
            for i, k in enumerate(klist):
                # Tracking may end within this loop: the last entry of a key
                # then goes through the untracked path below.
                if k in multi:
                    self._update_tracked(r, k, int(pb[i]), int(pa[i]))
                    tracked.append(i)
            if tracked:
                keep = np.ones(n, dtype=np.bool_)
                keep[tracked] = False
                keys, pb, pa = keys[keep], pb[keep], pa[keep]
                if depths is not None:
                    depths = depths[keep]
        appear = (pb == 0) & (pa != 0)
        vanish = (pb != 0) & (pa == 0)
        if any_(appear):
            assert depths is not None
            self._node_appear(r, keys[appear], depths[appear], pa[appear])
        if any_(vanish):
            self._node_vanish(r, keys[vanish])
        if self._tiers:
            change = ~(appear | vanish) & (pb != pa)
            if any_(change):
                pos = self._nodes.lookup(keys[change])
                ok = pos >= 0
                self._set_tier_bits(r, pos[ok], pa[change][ok])

    def _set_tier_bits(self, r: _Rank, pos: I64, pa: Any) -> None:
        cols = self._nodes.cols
        w = r.word
        bit = r.bit
        nbit = ~bit
        pa = np.broadcast_to(pa, pos.shape)
        for tier in _TIERS:
            col = cols[f"{_TIER_PREFIX[tier]}{w}"]
            has = (pa & np.uint8(1 << tier)) != 0
            if all_(has):
                col[pos] |= bit
            elif not any_(has):
                col[pos] &= nbit
            else:
                col[pos[has]] |= bit
                col[pos[~has]] &= nbit

    def _node_appear(self, r: _Rank, keys: U64, depths: I32, pa: Any) -> None:
        """Entries with these keys appeared in ``r`` (tier bits ``pa``)."""
        nodes = self._nodes
        pos, new = nodes.upsert(keys)
        if pos.shape[0] > 1:
            srt = sorted_(pos)
            if any_(srt[1:] == srt[:-1]):
                # Two new entries share a key: apply the first of each, then
                # the rest, which then find the key held and start tracking it.
                nodes.cols["depth"][pos[new]] = depths[new]
                _, first = np.unique(pos, return_index=True)
                rest = np.ones(pos.shape[0], dtype=np.bool_)
                rest[first] = False
                pa_arr = np.broadcast_to(pa, keys.shape)
                self._node_appear(r, keys[first], depths[first], pa_arr[first])
                self._node_appear(r, keys[rest], depths[rest], pa_arr[rest])
                return
        cols = nodes.cols
        anyw = cols[f"any{r.word}"]
        bit = r.bit
        if all_(new):
            cols["depth"][pos] = depths
        else:
            cols["depth"][pos[new]] = depths[new]
            already = (anyw[pos] & bit) != 0
            if any_(already):
                # Another engine hash of this rank has the same key: track both.
                pa_arr = np.broadcast_to(pa, keys.shape)
                for i in where_(already).tolist():
                    key = int(keys[i])
                    if key in r.multi:
                        self._update_tracked(r, key, 0, int(pa_arr[i]))
                    else:
                        self._start_tracking(r, key, int(pos[i]), int(pa_arr[i]))
                keep = ~already
                pos = pos[keep]
                pa = pa_arr[keep]
        anyw[pos] |= bit
        nh = cols["nh"]
        nh[pos] += np.uint32(1)
        if self._tiers:
            self._set_tier_bits(r, pos, pa)

    def _node_vanish(self, r: _Rank, keys: U64) -> None:
        nodes = self._nodes
        pos = nodes.lookup(keys)
        pos = pos[pos >= 0]
        cols = nodes.cols
        nbit = ~r.bit
        w = r.word
        cols[f"any{w}"][pos] &= nbit
        if self._tiers:
            for p in _TIER_PREFIX:
                cols[f"{p}{w}"][pos] &= nbit
        nh = cols["nh"]
        left = nh[pos] - np.uint32(1)
        nh[pos] = left
        nodes.delete(pos[left == 0])

    def _start_tracking(self, r: _Rank, key: int, npos: int, pa: int) -> None:
        cols = self._nodes.cols
        w = r.word
        bit = int(r.bit)
        if self._tiers:
            held = [int(cols[f"{p}{w}"][npos]) & bit != 0 for p in _TIER_PREFIX]
        else:
            held = [True, False, False]
        counts = [2] + [int(held[t]) + ((pa >> t) & 1) for t in _TIERS]
        r.multi[key] = counts
        if self._tiers:
            self._set_tier_bits(r, np.array([npos], dtype=np.int64), np.uint8(pa | _bits_of(held)))

    def _update_tracked(self, r: _Rank, key: int, pb: int, pa: int) -> None:
        counts = r.multi[key]
        if pb == 0 and pa != 0:
            counts[0] += 1
        elif pb != 0 and pa == 0:
            counts[0] -= 1
        for t in _TIERS:
            counts[1 + t] += ((pa >> t) & 1) - ((pb >> t) & 1)
        if counts[0] <= 1:
            del r.multi[key]
        if self._tiers:
            npos = self._nodes.lookup_one(key)
            if npos >= 0:
                held = [counts[1 + t] > 0 for t in _TIERS]
                self._set_tier_bits(
                    r, np.array([npos], dtype=np.int64), np.uint8(_bits_of(held))
                )


def _bits_of(held: list[bool]) -> int:
    return sum(1 << i for i, h in enumerate(held) if h)


def _depths(acc: U64, base: int) -> list[tuple[int, int]]:
    """(rank id, depth) for each bit of a running AND of holder masks.

    ``acc`` only loses bits as it goes, so a bit's depth is where it is lost.
    """
    m = acc.shape[0]
    if m == 0:
        return []
    first = int(acc[0])
    if not first:
        return []
    last = int(acc[m - 1])
    out = [(base + bit, m) for bit in _bits(last)]
    if first == last:
        return out
    change = (acc[1:] != acc[:-1]).nonzero()[0]
    values = acc[change].tolist()
    values.append(last)
    for j, i in enumerate(change.tolist()):
        for bit in _bits(values[j] & ~values[j + 1]):
            out.append((base + bit, i + 1))
    return out
