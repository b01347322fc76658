"""The publisher's mirror of its own rank's cache, and consistent snapshots of it.

Every batch the sender thread encodes reaches :class:`Mirror` in seq order:
the sender pushes each payload onto a feed that the publisher's service thread
decodes and applies in large batches (a few times a second, and always before
a snapshot starts), so the GIL changes hands rarely. The batches ``publish()``
dropped on a full queue go the same way: those are never sent, but the
publisher keeps them (at most ``mirror_backlog``) for the mirror alone, so a
snapshot repairs such a drop instead of refusing.
A gap in the seqs the mirror sees means a batch it never learnt (that second
bound was exceeded too): the mirror then stops vouching for itself until an
``AllBlocksCleared`` resets it, and snapshots are refused (the subscriber ends
PARTIAL, never stale). A batch that cannot be encoded does the same.

Representation, compact because a rank holds millions of blocks:

- each ``BlockStored`` event is one immutable :class:`_Chain`: its hashes as a
  packed ``array('Q')``, its parent, and its token ids kept as the packed
  msgpack bytes they arrived in (no Python int per token or per hash);
- per medium, a table from block hash to the chain holding it: recent entries
  in a dict, merged every few thousand changes into an open-addressing table of
  numpy arrays (12 bytes a slot) by vectorised operations; removals of merged
  blocks wait in a list and are applied at the merge;
- copies of a hash stored again while held (engines count copies) in a side
  dict. A chain is dropped when it holds no block any more.

Snapshots. :meth:`Mirror.snapshot` first merges everything, freezes the list of
chains and, while the snapshot is served, logs every change the live stream
makes to a block's holders (their value at the start, once per block): "holders
at start" is the log's value, else the current one, so the snapshot is the state
as of ``next_seq`` however long serving takes. Chains come out parents first
across the whole snapshot (a chain whose parent block lives in another chain
waits for that one), in bounded chunks of ``BlockStored`` events; a fully live
chain goes out with its original packed token bytes. A block whose parent was
evicted before it (engines evict children first, so this is rare) goes out under
that parent's hash, which the snapshot does not hold: a subscriber keeps it on a
detached chain, never matched past the hole, never stale.
"""

from __future__ import annotations

import operator
import time
from array import array
from collections.abc import Iterator, Sequence
from typing import Any

import msgspec
import numpy as np
import numpy.typing as npt

from kvwire.wire import AllBlocksCleared, BlockRemoved, BlockStored, Dialect, KVEventBatch
from kvwire.wire.codec import StoredParts, encode_parts
from kvwire.wire.events import TokenIds

__all__ = ["Mirror", "SnapshotCursor"]

_tokens = msgspec.msgpack.Decoder(list[int])
_encoder = msgspec.msgpack.Encoder()
_U64 = (1 << 64) - 1
_GOLDEN = 0x9E3779B97F4A7C15
_NP_GOLDEN = np.uint64(_GOLDEN)
_SHIFTS = [np.uint64(n) for n in range(65)]
_EMPTY = -1
_DELETED = -2
_MERGE_EVERY = 16384  # changes (stores, removals) between merges into the table
_SNAPSHOT_GROUP = 8192  # blocks whose liveness a snapshot looks up at once

U64s = npt.NDArray[np.uint64]
_ident = operator.attrgetter("ident")


class _Chain(msgspec.Struct, gc=False, eq=False):
    """One stored event: blocks ``hashes`` under ``parent``, tokens packed.

    Not tracked by the cyclic garbage collector (it holds no cycle), compared
    by identity: a mirror of a million blocks must not make every collection
    walk it.
    """

    hashes: array[int]
    parent: int | None
    tokens: msgspec.Raw
    block_size: int
    medium: str | None
    lora: str | None
    extra: list[Any] | None
    group: int | None
    ident: int = -1
    live: int = 0

    def token_list(self) -> list[int]:
        out: list[int] = _tokens.decode(self.tokens)
        return out

    def hash_array(self) -> U64s:
        return np.frombuffer(self.hashes, dtype=np.uint64)


def _packed(tokens: Any) -> msgspec.Raw:
    """A private packed copy of an event's token ids (never a view into a payload)."""
    if type(tokens) is TokenIds:
        return tokens.raw.copy()
    return msgspec.Raw(_encoder.encode(list(tokens)))


