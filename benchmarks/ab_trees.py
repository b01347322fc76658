"""Two (or more) built trees measured in one process, runs alternated: the before/after table.

A change that must lose no speed is judged against the tree before it on the same host at the
same time. On a shared machine two processes' medians differ by more than the effects asked
about, so this loads each tree's ``kvwire`` package (its own built extensions) and its own
benchmark scripts into one process once, puts that tree's modules into ``sys.modules`` before
each of its runs, and alternates the trees A B B A ...: a host that slows down moves both alike,
and the ratio of each run to the neighbouring run of the first tree (the "paired" column) says
more than two medians would. Each tree runs its own ``benchmarks/*.py``, so a tree whose API
changed brings the bench code that speaks it; what this script calls in them is
``engine_thread_bench.throughput_run`` / ``engine_run`` / ``calibrate`` / ``cores`` /
``gil_free_spin``, ``index_bench.Workload`` / ``KvwireSide`` / ``_median_us`` and
``subscriber_bench.make_frames`` / ``decode_rate`` / ``core_rate`` / ``index_rate`` /
``transport_rates``.

Sections (``--sections``; all but ``transport`` by default):

- ``cpu``: ``engine_thread_bench``'s cpu table: whole-process CPU µs per stored block,
  publishing as fast as the loop can into a SUB in another process (``--cases``, ``--sizes``);
- ``engine``: ``engine_thread_bench``'s engine table: the engine loop pinned alone on one
  core ("cpu": 1 ms of Python; "gpu": 200 µs of Python and 1.5 ms without the GIL), blocks of
  iterations with and without publishing alternated; the paired iteration ratio (with /
  without) and the publishing call's median time;
- ``index``: ``index_bench``'s ``independent`` workload (64 workers): ``apply_payload`` into a
  fresh index (unhinted, capacity-hinted, one-block events) and ``decode_batch`` + ``apply``
  (a ``Subscriber``'s general path), match from a cold list, a fresh list and precomputed keys;
- ``subscriber``: ``subscriber_bench``'s in-process figures, per CPU second of the calling
  thread: ``decode_batch`` alone, decode + sequencing to a no-op sink, and sequencing into a
  ``PrefixIndex`` by payload bytes, B = 16 and 256;
- ``transport``: ``subscriber_bench``'s 64 ranks over tcp into a ``Subscriber``: blocks per
  CPU second of the subscriber process (the sender runs in a child process).
- ``holders``: the index's holder sets at 1, 8, 64 and 1,024 ranks (``--holder-ranks``), by the
  public ``PrefixIndex`` API only (defined here, so a tree needs no bench code for it): every
  rank stores its own content-chained runs of 64 blocks, and the same 256 blocks as every other
  rank (a prefix that all ranks hold), by ``apply_payload``, 4 runs a batch; the index's bytes
  per distinct block (``IndexStats.memory_bytes`` / nodes), apply per CPU second, and the match
  of a stored prompt (token list) that one rank holds and of one that every rank holds.

Run (each tree a checkout with its extensions built in place, as ``make venv`` leaves it)::

    .venv/bin/python benchmarks/ab_trees.py OLD_TREE NEW_TREE [--runs 10] [--quick]
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import json
import logging
import os
import pkgutil
import statistics
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Any

BENCHES = ("engine_thread_bench", "index_bench", "subscriber_bench")
SECTIONS = ("cpu", "engine", "index", "subscriber", "transport", "holders")


def _ours(name: str) -> bool:
    return name in BENCHES or name.split(".")[0] in ("kvwire", "tests")


def _clear() -> None:
    for name in [k for k in sys.modules if _ours(k)]:
        del sys.modules[name]


@dataclass
class Tree:
    """One checkout: its kvwire modules and bench modules, as imported from it."""

    root: str
    label: str
    modules: dict[str, ModuleType] = field(default_factory=dict)
    state: dict[str, Any] = field(default_factory=dict)  # per section, built once per tree

    def bench(self, name: str) -> Any:
        return self.modules[name]


@contextlib.contextmanager
def active(tree: Tree) -> Iterator[None]:
    """``tree``'s modules in ``sys.modules``, its root and benchmarks first on ``sys.path``
    (a spawned child imports the bench module from there) and in ``PYTHONPATH`` (a child
    started by ``subprocess`` imports this tree's kvwire)."""
    _clear()
    sys.modules.update(tree.modules)
    entries = [str(Path(tree.root) / "benchmarks"), tree.root]
    saved_path, saved_env = list(sys.path), os.environ.get("PYTHONPATH")
    sys.path[0:0] = entries
    os.environ["PYTHONPATH"] = os.pathsep.join([*entries, *filter(None, [saved_env])])
    try:
        yield
    finally:
        sys.path[:] = saved_path
        if saved_env is None:
            os.environ.pop("PYTHONPATH", None)
        else:
            os.environ["PYTHONPATH"] = saved_env
        _check(tree)


def _check(tree: Tree) -> None:
    """Every kvwire module the run used came from ``tree`` (a lazy import could reach another)."""
    for name, mod in sys.modules.items():
        where = getattr(mod, "__file__", None) or ""
        if name.split(".")[0] == "kvwire" and where and not where.startswith(tree.root + os.sep):
            raise SystemExit(f"{tree.root}: {name} was imported from {where}")


def load(root: str, label: str) -> Tree:
    """Import every kvwire module of ``root`` (so no later lazy import reaches another tree)
    and its bench scripts, afresh."""
    tree = Tree(root, label)
    _clear()
    saved = list(sys.path)
    sys.path[0:0] = [str(Path(root) / "benchmarks"), root]
    importlib.invalidate_caches()
    try:
        pkg = importlib.import_module("kvwire")
        for info in pkgutil.walk_packages(pkg.__path__, "kvwire."):
            # Optional dependencies (an engine, torch) missing: that module is not benchmarked.
            with contextlib.suppress(ImportError):
                importlib.import_module(info.name)
        for name in BENCHES:
            importlib.import_module(name)
    finally:
        sys.path[:] = saved
    tree.modules = {k: v for k, v in sys.modules.items() if _ours(k)}
    _check(tree)
    return tree


# --- what one run of one tree measures: (figure, unit, higher is better) -> value ----------

Figure = tuple[str, str, bool]
Measure = Callable[[Tree], dict[Figure, float]]


def cpu_section(cases: list[str], sizes: list[int], quick: bool) -> Measure:
    def measure(tree: Tree) -> dict[Figure, float]:
        bench = tree.bench("engine_thread_bench")
        out: dict[Figure, float] = {}
        for case in cases:
            for b in sizes:
                n = (4000 if quick else 10_000) if b <= 16 else (600 if quick else 1500)
                cpu, gaps = bench.throughput_run(case, b, n)
                if gaps:
                    raise SystemExit(f"{tree.root}: {case} B={b}: {gaps} seq gaps")
                out[(f"cpu {case} B={b}", "µs/block", False)] = cpu
        return out

    return measure


def engine_section(
    cases: list[str], sizes: list[int], quick: bool
) -> tuple[Callable[[Tree], Any], Measure]:
    """The engine table's figures: the engine loop pinned alone on one core, blocks of
    iterations with and without publishing alternated; per case, loop and size the paired
    iteration ratio (with / without) and the publishing call's median time."""
    block_iters, rounds = (40, 6) if quick else (60, 8)
    spins: dict[str, int] = {}

    def prepare(tree: Tree) -> Any:
        bench = tree.bench("engine_thread_bench")
        bench._GPU_WAIT = bench.gil_free_spin()  # the bench's default wait (--gpu-wait spin)
        if not spins:  # the loop's work, calibrated once on the engine's core for every tree
            engine_core, other = bench.cores()
            me = threading.get_native_id()
            os.sched_setaffinity(me, engine_core)
            spins.update(cpu=bench.calibrate(0.001), gpu=bench.calibrate(0.0002))
            os.sched_setaffinity(me, other | engine_core)
        return None

    def measure(tree: Tree) -> dict[Figure, float]:
        bench = tree.bench("engine_thread_bench")
        out: dict[Figure, float] = {}
        for case in cases:
            for loop in ("cpu", "gpu"):
                for b in sizes:
                    _, _, pairs, call, _, gaps = bench.engine_run(
                        case, b, loop, block_iters, rounds, spins
                    )
                    if gaps:
                        raise SystemExit(f"{tree.root}: {case} {loop} B={b}: {gaps} seq gaps")
                    name = f"engine {loop} {case} B={b}"
                    out[(f"{name} iteration", "with/without", False)] = 1 + statistics.median(pairs)
                    out[(f"{name} call", "µs", False)] = call
        engine_core, other = bench.cores()  # engine_run leaves this thread on the other cores
        os.sched_setaffinity(threading.get_native_id(), engine_core | other)
        return out

    return prepare, measure


def index_section(seqs: int, lookups: int) -> tuple[Callable[[Tree], Any], Measure]:
    def prepare(tree: Tree) -> Any:
        bench = tree.bench("index_bench")
        return bench.KvwireSide(bench.Workload("independent", 64, seqs, 1, lookups))

    def measure(tree: Tree) -> dict[Figure, float]:
        bench, side = tree.bench("index_bench"), tree.state["index"]
        blocks = side.wl.blocks
        out: dict[Figure, float] = {}
        # Per CPU second of this process: apply runs in the calling thread, so its CPU time
        # is its cost whatever else the host runs (the bench's own figure is wall clock).
        _, cpu, _ = side.build(small=True)
        out[("index apply, one-block events", "M blocks/CPU s", True)] = blocks / cpu / 1e6
        _, cpu, _ = side.build(hint=True)
        out[("index apply, hinted", "M blocks/CPU s", True)] = blocks / cpu / 1e6
        _, cpu, _ = side.build(general=True)
        out[("index apply, decode_batch + apply", "M blocks/CPU s", True)] = blocks / cpu / 1e6
        _, cpu, _ = side.build()
        out[("index apply", "M blocks/CPU s", True)] = blocks / cpu / 1e6
        side.check()
        med = bench._median_us
        out[("index match, cold list", "µs", False)] = med(side.match_list())
        out[("index match, fresh list", "µs", False)] = med(side.match_fresh())
        out[("index match, keys", "µs", False)] = med(side.match_keys(side.keys()))
        side.index = None
        return out

    return prepare, measure


HOLDER_BS = 16
HOLDER_RUN = 64  # blocks a stored sequence
HOLDER_SHARED = 256  # blocks every rank holds
_holder_work: dict[tuple[int, int], Any] = {}


def _holder_workload(ranks: int, per_rank: int) -> Any:
    """Payloads per rank and the prompts to match, built once (wire bytes: the same for every
    tree); a distinct prompt is one rank's run, the shared one the common prefix."""
    key = (ranks, per_rank)
    if key in _holder_work:
        return _holder_work[key]
    import random

    import numpy as np

    from kvwire.wire import BlockStored, KVEventBatch, encode_batch

    rng = np.random.default_rng(ranks)
    pyrng = random.Random(ranks)
    shared_tok = rng.integers(1, 50_000, HOLDER_SHARED * HOLDER_BS).tolist()
    shared_hashes = [pyrng.getrandbits(62) for _ in range(HOLDER_SHARED)]
    payloads: list[tuple[str, bytes]] = []
    prompts: list[list[int]] = []
    for r in range(ranks):
        runs: list[Any] = []
        for a in range(0, HOLDER_SHARED, HOLDER_RUN):
            runs.append(BlockStored(shared_hashes[a : a + HOLDER_RUN],
                                    shared_hashes[a - 1] if a else None,
                                    shared_tok[a * HOLDER_BS : (a + HOLDER_RUN) * HOLDER_BS], HOLDER_BS))  # fmt: skip
        for _ in range(per_rank // HOLDER_RUN):
            tok = rng.integers(1, 50_000, HOLDER_RUN * HOLDER_BS).tolist()
            runs.append(BlockStored([pyrng.getrandbits(62) for _ in range(HOLDER_RUN)], None, tok, HOLDER_BS))
            if len(prompts) < 200 and pyrng.random() < 0.5:
                prompts.append(tok)
        for a in range(0, len(runs), 4):
            payloads.append((f"w{r}", encode_batch(KVEventBatch(0.0, runs[a : a + 4], 0))))
    pyrng.shuffle(payloads)  # ranks interleaved, as a router's batches arrive
    work = (payloads, prompts, shared_tok)
    _holder_work[key] = work
    return work


def holders_section(rank_counts: list[int], quick: bool) -> Measure:
    def measure(tree: Tree) -> dict[Figure, float]:
        from kvwire.prefix_index import PrefixIndex

        out: dict[Figure, float] = {}
        for ranks in rank_counts:
            # about 300 k blocks a size (1 M at 1,024 ranks); a rank at most 20,000
            per_rank = max(HOLDER_RUN, min(20_000, (300_000 if ranks < 1024 else 1_000_000) // ranks))
            if quick:
                per_rank = max(HOLDER_RUN, per_rank // 4)
            payloads, prompts, shared = _holder_workload(ranks, per_rank)
            index = PrefixIndex(HOLDER_BS)
            blocks = ranks * (per_rank // HOLDER_RUN * HOLDER_RUN + HOLDER_SHARED)
            t0 = time.process_time()
            for worker, payload in payloads:
                index.apply_payload(worker, 0, payload)
            cpu = time.process_time() - t0
            stats = index.stats()
            out[(f"holders {ranks} ranks: index bytes/block", "B", False)] = stats.memory_bytes / index._core.nodes
            out[(f"holders {ranks} ranks: apply", "M blocks/CPU s", True)] = blocks / cpu / 1e6
            one, every = [], []
            for tok in prompts:
                t0 = time.perf_counter()
                m = index.match(tok)
                one.append(time.perf_counter() - t0)
                assert len(m) == 1, len(m)
                t0 = time.perf_counter()
                m = index.match(shared)
                every.append(time.perf_counter() - t0)
                assert len(m) == ranks, len(m)
            out[(f"holders {ranks} ranks: match, one holder", "µs", False)] = statistics.median(one) * 1e6
            out[(f"holders {ranks} ranks: match, all hold", "µs", False)] = statistics.median(every) * 1e6
            del index
        return out

    return measure


def subscriber_section(quick: bool) -> tuple[Callable[[Tree], Any], Measure]:
    def prepare(tree: Tree) -> Any:
        bench = tree.bench("subscriber_bench")
        frames = {}
        for b in (16, 256):
            n = max(1_000, (100_000 if quick else 400_000) // b)
            frames[b] = bench.make_frames(b, n)
            bench.core_rate(frames[b][:200], b)  # warm up
        return frames

    def measure(tree: Tree) -> dict[Figure, float]:
        bench, frames = tree.bench("subscriber_bench"), tree.state["subscriber"]
        out: dict[Figure, float] = {}
        for b, f in frames.items():
            head = f[: max(1_000, 100_000 // b)]
            runs: list[tuple[str, Callable[..., float], tuple[Any, ...], int]] = [
                (f"decode_batch alone B={b}", bench.decode_rate, (f, b), len(f)),
                (f"subscriber decode+sequencing B={b}", bench.core_rate, (f, b), len(f)),
                (
                    f"subscriber into PrefixIndex, bytes B={b}",
                    bench.index_rate,
                    (head, b, True),
                    len(head),
                ),
            ]
            for name, fn, fn_args, n in runs:
                # Per CPU second of this thread (the bench's own figure is wall clock): the
                # work runs in the calling thread, so the rest of the host moves it less.
                c0 = time.thread_time()
                fn(*fn_args)
                out[(name, "M blocks/CPU s", True)] = n * b / (time.thread_time() - c0) / 1e6
        return out

    return prepare, measure


def transport_section(quick: bool) -> Measure:
    def measure(tree: Tree) -> dict[Figure, float]:
        bench = tree.bench("subscriber_bench")
        out: dict[Figure, float] = {}
        for b in (16, 256):
            per_rank = max(200, (500_000 if quick else 2_000_000) // b // bench.TRANSPORT_RANKS)
            _, cpu, _ = bench.transport_rates(b, bench.TRANSPORT_RANKS, per_rank, 1)
            out[(f"transport per subscriber CPU s, B={b}", "M blocks/s", True)] = cpu[0] / 1e6
        return out

    return measure


# --- main ------------------------------------------------------------------------------------


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "trees", nargs="+", help="checkouts with kvwire built in place; the first is the baseline"
    )
    parser.add_argument(
        "--labels", nargs="+", help="a short name per tree (default: the directory's)"
    )
    parser.add_argument(
        "--runs", type=int, default=None,
        help="runs per tree (default 10, --quick 6); even, so each tree runs first as often",
    )  # fmt: skip
    parser.add_argument("--sections", nargs="+", choices=SECTIONS, default=list(SECTIONS[:4]))
    parser.add_argument("--cases", nargs="+", default=["kvwire-wire"],
                        help="engine_thread_bench cases of the cpu section (kvwire-plugin needs vLLM's wheel)")  # fmt: skip
    parser.add_argument("--sizes", nargs="+", type=int, default=[16, 256])
    parser.add_argument("--holder-ranks", nargs="+", type=int, default=[1, 8, 64, 1024],
                        help="rank counts of the holders section")  # fmt: skip
    parser.add_argument("--quick", action="store_true",
                        help="fewer batches, sequences and lookups per run: a few minutes in all")  # fmt: skip
    parser.add_argument("--save", metavar="PATH",
                        help="also write every run's figures as JSON (labels, per tree per figure the runs)")  # fmt: skip
    args = parser.parse_args()
    roots = [os.path.abspath(t) for t in args.trees]
    labels = args.labels or [Path(r).name for r in roots]
    if len(labels) != len(roots) or len(set(labels)) != len(labels):
        raise SystemExit("--labels: one distinct label per tree")
    runs = args.runs or (6 if args.quick else 10)
    logging.getLogger("kvwire").setLevel(logging.ERROR)  # the plugin's loopback-bind warning

    started = time.monotonic()
    trees = [load(r, label) for r, label in zip(roots, labels, strict=True)]
    measures: list[Measure] = []
    prepares: dict[str, Callable[[Tree], Any]] = {}
    if "cpu" in args.sections:
        measures.append(cpu_section(args.cases, args.sizes, args.quick))
    if "engine" in args.sections:
        prepares["engine"], m = engine_section(args.cases, args.sizes, args.quick)
        measures.append(m)
    if "index" in args.sections:
        prepares["index"], m = index_section(
            100 if args.quick else 200, 1000 if args.quick else 2000
        )
        measures.append(m)
    if "subscriber" in args.sections:
        prepares["subscriber"], m = subscriber_section(args.quick)
        measures.append(m)
    if "transport" in args.sections:
        measures.append(transport_section(args.quick))
    if "holders" in args.sections:
        measures.append(holders_section(args.holder_ranks, args.quick))
    for tree in trees:
        with active(tree):
            for name, prepare in prepares.items():
                tree.state[name] = prepare(tree)

    results: list[dict[Figure, list[float]]] = [{} for _ in trees]
    for r in range(runs):
        for measure in measures:
            order = list(range(len(trees))) if r % 2 == 0 else list(reversed(range(len(trees))))
            for k in order:
                with active(trees[k]):
                    for fig, value in measure(trees[k]).items():
                        results[k].setdefault(fig, []).append(value)
        print(f"run {r + 1} of {runs} done, {time.monotonic() - started:.0f} s", flush=True)
    report(trees, results)
    if args.save:
        figures = [
            {"name": n, "unit": u, "higher": h, "runs": [res[(n, u, h)] for res in results]}
            for n, u, h in results[0]
        ]
        with open(args.save, "w") as f:
            json.dump({"labels": labels, "figures": figures}, f, indent=1)
    print(f"\n{runs} runs per tree, {time.monotonic() - started:.0f} s in all")


def report(trees: list[Tree], results: list[dict[Figure, list[float]]]) -> None:
    """Medians per tree; for each later tree the median of its per-run ratios to the first
    tree's run in the same round, and the change in the direction that is better."""
    base = trees[0].label
    head = f"{'figure':<42} {'unit':<11}" + "".join(f" {t.label[:14]:>14}" for t in trees)
    head += "".join(
        f"  {t.label[:10] + '/' + base[:10] + ' (gain)':>23} {'paired [range]':>21}"
        for t in trees[1:]
    )
    print(
        "\nmedians, each tree's runs alternated in one process (↑ higher is better, ↓ lower; "
        "gain: the change in the better direction)"
    )
    print(head)
    print("-" * len(head))
    for fig in results[0]:
        name, unit, higher = fig
        meds = [statistics.median(res[fig]) for res in results]
        row = f"{name:<42} {unit + (' ↑' if higher else ' ↓'):<11}"
        row += "".join(f" {m:>14.4g}" for m in meds)
        for k in range(1, len(trees)):
            paired = [b / a for a, b in zip(results[0][fig], results[k][fig], strict=True)]
            change = meds[k] / meds[0] - 1 if higher else meds[0] / meds[k] - 1
            row += f"  {meds[k] / meds[0]:>12.3f} ({change * 100:+6.1f}%)"
            row += f" {statistics.median(paired):>6.3f} [{min(paired):.2f}..{max(paired):.2f}]"
        print(row)


if __name__ == "__main__":
    main()
