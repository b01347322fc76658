"""The hooks a KV cache manager calls: collect one iteration's changes, publish one batch.

Everything on the engine thread is a cheap copy or a reference. Lists and
tuples of exact ints are read during the call into C memory (no reference is
kept: the engine frees its lists itself, and another core never touches them);
other lists and tuples are kept by reference and must not be changed after the
call. Numpy arrays and CPU tensors
are copied (engines reuse buffers), CUDA tensors copied into pinned host memory
without waiting (a CUDA event marks when the copy is done). Conversion,
coalescing and msgpack encoding happen later, on the publisher's sender thread.

The hooks themselves are C (``Collector`` in :mod:`kvwire.publisher._sender`):
for lists and tuples a call creates no Python object, it appends a record to C
memory holding their values (or, for what is not exact ints, references). With
an :class:`~kvwire.publisher.EventPublisher`, ``flush()`` queues those records
on its native sender as they are; with any other publisher it builds a
:class:`CollectedBatch` and calls ``publish()``.

The contract is what lets the native sender read a batch's lists without the
GIL: when every list or tuple holds exact ints (within 64 bits), parents and
group indices are ints or ``None``, ``medium`` and ``lora_name`` are ``None``
or ASCII strs and no store has ``extra_keys``, the sender thread encodes the
batch itself and the engine thread never waits for it. Anything else (array or
tensor captures, int subclasses, ``extra_keys``) is prepared with the GIL
taken (:meth:`CollectedBatch.encode`) for the same writer: one encoder, the
same bytes either way.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any, Literal, Protocol, TypeAlias

import numpy as np
import numpy.typing as npt

from kvwire.wire import KVEventBatch
from kvwire.wire._pack import snapshot

from ._sender import Collector
from .batch import CollectedBatch
from .publisher import EventPublisher, PendingBatch

__all__ = [
    "BatchPublisher",
    "CollectorStats",
    "EventCollector",
    "HashFormat",
]

HashFormat: TypeAlias = Literal["unsigned", "signed"]


class BatchPublisher(Protocol):
    """What the collector needs from a publisher (``EventPublisher`` is one)."""

    rank: int

    def publish(self, batch: KVEventBatch | PendingBatch) -> bool: ...


class _DeviceInts:
    """A CUDA tensor being copied to pinned host memory; read it off the engine thread
    (the encoder calls :meth:`numpy`).

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


_Captured: TypeAlias = "list[int] | tuple[int, ...] | memoryview | _DeviceInts"


def _capture(values: Any, what: str, pending: list[_DeviceInts]) -> _Captured:
    """Take a private snapshot of ``values`` as cheaply as the type allows.

    Arrays are copied (engines reuse their buffers) by one native call that
    also checks them: a typed ``memoryview`` the packer reads later.
    """
    kind = type(values)
    if kind is list or kind is tuple:
        return values  # type: ignore[no-any-return]
    if isinstance(values, np.ndarray):
        if not values.dtype.isnative:
            values = values.astype(values.dtype.newbyteorder("="))
        return snapshot(values, what)
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(values, torch.Tensor):
        dtype = values.dtype
        if values.dim() != 1 or dtype.is_floating_point or dtype.is_complex or dtype == torch.bool:
            shape = tuple(values.shape)
            raise TypeError(f"{what} must be a 1-D integer tensor, got {dtype} {shape}")
        if values.is_cuda:
            copy = _DeviceInts(values)
            pending.append(copy)
            return copy
        return snapshot(values.detach().numpy(), what)
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


class EventCollector(Collector):
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

    Every int goes out in its smallest msgpack form, so the bytes are those of
    ``encode_batch`` (and vLLM's); arrays and tensors are read natively, without
    a Python int per element. The hooks are the native base class's methods: a
    call runs no Python frame, so that the engine thread's own cost is its calls
    alone (the module says where the records go).
    """

    _block_size: int
    _cap: int | None
    _hash_format: HashFormat
    _publisher: BatchPublisher

    def __new__(
        cls,
        publisher: BatchPublisher,
        block_size: int,
        *,
        hash_format: HashFormat = "unsigned",
        max_stored_blocks_per_iteration: int | None = None,
    ) -> EventCollector:
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        if hash_format not in ("unsigned", "signed"):
            raise ValueError(f"hash_format must be 'unsigned' or 'signed', got {hash_format!r}")
        if max_stored_blocks_per_iteration is not None and max_stored_blocks_per_iteration < 0:
            raise ValueError(
                f"max_stored_blocks_per_iteration must be >= 0, got {max_stored_blocks_per_iteration}"
            )
        sender = publisher.direct_sender() if isinstance(publisher, EventPublisher) else None
        self = super().__new__(
            cls,
            publisher,
            block_size,
            hash_format == "signed",
            -1 if max_stored_blocks_per_iteration is None else max_stored_blocks_per_iteration,
            sender=sender,
            batch_type=CollectedBatch,
            capture=_capture,
            device=[],  # CUDA copies awaiting their event
            mark=_mark_copies_done,
        )
        self._publisher = publisher
        self._block_size = block_size
        self._hash_format = hash_format
        self._cap = max_stored_blocks_per_iteration
        return self

    @property
    def publisher(self) -> BatchPublisher:
        """Where :meth:`flush` publishes."""
        return self._publisher

    @property
    def block_size(self) -> int:
        """Tokens per block."""
        return self._block_size

    @property
    def hash_format(self) -> HashFormat:
        """The hashes' form on the wire."""
        return self._hash_format

    @property
    def max_stored_blocks_per_iteration(self) -> int | None:
        """The cap on stored blocks per batch (``None``: none)."""
        return self._cap

    def stats(self) -> CollectorStats:
        """Batches flushed and stored blocks dropped by the per-iteration cap."""
        return CollectorStats(*self._counters())
