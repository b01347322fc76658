"""Where an engine's KV cache manager calls kvwire's hooks.

A tiny paged KV cache manager (pure Python: a block pool, block hashes chained
over token ids, reference counts, an LRU list of free blocks) and a toy
scheduler loop, instrumented with :class:`kvwire.publisher.EventCollector`.
The four call sites, each marked ``HOOK`` in the code:

1. a full block gets a hash and enters the prefix cache -> ``collector.stored(hashes, parent, tokens)``
2. a cached block is evicted so its memory can be reused -> ``collector.removed(hashes)``
3. the whole prefix cache is reset                       -> ``collector.cleared()``
4. once at the end of every scheduler iteration          -> ``collector.flush()``

Report changes in the order they happen (an eviction before the store that
reuses the block). ``flush()`` only queues one batch; encoding and sending
happen on the publisher's thread, so the engine thread never waits on a
subscriber. ``held_hashes()`` is the truth a subscriber must reproduce.

Run it (binds loopback only), and watch it from another shell::

    python examples/engine_integration.py --iterations 300 --hold 30
    kvwire watch tcp://127.0.0.1:5557 --replay tcp://127.0.0.1:5657
"""

from __future__ import annotations

import argparse
import hashlib
import random
import time
from collections import OrderedDict, deque
from collections.abc import Sequence
from dataclasses import dataclass, field

from kvwire.publisher import EventCollector, EventPublisher

__all__ = ["CacheFullError", "KVCacheManager", "ToyEngine", "hash_block", "main"]


def hash_block(parent: int | None, tokens: Sequence[int]) -> int:
    """A block's hash: it covers its parent's hash, so equal hashes mean equal prefixes.

    Unsigned 64 bits (the last 8 bytes of a SHA-256 digest), as vLLM sends them.
    """
    data = (b"root" if parent is None else parent.to_bytes(8, "big")) + b"".join(
        t.to_bytes(4, "little") for t in tokens
    )
    return int.from_bytes(hashlib.sha256(data).digest()[-8:], "big")


class CacheFullError(RuntimeError):
    """Not enough free blocks; nothing was changed."""


@dataclass
class _Block:
    block_id: int
    ref_count: int = 0
    block_hash: int | None = None  # set while the block is in the prefix cache


@dataclass
class _Request:
    request_id: str
    tokens: list[int]
    block_ids: list[int] = field(default_factory=list)
    hashes: list[int] = field(default_factory=list)  # of its full blocks, in order


