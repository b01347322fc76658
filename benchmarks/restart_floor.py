"""What a warm restart cannot beat on this host: the fresh memory its index is built in.

A restarted router is a new process: it imports its checkpoint's view into tables whose every
page is new to it, and the kernel zeroes each on first touch. On a VM whose host backs guest
memory lazily (and takes freed memory back a huge page at a time, as free page reporting
does), a first touch also costs the host a fault, and a huge page's far more than its small
pages' (the import faults its tables in with small pages first for that reason). This prints,
in one run:

- the first-touch rate of fresh anonymous memory in small pages (as an import faults its
  tables in) and advised for huge pages (as tables grown by stores are), one thread, then
  huge pages on two at once, each after ``--settle`` idle seconds (as a router is down
  before it restarts), and of the same amount touched again at once (pages just freed: what
  a warm host gives);
- a fresh process loading a checkpoint of ``--ranks`` x ``--blocks`` blocks (fleet_lifecycle's
  case 3 fleet: 1,024 x 20,000, content-chained runs of 16 blocks) through ``load_file`` into a
  ``PrefixIndex``: wall time, user and system CPU, the index's bytes;
- the checkpoint file read through a read-only mapping (its pages are in the page cache: memory
  a load could use without fresh pages);
- with ``--beside kvwire,stock``, the loads again beside ``fleet_lifecycle``'s engines of
  that kind, running (its cases 3 and 4 share the host with them);
- the index's bytes read from a file into fresh memory and CRC-checked: what a load would
  cost if the checkpoint held the tables in their memory layout (a format kvwire does not
  have), the floor of that design;
- the floor: the index's bytes at the first-touch rate, beside case 3's 3 s target.

``--growth`` instead grows a fresh index by stores to the same size and prints its longest
store (where the shared table doubles: its fresh memory is faulted in there) and the build's
time; run it in the trees to compare.

Run: ``.venv/bin/python benchmarks/restart_floor.py [--ranks 1024] [--blocks 20000]``
(about 3 min and 4 GB at the defaults, 5 min and 4.4 GB more with ``--beside``; run it
alone: other processes' memory changes what is fresh).
"""

from __future__ import annotations

import argparse
import ctypes
import json
import mmap
import os
import subprocess
import sys
import tempfile
import threading
import time
import zlib

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import numpy as np

from kvwire.prefix_index import PrefixIndex
from kvwire.subscriber.checkpoint import Encoder, Header, Record, load_file, write_file
from kvwire.subscriber.seq import StreamPosition
from kvwire.wire.codec import encode_batch
from kvwire.wire.events import BlockStored, KVEvent, KVEventBatch

BLOCK = 16
RUN = 16
MADV_POPULATE_WRITE = 23  # Linux >= 5.14
_libc = ctypes.CDLL(None, use_errno=True)  # (a foreign call lets go of the GIL)


def touch(region: mmap.mmap, start: int, length: int) -> None:
    """Fault in ``region[start:start + length]`` for writing, as the index populates its tables."""
    base = ctypes.addressof(ctypes.c_char.from_buffer(region)) + start
    if _libc.madvise(ctypes.c_void_p(base), ctypes.c_size_t(length), MADV_POPULATE_WRITE) != 0:
        np.frombuffer(region, np.uint8, length, start)[::4096] = 1  # an older kernel


def first_touch(nbytes: int, threads: int, huge: bool = True) -> float:
    """Seconds to fault in ``nbytes`` of a new mapping, split among ``threads``, in huge
    pages where the kernel has them, or in small ones."""
    region = mmap.mmap(-1, nbytes)
    region.madvise(mmap.MADV_HUGEPAGE if huge else mmap.MADV_NOHUGEPAGE)
    part = nbytes // threads
    workers = [
        threading.Thread(target=touch, args=(region, i * part, part)) for i in range(threads)
    ]
    t = time.perf_counter()
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    seconds = time.perf_counter() - t
    region.close()
    return seconds


def rank_events(r: int, blocks: int) -> list[KVEvent]:
    """Rank ``r``'s ``blocks`` blocks as content-chained runs of ``RUN``, hashes and tokens
    of its own (every rank of a fleet holds as many)."""
    tokens = np.arange(blocks * BLOCK, dtype=np.int64) + r * (blocks * BLOCK)
    h = 1 + r * blocks
    events: list[KVEvent] = []
    for c in range(0, blocks, RUN):
        n = min(RUN, blocks - c)
        toks = tokens[c * BLOCK : (c + n) * BLOCK].tolist()
        events.append(BlockStored(list(range(h + c, h + c + n)), None, toks, BLOCK))
    return events


