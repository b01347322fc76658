"""The hooks a KV cache manager calls: collect one iteration's changes, publish one batch.

Everything on the engine thread is a reference or a cheap copy. Lists and
tuples are kept by reference, as engines pass fresh ones (slices, new lists of
hashes): they must not be changed after the call. Numpy arrays and CPU tensors
are copied (engines reuse buffers), CUDA tensors copied into pinned host memory
without waiting (a CUDA event marks when the copy is done). Conversion,
coalescing and msgpack encoding happen later, on the publisher's thread, when
it calls :meth:`CollectedBatch.encode`.
"""

from __future__ import annotations

import operator
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any, Literal, Protocol, TypeAlias

import msgspec
import numpy as np
import numpy.typing as npt

from kvwire.wire import AllBlocksCleared, Dialect, KVEventBatch, decode_batch
from kvwire.wire.codec import (
    EventParts,
    IntArray,
    RemovedParts,
    StoredParts,
    concat_int_arrays,
    encode_parts,
    pack_int_array,
)

from .publisher import PendingBatch

__all__ = [
    "BatchPublisher",
    "CollectedBatch",
    "CollectorStats",
    "EventCollector",
    "HashFormat",
    "IntWidths",
]

HashFormat: TypeAlias = Literal["unsigned", "signed"]
IntWidths: TypeAlias = Literal["minimal", "fixed"]

_U64 = (1 << 64) - 1
_I64_MIN = -(1 << 63)
_I64_MAX = (1 << 63) - 1

_STORE = 0
_REMOVE = 1
_CLEAR = 2
_CLEAR_RECORD = (_CLEAR,)
_CLEARED = AllBlocksCleared()
_CHANGED = (
    "the token ids or hashes passed to stored() changed before the batch was encoded; "
    "pass lists that are not modified afterwards"
)
# Below this length numpy's per-call overhead makes packing dearer than tolist().
_PACK_MIN = 512


class BatchPublisher(Protocol):
    """What the collector needs from a publisher (``EventPublisher`` is one)."""

    rank: int

    def publish(self, batch: KVEventBatch | PendingBatch) -> bool: ...


class _DeviceInts:
    """A CUDA tensor being copied to pinned host memory; read it off the engine thread.

    The copy is queued on the tensor's current stream without waiting. One CUDA
    event per stream, recorded at ``flush()``, marks when an iteration's copies
    are done; the publisher's thread waits on it, never the engine thread.
    """

    __slots__ = ("done", "host", "stream")

    def __init__(self, tensor: Any) -> None:
        import torch

        host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
        host.copy_(tensor, non_blocking=True)
        self.host = host
        self.stream = torch.cuda.current_stream(tensor.device)
        self.done: Any = None

    def __len__(self) -> int:
        return int(self.host.shape[0])

    def numpy(self) -> npt.NDArray[np.integer[Any]]:
        self.done.synchronize()
        out: npt.NDArray[np.integer[Any]] = self.host.numpy()
        return out


def _mark_copies_done(pending: list[_DeviceInts]) -> None:
    import torch

    events: dict[Any, Any] = {}
    for copy in pending:
        event = events.get(copy.stream)
        if event is None:
            event = events[copy.stream] = torch.cuda.Event()  # type: ignore[no-untyped-call]
            event.record(copy.stream)
        copy.done = event
    pending.clear()


_Captured: TypeAlias = "list[int] | tuple[int, ...] | npt.NDArray[np.integer[Any]] | _DeviceInts"


def _capture(values: Any, what: str, pending: list[_DeviceInts]) -> _Captured:
    """Take a private snapshot of ``values`` as cheaply as the type allows."""
    kind = type(values)
    if kind is list or kind is tuple:
        return values  # type: ignore[no-any-return]
    if isinstance(values, np.ndarray):
        if values.ndim != 1 or values.dtype.kind not in "iu":
            raise TypeError(
                f"{what} must be a 1-D integer array, got {values.dtype} {values.shape}"
            )
        return values.copy()
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(values, torch.Tensor):
        if values.dim() != 1 or values.dtype.is_floating_point or values.dtype.is_complex:
            raise TypeError(
                f"{what} must be a 1-D integer tensor, got {values.dtype} {tuple(values.shape)}"
            )
        if values.dtype == torch.bool:
            raise TypeError(f"{what} must be a 1-D integer tensor, got torch.bool")
        if values.is_cuda:
            copy = _DeviceInts(values)
            pending.append(copy)
            return copy
        out: npt.NDArray[np.integer[Any]] = values.detach().numpy().copy()
        return out
    if isinstance(values, Sequence) and not isinstance(values, (str, bytes, bytearray)):
        return list(values)
    raise TypeError(
        f"{what} must be a list, tuple, numpy array or torch tensor of ints, "
        f"not {type(values).__name__}"
    )


