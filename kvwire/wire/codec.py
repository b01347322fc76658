"""msgpack encoding and decoding of :class:`KVEventBatch` in every dialect.

Decoding takes a typed fast path (one C-level pass of msgspec) for the common
map dialect with integer hashes, and falls back to a generic decode plus an
explicit conversion for the rest: positional (array) events, ``bytes`` hashes,
old SGLang's metadata map. Both paths end in the same structs, with hashes
normalised to unsigned 64-bit.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Literal, TypeAlias, cast

import msgspec

from kvwire.wire import _pack
from kvwire.wire.errors import WireError
from kvwire.wire.events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEvent,
    KVEventBatch,
    TokenIds,
)

__all__ = [
    "DEFAULT_LIMITS",
    "POSITIONAL_FIELDS",
    "DecodeLimits",
    "Dialect",
    "EventParts",
    "IntArray",
    "RemovedParts",
    "StoredParts",
    "concat_int_arrays",
    "decode_batch",
    "encode_batch",
    "encode_parts",
    "normalise_hash",
    "pack_int_array",
]

Dialect: TypeAlias = Literal["map", "array"]

U64_MASK = (1 << 64) - 1

IntArray: TypeAlias = list[int] | tuple[int, ...] | msgspec.Raw
"""Ints as a Python sequence, or an already packed msgpack array of them."""

# --- encoding -----------------------------------------------------------------
# Every event field is declared once, in kvwire.wire.events; the wire forms here
# derive from it. vLLM 0.33 sends lora_id, medium and lora_name even when they
# are None, and omits the optional fields after them: the map mirrors below
# redeclare just those as required (and the int arrays as possibly pre-packed),
# in place, so msgspec produces exactly its bytes. The older positional dialect
# is the same fields in declaration order, cut where those consumers stop
# reading. The mirrors hold only ints, strings and arrays, never a cycle, so the
# cyclic garbage collector need not track a publisher's many short-lived
# instances (gc=False).


class _MapBlockStored(BlockStored, tag="BlockStored", omit_defaults=True, frozen=True, gc=False):
    block_hashes: IntArray  # type: ignore[assignment]
    token_ids: IntArray  # type: ignore[assignment]
    lora_id: int | None
    medium: str | None
    lora_name: str | None


class _MapBlockRemoved(BlockRemoved, tag="BlockRemoved", omit_defaults=True, frozen=True, gc=False):
    block_hashes: IntArray  # type: ignore[assignment]
    medium: str | None


# Older consumers read a positional BlockStored up to the sliding window, a
# BlockRemoved up to its medium.
_ARRAY_STORED_LEN = BlockStored.__struct_fields__.index("kv_cache_spec_sliding_window") + 1
_ARRAY_REMOVED_LEN = BlockRemoved.__struct_fields__.index("medium") + 1
_astuple = msgspec.structs.astuple


class _Envelope(msgspec.Struct, array_like=True, gc=False):
    ts: float
    events: list[Any]
    data_parallel_rank: int | None


_ARRAY_CLEARED = ("AllBlocksCleared",)
_encoder = msgspec.msgpack.Encoder()


def _wire_tokens(tokens: list[int] | TokenIds) -> IntArray:
    """Token ids as the encoder takes them: a lazily decoded array goes back as it came."""
    return tokens.raw if type(tokens) is TokenIds else tokens  # type: ignore[return-value]


def _to_map(e: KVEvent) -> Any:
    if type(e) is BlockStored:
        hashes, parent, tokens, *rest = _astuple(e)
        return _MapBlockStored(hashes, parent, _wire_tokens(tokens), *rest)
    if type(e) is BlockRemoved:
        return _MapBlockRemoved(*_astuple(e))
    return e


def encode_batch(batch: KVEventBatch, *, dialect: Dialect = "map") -> bytes:
    """Encode ``batch`` as msgpack.

    ``"map"`` is byte-for-byte what vLLM 0.33 (and SGLang >= 0.5, TensorRT-LLM)
    consumers read; ``"array"`` is the tagged positional layout that consumers
    older than that expect.
    """
    events = [_to_map(e) for e in batch.events]
    return encode_parts(batch.ts, events, batch.data_parallel_rank, dialect=dialect)


# --- publisher fast path ---------------------------------------------------------
# A publisher holding token ids and hashes as numpy arrays can hand them over
# already packed as msgpack (``msgspec.Raw``), skipping the conversion to Python
# ints. ``encode_parts`` then produces the same bytes ``encode_batch`` would for
# the equivalent batch: every int keeps msgspec's smallest encoding.

StoredParts = _MapBlockStored
"""A ``BlockStored`` exactly as the map dialect encodes it, int arrays possibly pre-packed.

