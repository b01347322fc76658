"""The engine server's command line and its control client's readiness wait."""

from __future__ import annotations

import pytest

from kvwire.publisher import PublisherConfig
from kvwire.reference.control import ControlClient, ControlError
from kvwire.reference.serve import EngineConfig, _parse


@pytest.mark.parametrize(
    "config",
    [
        EngineConfig(),
        EngineConfig(port=5557, replay_port=5657, control_port=5757),
        EngineConfig(ranks=4, host="0.0.0.0", port=7000, replay_port=None, control_port=7100,
                     num_blocks=64, block_size=8, device="cpu", hash_seed=9,
                     publisher=PublisherConfig(buffer_steps=20, hwm=5, max_queue_size=3, topic="kv")),
    ],
)
def test_argv_starts_the_same_configuration(config: EngineConfig) -> None:
    parsed, _ = _parse(config.argv())
    assert parsed == config


def test_wait_ready_stops_when_the_engine_is_gone() -> None:
    with ControlClient("tcp://127.0.0.1:1", timeout=0.1) as client, pytest.raises(
        ControlError, match="exited before it answered"
    ):
        client.wait_ready(30.0, alive=lambda: False)


def test_wait_ready_times_out_with_the_reason() -> None:
    with ControlClient("tcp://127.0.0.1:1", timeout=0.1) as client, pytest.raises(
        ControlError, match="no reply"
    ):
        client.wait_ready(0.3)
