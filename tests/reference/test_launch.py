"""The reference engine binds ephemeral ports and says where; a router follows it there."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

pytest.importorskip("torch")

from kvwire.prefix_index import PrefixIndex
from kvwire.reference.control import ControlClient
from kvwire.reference.launch import EngineProcess
from kvwire.reference.serve import EngineConfig
from kvwire.subscriber import RankState, Subscriber


def test_engine_reports_its_ephemeral_endpoints_and_a_router_ends_exact(tmp_path: Path) -> None:
    engine = EngineProcess(EngineConfig(ranks=3, num_blocks=32, block_size=4, device="cpu"), tmp_path / "e.log")
    try:
        bound = engine.start()
        ports = [int(ep.rpartition(":")[2]) for r in bound.ranks for ep in (r.endpoint, r.replay_endpoint) if ep]
        assert [r.rank for r in bound.ranks] == [0, 1, 2]
        assert len(set(ports)) == 6 and all(p > 0 for p in ports)
        assert all(r.endpoint.startswith("tcp://127.0.0.1:") for r in bound.ranks)
        with ControlClient(engine.control_endpoint) as client:
            assert client.endpoints() == bound
            client.submit(2, "early", list(range(12)))  # before the router: served by replay
            index = PrefixIndex(4)
            sub = Subscriber([engine.source("w")], index).start()
            try:
                client.submit(1, "late", list(range(100, 108)))
                deadline = time.monotonic() + 20
                while True:
                    states = {s.rank: s for s in sub.status()}
                    truths = [client.truth(r) for r in range(3)]
                    done = all(
                        states[r].state is RankState.SYNCED
                        and states[r].expected_seq == truths[r].last_seq + 1
                        and index.blocks("w", r) == set(truths[r].hashes)
                        for r in range(3)
                    )
                    if done:
                        break
                    assert time.monotonic() < deadline, f"router never caught up: {states}"
                    time.sleep(0.02)  # a poll under a deadline
                assert len(index.blocks("w", 2)) == 3 and len(index.blocks("w", 1)) == 2
            finally:
                sub.stop()
    finally:
        engine.stop()
    assert not engine.running()


def test_a_server_that_exits_early_is_reported_with_its_output(tmp_path: Path) -> None:
    engine = EngineProcess(EngineConfig(ranks=1), tmp_path / "e.log", extra_args=["--no-such-flag"])
    with pytest.raises(RuntimeError, match="did not report its endpoints") as info:
        engine.start(timeout=30)
    assert "--no-such-flag" in str(info.value)
