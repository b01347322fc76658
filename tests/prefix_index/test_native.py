"""The native tables under load and under hostile input.

The model test covers semantics on small tables; these drive the tables
through growth, shrinking and deletion in every order, and feed the token
reader bytes straight off a (possibly malicious) network.
"""

from __future__ import annotations

import random
import struct

import msgspec
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvwire.prefix_index import PrefixIndex, block_keys
from kvwire.wire import BlockRemoved, BlockStored, KVEventBatch, TokenIds, encode_batch

BS = 4


def packed(tokens: list[int]) -> TokenIds:
    return TokenIds(msgspec.Raw(msgspec.msgpack.encode(tokens)))


def raw_store(hashes: list[int], raw: bytes, parent: int | None = None) -> BlockStored:
    return BlockStored(block_hashes=hashes, parent_block_hash=parent,
                       token_ids=TokenIds(msgspec.Raw(raw)), block_size=BS)  # fmt: skip


def test_tables_grow_shrink_and_free_in_any_removal_order() -> None:
    rnd = random.Random(5)
    idx = PrefixIndex(BS)
    chains: dict[tuple[str, int], list[tuple[list[int], list[int]]]] = {}
    for w in range(6):
        for c in range(60):
            # Chains share a 3-block root across workers; the rest is their own.
            root = [c % 7] * (3 * BS)
            own = [rnd.randrange(100_000) for _ in range(30 * BS)]
            tokens = root + own
            hashes = [rnd.getrandbits(64) for _ in range(33)]
            idx.apply(f"w{w}", w % 2, KVEventBatch(0.0, [
                BlockStored(hashes, None, packed(tokens), BS)]))  # fmt: skip
            chains.setdefault((f"w{w}", w % 2), []).append((hashes, tokens))
    key_of = {h: k for cs in chains.values() for hs, toks in cs
              for h, k in zip(hs, block_keys(toks, BS).tolist(), strict=True)}  # fmt: skip
    full = idx.stats()
    assert full.holders == 6 * 60 * 33
    # Big enough that the tables' pages are populated in one call (64 KiB and more).
    assert full.memory_bytes > 1 << 18
    for name, cs in chains.items():
        assert idx.blocks(*name) == {h for hs, _ in cs for h in hs}
        for _, tokens in cs[:5]:
            assert idx.match(tokens)[name] == 33
    # Remove in a random order, a chunk at a time; answers stay exact.
    pending = [(name, h) for name, cs in chains.items() for hs, _ in cs for h in hs]
    rnd.shuffle(pending)
    held = {name: {h for hs, _ in cs for h in hs} for name, cs in chains.items()}
    for i in range(0, len(pending), 997):
        chunk = pending[i : i + 997]
        by_rank: dict[tuple[str, int], list[int]] = {}
        for name, h in chunk:
            by_rank.setdefault(name, []).append(h)
            held[name].discard(h)
        for name, hs in by_rank.items():
            idx.apply(*name, KVEventBatch(0.0, [BlockRemoved(hs)]))
        for name in chains:
            assert idx.blocks(*name) == held[name]
        # Chains with one root share its keys under different engine hashes:
        # a root block stays matched while any of them holds it.
        for name in (("w0", 0), ("w1", 1)):
            held_keys = {key_of[h] for h in held[name]}
            for _, tokens in chains[name][:8]:
                keys = block_keys(tokens, BS).tolist()
                depth = next((d for d, k in enumerate(keys) if k not in held_keys), len(keys))
                assert idx.match(tokens).get(name, 0) == depth
        if i > len(pending) * 0.9:
            assert idx.stats().memory_bytes < full.memory_bytes / 4
    s = idx.stats()
    assert (s.blocks, s.holders, s.memory_bytes) == (0, 0, 0)


