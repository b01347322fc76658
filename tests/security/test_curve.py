"""CURVE keys and the allow-list: who gets in, who does not, and rotation without a restart."""

from __future__ import annotations

import logging
import shutil
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import zmq

from kvwire.security import (
    AllowList,
    ClientKeys,
    SecurityError,
    ServerKeys,
    generate_keypair,
    is_loopback,
    load_public_key,
    load_secret_key,
    release_context,
    secure_client,
    secure_server,
    warn_if_exposed,
)


@pytest.fixture
def ctx() -> Iterator[zmq.Context[zmq.Socket[bytes]]]:
    c: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    yield c
    release_context(c)
    c.destroy(linger=0)


def _server(
    ctx: zmq.Context[zmq.Socket[bytes]], curve_keys: dict[str, Path]
) -> tuple[zmq.Socket[bytes], str]:
    router = ctx.socket(zmq.ROUTER)
    router.setsockopt(zmq.LINGER, 0)
    secure_server(router, ServerKeys(curve_keys["server_secret"], curve_keys["allow"]))
    router.bind("tcp://127.0.0.1:*")
    return router, router.getsockopt_string(zmq.LAST_ENDPOINT)


def _ask(
    ctx: zmq.Context[zmq.Socket[bytes]],
    endpoint: str,
    client: ClientKeys | None,
    server: zmq.Socket[bytes],
    wait_s: float,
) -> bool:
    """Whether a DEALER with ``client`` keys gets a message through to ``server`` in time."""
    dealer = ctx.socket(zmq.DEALER)
    dealer.setsockopt(zmq.LINGER, 0)
    if client is not None:
        secure_client(dealer, client)
    dealer.connect(endpoint)
    try:
        # Not blocking: a client the server refused before this send has no pipe left
        # (libzmq ends the session on a refused handshake), and a blocking send waits forever.
        dealer.send(b"hello", zmq.NOBLOCK)
        return bool(server.poll(int(wait_s * 1000)))
    except zmq.Again:
        return False  # refused already
    finally:
        dealer.close(linger=0)


def test_only_allowed_clients_get_through(
    ctx: zmq.Context[zmq.Socket[bytes]], curve_keys: dict[str, Path]
) -> None:
    server, endpoint = _server(ctx, curve_keys)
    assert not _ask(ctx, endpoint, None, server, 0.5)
    mallory = ClientKeys(curve_keys["server"], curve_keys["mallory_secret"])
    assert not _ask(ctx, endpoint, mallory, server, 0.5)
    wrong_server = ClientKeys(curve_keys["alice"], curve_keys["alice_secret"])  # expects another server
    assert not _ask(ctx, endpoint, wrong_server, server, 0.5)
    alice = ClientKeys(curve_keys["server"], curve_keys["alice_secret"])
    assert _ask(ctx, endpoint, alice, server, 5.0)
    assert server.recv_multipart()[1] == b"hello"
    server.close(linger=0)


def test_allow_list_rotates_without_a_restart(
    ctx: zmq.Context[zmq.Socket[bytes]], curve_keys: dict[str, Path]
) -> None:
    server, endpoint = _server(ctx, curve_keys)
    mallory = ClientKeys(curve_keys["server"], curve_keys["mallory_secret"])
    assert not _ask(ctx, endpoint, mallory, server, 0.5)
    shutil.copy(curve_keys["mallory"], curve_keys["allow"] / "mallory.key")
    assert _ask(ctx, endpoint, mallory, server, 5.0)
    server.recv_multipart()
    (curve_keys["allow"] / "alice.key").unlink()
    alice = ClientKeys(curve_keys["server"], curve_keys["alice_secret"])
    assert not _ask(ctx, endpoint, alice, server, 0.5)
    server.close(linger=0)


def test_allow_list_rereads_a_changed_directory(curve_keys: dict[str, Path]) -> None:
    allow = AllowList(curve_keys["allow"])
    assert allow.keys() == {load_public_key(curve_keys["alice"])}
    shutil.copy(curve_keys["mallory"], curve_keys["allow"] / "m.key")
    (curve_keys["allow"] / "junk.key").write_text("not a certificate")
    assert allow.keys() == {load_public_key(curve_keys["alice"]), load_public_key(curve_keys["mallory"])}
    assert allow.callback("*", load_public_key(curve_keys["mallory"]))
    assert not allow.callback("*", load_public_key(curve_keys["server"]))


def test_bad_key_files_are_refused_early(curve_keys: dict[str, Path], tmp_path: Path) -> None:
    with pytest.raises(SecurityError, match="no secret key"):
        load_secret_key(curve_keys["alice"])
    with pytest.raises(SecurityError, match="cannot read"):
        load_public_key(tmp_path / "missing.key")
    with pytest.raises(SecurityError, match="does not exist"):
        ServerKeys(curve_keys["server_secret"], tmp_path / "nowhere")
    with pytest.raises(SecurityError, match="no secret key"):
        ClientKeys(curve_keys["server"], curve_keys["server"])
    with pytest.raises(SecurityError, match="plain file name"):
        generate_keypair(tmp_path, "../escape")


def test_secret_key_file_is_private(curve_keys: dict[str, Path]) -> None:
    assert curve_keys["alice_secret"].stat().st_mode & 0o077 == 0


@pytest.mark.parametrize(
    ("endpoint", "loopback"),
    [
        ("tcp://127.0.0.1:5557", True),
        ("tcp://127.0.0.2:5557", True),
        ("tcp://localhost:5557", True),
        ("tcp://[::1]:5557", True),
        ("ipc:///tmp/kv", True),
        ("inproc://kv", True),
        ("tcp://*:5557", False),
        ("tcp://0.0.0.0:5557", False),
        ("tcp://10.1.2.3:5557", False),
    ],
)
def test_is_loopback(endpoint: str, loopback: bool) -> None:
    assert is_loopback(endpoint) is loopback


def test_exposed_binds_are_logged_loudly(caplog: pytest.LogCaptureFixture) -> None:
    log = logging.getLogger("kvwire.test")
    with caplog.at_level(logging.WARNING, logger="kvwire.test"):
        assert not warn_if_exposed(log, "tcp://127.0.0.1:1", "replay", secured=False)
        assert warn_if_exposed(log, "tcp://*:1", "replay", secured=False)
        assert warn_if_exposed(log, "tcp://*:2", "control", secured=True)
    assert len(caplog.records) == 2
    assert "WITHOUT authentication" in caplog.records[0].getMessage()
    assert "CURVE keys required" in caplog.records[1].getMessage()


def test_release_context_lets_the_context_terminate(curve_keys: dict[str, Path]) -> None:
    c: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    server, _ = _server(c, curve_keys)
    server.close(linger=0)
    release_context(c)
    started = time.monotonic()
    c.term()
    assert time.monotonic() - started < 5
