"""The publisher's mirror of its own rank's cache, and consistent snapshots of it.

Every batch the sender thread encodes reaches :class:`Mirror` in seq order:
the sender pushes each payload onto a feed that the publisher's service thread
reads and applies in large batches (a few times a second, and always before
a snapshot starts), so the GIL changes hands rarely. The batches ``publish()``
dropped on a full queue go the same way: those are never sent, but the
publisher keeps them (at most ``mirror_backlog``) for the mirror alone, so a
snapshot repairs such a drop instead of refusing.
A gap in the seqs the mirror sees means a batch it never learnt (that second
bound was exceeded too): the mirror then stops vouching for itself until an
``AllBlocksCleared`` resets it, and snapshots are refused (the subscriber ends
PARTIAL, never stale). A batch that cannot be encoded does the same.

Representation, compact because a rank holds millions of blocks, in C
(``_mirror.c``), with no Python object per block:

- each ``BlockStored`` event is one immutable chain: its hashes packed (8 bytes
  each), its parent, and its token ids kept as the packed msgpack bytes they
  arrived in;
- per medium, an open-addressing table from block hash to the newest chain
  holding it (16 bytes a slot); copies of a hash stored again while held
  (engines count copies) in a second table, hash to an array of the older
  holders. A chain is dropped when it holds no block any more.

The payloads the sender encoded are read straight into those tables
(:meth:`Mirror.apply_feed`, :meth:`Mirror.apply_payload`): a first pass checks
a whole payload (for a large feed, all of them, without the GIL), a second
applies it. A payload outside what that reader takes (a clear, bytes hashes,
extra keys, an unknown field) changes nothing there and is decoded and applied
event by event instead, with the same result.

Snapshots. :meth:`Mirror.snapshot` freezes the list of chains and, while the
snapshot is served, logs every change the live stream makes to a block's
holders (their value at the start, once per block): "holders at start" is the
log's value, else the current one, so the snapshot is the state as of
``next_seq`` however long serving takes. Chains come out parents first across
the whole snapshot (a chain whose parent block lives in another chain waits for
that one), in bounded chunks of ``BlockStored`` events; a fully live chain goes
out with its original packed token bytes; the chains that wait for no parent (most of
them) are taken in one native call per run of them (``Core.simple_parts``), the rest by
the walk here. A block whose parent was evicted
before it (engines evict children first, so this is rare) goes out under that
parent's hash, which the snapshot does not hold: a subscriber keeps it on a
detached chain, never matched past the hole, never stale.
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence
from typing import Any

import msgspec

from kvwire.publisher._mirror import Chain, Core
from kvwire.publisher.config import PublisherConfig
from kvwire.wire import AllBlocksCleared, BlockRemoved, BlockStored, Dialect, KVEventBatch
from kvwire.wire.codec import StoredParts, decode_batch, encode_parts
from kvwire.wire.events import TokenIds, WireError

__all__ = ["Mirror", "SnapshotCursor"]

_tokens = msgspec.msgpack.Decoder(list[int])
_encoder = msgspec.msgpack.Encoder()

_Undo = dict[tuple[str | None, int], tuple[Chain, ...]]
_END = object()  # the walk is over
NOT_SENT = "nothing was sent under it (skipped, or it did not encode)"
"""Why the mirror distrusts itself after a seq the sender left empty."""


def _packed(tokens: Any) -> bytes:
    """A private packed copy of an event's token ids (never a view into a payload)."""
    if type(tokens) is TokenIds:
        return bytes(tokens.raw)
    return _encoder.encode(list(tokens))


