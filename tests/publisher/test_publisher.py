"""EventPublisher over real sockets: live frames, replay, drops, close."""

from __future__ import annotations

import errno
import logging
import re
import sys
import threading
import time
from typing import Any

import msgspec
import pytest
import zmq

from kvwire.publisher import DEFAULT_ENDPOINT, EventPublisher, PublisherConfig
from kvwire.publisher import publisher as publisher_module
from kvwire.ratelog import RateLimitedLog
from kvwire.security import is_loopback
from kvwire.wire import (
    END_SEQ,
    BlockRemoved,
    BlockStored,
    Dialect,
    EndpointError,
    KVEventBatch,
    ReplayEnd,
    ReplayItem,
    decode_batch,
    encode_batch,
    epoch_topic,
    offset_endpoint,
    pack_seq,
    parse_replay_reply,
    replay_request_frames,
)

from .conftest import EPHEMERAL, connect_sub, recv_live, wait_for


def batch(i: int, rank: int | None = 0) -> KVEventBatch:
    return KVEventBatch(
        float(i),
        [BlockStored([1000 + i], i or None, [i, i + 1], 2), BlockRemoved([2000 + i])],
        rank,
    )


class BlockingBatch:
    """A pending batch whose encoding waits for a gate: a sender stuck mid-batch."""

    def __init__(self, gate: threading.Event, started: threading.Event | None = None) -> None:
        self.gate = gate
        self.started = started

    def encode(self, dialect: Dialect) -> bytes:
        if self.started is not None:
            self.started.set()
        assert self.gate.wait(30)
        return encode_batch(batch(0), dialect=dialect)


class FailingBatch:
    def encode(self, dialect: Dialect) -> bytes:
        raise ValueError("cannot encode this")


def endpoints(kind: str, ipc_dir: str) -> tuple[str, str]:
    """Endpoints to bind: tcp ones take ephemeral ports (the tests use what was bound)."""
    if kind == "tcp":
        return EPHEMERAL, EPHEMERAL
    return f"ipc://{ipc_dir}/pub", f"ipc://{ipc_dir}/replay"


# --- live --------------------------------------------------------------------------


@pytest.mark.parametrize(("kind", "coalesce"), [("tcp", 0.001), ("ipc", 0.0)])
def test_live_frames_and_consecutive_seqs(
    kind: str, coalesce: float, ipc_dir: str, zctx: zmq.Context[Any]
) -> None:
    live, _ = endpoints(kind, ipc_dir)
    with EventPublisher(
        live, config=PublisherConfig(topic="kv", send_coalesce_s=coalesce, heartbeat_s=None)
    ) as pub:
        sub, first = connect_sub(zctx, pub)
        sent = [batch(i) for i in range(50)]
        for b in sent:
            assert pub.publish(b) is True
        for i, b in enumerate(sent):
            msg = recv_live(sub)
            assert msg.topic == epoch_topic(b"kv", pub.epoch)
            assert msg.seq == first + i
            assert msg.payload == encode_batch(b)
            assert decode_batch(msg.payload) == b
    stats = pub.stats()
    assert stats.published == stats.enqueued == first + 50
    assert stats.dropped_queue_full == stats.dropped_send_error == 0


def test_topic_prefix_filtering(ipc_dir: str, zctx: zmq.Context[Any]) -> None:
    with EventPublisher(
        f"ipc://{ipc_dir}/p", config=PublisherConfig(topic="kv-events", heartbeat_s=None)
    ) as pub:
        sub, _ = connect_sub(zctx, pub, topic=b"kv")
        other: zmq.Socket[bytes] = zctx.socket(zmq.SUB)
        other.setsockopt(zmq.SUBSCRIBE, b"other")
        other.connect(pub.bound_endpoint)
        pub.publish(batch(1))
        assert recv_live(sub).topic == epoch_topic(b"kv-events", pub.epoch)
        assert not other.poll(200)