class _Table:
    """Block hash -> chain id: open addressing, linear probing, numpy arrays (12 bytes a slot)."""

    __slots__ = ("filled", "keys", "live", "mask", "shift", "vals")

    def __init__(self, capacity: int = 1024) -> None:
        self.keys: U64s = np.zeros(capacity, dtype=np.uint64)
        self.vals: npt.NDArray[np.int32] = np.full(capacity, _EMPTY, dtype=np.int32)
        self.mask = capacity - 1
        self.shift = 65 - capacity.bit_length()
        self.filled = 0  # live entries and tombstones
        self.live = 0

    def _home(self, hs: U64s) -> npt.NDArray[np.intp]:
        return ((hs * _NP_GOLDEN) >> _SHIFTS[self.shift]).astype(np.intp)

    def find(self, hs: U64s) -> npt.NDArray[np.intp]:
        """The slot of each hash, -1 where absent."""
        idx = self._home(hs)
        out = np.full(len(hs), -1, dtype=np.intp)
        todo = np.arange(len(hs))
        keys, vals, mask = self.keys, self.vals, self.mask
        while todo.size:
            at = idx[todo]
            v = vals[at]
            hit = (v >= 0) & (keys[at] == hs[todo])
            out[todo[hit]] = at[hit]
            todo = todo[~hit & (v != _EMPTY)]
            idx[todo] = (idx[todo] + 1) & mask
        return out

    def find_one(self, h: int) -> int:
        """:meth:`find` for one hash, in plain Python (no array set-up)."""
        at = ((h * _GOLDEN) & _U64) >> self.shift
        keys, vals, mask = self.keys, self.vals, self.mask
        while True:
            v = int(vals[at])
            if v == _EMPTY:
                return -1
            if v >= 0 and int(keys[at]) == h:
                return at
            at = (at + 1) & mask

    def insert(self, hs: U64s, ids: npt.NDArray[np.int32]) -> None:
        """Add hashes known to be absent (and distinct) with their chain ids."""
        n = len(hs)
        if (self.filled + n) * 10 > len(self.keys) * 7:  # load <= 0.7, tombstones included
            self._rebuild(n)
        idx = self._home(hs)
        todo = np.arange(n)
        keys, vals, mask = self.keys, self.vals, self.mask
        reused = 0
        while todo.size:
            at = idx[todo]
            free = vals[at] < 0
            if free.any():
                slots, first = np.unique(at[free], return_index=True)
                winners = todo[free][first]
                reused += int(np.count_nonzero(vals[slots] == _DELETED))
                keys[slots] = hs[winners]
                vals[slots] = ids[winners]
                placed = np.zeros(n, dtype=bool)
                placed[winners] = True
                todo = todo[~placed[todo]]
            idx[todo] = (idx[todo] + 1) & mask
        self.filled += n - reused
        self.live += n

    def _rebuild(self, extra: int) -> None:
        live = self.vals >= 0
        keys, vals = self.keys[live], self.vals[live]
        capacity = len(self.keys)
        while (len(keys) + extra) * 2 > capacity:  # rebuilt at most half full
            capacity *= 2
        fresh = _Table(capacity)
        if len(keys):
            fresh._fill(keys, vals)
        self.keys, self.vals, self.mask, self.shift = (
            fresh.keys,
            fresh.vals,
            fresh.mask,
            fresh.shift,
        )
        self.filled, self.live = fresh.filled, fresh.live

    def _fill(self, hs: U64s, ids: npt.NDArray[np.int32]) -> None:
        """Place distinct hashes into this empty table in one pass (no probing loop).

        In order of home slot, each key takes the first slot at or after its
        home that the keys before it left: ``pos[i] = max(home[i], pos[i-1] + 1)``,
        a running maximum. Keys pushed past the end wrap around through
        :meth:`insert`.
        """
        home = self._home(hs)
        order = np.argsort(home)
        n = len(hs)
        rank = np.arange(n)
        pos = rank + np.maximum.accumulate(home[order] - rank)
        fits = pos <= self.mask
        slots, chosen = pos[fits], order[fits]
        self.keys[slots] = hs[chosen]
        self.vals[slots] = ids[chosen]
        self.filled = self.live = len(slots)
        rest = order[~fits]
        if rest.size:
            self.insert(hs[rest], ids[rest])

    def delete(self, slot: int) -> None:
        self.vals[slot] = _DELETED
        self.live -= 1

    @property
    def nbytes(self) -> int:
        return int(self.keys.nbytes + self.vals.nbytes)


