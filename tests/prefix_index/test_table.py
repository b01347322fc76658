"""The numpy hash table against a dict."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from kvwire.prefix_index.table import EMPTY, U64Table

MAX = (1 << 64) - 1
# Small pools make repeats and re-inserts common; the extremes include EMPTY.
key = st.one_of(st.integers(0, 40), st.sampled_from([0, MAX, MAX - 1, 1 << 63]))
batch = st.lists(key, min_size=0, max_size=30)
op = st.tuples(st.sampled_from(["upsert", "upsert", "delete", "clear"]), batch)


@settings(max_examples=150, deadline=None)
@given(st.lists(op, min_size=1, max_size=40))
def test_table_matches_dict(ops: list[tuple[str, list[int]]]) -> None:
    t = U64Table({"v": np.uint32})
    ref: dict[int, int] = {}
    for kind, keys in ops:
        arr = np.array(keys, dtype=np.uint64)
        if kind == "upsert":
            pos, new = t.upsert(arr)
            # First listing of each absent key is the inserted one.
            seen: set[int] = set()
            for i, k in enumerate(keys):
                assert new[i] == (k not in ref and k not in seen)
                seen.add(k)
            t.cols["v"][pos] += np.uint32(1)
            for k in set(keys):
                ref[k] = ref.get(k, 0) + 1
        elif kind == "delete":
            present = sorted({k for k in keys if k in ref})
            rows = t.lookup(np.array(present, dtype=np.uint64))
            assert (rows >= 0).all()
            t.delete(rows)
            for k in present:
                del ref[k]
        else:
            t.clear()
            ref.clear()
        assert t.count == len(ref)
        probe = np.array(sorted(set(keys) | set(ref) | {5, MAX}), dtype=np.uint64)
        rows = t.lookup(probe)
        for k, r in zip(probe.tolist(), rows.tolist(), strict=True):
            if k in ref:
                assert r >= 0 and t.cols["v"][r] == ref[k]
                assert int(t.keys[r]) == k
                assert t.lookup_one(k) == r
            else:
                assert r == -1 and t.lookup_one(k) == -1
        held = t.positions()
        assert sorted(t.keys[held].tolist()) == sorted(ref)
    if not ref:
        assert t.nbytes() == 0


def test_grows_and_shrinks_with_many_keys() -> None:
    rng = np.random.default_rng(3)
    keys = np.unique(rng.integers(0, 1 << 63, 200_000, dtype=np.uint64))
    t = U64Table({"v": np.uint64})
    for i in range(0, keys.shape[0], 5000):
        pos, new = t.upsert(keys[i : i + 5000])
        assert new.all()
        t.cols["v"][pos] = keys[i : i + 5000]
    assert t.count == keys.shape[0]
    assert t.count <= 0.65 * t.capacity
    rows = t.lookup(keys)
    assert (t.cols["v"][rows] == keys).all()
    big = t.nbytes()
    t.delete(t.lookup(keys[1000:]))
    assert t.count == 1000 and t.nbytes() < big // 20
    assert (t.cols["v"][t.lookup(keys[:1000])] == keys[:1000]).all()
    assert (t.lookup(keys[1000:2000]) == -1).all()


def test_find_prefix_stops_at_first_missing() -> None:
    t = U64Table({})
    t.upsert(np.array([10, 11, 12, 14], dtype=np.uint64))
    probe = np.array([10, 11, 12, 13, 14], dtype=np.uint64)
    rows = t.find_prefix(probe)
    assert t.keys[rows].tolist() == [10, 11, 12]
    assert t.find_prefix(np.array([13, 10], dtype=np.uint64)).shape[0] == 0
    assert t.keys[t.find_prefix(probe[:3])].tolist() == [10, 11, 12]
    assert np.uint64(MAX) == EMPTY
