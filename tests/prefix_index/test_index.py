"""PrefixIndex behaviour: captured traffic, orphans, refcounts, namespaces, tiers."""

from __future__ import annotations

import threading
from typing import Any

import numpy as np
import pytest
import torch

from kvwire.prefix_index import PrefixIndex, TierDepths, block_keys, tier_of
from kvwire.wire import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEventBatch,
    decode_batch,
    parse_live,
)
from tests.conftest import hex_frames

BS = 4
TOK = list(range(500, 500 + 12 * BS))  # 12 blocks


def stored(hashes: list[int], parent: int | None, first_block: int, **kw: Any) -> BlockStored:
    toks = TOK[first_block * BS : (first_block + len(hashes)) * BS]
    return BlockStored(block_hashes=hashes, parent_block_hash=parent, token_ids=toks,
                       block_size=BS, **kw)  # fmt: skip


def batch(*events: Any) -> KVEventBatch:
    return KVEventBatch(0.0, list(events))


@pytest.fixture
def index() -> PrefixIndex:
    return PrefixIndex(BS)


def test_captured_traffic_leaves_the_engines_final_blocks(wire_fixture: dict[str, Any]) -> None:
    bs = wire_fixture["block_size"]
    idx = PrefixIndex(bs)
    for message in wire_fixture["live"]:
        msg = parse_live(hex_frames(message))
        idx.apply("engine", 0, decode_batch(msg.payload))
    want = set(wire_fixture["expected_final_blocks"])
    assert idx.blocks("engine", 0) == want
    assert idx.stats().holders == len(want)


def test_match_counts_the_contiguous_prefix(index: PrefixIndex) -> None:
    index.apply("w", 0, batch(stored([1, 2, 3, 4], None, 0)))
    index.apply("w", 1, batch(stored([1, 2], None, 0)))
    assert index.match(TOK) == {("w", 0): 4, ("w", 1): 2}
    assert index.match(TOK[: 3 * BS + 3]) == {("w", 0): 3, ("w", 1): 2}  # partial block
    assert index.match(TOK[BS:]) == {}  # not from block 0
    index.apply("w", 0, batch(BlockRemoved(block_hashes=[2])))
    assert index.match(TOK) == {("w", 0): 1, ("w", 1): 2}
    for tokens in (np.array(TOK), torch.tensor(TOK), tuple(TOK)):
        assert index.match(tokens) == {("w", 0): 1, ("w", 1): 2}


def test_orphans_are_kept_counted_removable_and_never_matched(index: PrefixIndex) -> None:
    # Joined late: block 2's parent (1) was stored before we listened.
    index.apply("w", 0, batch(stored([2, 3], 1, 1), stored([4], 3, 3)))
    s = index.stats()
    assert (s.orphan_stores, s.holders, s.detached) == (1, 3, 3)
    assert index.blocks("w", 0) == {2, 3, 4}
    assert index.match(TOK) == {}
    # Its children stay removable; removing all leaves nothing behind.
    index.apply("w", 0, batch(BlockRemoved(block_hashes=[3, 2, 4])))
    s = index.stats()
    assert (s.holders, s.detached, s.blocks, s.memory_bytes) == (0, 0, 0, 0)


def test_removal_is_refcounted_per_rank_and_hash(index: PrefixIndex) -> None:
    index.apply("w", 0, batch(stored([1, 2], None, 0)))
    index.apply("w", 0, batch(stored([1, 2], None, 0)))  # a second physical copy
    index.apply("x", 0, batch(stored([1, 2], None, 0)))
    index.apply("w", 0, batch(BlockRemoved(block_hashes=[1, 2])))
    assert index.match(TOK) == {("w", 0): 2, ("x", 0): 2}
    index.apply("w", 0, batch(BlockRemoved(block_hashes=[1, 2, 2])))
    assert index.match(TOK) == {("x", 0): 2}  # one rank's removal leaves the other
    assert index.stats().unknown_removals == 1


def test_clear_and_all_blocks_cleared_touch_only_that_rank(index: PrefixIndex) -> None:
    index.apply("w", 0, batch(stored([1, 2, 3], None, 0)))
    index.apply("w", 1, batch(stored([1, 2], None, 0)))
    index.apply("x", 0, batch(stored([7], None, 0)))
    index.apply("w", 0, batch(AllBlocksCleared()))
    assert index.match(TOK) == {("w", 1): 2, ("x", 0): 1}
    index.clear("w", 1)
    assert index.match(TOK) == {("x", 0): 1}
    index.clear("nobody", 3)
    index.remove_worker("x")
    assert index.match(TOK) == {} and index.ranks() == [("w", 0), ("w", 1)]
    s = index.stats()
    assert (s.blocks, s.holders, s.memory_bytes) == (0, 0, 0)


