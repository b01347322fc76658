"""The routing decision: which (worker, rank) should serve a prompt.

Cost of sending a prompt of ``P`` full blocks to a candidate::

    prefill_weight * (queued_prefill_tokens / block_size
                      + max(P - overlap_credit * credit, 0))
    + decode_blocks

where ``credit`` is the candidate's matched prefix weighted by tier (GPU 1.0,
CPU 0.75, storage 0.5 by default: a block loaded from a slower tier saves less
prefill than one already on the GPU). A candidate whose rank is not fully
synced (PARTIAL, still SYNCING, unknown to the subscriber), whose view is
incomplete (over the index's per-rank block cap or its memory budget) or that
never sent an event gets no credit: it stays routable on its load alone. A rank
found over cap is logged once as it goes over (rate limited across ranks).

Temperature 0 takes the cheapest candidate, ties going to the least loaded; a
positive temperature samples ``softmax(-normalised_cost / temperature)`` with
costs normalised to [0, 1], spreading load across near-equal candidates.
"""

from __future__ import annotations

import logging
import math
import random
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple, Protocol, TypeAlias, runtime_checkable

from kvwire.prefix_index.index import PrefixIndex, RankKey, TierDepths
from kvwire.prefix_index.keys import token_source
from kvwire.ratelog import RateLimitedLog
from kvwire.subscriber.state import RankState

log = logging.getLogger("kvwire.router")

__all__ = ["Candidate", "Decision", "KvRouter", "Load", "RankStateSource", "RankStates"]


@runtime_checkable
class RankStateSource(Protocol):
    """Anything that knows each followed rank's state: a ``Subscriber``."""

    def rank_state(self, worker_id: str, rank: int) -> RankState | None:
        """The rank's current state; ``None`` when it is not followed."""
        ...


RankStates: TypeAlias = RankStateSource | Callable[[str, int], RankState | None]
"""Where a router reads rank states: a :class:`RankStateSource` or a callable."""


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


class KvRouter:
    """Chooses where a prompt goes, from a :class:`PrefixIndex` and candidate loads.

    ``rank_states`` tells which ranks' index state is exact: the
    ``Subscriber`` feeding the index (anything with ``rank_state(worker_id,
    rank)``), or a callable ``(worker_id, rank) -> RankState | None``; only
    :attr:`RankState.SYNCED` ranks get cache credit when it is given. Without
    it every rank with events counts as synced. ``rng`` (or ``seed``) drives
    sampling at positive temperature.
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
        self._state_of: Callable[[str, int], RankState | None] | None = (
            rank_states.rank_state if isinstance(rank_states, RankStateSource) else rank_states
        )
        self.rng = rng if rng is not None else random.Random(seed)
        self._log = RateLimitedLog(log)
        self._over_cap: set[RankKey] = set()  # ranks logged as over cap, until seen under

    def _no_credit(self, key: RankKey) -> str | None:
        """Why a candidate gets no cache credit; None when it does."""
        index = self.index
        if not index.has_rank(*key):
            return "no events"
        if self._state_of is not None:
            state = self._state_of(*key)
            if state is not RankState.SYNCED:
                return "no rank status" if state is None else state.name
        why = index.cap_reason(*key)
        if why is not None:
            if key not in self._over_cap:
                self._over_cap.add(key)
                self._log.note(
                    "index-over-cap",
                    f"the prefix index refused a store at its {why}: the rank's view is "
                    "incomplete, so it is routed on load alone until it is cleared",
                    _name(key),
                )
            return f"over the index's {why}"
        self._over_cap.discard(key)
        return None

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
        self._log.flush()
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
        # The match builds a holder's depths only when looked up: a candidate
        # holding nothing costs nothing, nor do holders that are not candidates.
        held = matched.max_depth > 0
        gw, cw, sw = self.tier_weights
        scored: dict[RankKey, Candidate] = {}
        for key, raw in candidates.items():
            load = raw if isinstance(raw, Load) else Load(*raw)
            why = self._no_credit(key)
            if why is None:
                cached = matched.get(key, _NO_CACHE) if held else _NO_CACHE
                used, note = True, ""
            else:
                cached, used, note = _NO_CACHE, False, why
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
            keys = sorted(probs)
            chosen = self.rng.choices(keys, [probs[k] for k in keys])[0]
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

