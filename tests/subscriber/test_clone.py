"""Clones: a replica copies a running router's view, then follows the engines from there.

Replay buffers are shorter than the history, so a replica that started cold would
end PARTIAL: SYNCED and exact proves the peer's view and positions were used.
Broken clone streams come from a scripted peer serving a real router's pieces.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
import zmq

from kvwire.security import (
    ClientKeys,
    ServerKeys,
    generate_keypair,
    release_context,
    secure_server,
)
from kvwire.subscriber import CheckpointError, EngineSource, Subscriber
from kvwire.subscriber.clone import PROTOCOL, clone_view
from tests.subscriber.ckpt_helpers import ViewSet, engines, fleet
from tests.subscriber.helpers import bound_source, fast
from tests.subscriber.test_checkpoint import BEFORE, BUFFER, TAIL, exact, publish
from tests.waiting import wait_for


@pytest.mark.parametrize("kind", ["stock", "kvwire"])
def test_a_replica_clones_a_running_router_and_ends_exact(kind: str) -> None:
    with fleet(2, kind, buffer_steps=BUFFER) as pubs:
        engs = engines(2, seed=200)
        source = bound_source("w", pubs)
        peer_sink = ViewSet()
        with Subscriber([source], peer_sink, config=fast()) as peer:
            assert peer.wait_synced(timeout=10)
            publish(engs, pubs, BEFORE)
            wait_for(lambda: exact(peer, peer_sink, engs), 10, "the peer exact")
            endpoint = peer.serve_view()
            assert endpoint.startswith("tcp://127.0.0.1:")
            sink = ViewSet()
            with Subscriber([source], sink, config=fast(clone_from=endpoint)) as replica:
                publish(engs, pubs, TAIL)  # traffic goes on while it clones
                wait_for(lambda: exact(replica, sink, engs), 10, "the replica exact")
                wait_for(lambda: exact(peer, peer_sink, engs), 10, "the peer still exact")
                restored = replica.restored
                assert restored is not None and restored.source == f"clone from {endpoint}"
                assert sorted(restored.positions) == [("w", 0), ("w", 1)]
                assert replica.restore_refusals == []
                progress = replica.restore_progress()
                assert (progress.source, progress.done, progress.ranks_imported) == (
                    "clone",
                    True,
                    2,
                )
                assert progress.bytes_received == restored.nbytes and progress.bytes_expected == 0
                for st in replica.status():
                    assert st.counters.resyncs == 0 and st.counters.seqs_lost == 0
                    if kind == "stock":
                        assert st.counters.replayed <= TAIL, "the engines paid only the tail"


def take_pieces(endpoint: str) -> list[bytes]:
    """A running router's clone stream, piece by piece, as a raw client reads it."""
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()
    sock: zmq.Socket[bytes] = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(endpoint)
    sock.send_multipart([PROTOCOL, b"OPEN"])
    sock.send_multipart([PROTOCOL, b"CREDIT", (4).to_bytes(4, "big")])
    pieces: list[bytes] = []
    try:
        while True:
            assert sock.poll(5000), "the router serves its view"
            frames = sock.recv_multipart()
            if frames[1] == b"END":
                return pieces
            assert frames[1] == b"DATA"
            pieces.append(b"".join(frames[2:]))  # a piece in parts (a blob is one)
            sock.send_multipart([PROTOCOL, b"CREDIT", (1).to_bytes(4, "big")])
    finally:
        sock.close()


class ScriptedPeer:
    """A clone endpoint that serves ``pieces`` to one client, then ends (``end``) or dies."""

    def __init__(self, pieces: list[bytes], *, end: bool) -> None:
        self.ctx = zmq.Context()
        self.sock: zmq.Socket[bytes] = self.ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.bind("tcp://127.0.0.1:*")
        self.endpoint = self.sock.getsockopt_string(zmq.LAST_ENDPOINT)
        self.pieces, self.end = list(pieces), end
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        sock, todo = self.sock, list(self.pieces)
        while sock.poll(10_000):
            ident, _, verb, *rest = sock.recv_multipart()
            if verb != b"CREDIT":
                continue
            for _ in range(int.from_bytes(rest[0], "big")):
                if not todo:
                    if self.end:
                        sock.send_multipart([ident, PROTOCOL, b"END"])
                    sock.close()  # the peer dies (or is done)
                    return
                sock.send_multipart([ident, PROTOCOL, b"DATA", todo.pop(0)])
        sock.close()

    def close(self) -> None:
        self.thread.join(15)
        self.ctx.term()


@pytest.fixture(scope="module")
def served() -> Iterator[tuple[list[bytes], set[tuple[str, int]]]]:
    """The clone stream of a real router following two ranks, and the ranks it follows."""
    with fleet(2, "stock") as pubs:
        engs = engines(2, seed=300)
        sink = ViewSet()
        with Subscriber([bound_source("w", pubs)], sink, config=fast()) as sub:
            assert sub.wait_synced(timeout=10)
            publish(engs, pubs, 10)
            wait_for(lambda: exact(sub, sink, engs), 10, "exact")
            pieces = take_pieces(sub.serve_view())
    assert len(pieces) == 4  # header, two records, end
    yield pieces, {("w", 0), ("w", 1)}


