"""The Subscriber against the real EventPublisher: tcp and ipc, ranks, faults, shutdown."""

from __future__ import annotations

import asyncio
import builtins
import contextlib
import errno
import functools
import json
import logging
import os
import re
import select
import selectors
import signal
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import zmq.asyncio

from kvwire._native import libzmq_path
from kvwire.prefix_index import PrefixIndex
from kvwire.publisher import EventPublisher, PublisherConfig
from kvwire.subscriber import (
    Applied,
    BlockSetSink,
    Cleared,
    EngineSource,
    RankState,
    StreamConfig,
    Subscriber,
    receive,
)
from kvwire.wire import EndpointError, KVEventBatch
from tests.subscriber.helpers import (
    EPHEMERAL,
    FAST,
    Engine,
    bound_source,
    fast,
    ipc_endpoints,
    rank_status,
    settled,
    streams,
)
from tests.waiting import await_for, wait_for

ROOT = Path(__file__).resolve().parents[2]

# Batches (of 64 blocks, ~1.2 kB) sent while the reader stalls: well beyond what
# the high-water marks and the kernel's socket buffers hold (tcp's grow large).
STALL_BATCHES = {"tcp": 6000, "ipc": 2000}


@contextlib.contextmanager
def endpoints(transport: str, ranks: int) -> Iterator[tuple[str, str]]:
    """Base endpoints to bind: every tcp rank takes an ephemeral port, ipc ranks their offsets."""
    if transport == "tcp":
        yield EPHEMERAL, EPHEMERAL
    else:
        with ipc_endpoints() as eps:
            yield eps


@contextlib.contextmanager
def publishers(ep: str, rep: str | None, ranks: int, **kw: Any) -> Iterator[list[EventPublisher]]:
    # The engines' wire: no epoch, heartbeat or snapshot (these tests count seqs exactly).
    config = PublisherConfig(**{"epoch": False, "heartbeat_s": None, "snapshot": False, **kw})
    pubs = [EventPublisher(ep, rep, config, rank=r).start() for r in range(ranks)]
    try:
        yield pubs
    finally:
        for p in pubs:
            p.close(timeout=1.0)


class GatedSink(BlockSetSink):
    """A sink that can be paused: apply blocks (the subscriber's reader stalls) until opened."""

    def __init__(self) -> None:
        super().__init__()
        self.open = threading.Event()
        self.open.set()
        self.blocked = threading.Event()

    def apply(self, worker_id: str, rank: int, batch: KVEventBatch) -> None:
        if not self.open.is_set():
            self.blocked.set()
            self.open.wait(10.0)
        super().apply(worker_id, rank, batch)


class CountingIndex(PrefixIndex):
    """A prefix index that counts how each batch reached it."""

    def __init__(self) -> None:
        super().__init__(4)
        self.as_batch = self.as_bytes = 0
        self._in_payload = False  # (apply_payload may decode and apply itself)

    def apply(self, worker_id: str, rank: int, batch: KVEventBatch) -> None:
        self.as_batch += not self._in_payload
        super().apply(worker_id, rank, batch)

    def apply_payload(self, worker_id: str, rank: int, payload: Any, limits: Any = None) -> None:
        assert limits is FAST.stream.decode_limits, "the stream's own limits"
        self.as_bytes += 1
        self._in_payload = True
        try:
            super().apply_payload(worker_id, rank, payload, limits)
        finally:
            self._in_payload = False


def test_a_prefix_index_sink_gets_payload_bytes_and_ends_exact() -> None:
    with publishers(EPHEMERAL, EPHEMERAL, 2) as pubs:
        engines = [Engine(seed=40 + r, rank=r) for r in range(2)]
        for engine, pub in zip(engines, pubs, strict=True):
            engine.publish(pub, 10)  # replayed on first contact
        index = CountingIndex()
        with Subscriber([bound_source("w", pubs)], index, config=FAST) as sub:
            for engine, pub in zip(engines, pubs, strict=True):
                engine.publish(pub, 30)
            wait_for(
                lambda: all(settled(sub.status(), "w", r, 40) for r in range(2)),
                10,
                "both ranks to apply 40 batches",
            )
            for r, engine in enumerate(engines):
                assert rank_status(sub.status(), "w", r).state is RankState.SYNCED
                assert index.blocks("w", r) == engine.truth
        # Every batch as bytes: replayed and live, none decoded on the way.
        assert (index.as_batch, index.as_bytes) == (0, 80)


