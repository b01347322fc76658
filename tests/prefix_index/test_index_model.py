"""Property tests: the index answers exactly like the brute-force model."""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvwire.prefix_index import Matches, PrefixIndex
from kvwire.wire import AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch
from tests.budget import examples

from .model import MASK, Ident, ModelIndex

BS = 2
WORKERS = ["w0", "w1", "w2"]
LORAS = [None, None, None, "a", "b"]
SALTS = [None, None, None, None, "salt-1"]
MEDIA = [None, "GPU", "GPU", "GPU", "CPU", "CPU_PINNED", "STORAGE", "DISK"]
GROUPS = [None, 0, 0, 0, 1]
BLOCKS = [(a, b) for a in range(2) for b in range(2)]

worker = st.sampled_from([0, 0, 1, 1, 2])
rank = st.integers(0, 1)

store_op = st.tuples(
    st.just("store"),
    worker,
    rank,
    st.integers(0, 24),  # parent: 0 root, 1..19 a held hash, 20+ an unknown one
    st.lists(st.integers(0, len(BLOCKS) - 1), min_size=1, max_size=4),
    st.integers(0, len(LORAS) - 1),
    st.integers(0, len(MEDIA) - 1),
    st.integers(0, 5),  # hash mode: 0-3 content hash, 4 small ints, 5 another content hash
    st.integers(0, 6),  # extra keys: 0-3 none, 4 on some blocks, 5 bad tokens, 6 too few
    st.integers(0, len(GROUPS) - 1),
    st.integers(0, len(SALTS) - 1),
)
remove_op = st.tuples(
    st.just("remove"),
    worker,
    rank,
    st.lists(st.integers(0, 40), min_size=1, max_size=5),
    st.integers(0, len(MEDIA) - 1),
    st.integers(0, len(GROUPS) - 1),
)
restore_op = st.tuples(
    st.just("restore"),
    worker,
    rank,
    st.integers(0, 40),  # which held hash
    st.integers(0, len(MEDIA) - 1),
    st.booleans(),  # True: the same content under a new engine hash
    st.booleans(),  # True: send it to another rank
)
other_op = st.tuples(
    st.sampled_from(["cleared", "sink_clear", "remove_worker", "none", "none", "none"]), worker, rank
)
ops = st.lists(
    st.one_of(store_op, store_op, store_op, restore_op, restore_op, remove_op, remove_op, other_op),
    min_size=6,
    max_size=50,
)


def content_hash(*parts: Any) -> int:
    return int.from_bytes(hashlib.blake2b(repr(parts).encode(), digest_size=8).digest(), "big")


def ident_prompt(ident: Ident) -> tuple[list[int], list[Any], Ident] | None:
    """(tokens, extra keys, root) of an attached identity, None for a detached one."""
    blocks: list[tuple[int, ...]] = []
    extras: list[Any] = []
    while ident and isinstance(ident[0], tuple):
        ident, toks, extra = ident
        blocks.append(toks)
        extras.append(extra)
    if ident[0] != "root" or any(len(b) != BS for b in blocks):
        return None
    blocks.reverse()
    extras.reverse()
    return [t for b in blocks for t in b], extras, ident


