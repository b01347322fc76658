"""The Subscriber's limits: message size, open files and sockets, CURVE keys, sockets per rank."""

from __future__ import annotations

import os
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgspec
import pytest
import zmq

from kvwire.publisher import EventPublisher, PublisherConfig
from kvwire.security import ClientKeys, ServerKeys, generate_keypair, release_context, secure_server
from kvwire.subscriber import (
    BlockSetSink,
    EngineSource,
    RankState,
    ResourceLimitError,
    StreamConfig,
    Subscriber,
    SubscriberConfig,
)
from kvwire.subscriber import env as resources_module
from kvwire.wire import (
    ReplayRequest,
    WireError,
    encode_batch,
    pack_seq,
    parse_request,
    replay_end_frames,
    replay_item_frames,
)
from tests.subscriber.helpers import (
    EPHEMERAL,
    FAST,
    Engine,
    bound_source,
    fast,
    rank_status,
    settled,
)
from tests.waiting import wait_for

HUGE = 200 * 1024 * 1024


class Junk:
    """A batch whose payload is ``size`` bytes of junk (the publisher sends it as it is)."""

    def __init__(self, size: int) -> None:
        self.size = size

    def encode(self, dialect: Any) -> bytes:
        return b"\x00" * self.size


@pytest.mark.parametrize(
    ("limit", "size"),
    [(None, HUGE), (1 << 20, 2 << 20)],
    ids=["200MB-default-limit", "2MiB-over-1MiB"],
)
def test_an_oversized_payload_never_gets_in_and_the_rank_recovers(
    limit: int | None, size: int
) -> None:
    """libzmq drops the message with its connection, on SUB and on replay alike.

    The rank loses that seq (PARTIAL, cleared: nothing stale), reconnects, and
    is exact again after the engine's next clear.
    """
    kw = {} if limit is None else {"max_message_size": limit}
    # The engines' wire (no heartbeat, no snapshot): nothing repairs the loss but a clear.
    engines_wire = PublisherConfig(buffer_steps=64, epoch=False, heartbeat_s=None, snapshot=False)
    with EventPublisher(EPHEMERAL, EPHEMERAL, engines_wire) as pub:
        engine = Engine(seed=21)
        sink = BlockSetSink()
        with Subscriber([bound_source("w", [pub])], sink, config=fast(**kw)) as sub:
            engine.publish(pub, 5)
            wait_for(lambda: settled(sub.status(), "w", 0, 5), 10, "the first batches")
            assert pub.publish(Junk(size))  # seq 5
            engine.publish(pub, 3)
            wait_for(
                lambda: rank_status(sub.status(), "w", 0).state is RankState.PARTIAL,
                20,
                "the loss to be seen",
            )
            assert sink.blocks("w", 0) <= engine.truth
            engine.publish(pub, 1, clear=True)
            engine.publish(pub, 2)
            wait_for(lambda: settled(sub.status(), "w", 0, 12), 20, "the clear")
            st = rank_status(sub.status(), "w", 0)
            # Had the junk been read, it would be a decode error: it never was.
            assert st.counters.decode_errors == 0, st.counters
            assert st.state is RankState.SYNCED and st.connected, st
            assert sink.blocks("w", 0) == engine.truth


# --- limits ---------------------------------------------------------------------------


def test_too_low_an_open_file_hard_limit_is_a_clear_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(resources_module.resource, "getrlimit", lambda _: (1024, 1024))
    big = EngineSource("w", "tcp://127.0.0.1:20000", "tcp://127.0.0.1:25000", ranks=4096)
    with pytest.raises(ResourceLimitError, match=r"4096 ranks .*RLIMIT_NOFILE.*ulimit"):
        Subscriber([big], BlockSetSink())
    sub = Subscriber([EngineSource("a", "tcp://127.0.0.1:20000")], BlockSetSink())
    with pytest.raises(ResourceLimitError, match="RLIMIT_NOFILE"):
        sub.add_source(big)
    assert [s.worker_id for s in sub.sources] == ["a"]


