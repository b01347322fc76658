"""Shared test helpers: where the captured wire fixtures live (in this repository)."""

from __future__ import annotations

import json
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import zmq

from kvwire.security import generate_keypair

FIXTURE_DIR = Path(__file__).resolve().parent / "fixtures" / "wire"
"""Captured engine traffic, copied byte for byte (see its README); never regenerated."""


FIXTURE_FILES = sorted(FIXTURE_DIR.glob("*.json"))
"""Every captured-traffic file (tests/wire/test_fixtures.py fails when there are none)."""


def load_fixture(path: Path) -> dict[str, Any]:
    data: dict[str, Any] = json.loads(path.read_text())
    return data


def hex_frames(message: list[str]) -> list[bytes]:
    return [bytes.fromhex(f) for f in message]


@pytest.fixture
def ipc_dir() -> Iterator[str]:
    """A short private directory for ipc endpoints (paths are length-limited)."""
    path = tempfile.mkdtemp(prefix="kvw")
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def zctx() -> Iterator[zmq.Context[Any]]:
    ctx: zmq.Context[Any] = zmq.Context()
    yield ctx
    ctx.destroy(linger=0)


@pytest.fixture
def curve_keys(tmp_path: Path) -> dict[str, Path]:
    """CURVE key pairs for a server and three clients (``NAME`` public, ``NAME_secret``), and
    an allow-list directory (``allow``) that admits alice alone."""
    out: dict[str, Path] = {}
    for name in ("server", "alice", "bob", "mallory"):
        public, secret = generate_keypair(tmp_path / "keys", name)
        out[name] = public
        out[f"{name}_secret"] = secret
    allow = tmp_path / "allow"
    allow.mkdir()
    shutil.copy(out["alice"], allow / "alice.key")
    out["allow"] = allow
    return out


@pytest.fixture(params=FIXTURE_FILES, ids=lambda p: p.stem)
def wire_fixture(request: pytest.FixtureRequest) -> dict[str, Any]:
    return load_fixture(request.param)


PROPERTY_TIMEOUT_S = 600
"""The hang limit of a property test: its examples are a fixed amount of CPU (the
longest, about 10 s), so its wall time grows with what else runs on the cores;
pyproject's 120 s, meant for a test stuck waiting, is too close beside busy cores."""


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        hypothesis = getattr(getattr(item, "obj", None), "is_hypothesis_test", False)
        if hypothesis and item.get_closest_marker("timeout") is None:
            item.add_marker(pytest.mark.timeout(PROPERTY_TIMEOUT_S))


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    """Show how long each rank took to converge after each end-to-end fault."""
    from tests.e2e.harness import REPORTS

    if REPORTS:
        terminalreporter.section("convergence after faults (target: under 2 s)")
        for line in REPORTS:
            terminalreporter.write_line(line)