class Driver:
    def __init__(self, expected_blocks_per_rank: int = 0) -> None:
        self.index = PrefixIndex(BS, seed=7, expected_blocks_per_rank=expected_blocks_per_rank)
        self.model = ModelIndex(BS)
        self.probes: list[tuple[list[int], str | None, list[Any] | None, Any]] = []
        self.extra_values: dict[bytes | None, Any] = {None: None}
        self.origin: dict[int, tuple[Any, ...]] = {}

    def send(self, w: str, r: int, events: list[Any]) -> None:
        batch = KVEventBatch(0.0, events, r)
        self.index.apply(w, r, batch)
        self.model.apply(w, r, batch)

    def run(self, op: tuple[Any, ...]) -> None:
        kind = op[0]
        w = WORKERS[op[1]]
        r = op[2]
        held = sorted(self.model.blocks(w, r))
        if kind == "store":
            _, _, _, pchoice, blocks, lora_i, media_i, hmode, emode, group_i, salt_i = op
            if pchoice == 0 or (pchoice < 20 and not held):
                parent = None
            elif pchoice < 20:
                parent = held[(pchoice - 1) % len(held)]
            else:
                parent = 10_000 + pchoice
            tokens = [t for b in blocks for t in BLOCKS[b]]
            extra: list[Any] | None = None
            if emode == 4:
                extra = [None if i % 2 else ("mm", b, i) for i, b in enumerate(blocks)]
                for e in extra:
                    if e is not None:
                        self.extra_values[_enc(e)] = e
            if emode == 5:
                tokens = tokens[:-1]
            if emode == 6:
                extra = [None] * (len(blocks) - 1)
            lora = LORAS[lora_i]
            salt = SALTS[salt_i]
            hashes = []
            prev = parent if parent is not None else (lora, salt)
            for i, b in enumerate(blocks):
                if hmode == 4:
                    h = (content_hash(b, i) % 12) if (b + i) % 3 else i
                elif hmode == 5:
                    h = content_hash("other", prev, b)
                else:
                    h = content_hash(prev, b, None if extra is None or emode == 6 else extra[i])
                hashes.append(h)
                self.origin[h] = (
                    prev if i else parent,
                    list(BLOCKS[b]),
                    None if extra is None or emode == 6 else [extra[i]],
                    lora,
                    salt,
                )
                prev = h
            ev = BlockStored(
                block_hashes=hashes,
                parent_block_hash=parent,
                token_ids=tokens,
                block_size=BS,
                medium=MEDIA[media_i],
                lora_name=lora,
                extra_keys=extra,
                group_idx=GROUPS[group_i],
                cache_salt=salt,
            )
            self.send(w, r, [ev])
            if parent is None and emode < 5:
                self.probes.append((tokens, lora, extra, salt))
        elif kind == "restore":
            _, _, _, pick, media_i, new_hash, elsewhere = op
            if not held:
                # Re-store into a rank that holds something.
                names = sorted(k for k, v in self.model.ranks.items() if v)
                if not names:
                    return
                w, r = names[pick % len(names)]
                held = sorted(self.model.blocks(w, r))
            h = held[pick % len(held)]
            if h not in self.origin:
                return
            parent, toks, extra, lora, salt = self.origin[h]
            if new_hash:
                h = content_hash("copy", h)
                self.origin[h] = self.origin[held[pick % len(held)]]
            ev = BlockStored(
                block_hashes=[h],
                parent_block_hash=parent,
                token_ids=toks,
                block_size=BS,
                medium=MEDIA[media_i],
                lora_name=lora,
                extra_keys=extra,
                cache_salt=salt,
            )
            self.send(WORKERS[(WORKERS.index(w) + 1) % 2] if elsewhere else w, r, [ev])
        elif kind == "remove":
            _, _, _, picks, media_i, group_i = op
            hashes = [held[p % len(held)] if held and p < 35 else 20_000 + p for p in picks]
            ev = BlockRemoved(block_hashes=hashes, medium=MEDIA[media_i], group_idx=GROUPS[group_i])
            self.send(w, r, [ev])
        elif kind == "cleared":
            self.send(w, r, [AllBlocksCleared()])
        elif kind == "sink_clear":
            self.index.clear(w, r)
            self.model.clear(w, r)
        elif kind == "remove_worker":
            self.index.remove_worker(w)
            self.model.remove_worker(w)

    def all_probes(self) -> list[tuple[list[int], str | None, list[Any] | None, Any]]:
        out = list(self.probes)
        for entries in self.model.ranks.values():
            for e in entries.values():
                got = ident_prompt(e.ident)
                if got is None:
                    continue
                tokens, extras, root = got
                ex = None if all(x is None for x in extras) else [
                    self.extra_values[x] for x in extras
                ]
                salt = None if root[2] is None else "salt-1"
                out.append((tokens, root[1], ex, salt))
        out.append(([0, 0, 1, 1, 2, 2, 0], None, None, None))
        return out

    def check(self) -> None:
        for tokens, lora, extra, salt in self.all_probes():
            for toks in (tokens, [*tokens, 9]):
                kw = {"lora_name": lora, "extra_keys": extra, "cache_salt": salt}
                assert self.index.match_tiers(toks, **kw) == self.model.match_tiers(toks, **kw)
                assert self.index.match(toks, **kw) == self.model.match(toks, **kw)
                check_lazy(self.index.match_tiers(toks, **kw), self.model.match_tiers(toks, **kw))
                check_lazy(self.index.match(toks, **kw), self.model.match(toks, **kw))
        for name in self.model.ranks:
            assert self.index.blocks(*name) == self.model.blocks(*name), name
        s = self.index.stats()
        assert s.holders == self.model.holders()
        assert s.blocks == self.model.distinct_blocks()
        assert s.detached == self.model.detached()
        assert s.orphan_stores == self.model.orphan_stores
        assert s.unknown_removals == self.model.unknown_removals
        assert s.ignored_events == self.model.ignored
        assert s.malformed_stores == self.model.malformed

    def remove_everything(self) -> None:
        tier_media = ["GPU", "CPU", "STORAGE"]
        for (w, r), entries in list(self.model.ranks.items()):
            for t, medium in enumerate(tier_media):
                hashes = [h for h, e in entries.items() for _ in range(e.counts[t])]
                if hashes:
                    self.send(w, r, [BlockRemoved(block_hashes=hashes, medium=medium)])


