"""Issue 24 case 5 on the publisher: an engine process serving many ranks' replies leaves its
own threads the GIL: one reply slice at a time in the process, and service threads waiting
on slow clients look less and less often."""

from __future__ import annotations

import threading
import time
from typing import Any

import zmq

from kvwire.publisher import EventPublisher, PublisherConfig
from kvwire.publisher.replay import ReplayServer

from .conftest import EPHEMERAL, wait_for
from .test_replay_bytes import fill, read_snapshot
from .test_replay_limits import N_BATCHES, big_batch, hostile


def server(pub: EventPublisher) -> ReplayServer:
    replay = pub._replay
    assert replay is not None
    return replay


def test_one_reply_slice_at_a_time_in_a_process(zctx: zmq.Context[Any]) -> None:
    config = PublisherConfig(heartbeat_s=None, snapshot_chunk_blocks=256)
    pubs = [EventPublisher(EPHEMERAL, EPHEMERAL, config, rank=r).start() for r in range(3)]
    try:
        truths = [fill(pub, 6_000, seed=r) for r, pub in enumerate(pubs)]
        inside = 0
        most = 0
        slices = 0
        count = threading.Lock()

        def watched(orig: Any) -> Any:
            def serve_slice() -> bool:
                nonlocal inside, most, slices
                with count:
                    inside += 1
                    most = max(most, inside)
                    slices += 1
                try:
                    time.sleep(0.0005)  # widens each slice: overlapping ones would be seen
                    return bool(orig())
                finally:
                    with count:
                        inside -= 1

            return serve_slice

        for pub in pubs:
            replay = server(pub)
            replay._serve = watched(replay._serve)  # type: ignore[method-assign]
        got: list[set[int] | None] = [None] * len(pubs)

        def read(i: int) -> None:
            got[i] = read_snapshot(zctx, pubs[i].bound_replay_endpoint or "")[0]

        readers = [threading.Thread(target=read, args=(i,)) for i in range(len(pubs))]
        for t in readers:
            t.start()
        for t in readers:
            t.join(60)
        assert got == truths  # every snapshot whole
        assert slices > 3 * 24  # 24 chunks each, a slice or more apiece
        assert most == 1, f"{most} ranks' slices ran at once"
    finally:
        for pub in pubs:
            pub.close()


def test_waiting_on_stalled_clients_looks_less_and_less_often(
    ipc_dir: str, zctx: zmq.Context[Any]
) -> None:
    with EventPublisher(
        f"ipc://{ipc_dir}/p",
        f"ipc://{ipc_dir}/r",
        PublisherConfig(buffer_steps=N_BATCHES, max_replay_batches=N_BATCHES, heartbeat_s=None, replay_stall_s=60, snapshot=False),
    ) as pub:  # fmt: skip
        for i in range(N_BATCHES):
            pub.publish(big_batch(i))
        wait_for(lambda: pub.stats().published == N_BATCHES, what="buffer filled")
        replay = server(pub)
        calls = 0
        orig = replay.serve

        def counted() -> bool:
            nonlocal calls
            calls += 1
            return orig()

        replay.serve = counted  # type: ignore[method-assign]
        socks = [hostile(zctx, pub.bound_replay_endpoint or "") for _ in range(4)]
        wait_for(lambda: replay.jobs == 4, what="every job started")
        wait_for(
            lambda: all(job.stalled_since is not None for job in replay._jobs.values()),
            what="every job stalled",
        )
        wait_for(lambda: calls > 10, what="a few looks")  # past the first, quick ones
        c0, t0 = calls, time.monotonic()
        time.sleep(1.0)  # the window measured: every job stalled, none cut (60 s deadline)
        rate = (calls - c0) / (time.monotonic() - t0)
        assert replay.jobs == 4
        # Every 2 ms (with poll's rounding, about 330 a second) before; every 32 ms now.
        assert rate < 60, f"{rate:.0f} looks a second at stalled clients"
        for s in socks:
            s.close(linger=0)
