"""The KVWIRE_* variables, where the integrations bind, and the wheel set-up's failure mode."""

from __future__ import annotations

import logging
import re
import types
from pathlib import Path
from typing import Any

import msgspec
import msgspec.inspect as mi
import pytest

from kvwire.integrations.config import (
    IntegrationConfig,
    RelayConfig,
    bind_address,
    bind_addresses,
    plugin_enabled,
)
from kvwire.publisher import PublisherConfig
from kvwire.security import ServerKeys, generate_keypair

from .engines import EngineUnavailable, fetch_wheel

Engine = types.SimpleNamespace


class Recording(dict[str, str]):
    """An environment that remembers which variables were looked at."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.read: set[str] = set()

    def get(self, key: str, default: Any = None) -> Any:
        self.read.add(key)
        return super().get(key, default)

    def __getitem__(self, key: str) -> str:
        self.read.add(key)
        return super().__getitem__(key)

    def __contains__(self, key: object) -> bool:
        self.read.add(str(key))
        return super().__contains__(key)


def test_defaults_are_inert_and_loopback() -> None:
    config = IntegrationConfig.from_env({})
    assert config == IntegrationConfig()
    assert not config.enabled and not config.expose and config.server_keys() is None
    assert RelayConfig.from_env({}).endpoint == "tcp://127.0.0.1:5557"
    engine = config.publisher_config(buffer_steps=500, hwm=7, max_queue_size=9, topic="kv")
    # The engine's settings as given; kvwire's additions off, so the wire is the engine's.
    assert engine == PublisherConfig(
        buffer_steps=500, hwm=7, max_queue_size=9, topic="kv", epoch=False, heartbeat_s=None,
        snapshot=False,
    )  # fmt: skip
    assert engine.replay_batches == 500  # the whole buffer, as the engines answer
    # Nothing given: the publisher's own defaults, not copies of them.
    relay = RelayConfig().publisher_config()
    default = PublisherConfig()
    assert (relay.buffer_steps, relay.hwm, relay.max_queue_size, relay.send_coalesce_s) == (
        default.buffer_steps, default.hwm, default.max_queue_size, default.send_coalesce_s,
    )  # fmt: skip


PLUGIN_VARIABLES = {
    "KVWIRE_PUBLISHER": "1", "KVWIRE_EXPOSE": "true", "KVWIRE_COALESCE_MS": "0",
    "KVWIRE_EPOCH": "1", "KVWIRE_HEARTBEAT_S": "0.5", "KVWIRE_MAX_REPLAY_BATCHES": "7",
}  # fmt: skip
RELAY_VARIABLES = {
    "KVWIRE_ENDPOINT": "tcp://10.0.0.1:6000", "KVWIRE_REPLAY_ENDPOINT": "tcp://10.0.0.1:6100",
    "KVWIRE_BLOCK_SIZE": "64", "KVWIRE_BUFFER_STEPS": "9", "KVWIRE_MAX_QUEUE_SIZE": "11",
    "KVWIRE_HWM": "13", "KVWIRE_TOPIC": "kv",
}  # fmt: skip


def test_every_variable_is_read() -> None:
    plugin = IntegrationConfig(
        enabled=True, expose=True, coalesce_ms=0, max_replay_batches=7, epoch=True, heartbeat_s=0.5
    )
    assert IntegrationConfig.from_env(PLUGIN_VARIABLES) == plugin
    assert plugin.publisher_config(buffer_steps=500) == PublisherConfig(
        buffer_steps=500, send_coalesce_s=0.0, max_replay_batches=7, epoch=True, heartbeat_s=0.5,
        snapshot=False,
    )  # fmt: skip
    relay = RelayConfig.from_env({**PLUGIN_VARIABLES, **RELAY_VARIABLES})
    assert relay == RelayConfig(
        enabled=True, expose=True, coalesce_ms=0, max_replay_batches=7, epoch=True, heartbeat_s=0.5,
        endpoint="tcp://10.0.0.1:6000", replay_endpoint="tcp://10.0.0.1:6100", block_size=64,
        buffer_steps=9, max_queue_size=11, hwm=13, topic="kv",
    )  # fmt: skip
    assert relay.publisher_config() == PublisherConfig(
        buffer_steps=9, max_queue_size=11, hwm=13, topic="kv", send_coalesce_s=0.0,
        max_replay_batches=7, epoch=True, heartbeat_s=0.5, snapshot=False,
    )  # fmt: skip


def _range(cls: type[msgspec.Struct], name: str) -> Any:
    """A field's type with its constraints, ``None`` left out."""
    field = next(f for f in msgspec.structs.fields(cls) if f.name == name)
    info = mi.type_info(field.type)
    if isinstance(info, mi.UnionType):
        (info,) = [t for t in info.types if not isinstance(t, mi.NoneType)]
    return info


