"""kvwire inside vLLM 0.33, through vLLM's own plugin loader, factory, structs and decoder."""

from __future__ import annotations

import logging
import time
import types
from typing import Any

import msgspec
import pytest
import zmq

from kvwire.integrations.vllm import VllmEventPublisher
from kvwire.subscriber import EngineSource

from .streams import (
    BLOCK_SIZE,
    EngineStructs,
    assert_late_join_exact,
    assert_same_streams,
    raw_digest,
)

Engine = types.SimpleNamespace


def structs(kv: Any) -> EngineStructs:
    return EngineStructs(
        stored=lambda hashes, parent, tokens: kv.BlockStored(
            block_hashes=hashes,
            parent_block_hash=parent,
            token_ids=tokens,
            block_size=BLOCK_SIZE,
            lora_id=None,
            medium=kv.MEDIUM_GPU,
            lora_name=None,
            extra_keys=[None] * len(hashes),
            group_idx=0,
        ),
        removed=lambda hashes: kv.BlockRemoved(block_hashes=hashes, medium=kv.MEDIUM_GPU, group_idx=0),
        cleared=kv.AllBlocksCleared,
        batch=lambda events: kv.KVEventBatch(ts=time.time(), events=events),
        block_hash=raw_digest,
    )


def config(vllm: Engine, **fields: Any) -> Any:
    return vllm.config.KVEventsConfig(enable_kv_cache_events=True, **fields)


def load_plugins(vllm: Engine) -> None:
    """What every vLLM engine process does at start-up."""
    vllm.plugins.load_general_plugins()


def test_pyproject_declares_the_plugin(kvwire_entry_points: dict[str, dict[str, str]]) -> None:
    assert kvwire_entry_points["vllm.general_plugins"] == {"kvwire": "kvwire.integrations.vllm:register"}


def test_vllm_config_refuses_a_new_publisher_name(vllm: Engine) -> None:
    """Why the plugin takes over "zmq": vLLM 0.33 validates the publisher name."""
    with pytest.raises(Exception, match="publisher"):
        vllm.config.KVEventsConfig(enable_kv_cache_events=True, publisher="kvwire")


def test_factory_gives_kvwire_only_when_enabled(
    vllm: Engine, kvwire_entry_points: Any, monkeypatch: pytest.MonkeyPatch, ipc_dir: str,
    caplog: pytest.LogCaptureFixture,
) -> None:
    kv = vllm.kv_events
    factory = kv.EventPublisherFactory
    monkeypatch.delenv("KVWIRE_PUBLISHER", raising=False)
    load_plugins(vllm)
    assert factory._registry == vllm.pristine
    own = factory.create(config(vllm, endpoint=f"ipc://{ipc_dir}/own"), 0)
    assert type(own) is kv.ZmqEventPublisher
    own.shutdown()

    monkeypatch.setenv("KVWIRE_PUBLISHER", "1")
    monkeypatch.setattr(vllm.plugins, "plugins_loaded", False)
    with caplog.at_level(logging.WARNING, logger="kvwire"):
        load_plugins(vllm)
        monkeypatch.setattr(vllm.plugins, "plugins_loaded", False)
        load_plugins(vllm)  # loaded again: nothing changes, nothing is logged twice
    assert [r.getMessage() for r in caplog.records].count(
        "kvwire: vLLM's KV events are published by kvwire (the 'zmq' publisher replaced, "
        "'kvwire' registered)"
    ) == 1
    assert factory._registry["zmq"] is factory._registry["kvwire"]
    assert isinstance(factory.create(None), kv.NullEventPublisher)
    assert isinstance(factory.create(vllm.config.KVEventsConfig()), kv.NullEventPublisher)
    assert isinstance(factory.create(config(vllm, publisher="null")), kv.NullEventPublisher)
    ours = factory.create(config(vllm, endpoint=f"ipc://{ipc_dir}/ours", replay_endpoint=f"ipc://{ipc_dir}/r"), 0)
    try:
        assert isinstance(ours, kv.EventPublisher) and isinstance(ours, VllmEventPublisher)
        resolved = ours.get_publisher_config()
        assert isinstance(resolved, vllm.config.KVEventsConfig)
        assert (resolved.endpoint, resolved.replay_endpoint) == (f"ipc://{ipc_dir}/ours", f"ipc://{ipc_dir}/r")
    finally:
        ours.shutdown()
    # vLLM connects to a concrete tcp host; kvwire only binds, so vLLM's own serves it.
    with caplog.at_level(logging.WARNING, logger="kvwire"):
        connecting = factory.create(config(vllm, endpoint="tcp://127.0.0.1:1"), 0)
    assert type(connecting) is kv.ZmqEventPublisher
    assert "only binds" in caplog.text
    connecting.shutdown()


