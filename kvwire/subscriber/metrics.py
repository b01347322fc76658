"""Prometheus exposition of a subscriber's per-rank state and counters.

Needs the ``metrics`` extra (prometheus-client), imported only when used::

    from kvwire.subscriber.metrics import register_metrics
    register_metrics(subscriber)          # into prometheus_client's default registry

Every counter of :class:`~kvwire.subscriber.RankCounters` becomes
``kvwire_subscriber_<name>_total{worker, rank}``; the state is the gauge
``kvwire_subscriber_rank_state{worker, rank, state}`` (1 for the current
state, 0 for the others), plus ``kvwire_subscriber_expected_seq``,
``kvwire_subscriber_held_batches``, ``kvwire_subscriber_connected`` and
``kvwire_subscriber_replay_pending``. Values are read from
:meth:`Subscriber.status` at scrape time.

Recovery progress, for a readiness check or a dashboard of a (re)starting
router (from :meth:`Subscriber.progress`, where the subscriber has it):
``kvwire_subscriber_ranks{state}``, the ranks in each state (ranks not yet
contacted count as syncing; the states sum to every rank followed), and
``kvwire_subscriber_recoveries{kind}``, the ranks with a start or gap replay
(``kind="replay"``) or a snapshot (``kind="snapshot"``) still to come; and, of a
restore at start (:meth:`Subscriber.restore_progress`: a checkpoint or a peer's
clone), ``kvwire_subscriber_restore_bytes{kind="received"|"expected"}`` (expected
is 0 for a clone: its total is not known before its end),
``kvwire_subscriber_restore_ranks`` (ranks imported) and
``kvwire_subscriber_restore_done``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

from kvwire.subscriber.checkpoint import RestoreProgress
from kvwire.subscriber.readiness import SyncProgress
from kvwire.subscriber.state import RankCounters, RankState, RankStatus

__all__ = ["SubscriberCollector", "register_metrics"]

_PREFIX = "kvwire_subscriber"

_COUNTER_HELP = {
    "batches": "Batches applied to the sink",
    "replayed": "Batches applied from a replay",
    "events": "Events in the batches applied",
    "gaps": "Holes found in a rank's stream",
    "seqs_lost": "Sequence numbers given up on",
    "seq_jumps": "Live seqs that broke the stream without a restart",
    "replays_requested": "Replay requests sent",
    "replays_succeeded": "Replays that filled what they were asked for",
    "replays_failed": "Replays given up on after their retries",
    "replay_timeouts": "Replay requests that timed out",
    "probes": "Replays asked while idle",
    "snapshots_requested": "Snapshot requests sent",
    "snapshots_applied": "Snapshots applied",
    "snapshots_failed": "Snapshots refused, incomplete or too slow",
    "stale": "Times the rank went stale",
    "resyncs": "Unrecoverable losses after which the rank went on",
    "restarts": "Publisher restarts detected",
    "reconnects": "Reconnections to the publisher",
    "silent_reconnects": "Fresh connections asked for after a heartbeating publisher went silent",
    "decode_errors": "Frames that could not be parsed or decoded",
    "rank_mismatches": "Batches whose envelope names another rank",
    "duplicates": "Live copies of batches already replayed",
    "late": "Live batches that arrived after being given up on",
    "old_life": "Live messages of a publisher life left behind, dropped",
    "stale_replies": "Replay frames of abandoned requests",
    "held_overflows": "Times the held-batch buffer overflowed",
    "sink_errors": "Times the sink raised",
    "internal_errors": "Unexpected exceptions inside the stream",
}


_GAUGES: tuple[tuple[str, str, Callable[[RankStatus], float]], ...] = (
    ("expected_seq", "The next sequence number a rank expects", lambda st: st.expected_seq),
    ("held_batches", "Later batches held while a gap is repaired", lambda st: st.held),
    ("connected", "1 while the rank's SUB socket is connected", lambda st: st.connected),
    (
        "replay_pending",
        "1 while a replay or snapshot of the rank is out or due",
        lambda st: st.replay_pending,
    ),
)
"""The per-rank gauges besides the state: name, help, and the value of a rank's status."""


def _prometheus() -> Any:
    try:
        import prometheus_client.core as core
    except ImportError as exc:  # pragma: no cover - depends on the environment
        raise ImportError(
            "Prometheus metrics need prometheus-client: pip install 'kvwire[metrics]'"
        ) from exc
    return core