def _total(v: Any) -> int:
    return v if isinstance(v, int) else int(v.total)


def check_lazy(got: Matches[Any, Any], want: dict[Any, Any]) -> None:
    """Every way of reading a lazy result, each on a fresh one, answers like the dict."""
    assert isinstance(got, Mapping) and len(got) == len(want)
    order = list(got)  # rank slot order
    assert sorted(order) == sorted(want)
    assert got.max_depth == max(map(_total, want.values()), default=0)
    by_depth = sorted(order, key=lambda k: -_total(want[k]))  # stable: slot order on ties
    for n in (0, 1, 2, len(want) + 1):
        assert got.best(n) == [(k, want[k]) for k in by_depth[:n]]
    for k in order:  # lookups by scan, then (past a few) by the dict
        assert k in got and got[k] == want[k] and got.get(k) == want[k]
    absent = ("absent", 0)
    assert absent not in got and got.get(absent) is None and got.get(absent, 7) == 7
    with pytest.raises(KeyError):
        got[absent]
    assert dict(got.items()) == want and list(got.keys()) == order
    assert sorted(map(_total, got.values())) == sorted(map(_total, want.values()))
    assert got == want and want == got and (got != want) is False and repr(got) == repr(dict(got.items()))


def _enc(e: Any) -> bytes:
    import msgspec

    return msgspec.msgpack.encode(e)


@settings(max_examples=examples(250), deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ops, st.sampled_from([1, 4, 1000]), st.sampled_from([0, 0, 2, 40]))
def test_index_matches_model(op_list: list[tuple[Any, ...]], check_every: int, hint: int) -> None:
    """Same answers as the model after every operation, every few, or only at the end;
    with presized tables (a capacity hint under or over what the ranks hold) too."""
    d = Driver(hint)
    for i, op in enumerate(op_list):
        d.run(op)
        if i % check_every == check_every - 1:
            d.check()
    d.remove_everything()
    d.check()
    s = d.index.stats()
    assert (s.blocks, s.holders, s.detached) == (0, 0, 0)
    if not hint:
        assert s.memory_bytes == 0
    for tokens, lora, extra, salt in d.all_probes():
        assert d.index.match(tokens, lora_name=lora, extra_keys=extra, cache_salt=salt) == {}


def test_masks_cover_many_ranks() -> None:
    """More than 64 ranks: holder masks span several words; answers stay exact."""
    d = Driver()
    tokens = [1, 2, 3, 4, 5, 6]
    for i in range(150):
        w = f"w{i}"
        n = 1 + i % 3
        ev = BlockStored(
            block_hashes=[content_hash(j) for j in range(n)],
            parent_block_hash=None,
            token_ids=tokens[: n * BS],
            block_size=BS,
        )
        batch = KVEventBatch(0.0, [ev])
        d.index.apply(w, 0, batch)
        d.model.apply(w, 0, batch)
    got = d.index.match(tokens)
    assert got == d.model.match(tokens)
    assert sorted(set(got.values())) == [1, 2, 3]
    check_lazy(d.index.match(tokens), d.model.match(tokens))
    check_lazy(d.index.match_tiers(tokens), d.model.match_tiers(tokens))
    for i in range(0, 150, 2):
        d.index.remove_worker(f"w{i}")
        d.model.remove_worker(f"w{i}")
    assert d.index.match(tokens) == d.model.match(tokens)
    assert len(d.index.match(tokens)) == 75
    assert MASK == (1 << 64) - 1


@settings(max_examples=examples(30), deadline=None)
@given(st.integers(0, 2**32), st.sampled_from([40, 70, 140]))
def test_long_prompts_over_many_ranks_match_the_model(seed: int, ranks: int) -> None:
    """Prompts of many 8-block groups held to random depths by up to 140 ranks (one
    mask word and several), some on CPU: every walk answers like the model."""
    import random

    rng = random.Random(seed)
    d = Driver()
    prompts = [[rng.randrange(50) for _ in range(40 * BS)] for _ in range(4)]
    for i in range(ranks):
        tokens = prompts[rng.randrange(len(prompts))]
        n = rng.randint(1, 40)
        ev = BlockStored(
            block_hashes=[content_hash(tuple(tokens[: (j + 1) * BS])) for j in range(n)],
            parent_block_hash=None,
            token_ids=tokens[: n * BS],
            block_size=BS,
            medium=rng.choice([None, None, None, "CPU"]),
        )
        batch = KVEventBatch(0.0, [ev])
        d.index.apply(f"w{i}", 0, batch)
        d.model.apply(f"w{i}", 0, batch)
    for tokens in prompts:
        assert d.index.match(tokens) == d.model.match(tokens)
        assert d.index.match_tiers(tokens) == d.model.match_tiers(tokens)
        check_lazy(d.index.match(tokens), d.model.match(tokens))
