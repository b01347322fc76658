"""A rank's view as bytes (export_rank / import_rank), capacity hints (reserve) and the
memory budget (max_bytes): an imported rank answers and evolves exactly like the
original, and every bad view is refused with nothing changed."""

from __future__ import annotations

import gc
import logging
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvwire.prefix_index import KvRouter, PrefixIndex
from kvwire.prefix_index.keys import fmix64
from kvwire.subscriber.sink import BlockSetSink
from kvwire.wire import BlockRemoved, BlockStored, KVEventBatch, encode_batch
from tests.budget import SCALE, examples
from tests.waiting import wait_for

from .test_index_model import BS, WORKERS, Driver, ops

M64 = (1 << 64) - 1
_F1 = 0xFF51_AFD7_ED55_8CCD
_F2 = 0xC4CE_B9FE_1A85_EC53
_GOLDEN = 0x9E37_79B9_7F4A_7C15
HEAD = 24
REC = 32


# --- the view's layout, written out independently (to forge views that pass the checksum) ---


def checksum(view: bytes) -> int:
    lanes = [_F1, _F2, _GOLDEN, ~_GOLDEN & M64]

    def rec(r: bytes) -> None:
        for k in range(4):
            w = int.from_bytes(r[8 * k : 8 * k + 8], "little")
            lanes[k] = ((lanes[k] ^ w) * _GOLDEN) & M64

    rec(view[:16] + bytes(16))
    for i in range(HEAD, len(view), REC):
        rec(view[i : i + REC])
    return fmix64(lanes[0]) ^ fmix64(lanes[1] ^ 1) ^ fmix64(lanes[2] ^ 2) ^ fmix64(lanes[3] ^ 3)


def signed(view: bytes | bytearray) -> bytes:
    v = bytearray(view)
    v[16:24] = checksum(bytes(v)).to_bytes(8, "little")
    return bytes(v)


def records(view: bytes) -> list[dict[str, Any]]:
    out = []
    for i in range(HEAD, len(view), REC):
        r = view[i : i + REC]
        out.append({
            "h": int.from_bytes(r[0:8], "little"),
            "c": [int.from_bytes(r[8 + 2 * t : 10 + 2 * t], "little") for t in range(3)],
            "pad": int.from_bytes(r[14:16], "little"),
            "depth": int.from_bytes(r[16:20], "little", signed=True),
            "hh": int.from_bytes(r[20:24], "little"),
            "key": int.from_bytes(r[24:32], "little"),
        })  # fmt: skip
    return out


def pack(view: bytes, recs: list[dict[str, Any]], *, count: int | None = None, mark: int | None = None) -> bytes:
    head = bytearray(view[:HEAD])
    head[8:16] = (len(recs) if count is None else count).to_bytes(8, "little")
    if mark is not None:
        head[6:8] = mark.to_bytes(2, "little")
    body = b"".join(
        r["h"].to_bytes(8, "little")
        + b"".join(c.to_bytes(2, "little") for c in r["c"])
        + r["pad"].to_bytes(2, "little")
        + r["depth"].to_bytes(4, "little", signed=True)
        + r["hh"].to_bytes(4, "little")
        + r["key"].to_bytes(8, "little")
        for r in recs
    )
    return signed(bytes(head) + body)


def tokens(n: int, base: int = 0) -> list[int]:
    return [base + i for i in range(n * BS)]


def store(idx: PrefixIndex, w: str, r: int, hashes: list[int], parent: int | None, toks: list[int],
          medium: str | None = None) -> None:  # fmt: skip
    idx.apply(w, r, KVEventBatch(0.0, [BlockStored(hashes, parent, toks, BS, medium=medium)], r))


# --- round trip --------------------------------------------------------------------


