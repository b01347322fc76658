"""Prefix index speed and memory, side by side with Dynamo's Rust RadixTree.

Workload (per W in 16 and 64 workers, one rank each): 50 shared roots of
32 blocks; per worker 200 sequences of 128 blocks x 16 tokens, each a random
root plus 96 blocks of its own. Engine hashes are content-chained (the same
prefix has the same hash on every worker, as vLLM's are). A worker's first
sequence on a root stores all 128 blocks; later ones store the 96 new blocks
under the root's last block. One BlockStored per engine batch, workers
interleaved. Then 2,000 lookups of stored sequences.

Figures (medians of repeats):
- apply: msgpack payload bytes -> kvwire.wire.decode_batch -> PrefixIndex.apply,
  blocks/s; Dynamo: RadixTree.apply_event on its JSON events, timed until a
  find_matches queued behind them returns (tokens_hash precomputed with
  compute_block_hash_for_seq outside the timing; a second line adds that
  hashing, which a router fed token ids must do).
- match of a 128-block prompt: PrefixIndex.match from numpy tokens (keys
  included) and from precomputed keys; Dynamo: find_matches on precomputed
  local hashes.
- block keys from numpy tokens, tokens/s.
- memory per (block, holder): IndexStats.memory_bytes (the nbytes of every
  numpy array the index holds) / holders, and the growth of the process's
  resident set (/proc/self/statm) across the first build, at the workload
  scale and at 10 M (block, holder) pairs (--memory-10m, 64 workers).

Dynamo runs in a subprocess with its own interpreter (DYNAMO_PYTHON, default
.venv-dynamo/bin/python as `make bench` sets it up, else this one), reading the same workload from
a file. Without Dynamo the kvwire figures still print, with a note.

    python benchmarks/index_bench.py [--workers 16 64] [--repeats 3] [--memory-10m]
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
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
TARGETS = {
    "apply_ratio": 2.0,
    "match_ratio": 0.25,
    "keys_mtok_s": 100.0,
    "bytes_per_holder": 150.0,
}


# --- workload -------------------------------------------------------------------


def make_workload(workers: int, seqs_per_worker: int, seed: int) -> dict[str, Any]:
    """Token ids, root choice and engine hashes of every sequence."""
    from kvwire.prefix_index import block_keys

    rng = np.random.default_rng(seed)
    roots = rng.integers(0, VOCAB, (ROOTS, ROOT_BLOCKS * BLOCK), dtype=np.int32)
    n = workers * seqs_per_worker
    root_of = rng.integers(0, ROOTS, n).astype(np.int32)
    tokens = np.empty((n, SEQ_BLOCKS * BLOCK), dtype=np.int32)
    tokens[:, : ROOT_BLOCKS * BLOCK] = roots[root_of]
    tokens[:, ROOT_BLOCKS * BLOCK :] = rng.integers(
        0, VOCAB, (n, (SEQ_BLOCKS - ROOT_BLOCKS) * BLOCK), dtype=np.int32
    )
    # Engine hashes: an unrelated content-chained hash (another seed), 63-bit.
    hashes = np.empty((n, SEQ_BLOCKS), dtype=np.uint64)
    for i in range(n):
        hashes[i] = block_keys(tokens[i], BLOCK, seed=ENGINE_SEED) >> np.uint64(1)
    return {"tokens": tokens, "root_of": root_of, "hashes": hashes, "workers": workers}


def schedule(workers: int, seqs_per_worker: int, root_of: np.ndarray) -> list[tuple[int, int, int]]:
    """(worker, sequence, first stored block) in arrival order: workers interleaved."""
    have: list[set[int]] = [set() for _ in range(workers)]
    out = []
    for j in range(seqs_per_worker):
        for w in range(workers):
            i = w * seqs_per_worker + j
            r = int(root_of[i])
            first = ROOT_BLOCKS if r in have[w] else 0
            have[w].add(r)
            out.append((w, i, first))
    return out


# --- kvwire half ----------------------------------------------------------------


def kvwire_payloads(wl: dict[str, Any], order: list[tuple[int, int, int]]) -> list[tuple[str, bytes]]:
    from kvwire.wire import BlockStored, KVEventBatch, encode_batch

    tokens, hashes = wl["tokens"], wl["hashes"]
    out = []
    for w, i, first in order:
        ev = BlockStored(
            block_hashes=hashes[i, first:].tolist(),
            parent_block_hash=int(hashes[i, first - 1]) if first else None,
            token_ids=tokens[i, first * BLOCK :].tolist(),
            block_size=BLOCK,
            medium="GPU",
        )
        out.append((f"worker-{w}", encode_batch(KVEventBatch(time.time(), [ev], 0))))
    return out


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def run_kvwire(wl: dict[str, Any], repeats: int, seed: int) -> dict[str, Any]:
    from kvwire.prefix_index import PrefixIndex, block_keys
    from kvwire.wire import decode_batch

    workers = wl["workers"]
    spw = wl["tokens"].shape[0] // workers
    order = schedule(workers, spw, wl["root_of"])
    payloads = kvwire_payloads(wl, order)
    n_blocks = sum(SEQ_BLOCKS - first for _, _, first in order)
    res: dict[str, Any] = {"blocks_applied": n_blocks}

    rates = []
    index = None
    for rep in range(repeats):
        index = None
        gc.collect()
        rss0 = rss_bytes()
        index = PrefixIndex(BLOCK)
        t0 = time.perf_counter()
        for wid, payload in payloads:
            index.apply(wid, 0, decode_batch(payload))
        dt = time.perf_counter() - t0
        rates.append(n_blocks / dt)
        if rep == 0:
            # Later repeats reuse memory the allocator kept: only the first counts.
            res["rss_growth"] = rss_bytes() - rss0
    assert index is not None
    res["apply_blocks_s"] = statistics.median(rates)
    res["apply_runs"] = rates

    # Decode alone, to show what the index itself costs.
    t0 = time.perf_counter()
    for _, payload in payloads:
        decode_batch(payload)
    res["decode_blocks_s"] = n_blocks / (time.perf_counter() - t0)

    st = index.stats()
    res["stats"] = st.__dict__
    res["bytes_per_holder"] = st.memory_bytes / st.holders
    res["rss_per_holder"] = res["rss_growth"] / st.holders

    rng = np.random.default_rng(seed + 1)
    picks = rng.integers(0, wl["tokens"].shape[0], LOOKUPS)
    tokens = wl["tokens"]
    prompts = [np.ascontiguousarray(tokens[i]).astype(np.int64) for i in picks]
    expect = [(f"worker-{i // spw}", 0) for i in picks]
    for p, e in zip(prompts[:50], expect[:50], strict=True):
        got = index.match(p)
        if got.get(e) != SEQ_BLOCKS:
            raise AssertionError(f"lookup of a stored sequence matched {got.get(e)} blocks")
    lat = []
    for p in prompts:
        t0 = time.perf_counter_ns()
        index.match(p)
        lat.append(time.perf_counter_ns() - t0)
    res["match_us"] = _pct(lat)
    keys = [index.keys(p) for p in prompts]
    lat = []
    for k in keys:
        t0 = time.perf_counter_ns()
        index.match_keys(k)
        lat.append(time.perf_counter_ns() - t0)
    res["match_keys_us"] = _pct(lat)
    lists = [p.tolist() for p in prompts[:500]]
    lat = []
    for p in lists:
        t0 = time.perf_counter_ns()
        index.match(p)
        lat.append(time.perf_counter_ns() - t0)
    res["match_list_us"] = _pct(lat)

    # Block keys from numpy tokens: one prompt at a time, and in bulk.
    lat = []
    for p in prompts:
        t0 = time.perf_counter_ns()
        block_keys(p, BLOCK, seed=0)
        lat.append(time.perf_counter_ns() - t0)
    res["keys_prompt_mtok_s"] = SEQ_BLOCKS * BLOCK / (statistics.median(lat) / 1e3)
    flat = np.ascontiguousarray(tokens[: min(tokens.shape[0], 4096)]).reshape(-1).astype(np.int64)
    runs = []
    for _ in range(5):
        t0 = time.perf_counter()
        block_keys(flat, BLOCK, seed=0)
        runs.append(flat.shape[0] / (time.perf_counter() - t0) / 1e6)
    res["keys_bulk_mtok_s"] = statistics.median(runs)
    return res


def _pct(ns: list[int]) -> dict[str, float]:
    a = np.array(ns, dtype=np.float64) / 1e3
    return {"median": float(np.median(a)), "p99": float(np.percentile(a, 99))}


# --- Dynamo half (runs in Dynamo's interpreter: numpy + dynamo only) --------------


def dynamo_worker(workload_path: str, out_path: str, repeats: int, seed: int) -> None:
    from dynamo.llm import RadixTree, compute_block_hash_for_seq

    data = np.load(workload_path)
    tokens, hashes, root_of = data["tokens"], data["hashes"], data["root_of"]
    workers = int(data["workers"])
    spw = tokens.shape[0] // workers
    order = schedule(workers, spw, root_of)
    local = [compute_block_hash_for_seq(tokens[i].tolist(), BLOCK) for i in range(tokens.shape[0])]
    # Hashing what each event stores, as a router fed token ids must.
    stored_tokens = [tokens[i, first * BLOCK :].tolist() for _, i, first in order]
    t0 = time.perf_counter()
    for toks in stored_tokens:
        compute_block_hash_for_seq(toks, BLOCK)
    hash_s = time.perf_counter() - t0
    events = []
    for eid, (w, i, first) in enumerate(order):
        blocks = [
            {"block_hash": int(hashes[i, b]), "tokens_hash": int(local[i][b])}
            for b in range(first, SEQ_BLOCKS)
        ]
        parent = int(hashes[i, first - 1]) if first else None
        ev = {"event_id": eid, "data": {"stored": {"parent_hash": parent, "blocks": blocks}}, "dp_rank": 0}
        events.append((w, json.dumps(ev).encode()))
    n_blocks = sum(SEQ_BLOCKS - first for _, _, first in order)
    rates = []
    tree = None
    for _ in range(repeats):
        tree = None
        tree = RadixTree()
        t0 = time.perf_counter()
        for w, payload in events:
            tree.apply_event(w, payload)
        tree.find_matches(local[0])  # queued behind the events: waits for them
        rates.append(n_blocks / (time.perf_counter() - t0))
    assert tree is not None
    rng = np.random.default_rng(seed + 1)
    picks = rng.integers(0, tokens.shape[0], LOOKUPS)
    for i in picks[:50]:
        got = tree.find_matches(local[i]).scores.get((int(i) // spw, 0))
        if got != SEQ_BLOCKS:
            raise AssertionError(f"Dynamo matched {got} blocks of a stored sequence")
    lat = []
    for i in picks:
        seq = local[i]
        t0 = time.perf_counter_ns()
        tree.find_matches(seq)
        lat.append(time.perf_counter_ns() - t0)
    prompt_lists = [tokens[i].tolist() for i in picks]
    lat_tok = []
    for toks in prompt_lists:
        t0 = time.perf_counter_ns()
        tree.find_matches(compute_block_hash_for_seq(toks, BLOCK))
        lat_tok.append(time.perf_counter_ns() - t0)
    lat_hash = []
    for toks in prompt_lists[:500]:
        t0 = time.perf_counter_ns()
        compute_block_hash_for_seq(toks, BLOCK)
        lat_hash.append(time.perf_counter_ns() - t0)
    apply_s = n_blocks / statistics.median(rates)
    res = {
        "apply_blocks_s": statistics.median(rates),
        "apply_hashed_blocks_s": n_blocks / (apply_s + hash_s),
        "apply_runs": rates,
        "match_us": _pct(lat),
        "match_tokens_us": _pct(lat_tok),
        "hash_prompt_us": _pct(lat_hash)["median"],
        "hash_all_s": hash_s,
    }
    Path(out_path).write_text(json.dumps(res))


def dynamo_python() -> str | None:
    env = os.environ.get("DYNAMO_PYTHON")
    candidates = [env] if env else [str(Path(__file__).resolve().parents[1] / ".venv-dynamo" / "bin" / "python"), sys.executable]
    for py in candidates:
        if not py or not Path(py).exists():
            continue
        probe = subprocess.run(
            [py, "-c", "import dynamo.llm as m; m.RadixTree; m.compute_block_hash_for_seq"],
            capture_output=True,
        )
        if probe.returncode == 0:
            return py
    return None


def run_dynamo(py: str, wl: dict[str, Any], repeats: int, seed: int) -> dict[str, Any] | str:
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "workload.npz"
        out = Path(tmp) / "dynamo.json"
        np.savez(path, tokens=wl["tokens"], hashes=wl["hashes"], root_of=wl["root_of"],
                 workers=np.int64(wl["workers"]))  # fmt: skip
        cmd = [py, __file__, "--dynamo-worker", str(path), str(out),
               "--repeats", str(repeats), "--seed", str(seed)]  # fmt: skip
        env = dict(os.environ, RUST_LOG="error")
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
        if proc.returncode != 0 or not out.exists():
            return f"Dynamo run failed (exit {proc.returncode}): {proc.stderr.strip()[-600:]}"
        result: dict[str, Any] = json.loads(out.read_text())
        return result


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


def report(w: int, ours: dict[str, Any], dyn: dict[str, Any] | str) -> None:
    print(f"\n=== W = {w} workers: {ours['blocks_applied']:,} blocks stored, "
          f"{ours['stats']['holders']:,} (block, holder) pairs ===")  # fmt: skip
    have = isinstance(dyn, dict)
    if not have:
        print(f"  (no Dynamo figures: {dyn})")

    def line(name: str, mine: float, theirs: float | None, unit: str, target: str) -> None:
        if theirs is None:
            print(f"  {name:<34} kvwire {mine:>10.2f} {unit:<9} target {target}")
        else:
            print(f"  {name:<34} kvwire {mine:>10.2f} {unit:<9} Dynamo {theirs:>10.2f}  "
                  f"ratio {mine / theirs:5.2f}x  target {target}")  # fmt: skip

    d = dyn if isinstance(dyn, dict) else {}
    line("apply (payload bytes -> index)", ours["apply_blocks_s"] / 1e6,
         d["apply_blocks_s"] / 1e6 if have else None, "M blk/s", ">= 2x Dynamo")  # fmt: skip
    if have:
        line("  vs Dynamo incl. its block hashing", ours["apply_blocks_s"] / 1e6,
             d["apply_hashed_blocks_s"] / 1e6, "M blk/s", "(reported)")  # fmt: skip
    print(f"  {'':<34} (decode_batch alone: {ours['decode_blocks_s'] / 1e6:.2f} M blk/s)")
    line("match 128 blocks, numpy tokens: p50", ours["match_us"]["median"],
         d["match_us"]["median"] if have else None, "us", "<= 0.25x Dynamo")  # fmt: skip
    line("                                 p99", ours["match_us"]["p99"],
         d["match_us"]["p99"] if have else None, "us", "(reported)")  # fmt: skip
    line("match, precomputed keys: p50", ours["match_keys_us"]["median"],
         d["match_us"]["median"] if have else None, "us", "(reported)")  # fmt: skip
    line("match, token list: p50", ours["match_list_us"]["median"],
         d["match_tokens_us"]["median"] if have else None, "us",
         "(Dynamo: hash + find_matches)")  # fmt: skip
    if have:
        print(f"  {'Dynamo compute_block_hash_for_seq':<34} {d['hash_prompt_us']:.1f} us per "
              "2,048-token prompt (not in its find_matches figure)")  # fmt: skip
    line("keys, one 2,048-token prompt", ours["keys_prompt_mtok_s"], None, "M tok/s", ">= 100")
    line("keys, bulk numpy tokens", ours["keys_bulk_mtok_s"], None, "M tok/s", ">= 100")
    line("memory: index array bytes/holder", ours["bytes_per_holder"], None, "B", "<= 150")
    line("memory: RSS growth/holder", ours["rss_per_holder"], None, "B",
         "(reported; includes decoded events in flight)")  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--workers", type=int, nargs="+", default=[16, 64])
    ap.add_argument("--seqs", type=int, default=SEQS_PER_WORKER)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--memory-10m", action="store_true", help="also fill an index to 10 M pairs")
    ap.add_argument("--memory-pairs", type=int, default=10_000_000)
    ap.add_argument("--dynamo-worker", nargs=2, metavar=("WORKLOAD", "OUT"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.dynamo_worker:
        dynamo_worker(*args.dynamo_worker, args.repeats, args.seed)
        return
    py = dynamo_python()
    if py is None:
        print("Dynamo is not importable (pip install ai-dynamo-runtime, or set DYNAMO_PYTHON to "
              "an interpreter that has it): printing kvwire figures only.")  # fmt: skip
    else:
        print(f"Dynamo: dynamo.llm.RadixTree via {py}")
    for w in args.workers:
        wl = make_workload(w, args.seqs, args.seed)
        dyn: dict[str, Any] | str = "not installed" if py is None else run_dynamo(
            py, wl, args.repeats, args.seed
        )
        ours = run_kvwire(wl, args.repeats, args.seed)
        report(w, ours, dyn)
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