class _Medium:
    """One medium's blocks: who holds each hash (see the module docstring)."""

    __slots__ = ("delta", "dups", "pending", "table")

    def __init__(self) -> None:
        self.delta: dict[int, _Chain] = {}  # recent: hash -> newest holder
        self.table = _Table()  # merged: hash -> holder id
        self.dups: dict[int, list[_Chain]] = {}  # further holders of a hash
        self.pending: list[int] = []  # removals of merged hashes, applied at the merge


_Holders = tuple[_Chain, ...]


class Mirror:
    """What a rank holds, as its own published events describe it (one thread only)."""

    def __init__(self) -> None:
        self._media: dict[str | None, _Medium] = {}
        self._by_id: list[_Chain | None] = []
        self._free_ids: list[int] = []
        self._cursors: list[SnapshotCursor] = []
        self._changes = 0
        self.next_seq = 0
        """The state described is the one after every batch below this seq."""
        self.distrust_reason: str | None = None
        """Why the mirror cannot vouch for itself (``None``: it can)."""

    # --- updates ---------------------------------------------------------------

    def apply(self, seq: int, batch: KVEventBatch) -> None:
        """Mirror batch ``seq``; a seq skipped since the last one makes the mirror untrusted."""
        self.apply_events(seq, batch.events)

    def apply_events(self, seq: int, events: Sequence[Any]) -> None:
        """:meth:`apply` for a batch's decoded events."""
        if seq != self.next_seq:
            self.distrust(f"batches {self.next_seq}..{seq - 1} were dropped before publishing")
        self.next_seq = seq + 1
        for e in events:
            kind = type(e)
            if kind is BlockStored:
                self._store(e)
            elif kind is BlockRemoved:
                self._remove(e)
            elif kind is AllBlocksCleared:
                self._clear()
        if self._changes >= _MERGE_EVERY:
            self._merge()

    def skip(self, seq: int, reason: str) -> None:
        """Batch ``seq`` was seen but cannot be mirrored (e.g. it did not encode)."""
        self.distrust(f"batch {seq}: {reason}")
        self.next_seq = seq + 1

    def distrust(self, reason: str) -> None:
        """Refuse snapshots until an ``AllBlocksCleared`` makes the state known again."""
        if self.distrust_reason is None:
            self.distrust_reason = reason

    def count_blocks(self) -> int:
        """Distinct (medium, hash) blocks held (merges first: exact)."""
        self._merge()
        return sum(m.table.live for m in self._media.values())

    @property
    def approx_blocks(self) -> int:
        """Blocks held, give or take removals not merged yet; cheap, any thread."""
        return sum(m.table.live + len(m.delta) for m in list(self._media.values()))

    def memory(self) -> int:
        """Bytes of the compact parts: tables, packed hashes and tokens (not the dicts)."""
        media = list(self._media.values())
        chains = [c for c in self._by_id if c is not None]
        return sum(m.table.nbytes for m in media) + sum(
            len(c.hashes) * 8 + len(c.tokens) for c in chains
        )

    def _medium(self, medium: str | None) -> _Medium:
        m = self._media.get(medium)
        if m is None:
            m = self._media[medium] = _Medium()
        return m

    def _new_chain(self, e: BlockStored) -> _Chain:
        chain = _Chain(
            array("Q", e.block_hashes), e.parent_block_hash, _packed(e.token_ids),
            e.block_size, e.medium, e.lora_name, e.extra_keys, e.group_idx,
        )  # fmt: skip
        if self._free_ids:
            chain.ident = self._free_ids.pop()
            self._by_id[chain.ident] = chain
        else:
            chain.ident = len(self._by_id)
            self._by_id.append(chain)
        return chain

    def _lost(self, chain: _Chain) -> None:
        """``chain`` no longer holds one of its blocks."""
        chain.live -= 1
        if not chain.live:
            self._by_id[chain.ident] = None
            self._free_ids.append(chain.ident)

    def _holders(self, m: _Medium, h: int, slot: int | None = None) -> _Holders:
        """Every chain holding ``h`` now (``slot``: its table slot, when known)."""
        out: list[_Chain] = []
        newest = m.delta.get(h)
        if newest is not None:
            out.append(newest)
        out.extend(m.dups.get(h, ()))
        if slot is None:
            slot = m.table.find_one(h)
        if slot >= 0:
            owner = self._by_id[int(m.table.vals[slot])]
            if owner is not None:
                out.append(owner)
        return tuple(out)

    def _log(self, medium: str | None, h: int, holders: _Holders) -> None:
        for cursor in self._cursors:
            cursor._note((medium, h), holders)

    def _store(self, e: BlockStored) -> None:
        medium = e.medium
        m = self._medium(medium)
        chain = self._new_chain(e)
        delta = m.delta
        setdefault = delta.setdefault
        logging = bool(self._cursors)
        before = len(delta)
        copies = 0
        for h in e.block_hashes:
            if logging:
                self._log(medium, h, self._holders(m, h))
            old = setdefault(h, chain)
            if old is not chain:  # held already: this is another copy
                m.dups.setdefault(h, []).append(old)
                delta[h] = chain
                copies += 1
        live = chain.live = len(delta) - before + copies
        self._changes += len(e.block_hashes)
        if not live:
            self._by_id[chain.ident] = None
            self._free_ids.append(chain.ident)

    def _remove(self, e: BlockRemoved) -> None:
        m = self._media.get(e.medium)
        if m is None:
            return
        logging = bool(self._cursors)
        delta, dups = m.delta, m.dups
        deferred = m.pending
        for h in e.block_hashes:
            if logging:
                self._log(e.medium, h, self._holders(m, h))
            chain = delta.pop(h, None)
            if chain is not None:
                copies = dups.get(h)
                if copies:
                    delta[h] = copies.pop()
                    if not copies:
                        del dups[h]
                self._lost(chain)
            elif h in dups:  # the newest copy is merged: any other copy goes first
                copies = dups[h]
                self._lost(copies.pop())
                if not copies:
                    del dups[h]
            elif logging:
                self._remove_merged(m, [h])
            else:
                deferred.append(h)
        self._changes += len(e.block_hashes)

    def _remove_merged(self, m: _Medium, hashes: list[int]) -> None:
        """Drop one merged copy of each hash (those never held are ignored)."""
        if not hashes:
            return
        table = m.table
        slots = table.find(np.fromiter(hashes, dtype=np.uint64, count=len(hashes)))
        found = np.flatnonzero(slots >= 0)
        if not found.size:
            return
        by_id = self._by_id
        vals = table.vals
        for i, slot in zip(found.tolist(), slots[found].tolist(), strict=True):
            ident = int(vals[slot])
            if ident < 0:  # removed twice in one go
                continue
            h = hashes[i]
            copies = m.dups.get(h)
            if copies and h not in m.delta:
                vals[slot] = copies.pop().ident  # another copy becomes the merged one
                if not copies:
                    del m.dups[h]
            else:
                table.delete(slot)
            owner = by_id[ident]
            if owner is not None:
                self._lost(owner)

    def _merge(self) -> None:
        """Apply deferred removals, then move every recent entry into the compact table."""
        self._changes = 0
        for m in self._media.values():
            pending, m.pending = m.pending, []
            self._remove_merged(m, pending)
            delta = m.delta
            if not delta:
                continue
            n = len(delta)
            hs = np.fromiter(delta.keys(), dtype=np.uint64, count=n)
            ids = np.fromiter(map(_ident, delta.values()), dtype=np.int32, count=n)
            slots = m.table.find(hs)
            held = slots >= 0
            if held.any():  # merged already: the merged holder becomes a further copy
                by_id = self._by_id
                vals = m.table.vals
                for i in np.flatnonzero(held).tolist():
                    slot = int(slots[i])
                    older = by_id[int(vals[slot])]
                    if older is not None:
                        m.dups.setdefault(int(hs[i]), []).append(older)
                    vals[slot] = ids[i]
            m.table.insert(hs[~held], ids[~held])
            delta.clear()

    def _clear(self) -> None:
        for cursor in list(self._cursors):
            cursor._detach()
        self._media = {}
        self._by_id = []
        self._free_ids = []
        self._changes = 0
        self.distrust_reason = None

    # --- snapshots -----------------------------------------------------------------

    def snapshot(
        self, rank: int | None, *, chunk_blocks: int = 4096, dialect: Dialect = "map"
    ) -> SnapshotCursor:
        """Start a snapshot of the state as of :attr:`next_seq`; serve it with ``next_chunk()``."""
        self._merge()
        cursor = SnapshotCursor(self, rank, chunk_blocks, dialect)
        self._cursors.append(cursor)
        return cursor

    def _release(self, cursor: SnapshotCursor) -> None:
        if cursor in self._cursors:
            self._cursors.remove(cursor)

    @property
    def snapshots_in_progress(self) -> int:
        """Snapshots being served (each keeps a log of the changes since it began)."""
        return len(self._cursors)