class Twin:
    """Two indexes fed the same events; every query asks both and insists they agree."""

    def __init__(self, a: PrefixIndex, b: PrefixIndex) -> None:
        self.a, self.b = a, b

    def apply(self, w: str, r: int, batch: KVEventBatch) -> None:
        self.a.apply(w, r, batch)
        self.b.apply_payload(w, r, encode_batch(batch))  # the other path, the same result

    def clear(self, w: str, r: int) -> None:
        self.a.clear(w, r)
        self.b.clear(w, r)

    def remove_worker(self, w: str) -> None:
        self.a.remove_worker(w)
        self.b.remove_worker(w)

    def __getattr__(self, name: str) -> Any:
        def both(*args: Any, **kw: Any) -> Any:
            got = getattr(self.a, name)(*args, **kw)
            assert getattr(self.b, name)(*args, **kw) == got, (name, args)
            return got

        return both

    def stats(self) -> Any:
        return self.a.stats()


def same_view(a: PrefixIndex, b: PrefixIndex) -> None:
    """Everything a reader sees of the ranks of ``a`` (``b`` may have emptied ranks more)."""
    for name in a.ranks():
        assert b.has_rank(*name)
        assert a.blocks(*name) == b.blocks(*name), name
        assert a.rank_blocks(*name) == b.rank_blocks(*name)
        assert a.over_cap(*name) == b.over_cap(*name) and a.cap_reason(*name) == b.cap_reason(*name)
        assert sorted(records(a.export_rank(*name)), key=lambda r: r["h"]) == sorted(
            records(b.export_rank(*name)), key=lambda r: r["h"]
        )
    for name in b.ranks():
        if not a.has_rank(*name):
            assert b.blocks(*name) == set()
    sa, sb = a.stats(), b.stats()
    for f in ("blocks", "holders", "detached", "ranks_over_cap"):
        assert getattr(sa, f) == getattr(sb, f), f
    for idx in (a, b):
        assert idx._core.memory == idx._core.memory_summed


@settings(max_examples=examples(200), deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ops, ops, st.integers(0, 60), st.sampled_from([0, 0, 3]), st.sampled_from([None, 6]))
def test_imported_ranks_answer_and_evolve_like_the_original(
    before: list[tuple[Any, ...]], after: list[tuple[Any, ...]], head: int, hint: int, cap: int | None
) -> None:
    """Index A applies random events (stores on known, unknown and no parents, removals,
    clears, repeated stores, every tier, a small block cap); B saw only the first ones,
    then imports every rank of A. Both answer alike (matches on every stored prompt,
    blocks, stats), and keep answering alike (and like the brute-force model) as the
    same further events reach both, down to empty tables when everything is removed."""
    d = Driver(hint)
    d.index = PrefixIndex(BS, seed=7, expected_blocks_per_rank=hint, max_blocks_per_rank=cap)
    b = PrefixIndex(BS, seed=7, expected_blocks_per_rank=hint, max_blocks_per_rank=cap)
    for i, op in enumerate(before):
        d.run(op)
        if i < head:  # B follows the first ones, so an import replaces contents
            for name in d.index.ranks():
                b.import_rank(*name, d.index.export_rank(*name))
    a = d.index
    # Every rank in one bulk import (an unknown rank's view is empty).
    b.import_ranks([(*name, a.export_rank(*name)) for name in sorted({*a.ranks(), *b.ranks()})])
    same_view(a, b)
    d.index = Twin(a, b)  # type: ignore[assignment]
    if cap is None:
        d.check()  # matches, blocks and counters like the model; B agreeing on each
    for op in after:
        d.run(op)
    same_view(a, b)
    if cap is None:
        d.check()
    d.remove_everything()
    for idx in (a, b):
        s = idx.stats()
        assert (s.blocks, s.holders, s.detached) == (0, 0, 0)
        if not hint:
            assert s.memory_bytes == 0