def _hide_the_linux_paths(
    monkeypatch: pytest.MonkeyPatch, selector: type[selectors.BaseSelector]
) -> None:
    """As on a platform without them: no epoll, no /proc/self/maps, no native receive;
    ``selector`` is the platform's default, the one its event loops use."""
    real_open = builtins.open

    def without_maps(file: Any, *args: Any, **kw: Any) -> Any:
        if file == "/proc/self/maps":
            raise FileNotFoundError(errno.ENOENT, "hidden by the test", file)
        return real_open(file, *args, **kw)

    monkeypatch.delattr(select, "epoll", raising=False)
    monkeypatch.setattr(selectors, "DefaultSelector", selector)
    monkeypatch.setattr(builtins, "open", without_maps)
    monkeypatch.setitem(sys.modules, "kvwire.subscriber._recv", None)  # import fails
    libzmq_path.cache_clear()
    receive.load.cache_clear()


@pytest.mark.parametrize(
    "selector",
    # The loop's selector: EpollSelector keeps its own reference to epoll and stands
    # for kqueue (BSD, macOS), SelectSelector for the rest.
    [selectors.EpollSelector, selectors.SelectSelector],
    ids=["kqueue-like-loop", "select-loop"],
)
def test_without_epoll_proc_maps_or_the_native_receive_a_publisher_is_followed_exactly(
    monkeypatch: pytest.MonkeyPatch, selector: type[selectors.BaseSelector]
) -> None:
    """The portable path: another selector and pyzmq's reads follow kvwire publishers exactly.

    The publishers (in this process, with their native senders) start first; then
    the three are hidden, and the subscriber runs on a loop without epoll through
    pyzmq's receive, across history replayed at first contact, live batches,
    heartbeats and a clear, to an index equal to every engine's truth.
    """
    kw = {"epoch": True, "heartbeat_s": 0.2, "snapshot": True}
    with publishers(EPHEMERAL, EPHEMERAL, 2, **kw) as pubs:
        engines = [Engine(seed=60 + r, rank=r) for r in range(2)]
        for engine, pub in zip(engines, pubs, strict=True):
            engine.publish(pub, 10)  # replayed on first contact
        _hide_the_linux_paths(monkeypatch, selector)
        try:
            with pytest.raises(RuntimeError, match="/proc/self/maps"):
                libzmq_path()
            assert receive.load() is receive.PORTABLE

            async def follow() -> PrefixIndex:
                loop = asyncio.get_running_loop()
                assert isinstance(loop, asyncio.SelectorEventLoop)
                index = PrefixIndex(4)
                async with Subscriber([bound_source("w", pubs)], index, config=FAST) as sub:
                    for engine, pub in zip(engines, pubs, strict=True):
                        engine.publish(pub, 20)
                    engines[0].publish(pubs[0], 1, clear=True)
                    engines[0].publish(pubs[0], 5)
                    await await_for(
                        lambda: all(
                            sub.rank_state("w", r) is RankState.SYNCED
                            and index.blocks("w", r) == engine.truth
                            for r, engine in enumerate(engines)
                        ),
                        20,
                        "both ranks to apply every batch",
                    )
                    # Heartbeats (each on the next seq) go on meanwhile: read, in sequence.
                    await await_for(
                        lambda: all(s.expected_seq > 40 for s in sub.status()), 10, "heartbeats"
                    )
                    for st in sub.status():
                        assert st.state is RankState.SYNCED, st
                        assert st.counters.seqs_lost == st.counters.decode_errors == 0, st
                return index

            def loop() -> asyncio.AbstractEventLoop:
                return asyncio.SelectorEventLoop(selector())

            with asyncio.Runner(loop_factory=loop) as runner:
                index = runner.run(follow())
        finally:
            libzmq_path.cache_clear()
            receive.load.cache_clear()
        for r, engine in enumerate(engines):
            assert index.blocks("w", r) == engine.truth


