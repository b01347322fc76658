"""Prefix index speed and memory, side by side with Dynamo's Rust RadixTree, in one process.

Workloads (one rank per worker, 16-token blocks, engine hashes content-chained: the
same prefix has the same hash on every worker, as vLLM's do):

- ``shared-roots`` (W = 16 and 64): 50 shared roots of 32 blocks; per worker 200
  sequences of 128 blocks, each a random root plus 96 blocks of its own. A worker's
  first sequence on a root stores all 128 blocks in one event; later ones store
  the 96 new blocks under the root's last block.
- ``independent`` (W = 64; the workload of issue 13): as above, but a worker stores
  each root once, as an event of its own, and then only its 96-block sequences
  under the root's last block.
- ``re-store``: the ``independent`` index after every worker's reset
  (``AllBlocksCleared``), its content stored again under new engine hashes (as after
  a resync or an engine restart with another hash seed): the same content arrives
  under hashes never seen, from every worker at once.

One engine batch per event, workers interleaved. Then 2,000 lookups of stored
128-block prompts, given as Python lists of token ids (as tokenizers return them).

Figures. Both sides run in this process, alternated (kvwire first on even repeats,
Dynamo first on odd ones) so that this VM's speed drifting within a run hits both;
ratios are medians of the per-repeat ratios. Dynamo's figures are bimodal on a shared
machine (its background thread on a free core or not), so each line also compares
kvwire's median with Dynamo's best repeat.

- apply: payload bytes -> ``PrefixIndex.apply_payload`` (msgpack straight into the tables;
  a rank's first batch takes ``decode_batch`` + ``apply``); a second line gives kvwire by
  ``decode_batch`` + ``PrefixIndex.apply``, what a ``Subscriber`` sink does today;
  Dynamo: ``RadixTree.apply_event`` on its JSON events (block hashes precomputed,
  outside the timing), timed until a ``find_matches`` queued behind them returns.
  Dynamo applies on a background thread, a second core here: the wall-clock
  figure lets it use two cores, the CPU figure (process CPU time, all threads)
  counts what both cost. A third kvwire line builds the index told each rank's
  capacity (``expected_blocks_per_rank``, the most blocks a worker stores here, as a
  router knows an engine's ``num_gpu_blocks``): tables presized, no growth. Dynamo has
  no such knob; it is compared with Dynamo's same figures.
- apply as small events (``--small-events``, default ``independent``): the same stores as
  one-block events, a batch holding one from each of up to 16 sequences of a worker in
  flight, as engines send a block per request per step; Dynamo: an ``apply_event`` each.
- match from a token list: ``PrefixIndex.match(list)``; Dynamo:
  ``compute_block_hash_for_seq(list)`` + ``find_matches``. Twice: on the lookups' lists
  built once up front (cold in cache by the time each is matched: 2,000 lists of 2,048
  ints), and on a list built just before each call (untimed) from the prompt's numpy
  row, its int objects freshly allocated and warm, as a tokenizer hands them over.
- match from precomputed keys: ``PrefixIndex.match_keys``; Dynamo: ``find_matches``
  on precomputed hashes. Both return results built as read (kvwire's ``Matches``,
  Dynamo's ``OverlapScores``, whose ``.scores`` dict is built on access), so the
  next lines read both whole: kvwire's dict built (``.items()``) against Dynamo
  reading ``.scores``, and against Dynamo not reading it.
- removals (kvwire only, reported): every stored block removed again, 96 hashes a
  ``BlockRemoved`` batch, a worker's in random order, batches shuffled, by ``apply_payload``.
- block keys from numpy tokens; memory per (block, holder) (tables, and RSS growth)
  at the workload scale and at 10 M pairs (--memory-10m).
- a rank's view (``--rank-view``, kvwire only; alone with ``--rank-view-only``): one rank of
  20,000 blocks (content-chained runs of 100) exported (``export_rank``) and imported into a
  fresh index and over a held rank of an index of 16 such ranks (``import_rank``); and the
  same blocks as a snapshot's 200 payloads of 100 blocks applied to a fresh rank with and
  without a ``reserve`` hint first (its time included), into a fresh index and into one
  already holding 15 ranks. Medians of the repeats.

Why Dynamo is bimodal: its ``apply_event`` and ``find_matches`` are requests to a
background thread, answered through a channel, so each call wakes a thread on another
core. On this VM a halted (idle) vCPU takes tens of microseconds to wake, a running one
a few: Dynamo is slow on a quiet machine and fast when the other core is busy. kvwire
does its work in the calling thread. ``--hot-cores`` makes Dynamo's best case
deterministic: every other core runs a spinning process at the lowest priority
(``nice 19``), so a waking thread finds its core awake and preempts the spinner.

Dynamo comes from ``ai-dynamo-runtime`` 1.6.1: importable here, or from the
``.venv-dynamo`` that ``make bench`` creates (its site-packages is put at the end of
``sys.path``; the wheel is abi3). Without it the kvwire figures still print.

    python benchmarks/index_bench.py [--workloads shared-roots independent re-store]
        [--workers 16 64] [--repeats 5] [--lookups 2000] [--memory-10m] [--hot-cores]
        [--rank-view | --rank-view-only]
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

BLOCK = 16
ROOTS = 50
ROOT_BLOCKS = 32
SEQ_BLOCKS = 128
SEQS_PER_WORKER = 200
LOOKUPS = 2000
VOCAB = 32_000
ENGINE_SEED = 0x5EED
RESTORE_SEED = 0x5EEE
TARGETS = {"apply": 2.0, "match_list": 0.25, "match_keys": 0.15}
SMALL_BATCH = 16  # requests in flight a worker: one-block events a batch (--small-events)


# --- workload -------------------------------------------------------------------


class Workload:
    """Token ids and engine hashes of every sequence, and the event order."""

    def __init__(
        self, name: str, workers: int, seqs_per_worker: int, seed: int, lookups: int = LOOKUPS
    ) -> None:
        from kvwire.prefix_index import block_keys

        self.name = name
        self.workers = workers
        rng = np.random.default_rng(seed)
        roots = rng.integers(0, VOCAB, (ROOTS, ROOT_BLOCKS * BLOCK), dtype=np.int64)
        n = workers * seqs_per_worker
        self.spw = seqs_per_worker
        self.root_of = rng.integers(0, ROOTS, n)
        tokens = np.empty((n, SEQ_BLOCKS * BLOCK), dtype=np.int64)
        tokens[:, : ROOT_BLOCKS * BLOCK] = roots[self.root_of]
        tokens[:, ROOT_BLOCKS * BLOCK :] = rng.integers(
            0, VOCAB, (n, (SEQ_BLOCKS - ROOT_BLOCKS) * BLOCK), dtype=np.int64
        )
        self.tokens = tokens
        engine_seed = RESTORE_SEED if name == "re-store" else ENGINE_SEED
        # Engine hashes: an unrelated content-chained hash (another seed), 63-bit.
        self.hashes = np.stack([block_keys(t, BLOCK, seed=engine_seed) >> np.uint64(1) for t in tokens])
        if name == "re-store":
            self.prior = Workload("independent", workers, seqs_per_worker, seed, lookups)
        # (worker, sequence, first block, last block) in arrival order, workers interleaved.
        self.order: list[tuple[int, int, int, int]] = []
        have: list[set[int]] = [set() for _ in range(workers)]
        for j in range(seqs_per_worker):
            for w in range(workers):
                i = w * seqs_per_worker + j
                r = int(self.root_of[i])
                fresh = r not in have[w]
                have[w].add(r)
                if name == "shared-roots":
                    self.order.append((w, i, 0 if fresh else ROOT_BLOCKS, SEQ_BLOCKS))
                    continue
                if fresh:
                    self.order.append((w, i, 0, ROOT_BLOCKS))
                self.order.append((w, i, ROOT_BLOCKS, SEQ_BLOCKS))
        self.blocks = sum(b - a for _, _, a, b in self.order)
        per_worker = np.zeros(workers, dtype=np.int64)
        for w, _, a, b in self.order:
            per_worker[w] += b - a
        # What a router would know from each engine's cache size: the most blocks a rank holds.
        self.expected_per_rank = int(per_worker.max())
        picks = np.random.default_rng(seed + 1).integers(0, n, lookups)
        self.picks = picks
        self.prompts = [tokens[i].tolist() for i in picks]
        self.owner = [(f"worker-{i // seqs_per_worker}", 0) for i in picks]

    def small_batches(self) -> list[list[tuple[int, int, int, int]]]:
        """The same stores as one-block events, a batch holding one from each of up to
        SMALL_BATCH sequences of a worker in flight (as vLLM sends a block per request per
        step), workers interleaved. A sequence joins a batch group only once the root it
        chains on is stored (not by a sequence of the same group)."""
        seqs: list[list[tuple[int, int, int]]] = [[] for _ in range(self.workers)]
        for w, i, a, b in self.order:
            if seqs[w] and seqs[w][-1][0] == i:
                seqs[w][-1] = (i, seqs[w][-1][1], b)  # a fresh root and its tail: one request
            else:
                seqs[w].append((i, a, b))
        per_worker: list[list[list[tuple[int, int, int, int]]]] = []
        for w in range(self.workers):
            groups: list[list[tuple[int, int, int]]] = [[]]
            fresh: set[int] = set()
            for i, a, b in seqs[w]:
                root = int(self.root_of[i])
                if len(groups[-1]) == SMALL_BATCH or (a > 0 and root in fresh):
                    groups.append([])
                    fresh = set()
                if a == 0:
                    fresh.add(root)
                groups[-1].append((i, a, b))
            batches = []
            for g in groups:
                for t in range(max(b - a for _, a, b in g)):
                    batches.append([(w, i, a + t, a + t + 1) for i, a, b in g if a + t < b])
            per_worker.append(batches)
        out = []
        for k in range(max(len(b) for b in per_worker)):
            out += [batches[k] for batches in per_worker if k < len(batches)]
        return out

    def small_payloads(self) -> list[tuple[str, bytes]]:
        from kvwire.wire import BlockStored, KVEventBatch, encode_batch

        out = []
        for batch in self.small_batches():
            evs = [
                BlockStored(
                    block_hashes=[int(self.hashes[i, k])],
                    parent_block_hash=int(self.hashes[i, k - 1]) if k else None,
                    token_ids=self.tokens[i, k * BLOCK : (k + 1) * BLOCK].tolist(),
                    block_size=BLOCK,
                    medium="GPU",
                )
                for _, i, k, _ in batch
            ]
            out.append((f"worker-{batch[0][0]}", encode_batch(KVEventBatch(time.time(), evs, 0))))
        return out

    def payloads(self) -> list[tuple[str, bytes]]:
        from kvwire.wire import BlockStored, KVEventBatch, encode_batch

        out = []
        for w, i, a, b in self.order:
            ev = BlockStored(
                block_hashes=self.hashes[i, a:b].tolist(),
                parent_block_hash=int(self.hashes[i, a - 1]) if a else None,
                token_ids=self.tokens[i, a * BLOCK : b * BLOCK].tolist(),
                block_size=BLOCK,
                medium="GPU",
            )
            out.append((f"worker-{w}", encode_batch(KVEventBatch(time.time(), [ev], 0))))
        return out

    def dynamo_events(
        self, local: list[list[int]], first_id: int = 0, order: list[tuple[int, int, int, int]] | None = None
    ) -> list[tuple[int, bytes]]:
        out = []
        for eid, (w, i, a, b) in enumerate(self.order if order is None else order, first_id):
            blocks = [
                {"block_hash": int(self.hashes[i, k]), "tokens_hash": int(local[i][k])}
                for k in range(a, b)
            ]
            parent = int(self.hashes[i, a - 1]) if a else None
            ev = {"event_id": eid, "data": {"stored": {"parent_hash": parent, "blocks": blocks}},
                  "dp_rank": 0}  # fmt: skip
            out.append((w, json.dumps(ev).encode()))
        return out


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _median_us(ns: list[int]) -> float:
    return float(np.median(np.array(ns, dtype=np.float64))) / 1e3


def _p99_us(ns: list[int]) -> float:
    return float(np.percentile(np.array(ns, dtype=np.float64), 99)) / 1e3


def timed(fn: Callable[[Any], object], args: list[Any]) -> list[int]:
    out = []
    for a in args:
        t0 = time.perf_counter_ns()
        fn(a)
        out.append(time.perf_counter_ns() - t0)
    return out


def timed_fresh(fn: Callable[[Any], object], wl: Workload) -> list[int]:
    """``fn`` on each lookup's prompt as a list built just before the call (untimed), its int
    objects just allocated and warm in cache, as a tokenizer hands them over."""
    out = []
    for i in wl.picks:
        p = wl.tokens[i].tolist()
        t0 = time.perf_counter_ns()
        fn(p)
        out.append(time.perf_counter_ns() - t0)
    return out


# --- the two sides ----------------------------------------------------------------


class KvwireSide:
    name = "kvwire"

    def __init__(self, wl: Workload) -> None:
        self.wl = wl
        self.payloads = wl.payloads()
        self.prior = wl.prior.payloads() if wl.name == "re-store" else None
        self.small_payloads: list[tuple[str, bytes]] | None = None  # built when first applied
        self.index: Any = None

    def build(
        self, general: bool = False, hint: bool = False, small: bool = False
    ) -> tuple[float, float, int]:
        """(wall s, CPU s, RSS growth) of applying every payload to a fresh index.

        ``general``: by ``decode_batch`` + ``apply`` (what a ``Subscriber`` with the
        index as its sink does), not ``apply_payload``. ``hint``: the index told each
        rank's capacity up front (``expected_blocks_per_rank``; Dynamo has no such knob).
        ``small``: the same stores as one-block events (``Workload.small_batches``).
        """
        from kvwire.prefix_index import PrefixIndex
        from kvwire.wire import AllBlocksCleared, KVEventBatch, decode_batch, encode_batch

        self.index = None
        gc.collect()
        index = PrefixIndex(BLOCK, expected_blocks_per_rank=self.wl.expected_per_rank if hint else 0)
        apply = index.apply_payload
        if general:

            def apply(wid: str, rank: int, payload: bytes) -> None:
                index.apply(wid, rank, decode_batch(payload))

        if self.prior is not None:
            for wid, payload in self.prior:
                apply(wid, 0, payload)
            reset = encode_batch(KVEventBatch(0.0, [AllBlocksCleared()], 0))
            for w in range(self.wl.workers):
                apply(f"worker-{w}", 0, reset)
        gc.collect()
        rss0 = rss_bytes()
        payloads = self.payloads
        if small:
            if self.small_payloads is None:
                self.small_payloads = self.wl.small_payloads()
            payloads = self.small_payloads
        w0, c0 = time.perf_counter(), time.process_time()
        for wid, payload in payloads:
            apply(wid, 0, payload)
        wall, cpu = time.perf_counter() - w0, time.process_time() - c0
        self.index = index
        return wall, cpu, rss_bytes() - rss0

    def check(self) -> None:
        for p, owner in zip(self.wl.prompts[:50], self.wl.owner[:50], strict=True):
            got = self.index.match(p).get(owner)
            if got != SEQ_BLOCKS:
                raise AssertionError(f"kvwire matched {got} blocks of a stored sequence")

    def match_list(self) -> list[int]:
        return timed(self.index.match, self.wl.prompts)

    def match_fresh(self) -> list[int]:
        return timed_fresh(self.index.match, self.wl)

    def keys(self) -> list[Any]:
        return [self.index.keys(p) for p in self.wl.prompts]

    def match_keys(self, keys: list[Any]) -> list[int]:
        return timed(self.index.match_keys, keys)

    def match_keys_dict(self, keys: list[Any]) -> list[int]:
        """The result's dict built: what reading every holder costs."""
        m = self.index.match_keys
        return timed(lambda k: m(k).items(), keys)

    def removals(self) -> list[tuple[str, bytes]]:
        """Every stored block removed, 96 hashes a batch, a worker's in random order."""
        from kvwire.wire import BlockRemoved, KVEventBatch, encode_batch

        rng = np.random.default_rng(7)
        held: dict[int, dict[int, None]] = {}
        for w, i, a, b in self.wl.order:
            held.setdefault(w, {}).update(dict.fromkeys(self.wl.hashes[i, a:b].tolist()))
        out = []
        for w, hashes in held.items():
            hs = list(hashes)
            rng.shuffle(hs)  # type: ignore[arg-type]
            for a in range(0, len(hs), 96):
                out.append((f"worker-{w}", encode_batch(KVEventBatch(0.0, [BlockRemoved(hs[a : a + 96])], 0))))
        rng.shuffle(out)  # type: ignore[arg-type]
        return out

    def remove_all(self, payloads: list[tuple[str, bytes]]) -> float:
        """Blocks removed per second by ``payloads`` (all of them) from the built index."""
        held = self.index.stats().holders
        apply = self.index.apply_payload
        t0 = time.perf_counter()
        for wid, payload in payloads:
            apply(wid, 0, payload)
        wall = time.perf_counter() - t0
        left = self.index.stats().holders
        if left:
            raise AssertionError(f"kvwire holds {left} blocks after removing them all")
        return held / wall