def test_view_keeps_tiers_detached_chains_repeats_and_the_cap_mark() -> None:
    a = PrefixIndex(BS, max_blocks_per_rank=8)
    store(a, "w", 0, [1, 2, 3], None, tokens(3))
    store(a, "w", 0, [4], 3, tokens(1, 100), "CPU")
    store(a, "w", 0, [4], 3, tokens(1, 100), "CPU")  # a second copy
    store(a, "w", 0, [5, 6], 999, tokens(2, 50))  # unknown parent: detached
    store(a, "w", 0, [7], 6, tokens(1, 60), "DISK")
    store(a, "w", 0, list(range(20, 30)), None, tokens(10, 7))  # past the cap: refused
    assert a.cap_reason("w", 0) == "max_blocks_per_rank"
    b = PrefixIndex(BS, max_blocks_per_rank=8)
    b.import_rank("w", 0, a.export_rank("w", 0))
    prompt = tokens(3) + tokens(1, 100)
    assert b.match_tiers(prompt) == a.match_tiers(prompt) == {("w", 0): (3, 1, 0)}
    assert b.over_cap("w", 0) and b.stats().detached == a.stats().detached == 3
    assert b.match(tokens(2, 50)) == {}  # a detached chain stays unmatchable
    for idx in (a, b):
        idx.apply("w", 0, KVEventBatch(0.0, [BlockRemoved([4], "CPU")], 0))
        assert idx.match_tiers(prompt)[("w", 0)] == (3, 1, 0)  # one copy left
        idx.apply("w", 0, KVEventBatch(0.0, [BlockRemoved([4, 5, 6], "CPU")], 0))
        idx.apply("w", 0, KVEventBatch(0.0, [BlockRemoved([5, 6])], 0))
        idx.apply("w", 0, KVEventBatch(0.0, [BlockRemoved([7], "DISK")], 0))
        assert idx.match_tiers(prompt) == {("w", 0): (3, 0, 0)}
        assert idx.stats().unknown_removals == 2
        idx.clear("w", 0)
        assert not idx.over_cap("w", 0) and idx.stats().memory_bytes == 0


def test_shared_keys_of_one_rank_stay_counted() -> None:
    """Two engine hashes of one rank with the same content (one key): the import counts
    both, so removing one keeps the key held, removing both drops it."""
    a = PrefixIndex(BS)
    store(a, "w", 0, [1, 2], None, tokens(2))
    store(a, "w", 0, [11, 12], None, tokens(2))
    store(a, "v", 0, [1, 2], None, tokens(2))
    b = PrefixIndex(BS)
    store(b, "v", 0, [1, 2], None, tokens(2))
    b.import_rank("w", 0, a.export_rank("w", 0))
    for idx in (a, b):
        idx.apply("w", 0, KVEventBatch(0.0, [BlockRemoved([1, 2])], 0))
        assert idx.match(tokens(2)) == {("w", 0): 2, ("v", 0): 2}
        idx.apply("w", 0, KVEventBatch(0.0, [BlockRemoved([11, 12])], 0))
        assert idx.match(tokens(2)) == {("v", 0): 2}
        assert idx.stats().holders == 2


def test_many_ranks_and_slots() -> None:
    """Views imported into ranks past 64 (another mask word), slots freed and reused."""
    a, b = PrefixIndex(BS), PrefixIndex(BS)
    for i in range(70):
        store(a, f"w{i}", 0, [i, i + 1000], None, tokens(2) if i % 2 else tokens(2, 9))
    for name in reversed(a.ranks()):
        b.import_rank(*name, a.export_rank(*name))
    assert b.match(tokens(2)) == a.match(tokens(2)) and len(a.match(tokens(2))) == 35
    for i in range(0, 70, 3):
        b.remove_worker(f"w{i}")
        a.remove_worker(f"w{i}")
    b.import_rank("new", 5, a.export_rank("w1", 0))  # takes a freed slot
    assert b.match(tokens(2))[("new", 5)] == 2
    assert b.stats().holders == a.stats().holders + 2


