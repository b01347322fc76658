"""Subscriber throughput: frames received to batches delivered, in one process.

Workload: each batch stores B blocks of 16 tokens as one chain (64-bit hashes,
token ids below 50k, vLLM's map dialect), B = 16 and B = 256. The core figure
feeds pre-received live frames ``[topic, seq, payload]`` through
``RankStream.live`` (decode + sequencing) and hands every batch to a no-op
sink, as the transport does. Target: >= 3 million blocks/s at both sizes.

The transport figure runs the same batches through ZeroMQ (a PUB socket on a
thread of this process, ipc) into a ``Subscriber`` and its no-op sink; it is
shown for information (the sending thread shares the GIL).

Run: ``.venv/bin/python benchmarks/subscriber_bench.py [--repeats N]``.
Figures are medians over the repeats.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import tempfile
import threading
import time

import zmq

from kvwire.subscriber import Apply, EngineSource, RankStream, StreamConfig, Subscriber
from kvwire.wire import BlockStored, KVEventBatch, decode_batch, encode_batch, pack_seq

TARGET_BLOCKS_PER_S = 3_000_000
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


def transport_rate(frames: list[list[bytes]], blocks_per_batch: int) -> float:
    """Blocks/s from a PUB socket into a Subscriber's no-op sink, over ipc."""
    with tempfile.TemporaryDirectory(prefix="kvwb") as d:
        endpoint = f"ipc://{d}/ev"
        ctx = zmq.Context()
        pub = ctx.socket(zmq.PUB)
        pub.setsockopt(zmq.SNDHWM, 0)
        pub.bind(endpoint)
        done = asyncio.Event()
        counted = 0
        total = len(frames)

        class Counting(NoOpSink):
            def apply(self, worker_id: str, rank: int, batch: KVEventBatch) -> None:
                nonlocal counted
                counted += 1
                if counted == total:
                    loop.call_soon(done.set)

        async def run() -> float:
            cfg = StreamConfig(replay=False, idle_probe=None)
            async with Subscriber([EngineSource("w", endpoint)], Counting(), config=cfg) as sub:
                while not sub.status() or not sub.status()[0].connected:
                    await asyncio.sleep(0.001)
                # Warm the subscription: the first message only marks it as active.
                await asyncio.sleep(0.2)
                start = time.perf_counter()
                sender = threading.Thread(target=lambda: [pub.send_multipart(f) for f in frames])
                sender.start()
                await asyncio.wait_for(done.wait(), 120)
                elapsed = time.perf_counter() - start
                sender.join()
            return total * blocks_per_batch / elapsed

        loop = asyncio.new_event_loop()
        try:
            return loop.run_until_complete(run())
        finally:
            loop.close()
            pub.close(linger=0)
            ctx.term()


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
    args = parser.parse_args()

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
        if not args.skip_transport:
            tframes = frames[: max(1_000, 50_000 // blocks)]
            trates = [transport_rate(tframes, blocks) for _ in range(max(3, args.repeats // 2))]
            print(
                f"        through ZeroMQ  {statistics.median(trates) / 1e6:5.2f} M blocks/s"
                "  (ipc PUB thread -> Subscriber -> no-op sink; informational)"
            )


if __name__ == "__main__":
    main()
