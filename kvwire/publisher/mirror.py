"""The publisher's mirror of its own rank's cache, and consistent snapshots of it.

The sender thread feeds every batch it encodes, in seq order, to :class:`Mirror`.
A gap in those seqs means a batch was dropped before the sender saw it (queue
full): its events are unknown, so the mirror stops vouching for itself until an
``AllBlocksCleared`` resets it. (Keeping dropped batches for the mirror alone
would double the memory a full queue already holds, exactly when the engine
outruns the sender; an honest refusal leaves the subscriber PARTIAL, never
stale.) An encoding error does the same.

Representation. Each ``BlockStored`` event becomes one immutable :class:`_Chain`:
its hashes (the list the decoder made), its parent, and its token ids kept as
the packed msgpack bytes they arrived in (no Python int per token). A dict per
medium maps each live block hash to its chain; a block is live in a chain while
that dict points there. A chain is dropped when its last block is. Copies of a
hash stored again while held (engines count copies) wait in a side dict.

Snapshots. :meth:`Mirror.snapshot` freezes the list of chains and, while the
snapshot is served, every change the live stream makes to a block's entry is
first logged (its value at the start, once per block): reading "entry at start"
as the log's value, else the current one, gives the state as of ``next_seq``
however long serving takes. Chains come out parents first across the whole
snapshot (a chain whose parent block lives in another chain waits for that
one), in bounded chunks of ``BlockStored`` events; a fully live chain goes out
with its original packed token bytes. A block whose parent was evicted before it
(engines evict children first, so this is rare) goes out under that parent's
hash, which the snapshot does not hold: a subscriber keeps it on a detached
chain, never matched past the hole, never stale.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import msgspec

from kvwire.wire import AllBlocksCleared, BlockRemoved, BlockStored, Dialect, KVEventBatch
from kvwire.wire.codec import StoredParts, encode_parts
from kvwire.wire.events import TokenIds

__all__ = ["Mirror", "SnapshotCursor"]

_tokens = msgspec.msgpack.Decoder(list[int])
_encoder = msgspec.msgpack.Encoder()
_MISSING: Any = object()


class _Chain(msgspec.Struct, gc=False):
    """One stored event: blocks ``hashes`` under ``parent``, tokens packed.

    Not tracked by the cyclic garbage collector (it holds no cycle): a mirror
    of a million blocks must not make every collection walk it.
    """

    hashes: tuple[int, ...]
    parent: int | None
    tokens: msgspec.Raw
    block_size: int
    medium: str | None
    lora: str | None
    extra: list[Any] | None
    group: int | None
    live: int = 0

    def token_list(self) -> list[int]:
        out: list[int] = _tokens.decode(self.tokens)
        return out


def _packed(tokens: Any) -> msgspec.Raw:
    """A private packed copy of an event's token ids (never a view into a payload)."""
    if type(tokens) is TokenIds:
        return tokens.raw.copy()
    return msgspec.Raw(_encoder.encode(list(tokens)))


_State = tuple["_Chain | None", "tuple[_Chain, ...]"]
"""A block's entry: the chain the dict points to, and the other copies held."""


