"""Issue 12 rows 7 and 10 on the publisher: hostile replay clients, bind warnings, size limits."""

from __future__ import annotations

import logging
import os
import time
from typing import Any

import pytest
import zmq

from kvwire.publisher import EventPublisher, PublisherConfig
from kvwire.wire import (
    BlockStored,
    KVEventBatch,
    ReplayEnd,
    parse_replay_reply,
    replay_request_frames,
)

from .conftest import wait_for

N_BATCHES = 2_000


def big_batch(i: int) -> KVEventBatch:
    """About 4 KB on the wire."""
    return KVEventBatch(float(i), [BlockStored(list(range(64)), None, [70_000] * 1024, 16)], 0)


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096


def hostile(ctx: zmq.Context[Any], endpoint: str) -> zmq.Socket[bytes]:
    """A DEALER that asks for everything and never reads."""
    sock: zmq.Socket[bytes] = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.RCVHWM, 1)
    sock.setsockopt(zmq.RCVBUF, 4096)
    sock.connect(endpoint)
    sock.send_multipart(replay_request_frames(0))
    return sock


def legit_replay(ctx: zmq.Context[Any], endpoint: str, deadline_s: float) -> list[int]:
    sock: zmq.Socket[bytes] = ctx.socket(zmq.DEALER)
    sock.connect(endpoint)
    sock.send_multipart(replay_request_frames(0))
    seqs = []
    end = time.monotonic() + deadline_s
    while True:
        left = end - time.monotonic()
        assert left > 0 and sock.poll(int(left * 1000)), "the legitimate replay was not served"
        reply = parse_replay_reply(sock.recv_multipart())
        if isinstance(reply, ReplayEnd):
            sock.close(linger=0)
            return seqs
        seqs.append(reply.seq)


def test_never_reading_clients_share_the_buffer_and_cannot_starve_a_subscriber(
    ipc_dir: str, zctx: zmq.Context[Any]
) -> None:
    with EventPublisher(
        f"ipc://{ipc_dir}/p",
        f"ipc://{ipc_dir}/r",
        PublisherConfig(buffer_steps=N_BATCHES, max_replay_batches=N_BATCHES, heartbeat_s=None, replay_stall_s=0.5),
    ) as pub:  # fmt: skip
        for i in range(N_BATCHES):
            pub.publish(big_batch(i))
        wait_for(lambda: pub.stats().published == N_BATCHES, what="buffer filled")
        endpoint = pub.bound_replay_endpoint or ""
        before = rss_bytes()
        socks = [hostile(zctx, endpoint) for _ in range(64)]
        for s in socks[:8]:  # the same identities asking again replace their own jobs
            for _ in range(5):
                s.send_multipart(replay_request_frames(0))
        replay = pub._replay
        assert replay is not None
        peak_jobs = 0
        end = time.monotonic() + 3
        while time.monotonic() < end:
            peak_jobs = max(peak_jobs, replay.jobs)
            time.sleep(0.01)
        grown = rss_bytes() - before
        # One copy of the buffer is 8 MB; 64 readers each holding one used to cost 512 MB.
        assert grown < 48 * 2**20, f"publisher grew {grown / 2**20:.0f} MB for 64 stalled readers"
        assert peak_jobs <= 64
        t0 = time.monotonic()
        assert legit_replay(zctx, endpoint, deadline_s=10.0) == list(range(N_BATCHES))
        served_in = time.monotonic() - t0
        assert served_in < 10.0
        wait_for(lambda: pub.stats().replay_dropped >= 1, what="stalled readers cut off")
        for s in socks:
            s.close(linger=0)


def test_a_full_house_of_stalled_jobs_admits_a_new_client(
    ipc_dir: str, zctx: zmq.Context[Any]
) -> None:
    with EventPublisher(
        f"ipc://{ipc_dir}/p",
        f"ipc://{ipc_dir}/r",
        PublisherConfig(buffer_steps=N_BATCHES, max_replay_batches=N_BATCHES, heartbeat_s=None, max_replay_jobs=4, replay_stall_s=30),
    ) as pub:  # fmt: skip
        for i in range(N_BATCHES):
            pub.publish(big_batch(i))
        wait_for(lambda: pub.stats().published == N_BATCHES, what="buffer filled")
        endpoint = pub.bound_replay_endpoint or ""
        socks = [hostile(zctx, endpoint) for _ in range(4)]
        replay = pub._replay
        assert replay is not None
        wait_for(lambda: replay.jobs == 4, what="every slot taken")
        wait_for(  # their clients read nothing: every job stalls (the deadline itself is 30 s)
            lambda: all(job.stalled_since is not None for job in replay._jobs.values()),
            what="every job stalled",
        )
        # Not cut off by the deadline, but evicted, the longest stalled first, to admit it.
        assert legit_replay(zctx, endpoint, deadline_s=10.0) == list(range(N_BATCHES))
        for s in socks:
            s.close(linger=0)


