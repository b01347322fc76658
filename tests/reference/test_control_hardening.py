"""The reference engine's control endpoint against hostile and careless clients (#12 row 8)."""

from __future__ import annotations

import logging
import math
import shutil
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgspec
import pytest
import zmq

pytest.importorskip("torch")

from kvwire.reference.control import (
    ControlClient,
    ControlError,
    Drive,
    Shutdown,
    Submit,
    encoder,
)
from kvwire.reference.serve import EngineConfig, EngineServer, _parse
from kvwire.security import ClientKeys, ServerKeys, generate_keypair

CONFIG = EngineConfig(ranks=2, num_blocks=16, block_size=4, device="cpu")


class Running:
    """An engine server on its own thread, as ``python -m kvwire.reference.serve`` runs it."""

    def __init__(self, config: EngineConfig) -> None:
        self.ctx: zmq.Context[Any] = zmq.Context()
        self.server = EngineServer(config, context=self.ctx)
        self.server.start()
        self.endpoint = self.server.endpoints().control
        self.thread = threading.Thread(target=self.server.serve, daemon=True)
        self.thread.start()

    def alive(self) -> bool:
        return self.thread.is_alive()

    def close(self) -> None:
        self.server.stop()
        self.thread.join(10)
        self.server.close()
        self.ctx.term()


@pytest.fixture
def engine() -> Iterator[Running]:
    running = Running(CONFIG)
    yield running
    running.close()


def assert_serving(endpoint: str, **keys: Any) -> None:
    with ControlClient(endpoint, timeout=5, **keys) as client:
        assert len(client.stats().ranks) == 2


@pytest.mark.parametrize(
    "rate", [math.nan, 1e-320, 0.0005, -1.0, math.inf, -math.inf, 1e9], ids=repr
)
def test_a_bad_drive_rate_is_refused_and_the_engine_keeps_serving(engine: Running, rate: float) -> None:
    with ControlClient(engine.endpoint, timeout=5) as client, pytest.raises(ControlError, match="rate"):
        client.drive(rate)
    assert engine.alive()
    assert_serving(engine.endpoint)
    assert engine.server._workload is None


def test_the_server_refuses_a_bad_rate_however_it_is_called() -> None:
    ctx: zmq.Context[Any] = zmq.Context()
    server = EngineServer(CONFIG, context=ctx)
    for rate in (math.nan, 1e-320, math.inf):
        with pytest.raises(ValueError, match="drive rate"):
            server.drive(rate)
    with pytest.raises(ValueError, match="hold"):
        server.drive(1.0, hold=0)
    server.drive(MIN := 0.001)  # the slowest allowed
    assert server._drive_interval == pytest.approx(1 / MIN)
    server.close()
    ctx.term()


@pytest.mark.parametrize(
    ("call", "fragment"),
    [
        (lambda c: c.submit(-1, "r", [1, 2, 3, 4]), "rank"),
        (lambda c: c.submit(2, "r", [1, 2, 3, 4]), "outside 0..1"),
        (lambda c: c.submit(0, "", [1, 2, 3, 4]), "request_id"),
        (lambda c: c.submit(0, "r" * 257, [1, 2, 3, 4]), "request_id"),
        (lambda c: c.submit(0, "r", [1, -2, 3, 4]), "token_ids"),
        (lambda c: c.submit(0, "r", [1, 2**40, 3, 4]), "token_ids"),
        (lambda c: c.probe(0, [-1]), "token_ids"),
        (lambda c: c.set_publisher(0, max_queue_size=0), "max_queue_size"),
        (lambda c: c.set_publisher(0, max_queue_size=10**12), "max_queue_size"),
        (lambda c: c.drive(1.0, hold=0), "hold"),
        (lambda c: c.drive(1.0, seed=-1), "seed"),
        (lambda c: c.reset(70_000), "rank"),
    ],
)
def test_every_field_is_bounded(engine: Running, call: Any, fragment: str) -> None:
    with ControlClient(engine.endpoint, timeout=5) as client:
        before = client.truth(0).last_seq
        with pytest.raises(ControlError, match=fragment):
            call(client)
        assert client.truth(0).last_seq == before  # no work was done: nothing published
    assert engine.alive()


def test_a_prompt_longer_than_the_cache_is_refused_before_any_work(engine: Running) -> None:
    limit = CONFIG.max_prompt_tokens
    with ControlClient(engine.endpoint, timeout=5) as client:
        before = client.truth(0)
        with pytest.raises(ControlError, match=f"exceed the {limit}"):
            client.submit(0, "long", list(range(limit + 1)))
        with pytest.raises(ControlError, match=f"exceed the {limit}"):
            client.probe(0, list(range(limit + 1)))
        after = client.truth(0)
        assert (after.last_seq, after.hashes) == (before.last_seq, before.hashes)
        assert client.stats().ranks[0].active_requests == 0
        client.submit(0, "fits", list(range(limit)))  # the whole cache is still a valid prompt


