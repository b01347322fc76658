"""kvwire's publisher inside real engines: vLLM and SGLang plugins, a TensorRT-LLM relay.

Importing this package imports no engine. ``kvwire.integrations.vllm`` and
``kvwire.integrations.sglang`` are the engines' plugin entry points (inert
unless ``KVWIRE_PUBLISHER=1``); ``kvwire.integrations.tensorrt_llm`` relays
TensorRT-LLM's ``get_kv_cache_events`` through kvwire. The ``KVWIRE_*``
variables are listed in :mod:`kvwire.integrations.config`.
"""

from kvwire.integrations.config import IntegrationConfig, RelayConfig

__all__ = ["IntegrationConfig", "RelayConfig"]
