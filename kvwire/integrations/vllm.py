"""kvwire's publisher inside vLLM, as a general plugin (entry point ``vllm.general_plugins``).

vLLM loads every general plugin in each engine process, possibly more than
once. With ``KVWIRE_PUBLISHER=1`` the plugin puts kvwire's publisher in place
of the ``"zmq"`` entry of ``vllm.distributed.kv_events.EventPublisherFactory``
(vLLM 0.33's ``KVEventsConfig.publisher`` accepts only ``"null"`` and
``"zmq"``) and registers ``"kvwire"`` for versions that accept other names.
Without it the plugin does nothing. Then start vLLM as usual, e.g.::

    KVWIRE_PUBLISHER=1 vllm serve MODEL --kv-events-config \\
      '{"enable_kv_cache_events": true, "endpoint": "tcp://*:5557", "replay_endpoint": "tcp://*:5657"}'
"""

from __future__ import annotations

import importlib
from typing import Any

from kvwire.integrations.adapter import EngineEventPublisher, install
from kvwire.integrations.config import IntegrationConfig, plugin_enabled

__all__ = ["VllmEventPublisher", "register"]


class VllmEventPublisher(EngineEventPublisher):
    """kvwire's publisher with vLLM's constructor and methods (subclassed per vLLM module)."""

    rank_field = "data_parallel_rank"
    engine = "vLLM"

    def get_publisher_config(self) -> Any:
        """What vLLM's own publisher reports: its resolved (bound) configuration."""
        config = self.publisher.config
        return self.kv_events.KVEventsConfig(
            enable_kv_cache_events=True,
            publisher="zmq",
            endpoint=self.publisher.bound_endpoint,
            replay_endpoint=self.publisher.bound_replay_endpoint,
            buffer_steps=config.buffer_steps,
            hwm=config.hwm,
            max_queue_size=config.max_queue_size,
            topic=config.topic,
        )


def register() -> None:
    """The ``vllm.general_plugins`` entry point: idempotent, inert unless ``KVWIRE_PUBLISHER=1``.

    vLLM calls it without a guard in every process, so while off it reads
    ``KVWIRE_PUBLISHER`` alone and cannot raise. On, a bad ``KVWIRE_*`` value
    stops vLLM here with an error naming the variable: the operator asked for
    kvwire, and an engine publishing nothing would look healthy.
    """
    if not plugin_enabled(VllmEventPublisher.engine):
        return
    IntegrationConfig.from_env()
    install(importlib.import_module("vllm.distributed.kv_events"), VllmEventPublisher)
