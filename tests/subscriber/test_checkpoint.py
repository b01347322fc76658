"""Checkpoints: a router that restarts from its own view, and every bad file refused.

Real publishers on loopback whose replay buffers are shorter than their history: a
router that started cold would end PARTIAL, so SYNCED and exact after a restart
proves the checkpoint's view and positions were used, with only the tail replayed.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import threading
import time
from collections.abc import Set
from pathlib import Path
from typing import Protocol

import prometheus_client
import pytest

from kvwire.cli import main
from kvwire.prefix_index import PrefixIndex
from kvwire.publisher import EventPublisher
from kvwire.subscriber import CheckpointError, EngineSource, RankState, Subscriber
from kvwire.subscriber.checkpoint import IMPORT_BATCH, VERSION, load_file, write_file
from kvwire.subscriber.metrics import register_metrics
from kvwire.subscriber.persist import TURN_WAIT_S, loop_turn
from tests.subscriber.ckpt_helpers import FORMAT, ViewSet, built_view, engines, fleet
from tests.subscriber.helpers import Engine, bound_source, fast, rank_status
from tests.waiting import wait_for

BEFORE, TAIL, BUFFER = 60, 20, 40


class Blocks(Protocol):
    def blocks(self, worker_id: str, rank: int) -> Set[int]: ...


def exact(sub: Subscriber, sink: Blocks, engs: list[Engine], worker: str = "w") -> bool:
    """Every rank SYNCED, nothing pending, and the sink holds the engine's truth."""
    statuses = sub.status()
    if len(statuses) != len(engs):
        return False
    for r, eng in enumerate(engs):
        st = rank_status(statuses, worker, r)
        if st.state is not RankState.SYNCED or st.replay_pending or st.held:
            return False
        if sink.blocks(worker, r) != eng.truth:
            return False
    return True


def publish(engs: list[Engine], pubs: list[EventPublisher], n: int) -> None:
    for eng, pub in zip(engs, pubs, strict=True):
        eng.publish(pub, n)


@pytest.mark.parametrize("kind", ["stock", "kvwire"])
def test_a_router_restarts_from_its_checkpoint_exact_replaying_only_the_tail(
    tmp_path: Path, kind: str
) -> None:
    path = str(tmp_path / "view.ckpt")
    with fleet(2, kind, buffer_steps=BUFFER) as pubs:
        engs = engines(2, seed=100)
        source = bound_source("w", pubs)
        first = ViewSet()
        with Subscriber([source], first, config=fast(checkpoint=path)) as sub:
            assert sub.restored is None and sub.restore_refusals == []
            assert sub.wait_synced(timeout=10), "connected before the history is published"
            publish(engs, pubs, BEFORE)
            wait_for(lambda: exact(sub, first, engs), 10, "the first router exact")
        assert os.path.exists(path), "written on stop"
        publish(engs, pubs, TAIL)  # while no router runs
        second = ViewSet()
        with Subscriber([source], second, config=fast(checkpoint=path)) as sub:
            wait_for(lambda: exact(sub, second, engs), 10, "the restarted router exact")
            restored = sub.restored
            assert restored is not None and sorted(restored.positions) == [("w", 0), ("w", 1)]
            assert second.imports == 2
            progress = sub.restore_progress()
            size = os.path.getsize(path)
            assert (progress.source, progress.done, progress.ranks_imported) == (
                "checkpoint",
                True,
                2,
            )
            assert progress.bytes_received == progress.bytes_expected == size == restored.nbytes
            registry = prometheus_client.CollectorRegistry()
            register_metrics(sub, registry)
            text = prometheus_client.generate_latest(registry).decode()
            assert f'kvwire_subscriber_restore_bytes{{kind="received"}} {float(size)}' in text
            assert "kvwire_subscriber_restore_ranks 2.0" in text
            assert "kvwire_subscriber_restore_done 1.0" in text
            for st in sub.status():
                assert st.counters.resyncs == 0 and st.counters.seqs_lost == 0
                if kind == "stock":  # (kvwire's buffer holds heartbeats too)
                    assert st.counters.replayed == TAIL
                else:
                    assert TAIL <= st.counters.replayed < BEFORE


