"""The publisher's native side (``kvwire/publisher/sender/*.c``): the sender thread, the
collector's hooks, engine formats."""

from collections.abc import Callable, Sequence
from typing import Any, Final, Self, final

STORED: Final[int]
REMOVED: Final[int]
CLEARED: Final[int]
RING_TAKE_MAX: Final[int]
"""Batches one ``send_range``/``replay_range`` call takes from the ring, at most."""

@final
class Record:
    """One hook call as the collector recorded it: a store, a removal or a clear.

    A stored record has every field (``None`` where not given); a removed one
    its ``block_hashes``, ``medium`` and ``group_idx`` (the rest read ``None``);
    a cleared one none. The values are kept as given, by reference.
    """

    def __new__(
        cls,
        kind: int,
        *,
        block_hashes: Any = ...,
        parent_hash: Any = ...,
        token_ids: Any = ...,
        lora_name: str | None = ...,
        medium: str | None = ...,
        extra_keys: Sequence[Any] | None = ...,
        group_idx: int | None = ...,
    ) -> Record: ...
    @property
    def kind(self) -> int: ...
    @property
    def block_hashes(self) -> Any: ...
    @property
    def parent_hash(self) -> Any: ...
    @property
    def token_ids(self) -> Any: ...
    @property
    def lora_name(self) -> str | None: ...
    @property
    def medium(self) -> str | None: ...
    @property
    def extra_keys(self) -> Any: ...
    @property
    def group_idx(self) -> int | None: ...

def encode_collected(batch: Any, format: EngineFormat, pack: Callable[[Any], bytes], /) -> bytes:
    """A ``CollectedBatch``'s payload in ``format`` (a dialect's, for records): the sender
    thread's writer, any value prepared with the GIL (``pack`` encodes ``extra_keys``)."""

def heartbeat_due(
    last_sent: float, interval: float, now: float, wall: float, after_batch: bool,
    phase: float = 0.0, /,
) -> float:  # fmt: skip
    """The sender's heartbeat rule (``kvwire.wire.heartbeat.heartbeat_at``, in C)."""

@final
class Payload:
    """A sent batch's payload: a read-only buffer, shared, never copied."""

    def __buffer__(self, flags: int, /) -> memoryview: ...
    def __len__(self) -> int: ...

def payload_of(data: Any, /) -> Payload:
    """A copy of any buffer as a Payload, to be shared by every client's pipe."""

def holders(payload: Payload, /) -> int:
    """The references to a payload's buffer (its Payloads, the ring, the pipes holding it)."""

@final
class Account:
    """One reply's bytes in flight (made by :meth:`Replies.account`)."""

    @property
    def in_flight(self) -> int: ...
    @property
    def taken(self) -> int: ...

@final
class Replies:
    """The replay ROUTER's replies, sent in C, and their bytes in flight (``serve.c``)."""

    def __new__(cls, sender: Sender, router_address: int, libzmq_path: str) -> Replies: ...
    @property
    def in_flight(self) -> int: ...
    @property
    def taken(self) -> int: ...
    @property
    def peak(self) -> int: ...
    def account(self) -> Account: ...
    def send(
        self,
        account: Account,
        identity: bytes,
        head: tuple[bytes, ...],
        payload: Payload,
        job_cap: int,
        total_cap: int,
        /,
    ) -> int: ...
    def send_range(
        self,
        account: Account,
        identity: bytes,
        topic: bytes,
        start_seq: int,
        n: int,
        job_cap: int,
        total_cap: int,
        /,
    ) -> tuple[int, int, int, int, int]: ...
    def arm(self) -> None: ...
    def close(self) -> None: ...

