"""``kvwire watch`` and ``kvwire dump`` against a real EventPublisher."""

from __future__ import annotations

import argparse
import asyncio
import io
import json
import subprocess
import sys
from pathlib import Path

import pytest

from kvwire.cli import _watch, build_parser, main
from kvwire.publisher import EventPublisher
from tests.subscriber.helpers import Engine, tcp_endpoints

ROOT = Path(__file__).resolve().parents[2]


def test_dump_prints_history_and_live_batches_as_json_lines() -> None:
    ep, rep = tcp_endpoints(1)
    engine = Engine(seed=21)
    with EventPublisher(ep, rep) as pub:
        published = [engine.batch() for _ in range(4)]
        for b in published:
            assert pub.publish(b)
        argv = ["dump", ep, "--replay", rep, "--count", "4", "--duration", "20", "--worker", "e1"]
        proc = subprocess.run(
            [sys.executable, "-m", "kvwire.cli", *argv],
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=60,
        )
    assert proc.returncode == 0, proc.stderr
    lines = [json.loads(line) for line in proc.stdout.splitlines()]
    assert [(r["type"], r["worker"], r["rank"], r["seq"]) for r in lines] == [
        ("batch", "e1", 0, seq) for seq in range(4)
    ]
    for record, batch in zip(lines, published, strict=True):
        assert record["data_parallel_rank"] == 0
        assert record["ts"] == batch.ts
        stored = [e for e in record["events"] if e["type"] == "BlockStored"]
        want = [e for e in batch.events if type(e).__name__ == "BlockStored"]
        assert [e["block_hashes"] for e in stored] == [e.block_hashes for e in want]  # type: ignore[union-attr]
        assert [e["token_ids"] for e in stored] == [e.token_ids for e in want]  # type: ignore[union-attr]


def test_dump_stops_after_its_duration_without_traffic(
    capsysbinary: pytest.CaptureFixture[bytes],
) -> None:
    ep, rep = tcp_endpoints(1)
    with EventPublisher(ep, rep):
        assert main(["dump", ep, "--replay", rep, "--duration", "0.5"]) == 0
    assert capsysbinary.readouterr().out == b""


def test_watch_once_shows_every_rank(capsys: pytest.CaptureFixture[str]) -> None:
    ep, rep = tcp_endpoints(2)
    engines = [Engine(seed=30 + r, rank=r) for r in range(2)]
    with (  # heartbeats too rare to add a seq during the test
        EventPublisher(ep, rep, rank=0, heartbeat=60) as p0,
        EventPublisher(ep, rep, rank=1, heartbeat=60) as p1,
    ):
        engines[0].publish(p0, 6)
        engines[1].publish(p1, 9)
        code = main(["watch", ep, "--replay", rep, "--ranks", "2", "--worker", "gpu7", "--once"])
    out = capsys.readouterr().out
    assert code == 0
    assert "\x1b[" not in out
    rows = [line.split() for line in out.splitlines() if line.startswith("gpu7")]
    assert [(r[1], r[2], r[3]) for r in rows] == [("0", "synced", "6"), ("1", "synced", "9")]
    blocks = {int(r[1]): int(r[10]) for r in rows}  # the BLOCKS column
    assert blocks == {0: len(engines[0].truth), 1: len(engines[1].truth)}


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_watch_refreshes_in_place_on_a_terminal() -> None:
    ep, rep = tcp_endpoints(1)
    out = _Terminal()
    args = build_parser().parse_args(
        ["watch", ep, "--replay", rep, "--duration", "0.7", "--interval", "0.2"]
    )
    with EventPublisher(ep, rep) as pub:
        Engine(seed=40).publish(pub, 3)
        assert asyncio.run(_watch(args, out)) == 0
    text = out.getvalue()
    frames = text.count("kvwire watch")
    assert frames >= 2
    assert text.count("\x1b[J") == frames - 1  # every frame after the first redraws in place


def test_watch_without_a_tty_prints_successive_tables(capsys: pytest.CaptureFixture[str]) -> None:
    ep, _ = tcp_endpoints(1)
    with EventPublisher(ep):
        assert main(["watch", ep, "--duration", "0.5", "--interval", "0.2"]) == 0
    out = capsys.readouterr().out
    assert out.count("kvwire watch") >= 2 and "\x1b[" not in out
    assert "no replay" in out


def test_bad_endpoints_exit_with_a_clear_message(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["dump", "tcp://*:5557"]) == 2
    assert "bind address" in capsys.readouterr().err
    assert main(["watch", "udp://127.0.0.1:1"]) == 2
    assert "unknown scheme" in capsys.readouterr().err


def test_subcommands_are_required() -> None:
    with pytest.raises(SystemExit):
        build_parser().parse_args([])
    assert isinstance(build_parser(), argparse.ArgumentParser)
