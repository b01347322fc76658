"""The native writer's formats: how msgspec writes a struct, for the sender's C writer.

One writer (``kvwire/publisher/sender/writer.c``) writes every payload the
publisher sends: a collector's batch in kvwire's dialects and an engine's own
batch structs. It needs, per event struct, the tag, the field keys in order
and which fields msgspec omits when ``None``: :func:`struct_layout` reads them
from the struct's class, so the bytes follow the class (``kvwire.wire.events``
for kvwire's dialects, the engine's ``kv_events`` for an engine's).
"""

from __future__ import annotations

import functools
from typing import Any

from kvwire.wire import Dialect
from kvwire.wire.codec import POSITIONAL_FIELDS

from ._sender import EngineFormat

__all__ = ["EventLayout", "struct_layout", "wire_format"]

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
