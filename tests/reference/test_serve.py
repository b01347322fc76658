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
        EngineConfig(publisher=PublisherConfig(
            max_queue_size=7, hwm=9, send_coalesce_s=0.125, topic="t", dialect="array", buffer_steps=11,
            max_replay_batches=3, max_replay_jobs=2, replay_stall_s=0.5, max_replay_bytes=17, epoch=False, heartbeat_s=None,
            snapshot=False, snapshot_chunk_blocks=5, mirror_backlog=13,
        )),
        EngineConfig(publisher=PublisherConfig(heartbeat_s=0.25)),
    ],
)
def test_argv_starts_the_same_configuration(config: EngineConfig) -> None:
    parsed, _ = _parse(config.argv())
    assert parsed == config


def test_every_publisher_setting_has_a_flag_and_absent_flags_keep_the_defaults() -> None:
    changed = EngineConfig(publisher=PublisherConfig(
        max_queue_size=7, hwm=9, send_coalesce_s=0.125, topic="t", dialect="array", buffer_steps=11,
        max_replay_batches=3, max_replay_jobs=2, replay_stall_s=0.5, max_replay_bytes=17, epoch=False, heartbeat_s=None,
        snapshot=False, snapshot_chunk_blocks=5, mirror_backlog=13,
    ))  # fmt: skip
    flags = {arg.removeprefix("--no-").removeprefix("--") for arg in changed.argv() if arg.startswith("--")}
    assert {name.replace("_", "-") for name in PublisherConfig.__struct_fields__} <= flags
    assert _parse([])[0].publisher == PublisherConfig()


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--heartbeat-s", "1e-7"], "--heartbeat-s='1e-7' is refused: expected a number from 0.001 to 3600, or none"),
        (["--buffer-steps", "0"], "--buffer-steps='0' is refused: expected an integer >= 1"),
        (["--dialect", "json"], "--dialect='json' is refused: expected one of 'array', 'map'"),
        (["--hwm", "none"], "--hwm='none' is refused: expected an integer from 1 to 2147483647"),
    ],
)
def test_a_bad_publisher_flag_is_refused_naming_it(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit):
        _parse(argv)
    assert message in capsys.readouterr().err


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
