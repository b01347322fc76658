"""One iteration's records as a batch, and the formats of the one native writer.

One writer (``kvwire/publisher/sender/writer.c``) writes every payload the
publisher sends: a collector's batch in kvwire's dialects and an engine's own
batch structs, so the bytes, the coalescing of chained stores and of removals,
and the errors for bad input exist once. It needs, per event struct, the tag,
the field keys in order and which fields msgspec omits when ``None``:
:func:`struct_layout` reads them from the struct's class, so the bytes follow
the class (``kvwire.wire.events`` for kvwire's dialects, the engine's
``kv_events`` for an engine's).

A :class:`CollectedBatch` holds the hook calls of one iteration as
:class:`~kvwire.publisher._sender.Record` objects (the collector's C records
seen from Python: named fields, no copy), encoded by that writer.
"""

from __future__ import annotations

import functools
from typing import Any

import msgspec

from kvwire.wire import Dialect, KVEventBatch, decode_batch
from kvwire.wire.codec import POSITIONAL_FIELDS

from ._sender import CLEARED, REMOVED, STORED, EngineFormat, Record, encode_collected

__all__ = [
    "CLEARED", "REMOVED", "STORED", "CollectedBatch", "EventLayout", "Record", "struct_layout",
    "wire_format",
]  # fmt: skip

_pack = msgspec.msgpack.Encoder().encode  # extra_keys, whatever their items are

EventLayout = tuple[type, "str | None", str, tuple[tuple[str, str, bool], ...]]
"""``(cls, tag_field, tag, ((attr, key, omit_none), ...))``; tag_field ``None``: a
tagged array ``[tag, value...]``."""


def struct_layout(cls: type, positional: int | None = None) -> EventLayout | None:
    """How msgspec writes a tagged event struct: as a map, or with ``positional`` as a
    tagged array of its first ``positional`` fields. ``None`` when the native writer
    cannot write it (array-like, untagged, a default other than ``None``)."""
    config: Any = cls.__struct_config__  # type: ignore[attr-defined]
    if config.array_like or not isinstance(config.tag, str) or config.tag_field is None:
        return None
    names: tuple[str, ...] = cls.__struct_fields__  # type: ignore[attr-defined]
    keys: tuple[str, ...] = cls.__struct_encode_fields__  # type: ignore[attr-defined]
    if positional is not None:
        fields = tuple((n, k, False) for n, k in zip(names, keys, strict=True))[:positional]
        return (cls, None, config.tag, fields)
    defaults: tuple[Any, ...] = cls.__struct_defaults__  # type: ignore[attr-defined]
    if config.omit_defaults and any(d is not None for d in defaults):
        return None
    first_default = len(names) - len(defaults)
    return (cls, config.tag_field, config.tag, tuple(
        (name, key, bool(config.omit_defaults) and i >= first_default)
        for i, (name, key) in enumerate(zip(names, keys, strict=True))
    ))  # fmt: skip


class _Envelope:
    """The batch layout the formats name: ``[ts, events, rank]`` (never instantiated)."""

    __slots__ = ("data_parallel_rank", "events", "ts")


@functools.cache
def wire_format(dialect: Dialect) -> EngineFormat:
    """kvwire's ``dialect`` as a format for collector records: ``encode_batch``'s bytes."""
    if dialect not in ("map", "array"):
        raise ValueError(f"unknown dialect {dialect!r}: expected 'map' or 'array'")
    layouts = []
    for cls, n in POSITIONAL_FIELDS.items():
        layout = struct_layout(cls, n if dialect == "array" else None)
        assert layout is not None, cls  # kvwire's own events: always writable
        layouts.append(layout)
    return EngineFormat(
        _Envelope, ("ts", "events", "data_parallel_rank"), tuple(layouts), records=True
    )


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

    # The native sender asks its batch type for the format (``batch_type.wire_format()``).
    wire_format = staticmethod(wire_format)

    def to_batch(self) -> KVEventBatch:
        """The batch as wire structs (hashes unsigned, as decoding yields them)."""
        return decode_batch(self.encode("map"))
