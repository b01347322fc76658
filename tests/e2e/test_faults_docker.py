"""The fault scenarios with engines in containers and the router on the host.

Two engine containers with two ranks each on a project network; the router
connects to them by container address. Faults are Docker's: SIGKILL and
start, pause and unpause, network disconnect and connect.
"""

from __future__ import annotations

import pytest

from . import docker_env as de
from .docker_engine import DockerEngine
from .scenarios import SCENARIOS

pytestmark = pytest.mark.e2e


# The test's own time; building the engine image (the first test's fixture, minutes on
# busy cores) is bounded by its steps' own timeouts (tests/e2e/docker_env.py).
@pytest.mark.timeout(240, func_only=True)
@pytest.mark.parametrize("name", sorted(SCENARIOS))
def test_fault_in_containers(name: str, project_network: de.ProjectNetwork) -> None:
    SCENARIOS[name](lambda spec: DockerEngine(spec, project_network))