@final
class Sender:
    """The publisher's queue and native sender thread."""

    def __new__(
        cls,
        *,
        topic: bytes,
        dialect: str,
        rank: int,
        max_queue: int,
        buffer_steps: int,
        coalesce_s: float,
        heartbeat_s: float,
        mirror: bool,
        mirror_backlog: int,
        batch_type: type,
        encode: Callable[[Any], bytes | None],
    ) -> Sender: ...
    @property
    def service_fd(self) -> int: ...
    def publish(self, batch: object, /) -> bool: ...
    def skip(self) -> bool: ...
    def start(self, socket_address: int, libzmq_path: str, /) -> None: ...
    def close(self, timeout: float, /) -> tuple[bool, bool]: ...
    def join(self) -> None: ...
    def stats(self) -> dict[str, int]: ...
    def set_max_queue(self, n: int, /) -> None: ...
    def set_coalesce(self, seconds: float, /) -> None: ...
    def set_heartbeat_phase(self, phase: float, /) -> None: ...
    def replay_range(self, start_seq: int, n: int, /) -> list[tuple[int, Payload]]: ...
    def take_feed(self) -> list[tuple[int, Payload | None]]: ...
    def arm_feed(self) -> None: ...
    def wake(self) -> None: ...
    def clear_wake(self) -> None: ...
    def seqs(self, ring: bool, /) -> list[int]: ...
    def slabs(self) -> tuple[tuple[int, int], tuple[int, int]]: ...
    def encode_native(self, batch: object, /) -> bytes | None: ...

class Collector:
    """``EventCollector``'s native base: its hooks, one iteration's records in C memory.

    With ``sender`` (the publisher's own), ``flush()`` queues the records on it
    as they are; with ``None`` it builds a ``batch_type`` and calls
    ``publisher.publish``. ``cap`` is the stored blocks per iteration (-1: none).
    """

    def __new__(
        cls,
        publisher: Any,
        block_size: int,
        signed: bool,
        cap: int,
        *,
        sender: Sender | None,
        batch_type: type,
        capture: Callable[[Any, str, list[Any]], Any],
        device: list[Any],
        mark: Callable[[list[Any]], None],
    ) -> Self: ...
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
    def removed(
        self, block_hashes: Any, *, medium: str | None = "GPU", group_idx: int | None = None
    ) -> None:
        """Blocks left the cache (never dropped by the cap)."""
    def cleared(self) -> None:
        """The whole prefix cache was dropped (a reset)."""
    def flush(self) -> bool:
        """Publish what this iteration collected as one batch.

        Returns ``True`` when a batch was queued, ``False`` when there was
        nothing to send (an idle engine sends nothing) or the publisher
        dropped it (its counters say why).
        """
    def _counters(self) -> tuple[int, int, int]:
        """(batches, dropped_stored_blocks, dropped_store_calls)."""

@final
class EngineFormat:
    """Where an engine's batch and tagged event structs keep their fields (slot offsets),
    and how msgspec writes them: ``events`` holds ``(cls, tag_field, tag, ((attr, key,
    omit_none), ...))`` per class (``tag_field`` ``None``: a tagged array); ``wrap(batch)``
    makes what the sender's ``encode`` takes (the engine's msgspec encoding), for the
    batches the thread leaves to Python. ``records``: a format for collector batches
    (kvwire's dialects): the store, removal and clear layouts, in that order."""

    def __new__(
        cls,
        batch_type: type,
        batch_fields: tuple[str, str, str],
        events: tuple[tuple[type, str | None, str, tuple[tuple[str, str, bool], ...]], ...],
        *,
        wrap: Callable[[Any], Any] | None = None,
        records: bool = False,
    ) -> EngineFormat: ...
    def encode(self, batch: object, /) -> bytes | None: ...

@final
class EnginePublish:
    """An engine plugin's ``publish(events)`` in C: stamp ``rank`` into ``rank_field``
    where the batch leaves it ``None``, queue it on ``sender`` read as ``format``
    describes, or hand it to ``fallback`` (a batch the native path leaves)."""

    def __new__(
        cls,
        sender: Sender,
        format: EngineFormat,
        rank_field: str,
        rank: object,
        fallback: Callable[[Any], object],
    ) -> EnginePublish: ...
    def __call__(self, events: object, /) -> None: ...
