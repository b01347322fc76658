"""Subscriber throughput: frames received to batches delivered, in one process.

Workload: each batch stores B blocks of 16 tokens as one chain (64-bit hashes,
token ids below 50k, vLLM's map dialect), B = 16 and B = 256. The core figure
feeds pre-received live frames ``[topic, seq, payload]`` through
``RankStream.live`` (decode + sequencing) and hands every batch to a no-op
sink, as the transport does. Target: >= 3 million blocks/s at both sizes.

The transport figure runs the same batches through ZeroMQ over tcp loopback:
64 PUB sockets (one per rank) in another process send as fast as they can,
ranks interleaved, into one ``Subscriber`` (background thread) and its no-op
sink; blocks/s from the first batch delivered to the last. Targets: >= 1.5 M
blocks/s at B = 16 and >= 4 M at B = 256, against decode + sequencing alone
printed just above it.

The index figure runs the core one into a ``PrefixIndex`` instead of a no-op
sink, both ways a router can: each batch decoded by the stream and given to
``PrefixIndex.apply`` (a plain ``EventSink``), against the stream vouching for
the payload natively and giving its bytes to ``PrefixIndex.apply_payload`` (a
``PayloadSink``, as a ``Subscriber`` does for one); the two alternate, and
both indexes must end holding every block.

Run: ``.venv/bin/python benchmarks/subscriber_bench.py [--repeats N]``.
Figures are medians over the repeats.
"""

from __future__ import annotations

import argparse
import json
import random
import resource
import statistics
import subprocess
import sys
import threading
import time

import zmq

from kvwire.prefix_index import PrefixIndex
from kvwire.subscriber import (
    Apply,
    ApplyPayload,
    EngineSource,
    EventSink,
    RankStream,
    StreamConfig,
    Subscriber,
    SubscriberConfig,
)
from kvwire.wire import (
    BlockStored,
    DecodeLimits,
    KVEventBatch,
    decode_batch,
    encode_batch,
    pack_seq,
)

TARGET_BLOCKS_PER_S = 3_000_000
TRANSPORT_RANKS = 64
TRANSPORT_TARGET = {16: 1_500_000, 256: 4_000_000}
BLOCK_TOKENS = 16
TOPIC = b""


def make_frames(blocks_per_batch: int, batches: int, seed: int = 0) -> list[list[bytes]]:
    rng = random.Random(seed)
    frames = []
    parent = None
    for seq in range(batches):
        hashes = [rng.getrandbits(64) for _ in range(blocks_per_batch)]
        tokens = [rng.randrange(50_000) for _ in range(blocks_per_batch * BLOCK_TOKENS)]
        batch = KVEventBatch(
            time.time(),
            [
                BlockStored(
                    block_hashes=hashes,
                    parent_block_hash=parent,
                    token_ids=tokens,
                    block_size=BLOCK_TOKENS,
                )
            ],
            0,
        )
        parent = hashes[-1]
        frames.append([TOPIC, pack_seq(seq), encode_batch(batch)])
    return frames


class NoOpSink:
    def apply(self, worker_id: str, rank: int, batch: KVEventBatch) -> None:
        pass

    def clear(self, worker_id: str, rank: int) -> None:
        pass


def core_rate(frames: list[list[bytes]], blocks_per_batch: int) -> float:
    """Blocks/s through decode + sequencing + delivery to a no-op sink."""
    stream = RankStream(0, StreamConfig(replay=False, idle_probe=None))
    stream.connected(0.0)
    sink = NoOpSink()
    live = stream.live
    apply = sink.apply
    clock = time.monotonic
    start = time.perf_counter()
    for f in frames:
        for action in live(f, clock()):
            if type(action) is Apply:
                apply("w", 0, action.batch)
    elapsed = time.perf_counter() - start
    assert stream.expected_seq == len(frames), "not every batch was delivered"
    return len(frames) * blocks_per_batch / elapsed