def test_missing_rank_is_filled_and_array_dialect(ipc_dir: str, zctx: zmq.Context[Any]) -> None:
    with EventPublisher(
        f"ipc://{ipc_dir}/p", config=PublisherConfig(dialect="array", heartbeat_s=None), rank=3
    ) as pub:
        assert pub.bound_endpoint == f"ipc://{ipc_dir}/p_dp3"
        sub, _ = connect_sub(zctx, pub)
        pub.publish(batch(7, rank=None))
        msg = recv_live(sub)
        assert msg.payload == encode_batch(batch(7, rank=3), dialect="array")
        assert decode_batch(msg.payload).data_parallel_rank == 3


def test_rank_offsets_tcp_ports() -> None:
    """Rank 2 of 4 binds base + 2 on both sockets.

    The bases are rank 0's ephemeral ports; another process may hold base + 2
    meanwhile, so a refused bind takes new bases, a few times at most.
    """
    for _ in range(20):
        with EventPublisher(EPHEMERAL, EPHEMERAL, PublisherConfig(heartbeat_s=None)) as rank0:
            base, replay = rank0.bound_endpoint, rank0.bound_replay_endpoint
            assert replay is not None
            try:
                pub = EventPublisher(base, replay, PublisherConfig(heartbeat_s=None), rank=2)
                pub.start()
            except EndpointError:  # the two bases less than four ports apart
                continue
            except zmq.ZMQError as exc:
                if exc.errno != errno.EADDRINUSE:
                    raise
                pub.close()
                continue
            with pub:
                assert pub.bound_endpoint == f"tcp://127.0.0.1:{_port(base) + 2}"
                assert pub.bound_replay_endpoint == f"tcp://127.0.0.1:{_port(replay) + 2}"
            return
    raise AssertionError("no bases with base + 2 free in 20 tries")


def _port(endpoint: str) -> int:
    return int(endpoint.rpartition(":")[2])


def test_default_endpoint_is_loopback_only() -> None:
    assert DEFAULT_ENDPOINT == "tcp://127.0.0.1:5557"
    assert EventPublisher().endpoint == DEFAULT_ENDPOINT
    assert is_loopback(DEFAULT_ENDPOINT)
    assert is_loopback("ipc:///tmp/x")
    assert not is_loopback("tcp://*:5557")
    assert not is_loopback("tcp://0.0.0.0:5557")
    assert not is_loopback("tcp://10.1.2.3:5557")


def test_bad_endpoints_and_settings_are_rejected() -> None:
    with pytest.raises(EndpointError, match="both"):
        EventPublisher("tcp://127.0.0.1:6000", "tcp://127.0.0.1:6000")
    with pytest.raises(EndpointError, match="overlap"):
        EventPublisher("tcp://127.0.0.1:6000", "tcp://127.0.0.1:6001", rank=1)
    with pytest.raises(EndpointError, match="scheme"):
        EventPublisher("udp://127.0.0.1:6000")
    with pytest.raises(EndpointError, match="65535"):
        EventPublisher("tcp://127.0.0.1:65535", rank=1)
    with pytest.raises(ValueError, match="max_queue_size"):
        EventPublisher(config=PublisherConfig(max_queue_size=0))
    with pytest.raises(ValueError, match="dialect"):
        EventPublisher(config=PublisherConfig(dialect="json"))  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="coalesce_s"):
        EventPublisher(config=PublisherConfig(send_coalesce_s=-1))