def test_a_bulk_import_equals_rank_by_rank_imports() -> None:
    """import_ranks over 130 ranks (three mask words), new and held, shared keys among
    them: the same index as importing them one at a time."""
    a = PrefixIndex(BS)
    for i in range(130):
        store(a, f"w{i % 3}", i, [i, i + 1000], None, tokens(2, i % 5))
        store(a, f"w{i % 3}", i, [i + 2000], i + 1000, tokens(1, 7), "CPU" if i % 4 else None)
    one, bulk = PrefixIndex(BS), PrefixIndex(BS)
    for idx in (one, bulk):
        store(idx, "w1", 1, [9], None, tokens(1, 3))  # a held rank, replaced
        store(idx, "x", 0, [8], None, tokens(1, 4))  # one left alone
    views = [(*name, a.export_rank(*name)) for name in a.ranks()]
    for view in views:
        one.import_rank(*view)
    bulk.import_ranks(views)
    same_view(one, bulk)
    assert bulk.match(tokens(2, 1)) == a.match(tokens(2, 1)) and len(bulk.match(tokens(2, 1))) == 26


def test_large_views_import_alike_and_a_refused_one_keeps_no_memory() -> None:
    """Views whose tables come from the arena (0.5 and 1 MiB, its chunks mapped for the
    whole import up front): the same index as rank-by-rank imports, and a bulk import
    refused after its tables were built leaves the index's memory as it was."""
    a = PrefixIndex(BS)
    sizes = [12_000, 12_000, 6_000, 12_000, 6_000]
    for r, n in enumerate(sizes):
        base = 10**6 * (r + 1)
        store(a, "w", r, list(range(base, base + n)), None, tokens(n, base))
    views = [("w", r, a.export_rank("w", r)) for r in range(len(sizes))]
    one, bulk = PrefixIndex(BS), PrefixIndex(BS)
    for view in views:
        one.import_rank(*view)
    bulk.import_ranks(views)
    same_view(one, bulk)
    same_view(a, bulk)
    assert bulk.stats().memory_bytes == one.stats().memory_bytes
    recs = records(views[0][2])
    bad = pack(views[0][2], [*recs, recs[1]])  # checksum valid, a hash twice
    fresh = PrefixIndex(BS)
    store(fresh, "x", 0, [1], None, tokens(1))
    before = (state(fresh), fresh.stats().memory_bytes)
    with pytest.raises(ValueError, match="twice"):
        fresh.import_ranks([*views, ("w", 9, bad)])
    assert (state(fresh), fresh.stats().memory_bytes) == before


def _huge_advised() -> tuple[int, int]:
    """(Rss, AnonHugePages) in KiB over this process's mappings advised for huge pages."""
    rss = huge = 0
    region: dict[str, int] = {}
    with open("/proc/self/smaps") as f:
        for line in f:
            key, _, rest = line.partition(":")
            if key in ("Rss", "AnonHugePages"):
                region[key] = int(rest.split()[0])
            elif key == "VmFlags":
                if "hg" in rest.split():
                    rss += region.get("Rss", 0)
                    huge += region.get("AnonHugePages", 0)
                region = {}
    return rss, huge


def test_an_imports_tables_are_faulted_in_with_small_pages_first() -> None:
    """An import's fresh memory (its rank tables' arena chunks, the shared table grown for
    it) is faulted in with small pages and only then advised for huge ones: on a VM that
    takes free memory back a huge page at a time, a huge page's first fault cost up to 25x
    its small pages'. khugepaged may collapse some meanwhile: at most ``pages_to_scan``
    pages a wake-up, and this test is over well before a second one."""
    thp = "/sys/kernel/mm/transparent_hugepage"
    try:
        with open(f"{thp}/enabled") as f:
            if "[never]" in f.read():
                pytest.skip("transparent huge pages are off")
        with open(f"{thp}/khugepaged/pages_to_scan") as f:
            collapsed = 2 * int(f.read()) * 4  # KiB khugepaged may collapse meanwhile
        _huge_advised()
    except OSError:
        pytest.skip("no transparent huge pages or /proc/self/smaps here")
    a = PrefixIndex(BS)
    store(a, "w", 0, list(range(10**6, 10**6 + 12_000)), None, tokens(12_000, 10**6))
    view = a.export_rank("w", 0)
    # A large table an earlier test grew may still be collapsing into huge pages (on a
    # thread of its own): measured once its count stops moving.
    gc.collect()
    readings = [_huge_advised()[1]]

    def settled() -> bool:
        readings.append(_huge_advised()[1])
        return readings[-1] == readings[-2]

    wait_for(settled, 30, "earlier tables' huge pages to settle", poll=0.25)
    rss0, huge0 = _huge_advised()
    b = PrefixIndex(BS)
    b.import_ranks([("w", r, view) for r in range(64)])  # 64 rank tables of 1 MiB
    rss1, huge1 = _huge_advised()
    if rss1 - rss0 < 4 << 10:
        pytest.skip("tables from the allocator here (a sanitizer build)")
    assert rss1 - rss0 >= 48 << 10 and huge1 - huge0 <= collapsed
    assert b.match(tokens(12_000, 10**6)) == {("w", r): 12_000 for r in range(64)}