def test_every_socket_bound_beyond_loopback_warns(caplog: pytest.LogCaptureFixture) -> None:
    with (
        caplog.at_level(logging.WARNING, logger="kvwire.publisher.publisher"),
        EventPublisher("tcp://*:*", "tcp://*:*", PublisherConfig(heartbeat_s=None)),
    ):
        pass
    messages = [r.getMessage() for r in caplog.records]
    assert any("PUB socket" in m and "WITHOUT authentication" in m for m in messages)
    assert any("replay socket" in m and "WITHOUT authentication" in m for m in messages)
    caplog.clear()
    with (
        caplog.at_level(logging.WARNING, logger="kvwire.publisher.publisher"),
        EventPublisher("tcp://127.0.0.1:*", "tcp://127.0.0.1:*", PublisherConfig(heartbeat_s=None)),
    ):
        pass
    assert not caplog.records


def test_oversized_replay_requests_are_refused_by_the_socket(
    ipc_dir: str, zctx: zmq.Context[Any]
) -> None:
    with EventPublisher(
        f"ipc://{ipc_dir}/p", f"ipc://{ipc_dir}/r", PublisherConfig(heartbeat_s=None)
    ) as pub:
        pub.publish(big_batch(0))
        wait_for(lambda: pub.stats().published == 1, what="sent")
        junk: zmq.Socket[bytes] = zctx.socket(zmq.DEALER)
        junk.connect(pub.bound_replay_endpoint or "")
        junk.send_multipart([b"", b"x" * 100_000])  # over MAXMSGSIZE: the peer is dropped
        assert legit_replay(zctx, pub.bound_replay_endpoint or "", deadline_s=5.0) == [0]
        assert pub.stats().replay_invalid == 0  # never even read


def test_a_clients_new_request_replaces_its_old_job(ipc_dir: str, zctx: zmq.Context[Any]) -> None:
    with EventPublisher(
        f"ipc://{ipc_dir}/p",
        f"ipc://{ipc_dir}/r",
        PublisherConfig(buffer_steps=N_BATCHES, max_replay_batches=N_BATCHES, heartbeat_s=None, replay_stall_s=30),
    ) as pub:  # fmt: skip
        for i in range(N_BATCHES):
            pub.publish(big_batch(i))
        wait_for(lambda: pub.stats().published == N_BATCHES, what="buffer filled")
        sock = hostile(zctx, pub.bound_replay_endpoint or "")  # asks once, reads nothing
        replay = pub._replay
        assert replay is not None
        wait_for(lambda: replay.jobs == 1, what="the first job")
        for _ in range(9):
            sock.send_multipart(replay_request_frames(0))
        wait_for(lambda: replay.requests == 10, what="every request read")
        assert replay.jobs == 1
        ends = items = 0
        while sock.poll(2000):
            reply = parse_replay_reply(sock.recv_multipart())
            if isinstance(reply, ReplayEnd):
                ends += 1
                if items >= N_BATCHES:
                    break
            else:
                items += 1
        assert ends == 1  # the nine earlier jobs were replaced, never finished
        wait_for(lambda: replay.jobs == 0, what="the job to finish")


def thread_cpu_s(native_id: int) -> float:
    """CPU seconds a thread of this process has used (from /proc)."""
    with open(f"/proc/self/task/{native_id}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def test_stalled_clients_do_not_keep_the_replay_thread_busy(ipc_dir: str, zctx: zmq.Context[Any]) -> None:
    with EventPublisher(
        f"ipc://{ipc_dir}/p",
        f"ipc://{ipc_dir}/r",
        PublisherConfig(buffer_steps=N_BATCHES, max_replay_batches=N_BATCHES, heartbeat_s=None, replay_stall_s=60),
    ) as pub:  # fmt: skip
        for i in range(N_BATCHES):
            pub.publish(big_batch(i))
        wait_for(lambda: pub.stats().published == N_BATCHES, what="buffer filled")
        socks = [hostile(zctx, pub.bound_replay_endpoint or "") for _ in range(16)]
        replay = pub._replay
        assert replay is not None and pub._service is not None
        wait_for(lambda: replay.jobs == 16, what="every job started")
        sender = pub._service.native_id
        assert sender is not None
        wait_for(  # their pipes fill up
            lambda: all(job.stalled_since is not None for job in replay._jobs.values()),
            what="every job stalled",
        )
        cpu0, t0 = thread_cpu_s(sender), time.monotonic()
        time.sleep(1.0)  # the window measured: every job stalled, none cut (60 s deadline)
        used = (thread_cpu_s(sender) - cpu0) / (time.monotonic() - t0)
        assert replay.jobs == 16
        assert used < 0.3, f"the replay thread used {used:.0%} of a core on stalled clients"
        for s in socks:
            s.close(linger=0)