def test_tables_past_two_mib_grow_and_shrink_exact() -> None:
    """One rank's table and the nodes' table pass 2 MiB (their own huge-page mappings),
    through the native payload path; answers stay exact as they shrink and free."""
    rnd = random.Random(9)
    idx = PrefixIndex(BS)
    n, per = 60_000, 2_000
    tokens = [rnd.randrange(50_000) for _ in range(n * BS)]
    hashes = rnd.sample(range(1, 1 << 62), n)
    for a in range(0, n, per):
        ev = BlockStored(hashes[a : a + per], hashes[a - 1] if a else None,
                         tokens[a * BS : (a + per) * BS], BS)  # fmt: skip
        idx.apply_payload("w", 0, encode_batch(KVEventBatch(0.0, [ev], 0)))
    full = idx.stats()
    assert (full.holders, full.blocks) == (n, n)
    assert full.memory_bytes > 4 << 20  # 32 B a rank slot and 16 B a node slot, at load <= 0.7
    assert idx.match(tokens) == {("w", 0): n}
    # All but the first 16th in a random order, the tables shrinking back under 2 MiB
    # as they go; then the rest: the prefix follows exactly.
    keep = n // 16
    tail = hashes[keep:]
    rnd.shuffle(tail)
    position = {h: i for i, h in enumerate(hashes)}
    first_gone = n
    for a in range(0, len(tail), 5_000):
        gone = tail[a : a + 5_000]
        idx.apply_payload("w", 0, encode_batch(KVEventBatch(0.0, [BlockRemoved(gone)], 0)))
        first_gone = min(first_gone, *(position[h] for h in gone))
        assert idx.match(tokens) == {("w", 0): first_gone}
    assert idx.match(tokens) == {("w", 0): keep}
    # The rank's table at 512 KiB (in a 2 MiB arena chunk, counted whole), the nodes' under it.
    assert idx.stats().memory_bytes < 5 << 19
    idx.apply_payload("w", 0, encode_batch(KVEventBatch(0.0, [BlockRemoved(hashes[:keep])], 0)))
    s = idx.stats()
    assert (s.blocks, s.holders, s.memory_bytes) == (0, 0, 0)
    assert idx.match(tokens) == {}


def test_tables_double_many_times_with_removals_interleaved() -> None:
    """Two ranks grow from empty through a dozen doublings of both tables while
    part of what they hold is removed after every store; answers stay exact."""
    rnd = random.Random(11)
    idx = PrefixIndex(BS)
    held: dict[tuple[str, int], dict[int, int]] = {("a", 0): {}, ("b", 1): {}}  # hash -> key
    chains: dict[tuple[str, int], list[tuple[list[int], list[int]]]] = {n: [] for n in held}
    for step in range(200):
        for name in held:
            tokens = [rnd.randrange(1 << 20) for _ in range(64 * BS)]
            hashes = rnd.sample(range(1, 1 << 62), 64)
            idx.apply(*name, KVEventBatch(0.0, [BlockStored(hashes, None, packed(tokens), BS)]))
            held[name].update(zip(hashes, block_keys(tokens, BS).tolist(), strict=True))
            chains[name].append((hashes, tokens))
            gone = rnd.sample(sorted(held[name]), 16)
            idx.apply(*name, KVEventBatch(0.0, [BlockRemoved(gone)]))
            for h in gone:
                del held[name][h]
        if step % 25 == 24:
            for name, hs in held.items():
                assert idx.blocks(*name) == set(hs)
                keys = set(hs.values())
                for _, tokens in rnd.sample(chains[name], 8):
                    ks = block_keys(tokens, BS).tolist()
                    depth = next((d for d, k in enumerate(ks) if k not in keys), len(ks))
                    assert idx.match(tokens).get(name, 0) == depth
    assert idx.stats().holders == 2 * 200 * 48  # 9,600 a rank: 8 -> 16,384 slots, 11 doublings


