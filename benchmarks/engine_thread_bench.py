"""What publishing costs the engine thread (GIL contention), side by side with vLLM 0.33 (issue 10).

An engine's scheduler is Python: every microsecond a publisher's thread holds
the GIL is a microsecond the scheduler may wait. This measures that loss.

Engine loop, each iteration: a fixed amount of pure-Python work that never
releases the GIL (calibrated to about 1 ms, like a busy scheduler; "gpu": about
200 us of Python, then 1.5 ms with the GIL released, like waiting on a GPU
step: a busy wait, as CUDA's synchronize spins; ``--gpu-wait sleep``: time.sleep),
then one batch: B stored blocks of 16 tokens (one chain) and B removed blocks,
hashes and tokens as Python lists, the way vLLM hands them. A SUB process
receives everything (seq gaps are counted and printed).

Publishers, each a case:
- ``vllm``: vLLM 0.33's own ``ZmqEventPublisher`` from its wheel, fed vLLM's
  ``KVEventBatch`` / ``BlockStored`` / ``BlockRemoved`` structs;
- ``kvwire-wire``: kvwire's ``EventCollector`` + ``EventPublisher`` speaking
  the engines' wire (epoch, heartbeat and snapshot mirror off);
- ``kvwire-plugin``: the publisher ``kvwire.integrations`` puts into vLLM,
  fed vLLM's structs (the engines' wire, as the plugin's defaults have it);
- ``kvwire-defaults``: ``EventCollector`` + ``EventPublisher`` with its
  defaults (epoch, heartbeat, replay with the snapshot mirror);
- ``hooks-only``: the ``EventCollector`` hooks with a publisher that drops
  every batch (an ``EventPublisher`` closed before its first batch: the
  collector's native path up to the queue, which drops and counts it; no sender
  thread, no SUB): what the engine thread pays for its own hook calls, the
  floor the issue aims at;
- ``kvwire-nosub``: ``kvwire-wire`` with no SUB connected (libzmq drops each
  message at once): what is left of ``kvwire-wire`` without the consumer and
  the transport running on the other core (engine-thread table only).
- ``call-only``, ``alloc-only`` and ``structs-only`` (engine table only, on
  request with ``--cases``): no publisher at all; the harness's own publishing
  step; that step plus allocating and dropping what the Python collector's
  hooks allocated per iteration (a records list and two record tuples; the
  native hooks allocate nothing); and that step plus building and dropping
  vLLM's ``KVEventBatch`` / ``BlockStored`` / ``BlockRemoved``, which vLLM's
  scheduler builds per iteration whatever publisher it has (the floor of
  ``vllm`` and ``kvwire-plugin``). They separate what the harness and Python
  allocation cost the CPU-bound loop from publishing.
Every publisher has a replay endpoint.
The engine loop builds new lists of new ints every iteration, with or without publishing,
and drops them after the call, as an engine does: a publisher that keeps them past the call
frees them later, on the engine thread, after its own thread has read them, and that costs
the engine more than anything else here. ``--prebuilt-lists``: four prebuilt variants instead,
never freed (how the tables before December 2026 were taken; it hides that cost).

This 2-core VM gives a process a full or a half core at random, so a baseline
from another process means nothing: within one process, blocks of iterations
with publishing alternate with blocks without, and the engine thread is pinned
alone on one core while everything else (the sender thread, libzmq's I/O
threads, the SUB process) runs on the other, as on a host with cores to spare,
so what remains is the GIL (and, on a VM whose two vCPUs share a physical
core, the other core's load: compare ``kvwire-nosub``). Slowdown = median iteration with publishing /
median without - 1 (issue 10's figure); the figure printed is the median over
``--runs`` runs (the runs' range in brackets). A second line gives the same by
mean iteration: the sender takes the GIL in bursts (a forced switch after the
interpreter's 5 ms switch interval), which land in a minority of iterations
that the median does not see, so the mean is the time the engine loses
(kvwire's native sender takes it only for batches Python must encode). A
third line ("paired") compares each block with publishing only with the block
next to it without (the two ~0.1 s apart), so that the host's speed changing
between seconds cancels out: the median over every round of every run, with
its 95% confidence interval in parentheses (order statistics, no assumption
on the distribution). The runs' medians above swing by several points on this
VM, more than the targets; the paired figure is how to tell a 0.5% effect
from noise (more ``--runs`` narrow its interval). A
fourth line ("call") gives the median time of the publishing step itself
(hooks, flush, ``publish()``) in the iterations that publish: what the engine
thread pays in its own calls, apart from anything it waits for; "p99" its 99th
percentile (kvwire: the first batch of a block, after the sender went idle in the
block without publishing, wakes it with a syscall).

``--sections calls``: the publishing step alone, every case in one process with
no SUB, alternated iteration by iteration after the loop's work, each against
its floor: ``kvwire-nosub`` (hooks and a live ``flush()``) against
``hooks-only`` (the same into a closed publisher), ``kvwire-plugin`` and
``vllm`` against ``structs-only``.

Second table: whole-process CPU per stored block, publishing as fast as a loop
can (no work between batches, paced so the queue stays below 512), kvwire
against vLLM, runs alternated, unpinned.

Run: ``python benchmarks/engine_thread_bench.py`` (``--quick``: 3 runs, fewer iterations).
Needs vLLM 0.33.0's wheel (fetched with ``pip download`` into ``~/.cache/kvwire/wheels``).
"""