class Mirror:
    """What a rank holds, as its own published events describe it (one thread only)."""

    def __init__(self) -> None:
        self._core = Core()
        self._cursors: list[SnapshotCursor] = []
        self.next_seq = 0
        """The state described is the one after every batch below this seq."""
        self.distrust_reason: str | None = None
        """Why the mirror cannot vouch for itself (``None``: it can)."""

    # --- updates ---------------------------------------------------------------

    def apply_payload(self, seq: int, payload: Any) -> None:
        """Mirror batch ``seq`` from its encoded payload (any buffer), read in C when it can be."""
        self._advance(seq)
        try:
            if self._core.apply_payload(payload):
                return
            events = decode_batch(payload).events
        except WireError as exc:  # encode and decode disagree: a bug, but never a wrong state
            self.distrust(f"batch {seq}: its payload did not decode: {exc}")
            return
        except MemoryError:  # possibly applied in part
            self.distrust(f"batch {seq}: out of memory while mirroring it")
            return
        self._apply(events)

    def apply_feed(self, feed: list[tuple[int, Any]]) -> None:
        """Mirror the sender's feed ``[(seq, payload or None)]`` in order, as one C call where it
        can (see the module); an entry C does not take (a seq gap, a batch that did not encode,
        a payload outside the reader's subset) is applied here, and the rest resumes in C."""
        i, n = 0, len(feed)
        while i < n:
            try:
                j = self._core.apply_feed(feed, i, self.next_seq)
            except MemoryError:  # possibly applied in part
                self.distrust("out of memory while mirroring the feed")
                self.next_seq = feed[-1][0] + 1
                return
            if j > i:
                self.next_seq = feed[j - 1][0] + 1
            if j < n:
                seq, payload = feed[j]
                if payload is None:
                    self.skip(seq, NOT_SENT)
                else:
                    self.apply_payload(seq, payload)
            i = j + 1

    def apply(self, seq: int, batch: KVEventBatch) -> None:
        """Mirror decoded batch ``seq``; a seq skipped since the last one makes the mirror untrusted."""
        self._advance(seq)
        self._apply(batch.events)

    def _advance(self, seq: int) -> None:
        if seq != self.next_seq:
            self.distrust(f"batches {self.next_seq}..{seq - 1} were dropped before publishing")
        self.next_seq = seq + 1

    def _apply(self, events: Sequence[Any]) -> None:
        core = self._core
        for e in events:
            kind = type(e)
            if kind is BlockStored:
                core.store(
                    e.block_hashes, e.parent_block_hash, _packed(e.token_ids), e.block_size,
                    e.medium, e.lora_name, e.extra_keys, e.group_idx,
                )  # fmt: skip
            elif kind is BlockRemoved:
                core.remove(e.medium, e.block_hashes)
            elif kind is AllBlocksCleared:
                self._clear()
                core = self._core

    def skip(self, seq: int, reason: str) -> None:
        """Batch ``seq`` was seen but cannot be mirrored (e.g. it did not encode)."""
        self.distrust(f"batch {seq}: {reason}")
        self.next_seq = seq + 1

    def distrust(self, reason: str) -> None:
        """Refuse snapshots until an ``AllBlocksCleared`` makes the state known again."""
        if self.distrust_reason is None:
            self.distrust_reason = reason

    def count_blocks(self) -> int:
        """Distinct (medium, hash) blocks held; any thread may ask (one C call under the GIL)."""
        return self._core.count()

    def _clear(self) -> None:
        """A new, empty state; snapshots being served keep serving the old one."""
        for cursor in list(self._cursors):
            cursor._detach()
        self._core = Core()
        self.distrust_reason = None

    # --- snapshots -----------------------------------------------------------------

    def snapshot(
        self,
        rank: int | None,
        *,
        chunk_blocks: int = PublisherConfig().snapshot_chunk_blocks,
        dialect: Dialect = "map",
    ) -> SnapshotCursor:
        """Start a snapshot of the state as of :attr:`next_seq`; serve it with ``next_chunk()``
        in chunks of at most ``chunk_blocks`` blocks (the publisher passes its config's)."""
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
        self.announced = mirror._core.count()
        """The blocks the state holds (distinct medium and hash), announced on chunk 0."""
        self._mirror = mirror
        self._rank = rank
        self._dialect: Dialect = dialect
        self._chunk_blocks = chunk_blocks
        self._core = mirror._core
        self._undo: _Undo = {}
        self._core.logs.append(self._undo)  # the core logs holders before each change
        self._chains = self._core.chains()
        self._next_root = 0  # the index in _chains of the next root to walk
        self._yielded: set[tuple[Chain, int]] = set()  # runs taken, as (chain, start)
        self._runs_left = self._walk()
        self._stash: tuple[Chain, int, int] | None = None
        self._done = False

    def _detach(self) -> None:
        """The mirror drops this state for a new one: it (and the log) stays as it is."""
        self._unlog()
        self._mirror._release(self)

    def _unlog(self) -> None:
        logs = self._core.logs
        logs[:] = [d for d in logs if d is not self._undo]

    def _walk(self) -> Iterator[tuple[Chain, int, int] | None]:
        """Live runs ``(chain, start, end)``, each after the run holding its parent block;
        ``None`` between roots, where :meth:`next_chunk` may take the chains that wait for
        nothing in one native call (``Core.simple_parts``), from ``_next_root`` on.

        Runs, not whole chains, are ordered: with copies and holes, two chains
        may each hold the other's parent.
        """
        core, undo, chains, done = self._core, self._undo, self._chains, self._yielded
        runs: dict[int, list[tuple[int, int]]] = {}

        def runs_of(chain: Chain) -> list[tuple[int, int]]:
            found = runs.get(id(chain))
            if found is None:
                found = runs[id(chain)] = core.runs(chain, undo)
            return found

        while True:
            yield None
            if self._next_root >= len(chains):
                break
            root = chains[self._next_root]
            self._next_root += 1
            for root_run in runs_of(root):
                if (root, root_run[0]) in done:
                    continue
                stack = [(root, *root_run)]
                pending = {(root, root_run[0])}
                while stack:
                    chain, start, end = stack[-1]
                    parent = chain.hash_at(start - 1) if start else chain.parent
                    owner = waiting = None
                    if parent is not None:
                        owner = core.owner(chain.medium, parent, undo)
                        if owner is not None:
                            waiting = self._run_holding(owner, parent, runs_of(owner))
                    if owner is not None and waiting is not None:
                        key = (owner, waiting[0])
                        if key not in done and key not in pending:  # a cycle is cut, not followed
                            stack.append((owner, *waiting))
                            pending.add(key)
                            continue
                    stack.pop()
                    pending.discard((chain, start))
                    done.add((chain, start))
                    yield chain, start, end
        runs.clear()

    @staticmethod
    def _run_holding(chain: Chain, h: int, runs: list[tuple[int, int]]) -> tuple[int, int] | None:
        """The live run of ``chain`` that holds block ``h``."""
        at = chain.index(h, 0)
        while at >= 0:
            for start, end in runs:
                if start <= at < end:
                    return start, end
            at = chain.index(h, at + 1)
        return None

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
                step: Any = next(self._runs_left, _END)
                if step is _END:
                    self.close()
                    break
                if step is None:  # between roots: those that wait for nothing, in C
                    got, self._next_root, n = self._core.simple_parts(
                        self._chains, self._next_root, room, self._undo, self._yielded,
                        StoredParts, msgspec.Raw,
                    )  # fmt: skip
                    parts += got
                    room -= n
                    self.blocks += n
                    continue
                run = step
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

    @staticmethod
    def _part(chain: Chain, start: int, end: int) -> Any:
        extra = chain.extra
        if start == 0 and end == len(chain):
            tokens: Any = msgspec.Raw(chain.tokens)
        else:
            bs = chain.block_size
            tokens = _tokens.decode(chain.tokens)[start * bs : end * bs]
            extra = None if extra is None else extra[start:end]
        parent = chain.hash_at(start - 1) if start else chain.parent
        return StoredParts(
            chain.hash_list(start, end), parent, tokens, chain.block_size, None, chain.medium,
            chain.lora, extra, chain.group,
        )  # fmt: skip

    def close(self) -> None:
        """Stop serving (done, or the client gone): the mirror stops logging for this snapshot."""
        self._done = True
        self._unlog()
        self._mirror._release(self)
        self._undo = {}
        self._chains = []
        self._yielded = set()