class KVCacheManager:
    """A paged prefix cache that reports every change to an :class:`EventCollector`."""

    def __init__(self, num_blocks: int, block_size: int, collector: EventCollector | None) -> None:
        self.block_size = block_size
        self.collector = collector
        self.blocks = [_Block(i) for i in range(num_blocks)]
        self.free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))  # LRU first
        self.cached: dict[int, int] = {}  # block hash -> block id
        self.requests: dict[str, _Request] = {}
        self.evictions = 0

    def held_hashes(self) -> set[int]:
        """The hashes of every block in the prefix cache: what subscribers must end up with."""
        return set(self.cached)

    def probe(self, tokens: Sequence[int]) -> int:
        """How many leading full blocks of ``tokens`` are cached."""
        bs, parent, hits = self.block_size, None, 0
        for i in range(len(tokens) // bs):
            parent = hash_block(parent, tokens[i * bs : (i + 1) * bs])
            if parent not in self.cached:
                break
            hits += 1
        return hits

    def allocate(self, request_id: str, tokens: Sequence[int]) -> int:
        """Admit a prompt: reuse its cached prefix, allocate the rest. Returns cached blocks."""
        bs = self.block_size
        hits = self.probe(tokens)
        hashes = self._hashes(tokens, hits)
        reused = [self.cached[h] for h in hashes]
        needed = -(-len(tokens) // bs) - hits
        if needed > len(self.free) - sum(1 for b in reused if b in self.free):
            raise CacheFullError(f"{request_id} needs {needed} blocks")
        req = _Request(request_id, list(tokens))
        for b in reused:
            self._ref(b)
        req.block_ids = reused + self._take(needed)
        req.hashes = hashes
        self.requests[request_id] = req
        self._cache_full_blocks(req)  # the prompt's K/V was computed: its full blocks are reusable
        return hits

    def append_token(self, request_id: str, token: int) -> None:
        """One decoded token; a block it fills enters the cache like a prompt block."""
        req = self.requests[request_id]
        req.tokens.append(token)
        if len(req.tokens) > len(req.block_ids) * self.block_size:
            if not self.free:
                raise CacheFullError(f"{request_id} needs a block to decode")
            req.block_ids += self._take(1)
        self._cache_full_blocks(req)

    def free_request(self, request_id: str) -> None:
        """A request finished: its blocks stay cached but become evictable, tail first."""
        for b in reversed(self.requests.pop(request_id).block_ids):
            block = self.blocks[b]
            block.ref_count -= 1
            if block.ref_count == 0:
                self.free[b] = None
                if block.block_hash is None:
                    self.free.move_to_end(b, last=False)  # holds nothing reusable: reuse first

    def reset_prefix_cache(self) -> bool:
        """Drop every cached block (only when nothing runs, like vLLM's reset)."""
        if self.requests:
            return False
        for block in self.blocks:
            block.block_hash = None
        self.cached.clear()
        if self.collector is not None:
            self.collector.cleared()  # HOOK 3: the whole prefix cache is gone
        return True

    def _hashes(self, tokens: Sequence[int], count: int) -> list[int]:
        bs, parent, out = self.block_size, None, []
        for i in range(count):
            parent = hash_block(parent, tokens[i * bs : (i + 1) * bs])
            out.append(parent)
        return out

    def _ref(self, b: int) -> None:
        self.blocks[b].ref_count += 1
        self.free.pop(b, None)

    def _take(self, count: int) -> list[int]:
        """Pop ``count`` blocks off the LRU end, evicting the cached ones among them."""
        taken, evicted = [], []
        for _ in range(count):
            b, _ = self.free.popitem(last=False)
            block = self.blocks[b]
            if block.block_hash is not None:
                del self.cached[block.block_hash]
                evicted.append(block.block_hash)
                block.block_hash = None
            block.ref_count = 1
            taken.append(b)
        if evicted:
            self.evictions += len(evicted)
            if self.collector is not None:
                self.collector.removed(evicted)  # HOOK 2: before the stores that reuse them
        return taken

    def _cache_full_blocks(self, req: _Request) -> None:
        """Hash the request's newly full blocks and report each run of new cache entries."""
        bs = self.block_size
        run_start = len(req.hashes)
        for i in range(len(req.hashes), len(req.tokens) // bs):
            parent = req.hashes[-1] if req.hashes else None
            req.hashes.append(hash_block(parent, req.tokens[i * bs : (i + 1) * bs]))
            if req.hashes[i] in self.cached:  # another block holds this content: not ours to cache
                self._report_stored(req, run_start, i)
                run_start = i + 1
            else:
                self.cached[req.hashes[i]] = req.block_ids[i]
                self.blocks[req.block_ids[i]].block_hash = req.hashes[i]
        self._report_stored(req, run_start, len(req.hashes))

    def _report_stored(self, req: _Request, start: int, stop: int) -> None:
        if start < stop and self.collector is not None:
            bs = self.block_size
            self.collector.stored(  # HOOK 1: one chain of new blocks, under their parent
                req.hashes[start:stop],
                req.hashes[start - 1] if start > 0 else None,
                req.tokens[start * bs : stop * bs],
            )


class ToyEngine:
    """A scheduler loop: admit waiting prompts, decode one token each, finish, flush."""

    def __init__(self, manager: KVCacheManager, collector: EventCollector, seed: int = 0) -> None:
        self.manager = manager
        self.collector = collector
        self.rng = random.Random(seed)
        self.waiting: deque[tuple[str, list[int], int]] = deque()
        self.running: dict[str, int] = {}  # request id -> tokens still to decode
        self.steps = 0
        self.cached_blocks = 0

    def add_request(self, request_id: str, prompt: list[int], max_tokens: int) -> None:
        self.waiting.append((request_id, prompt, max_tokens))

    def idle(self) -> bool:
        return not self.waiting and not self.running

    def step(self) -> None:
        """One iteration; everything it changed in the cache goes out as one batch."""
        while self.waiting:
            request_id, prompt, max_tokens = self.waiting[0]
            try:
                self.cached_blocks += self.manager.allocate(request_id, prompt)
            except CacheFullError:
                if self.running:
                    break  # retried next iteration, after some requests finished
                self.waiting.popleft()  # larger than the whole cache: rejected
                continue
            self.waiting.popleft()
            self.running[request_id] = max_tokens
        for request_id in list(self.running):
            token = self.rng.randrange(32_000)
            try:
                self.manager.append_token(request_id, token)
            except CacheFullError:
                self.running[request_id] = 1  # out of memory: finish it early
            self.running[request_id] -= 1
            if self.running[request_id] <= 0:
                del self.running[request_id]
                self.manager.free_request(request_id)
        self.steps += 1
        self.collector.flush()  # HOOK 4: once per iteration, never blocks


def drive(
    engine: ToyEngine, iterations: int, seed: int = 0, prompts: list[list[int]] | None = None
) -> None:
    """Feed chat-like traffic: shared system prompts, growing conversations, one-offs."""
    rng = random.Random(seed)
    bs = engine.manager.block_size
    systems = [[rng.randrange(32_000) for _ in range(3 * bs)] for _ in range(3)]
    chats = [list(rng.choice(systems)) for _ in range(4)]
    for i in range(iterations):
        if rng.random() < 0.6:
            if rng.random() < 0.2:
                prompt = [rng.randrange(32_000) for _ in range(rng.randint(bs, 4 * bs))]
            else:
                c = rng.randrange(len(chats))
                chats[c] += [rng.randrange(32_000) for _ in range(rng.randint(1, 2 * bs))]
                if len(chats[c]) > 10 * bs:
                    chats[c] = list(rng.choice(systems))
                prompt = list(chats[c])
            engine.add_request(f"req-{seed}-{i}", prompt, rng.randint(1, 2 * bs))
            if prompts is not None:
                prompts.append(prompt)
        engine.step()


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="A toy KV cache manager publishing KV events.")
    p.add_argument("--endpoint", default="tcp://127.0.0.1:5557")
    p.add_argument("--replay-endpoint", default="tcp://127.0.0.1:5657")
    p.add_argument("--rank", type=int, default=0)
    p.add_argument("--iterations", type=int, default=200)
    p.add_argument("--num-blocks", type=int, default=64)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--hold", type=float, default=0.0, help="keep serving replays S s after")
    args = p.parse_args(argv)
    with EventPublisher(args.endpoint, args.replay_endpoint, rank=args.rank) as publisher:
        collector = EventCollector(publisher, args.block_size)
        manager = KVCacheManager(args.num_blocks, args.block_size, collector)
        engine = ToyEngine(manager, collector, seed=1)
        drive(engine, args.iterations)
        while not engine.idle():
            engine.step()
        manager.reset_prefix_cache()
        engine.step()  # flushes the reset
        print(
            f"{engine.steps} iterations, {engine.cached_blocks} prompt blocks from cache, "
            f"{manager.evictions} evictions; publisher {publisher.stats()}"
        )
        time.sleep(args.hold)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