from __future__ import annotations

import argparse
import logging
import multiprocessing as mp
import os
import random
import resource
import socket
import statistics
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import zmq

BLOCK_TOKENS = 16
CASES = ("vllm", "kvwire-wire", "kvwire-plugin", "kvwire-defaults", "hooks-only", "kvwire-nosub")
# Floors of the engine table only (no publisher at all): the harness's own step; that step
# plus what the Python collector's hooks allocated per iteration; that step plus vLLM's structs.
FLOORS = ("call-only", "alloc-only", "structs-only")
LOOPS = ("cpu", "gpu")
TARGET_NOTE = "target: <= max(0.5%, 1/4 of vLLM's)"
CPU_RATIO_TARGET = 0.5
_FRESH = True  # the engine builds new lists every iteration (--prebuilt-lists: not)
_OPTIONS: dict[str, Any] = {}  # extra EventPublisher keywords for the kvwire-wire/-defaults cases


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


# --- the SUB process ------------------------------------------------------------------


def subscriber(endpoint: str, conn: Any) -> None:
    """Receive everything until told to stop; report messages and seq gaps."""
    ctx = zmq.Context()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.setsockopt(zmq.RCVHWM, 0)
    sub.connect(endpoint)
    got = gaps = 0
    prev = -1
    told = False
    while True:
        if sub.poll(100):
            frames = sub.recv_multipart()
            seq = int.from_bytes(frames[1], "big")
            if got == 0:
                conn.send("ready")
            elif seq != prev + 1:
                gaps += max(0, seq - prev - 1)
            prev = seq
            got += 1
            continue
        if told or (conn.poll() and conn.recv() == "stop"):
            if told:
                break
            told = True  # one more quiet poll, then report
    conn.send((got, gaps))
    sub.close(linger=0)
    ctx.term()


# --- inputs and publishers -----------------------------------------------------------------


@dataclass
class Inputs:
    """Each iteration's lists: a few prebuilt variants, or (``fresh``) new lists of new ints
    built by the engine loop every iteration, with or without publishing, as an engine builds
    them and drops them after the call."""

    stores: list[tuple[list[int], int, list[int]]]
    removes: list[list[int]]
    fresh: bool = False
    current: tuple[list[int], int, list[int], list[int]] | None = None

    def make(self, n: int) -> None:
        """Fresh mode: iteration ``n``'s lists (new list and int objects; the old ones dropped)."""
        h, p, t = self.stores[n % len(self.stores)]
        k = n % 1000 + 1
        self.current = ([x ^ k for x in h], p ^ k, [x ^ k for x in t],
                        [x ^ k for x in self.removes[n % len(self.removes)]])  # fmt: skip

    def at(self, i: int) -> tuple[list[int], int, list[int], list[int]]:
        if self.fresh:
            if self.current is None:
                self.make(i)
            return self.current
        h, p, t = self.stores[i % len(self.stores)]
        return h, p, t, self.removes[i % len(self.removes)]


def make_inputs(blocks: int, variants: int = 4, seed: int = 0, fresh: bool = False) -> Inputs:
    rng = random.Random(seed)
    stores = []
    removes = []
    for _ in range(variants):
        hashes = [rng.getrandbits(64) for _ in range(blocks)]
        tokens = [rng.randrange(128_000) for _ in range(blocks * BLOCK_TOKENS)]
        stores.append((hashes, rng.getrandbits(64), tokens))
        removes.append([rng.getrandbits(64) for _ in range(blocks)])
    return Inputs(stores, removes, fresh)