def import_dynamo() -> Any:
    """dynamo.llm from this interpreter, else from .venv-dynamo's site-packages."""
    try:
        import dynamo.llm as llm
    except ImportError:
        venv = Path(__file__).resolve().parents[1] / ".venv-dynamo"
        found = sorted(venv.glob("lib/python3*/site-packages"))
        if not found:
            return None
        sys.path.append(str(found[0]))
        try:
            import dynamo.llm as llm
        except ImportError:
            return None
    return llm


class DynamoSide:
    name = "Dynamo"

    def __init__(self, wl: Workload, llm: Any) -> None:
        self.llm = llm
        self.wl = wl
        h = llm.compute_block_hash_for_seq
        self.local = [h(t.tolist(), BLOCK) for t in wl.tokens]
        self.events = wl.dynamo_events(self.local)
        self.prior = None
        if wl.name == "re-store":
            prior = wl.prior
            self.prior = prior.dynamo_events([h(t.tolist(), BLOCK) for t in prior.tokens])
            base = len(self.prior) + wl.workers
            self.events = wl.dynamo_events(self.local, base)
        self.small_events: list[tuple[int, bytes]] | None = None  # built when first applied
        self.tree: Any = None

    def build(self, small: bool = False) -> tuple[float, float, int]:
        self.tree = None
        gc.collect()
        events = self.events
        if small:
            if self.small_events is None:
                order = [e for batch in self.wl.small_batches() for e in batch]
                first = len(self.prior) + self.wl.workers if self.prior is not None else 0
                self.small_events = self.wl.dynamo_events(self.local, first, order)
            events = self.small_events
        tree = self.llm.RadixTree()
        if self.prior is not None:
            for w, payload in self.prior:
                tree.apply_event(w, payload)
            for w in range(self.wl.workers):
                ev = {"event_id": len(self.prior) + w, "data": "cleared", "dp_rank": 0}
                tree.apply_event(w, json.dumps(ev).encode())
            tree.find_matches(self.local[0])
        gc.collect()
        rss0 = rss_bytes()
        w0, c0 = time.perf_counter(), time.process_time()
        for w, payload in events:
            tree.apply_event(w, payload)
        tree.find_matches(self.local[0])  # queued behind the events: waits for them
        wall, cpu = time.perf_counter() - w0, time.process_time() - c0
        self.tree = tree
        return wall, cpu, rss_bytes() - rss0

    def check(self) -> None:
        for i in self.wl.picks[:50]:
            got = self.tree.find_matches(self.local[i]).scores.get((int(i) // self.wl.spw, 0))
            if got != SEQ_BLOCKS:
                raise AssertionError(f"Dynamo matched {got} blocks of a stored sequence")

    def match_list(self) -> list[int]:
        h, find = self.llm.compute_block_hash_for_seq, self.tree.find_matches
        return timed(lambda p: find(h(p, BLOCK)), self.wl.prompts)

    def match_fresh(self) -> list[int]:
        h, find = self.llm.compute_block_hash_for_seq, self.tree.find_matches
        return timed_fresh(lambda p: find(h(p, BLOCK)), self.wl)

    def keys(self) -> list[Any]:
        return [self.local[i] for i in self.wl.picks]

    def match_keys(self, keys: list[Any]) -> list[int]:
        return timed(self.tree.find_matches, keys)

    def match_keys_scores(self, keys: list[Any]) -> list[int]:
        find = self.tree.find_matches
        return timed(lambda k: find(k).scores, keys)


# --- one workload, both sides alternated -----------------------------------------


def run_workload(wl: Workload, llm: Any, repeats: int, small: bool = False) -> dict[str, Any]:
    sides: list[Any] = [KvwireSide(wl)]
    if llm is not None:
        sides.append(DynamoSide(wl, llm))
    runs: dict[str, dict[str, list[float]]] = {s.name: {} for s in sides}

    def add(side: str, what: str, value: float) -> None:
        runs[side].setdefault(what, []).append(value)

    rss: dict[str, int] = {}
    hinted_bytes = 0.0
    removals = sides[0].removals()
    stats = None
    for rep in range(repeats):
        order = sides if rep % 2 == 0 else sides[::-1]
        for side in order:
            if small:
                wall, cpu, _ = side.build(small=True)
                add(side.name, "apply_small", wl.blocks / wall)
                add(side.name, "apply_small_cpu", wl.blocks / cpu)
            wall, cpu, grown = side.build()
            add(side.name, "apply_wall", wl.blocks / wall)
            add(side.name, "apply_cpu", wl.blocks / cpu)
            if isinstance(side, KvwireSide):
                wall, _, _ = side.build(general=True)
                add(side.name, "apply_general", wl.blocks / wall)
                wall, cpu, _ = side.build(hint=True)
                add(side.name, "apply_hint", wl.blocks / wall)
                add(side.name, "apply_hint_cpu", wl.blocks / cpu)
                st = side.index.stats()
                hinted_bytes = st.memory_bytes / st.holders
                side.build()  # the lookups and removals below run on an index built without the hint
            rss.setdefault(side.name, grown)  # later repeats reuse freed memory
        for side in order:
            if rep == 0:
                side.check()
            add(side.name, "match_list", _median_us(side.match_list()))
            add(side.name, "match_fresh", _median_us(side.match_fresh()))
            keys = side.keys()
            lat = side.match_keys(keys)
            add(side.name, "match_keys", _median_us(lat))
            add(side.name, "match_keys_p99", _p99_us(lat))
            if isinstance(side, DynamoSide):
                add(side.name, "match_keys_scores", _median_us(side.match_keys_scores(keys)))
            else:
                add(side.name, "match_keys_dict", _median_us(side.match_keys_dict(keys)))
                stats = side.index.stats()
                add(side.name, "remove", side.remove_all(removals))  # empties the index
    res: dict[str, Any] = {"runs": runs, "rss": rss}
    assert stats is not None
    st = stats
    res["holders"] = st.holders
    res["bytes_per_holder"] = st.memory_bytes / st.holders
    res["bytes_per_holder_hint"] = hinted_bytes
    return res


def med(xs: list[float]) -> float:
    return float(statistics.median(xs))


def ratio(a: list[float], b: list[float]) -> float:
    return med([x / y for x, y in zip(a, b, strict=True)])


def keys_throughput(seed: int) -> tuple[float, float]:
    """Block keys from numpy tokens: one 2,048-token prompt, and 4,096 of them at once."""
    from kvwire.prefix_index import block_keys

    rng = np.random.default_rng(seed)
    flat = rng.integers(0, VOCAB, 4096 * SEQ_BLOCKS * BLOCK, dtype=np.int64)
    prompts = [flat[i * 2048 : (i + 1) * 2048] for i in range(2000)]
    lat = timed(lambda p: block_keys(p, BLOCK), prompts)
    one = SEQ_BLOCKS * BLOCK / (_median_us(lat))
    bulk = []
    for _ in range(5):
        t0 = time.perf_counter()
        block_keys(flat, BLOCK)
        bulk.append(flat.shape[0] / (time.perf_counter() - t0) / 1e6)
    return one, med(bulk)


# --- memory at 10 M blocks ----------------------------------------------------------


def memory_10m(target: int, workers: int, seed: int) -> dict[str, Any]:
    """Apply generated stores until ``target`` (block, holder) pairs; bytes per pair."""
    from kvwire.prefix_index import PrefixIndex, block_keys
    from kvwire.wire import BlockStored, KVEventBatch

    rng = np.random.default_rng(seed)
    roots = rng.integers(0, VOCAB, (ROOTS, ROOT_BLOCKS * BLOCK), dtype=np.int64)
    root_hashes = [block_keys(r, BLOCK, seed=ENGINE_SEED) >> np.uint64(1) for r in roots]
    gc.collect()
    rss0 = rss_bytes()
    index = PrefixIndex(BLOCK)
    have: list[set[int]] = [set() for _ in range(workers)]
    pairs = 0
    t0 = time.perf_counter()
    while pairs < target:
        for w in range(workers):
            r = int(rng.integers(ROOTS))
            suffix = rng.integers(0, VOCAB, (SEQ_BLOCKS - ROOT_BLOCKS) * BLOCK, dtype=np.int64)
            tail = block_keys(
                suffix, BLOCK, seed=ENGINE_SEED, parent_key=int(root_hashes[r][-1] << np.uint64(1)),
                position=ROOT_BLOCKS,
            ) >> np.uint64(1)
            if r in have[w]:
                ev = BlockStored(tail.tolist(), int(root_hashes[r][-1]), suffix.tolist(), BLOCK)
            else:
                have[w].add(r)
                ev = BlockStored(
                    root_hashes[r].tolist() + tail.tolist(), None,
                    roots[r].tolist() + suffix.tolist(), BLOCK,
                )  # fmt: skip
            pairs += len(ev.block_hashes)
            index.apply(f"worker-{w}", 0, KVEventBatch(0.0, [ev], 0))
    elapsed = time.perf_counter() - t0
    gc.collect()
    st = index.stats()
    return {
        "holders": st.holders,
        "blocks": st.blocks,
        "bytes_per_holder": st.memory_bytes / st.holders,
        "rss_per_holder": (rss_bytes() - rss0) / st.holders,
        "seconds": elapsed,
    }


# --- report ---------------------------------------------------------------------------


VIEW_BLOCKS = 20_000
VIEW_RUN = 100  # blocks per content-chained run, and per snapshot payload


def _rank_payloads(seed: int, rank: int) -> list[bytes]:
    """One rank's VIEW_BLOCKS blocks as snapshot payloads: runs of VIEW_RUN chained blocks."""
    from kvwire.wire import BlockStored, KVEventBatch, encode_batch

    rng = np.random.default_rng([seed, rank])
    out = []
    for run in range(VIEW_BLOCKS // VIEW_RUN):
        toks = rng.integers(0, VOCAB, VIEW_RUN * BLOCK)
        hashes = (np.arange(VIEW_RUN, dtype=np.uint64) + np.uint64((rank << 32) + run * VIEW_RUN + 1)).tolist()
        ev = BlockStored(block_hashes=hashes, parent_block_hash=None, token_ids=toks.tolist(),
                         block_size=BLOCK, medium="GPU")  # fmt: skip
        out.append(encode_batch(KVEventBatch(time.time(), [ev], 0)))
    return out


def rank_view_bench(repeats: int, seed: int) -> None:
    """Export/import of one 20,000-block rank, and a snapshot's apply with and without reserve."""
    from kvwire.prefix_index import PrefixIndex

    def loaded(ranks: int) -> Any:
        idx = PrefixIndex(BLOCK)
        for r in range(ranks):
            for p in payloads[r]:
                idx.apply_payload(f"worker-{r}", 0, p)
        return idx

    def us(t0: int) -> float:
        return (time.perf_counter_ns() - t0) / 1e3

    payloads = [_rank_payloads(seed, r) for r in range(16)]
    full = loaded(16)
    view = full.export_rank("worker-0", 0)
    res: dict[str, list[float]] = {k: [] for k in ("export", "import_fresh", "import_over", "plain_fresh",
                                                   "hint_fresh", "plain_busy", "hint_busy")}  # fmt: skip
    busy = loaded(15)
    for rep in range(max(repeats, 5)):
        gc.collect()
        t0 = time.perf_counter_ns()
        full.export_rank("worker-0", 0)
        res["export"].append(us(t0))
        fresh = PrefixIndex(BLOCK)
        t0 = time.perf_counter_ns()
        fresh.import_rank("worker-0", 0, view)
        res["import_fresh"].append(us(t0))
        t0 = time.perf_counter_ns()
        full.import_rank("worker-0", 0, view)  # over itself: every old bit dropped, every new one set
        res["import_over"].append(us(t0))
        for hint in (False, True) if rep % 2 else (True, False):
            for where, idx in (("fresh", PrefixIndex(BLOCK)), ("busy", busy)):
                name = f"snap-{rep}-{hint}"
                gc.collect()
                t0 = time.perf_counter_ns()
                if hint:
                    idx.reserve(name, 0, VIEW_BLOCKS)
                for p in payloads[15]:
                    idx.apply_payload(name, 0, p)
                res[("hint_" if hint else "plain_") + where].append(us(t0))
                assert idx.rank_blocks(name, 0) == VIEW_BLOCKS
                idx.remove_worker(name)
    assert fresh.match(np.random.default_rng([seed, 0]).integers(0, VOCAB, 4 * BLOCK).tolist())
    m = {k: med(v) for k, v in res.items()}
    print(f"\n=== a rank's view: {VIEW_BLOCKS:,} blocks ({len(view):,} B), medians of {len(res['export'])} ===")
    print(f"  export_rank                         {m['export']:9.0f} us  ({m['export'] / VIEW_BLOCKS * 1e3:.1f} ns a block)")
    print(f"  import_rank, fresh index            {m['import_fresh']:9.0f} us  ({m['import_fresh'] / VIEW_BLOCKS * 1e3:.1f} ns a block)")
    print(f"  import_rank over it, 16 ranks held  {m['import_over']:9.0f} us")
    for where, what in (("fresh", "a fresh index"), ("busy", "an index holding 15 ranks")):
        plain, hinted = m["plain_" + where], m["hint_" + where]
        print(f"  snapshot apply into {what}: {plain / 1e3:.1f} ms plain, {hinted / 1e3:.1f} ms after reserve "
              f"({plain / hinted:.2f}x)")  # fmt: skip


def report(wl: Workload, res: dict[str, Any]) -> None:
    runs = res["runs"]
    k = runs["kvwire"]
    d = runs.get("Dynamo")
    print(f"\n=== {wl.name}, W = {wl.workers} workers: {wl.blocks:,} blocks stored in "
          f"{len(wl.order):,} events, {res['holders']:,} (block, holder) pairs; "
          f"{len(k['apply_wall'])} alternated repeats, medians ===")  # fmt: skip

    def line(name: str, what: str, unit: str, scale: float, target: str, theirs: str = "") -> None:
        mine = med(k[what]) * scale
        if d is None:
            print(f"  {name:<36} kvwire {mine:>8.2f} {unit}")
            return
        other = [x * scale for x in d[theirs or what]]
        faster = unit.endswith("/s")
        # Dynamo's best repeat: its background thread hot on a free core.
        best = max(other) if faster else min(other)
        worst = min(other) if faster else max(other)
        r_med, r_best = ratio(k[what], d[theirs or what]), mine / best
        verdict = ""
        if target[0] in "<>":
            goal = float(target.split()[-1].rstrip("x"))
            ok = [(r >= goal) if faster else (r <= goal) for r in (r_med, r_best)]
            verdict = {(True, True): "met", (True, False): "met vs median only"}.get(
                (ok[0], ok[1]), "missed"
            )
        print(f"  {name:<36} kvwire {mine:>8.2f} {unit:<7} Dynamo median {med(other):>7.2f} "
              f"(best {best:.2f}, worst {worst:.2f})  ratio {r_med:5.2f}, vs best {r_best:5.2f}  "
              f"target {target} {verdict}")  # fmt: skip

    line("apply, wall clock", "apply_wall", "M blk/s", 1e-6, ">= 2x")
    line("apply, per CPU second (all threads)", "apply_cpu", "M blk/s", 1e-6, "(reported)")
    line("  kvwire by decode_batch + apply", "apply_general", "M blk/s", 1e-6, "(reported)",
         "apply_wall")  # fmt: skip
    print(f"  with expected_blocks_per_rank={wl.expected_per_rank:,} (kvwire only; Dynamo has no capacity hint):")
    line("  apply, wall clock, hinted", "apply_hint", "M blk/s", 1e-6, ">= 2x", "apply_wall")
    line("  apply per CPU second, hinted", "apply_hint_cpu", "M blk/s", 1e-6, "(reported)", "apply_cpu")
    if "apply_small" in k:
        print(f"  the same stores as one-block events, up to {SMALL_BATCH} a batch "
              "(Dynamo: an apply_event each):")  # fmt: skip
        line("  apply, wall clock, small events", "apply_small", "M blk/s", 1e-6, ">= 2x")
        line("  apply per CPU second, small events", "apply_small_cpu", "M blk/s", 1e-6, "(reported)")
    line("match 128 blocks from a token list", "match_list", "us", 1, "<= 0.25")
    line("  from a fresh list (as tokenized)", "match_fresh", "us", 1, "<= 0.25")
    line("match from precomputed keys", "match_keys", "us", 1, "<= 0.15")
    if d is not None:
        line("  both read whole (dict, .scores)", "match_keys_dict", "us", 1, "(reported)",
             "match_keys_scores")  # fmt: skip
        line("  kvwire read whole, Dynamo not", "match_keys_dict", "us", 1, "(reported)", "match_keys")
    line("  p99", "match_keys_p99", "us", 1, "(reported)")
    mine = med(k["remove"]) / 1e6
    print(f"  {'remove every block (96 a batch)':<36} kvwire {mine:>8.2f} M blk/s (reported; kvwire only)")
    runs_txt = ", ".join(f"{x / 1e6:.2f}" for x in k["apply_wall"])
    print(f"  kvwire apply runs (M blk/s): {runs_txt}"
          + ("" if d is None else "; Dynamo: " + ", ".join(f"{x / 1e6:.2f}" for x in d["apply_wall"])))
    print(f"  memory: tables {res['bytes_per_holder']:.1f} B/holder "
          f"({res['bytes_per_holder_hint']:.1f} hinted); RSS growth over the first "
          f"build {res['rss']['kvwire'] / res['holders']:.1f} B/holder (kvwire)"
          + ("" if d is None else f", {res['rss']['Dynamo'] / res['holders']:.1f} B/holder (Dynamo)"))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--workloads", nargs="+", default=["shared-roots", "independent", "re-store"],
                    choices=["shared-roots", "independent", "re-store"])  # fmt: skip
    ap.add_argument("--workers", type=int, nargs="+", default=[16, 64],
                    help="worker counts of the shared-roots workload (the others use 64)")  # fmt: skip
    ap.add_argument("--seqs", type=int, default=SEQS_PER_WORKER)
    ap.add_argument("--lookups", type=int, default=LOOKUPS,
                    help="prompts matched per repeat (fewer: a shorter run)")  # fmt: skip
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--small-events", nargs="*", default=["independent"],
                    help="workloads also applied as one-block events (default: independent)")  # fmt: skip
    ap.add_argument("--memory-10m", action="store_true", help="also fill an index to 10 M pairs")
    ap.add_argument("--memory-pairs", type=int, default=10_000_000)
    ap.add_argument("--rank-view", action="store_true",
                    help="also time a rank's export/import and a snapshot with and without reserve")  # fmt: skip
    ap.add_argument("--rank-view-only", action="store_true", help="only the --rank-view figures")
    ap.add_argument("--hot-cores", action="store_true",
                    help="keep the other cores busy at nice 19 (Dynamo's fast mode)")  # fmt: skip
    args = ap.parse_args()
    spinners = hot_cores() if args.hot_cores else []
    try:
        run(args)
    finally:
        for proc in spinners:
            proc.kill()
            proc.wait()


def hot_cores() -> list[subprocess.Popen[bytes]]:
    """One lowest-priority spinning process per core but one: no core sits halted."""
    n = max(1, len(os.sched_getaffinity(0)) - 1)
    code = "import os; os.nice(19)\nwhile True: pass"
    print(f"--hot-cores: {n} spinning process(es) at nice 19 keep the other cores awake")
    return [subprocess.Popen([sys.executable, "-c", code]) for _ in range(n)]


def run(args: argparse.Namespace) -> None:
    if args.rank_view_only:
        rank_view_bench(args.repeats, args.seed)
        return
    llm = import_dynamo()
    if llm is None:
        print("Dynamo is not importable (pip install ai-dynamo-runtime==1.6.1, or `make bench`, "
              "which puts it in .venv-dynamo): printing kvwire figures only.")  # fmt: skip
    else:
        print(f"Dynamo: dynamo.llm.RadixTree from {Path(llm.__file__).parent}, in this process")
    for name in args.workloads:
        for w in args.workers if name == "shared-roots" else [64]:
            wl = Workload(name, w, args.seqs, args.seed, args.lookups)
            report(wl, run_workload(wl, llm, args.repeats, name in args.small_events))
    one, bulk = keys_throughput(args.seed)
    print(f"\nblock keys from numpy tokens: {one:.0f} M tokens/s for one 2,048-token prompt, "
          f"{bulk:.0f} M tokens/s in bulk (target >= 100)")  # fmt: skip
    if args.rank_view:
        rank_view_bench(args.repeats, args.seed)
    if args.memory_10m:
        m = memory_10m(args.memory_pairs, 64, args.seed)
        print(f"\n=== memory at {m['holders']:,} (block, holder) pairs, {m['blocks']:,} blocks, "
              f"64 workers (built in {m['seconds']:.0f} s) ===")  # fmt: skip
        print(f"  index array bytes / holder   {m['bytes_per_holder']:.1f} B   target <= 150"
              "   (IndexStats.memory_bytes / holders)")  # fmt: skip
        print(f"  RSS growth / holder          {m['rss_per_holder']:.1f} B   (whole process, "
              "/proc/self/statm)")  # fmt: skip


if __name__ == "__main__":
    main()