def test_the_variables_ranges_are_the_publishers() -> None:
    """A variable that sets a PublisherConfig field is checked by that field's own range."""
    for name in ("buffer_steps", "max_queue_size", "hwm", "max_replay_batches", "heartbeat_s"):
        assert _range(RelayConfig, name) == _range(PublisherConfig, name), name
    coalesce_ms, coalesce_s = _range(IntegrationConfig, "coalesce_ms"), _range(PublisherConfig, "send_coalesce_s")
    assert (coalesce_ms.ge, coalesce_ms.le) == (coalesce_s.ge * 1000, coalesce_s.le * 1000)


def test_relay_variables_are_read_by_the_relay_only() -> None:
    env = Recording({**PLUGIN_VARIABLES, "KVWIRE_BLOCK_SIZE": "abc", "KVWIRE_HWM": "-1"})
    IntegrationConfig.from_env(env)
    assert env.read == set(PLUGIN_VARIABLES) | {"KVWIRE_SECRET_KEY", "KVWIRE_ALLOW_DIR"}
    with pytest.raises(ValueError, match=r"KVWIRE_BLOCK_SIZE|KVWIRE_HWM"):
        RelayConfig.from_env(env)


@pytest.mark.parametrize(("value", "on"), [("1", True), ("true", True), ("TRUE", True),
                                           ("0", False), ("false", False), ("", False)])  # fmt: skip
def test_the_switch_is_one_or_zero(value: str, on: bool) -> None:
    assert plugin_enabled("vLLM", {"KVWIRE_PUBLISHER": value}) is on
    assert IntegrationConfig.from_env({"KVWIRE_PUBLISHER": value}).enabled is on


@pytest.mark.parametrize("value", ["2", "yes please", "on"])
def test_a_switch_neither_on_nor_off_is_refused_and_leaves_a_plugin_off(
    value: str, caplog: pytest.LogCaptureFixture
) -> None:
    with pytest.raises(ValueError, match=f"KVWIRE_PUBLISHER='{value}' is refused: expected a boolean"):
        IntegrationConfig.from_env({"KVWIRE_PUBLISHER": value})
    with caplog.at_level(logging.ERROR, logger="kvwire"):
        assert plugin_enabled("vLLM", {"KVWIRE_PUBLISHER": value}) is False
    assert f"vLLM plugin stays off: KVWIRE_PUBLISHER='{value}' is refused" in caplog.text


def test_an_off_switch_reads_nothing_else() -> None:
    env = Recording({"KVWIRE_HEARTBEAT_S": "1e-7", "KVWIRE_SECRET_KEY": "/nowhere"})
    assert plugin_enabled("vLLM", env) is False
    assert env.read == {"KVWIRE_PUBLISHER"}