def index_rate(frames: list[list[bytes]], blocks_per_batch: int, payloads: bool) -> float:
    """Blocks/s through sequencing into a fresh PrefixIndex: decoded batches to
    ``apply``, or (``payloads``) vouched-for payload bytes to ``apply_payload``."""
    index = PrefixIndex(BLOCK_TOKENS)
    stream = RankStream(0, StreamConfig(replay=False, idle_probe=None), payloads=payloads)
    stream.connected(0.0)
    limits = stream.config.decode_limits
    live = stream.live
    apply, apply_payload = index.apply, index.apply_payload
    clock = time.monotonic
    by_payload = 0
    start = time.perf_counter()
    for f in frames:
        for action in live(f, clock()):
            kind = type(action)
            if kind is ApplyPayload:
                apply_payload("w", 0, action.payload, limits)  # type: ignore[union-attr]
                by_payload += 1
            elif kind is Apply:
                apply("w", 0, action.batch)  # type: ignore[union-attr]
    elapsed = time.perf_counter() - start
    assert stream.expected_seq == len(frames), "not every batch was delivered"
    assert index.rank_blocks("w", 0) == len(frames) * blocks_per_batch, "blocks missing"
    if payloads:  # a rank's first batch aside, every batch went as bytes
        assert by_payload == len(frames), f"only {by_payload} of {len(frames)} batches as bytes"
    return len(frames) * blocks_per_batch / elapsed


def publisher_child(blocks_per_batch: int, ranks: int, batches: int) -> None:
    """The sending side of the transport figure, in its own process: one PUB per rank.

    Prints the bound endpoints, then for each ``go`` line sends ``batches``
    batches per rank (ranks interleaved, seqs continuing) and prints ``sent``.
    """
    payloads = [f[2] for f in make_frames(blocks_per_batch, min(batches, 500))]
    ctx = zmq.Context()
    ctx.set(zmq.MAX_SOCKETS, ranks + 64)
    pubs = []
    for _ in range(ranks):
        pub = ctx.socket(zmq.PUB)
        pub.setsockopt(zmq.SNDHWM, 0)
        pub.bind("tcp://127.0.0.1:*")
        pubs.append(pub)
    print(json.dumps([p.getsockopt_string(zmq.LAST_ENDPOINT) for p in pubs]), flush=True)
    seq = 0
    for line in sys.stdin:
        if line.strip() != "go":
            break
        for i in range(batches):
            frames = [TOPIC, pack_seq(seq + i), payloads[i % len(payloads)]]
            for pub in pubs:
                pub.send_multipart(frames)
        seq += batches
        print("sent", flush=True)
    for pub in pubs:
        pub.close(linger=0)
    ctx.term()


def _cpu_s() -> float:
    ru = resource.getrusage(resource.RUSAGE_SELF)
    return ru.ru_utime + ru.ru_stime


