"""Prometheus exposition of subscriber status."""

from __future__ import annotations

import prometheus_client
from prometheus_client.parser import text_string_to_metric_families

from kvwire.publisher import EventPublisher
from kvwire.subscriber import BlockSetSink, RankCounters, Subscriber
from kvwire.subscriber.metrics import register_metrics
from tests.subscriber.helpers import (
    EPHEMERAL,
    FAST,
    Engine,
    bound_source,
    settled,
)
from tests.waiting import wait_for


def test_metrics_follow_prometheus_conventions_and_report_every_rank() -> None:
    registry = prometheus_client.CollectorRegistry()
    with (
        EventPublisher(EPHEMERAL, EPHEMERAL, rank=0) as p0,
        EventPublisher(EPHEMERAL, EPHEMERAL, rank=1) as p1,
    ):
        Engine(seed=50).publish(p0, 4)
        source = bound_source("w", [p0, p1])
        with Subscriber([source], BlockSetSink(), config=FAST) as sub:
            register_metrics(sub, registry)
            wait_for(lambda: settled(sub.status(), "w", 0, 4), 10, "batches")
            text = prometheus_client.generate_latest(registry).decode()
    families = {f.name: f for f in text_string_to_metric_families(text)}
    for field in RankCounters.__struct_fields__:
        family = families[f"kvwire_subscriber_{field}"]
        assert family.type == "counter"
        assert {s.name for s in family.samples} >= {f"kvwire_subscriber_{field}_total"}
    batches = {
        (s.labels["worker"], s.labels["rank"]): s.value
        for s in families["kvwire_subscriber_batches"].samples
        if s.name.endswith("_total")
    }
    assert batches == {("w", "0"): 4.0, ("w", "1"): 0.0}
    state = {
        (s.labels["rank"], s.labels["state"]): s.value
        for s in families["kvwire_subscriber_rank_state"].samples
    }
    assert state[("0", "synced")] == 1.0 and state[("0", "partial")] == 0.0
    assert sum(v for (rank, _), v in state.items() if rank == "1") == 1.0
    expected = {
        s.labels["rank"]: s.value for s in families["kvwire_subscriber_expected_seq"].samples
    }
    assert expected["0"] == 4.0
    assert families["kvwire_subscriber_connected"].type == "gauge"