@pytest.mark.parametrize(
    ("reader", "name", "value", "allowed"),
    [
        (IntegrationConfig, "KVWIRE_HEARTBEAT_S", "1e-7", "a number from 0.001 to 3600, or unset"),
        (IntegrationConfig, "KVWIRE_HEARTBEAT_S", "nan", "a number from 0.001 to 3600"),
        (IntegrationConfig, "KVWIRE_HEARTBEAT_S", "often", "a number from 0.001 to 3600"),
        (IntegrationConfig, "KVWIRE_COALESCE_MS", str(10**15), "an integer from 0 to 60000"),
        (IntegrationConfig, "KVWIRE_COALESCE_MS", "two", "an integer from 0 to 60000"),
        (IntegrationConfig, "KVWIRE_COALESCE_MS", "-1", "an integer from 0 to 60000"),
        (IntegrationConfig, "KVWIRE_MAX_REPLAY_BATCHES", "0", "an integer >= 1, or unset"),
        (IntegrationConfig, "KVWIRE_EPOCH", "2", "a boolean (1, 0, true or false)"),
        (RelayConfig, "KVWIRE_BLOCK_SIZE", "abc", "an integer >= 1"),
        (RelayConfig, "KVWIRE_BLOCK_SIZE", "0", "an integer >= 1"),
        (RelayConfig, "KVWIRE_HWM", "-1", "an integer from 1 to 2147483647, or unset"),
        (RelayConfig, "KVWIRE_BUFFER_STEPS", "1.5", "an integer >= 1, or unset"),
    ],
)
def test_a_bad_value_is_refused_naming_variable_value_and_range(
    reader: type[IntegrationConfig], name: str, value: str, allowed: str
) -> None:
    with pytest.raises(ValueError) as info:
        reader.from_env({"KVWIRE_PUBLISHER": "1", name: value})
    assert str(info.value).startswith(f"{name}={value!r} is refused: expected {allowed}")


def test_keys_go_together_and_a_missing_file_is_named(tmp_path: Path) -> None:
    for env in ({"KVWIRE_SECRET_KEY": "/x.key_secret"}, {"KVWIRE_ALLOW_DIR": str(tmp_path)}):
        with pytest.raises(ValueError, match="KVWIRE_SECRET_KEY and KVWIRE_ALLOW_DIR go together"):
            IntegrationConfig.from_env(env)
    missing = str(tmp_path / "gone.key_secret")
    with pytest.raises(ValueError, match=f"KVWIRE_SECRET_KEY='{missing}'.*cannot read key file"):
        IntegrationConfig.from_env({"KVWIRE_SECRET_KEY": missing, "KVWIRE_ALLOW_DIR": str(tmp_path)})


def test_curve_keys_from_the_environment(tmp_path: Path) -> None:
    _, secret = generate_keypair(tmp_path, "engine")
    config = IntegrationConfig.from_env({"KVWIRE_SECRET_KEY": str(secret), "KVWIRE_ALLOW_DIR": str(tmp_path)})
    assert config.server_keys() == ServerKeys(secret, tmp_path)


# --- the plugins, through the engines' own loaders ------------------------------------

POISON = [
    {"KVWIRE_HEARTBEAT_S": "1e-7"},
    {"KVWIRE_COALESCE_MS": str(10**15)},
    {"KVWIRE_BLOCK_SIZE": "abc", "KVWIRE_HWM": "-1"},
    {"KVWIRE_SECRET_KEY": "/x.key_secret"},
    {"KVWIRE_SECRET_KEY": "/nowhere/x.key_secret", "KVWIRE_ALLOW_DIR": "/nowhere"},
    {"KVWIRE_EPOCH": "maybe", "KVWIRE_EXPOSE": "2", "KVWIRE_MAX_REPLAY_BATCHES": "0"},
]


def _environment(monkeypatch: pytest.MonkeyPatch, switch: str | None, env: dict[str, str]) -> None:
    if switch is None:
        monkeypatch.delenv("KVWIRE_PUBLISHER", raising=False)
    else:
        monkeypatch.setenv("KVWIRE_PUBLISHER", switch)
    for name, value in env.items():
        monkeypatch.setenv(name, value)


