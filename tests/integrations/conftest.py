"""Fixtures for the engine integration tests: the engines' real modules and a clean factory per test."""

from __future__ import annotations

import tomllib
import types
from pathlib import Path
from typing import Any

import pytest

from .engines import SGLANG, VLLM, EngineUnavailable, import_sglang, import_vllm, wheel_cache

REPO = Path(__file__).resolve().parents[2]
DOWNLOAD_TIMEOUT_S = 1800


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """A wheel not cached yet is downloaded by the first test that needs it: give that one time."""
    missing = {
        name for name, version in (VLLM, SGLANG) if not any(wheel_cache().glob(f"{name}-{version}-*.whl"))
    }
    for item in items:
        fixtures = set(getattr(item, "fixturenames", ()))
        if {"vllm", "vllm_session"} & fixtures and "vllm" in missing:
            item.add_marker(pytest.mark.timeout(DOWNLOAD_TIMEOUT_S))
            missing.discard("vllm")
        if {"sglang", "sglang_session"} & fixtures and "sglang" in missing:
            item.add_marker(pytest.mark.timeout(DOWNLOAD_TIMEOUT_S))
            missing.discard("sglang")


def _engine(load: Any) -> types.SimpleNamespace:
    try:
        engine: types.SimpleNamespace = load()
    except EngineUnavailable as exc:
        pytest.fail(f"the engine's wheel is unavailable: {exc}", pytrace=False)
    return engine


@pytest.fixture(scope="session")
def vllm_session() -> types.SimpleNamespace:
    engine = _engine(import_vllm)
    engine.pristine = dict(engine.kv_events.EventPublisherFactory._registry)
    return engine


@pytest.fixture(scope="session")
def sglang_session() -> types.SimpleNamespace:
    engine = _engine(import_sglang)
    engine.pristine = dict(engine.kv_events.EventPublisherFactory._registry)
    return engine


@pytest.fixture
def vllm(vllm_session: types.SimpleNamespace, monkeypatch: pytest.MonkeyPatch) -> types.SimpleNamespace:
    """vLLM's modules with its publisher registry and plugin guard as a fresh process has them."""
    monkeypatch.setattr(vllm_session.kv_events.EventPublisherFactory, "_registry", dict(vllm_session.pristine))
    monkeypatch.setattr(vllm_session.plugins, "plugins_loaded", False)
    monkeypatch.setenv("VLLM_PLUGINS", "kvwire")
    return vllm_session


@pytest.fixture
def sglang(sglang_session: types.SimpleNamespace, monkeypatch: pytest.MonkeyPatch) -> types.SimpleNamespace:
    """SGLang's modules with its publisher registry and plugin guard as a fresh process has them."""
    monkeypatch.setattr(sglang_session.kv_events.EventPublisherFactory, "_registry", dict(sglang_session.pristine))
    monkeypatch.setattr(sglang_session.plugins, "_plugins_loaded", False)
    monkeypatch.setenv("SGLANG_PLUGINS", "kvwire")
    return sglang_session


@pytest.fixture
def kvwire_entry_points(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> dict[str, dict[str, str]]:
    """kvwire's distribution metadata with the entry points pyproject.toml declares.

    Shadows whatever kvwire install the environment has, so the engines'
    plugin loaders find exactly what this checkout would install.
    """
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    groups: dict[str, dict[str, str]] = project.get("entry-points", {})
    info = tmp_path / "site" / f"kvwire-{project['version']}.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: kvwire\nVersion: {project['version']}\n")
    (info / "entry_points.txt").write_text(
        "".join(f"[{g}]\n" + "".join(f"{k} = {v}\n" for k, v in eps.items()) for g, eps in groups.items())
    )
    monkeypatch.syspath_prepend(str(info.parent))
    return groups


