"""Routing decisions: cost, tiers, rank states, ties and sampling."""

from __future__ import annotations

import enum
import random
from collections import Counter

import pytest

from kvwire.prefix_index import KvRouter, Load, PrefixIndex
from kvwire.subscriber import RankState
from kvwire.wire import BlockStored, KVEventBatch

BS = 4
PROMPT = list(range(100, 100 + 10 * BS))  # 10 blocks


def store(index: PrefixIndex, worker: str, blocks: int, *, medium: str = "GPU", rank: int = 0,
          first: int = 0) -> None:  # fmt: skip
    hashes = [1000 * (ord(worker[-1]) + rank) + i for i in range(first, blocks)]
    parent = None if first == 0 else 1000 * (ord(worker[-1]) + rank) + first - 1
    ev = BlockStored(
        block_hashes=hashes,
        parent_block_hash=parent,
        token_ids=PROMPT[first * BS : blocks * BS],
        block_size=BS,
        medium=medium,
    )
    index.apply(worker, rank, KVEventBatch(0.0, [ev]))


class State(enum.Enum):
    SYNCING = "syncing"
    SYNCED = "synced"
    PARTIAL = "partial"


@pytest.fixture()
def index() -> PrefixIndex:
    idx = PrefixIndex(BS)
    store(idx, "wa", 8)
    store(idx, "wb", 2)
    return idx


def test_cache_wins_when_loads_are_equal(index: PrefixIndex) -> None:
    d = KvRouter(index).choose(PROMPT, {("wa", 0): Load(), ("wb", 0): Load()})
    assert d.target == ("wa", 0)
    assert d.costs == {("wa", 0): 2.0, ("wb", 0): 8.0}
    assert d.cached_blocks == {("wa", 0): 8, ("wb", 0): 2}
    assert d.prompt_blocks == 10
    assert "wa/0" in d.reason and "cached 8 blocks" in d.reason and "next wb/0" in d.reason


def test_load_outweighs_a_small_cache_advantage(index: PrefixIndex) -> None:
    loads = {("wa", 0): Load(prefill_tokens=20 * BS, decode_blocks=5), ("wb", 0): Load()}
    d = KvRouter(index).choose(PROMPT, loads)
    assert d.target == ("wb", 0)
    assert d.costs[("wa", 0)] == pytest.approx(20 + 2 + 5)
    # Weights change the balance: prefill counted at 0.1 makes the queue cheap.
    d = KvRouter(index, prefill_weight=0.1).choose(PROMPT, loads)
    assert d.costs[("wa", 0)] == pytest.approx(0.1 * 22 + 5)
    assert d.target == ("wb", 0)
    d = KvRouter(index, prefill_weight=10).choose(
        PROMPT, {("wa", 0): Load(0, 20), ("wb", 0): Load()}
    )
    assert d.target == ("wa", 0)


def test_ties_go_to_the_least_loaded() -> None:
    idx = PrefixIndex(BS)
    # Same cost (one has more cache but more decode load): less loaded wins.
    store(idx, "wa", 4)
    cands = {("wa", 0): Load(0, 4), ("wb", 0): Load(0, 0), ("wc", 0): (0, 0)}
    d = KvRouter(idx).choose(PROMPT, cands)
    assert d.costs[("wa", 0)] == d.costs[("wb", 0)] == 10
    assert d.target == ("wb", 0)  # wb and wc tie on load too: by name
    assert "tie" in d.reason


def test_tiers_weigh_cached_blocks() -> None:
    idx = PrefixIndex(BS)
    store(idx, "wa", 4, medium="GPU")
    store(idx, "wa", 8, medium="CPU", first=4)
    store(idx, "wb", 8, medium="DISK")
    d = KvRouter(idx).choose(PROMPT, {("wa", 0): Load(), ("wb", 0): Load()})
    ca, cb = d.candidates[("wa", 0)], d.candidates[("wb", 0)]
    assert (ca.cached.gpu, ca.cached.cpu, ca.cached.storage) == (4, 4, 0)
    assert (cb.cached.gpu, cb.cached.cpu, cb.cached.storage) == (0, 0, 8)
    assert ca.credit == pytest.approx(4 + 0.75 * 4)
    assert cb.credit == pytest.approx(0.5 * 8)
    assert d.target == ("wa", 0)
    d = KvRouter(idx, tier_weights=(1.0, 0.1, 1.0)).choose(
        PROMPT, {("wa", 0): Load(), ("wb", 0): Load()}
    )
    assert d.target == ("wb", 0)


