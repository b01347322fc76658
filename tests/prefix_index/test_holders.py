"""Sparse holder sets: a key one rank holds keeps that rank inline in its node, and only a key
two or more ranks hold takes a row of the holder pool. Every transition (inline -> pool ->
inline -> gone), tiers, clears and removals beside other holders, growth past 64/128/1,024
ranks, imports into a populated index and the memory budget, against what the ranks hold."""

from __future__ import annotations

import random

from kvwire.prefix_index import PrefixIndex, TierDepths
from kvwire.wire import AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch, encode_batch

BS = 4


def seq(seed: int, blocks: int) -> tuple[list[int], list[int]]:
    """Engine hashes and tokens of a content-chained run (the same seed: the same content)."""
    rnd = random.Random(seed)
    return [rnd.getrandbits(62) | 1 for _ in range(blocks)], [rnd.randrange(1, 1 << 20) for _ in range(blocks * BS)]


def store(idx: PrefixIndex, worker: str, hashes: list[int], tokens: list[int], medium: str | None = None,
          parent: int | None = None) -> None:  # fmt: skip
    ev = BlockStored(hashes, parent, tokens, BS, medium=medium)
    idx.apply_payload(worker, 0, encode_batch(KVEventBatch(0.0, [ev], 0)))


def remove(idx: PrefixIndex, worker: str, hashes: list[int], medium: str | None = None) -> None:
    idx.apply_payload(worker, 0, encode_batch(KVEventBatch(0.0, [BlockRemoved(hashes, medium)], 0)))


def exact_memory(idx: PrefixIndex) -> None:
    """The running count the budget reads equals the tables summed one by one."""
    assert idx._core.memory == idx._core.memory_summed == idx.stats().memory_bytes


def test_inline_to_pool_to_inline_to_gone() -> None:
    idx = PrefixIndex(BS)
    hashes, tokens = seq(1, 8)
    store(idx, "w0", hashes, tokens)
    assert (idx._core.nodes, idx._core.pooled) == (8, 0)
    assert idx.match(tokens) == {("w0", 0): 8}
    exact_memory(idx)
    store(idx, "w1", hashes, tokens)  # a second holder: every key to a pool row
    assert (idx._core.nodes, idx._core.pooled) == (8, 8)
    assert idx.match(tokens) == {("w0", 0): 8, ("w1", 0): 8}
    exact_memory(idx)
    remove(idx, "w0", hashes[4:])  # back to one holder: inline again, rows released
    assert (idx._core.nodes, idx._core.pooled) == (8, 4)
    assert idx.match(tokens) == {("w0", 0): 4, ("w1", 0): 8}
    remove(idx, "w0", hashes[:4])
    assert (idx._core.nodes, idx._core.pooled) == (8, 0)
    assert idx.match(tokens) == {("w1", 0): 8}
    exact_memory(idx)
    store(idx, "w0", hashes[:2], tokens[: 2 * BS])  # and pooled again
    assert idx._core.pooled == 2
    assert idx.match(tokens) == {("w0", 0): 2, ("w1", 0): 8}
    remove(idx, "w1", hashes)
    remove(idx, "w0", hashes[:2])
    assert (idx._core.nodes, idx._core.pooled, len(idx.match(tokens))) == (0, 0, 0)
    exact_memory(idx)


def test_one_rank_holding_a_key_twice_beside_another_rank() -> None:
    """Two engine hashes of one rank with the same key (its multi-key count) while another
    rank shares the key: the rank leaves the node only with its last copy."""
    idx = PrefixIndex(BS)
    hashes, tokens = seq(2, 4)
    other = [h ^ (1 << 40) for h in hashes]
    store(idx, "w0", hashes, tokens)
    store(idx, "w0", other, tokens)
    store(idx, "w1", hashes, tokens)
    assert idx._core.pooled == 4
    remove(idx, "w0", hashes)
    assert idx.match(tokens) == {("w0", 0): 4, ("w1", 0): 4}
    remove(idx, "w0", other)
    assert idx._core.pooled == 0
    assert idx.match(tokens) == {("w1", 0): 4}
    exact_memory(idx)