@pytest.mark.skipif(SCALE < 1, reason="a sanitizer build's tables come from its allocator")
def test_a_large_table_collapsing_into_huge_pages_stays_exact_and_can_be_freed() -> None:
    """A shared table of 32 MiB or more grown by stores is collapsed into huge pages by a
    thread of its own while stores go on; freeing it stops that thread first. Two
    indexes grown past it, the first dropped mid-collapse: the second answers exactly."""
    n = 1_600_000  # blocks: past 2^21 nodes, a 32 MiB shared table
    for round_ in range(2):
        idx = PrefixIndex(BS)
        for r in range(8):
            base = (round_ * 8 + r) * n * BS
            per = n // 8
            store(idx, "w", r, list(range(base + 1, base + 1 + per)), None, tokens(per, base))
        if round_ == 0:
            del idx  # its collapse, if still going, is stopped before the unmap
            continue
        for r in range(8):
            base = (8 + r) * n * BS
            assert idx.match(tokens(64, base)) == {("w", r): 64}
        assert idx.stats().blocks == n


# --- bad views ---------------------------------------------------------------------


def test_a_bulk_import_with_one_bad_view_changes_nothing_and_names_it() -> None:
    a, good = sample_view()
    bad = bytearray(good)
    bad[HEAD + 3] ^= 1
    b = target()
    before = state(b)
    for views in (
        [("w", 0, good), ("new", 3, bytes(bad))],
        [("new", 3, good), ("new", 4, good[:-1]), ("w", 0, good)],
    ):
        with pytest.raises(ValueError) as info:
            b.import_ranks(views)
        assert len(info.value.args) == 2 and views[info.value.args[1]][2] != good
        assert state(b) == before
    with pytest.raises(ValueError, match="two views of worker w rank 0"):
        b.import_ranks([("w", 0, good), ("w", 0, good)])
    assert state(b) == before
    b.import_ranks([("w", 0, good), ("new", 3, good)])
    assert b.blocks("new", 3) == b.blocks("w", 0) == a.blocks("w", 0)


def state(idx: PrefixIndex) -> Any:
    names = sorted(idx.ranks())
    return (
        names,
        {n: idx.export_rank(*n) for n in names},
        idx.stats(),
        idx.match(tokens(3)),
        idx.match_tiers(tokens(3)),
        idx._core.memory,
    )


def sample_view() -> tuple[PrefixIndex, bytes]:
    a = PrefixIndex(BS, max_blocks_per_rank=6)
    store(a, "w", 0, [1, 2, 3], None, tokens(3))
    store(a, "w", 0, [4], 99, tokens(1, 9), "CPU")
    store(a, "w", 0, [9, 10, 11, 12], None, tokens(4, 3))  # refused: over the cap
    return a, a.export_rank("w", 0)


def target() -> PrefixIndex:
    b = PrefixIndex(BS, max_blocks_per_rank=6)
    store(b, "w", 0, [7, 8], None, tokens(2))
    store(b, "x", 1, [5], None, tokens(1))
    return b


def refused(b: PrefixIndex, view: bytes, match: str | None = None) -> None:
    before = state(b)
    for name in (("w", 0), ("new", 3)):  # into a held rank, and into a new one
        with pytest.raises(ValueError, match=match):
            b.import_rank(*name, view)
        assert state(b) == before