@dataclass(frozen=True)
class CollectorStats:
    """The collector's own counters (the publisher keeps the batch counters)."""

    batches: int
    dropped_stored_blocks: int
    dropped_store_calls: int

    def as_dict(self) -> dict[str, int]:
        """The counters by name."""
        return asdict(self)


class EventCollector:
    """Collects one scheduler iteration's cache changes and publishes them as one batch.

    Call :meth:`stored`, :meth:`removed` and :meth:`cleared` as the cache
    changes, in the order it changes, then :meth:`flush` once per iteration.
    Hashes and token ids may be Python lists or tuples, numpy arrays or torch
    tensors (CPU or CUDA); only full blocks are published.

    ``hash_format`` is what goes on the wire: ``"unsigned"`` 64-bit (vLLM) or
    ``"signed"`` int64 (TensorRT-LLM, SGLang); hashes given in the other form
    are converted. ``max_stored_blocks_per_iteration`` caps the stored blocks
    per batch: a store beyond the cap keeps its leading blocks (a valid chain)
    and drops the rest, counted in :meth:`stats`. Removals and clears are never
    dropped: losing one would leave consumers believing a block is cached.

    ``int_widths="minimal"`` (the default) encodes every int as msgspec does,
    so the bytes are those of ``encode_batch`` (and vLLM). ``"fixed"`` lets a
    large numpy or torch array go out at one width per array, which skips
    making a Python int per token: valid msgpack that every decoder reads as
    the same values, several times cheaper for long token arrays.
    """

    def __init__(
        self,
        publisher: BatchPublisher,
        block_size: int,
        *,
        hash_format: HashFormat = "unsigned",
        max_stored_blocks_per_iteration: int | None = None,
        int_widths: IntWidths = "minimal",
    ) -> None:
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        if hash_format not in ("unsigned", "signed"):
            raise ValueError(f"hash_format must be 'unsigned' or 'signed', got {hash_format!r}")
        if int_widths not in ("minimal", "fixed"):
            raise ValueError(f"int_widths must be 'minimal' or 'fixed', got {int_widths!r}")
        if max_stored_blocks_per_iteration is not None and max_stored_blocks_per_iteration < 0:
            raise ValueError(
                f"max_stored_blocks_per_iteration must be >= 0, got {max_stored_blocks_per_iteration}"
            )
        self.publisher = publisher
        self.block_size = block_size
        self.hash_format: HashFormat = hash_format
        self.max_stored_blocks_per_iteration = max_stored_blocks_per_iteration
        self.int_widths: IntWidths = int_widths
        self._signed = hash_format == "signed"
        self._fixed = int_widths == "fixed"
        self._records: list[tuple[Any, ...]] = []
        self._device: list[_DeviceInts] = []  # CUDA copies awaiting their event
        self._stored_blocks = 0
        self._batches = 0
        self._dropped_blocks = 0
        self._dropped_calls = 0

    def stored(
        self,
        block_hashes: Any,
        parent_hash: int | None,
        token_ids: Any,
        *,
        lora_name: str | None = None,
        medium: str | None = "GPU",
        extra_keys: Sequence[Any] | None = None,
        group_idx: int | None = None,
    ) -> None:
        """Blocks ``block_hashes`` (a chain under ``parent_hash``) entered the cache.

        ``token_ids`` holds ``block_size`` tokens per block, in order; anything
        else raises ``ValueError`` (partial blocks are never published).
        ``extra_keys``, when given, has one entry per block. A list or tuple
        argument is kept by reference until the batch is encoded: do not
        change it afterwards.
        """
        n = len(block_hashes)
        bs = self.block_size
        if len(token_ids) != n * bs:
            raise ValueError(
                f"stored() got {len(token_ids)} token ids for {n} blocks of {bs}: "
                "only full blocks are published"
            )
        if not n:
            return
        if extra_keys is not None:
            if len(extra_keys) != n:
                raise ValueError(f"extra_keys has {len(extra_keys)} entries for {n} blocks")
            extra_keys = list(extra_keys)
        cap = self.max_stored_blocks_per_iteration
        if cap is not None:
            if self._stored_blocks + n > cap:
                keep = max(0, cap - self._stored_blocks)
                self._dropped_blocks += n - keep
                self._dropped_calls += 1
                if keep == 0:
                    return
                block_hashes = block_hashes[:keep]
                token_ids = token_ids[: keep * bs]
                if extra_keys is not None:
                    extra_keys = extra_keys[:keep]
                n = keep
            self._stored_blocks += n
        if type(block_hashes) is not list:
            block_hashes = _capture(block_hashes, "block_hashes", self._device)
        if type(token_ids) is not list:
            token_ids = _capture(token_ids, "token_ids", self._device)
        self._records.append(
            (_STORE, block_hashes, parent_hash, token_ids, lora_name, medium, extra_keys, group_idx)
        )

    def removed(
        self, block_hashes: Any, *, medium: str | None = "GPU", group_idx: int | None = None
    ) -> None:
        """Blocks left the cache (never dropped by the cap)."""
        if len(block_hashes):
            if type(block_hashes) is not list:
                block_hashes = _capture(block_hashes, "block_hashes", self._device)
            self._records.append((_REMOVE, block_hashes, medium, group_idx))

    def cleared(self) -> None:
        """The whole prefix cache was dropped (a reset)."""
        self._records.append(_CLEAR_RECORD)

    def flush(self) -> bool:
        """Publish what this iteration collected as one batch.

        Returns ``True`` when a batch was queued, ``False`` when there was
        nothing to send (an idle engine sends nothing) or the publisher
        dropped it (its counters say why).
        """
        records = self._records
        if not records:
            return False
        if self._device:
            _mark_copies_done(self._device)
        self._records = []
        self._stored_blocks = 0
        self._batches += 1
        batch = CollectedBatch(
            time.time(), records, self.publisher.rank, self.block_size, self._signed, self._fixed
        )
        return self.publisher.publish(batch)

    def stats(self) -> CollectorStats:
        """Batches flushed and stored blocks dropped by the per-iteration cap."""
        return CollectorStats(self._batches, self._dropped_blocks, self._dropped_calls)