class Case:
    """One publisher under test: the engine's per-iteration publish call, drain, close."""

    def __init__(self, name: str, inputs: Inputs, options: dict[str, Any] | None = None) -> None:
        self.name = name
        pub_port, replay_port = free_port(), free_port()
        self.endpoint = f"tcp://127.0.0.1:{pub_port}"
        at = inputs.at
        self.publish: Callable[[int], None]
        self.pub: Any
        self._depth: Callable[[bool], int]
        if name in ("vllm", "kvwire-plugin", "structs-only"):
            from tests.integrations.engines import import_vllm

            kv = import_vllm().kv_events
            if name == "structs-only":
                self.pub = _Discard()
                self._depth = lambda mirror: 0
            elif name == "vllm":
                self.pub = kv.ZmqEventPublisher(
                    0, f"tcp://*:{pub_port}", f"tcp://*:{replay_port}"
                )
                q = self.pub._event_queue
                self._depth = lambda mirror: int(q.unfinished_tasks)
            else:
                from kvwire.integrations.adapter import factory_for
                from kvwire.integrations.vllm import VllmEventPublisher

                for var in [v for v in os.environ if v.startswith("KVWIRE_")]:
                    del os.environ[var]  # the plugin's defaults: the engines' wire
                self.pub = factory_for(kv, VllmEventPublisher)(
                    endpoint=f"tcp://*:{pub_port}",
                    replay_endpoint=f"tcp://*:{replay_port}",
                    data_parallel_rank=0,
                )
                inner = self.pub.publisher
                self._depth = lambda mirror: _kvwire_backlog(inner, mirror)
            batch_cls, stored_cls, removed_cls = kv.KVEventBatch, kv.BlockStored, kv.BlockRemoved
            publish_struct = self.pub.publish

            def publish(i: int) -> None:
                h, p, t, r = at(i)
                stored = stored_cls(
                    block_hashes=h, parent_block_hash=p, token_ids=t, block_size=BLOCK_TOKENS,
                    lora_id=None, medium="GPU", lora_name=None,
                )  # fmt: skip
                removed = removed_cls(block_hashes=r, medium="GPU")
                publish_struct(batch_cls(ts=time.time(), events=[stored, removed]))

            self.publish = publish
            self._close = self.pub.close if name == "structs-only" else self.pub.shutdown
        elif name in FLOORS:
            alloc = name == "alloc-only"

            def publish(i: int) -> None:
                h, p, t, r = at(i)
                if alloc:  # the records list and the two record tuples of one iteration
                    records = [(0, h, p, t, None, "GPU", None, None)]
                    records.append((1, r, "GPU", None))

            self.publish = publish
            self.pub = _Discard()
            self._depth = lambda mirror: 0
            self._close = self.pub.close
        else:
            from kvwire.publisher import EventCollector

            options = dict(options or {})
            if name in ("kvwire-wire", "kvwire-nosub", "hooks-only"):
                options.update(epoch=False, heartbeat_s=None, snapshot=False)
            self.pub = _publisher(self.endpoint, f"tcp://127.0.0.1:{replay_port}", options)
            if name == "hooks-only":
                self.pub.close()  # never bound: every batch is dropped (and counted) at once
            else:
                self.pub.start()
            col = EventCollector(self.pub, BLOCK_TOKENS)
            stored_hook, removed_hook, flush = col.stored, col.removed, col.flush

            def publish(i: int) -> None:
                h, p, t, r = at(i)
                stored_hook(h, p, t)
                removed_hook(r)
                flush()

            self.publish = publish
            inner = self.pub
            self._depth = lambda mirror: _kvwire_backlog(inner, mirror)
            self._close = self.pub.close

    def backlog(self, mirror: bool = True) -> int:
        """Batches published but not yet sent (``mirror``: or not yet applied to the mirror)."""
        return self._depth(mirror)

    def drain(self, timeout: float = 60.0) -> None:
        end = time.monotonic() + timeout
        while self.backlog():
            if time.monotonic() > end:
                raise RuntimeError(f"{self.name}: the sender did not drain")
            time.sleep(0.0005)

    def close(self) -> None:
        self._close()


