"""Whole-process CPU per block of two (or more) builds in one process (issue 10).

Each tree's ``kvwire`` package (its own built ``_sender``) is imported once and swapped in
``sys.modules`` before each run of ``engine_thread_bench.throughput_run``, the trees alternated
A B B A ...: a noisy host then moves both builds alike, and the paired ratio of each pair of
runs says more than two processes' medians would.

Run: ``python benchmarks/ab_trees.py kvwire-wire 256 10 /path/to/old /path/to/new`` (case,
blocks per batch, runs per tree, then trees holding a built ``kvwire``; ``--batches`` as the
bench: 1,500 at B=256, 10,000 at B=16).
"""

from __future__ import annotations

import argparse
import importlib
import logging
import os
import statistics
import sys
from pathlib import Path
from types import ModuleType


def load(tree: str) -> dict[str, ModuleType]:
    """The tree's kvwire modules (what the bench's cases import), imported afresh."""
    for name in [k for k in sys.modules if k == "kvwire" or k.startswith("kvwire.")]:
        del sys.modules[name]
    sys.path.insert(0, tree)
    importlib.invalidate_caches()
    for name in ("kvwire.publisher", "kvwire.integrations.vllm", "kvwire.integrations.adapter"):
        importlib.import_module(name)
    sys.path.remove(tree)
    mods = {k: v for k, v in sys.modules.items() if k == "kvwire" or k.startswith("kvwire.")}
    where = mods["kvwire.publisher._sender"].__file__ or ""
    if not where.startswith(tree):
        raise SystemExit(f"{tree}: imported {where} instead")
    return mods


def use(mods: dict[str, ModuleType]) -> None:
    for name in [k for k in sys.modules if k == "kvwire" or k.startswith("kvwire.")]:
        del sys.modules[name]
    sys.modules.update(mods)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("case")
    parser.add_argument("blocks", type=int)
    parser.add_argument("runs", type=int)
    parser.add_argument("trees", nargs="+")
    parser.add_argument("--batches", type=int, default=None)
    args = parser.parse_args()
    here = Path(__file__).resolve().parent
    sys.path.insert(0, str(here))
    sys.path.insert(0, str(here.parent))  # tests.integrations.engines, for vLLM's wheel
    import engine_thread_bench as bench

    sys.path.remove(str(here.parent))
    logging.getLogger("kvwire").setLevel(logging.ERROR)
    trees = [os.path.abspath(t) for t in args.trees]
    n = args.batches or (10_000 if args.blocks <= 16 else 1500)
    builds = [load(t) for t in trees]
    res: list[list[float]] = [[] for _ in trees]
    for r in range(args.runs):
        order = range(len(trees)) if r % 2 == 0 else reversed(range(len(trees)))
        for k in order:
            use(builds[k])
            cpu, gaps = bench.throughput_run(args.case, args.blocks, n)
            if gaps:
                raise SystemExit(f"{trees[k]}: {gaps} gaps")
            res[k].append(cpu)
    for tree, v in zip(trees, res, strict=True):
        print(
            f"{args.case} B={args.blocks} {tree}: median {statistics.median(v):.4f} "
            f"[{min(v):.4f}..{max(v):.4f}] µs a block, {len(v)} runs"
        )
    for k in range(1, len(trees)):
        ratio = [b / a for a, b in zip(res[0], res[k], strict=True)]
        print(
            f"  paired {trees[k]} / {trees[0]}: median {statistics.median(ratio):.3f} "
            f"[{min(ratio):.3f}..{max(ratio):.3f}]"
        )


if __name__ == "__main__":
    main()
