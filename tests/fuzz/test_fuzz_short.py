"""A few seconds of the fuzzing campaign (benchmarks/fuzz_campaign.py) on every run."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
CAMPAIGN = ROOT / "benchmarks" / "fuzz_campaign.py"


def run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, str(CAMPAIGN), "--timeout", "120", *args],
        cwd=ROOT, capture_output=True, text=True, timeout=300,
    )  # fmt: skip


def test_subscriber_and_replay_socket_survive_junk_and_legit_rank_ends_exact() -> None:
    proc = run("--frames", "5000", "--replay-requests", "2000", "--control-requests", "0", "--seed", "3")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "PASS" in proc.stdout and "index exact" in proc.stdout
    assert "hostile live frames sent 5,000" in proc.stdout


def test_reference_engine_control_endpoint_refuses_junk_and_stays_up() -> None:
    proc = run("--frames", "200", "--replay-requests", "10", "--control-requests", "300", "--seed", "4")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "300 malformed requests" in proc.stdout and "answered Stats and Probe after" in proc.stdout


def test_every_payload_reader_agrees_on_mutated_payloads() -> None:
    proc = run("--differential", "2000", "--seed", "5")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "PASS" in proc.stdout and "differential: 2,000 payloads" in proc.stdout