class SubscriberCollector:
    """A prometheus-client collector reading ``status()`` at each scrape.

    ``status`` is any callable returning :class:`RankStatus` values, usually
    ``subscriber.status``; ``progress``, one returning a :class:`SyncProgress`
    (``subscriber.progress``) for the recovery gauges, which are left out without it.
    """

    def __init__(
        self,
        status: Callable[[], list[RankStatus]],
        progress: Callable[[], SyncProgress] | None = None,
        restore: Callable[[], RestoreProgress] | None = None,
    ) -> None:
        self._status = status
        self._progress = progress
        self._restore = restore
        self._core = _prometheus()

    def describe(self) -> list[Any]:
        return []  # collected lazily: the set of ranks changes at run time

    def _gauge(self, name: str, text: str, labels: list[str] | None = None) -> Any:
        return self._core.GaugeMetricFamily(f"{_PREFIX}_{name}", text, labels=labels)

    def collect(self) -> Iterator[Any]:
        labels = ["worker", "rank"]
        counters = {
            name: self._core.CounterMetricFamily(f"{_PREFIX}_{name}", help_text, labels=labels)
            for name, help_text in _COUNTER_HELP.items()
        }
        state = self._gauge(
            "rank_state",
            "1 for the rank's current state (syncing, synced, partial), else 0",
            [*labels, "state"],
        )
        gauges = [(self._gauge(name, text, labels), value) for name, text, value in _GAUGES]
        for st in self._status():
            key = [st.worker_id, str(st.rank)]
            for name, family in counters.items():
                family.add_metric(key, float(getattr(st.counters, name)))
            for s in RankState:
                state.add_metric([*key, s.value], 1.0 if st.state is s else 0.0)
            for family, value in gauges:
                family.add_metric(key, float(value(st)))
        yield from counters.values()
        yield state
        yield from (family for family, _ in gauges)
        if self._progress is not None:
            yield from self._recovery(self._progress())
        if self._restore is not None:
            yield from self._restoring(self._restore())

    def _restoring(self, progress: RestoreProgress) -> Iterator[Any]:
        nbytes = self._gauge(
            "restore_bytes",
            "Bytes of the checkpoint or clone read at start, and expected (0: unknown)",
            ["kind"],
        )
        nbytes.add_metric(["received"], float(progress.bytes_received))
        nbytes.add_metric(["expected"], float(progress.bytes_expected))
        ranks = self._gauge("restore_ranks", "Ranks imported from the checkpoint or clone at start")
        ranks.add_metric([], float(progress.ranks_imported))
        done = self._gauge(
            "restore_done", "1 once the start-up restore is over (or none was asked)"
        )
        done.add_metric([], 1.0 if progress.done or not progress.source else 0.0)
        yield from (nbytes, ranks, done)

    def _recovery(self, progress: SyncProgress) -> Iterator[Any]:
        ranks = self._gauge(
            "ranks", "Ranks in each state (those not yet contacted count as syncing)", ["state"]
        )
        for s in RankState:
            ranks.add_metric([s.value], float(getattr(progress, s.value)))
        recoveries = self._gauge(
            "recoveries", "Ranks with a start or gap replay, or a snapshot, still to come", ["kind"]
        )
        recoveries.add_metric(["replay"], float(progress.replaying))
        recoveries.add_metric(["snapshot"], float(progress.snapshotting))
        yield from (ranks, recoveries)


def register_metrics(subscriber: Any, registry: Any = None) -> SubscriberCollector:
    """Register a collector for ``subscriber`` (anything with ``status()``; with
    ``progress()`` too, the recovery gauges)."""
    collector = SubscriberCollector(
        subscriber.status,
        getattr(subscriber, "progress", None),
        getattr(subscriber, "restore_progress", None),
    )
    if registry is None:
        import prometheus_client

        registry = prometheus_client.REGISTRY
    registry.register(collector)
    return collector


if not {s.value for s in RankState} <= set(SyncProgress.__struct_fields__):  # pragma: no cover
    raise RuntimeError("SyncProgress needs a count for every RankState")
if set(_COUNTER_HELP) != set(RankCounters.__struct_fields__):  # pragma: no cover
    raise RuntimeError("every RankCounters field needs help text in kvwire.subscriber.metrics")
