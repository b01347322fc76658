"""The reference paged KV cache: reuse, eviction, reset, and its event stream as truth."""

from __future__ import annotations

import random
from typing import Any

import pytest
import zmq

torch = pytest.importorskip("torch")

from kvwire.publisher import CollectedBatch, EventCollector, EventPublisher, PendingBatch  # noqa: E402
from kvwire.reference import CacheFullError, PagedKVCache, block_hashes  # noqa: E402
from kvwire.wire import (  # noqa: E402
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    Dialect,
    KVEventBatch,
    decode_batch,
)
from tests.publisher.conftest import connect_sub, recv_live  # noqa: E402

BS = 4


class Capture:
    rank = 0

    def __init__(self) -> None:
        self.batches: list[CollectedBatch] = []

    def publish(self, batch: KVEventBatch | PendingBatch) -> bool:
        assert isinstance(batch, CollectedBatch)
        self.batches.append(batch)
        return True

    def take(self, dialect: Dialect = "map") -> list[Any]:
        """Every batch so far, through the real wire codec."""
        out = [decode_batch(b.encode(dialect)) for b in self.batches]
        self.batches.clear()
        return out


def apply(held: set[int], batch: KVEventBatch) -> None:
    for e in batch.events:
        if isinstance(e, BlockStored):
            held.update(e.block_hashes)
        elif isinstance(e, BlockRemoved):
            held.difference_update(e.block_hashes)
        else:
            held.clear()


def small_cache(num_blocks: int = 16) -> tuple[PagedKVCache, EventCollector, Capture]:
    cap = Capture()
    col = EventCollector(cap, BS)
    cache = PagedKVCache(
        num_blocks, BS, col, device="cpu", num_layers=2, num_kv_heads=1, head_dim=4
    )
    return cache, col, cap


def events_of(col: EventCollector, cap: Capture) -> list[Any]:
    col.flush()
    return [e for b in cap.take() for e in b.events]


def test_prefix_reuse_serves_the_right_kv() -> None:
    cache, col, cap = small_cache()
    shared = list(range(100, 112))  # 3 full blocks
    a = cache.admit("a", [*shared, 1, 2, 3, 4, 5])
    assert (a.prompt_blocks, a.cached_blocks, a.new_blocks) == (4, 0, 5)
    stored = events_of(col, cap)
    assert stored == [
        BlockStored(block_hashes([*shared, 1, 2, 3, 4], BS), None, [*shared, 1, 2, 3, 4], BS,
                    None, "GPU", None)
    ]  # fmt: skip
    cache.release("a")
    b = cache.admit("b", [*shared, 9, 9, 9, 9])
    assert (b.cached_blocks, b.new_blocks) == (3, 1)
    assert b.block_ids[:3] == a.block_ids[:3]
    assert torch.equal(cache.read_kv("b"), cache.expected_kv([*shared, 9, 9, 9, 9]))
    [event] = events_of(col, cap)
    assert isinstance(event, BlockStored)
    assert event.parent_block_hash == block_hashes(shared, BS)[-1]
    assert cache.probe([*shared, 9, 9, 9, 9, 1]) == 4
    assert cache.probe([0] * 8) == 0


def test_lru_eviction_of_unreferenced_blocks_only() -> None:
    cache, col, cap = small_cache(num_blocks=4)
    cache.admit("a", list(range(8)))  # 2 blocks
    cache.admit("b", list(range(50, 54)))  # 1 block
    cache.release("a")  # a's blocks evictable; b still holds its block
    events_of(col, cap)
    c = cache.admit("c", list(range(200, 212)))  # needs 3: 1 free + evicts a's 2
    assert c.evicted_blocks == 2
    removed, stored = events_of(col, cap)
    # a's blocks were freed last-first, so its deepest block goes first (a prefix survives longest).
    assert removed == BlockRemoved(block_hashes(range(8), BS)[::-1])
    assert isinstance(stored, BlockStored)
    assert cache.held_hashes() == set(
        block_hashes(range(50, 54), BS) + block_hashes(range(200, 212), BS)
    )
    with pytest.raises(CacheFullError):
        cache.admit("d", [7] * 4)  # b and c hold every block
    assert cache.free_blocks == 0 and cache.active_requests == 2


def test_a_full_cache_changes_nothing() -> None:
    cache, col, cap = small_cache(num_blocks=3)
    cache.admit("a", list(range(8)))
    cache.release("a")
    before = cache.held_hashes()
    events_of(col, cap)
    with pytest.raises(CacheFullError, match="needs 4 blocks"):
        cache.admit("big", list(range(100, 116)))
    assert cache.held_hashes() == before and cache.free_blocks == 3
    assert events_of(col, cap) == []