def test_tiers_inline_and_pooled() -> None:
    idx = PrefixIndex(BS)
    hashes, tokens = seq(3, 6)
    store(idx, "w0", hashes, tokens)
    store(idx, "w1", hashes, tokens)  # pooled on one tier, then re-laid out to three
    store(idx, "w2", hashes[:3], tokens[: 3 * BS], medium="CPU")
    store(idx, "w3", [h + 2 for h in hashes[:2]], tokens[: 2 * BS], medium="STORAGE")
    assert idx.match_tiers(tokens) == {
        ("w0", 0): TierDepths(6, 0, 0),
        ("w1", 0): TierDepths(6, 0, 0),
        ("w2", 0): TierDepths(0, 3, 0),
        ("w3", 0): TierDepths(0, 0, 2),
    }
    # Down to one holder of blocks 0-2 (w2, on CPU only): inline with its tier.
    remove(idx, "w0", hashes)
    remove(idx, "w1", hashes)
    remove(idx, "w3", [h + 2 for h in hashes[:2]], medium="STORAGE")
    assert idx._core.pooled == 0
    assert idx.match_tiers(tokens) == {("w2", 0): TierDepths(0, 3, 0)}
    # One rank on two tiers stays inline; a second holder pools both tiers.
    store(idx, "w2", [h + 1 for h in hashes[:2]], tokens[: 2 * BS], medium="GPU")
    assert idx._core.pooled == 0
    assert idx.match_tiers(tokens) == {("w2", 0): TierDepths(2, 1, 0)}
    store(idx, "w4", hashes[:1], tokens[:BS], medium="STORAGE")
    assert idx._core.pooled == 1
    assert idx.match_tiers(tokens) == {("w2", 0): TierDepths(2, 1, 0), ("w4", 0): TierDepths(0, 0, 1)}
    remove(idx, "w4", hashes[:1], medium="STORAGE")
    assert idx._core.pooled == 0
    assert idx.match_tiers(tokens) == {("w2", 0): TierDepths(2, 1, 0)}
    exact_memory(idx)


def test_a_rank_cleared_or_removed_while_others_share_its_keys() -> None:
    idx = PrefixIndex(BS)
    prefix, ptok = seq(4, 4)
    own = {w: seq(10 + w, 3) for w in range(3)}
    for w in range(3):
        store(idx, f"w{w}", prefix, ptok)
        store(idx, f"w{w}", own[w][0], own[w][1], parent=prefix[-1])
    assert (idx._core.nodes, idx._core.pooled) == (4 + 9, 4)
    idx.apply_payload("w1", 0, encode_batch(KVEventBatch(0.0, [AllBlocksCleared()], 0)))
    assert idx.match(ptok + own[1][1]) == {("w0", 0): 4, ("w2", 0): 4}
    assert idx._core.pooled == 4
    idx.remove_worker("w0")  # one holder left of the prefix: inline
    assert (idx._core.nodes, idx._core.pooled) == (4 + 3, 0)
    assert idx.match(ptok + own[2][1]) == {("w2", 0): 7}
    idx.clear("w2", 0)
    assert (idx._core.nodes, idx._core.pooled, len(idx.match(ptok))) == (0, 0, 0)
    exact_memory(idx)


