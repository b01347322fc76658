"""The KV-cache event types every engine dialect shares (see WIRE.md).

These structs are what :func:`kvwire.wire.decode_batch` returns and what
:func:`kvwire.wire.encode_batch` takes. Hashes are always unsigned 64-bit
integers here, whatever the engine put on the wire.
"""

from __future__ import annotations

from typing import Any, TypeAlias

import msgspec

__all__ = [
    "AllBlocksCleared",
    "BlockRemoved",
    "BlockStored",
    "KVEvent",
    "KVEventBatch",
]


class BlockStored(msgspec.Struct, tag=True, omit_defaults=True, frozen=True):
    """Blocks that entered the prefix cache, as one chain.

    Block ``i``'s parent is block ``i - 1``; block 0's is ``parent_block_hash``
    (``None``: the first block of a sequence). ``token_ids`` holds the tokens of
    every listed block, ``block_size`` each, in order.
    """

    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None = None
    medium: str | None = "GPU"
    lora_name: str | None = None
    extra_keys: list[Any] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None
    locality: Any = None
    ownership: Any = None
    session_id: Any = None
    lookahead_token_ids: list[int] | None = None
    cache_salt: Any = None


class BlockRemoved(msgspec.Struct, tag=True, omit_defaults=True, frozen=True):
    """Blocks that left the cache; they may belong to different chains."""

    block_hashes: list[int]
    medium: str | None = "GPU"
    group_idx: int | None = None
    locality: Any = None
    ownership: Any = None


class AllBlocksCleared(msgspec.Struct, tag=True, frozen=True):
    """The engine dropped its whole prefix cache (a reset)."""


KVEvent: TypeAlias = BlockStored | BlockRemoved | AllBlocksCleared


class KVEventBatch(msgspec.Struct, array_like=True, frozen=True):
    """One engine iteration's events: the positional envelope ``[ts, events, rank]``."""

    ts: float
    events: list[KVEvent]
    data_parallel_rank: int | None = None