def test_wildcard_binds_loopback_unless_exposed(
    vllm: Engine, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setenv("KVWIRE_PUBLISHER", "1")
    from kvwire.integrations import vllm as plugin

    plugin.register()
    with caplog.at_level(logging.WARNING, logger="kvwire"):
        ours = vllm.kv_events.EventPublisherFactory.create(
            config(vllm, endpoint="tcp://*:0", replay_endpoint="tcp://*:0"), 1
        )
    try:
        assert ours.publisher.bound_endpoint.startswith("tcp://127.0.0.1:")
        assert ours.publisher.bound_replay_endpoint.startswith("tcp://127.0.0.1:")
        assert "KVWIRE_EXPOSE=1" in caplog.text
    finally:
        ours.shutdown()
    monkeypatch.setenv("KVWIRE_EXPOSE", "1")
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="kvwire"):
        exposed = vllm.kv_events.EventPublisherFactory.create(config(vllm, endpoint="tcp://*:0"), 1)
    try:
        assert exposed.publisher.bound_endpoint.startswith("tcp://0.0.0.0:")
        assert "reachable beyond this host" in caplog.text
    finally:
        exposed.shutdown()


@pytest.mark.usefixtures("kvwire_entry_points")
def test_side_by_side_byte_identical_live_and_replay(
    vllm: Engine, monkeypatch: pytest.MonkeyPatch, ipc_dir: str, zctx: zmq.Context[Any]
) -> None:
    """vLLM's own publisher and kvwire's, fed the same batches: the same bytes, live and replayed."""
    kv = vllm.kv_events
    factory = kv.EventPublisherFactory
    eps = (f"ipc://{ipc_dir}/own", f"ipc://{ipc_dir}/own-r"), (f"ipc://{ipc_dir}/ours", f"ipc://{ipc_dir}/ours-r")
    own = factory.create(config(vllm, endpoint=eps[0][0], replay_endpoint=eps[0][1], topic="kv"), 0)
    monkeypatch.setenv("KVWIRE_PUBLISHER", "1")
    load_plugins(vllm)
    ours = factory.create(config(vllm, endpoint=eps[1][0], replay_endpoint=eps[1][1], topic="kv"), 0)
    try:
        assert type(own) is kv.ZmqEventPublisher and isinstance(ours, VllmEventPublisher)
        live = assert_same_streams(zctx, own, ours, eps, structs(kv))
        decoded = [msgspec.msgpack.decode(m[2], type=kv.KVEventBatch) for m in live]  # vLLM's own decoder
        assert all(d.data_parallel_rank == 0 for d in decoded)
        assert {type(e) for d in decoded for e in d.events} == {kv.BlockStored, kv.BlockRemoved, kv.AllBlocksCleared}
    finally:
        own.shutdown()
        ours.shutdown()


@pytest.mark.usefixtures("kvwire_entry_points")
def test_scheduler_loop_late_join_ends_exact_and_shuts_down(
    vllm: Engine, monkeypatch: pytest.MonkeyPatch, ipc_dir: str
) -> None:
    """A scheduler publishes vLLM's own batches; a router joining late is served the rest by replay."""
    kv = vllm.kv_events
    monkeypatch.setenv("KVWIRE_PUBLISHER", "1")
    load_plugins(vllm)
    pub = kv.EventPublisherFactory.create(
        config(vllm, endpoint=f"ipc://{ipc_dir}/ev", replay_endpoint=f"ipc://{ipc_dir}/rp"), 0
    )
    assert isinstance(pub, VllmEventPublisher)
    assert_late_join_exact(pub, structs(kv), EngineSource("vllm", f"ipc://{ipc_dir}/ev", f"ipc://{ipc_dir}/rp"))


@pytest.mark.usefixtures("kvwire_entry_points")
def test_vllm_plugins_filter_is_honoured(vllm: Engine, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVWIRE_PUBLISHER", "1")
    monkeypatch.setenv("VLLM_PLUGINS", "someone-else")
    load_plugins(vllm)
    assert vllm.kv_events.EventPublisherFactory._registry == vllm.pristine
    monkeypatch.setattr(vllm.plugins, "plugins_loaded", False)
    monkeypatch.setenv("VLLM_PLUGINS", "someone-else,kvwire")
    load_plugins(vllm)
    assert "kvwire" in vllm.kv_events.EventPublisherFactory._registry
