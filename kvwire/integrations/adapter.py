"""kvwire's publisher behind an engine's own publisher interface (vLLM, SGLang).

The engine hands ``publish()`` its own batch struct. The adapter reserves the
seq and queues the batch without blocking (kvwire's :class:`EventPublisher`);
the sender thread encodes it with msgspec exactly as the engine's own
``ZmqEventPublisher`` does, so the bytes on the wire, live and replayed, are
the engine's. What kvwire adds: ``publish()`` never blocks the scheduler, a
bounded replay, loopback unless asked, and its counters.
"""

from __future__ import annotations

import atexit
import logging
from collections.abc import Callable
from types import ModuleType
from typing import Any

import msgspec

from kvwire.integrations.config import IntegrationConfig, bind_address
from kvwire.publisher import EventPublisher
from kvwire.wire import Dialect

__all__ = ["EncodedBatch", "EngineEventPublisher", "binds", "factory_for", "install"]

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


def binds(endpoint: str, bind: bool | None = None) -> bool:
    """Whether the engine's own publisher binds ``endpoint`` (it connects to the rest).

    The engines bind wildcard hosts, ipc and inproc, and (SGLang) whatever
    ``bind=True`` names; kvwire's publisher only binds.
    """
    if bind is not None:
        return bind
    return (
        "*" in endpoint
        or "::" in endpoint
        or "0.0.0.0" in endpoint
        or endpoint.startswith(("ipc://", "inproc://"))
    )


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
        rank: int,
        endpoint: str,
        replay_endpoint: str | None,
        buffer_steps: int,
        hwm: int,
        max_queue_size: int,
        topic: str,
        config: IntegrationConfig,
        ignored: dict[str, Any] | None = None,
    ) -> None:
        """``ignored``: the engine's settings newer than this publisher, logged and left out."""
        if ignored:
            log.info("kvwire publisher ignores %s settings %s", self.engine, sorted(ignored))
        self.rank = rank
        self.topic = topic
        self.buffer_steps = buffer_steps
        self.hwm = hwm
        self.max_queue_size = max_queue_size
        pub = bind_address(endpoint, config)
        replay = None if replay_endpoint is None else bind_address(replay_endpoint, config)
        if (pub, replay) != (endpoint, replay_endpoint) and not config.expose:
            log.warning(
                "kvwire binds %s (replay %s) for the configured %s (replay %s): KV events "
                "carry prompt token ids; set KVWIRE_EXPOSE=1 to bind as configured",
                pub, replay, endpoint, replay_endpoint,
            )  # fmt: skip
        self.publisher = EventPublisher(
            pub,
            replay,
            rank=rank,
            buffer_steps=buffer_steps,
            hwm=hwm,
            max_queue_size=max_queue_size,
            topic=topic,
            **config.publisher_options(buffer_steps),
        ).start()
        self._encoder = msgspec.msgpack.Encoder()
        self._closed = False
        atexit.register(self.shutdown)
        log.info(
            "kvwire publisher for %s rank %d on %s (replay %s)",
            self.engine, rank, self.publisher.bound_endpoint, self.publisher.bound_replay_endpoint,
        )  # fmt: skip

    def publish(self, events: Any) -> None:
        """Queue the engine's batch; never blocks (a full queue drops it, a visible gap)."""
        if getattr(events, self.rank_field) is None:
            setattr(events, self.rank_field, self.rank)
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
