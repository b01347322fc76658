"""msgpack encoding and decoding of :class:`KVEventBatch` in every dialect.

Decoding takes a typed fast path (one C-level pass of msgspec) for the common
map dialect with integer hashes, and falls back to a generic decode plus an
explicit conversion for the rest: positional (array) events, ``bytes`` hashes,
old SGLang's metadata map. Both paths end in the same structs, with hashes
normalised to unsigned 64-bit.
"""

from __future__ import annotations

from typing import Any, Literal, TypeAlias

import msgspec

from kvwire.wire.errors import WireError
from kvwire.wire.events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEvent,
    KVEventBatch,
)

__all__ = ["Dialect", "decode_batch", "encode_batch", "normalise_hash"]

Dialect: TypeAlias = Literal["map", "array"]

U64_MASK = (1 << 64) - 1

# --- encoding -----------------------------------------------------------------
# vLLM 0.33 sends lora_id, medium and lora_name even when they are None, and
# omits the optional fields after them. These mirrors make msgspec produce
# exactly its bytes; the public structs keep defaults so any dialect decodes.


class _MapBlockStored(msgspec.Struct, tag="BlockStored", omit_defaults=True):
    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[Any] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None
    locality: Any = None
    ownership: Any = None
    session_id: Any = None
    lookahead_token_ids: list[int] | None = None
    cache_salt: Any = None


class _MapBlockRemoved(msgspec.Struct, tag="BlockRemoved", omit_defaults=True):
    block_hashes: list[int]
    medium: str | None
    group_idx: int | None = None
    locality: Any = None
    ownership: Any = None


class _ArrayBlockStored(msgspec.Struct, tag="BlockStored", array_like=True):
    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[Any] | None
    group_idx: int | None
    kv_cache_spec_kind: str | None
    kv_cache_spec_sliding_window: int | None


class _ArrayBlockRemoved(msgspec.Struct, tag="BlockRemoved", array_like=True):
    block_hashes: list[int]
    medium: str | None


class _ArrayAllBlocksCleared(msgspec.Struct, tag="AllBlocksCleared", array_like=True):
    pass


class _Envelope(msgspec.Struct, array_like=True):
    ts: float
    events: list[Any]
    data_parallel_rank: int | None


_ARRAY_CLEARED = _ArrayAllBlocksCleared()
_encoder = msgspec.msgpack.Encoder()


def _to_map(e: KVEvent) -> Any:
    if type(e) is BlockStored:
        return _MapBlockStored(
            e.block_hashes, e.parent_block_hash, e.token_ids, e.block_size,
            e.lora_id, e.medium, e.lora_name, e.extra_keys, e.group_idx,
            e.kv_cache_spec_kind, e.kv_cache_spec_sliding_window, e.locality,
            e.ownership, e.session_id, e.lookahead_token_ids, e.cache_salt,
        )  # fmt: skip
    if type(e) is BlockRemoved:
        return _MapBlockRemoved(
            e.block_hashes, e.medium, e.group_idx, e.locality, e.ownership
        )
    return e


def _to_array(e: KVEvent) -> Any:
    if type(e) is BlockStored:
        return _ArrayBlockStored(
            e.block_hashes, e.parent_block_hash, e.token_ids, e.block_size,
            e.lora_id, e.medium, e.lora_name, e.extra_keys, e.group_idx,
            e.kv_cache_spec_kind, e.kv_cache_spec_sliding_window,
        )  # fmt: skip
    if type(e) is BlockRemoved:
        return _ArrayBlockRemoved(e.block_hashes, e.medium)
    return _ARRAY_CLEARED


def encode_batch(batch: KVEventBatch, *, dialect: Dialect = "map") -> bytes:
    """Encode ``batch`` as msgpack.

    ``"map"`` is byte-for-byte what vLLM 0.33 (and SGLang >= 0.5, TensorRT-LLM)
    consumers read; ``"array"`` is the tagged positional layout that consumers
    older than that expect.
    """
    if dialect == "map":
        convert = _to_map
    elif dialect == "array":
        convert = _to_array
    else:
        raise ValueError(f"unknown dialect {dialect!r}: expected 'map' or 'array'")
    events = [convert(e) for e in batch.events]
    return _encoder.encode(_Envelope(batch.ts, events, batch.data_parallel_rank))


# --- decoding -----------------------------------------------------------------

_fast_decoder = msgspec.msgpack.Decoder(KVEventBatch)
_generic_decoder = msgspec.msgpack.Decoder()

_STORED_POSITIONAL = (
    "block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id",
    "medium", "lora_name", "extra_keys", "group_idx", "kv_cache_spec_kind",
    "kv_cache_spec_sliding_window", "locality", "ownership", "session_id",
    "lookahead_token_ids", "cache_salt",
)  # fmt: skip
_REMOVED_POSITIONAL = ("block_hashes", "medium", "group_idx", "locality", "ownership")
_POSITIONAL = {"BlockStored": _STORED_POSITIONAL, "BlockRemoved": _REMOVED_POSITIONAL}
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


def _has_negative(hashes: list[int]) -> bool:
    return bool(hashes) and min(hashes) < 0


def _normalise_signed(batch: KVEventBatch) -> KVEventBatch:
    """Fast-path fix-up: mask negative (int64) hashes, the TensorRT-LLM/SGLang form."""
    events: list[KVEvent] = []
    changed = False
    for e in batch.events:
        if type(e) is BlockStored:
            parent = e.parent_block_hash
            if _has_negative(e.block_hashes) or (parent is not None and parent < 0):
                e = msgspec.structs.replace(
                    e,
                    block_hashes=[h & U64_MASK for h in e.block_hashes],
                    parent_block_hash=None if parent is None else parent & U64_MASK,
                )
                changed = True
        elif type(e) is BlockRemoved and _has_negative(e.block_hashes):
            e = msgspec.structs.replace(
                e, block_hashes=[h & U64_MASK for h in e.block_hashes]
            )
            changed = True
        events.append(e)
    if not changed:
        return batch
    return KVEventBatch(batch.ts, events, batch.data_parallel_rank)


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
        elif cls is BlockRemoved:
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


def decode_batch(payload: bytes | bytearray | memoryview) -> KVEventBatch:
    """Decode one batch payload of any dialect in the wild.

    Raises :class:`WireError` naming the problem for anything that is not a
    whole, valid batch.
    """
    try:
        batch = _fast_decoder.decode(payload)
    except (msgspec.ValidationError, msgspec.DecodeError):
        return _decode_generic(bytes(payload))
    return _normalise_signed(batch)