def _publisher(endpoint: str, replay: str, settings: dict[str, Any]) -> Any:
    """An EventPublisher with ``settings`` (PublisherConfig fields); a tree from before
    PublisherConfig takes them as keywords under their old names (ab_trees.py alternates trees)."""
    import kvwire.publisher as kp

    if hasattr(kp, "PublisherConfig"):
        return kp.EventPublisher(endpoint, replay, kp.PublisherConfig(**settings))
    old = {"heartbeat_s": "heartbeat", "send_coalesce_s": "coalesce_s"}
    return kp.EventPublisher(endpoint, replay, **{old.get(k, k): v for k, v in settings.items()})


class _Discard:
    """A publisher that drops every batch: the floors' stand-in (no sender, no socket)."""

    rank = 0
    endpoint = None

    def publish(self, batch: Any) -> bool:
        return True

    def stats(self) -> Any:
        return None

    def close(self) -> None:
        pass


def _kvwire_backlog(pub: Any, mirror: bool) -> int:
    if type(pub) is _Discard:
        return 0
    s = pub.stats()
    done = s.published + s.dropped_send_error + s.dropped_encode_error + s.dropped_queue_full
    # Batches the snapshot mirror has yet to apply count too: that work is the publisher's.
    return int(s.enqueued + s.dropped_queue_full - done) + (s.mirror_pending if mirror else 0)


def connect(case: Case, ctx: mp.context.SpawnContext) -> tuple[Any, Any]:
    """A SUB process that has received at least one batch (the slow joiner)."""
    if type(case.pub) is _Discard or case.name in ("kvwire-nosub", "hooks-only"):
        return None, None
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=subscriber, args=(case.endpoint, child), daemon=True)
    proc.start()
    deadline = time.monotonic() + 30
    i = 0
    while not parent.poll(0.01):
        if time.monotonic() > deadline:
            raise RuntimeError("the SUB process never received anything")
        case.publish(i)
        i += 1
    assert parent.recv() == "ready"
    case.drain()
    return proc, parent


def finish(case: Case, proc: Any, conn: Any) -> int:
    """Close the case; the SUB's seq gaps."""
    case.drain()
    if conn is None:
        case.close()
        return 0
    conn.send("stop")
    _got, gaps = conn.recv()
    proc.join(10)
    case.close()
    return int(gaps)


# --- the engine loop --------------------------------------------------------------------------


def spin(n: int) -> int:
    """Pure-Python work that never releases the GIL."""
    x = 0
    for i in range(n):
        x ^= i * 7
    return x


_SPIN_C = r"""
#include <time.h>
/* Busy until `seconds` have passed. ctypes releases the GIL around the call. */
void kvw_bench_spin(double seconds) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    double end = (double)t.tv_sec + 1e-9 * (double)t.tv_nsec + seconds;
    do clock_gettime(CLOCK_MONOTONIC, &t);
    while ((double)t.tv_sec + 1e-9 * (double)t.tv_nsec < end);
}
"""


def gil_free_spin() -> Callable[[float], None]:
    """A busy wait with the GIL released, like an engine's wait on its GPU step
    (CUDA's synchronize spins by default). ``time.sleep`` instead lets the core go
    idle, and on a VM the time to wake a halted vCPU (tens of µs, varying) then
    swamps the effect measured here. Built with the C compiler the extensions need,
    once, into ``~/.cache/kvwire/bench``."""
    import ctypes
    import hashlib
    import subprocess

    cache = Path.home() / ".cache" / "kvwire" / "bench"
    cache.mkdir(parents=True, exist_ok=True)
    lib = cache / f"spin-{hashlib.sha256(_SPIN_C.encode()).hexdigest()[:12]}.so"
    if not lib.exists():
        src = lib.with_suffix(".c")
        src.write_text(_SPIN_C)
        cc = os.environ.get("CC", "cc")
        tmp = lib.with_suffix(f".{os.getpid()}.tmp")
        try:
            subprocess.run([cc, "-O2", "-shared", "-fPIC", "-o", str(tmp), str(src)], check=True)
        except (OSError, subprocess.CalledProcessError) as e:
            raise SystemExit(f"--gpu-wait spin needs a C compiler ({cc}: {e}); or use --gpu-wait sleep") from e
        tmp.replace(lib)
    fn = ctypes.CDLL(str(lib)).kvw_bench_spin
    fn.argtypes = [ctypes.c_double]
    fn.restype = None
    return fn  # type: ignore[no-any-return]