def test_a_fleet_going_away_is_one_line_and_a_summary(caplog: pytest.LogCaptureFixture) -> None:
    """Every rank losing its publisher at once logs its first rank, then one summary."""
    ranks = 8
    with publishers(EPHEMERAL, EPHEMERAL, ranks) as pubs:
        for r, pub in enumerate(pubs):
            Engine(seed=70 + r, rank=r).publish(pub, 2)
        with (
            caplog.at_level(logging.INFO, "kvwire.subscriber"),
            Subscriber([bound_source("w", pubs)], BlockSetSink(), config=FAST) as sub,
        ):
            wait_for(
                lambda: all(settled(sub.status(), "w", r, 2) for r in range(ranks)),
                10,
                "every rank",
            )
            for pub in pubs:
                pub.close(timeout=1.0)
            wait_for(
                lambda: not any(st.connected for st in sub.status()),
                10,
                "every rank to see its publisher go",
            )
        # The subscriber has stopped: what it held is summarised.
    messages = [r.getMessage() for r in caplog.records]
    gone = [m for m in messages if "disconnected from the publisher" in m]

    def ranks_in(line: str) -> int:
        m = re.search(r"\((once|\d+ times) since the last report", line)
        return 1 if m is None or m[1] == "once" else int(m[1].split()[0])

    assert 1 <= len(gone) <= 2, gone  # the first at once (unless one was logged just before)
    assert sum(ranks_in(line) for line in gone) == ranks, gone
    assert f"from {ranks - len(gone) + 1}: worker w rank" in gone[-1], gone


@pytest.mark.parametrize("transport", ["tcp", "ipc"])
def test_several_ranks_late_join_and_follow_exactly(transport: str) -> None:
    ranks = 3
    with endpoints(transport, ranks) as (ep, rep), publishers(ep, rep, ranks) as pubs:
        engines = [Engine(seed=10 + r, rank=r) for r in range(ranks)]
        for engine, pub in zip(engines, pubs, strict=True):
            engine.publish(pub, 20)  # before the subscriber exists: replayed on first contact
        sink = BlockSetSink()
        # ipc: the base endpoints (rank r at its offset); tcp: the port each rank bound.
        source = EngineSource("w", ep, rep, ranks) if transport == "ipc" else bound_source("w", pubs)
        with Subscriber([source], sink, config=FAST) as sub:
            for engine, pub in zip(engines, pubs, strict=True):
                engine.publish(pub, 30)
            wait_for(
                lambda: all(settled(sub.status(), "w", r, 50) for r in range(ranks)),
                10,
                "every rank to apply 50 batches",
            )
            for r, engine in enumerate(engines):
                st = rank_status(sub.status(), "w", r)
                assert st.state is RankState.SYNCED, st
                assert sink.blocks("w", r) == engine.truth
                c = st.counters
                assert (c.batches, c.seqs_lost, c.rank_mismatches, c.decode_errors) == (
                    50,
                    0,
                    0,
                    0,
                )
                assert st.endpoint == pubs[r].bound_endpoint