def test_growing_past_64_128_and_1024_ranks() -> None:
    """Rank slots added one by one: the pool's rows widen (a relayout of the pool only);
    inline holders of every word and pooled keys answer alike at each step."""
    idx = PrefixIndex(BS)
    prefix, ptok = seq(5, 3)
    own = {}
    for w in range(1030):
        own[w] = seq(1000 + w, 2)
        store(idx, f"w{w}", prefix, ptok)
        store(idx, f"w{w}", own[w][0], own[w][1], parent=prefix[-1])
        if w in (0, 1, 63, 64, 65, 127, 128, 129, 1023, 1024, 1029):
            n = w + 1
            assert idx._core.pooled == (3 if n > 1 else 0)
            assert idx._core.nodes == 3 + 2 * n
            full = idx.match(ptok)
            assert len(full) == n and set(full.values()) == {3}
            for v in {0, w // 2, w}:
                assert idx.match(ptok + own[v][1]) == {
                    **{(f"w{u}", 0): 3 for u in range(n)},
                    (f"w{v}", 0): 5,
                }
            exact_memory(idx)
    # A CPU copy now: the three-tier relayout of wide rows.
    store(idx, "w700", [h + 1 for h in prefix], ptok, medium="CPU")
    tiers = idx.match_tiers(ptok + own[700][1])
    assert tiers[("w700", 0)] == TierDepths(5, 0, 0)
    assert tiers[("w1029", 0)] == TierDepths(3, 0, 0)
    for w in range(1029):
        idx.clear(f"w{w}", 0)
    assert idx._core.pooled == 0  # only w1029 holds the prefix (and w1029's own blocks)
    assert idx.match(ptok + own[1029][1]) == {("w1029", 0): 5}
    exact_memory(idx)


def test_import_ranks_into_a_populated_index() -> None:
    prefix, ptok = seq(6, 5)
    mine, mtok = seq(7, 4)
    src = PrefixIndex(BS)
    store(src, "a", prefix, ptok)
    store(src, "a", mine, mtok, parent=prefix[-1])
    view = src.export_rank("a", 0)

    dst = PrefixIndex(BS)
    for w in ("b", "c"):  # other ranks already hold the prefix (pooled)...
        store(dst, w, prefix, ptok)
    other, otok = seq(8, 3)
    store(dst, "a", other, otok)  # ...and the imported rank's old blocks go
    store(dst, "d", prefix, ptok)
    store(dst, "d", mine, mtok, parent=prefix[-1])  # one rank alone holds `mine`: inline
    dst.import_rank("a", 0, view)
    assert dst.match(ptok + mtok) == {("a", 0): 9, ("b", 0): 5, ("c", 0): 5, ("d", 0): 9}
    assert dst.match(otok) == {}
    assert (dst._core.nodes, dst._core.pooled) == (9, 9)
    exact_memory(dst)
    # Imported over again (its own rows freed and taken again), then alongside a second view.
    dst.import_ranks([("a", 0, view), ("b", 0, src.export_rank("a", 0))])
    assert dst.match(ptok + mtok) == {("a", 0): 9, ("b", 0): 9, ("c", 0): 5, ("d", 0): 9}
    dst.clear("d", 0)
    dst.clear("c", 0)
    dst.clear("b", 0)
    assert (dst._core.nodes, dst._core.pooled) == (9, 0)
    assert dst.match(ptok + mtok) == {("a", 0): 9}
    exact_memory(dst)


def test_the_memory_budget_counts_pool_rows_exactly() -> None:
    """8 blocks: a rank's table of 16 slots (512 B) and 16 node slots (256 B); a second
    holder of the same 8 keys adds its table and 16 pool rows of 2 words (256 B)."""
    hashes, tokens = seq(9, 8)
    one = 16 * 32 + 16 * 16
    tight = PrefixIndex(BS, max_bytes=one + 512)
    store(tight, "w0", hashes, tokens)
    assert tight.stats().memory_bytes == one
    store(tight, "w1", hashes, tokens)  # would need the pool: refused whole
    assert tight.over_cap("w1", 0) and tight.cap_reason("w1", 0) == "max_bytes"
    assert tight.match(tokens) == {("w0", 0): 8}
    assert tight._core.pooled == 0
    exact_memory(tight)
    other, otok = seq(10, 8)
    store(tight, "w2", other[:1], otok[:BS])  # a distinct key takes no row: it fits
    assert not tight.over_cap("w2", 0)
    assert tight.stats().memory_bytes == one + 8 * 32  # its table of 8 slots; the nodes have room
    exact_memory(tight)

    fits = PrefixIndex(BS, max_bytes=one + 512 + 256)
    store(fits, "w0", hashes, tokens)
    store(fits, "w1", hashes, tokens)
    assert not fits.over_cap("w1", 0)
    assert fits.stats().memory_bytes == one + 512 + 256 == fits.max_bytes
    assert fits.match(tokens) == {("w0", 0): 8, ("w1", 0): 8}
    exact_memory(fits)
    # An import that would need rows past the budget is refused like the store.
    src = PrefixIndex(BS)
    store(src, "x", hashes, tokens)
    fits.clear("w1", 0)
    store(fits, "w3", other, otok)  # its table, and the nodes' table doubled, in w1's room
    assert fits.stats().memory_bytes == one + 512 + 256 == fits.max_bytes
    exact_memory(fits)
    fits.import_rank("w4", 0, src.export_rank("x", 0))
    assert fits.over_cap("w4", 0)
    assert fits.match(tokens) == {("w0", 0): 8}
    assert fits.stats().memory_bytes <= fits.max_bytes
    exact_memory(fits)


Counts = dict[tuple[int, int, int], list[int]]  # (rank, sequence, block) -> copies per tier


def held(count: Counts, r: int, s: int, j: int, tiers: range = range(3)) -> bool:
    c = count.get((r, s, j))
    return c is not None and any(c[t] for t in tiers)


def depth(count: Counts, r: int, s: int, tiers: range = range(3), blocks: int = 6) -> int:
    """The model's match: the longest run of sequence s from its first block rank r holds."""
    d = 0
    while d < blocks and held(count, r, s, d, tiers):
        d += 1
    return d


def test_random_stores_removals_and_clears_over_70_ranks_match_a_model() -> None:
    """Seeded random histories over 70 ranks (past one mask word) and 3 tiers, the same 5
    sequences on every rank: after each step the matches, the tiers, the node and pooled
    counts and the memory agree with a model of what each rank holds."""
    ranks, seqs, blocks = 70, 5, 6
    media = ("GPU", "CPU", "STORAGE")
    content = [seq(100 + s, blocks) for s in range(seqs)]
    for seed in range(3):
        rnd = random.Random(seed)
        idx = PrefixIndex(BS)
        count: Counts = {}
        for _ in range(300):
            r, s, op = rnd.randrange(ranks), rnd.randrange(seqs), rnd.random()
            hashes, tokens = content[s]
            tier = rnd.choice((0, 0, 1, 2))
            if op < 0.55:
                k = rnd.randrange(1, blocks + 1)
                store(idx, f"w{r}", hashes[:k], tokens[: k * BS], medium=media[tier])
                for j in range(k):
                    count.setdefault((r, s, j), [0, 0, 0])[tier] += 1
            elif op < 0.95:
                j = rnd.randrange(blocks)
                remove(idx, f"w{r}", [hashes[j]], medium=media[tier])
                c = count.get((r, s, j))
                if c is not None and c[tier]:
                    c[tier] -= 1
            else:
                idx.clear(f"w{r}", 0)
                for key in [key for key in count if key[0] == r]:
                    del count[key]
            keyed = {(s2, j) for (_, s2, j), c in count.items() if any(c)}
            holders = {key: sum(1 for r2 in range(ranks) if held(count, r2, *key)) for key in keyed}
            assert idx._core.nodes == len(keyed)
            assert idx._core.pooled == sum(1 for n in holders.values() if n > 1)
            for s2 in range(seqs):
                want = {(f"w{r2}", 0): depth(count, r2, s2) for r2 in range(ranks) if depth(count, r2, s2)}
                assert idx.match(content[s2][1]) == want
            tiers = idx.match_tiers(content[s][1])
            for r2 in range(ranks):
                d = depth(count, r2, s)
                if d:
                    g, f = depth(count, r2, s, range(1)), depth(count, r2, s, range(2))
                    assert tiers[(f"w{r2}", 0)] == TierDepths(g, f - g, d - f)
            exact_memory(idx)
