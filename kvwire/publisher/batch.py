"""One iteration's records as a batch: what the collector hands a publisher.

A :class:`CollectedBatch` holds the hook calls of one iteration as
:class:`~kvwire.publisher._sender.Record` objects (the collector's C records
seen from Python: named fields, no copy). It is encoded by the one native
writer that also serves the publisher's sender thread
(``kvwire/publisher/sender/writer.c``), so the bytes, the coalescing of
chained stores and of removals, and the errors for bad input exist once.
"""

from __future__ import annotations

import msgspec

from kvwire.wire import Dialect, KVEventBatch, decode_batch

from ._sender import CLEARED, REMOVED, STORED, EngineFormat, Record, encode_collected
from .formats import wire_format

__all__ = ["CLEARED", "REMOVED", "STORED", "CollectedBatch", "Record"]

_pack = msgspec.msgpack.Encoder().encode  # extra_keys, whatever their items are


class CollectedBatch(msgspec.Struct, gc=False):
    """One iteration's records; encoded on the publisher's sender thread.

    ``records`` are the hook calls in order (:class:`Record`: ``kind``,
    ``block_hashes``, ``parent_hash``, ``token_ids``, ``lora_name``,
    ``medium``, ``extra_keys``, ``group_idx``). Not tracked by the cyclic
    garbage collector: a backlog of these must not make every collection
    slower (it holds only records of lists, arrays and ints).
    """

    ts: float
    records: list[Record]
    rank: int
    block_size: int
    signed: bool

    def encode(self, dialect: Dialect) -> bytes:
        """Convert, coalesce and encode: the bytes ``encode_batch`` gives for :meth:`to_batch`.

        A store continuing the previous one's chain joins its event, as does a
        removal following one of the same medium and group. Hashes take the
        wire's form (``signed``: int64, else unsigned 64-bit). A value that is
        no 64-bit int raises ``ValueError`` naming it, as does a store whose
        token ids no longer match its hashes.
        """
        return encode_collected(self, wire_format(dialect), _pack)

    @staticmethod
    def wire_format(dialect: Dialect) -> EngineFormat:
        """The native writer's format for ``dialect`` (what the sender takes)."""
        return wire_format(dialect)

    def to_batch(self) -> KVEventBatch:
        """The batch as wire structs (hashes unsigned, as decoding yields them)."""
        return decode_batch(self.encode("map"))