# How the "gpu" loop waits its 1.5 ms with the GIL released (``--gpu-wait``).
_GPU_WAIT: Callable[[float], None] = time.sleep


def calibrate(seconds: float) -> int:
    n = 1000
    while True:
        t0 = time.perf_counter()
        spin(n)
        took = time.perf_counter() - t0
        if took > 0.002:
            break
        n *= 2
    samples = []
    for _ in range(15):
        t0 = time.perf_counter()
        spin(n)
        samples.append(time.perf_counter() - t0)
    return max(1, int(n * seconds / statistics.median(samples)))


_CORES: list[int] = []


def cores() -> tuple[set[int], set[int]]:
    """The engine's core and the rest (the cores the process was started with)."""
    if not _CORES:
        _CORES.extend(sorted(os.sched_getaffinity(0)))
    avail = _CORES
    if len(avail) < 2:
        raise SystemExit("needs at least 2 cores to pin the engine thread alone")
    return {avail[0]}, set(avail[1:])


def engine_run(
    name: str, blocks: int, loop: str, block_iters: int, rounds: int, spins: dict[str, int]
) -> tuple[float, float, list[float], float, float, int]:
    """One run: the engine thread's slowdown by median and by mean iteration, and per
    round (a block with publishing against the block next to it without), the median
    and 99th-percentile time (µs) of the publishing step itself (hooks, flush, publish);
    the SUB's gaps."""
    engine_core, other = cores()
    me = threading.get_native_id()
    os.sched_setaffinity(me, other)  # threads and processes made now inherit "other"
    inputs = make_inputs(blocks, fresh=_FRESH)
    case = Case(name, inputs, _OPTIONS)
    proc, conn = connect(case, mp.get_context("spawn"))
    os.sched_setaffinity(me, engine_core)
    work = spins["cpu"] if loop == "cpu" else spins["gpu"]
    wait = 0.0 if loop == "cpu" else 0.0015
    gpu_wait = _GPU_WAIT
    publish = case.publish
    clock = time.perf_counter
    on: list[float] = []
    off: list[float] = []
    calls: list[float] = []
    pairs: list[float] = []
    i = n = 0
    make = inputs.make if inputs.fresh else None
    try:
        for r in range(rounds):
            block: dict[bool, list[float]] = {True: [], False: []}
            for with_pub in (True, False) if r % 2 == 0 else (False, True):
                out = block[with_pub]
                for _ in range(block_iters):
                    t0 = clock()
                    if make:
                        make(n)  # the engine's own lists, with or without publishing
                        n += 1
                    spin(work)
                    if wait:
                        gpu_wait(wait)
                    if with_pub:
                        t1 = clock()
                        publish(i)
                        calls.append(clock() - t1)
                        i += 1
                    out.append(clock() - t0)
                case.drain()
            on += block[True]
            off += block[False]
            pairs.append(statistics.median(block[True]) / statistics.median(block[False]) - 1)
    finally:
        os.sched_setaffinity(me, other)
        gaps = finish(case, proc, conn)
    median = statistics.median(on) / statistics.median(off) - 1
    mean = statistics.fmean(on) / statistics.fmean(off) - 1
    p99 = statistics.quantiles(calls, n=100)[98]
    return median, mean, pairs, statistics.median(calls) * 1e6, p99 * 1e6, gaps


def median_ci(xs: list[float]) -> tuple[float, float, float]:
    """The median and its distribution-free 95% confidence interval (order statistics)."""
    s = sorted(xs)
    n = len(s)
    half = 0.98 * n**0.5  # 1.96 * sqrt(n) / 2 ranks each side
    lo, hi = max(0, int(n / 2 - half)), min(n - 1, int(n / 2 + half + 0.5))
    return statistics.median(s), s[lo], s[hi]


# --- whole-process CPU per block ---------------------------------------------------------------