@pytest.mark.parametrize("transport", ["tcp", "ipc"])
def test_paused_reader_with_tiny_high_water_marks_is_repaired_by_replay(transport: str) -> None:
    with endpoints(transport, 1) as (ep, rep), publishers(ep, rep, 1, hwm=2) as (pub,):
        engine = Engine(seed=3)
        sink = GatedSink()
        with Subscriber([bound_source("w", [pub])], sink, config=fast(hwm=2)) as sub:
            engine.publish(pub, 5)
            wait_for(lambda: settled(sub.status(), "w", 0, 5), 10, "first batches")
            sink.open.clear()
            engine.publish(pub, 1)
            assert sink.blocked.wait(5), "the reader never stalled"
            engine.publish(pub, STALL_BATCHES[transport], blocks=64)
            wait_for(lambda: pub.queue_depth == 0, 10, "the publisher to send everything")
            sink.open.set()
            last = pub.last_seq + 1
            wait_for(lambda: settled(sub.status(), "w", 0, last), 20, "the gap to be repaired")
            st = rank_status(sub.status(), "w", 0)
            # The stall lost live batches (a gap, or a heartbeat timeout while the
            # full queue stopped reading: a reconnect); the replay brought them.
            assert st.counters.replayed > 0, "no loss happened: the test proved nothing"
            assert st.counters.seqs_lost == 0
            assert st.state is RankState.SYNCED
            assert sink.blocks("w", 0) == engine.truth


def test_replay_buffer_too_small_leaves_partial_without_stale_blocks() -> None:
    with ipc_endpoints() as (ep, rep), publishers(ep, rep, 1, hwm=2, buffer_steps=8) as (pub,):
        engine = Engine(seed=4)
        sink = GatedSink()
        with Subscriber([EngineSource("w", ep, rep)], sink, config=fast(hwm=2)) as sub:
            engine.publish(pub, 5)
            wait_for(lambda: settled(sub.status(), "w", 0, 5), 10, "first batches")
            sink.open.clear()
            engine.publish(pub, 1)
            assert sink.blocked.wait(5)
            engine.publish(pub, STALL_BATCHES["ipc"], blocks=64)
            wait_for(lambda: pub.queue_depth == 0, 10, "the publisher to send everything")
            sink.open.set()
            last = pub.last_seq + 1
            wait_for(lambda: settled(sub.status(), "w", 0, last), 20, "the loss to be handled")
            st = rank_status(sub.status(), "w", 0)
            assert st.state is RankState.PARTIAL, st
            assert st.counters.seqs_lost > 0 and st.counters.resyncs >= 1
            held = sink.blocks("w", 0)
            assert held <= engine.truth and held != engine.truth
            # The engine drops its cache: from there the view is exact again.
            engine.publish(pub, 1, clear=True)
            engine.publish(pub, 3)
            last = pub.last_seq + 1
            wait_for(lambda: settled(sub.status(), "w", 0, last), 10, "the clear")
            assert rank_status(sub.status(), "w", 0).state is RankState.SYNCED
            assert sink.blocks("w", 0) == engine.truth


def test_without_a_replay_endpoint_a_gap_is_partial_at_once() -> None:
    with ipc_endpoints() as (ep, _), publishers(ep, None, 1, hwm=2) as (pub,):
        engine = Engine(seed=5)
        sink = GatedSink()
        with Subscriber([EngineSource("w", ep)], sink, config=fast(hwm=2)) as sub:
            # Batches sent before the subscription reaches the publisher are lost
            # and nothing can replay them; an AllBlocksCleared makes the view exact.
            for _ in range(50):
                engine.publish(pub, 1, clear=True)
                with contextlib.suppress(AssertionError):
                    nxt = pub.last_seq + 1
                    wait_for(functools.partial(_settled, sub, "w", 0, nxt), 0.2, "a clear")
                    break
            assert rank_status(sub.status(), "w", 0).state is RankState.SYNCED
            sink.open.clear()
            engine.publish(pub, 1)
            assert sink.blocked.wait(5)
            engine.publish(pub, STALL_BATCHES["ipc"], blocks=64)
            wait_for(lambda: pub.queue_depth == 0, 10, "the publisher to send everything")
            sink.open.set()
            # The tiny high-water mark may drop batches sent while the reader
            # catches up: send until one gets through.
            for _ in range(50):
                engine.publish(pub, 1)
                with contextlib.suppress(AssertionError):
                    nxt = pub.last_seq + 1
                    wait_for(functools.partial(_settled, sub, "w", 0, nxt), 0.2, "a batch")
                    break
            last = pub.last_seq + 1
            wait_for(lambda: settled(sub.status(), "w", 0, last), 10, "the last batch")
            st = rank_status(sub.status(), "w", 0)
            assert st.state is RankState.PARTIAL
            assert st.counters.replays_requested == 0 and st.counters.seqs_lost > 0
            assert sink.blocks("w", 0) <= engine.truth


