"""The index under hostile events, and its native types used before __init__."""

from __future__ import annotations

import copy
import gc
import pickle
import subprocess
import sys
import textwrap
import weakref
from typing import Self

import pytest

from kvwire.prefix_index import KvRouter, Load, PrefixIndex
from kvwire.prefix_index._core import Index, Matches
from kvwire.wire import DEFAULT_LIMITS, BlockRemoved, BlockStored, KVEventBatch

BS = 4


def tokens(n_blocks: int, base: int = 0) -> list[int]:
    return [base + i for i in range(n_blocks * BS)]


@pytest.mark.parametrize("size", [10**6, 3 * 10**6, 2**40, 0, -5])
def test_absurd_block_size_is_malformed_and_nothing_else_is_lost(size: int) -> None:
    idx = PrefixIndex(BS)
    good = BlockStored([1, 2], None, tokens(2), BS)
    bad = BlockStored([10, 11], None, [7] * 8, size)
    after = BlockStored([3], 2, tokens(1, 100), BS)
    idx.apply("w", 0, KVEventBatch(0.0, [good, bad, after], 0))
    st = idx.stats()
    assert st.malformed_stores == 1
    assert idx.blocks("w", 0) == {1, 2, 3, 10, 11}  # held, under unmatchable keys
    assert idx.match(tokens(2) + tokens(1, 100)) == {("w", 0): 3}
    idx.apply("w", 0, KVEventBatch(0.0, [BlockRemoved([10, 11])], 0))
    assert idx.blocks("w", 0) == {1, 2, 3}
    assert idx.stats().unknown_removals == 0


def test_block_size_bound_is_configurable() -> None:
    """By default the bound decoding applies (one definition), narrower on request."""
    with pytest.raises(ValueError):
        PrefixIndex(DEFAULT_LIMITS.max_block_size + 1)
    with pytest.raises(ValueError):
        PrefixIndex(8192, max_block_size=4096)
    idx = PrefixIndex(8192)
    idx.apply("w", 0, KVEventBatch(0.0, [BlockStored([1], None, list(range(8192)), 8192)], 0))
    assert idx.match(list(range(8192))) == {("w", 0): 1}


def test_rank_block_cap_refuses_whole_stores_and_shows_the_rank() -> None:
    idx = PrefixIndex(BS, max_blocks_per_rank=10)
    idx.apply("w", 0, KVEventBatch(0.0, [BlockStored(list(range(1, 9)), None, tokens(8), BS)], 0))
    idx.apply("w", 1, KVEventBatch(0.0, [BlockStored(list(range(1, 9)), None, tokens(8), BS)], 0))
    # Storing held blocks again adds no entries: not refused.
    idx.apply("w", 0, KVEventBatch(0.0, [BlockStored([1, 2], None, tokens(2), BS)], 0))
    assert not idx.over_cap("w", 0)
    # Three new blocks would make 11.
    idx.apply("w", 0, KVEventBatch(0.0, [BlockStored([9, 10, 11], 8, tokens(3, 50), BS)], 0))
    assert idx.over_cap("w", 0) and not idx.over_cap("w", 1)
    assert idx.rank_blocks("w", 0) == 8
    assert idx.blocks("w", 0) == set(range(1, 9))  # nothing of the refused store
    st = idx.stats()
    assert (st.refused_stores, st.ranks_over_cap) == (1, 1)
    # The router gives an over-cap rank no cache credit.
    router = KvRouter(idx)
    d = router.choose(tokens(8), {("w", 0): Load(0, 0), ("w", 1): Load(0, 5)})
    assert d.candidates[("w", 0)].cache_used is False
    assert "over" in d.candidates[("w", 0)].note
    assert d.candidates[("w", 1)].cached.total == 8
    idx.clear("w", 0)
    assert not idx.over_cap("w", 0) and idx.stats().ranks_over_cap == 0


def test_rank_blocks_counts_each_ranks_hashes() -> None:
    idx = PrefixIndex(BS)
    assert idx.rank_blocks("w", 0) == 0
    idx.apply("w", 0, KVEventBatch(0.0, [BlockStored([1, 2, 3], None, tokens(3), BS)], 0))
    idx.apply("w", 0, KVEventBatch(0.0, [BlockRemoved([2])], 0))
    assert idx.rank_blocks("w", 0) == 2


def run_python(code: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True,
                          text=True, timeout=60)  # fmt: skip