def test_frames_beyond_the_limit_are_dropped_by_the_socket(engine: Running) -> None:
    """A 2M-token Submit (and anything past ``control_max_message``) never reaches the engine."""
    ctx: zmq.Context[Any] = zmq.Context()
    try:
        hostile: zmq.Socket[bytes] = ctx.socket(zmq.DEALER)
        hostile.setsockopt(zmq.LINGER, 0)
        hostile.connect(engine.endpoint)
        big = encoder.encode((1, Submit(0, "huge", list(range(2_000_000)))))
        assert len(big) > CONFIG.control_max_message
        hostile.send_multipart([b"", big])
        hostile.send_multipart([b"", b"\x00" * (CONFIG.control_max_message + 1)])
        assert not hostile.poll(500), "the engine answered a message it must never read"
        hostile.close(0)
    finally:
        ctx.destroy(linger=0)
    assert engine.alive()
    assert_serving(engine.endpoint)


def test_junk_is_answered_not_fatal(engine: Running) -> None:
    ctx: zmq.Context[Any] = zmq.Context()
    try:
        sock: zmq.Socket[bytes] = ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(engine.endpoint)
        for junk in (b"", b"\xc1", msgspec.msgpack.encode([1, {"type": "Nope"}]), b"\x92\x01\xdc\xff\xff"):
            sock.send_multipart([b"", junk])
            assert sock.poll(5000)
            _, reply = msgspec.msgpack.decode(sock.recv_multipart()[-1])
            assert reply["type"] == "Failed"
        sock.close(0)
    finally:
        ctx.destroy(linger=0)
    assert_serving(engine.endpoint)


def test_binding_control_beyond_loopback_warns(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING):
        running = Running(EngineConfig(ranks=1, host="0.0.0.0", num_blocks=4, block_size=4, device="cpu"))
        running.close()
    warned = [r.getMessage() for r in caplog.records if "control endpoint" in r.getMessage()]
    assert warned and "WITHOUT authentication" in warned[0]


@pytest.fixture
def keys(tmp_path: Path) -> dict[str, Any]:
    keydir, allow = tmp_path / "keys", tmp_path / "allowed"
    allow.mkdir()
    server_public, server_secret = generate_keypair(keydir, "server")
    out: dict[str, Any] = {"allow": allow, "server": ServerKeys(server_secret, allow)}
    for name in ("operator", "stranger"):
        public, secret = generate_keypair(keydir, name)
        out[name] = ClientKeys(server_public, secret)
        out[f"{name}_public"] = public
    shutil.copy(out["operator_public"], allow)
    return out


def test_curve_only_the_allow_list_may_command(keys: dict[str, Any]) -> None:
    config = EngineConfig(ranks=2, num_blocks=16, block_size=4, device="cpu", control_keys=keys["server"])
    assert _parse(config.argv())[0] == config
    running = Running(config)
    try:
        for who in ({}, {"keys": keys["stranger"]}):
            with ControlClient(running.endpoint, timeout=0.5, **who) as client:
                with pytest.raises(ControlError, match=r"no reply|could not be sent"):
                    client.shutdown()
                with pytest.raises(ControlError, match=r"no reply|could not be sent"):
                    client.set_publisher(0, max_queue_size=1)
        ctx: zmq.Context[Any] = zmq.Context()
        raw: zmq.Socket[bytes] = ctx.socket(zmq.DEALER)  # plain text to a CURVE server: nothing
        raw.setsockopt(zmq.LINGER, 0)
        raw.connect(running.endpoint)
        raw.send_multipart([b"", encoder.encode((1, Shutdown()))])
        raw.send_multipart([b"", encoder.encode((2, Drive(math.nan)))])
        assert not raw.poll(500)
        ctx.destroy(linger=0)
        assert running.alive()
        with ControlClient(running.endpoint, timeout=5, keys=keys["operator"]) as client:
            assert client.stats().ranks[0].publisher["queue_depth"] == 0
            assert running.server.ranks[0].publisher.max_queue_size == CONFIG.publisher.max_queue_size
        # Rotation: a key added to the directory is let in, without a restart.
        shutil.copy(keys["stranger_public"], keys["allow"])
        assert_serving(running.endpoint, keys=keys["stranger"])
        with ControlClient(running.endpoint, timeout=5, keys=keys["operator"]) as client:
            client.shutdown()
        running.thread.join(10)
        assert not running.alive()
    finally:
        running.close()


def test_half_a_key_configuration_is_refused() -> None:
    with pytest.raises(SystemExit):
        _parse(["--control-secret-key", "/nonexistent.key_secret"])
