"""The fault scenarios against engine processes on loopback (no Docker)."""

from __future__ import annotations

from pathlib import Path

import pytest

from .harness import EngineSpec, LocalEngine
from .scenarios import SCENARIOS


@pytest.mark.timeout(120)
@pytest.mark.parametrize("name", sorted(SCENARIOS))
def test_fault_on_loopback(name: str, tmp_path: Path) -> None:
    SCENARIOS[name](lambda spec: LocalEngine(spec, tmp_path))


# A quick guard that the harness itself can fail: a router that never started
# must not be reported as converged.
def test_converge_fails_without_a_router(tmp_path: Path) -> None:
    from .harness import cluster, converge, quiesce

    with cluster(lambda s: LocalEngine(s, tmp_path), [EngineSpec("solo", ranks=1)], start_router=False) as (
        engines,
        router,
    ):
        quiesce(engines)
        with pytest.raises(AssertionError, match="did not converge"):
            converge(router, engines, 0.0, timeout=1.0)