def test_every_truncation_is_refused() -> None:
    _, view = sample_view()
    b = target()
    for n in range(len(view)):
        refused(b, view[:n])
    refused(b, view + b"\0")
    refused(b, view + view[HEAD : HEAD + REC])


def test_every_flipped_byte_is_refused() -> None:
    _, view = sample_view()
    b = target()
    for i in range(len(view)):
        for bit in (0x01, 0x80, 0xFF):
            bad = bytearray(view)
            bad[i] ^= bit
            refused(b, bytes(bad))


def test_bad_contents_with_a_valid_checksum_are_refused() -> None:
    _, view = sample_view()
    recs = records(view)
    assert len(recs) == 4
    b = target()
    b.import_rank("ok", 0, pack(view, recs))  # the forger writes views this index takes

    def change(i: int, **kw: Any) -> list[dict[str, Any]]:
        out = [dict(r) for r in recs]
        out[i].update(kw)
        return out

    at0 = next(i for i, r in enumerate(recs) if r["depth"] == 0)
    at1 = next(i for i, r in enumerate(recs) if r["depth"] == 1)
    det = next(i for i, r in enumerate(recs) if r["depth"] < 0)
    refused(b, pack(view, recs, count=3), "cannot hold")
    refused(b, pack(view, recs, count=5), "cannot hold")
    refused(b, pack(view, recs, count=2**61), "cannot hold")
    refused(b, pack(view, recs, mark=4), "mark")
    refused(b, pack(view, [*recs, recs[1]]), "twice")
    refused(b, pack(view, change(1, c=[0, 0, 0])), "no store count")
    refused(b, pack(view, change(1, pad=1)), "padding")
    refused(b, pack(view, change(at1, depth=(1 << 31) - 1)), "position")
    refused(b, pack(view, change(det, depth=-(1 << 31))), "position")
    refused(b, pack(view, change(at0, hh=recs[at0]["hh"] ^ 1)), "home hash")
    refused(b, pack(view, change(det, hh=recs[det]["hh"] ^ 1)), "home hash")
    two_homes = [dict(r) for r in recs] + [dict(recs[at1], h=12345), dict(recs[at1], h=12346, hh=recs[at1]["hh"] ^ 1)]
    refused(b, pack(view, two_homes), "two home hashes")
    bad = bytearray(pack(view, recs))
    bad[4] = 2
    refused(b, signed(bad), "version")
    refused(b, signed(b"KVIY" + bytes(pack(view, recs))[4:]), "magic")
    six = [dict(recs[at0], h=100 + i) for i in range(7)]
    refused(b, pack(view, six), "max_blocks_per_rank")
    b.import_rank("six", 0, pack(view, six[:6]))  # at the cap: taken
    refused(b, b"x" * 3)
    with pytest.raises(TypeError):
        b.import_rank("w", 0, "a string")  # type: ignore[arg-type]


def test_view_format_tells_the_key_parameters_apart() -> None:
    base = PrefixIndex(16).view_format()
    assert PrefixIndex(16).view_format() == base
    assert PrefixIndex(16, groups=(None, 0)).view_format() == base
    others = [PrefixIndex(32), PrefixIndex(16, seed=1), PrefixIndex(16, groups=(0, 1))]
    assert len({base, *(o.view_format() for o in others)}) == 4
    assert PrefixIndex(16, max_bytes=1 << 30).view_format() == base  # not a key parameter
    assert BlockSetSink().view_format() != base


# --- reserve -------------------------------------------------------------------------


