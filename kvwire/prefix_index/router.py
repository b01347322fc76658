"""The routing decision: which (worker, rank) should serve a prompt.

Cost of sending a prompt of ``P`` full blocks to a candidate::

    prefill_weight * (queued_prefill_tokens / block_size
                      + max(P - overlap_credit * credit, 0))
    + decode_blocks

where ``credit`` is the candidate's matched prefix weighted by tier (GPU 1.0,
CPU 0.75, storage 0.5 by default: a block loaded from a slower tier saves less
prefill than one already on the GPU). A candidate whose rank is not fully
synced (PARTIAL, still SYNCING, unknown to the subscriber) or that never sent
an event gets no credit: it stays routable on its load alone.

Temperature 0 takes the cheapest candidate, ties going to the least loaded; a
positive temperature samples ``softmax(-normalised_cost / temperature)`` with
costs normalised to [0, 1], spreading load across near-equal candidates.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

from kvwire.prefix_index.index import PrefixIndex, RankKey, TierDepths
from kvwire.prefix_index.keys import token_source

__all__ = ["Candidate", "Decision", "KvRouter", "Load"]

RankStates = Callable[[str, int], object] | Mapping[RankKey, object]


class Load(NamedTuple):
    """A candidate's current load."""

    prefill_tokens: int = 0
    decode_blocks: int = 0


@dataclass(frozen=True)
class Candidate:
    """How one candidate was scored."""

    worker_id: str
    rank: int
    cost: float
    cached: TierDepths
    credit: float
    load: Load
    cache_used: bool
    note: str


@dataclass(frozen=True)
class Decision:
    """The chosen (worker, rank), every candidate's score, and why."""

    worker_id: str
    rank: int
    prompt_blocks: int
    candidates: dict[RankKey, Candidate]
    reason: str
    probabilities: dict[RankKey, float] | None = None

    @property
    def target(self) -> RankKey:
        """``(worker_id, rank)`` of the choice."""
        return (self.worker_id, self.rank)

    @property
    def costs(self) -> dict[RankKey, float]:
        """Cost per candidate."""
        return {k: c.cost for k, c in self.candidates.items()}

    @property
    def cached_blocks(self) -> dict[RankKey, int]:
        """Matched prefix blocks per candidate (0 where the cache was not used)."""
        return {k: c.cached.total for k, c in self.candidates.items()}


_NO_CACHE = TierDepths(0, 0, 0)


def _state_name(state: object) -> str | None:
    """A rank state as an upper-case name: enums, strings, anything with ``name``."""
    if state is None:
        return None
    name = getattr(state, "name", state)
    return str(name).upper()