@pytest.mark.usefixtures("kvwire_entry_points")
@pytest.mark.parametrize("switch", [None, "0", "false", "2", "yes"])
@pytest.mark.parametrize("env", POISON)
def test_an_off_plugin_never_stops_vllm(
    vllm: Engine, monkeypatch: pytest.MonkeyPatch, switch: str | None, env: dict[str, str]
) -> None:
    """vLLM 0.33 runs general plugins without a guard: whatever the other variables say,
    a plugin that is off returns, and vLLM keeps its own publisher."""
    _environment(monkeypatch, switch, env)
    vllm.plugins.load_general_plugins()
    assert vllm.kv_events.EventPublisherFactory._registry == vllm.pristine


@pytest.mark.usefixtures("kvwire_entry_points")
@pytest.mark.parametrize("switch", [None, "0", "2"])
@pytest.mark.parametrize("env", POISON)
def test_an_off_plugin_never_fails_in_sglang(
    sglang: Engine, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture,
    switch: str | None, env: dict[str, str],
) -> None:  # fmt: skip
    _environment(monkeypatch, switch, env)
    with caplog.at_level(logging.ERROR):
        sglang.plugins.load_plugins()
    assert "Failed to execute general plugin" not in caplog.text
    registry = sglang.kv_events.EventPublisherFactory._registry
    assert set(registry) == set(sglang.pristine) | {"kvwire"}
    assert registry["zmq"] is sglang.pristine["zmq"]


@pytest.mark.usefixtures("kvwire_entry_points")
@pytest.mark.parametrize(
    ("env", "named"),
    [
        ({"KVWIRE_HEARTBEAT_S": "1e-7"}, "KVWIRE_HEARTBEAT_S='1e-7' is refused"),
        ({"KVWIRE_COALESCE_MS": str(10**15)}, "KVWIRE_COALESCE_MS='1000000000000000' is refused"),
        ({"KVWIRE_SECRET_KEY": "/x.key_secret"}, "KVWIRE_SECRET_KEY and KVWIRE_ALLOW_DIR go together"),
        ({"KVWIRE_SECRET_KEY": "/nowhere/x.key_secret", "KVWIRE_ALLOW_DIR": "/nowhere"},
         "KVWIRE_SECRET_KEY='/nowhere/x.key_secret'"),
    ],
)  # fmt: skip
def test_an_on_plugin_with_a_bad_setting_stops_vllm_naming_it(
    vllm: Engine, monkeypatch: pytest.MonkeyPatch, env: dict[str, str], named: str
) -> None:
    """The operator asked for kvwire: an engine that starts without it would look healthy and
    publish nothing a router can use, so vLLM stops at start-up with the variable named."""
    _environment(monkeypatch, "1", env)
    with pytest.raises(ValueError, match=re.escape(named)):
        vllm.plugins.load_general_plugins()
    assert vllm.kv_events.EventPublisherFactory._registry == vllm.pristine


@pytest.mark.usefixtures("kvwire_entry_points")
def test_an_on_plugin_ignores_the_relay_variables(vllm: Engine, monkeypatch: pytest.MonkeyPatch) -> None:
    _environment(monkeypatch, "1", {"KVWIRE_BLOCK_SIZE": "abc", "KVWIRE_HWM": "-1"})
    vllm.plugins.load_general_plugins()
    registry = vllm.kv_events.EventPublisherFactory._registry
    assert registry["zmq"] is registry["kvwire"]