class CollectedBatch(msgspec.Struct, gc=False):
    """One iteration's records; encoded on the publisher's thread.

    Not tracked by the cyclic garbage collector: a backlog of these must not
    make every collection slower (it holds only tuples, arrays and ints).
    """

    ts: float
    records: list[tuple[Any, ...]]
    rank: int
    block_size: int
    signed: bool
    fixed_widths: bool = False

    def encode(self, dialect: Dialect) -> bytes:
        """Convert, coalesce and encode: the bytes ``encode_batch`` gives for :meth:`to_batch`.

        Lists of ints take the fast path; one holding something msgpack cannot
        take as an int (a numpy scalar, say) is converted element by element.
        Raises ``ValueError`` for values that are not 64-bit ints at all.
        """
        try:
            return encode_parts(self.ts, self.parts(), self.rank, dialect=dialect)
        except (TypeError, OverflowError):
            return encode_parts(self.ts, self.parts(strict=True), self.rank, dialect=dialect)

    def to_batch(self) -> KVEventBatch:
        """The batch as wire structs (hashes unsigned, as decoding yields them)."""
        return decode_batch(self.encode("map"))

    def parts(self, *, strict: bool = False) -> list[EventParts]:
        """The coalesced events in wire form, int arrays packed where that is cheap.

        ``strict`` converts every element of a list with ``operator.index`` first.
        """
        records = [_strict_record(r) for r in self.records] if strict else self.records
        signed = self.signed
        fixed = self.fixed_widths
        # Hashes already in the wire's form, the common case, pass through untouched
        # (one outside 64 bits makes the encoder raise, and encode() retries strictly).
        low, high = (_I64_MIN, _I64_MAX) if signed else (0, _U64)
        hashes: IntArray
        tokens: IntArray
        out: list[EventParts] = []
        n = len(records)
        i = 0
        while i < n:
            rec = records[i]
            i += 1
            tag = rec[0]
            if tag == _STORE:
                _, hs, parent, toks, lora, medium, keys, group = rec
                if len(toks) != len(hs) * self.block_size:
                    raise ValueError(_CHANGED)
                if (type(hs) is list or type(hs) is tuple) and (
                    max(hs) <= high if signed else min(hs) >= 0
                ):
                    hashes, last = hs, hs[-1]
                else:
                    hashes, last = _hash_array(hs, signed)
                if parent is not None and not (type(parent) is int and low <= parent <= high):
                    parent = _hash_int(parent, signed)
                tokens = (
                    toks if type(toks) is list or type(toks) is tuple else _token_array(toks, fixed)
                )
                extra = keys
                if i < n and records[i][0] == _STORE:
                    hash_parts, token_parts = [hashes], [tokens]
                    extra = None if keys is None else list(keys)
                    while i < n:
                        nxt = records[i]
                        if (
                            nxt[0] != _STORE
                            or nxt[2] is None
                            or nxt[4] != lora
                            or nxt[5] != medium
                            or nxt[7] != group
                            or (nxt[6] is None) != (keys is None)
                            or _hash_int(nxt[2], signed) != last
                        ):
                            break
                        if len(nxt[3]) != len(nxt[1]) * self.block_size:
                            raise ValueError(_CHANGED)
                        more, last = _hash_array(nxt[1], signed)
                        hash_parts.append(more)
                        token_parts.append(_token_array(nxt[3], fixed))
                        if extra is not None:
                            extra.extend(nxt[6])
                        i += 1
                    hashes = concat_int_arrays(hash_parts)
                    tokens = concat_int_arrays(token_parts)
                out.append(StoredParts(
                    hashes, parent, tokens, self.block_size, None, medium, lora, extra, group
                ))  # fmt: skip
            elif tag == _REMOVE:
                _, hs, medium, group = rec
                if (type(hs) is list or type(hs) is tuple) and (
                    max(hs) <= high if signed else min(hs) >= 0
                ):
                    hashes = hs
                else:
                    hashes, _ = _hash_array(hs, signed)
                if i < n and records[i][0] == _REMOVE:
                    hash_parts = [hashes]
                    while i < n:
                        nxt = records[i]
                        if nxt[0] != _REMOVE or nxt[2] != medium or nxt[3] != group:
                            break
                        hash_parts.append(_hash_array(nxt[1], signed)[0])
                        i += 1
                    hashes = concat_int_arrays(hash_parts)
                out.append(RemovedParts(hashes, medium, group))
            else:
                out.append(_CLEARED)
        return out