def test_keychain_before_init_raises_instead_of_crashing() -> None:
    proc = run_python(
        """
        import numpy as np
        from kvwire.prefix_index._core import Index, KeyChain
        chain = KeyChain.__new__(KeyChain)
        for call in (lambda: chain.keys_into([1, 2, 3, 4], False, 0, 0, None, np.empty(4, np.uint64)),
                     lambda: chain.block_size):
            try:
                call()
            except ValueError as exc:
                print("refused:", exc)
        idx = Index()
        idx.ensure_rank(0)
        try:
            idx.store(0, chain, [1], None, [1, 2], False, 0, None, 0)
        except ValueError as exc:
            print("refused:", exc)
        """
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.count("before __init__") == 3


def test_index_before_init_is_an_empty_valid_index() -> None:
    proc = run_python(
        """
        import numpy as np
        from kvwire.prefix_index._core import Index
        from kvwire.prefix_index.keys import key_scheme
        chain = key_scheme(0, 2).native
        idx = Index.__new__(Index)
        keys = np.empty(2, np.uint64)
        chain.keys_into([1, 2, 3, 4], False, 7, 0, None, keys)
        print(idx.match(keys, ["a"], None))
        idx.ensure_rank(0)
        idx.store(0, chain, [11, 12], None, [1, 2, 3, 4], False, 7, None, 0)
        print(idx.match(keys, ["a"], None), idx.nodes, idx.rank_stats(0))
        for call in (lambda: idx.apply_payload(0, b"", None), lambda: idx.match_list([1, 2])):
            try:
                call()
            except ValueError as exc:
                print(exc)
        other = Index.__new__(Index)
        other.import_ranks([3], [idx.export_rank(0)])
        print(other.match(keys, ["a", "b", "c", "d"], None), other.rank_stats(3), other.reserve(3, 10))
        other.forget_rank(3)
        print(other.nodes, other.memory, other.export_rank(None) == idx.export_rank(None))
        """
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.split("\n")[:7] == [
        "{}",
        "{'a': 2} 2 (2, 0, 0)",
        "Index used before configure()",
        "Index used before configure()",
        "{'d': 2} (2, 0, 0) True",
        "0 0 True",
        "",
    ]


def test_match_survives_a_tiers_type_that_empties_the_names() -> None:
    idx = PrefixIndex(BS)
    for w in range(5):
        idx.apply(f"w{w}", 0, KVEventBatch(0.0, [BlockStored([1, 2], None, tokens(2), BS)], 0))
    names = list(idx._names)
    keys = idx.keys(tokens(2))

    def evil(g: int, c: int, s: int) -> tuple[int, int, int]:
        names.clear()
        return (g, c, s)

    got = idx._core.match(keys, names, evil)
    # The result holds the names it was built with; a value built later (here,
    # running the evil type) cannot change which holders it has.
    assert len(got) == 5 and names
    assert got[("w0", 0)] == (2, 0, 0) and not names
    assert dict(got) == {(f"w{w}", 0): (2, 0, 0) for w in range(5)}


def test_index_max_entries_is_checked() -> None:
    with pytest.raises(ValueError):
        Index(-1)
    assert Index(5).max_entries == 5


def test_other_block_sizes_cost_no_key_scheme_and_stay_unmatched() -> None:
    from kvwire.prefix_index.keys import key_scheme

    idx = PrefixIndex(BS)
    before = key_scheme.cache_info()
    for size in range(BS + 1, BS + 200):
        idx.apply("w", 0, KVEventBatch(0.0, [BlockStored([size], None, [1] * size, size)], 0))
    after = key_scheme.cache_info()
    assert (after.hits, after.misses) == (before.hits, before.misses)
    assert idx.rank_blocks("w", 0) == 199
    assert idx.stats().malformed_stores == 0
    assert idx.match([1] * (BS + 1)) == {}


def test_a_match_result_cannot_be_made_from_python_and_outlives_its_index() -> None:
    with pytest.raises(TypeError):
        Matches()
    with pytest.raises(TypeError):
        Matches.__new__(Matches)
    idx = PrefixIndex(BS)
    for w in range(3):
        idx.apply(f"w{w}", 0, KVEventBatch(0.0, [BlockStored([1, 2], None, tokens(2), BS)], 0))
    got, tiers = idx.match(tokens(2)), idx.match_tiers(tokens(2))
    idx.remove_worker("w0")
    del idx
    gc.collect()
    assert got == {("w0", 0): 2, ("w1", 0): 2, ("w2", 0): 2}  # a snapshot of the walk
    assert tiers[("w2", 0)] == (2, 0, 0) and tiers.best(1) == [(("w0", 0), (2, 0, 0))]
    with pytest.raises(TypeError):
        hash(got)
    for copied in (copy.copy(got), pickle.loads(pickle.dumps(got))):
        assert type(copied) is dict and copied == got
    with pytest.raises(TypeError):
        got[["unhashable"]]  # type: ignore[index]


def test_a_match_result_in_a_cycle_is_collected() -> None:
    idx = PrefixIndex(BS)
    idx.apply("w", 0, KVEventBatch(0.0, [BlockStored([1], None, tokens(1), BS)], 0))

    class Depths(tuple):  # type: ignore[type-arg]
        def __new__(cls, *depths: int) -> Self:
            return super().__new__(cls, depths)

    got = idx._core.match(idx.keys(tokens(1)), [("w", 0)], Depths)
    holder = got[("w", 0)]
    holder_ref = weakref.ref(Depths)
    Depths.result = got  # type: ignore[attr-defined]  # result -> type -> result
    del got, holder, Depths
    gc.collect()
    assert holder_ref() is None
