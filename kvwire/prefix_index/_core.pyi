"""Types of the native tables and key chain (``_core.c``)."""

from collections.abc import Iterator, Mapping, Sequence
from typing import Any, TypeVar, overload

_K = TypeVar("_K")
_V = TypeVar("_V")
_T = TypeVar("_T")

ORPHAN: int
MALFORMED: int
OVER_CAP: int
OVER_BUDGET: int
CAP_BLOCKS: int
CAP_BYTES: int
VIEW_VERSION: int

class KeyChain:
    """The chained block key function of one (seed, block size)."""

    def __init__(
        self, weights: Sequence[int], q: int, pos_k: int, detached_k: int, malformed_k: int
    ) -> None: ...
    @property
    def block_size(self) -> int: ...
    def keys_into(
        self, tokens: Any, packed: bool, start: int, position: int, extra: Any, out: Any
    ) -> int: ...

class Matches(Mapping[_K, _V]):
    """A match's holders and their matched blocks: a read-only mapping, built as read.

    Made only by a match. Equal to the dict of the same items; ``len``,
    ``in``, iteration (over the holders, rank slot order), ``best`` and
    ``max_depth`` build no values, a lookup builds one, and ``keys``,
    ``values``, ``items``, equality and ``repr`` (that of the dict) build (and keep) the dict.
    """

    def __getitem__(self, key: _K) -> _V: ...
    def __iter__(self) -> Iterator[_K]: ...
    def __len__(self) -> int: ...
    @overload
    def get(self, key: _K, /) -> _V | None: ...
    @overload
    def get(self, key: _K, default: _V | _T, /) -> _V | _T: ...
    def best(self, n: int = 1, /) -> list[tuple[_K, _V]]:
        """The ``n`` deepest holders with their depths, deepest first (ties: rank slot order)."""
    @property
    def max_depth(self) -> int:
        """The deepest holder's matched blocks in any tier (0 when none)."""

class Index:
    """Holder tables of the prefix index."""

    def __init__(
        self, max_entries: int = 0, *, expected_blocks_per_rank: int = 0, max_bytes: int = 0
    ) -> None: ...
    @property
    def max_entries(self) -> int: ...
    @property
    def expected_blocks_per_rank(self) -> int: ...
    @property
    def nodes(self) -> int: ...
    @property
    def pooled(self) -> int: ...
    @property
    def memory(self) -> int: ...
    @property
    def memory_summed(self) -> int: ...
    @property
    def max_bytes(self) -> int: ...
    def ensure_rank(self, sid: int) -> None: ...
    def store(
        self,
        sid: int,
        chain: KeyChain,
        hashes: Sequence[int],
        parent: int | None,
        tokens: Any,
        packed: bool,
        start: int,
        extra: Any,
        tier: int,
    ) -> int: ...
    def remove(self, sid: int, hashes: Sequence[int], tier: int) -> int: ...
    def clear_rank(self, sid: int) -> None: ...
    def forget_rank(self, sid: int) -> None: ...
    def reserve(self, sid: int, blocks: int) -> bool: ...
    def export_rank(self, sid: int | None) -> bytes: ...
    def import_ranks(self, sids: Sequence[int], views: Sequence[Any]) -> list[int]: ...
    def configure(
        self,
        chain: KeyChain,
        root: int,
        index_max_block_size: int,
        groups: frozenset[int | None] | None,
        tiers: dict[str, int],
        names: list[Any],
    ) -> None: ...
    @property
    def counters(self) -> tuple[int, int, int, int, int, int]: ...
    def apply_payload(self, sid: int, payload: Any, limits: Any) -> bool: ...
    def blocks(self, sid: int) -> list[int]: ...
    def rank_stats(self, sid: int) -> tuple[int, int, int]: ...
    def match(self, keys: Any, names: list[Any], tiers_type: Any) -> Matches[Any, Any]: ...
    def match_tokens(
        self,
        chain: KeyChain,
        tokens: Any,
        packed: bool,
        start: int,
        extra: Any,
        names: list[Any],
        tiers_type: Any,
    ) -> Matches[Any, Any]: ...
    def match_list(self, tokens: Any) -> Matches[Any, Any]: ...