def _strict_record(rec: tuple[Any, ...]) -> tuple[Any, ...]:
    if rec[0] == _STORE:
        _, hs, parent, toks, *rest = rec
        return (
            _STORE,
            _strict_list(hs, "block hash"),
            parent,
            _strict_list(toks, "token id"),
            *rest,
        )
    if rec[0] == _REMOVE:
        return (_REMOVE, _strict_list(rec[1], "block hash"), *rec[2:])
    return rec


def _hash_int(h: Any, signed: bool) -> int:
    if type(h) is int and 0 <= h <= _I64_MAX:
        return h
    value = operator.index(h)
    if not _I64_MIN <= value <= _U64:
        raise ValueError(f"block hash {value} does not fit in 64 bits")
    if signed:
        return value - (1 << 64) if value > _I64_MAX else value
    return value & _U64


def _hash_array(values: _Captured, signed: bool) -> tuple[IntArray, int]:
    """The hashes in the wire's format, and the last one (a possible child's parent)."""
    if type(values) is tuple or type(values) is list:
        # Values outside 64 bits, or not ints, make the encoder raise: strict path.
        if signed:
            if max(values) > _I64_MAX:
                converted = [h - (1 << 64) if h > _I64_MAX else h for h in values]
                return converted, converted[-1]
        elif min(values) < 0:
            converted = [h & _U64 for h in values]
            return converted, converted[-1]
        return values, values[-1]
    array = values.numpy() if type(values) is _DeviceInts else values
    assert isinstance(array, np.ndarray)
    array = array.astype(np.int64 if signed else np.uint64, copy=False)
    last = int(array[-1])
    if array.shape[0] >= _PACK_MIN:
        packed = pack_int_array(array)
        if packed is not None:
            return packed, last
    hashes: list[int] = array.tolist()
    return hashes, last


def _strict_list(values: _Captured, what: str) -> _Captured:
    if type(values) is not list and type(values) is not tuple:
        return values
    try:
        converted = [operator.index(v) for v in values]
    except TypeError:
        bad = next(v for v in values if not hasattr(v, "__index__"))
        raise ValueError(f"{what} {bad!r} is not an int") from None
    if what == "block hash":
        for v in converted:
            _hash_int(v, False)  # range check: raises ValueError
    return converted


def _token_array(values: _Captured, fixed: bool) -> IntArray:
    if type(values) is list or type(values) is tuple:
        return values
    array = values.numpy() if type(values) is _DeviceInts else values
    assert isinstance(array, np.ndarray)
    if array.shape[0] >= _PACK_MIN:
        packed = pack_int_array(array, minimal=not fixed)
        if packed is not None:
            return packed
    tokens: list[int] = array.tolist()
    return tokens
