"""The KV-cache event types every engine dialect shares (see WIRE.md), and the wire's error.

These structs are what :func:`kvwire.wire.decode_batch` returns and what
:func:`kvwire.wire.encode_batch` takes. Hashes are always unsigned 64-bit
integers here, whatever the engine put on the wire.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING, Any, TypeAlias, overload

import msgspec

__all__ = [
    "AllBlocksCleared",
    "BlockRemoved",
    "BlockStored",
    "KVEvent",
    "KVEventBatch",
    "TokenIds",
    "WireError",
    "enc_hook",
]


class WireError(ValueError):
    """A payload or frame that is not valid KV-event traffic, the one exception the wire
    layer raises for bad input. The message names what was wrong. Decoding either returns a
    whole batch or raises this; it never returns half a batch."""


_token_decoder = msgspec.msgpack.Decoder(list[int])


def packed_count(packed: bytes | memoryview, fix: int) -> int | None:
    """The item count a packed msgpack array (``fix`` 0x90) or map (0x80) declares in its
    header; ``None``: the bytes start no such container."""
    first = packed[0] if len(packed) else 0
    if fix <= first <= fix + 15:
        return first & 0x0F
    wide = 0xDC if fix == 0x90 else 0xDE  # then the 32-bit form, wide + 1
    if first in (wide, wide + 1):
        return int.from_bytes(packed[1 : 3 if first == wide else 5], "big")
    return None


class TokenIds(Sequence[int]):
    """A decoded event's token ids, still in their msgpack form until first read.

    Decoding makes a Python int per token, the largest cost of reading a batch;
    a consumer that never looks at tokens (sequencing, block-set tracking)
    never pays it. Reading (iteration, indexing, :meth:`tolist`, comparison)
    decodes once; bad content raises :class:`WireError` then. ``len()`` reads
    the array header only.
    """

    __slots__ = ("_list", "raw")

    def __init__(self, raw: msgspec.Raw) -> None:
        self.raw = raw
        """The msgpack array as received."""
        self._list: list[int] | None = None

    def tolist(self) -> list[int]:
        """The token ids as a list (decoded on first call, then kept)."""
        if self._list is None:
            try:
                self._list = _token_decoder.decode(self.raw)
            except (msgspec.ValidationError, msgspec.DecodeError) as exc:
                raise WireError(f"token_ids: {exc}") from None
        return self._list

    def __len__(self) -> int:
        if self._list is not None:
            return len(self._list)
        head = memoryview(self.raw)
        n = packed_count(head, 0x90)
        if n is None:
            raise WireError(f"token_ids is not an array (it starts {bytes(head[:1])!r})")
        return n

    @overload
    def __getitem__(self, index: int) -> int: ...

    @overload
    def __getitem__(self, index: slice) -> list[int]: ...

    def __getitem__(self, index: int | slice) -> int | list[int]:
        return self.tolist()[index]

    def __iter__(self) -> Iterator[int]:
        return iter(self.tolist())

    def __eq__(self, other: object) -> bool:
        if isinstance(other, TokenIds):
            return bytes(self.raw) == bytes(other.raw) or self.tolist() == other.tolist()
        if isinstance(other, (list, tuple)):
            return self.tolist() == list(other)
        return NotImplemented

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        return f"TokenIds({self.tolist()!r})"


def enc_hook(obj: Any) -> Any:
    """msgspec ``enc_hook`` for event structs: lazily decoded token ids encode as a list.

    Pass it to ``msgspec.to_builtins`` or a ``msgspec.json.Encoder`` to turn
    decoded events into JSON or plain Python objects.
    """
    if type(obj) is TokenIds:
        return obj.tolist()
    raise TypeError(f"cannot encode objects of type {type(obj).__name__}")


class BlockStored(msgspec.Struct, tag=True, omit_defaults=True, frozen=True, gc=False):
    """Blocks that entered the prefix cache, as one chain.

    Block ``i``'s parent is block ``i - 1``; block 0's is ``parent_block_hash``
    (``None``: the first block of a sequence). ``token_ids`` holds the tokens of
    every listed block, ``block_size`` each, in order: a list when built here,
    a lazily decoded :class:`TokenIds` when decoded from the wire.
    """

    block_hashes: list[int]
    parent_block_hash: int | None
    if TYPE_CHECKING:
        token_ids: list[int] | TokenIds
    else:
        # msgspec decodes the packed array; decode_batch wraps it in TokenIds
        # before anyone sees the event.
        token_ids: msgspec.Raw
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


class BlockRemoved(msgspec.Struct, tag=True, omit_defaults=True, frozen=True, gc=False):
    """Blocks that left the cache; they may belong to different chains."""

    block_hashes: list[int]
    medium: str | None = "GPU"
    group_idx: int | None = None
    locality: Any = None
    ownership: Any = None


class AllBlocksCleared(msgspec.Struct, tag=True, frozen=True):
    """The engine dropped its whole prefix cache (a reset)."""


KVEvent: TypeAlias = BlockStored | BlockRemoved | AllBlocksCleared


class KVEventBatch(msgspec.Struct, array_like=True, frozen=True, gc=False):
    """One engine iteration's events: the positional envelope ``[ts, events, rank]``."""

    ts: float
    events: list[KVEvent]
    data_parallel_rank: int | None = None