def test_shared_blocks_stay_while_any_request_holds_them() -> None:
    cache, _col, _cap = small_cache(num_blocks=5)
    prompt = list(range(8))
    cache.admit("a", prompt)
    b = cache.admit("b", [*prompt, 1, 2, 3, 4])
    assert b.cached_blocks == 2
    cache.release("a")
    with pytest.raises(CacheFullError):
        cache.admit("c", list(range(300, 316)))  # 4 blocks; only 2 are free
    cache.release("b")
    assert cache.admit("c", list(range(300, 316))).evicted_blocks == 2
    assert cache.probe(prompt) == 1  # deepest blocks went first: the root survives


def test_extend_registers_blocks_as_they_fill() -> None:
    cache, col, cap = small_cache()
    cache.admit("a", [1, 2, 3, 4, 5, 6])
    first = events_of(col, cap)
    assert cache.extend("a", [7]) == 0
    assert cache.extend("a", [8, 9, 10, 11, 12, 13]) == 2
    later = events_of(col, cap)
    tokens = list(range(1, 14))
    hashes = block_hashes(tokens, BS)
    assert first == [BlockStored(hashes[:1], None, tokens[:4], BS, None, "GPU", None)]
    assert later == [BlockStored(hashes[1:3], hashes[0], tokens[4:12], BS, None, "GPU", None)]
    assert torch.equal(cache.read_kv("a"), cache.expected_kv(tokens))


def test_reset_clears_everything() -> None:
    cache, col, cap = small_cache()
    cache.admit("a", list(range(12)))
    cache.admit("b", list(range(40, 48)))
    cache.reset()
    events = events_of(col, cap)
    assert isinstance(events[-1], AllBlocksCleared)
    assert cache.held_hashes() == set() and cache.active_requests == 0
    assert cache.free_blocks == 16
    assert cache.admit("a", list(range(12))).cached_blocks == 0


def test_content_already_cached_elsewhere_is_not_registered_twice() -> None:
    cache, col, cap = small_cache(num_blocks=6)
    prompt = [1, 2, 3, 4, 5, 6]
    cache.admit("a", prompt)
    assert cache.admit("b", prompt).cached_blocks == 1
    held: set[int] = set()
    for e in events_of(col, cap):
        apply(held, KVEventBatch(0.0, [e]))
    # Both decode the same tokens: the second copy of that block stays private.
    assert cache.extend("a", [7, 8]) == 1
    assert cache.extend("b", [7, 8]) == 0
    assert cache.extend("b", [9, 9, 9, 9]) == 1  # b's next block chains on a's copy
    h = block_hashes([*prompt, 7, 8, 9, 9, 9, 9], BS)
    stored = events_of(col, cap)
    assert stored == [  # one chain, though different requests stored its blocks
        BlockStored([h[1], h[2]], h[0], [5, 6, 7, 8, 9, 9, 9, 9], BS, None, "GPU", None),
    ]
    cache.release("a")
    cache.admit("c", [0] * 12)  # takes the two free blocks, then evicts a's copy of h1
    events = events_of(col, cap)
    assert events[0] == BlockRemoved([h[1]])
    for e in stored + events:
        apply(held, KVEventBatch(0.0, [e]))
    # b still has the content in a private block, but the cache no longer offers h1.
    assert held == cache.held_hashes() and h[1] not in held and h[2] in held


def test_lora_and_seed_change_the_hashes() -> None:
    tokens = list(range(8))
    assert block_hashes(tokens, BS) != block_hashes(tokens, BS, lora_name="x")
    assert block_hashes(tokens, BS) != block_hashes(tokens, BS, seed=1)
    assert block_hashes(tokens, BS) == block_hashes([*tokens, 1, 2], BS)
    cache, col, cap = small_cache()
    cache.admit("a", tokens, lora_name="x")
    [event] = events_of(col, cap)
    assert isinstance(event, BlockStored)
    assert event.lora_name == "x" and event.block_hashes == block_hashes(tokens, BS, lora_name="x")
    assert cache.probe(tokens) == 0 and cache.probe(tokens, lora_name="x") == 2


def test_bad_requests() -> None:
    cache, _, _ = small_cache()
    with pytest.raises(ValueError, match="no tokens"):
        cache.admit("a", [])
    cache.admit("a", [1])
    with pytest.raises(ValueError, match="already"):
        cache.admit("a", [1])
    with pytest.raises(ValueError, match="block_size"):
        PagedKVCache(4, 8, EventCollector(Capture(), 4), device="cpu")


