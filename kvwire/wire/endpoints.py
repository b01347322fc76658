"""Endpoint arithmetic and validation for per-rank sockets.

Each data-parallel rank publishes on its own socket: ``base_port + rank`` for
tcp, a ``_dp{rank}`` suffix for ipc/inproc, rank 0 unchanged. The replay
endpoint is offset the same way. A tcp port of ``*`` (bind only) asks the
system for an ephemeral port, for every rank alike; the bound socket reports
which one it got.
"""

from __future__ import annotations

__all__ = [
    "EndpointError",
    "is_ephemeral",
    "local_endpoint",
    "offset_endpoint",
    "validate_endpoint",
    "validate_endpoints",
]

_SCHEMES = ("tcp", "ipc", "inproc")
_WILDCARD_HOSTS = {"*", "0.0.0.0", "[::]", "::"}


class EndpointError(ValueError):
    """An endpoint that cannot be bound or connected as configured."""


def _split(endpoint: str) -> tuple[str, str]:
    if not isinstance(endpoint, str) or not endpoint:
        raise EndpointError(f"endpoint {endpoint!r} is empty")
    scheme, sep, rest = endpoint.partition("://")
    if not sep or scheme not in _SCHEMES:
        raise EndpointError(
            f"endpoint {endpoint!r} has an unknown scheme: expected one of "
            + ", ".join(f"{s}://" for s in _SCHEMES)
        )
    if not rest:
        raise EndpointError(f"endpoint {endpoint!r} has no address after the scheme")
    return scheme, rest


def is_ephemeral(endpoint: str) -> bool:
    """Whether ``endpoint`` is a tcp bind address with port ``*`` (any free port)."""
    return endpoint.startswith("tcp://") and endpoint.endswith(":*")


def local_endpoint(endpoint: str) -> str:
    """Where a process on this host connects to a socket bound at ``endpoint``.

    A wildcard host (``0.0.0.0``, ``*``, ``::``) becomes loopback; anything else is returned as is.
    """
    for wildcard, loopback in (
        ("tcp://0.0.0.0:", "tcp://127.0.0.1:"),
        ("tcp://*:", "tcp://127.0.0.1:"),
        ("tcp://[::]:", "tcp://[::1]:"),
        ("tcp://:::", "tcp://[::1]:"),
    ):
        if endpoint.startswith(wildcard):
            return loopback + endpoint[len(wildcard) :]
    return endpoint


def _tcp_host_port(endpoint: str, rest: str) -> tuple[str, int]:
    """Host and port of a tcp endpoint; port 0 stands for ``*``."""
    host, sep, port_s = rest.rpartition(":")
    if not sep or not host or not port_s:
        raise EndpointError(f"tcp endpoint {endpoint!r} needs host:port")
    if port_s == "*":
        return host, 0
    if not port_s.isdigit():
        raise EndpointError(f"tcp endpoint {endpoint!r} has a non-numeric port {port_s!r}")
    port = int(port_s)
    if not 1 <= port <= 65535:
        raise EndpointError(f"tcp endpoint {endpoint!r} has port {port} outside 1..65535")
    return host, port


def validate_endpoint(endpoint: str, ranks: int = 1) -> None:
    """Check that ``endpoint`` and its ``ranks`` offsets are all usable."""
    if ranks < 1:
        raise EndpointError(f"ranks must be >= 1 for endpoint {endpoint!r}, got {ranks}")
    scheme, rest = _split(endpoint)
    if scheme == "tcp":
        _, port = _tcp_host_port(endpoint, rest)
        if port and port + ranks - 1 > 65535:
            raise EndpointError(
                f"tcp endpoint {endpoint!r} with {ranks} ranks needs ports up to "
                f"{port + ranks - 1}, beyond 65535"
            )


def offset_endpoint(endpoint: str, rank: int) -> str:
    """The endpoint of ``rank``: tcp port + rank, ipc/inproc ``_dp{rank}`` suffix.

    A ``*`` port stays ``*``: every rank binds its own ephemeral port.
    """
    if rank < 0:
        raise EndpointError(f"rank must be >= 0, got {rank} for endpoint {endpoint!r}")
    validate_endpoint(endpoint, rank + 1)
    if rank == 0 or is_ephemeral(endpoint):
        return endpoint
    scheme, rest = _split(endpoint)
    if scheme == "tcp":
        host, port = _tcp_host_port(endpoint, rest)
        return f"tcp://{host}:{port + rank}"
    return f"{endpoint}_dp{rank}"


def _addresses(endpoint: str, ranks: int) -> set[tuple[str, str]]:
    """(host-or-kind, port-or-path) of every rank, wildcards folded to one host."""
    out: set[tuple[str, str]] = set()
    for rank in range(ranks):
        scheme, rest = _split(offset_endpoint(endpoint, rank))
        if scheme == "tcp":
            _, port = _tcp_host_port(endpoint, rest)
            out.add(("tcp", str(port)))
        else:
            out.add((scheme, rest))
    return out


def _hosts_may_clash(a: str, b: str) -> bool:
    sa, ra = _split(a)
    sb, rb = _split(b)
    if sa != "tcp" or sb != "tcp":
        return True
    if is_ephemeral(a) or is_ephemeral(b):
        return False  # the system hands out distinct ports
    ha, _ = _tcp_host_port(a, ra)
    hb, _ = _tcp_host_port(b, rb)
    return ha == hb or ha in _WILDCARD_HOSTS or hb in _WILDCARD_HOSTS


def validate_endpoints(
    endpoint: str, replay_endpoint: str | None = None, ranks_per_host: int = 1
) -> None:
    """Validate a publish endpoint and optional replay endpoint for a host's ranks.

    Rejects identical endpoints and publish/replay spans that overlap once
    offset for ``ranks_per_host`` ranks (publish and replay base ports must be
    at least that far apart).
    """
    validate_endpoint(endpoint, ranks_per_host)
    if replay_endpoint is None:
        return
    validate_endpoint(replay_endpoint, ranks_per_host)
    if replay_endpoint == endpoint and not is_ephemeral(endpoint):
        raise EndpointError(f"publish and replay endpoints are both {endpoint!r}")
    if not _hosts_may_clash(endpoint, replay_endpoint):
        return
    clash = _addresses(endpoint, ranks_per_host) & _addresses(replay_endpoint, ranks_per_host)
    if clash:
        raise EndpointError(
            f"publish endpoint {endpoint!r} and replay endpoint {replay_endpoint!r} "
            f"overlap for {ranks_per_host} ranks per host (shared: "
            + ", ".join(sorted(v for _, v in clash))
            + "); their base ports must be at least ranks_per_host apart"
        )