def test_rank_tables_share_arena_chunks_through_growth_and_removal() -> None:
    """Five ranks' tables grow through the arena's sizes (0.5 and 1 MiB, two or four to a
    2 MiB chunk), then shrink and free in an interleaved random order; answers stay exact
    and the chunks go back once empty."""
    rnd = random.Random(11)
    idx = PrefixIndex(BS)
    n, per, ranks = 12_000, 1_500, 5
    tokens = {w: [rnd.randrange(50_000) for _ in range(n * BS)] for w in range(ranks)}
    hashes = {w: rnd.sample(range(1, 1 << 62), n) for w in range(ranks)}
    for a in range(0, n, per):
        for w in range(ranks):
            ev = BlockStored(hashes[w][a : a + per], hashes[w][a - 1] if a else None,
                             tokens[w][a * BS : (a + per) * BS], BS)  # fmt: skip
            idx.apply_payload(f"w{w}", 0, encode_batch(KVEventBatch(0.0, [ev], 0)))
    # Five 1 MiB rank tables: three chunks (or, under ASan, five arrays of their own);
    # 60,000 nodes: 131,072 slots of 16 B.
    assert idx.stats().memory_bytes in (3 * (2 << 20) + (2 << 20), 5 * (1 << 20) + (2 << 20))
    for w in range(ranks):
        assert idx.match(tokens[w]) == {(f"w{w}", 0): n}
    position = {(w, h): i for w in range(ranks) for i, h in enumerate(hashes[w])}
    pending = [(w, h) for w in range(ranks) for h in hashes[w]]
    rnd.shuffle(pending)
    first_gone = dict.fromkeys(range(ranks), n)
    for a in range(0, len(pending), 4_000):
        by_rank: dict[int, list[int]] = {}
        for w, h in pending[a : a + 4_000]:
            by_rank.setdefault(w, []).append(h)
            first_gone[w] = min(first_gone[w], position[(w, h)])
        for w, gone in by_rank.items():
            idx.apply_payload(f"w{w}", 0, encode_batch(KVEventBatch(0.0, [BlockRemoved(gone)], 0)))
        for w in range(ranks):
            want = {(f"w{w}", 0): first_gone[w]} if first_gone[w] else {}
            assert idx.match(tokens[w]) == want
    s = idx.stats()
    assert (s.blocks, s.holders, s.memory_bytes) == (0, 0, 0)


def test_capacity_hint_presizes_the_tables_and_keeps_them() -> None:
    """With ``expected_blocks_per_rank`` the tables take their size at the first
    store and keep it while the rank holds up to that many blocks, removals
    included; past it they grow as without. Answers match an index without it."""
    rnd = random.Random(13)
    hinted, plain = PrefixIndex(BS, expected_blocks_per_rank=5_000), PrefixIndex(BS)
    assert hinted.stats().memory_bytes == 0  # nothing allocated before a store
    tokens = [rnd.randrange(1 << 20) for _ in range(9_000 * BS)]
    hashes = rnd.sample(range(1, 1 << 62), 9_000)

    def store(a: int, b: int) -> None:
        ev = BlockStored(hashes[a:b], hashes[a - 1] if a else None, tokens[a * BS : b * BS], BS)
        for idx in (hinted, plain):
            idx.apply_payload("w", 0, encode_batch(KVEventBatch(0.0, [ev], 0)))

    store(0, 10)
    first = hinted.stats().memory_bytes
    # One rank: 8,192 slots (5,000 at load <= 0.7) of 32 B in its table and of 16 B of nodes.
    assert first == 8192 * (32 + 16) > 50 * plain.stats().memory_bytes
    for a in range(10, 5_000, 700):
        store(a, min(a + 700, 5_000))
        assert hinted.stats().memory_bytes == first
    assert hinted.match(tokens) == plain.match(tokens) == {("w", 0): 5_000}
    gone = BlockRemoved(hashes[1:4_999])
    for idx in (hinted, plain):
        idx.apply_payload("w", 0, encode_batch(KVEventBatch(0.0, [gone], 0)))
    assert hinted.stats().memory_bytes == first > 20 * plain.stats().memory_bytes
    assert hinted.match(tokens) == plain.match(tokens) == {("w", 0): 1}
    store(1, 9_000)
    assert hinted.stats().memory_bytes > first
    assert hinted.match(tokens) == plain.match(tokens) == {("w", 0): 9_000}
    assert hinted.blocks("w", 0) == plain.blocks("w", 0) == set(hashes)
    # A second rank raises the nodes' table to room for both ranks' blocks.
    idx2 = PrefixIndex(BS, expected_blocks_per_rank=5_000)
    for w in ("w0", "w1"):
        ev = BlockStored(hashes[:10], None, tokens[: 10 * BS], BS)
        idx2.apply_payload(w, 0, encode_batch(KVEventBatch(0.0, [ev], 0)))
    # Both hold the same 10 keys: a pool row each (16 rows of a count and one mask word).
    assert idx2.stats().memory_bytes == 2 * 8192 * 32 + 16384 * 16 + 16 * 16
    # A presized rank table of 1 MiB comes from a 2 MiB huge-page arena chunk, counted whole
    # (not under AddressSanitizer, whose build allocates every table exactly).
    big = PrefixIndex(BS, expected_blocks_per_rank=20_000)
    big.apply_payload("w", 0, encode_batch(KVEventBatch(0.0, [BlockStored(hashes[:10], None, tokens[: 10 * BS], BS)], 0)))
    assert big.stats().memory_bytes in (32768 * 32 + 32768 * 16, (2 << 20) + 32768 * 16)
    assert big.match(tokens[: 10 * BS]) == {("w", 0): 10}
    with pytest.raises(ValueError, match="expected_blocks_per_rank"):
        PrefixIndex(BS, expected_blocks_per_rank=-1)
    with pytest.raises(ValueError, match="expected_blocks_per_rank"):
        PrefixIndex(BS, max_blocks_per_rank=None, expected_blocks_per_rank=(1 << 24) + 1)
    # Never above the per-rank bound.
    assert PrefixIndex(BS, max_blocks_per_rank=100, expected_blocks_per_rank=10**9)._core.expected_blocks_per_rank == 100


