"""The engines' real code, from their wheels: fetched with ``pip download``, imported with few stubs.

The wheels are fetched once into ``~/.cache/kvwire/wheels`` (or
``$KVWIRE_WHEEL_CACHE``) and reused; a failed download raises
:class:`EngineUnavailable` with pip's reason, and the tests fail with it. Only
the ``.py`` files are unpacked. The engines' top-level packages pull in their
whole runtime (CUDA kernels, model code), so each package on the way to the
modules under test is entered without running its ``__init__``, and the one
name vLLM's ``kv_events`` takes from its KV cache manager is stubbed. Every
module the tests exercise (``kv_events``, the config classes, the plugin
loaders, their logging and environment modules) is the engine's own.
"""

from __future__ import annotations

import importlib
import os
import shutil
import subprocess
import sys
import types
import zipfile
from pathlib import Path
from typing import Any

VLLM = ("vllm", "0.33.0")
SGLANG = ("sglang", "0.5.23")


class EngineUnavailable(RuntimeError):
    """An engine's wheel could not be fetched or unpacked."""


def wheel_cache() -> Path:
    return Path(os.environ.get("KVWIRE_WHEEL_CACHE", "~/.cache/kvwire/wheels")).expanduser()


def fetch_wheel(name: str, version: str) -> Path:
    """The engine's wheel, from the cache or ``pip download --no-deps``."""
    cache = wheel_cache()
    found = sorted(cache.glob(f"{name}-{version}-*.whl"))
    if found:
        return found[0]
    cache.mkdir(parents=True, exist_ok=True)
    cmd = [
        sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
        "-d", str(cache), f"{name}=={version}",
    ]  # fmt: skip
    try:
        res = subprocess.run(cmd, capture_output=True, text=True, timeout=1800)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise EngineUnavailable(f"`{' '.join(cmd)}` failed: {exc}") from exc
    found = sorted(cache.glob(f"{name}-{version}-*.whl"))
    if res.returncode != 0 or not found:
        raise EngineUnavailable(
            f"`{' '.join(cmd)}` exited {res.returncode} without a wheel:\n{res.stderr[-3000:]}"
        )
    return found[0]


def unpack(wheel: Path, package: str) -> Path:
    """The wheel's Python sources, unpacked once next to the wheel cache; returns the root."""
    root = wheel_cache().parent / "engines" / wheel.stem
    if (root / ".complete").exists():
        return root
    tmp = root.with_name(root.name + f".tmp{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        with zipfile.ZipFile(wheel) as zf:
            members = [m for m in zf.namelist() if m.startswith(f"{package}/") and m.endswith(".py")]
            zf.extractall(tmp, members)
    except (OSError, zipfile.BadZipFile) as exc:
        shutil.rmtree(tmp, ignore_errors=True)
        raise EngineUnavailable(f"cannot unpack {wheel}: {exc}") from exc
    (tmp / ".complete").touch()
    shutil.rmtree(root, ignore_errors=True)
    tmp.rename(root)
    return root


def _enter_package(name: str, path: Path) -> None:
    """Make ``name`` a package whose submodules load from ``path``, without its ``__init__``."""
    if name in sys.modules:
        return
    mod = types.ModuleType(name)
    mod.__path__ = [str(path)]
    mod.__package__ = name
    sys.modules[name] = mod
    parent, _, child = name.rpartition(".")
    if parent:
        setattr(sys.modules[parent], child, mod)


def _stub(name: str, **attrs: Any) -> None:
    if name in sys.modules:
        return
    mod = types.ModuleType(name)
    mod.__dict__.update(attrs)
    sys.modules[name] = mod


def _sources(engine: tuple[str, str]) -> Path:
    name, version = engine
    return unpack(fetch_wheel(name, version), name)


def import_vllm() -> types.SimpleNamespace:
    """vLLM 0.33's ``kv_events``, ``KVEventsConfig`` and plugin loader."""
    root = _sources(VLLM) / "vllm"
    # vllm/__init__ imports the engine; config/__init__ every config class;
    # distributed/__init__ torch.distributed's process groups.
    for pkg in ("vllm", "vllm.config", "vllm.distributed", "vllm.v1", "vllm.v1.core"):
        _enter_package(pkg, root.joinpath(*pkg.split(".")[1:]))
    # kv_events needs one alias from the KV cache manager, which imports the model runner.
    _stub("vllm.v1.core.kv_cache_utils", ExternalBlockHash=bytes | int)
    return types.SimpleNamespace(
        kv_events=importlib.import_module("vllm.distributed.kv_events"),
        config=importlib.import_module("vllm.config.kv_events"),
        plugins=importlib.import_module("vllm.plugins"),
    )


class _Parallel:
    """The parallel layout SGLang's scheduler would report: one attention-DP rank 0."""

    pp_rank = attn_tp_rank = attn_cp_rank = attn_dp_rank = 0
    attn_dp_size = 1
    dp_rank: int | None = None


def import_sglang() -> types.SimpleNamespace:
    """SGLang 0.5.23's ``kv_events`` (with its ``KVEventsConfig``) and plugin loader."""
    root = _sources(SGLANG) / "sglang"
    # sglang/__init__ imports the frontend language; srt/utils/__init__ the whole runtime.
    for pkg in ("sglang", "sglang.srt", "sglang.srt.utils", "sglang.srt.disaggregation"):
        _enter_package(pkg, root.joinpath(*pkg.split(".")[1:]))
    # The scheduler's parallel layout is process state that a server start fills in.
    _stub("sglang.srt.runtime_context", get_parallel=_Parallel)
    return types.SimpleNamespace(
        kv_events=importlib.import_module("sglang.srt.disaggregation.kv_events"),
        plugins=importlib.import_module("sglang.srt.plugins"),
    )


def main() -> int:
    """Fetch and unpack both engines' wheels (``make engine-wheels``); exit 1 with pip's reason."""
    try:
        for engine in (VLLM, SGLANG):
            print(f"{engine[0]} {engine[1]}: {_sources(engine)}")
    except EngineUnavailable as exc:
        print(f"engine wheels unavailable: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