BAD_SETTINGS = [
    ("max_queue_size", 0, "an integer >= 1"),
    ("hwm", 2**31, "an integer from 1 to 2147483647"),
    ("send_coalesce_s", -0.001, "a number from 0 to 60"),
    ("send_coalesce_s", 10**15, "a number from 0 to 60"),
    ("topic", 5, "a string"),
    ("dialect", "json", "one of 'array', 'map'"),
    ("buffer_steps", 0, "an integer >= 1"),
    ("max_replay_batches", 0, "an integer >= 1, or None"),
    ("max_replay_jobs", -1, "an integer >= 1"),
    ("replay_stall_s", 0, "a number > 0"),
    ("max_replay_bytes", 0, "an integer >= 1"),
    ("epoch", 1, "a boolean"),
    ("heartbeat_s", 1e-7, "a number from 0.001 to 3600, or None"),
    ("heartbeat_s", float("nan"), "a number from 0.001 to 3600, or None"),
    ("snapshot", "yes", "a boolean"),
    ("snapshot_chunk_blocks", 0, "an integer >= 1"),
    ("mirror_backlog", 0, "an integer >= 1"),
]


@pytest.mark.parametrize(("field", "bad", "allowed"), BAD_SETTINGS)
def test_a_bad_setting_is_refused_however_the_config_is_made(
    field: str, bad: object, allowed: str
) -> None:
    """One rule per setting: the annotation's range, applied when built and when read."""
    message = f"PublisherConfig.{field}={bad!r} is refused: expected {allowed}"
    with pytest.raises(ValueError, match=re.escape(message)):
        PublisherConfig(**{field: bad})  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=re.escape(message)):
        msgspec.structs.replace(PublisherConfig(), **{field: bad})
    with pytest.raises(msgspec.ValidationError, match=re.escape(f"at `$.{field}`")):
        msgspec.convert({field: bad}, PublisherConfig)


def test_every_setting_has_a_range_checked_and_old_names_are_refused() -> None:
    assert {field for field, _, _ in BAD_SETTINGS} == set(PublisherConfig.__struct_fields__)
    config = msgspec.json.decode(b'{"heartbeat_s": null, "send_coalesce_s": 0}', type=PublisherConfig)
    assert config == PublisherConfig(heartbeat_s=None, send_coalesce_s=0)
    for old in ("heartbeat", "coalesce_s", "clock"):
        with pytest.raises(msgspec.ValidationError, match=f"unknown field `{old}`"):
            msgspec.convert({old: 1}, PublisherConfig)


def test_a_running_publisher_keeps_its_config_in_range(ipc_dir: str) -> None:
    pub = EventPublisher(f"ipc://{ipc_dir}/p", config=PublisherConfig(heartbeat_s=None))
    pub.max_queue_size = 5
    pub.send_coalesce_s = 0.25
    assert pub.config == PublisherConfig(heartbeat_s=None, max_queue_size=5, send_coalesce_s=0.25)
    for name, bad in (("max_queue_size", 0), ("send_coalesce_s", 61.0)):
        with pytest.raises(ValueError, match=f"PublisherConfig.{name}="):
            setattr(pub, name, bad)
    assert (pub.max_queue_size, pub.send_coalesce_s) == (5, 0.25)  # unchanged
    pub.close()


def test_bind_failure_raises_from_start(zctx: zmq.Context[Any]) -> None:
    blocker: zmq.Socket[bytes] = zctx.socket(zmq.PUB)
    blocker.bind(EPHEMERAL)
    pub = EventPublisher(blocker.getsockopt_string(zmq.LAST_ENDPOINT))
    with pytest.raises(zmq.ZMQError):
        pub.start()
    assert pub.close() is True


# --- replay ------------------------------------------------------------------------


def replay_via_dealer(
    ctx: zmq.Context[Any], endpoint: str, start: int, topic: bytes = b""
) -> list[Any]:
    dealer: zmq.Socket[bytes] = ctx.socket(zmq.DEALER)
    dealer.connect(endpoint)
    dealer.send_multipart(replay_request_frames(start))
    out: list[Any] = []
    while True:
        assert dealer.poll(5000), "replay reply stalled"
        frames = dealer.recv_multipart()
        reply = parse_replay_reply(frames)
        out.append(reply)
        if isinstance(reply, ReplayEnd):
            assert frames == [b"", topic, END_SEQ, b""]
            dealer.close(linger=0)
            return out


