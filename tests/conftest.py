"""Shared test helpers: where the captured wire fixtures live."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

FIXTURE_DIR = Path(__file__).resolve().parents[2] / "shared" / "fixtures" / "wire"


def fixture_files() -> list[Path]:
    """Every captured-traffic file; an empty list fails loudly rather than skipping."""
    files = sorted(FIXTURE_DIR.glob("*.json"))
    if not files:
        raise RuntimeError(f"no wire fixtures found in {FIXTURE_DIR}")
    return files


def load_fixture(path: Path) -> dict[str, Any]:
    data: dict[str, Any] = json.loads(path.read_text())
    return data


def hex_frames(message: list[str]) -> list[bytes]:
    return [bytes.fromhex(f) for f in message]


@pytest.fixture(params=fixture_files(), ids=lambda p: p.stem)
def wire_fixture(request: pytest.FixtureRequest) -> dict[str, Any]:
    return load_fixture(request.param)
