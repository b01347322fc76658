"""kvwire inside SGLang 0.5.23, through SGLang's own plugin loader, factory, structs and decoder."""

from __future__ import annotations

import json
import logging
import time
import types
from typing import Any

import msgspec
import pytest
import zmq

from kvwire.integrations.sglang import SglangEventPublisher
from kvwire.subscriber import EngineSource

from .streams import (
    BLOCK_SIZE,
    EngineStructs,
    assert_late_join_exact,
    assert_same_streams,
    signed_hash,
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
            medium=kv.StorageMedium.GPU.value,
        ),
        removed=lambda hashes: kv.BlockRemoved(block_hashes=hashes, medium=kv.StorageMedium.GPU.value),
        cleared=kv.AllBlocksCleared,
        batch=lambda events: kv.KVEventBatch(ts=time.time(), events=events),
        block_hash=signed_hash,
    )


def config(**fields: Any) -> str:
    """SGLang's ``--kv-events-config`` JSON."""
    return json.dumps(fields)


def load_plugins(sglang: Engine) -> None:
    """What every SGLang process does at start-up."""
    sglang.plugins.load_plugins()


def test_pyproject_declares_the_plugin(kvwire_entry_points: dict[str, dict[str, str]]) -> None:
    assert kvwire_entry_points["sglang.srt.plugins"] == {"kvwire": "kvwire.integrations.sglang:register"}


def test_factory_gives_kvwire_by_name_and_for_zmq_only_when_enabled(
    sglang: Engine, kvwire_entry_points: Any, monkeypatch: pytest.MonkeyPatch, ipc_dir: str,
    caplog: pytest.LogCaptureFixture,
) -> None:
    kv = sglang.kv_events
    factory = kv.EventPublisherFactory
    monkeypatch.delenv("KVWIRE_PUBLISHER", raising=False)
    load_plugins(sglang)
    # Without KVWIRE_PUBLISHER only the new name exists; "zmq" stays SGLang's own.
    assert set(factory._registry) == set(sglang.pristine) | {"kvwire"}
    assert all(factory._registry[n] is f for n, f in sglang.pristine.items())
    named = factory.create(config(publisher="kvwire", endpoint=f"ipc://{ipc_dir}/x"), 0)
    assert isinstance(named, kv.EventPublisher) and isinstance(named, SglangEventPublisher)
    named.shutdown()
    own = factory.create(config(publisher="zmq", endpoint=f"ipc://{ipc_dir}/own"), 0)
    assert type(own) is kv.ZmqEventPublisher
    own.shutdown()

    monkeypatch.setenv("KVWIRE_PUBLISHER", "1")
    monkeypatch.setattr(sglang.plugins, "_plugins_loaded", False)
    with caplog.at_level(logging.WARNING, logger="kvwire"):
        load_plugins(sglang)
        monkeypatch.setattr(sglang.plugins, "_plugins_loaded", False)
        load_plugins(sglang)  # loaded again: nothing changes, nothing is logged twice
    assert caplog.text.count("SGLang's KV events are published by kvwire") == 1
    assert factory._registry["zmq"] is factory._registry["kvwire"]
    assert isinstance(factory.create(None), kv.NullEventPublisher)
    for name in ("kvwire", "zmq"):
        ours = factory.create(
            config(publisher=name, endpoint=f"ipc://{ipc_dir}/{name}", replay_endpoint=f"ipc://{ipc_dir}/{name}-r",
                   topic="t", format="dynamo"),
            0,
        )
        try:
            assert isinstance(ours, kv.EventPublisher) and isinstance(ours, SglangEventPublisher)
            assert ours.describe_local_source(16) == {
                "dp_rank": 0, "endpoint": f"ipc://{ipc_dir}/{name}", "topic": "t", "block_size": 16,
                "replay_endpoint": f"ipc://{ipc_dir}/{name}-r",
            }  # fmt: skip
        finally:
            ours.shutdown()
    # bind=false asks SGLang to connect; kvwire only binds, so SGLang's own serves it.
    with caplog.at_level(logging.WARNING, logger="kvwire"):
        connecting = factory.create(config(publisher="zmq", endpoint="tcp://127.0.0.1:1", bind=False), 0)
    assert type(connecting) is kv.ZmqEventPublisher
    assert "only binds" in caplog.text
    connecting.shutdown()


