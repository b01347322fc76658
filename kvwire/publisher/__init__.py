"""The engine side: what an inference engine embeds to publish KV-cache events.

``EventPublisher`` owns the sockets, ``PublisherConfig`` holds its settings
and ``EventCollector`` is what a cache manager calls each iteration. The engine integrations (vLLM, SGLang,
TensorRT-LLM) live in :mod:`kvwire.integrations`; the reference engine that
the demo and the tests drive lives in :mod:`kvwire.reference`.
"""

from kvwire.publisher.batch import CollectedBatch, Record
from kvwire.publisher.collector import (
    BatchPublisher,
    CollectorStats,
    EventCollector,
    HashFormat,
)
from kvwire.publisher.config import PublisherConfig
from kvwire.publisher.publisher import (
    DEFAULT_ENDPOINT,
    EventPublisher,
    PendingBatch,
    PublisherStats,
)

__all__ = [
    "DEFAULT_ENDPOINT",
    "BatchPublisher",
    "CollectedBatch",
    "CollectorStats",
    "EventCollector",
    "EventPublisher",
    "HashFormat",
    "PendingBatch",
    "PublisherConfig",
    "PublisherStats",
    "Record",
]