# --- churn: the event stream reproduces the truth ------------------------------------------


def churn(
    cache: PagedKVCache, col: EventCollector, rng: random.Random, steps: int, check: Any
) -> dict[str, int]:
    """Random traffic: shared system prompts, multi-turn growth, decode, releases, resets."""
    systems = [[rng.randrange(50_000) for _ in range(BS * rng.randint(1, 4))] for _ in range(5)]
    active: dict[str, list[int]] = {}
    history: list[list[int]] = []
    seen = {"evicted": 0, "reused": 0, "resets": 0, "full": 0, "admitted": 0}
    for step in range(steps):
        r = rng.random()
        if r < 0.45 or not active:
            if history and rng.random() < 0.4:
                prompt = rng.choice(history) + [
                    rng.randrange(50_000) for _ in range(rng.randint(1, 9))
                ]
            else:
                prompt = rng.choice(systems) + [
                    rng.randrange(50_000) for _ in range(rng.randint(1, 13))
                ]
            rid = f"r{step}"
            try:
                res = cache.admit(rid, prompt, lora_name=rng.choice([None, None, None, "l"]))
            except CacheFullError:
                seen["full"] += 1
            else:
                active[rid] = prompt
                seen["admitted"] += 1
                seen["evicted"] += res.evicted_blocks
                seen["reused"] += res.cached_blocks
        elif r < 0.75:
            rid = rng.choice(sorted(active))
            history.append(active.pop(rid))
            history = history[-20:]
            cache.release(rid)
        elif r < 0.995:
            rid = rng.choice(sorted(active))
            new = [rng.randrange(50_000) for _ in range(rng.randint(1, 6))]
            try:
                cache.extend(rid, new)
            except CacheFullError:
                seen["full"] += 1
            else:
                active[rid] = active[rid] + new
        else:
            cache.reset()
            active.clear()
            seen["resets"] += 1
        if rng.random() < 0.7:  # several changes may share one engine iteration
            col.flush()
            check()
    col.flush()
    check()
    return seen


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_churn_replayed_through_the_codec_reproduces_the_truth(seed: int) -> None:
    cap = Capture()
    col = EventCollector(cap, BS, hash_format="signed" if seed == 2 else "unsigned")
    cache = PagedKVCache(48, BS, col, device="cpu", num_layers=1, num_kv_heads=1, head_dim=2)
    held: set[int] = set()
    dialects: list[Dialect] = ["map", "array"]

    def check() -> None:
        for batch in cap.take(dialects[len(held) % 2]):
            apply(held, batch)
        assert held == cache.held_hashes()

    seen = churn(cache, col, random.Random(seed), 2500, check)
    assert seen["evicted"] > 100 and seen["reused"] > 100 and seen["resets"] >= 2, seen
    assert seen["full"] > 0 and seen["admitted"] > 500, seen


def test_churn_over_a_real_publisher(ipc_dir: str, zctx: zmq.Context[Any]) -> None:
    with EventPublisher(f"ipc://{ipc_dir}/p") as pub:
        sub, first = connect_sub(zctx, pub)
        col = EventCollector(pub, BS)
        cache = PagedKVCache(32, BS, col, device="cpu", num_layers=1, num_kv_heads=1, head_dim=2)
        seen = churn(cache, col, random.Random(7), 800, lambda: None)
        truth = cache.held_hashes()
        last = pub.last_seq
        assert pub.close() is True
    held: set[int] = set()
    expected = first
    while expected <= last:
        msg = recv_live(sub)
        assert msg.seq == expected  # nothing lost
        apply(held, decode_batch(msg.payload))
        expected += 1
    assert held == truth and seen["evicted"] > 0


@pytest.mark.gpu
def test_cuda_pool() -> None:
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device: the pool's CUDA path needs one")
    cap = Capture()
    col = EventCollector(cap, BS)
    cache = PagedKVCache(64, BS, col)
    assert cache.kv.device.type == "cuda" and cache.kv.dtype == torch.float16
    prompt = list(range(40))
    cache.admit("a", prompt)
    cache.release("a")
    assert cache.admit("b", [*prompt, 1]).cached_blocks == 10
    assert torch.equal(cache.read_kv("b"), cache.expected_kv([*prompt, 1]))
    held: set[int] = set()
    col.flush()
    for batch in cap.take():
        apply(held, batch)
    assert held == cache.held_hashes()