class KvRouter:
    """Chooses where a prompt goes, from a :class:`PrefixIndex` and candidate loads.

    ``rank_states`` tells which ranks' index state is complete: a mapping or a
    callable ``(worker_id, rank) -> state`` (the subscriber's rank status);
    only SYNCED ranks get cache credit when it is given. ``rng`` (or ``seed``)
    drives sampling at positive temperature.
    """

    def __init__(
        self,
        index: PrefixIndex,
        *,
        prefill_weight: float = 1.0,
        overlap_credit: float = 1.0,
        tier_weights: tuple[float, float, float] = (1.0, 0.75, 0.5),
        temperature: float = 0.0,
        rank_states: RankStates | None = None,
        rng: random.Random | None = None,
        seed: int | None = None,
    ) -> None:
        if temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {temperature}")
        self.index = index
        self.prefill_weight = prefill_weight
        self.overlap_credit = overlap_credit
        self.tier_weights = tier_weights
        self.temperature = temperature
        self.rank_states = rank_states
        self.rng = rng if rng is not None else random.Random(seed)

    def _state(self, key: RankKey) -> str | None:
        states = self.rank_states
        if states is None:
            return "SYNCED"
        if isinstance(states, Mapping):
            return _state_name(states.get(key))
        return _state_name(states(*key))

    def choose(
        self,
        tokens: Any,
        candidates: Mapping[RankKey, Load | tuple[int, int]],
        *,
        lora_name: str | None = None,
        extra_keys: Sequence[Any] | None = None,
        cache_salt: Any = None,
        temperature: float | None = None,
    ) -> Decision:
        """Score every candidate and pick one (see the module docstring)."""
        if not candidates:
            raise ValueError("no candidates to route to")
        temp = self.temperature if temperature is None else temperature
        if temp < 0:
            raise ValueError(f"temperature must be >= 0, got {temp}")
        index = self.index
        bs = index.block_size
        src, packed, n_tokens = token_source(tokens)
        prompt_blocks = n_tokens // bs
        matched = index.match_tiers(
            tokens if packed else src, lora_name=lora_name, extra_keys=extra_keys,
            cache_salt=cache_salt,
        )  # fmt: skip
        gw, cw, sw = self.tier_weights
        scored: dict[RankKey, Candidate] = {}
        for key, raw in candidates.items():
            load = raw if isinstance(raw, Load) else Load(*raw)
            state = self._state(key)
            if not index.has_rank(*key):
                cached, used, note = _NO_CACHE, False, "no events"
            elif state != "SYNCED":
                cached, used, note = _NO_CACHE, False, state or "no rank status"
            else:
                cached, used, note = matched.get(key, _NO_CACHE), True, ""
            credit = gw * cached.gpu + cw * cached.cpu + sw * cached.storage
            new_blocks = max(prompt_blocks - self.overlap_credit * credit, 0.0)
            cost = self.prefill_weight * (load.prefill_tokens / bs + new_blocks)
            cost += load.decode_blocks
            scored[key] = Candidate(key[0], key[1], cost, cached, credit, load, used, note)
        probs: dict[RankKey, float] | None = None
        if temp == 0:
            chosen = min(scored, key=lambda k: (scored[k].cost, _load_of(scored[k], bs), k))
        else:
            probs = _softmax({k: c.cost for k, c in scored.items()}, temp)
            chosen = _sample(probs, self.rng)
        reason = self._reason(chosen, scored, prompt_blocks, temp, probs)
        return Decision(chosen[0], chosen[1], prompt_blocks, scored, reason, probs)

    def _reason(
        self,
        chosen: RankKey,
        scored: dict[RankKey, Candidate],
        prompt_blocks: int,
        temp: float,
        probs: dict[RankKey, float] | None,
    ) -> str:
        c = scored[chosen]
        bs = self.index.block_size
        parts = [
            f"{_name(chosen)}: cost {c.cost:.1f} = {self.prefill_weight:g} x "
            f"({c.load.prefill_tokens / bs:.1f} queued + max({prompt_blocks} prompt - "
            f"{self.overlap_credit:g} x {c.credit:.2f} cached credit, 0)) + "
            f"{c.load.decode_blocks} decode"
        ]
        if c.cache_used:
            t = c.cached
            parts.append(f"cached {t.total} blocks (gpu {t.gpu}, cpu {t.cpu}, storage {t.storage})")
        else:
            parts.append(f"routed on load alone ({c.note})")
        others = sorted((k for k in scored if k != chosen), key=lambda k: scored[k].cost)
        if temp == 0:
            if others:
                nxt = others[0]
                tie = " (tie, less loaded)" if scored[nxt].cost == c.cost else ""
                parts.append(
                    f"cheapest of {len(scored)}{tie}; next {_name(nxt)} at {scored[nxt].cost:.1f}"
                )
            else:
                parts.append("only candidate")
        else:
            assert probs is not None
            parts.append(
                f"sampled at temperature {temp:g} with probability {probs[chosen]:.2f} "
                f"of {len(scored)}"
            )
        ignored = [f"{_name(k)} ({s.note})" for k, s in sorted(scored.items()) if not s.cache_used]
        if ignored:
            parts.append("cache not used for " + ", ".join(ignored))
        return "; ".join(parts)


def _name(key: RankKey) -> str:
    return f"{key[0]}/{key[1]}"


def _load_of(c: Candidate, block_size: int) -> float:
    return c.load.prefill_tokens / block_size + c.load.decode_blocks


def _softmax(costs: dict[RankKey, float], temperature: float) -> dict[RankKey, float]:
    lo = min(costs.values())
    hi = max(costs.values())
    span = hi - lo
    weights = {
        k: math.exp(-((c - lo) / span if span > 0 else 0.0) / temperature)
        for k, c in costs.items()
    }
    total = sum(weights.values())
    return {k: w / total for k, w in weights.items()}


def _sample(probs: dict[RankKey, float], rng: random.Random) -> RankKey:
    x = rng.random()
    acc = 0.0
    keys = sorted(probs)
    for k in keys:
        acc += probs[k]
        if x < acc:
            return k
    return keys[-1]
