"""What publishing costs a GPU decode loop, and the reference cache's CUDA path.

Part 1 (issue 2 section 6): a synthetic decode step, 32 layers of
``(64x4096) @ (4096x8192)``, relu, ``@ (8192x4096)`` in bf16, then a
synchronize; after each step one batch goes through ``EventCollector`` and
``EventPublisher`` (stores of B blocks of 16 tokens as one chain, removals of B
other blocks, ``flush()``), to a SUB socket in another process. Modes run in
interleaved blocks: no publishing, B=16, B=256 (Python lists, as engines pass
them), B=256 given as CUDA tensors (the collector's pinned-copy path), and a
sweep of the publisher's ``coalesce_s`` (0, 0.5 ms, 2 ms against the default).
Printed: the median step time per mode over ``--steps`` steps and its overhead
against no publishing (target: under 1% at both sizes; vLLM 0.33's publisher
measured 4.4% at 16 blocks and 7.8% at 256 on an H200), plus the median time
of the publishing calls on the engine thread.

Part 2: the reference ``PagedKVCache`` with its pool on the GPU: admit and
release chat-like requests with shared prefixes under eviction, publish each
iteration, then check that the received event stream reproduces the cache's
block set exactly.

Needs only torch, pyzmq, msgspec, numpy (and this repository on PYTHONPATH).
``--cpu-smoke`` runs tiny sizes on the CPU to check the script itself.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import random
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np
import torch
import zmq

from kvwire.publisher import EventCollector, EventPublisher, PublisherConfig
from kvwire.reference import CacheFullError, PagedKVCache
from kvwire.wire import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEventBatch,
    decode_batch,
    epoch_topic,
    parse_live,
)

BLOCK_TOKENS = 16
TARGET_OVERHEAD_PCT = 1.0
VLLM_OVERHEAD_PCT = {16: 4.4, 256: 7.8}


def sink(endpoints: list[str], conn: Any) -> None:
    """A SUB in another process, connected to every publisher, that reads everything."""
    ctx = zmq.Context()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.setsockopt(zmq.RCVHWM, 0)
    for endpoint in endpoints:
        sub.connect(endpoint)
    seen: set[bytes] = set()
    while len(seen) < len(endpoints):  # each publisher is its own topic
        seen.add(sub.recv_multipart()[0])
    conn.send("ready")
    first: dict[bytes, int] = conn.recv()  # count what each publishes from this seq on
    got = 0

    def take() -> int:
        topic, seq, _ = sub.recv_multipart()
        return 1 if int.from_bytes(seq, "big") >= first[topic] else 0

    while not conn.poll(0):
        if sub.poll(50):
            got += take()
    while sub.poll(300):  # what is still in flight
        got += take()
    conn.send(got)
    sub.close(linger=0)
    ctx.term()


def wire_topic(pub: EventPublisher) -> bytes:
    """The topic frame ``pub`` sends: its topic and its epoch."""
    return epoch_topic(pub.topic.encode(), pub.epoch)


def start_sink(pubs: list[EventPublisher]) -> tuple[Any, Any, dict[bytes, int]]:
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    endpoints = [p.bound_endpoint for p in pubs]
    proc = ctx.Process(target=sink, args=(endpoints, child), daemon=True)
    proc.start()
    ping = KVEventBatch(0.0, [AllBlocksCleared()], 0)
    deadline = time.monotonic() + 60
    while not parent.poll(0.01):
        if time.monotonic() > deadline:
            raise RuntimeError("subscriber process never received anything")
        for p in pubs:
            p.publish(ping)
    assert parent.recv() == "ready"
    while any(p.queue_depth for p in pubs):
        time.sleep(0.001)
    first = {wire_topic(p): p.last_seq + 1 for p in pubs}
    parent.send(first)
    return proc, parent, first


# --- part 1: the decode loop ----------------------------------------------------------


class Step:
    """The synthetic decode step."""

    def __init__(self, device: torch.device, tiny: bool) -> None:
        tokens, hidden, ffn, layers = (8, 64, 128, 2) if tiny else (64, 4096, 8192, 32)
        dtype = torch.float32 if device.type == "cpu" else torch.bfloat16
        gen = torch.Generator(device="cpu").manual_seed(0)
        self.x = (torch.randn(tokens, hidden, generator=gen) * 0.1).to(device, dtype)
        self.w1 = [
            (torch.randn(hidden, ffn, generator=gen) * 0.02).to(device, dtype)
            for _ in range(layers)
        ]
        self.w2 = [
            (torch.randn(ffn, hidden, generator=gen) * 0.02).to(device, dtype)
            for _ in range(layers)
        ]
        self.cuda = device.type == "cuda"

    def __call__(self) -> None:
        h = self.x
        for w1, w2 in zip(self.w1, self.w2, strict=True):
            h = torch.relu(h @ w1) @ w2
        if self.cuda:
            torch.cuda.synchronize()


class Workload:
    """Pre-built per-step inputs: B stored blocks (one chain) and B removed blocks."""

    def __init__(
        self, blocks: int, device: torch.device | None, variants: int = 8, numpy: bool = False
    ) -> None:
        rng = random.Random(blocks)
        self.items: list[tuple[Any, int, Any, Any]] = []
        for _ in range(variants):
            hashes = [rng.getrandbits(63) for _ in range(blocks)]
            tokens = [rng.randrange(128_000) for _ in range(blocks * BLOCK_TOKENS)]
            removed = [rng.getrandbits(63) for _ in range(blocks)]
            if device is not None:
                self.items.append((
                    torch.tensor(hashes, device=device),
                    rng.getrandbits(63),
                    torch.tensor(tokens, device=device),
                    torch.tensor(removed, device=device),
                ))  # fmt: skip
            elif numpy:
                self.items.append((
                    np.array(hashes, dtype=np.uint64),
                    rng.getrandbits(63),
                    np.array(tokens, dtype=np.int64),
                    np.array(removed, dtype=np.uint64),
                ))  # fmt: skip
            else:
                self.items.append((hashes, rng.getrandbits(63), tokens, removed))
        self.i = 0

    def publish(self, col: EventCollector) -> None:
        hashes, parent, tokens, removed = self.items[self.i % len(self.items)]
        self.i += 1
        col.stored(hashes, parent, tokens)
        col.removed(removed)
        col.flush()


def run_decode_loop(args: argparse.Namespace, device: torch.device) -> None:
    print("== part 1: synthetic decode step, one published batch per step ==")
    step = Step(device, args.cpu_smoke)
    for _ in range(3):
        step()
    t0 = time.perf_counter()
    for _ in range(5):
        step()
    one = (time.perf_counter() - t0) / 5
    print(f"step alone: {one * 1e3:.3f} ms (H200 reference: ~1.54 ms)")
    default_coalesce = PublisherConfig().send_coalesce_s
    coalesces = [default_coalesce] + ([] if args.no_sweep else [0.0, 0.0005, 0.002])
    pubs = {
        coalesce: EventPublisher(
            "tcp://127.0.0.1:*",
            config=PublisherConfig(topic=f"coalesce{coalesce}", send_coalesce_s=coalesce),
        ).start()
        for coalesce in coalesces
    }
    try:
        proc, conn, first = start_sink(list(pubs.values()))
        cols = {coalesce: EventCollector(pub, BLOCK_TOKENS) for coalesce, pub in pubs.items()}
        w16, w256 = Workload(16, None), Workload(256, None)
        modes: dict[str, tuple[Workload | None, EventCollector | None]] = {
            "none": (None, None),
            "kvwire B=16": (w16, cols[default_coalesce]),
            "kvwire B=256": (w256, cols[default_coalesce]),
        }
        modes["numpy B=16"] = (Workload(16, None, numpy=True), cols[default_coalesce])
        modes["numpy B=256"] = (Workload(256, None, numpy=True), cols[default_coalesce])
        if device.type == "cuda" or args.cpu_smoke:
            # The collector's device path (CPU tensors in a smoke run).
            modes["kvwire B=256 tensors"] = (Workload(256, device), cols[default_coalesce])
        for coalesce in coalesces[1:]:
            label = f"coalesce {coalesce * 1e3:g} ms"
            modes[f"B=16 {label}"] = (w16, cols[coalesce])
            modes[f"B=256 {label}"] = (w256, cols[coalesce])
        block = args.block
        discard = 3
        blocks = -(-args.steps // (block - discard))
        times: dict[str, list[float]] = {m: [] for m in modes}
        call: dict[str, list[float]] = {m: [] for m in modes}
        order = list(modes)
        for _ in range(10):  # warm up every path
            for work, col in modes.values():
                step()
                if work is not None and col is not None:
                    work.publish(col)
        for b in range(blocks):
            random.Random(b).shuffle(order)
            for mode in order:
                work, col = modes[mode]
                prev = time.perf_counter()
                for i in range(block):
                    step()
                    c0 = time.perf_counter()
                    if work is not None and col is not None:
                        work.publish(col)
                    now = time.perf_counter()
                    if i >= discard:
                        times[mode].append(now - prev)
                        call[mode].append(now - c0)
                    prev = now
        published = sum(p.last_seq + 1 - first[wire_topic(p)] for p in pubs.values())
        dropped = sum(
            p.stats().dropped_queue_full + p.stats().dropped_send_error for p in pubs.values()
        )
        conn.send("stop")
        received = conn.recv()
        proc.join(10)
    finally:
        for pub in pubs.values():
            pub.close()
    base = statistics.median(times["none"][: args.steps])
    print(
        f"{'mode':<24} {'median step ms':>15} {'overhead':>9} {'target':>7} "
        f"{'vLLM 0.33':>9} {'engine-thread us':>17}"
    )
    for mode in modes:
        med = statistics.median(times[mode][: args.steps])
        over = (med / base - 1) * 100
        headline = mode.startswith("kvwire")
        size = 16 if "B=16" in mode else 256
        vllm = f"{VLLM_OVERHEAD_PCT[size]:.1f}%" if headline else "-"
        target = f"<{TARGET_OVERHEAD_PCT:.0f}%" if headline and "tensors" not in mode else "-"
        calls = statistics.median(call[mode][: args.steps]) * 1e6
        print(f"{mode:<24} {med * 1e3:>15.4f} {over:>+8.2f}% {target:>7} {vllm:>9} {calls:>17.1f}")
    print(
        f"({len(times['none'][: args.steps])} steps per mode, interleaved blocks of {block}; "
        f"kvwire rows use the default coalesce_s={default_coalesce * 1e3:g} ms; "
        f"published {published}, dropped {dropped}, received by the subscriber {received})"
    )


# --- part 2: the reference cache on the GPU ----------------------------------------------


def run_reference_cache(args: argparse.Namespace, device: torch.device) -> None:
    print(f"\n== part 2: reference PagedKVCache on {device} ==")
    tiny = args.cpu_smoke
    dims = (
        dict(num_layers=2, num_kv_heads=2, head_dim=8)
        if tiny
        else dict(num_layers=32, num_kv_heads=8, head_dim=128)
    )
    num_blocks = 512 if tiny else 8192
    reset_every = 97 if tiny else 500
    max_prompt = 1024 if tiny else 4096
    requests = 200 if tiny else 1500
    ipc = tempfile.mkdtemp(prefix="kvwg")
    ctx: zmq.Context[Any] = zmq.Context()
    with EventPublisher(f"ipc://{ipc}/cache", config=PublisherConfig(buffer_steps=10)) as pub:
        sub = ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        sub.setsockopt(zmq.RCVHWM, 0)
        sub.connect(pub.bound_endpoint)
        ping = KVEventBatch(0.0, [AllBlocksCleared()], 0)
        while True:
            pub.publish(ping)
            if sub.poll(20):
                break
        col = EventCollector(pub, BLOCK_TOKENS)
        cache = PagedKVCache(num_blocks, BLOCK_TOKENS, col, device=device, **dims)  # type: ignore[arg-type]
        pool_gb = cache.kv.numel() * cache.kv.element_size() / 1e9
        rng = random.Random(0)
        systems = [
            [rng.randrange(128_000) for _ in range(512 if not tiny else 64)] for _ in range(8)
        ]
        active: list[str] = []
        history: list[list[int]] = []
        iter_s: list[float] = []
        written = reused = evicted = 0
        t_all = time.perf_counter()
        for r in range(requests):
            t0 = time.perf_counter()
            if history and rng.random() < 0.5:
                prompt = rng.choice(history) + [
                    rng.randrange(128_000) for _ in range(rng.randint(16, 200))
                ]
            else:
                prompt = rng.choice(systems) + [
                    rng.randrange(128_000) for _ in range(rng.randint(16, 400))
                ]
            if len(prompt) > max_prompt:
                prompt = rng.choice(systems) + [rng.randrange(128_000) for _ in range(64)]
            rid = f"r{r}"
            while True:
                try:
                    res = cache.admit(rid, prompt)
                    break
                except CacheFullError:  # preempt, as an engine would
                    if not active:
                        raise
                    cache.release(active.pop(0))
            written += res.new_blocks
            reused += res.cached_blocks
            evicted += res.evicted_blocks
            active.append(rid)
            history = ([*history, prompt])[-32:]
            if len(active) > 24:
                cache.release(active.pop(rng.randrange(len(active))))
            if r % reset_every == reset_every - 1:
                cache.reset()
                active.clear()
            col.flush()
            if device.type == "cuda":
                torch.cuda.synchronize()
            iter_s.append(time.perf_counter() - t0)
        wall = time.perf_counter() - t_all
        truth = cache.held_hashes()
        last = pub.last_seq
    held: set[int] = set()
    seen = 0
    while seen < last:
        if not sub.poll(5000):
            break
        msg = parse_live(sub.recv_multipart())
        seen = msg.seq
        for e in decode_batch(msg.payload).events:
            if isinstance(e, BlockStored):
                held.update(e.block_hashes)
            elif isinstance(e, BlockRemoved):
                held.difference_update(e.block_hashes)
            else:
                held.clear()
    sub.close(linger=0)
    ctx.term()
    shutil.rmtree(ipc, ignore_errors=True)
    print(
        f"pool {pool_gb:.2f} GB ({num_blocks} blocks x {BLOCK_TOKENS} tokens, {dims}); "
        f"{requests} requests in {wall:.2f} s"
    )
    print(
        f"iteration (admit + release + flush + sync): median {statistics.median(iter_s) * 1e3:.3f} ms, "
        f"p99 {sorted(iter_s)[int(0.99 * len(iter_s))] * 1e3:.3f} ms"
    )
    print(
        f"blocks written {written} ({written * BLOCK_TOKENS / wall:,.0f} tokens/s), "
        f"reused {reused}, evicted {evicted}; held now {len(truth)}"
    )
    ok = held == truth
    print(f"event stream reproduces the cache's block set: {'yes' if ok else 'NO'}")
    if not ok:
        raise SystemExit(1)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=300, help="measured steps per mode")
    ap.add_argument("--block", type=int, default=28, help="steps per interleaved block")
    ap.add_argument("--cpu-smoke", action="store_true", help="tiny sizes on the CPU")
    ap.add_argument("--skip-cache", action="store_true", help="only part 1")
    ap.add_argument("--no-sweep", action="store_true", help="skip the coalesce_s sweep rows")
    args = ap.parse_args()
    if args.cpu_smoke:
        device = torch.device("cpu")
        args.steps = min(args.steps, 40)
        args.block = min(args.block, 13)
    elif torch.cuda.is_available():
        device = torch.device("cuda")
    else:
        raise SystemExit("no CUDA device; use --cpu-smoke to check the script on a CPU")
    gpu = torch.cuda.get_device_name(0) if device.type == "cuda" else "cpu"
    print(
        f"torch {torch.__version__}, device {gpu}, {os.cpu_count()} CPUs, "
        f"python {sys.version.split()[0]}"
    )
    run_decode_loop(args, device)
    if not args.skip_cache:
        run_reference_cache(args, device)


if __name__ == "__main__":
    main()