def write_checkpoint(path: str, ranks: int, blocks: int) -> int:
    """A checkpoint of ``ranks`` views, each of ``blocks`` blocks in content-chained runs."""
    index = PrefixIndex(BLOCK)
    enc = Encoder()
    fleet = [("w", r, f"tcp://127.0.0.1:{5557 + r}") for r in range(ranks)]
    pieces = [
        enc.start_parts(Header(view_format=index.view_format(), created=time.time(), fleet=fleet))
    ]
    for r in range(ranks):
        payload = encode_batch(KVEventBatch(ts=time.time(), events=rank_events(r, blocks)))
        index.apply_payload("w", r, payload)
        pos = StreamPosition(topic=b"", epoch=None, next_seq=1, anchor_seq=0, anchor=payload[:64])
        pieces.append(
            enc.record_parts(
                Record(worker_id="w", rank=r, position=pos, blob=index.export_rank("w", r))
            )
        )
        index.clear("w", r)
    pieces.append(enc.end_parts())
    return write_file(path, pieces)


def child(path: str, ranks: int) -> None:
    """A fresh process loads the checkpoint: what a restarted router does first."""
    index = PrefixIndex(BLOCK)
    t0, c0 = time.perf_counter(), os.times()
    load_file(path, index, [("w", r) for r in range(ranks)])
    t1, c1 = time.perf_counter(), os.times()
    print(json.dumps({
        "wall": t1 - t0, "user": c1.user - c0.user, "sys": c1.system - c0.system,
        "bytes": index.stats().memory_bytes,
    }))  # fmt: skip


def growth(ranks: int, blocks: int) -> None:
    """A fresh index grown by stores to ``ranks`` x ``blocks`` (batches of 64 events of 16
    blocks): the longest ``apply_payload``, which is where its shared table doubles and its
    fresh memory is faulted in, and the whole build's time."""
    index = PrefixIndex(BLOCK)
    longest, at = 0.0, 0
    t0 = time.perf_counter()
    for r in range(ranks):
        events = rank_events(r, blocks)
        for i in range(0, len(events), 64):
            payload = encode_batch(KVEventBatch(ts=0.0, events=events[i : i + 64]))
            t = time.perf_counter()
            index.apply_payload("w", r, payload)
            took = time.perf_counter() - t
            if took > longest:
                longest, at = took, index.stats().blocks
    print(f"grown by stores to {ranks} x {blocks:,} blocks in {time.perf_counter() - t0:.1f} s; "
          f"the longest apply {longest * 1e3:.0f} ms (at {at:,} blocks)")  # fmt: skip


def image_load(nbytes: int, directory: str) -> tuple[float, float]:
    """What a load of the index's tables in their memory layout would cost, a design that
    skips the import's work: ``nbytes`` read from a file in the page cache into fresh
    memory (small pages, as an import's), and checked with the checkpoint's CRC. Seconds
    for each."""
    path = os.path.join(directory, "image")
    chunk = np.random.default_rng(0).integers(0, 256, 1 << 24, dtype=np.uint8).tobytes()
    with open(path, "wb") as f:
        for _ in range(0, nbytes, len(chunk)):
            f.write(chunk)
    region = mmap.mmap(-1, nbytes)
    region.madvise(mmap.MADV_NOHUGEPAGE)
    try:
        with open(path, "rb", buffering=0) as f:
            t = time.perf_counter()
            done = 0
            view = memoryview(region)
            while done < nbytes:
                got = f.readinto(view[done:])
                if not got:
                    break
                done += got
            read = time.perf_counter() - t
            t = time.perf_counter()
            zlib.crc32(view)
            crc = time.perf_counter() - t
            view.release()
    finally:
        region.close()
        os.unlink(path)
    return read, crc


def load(path: str, ranks: int, where: str) -> dict[str, float]:
    """The checkpoint loaded by a fresh process (the child), printed and returned."""
    out = subprocess.run(
        [sys.executable, __file__, "--child", path, "--ranks", str(ranks)],
        check=True, capture_output=True, text=True,
    )  # fmt: skip
    x: dict[str, float] = json.loads(out.stdout)
    print(f"load in a fresh process{where}: {x['wall']:.2f} s wall, user {x['user']:.2f} s, "
          f"system {x['sys']:.2f} s, index {x['bytes'] / 2**20:.0f} MiB", flush=True)  # fmt: skip
    return x