def test_tiers_show_up_after_many_ranks() -> None:
    """Per-tier masks appear after masks already span several words."""
    idx = PrefixIndex(BS)
    tokens = list(range(3 * BS))
    for i in range(130):
        idx.apply(f"w{i}", 0, KVEventBatch(0.0, [BlockStored([1, 2, 3], None, tokens, BS)]))
    idx.apply("w129", 0, KVEventBatch(0.0, [BlockStored([1, 2], None, tokens[: 2 * BS], BS,
                                                        medium="CPU")]))  # fmt: skip
    idx.apply("w3", 0, KVEventBatch(0.0, [BlockRemoved([3])]))
    tiers = idx.match_tiers(tokens)
    assert len(tiers) == 130
    assert tiers[("w0", 0)] == (3, 0, 0)
    assert tiers[("w3", 0)] == (2, 0, 0)
    assert tiers[("w129", 0)] == (3, 0, 0)  # its GPU copy still covers all three
    idx.apply("w129", 0, KVEventBatch(0.0, [BlockRemoved([1, 2, 3])]))
    assert idx.match_tiers(tokens)[("w129", 0)] == (0, 2, 0)


BAD_TOKENS = [
    b"",  # nothing
    b"\xc0",  # nil, not an array
    b"\x94\x01\x02\x03",  # fewer items than the header says
    b"\x94\x01\x02\x03\x04\x05",  # trailing bytes
    b"\x94\x01\xa1x\x03\x04",  # a string item
    b"\x94\x01\xcb" + struct.pack(">d", 1.0) + b"\x03\x04",  # a float item
    b"\x94\x01\xcd\x01",  # truncated integer
    b"\xdd\xff\xff\xff\xff\x01",  # header claims 4 G items
    b"\xdc\x00",  # truncated header
]


def test_unusable_token_bytes_are_counted_and_the_blocks_kept() -> None:
    idx = PrefixIndex(BS)
    for i, raw in enumerate(BAD_TOKENS):
        idx.apply("w", 0, KVEventBatch(0.0, [raw_store([100 + i], raw)]))
    s = idx.stats()
    assert s.malformed_stores == len(BAD_TOKENS)
    assert idx.blocks("w", 0) == {100 + i for i in range(len(BAD_TOKENS))}
    idx.apply("w", 0, KVEventBatch(0.0, [BlockRemoved([100 + i for i in range(len(BAD_TOKENS))])]))
    assert idx.stats().holders == 0


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=64), st.integers(1, 3))
def test_any_token_bytes_leave_the_index_consistent(raw: bytes, n: int) -> None:
    idx = PrefixIndex(BS)
    idx.apply("w", 0, KVEventBatch(0.0, [raw_store(list(range(n)), raw)]))
    assert idx.blocks("w", 0) == set(range(n))
    s = idx.stats()
    try:
        tokens = msgspec.msgpack.decode(raw, type=list[int])
    except msgspec.DecodeError:
        tokens = None
    if tokens is not None and len(tokens) == n * BS and all(-(2**63) <= t < 2**64 for t in tokens):
        assert s.malformed_stores == 0
        assert idx.match(tokens) == {("w", 0): n}
        assert (idx.keys(packed(tokens)) == block_keys(tokens, BS)).all()
    else:
        assert s.malformed_stores == 1


