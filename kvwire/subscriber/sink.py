"""Where a subscriber's ordered stream goes: the sink contract and its item types."""

from __future__ import annotations

from typing import NamedTuple, Protocol, TypeAlias, runtime_checkable

from kvwire.wire import AllBlocksCleared, BlockRemoved, BlockStored, DecodeLimits, KVEventBatch

__all__ = [
    "Applied", "BlockSetSink", "Cleared", "EventSink", "PayloadSink", "SinkItem", "ViewSink",
]  # fmt: skip


@runtime_checkable
class EventSink(Protocol):
    """Anything that keeps per-(worker, rank) cache state from the event stream.

    ``apply`` receives each rank's batches in publisher order, exactly once,
    and must honour an ``AllBlocksCleared`` at its place among the batch's
    events (an empty batch, a heartbeat, changes nothing and may not be passed
    on: a rank's heartbeats in sequence are taken without calling the sink).
    ``clear`` drops everything the sink holds for the rank (publisher
    restart, unrecoverable loss, source removed). Both run on the subscriber's
    event-loop thread; an exception is counted and logged, and the rank is
    then cleared and marked PARTIAL since the sink's view of it is suspect.

    A sink that buffers work may also have a ``flush()`` method: the
    subscriber calls it whenever a rank's socket is drained, so buffered
    events are applied on the subscriber's thread rather than in a reader's
    query.
    """

    def apply(self, worker_id: str, rank: int, batch: KVEventBatch) -> None: ...

    def clear(self, worker_id: str, rank: int) -> None: ...


@runtime_checkable
class PayloadSink(EventSink, Protocol):
    """An :class:`EventSink` that reads a batch's msgpack bytes itself.

    The subscriber gives such a sink ``apply_payload`` rather than ``apply``
    for every batch whose payload a native check vouches ``decode_batch``
    accepts within ``limits`` (the stream's own, from its config), so no
    Python object is made per event on the way; it must do exactly what
    ``apply(worker_id, rank, decode_batch(payload, limits))`` does. Other
    batches still come to ``apply``. Raising is a sink failure like any
    other: the rank is cleared and marked PARTIAL.
    :class:`~kvwire.prefix_index.PrefixIndex` is one.
    """

    def apply_payload(
        self,
        worker_id: str,
        rank: int,
        payload: bytes | bytearray | memoryview,
        limits: DecodeLimits,
    ) -> None: ...


@runtime_checkable
class ViewSink(Protocol):
    """A sink whose view of a rank can be saved and restored: checkpoints and peer clones.

    ``export_rank`` returns the rank's contents as bytes and ``import_rank``
    replaces the rank's contents with such bytes (raising ``ValueError``, with
    nothing changed, on bytes it cannot read); both run on the subscriber's
    thread, between its inputs, so a rank's bytes and its stream position are
    taken at the same instant. ``view_format`` names the kind of view and
    the parameters its bytes depend on (a block size, a hash): a checkpoint
    or clone written by a sink of another format is refused, not misread.
    """

    def export_rank(self, worker_id: str, rank: int) -> bytes: ...

    def import_rank(self, worker_id: str, rank: int, blob: bytes) -> None: ...

    def view_format(self) -> bytes: ...


class Applied(NamedTuple):
    """An async-iterator item: apply ``batch`` (the publisher's ``seq``) to the rank."""

    worker_id: str
    rank: int
    seq: int
    batch: KVEventBatch


class Cleared(NamedTuple):
    """An async-iterator item: drop everything known about the rank."""

    worker_id: str
    rank: int
    reason: str


SinkItem: TypeAlias = Applied | Cleared


class BlockSetSink:
    """The smallest useful sink: the set of block hashes each rank holds.

    Used by ``kvwire watch`` and by tests as the reference view; a router
    wants the prefix index instead.
    """

    def __init__(self) -> None:
        self._blocks: dict[tuple[str, int], set[int]] = {}

    def apply(self, worker_id: str, rank: int, batch: KVEventBatch) -> None:
        held = self._blocks.get((worker_id, rank))
        if held is None:
            held = self._blocks[(worker_id, rank)] = set()
        for event in batch.events:
            if isinstance(event, BlockStored):
                held.update(event.block_hashes)
            elif isinstance(event, BlockRemoved):
                held.difference_update(event.block_hashes)
            elif isinstance(event, AllBlocksCleared):
                held.clear()

    def clear(self, worker_id: str, rank: int) -> None:
        self._blocks.pop((worker_id, rank), None)

    def blocks(self, worker_id: str, rank: int) -> frozenset[int]:
        """The block hashes the rank is believed to hold."""
        return frozenset(self._blocks.get((worker_id, rank), ()))

    def count(self, worker_id: str, rank: int) -> int:
        return len(self._blocks.get((worker_id, rank), ()))

    def ranks(self) -> list[tuple[str, int]]:
        """Every (worker, rank) that holds at least one block."""
        return [key for key, held in self._blocks.items() if held]

    # A rank's view as bytes (checkpoints and clones; the prefix index's contract):
    # b"KVBS", version u16, 0 u16, count u64, then the hashes as u64, ascending,
    # little-endian. Sorted, so a view has one form and a repeated hash is refused.

    def view_format(self) -> bytes:
        """What :meth:`export_rank`'s bytes mean; a loader refuses a view of another format."""
        return b"kvwire.BlockSetSink rank view 1"

    def export_rank(self, worker_id: str, rank: int) -> bytes:
        """The rank's block hashes as bytes (an unknown rank: an empty view)."""
        held = sorted(self._blocks.get((worker_id, rank), ()))
        head = b"KVBS" + (1).to_bytes(2, "little") + bytes(2) + len(held).to_bytes(8, "little")
        return head + b"".join(h.to_bytes(8, "little") for h in held)

    def import_rank(self, worker_id: str, rank: int, view: bytes | bytearray | memoryview) -> None:
        """Replace the rank's hashes with an :meth:`export_rank` view's; ``ValueError``
        (nothing changed) for anything else."""
        data = bytes(view)
        if len(data) < 16:
            raise ValueError(f"a rank view of {len(data)} bytes is shorter than its 16-byte header")
        if data[:8] != b"KVBS\x01\x00\x00\x00":
            raise ValueError("not a BlockSetSink rank view of version 1")
        count = int.from_bytes(data[8:16], "little")
        if len(data) != 16 + 8 * count:
            raise ValueError(f"a rank view of {len(data)} bytes cannot hold the {count} hashes it gives")
        hashes = [int.from_bytes(data[i : i + 8], "little") for i in range(16, len(data), 8)]
        if any(hashes[i] >= hashes[i + 1] for i in range(len(hashes) - 1)):
            raise ValueError("a rank view's hashes are not strictly ascending (repeated or corrupt)")
        self._blocks[(worker_id, rank)] = set(hashes)
