"""``kvwire watch`` and ``kvwire dump`` against a real EventPublisher."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import io
import json
import subprocess
import sys
from pathlib import Path

import pytest

from kvwire.cli import _source, _watch, build_parser, main
from kvwire.publisher import EventPublisher, PublisherConfig
from kvwire.wire import BlockStored, KVEventBatch
from tests.subscriber.helpers import EPHEMERAL, Engine, ipc_endpoints

ROOT = Path(__file__).resolve().parents[2]


def test_dump_prints_history_and_live_batches_as_json_lines() -> None:
    engine = Engine(seed=21)
    with EventPublisher(EPHEMERAL, EPHEMERAL) as pub:
        ep, rep = pub.bound_endpoint, pub.bound_replay_endpoint
        assert rep is not None
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


def test_dump_keeps_going_past_a_batch_that_does_not_decode() -> None:
    bad = KVEventBatch(1.0, [BlockStored([7], None, ["a", "b"], 2)], 0)  # type: ignore[list-item]
    good = KVEventBatch(2.0, [BlockStored([8], None, [1, 2], 2)], 0)
    with EventPublisher(EPHEMERAL, EPHEMERAL) as pub:
        ep, rep = pub.bound_endpoint, pub.bound_replay_endpoint
        assert rep is not None
        for b in (good, bad, good, bad, good):
            assert pub.publish(b)
        argv = ["dump", ep, "--replay", rep, "--count", "5", "--duration", "20"]
        proc = subprocess.run(
            [sys.executable, "-m", "kvwire.cli", *argv],
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=60,
        )
    assert proc.returncode == 0, proc.stderr
    # Token ids that are not ints make a batch invalid: the rank is cleared there, and goes on.
    records = [json.loads(line) for line in proc.stdout.splitlines()]
    assert [r["type"] for r in records][:5] == ["batch", "clear", "batch", "clear", "batch"]
    assert [r["seq"] for r in records if r["type"] == "batch"][:3] == [0, 2, 4]


def test_dump_stops_after_its_duration_without_traffic(
    capsysbinary: pytest.CaptureFixture[bytes],
) -> None:
    with EventPublisher(EPHEMERAL, EPHEMERAL) as pub:
        ep, rep = pub.bound_endpoint, pub.bound_replay_endpoint
        assert rep is not None
        assert main(["dump", ep, "--replay", rep, "--duration", "0.5"]) == 0
    assert capsysbinary.readouterr().out == b""


@pytest.mark.parametrize("ranks_given", ["rank-endpoints", "base-and-ranks"])
def test_watch_once_shows_every_rank(ranks_given: str, capsys: pytest.CaptureFixture[str]) -> None:
    """Every rank by its own endpoints (tcp, ephemeral ports) or at its offset of the bases (ipc)."""
    engines = [Engine(seed=30 + r, rank=r) for r in range(2)]
    with contextlib.ExitStack() as stack:
        if ranks_given == "base-and-ranks":
            ep, rep = stack.enter_context(ipc_endpoints())
        else:
            ep, rep = EPHEMERAL, EPHEMERAL
        # heartbeats too rare to add a seq during the test
        pubs = [
            stack.enter_context(EventPublisher(ep, rep, PublisherConfig(heartbeat_s=60), rank=r))
            for r in range(2)
        ]
        engines[0].publish(pubs[0], 6)
        engines[1].publish(pubs[1], 9)
        if ranks_given == "base-and-ranks":
            where = [ep, "--replay", rep, "--ranks", "2"]
        else:
            where = []
            for pub in pubs:
                assert pub.bound_replay_endpoint is not None
                where += ["--rank-endpoint", pub.bound_endpoint, pub.bound_replay_endpoint]
        code = main(["watch", *where, "--worker", "gpu7", "--once"])
    out = capsys.readouterr().out
    assert code == 0
    assert "\x1b[" not in out
    rows = [line.split() for line in out.splitlines() if line.startswith("gpu7")]
    assert [(r[1], r[2], r[3]) for r in rows] == [("0", "synced", "6"), ("1", "synced", "9")]
    blocks = {int(r[1]): int(r[10]) for r in rows}  # the BLOCKS column
    assert blocks == {0: len(engines[0].truth), 1: len(engines[1].truth)}


class _Terminal(io.StringIO):
    """A terminal that says when it has shown ``frames`` tables."""

    def __init__(self, frames: int) -> None:
        super().__init__()
        self.frames = frames
        self.enough = asyncio.Event()

    def isatty(self) -> bool:
        return True

    def write(self, s: str) -> int:
        n = super().write(s)
        if self.getvalue().count("kvwire watch") >= self.frames:
            self.enough.set()
        return n


def test_watch_refreshes_in_place_on_a_terminal() -> None:
    """Every table after the first is drawn over it. Counted in frames, not seconds (a
    loaded machine may draw one table in a fixed duration): the watch runs until the
    terminal has shown three, then is stopped."""
    with EventPublisher(EPHEMERAL, EPHEMERAL) as pub:
        ep, rep = pub.bound_endpoint, pub.bound_replay_endpoint
        assert rep is not None
        args = build_parser().parse_args(["watch", ep, "--replay", rep, "--interval", "0.05"])
        Engine(seed=40).publish(pub, 3)
        out = asyncio.run(_watch_frames(args, 3))
    text = out.getvalue()
    frames = text.count("kvwire watch")
    assert frames >= 3
    assert text.count("\x1b[J") == frames - 1  # every frame after the first redraws in place


async def _watch_frames(args: argparse.Namespace, frames: int) -> _Terminal:
    out = _Terminal(frames)
    task = asyncio.create_task(_watch(args, out))
    await asyncio.wait_for(out.enough.wait(), 30)
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task
    return out


def test_watch_without_a_tty_prints_successive_tables(capsys: pytest.CaptureFixture[str]) -> None:
    with EventPublisher(EPHEMERAL) as pub:
        argv = ["watch", pub.bound_endpoint, "--duration", "0.5", "--interval", "0.2"]
        assert main(argv) == 0
    out = capsys.readouterr().out
    assert out.count("kvwire watch") >= 2 and "\x1b[" not in out
    assert "no replay" in out


def test_bad_endpoints_exit_with_a_clear_message(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["dump", "tcp://*:5557"]) == 2
    assert "bind address" in capsys.readouterr().err
    assert main(["watch", "udp://127.0.0.1:1"]) == 2
    assert "unknown scheme" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("argv", "error"),
    [
        ([], "ENDPOINT or every rank's --rank-endpoint"),
        (["tcp://127.0.0.1:5557", "--rank-endpoint", "tcp://127.0.0.1:5558"], "replaces"),
        (["--rank-endpoint", "tcp://127.0.0.1:5558", "--ranks", "2"], "replaces"),
        (["--rank-endpoint", "tcp://127.0.0.1:5558", "--replay", "tcp://127.0.0.1:6"], "replaces"),
        (["--rank-endpoint", "tcp://h:1", "tcp://h:2", "tcp://h:3"], "rank 0: at most"),
        (["--rank-endpoint", "tcp://h:1", "tcp://h:2", "--rank-endpoint", "tcp://h:3"], "every rank"),
        (["--rank-endpoint", "tcp://127.0.0.1:*"], "bind address"),
    ],
)
def test_rank_endpoints_are_checked(
    argv: list[str], error: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["dump", *argv, "--duration", "0.1"]) == 2
    assert error in capsys.readouterr().err


def test_rank_endpoints_are_given_in_rank_order() -> None:
    args = build_parser().parse_args(
        ["dump", "--rank-endpoint", "tcp://h:7", "--rank-endpoint", "tcp://g:3", "--worker", "w"]
    )
    source = _source(args)
    assert [(r.rank, r.endpoint, r.replay_endpoint) for r in source.rank_endpoints()] == [
        (0, "tcp://h:7", None),
        (1, "tcp://g:3", None),
    ]
    assert source.worker_id == "w" and source.ranks == 2


def test_keygen_writes_a_zmq_auth_key_pair(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    import zmq.auth

    assert main(["keygen", "router-1", "--dir", str(tmp_path / "keys")]) == 0
    public, secret = tmp_path / "keys" / "router-1.key", tmp_path / "keys" / "router-1.key_secret"
    assert str(public) in capsys.readouterr().out
    pub, none = zmq.auth.load_certificate(public)
    pub2, sec = zmq.auth.load_certificate(secret)
    assert none is None and pub == pub2 and len(pub) == 40 and sec is not None and len(sec) == 40
    assert secret.stat().st_mode & 0o077 == 0
    assert main(["keygen", "../escape", "--dir", str(tmp_path)]) == 2


def test_curve_keys_go_together_and_must_exist(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["keygen", "engine", "--dir", str(tmp_path)]) == 0
    assert main(["keygen", "router", "--dir", str(tmp_path)]) == 0
    ep = "tcp://127.0.0.1:5557"
    assert main(["dump", ep, "--server-key", str(tmp_path / "engine.key")]) == 2
    assert "go together" in capsys.readouterr().err
    argv = ["dump", ep, "--server-key", str(tmp_path / "engine.key"), "--client-key"]
    assert main([*argv, str(tmp_path / "missing.key_secret")]) == 2
    assert "missing.key_secret" in capsys.readouterr().err
    # A public key where the secret one belongs is refused too.
    assert main([*argv, str(tmp_path / "router.key")]) == 2


def test_dump_reads_a_curve_publisher_with_the_keys_and_nothing_without(tmp_path: Path) -> None:
    from kvwire.security import ServerKeys

    allow = tmp_path / "allow"
    assert main(["keygen", "engine", "--dir", str(tmp_path)]) == 0
    assert main(["keygen", "router", "--dir", str(allow)]) == 0
    keys = ServerKeys(tmp_path / "engine.key_secret", allow)
    with EventPublisher(EPHEMERAL, EPHEMERAL, server_keys=keys) as pub:
        ep, rep = pub.bound_endpoint, pub.bound_replay_endpoint
        assert rep is not None
        for _ in range(3):
            assert pub.publish(Engine(seed=5).batch())
        base = [sys.executable, "-m", "kvwire.cli", "dump", ep, "--replay", rep]
        keyed = [*base, "--count", "3", "--duration", "20", "--server-key",
                 str(tmp_path / "engine.key"), "--client-key", str(allow / "router.key_secret")]  # fmt: skip
        proc = subprocess.run(keyed, cwd=ROOT, capture_output=True, text=True, timeout=60)
        assert proc.returncode == 0, proc.stderr
        assert [json.loads(line)["seq"] for line in proc.stdout.splitlines()] == [0, 1, 2]
        bare = subprocess.run([*base, "--duration", "2"], cwd=ROOT, capture_output=True,
                              text=True, timeout=60)  # fmt: skip
        assert bare.returncode == 0 and bare.stdout == ""


def test_subcommands_are_required() -> None:
    with pytest.raises(SystemExit):
        build_parser().parse_args([])
    assert isinstance(build_parser(), argparse.ArgumentParser)
