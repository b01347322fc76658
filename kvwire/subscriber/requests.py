"""What one rank's stream has asked its publisher, and when it may ask again.

:class:`Requests` is the request half of :class:`~kvwire.subscriber.RankStream`:
the replay or snapshot out (at most one, with its token and deadlines), whether
an abandoned one may still be answered, the retries of a failing replay and the
backoff of failing recoveries (snapshots are never abandoned, only spaced). It decides nothing about the phase.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

from kvwire.subscriber.actions import RequestReplay, RequestSnapshot
from kvwire.subscriber.state import RankState, StreamConfig
from kvwire.wire.framing import Frame

if TYPE_CHECKING:
    from kvwire.subscriber.batches import Judged
    from kvwire.subscriber.phases import Phase

__all__ = ["Replay", "Requests", "Snapshot"]


class _Request:
    """What every request out has: its token, its deadlines, the horizon when sent."""

    __slots__ = ("deadline", "hard_deadline", "horizon_at_send", "token")
    _overall = "replay_deadline"  # the StreamConfig field bounding the whole reply

    def __init__(self, token: int, now: float, config: StreamConfig, horizon: int) -> None:
        self.token = token
        self.horizon_at_send = horizon
        self.begin(now, config)

    def begin(self, now: float, config: StreamConfig) -> None:
        """Sent at ``now``: the overall deadline and the first message's run from here."""
        self.hard_deadline = now + getattr(config, self._overall)
        self.heard(now, config)

    def heard(self, now: float, config: StreamConfig) -> None:
        """A message of the reply arrived at ``now``: the next is due ``replay_timeout`` on."""
        self.deadline = min(now + config.replay_timeout, self.hard_deadline)


class Replay(_Request):
    """One outstanding replay request and what its reply showed so far."""

    __slots__ = (
        "anchor_payload",
        "anchored",
        "claim",
        "first",
        "identify",
        "kind",
        "last_seq",
        "progressed",
        "start",
        "undecodable",
        "verified",
    )

    def __init__(
        self,
        token: int,
        kind: Phase,
        start: int,
        anchor_payload: Frame | None,
        now: float,
        config: StreamConfig,
        horizon: int,
    ) -> None:
        super().__init__(token, now, config, horizon)
        self.kind = kind
        self.start = start
        self.anchored = anchor_payload is not None
        self.anchor_payload = anchor_payload
        self.first = True  # no item at or above start seen yet
        self.progressed = False  # applied at least one batch
        self.verified = False  # the anchor matched
        self.last_seq = -1  # the highest seq in the reply so far
        self.undecodable = -1  # a seq whose buffered copy does not decode
        self.claim = RankState.SYNCED  # what an exact rank reads while this probe is out
        self.identify = -1  # asking the whole buffer after an empty reply from this anchor


def _backoff(initial: float, cap: float, failures: int) -> float:
    """The wait after ``failures`` (>= 1) in a row: ``initial`` doubling, at most ``cap``."""
    return min(cap, initial * 2.0 ** min(failures - 1, 64))


class Snapshot(_Request):
    """One outstanding snapshot request and the chunks read so far."""

    __slots__ = ("blocks", "chunks", "next_seq")
    _overall = "snapshot_deadline"

    def __init__(self, token: int, now: float, config: StreamConfig, horizon: int) -> None:
        super().__init__(token, now, config, horizon)
        self.next_seq = -1
        self.chunks: list[tuple[Judged, Frame]] = []
        self.blocks: int | None = None  # the rank's block count, as chunk 0 announced it


class Requests:
    """The request out, its successors' freshness, retries and recovery backoff."""

    __slots__ = (
        "active",
        "fresh",
        "last_probe_at",
        "recoveries",
        "recovery_after",
        "resume",
        "retries",
        "retry_at",
        "token",
    )

    def __init__(self, resume: Phase) -> None:
        self.active: Replay | Snapshot | None = None
        self.fresh = False  # an abandoned request may still be answered
        self.token = 0
        self.retries = 0  # of the replay being retried
        self.retry_at = 0.0  # when BACKOFF asks again ...
        self.resume = resume  # ... and what
        # Snapshots asked since the rank was last SYNCED (or connected, or restarted):
        # one that was applied but did not end in sequence counts like a failed one.
        self.recoveries = 0
        self.recovery_after = 0.0  # no snapshot is asked before (the last one's backoff)
        self.last_probe_at = 0.0

    def replay(
        self,
        kind: Phase,
        start: int,
        anchor_payload: Frame | None,
        now: float,
        config: StreamConfig,
        horizon: int,
    ) -> tuple[Replay, RequestReplay]:
        """A replay from ``start`` (anchored: ``anchor_payload`` is the batch there)."""
        self.token += 1
        r = Replay(self.token, kind, start, anchor_payload, now, config, horizon)
        self.active = r
        fresh, self.fresh = self.fresh, False
        return r, RequestReplay(start, self.token, fresh)

    def snapshot(self, now: float, config: StreamConfig, horizon: int) -> RequestSnapshot:
        """A snapshot; it counts toward the recovery backoff until the rank is SYNCED."""
        self.token += 1
        self.active = Snapshot(self.token, now, config, horizon)
        fresh, self.fresh = self.fresh, False
        self.recoveries += 1
        return RequestSnapshot(self.token, fresh)

    def snapshot_ended(self, now: float, config: StreamConfig) -> None:
        """A snapshot failed, or was applied: the next one waits its backoff (never
        abandoned: a publisher that can serve one is asked again, less and less often)."""
        delay = _backoff(config.backoff_initial, config.snapshot_backoff_max, self.recoveries)
        self.recovery_after = now + delay

    def snapshot_allowed(self, now: float) -> bool:
        """Whether another snapshot may be asked now (its backoff has passed)."""
        return now >= self.recovery_after

    def waiting(self, token: int) -> bool:
        """Request ``token`` waits for its turn to be sent: no deadline runs meanwhile."""
        r = self.active
        if r is None or r.token != token:
            return False
        r.deadline = r.hard_deadline = math.inf
        return True

    def sent(self, token: int, now: float, config: StreamConfig) -> bool:
        """Request ``token`` was sent at ``now`` (after waiting): its deadlines start here."""
        r = self.active
        if r is None or r.token != token:
            return False
        r.begin(now, config)
        return True

    def recovered(self) -> None:
        """The rank is exact and in sequence: the recovery backoff starts over."""
        self.recoveries = 0
        self.recovery_after = 0.0

    def abandon(self) -> None:
        """Stop waiting for the request out; a later one goes on a fresh socket."""
        if self.active is not None:
            self.active = None
            self.fresh = True

    def drop(self) -> None:
        """Forget whatever was asked (a bug met an input): the next request goes fresh."""
        self.active = None
        self.fresh = True

    def answered(self) -> None:
        """The request out was answered in full: nothing more of it can come."""
        self.active = None

    def backoff(self, now: float, config: StreamConfig, resume: Phase) -> bool:
        """One more retry of a failing replay, asked at :attr:`retry_at`; False: no more."""
        self.retries += 1
        if self.retries > config.replay_retries:
            return False
        self.retry_at = now + _backoff(config.backoff_initial, config.backoff_max, self.retries)
        self.resume = resume
        return True