def _settled(sub: Subscriber, worker: str, rank: int, next_seq: int) -> bool:
    return settled(sub.status(), worker, rank, next_seq)


def _caught_up(sub: Subscriber, worker: str, rank: int, count: int) -> bool:
    """The rank applied the ``count`` batches published and is not mid-repair.

    A publisher process heartbeats once it is done (empty batches on the next
    seqs), so the rank may be past ``count`` when this is polled: waiting for
    exactly ``count`` missed it on a loaded host.
    """
    st = next((s for s in sub.status() if (s.worker_id, s.rank) == (worker, rank)), None)
    return (
        st is not None
        and st.expected_seq >= count
        and st.state is not RankState.SYNCING
        and not st.replay_pending
        and st.held == 0
    )


def _spawn(
    ep: str, rep: str, life: int, count: int
) -> tuple[subprocess.Popen[str], set[int], tuple[str, str]]:
    """A publisher process bound at ``ep``/``rep``: it, its engine's blocks, what it bound."""
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "tests.subscriber.publisher_proc",
            ep,
            rep,
            "7",
            str(life),
            str(count),
        ],
        cwd=ROOT,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout is not None
    line = proc.stdout.readline()
    assert line, "the publisher process died"
    report = json.loads(line)
    return proc, set(report["blocks"]), (report["endpoint"], report["replay_endpoint"])


def _kill(proc: subprocess.Popen[str]) -> None:
    proc.send_signal(signal.SIGKILL)
    proc.wait(10)
    for f in (proc.stdin, proc.stdout):
        if f is not None:
            f.close()


@pytest.mark.parametrize("new_count", [10, 45], ids=["restart-behind", "restart-ahead"])
def test_publisher_killed_and_restarted_is_followed_from_its_new_stream(new_count: int) -> None:
    """The new life publishes before the subscriber reconnects: only replay shows it.

    With 10 batches the new stream is behind the old position (the anchored
    replay comes back empty); with 45 it is ahead (the anchor's content differs).
    """
    sink = BlockSetSink()
    proc, truth, (ep, rep) = _spawn(EPHEMERAL, EPHEMERAL, life=0, count=30)
    try:  # the new life binds the ports the first one bound
        with Subscriber([EngineSource("w", ep, rep)], sink, config=FAST) as sub:
            wait_for(lambda: _caught_up(sub, "w", 0, 30), 10, "the first life")
            assert sink.blocks("w", 0) == truth
            _kill(proc)
            proc, truth, bound = _spawn(ep, rep, life=1, count=new_count)
            assert bound == (ep, rep)
            wait_for(
                lambda: (
                    rank_status(sub.status(), "w", 0).counters.restarts >= 1
                    and _caught_up(sub, "w", 0, new_count)
                ),
                15,
                "the restart to be followed",
            )
            st = rank_status(sub.status(), "w", 0)
            assert st.state is RankState.SYNCED, st
            assert sink.blocks("w", 0) == truth
    finally:
        _kill(proc)