def refuse(
    pieces: list[bytes], followed: set[tuple[str, int]], *, end: bool, match: str | None = None
) -> None:
    peer = ScriptedPeer(pieces, end=end)
    sink = ViewSet()
    try:
        with pytest.raises(CheckpointError, match=match):
            clone_view(zmq.Context.instance(), peer.endpoint, sink, followed, timeout=0.3)
    finally:
        peer.close()
    assert sink.ranks() == [], "whatever was imported was cleared again"


def test_the_scripted_peer_serves_a_valid_clone(
    served: tuple[list[bytes], set[tuple[str, int]]],
) -> None:
    pieces, followed = served
    peer = ScriptedPeer(pieces, end=True)
    sink = ViewSet()
    try:
        restored = clone_view(zmq.Context.instance(), peer.endpoint, sink, followed, timeout=5)
    finally:
        peer.close()
    assert sorted(restored.positions) == sorted(followed) and sink.imports == 2


def test_a_peer_that_dies_mid_clone_is_refused(
    served: tuple[list[bytes], set[tuple[str, int]]],
) -> None:
    pieces, followed = served
    for k in range(len(pieces)):
        refuse(pieces[:k], followed, end=False, match="sent nothing")


def test_a_truncated_clone_stream_is_refused(
    served: tuple[list[bytes], set[tuple[str, int]]],
) -> None:
    pieces, followed = served
    for k in range(len(pieces)):
        refuse(pieces[:k], followed, end=True, match="truncated")
    last = pieces[-1]
    refuse([*pieces[:-1], last[: len(last) - 2]], followed, end=True, match="truncated")


