"""kvwire's publisher inside SGLang, as a general plugin (entry point ``sglang.srt.plugins``).

The plugin registers kvwire's publisher as ``"kvwire"`` in
``sglang.srt.disaggregation.kv_events.EventPublisherFactory`` (a config must
name it), and with ``KVWIRE_PUBLISHER=1`` also puts it in place of ``"zmq"``.
SGLang's positional batch (``attn_dp_rank`` in the envelope) goes on the wire
byte for byte as SGLang's own publisher sends it::

    KVWIRE_PUBLISHER=1 python -m sglang.launch_server --model-path MODEL --kv-events-config \\
      '{"publisher": "kvwire", "endpoint": "tcp://*:5557", "replay_endpoint": "tcp://*:5657"}'
"""

from __future__ import annotations

import importlib
from typing import Any

from kvwire.integrations.adapter import EngineEventPublisher, install
from kvwire.integrations.config import IntegrationConfig, plugin_enabled
from kvwire.wire import local_endpoint

__all__ = ["SglangEventPublisher", "register"]


class SglangEventPublisher(EngineEventPublisher):
    """kvwire's publisher with SGLang's constructor and methods (subclassed per SGLang module)."""

    rank_field = "attn_dp_rank"
    engine = "SGLang"

    def describe_local_source(self, block_size: int) -> dict[str, Any] | None:
        """Where a process on this host subscribes (SGLang advertises it in /server_info)."""
        source: dict[str, Any] = {
            "dp_rank": self.rank,
            "endpoint": local_endpoint(self.publisher.bound_endpoint),
            "topic": self.topic,
            "block_size": block_size,
        }
        replay = self.publisher.bound_replay_endpoint
        if replay is not None:
            source["replay_endpoint"] = local_endpoint(replay)
        return source


def register() -> None:
    """The ``sglang.srt.plugins`` entry point, idempotent: ``"kvwire"`` is registered always
    (SGLang accepts any publisher name, and nothing runs until a config names it); ``"zmq"`` is
    taken over only with ``KVWIRE_PUBLISHER=1``.

    Off, it reads ``KVWIRE_PUBLISHER`` alone and cannot fail on a setting; the
    other variables are read when a config names ``"kvwire"`` (the publisher is
    made) or, on, here: a bad value raises naming the variable (SGLang logs the
    failed plugin and keeps its own publisher).
    """
    enabled = plugin_enabled(SglangEventPublisher.engine)
    if enabled:
        IntegrationConfig.from_env()
    install(
        importlib.import_module("sglang.srt.disaggregation.kv_events"),
        SglangEventPublisher,
        replace_zmq=enabled,
    )