def test_the_soft_limit_is_raised_to_what_the_ranks_need(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[tuple[int, tuple[int, int]]] = []
    monkeypatch.setattr(resources_module.resource, "getrlimit", lambda _: (1024, 65536))
    monkeypatch.setattr(
        resources_module.resource, "setrlimit", lambda which, limits: calls.append((which, limits))
    )
    big = EngineSource("w", "tcp://127.0.0.1:20000", "tcp://127.0.0.1:25000", ranks=4096)
    Subscriber([big], BlockSetSink())
    assert len(calls) == 1
    soft, hard = calls[0][1]
    assert 4 * 4096 <= soft <= hard == 65536


def test_a_given_context_with_too_few_sockets_is_a_clear_error() -> None:
    ctx: zmq.Context[Any] = zmq.Context()
    try:
        big = EngineSource("w", "tcp://127.0.0.1:20000", "tcp://127.0.0.1:25000", ranks=1024)
        with pytest.raises(ResourceLimitError, match="MAX_SOCKETS"):
            Subscriber([big], BlockSetSink(), context=ctx)
    finally:
        ctx.term()


def test_a_rank_at_rest_holds_one_connection_and_no_replay_socket() -> None:
    """Per rank at rest: SUB + monitor pair (three mailboxes) and one TCP connection."""
    ranks = 8
    pubs = [EventPublisher(EPHEMERAL, EPHEMERAL, rank=r).start() for r in range(ranks)]
    try:
        for r, pub in enumerate(pubs):
            Engine(seed=30 + r, rank=r).publish(pub, 3)
        before = len(os.listdir("/proc/self/fd"))
        sink = BlockSetSink()
        # No probe opens a socket.
        quiet = fast(stream=msgspec.structs.replace(FAST.stream, idle_probe=None))
        with Subscriber([bound_source("w", pubs)], sink, config=quiet) as sub:
            wait_for(
                lambda: all(settled(sub.status(), "w", r, 3) for r in range(ranks)),
                10,
                "every rank",
            )
            assert all(sub.rank_state("w", r) is RankState.SYNCED for r in range(ranks))
            assert sub.rank_state("w", ranks) is None and sub.rank_state("x", 0) is None
            # Replay sockets close once their replies are in; the publisher closes its end.
            wait_for(
                lambda: len(os.listdir("/proc/self/fd")) - before <= 5 * ranks + 12,
                10,
                "replay sockets to close",
            )
            # Per rank: three mailboxes, our end of the connection and the publisher's
            # (in this process); the rest is the loop and the context. A replay socket
            # kept per rank would add three more per rank.
    finally:
        for pub in pubs:
            pub.close(timeout=1.0)


# --- CURVE ----------------------------------------------------------------------------


class CurveEngine:
    """A raw CURVE PUB + replay ROUTER serving one rank's batches (the engine side)."""

    def __init__(self, server: ServerKeys) -> None:
        self.ctx: zmq.Context[Any] = zmq.Context()
        self.pub = self.ctx.socket(zmq.PUB)
        self.router = self.ctx.socket(zmq.ROUTER)
        for sock in (self.pub, self.router):
            sock.setsockopt(zmq.LINGER, 0)
            secure_server(sock, server)
            sock.bind("tcp://127.0.0.1:*")
        self.monitor = self.pub.get_monitor_socket(
            zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL
            | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
            | zmq.EVENT_HANDSHAKE_FAILED_AUTH
        )
        self.refused = 0
        self.endpoint = self.pub.getsockopt_string(zmq.LAST_ENDPOINT)
        self.replay_endpoint = self.router.getsockopt_string(zmq.LAST_ENDPOINT)
        self.engine = Engine(seed=40)
        self.buffer: list[bytes] = []
        self.lock = threading.Lock()
        self.replay_requests = 0
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def publish(self, n: int) -> None:
        for _ in range(n):
            payload = encode_batch(self.engine.batch())
            with self.lock:
                seq = len(self.buffer)
                self.buffer.append(payload)
                self.pub.send_multipart([b"", pack_seq(seq), payload])

    def refusals(self) -> int:
        """Handshakes the PUB refused so far (read on the test's thread)."""
        while True:
            try:
                self.monitor.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return self.refused
            self.refused += 1

    def _serve(self) -> None:
        poller = zmq.Poller()
        poller.register(self.router, zmq.POLLIN)
        while not self.stop.is_set():
            if not poller.poll(50):
                continue
            frames = self.router.recv_multipart()
            try:
                request = parse_request(frames)
            except WireError:
                continue
            identity = frames[0]
            self.replay_requests += 1
            with self.lock:
                items = (
                    list(enumerate(self.buffer))[request.start_seq :]
                    if isinstance(request, ReplayRequest)
                    else []
                )
                for seq, payload in items:
                    self.router.send_multipart([identity, *replay_item_frames(b"", seq, payload)])
                self.router.send_multipart([identity, *replay_end_frames(b"")])

    def close(self) -> None:
        self.stop.set()
        self.thread.join(5)
        self.pub.disable_monitor()
        for sock in (self.monitor, self.pub, self.router):
            sock.close(linger=0)
        release_context(self.ctx)
        self.ctx.term()


@pytest.fixture
def curve(tmp_path: Path) -> Iterator[tuple[CurveEngine, ClientKeys, ClientKeys]]:
    keys, allow, other = tmp_path / "keys", tmp_path / "allow", tmp_path / "other"
    _, server_secret = generate_keypair(keys, "server")
    client_public, client_secret = generate_keypair(keys, "client")
    _, stranger_secret = generate_keypair(other, "stranger")
    allow.mkdir()
    (allow / "client.key").write_bytes(client_public.read_bytes())
    engine = CurveEngine(ServerKeys(server_secret, allow))
    server_public = keys / "server.key"
    try:
        yield (
            engine,
            ClientKeys(server_public, client_secret),
            ClientKeys(server_public, stranger_secret),
        )
    finally:
        engine.close()


def test_curve_an_allowed_key_follows_the_engine_exactly(
    curve: tuple[CurveEngine, ClientKeys, ClientKeys],
) -> None:
    engine, allowed, _ = curve
    engine.publish(10)  # before the subscriber: replayed over CURVE
    sink = BlockSetSink()
    source = EngineSource("w", engine.endpoint, engine.replay_endpoint, keys=allowed)
    with Subscriber([source], sink, config=FAST) as sub:
        wait_for(lambda: rank_status(sub.status(), "w", 0).connected, 10, "the handshake")
        engine.publish(10)
        wait_for(lambda: settled(sub.status(), "w", 0, 20), 10, "every batch")
        st = rank_status(sub.status(), "w", 0)
        assert st.state is RankState.SYNCED and st.counters.replayed >= 10, st
        assert sink.blocks("w", 0) == engine.engine.truth


@pytest.mark.parametrize("who", ["no keys", "unlisted key"])
def test_curve_without_an_allowed_key_nothing_is_received(
    curve: tuple[CurveEngine, ClientKeys, ClientKeys], who: str
) -> None:
    engine, _, stranger = curve
    engine.publish(5)
    keys = None if who == "no keys" else stranger
    sink = BlockSetSink()
    source = EngineSource("w", engine.endpoint, engine.replay_endpoint, keys=keys)
    with Subscriber([source], sink, config=FAST) as sub:
        # Several connection attempts, each refused, with batches sent meanwhile.
        for attempts in (1, 2, 3):
            wait_for(lambda n=attempts: engine.refusals() >= n, 10, "a refused handshake")
            engine.publish(2)
        st = rank_status(sub.status(), "w", 0)
        assert not st.connected and st.counters.batches == 0, st
        assert sink.ranks() == [] and engine.replay_requests == 0


def test_one_replay_socket_at_a_time_still_brings_every_rank_in() -> None:
    """``max_replays=1``: first contacts and replays queue for the one socket and all end exact."""
    ranks = 6
    pubs = [EventPublisher(EPHEMERAL, EPHEMERAL, rank=r).start() for r in range(ranks)]
    try:
        engines = [Engine(seed=50 + r, rank=r) for r in range(ranks)]
        for engine, pub in zip(engines, pubs, strict=True):
            engine.publish(pub, 4)  # history: each first contact must replay it
        sink = BlockSetSink()
        source = bound_source("w", pubs)
        with Subscriber([source], sink, config=fast(max_replays=1)) as sub:
            for engine, pub in zip(engines, pubs, strict=True):
                engine.publish(pub, 2)
            wait_for(
                lambda: all(settled(sub.status(), "w", r, 6) for r in range(ranks)),
                20,
                "every rank",
            )
            for r, engine in enumerate(engines):
                st = rank_status(sub.status(), "w", r)
                assert st.state is RankState.SYNCED and st.counters.seqs_lost == 0, st
                assert sink.blocks("w", r) == engine.truth
    finally:
        for pub in pubs:
            pub.close(timeout=1.0)


def test_curve_a_key_added_to_the_allow_list_gets_in_without_a_restart(tmp_path: Path) -> None:
    """libzmq gives up on a refused handshake; the subscriber keeps trying, backing off."""
    keys, allow = tmp_path / "keys", tmp_path / "allow"
    _, server_secret = generate_keypair(keys, "server")
    client_public, client_secret = generate_keypair(keys, "client")
    allow.mkdir()
    engine = CurveEngine(ServerKeys(server_secret, allow))
    try:
        engine.publish(3)
        sink = BlockSetSink()
        client = ClientKeys(keys / "server.key", client_secret)
        source = EngineSource("w", engine.endpoint, engine.replay_endpoint, keys=client)
        with Subscriber([source], sink, config=FAST) as sub:
            wait_for(lambda: engine.refusals() >= 2, 10, "refused handshakes")
            assert rank_status(sub.status(), "w", 0).counters.batches == 0
            (allow / "client.key").write_bytes(client_public.read_bytes())
            engine.publish(2)
            wait_for(lambda: settled(sub.status(), "w", 0, 5), 10, "the rank to get in")
            assert rank_status(sub.status(), "w", 0).state is RankState.SYNCED
            assert sink.blocks("w", 0) == engine.engine.truth
    finally:
        engine.close()


# --- settings -------------------------------------------------------------------------


def test_subscriber_config_is_built_and_checked_the_same_from_data_or_code() -> None:
    """msgspec.convert (settings read from a file or the environment) gives the same struct
    and the same refusals as the constructor; the stream's settings nest as ``stream``."""
    cfg = msgspec.convert(
        {"hwm": 5, "max_replays": 2, "stream": {"replay_timeout": 0.25, "idle_probe": None}},
        SubscriberConfig,
    )
    assert cfg == SubscriberConfig(
        hwm=5, max_replays=2, stream=StreamConfig(replay_timeout=0.25, idle_probe=None)
    )
    assert SubscriberConfig().stream == StreamConfig()
    for bad, field in (({"hwm": 0}, "hwm"), ({"probe_rate": 0.0}, "probe_rate")):
        with pytest.raises(ValueError, match=field):
            SubscriberConfig(**bad)  # type: ignore[arg-type]
        with pytest.raises(msgspec.ValidationError, match=field):
            msgspec.convert(bad, SubscriberConfig)
    with pytest.raises(msgspec.ValidationError, match="replay_timeout"):
        msgspec.convert({"stream": {"replay_timeout": 0}}, SubscriberConfig)
    with pytest.raises(TypeError, match="SubscriberConfig"):
        Subscriber([], BlockSetSink(), config=StreamConfig())  # type: ignore[arg-type]
