"""The router side: follow every rank of every engine, in order, or say what is missing.

:class:`RankStream` is the sans-I/O core (one per engine rank);
:class:`Subscriber` follows every rank over ZeroMQ (one
:class:`~kvwire.subscriber.link.RankLink` per rank, read and timed by one
:class:`~kvwire.subscriber.reactor.Reactor`), feeding an :class:`EventSink`
(or an async iterator of :data:`SinkItem`); :class:`SubscriberConfig` tunes it.
"""

from kvwire.subscriber.actions import (
    Action,
    Apply,
    ApplyPayload,
    ClearRank,
    Reconnect,
    RequestReplay,
    RequestSnapshot,
    StateChanged,
)
from kvwire.subscriber.checkpoint import CheckpointError, CheckpointInfo, Restored
from kvwire.subscriber.config import SubscriberConfig
from kvwire.subscriber.readiness import SyncProgress
from kvwire.subscriber.seq import StreamPosition
from kvwire.subscriber.sink import (
    Applied,
    BlockSetSink,
    Cleared,
    EventSink,
    PayloadSink,
    SinkItem,
    ViewSink,
)
from kvwire.subscriber.source import EngineSource, RankEndpoints
from kvwire.subscriber.state import (
    LossPolicy,
    RankCounters,
    RankState,
    RankStatus,
    StreamConfig,
)
from kvwire.subscriber.stream import RankStream
from kvwire.subscriber.subscriber import ResourceLimitError, Subscriber

__all__ = [
    "Action",
    "Applied",
    "Apply",
    "ApplyPayload",
    "BlockSetSink",
    "CheckpointError",
    "CheckpointInfo",
    "ClearRank",
    "Cleared",
    "EngineSource",
    "EventSink",
    "LossPolicy",
    "PayloadSink",
    "RankCounters",
    "RankEndpoints",
    "RankState",
    "RankStatus",
    "RankStream",
    "Reconnect",
    "RequestReplay",
    "RequestSnapshot",
    "ResourceLimitError",
    "Restored",
    "SinkItem",
    "StateChanged",
    "StreamConfig",
    "StreamPosition",
    "Subscriber",
    "SubscriberConfig",
    "SyncProgress",
    "ViewSink",
]
