"""The engine side: publish KV-cache events, collect them from a cache, a reference cache.

``EventPublisher`` owns the sockets, ``EventCollector`` is what a cache manager
calls each iteration, and ``PagedKVCache`` (needs the ``engine`` extra, torch)
is a reference paged KV cache that reports every change through a collector.
"""

from kvwire.publisher.collector import (
    BatchPublisher,
    CollectedBatch,
    CollectorStats,
    EventCollector,
    HashFormat,
)
from kvwire.publisher.paged_cache import AdmitResult, CacheFullError, PagedKVCache, block_hashes
from kvwire.publisher.publisher import (
    DEFAULT_ENDPOINT,
    EventPublisher,
    PendingBatch,
    PublisherStats,
)

__all__ = [
    "DEFAULT_ENDPOINT",
    "AdmitResult",
    "BatchPublisher",
    "CacheFullError",
    "CollectedBatch",
    "CollectorStats",
    "EventCollector",
    "EventPublisher",
    "HashFormat",
    "PagedKVCache",
    "PendingBatch",
    "PublisherStats",
    "block_hashes",
]