class SnapshotCursor:
    """One snapshot being served, a chunk at a time, consistent as of ``next_seq``."""

    def __init__(
        self, mirror: Mirror, rank: int | None, chunk_blocks: int, dialect: Dialect
    ) -> None:
        if chunk_blocks < 1:
            raise ValueError(f"chunk_blocks must be >= 1, got {chunk_blocks}")
        self.next_seq = mirror.next_seq
        self.chunks = 0
        self.blocks = 0
        self._mirror = mirror
        self._rank = rank
        self._dialect: Dialect = dialect
        self._chunk_blocks = chunk_blocks
        self._media = mirror._media
        self._by_id = mirror._by_id
        self._undo: dict[tuple[str | None, int], _Holders] = {}
        chains = [c for c in mirror._by_id if c is not None]
        self._runs_left = self._walk(chains)
        self._stash: tuple[_Chain, int, int] | None = None
        self._done = False

    def _note(self, key: tuple[str | None, int], holders: _Holders) -> None:
        """The mirror is about to change ``key``'s holders: keep their first value."""
        if key not in self._undo:
            self._undo[key] = holders

    def _detach(self) -> None:
        """The mirror drops its tables for new ones: the old ones (and the log) stay as they are."""
        if self in self._mirror._cursors:
            self._mirror._cursors.remove(self)

    def _owner_at_start(self, medium: str | None, h: int) -> _Chain | None:
        """A chain that held ``h`` when the snapshot began."""
        holders = self._undo.get((medium, h))
        if holders is None:
            m = self._media.get(medium)
            if m is None:
                return None
            holders = self._holders_now(m, h)
        return holders[0] if holders else None

    def _holders_now(self, m: _Medium, h: int) -> _Holders:
        """Holders in the tables as they are (once cleared, the mirror no longer changes them)."""
        out: list[_Chain] = []
        if h in m.delta:
            out.append(m.delta[h])
        out.extend(m.dups.get(h, ()))
        slot = m.table.find_one(h)
        if slot >= 0:
            owner = self._by_id[int(m.table.vals[slot])]
            if owner is not None:
                out.append(owner)
        return tuple(out)

    def _live_flags(self, chains: list[_Chain]) -> list[list[bool]]:
        """Whether each chain held each of its blocks when the snapshot began.

        One vectorised table lookup for the whole group; blocks changed since
        the start (in the log) or held as further copies are checked one by one.
        """
        out: list[list[bool]] = [[] for _ in chains]
        by_medium: dict[str | None, list[int]] = {}
        for i, chain in enumerate(chains):
            by_medium.setdefault(chain.medium, []).append(i)
        undo = self._undo
        for medium, members in by_medium.items():
            m = self._media.get(medium)
            group = [chains[i] for i in members]
            if m is None:
                for i in members:
                    out[i] = [False] * len(chains[i].hashes)
                continue
            lengths = [len(c.hashes) for c in group]
            hs = np.concatenate([c.hash_array() for c in group])
            ids = np.repeat(np.fromiter(map(_ident, group), dtype=np.int32), lengths)
            slots = m.table.find(hs)
            live = (slots >= 0) & (m.table.vals[np.maximum(slots, 0)] == ids)
            flags = live.tolist()
            check = bool(undo or m.delta or m.dups)
            at = 0
            for i, chain, n in zip(members, group, lengths, strict=True):
                mine = flags[at : at + n]
                at += n
                if check:
                    self._correct(chain, mine, m)
                out[i] = mine
        return out

    def _correct(self, chain: _Chain, flags: list[bool], m: _Medium) -> None:
        """Flags of blocks changed since the start, or held as a further copy."""
        undo = self._undo
        medium = chain.medium
        delta, dups = m.delta, m.dups
        for i, h in enumerate(chain.hashes.tolist()):
            holders = undo.get((medium, h)) if undo else None
            if holders is not None:
                flags[i] = any(c is chain for c in holders)
            elif not flags[i] and (delta or dups):
                flags[i] = delta.get(h) is chain or any(c is chain for c in dups.get(h, ()))

    def _walk(self, chains: list[_Chain]) -> Iterator[tuple[_Chain, int, int]]:
        """Live runs ``(chain, start, end)``, each after the run holding its parent block.

        Runs, not whole chains, are ordered: with copies and holes, two chains
        may each hold the other's parent.
        """
        runs: dict[int, list[tuple[int, int]]] = {}

        def runs_of(chain: _Chain) -> list[tuple[int, int]]:
            found = runs.get(id(chain))
            if found is None:
                found = runs[id(chain)] = self._runs(self._live_flags([chain])[0])
            return found

        done: set[tuple[int, int]] = set()
        ahead = 0  # chains[:ahead] have their runs computed (or had, and were walked)
        for position, root in enumerate(chains):
            if position >= ahead:  # the next group, in one lookup
                blocks = 0
                group = []
                while ahead < len(chains) and blocks < _SNAPSHOT_GROUP:
                    if id(chains[ahead]) not in runs:
                        group.append(chains[ahead])
                        blocks += len(chains[ahead].hashes)
                    ahead += 1
                for chain, flags in zip(group, self._live_flags(group), strict=True):
                    runs[id(chain)] = self._runs(flags)
            for root_run in runs_of(root):
                if (id(root), root_run[0]) in done:
                    continue
                stack = [(root, *root_run)]
                pending = {(id(root), root_run[0])}
                while stack:
                    chain, start, end = stack[-1]
                    parent = chain.hashes[start - 1] if start else chain.parent
                    waiting = None
                    owner = None if parent is None else self._owner_at_start(chain.medium, parent)
                    if owner is not None:
                        waiting = self._run_holding(owner, parent, runs_of(owner))  # type: ignore[arg-type]
                    if waiting is not None:
                        key = (id(owner), waiting[0])
                        if key not in done and key not in pending:  # a cycle is cut, not followed
                            stack.append((owner, *waiting))  # type: ignore[arg-type]
                            pending.add(key)
                            continue
                    stack.pop()
                    pending.discard((id(chain), start))
                    done.add((id(chain), start))
                    yield chain, start, end
        runs.clear()

    @staticmethod
    def _run_holding(chain: _Chain, h: int, runs: list[tuple[int, int]]) -> tuple[int, int] | None:
        """The live run of ``chain`` that holds block ``h``."""
        at = -1
        while True:
            try:
                at = chain.hashes.index(h, at + 1)
            except ValueError:
                return None
            for start, end in runs:
                if start <= at < end:
                    return start, end

    @staticmethod
    def _runs(flags: list[bool]) -> list[tuple[int, int]]:
        out: list[tuple[int, int]] = []
        start = -1
        for i, live in enumerate(flags):
            if live:
                if start < 0:
                    start = i
            elif start >= 0:
                out.append((start, i))
                start = -1
        if start >= 0:
            out.append((start, len(flags)))
        return out

    def next_chunk(self) -> bytes | None:
        """The next chunk's payload (``BlockStored`` chains, at most ``chunk_blocks``), or ``None``."""
        if self._done:
            return None
        parts: list[Any] = []
        room = self._chunk_blocks
        while room:
            run = self._stash
            self._stash = None
            if run is None:
                run = next(self._runs_left, None)
                if run is None:
                    self._finish()
                    break
            chain, start, end = run
            if end - start > room:
                self._stash = (chain, start + room, end)
                end = start + room
            parts.append(self._part(chain, start, end))
            room -= end - start
            self.blocks += end - start
        if not parts:
            return None
        self.chunks += 1
        return encode_parts(time.time(), parts, self._rank, dialect=self._dialect)

    def _part(self, chain: _Chain, start: int, end: int) -> Any:
        hashes = chain.hashes
        if start == 0 and end == len(hashes):
            tokens: Any = chain.tokens
            extra = chain.extra
        else:
            bs = chain.block_size
            tokens = chain.token_list()[start * bs : end * bs]
            extra = None if chain.extra is None else chain.extra[start:end]
        parent = hashes[start - 1] if start else chain.parent
        return StoredParts(
            hashes[start:end].tolist(), parent, tokens, chain.block_size, None, chain.medium,
            chain.lora, extra, chain.group,
        )  # fmt: skip

    def _finish(self) -> None:
        self._done = True
        self._mirror._release(self)
        self._undo = {}

    def close(self) -> None:
        """Stop serving (client gone): the mirror stops logging for this snapshot."""
        self._finish()
