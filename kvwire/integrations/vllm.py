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
from kvwire.integrations.config import IntegrationConfig

__all__ = ["VllmEventPublisher", "register"]


class VllmEventPublisher(EngineEventPublisher):
    """kvwire's publisher with vLLM's constructor and methods (subclassed per vLLM module)."""

    rank_field = "data_parallel_rank"
    engine = "vLLM"

    def __init__(
        self,
        data_parallel_rank: int = 0,
        endpoint: str = "tcp://*:5557",
        replay_endpoint: str | None = None,
        buffer_steps: int = 10_000,
        hwm: int = 100_000,
        max_queue_size: int = 100_000,
        topic: str = "",
        *,
        config: IntegrationConfig | None = None,
        **later_fields: Any,
    ) -> None:
        super().__init__(
            data_parallel_rank,
            endpoint,
            replay_endpoint,
            buffer_steps,
            hwm,
            max_queue_size,
            topic,
            config or IntegrationConfig.from_env(),
            later_fields,
        )

    def get_publisher_config(self) -> Any:
        """What vLLM's own publisher reports: its resolved (bound) configuration."""
        return self.kv_events.KVEventsConfig(
            enable_kv_cache_events=True,
            publisher="zmq",
            endpoint=self.publisher.bound_endpoint,
            replay_endpoint=self.publisher.bound_replay_endpoint,
            buffer_steps=self.buffer_steps,
            hwm=self.hwm,
            max_queue_size=self.max_queue_size,
            topic=self.topic,
        )


def register() -> None:
    """The ``vllm.general_plugins`` entry point: idempotent, inert unless ``KVWIRE_PUBLISHER=1``."""
    if not IntegrationConfig.from_env().enabled:
        return
    install(importlib.import_module("vllm.distributed.kv_events"), VllmEventPublisher)