def test_sources_added_and_removed_at_run_time() -> None:
    with publishers(EPHEMERAL, EPHEMERAL, 1) as (p1,), publishers(EPHEMERAL, EPHEMERAL, 1) as (p2,):
        e1, e2 = Engine(seed=1), Engine(seed=2)
        e1.publish(p1, 4)
        e2.publish(p2, 6)
        sink = BlockSetSink()
        with Subscriber([bound_source("a", [p1])], sink, config=FAST) as sub:
            wait_for(lambda: settled(sub.status(), "a", 0, 4), 10, "worker a")
            sub.add_source(bound_source("b", [p2]))
            wait_for(lambda: settled(sub.status(), "b", 0, 6), 10, "worker b")
            assert sink.blocks("b", 0) == e2.truth
            with pytest.raises(ValueError):
                sub.add_source(bound_source("b", [p1]))
            sub.remove_source("a")
            assert sink.blocks("a", 0) == frozenset(), "removal must clear downstream"
            assert [s.worker_id for s in sub.status()] == ["b"]
            e2.publish(p2, 2)
            wait_for(lambda: settled(sub.status(), "b", 0, 8), 10, "worker b goes on")
            assert sink.blocks("b", 0) == e2.truth
            with pytest.raises(KeyError):
                sub.remove_source("a")


def test_a_failing_sink_is_counted_and_the_rank_cleared_not_fatal() -> None:
    class Flaky(BlockSetSink):
        calls = 0

        def apply(self, worker_id: str, rank: int, batch: KVEventBatch) -> None:
            self.calls += 1
            if self.calls == 3:
                raise RuntimeError("index full")
            super().apply(worker_id, rank, batch)

    with publishers(EPHEMERAL, EPHEMERAL, 1) as (pub,):
        engine = Engine(seed=8)
        sink = Flaky()
        with Subscriber([bound_source("w", [pub])], sink, config=FAST) as sub:
            engine.publish(pub, 5)
            wait_for(lambda: settled(sub.status(), "w", 0, 5), 10, "batches")
            st = rank_status(sub.status(), "w", 0)
            assert st.counters.sink_errors == 1 and st.state is RankState.PARTIAL
            assert sink.blocks("w", 0) <= engine.truth
            engine.publish(pub, 1, clear=True)
            wait_for(lambda: settled(sub.status(), "w", 0, 6), 10, "the clear")
            assert rank_status(sub.status(), "w", 0).state is RankState.SYNCED
            assert sink.blocks("w", 0) == engine.truth


def test_envelope_rank_mismatch_is_counted() -> None:
    with publishers(EPHEMERAL, EPHEMERAL, 2) as pubs:
        wrong = Engine(seed=9, rank=0)  # rank 1's socket sending rank-0 envelopes
        sink = BlockSetSink()
        with Subscriber([bound_source("w", pubs)], sink, config=FAST) as sub:
            wrong.publish(pubs[1], 3)
            wait_for(lambda: settled(sub.status(), "w", 1, 3), 10, "batches")
            assert rank_status(sub.status(), "w", 1).counters.rank_mismatches == 3
            assert sink.blocks("w", 1) == wrong.truth  # the endpoint decides the rank


def test_async_iterator_and_clean_shutdown() -> None:
    asyncio.run(_async_iterator_and_clean_shutdown())


async def _async_iterator_and_clean_shutdown() -> None:
    fds_before = len(os.listdir("/proc/self/fd"))
    threads_before = set(threading.enumerate())
    ctx = zmq.asyncio.Context()
    with publishers(EPHEMERAL, EPHEMERAL, 1) as (pub,):
        engine = Engine(seed=11)
        engine.publish(pub, 7)
        items: list[Applied | Cleared] = []
        # The seq of the last batch: a heartbeat may take a seq between the history and
        # the batches after it (a loaded machine), so it is read, not assumed to be 9.
        last: list[int] = []
        async with Subscriber([bound_source("w", [pub])], config=FAST, context=ctx) as sub:

            async def consume() -> None:
                async for item in sub:
                    items.append(item)
                    if isinstance(item, Applied) and last and item.seq >= last[0]:
                        return

            reader = asyncio.create_task(consume())
            await await_for(lambda: settled(sub.status(), "w", 0, 7), 10, "history")
            engine.publish(pub, 3)
            last.append(pub.last_seq)  # no await since publish: the reader has not run
            await asyncio.wait_for(reader, 10)
        assert [i.seq for i in items if isinstance(i, Applied)] == list(range(last[0] + 1))
        held = BlockSetSink()
        for item in items:
            assert isinstance(item, Applied)
            held.apply(item.worker_id, item.rank, item.batch)
        assert held.blocks("w", 0) == engine.truth
    # Nothing left behind: tasks, sockets (the given context has none open), threads.
    others = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
    assert others == []
    ctx.term()  # would block if any socket were still open
    _assert_nothing_left(threads_before, fds_before)


