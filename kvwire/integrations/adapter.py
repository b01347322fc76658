"""kvwire's publisher behind an engine's own publisher interface (vLLM, SGLang).

The engine hands ``publish()`` its own batch struct. The adapter reserves the
seq and queues the batch without blocking (kvwire's :class:`EventPublisher`).
Its fields are read in C on the engine thread (:class:`EngineFormat`, made once
from the engine's classes) and the native sender writes msgspec's bytes for
them without the GIL; a batch it cannot write byte for byte (bytes hashes,
extra keys, a class it does not know...) is encoded by the engine's msgspec
encoder on the sender thread. Either way the bytes on the wire, live and
replayed, are the engine's. What kvwire adds: ``publish()`` never blocks the scheduler, a
bounded replay, loopback unless asked or keyed, and its counters.
"""

from __future__ import annotations

import atexit
import functools
import logging
from collections.abc import Callable
from types import ModuleType
from typing import Any

import msgspec

from kvwire.integrations.config import IntegrationConfig, bind_addresses
from kvwire.publisher import EventPublisher
from kvwire.publisher._sender import EngineFormat, EnginePublish
from kvwire.publisher.batch import struct_layout
from kvwire.wire import Dialect

__all__ = [
    "EncodedBatch", "EngineEventPublisher", "binds", "engine_format", "factory_for", "install",
]  # fmt: skip

log = logging.getLogger(__name__)


class EncodedBatch:
    """An engine's batch struct, encoded on the sender thread as the engine encodes it."""

    __slots__ = ("batch", "encoder")

    def __init__(self, batch: Any, encoder: msgspec.msgpack.Encoder) -> None:
        self.batch = batch
        self.encoder = encoder

    def encode(self, dialect: Dialect) -> bytes:
        """The engine's own msgpack (the dialect is the engine's, whatever is asked)."""
        return self.encoder.encode(self.batch)


EVENT_CLASSES = ("BlockStored", "BlockRemoved", "AllBlocksCleared")


def engine_format(
    kv_events: ModuleType, rank_field: str, encoder: msgspec.msgpack.Encoder
) -> EngineFormat | None:
    """The native sender's view of an engine's ``KVEventBatch`` and event classes, or
    ``None`` when the batch is not the positional ``[ts, events, rank]`` it writes
    (every batch then goes to msgspec). ``encoder``: the engine's msgspec encoder, for
    the batches the sender leaves to Python (as :class:`EncodedBatch`)."""
    batch = kv_events.KVEventBatch
    config = batch.__struct_config__
    if not config.array_like or batch.__struct_fields__ != ("ts", "events", rank_field):
        return None
    layouts = [struct_layout(getattr(kv_events, name)) for name in EVENT_CLASSES]
    return EngineFormat(
        batch,
        ("ts", "events", rank_field),
        tuple(layout for layout in layouts if layout is not None),
        wrap=functools.partial(EncodedBatch, encoder=encoder),
    )


def binds(endpoint: str, bind: bool | None = None) -> bool:
    """Whether the engine's own publisher binds ``endpoint`` (it connects to the rest).

    The engines bind wildcard hosts, ipc and inproc, and (SGLang) whatever
    ``bind=True`` names; kvwire's publisher only binds.
    """
    if bind is not None:
        return bind
    wildcard = any(host in endpoint for host in ("*", "::", "0.0.0.0"))
    return wildcard or endpoint.startswith(("ipc://", "inproc://"))


