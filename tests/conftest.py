"""Shared test helpers: where the captured wire fixtures live (in this repository)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

FIXTURE_DIR = Path(__file__).resolve().parent / "fixtures" / "wire"
"""Captured engine traffic, copied byte for byte (see its README); never regenerated."""


FIXTURE_FILES = sorted(FIXTURE_DIR.glob("*.json"))
"""Every captured-traffic file (tests/wire/test_fixtures.py fails when there are none)."""


def load_fixture(path: Path) -> dict[str, Any]:
    data: dict[str, Any] = json.loads(path.read_text())
    return data


def hex_frames(message: list[str]) -> list[bytes]:
    return [bytes.fromhex(f) for f in message]


@pytest.fixture(params=FIXTURE_FILES, ids=lambda p: p.stem)
def wire_fixture(request: pytest.FixtureRequest) -> dict[str, Any]:
    return load_fixture(request.param)


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    """Show how long each rank took to converge after each end-to-end fault."""
    from tests.e2e.harness import REPORTS

    if REPORTS:
        terminalreporter.section("convergence after faults (target: under 2 s)")
        for line in REPORTS:
            terminalreporter.write_line(line)