def test_a_slow_iterator_reader_pauses_reading_and_loses_nothing() -> None:
    """Past ``backlog`` queued items reading stops; once the reader catches up it goes on."""
    asyncio.run(_slow_iterator_reader())


async def _slow_iterator_reader() -> None:
    total = 3000
    with publishers(EPHEMERAL, EPHEMERAL, 1) as (pub,):
        engine = Engine(seed=12)
        async with Subscriber([bound_source("w", [pub])], config=fast(backlog=8)) as sub:
            await await_for(lambda: rank_status(sub.status(), "w", 0).connected, 10, "connection")
            engine.publish(pub, total)
            seqs: list[int] = []
            held = BlockSetSink()
            async for item in sub:
                assert isinstance(item, Applied), item
                seqs.append(item.seq)
                held.apply(item.worker_id, item.rank, item.batch)
                if len(seqs) == 1:
                    # Stay behind until the publisher has sent everything.
                    await await_for(lambda: pub.queue_depth == 0, 10, "every batch sent")
                if len(seqs) == total:
                    break
            assert seqs == list(range(total))
            assert held.blocks("w", 0) == engine.truth
            # A SUB found full at a mark far below what its batches allow is reopened (a
            # reconnect): the rank reads SYNCED again once its replay proves continuity.
            await await_for(
                lambda: rank_status(sub.status(), "w", 0).state is RankState.SYNCED, 10, "synced"
            )
            st = rank_status(sub.status(), "w", 0)
            assert st.counters.seqs_lost == 0 and st.counters.resyncs == 0, st


def _assert_nothing_left(threads_before: set[threading.Thread], fds_before: int) -> None:
    """No thread and no descriptor beyond those there before, within a deadline.

    libzmq's reaper closes a socket's descriptors just after ``close()`` returns,
    so a loaded machine may need a moment; a real leak never ends.
    """
    wait_for(
        lambda: set(threading.enumerate()) <= threads_before
        and len(os.listdir("/proc/self/fd")) <= fds_before + 2,
        5,
        "threads and descriptors released",
    )


def test_background_thread_stops_in_bounded_time_leaving_nothing() -> None:
    threads_before = set(threading.enumerate())
    fds_before = len(os.listdir("/proc/self/fd"))
    with publishers(EPHEMERAL, EPHEMERAL, 2) as pubs:
        sink = BlockSetSink()
        sub = Subscriber([bound_source("w", pubs)], sink, config=FAST).start()
        Engine(seed=12).publish(pubs[0], 2)
        wait_for(lambda: settled(sub.status(), "w", 0, 2), 10, "batches")
        sub.stop(timeout=2.0)
        with pytest.raises(RuntimeError):
            asyncio.run(sub.run())  # a subscriber runs once
    _assert_nothing_left(threads_before, fds_before)