def test_lora_salt_and_extra_keys_namespace_matches(index: PrefixIndex) -> None:
    index.apply("w", 0, batch(stored([1, 2], None, 0, lora_name="a")))
    index.apply("w", 1, batch(stored([1, 2], None, 0, cache_salt="s")))
    extra = [("img", 9), None]
    index.apply("w", 2, batch(stored([1, 2], None, 0, extra_keys=extra)))
    assert index.match(TOK) == {}
    assert index.match(TOK, lora_name="a") == {("w", 0): 2}
    assert index.match(TOK, cache_salt="s") == {("w", 1): 2}
    assert index.match(TOK, extra_keys=extra + [None] * 10) == {("w", 2): 2}
    assert index.match(TOK, extra_keys=[("img", 8), None] + [None] * 10) == {}


def test_other_groups_are_ignored() -> None:
    idx = PrefixIndex(BS, groups=(0, None))
    idx.apply("w", 0, batch(stored([1], None, 0, group_idx=1), stored([2], None, 0, group_idx=0)))
    idx.apply("w", 0, batch(BlockRemoved(block_hashes=[2], group_idx=1)))
    assert idx.blocks("w", 0) == {2}
    assert idx.stats().ignored_events == 2
    only1 = PrefixIndex(BS, groups=(1,))
    only1.apply("w", 0, batch(stored([1], None, 0, group_idx=1), stored([2], None, 0)))
    assert only1.blocks("w", 0) == {1}


def test_tiers_split_the_match(index: PrefixIndex) -> None:
    index.apply("w", 0, batch(stored([1, 2], None, 0)))
    index.apply("w", 0, batch(stored([3, 4], 2, 2, medium="CPU_PINNED")))
    index.apply("w", 0, batch(stored([5], 4, 4, medium="DISK")))
    assert index.match_tiers(TOK) == {("w", 0): TierDepths(2, 2, 1)}
    # The CPU copy of block 2 does not extend the GPU prefix past block 1.
    index.apply("w", 0, batch(stored([2], 1, 1, medium="CPU")))
    index.apply("w", 0, batch(BlockRemoved(block_hashes=[2], medium="GPU")))
    assert index.match_tiers(TOK) == {("w", 0): TierDepths(1, 3, 1)}
    assert index.match(TOK) == {("w", 0): 5}
    assert [tier_of(m) for m in (None, "GPU", "cpu", "CPU_PINNED", "STORAGE", "EXTERNAL")] == [
        0, 0, 1, 1, 2, 2,
    ]  # fmt: skip


def test_other_block_sizes_and_bad_stores_are_kept_but_unmatched(index: PrefixIndex) -> None:
    index.apply("w", 0, batch(BlockStored([1, 2], None, TOK[:16], 8)))
    index.apply("w", 0, batch(BlockStored([3], None, TOK[:3], BS)))  # too few tokens
    index.apply("w", 0, batch(BlockStored([9], None, TOK[:BS], BS, extra_keys=[])))
    assert index.match(TOK) == {}
    assert index.blocks("w", 0) == {1, 2, 3, 9}
    assert index.stats().malformed_stores == 2
    index.apply("w", 0, batch(BlockRemoved([1, 2, 3, 9])))
    assert index.stats().holders == 0


def test_hash_extremes_round_trip(index: PrefixIndex) -> None:
    top = 2**64 - 1
    index.apply("w", 0, batch(stored([top, 0, 2**63], None, 0)))
    assert index.blocks("w", 0) == {top, 0, 2**63}
    assert index.match(TOK) == {("w", 0): 3}
    index.apply("w", 0, batch(stored([5], top, 1)))  # parent is the EMPTY key
    assert index.stats().orphan_stores == 0
    index.apply("w", 0, batch(BlockRemoved([top])))
    assert index.match(TOK) == {}
    assert index.blocks("w", 0) == {0, 2**63, 5}


def test_router_keys_match_index_keys(index: PrefixIndex) -> None:
    index.apply("w", 0, batch(stored([1, 2, 3], None, 0)))
    keys = block_keys(TOK, BS, seed=0)
    assert (keys == index.keys(TOK)).all()
    assert index.match_keys(keys) == {("w", 0): 3}


def test_concurrent_apply_and_match_stay_consistent() -> None:
    idx = PrefixIndex(BS)
    errors: list[BaseException] = []
    done = threading.Event()

    def writer() -> None:
        try:
            for i in range(300):
                idx.apply("w", 0, batch(stored([10_000 + i * 20 + b for b in range(12)], None, 0)))
                if i % 3 == 0:
                    idx.apply("w", 0, batch(AllBlocksCleared()))
        except BaseException as e:  # pragma: no cover - reported below
            errors.append(e)
        finally:
            done.set()

    t = threading.Thread(target=writer)
    t.start()
    while not done.is_set():
        assert idx.match(TOK) in ({}, {("w", 0): 12})
    t.join(timeout=30)
    assert not t.is_alive() and not errors
    assert idx.match(TOK) == {("w", 0): 12}