def test_attention_dp_rank_offsets_and_stamps(
    sglang: Engine, monkeypatch: pytest.MonkeyPatch, zctx: zmq.Context[Any]
) -> None:
    """Rank 2 binds its own port (here: an ephemeral one) and stamps attn_dp_rank=2."""
    monkeypatch.setenv("KVWIRE_PUBLISHER", "1")
    from kvwire.integrations import sglang as plugin

    plugin.register()
    kv = sglang.kv_events
    pub = kv.EventPublisherFactory.create(config(publisher="kvwire", endpoint="tcp://127.0.0.1:*"), 2)
    try:
        source = pub.describe_local_source(BLOCK_SIZE)
        assert source["dp_rank"] == 2 and source["endpoint"].startswith("tcp://127.0.0.1:")
        sub: zmq.Socket[bytes] = zctx.socket(zmq.SUB)
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        sub.connect(source["endpoint"])
        deadline = time.monotonic() + 10
        while not sub.poll(20):
            assert time.monotonic() < deadline, "never joined"
            pub.publish(kv.KVEventBatch(ts=1.0, events=[kv.AllBlocksCleared()]))
        batch = msgspec.msgpack.decode(sub.recv_multipart()[2], type=kv.KVEventBatch)
        assert batch.attn_dp_rank == 2
        sub.close(0)
    finally:
        pub.shutdown()


@pytest.mark.usefixtures("kvwire_entry_points")
def test_side_by_side_byte_identical_live_and_replay(
    sglang: Engine, monkeypatch: pytest.MonkeyPatch, ipc_dir: str, zctx: zmq.Context[Any]
) -> None:
    """SGLang's own publisher and kvwire's, fed the same batches: the same bytes, live and replayed."""
    kv = sglang.kv_events
    factory = kv.EventPublisherFactory
    eps = (f"ipc://{ipc_dir}/own", f"ipc://{ipc_dir}/own-r"), (f"ipc://{ipc_dir}/ours", f"ipc://{ipc_dir}/ours-r")
    own = factory.create(config(publisher="zmq", endpoint=eps[0][0], replay_endpoint=eps[0][1], topic="kv"), 0)
    monkeypatch.setenv("KVWIRE_PUBLISHER", "1")
    load_plugins(sglang)
    ours = factory.create(config(publisher="zmq", endpoint=eps[1][0], replay_endpoint=eps[1][1], topic="kv"), 0)
    try:
        assert type(own) is kv.ZmqEventPublisher and isinstance(ours, SglangEventPublisher)
        live = assert_same_streams(zctx, own, ours, eps, structs(kv))
        decoded = [msgspec.msgpack.decode(m[2], type=kv.KVEventBatch) for m in live]  # SGLang's own decoder
        assert all(d.attn_dp_rank == 0 for d in decoded)
        assert {type(e) for d in decoded for e in d.events} == {kv.BlockStored, kv.BlockRemoved, kv.AllBlocksCleared}
    finally:
        own.shutdown()
        ours.shutdown()


@pytest.mark.usefixtures("kvwire_entry_points")
def test_scheduler_loop_late_join_ends_exact_and_shuts_down(
    sglang: Engine, monkeypatch: pytest.MonkeyPatch, ipc_dir: str
) -> None:
    """A scheduler publishes SGLang's own batches; a router joining late is served the rest by replay."""
    kv = sglang.kv_events
    monkeypatch.setenv("KVWIRE_PUBLISHER", "1")
    load_plugins(sglang)
    pub = kv.EventPublisherFactory.create(
        config(publisher="kvwire", endpoint=f"ipc://{ipc_dir}/ev", replay_endpoint=f"ipc://{ipc_dir}/rp"), 0
    )
    assert isinstance(pub, SglangEventPublisher)
    assert_late_join_exact(pub, structs(kv), EngineSource("sglang", f"ipc://{ipc_dir}/ev", f"ipc://{ipc_dir}/rp"))


@pytest.mark.usefixtures("kvwire_entry_points")
def test_sglang_plugins_filter_is_honoured(sglang: Engine, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVWIRE_PUBLISHER", "1")
    monkeypatch.setenv("SGLANG_PLUGINS", "someone-else")
    load_plugins(sglang)
    assert sglang.kv_events.EventPublisherFactory._registry == sglang.pristine
    monkeypatch.setattr(sglang.plugins, "_plugins_loaded", False)
    monkeypatch.setenv("SGLANG_PLUGINS", "someone-else,kvwire")
    load_plugins(sglang)
    assert "kvwire" in sglang.kv_events.EventPublisherFactory._registry