def test_engine_source_validates_its_endpoints() -> None:
    with pytest.raises(EndpointError):
        EngineSource("w", "tcp://*:5557")
    with pytest.raises(EndpointError):
        EngineSource("w", "tcp://127.0.0.1:5557", "tcp://127.0.0.1:5558", ranks=2)
    with pytest.raises(ValueError):
        EngineSource("", "tcp://127.0.0.1:5557")
    src = EngineSource("w", "ipc:///tmp/kv", "ipc:///tmp/rp", ranks=2)
    assert [(r.endpoint, r.replay_endpoint) for r in src.rank_endpoints()] == [
        ("ipc:///tmp/kv", "ipc:///tmp/rp"),
        ("ipc:///tmp/kv_dp1", "ipc:///tmp/rp_dp1"),
    ]
    src = EngineSource("w", "tcp://127.0.0.1:5557", "tcp://127.0.0.1:5657", ranks=3)
    assert [(r.endpoint, r.replay_endpoint) for r in src.rank_endpoints()] == [
        (f"tcp://127.0.0.1:{5557 + r}", f"tcp://127.0.0.1:{5657 + r}") for r in range(3)
    ]
    explicit = [("tcp://127.0.0.1:41000", "tcp://127.0.0.1:39000"), ("tcp://h:7", "tcp://h:8")]
    src = EngineSource.from_rank_endpoints("w", explicit)
    assert [(r.endpoint, r.replay_endpoint) for r in src.rank_endpoints()] == explicit
    with pytest.raises(EndpointError):  # a bind address, not where to connect
        EngineSource.from_rank_endpoints("w", [("tcp://127.0.0.1:*", None)])
    with pytest.raises(ValueError, match="every rank"):
        EngineSource.from_rank_endpoints("w", [("tcp://h:1", "tcp://h:2"), ("tcp://h:3", None)])


def test_stream_config_replay_flag_follows_the_source() -> None:
    """A source without a replay endpoint never sends a replay request."""
    with publishers(EPHEMERAL, None, 1) as (pub,):
        sink = BlockSetSink()
        cfg = streams(StreamConfig(replay=True, idle_probe=0.05))
        with Subscriber([bound_source("w", [pub])], sink, config=cfg) as sub:
            Engine(seed=13).publish(pub, 0)
            wait_for(lambda: rank_status(sub.status(), "w", 0).connected, 5, "connection")
            Engine(seed=13).publish(pub, 2)
            wait_for(lambda: settled(sub.status(), "w", 0, 2), 5, "batches")
            c = rank_status(sub.status(), "w", 0).counters
            assert c.replays_requested == 0 and c.probes == 0


class FlushingSink(BlockSetSink):
    """Buffers batches until ``flush()``, like a coalescing index."""

    def __init__(self) -> None:
        super().__init__()
        self.pending: list[tuple[str, int, Any]] = []
        self.flushes = 0

    def apply(self, worker_id: str, rank: int, batch: Any) -> None:
        self.pending.append((worker_id, rank, batch))

    def flush(self) -> None:
        self.flushes += 1
        pending, self.pending = self.pending, []
        for worker_id, rank, batch in pending:
            super().apply(worker_id, rank, batch)


def test_a_buffering_sink_is_flushed_once_the_socket_is_drained() -> None:
    with ipc_endpoints() as (ep, rep), publishers(ep, rep, 1) as (pub,):
        engine = Engine(seed=9)
        sink = FlushingSink()
        with Subscriber([EngineSource("w", ep, rep)], sink, config=FAST) as sub:
            engine.publish(pub, 20)
            wait_for(lambda: settled(sub.status(), "w", 0, 20), 10, "the batches")
            # Without a query ever calling flush(), the subscriber applied them.
            wait_for(lambda: sink.blocks("w", 0) == engine.truth, 10, "the sink to be flushed")
            assert sink.flushes > 0 and not sink.pending


class _ProactorLike(asyncio.SelectorEventLoop):
    """A running loop that cannot watch descriptors, as Windows' proactor loop."""

    add_reader = asyncio.AbstractEventLoop.add_reader  # type: ignore[assignment]


def test_a_loop_that_cannot_watch_descriptors_is_refused_with_the_way_out() -> None:
    from kvwire.subscriber.reactor import watches_descriptors

    assert watches_descriptors(asyncio.new_event_loop())
    loop = _ProactorLike()
    try:
        assert not watches_descriptors(loop)
        sub = Subscriber([EngineSource("w", "tcp://127.0.0.1:1")], BlockSetSink())
        with pytest.raises(RuntimeError, match="add_reader"):
            loop.run_until_complete(sub.run())
        with pytest.raises(RuntimeError, match="runs once"):
            loop.run_until_complete(sub.run())
    finally:
        loop.close()