def test_a_prefix_index_restarts_from_its_checkpoint_exact(tmp_path: Path) -> None:
    """The router's own sink: its rank views through the payload path, resumed exact."""
    path = str(tmp_path / "index.ckpt")
    with fleet(2, "stock", buffer_steps=BUFFER) as pubs:
        engs = engines(2, seed=150)
        source = bound_source("w", pubs)
        first = PrefixIndex(4)
        with Subscriber([source], first, config=fast(checkpoint=path)) as sub:
            assert sub.wait_synced(timeout=10)
            publish(engs, pubs, BEFORE)
            wait_for(lambda: exact(sub, first, engs), 10, "the first router exact")
        publish(engs, pubs, TAIL)
        second = PrefixIndex(4)
        with Subscriber([source], second, config=fast(checkpoint=path)) as sub:
            wait_for(lambda: exact(sub, second, engs), 10, "the restarted router exact")
            assert sub.restored is not None
            assert [st.counters.replayed for st in sub.status()] == [TAIL, TAIL]
        # A sink of another format refuses it: the router starts cold, nothing applied.
        other = PrefixIndex(8)
        with Subscriber([source], other, config=fast(checkpoint=path)) as sub:
            wait_for(lambda: sub.restore_refusals, 10, "the refusal")
            assert "view format" in sub.restore_refusals[0] and sub.restored is None