class EngineEventPublisher:
    """The engine-neutral part: sockets, queueing, the engine's encoding, shutdown.

    ``rank_field`` names the batch field the engine stamps with its rank when
    the scheduler left it ``None`` (``data_parallel_rank``, ``attn_dp_rank``).
    """

    rank_field = "data_parallel_rank"
    engine = "engine"
    kv_events: ModuleType
    """The engine's ``kv_events`` module (set on the subclass :func:`factory_for` makes)."""

    def __init__(
        self,
        rank: int = 0,
        endpoint: str = "tcp://*:5557",
        replay_endpoint: str | None = None,
        buffer_steps: int | None = None,
        hwm: int | None = None,
        max_queue_size: int | None = None,
        topic: str = "",
        bind: bool | None = None,
        *,
        config: IntegrationConfig | None = None,
        **later_fields: Any,
    ) -> None:
        """The engine's own settings, in its constructor's order (``None``: the publisher's
        default; ``bind``, the engine's choice to bind or connect, is read by
        :func:`factory_for`), and kvwire's (``config``, by default from the ``KVWIRE_*``
        variables). ``later_fields``: the engine's settings newer than this publisher,
        logged and left out."""
        if later_fields:
            log.info("kvwire publisher ignores %s settings %s", self.engine, sorted(later_fields))
        config = config or IntegrationConfig.from_env()
        self.rank = rank
        pub, replay = bind_addresses(endpoint, replay_endpoint, config)
        self.publisher = EventPublisher(
            pub,
            replay,
            config.publisher_config(buffer_steps, hwm, max_queue_size, topic),
            rank=rank,
            server_keys=config.server_keys(),
        ).start()
        self._encoder = msgspec.msgpack.Encoder()
        fmt = engine_format(self.kv_events, self.rank_field, self._encoder)
        sender = self.publisher.direct_sender()
        if fmt is not None and sender is not None:
            # publish() in C, as the instance's own: the scheduler's call runs no frame.
            self.publish = EnginePublish(  # type: ignore[method-assign,assignment]
                sender, fmt, self.rank_field, self.rank, self._publish_encoded
            )
        self._closed = False
        atexit.register(self.shutdown)
        log.info(
            "kvwire publisher for %s rank %d on %s (replay %s)",
            self.engine, rank, self.publisher.bound_endpoint, self.publisher.bound_replay_endpoint,
        )  # fmt: skip

    @property
    def topic(self) -> str:
        """The topic the engine configured."""
        return self.publisher.config.topic

    def publish(self, events: Any) -> None:
        """Queue the engine's batch; never blocks (a full queue drops it, a visible gap).

        With the native sender, an :class:`EnginePublish` takes this method's place on
        the instance: the same steps in C, the batch's fields read natively."""
        if getattr(events, self.rank_field) is None:
            setattr(events, self.rank_field, self.rank)
        self._publish_encoded(events)

    def _publish_encoded(self, events: Any) -> None:
        """Queue a batch the engine's msgspec encoder encodes on the sender thread."""
        self.publisher.publish(EncodedBatch(events, self._encoder))

    def shutdown(self) -> None:
        """Send what is queued (bounded wait), then close the sockets. Idempotent."""
        if self._closed:
            return
        self._closed = True
        atexit.unregister(self.shutdown)
        self.publisher.close()


Factory = Callable[..., Any]


_factories: dict[tuple[ModuleType, type[EngineEventPublisher]], Factory] = {}


def factory_for(kv_events: ModuleType, publisher: type[EngineEventPublisher]) -> Factory:
    """The constructor an engine's ``EventPublisherFactory`` calls, for its ``kv_events`` module.

    kvwire's publisher, made a subclass of the engine's abstract
    ``EventPublisher``, for endpoints the engine would bind; the engine's own
    ``ZmqEventPublisher`` (with a warning) for endpoints it would connect to.
    One per module, so registering again changes nothing.
    """
    key = (kv_events, publisher)
    if key in _factories:
        return _factories[key]
    cls = type(
        "KvwireEventPublisher",
        (publisher, kv_events.EventPublisher),
        {"kv_events": kv_events, "__module__": publisher.__module__},
    )
    own = kv_events.ZmqEventPublisher
    rank_kw = publisher.rank_field

    def create_publisher(**fields: Any) -> Any:
        endpoint = fields.get("endpoint", "tcp://*:5557")
        if not binds(endpoint, fields.get("bind")):
            log.warning(
                "kvwire: %s connects its publisher to %s (not a bind address); kvwire's "
                "publisher only binds, so %s's own publisher serves this endpoint",
                publisher.engine, endpoint, publisher.engine,
            )  # fmt: skip
            return own(**fields)
        return cls(fields.pop(rank_kw, 0), **fields)

    _factories[key] = create_publisher
    return create_publisher


def install(
    kv_events: ModuleType, publisher: type[EngineEventPublisher], *, replace_zmq: bool = True
) -> bool:
    """Register kvwire's publisher as ``"kvwire"`` and, with ``replace_zmq``, in place of
    ``"zmq"``; idempotent.

    Returns whether anything changed. The registry is written directly: the
    engines' ``register_publisher`` refuses a name that exists.
    """
    registry: dict[str, Any] = kv_events.EventPublisherFactory._registry
    factory = factory_for(kv_events, publisher)
    names = ("kvwire", "zmq") if replace_zmq else ("kvwire",)
    if all(registry.get(name) is factory for name in names):
        return False
    for name in names:
        registry[name] = factory
    if replace_zmq:
        log.warning(
            "kvwire: %s's KV events are published by kvwire (the 'zmq' publisher replaced, "
            "'kvwire' registered)",
            publisher.engine,
        )
    else:
        log.info("kvwire: publisher 'kvwire' registered in %s", publisher.engine)
    return True