class Follower:
    """A stand-in for the Subscriber: rank states by (worker, rank)."""

    def __init__(self, states: dict[tuple[str, int], RankState]) -> None:
        self.states = states

    def rank_state(self, worker_id: str, rank: int) -> RankState | None:
        return self.states.get((worker_id, rank))


def test_partial_and_eventless_ranks_route_on_load(index: PrefixIndex) -> None:
    states = {("wa", 0): RankState.PARTIAL, ("wb", 0): RankState.SYNCED}
    cands = {("wa", 0): Load(), ("wb", 0): Load(0, 3), ("wz", 0): Load(0, 1)}
    d = KvRouter(index, rank_states=Follower(states)).choose(PROMPT, cands)
    assert not d.candidates[("wa", 0)].cache_used
    assert d.candidates[("wa", 0)].cost == 10
    assert d.candidates[("wb", 0)].cost == 8 + 3
    assert d.candidates[("wz", 0)].note == "no events"
    assert d.target == ("wa", 0)
    assert "PARTIAL" in d.reason and "no events" in d.reason
    # A callable works too; only the SYNCED member counts, not a look-alike.
    d = KvRouter(index, rank_states=lambda w, r: RankState.SYNCED).choose(PROMPT, cands)
    assert d.target == ("wa", 0) and d.candidates[("wa", 0)].cache_used
    d = KvRouter(index, rank_states=lambda w, r: State.SYNCED).choose(PROMPT, cands)  # type: ignore[arg-type, return-value]
    assert not any(c.cache_used for c in d.candidates.values())
    d = KvRouter(index, rank_states=lambda w, r: RankState.SYNCING).choose(PROMPT, cands)
    assert d.candidates[("wa", 0)].note == "SYNCING"
    d = KvRouter(index, rank_states=lambda w, r: None).choose(PROMPT, cands)
    assert all(not c.cache_used for c in d.candidates.values())
    assert d.target == ("wa", 0)


def test_positive_temperature_samples_by_cost(index: PrefixIndex) -> None:
    cands = {("wa", 0): Load(), ("wb", 0): Load(), ("wc", 0): Load(0, 4)}
    router = KvRouter(index, temperature=0.5, rng=random.Random(7))
    first = router.choose(PROMPT, cands)
    probs = first.probabilities
    assert probs is not None and sum(probs.values()) == pytest.approx(1)
    # Normalised costs: wa 0, wb 6/12, wc 12/12 -> weights e^0, e^-1, e^-2.
    assert probs[("wa", 0)] > probs[("wb", 0)] > probs[("wc", 0)]
    assert probs[("wb", 0)] / probs[("wa", 0)] == pytest.approx(2.718281828**-1)
    counts = Counter(router.choose(PROMPT, cands).target for _ in range(3000))
    for k, p in probs.items():
        assert counts[k] / 3000 == pytest.approx(p, abs=0.04)
    # Seeded: the same draws again.
    r1 = KvRouter(index, temperature=1, seed=5)
    r2 = KvRouter(index, temperature=1, seed=5)
    assert [r1.choose(PROMPT, cands).target for _ in range(50)] == [
        r2.choose(PROMPT, cands).target for _ in range(50)
    ]
    assert "sampled at temperature" in first.reason


def test_no_candidates_or_bad_temperature_is_an_error(index: PrefixIndex) -> None:
    with pytest.raises(ValueError):
        KvRouter(index).choose(PROMPT, {})
    with pytest.raises(ValueError):
        KvRouter(index, temperature=-1)
