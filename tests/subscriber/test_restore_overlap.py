"""A view loaded at start overlaps the ranks' replays, and nothing reaches the sink early.

While a checkpoint or clone is imported, each of its ranks connects and asks its
replay as soon as its position is read; what it reads is sequenced but held, and
reaches the sink only after the view is in, in order. A sink whose imports wait
for the test shows it: the replays finish during the import, and the sink sees
each rank's import first, then its batches.
"""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import pytest
import zmq

from kvwire.subscriber import EngineSource, RankState, Subscriber
from kvwire.subscriber.clone import PROTOCOL
from kvwire.wire import KVEventBatch
from tests.subscriber.ckpt_helpers import ViewSet, engines, fleet
from tests.subscriber.helpers import bound_source, fast
from tests.subscriber.test_checkpoint import BEFORE, BUFFER, TAIL, exact, publish
from tests.subscriber.test_clone import take_pieces
from tests.waiting import wait_for

MORE = 5  # live batches published while the view is held back


class SlowImport(ViewSet):
    """A view sink whose imports wait for ``go``, logging every call that changes it."""

    def __init__(self) -> None:
        super().__init__()
        self.go = threading.Event()
        self.calls: list[tuple[str, str, int]] = []

    def import_rank(self, worker_id: str, rank: int, view: bytes | bytearray | memoryview) -> None:
        assert self.go.wait(20), "the test let the import go"
        self.calls.append(("import", worker_id, rank))
        super().import_rank(worker_id, rank, view)

    def apply(self, worker_id: str, rank: int, batch: KVEventBatch) -> None:
        self.calls.append(("apply", worker_id, rank))
        super().apply(worker_id, rank, batch)

    def clear(self, worker_id: str, rank: int) -> None:
        self.calls.append(("clear", worker_id, rank))
        super().clear(worker_id, rank)

    def of(self, rank: int) -> list[str]:
        return [what for what, _, r in self.calls if r == rank]


def replays_done(sub: Subscriber, ranks: int = 2) -> bool:
    statuses = sub.status()
    return len(statuses) == ranks and all(st.counters.replays_succeeded >= 1 for st in statuses)


def checkpoint_then_miss(
    source: EngineSource, pubs: Any, engs: Any, path: str, before: int, missed: int
) -> None:
    """A first router follows ``before`` steps exactly and writes its checkpoint at stop;
    then the fleet publishes ``missed`` steps while no router runs."""
    first = ViewSet()
    with Subscriber([source], first, config=fast(checkpoint=path)) as sub:
        assert sub.wait_synced(timeout=10)
        publish(engs, pubs, before)
        wait_for(lambda: exact(sub, first, engs), 10, "the first router exact")
    publish(engs, pubs, missed)


def test_batches_read_during_the_import_reach_the_sink_after_the_view_in_order(
    tmp_path: Path,
) -> None:
    path = str(tmp_path / "view.ckpt")
    with fleet(2, "stock", buffer_steps=BUFFER) as pubs:
        engs = engines(2, seed=700)
        source = bound_source("w", pubs)
        checkpoint_then_miss(source, pubs, engs, path, BEFORE, TAIL)
        sink = SlowImport()
        with Subscriber([source], sink, config=fast(checkpoint=path)) as sub:
            try:
                wait_for(
                    lambda: replays_done(sub) and all(st.connected for st in sub.status()),
                    10,
                    "the tails replayed during the import",
                )
                publish(engs, pubs, MORE)  # live batches, read while the view is held back
                seqs = BEFORE + TAIL + MORE
                wait_for(
                    lambda: all(st.expected_seq == seqs for st in sub.status()),
                    10,
                    "the live batches read",
                )
                assert sink.calls == [], "nothing reached the sink before its view"
                assert not sub.is_synced(0.5)
                for st in sub.status():
                    assert st.state is RankState.SYNCING
                    assert st.reason.startswith("the view is loading")
                    assert sub.rank_state("w", st.rank) is RankState.SYNCING
            finally:
                sink.go.set()
            wait_for(lambda: exact(sub, sink, engs), 10, "exact once the view is in")
            for r in range(2):
                assert sink.of(r) == ["import"] + ["apply"] * (TAIL + MORE), "view first, in order"
            for st in sub.status():
                # A live batch sent before the SUB's subscription reached the engine (a
                # loaded host) is lost there and replayed instead: held all the same.
                assert TAIL <= st.counters.replayed <= TAIL + MORE
                assert st.counters.resyncs == 0 and st.counters.seqs_lost == 0