def cpu_seconds() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def throughput_run(name: str, blocks: int, iterations: int) -> tuple[float, int]:
    """Whole-process CPU microseconds per stored block, publishing as fast as the loop can."""
    engine_core, other = cores()
    os.sched_setaffinity(threading.get_native_id(), engine_core | other)
    case = Case(name, make_inputs(blocks), _OPTIONS)
    proc, conn = connect(case, mp.get_context("spawn"))
    publish, backlog = case.publish, case.backlog
    c0 = cpu_seconds()
    for i in range(iterations):
        publish(i)
        # Paced by the send queue alone: the mirror applies its feed every 80 ms by design
        # (an engine never waits for it); the drain below counts its work.
        if i & 63 == 0 and backlog(False) > 512:
            while backlog(False) > 64:
                time.sleep(0.001)
    case.drain()
    c1 = cpu_seconds()
    gaps = finish(case, proc, conn)
    return (c1 - c0) * 1e6 / (iterations * blocks), gaps


# --- the publishing call alone ---------------------------------------------------------------

CALL_PAIRS = (
    ("kvwire-nosub", "hooks-only"),
    ("kvwire-plugin", "structs-only"),
    ("vllm", "structs-only"),
)


def calls_run(blocks: int, loop: str, iters: int, spins: dict[str, int]) -> dict[str, float]:
    """The publishing step's median time (µs) per case, every case in one process,
    alternated iteration by iteration after the loop's work; no SUB (nothing sent
    anywhere): what each publisher's own calls cost a cold engine thread."""
    engine_core, other = cores()
    me = threading.get_native_id()
    names = sorted({n for pair in CALL_PAIRS for n in pair})
    os.sched_setaffinity(me, other)
    inputs = make_inputs(blocks)
    cases = [Case(n, inputs, _OPTIONS) for n in names]
    os.sched_setaffinity(me, engine_core)
    work = spins[loop]
    wait = 0.0 if loop == "cpu" else 0.0015
    gpu_wait = _GPU_WAIT
    clock = time.perf_counter
    times: dict[str, list[float]] = {n: [] for n in names}
    try:
        for i in range(iters):
            for case in cases if i % 2 == 0 else cases[::-1]:
                spin(work)
                if wait:
                    gpu_wait(wait)
                t0 = clock()
                case.publish(i)
                times[case.name].append(clock() - t0)
    finally:
        os.sched_setaffinity(me, other)
        for case in cases:
            case.drain()
            case.close()
    return {n: statistics.median(v) * 1e6 for n, v in times.items()}


# --- main ------------------------------------------------------------------------------------


