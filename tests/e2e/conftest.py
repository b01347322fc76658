"""Fixtures of the containerised tests: a Docker engine and the engine image, built here.

Nothing is pulled: the image is a Debian root filesystem made with
debootstrap plus wheels of kvwire and its dependencies built on this host.
If any step fails the tests fail with the reason; they are never skipped.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from . import docker_env as de

REPO = Path(__file__).resolve().parents[2]
WHEELS = REPO / "build" / "e2e-wheels"
# What the engine needs inside the container; torch is the CPU build on local disk.
RUNTIME_REQUIREMENTS = ["torch==2.13.0", "pyzmq", "msgspec", "numpy", "sortedcontainers"]


def _run(cmd: list[str], what: str) -> None:
    res = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=900)
    if res.returncode != 0:
        raise RuntimeError(f"{what} failed ({res.returncode}):\n{res.stdout[-3000:]}\n{res.stderr[-3000:]}")


def _build_wheels() -> Path:
    WHEELS.mkdir(parents=True, exist_ok=True)
    stamp = WHEELS / ".requirements"
    want = "\n".join(RUNTIME_REQUIREMENTS)
    if not stamp.exists() or stamp.read_text() != want:
        for old in WHEELS.glob("*.whl"):
            old.unlink()
        _run(
            [sys.executable, "-m", "pip", "download", "-q", "--only-binary=:all:", "-d", str(WHEELS), *RUNTIME_REQUIREMENTS],
            "downloading the engine's dependency wheels",
        )
        stamp.write_text(want)
    for old in WHEELS.glob("kvwire-*.whl"):
        old.unlink()
    # an interrupted build leaves its staging folder behind, and the next build refuses it
    for stale in (REPO / "build").glob("bdist.*"):
        shutil.rmtree(stale, ignore_errors=True)
    _run(
        [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "-w", str(WHEELS), "."],
        "building the kvwire wheel",
    )
    return WHEELS


@pytest.fixture(scope="session")
def engine_image() -> str:
    reason = de.engine_unavailable_reason()
    if reason is not None:
        pytest.fail(f"containerised tests cannot run: {reason}", pytrace=False)
    try:
        de.ensure_engine()
        de.sweep_leftovers()
        wheels = _build_wheels()
        return de.ensure_image(wheels)
    except RuntimeError as exc:
        pytest.fail(f"the Docker engine or the engine image could not be set up:\n{exc}", pytrace=False)


@pytest.fixture
def project_network(engine_image: str) -> Iterator[de.ProjectNetwork]:
    with de.ProjectNetwork(image=engine_image) as net:
        yield net