def test_kvwire_watch_saves_and_resumes_its_checkpoint(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = str(tmp_path / "watch.ckpt")
    with fleet(1, "stock", buffer_steps=BUFFER) as pubs:
        engs = engines(1, seed=170)
        publish(engs, pubs, 10)
        pub = pubs[0]
        assert pub.bound_replay_endpoint is not None
        argv = ["watch", pub.bound_endpoint, "--replay", pub.bound_replay_endpoint]
        argv += ["--once", "--duration", "0.5", "--checkpoint", path]
        assert main(argv) == 0
        sink = ViewSet()
        load_file(path, sink, {("engine", 0)})
        assert sink.blocks("engine", 0) == engs[0].truth, "saved on exit"
        publish(engs, pubs, 35)  # 45 in all: a cold start would miss seqs 0-4, out of the buffer
        assert main(argv) == 0
    rows = [line.split() for line in capsys.readouterr().out.splitlines()]
    rows = [r for r in rows if r and r[0] == "engine"]
    assert rows[-1][2] == "synced" and int(rows[-1][10]) == len(engs[0].truth)


def test_without_the_checkpoint_the_same_restart_is_partial(tmp_path: Path) -> None:
    """The control: the same history, a cold router: the buffer no longer covers it."""
    with fleet(1, "stock", buffer_steps=BUFFER) as pubs:
        engs = engines(1, seed=7)
        publish(engs, pubs, BEFORE + TAIL)
        sink = ViewSet()
        with Subscriber([bound_source("w", pubs)], sink, config=fast()) as sub:
            wait_for(
                lambda: sub.rank_state("w", 0) is RankState.PARTIAL, 10, "the cold rank PARTIAL"
            )
            assert sink.blocks("w", 0) != engs[0].truth


@pytest.mark.parametrize("snapshot", [False, True])
def test_a_gap_longer_than_the_buffer_falls_back_as_a_fresh_rank_would(
    tmp_path: Path, snapshot: bool
) -> None:
    path = str(tmp_path / "view.ckpt")
    kind = {"snapshot": True} if snapshot else {}
    with fleet(1, "kvwire", buffer_steps=10, **kind) as pubs:
        engs = engines(1, seed=11)
        source = bound_source("w", pubs)
        first = ViewSet()
        with Subscriber([source], first, config=fast(checkpoint=path)) as sub:
            assert sub.wait_synced(timeout=10)
            publish(engs, pubs, 30)
            wait_for(lambda: exact(sub, first, engs), 10, "the first router exact")
        publish(engs, pubs, 30)  # three buffers' worth: the anchor is gone
        second = ViewSet()
        with Subscriber([source], second, config=fast(checkpoint=path)) as sub:
            if snapshot:
                wait_for(lambda: exact(sub, second, engs), 10, "SYNCED from a snapshot")
                st = sub.status()[0]
                assert st.counters.snapshots_applied >= 1
                assert sub.restored is not None and second.imports == 1
            else:
                wait_for(
                    lambda: sub.rank_state("w", 0) is RankState.PARTIAL, 10, "the rank PARTIAL"
                )
                assert sub.restored is not None and second.imports == 1
                assert second.clears >= 1, "the resumed view was cleared"
                assert second.blocks("w", 0) <= engs[0].truth


def test_checkpoint_now_and_periodically_while_batches_flow(tmp_path: Path) -> None:
    now_path, every_path = str(tmp_path / "now.ckpt"), str(tmp_path / "every.ckpt")
    with fleet(3, "stock") as pubs:
        engs = engines(3, seed=30)
        sink = ViewSet()
        config = fast(checkpoint=every_path, checkpoint_every=0.05)
        with Subscriber([bound_source("w", pubs)], sink, config=config) as sub:
            publish(engs, pubs, 20)
            wait_for(lambda: exact(sub, sink, engs), 10, "exact")
            info = sub.checkpoint(now_path)
            assert (info.ranks, info.skipped) == (3, 0)
            assert info.nbytes == os.path.getsize(now_path) and info.seconds >= 0
            wait_for(lambda: os.path.exists(every_path), 10, "a periodic checkpoint")
            with pytest.raises(ValueError, match="no checkpoint path"):
                Subscriber([], ViewSet()).start().checkpoint()
        loaded = ViewSet()
        restored = load_file(now_path, loaded, {("w", r) for r in range(3)})
        assert len(restored.positions) == 3
        for r, eng in enumerate(engs):
            assert loaded.blocks("w", r) == eng.truth


def test_no_rank_synced_writes_no_checkpoint_and_keeps_the_old_one(tmp_path: Path) -> None:
    path = tmp_path / "view.ckpt"
    old = built_view([("w", 0)])
    path.write_bytes(old)
    # A publisher that is never reached: the rank never syncs.
    sink = ViewSet()
    dead = EngineSource("w", "tcp://127.0.0.1:9", None)
    with (
        Subscriber([dead], sink, config=fast(checkpoint=str(path))) as sub,
        pytest.raises(CheckpointError, match="no rank is SYNCED"),
    ):
        sub.checkpoint()
    assert path.read_bytes() == old, "neither the call nor the stop replaced it"


# --- refusals: nothing applied ---------------------------------------------------------------

FOLLOWED = {("w", 0), ("w", 1)}


def refused(tmp_path: Path, data: bytes, match: str | None = None) -> str:
    path = tmp_path / "bad.ckpt"
    path.write_bytes(data)
    sink = ViewSet()
    with pytest.raises(CheckpointError, match=match) as info:
        load_file(str(path), sink, FOLLOWED)
    assert sink.imports == 0 and sink.ranks() == [], "nothing applied"
    return str(info.value)


def test_a_valid_file_loads_and_skips_ranks_not_followed(tmp_path: Path) -> None:
    path = tmp_path / "ok.ckpt"
    path.write_bytes(built_view([("w", 0), ("w", 1), ("other", 0)]))
    sink = ViewSet()
    restored = load_file(str(path), sink, FOLLOWED)
    assert sorted(restored.positions) == [("w", 0), ("w", 1)] and restored.skipped == 1
    assert sink.blocks("w", 1) == {10, 11, 12}


def test_the_loop_takes_a_turn_between_import_calls(tmp_path: Path) -> None:
    """Every position is announced before the first import (the ranks connect and ask
    their replays), and the loop gets a turn after every IMPORT_BATCH ranks imported."""
    ranks = [("w", r) for r in range(2 * IMPORT_BATCH + 3)]
    path = tmp_path / "ok.ckpt"
    path.write_bytes(built_view(ranks))
    sink = ViewSet()
    told: list[tuple[int, int]] = []  # (ranks announced, imports done when told)
    turns: list[int] = []  # imports done at each turn

    def turn() -> None:  # a loop that takes 20 ms a turn
        turns.append(sink.imports)
        time.sleep(0.02)

    restored = load_file(
        str(path),
        sink,
        set(ranks),
        announce=lambda positions: told.append((len(positions), sink.imports)),
        turn=turn,
    )
    assert told == [(len(ranks), 0)]
    assert turns == [IMPORT_BATCH, 2 * IMPORT_BATCH, len(ranks)]
    # The time spent in the turns is told apart from the load's own.
    assert 3 * 0.02 <= restored.turn_s <= restored.seconds


def test_loop_turn_returns_once_the_loop_ran_what_was_queued_before() -> None:
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    try:
        ran = threading.Event()

        def slow() -> None:  # a loop busy with what it was given before the turn was asked
            time.sleep(0.2)
            ran.set()

        loop.call_soon_threadsafe(slow)
        loop_turn(loop, lambda: False)
        assert ran.is_set()
        t = time.monotonic()
        loop_turn(loop, lambda: True)  # stopping: no wait
        assert time.monotonic() - t < TURN_WAIT_S / 2
    finally:
        loop.call_soon_threadsafe(loop.stop)
        thread.join(5)
        loop.close()
    loop_turn(loop, lambda: False)  # closed: returns at once, no error


def test_truncated_at_every_length_is_refused(tmp_path: Path) -> None:
    data = built_view([("w", 0), ("w", 1)])
    for n in range(len(data)):
        refused(tmp_path, data[:n])


def test_every_flipped_byte_is_refused(tmp_path: Path) -> None:
    data = built_view([("w", 0), ("w", 1)])
    for i in range(len(data)):
        for bit in (0x01, 0x80):
            bad = bytearray(data)
            bad[i] ^= bit
            refused(tmp_path, bytes(bad))


def test_bytes_after_the_end_are_refused(tmp_path: Path) -> None:
    refused(tmp_path, built_view([("w", 0)]) + b"\0", "after the end")


def test_another_version_is_refused(tmp_path: Path) -> None:
    data = bytearray(built_view([("w", 0)]))
    data[8:10] = (VERSION + 1).to_bytes(2, "big")
    why = refused(tmp_path, bytes(data), "version")
    assert f"reads version {VERSION}" in why


def test_another_view_format_is_refused(tmp_path: Path) -> None:
    why = refused(tmp_path, built_view([("w", 0)], fmt=b"prefix-index/block=16"), "view format")
    assert FORMAT.decode() in why


def test_another_fleets_view_is_refused(tmp_path: Path) -> None:
    refused(tmp_path, built_view([("x", 0), ("x", 1)]), "another fleet")
    # Its fleet names a rank followed here, but no record is one of them.
    refused(tmp_path, built_view([("x", 0)], fleet_ranks=[("x", 0), ("w", 0)]), "another fleet")


@pytest.mark.parametrize("data", [b"", b"{}\n", b"KVWVIEW", os.urandom(4096)])
def test_not_a_checkpoint_is_refused(tmp_path: Path, data: bytes) -> None:
    refused(tmp_path, data)


def test_a_refused_checkpoint_starts_the_router_cold(tmp_path: Path) -> None:
    path = tmp_path / "view.ckpt"
    data = bytearray(built_view([("w", 0)]))
    data[-1] ^= 1
    path.write_bytes(bytes(data))
    with fleet(1, "stock") as pubs:
        engs = engines(1, seed=3)
        publish(engs, pubs, 5)
        sink = ViewSet()
        with Subscriber([bound_source("w", pubs)], sink, config=fast(checkpoint=str(path))) as sub:
            wait_for(lambda: exact(sub, sink, engs), 10, "exact from a cold start")
            assert sub.restored is None and sink.imports == 0
            assert len(sub.restore_refusals) == 1 and "checksum" in sub.restore_refusals[0]


def test_a_checkpoint_needs_a_view_sink(tmp_path: Path) -> None:
    from kvwire.subscriber import EventSink

    class Plain(EventSink):
        def apply(self, worker_id: str, rank: int, batch: object) -> None: ...

        def clear(self, worker_id: str, rank: int) -> None: ...

    with pytest.raises(TypeError, match="ViewSink"):
        Subscriber([], Plain(), config=fast(checkpoint=str(tmp_path / "x")))


CRASH = """
import os, sys
from kvwire.subscriber import checkpoint
from tests.subscriber.ckpt_helpers import built_view
checkpoint._rename = lambda tmp, path: os._exit(9)  # the process dies before the rename
checkpoint.write_file(sys.argv[1], [built_view([("w", 0), ("w", 1)])])
"""


def test_a_crash_between_write_and_rename_leaves_the_old_checkpoint(tmp_path: Path) -> None:
    path = tmp_path / "view.ckpt"
    write_file(str(path), [built_view([("w", 0)])])
    root = Path(__file__).resolve().parents[2]
    proc = subprocess.run([sys.executable, "-c", CRASH, str(path)], cwd=root, timeout=60)
    assert proc.returncode == 9
    leftovers = [p for p in os.listdir(tmp_path) if p != "view.ckpt"]
    assert len(leftovers) == 1 and leftovers[0].endswith(".tmp"), "the crash left its temp file"
    sink = ViewSet()
    restored = load_file(str(path), sink, FOLLOWED)
    assert list(restored.positions) == [("w", 0)], "the old checkpoint, whole"


def test_a_failed_write_removes_its_temp_file_and_keeps_the_old(tmp_path: Path) -> None:
    path = tmp_path / "view.ckpt"
    write_file(str(path), [built_view([("w", 0)])])

    def pieces() -> object:
        yield b"partial"
        raise OSError("disk full")

    with pytest.raises(OSError, match="disk full"):
        write_file(str(path), pieces())  # type: ignore[arg-type]
    assert os.listdir(tmp_path) == ["view.ckpt"]
    load_file(str(path), ViewSet(), FOLLOWED)