def main() -> None:
    global _FRESH, _GPU_WAIT
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="3 runs, fewer iterations")
    parser.add_argument("--runs", type=int, default=None)
    parser.add_argument("--cases", nargs="+", default=list(CASES), choices=CASES + FLOORS)
    parser.add_argument("--sizes", nargs="+", type=int, default=[16, 256])
    parser.add_argument("--loops", nargs="+", default=list(LOOPS), choices=LOOPS)
    parser.add_argument(
        "--sections", nargs="+", default=["engine", "cpu"], choices=["engine", "cpu", "calls"]
    )
    parser.add_argument(
        "--coalesce-ms", type=float, default=None, help="kvwire's coalesce_s (default: its own)"
    )
    parser.add_argument(
        "--prebuilt-lists", action="store_true",
        help="engine table: 4 prebuilt lists, never freed, not new ones every iteration",
    )  # fmt: skip
    parser.add_argument(
        "--gpu-wait", choices=("spin", "sleep"), default="spin",
        help="the gpu loop's 1.5 ms without the GIL: a busy wait (default) or time.sleep "
        "(how the tables before 2026-12-01 evening were taken)",
    )  # fmt: skip
    args = parser.parse_args()
    _FRESH = not args.prebuilt_lists
    if args.gpu_wait == "spin":
        _GPU_WAIT = gil_free_spin()
    if args.coalesce_ms is not None:
        _OPTIONS["coalesce_s"] = args.coalesce_ms / 1000
    logging.getLogger("kvwire").setLevel(logging.ERROR)  # the plugin's loopback-bind warning
    runs = args.runs or (3 if args.quick else 5)
    block_iters, rounds = (40, 6) if args.quick else (60, 8)

    engine_core, other = cores()
    os.sched_setaffinity(threading.get_native_id(), engine_core)
    spins = {"cpu": calibrate(0.001), "gpu": calibrate(0.0002)}
    os.sched_setaffinity(threading.get_native_id(), other)
    print(
        f"engine thread pinned to core {sorted(engine_core)}, everything else to {sorted(other)}; "
        f"{runs} runs per case, each {rounds} alternated blocks of {block_iters} iterations "
        f"with publishing and {rounds} without"
    )
    if "engine" in args.sections:
        print(f"\nEngine-thread slowdown, median of {runs} runs [min..max]; {TARGET_NOTE}")
        header = f"{'loop':>4} {'B':>4} {'':>6} " + " ".join(f"{c:>26}" for c in args.cases)
        header += "  gaps"
        print(header)
        print("-" * len(header))
        for loop in args.loops:
            for blocks in args.sizes:
                per: dict[str, list[float]] = {c: [] for c in args.cases}
                means: dict[str, list[float]] = {c: [] for c in args.cases}
                paired: dict[str, list[float]] = {c: [] for c in args.cases}
                steps: dict[str, list[float]] = {c: [] for c in args.cases}
                tails: dict[str, list[float]] = {c: [] for c in args.cases}
                gaps = 0
                for r in range(runs):
                    order = args.cases if r % 2 == 0 else list(reversed(args.cases))
                    for name in order:
                        slow, mean, pairs, step, tail, g = engine_run(
                            name, blocks, loop, block_iters, rounds, spins
                        )
                        per[name].append(slow)
                        means[name].append(mean)
                        paired[name] += pairs
                        steps[name].append(step)
                        tails[name].append(tail)
                        gaps += g
                for label, table in (("median", per), ("mean", means)):
                    cells = [
                        f"{statistics.median(v) * 100:+.2f}% [{min(v) * 100:+.1f}..{max(v) * 100:+.1f}]"
                        for v in (table[name] for name in args.cases)
                    ]
                    first = label == "median"
                    row = f"{loop if first else '':>4} {blocks if first else '':>4} {label:>6} "
                    print(
                        row
                        + " ".join(f"{c:>26}" for c in cells)
                        + (f"  {gaps}" if label == "median" else "")
                    )
                cells = []
                for name in args.cases:
                    mid, lo, hi = median_ci(paired[name])
                    cells.append(f"{mid * 100:+.2f}% ({lo * 100:+.1f}..{hi * 100:+.1f})")
                print(f"{'':>4} {'':>4} {'paired':>6} " + " ".join(f"{c:>26}" for c in cells))
                for label, times in (("call", steps), ("p99", tails)):
                    cells = [f"{statistics.median(times[name]):.2f} us" for name in args.cases]
                    print(f"{'':>4} {'':>4} {label:>6} " + " ".join(f"{c:>26}" for c in cells))
                sys.stdout.flush()
    if "calls" in args.sections:
        iters = 300 if args.quick else 800
        print(
            f"\nThe publishing call alone (µs, median of {runs} runs of {iters} iterations, every "
            "case in one process, alternated; no SUB): case - its floor"
        )
        for loop in args.loops:
            for blocks in args.sizes:
                got = [calls_run(blocks, loop, iters, spins) for _ in range(runs)]
                med = {n: statistics.median(g[n] for g in got) for n in got[0]}
                cells = [
                    f"{a} {med[a]:.2f} - {b} {med[b]:.2f} = "
                    f"{statistics.median(g[a] - g[b] for g in got):+.2f}"
                    for a, b in CALL_PAIRS
                ]
                print(f"{loop:>4} {blocks:>4}  " + "   ".join(cells))
                sys.stdout.flush()
    if "cpu" in args.sections:
        print(
            f"\nWhole-process CPU us per stored block, as fast as possible, median of {runs} "
            f"alternated runs; target kvwire <= {CPU_RATIO_TARGET}x vLLM"
        )
        # Nothing received, or nothing published: no figure.
        cases = [c for c in args.cases if c != "kvwire-nosub" and c not in FLOORS]
        for blocks in args.sizes:
            n = (4000 if args.quick else 10_000) if blocks <= 16 else (600 if args.quick else 1500)
            per = {c: [] for c in cases}
            gaps = 0
            for r in range(runs):
                order = cases if r % 2 == 0 else list(reversed(cases))
                for name in order:
                    cpu, g = throughput_run(name, blocks, n)
                    per[name].append(cpu)
                    gaps += g
            med = {c: statistics.median(v) for c, v in per.items()}
            base = med.get("vllm")
            cells = [
                f"{c} {med[c]:.3f}" + (f" ({med[c] / base:.2f}x)" if base and c != "vllm" else "")
                for c in cases
            ]
            print(f"  B={blocks:>4}, {n} batches: " + "  ".join(cells) + f"  gaps {gaps}")
            sys.stdout.flush()


if __name__ == "__main__":
    main()