def test_token_arrays_of_every_width_and_order_key_alike() -> None:
    base = np.arange(1, 1 + 8 * BS, dtype=np.int64) * 1000 % 65_000
    want = block_keys(base, BS)
    for dt in ("<i2", "<u2", "<i4", "<u4", "<i8", "<u8", ">i4", ">u8"):
        arr = base.astype(dt)
        assert (block_keys(arr, BS) == want).all(), dt
        assert (block_keys(arr[::-1][::-1], BS) == want).all(), dt
    assert (block_keys(np.repeat(base, 2)[::2], BS) == want).all()  # strided


@settings(max_examples=60, deadline=None)
@given(st.integers(0, 2**32), st.integers(1, 40), st.integers(0, 3))
def test_match_from_tokens_agrees_with_match_from_keys(seed: int, n_blocks: int, salt: int) -> None:
    """Keys computed chunk by chunk during the walk equal the precomputed ones."""
    rnd = random.Random(seed)
    idx = PrefixIndex(BS)
    base = [rnd.randrange(50) for _ in range(n_blocks * BS)]
    for w in range(70):  # past one mask word
        cut = rnd.randrange(n_blocks + 1)
        if cut:
            toks = base[: cut * BS]
            idx.apply(f"w{w}", 0, KVEventBatch(0.0, [BlockStored(
                [hash((w, i)) & 0xFFFF for i in range(cut)], None, toks, BS, medium="GPU" if w % 3 else "CPU",
            )], 0))  # fmt: skip
    prompt = base[: rnd.randrange(n_blocks * BS + BS)] + [rnd.randrange(50) for _ in range(salt)]
    keys = idx.keys(prompt)
    for form in (prompt, tuple(prompt), np.array(prompt, dtype=np.int32), packed(prompt)):
        assert idx.match(form) == idx.match_keys(keys)
        assert idx.match_tiers(form) == idx.match_keys_tiers(keys)


def test_match_reads_a_list_only_as_far_as_it_matches() -> None:
    idx = PrefixIndex(BS)
    idx.apply("w", 0, KVEventBatch(0.0, [BlockStored([1, 2], None, list(range(2 * BS)), BS)], 0))
    tail: list[object] = ["not a token"] * (40 * BS)
    # Keys go a chunk of 16 blocks at a time: the walk ends in the first.
    assert idx.match([*range(2 * BS), *[99] * (14 * BS), *tail]) == {("w", 0): 2}
    with pytest.raises(TypeError):
        idx.match(["x", *range(2 * BS)])
    with pytest.raises(ValueError):
        idx.match([2**64, *range(2 * BS)])
    assert idx.match([2**64 - 1] * BS) == {}


def test_match_raises_for_a_bad_item_only_where_the_walk_reaches() -> None:
    """The next chunk's items are read ahead of the walk; their errors wait for it."""
    idx = PrefixIndex(BS)
    toks = list(range(40 * BS))
    idx.apply("w", 0, KVEventBatch(0.0, [BlockStored(list(range(1, 41)), None, toks, BS)], 0))
    for bad_block in (16, 17, 31, 32, 39):
        prompt: list[object] = list(toks)
        prompt[bad_block * BS + 1] = "x"
        with pytest.raises(TypeError):
            idx.match(prompt)
        # The same bad item past where the prompt stops matching: never raised.
        prompt[(bad_block - 16) * BS] = -1
        held = bad_block - 16
        assert idx.match(prompt) == ({("w", 0): held} if held else {})