def beside(kind: str, path: str, args: argparse.Namespace, tmp: str) -> None:
    """The loads again beside a fleet of ``fleet_lifecycle``'s engines of ``kind`` (8
    engines of ``--ranks`` / 8 ranks holding ``--blocks`` blocks, traffic running), as in
    its cases 3 and 4, where the engines share this host with the router."""
    import fleet_lifecycle as fl

    fl.LOG.file = open(os.path.join(tmp, f"{kind}.log"), "w")  # noqa: SIM115 (the fleet's)
    opts = argparse.Namespace(run=RUN, pending=False, rate=1.0)
    procs, per = (8, 1) if kind == "kvwire" else (1, 8)
    fleet = fl.Fleet(
        kind, procs, per, args.ranks // 8, opts, blocks=args.blocks, buffer=64,
        preload_runs=10, tag=kind[:2], taken=set(),
    )  # fmt: skip
    try:
        fleet.preload()
        fleet.ask_all("run")
        for _ in range(args.repeats):
            time.sleep(3)
            load(path, args.ranks, f" beside the {kind} fleet")
    finally:
        fleet.close()
        fl.LOG.file.close()


def mapped_read(path: str) -> float:
    """Seconds to read every page of ``path`` through a read-only mapping (the file is in
    the page cache, just written): memory that needs no fresh page."""
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as m:
        t = time.perf_counter()
        int(np.frombuffer(m, np.uint8)[::4096].sum())
        return time.perf_counter() - t


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--ranks", type=int, default=1024)
    ap.add_argument("--blocks", type=int, default=20000)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--settle", type=float, default=10.0, help="idle seconds before a first touch")
    ap.add_argument("--target", type=float, default=3.0, help="seconds (case 3)")
    ap.add_argument(
        "--growth", action="store_true", help="only: the longest store while an index grows"
    )
    ap.add_argument(
        "--beside",
        type=lambda v: [k for k in v.split(",") if k],
        default=[],
        help="also load beside a running fleet_lifecycle fleet of these kinds: kvwire,stock",
    )
    ap.add_argument("--child", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        child(args.child, args.ranks)
        return
    if args.growth:
        growth(args.ranks, args.blocks)
        return
    with tempfile.TemporaryDirectory(prefix="kvwire-floor-") as tmp:
        path = os.path.join(tmp, "view.ckpt")
        t = time.perf_counter()
        size = write_checkpoint(path, args.ranks, args.blocks)
        print(f"checkpoint: {args.ranks} ranks x {args.blocks:,} blocks, {size / 2**20:.0f} MiB "
              f"(built in {time.perf_counter() - t:.1f} s)", flush=True)  # fmt: skip
        loads = [load(path, args.ranks, "") for _ in range(args.repeats)]
        for kind in args.beside:
            beside(kind, path, args, tmp)
        mapped = size / min(mapped_read(path) for _ in range(args.repeats))
        nbytes = int(loads[-1]["bytes"])
        images = [image_load(nbytes, tmp) for _ in range(args.repeats)]
    print(f"the checkpoint read through a read-only mapping: {mapped / 1e9:.2f} GB/s")
    print(
        f"the index's {nbytes / 2**20:.0f} MiB as table images (not a format kvwire has): "
        "read into fresh memory " + " / ".join(f"{r:.2f}" for r, _ in images) + " s, their CRC "
        + " / ".join(f"{c:.2f}" for _, c in images) + " s"
    )  # fmt: skip
    rates: dict[str, list[float]] = {
        "small pages, one thread": [],
        "huge pages, one thread": [],
        "huge pages, again at once": [],
        "huge pages, two threads": [],
    }
    for _ in range(args.repeats):
        # Idle first, as while a router is down: memory freed by the step before goes back.
        time.sleep(args.settle)
        rates["small pages, one thread"].append(nbytes / first_touch(nbytes, 1, huge=False))
        time.sleep(args.settle)
        rates["huge pages, one thread"].append(nbytes / first_touch(nbytes, 1))
        rates["huge pages, again at once"].append(nbytes / first_touch(nbytes, 1))
        time.sleep(args.settle)
        rates["huge pages, two threads"].append(nbytes / first_touch(nbytes, 2))
    for what, r in rates.items():
        print(f"first touch of {nbytes / 2**20:.0f} MiB, {what}: "
              + " / ".join(f"{x / 1e9:.2f}" for x in r) + " GB/s")  # fmt: skip

    def median(xs: list[dict[str, float]], key: str) -> float:
        return sorted(x[key] for x in xs)[len(xs) // 2]

    cold = min(rates["small pages, one thread"])
    print(
        f"floor: the index's {nbytes / 2**20:.0f} MiB at the slowest small-page first touch seen "
        f"({cold / 1e9:.2f} GB/s) take {nbytes / cold:.2f} s before any work; a load in a fresh "
        f"process {median(loads, 'wall'):.2f} s (median; {median(loads, 'sys'):.2f} s of it in the "
        f"kernel); target {args.target:.1f} s"
    )


if __name__ == "__main__":
    main()
