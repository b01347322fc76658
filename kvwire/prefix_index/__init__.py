"""Which worker holds the longest prefix of a prompt, and where to route it.

- :class:`PrefixIndex`: the subscriber's sink; matches prompts against the
  blocks each (worker, rank) reported.
- :func:`block_keys`: the chained block keys the index uses, for routers that
  compute them once per prompt.
- :class:`KvRouter`: the routing decision from cache overlap and load; it reads
  rank states from the ``Subscriber`` (any :class:`RankStateSource`).
"""

from kvwire.prefix_index import index, router
from kvwire.prefix_index.index import *  # noqa: F403
from kvwire.prefix_index.keys import as_token_array, block_keys
from kvwire.prefix_index.router import *  # noqa: F403

__all__ = [*index.__all__, "as_token_array", "block_keys", *router.__all__]