def test_a_store_count_stops_at_65535_and_tiers_count_apart() -> None:
    # An entry counts up to 65,535 stores a tier (2 bytes each); more stores of
    # one hash without a removal leave it there, so 65,535 removals take it out.
    idx = PrefixIndex(BS)
    tokens = list(range(BS))
    gpu = BlockStored([7], None, tokens, BS)
    idx.apply("w", 0, KVEventBatch(0.0, [gpu] * 65_540, 0))
    idx.apply("w", 0, KVEventBatch(0.0, [BlockStored([7], None, tokens, BS, medium="CPU")] * 2, 0))
    idx.apply("w", 0, KVEventBatch(0.0, [BlockRemoved([7] * 65_534)], 0))
    assert idx.match(tokens) == {("w", 0): 1}
    assert idx.match_tiers(tokens)[("w", 0)] == (1, 0, 0)
    idx.apply("w", 0, KVEventBatch(0.0, [BlockRemoved([7])], 0))
    assert idx.match_tiers(tokens)[("w", 0)] == (0, 1, 0)
    assert idx.stats().unknown_removals == 0
    last = [BlockRemoved([7]), BlockRemoved([7] * 3, medium="CPU")]
    idx.apply("w", 0, KVEventBatch(0.0, last, 0))
    assert idx.match(tokens) == {}
    assert idx.stats().unknown_removals == 2
    assert idx.stats().holders == 0


class _Id(int):
    pass


def _int_forms(rnd: random.Random, n: int) -> list[object]:
    """Token ids in every form a list can hold them: small exact ints (the fast
    read), ints of two or more digits, negatives, past 2**63, and int subclasses."""
    import enum

    class Tok(enum.IntEnum):
        A = 7

    forms = [
        lambda: rnd.randrange(50_000), lambda: 0, lambda: 2**30 - 1, lambda: 2**30,
        lambda: rnd.randrange(2**30, 2**62), lambda: -rnd.randrange(1, 2**40), lambda: -(2**63),
        lambda: 2**64 - 1 - rnd.randrange(2**20), lambda: True, lambda: Tok.A,
        lambda: _Id(rnd.randrange(50_000)),
    ]  # fmt: skip
    # Mostly small ints, so that whole blocks of them take the fast read too.
    return [rnd.choice(forms)() if rnd.random() < 0.3 else rnd.randrange(50_000) for _ in range(n)]


@pytest.mark.parametrize("bs", [1, 3, 4, 5, 16])
def test_list_items_of_every_int_form_key_as_their_values(bs: int) -> None:
    """match(list) reads exact small ints off the objects, a block at a time, and
    anything else the general way: both give the keys of the values mod 2**64."""
    rnd = random.Random(bs)
    for trial in range(20):
        n = rnd.randrange(1, 40)
        toks = _int_forms(rnd, n * bs) if trial else [rnd.randrange(50_000) for _ in range(n * bs)]
        values = [int(t) % 2**64 for t in toks]  # type: ignore[call-overload]
        idx = PrefixIndex(bs)
        stored = BlockStored(list(range(1, n + 1)), None, values, bs)
        idx.apply("w", 0, KVEventBatch(0.0, [stored], 0))
        tail = [rnd.randrange(50_000) for _ in range(rnd.randrange(bs))]  # a partial last block
        assert idx.match([*toks, *tail]) == {("w", 0): n}
        assert idx.match((*toks, *tail)) == {("w", 0): n}
        keys = block_keys(np.array(values, dtype=np.uint64), bs)
        assert (idx.keys(toks) == keys).all()


@pytest.mark.parametrize("bad", ["x", 1.0, None, 2**64, -(2**63) - 1, 2**100])
def test_a_bad_list_item_raises_at_every_place_in_a_block(bad: object) -> None:
    err = TypeError if not isinstance(bad, int) else ValueError
    for bs in (1, 3, 16):
        toks = list(range(8 * bs))
        idx = PrefixIndex(bs)
        idx.apply("w", 0, KVEventBatch(0.0, [BlockStored(list(range(1, 9)), None, toks, bs)], 0))
        for at in range(3 * bs):
            prompt: list[object] = list(toks)
            prompt[at] = bad
            with pytest.raises(err):
                idx.match(prompt)
        # In the partial last block: never read.
        assert idx.match([*toks, *[bad] * (bs - 1)]) == {("w", 0): 8}


def test_keys_of_a_list_raise_for_its_first_bad_item() -> None:
    idx = PrefixIndex(BS)
    for first, then, err in ((2**64, "x", ValueError), ("x", 2**64, TypeError), (-(2**64), 1.5, ValueError)):
        toks: list[object] = list(range(4 * BS))
        toks[3], toks[10] = first, then
        with pytest.raises(err):
            idx.keys(toks)
        with pytest.raises(err):
            idx.keys(tuple(toks))
