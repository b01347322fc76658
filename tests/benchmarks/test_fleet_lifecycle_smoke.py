"""Smoke test of ``benchmarks/fleet_lifecycle.py --quick``: the script runs end to end.

Not a timing assertion: the figures depend on the host. It checks what must hold on
any host: the engine simulators' truth and the router's view agree where a router
can be exact (kvwire publishers with snapshots; stock publishers followed from their
first batch), and a cold start on stock publishers leaves PARTIAL ranks.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "fleet_lifecycle.py"


@pytest.mark.timeout(90)
def test_fleet_lifecycle_quick_smoke(tmp_path: Path) -> None:
    out = tmp_path / "rows.json"
    run = subprocess.run(
        [
            sys.executable,
            str(SCRIPT),
            "--quick",
            "--cases",
            "1,2,6",
            "--window",
            "0.5",
            "--engines",
            "1",
            "--ranks-per-engine",
            "16",
            "--blocks",
            "1000",
            "--buffer",
            "16",
            "--case6-procs",
            "2",
            "--case6-ranks",
            "32",
            "--json",
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=80,
    )
    assert run.returncode == 0, run.stderr[-4000:]
    rows = {r["case"].split()[0]: r for r in json.loads(out.read_text())}
    assert set(rows) == {"1", "2", "6"}, rows
    assert rows["1"]["exact"] == "yes" and rows["1"]["partial"] == "0", rows["1"]
    assert rows["6"]["exact"] == "yes" and rows["6"]["partial"] == "0", rows["6"]
    # No snapshot and history longer than the replay buffer: every rank PARTIAL.
    assert int(rows["2"]["partial"]) == rows["2"]["ranks"], rows["2"]
    assert rows["2"]["exact"].startswith("NO"), rows["2"]