class Mirror:
    """What a rank holds, as its own published events describe it (sender thread only)."""

    def __init__(self) -> None:
        self._media: dict[str | None, dict[int, _Chain]] = {}
        self._dups: dict[tuple[str | None, int], list[_Chain]] = {}
        self._chains: dict[int, _Chain] = {}
        self._cursors: list[SnapshotCursor] = []
        self.next_seq = 0
        """The state described is the one after every batch below this seq."""
        self.distrust_reason: str | None = None
        """Why the mirror cannot vouch for itself (``None``: it can)."""
        self.blocks = 0

    # --- updates ---------------------------------------------------------------

    def apply(self, seq: int, batch: KVEventBatch) -> None:
        """Mirror batch ``seq``; a seq skipped since the last one makes the mirror untrusted."""
        if seq != self.next_seq:
            self.distrust(f"batches {self.next_seq}..{seq - 1} were dropped before publishing")
        self.next_seq = seq + 1
        for e in batch.events:
            kind = type(e)
            if kind is BlockStored:
                self._store(e)  # type: ignore[arg-type]
            elif kind is BlockRemoved:
                self._remove(e)  # type: ignore[arg-type]
            elif kind is AllBlocksCleared:
                self._clear()

    def skip(self, seq: int, reason: str) -> None:
        """Batch ``seq`` was seen but cannot be mirrored (e.g. it did not encode)."""
        self.distrust(f"batch {seq}: {reason}")
        self.next_seq = seq + 1

    def distrust(self, reason: str) -> None:
        """Refuse snapshots until an ``AllBlocksCleared`` makes the state known again."""
        if self.distrust_reason is None:
            self.distrust_reason = reason

    def _log(self, medium: str | None, h: int, main: _Chain | None) -> None:
        """Before an entry changes: every snapshot in progress keeps its value at the start."""
        copies = self._dups.get((medium, h)) if self._dups else None
        state = (main, tuple(copies) if copies else ())
        for cursor in self._cursors:
            cursor._note((medium, h), state)

    def _store(self, e: BlockStored) -> None:
        medium = e.medium
        blocks = self._media.get(medium)
        if blocks is None:
            blocks = self._media[medium] = {}
        chain = _Chain(
            tuple(e.block_hashes), e.parent_block_hash, _packed(e.token_ids), e.block_size,
            medium, e.lora_name, e.extra_keys, e.group_idx,
        )  # fmt: skip
        logging = bool(self._cursors)
        setdefault = blocks.setdefault
        before = len(blocks)
        copies = 0
        for h in chain.hashes:
            if logging:
                self._log(medium, h, blocks.get(h))
            old = setdefault(h, chain)
            if old is not chain:  # held already: this is another copy
                self._dups.setdefault((medium, h), []).append(old)
                blocks[h] = chain
                copies += 1
        added = len(blocks) - before
        self.blocks += added
        chain.live = added + copies
        if chain.live:
            self._chains[id(chain)] = chain

    def _remove(self, e: BlockRemoved) -> None:
        medium = e.medium
        blocks = self._media.get(medium)
        if not blocks:
            return
        logging = bool(self._cursors)
        dups = self._dups
        pop = blocks.pop
        chains = self._chains
        for h in e.block_hashes:
            chain = pop(h, None)
            if chain is None:
                continue
            if logging:
                self._log(medium, h, chain)
            copies = dups.get((medium, h)) if dups else None
            if copies:
                blocks[h] = copies.pop()
                if not copies:
                    del dups[(medium, h)]
            else:
                self.blocks -= 1
            chain.live -= 1
            if not chain.live:
                del chains[id(chain)]

    def _clear(self) -> None:
        for cursor in list(self._cursors):
            cursor._detach()
        self._media = {}
        self._dups = {}
        self._chains = {}
        self.blocks = 0
        self.distrust_reason = None

    # --- snapshots -----------------------------------------------------------------

    def snapshot(
        self, rank: int | None, *, chunk_blocks: int = 4096, dialect: Dialect = "map"
    ) -> SnapshotCursor:
        """Start a snapshot of the state as of :attr:`next_seq`; serve it with ``next_chunk()``."""
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
        self._dups = mirror._dups
        self._undo: dict[tuple[str | None, int], _State] = {}
        self._runs_left = self._walk(list(mirror._chains.values()))
        self._stash: tuple[_Chain, int, int] | None = None
        self._done = False

    def _note(self, key: tuple[str | None, int], state: _State) -> None:
        """The mirror is about to change ``key``'s entry: keep its first value."""
        if key not in self._undo:
            self._undo[key] = state

    def _detach(self) -> None:
        """The mirror drops its tables for new ones: the old ones (and the log) stay as they are."""
        if self in self._mirror._cursors:
            self._mirror._cursors.remove(self)

    def _at_start(self, medium: str | None, h: int) -> _State:
        state = self._undo.get((medium, h))
        if state is not None:
            return state
        blocks = self._media.get(medium)
        chain = blocks.get(h) if blocks else None
        copies = self._dups.get((medium, h)) if self._dups else None
        return chain, tuple(copies) if copies else ()

    def _live(self, chain: _Chain, h: int) -> bool:
        main, copies = self._at_start(chain.medium, h)
        return main is chain or chain in copies

    def _walk(self, chains: list[_Chain]) -> Iterator[tuple[_Chain, int, int]]:
        """Live runs ``(chain, start, end)``, every chain after the one holding its parent."""
        done: set[int] = set()
        for root in chains:
            if id(root) in done:
                continue
            stack = [root]
            pending = {id(root)}
            while stack:
                chain = stack[-1]
                runs = self._runs(chain)
                waiting = None
                for start, _ in runs:
                    parent = chain.hashes[start - 1] if start else chain.parent
                    if parent is None:
                        continue
                    owner, _ = self._at_start(chain.medium, parent)
                    if (
                        owner is not None
                        and owner is not chain
                        and id(owner) not in done
                        and id(owner) not in pending  # a cycle is cut, not followed
                    ):
                        waiting = owner
                        break
                if waiting is not None:
                    stack.append(waiting)
                    pending.add(id(waiting))
                    continue
                stack.pop()
                pending.discard(id(chain))
                done.add(id(chain))
                for start, end in runs:
                    yield chain, start, end

    def _runs(self, chain: _Chain) -> list[tuple[int, int]]:
        out: list[tuple[int, int]] = []
        start = -1
        hashes = chain.hashes
        for i, h in enumerate(hashes):
            if self._live(chain, h):
                if start < 0:
                    start = i
            elif start >= 0:
                out.append((start, i))
                start = -1
        if start >= 0:
            out.append((start, len(hashes)))
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
            hashes[start:end] if start or end != len(hashes) else hashes, parent, tokens,
            chain.block_size, None, chain.medium, chain.lora, extra, chain.group,
        )  # fmt: skip

    def _finish(self) -> None:
        self._done = True
        self._mirror._release(self)
        self._undo = {}

    def close(self) -> None:
        """Stop serving (client gone): the mirror stops logging for this snapshot."""
        self._finish()
