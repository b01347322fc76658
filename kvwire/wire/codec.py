"""msgpack encoding and decoding of :class:`KVEventBatch` in every dialect.

Decoding takes a typed fast path for a payload the native reader
(``kvwire/_native/scan.h``, the one every native consumer uses) vouches for:
the structs are built in C from the reader's flat view of the events (the
bytes walked once), or, for the rarer fields the view does not hold, by
msgspec. Any other payload goes the general way, a generic decode plus an
explicit conversion, every rule checked in Python: ``bytes`` hashes, old
SGLang's metadata map, non-ASCII strings, anything malformed. Both end in the
same structs, with hashes normalised to unsigned 64-bit and token ids packed
as received (:class:`TokenIds`).
"""

from __future__ import annotations

from typing import Any, Literal, TypeAlias

import msgspec

from kvwire.wire import _pack, _scan
from kvwire.wire.events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEvent,
    KVEventBatch,
    TokenIds,
    WireError,
    packed_count,
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


_encoder = msgspec.msgpack.Encoder()


def _to_map(e: KVEvent) -> Any:
    if type(e) is BlockStored:
        hashes, parent, tokens, *rest = _astuple(e)
        if type(tokens) is TokenIds:  # a lazily decoded array goes back as it came
            tokens = tokens.raw
        return _MapBlockStored(hashes, parent, tokens, *rest)
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
    # each event [tag, field...], as many fields as POSITIONAL_FIELDS says
    out = [(type(e).__struct_config__.tag, *_astuple(e)[: POSITIONAL_FIELDS[type(e)]]) for e in events]
    return _encoder.encode(_Envelope(ts, out, data_parallel_rank))


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


class _MapBatch(msgspec.Struct, frozen=True, gc=False):
    """The envelope as a map, ``{"ts", "events", "data_parallel_rank"?}``: vLLM's
    ``EventBatch`` at the commits where it was not ``array_like``."""

    ts: float
    events: list[KVEvent]
    data_parallel_rank: int | None = None


# The positional dialect, typed: each event a tagged array of its fields in
# declaration order (trailing ones omitted take their defaults).
class _ArrayStored(BlockStored, tag="BlockStored", array_like=True, frozen=True, gc=False):
    pass


class _ArrayRemoved(BlockRemoved, tag="BlockRemoved", array_like=True, frozen=True, gc=False):
    pass


class _ArrayCleared(AllBlocksCleared, tag="AllBlocksCleared", array_like=True, frozen=True):
    pass


class _ArrayEventsBatch(msgspec.Struct, array_like=True, frozen=True, gc=False):
    ts: float
    events: list[_ArrayStored | _ArrayRemoved | _ArrayCleared]
    data_parallel_rank: int | None = None


_fast_decoder = msgspec.msgpack.Decoder(KVEventBatch)
_fast_map_decoder = msgspec.msgpack.Decoder(_MapBatch)
_fast_array_decoder = msgspec.msgpack.Decoder(_ArrayEventsBatch)
_set = msgspec.structs.force_setattr
_generic_decoder = msgspec.msgpack.Decoder()
_raw_items = msgspec.msgpack.Decoder(list[msgspec.Raw])