@pytest.mark.parametrize("kind", ["tcp", "ipc"])
def test_replay_from_dealer(kind: str, ipc_dir: str, zctx: zmq.Context[Any]) -> None:
    live, replay = endpoints(kind, ipc_dir)
    with EventPublisher(live, replay, PublisherConfig(topic="t", heartbeat_s=None)) as pub:
        sent = {pub.last_seq + 1 + i: batch(i) for i in range(20)}
        for b in sent.values():
            pub.publish(b)
        wait_for(lambda: pub.stats().published == 20, what="batches sent")
        topic = epoch_topic(b"t", pub.epoch)
        replies = replay_via_dealer(zctx, pub.bound_replay_endpoint or "", 5, topic)
        items = replies[:-1]
        assert [r.seq for r in items] == list(range(5, 20))
        for r in items:
            assert isinstance(r, ReplayItem)
            assert r.topic == topic
            assert r.payload == encode_batch(sent[r.seq])
        assert isinstance(replies[-1], ReplayEnd)
        wait_for(lambda: pub.stats().replay_served == 1, what="replay counted")


def test_replay_from_req_socket(ipc_dir: str, zctx: zmq.Context[Any]) -> None:
    with EventPublisher(
        f"ipc://{ipc_dir}/p", f"ipc://{ipc_dir}/r", PublisherConfig(heartbeat_s=None)
    ) as pub:
        for i in range(5):
            pub.publish(batch(i))
        wait_for(lambda: pub.stats().published == 5, what="batches sent")
        req: zmq.Socket[bytes] = zctx.socket(zmq.REQ)
        req.connect(pub.bound_replay_endpoint or "")
        req.send(pack_seq(3))  # REQ adds the empty delimiter itself
        assert req.poll(5000)
        topic, seq, payload = req.recv_multipart()  # a REQ reads the first reply only
        assert (topic, seq) == (epoch_topic(b"", pub.epoch), pack_seq(3))
        assert payload == encode_batch(batch(3))


def test_replay_cap_and_buffer_limit(ipc_dir: str, zctx: zmq.Context[Any]) -> None:
    with EventPublisher(
        f"ipc://{ipc_dir}/p",
        f"ipc://{ipc_dir}/r",
        PublisherConfig(buffer_steps=8, max_replay_batches=3, heartbeat_s=None),
    ) as pub:  # fmt: skip
        for i in range(12):
            pub.publish(batch(i))
        wait_for(lambda: pub.stats().published == 12, what="batches sent")
        endpoint = pub.bound_replay_endpoint or ""
        # Asked from 0, but only seqs 4..11 are buffered: it starts later, silently.
        topic = epoch_topic(b"", pub.epoch)
        assert [r.seq for r in replay_via_dealer(zctx, endpoint, 0, topic)[:-1]] == [4, 5, 6]
        assert [r.seq for r in replay_via_dealer(zctx, endpoint, 10, topic)[:-1]] == [10, 11]
        assert replay_via_dealer(zctx, endpoint, 50, topic) == [ReplayEnd(topic)]
        wait_for(lambda: pub.stats().replay_served == 3, what="replays counted")


