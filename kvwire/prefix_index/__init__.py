"""Which worker holds the longest prefix of a prompt, and where to route it.

- :class:`PrefixIndex`: the subscriber's sink; matches prompts against the
  blocks each (worker, rank) reported.
- :func:`block_keys`: the chained block keys the index uses, for routers that
  compute them once per prompt.
- :class:`KvRouter`: the routing decision from cache overlap and load; it reads
  rank states from the ``Subscriber`` (any :class:`RankStateSource`).
"""

from kvwire.prefix_index.index import (
    CPU,
    GPU,
    STORAGE,
    IndexStats,
    Matches,
    PrefixIndex,
    RankKey,
    TierDepths,
    tier_of,
)
from kvwire.prefix_index.keys import as_token_array, block_keys
from kvwire.prefix_index.router import (
    Candidate,
    Decision,
    KvRouter,
    Load,
    RankStates,
    RankStateSource,
)

__all__ = [
    "CPU",
    "GPU",
    "STORAGE",
    "Candidate",
    "Decision",
    "IndexStats",
    "KvRouter",
    "Load",
    "Matches",
    "PrefixIndex",
    "RankKey",
    "RankStateSource",
    "RankStates",
    "TierDepths",
    "as_token_array",
    "block_keys",
    "tier_of",
]