Positional: ``(block_hashes, parent_block_hash, token_ids, block_size, lora_id,
medium, lora_name, extra_keys=None, group_idx=None, ...)``.
"""

RemovedParts = _MapBlockRemoved
"""A ``BlockRemoved`` as the map dialect encodes it: ``(block_hashes, medium, group_idx=None)``."""

EventParts: TypeAlias = "_MapBlockStored | _MapBlockRemoved | AllBlocksCleared"

POSITIONAL_FIELDS: dict[type, int] = {
    _MapBlockStored: _ARRAY_STORED_LEN,
    _MapBlockRemoved: _ARRAY_REMOVED_LEN,
    AllBlocksCleared: 0,
}
"""The structs both dialects write (stored, removed, cleared), each with how many of its
fields the ``"array"`` dialect writes after the tag (the native writer's formats)."""


def encode_parts(
    ts: float,
    events: list[EventParts],
    data_parallel_rank: int | None,
    *,
    dialect: Dialect = "map",
) -> bytes:
    """Encode a batch given as parts; byte-identical to :func:`encode_batch`.

    For publishers that build events straight in wire form (no conversion for
    the map dialect) with int arrays from :func:`pack_int_array`.
    """
    if dialect == "map":
        return _encoder.encode(_Envelope(ts, events, data_parallel_rank))
    if dialect != "array":
        raise ValueError(f"unknown dialect {dialect!r}: expected 'map' or 'array'")
    out: list[Any] = []
    for e in events:
        if type(e) is _MapBlockStored:
            out.append(("BlockStored", *_astuple(e)[:_ARRAY_STORED_LEN]))
        elif type(e) is _MapBlockRemoved:
            out.append(("BlockRemoved", *_astuple(e)[:_ARRAY_REMOVED_LEN]))
        else:
            out.append(_ARRAY_CLEARED)
    return _encoder.encode(_Envelope(ts, out, data_parallel_rank))


def _array_header(n: int) -> bytes:
    if n < 16:
        return bytes((0x90 | n,))
    if n < 1 << 16:
        return b"\xdc" + n.to_bytes(2, "big")
    return b"\xdd" + n.to_bytes(4, "big")


def _split_array(raw: msgspec.Raw) -> tuple[int, memoryview]:
    """(length, body) of a packed msgpack array."""
    view = memoryview(raw)
    first = view[0]
    if 0x90 <= first <= 0x9F:
        return first & 0x0F, view[1:]
    if first == 0xDC:
        return int.from_bytes(view[1:3], "big"), view[3:]
    if first == 0xDD:
        return int.from_bytes(view[1:5], "big"), view[5:]
    raise ValueError(f"packed value is not a msgpack array (first byte 0x{first:02x})")


_PACK_MODES = {None: 0, "unsigned": 1, "signed": 2}


def pack_int_array(
    values: Any, *, hashes: Literal["unsigned", "signed"] | None = None, what: str = "int"
) -> msgspec.Raw:
    """Pack ints as a msgpack array, every int in its smallest form.

    The bytes are exactly what msgspec gives for the same list of Python ints,
    so a batch built from packed arrays is byte-identical to
    :func:`encode_batch`'s. ``values`` is a list or tuple of ints, or a 1-D
    integer array (numpy, ``array.array``; any stride), read without making a
    Python int per element. ``hashes`` converts 64-bit hashes to the wire's
    form as they are packed: ``"unsigned"`` wraps negative ones, ``"signed"``
    wraps those above 2**63 - 1. A value that is not an int, or does not fit
    64 bits, raises ``ValueError`` naming it as ``what``.
    """
    return msgspec.Raw(_pack.pack_ints(values, _PACK_MODES[hashes], what))


def concat_int_arrays(parts: Sequence[IntArray]) -> IntArray:
    """Join int arrays end to end, packed or not, into one array for the encoder."""
    if len(parts) == 1:
        return parts[0]
    if not any(type(p) is msgspec.Raw for p in parts):
        out: list[int] = []
        for p in parts:
            out.extend(p)
        return out
    total = 0
    bodies: list[bytes | memoryview] = []
    for p in parts:
        if type(p) is msgspec.Raw:
            n, body = _split_array(p)
        else:
            n, body = _split_array(msgspec.Raw(_encoder.encode(p)))
        total += n
        bodies.append(body)
    return msgspec.Raw(_array_header(total) + b"".join(bodies))


# --- decoding -----------------------------------------------------------------


class DecodeLimits(msgspec.Struct, frozen=True):
    """Bounds :func:`decode_batch` enforces on what a batch may ask of a consumer.

    A batch beyond any of them is a :class:`WireError`, like a malformed one.
    The payload's size is bounded by the receiving socket (``ZMQ_MAXMSGSIZE``);
    these bound the work and memory its content asks for downstream (one index
    entry per block, one weight per token of a block).

    - ``max_events``: events per batch.
    - ``max_blocks``: block hashes per ``BlockStored`` / ``BlockRemoved``. A
      128k-token prompt is 8,192 blocks of 16 tokens.
    - ``max_block_size``: tokens per block; a ``BlockStored`` must have
      ``1 <= block_size <= max_block_size``. Engines use 16 to 1,024.
    - ``max_tokens``: token ids per ``BlockStored``.
    """

    max_events: int = 65_536
    max_blocks: int = 65_536
    max_block_size: int = 65_536
    max_tokens: int = 1 << 22


DEFAULT_LIMITS = DecodeLimits()
"""The limits :func:`decode_batch` applies unless given others."""


class _ListBlockStored(BlockStored, tag="BlockStored", frozen=True, gc=False):
    """The generic path's ``BlockStored``: token ids arrive as a list."""

    token_ids: list[int]


_fast_decoder = msgspec.msgpack.Decoder(KVEventBatch)
_set = msgspec.structs.force_setattr
# msgpack type bytes that start an array: fixarray, array16, array32.
_ARRAY_HEAD = [0x90 <= b <= 0x9F or b in (0xDC, 0xDD) for b in range(256)]
_generic_decoder = msgspec.msgpack.Decoder()


# The positional dialect lists an event's fields in declaration order.
_POSITIONAL = {
    "BlockStored": BlockStored.__struct_fields__,
    "BlockRemoved": BlockRemoved.__struct_fields__,
}
_EVENT_TYPES: dict[str, type[KVEvent]] = {
    "BlockStored": BlockStored,
    "BlockRemoved": BlockRemoved,
    "AllBlocksCleared": AllBlocksCleared,
}


def normalise_hash(h: object) -> int:
    """Map an engine's block hash to the unsigned 64-bit id kvwire uses.

    ints (signed or unsigned) are masked to 64 bits; ``bytes`` (vLLM's raw
    digest mode) keep their last 8 bytes, big-endian, as vLLM's int mode does.
    """
    if type(h) is int:
        if h < -(1 << 63) or h > U64_MASK:
            raise WireError(f"block hash {h} does not fit in 64 bits")
        return h & U64_MASK
    if isinstance(h, (bytes, bytearray, memoryview)):
        b = bytes(h)
        if not b:
            raise WireError("block hash is an empty byte string")
        return int.from_bytes(b[-8:], "big")
    raise WireError(f"block hash must be an int or bytes, not {type(h).__name__}")


def _event_from_generic(index: int, raw: Any) -> KVEvent:
    if isinstance(raw, dict):
        fields = dict(raw)
        kind = fields.pop("type", None)
    elif isinstance(raw, list) and raw:
        kind = raw[0]
        values = raw[1:]
        names = _POSITIONAL.get(kind, ()) if isinstance(kind, str) else ()
        fields = dict(zip(names, values, strict=False))
        if isinstance(fields.get("lora_name"), dict):
            # Old SGLang: a metadata map (cache_salt) where lora_name now is.
            fields["cache_salt"] = fields.pop("lora_name").get("cache_salt")
    else:
        raise WireError(f"event {index} is neither a map nor a tagged array: {raw!r:.80}")
    cls = _EVENT_TYPES.get(kind) if isinstance(kind, str) else None
    if cls is None:
        raise WireError(f"event {index} has unknown type {kind!r:.80}")
    try:
        if cls is BlockStored:
            fields["block_hashes"] = [normalise_hash(h) for h in _as_list(fields, "block_hashes")]
            parent = fields.get("parent_block_hash")
            fields["parent_block_hash"] = None if parent is None else normalise_hash(parent)
            known = _ListBlockStored.__struct_fields__
            e = msgspec.convert({k: v for k, v in fields.items() if k in known}, _ListBlockStored)
            return BlockStored(*msgspec.structs.astuple(e))
        if cls is BlockRemoved:
            fields["block_hashes"] = [normalise_hash(h) for h in _as_list(fields, "block_hashes")]
        known = cls.__struct_fields__
        fields = {k: v for k, v in fields.items() if k in known}
        return msgspec.convert(fields, cls)
    except WireError as exc:
        raise WireError(f"event {index} ({kind}): {exc}") from None
    except msgspec.ValidationError as exc:
        raise WireError(f"event {index} ({kind}): {exc}") from None


def _as_list(fields: dict[str, Any], name: str) -> list[Any]:
    value = fields.get(name)
    if not isinstance(value, list):
        raise WireError(f"{name} must be an array, got {type(value).__name__}")
    return value


def _decode_generic(payload: bytes) -> KVEventBatch:
    try:
        raw = _generic_decoder.decode(payload)
    except msgspec.DecodeError as exc:
        raise WireError(f"payload is not valid msgpack: {exc}") from None
    except RecursionError:
        raise WireError("payload nests too deeply") from None
    if not isinstance(raw, list) or len(raw) < 2:
        raise WireError(
            f"envelope must be an array [ts, events, rank?], got {type(raw).__name__}"
            + (f" of length {len(raw)}" if isinstance(raw, list) else "")
        )
    ts, events = raw[0], raw[1]
    rank = raw[2] if len(raw) > 2 else None
    if type(ts) not in (int, float):
        raise WireError(f"envelope timestamp must be a number, got {type(ts).__name__}")
    if not isinstance(events, list):
        raise WireError(f"envelope events must be an array, got {type(events).__name__}")
    if rank is not None and type(rank) is not int:
        raise WireError(f"envelope rank must be an int or nil, got {type(rank).__name__}")
    decoded = [_event_from_generic(i, e) for i, e in enumerate(events)]
    return KVEventBatch(float(ts), decoded, rank)


def decode_batch(
    payload: bytes | bytearray | memoryview, limits: DecodeLimits = DEFAULT_LIMITS
) -> KVEventBatch:
    """Decode one batch payload of any dialect in the wild.

    Raises :class:`WireError` naming the problem for anything that is not a
    whole, valid batch within ``limits`` (nesting too deep included). Token
    ids are checked to be an array here and turned into ints only when first
    read (:class:`TokenIds`), which raises :class:`WireError` then if they are
    not ints.
    """
    try:
        batch = _fast_decoder.decode(payload)
    except (msgspec.ValidationError, msgspec.DecodeError):
        return _check_limits(_decode_generic(bytes(payload)), limits)
    except RecursionError:
        raise WireError("payload nests too deeply") from None
    events = batch.events
    if len(events) > limits.max_events:
        raise WireError(f"batch has {len(events)} events, more than {limits.max_events}")
    max_blocks = limits.max_blocks
    # Fix-ups in place, on events no one else has seen yet: wrap the packed token
    # ids, and mask signed (int64) hashes, the TensorRT-LLM/SGLang form, to unsigned.
    for e in events:
        kind = type(e)
        if kind is BlockStored:
            raw = cast(msgspec.Raw, e.token_ids)  # type: ignore[union-attr]
            if not _ARRAY_HEAD[memoryview(raw)[0]]:
                raise WireError("a BlockStored event's token_ids must be an array")
            tokens = TokenIds(raw)
            size = e.block_size  # type: ignore[union-attr]
            if not 1 <= size <= limits.max_block_size or (
                len(raw) > limits.max_tokens and len(tokens) > limits.max_tokens
            ):
                _check_stored(e, limits)  # type: ignore[arg-type]
            _set(e, "token_ids", tokens)
            parent = e.parent_block_hash  # type: ignore[union-attr]
            if parent is not None and parent < 0:
                _set(e, "parent_block_hash", parent & U64_MASK)
        elif kind is not BlockRemoved:
            continue
        hashes = e.block_hashes  # type: ignore[union-attr]
        if len(hashes) > max_blocks:
            raise WireError(f"an event lists {len(hashes)} blocks, more than {max_blocks}")
        if hashes and min(hashes) < 0:
            _set(e, "block_hashes", [h & U64_MASK for h in hashes])
    return batch


def _check_stored(e: BlockStored, limits: DecodeLimits) -> None:
    """Raise :class:`WireError` when a store's block size or token count is out of bounds."""
    size = e.block_size
    if not 1 <= size <= limits.max_block_size:
        raise WireError(f"block_size {size} is outside 1..{limits.max_block_size}")
    tokens: Any = e.token_ids
    n = len(TokenIds(tokens) if type(tokens) is msgspec.Raw else tokens)
    if n > limits.max_tokens:
        raise WireError(f"an event carries {n} token ids, more than {limits.max_tokens}")


def _check_limits(batch: KVEventBatch, limits: DecodeLimits) -> KVEventBatch:
    """``batch`` when it is within ``limits``; else :class:`WireError`."""
    if len(batch.events) > limits.max_events:
        raise WireError(f"batch has {len(batch.events)} events, more than {limits.max_events}")
    for e in batch.events:
        if type(e) is AllBlocksCleared:
            continue
        if len(e.block_hashes) > limits.max_blocks:  # type: ignore[union-attr]
            raise WireError(
                f"an event lists {len(e.block_hashes)} blocks, more than {limits.max_blocks}"  # type: ignore[union-attr]
            )
        if type(e) is BlockStored:
            _check_stored(e, limits)
    return batch
