"""Per-rank endpoint arithmetic and the configurations we refuse."""

from __future__ import annotations

import re

import pytest

from kvwire.wire import (
    EndpointError,
    is_ephemeral,
    local_endpoint,
    offset_endpoint,
    validate_endpoint,
    validate_endpoints,
)


@pytest.mark.parametrize(
    ("endpoint", "rank", "expected"),
    [
        ("tcp://127.0.0.1:5557", 0, "tcp://127.0.0.1:5557"),
        ("tcp://127.0.0.1:5557", 3, "tcp://127.0.0.1:5560"),
        ("tcp://*:5557", 1, "tcp://*:5558"),
        ("tcp://[::1]:6000", 2, "tcp://[::1]:6002"),
        ("ipc:///tmp/kv", 0, "ipc:///tmp/kv"),
        ("ipc:///tmp/kv", 2, "ipc:///tmp/kv_dp2"),
        ("inproc://events", 1, "inproc://events_dp1"),
    ],
)
def test_offset_endpoint(endpoint: str, rank: int, expected: str) -> None:
    assert offset_endpoint(endpoint, rank) == expected


@pytest.mark.parametrize(
    ("endpoint", "ranks", "fragment"),
    [
        ("", 1, "is empty"),
        ("udp://1.2.3.4:5", 1, "unknown scheme"),
        ("127.0.0.1:5557", 1, "unknown scheme"),
        ("tcp://", 1, "no address"),
        ("tcp://127.0.0.1", 1, "needs host:port"),
        ("tcp://127.0.0.1:", 1, "needs host:port"),
        ("tcp://127.0.0.1:http", 1, "non-numeric port"),
        ("tcp://127.0.0.1:0", 1, "outside 1..65535"),
        ("tcp://127.0.0.1:65536", 1, "outside 1..65535"),
        ("tcp://127.0.0.1:65535", 2, "beyond 65535"),
        ("tcp://127.0.0.1:5557", 0, "ranks must be >= 1"),
    ],
)
def test_invalid_endpoints_are_named(endpoint: str, ranks: int, fragment: str) -> None:
    with pytest.raises(EndpointError, match=fragment) as info:
        validate_endpoint(endpoint, ranks)
    if endpoint:
        assert endpoint in str(info.value)


def test_rank_beyond_port_range() -> None:
    with pytest.raises(EndpointError, match="beyond 65535"):
        offset_endpoint("tcp://h:65535", 1)
    with pytest.raises(EndpointError, match="rank must be >= 0"):
        offset_endpoint("tcp://h:1", -1)


def test_identical_publish_and_replay_rejected() -> None:
    with pytest.raises(EndpointError, match=re.escape("both 'tcp://127.0.0.1:5557'")):
        validate_endpoints("tcp://127.0.0.1:5557", "tcp://127.0.0.1:5557")


@pytest.mark.parametrize(
    ("pub", "replay", "ranks"),
    [
        ("tcp://127.0.0.1:5557", "tcp://127.0.0.1:5558", 2),
        ("tcp://*:5557", "tcp://127.0.0.1:5559", 4),
        ("tcp://127.0.0.1:5560", "tcp://0.0.0.0:5557", 4),
        ("ipc:///tmp/kv", "ipc:///tmp/kv_dp1", 2),
    ],
)
def test_overlapping_spans_rejected(pub: str, replay: str, ranks: int) -> None:
    with pytest.raises(EndpointError, match="overlap") as info:
        validate_endpoints(pub, replay, ranks_per_host=ranks)
    assert pub in str(info.value) and replay in str(info.value)


@pytest.mark.parametrize(
    ("pub", "replay", "ranks"),
    [
        ("tcp://127.0.0.1:5557", "tcp://127.0.0.1:5559", 2),
        ("tcp://127.0.0.1:5557", "tcp://127.0.0.2:5558", 4),  # different hosts
        ("tcp://127.0.0.1:5557", None, 8),
        ("ipc:///tmp/kv", "ipc:///tmp/kv-replay", 4),
    ],
)
def test_disjoint_spans_accepted(pub: str, replay: str | None, ranks: int) -> None:
    validate_endpoints(pub, replay, ranks_per_host=ranks)


@pytest.mark.parametrize("rank", [0, 1, 7, 1000])
def test_ephemeral_port_stays_ephemeral_for_every_rank(rank: int) -> None:
    assert offset_endpoint("tcp://127.0.0.1:*", rank) == "tcp://127.0.0.1:*"
    assert offset_endpoint("tcp://*:*", rank) == "tcp://*:*"


def test_ephemeral_publish_and_replay_do_not_clash() -> None:
    validate_endpoints("tcp://127.0.0.1:*", "tcp://127.0.0.1:*", ranks_per_host=64)
    validate_endpoints("tcp://127.0.0.1:*", "tcp://127.0.0.1:5557", ranks_per_host=4)
    assert is_ephemeral("tcp://127.0.0.1:*")
    assert not is_ephemeral("tcp://127.0.0.1:5557")
    assert not is_ephemeral("ipc:///tmp/kv*")


@pytest.mark.parametrize(
    ("bound", "local"),
    [
        ("tcp://0.0.0.0:41000", "tcp://127.0.0.1:41000"),
        ("tcp://*:41000", "tcp://127.0.0.1:41000"),
        ("tcp://[::]:41000", "tcp://[::1]:41000"),
        ("tcp://10.0.0.5:41000", "tcp://10.0.0.5:41000"),
        ("ipc:///tmp/kv", "ipc:///tmp/kv"),
    ],
)
def test_local_endpoint(bound: str, local: str) -> None:
    assert local_endpoint(bound) == local