@pytest.mark.usefixtures("kvwire_entry_points")
def test_an_on_plugin_with_a_bad_setting_is_refused_in_sglang(
    sglang: Engine, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """SGLang logs a failing plugin and goes on with its own publisher: the error names the variable."""
    _environment(monkeypatch, "1", {"KVWIRE_HEARTBEAT_S": "1e-7"})
    with caplog.at_level(logging.ERROR):
        sglang.plugins.load_plugins()
    assert "KVWIRE_HEARTBEAT_S='1e-7' is refused" in caplog.text
    assert sglang.kv_events.EventPublisherFactory._registry == sglang.pristine


KEYED = {"secret_key": "/keys/engine.key_secret", "allow_dir": "/keys/clients"}


@pytest.mark.parametrize(
    ("endpoint", "expose", "keyed", "bound"),
    [
        ("tcp://*:5557", False, False, "tcp://127.0.0.1:5557"),
        ("tcp://0.0.0.0:5557", False, False, "tcp://127.0.0.1:5557"),
        ("tcp://[::]:5557", False, False, "tcp://[::1]:5557"),
        ("tcp://*:0", False, False, "tcp://127.0.0.1:*"),
        ("tcp://*:5557", True, False, "tcp://*:5557"),
        ("tcp://*:0", True, False, "tcp://*:*"),
        ("tcp://10.1.2.3:5557", False, False, "tcp://10.1.2.3:5557"),
        ("ipc:///tmp/kv", False, False, "ipc:///tmp/kv"),
        # Keys imply reach: the keys decide who reads, so the wildcard stays.
        ("tcp://*:5557", False, True, "tcp://*:5557"),
        ("tcp://0.0.0.0:5557", False, True, "tcp://0.0.0.0:5557"),
        ("tcp://[::]:5557", False, True, "tcp://[::]:5557"),
        ("tcp://*:0", False, True, "tcp://*:*"),
        ("tcp://*:5557", True, True, "tcp://*:5557"),
        ("tcp://127.0.0.1:5557", False, True, "tcp://127.0.0.1:5557"),
    ],
)
def test_bind_address(endpoint: str, expose: bool, keyed: bool, bound: str) -> None:
    config = IntegrationConfig(expose=expose, **(KEYED if keyed else {}))
    assert config.keyed is keyed
    assert bind_address(endpoint, config) == bound


@pytest.mark.parametrize(
    ("env", "bound", "said", "unsaid"),
    [
        # No keys: loopback, and a warning naming both ways to bind as configured.
        ({}, ("tcp://127.0.0.1:5557", "tcp://127.0.0.1:5558"),
         (logging.WARNING, "for the configured tcp://*:5557 (replay tcp://*:5558)"), "CURVE keys (KVWIRE_SECRET_KEY) guard"),
        # KVWIRE_EXPOSE=1 without keys: as configured; the publisher warns per socket (below).
        ({"expose": True}, ("tcp://*:5557", "tcp://*:5558"), None, "KVWIRE_EXPOSE=1"),
        # Keys: as configured, one line naming the endpoints and the keys guarding them.
        (KEYED, ("tcp://*:5557", "tcp://*:5558"),
         (logging.INFO, "kvwire binds tcp://*:5557 (replay tcp://*:5558) as configured: CURVE keys "
                        "(KVWIRE_SECRET_KEY) guard it, only clients whose public key is in "
                        "KVWIRE_ALLOW_DIR=/keys/clients read the events"), "KVWIRE_EXPOSE=1"),
        ({**KEYED, "expose": True}, ("tcp://*:5557", "tcp://*:5558"),
         (logging.INFO, "as configured: CURVE keys (KVWIRE_SECRET_KEY) guard it"), "KVWIRE_EXPOSE=1"),
    ],
)  # fmt: skip
def test_bind_addresses_say_why_a_wildcard_is_narrowed_or_kept(
    caplog: pytest.LogCaptureFixture,
    env: dict[str, Any],
    bound: tuple[str, str],
    said: tuple[int, str] | None,
    unsaid: str,
) -> None:
    with caplog.at_level(logging.DEBUG, logger="kvwire"):
        assert bind_addresses("tcp://*:5557", "tcp://*:5558", IntegrationConfig(**env)) == bound
    records = [(r.levelno, r.getMessage()) for r in caplog.records]
    if said is None:
        assert records == []
    else:
        assert len(records) == 1 and records[0][0] == said[0] and said[1] in records[0][1]
    assert unsaid not in caplog.text


@pytest.mark.parametrize("keyed", [False, True])
def test_no_wildcard_no_line(caplog: pytest.LogCaptureFixture, keyed: bool) -> None:
    """Nothing was narrowed or kept, so nothing to explain (the publisher still warns for a
    wide concrete host)."""
    config = IntegrationConfig(**(KEYED if keyed else {}))
    with caplog.at_level(logging.DEBUG, logger="kvwire"):
        assert bind_addresses("tcp://127.0.0.1:0", None, config) == ("tcp://127.0.0.1:*", None)
        assert bind_addresses("ipc:///tmp/kv", "ipc:///tmp/r", config) == ("ipc:///tmp/kv", "ipc:///tmp/r")
    assert caplog.records == []


def _keyed_environment(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> ServerKeys:
    """``KVWIRE_PUBLISHER=1`` with an engine key and an allow-list of one router key."""
    _, secret = generate_keypair(tmp_path / "engine", "engine")
    allow = tmp_path / "clients"
    generate_keypair(allow, "router")
    _environment(monkeypatch, "1", {"KVWIRE_SECRET_KEY": str(secret), "KVWIRE_ALLOW_DIR": str(allow)})
    return ServerKeys(secret, allow)


def _assert_keyed_wildcard(ours: Any, keys: ServerKeys, caplog: pytest.LogCaptureFixture) -> None:
    """Bound on every interface, the keys on both sockets, and the log naming the
    endpoint and the keys guarding it (and no loopback or keyless warning)."""
    assert ours.publisher.bound_endpoint.startswith("tcp://0.0.0.0:")
    assert ours.publisher.bound_replay_endpoint.startswith("tcp://0.0.0.0:")
    assert ours.publisher.server_keys == keys
    keyed = [r for r in caplog.records if "CURVE keys (KVWIRE_SECRET_KEY) guard it" in r.getMessage()]
    assert len(keyed) == 1 and "kvwire binds tcp://*:* (replay tcp://*:*)" in keyed[0].getMessage()
    assert caplog.text.count("(CURVE keys required to connect)") == 2  # PUB and replay
    assert "KVWIRE_EXPOSE=1" not in caplog.text and "WITHOUT authentication" not in caplog.text


@pytest.mark.usefixtures("kvwire_entry_points")
def test_keys_let_vllm_bind_its_wildcard_and_the_log_says_keyed(
    vllm: Engine, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, tmp_path: Path
) -> None:
    """vLLM's own ``tcp://*`` through the plugin, with CURVE keys: bound as configured."""
    keys = _keyed_environment(monkeypatch, tmp_path)
    vllm.plugins.load_general_plugins()
    kv_config = vllm.config.KVEventsConfig(
        enable_kv_cache_events=True, endpoint="tcp://*:0", replay_endpoint="tcp://*:0"
    )
    with caplog.at_level(logging.INFO, logger="kvwire"):
        ours = vllm.kv_events.EventPublisherFactory.create(kv_config, 0)
    try:
        _assert_keyed_wildcard(ours, keys, caplog)
    finally:
        ours.shutdown()


@pytest.mark.usefixtures("kvwire_entry_points")
def test_keys_let_sglang_bind_its_wildcard_and_the_log_says_keyed(
    sglang: Engine, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, tmp_path: Path
) -> None:
    """SGLang's ``tcp://*`` through its plugin, with CURVE keys: bound as configured."""
    keys = _keyed_environment(monkeypatch, tmp_path)
    sglang.plugins.load_plugins()
    kv_config = '{"publisher": "zmq", "endpoint": "tcp://*:0", "replay_endpoint": "tcp://*:0"}'
    with caplog.at_level(logging.INFO, logger="kvwire"):
        ours = sglang.kv_events.EventPublisherFactory.create(kv_config, 0)
    try:
        _assert_keyed_wildcard(ours, keys, caplog)
    finally:
        ours.shutdown()


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