def test_reserve_sizes_the_rank_once_and_changes_no_answer() -> None:
    plain, hinted = PrefixIndex(BS), PrefixIndex(BS)
    hinted.reserve("w", 0, 5000)
    assert not hinted.has_rank("w", 0)  # a hint waits for the rank's first event
    for idx in (plain, hinted):
        store(idx, "w", 0, [1, 2], None, tokens(2))
    assert hinted.match(tokens(2)) == plain.match(tokens(2)) == {("w", 0): 2}
    grown = hinted.stats().memory_bytes
    assert grown > 5000 * 32 + 5000 * 24 > plain.stats().memory_bytes
    for n in range(3, 3000):
        store(hinted, "w", 0, [n], n - 1, tokens(1, n))
    assert hinted.stats().memory_bytes == grown  # no growth: sized for it up front
    hinted.clear("w", 0)
    store(hinted, "w", 0, [1], None, tokens(1))
    assert hinted.stats().memory_bytes == grown  # the hint outlives a clear
    hinted.reserve("w", 0, 0)  # a later hint replaces it
    hinted.clear("w", 0)
    assert hinted.stats().memory_bytes == 0
    hinted.reserve("w", 0, 10**9)  # clamped (max_blocks_per_rank, 2**24)
    hinted.remove_worker("w")
    assert hinted.stats().memory_bytes == 0 and hinted._core.memory_summed == 0
    with pytest.raises(ValueError):
        hinted.reserve("w", 0, -1)


def test_reserve_within_a_budget_is_dropped_not_refused() -> None:
    idx = PrefixIndex(BS, max_bytes=64 << 10)
    store(idx, "w", 0, [1], None, tokens(1))
    idx.reserve("w", 0, 1 << 20)  # no room for it: dropped
    store(idx, "w", 0, [2], 1, tokens(1, 5))
    assert not idx.over_cap("w", 0) and idx.stats().memory_bytes <= 64 << 10


# --- memory budget ---------------------------------------------------------------------


@pytest.mark.parametrize("payload", [False, True])
def test_memory_budget_refuses_the_growing_rank_and_never_lies(payload: bool) -> None:
    budget = 256 << 10
    idx = PrefixIndex(BS, max_bytes=budget)
    held: dict[tuple[str, int], set[int]] = {}
    refusals = 0
    for step in range(3000):
        name = (WORKERS[step % 3], step % 2)
        hashes = [step * 10 + k for k in range(4)]
        batch = KVEventBatch(0.0, [BlockStored(hashes, None, tokens(4, step), BS)], name[1])
        was = idx.stats().refused_over_budget
        if payload:
            idx.apply_payload(*name, encode_batch(batch))
        else:
            idx.apply(*name, batch)
        if idx.stats().refused_over_budget > was:
            refusals += 1
            assert idx.cap_reason(*name) == "max_bytes"
        else:
            held.setdefault(name, set()).update(hashes)
        assert idx.stats().memory_bytes <= budget
        assert idx._core.memory == idx._core.memory_summed
    assert refusals > 0
    s = idx.stats()
    assert s.refused_over_budget == s.refused_stores == refusals and s.ranks_over_cap > 0
    for name, taken in held.items():
        assert idx.blocks(*name) == taken  # exactly what was taken: nothing silently lost
    # Removals free room; a cleared rank is whole again and takes stores.
    name = next(n for n in held if idx.over_cap(*n))
    idx.clear(*name)
    assert not idx.over_cap(*name)
    store(idx, *name, [1, 2], None, tokens(2, 10**6))
    assert idx.match(tokens(2, 10**6)) == {name: 2}


def test_an_import_past_the_budget_leaves_the_rank_empty_and_over_cap() -> None:
    a = PrefixIndex(BS)
    store(a, "w", 0, list(range(1, 5001)), None, tokens(5000))
    b = PrefixIndex(BS, max_bytes=64 << 10)
    store(b, "w", 0, [7], None, tokens(1))
    b.import_rank("w", 0, a.export_rank("w", 0))
    assert b.blocks("w", 0) == set() and b.cap_reason("w", 0) == "max_bytes"
    s = b.stats()
    assert (s.refused_over_budget, s.refused_stores, s.ranks_over_cap) == (1, 1, 1)
    assert s.memory_bytes <= 64 << 10 and b._core.memory == b._core.memory_summed