def transport_rates(
    blocks_per_batch: int, ranks: int, batches: int, repeats: int, sink_kind: str = "noop"
) -> tuple[list[float], list[float], list[float]]:
    """From ``ranks`` PUB sockets in another process into one Subscriber, over tcp.

    Returns blocks/s delivered (wall clock), blocks per second of the
    subscriber process's CPU (its reading thread and libzmq's I/O thread:
    what the transport costs, whatever the sender's speed), and blocks/s sent.
    ``sink_kind``: a no-op sink (``noop``), or a PrefixIndex given decoded
    batches (``decoded``, a plain EventSink) or payload bytes (``bytes``).
    """
    child = subprocess.Popen(
        [
            sys.executable,
            __file__,
            "--publisher-child",
            f"{blocks_per_batch},{ranks},{batches}",
        ],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert child.stdin is not None and child.stdout is not None
    endpoints = json.loads(child.stdout.readline())
    lock = threading.Lock()
    state = {"count": 0, "first": 0.0, "last": 0.0}
    done = threading.Event()
    target = [0]

    def count() -> None:
        now = time.perf_counter()
        with lock:
            if state["count"] == 0:
                state["first"] = now
            state["count"] += 1
            state["last"] = now
            if state["count"] >= target[0]:
                done.set()

    class Counting(NoOpSink):
        def apply(self, worker_id: str, rank: int, batch: KVEventBatch) -> None:
            count()

    class DecodedIndex:
        def __init__(self) -> None:
            self.index = PrefixIndex(BLOCK_TOKENS)

        def apply(self, worker_id: str, rank: int, batch: KVEventBatch) -> None:
            self.index.apply(worker_id, rank, batch)
            count()

        def clear(self, worker_id: str, rank: int) -> None:
            self.index.clear(worker_id, rank)

    class BytesIndex(DecodedIndex):
        def apply_payload(
            self, worker_id: str, rank: int, payload: bytes, limits: DecodeLimits
        ) -> None:
            self.index.apply_payload(worker_id, rank, payload, limits)
            count()

    sinks: dict[str, type[EventSink]] = {
        "noop": Counting,
        "decoded": DecodedIndex,
        "bytes": BytesIndex,
    }
    sink = sinks[sink_kind]()
    cfg = SubscriberConfig(stream=StreamConfig(replay=False, idle_probe=None))
    sources = [EngineSource(f"r{i}", ep) for i, ep in enumerate(endpoints)]
    rates, cpu_rates, sent_rates = [], [], []
    sub = Subscriber(sources, sink, config=cfg).start()
    try:
        deadline = time.monotonic() + 10
        while not all(s.connected for s in sub.status()):
            if time.monotonic() > deadline:
                raise RuntimeError("the subscriber did not connect")
            time.sleep(0.01)
        time.sleep(0.3)  # subscriptions reach the publishers after the connection
        for _ in range(repeats):
            with lock:
                state["count"] = 0
                target[0] = ranks * batches
                done.clear()
            c0, t0 = _cpu_s(), time.perf_counter()
            child.stdin.write("go\n")
            child.stdin.flush()
            child.stdout.readline()
            sent = time.perf_counter() - t0
            done.wait(60)
            cpu = _cpu_s() - c0
            with lock:
                n, elapsed = state["count"], state["last"] - state["first"]
            blocks = n * blocks_per_batch
            rates.append(blocks / elapsed if elapsed > 0 else 0.0)
            cpu_rates.append(blocks / cpu if cpu > 0 else 0.0)
            sent_rates.append(ranks * batches * blocks_per_batch / sent)
        for st in sub.status():
            c = st.counters
            assert c.decode_errors == c.sink_errors == 0, (st.worker_id, c)
    finally:
        sub.stop()
        child.stdin.close()
        child.wait(10)
    return rates, cpu_rates, sent_rates


def decode_rate(frames: list[list[bytes]], blocks_per_batch: int) -> float:
    """Blocks/s of ``decode_batch`` alone, for the share of the total it takes."""
    payloads = [f[2] for f in frames]
    start = time.perf_counter()
    for p in payloads:
        decode_batch(p)
    return len(payloads) * blocks_per_batch / (time.perf_counter() - start)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--skip-transport", action="store_true")
    parser.add_argument("--publisher-child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.publisher_child:
        b, r, n = (int(x) for x in args.publisher_child.split(","))
        publisher_child(b, r, n)
        return

    print(
        f"target: >= {TARGET_BLOCKS_PER_S / 1e6:.1f} M blocks/s through decode + sequencing "
        f"(no-op sink); medians of {args.repeats} runs"
    )
    for blocks in (16, 256):
        batches = max(2_000, 400_000 // blocks)
        frames = make_frames(blocks, batches)
        core_rate(frames[:200], blocks)  # warm up
        rates, decodes = [], []
        for _ in range(args.repeats):  # interleaved, so both see the same machine load
            rates.append(core_rate(frames, blocks))
            decodes.append(decode_rate(frames, blocks))
        decode = statistics.median(decodes)
        median = statistics.median(rates)
        verdict = "meets" if median >= TARGET_BLOCKS_PER_S else "MISSES"
        per_batch = 1e6 * blocks / median
        decode_per_batch = 1e6 * blocks / decode
        print(
            f"B={blocks:>3}  decode+sequencing  {median / 1e6:5.2f} M blocks/s"
            f"  ({per_batch:6.1f} us/batch, {1e6 / median:5.3f} us/block)  {verdict} the target"
            f"  [min {min(rates) / 1e6:.2f}, max {max(rates) / 1e6:.2f}]"
        )
        print(
            f"        of which decode_batch  {decode_per_batch:6.1f} us/batch"
            f" ({100 * decode_per_batch / per_batch:.0f}%), sequencing and delivery"
            f" {per_batch - decode_per_batch:4.1f} us/batch"
        )
        decoded, as_bytes = [], []
        index_frames = frames[: max(1_000, 100_000 // blocks)]
        index_rate(index_frames[:200], blocks, True)  # warm up
        for _ in range(args.repeats):  # alternated
            decoded.append(index_rate(index_frames, blocks, False))
            as_bytes.append(index_rate(index_frames, blocks, True))
        dmed, bmed = statistics.median(decoded), statistics.median(as_bytes)
        print(
            f"        into a PrefixIndex  decoded, to apply {dmed / 1e6:5.2f} M blocks/s"
            f" [min {min(decoded) / 1e6:.2f}, max {max(decoded) / 1e6:.2f}];"
            f" payload bytes, to apply_payload {bmed / 1e6:5.2f} M blocks/s"
            f" [min {min(as_bytes) / 1e6:.2f}, max {max(as_bytes) / 1e6:.2f}]:"
            f" {bmed / dmed:.2f}x"
        )
        if not args.skip_transport:
            per_rank = max(200, 2_000_000 // blocks // TRANSPORT_RANKS)
            trates, crates, srates = transport_rates(
                blocks, TRANSPORT_RANKS, per_rank, args.repeats
            )
            tmedian = statistics.median(trates)
            goal = TRANSPORT_TARGET[blocks]
            print(
                f"        through ZeroMQ  {tmedian / 1e6:5.2f} M blocks/s from {TRANSPORT_RANKS} ranks"
                f" over tcp (another process) to a Subscriber's no-op sink"
                f" [min {min(trates) / 1e6:.2f}, max {max(trates) / 1e6:.2f}];"
                f" target >= {goal / 1e6:.1f} M: {'meets' if tmedian >= goal else 'MISSES'} it;"
                f" {100 * tmedian / median:.0f}% of decode+sequencing"
            )
            cmedian = statistics.median(crates)
            print(
                f"        per CPU second of the subscriber process (reader + libzmq I/O thread)"
                f"  {cmedian / 1e6:5.2f} M blocks/s ({1e6 * blocks / cmedian:5.1f} us/batch; "
                f"{'meets' if cmedian >= goal else 'MISSES'} the target as a cost);"
                f" sender {statistics.median(srates) / 1e6:.2f} M blocks/s"
            )
            # Into a PrefixIndex through ZeroMQ, both ways, alternated (a fresh
            # Subscriber and sender per run; each rank re-stores the same 500
            # batches' blocks, so the index stays small).
            runs: dict[str, list[tuple[float, float]]] = {"decoded": [], "bytes": []}
            for _ in range(args.repeats):
                for kind, out in runs.items():
                    w, c, _ = transport_rates(blocks, TRANSPORT_RANKS, per_rank // 2, 1, kind)
                    out.append((w[0], c[0]))
            med = {
                k: (statistics.median(w for w, _ in v), statistics.median(c for _, c in v))
                for k, v in runs.items()
            }
            (dw, dc), (bw, bc) = med["decoded"], med["bytes"]
            print(
                f"        into a PrefixIndex through ZeroMQ  decoded, to apply"
                f" {dw / 1e6:5.2f} M blocks/s ({1e6 * blocks / dc:5.1f} us CPU/batch);"
                f" payload bytes, to apply_payload {bw / 1e6:5.2f} M blocks/s"
                f" ({1e6 * blocks / bc:5.1f} us CPU/batch): {bw / dw:.2f}x wall, {bc / dc:.2f}x CPU"
            )


if __name__ == "__main__":
    main()
