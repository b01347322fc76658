"""The KVWIRE_* variables, where the integrations bind, and the wheel set-up's failure mode."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvwire.integrations.config import IntegrationConfig, bind_address

from .engines import EngineUnavailable, fetch_wheel


def test_defaults_are_inert_and_loopback() -> None:
    config = IntegrationConfig.from_env({})
    assert config == IntegrationConfig()
    assert not config.enabled and not config.expose
    assert config.endpoint == "tcp://127.0.0.1:5557"
    options = config.publisher_options(500)
    assert options["max_replay_batches"] == 500
    assert options.get("epoch", False) is False and options.get("heartbeat") is None
    assert options.get("snapshot", False) is False and options.get("server_keys") is None


def test_every_variable_is_read() -> None:
    config = IntegrationConfig.from_env({
        "KVWIRE_PUBLISHER": "1", "KVWIRE_EXPOSE": "true", "KVWIRE_COALESCE_MS": "0",
        "KVWIRE_EPOCH": "1", "KVWIRE_HEARTBEAT_S": "0.5",
        "KVWIRE_MAX_REPLAY_BATCHES": "7", "KVWIRE_ENDPOINT": "tcp://10.0.0.1:6000",
        "KVWIRE_REPLAY_ENDPOINT": "tcp://10.0.0.1:6100", "KVWIRE_BLOCK_SIZE": "64",
        "KVWIRE_BUFFER_STEPS": "9", "KVWIRE_MAX_QUEUE_SIZE": "11", "KVWIRE_HWM": "13",
        "KVWIRE_TOPIC": "kv",
    })  # fmt: skip
    assert config == IntegrationConfig(
        enabled=True, expose=True, coalesce_ms=0, max_replay_batches=7, epoch=True, heartbeat_s=0.5,
        endpoint="tcp://10.0.0.1:6000",
        replay_endpoint="tcp://10.0.0.1:6100", block_size=64, buffer_steps=9, max_queue_size=11,
        hwm=13, topic="kv",
    )  # fmt: skip

    assert config.publisher_options(500) == {
        "coalesce_s": 0.0, "max_replay_batches": 7, "epoch": True, "heartbeat": 0.5, "snapshot": False,
        "server_keys": None,
    }  # fmt: skip
    assert IntegrationConfig().publisher_options(9) == {
        "coalesce_s": 0.002, "max_replay_batches": 9, "epoch": False, "heartbeat": None,
        "snapshot": False, "server_keys": None,
    }  # fmt: skip


@pytest.mark.parametrize("value", ["0", "yes please", "2"])
def test_only_a_clear_yes_enables(value: str) -> None:
    assert not IntegrationConfig.from_env({"KVWIRE_PUBLISHER": value}).enabled


@pytest.mark.parametrize(
    ("name", "value", "fragment"),
    [
        ("KVWIRE_COALESCE_MS", "two", "is not an integer"),
        ("KVWIRE_COALESCE_MS", "-1", "must be >= 0"),
        ("KVWIRE_HEARTBEAT_S", "nan", "positive number of seconds"),
        ("KVWIRE_HEARTBEAT_S", "often", "not a number of seconds"),
        ("KVWIRE_SECRET_KEY", "/x.key_secret", "go together"),
        ("KVWIRE_BLOCK_SIZE", "0", "must be >= 1"),
        ("KVWIRE_MAX_REPLAY_BATCHES", "0", "must be >= 1"),
    ],
)
def test_a_bad_value_is_named(name: str, value: str, fragment: str) -> None:
    with pytest.raises(ValueError, match=fragment) as info:
        IntegrationConfig.from_env({name: value})
    assert name in str(info.value)


def test_curve_keys_from_the_environment(tmp_path: Path) -> None:
    from kvwire.security import ServerKeys, generate_keypair

    _, secret = generate_keypair(tmp_path, "engine")
    config = IntegrationConfig.from_env({"KVWIRE_SECRET_KEY": str(secret), "KVWIRE_ALLOW_DIR": str(tmp_path)})
    assert config.server_keys == ServerKeys(secret, tmp_path)


@pytest.mark.parametrize(
    ("endpoint", "expose", "bound"),
    [
        ("tcp://*:5557", False, "tcp://127.0.0.1:5557"),
        ("tcp://0.0.0.0:5557", False, "tcp://127.0.0.1:5557"),
        ("tcp://[::]:5557", False, "tcp://[::1]:5557"),
        ("tcp://*:0", False, "tcp://127.0.0.1:*"),
        ("tcp://*:5557", True, "tcp://*:5557"),
        ("tcp://*:0", True, "tcp://*:*"),
        ("tcp://10.1.2.3:5557", False, "tcp://10.1.2.3:5557"),
        ("ipc:///tmp/kv", False, "ipc:///tmp/kv"),
    ],
)
def test_bind_address(endpoint: str, expose: bool, bound: str) -> None:
    assert bind_address(endpoint, IntegrationConfig(expose=expose)) == bound


def test_a_failed_wheel_download_names_the_reason(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Offline, with nothing cached: the set-up fails with pip's own words, it does not skip."""
    monkeypatch.setenv("KVWIRE_WHEEL_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    monkeypatch.setenv("PIP_FIND_LINKS", str(tmp_path))
    with pytest.raises(EngineUnavailable, match=r"vllm==0\.33\.0") as info:
        fetch_wheel("vllm", "0.33.0")
    assert "No matching distribution" in str(info.value) or "ERROR" in str(info.value)


def test_a_cached_wheel_is_reused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    cache = tmp_path / "cache"
    cache.mkdir()
    wheel = cache / "vllm-0.33.0-cp38-abi3-manylinux_2_28_x86_64.whl"
    wheel.write_bytes(b"")
    monkeypatch.setenv("KVWIRE_WHEEL_CACHE", str(cache))
    monkeypatch.setenv("PIP_NO_INDEX", "1")  # pip would fail: it must not be asked
    assert fetch_wheel("vllm", "0.33.0") == wheel