# By tag; the positional dialect lists an event's fields in declaration order.
_EVENT_TYPES: dict[str, type[KVEvent]] = {
    c.__name__: c for c in (BlockStored, BlockRemoved, AllBlocksCleared)
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


def _named(packed: memoryview, what: str) -> dict[str, msgspec.Raw] | None:
    """A packed map's values by key (``None``: not a map); a key that is not a string, or
    one given twice, is a :class:`WireError` naming ``what``."""
    n = packed_count(packed, 0x80)
    if n is None:
        return None
    try:
        named = _map_values.decode(packed)
    except msgspec.ValidationError:
        raise WireError(f"{what} has a key that is not a string") from None
    if len(named) != n:
        raise WireError(f"{what} gives a key twice")
    return named


def _event_from_generic(index: int, raw: msgspec.Raw) -> KVEvent:
    packed = memoryview(raw)
    named = _named(packed, f"event {index}")
    is_map = named is not None
    if named is not None:
        kind = _generic_decoder.decode(named.pop("type")) if "type" in named else None
    else:
        try:
            values = _raw_items.decode(packed)
        except msgspec.ValidationError:
            value = _generic_decoder.decode(packed)
            raise WireError(f"event {index} is neither a map nor a tagged array: {value!r:.80}") from None
        if not values:
            raise WireError(f"event {index} is an empty array, not a tagged event")
        kind = _generic_decoder.decode(values[0])
    cls = _EVENT_TYPES.get(kind) if isinstance(kind, str) else None
    if cls is None:
        raise WireError(f"event {index} has unknown type {kind!r:.80}")
    known = cls.__struct_fields__
    if named is None:
        named = dict(zip(known, values[1:], strict=False))
    # Unknown fields are skipped unread, as msgspec's typed decoding skips them.
    fields = {k: _generic_decoder.decode(v) for k, v in named.items() if k in known and k != "token_ids"}
    try:
        if cls is not AllBlocksCleared:
            hashes = fields.get("block_hashes")
            if not isinstance(hashes, list):
                raise WireError(f"block_hashes must be an array, got {type(hashes).__name__}")
            fields["block_hashes"] = [normalise_hash(h) for h in hashes]
        if cls is not BlockStored:
            return msgspec.convert(fields, cls)
        if not is_map and isinstance(fields.get("lora_name"), dict):
            # Old SGLang: a metadata map (cache_salt) where lora_name now is.
            fields["cache_salt"] = fields.pop("lora_name").get("cache_salt")
        if fields.get("parent_block_hash") is not None:
            fields["parent_block_hash"] = normalise_hash(fields["parent_block_hash"])
        tokens = None
        if "token_ids" in named:
            tokens = TokenIds(named["token_ids"])
            tokens.tolist()  # WireError for anything but an array of ints
            fields["token_ids"] = []
        e = msgspec.convert(fields, _ListBlockStored)
        _set(e, "token_ids", tokens)
        return BlockStored(*msgspec.structs.astuple(e))
    except (WireError, msgspec.ValidationError) as exc:
        raise WireError(f"event {index} ({kind}): {exc}") from None


def _decode_generic(payload: bytes | bytearray | memoryview, limits: DecodeLimits) -> KVEventBatch:
    """The general path: any dialect, every rule checked in Python."""
    try:
        return _check_limits(_generic_batch(memoryview(payload)), limits)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise WireError(f"payload is not valid msgpack: {exc}") from None
    except RecursionError:
        raise WireError("payload nests too deeply") from None


def _generic_batch(payload: memoryview) -> KVEventBatch:
    rank: Any = None
    envelope = _named(payload, "envelope map")
    if envelope is not None:
        missing = [k for k in ("ts", "events") if k not in envelope]
        if missing:
            raise WireError(f"envelope map lacks {', '.join(missing)}")
        ts = _generic_decoder.decode(envelope["ts"])
        packed_events = envelope["events"]
        if "data_parallel_rank" in envelope:
            rank = _generic_decoder.decode(envelope["data_parallel_rank"])
    else:
        try:
            items = _raw_items.decode(payload)
        except msgspec.ValidationError:
            got = type(_generic_decoder.decode(payload)).__name__
            raise WireError(f"envelope must be an array [ts, events, rank?] or a map, got {got}") from None
        if len(items) < 2:
            raise WireError(f"envelope must be an array [ts, events, rank?], got one of length {len(items)}")
        ts, packed_events = _generic_decoder.decode(items[0]), items[1]
        if len(items) > 2:
            rank = _generic_decoder.decode(items[2])
    if type(ts) not in (int, float):
        raise WireError(f"envelope timestamp must be a number, got {type(ts).__name__}")
    try:
        raw_events = _raw_items.decode(packed_events)
    except msgspec.ValidationError:
        got = type(_generic_decoder.decode(packed_events)).__name__
        raise WireError(f"envelope events must be an array, got {got}") from None
    if rank is not None and type(rank) is not int:
        raise WireError(f"envelope rank must be an int or nil, got {type(rank).__name__}")
    decoded = [_event_from_generic(i, e) for i, e in enumerate(raw_events)]
    return KVEventBatch(float(ts), decoded, rank)


_map_values = msgspec.msgpack.Decoder(dict[str, msgspec.Raw])


def decode_batch(
    payload: bytes | bytearray | memoryview, limits: DecodeLimits = DEFAULT_LIMITS
) -> KVEventBatch:
    """Decode one batch payload of any dialect in the wild.

    Raises :class:`WireError` naming the problem for anything that is not a
    whole, valid batch within ``limits``: a missing required field, a key
    given twice, a token id that is not an integer among them. One answer
    whichever path is taken (see the module). Token ids stay packed until
    first read (:class:`TokenIds`).
    """
    batch = _decode_typed(payload, limits)
    return _decode_generic(payload, limits) if batch is None else batch


_FROM_ARRAYS: dict[type, type[KVEvent]] = {
    _ArrayStored: BlockStored,
    _ArrayRemoved: BlockRemoved,
    _ArrayCleared: AllBlocksCleared,
}


def _from_arrays(b: _ArrayEventsBatch) -> KVEventBatch:
    """The positional dialect's batch as the event structs."""
    events = [_FROM_ARRAYS[type(e)](*_astuple(e)) for e in b.events]
    return KVEventBatch(b.ts, events, b.data_parallel_rank)


def _from_map_envelope(payload: bytes | bytearray | memoryview) -> KVEventBatch:
    m = _fast_map_decoder.decode(payload)
    return KVEventBatch(m.ts, m.events, m.data_parallel_rank)


# The typed path, in C (kvwire/wire/_scan.c): the native reader vouches for the
# payload and the structs are built from its flat view; a batch with fields
# the view does not hold (lora_id, extra_keys, ...) is decoded by msgspec (the
# decoder for its envelope and event forms) and fixed up in place: packed token
# ids wrapped (TokenIds), signed (int64) hashes, the TensorRT-LLM/SGLang form,
# masked to unsigned. ``None``: a payload for the general path.
_scan.bind(
    _fast_decoder.decode,
    lambda payload: _from_arrays(_fast_array_decoder.decode(payload)),
    _from_map_envelope,
    (msgspec.ValidationError, msgspec.DecodeError),
    TokenIds,
    msgspec.Raw,
    KVEventBatch,
    BlockStored,
    BlockRemoved,
    AllBlocksCleared,
)
_decode_typed = _scan.typed


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
        if type(e) is not BlockStored:
            continue
        size = e.block_size
        if not 1 <= size <= limits.max_block_size:
            raise WireError(f"block_size {size} is outside 1..{limits.max_block_size}")
        tokens: Any = e.token_ids
        n = len(TokenIds(tokens) if type(tokens) is msgspec.Raw else tokens)
        if n > limits.max_tokens:
            raise WireError(f"an event carries {n} token ids, more than {limits.max_tokens}")
    return batch
