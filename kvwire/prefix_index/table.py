"""A numpy-backed hash table from unsigned 64-bit keys to rows of fixed-width columns.

Python dicts cost over 100 bytes per entry once the int objects are counted;
the prefix index holds tens of millions of entries, so it keeps them in flat
numpy arrays instead and works on whole arrays of keys per call.

Layout: buckets of :data:`BUCKET` slots; a key may live in either of two
buckets (two multiplicative hashes) and is put in the emptier one. With two
choices the fullest bucket stays within a few slots of the mean, so a lookup
reads exactly two (distinct) buckets, needs no probe loop, and a delete just empties its
slot (no tombstones). A free slot holds :data:`EMPTY`; the key ``EMPTY``
itself, should it occur, lives in one extra row past the buckets.

Rows returned by the table index its columns; they stay valid until the next
insert (which may grow the table) or delete (which may shrink it).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import numpy.typing as npt

__all__ = ["BUCKET", "EMPTY", "U64Table"]

U64 = npt.NDArray[np.uint64]
I64 = npt.NDArray[np.int64]
Bools = npt.NDArray[np.bool_]

BUCKET = 16
_LOG2B = 4
EMPTY = np.uint64(0xFFFF_FFFF_FFFF_FFFF)
_EMPTY_INT = 0xFFFF_FFFF_FFFF_FFFF
_MASK = 0xFFFF_FFFF_FFFF_FFFF
_M1 = 0x9E37_79B9_7F4A_7C15
_M2 = 0xC2B2_AE3D_27D4_EB4F
_MULTS = np.array([_M1, _M2], dtype=np.uint64)
_ONE = np.uint64(1)
_MIN_BUCKETS = 4
_GROW_LOAD = 0.65
_TARGET_LOAD = 0.5
_SHRINK_LOAD = 0.1
_ARANGE = np.arange(4096, dtype=np.int64)


# numpy's Python-level wrappers (flatnonzero, full, any, sort...) cost a few
# microseconds each, as much as the work on a 128-key batch: the hot paths
# use these thin equivalents over methods and C functions instead.
_count = np.count_nonzero


def any_(x: npt.NDArray[Any]) -> bool:
    """``x.any()`` for a boolean array, faster for small arrays."""
    return bool(_count(x))


def all_(x: npt.NDArray[Any]) -> bool:
    """``x.all()`` for a boolean array, faster for small arrays."""
    return bool(_count(x) == x.size)


def where_(x: npt.NDArray[np.bool_]) -> I64:
    """``np.flatnonzero(x)``, faster for small arrays."""
    found: I64 = x.reshape(-1).nonzero()[0]
    return found


def sorted_(x: npt.NDArray[Any]) -> npt.NDArray[Any]:
    """``np.sort(x)``, faster for small arrays."""
    out = x.copy()
    out.sort()
    return out


def minus_ones(n: int) -> I64:
    """A fresh ``int64`` array of ``n`` -1s."""
    out = np.empty(n, dtype=np.int64)
    out.fill(-1)
    return out


def _arange(n: int) -> I64:
    """A shared read-only ``arange(n)``."""
    global _ARANGE
    if n > _ARANGE.shape[0]:
        _ARANGE = np.arange(max(n, 2 * _ARANGE.shape[0]), dtype=np.int64)
    return _ARANGE[:n]


def _first_listings(k: U64, idx: I64) -> I64:
    """``idx`` without the listings that repeat an earlier listing's key."""
    if idx.shape[0] < 2:
        return idx
    srt = sorted_(k[idx])
    if not any_(srt[1:] == srt[:-1]):
        return idx
    _, first = np.unique(k[idx], return_index=True)
    return idx[np.sort(first)]


def _buckets_for(n: int) -> int:
    """Smallest power-of-two bucket count holding ``n`` keys at the target load."""
    nb = _MIN_BUCKETS
    while nb * BUCKET * _TARGET_LOAD < n:
        nb *= 2
    return nb