@pytest.mark.parametrize("snapshot", [False, True])
def test_a_replay_that_fails_during_the_import_falls_back_after_the_view(
    tmp_path: Path, snapshot: bool
) -> None:
    """The buffer no longer holds the anchor: the rank clears its view (after the view is
    in) and ends PARTIAL, or SYNCED from a snapshot, as a rank resumed later would."""
    path = str(tmp_path / "view.ckpt")
    kind = {"snapshot": True} if snapshot else {}
    with fleet(1, "kvwire", buffer_steps=10, **kind) as pubs:
        engs = engines(1, seed=710)
        source = bound_source("w", pubs)
        checkpoint_then_miss(source, pubs, engs, path, 30, 30)  # 3 buffers: the anchor is gone
        sink = SlowImport()
        with Subscriber([source], sink, config=fast(checkpoint=path)) as sub:
            try:
                wait_for(
                    lambda: sub.status()[0].counters.resyncs >= 1, 10, "the loss seen meanwhile"
                )
                assert sink.calls == [] and sub.rank_state("w", 0) is RankState.SYNCING
            finally:
                sink.go.set()
            if snapshot:
                wait_for(lambda: exact(sub, sink, engs), 10, "SYNCED from a snapshot")
            else:
                wait_for(lambda: sub.rank_state("w", 0) is RankState.PARTIAL, 10, "PARTIAL")
                assert sink.blocks("w", 0) <= engs[0].truth
            calls = sink.of(0)
            assert calls[:2] == ["import", "clear"], "the view first, then its loss"


class DyingPeer:
    """A clone endpoint serving ``pieces`` to one client, then only empty pieces (so the
    client waits on) until ``die`` is set, when it goes silent for good."""

    def __init__(self, pieces: list[bytes]) -> None:
        self.ctx = zmq.Context()
        self.sock: zmq.Socket[bytes] = self.ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.bind("tcp://127.0.0.1:*")
        self.endpoint = self.sock.getsockopt_string(zmq.LAST_ENDPOINT)
        self.pieces = list(pieces)
        self.die = threading.Event()
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        sock, todo, ident = self.sock, list(self.pieces), None
        while not self.die.is_set():
            if sock.poll(50):
                ident, _, verb, *rest = sock.recv_multipart()
                if verb == b"CREDIT":
                    for _ in range(int.from_bytes(rest[0], "big")):
                        if todo:
                            sock.send_multipart([ident, PROTOCOL, b"DATA", todo.pop(0)])
            elif ident is not None and not todo:
                sock.send_multipart([ident, PROTOCOL, b"DATA", b""])  # still here
        sock.close()

    def close(self) -> None:
        self.die.set()
        self.thread.join(15)
        self.ctx.term()


def test_a_peer_dying_mid_clone_while_links_are_open_leaves_no_rank_synced() -> None:
    """The ranks cloned so far connected and replayed their tails meanwhile; the clone is
    then refused: they start over cold (a buffer shorter than the history: PARTIAL), and
    none is SYNCED from a view that was never whole."""
    with fleet(2, "stock", buffer_steps=BUFFER) as pubs:
        engs = engines(2, seed=720)
        source = bound_source("w", pubs)
        peer_sink = ViewSet()
        with Subscriber([source], peer_sink, config=fast()) as peer:
            assert peer.wait_synced(timeout=10)
            publish(engs, pubs, BEFORE)
            wait_for(lambda: exact(peer, peer_sink, engs), 10, "the peer exact")
            pieces = take_pieces(peer.serve_view())
        assert len(pieces) == 4  # header, two records, end
        publish(engs, pubs, TAIL)
        dying = DyingPeer(pieces[:3])  # every record, but no end
        try:
            sink = ViewSet()
            config = fast(clone_from=dying.endpoint, clone_timeout=0.5)
            with Subscriber([source], sink, config=config) as replica:
                wait_for(lambda: replays_done(replica), 10, "the tails replayed mid-clone")
                assert not replica.is_synced(0.5) and sink.clears == 0
                assert all(st.state is RankState.SYNCING for st in replica.status())
                dying.die.set()
                wait_for(lambda: replica.restore_refusals, 10, "the clone refused")
                wait_for(
                    lambda: all(st.state is RankState.PARTIAL for st in replica.status()),
                    10,
                    "both ranks PARTIAL from a cold start",
                )
                assert replica.restored is None and "sent nothing" in replica.restore_refusals[0]
                for st in replica.status():
                    assert st.counters.replayed <= BUFFER, "a fresh stream: the buffer only"
                    assert sink.blocks("w", st.rank) != engs[st.rank].truth, "not exact"
        finally:
            dying.close()


def test_a_rank_whose_hold_fills_its_share_reads_on_after_the_view_exact(tmp_path: Path) -> None:
    """A receive budget so small that a few held batches fill a rank's share: the rank
    stops reading (its sockets keep the rest, its replay's deadlines wait) and reads on
    once the view is in; it ends exact, having replayed only its tail."""
    path = str(tmp_path / "view.ckpt")
    with fleet(2, "stock", buffer_steps=BUFFER) as pubs:
        engs = engines(2, seed=730)
        source = bound_source("w", pubs)
        checkpoint_then_miss(source, pubs, engs, path, BEFORE, TAIL)
        sink = SlowImport()
        config = fast(checkpoint=path, receive_budget_bytes=2048)  # a share of ~400 bytes
        with Subscriber([source], sink, config=config) as sub:
            try:
                wait_for(
                    lambda: all(0 < st.counters.replayed < TAIL for st in sub.status()),
                    10,
                    "part of each tail read, then the hold full",
                )
                assert sink.calls == [] and not sub.is_synced(0.5)
            finally:
                sink.go.set()
            wait_for(lambda: exact(sub, sink, engs), 10, "exact once the view is in")
            for r in range(2):
                assert sink.of(r) == ["import"] + ["apply"] * TAIL
            for st in sub.status():
                assert st.counters.replayed == TAIL and st.counters.resyncs == 0