def test_a_corrupt_clone_stream_is_refused(
    served: tuple[list[bytes], set[tuple[str, int]]],
) -> None:
    pieces, followed = served
    for i, piece in enumerate(pieces):
        for at in (0, len(piece) // 2, len(piece) - 1):
            bad = bytearray(piece)
            bad[at] ^= 0x04
            refuse([*pieces[:i], bytes(bad), *pieces[i + 1 :]], followed, end=True)


def test_another_fleets_view_is_refused(
    served: tuple[list[bytes], set[tuple[str, int]]],
) -> None:
    pieces, _ = served
    refuse(pieces, {("x", 0)}, end=True, match="another fleet")


def test_a_replica_whose_peer_dies_mid_clone_starts_cold_and_ends_exact(
    served: tuple[list[bytes], set[tuple[str, int]]],
) -> None:
    pieces, _ = served
    peer = ScriptedPeer(pieces[:2], end=False)  # the header and one rank, then nothing
    try:
        with fleet(2, "stock") as pubs:
            engs = engines(2, seed=400)
            publish(engs, pubs, 5)
            sink = ViewSet()
            config = fast(clone_from=peer.endpoint, clone_timeout=0.3)
            with Subscriber([bound_source("w", pubs)], sink, config=config) as replica:
                wait_for(lambda: exact(replica, sink, engs), 10, "exact from a cold start")
                assert replica.restored is None
                [why] = replica.restore_refusals
                assert "sent nothing" in why
    finally:
        peer.close()


def test_a_clone_of_another_fleet_starts_the_replica_cold() -> None:
    with fleet(1, "stock") as pubs:
        engs = engines(1, seed=500)
        peer_sink = ViewSet()
        with Subscriber([bound_source("x", pubs)], peer_sink, config=fast()) as peer:
            assert peer.wait_synced(timeout=10)
            publish(engs, pubs, 5)
            wait_for(lambda: exact(peer, peer_sink, engs, "x"), 10, "the peer exact")
            sink = ViewSet()
            config = fast(clone_from=peer.serve_view())
            with Subscriber([bound_source("w", pubs)], sink, config=config) as replica:
                wait_for(lambda: exact(replica, sink, engs), 10, "exact from a cold start")
                assert replica.restored is None and sink.imports == 0
                [why] = replica.restore_refusals
                assert "another fleet" in why


def test_curve_keys_guard_the_clone_endpoint(tmp_path: Path) -> None:
    keys = tmp_path / "keys"
    allow = tmp_path / "allow"
    allow.mkdir()
    server_public, server_secret = generate_keypair(keys, "router")
    generate_keypair(allow, "replica")
    (allow / "replica.key_secret").rename(keys / "replica.key_secret")
    client_secret = keys / "replica.key_secret"
    with fleet(1, "stock", buffer_steps=BUFFER) as pubs:
        engs = engines(1, seed=600)
        source = bound_source("w", pubs)
        peer_sink = ViewSet()
        with Subscriber([source], peer_sink, config=fast()) as peer:
            assert peer.wait_synced(timeout=10)
            publish(engs, pubs, BEFORE)
            wait_for(lambda: exact(peer, peer_sink, engs), 10, "the peer exact")
            endpoint = peer.serve_view(keys=ServerKeys(server_secret, allow))
            # Without keys: no handshake, nothing received, refused.
            sink = ViewSet()
            with Subscriber(
                [source], sink, config=fast(clone_from=endpoint, clone_timeout=0.3)
            ) as replica:
                wait_for(lambda: replica.restore_refusals, 10, "the keyless clone refused")
                assert replica.restored is None
            sink = ViewSet()
            config = fast(clone_from=endpoint, clone_keys=ClientKeys(server_public, client_secret))
            with Subscriber([source], sink, config=config) as replica:
                wait_for(lambda: exact(replica, sink, engs), 10, "the keyed replica exact")
                assert replica.restored is not None


class _LateSocket(zmq.Socket[bytes]):
    """A socket whose ``connect`` returns once the peer has refused the handshake: the
    clone client's thread running late, as on a loaded machine."""

    def connect(self, addr: str) -> None:  # type: ignore[override]
        super().connect(addr)
        # A DEALER may send while its pipe lives; the refused session ends it.
        wait_for(lambda: not self.get(zmq.EVENTS) & zmq.POLLOUT, 10, "the handshake refused")


class _LateContext(zmq.Context[_LateSocket]):
    _socket_class = _LateSocket


def test_a_clone_refused_before_it_asks_fails_without_blocking(tmp_path: Path) -> None:
    """A peer that wants keys refuses a keyless client during the handshake. However
    late the client sends its first request, the clone fails at once (it used to wait
    forever in a blocking send, past its timeout and the subscriber's stop)."""
    _, server_secret = generate_keypair(tmp_path / "keys", "router")
    (tmp_path / "allow").mkdir()
    server_ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    router = server_ctx.socket(zmq.ROUTER)
    router.setsockopt(zmq.LINGER, 0)
    secure_server(router, ServerKeys(server_secret, tmp_path / "allow"))
    router.bind("tcp://127.0.0.1:*")
    endpoint = router.getsockopt_string(zmq.LAST_ENDPOINT)
    ctx = _LateContext()
    errors: list[BaseException] = []

    def clone() -> None:
        try:
            clone_view(ctx, endpoint, ViewSet(), [("w", 0)], timeout=60)
        except BaseException as exc:
            errors.append(exc)

    thread = threading.Thread(target=clone, daemon=True)
    try:
        thread.start()
        thread.join(10)
        assert not thread.is_alive(), "the clone blocked on a refused connection"
        assert len(errors) == 1 and isinstance(errors[0], CheckpointError), errors
        assert "handshake" in str(errors[0])
    finally:
        ctx.destroy(linger=0)  # (frees a send still blocked)
        router.close(linger=0)
        release_context(server_ctx)
        server_ctx.destroy(linger=0)


def test_serving_needs_a_running_subscriber_with_a_view_sink() -> None:
    with pytest.raises(RuntimeError, match="running"):
        Subscriber([EngineSource("w", "tcp://127.0.0.1:9")], ViewSet()).serve_view()


def test_stop_during_a_clone_returns_promptly() -> None:
    """A replica waiting on a silent peer stops at once: the clone is abandoned, not awaited."""
    silent: zmq.Socket[bytes] = zmq.Context.instance().socket(zmq.ROUTER)
    silent.setsockopt(zmq.LINGER, 0)
    silent.bind("tcp://127.0.0.1:*")
    try:
        endpoint = silent.getsockopt_string(zmq.LAST_ENDPOINT)
        config = fast(clone_from=endpoint, clone_timeout=60)
        sub = Subscriber([EngineSource("w", "tcp://127.0.0.1:9")], ViewSet(), config=config)
        sub.start()
        assert silent.poll(5000), "the replica asked for the view"
        sub.stop(timeout=3)  # raises TimeoutError if the clone held the thread
        assert sub.restored is None
        assert "abandoned" in sub.restore_refusals[0]
    finally:
        silent.close()


def test_a_wildcard_clone_endpoint_warns_loudly_without_keys(
    caplog: pytest.LogCaptureFixture,
) -> None:
    with Subscriber([EngineSource("w", "tcp://127.0.0.1:9")], ViewSet()) as sub:
        with caplog.at_level("WARNING", logger="kvwire.subscriber.clone"):
            endpoint = sub.serve_view("tcp://0.0.0.0:*")
        assert endpoint.startswith("tcp://0.0.0.0:")
        assert "WITHOUT authentication" in caplog.text and "clone service" in caplog.text
        caplog.clear()
        with caplog.at_level("WARNING", logger="kvwire.subscriber.clone"):
            sub.serve_view()  # loopback: nothing to say
        assert caplog.text == ""
