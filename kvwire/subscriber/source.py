"""Where an engine publishes: its endpoints, ranks and topic."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from kvwire.security import ClientKeys
from kvwire.wire import EndpointError, offset_endpoint, validate_endpoints

__all__ = ["EngineSource", "RankEndpoints"]

_WILDCARD_HOSTS = ("*", "0.0.0.0", "[::]", "::")


@dataclass(frozen=True)
class RankEndpoints:
    """The sockets of one rank: where to subscribe and where to ask for replays."""

    rank: int
    endpoint: str
    replay_endpoint: str | None


@dataclass(frozen=True)
class EngineSource:
    """One engine to follow: every data-parallel rank it publishes.

    ``endpoint`` and ``replay_endpoint`` are the engine's *base* endpoints, as
    in its KV-events configuration; rank ``r`` is at ``offset_endpoint(base,
    r)`` (tcp port + r, ipc ``_dp{r}``). ``topic`` is the subscription prefix
    (the engine's topic; SGLang's epoch suffix still matches). Without a
    replay endpoint every gap is an unrecoverable loss. Ranks that bound
    unrelated ports (ephemeral ones) are given one by one with
    :meth:`from_rank_endpoints`.

    ``keys``: when the engine's sockets are CURVE servers, the server's public
    key and this subscriber's key pair (:class:`kvwire.security.ClientKeys`);
    the SUB and replay sockets of every rank use them.
    """

    worker_id: str
    endpoint: str
    replay_endpoint: str | None = None
    ranks: int = 1
    topic: str = ""
    per_rank: tuple[RankEndpoints, ...] = ()
    """Explicit endpoints of every rank, in rank order; empty: offsets of the bases."""
    keys: ClientKeys | None = None

    @classmethod
    def from_rank_endpoints(
        cls,
        worker_id: str,
        ranks: Sequence[tuple[str, str | None]],
        topic: str = "",
        keys: ClientKeys | None = None,
    ) -> EngineSource:
        """An engine whose rank ``r`` publishes on ``ranks[r]`` = (endpoint, replay endpoint)."""
        per_rank = tuple(RankEndpoints(r, ep, replay) for r, (ep, replay) in enumerate(ranks))
        if not per_rank:
            raise ValueError("an engine needs at least one rank")
        first = per_rank[0]
        return cls(
            worker_id, first.endpoint, first.replay_endpoint, len(per_rank), topic, per_rank, keys
        )

    def __post_init__(self) -> None:
        if self.keys is not None and not isinstance(self.keys, ClientKeys):
            raise TypeError(f"keys must be kvwire.security.ClientKeys, got {self.keys!r}")
        if not isinstance(self.worker_id, str) or not self.worker_id:
            raise ValueError(f"worker_id must be a non-empty string, got {self.worker_id!r}")
        if not isinstance(self.ranks, int) or self.ranks < 1:
            raise ValueError(f"ranks must be an int >= 1, got {self.ranks!r}")
        if self.per_rank and len(self.per_rank) != self.ranks:
            raise ValueError(f"{len(self.per_rank)} rank endpoints for {self.ranks} ranks")
        for rank in self.per_rank or (RankEndpoints(0, self.endpoint, self.replay_endpoint),):
            if (rank.replay_endpoint is None) != (self.replay_endpoint is None):
                raise ValueError("either every rank has a replay endpoint or none has")
            validate_endpoints(
                rank.endpoint, rank.replay_endpoint, 1 if self.per_rank else self.ranks
            )
            for ep in (rank.endpoint, rank.replay_endpoint):
                if ep is None or not ep.startswith("tcp://"):
                    continue
                host, _, port = ep[len("tcp://") :].rpartition(":")
                if host in _WILDCARD_HOSTS or port == "*":
                    raise EndpointError(
                        f"endpoint {ep!r} is a bind address: connect to the engine's host instead"
                    )

    def rank_endpoints(self) -> list[RankEndpoints]:
        """The endpoints of every rank, in rank order."""
        if self.per_rank:
            return list(self.per_rank)
        return [
            RankEndpoints(
                rank,
                offset_endpoint(self.endpoint, rank),
                None
                if self.replay_endpoint is None
                else offset_endpoint(self.replay_endpoint, rank),
            )
            for rank in range(self.ranks)
        ]