def test_router_logs_each_rank_going_over_cap_once(caplog: pytest.LogCaptureFixture) -> None:
    idx = PrefixIndex(BS, max_bytes=32 << 10)
    router = KvRouter(idx)
    store(idx, "v", 0, [1], None, tokens(1))
    for i in range(200):
        store(idx, "w", 0, [i * 2 + 1, i * 2 + 2], None, tokens(2, i))
    assert not idx.over_cap("v", 0)
    assert idx.over_cap("w", 0)
    cands = {("w", 0): (0, 0), ("v", 0): (0, 0)}
    with caplog.at_level(logging.WARNING, logger="kvwire.router"):
        for _ in range(5):
            d = router.choose(tokens(2), cands)
            assert not d.candidates[("w", 0)].cache_used
            assert "max_bytes" in d.candidates[("w", 0)].note
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 1 and lines[0].startswith("w/0: ") and "max_bytes" in lines[0]
    idx.clear("w", 0)
    router.choose(tokens(2), cands)
    store(idx, "w", 0, list(range(10**6, 10**6 + 4000)), None, tokens(4000))  # over again
    assert idx.over_cap("w", 0)
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="kvwire.router"):
        router.choose(tokens(2), cands)
    assert len(caplog.records) <= 1  # noted again (within the interval: held for the summary)
    assert router._log.held + len(caplog.records) == 1


def test_budget_is_validated() -> None:
    with pytest.raises(ValueError):
        PrefixIndex(BS, max_bytes=0)
    assert PrefixIndex(BS, max_bytes=1).max_bytes == 1


# --- BlockSetSink's views ----------------------------------------------------------


def test_block_set_sink_views_round_trip_and_refuse_bad_ones() -> None:
    a = BlockSetSink()
    a.apply("w", 0, KVEventBatch(0.0, [BlockStored([5, 3, M64], None, [1, 2, 3], 1)], 0))
    view = a.export_rank("w", 0)
    b = BlockSetSink()
    b.apply("w", 0, KVEventBatch(0.0, [BlockStored([9], None, [1], 1)], 0))
    b.import_rank("w", 0, view)
    b.import_rank("x", 1, a.export_rank("nobody", 0))
    assert b.blocks("w", 0) == {3, 5, M64} and b.ranks() == [("w", 0)]
    before = (b.blocks("w", 0), b.ranks())
    bad = [view[:n] for n in range(len(view))] + [view + b"\0"]
    bad += [view[:4] + b"\2" + view[5:], view[:16] + view[24:32] + view[16:24] + view[32:]]
    bad += [view[:16] + view[16:24] * 2 + view[32:]]
    for v in bad:
        with pytest.raises(ValueError):
            b.import_rank("w", 0, v)
        assert (b.blocks("w", 0), b.ranks()) == before


def test_many_shared_keys_of_one_rank() -> None:
    """A rank holding the same content under several hashes, in several tiers (hundreds of
    shared keys, past the filter's chance collisions): imported, it matches and drains
    like the original."""
    a = PrefixIndex(BS)
    media = [None, "CPU", "DISK"]
    for copy in range(3):
        for run in range(40):
            hashes = [10**6 * copy + 100 * run + k + 1 for k in range(8)]
            store(a, "w", 0, hashes, None, tokens(8, run * 1000), media[(run + copy) % 3])
    b = PrefixIndex(BS)
    store(b, "w", 0, [5], None, tokens(1, 5))
    b.import_rank("w", 0, a.export_rank("w", 0))
    same_view(a, b)
    for run in range(40):
        assert b.match_tiers(tokens(8, run * 1000)) == a.match_tiers(tokens(8, run * 1000))
    for copy in range(3):
        for idx in (a, b):
            for run in range(40):
                hashes = [10**6 * copy + 100 * run + k + 1 for k in range(8)]
                idx.apply("w", 0, KVEventBatch(0.0, [BlockRemoved(hashes, media[(run + copy) % 3])], 0))
        same_view(a, b)
        assert b.match_tiers(tokens(8, 3000)) == a.match_tiers(tokens(8, 3000))
    assert b.stats().memory_bytes == a.stats().memory_bytes == 0