class U64Table:
    """Open-addressing table: ``uint64`` key -> row of the named columns.

    Columns are zero for every free row, so a new entry starts at zero in all
    of them. Callers keep no arrays across a call that inserts or deletes.
    """

    __slots__ = (
        "_grid",
        "_nb",
        "_occ",
        "_scratch",
        "_shift",
        "_shift_int",
        "_special_used",
        "cols",
        "count",
        "keys",
    )

    def __init__(self, columns: dict[str, Any]) -> None:
        self.cols: dict[str, npt.NDArray[Any]] = {
            name: np.zeros(0, dtype=dt) for name, dt in columns.items()
        }
        self.count = 0
        self._nb = 0
        self._shift = np.uint64(0)
        self._shift_int = 0
        self.keys: U64 = np.zeros(0, dtype=np.uint64)
        self._grid: U64 = self.keys.reshape(0, BUCKET)
        self._occ: npt.NDArray[np.uint8] = np.zeros(0, dtype=np.uint8)
        self._scratch: I64 = np.zeros(0, dtype=np.int64)
        self._special_used = False

    # --- sizes ---------------------------------------------------------------

    @property
    def capacity(self) -> int:
        """Slots in the buckets (0 while the table holds nothing)."""
        return self._nb * BUCKET

    @property
    def special_pos(self) -> int:
        """The row of the key ``EMPTY``, kept past the buckets."""
        return self._nb * BUCKET

    def nbytes(self) -> int:
        """Bytes held by the table's arrays."""
        total = self.keys.nbytes + self._occ.nbytes + self._scratch.nbytes
        return total + sum(c.nbytes for c in self.cols.values())

    def add_column(self, name: str, dtype: Any) -> None:
        """Add a zero-filled column (no-op when it exists)."""
        if name not in self.cols:
            self.cols[name] = np.zeros(self.keys.shape[0], dtype=dtype)

    # --- lookups -------------------------------------------------------------

    def _buckets(self, k: U64) -> I64:
        """The two candidate buckets of each key, shape (n, 2)."""
        h = k[:, None] * _MULTS
        h >>= self._shift
        # The second bucket differs from the first in at least the low bit,
        # so a present key is found exactly once.
        second = h[:, 1]
        second |= _ONE
        second ^= h[:, 0]
        return h.view(np.int64)

    def lookup(self, k: U64) -> I64:
        """Row of each key, -1 where absent."""
        n = k.shape[0]
        pos = minus_ones(n)
        if self.count == 0 or n == 0:
            return pos
        rows = self._buckets(k)
        f = where_(self._grid[rows] == k[:, None, None])
        # f = key * 2B + choice * B + slot
        pos[f >> (_LOG2B + 1)] = rows.ravel()[f >> _LOG2B] * BUCKET + (f & (BUCKET - 1))
        # Free slots hold EMPTY, so the key EMPTY itself needs a fix-up.
        is_empty = k == EMPTY
        if any_(is_empty):
            pos[is_empty] = self.special_pos if self._special_used else -1
        return pos

    def find_prefix(self, k: U64) -> I64:
        """Rows of the longest run of present keys from the start.

        For the index's own keys, which are never EMPTY in practice: were
        one EMPTY, it would find a free row, whose columns are all zero.
        """
        n = k.shape[0]
        if self.count == 0 or n == 0:
            return np.zeros(0, dtype=np.int64)
        rows = self._buckets(k)
        f = where_(self._grid[rows] == k[:, None, None])
        which = f >> (_LOG2B + 1)
        m = f.shape[0]
        if m == 0 or which[0] != 0:
            return np.zeros(0, dtype=np.int64)
        if which[m - 1] != m - 1:
            m = int((which != _arange(m)).argmax())
            f = f[:m]
        found: I64 = rows.ravel()[f >> _LOG2B] * BUCKET + (f & (BUCKET - 1))
        return found

    def lookup_one(self, key: int) -> int:
        """Row of one key (a Python int in [0, 2**64)), -1 when absent."""
        if self.count == 0:
            return -1
        if key == _EMPTY_INT:
            return self.special_pos if self._special_used else -1
        sh = self._shift_int
        keys = self.keys
        b1 = ((key * _M1) & _MASK) >> sh
        b2 = b1 ^ ((((key * _M2) & _MASK) >> sh) | 1)
        for b in (b1, b2):
            start = b * BUCKET
            seg: list[int] = keys[start : start + BUCKET].tolist()
            if key in seg:
                return start + seg.index(key)
        return -1

    def positions(self) -> I64:
        """Rows of every entry, in slot order."""
        if self.count == 0:
            return np.zeros(0, dtype=np.int64)
        pos = where_(self.keys[: self.capacity] != EMPTY)
        if self._special_used:
            pos = np.append(pos, self.special_pos)
        return pos.astype(np.int64, copy=False)

    # --- updates -------------------------------------------------------------

    def upsert(self, k: U64) -> tuple[I64, Bools]:
        """Rows of the keys, inserting the absent ones.

        Returns the rows and a mask of the listings this call inserted: a key
        listed more than once is inserted once, for its first listing.
        """
        n = k.shape[0]
        inserted: Bools = np.zeros(n, dtype=np.bool_)
        if n == 0:
            return np.zeros(0, dtype=np.int64), inserted
        if self._nb == 0:
            self._resize(_buckets_for(n))
        is_empty = k == EMPTY
        if any_(is_empty) and not self._special_used:
            self._special_used = True
            self.count += 1
            inserted[int(is_empty.argmax())] = True
        pos = self.lookup(k)
        missing = where_(pos < 0)
        if missing.shape[0] == 0:
            return pos, inserted
        if self.count + missing.shape[0] > _GROW_LOAD * self.capacity:
            self._resize(_buckets_for(self.count + missing.shape[0]))
            pos = self.lookup(k)
        missing = _first_listings(k, missing)
        while missing.shape[0]:
            ranked = missing.shape[0] * 8 > self._nb
            placed = self._place(k[missing], ranked)
            if placed is None:
                # Both buckets of some key are full: rare, grow and retry.
                self._resize(self._nb * 2)
                pos = self.lookup(k)
                missing = _first_listings(k, where_(pos < 0))
                continue
            won, rows = placed
            pos[missing[won]] = rows
            inserted[missing[won]] = True
            missing = missing[~won]
        absent = pos < 0
        if any_(absent):
            # Repeats of keys placed above.
            rest = where_(absent)
            pos[rest] = self.lookup(k[rest])
        return pos, inserted

    def _place(self, k: U64, ranked: bool = False) -> tuple[Bools, I64] | None:
        """Put distinct absent keys into the emptier of their two buckets.

        Plain: the first key choosing a bucket gets its first free slot and
        the others sit out this round (cheap when keys are few next to the
        buckets). ``ranked``: the r-th key choosing a bucket takes its r-th
        free slot, if it has one (for rebuilding a whole table). Returns which
        keys went in and their rows, or None when some key found both its
        buckets full (then nothing is placed).
        """
        n = k.shape[0]
        rows = self._buckets(k)
        occ = self._occ[rows]
        second = (occ[:, 1] < occ[:, 0]).view(np.int8)
        ar = _arange(n)
        bucket = rows[ar, second]
        if any_(occ[ar, second] >= BUCKET):
            return None
        if not ranked:
            scratch = self._scratch
            scratch[bucket[::-1]] = ar[::-1]
            won = scratch[bucket] == ar
            wb = bucket if all_(won) else bucket[won]
            j = (self._grid[wb] == EMPTY).argmax(axis=1)
            placed: I64 = wb * BUCKET + j
            self.keys[placed] = k[won]
            self._occ[wb] += np.uint8(1)
            self.count += placed.shape[0]
            return won, placed
        # Rank each key among those choosing the same bucket.
        order = bucket.argsort(kind="stable")
        b = bucket[order]
        head = np.empty(n, dtype=np.bool_)
        head[0] = True
        np.not_equal(b[1:], b[:-1], out=head[1:])
        rank = ar - np.maximum.accumulate(np.where(head, ar, 0))
        occb = self._occ[b]
        fits = rank < BUCKET - occb
        won = np.zeros(n, dtype=np.bool_)
        if not all_(fits):
            order, b, rank, occb = order[fits], b[fits], rank[fits], occb[fits]
        free = np.add.accumulate(self._grid[b] == EMPTY, axis=1, dtype=np.int8)
        j = (free > rank[:, None]).argmax(axis=1)
        placed_sorted = b * BUCKET + j
        self.keys[placed_sorted] = k[order]
        # Within a bucket ranks rise, and the last write of a repeated index
        # wins: each bucket ends up with its old count plus its winners.
        self._occ[b] = occb + (rank + 1).astype(np.uint8)
        self.count += placed_sorted.shape[0]
        won[order] = True
        placed = np.empty(n, dtype=np.int64)
        placed[order] = placed_sorted
        return won, placed[won]

    def delete(self, rows: I64) -> None:
        """Remove the entries at ``rows`` (distinct rows of live entries)."""
        if rows.shape[0] == 0:
            return
        for col in self.cols.values():
            col[rows] = 0
        special = rows == self.special_pos
        if any_(special):
            self._special_used = False
            rows = rows[~special]
            self.count -= 1
        self.keys[rows] = EMPTY
        np.subtract.at(self._occ, rows >> _LOG2B, 1)
        self.count -= rows.shape[0]
        if self.count == 0:
            self._release()
        elif self._nb > _MIN_BUCKETS and self.count < _SHRINK_LOAD * self.capacity:
            self._resize(_buckets_for(self.count))

    def clear(self) -> None:
        """Drop every entry and give the memory back."""
        self._release()

    def _release(self) -> None:
        self.count = 0
        self._special_used = False
        self._nb = 0
        self.keys = np.zeros(0, dtype=np.uint64)
        self._grid = self.keys.reshape(0, BUCKET)
        self._occ = np.zeros(0, dtype=np.uint8)
        self._scratch = np.zeros(0, dtype=np.int64)
        for name, col in self.cols.items():
            self.cols[name] = np.zeros(0, dtype=col.dtype)

    def _resize(self, nb: int) -> None:
        """Rebuild with ``nb`` buckets, keeping every entry and its columns."""
        special = self._special_used
        old_special = self.special_pos
        if self._nb:
            live = where_(self.keys[: self.capacity] != EMPTY)
        else:
            live = np.zeros(0, dtype=np.int64)
        old_keys = self.keys[live]
        old_cols = self.cols
        while True:
            self._nb = nb
            self._shift_int = 64 - (nb.bit_length() - 1)
            self._shift = np.uint64(self._shift_int)
            self.keys = np.full(nb * BUCKET + 1, EMPTY, dtype=np.uint64)
            self._grid = self.keys[: nb * BUCKET].reshape(nb, BUCKET)
            self._occ = np.zeros(nb, dtype=np.uint8)
            self._scratch = np.zeros(nb, dtype=np.int64)
            self.count = 0
            new_rows = np.empty(live.shape[0], dtype=np.int64)
            pending = _arange(live.shape[0]).copy()
            ok = True
            while pending.shape[0]:
                placed = self._place(old_keys[pending], ranked=True)
                if placed is None:
                    ok = False
                    break
                won, rows = placed
                new_rows[pending[won]] = rows
                pending = pending[~won]
            if ok:
                break
            nb *= 2
        self.cols = {}
        for name, col in old_cols.items():
            fresh = np.zeros(nb * BUCKET + 1, dtype=col.dtype)
            if col.shape[0]:
                fresh[new_rows] = col[live]
                if special:
                    fresh[nb * BUCKET] = col[old_special]
            self.cols[name] = fresh
        self._special_used = special
        self.count += int(special)
