"""A checkpoint's import into a PrefixIndex, and what a second thread gets done meanwhile.

A router restarting from its checkpoint (or cloning a peer) imports every rank's view with
``PrefixIndex.import_ranks``, ``--per-call`` views a call; its event loop and its engines'
receivers are other threads of the same process. This times the import of ``--ranks`` views
of ``--blocks`` blocks each (the first ``--shared`` of them a chain every rank holds) into a
fresh index alone, then again beside a second thread running a pure-Python loop (a stand-in
for the loop thread), whose iterations during it are counted against its rate alone: "other"
is the share of a core the second thread got while the import ran (0% when the import holds
the GIL throughout), "CPU" the importing thread's CPU time then.

Trees are compared side by side: ``--trees A B`` runs each run of each tree in a child
process of that tree's ``kvwire`` (built in place), alternated A B B A ..., all importing the
same views (written once by this tree)::

    .venv/bin/python benchmarks/import_bench.py [--trees OLD NEW] [--ranks 64] [--blocks 20000]
"""

from __future__ import annotations

import argparse
import json
import os
import pickle
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from typing import Any

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BS = 16


def build_views(ranks: int, blocks: int, shared: int) -> list[bytes]:
    import numpy as np

    from kvwire.prefix_index import PrefixIndex

    src = PrefixIndex(BS)
    for r in range(ranks):
        src.add_rank("w", r)
    core, chain, root = src._core, src._scheme.native, src._scheme.root(None, None)
    common = np.arange(shared * BS, dtype=np.uint64)
    for r in range(ranks):
        own = np.arange((blocks - shared) * BS, dtype=np.uint64) + np.uint64((r + 1) << 40)
        hashes = [(r << 32) + i + 1 for i in range(blocks)]
        tokens = np.concatenate([common, own])
        core.store(src._sids[("w", r)], chain, hashes, None, tokens, False, root, None, 0)
    return [src.export_rank("w", r) for r in range(ranks)]


class Spinner:
    """A thread counting loop iterations (pure Python: it needs the GIL for each) while running."""

    def __init__(self) -> None:
        self.n = 0
        self.running = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while self.running.wait():
            self.n += 1

    def rate(self, seconds: float) -> float:
        n0, t0 = self.n, time.perf_counter()
        time.sleep(seconds)
        return (self.n - n0) / (time.perf_counter() - t0)


def timed_import(views: list[bytes], per_call: int) -> tuple[float, float]:
    """Wall and CPU seconds of this thread for an import of every view into a fresh index."""
    from kvwire.prefix_index import PrefixIndex

    idx = PrefixIndex(BS)
    named = [("w", r, v) for r, v in enumerate(views)]
    c0, t0 = time.thread_time(), time.perf_counter()
    for i in range(0, len(named), per_call):
        idx.import_ranks(named[i : i + per_call])
    return time.perf_counter() - t0, time.thread_time() - c0


def one_tree(views: list[bytes], per_call: int, repeats: int) -> dict[str, float]:
    """Medians over `repeats` imports alone, and as many beside the spinner (this process's kvwire)."""
    spin = Spinner()
    out: dict[str, list[float]] = {"alone_s": [], "wall_s": [], "cpu_s": [], "other": []}
    for _ in range(repeats):
        out["alone_s"].append(timed_import(views, per_call)[0])
        spin.running.set()
        alone = spin.rate(0.3)
        n0 = spin.n
        wall, cpu = timed_import(views, per_call)
        out["other"].append((spin.n - n0) / (alone * wall))
        spin.running.clear()
        out["wall_s"].append(wall)
        out["cpu_s"].append(cpu)
    return {k: statistics.median(v) for k, v in out.items()}


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument(
        "--trees", nargs="+", default=[HERE], help="checkouts to compare (default: this one)"
    )
    ap.add_argument("--ranks", type=int, default=64)
    ap.add_argument("--blocks", type=int, default=20_000, help="blocks a rank (default 20,000)")
    ap.add_argument("--shared", type=int, default=256, help="blocks every rank holds (default 256)")
    ap.add_argument(
        "--per-call", type=int, default=64, help="views an import_ranks call (default 64)"
    )
    ap.add_argument("--runs", type=int, default=3, help="child processes a tree (default 3)")
    ap.add_argument("--repeats", type=int, default=3, help="imports a child (default 3)")
    ap.add_argument("--child", metavar="VIEWS", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        with open(args.child, "rb") as f:
            views = pickle.load(f)
        print(json.dumps(one_tree(views, args.per_call, args.repeats)))
        return
    sys.path.insert(0, HERE)
    views = build_views(args.ranks, args.blocks, args.shared)
    blocks = sum((len(v) - 24) // 32 for v in views)
    results: dict[str, list[dict[str, float]]] = {t: [] for t in args.trees}
    with tempfile.NamedTemporaryFile(suffix=".pickle") as f:
        pickle.dump(views, f)
        f.flush()
        order = [
            t for i in range(args.runs) for t in (args.trees if i % 2 == 0 else args.trees[::-1])
        ]
        for tree in order:
            env = {**os.environ, "PYTHONPATH": os.path.abspath(tree)}
            cmd = [
                sys.executable,
                os.path.abspath(__file__),
                "--child",
                f.name,
                "--per-call",
                str(args.per_call),
            ]
            cmd += ["--repeats", str(args.repeats)]
            out = subprocess.run(cmd, env=env, check=True, capture_output=True, text=True, cwd=tree)
            results[tree].append(json.loads(out.stdout.splitlines()[-1]))
    print(
        f"{args.ranks} views of {args.blocks:,} blocks ({blocks:,} in all), {args.per_call} a call;"
    )
    print(f"medians of {args.runs} processes x {args.repeats} imports")
    print("alone: the import with no other thread running; beside: with the spinner running")
    print(
        f"{'tree':24s} {'alone ms':>9s} {'beside ms':>10s} {'CPU ms':>7s} {'M blocks/s':>10s} {'other':>6s}"
    )
    for tree, rs in results.items():
        med: dict[str, Any] = {k: statistics.median(r[k] for r in rs) for k in rs[0]}
        print(
            f"{os.path.basename(os.path.abspath(tree)):24s} {1e3 * med['alone_s']:9.0f} {1e3 * med['wall_s']:10.0f} "
            f"{1e3 * med['cpu_s']:7.0f} {blocks / med['alone_s'] / 1e6:10.2f} {100 * med['other']:5.0f}%"
        )


if __name__ == "__main__":
    main()