def test_malformed_replay_requests_are_counted_and_ignored(
    ipc_dir: str, zctx: zmq.Context[Any]
) -> None:
    with EventPublisher(
        f"ipc://{ipc_dir}/p", f"ipc://{ipc_dir}/r", PublisherConfig(heartbeat_s=None)
    ) as pub:
        pub.publish(batch(0))
        wait_for(lambda: pub.stats().published == 1, what="the batch in the replay ring")
        dealer: zmq.Socket[bytes] = zctx.socket(zmq.DEALER)
        dealer.connect(pub.bound_replay_endpoint or "")
        dealer.send_multipart([b"", b"short"])
        dealer.send_multipart([b"no delimiter", pack_seq(0)])
        dealer.send_multipart([b"", END_SEQ])
        dealer.send_multipart([b"", pack_seq(0), b"extra"])
        wait_for(lambda: pub.stats().replay_invalid == 4, what="invalid requests counted")
        dealer.send_multipart(replay_request_frames(0))  # still serves a good one
        first = parse_replay_reply(dealer.recv_multipart())
        assert isinstance(first, ReplayItem) and first.seq == 0
        assert isinstance(parse_replay_reply(dealer.recv_multipart()), ReplayEnd)
        assert not dealer.poll(100)  # nothing was sent for the bad ones
        assert pub.stats().replay_invalid == 4


def test_replay_does_not_starve_live(ipc_dir: str, zctx: zmq.Context[Any]) -> None:
    n = 5_000
    with EventPublisher(
        f"ipc://{ipc_dir}/p",
        f"ipc://{ipc_dir}/r",
        PublisherConfig(buffer_steps=2 * n, max_replay_batches=2 * n, heartbeat_s=None),
    ) as pub:  # fmt: skip
        sub, first = connect_sub(zctx, pub)
        for i in range(n):
            pub.publish(batch(i))
        while recv_live(sub).seq < first + n - 1:  # the backlog, live
            pass
        dealer: zmq.Socket[bytes] = zctx.socket(zmq.DEALER)
        dealer.connect(pub.bound_replay_endpoint or "")
        dealer.send_multipart(replay_request_frames(0))
        assert dealer.poll(5000)  # the replay is under way
        marker = batch(999_999)
        pub.publish(marker)
        msg = recv_live(sub)
        assert msg.payload == encode_batch(marker)
        # The live batch went out while thousands of replay messages were still to go.
        assert pub.stats().replay_served == 0
        seqs = []
        while not isinstance(reply := parse_replay_reply(dealer.recv_multipart()), ReplayEnd):
            seqs.append(reply.seq)
        # Everything buffered, the marker included: it was sent before the replay ended.
        assert seqs == list(range(0, first + n + 1))


# --- drops, blocking, close --------------------------------------------------------


def test_queue_full_drops_are_counted_leave_gaps_and_never_block(
    ipc_dir: str, zctx: zmq.Context[Any], caplog: pytest.LogCaptureFixture
) -> None:
    gate = threading.Event()
    started = threading.Event()
    with EventPublisher(
        f"ipc://{ipc_dir}/p", config=PublisherConfig(max_queue_size=4, heartbeat_s=None)
    ) as pub:
        sub, first = connect_sub(zctx, pub)
        assert pub.publish(BlockingBatch(gate, started))  # seq first: the sender takes it
        assert started.wait(5)
        results = []
        t0 = time.perf_counter()
        for i in range(10):  # seqs first+1 .. first+10
            results.append(pub.publish(batch(i)))
        elapsed = time.perf_counter() - t0
        assert results == [True] * 4 + [False] * 6
        assert elapsed < 0.5  # never waits for the stuck sender
        assert pub.stats().dropped_queue_full == 6
        caplog.set_level(logging.WARNING, logger="kvwire.publisher.publisher")
        gate.set()
        seqs = [recv_live(sub).seq for _ in range(5)]
        assert seqs == [first, first + 1, first + 2, first + 3, first + 4]
        pub.publish(batch(99))
        assert recv_live(sub).seq == first + 11  # the six dropped seqs are a visible gap
    # logged once, with the count, by the service thread's next round (at the latest on close)
    full_logs = [r for r in caplog.records if "queue was full" in r.message]
    assert len(full_logs) == 1 and "6 batches dropped" in full_logs[0].message


