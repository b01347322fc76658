"""Where an engine publishes: its endpoints, ranks and topic."""

from __future__ import annotations

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
    replay endpoint every gap is an unrecoverable loss.

    ``keys``: when the engine's sockets are CURVE servers, the server's public
    key and this subscriber's key pair (:class:`kvwire.security.ClientKeys`);
    the SUB and replay sockets of every rank use them.
    """

    worker_id: str
    endpoint: str
    replay_endpoint: str | None = None
    ranks: int = 1
    topic: str = ""
    keys: ClientKeys | None = None

    def __post_init__(self) -> None:
        if self.keys is not None and not isinstance(self.keys, ClientKeys):
            raise TypeError(f"keys must be kvwire.security.ClientKeys, got {self.keys!r}")
        if not isinstance(self.worker_id, str) or not self.worker_id:
            raise ValueError(f"worker_id must be a non-empty string, got {self.worker_id!r}")
        if not isinstance(self.ranks, int) or self.ranks < 1:
            raise ValueError(f"ranks must be an int >= 1, got {self.ranks!r}")
        validate_endpoints(self.endpoint, self.replay_endpoint, self.ranks)
        for ep in (self.endpoint, self.replay_endpoint):
            if ep is None or not ep.startswith("tcp://"):
                continue
            host = ep[len("tcp://") :].rpartition(":")[0]
            if host in _WILDCARD_HOSTS:
                raise EndpointError(
                    f"endpoint {ep!r} is a bind address: connect to the engine's host instead"
                )

    def rank_endpoints(self) -> list[RankEndpoints]:
        """The endpoints of every rank, in rank order."""
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
