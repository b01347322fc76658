"""The engine side: what an inference engine embeds to publish KV-cache events.

``EventPublisher`` owns the sockets, ``PublisherConfig`` holds its settings
and ``EventCollector`` is what a cache manager calls each iteration. The engine integrations (vLLM, SGLang,
TensorRT-LLM) live in :mod:`kvwire.integrations`; the reference engine that
the demo and the tests drive lives in :mod:`kvwire.reference`.
"""

from kvwire.publisher import collector, publisher
from kvwire.publisher.batch import CollectedBatch, Record
from kvwire.publisher.collector import *  # noqa: F403
from kvwire.publisher.config import PublisherConfig
from kvwire.publisher.publisher import *  # noqa: F403

__all__ = [*collector.__all__, *publisher.__all__, "CollectedBatch", "PublisherConfig", "Record"]