def test_queue_bound_and_coalescing_changed_on_a_running_publisher(
    ipc_dir: str, zctx: zmq.Context[Any]
) -> None:
    """An operator's change reaches the sender thread: a bound of one and a 0.3 s wait
    after each wake-up make the second of two batches in a row find the first queued."""
    with EventPublisher(
        f"ipc://{ipc_dir}/p", config=PublisherConfig(heartbeat_s=None, send_coalesce_s=0)
    ) as pub:
        sub, first = connect_sub(zctx, pub)
        pub.max_queue_size = 1
        pub.send_coalesce_s = 0.3
        assert (pub.max_queue_size, pub.send_coalesce_s) == (1, 0.3)
        wait_for(lambda: pub.queue_depth == 0, what="an idle sender")
        t0 = time.monotonic()
        assert pub.publish(batch(1))
        assert not pub.publish(batch(2))  # the first still waits out the 0.3 s
        assert pub.stats().dropped_queue_full == 1
        assert recv_live(sub).seq == first
        assert time.monotonic() - t0 >= 0.25  # sent after the new wait, not at once
        pub.send_coalesce_s = 0
        pub.max_queue_size = 100
        assert pub.publish(batch(3))
        assert recv_live(sub).seq == first + 2  # seq first + 1 is the visible gap
        with pytest.raises(ValueError, match="coalesce_s"):
            pub.send_coalesce_s = -1


def test_publish_stays_fast_while_the_only_subscriber_is_stalled(
    ipc_dir: str, zctx: zmq.Context[Any]
) -> None:
    big = KVEventBatch(0.0, [BlockStored(list(range(256)), None, list(range(4096)), 16)], 0)
    with EventPublisher(
        f"ipc://{ipc_dir}/p", config=PublisherConfig(hwm=10, heartbeat_s=None)
    ) as pub:
        sub, first = connect_sub(zctx, pub, RCVHWM=10, RCVBUF=4096)
        worst = 0.0
        for _ in range(3000):  # the subscriber reads nothing meanwhile
            t0 = time.perf_counter()
            assert pub.publish(big)
            worst = max(worst, time.perf_counter() - t0)
        wait_for(lambda: pub.stats().published == pub.stats().enqueued, what="all sent")
        assert worst < 0.05
        seqs = []
        while sub.poll(300):
            seqs.append(recv_live(sub).seq)
        pub.publish(big)
        seqs.append(recv_live(sub).seq)
        assert seqs[0] == first and seqs[-1] == first + 3000
        assert seqs == sorted(set(seqs))
        # What did not fit the high-water marks was dropped inside ZeroMQ: gaps.
        assert len(seqs) < 3001


def test_encode_errors_are_counted_and_leave_a_gap(
    ipc_dir: str,
    zctx: zmq.Context[Any],
    caplog: pytest.LogCaptureFixture,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # The process's publishers share one rate-limited log (a fresh one here: no other
    # test's notes in it).
    monkeypatch.setattr(publisher_module, "_PROBLEMS", RateLimitedLog(publisher_module.log, 10.0))
    logs = caplog.at_level(logging.WARNING, logger="kvwire.publisher.publisher")
    quiet = PublisherConfig(heartbeat_s=None)
    with (
        logs,
        EventPublisher(f"ipc://{ipc_dir}/p0", config=quiet, rank=0) as pub0,
        EventPublisher(f"ipc://{ipc_dir}/p1", config=quiet, rank=1) as pub1,
    ):
        sub, first = connect_sub(zctx, pub0)
        for _ in range(3):
            pub0.publish(FailingBatch())
        pub0.publish(batch(1))
        assert recv_live(sub).seq == first + 3
        assert pub0.stats().dropped_encode_error == 3
        pub1.publish(FailingBatch())
        wait_for(lambda: pub1.stats().dropped_encode_error == 1, what="rank 1's failed encode")
    # The first is logged at once; the repeats, the other rank's too, in one line (at the
    # latest on close).
    lines = [r.getMessage() for r in caplog.records if "could not be encoded" in r.getMessage()]
    assert lines == [
        "rank 0: a batch could not be encoded: cannot encode this",
        "a batch could not be encoded: cannot encode this "
        "(3 times since the last report, from 2: rank 0, rank 1)",
    ]


def test_skip_leaves_a_gap_that_replay_cannot_fill(ipc_dir: str, zctx: zmq.Context[Any]) -> None:
    with EventPublisher(
        f"ipc://{ipc_dir}/p", f"ipc://{ipc_dir}/r", PublisherConfig(heartbeat_s=0.2)
    ) as pub:
        sub, _ = connect_sub(zctx, pub)
        assert pub.publish(batch(1))
        assert pub.skip()
        # Nothing is published after the gap: the next heartbeat shows it. (Heartbeats may
        # come before the batch too: read until the seqs have a hole.)
        seqs: dict[int, bool] = {}  # seq -> carries events
        while not seqs or len(seqs) == max(seqs) - min(seqs) + 1:
            msg = recv_live(sub)
            seqs[msg.seq] = bool(decode_batch(msg.payload).events)
        (hole,) = set(range(min(seqs), max(seqs) + 1)) - set(seqs)
        assert seqs[hole - 1] and not seqs[hole + 1]  # the batch, the gap, a heartbeat
        assert pub.publish(batch(2))
        msg = recv_live(sub)
        while not decode_batch(msg.payload).events:
            msg = recv_live(sub)
        assert msg.seq > hole + 1
        stats = pub.stats()
        assert (stats.skipped, stats.dropped_encode_error) == (1, 0)
        assert hole not in pub.replayable_seqs()
        assert {hole - 1, hole + 1, msg.seq} <= set(pub.replayable_seqs())
        # The snapshot mirror cannot vouch for a state with a batch missing.
        wait_for(lambda: pub.stats().mirror_pending == 0, what="mirror caught up")
        assert pub._mirror is not None and pub._mirror.distrust_reason is not None


def test_close_flushes_then_refuses(ipc_dir: str, zctx: zmq.Context[Any]) -> None:
    pub = EventPublisher(
        f"ipc://{ipc_dir}/p", config=PublisherConfig(buffer_steps=5, heartbeat_s=None)
    )
    pub.start()
    sub, first = connect_sub(zctx, pub)
    for i in range(200):
        pub.publish(batch(i))
    assert pub.close(timeout=5) is True
    seqs = [recv_live(sub).seq for _ in range(200)]
    assert seqs == list(range(first, first + 200))
    assert pub.publish(batch(0)) is False
    stats = pub.stats()
    assert stats.dropped_closed == 1 and stats.published == first + 200
    assert pub.close() is True  # idempotent
    with pytest.raises(RuntimeError, match="closed"):
        pub.start()


def test_close_is_bounded_when_the_sender_is_stuck(ipc_dir: str) -> None:
    gate = threading.Event()
    started = threading.Event()
    pub = EventPublisher(f"ipc://{ipc_dir}/p", config=PublisherConfig(heartbeat_s=None)).start()
    pub.publish(BlockingBatch(gate, started))
    assert started.wait(5)
    pub.publish(batch(1))
    t0 = time.monotonic()
    flushed = pub.close(timeout=0.3)
    assert time.monotonic() - t0 < 3.0
    assert flushed is False
    gate.set()  # let the thread finish; the batch left behind is counted
    wait_for(lambda: pub.stats().dropped_closed == 1, what="leftover counted")


def test_unstarted_publisher_close_and_context_manager(ipc_dir: str) -> None:
    pub = EventPublisher(f"ipc://{ipc_dir}/p")
    assert pub.publish(batch(0)) is True  # queued before start
    assert pub.close() is False  # never started: the queued batch is lost
    with EventPublisher(f"ipc://{ipc_dir}/q") as pub2:
        assert pub2.bound_endpoint.startswith("ipc://")
    assert pub2.publish(batch(0)) is False


def test_max_queue_size_can_change_at_run_time(ipc_dir: str) -> None:
    pub = EventPublisher(f"ipc://{ipc_dir}/p", config=PublisherConfig(max_queue_size=10))
    pub.max_queue_size = 2
    assert [pub.publish(batch(i)) for i in range(3)] == [True, True, False]
    with pytest.raises(ValueError):
        pub.max_queue_size = 0
    pub.close()


def test_stats_is_a_consistent_snapshot() -> None:
    pub = EventPublisher("ipc:///nonexistent-dir-kvwire/p")  # never started
    for i in range(3):
        pub.publish(batch(i))
    s = pub.stats()
    assert (s.enqueued, s.queue_depth, s.last_seq) == (3, 3, 2)
    assert set(s.as_dict()) >= {
        "enqueued",
        "published",
        "dropped_queue_full",
        "dropped_send_error",
        "replay_served",
        "replay_invalid",
    }
    assert msgspec.json.decode(msgspec.json.encode(s.as_dict()))["enqueued"] == 3
    pub.close()


# --- several publishing threads, ephemeral ports -------------------------------------


def test_publish_from_several_threads_keeps_seq_order(ipc_dir: str, zctx: zmq.Context[Any]) -> None:
    n, threads = 20_000, 4
    old = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # switch threads as often as possible
    try:
        pub = EventPublisher(
            f"ipc://{ipc_dir}/p",
            config=PublisherConfig(max_queue_size=n * threads, heartbeat_s=None),
        )
        item = batch(1)
        go = threading.Event()

        def engine() -> None:
            go.wait()
            for _ in range(n):
                pub.publish(item)

        workers = [threading.Thread(target=engine) for _ in range(threads)]
        for w in workers:
            w.start()
        go.set()
        for w in workers:
            w.join()
    finally:
        sys.setswitchinterval(old)
    seqs = pub._sender.seqs(False)
    assert seqs == list(range(n * threads))  # queue order is seq order
    pub.close()


def test_several_threads_on_the_wire_and_in_the_replay_buffer(
    ipc_dir: str, zctx: zmq.Context[Any]
) -> None:
    n, threads = 5_000, 3
    with EventPublisher(
        f"ipc://{ipc_dir}/p",
        f"ipc://{ipc_dir}/r",
        PublisherConfig(buffer_steps=n * threads + 100, heartbeat_s=None),
    ) as pub:
        sub, first = connect_sub(zctx, pub)
        workers = [
            threading.Thread(target=lambda: [pub.publish(batch(1)) for _ in range(n)])
            for _ in range(threads)
        ]
        for w in workers:
            w.start()
        for w in workers:
            w.join()
        seqs = [recv_live(sub).seq for _ in range(n * threads)]
        assert seqs == list(range(first, first + n * threads))
        wait_for(lambda: pub.stats().published == first + n * threads, what="all sent")
        replayed = pub.replayable_seqs()
        assert replayed == list(range(first + n * threads))


def test_ephemeral_ports_for_every_rank(zctx: zmq.Context[Any]) -> None:
    assert offset_endpoint("tcp://127.0.0.1:*", 3) == "tcp://127.0.0.1:*"
    pubs = [
        EventPublisher(
            "tcp://127.0.0.1:*", "tcp://127.0.0.1:*", PublisherConfig(heartbeat_s=None), rank=r
        ).start()
        for r in range(4)
    ]
    try:
        bound = [p.bound_endpoint for p in pubs] + [p.bound_replay_endpoint or "" for p in pubs]
        assert len(set(bound)) == 8
        assert all(b.startswith("tcp://127.0.0.1:") and not b.endswith("*") for b in bound)
        sub, _ = connect_sub(zctx, pubs[3])
        pubs[3].publish(batch(5, rank=None))
        assert decode_batch(recv_live(sub).payload).data_parallel_rank == 3
    finally:
        for p in pubs:
            p.close()
