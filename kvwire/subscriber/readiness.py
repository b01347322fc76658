"""How far a subscriber has come: ranks per state, kept as they change, and waits on them.

A router should not answer "ready" (or route on its index) before it has heard
from the engines: :class:`Readiness` counts the ranks in each
:class:`~kvwire.subscriber.RankState` as the links report their changes (on the
subscriber's loop), so that asking costs nothing whatever the number of ranks,
and wakes whoever waits for a fraction of them to be SYNCED, on a
:class:`threading.Condition` for threads and a future on their own loop for
coroutines: waiting never polls. A rank of a source that has no link yet
(the subscriber has not started, or not yet opened it) counts as SYNCING.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import threading
import time

import msgspec

from kvwire.subscriber.state import RankState

__all__ = ["Readiness", "SyncProgress", "check_fraction", "ranks_needed"]


def check_fraction(fraction: float) -> float:
    """``fraction`` as a float, or a clear error when it is not in (0, 1]."""
    if isinstance(fraction, bool) or not isinstance(fraction, (int, float)):
        raise TypeError(f"fraction must be a number in (0, 1], got {fraction!r}")
    if not 0.0 < fraction <= 1.0:  # NaN fails too
        raise ValueError(f"fraction must be in (0, 1], got {fraction!r}")
    return float(fraction)


def ranks_needed(fraction: float, ranks: int) -> int:
    """SYNCED ranks needed for ``fraction`` of ``ranks``: the least whole number not below
    it, so that 0.07 of 100 is 7, not the 8 that ``0.07 * 100`` (7.000000000000001) rounds up to."""
    return math.ceil(round(fraction * ranks, 9))


class SyncProgress(msgspec.Struct, frozen=True, kw_only=True):
    """A subscriber's ranks by state, and the recoveries still to come, at one instant."""

    ranks: int
    """Every rank of every source followed (each of the counts below is part of it)."""
    synced: int
    syncing: int
    """Includes the ranks not yet contacted."""
    partial: int
    stale: int
    replaying: int
    """Ranks with a replay out or due that must end before they are in sequence
    (a start or gap replay, or its retry; idle probes are not counted)."""
    snapshotting: int
    """Ranks with a snapshot out."""

    @property
    def fraction(self) -> float:
        """The fraction of ranks SYNCED (1.0 with no ranks: none is missing)."""
        return self.synced / self.ranks if self.ranks else 1.0

    def reached(self, fraction: float) -> bool:
        """Whether at least ``fraction`` of the ranks are SYNCED."""
        return self.synced >= ranks_needed(check_fraction(fraction), self.ranks)


class Readiness:
    """Ranks per state, updated where they change, and the waiters woken when they do.

    The links report from the subscriber's loop (:meth:`moved`, :meth:`closed`);
    any thread may read and wait. Each report names the rank's state as it is
    now, so a change reported twice or out of order still counts right.
    """

    def __init__(self, ranks: int = 0) -> None:
        self._cond = threading.Condition()  # guards everything below
        self._ranks = ranks  # every rank of every source
        self._seen: dict[object, RankState] = {}  # each open rank -> its state as counted
        self._counts = dict.fromkeys(RankState, 0)  # over the open ranks
        self._futures: list[tuple[asyncio.AbstractEventLoop, asyncio.Future[None]]] = []
        self._stopped = False

    # --- reports (the subscriber) --------------------------------------------------------

    def resize(self, ranks: int) -> None:
        """The sources now have ``ranks`` ranks in all."""
        with self._cond:
            self._ranks = ranks
            self._changed()

    def moved(self, rank: object, state: RankState) -> None:
        """``rank`` is in ``state`` now."""
        with self._cond:
            old = self._seen.get(rank)
            if old is state:
                return
            if old is not None:
                self._counts[old] -= 1
            self._seen[rank] = state
            self._counts[state] += 1
            self._changed()

    def closed(self, rank: object) -> None:
        with self._cond:
            old = self._seen.pop(rank, None)
            if old is not None:
                self._counts[old] -= 1
                self._changed()

    def stopped(self) -> None:
        """The subscriber stopped: no rank will sync any more; waiters are told so."""
        with self._cond:
            self._stopped = True
            self._changed()

    def _changed(self) -> None:
        """Wake every waiter to look again (called holding the lock)."""
        self._cond.notify_all()
        futures, self._futures = self._futures, []
        for loop, future in futures:
            with contextlib.suppress(RuntimeError):  # its loop has closed: nobody waits
                loop.call_soon_threadsafe(_wake, future)

    # --- reading and waiting (any thread) --------------------------------------------------

    def counts(self) -> tuple[int, dict[RankState, int]]:
        """Every rank, and how many are in each state (ranks with no link yet: SYNCING)."""
        with self._cond:
            counts = dict(self._counts)
            counts[RankState.SYNCING] += max(0, self._ranks - len(self._seen))
            return max(self._ranks, len(self._seen)), counts

    def _reached(self, needed: float) -> bool:
        return self._counts[RankState.SYNCED] >= ranks_needed(needed, self._ranks)

    def reached(self, fraction: float) -> bool:
        """Whether at least ``fraction`` of the ranks are SYNCED now."""
        fraction = check_fraction(fraction)
        with self._cond:
            return self._reached(fraction)

    def wait(self, fraction: float, timeout: float | None) -> bool:
        """Block until ``fraction`` of the ranks are SYNCED (True), or until ``timeout``
        passes or the subscriber stops first (False)."""
        fraction = check_fraction(fraction)
        with self._cond:
            self._cond.wait_for(lambda: self._reached(fraction) or self._stopped, timeout)
            return self._reached(fraction)

    async def wait_async(self, fraction: float, timeout: float | None) -> None:
        """:meth:`wait` for a coroutine on any loop: raises :class:`TimeoutError` when
        ``timeout`` passes first, :class:`RuntimeError` when the subscriber stops first."""
        fraction = check_fraction(fraction)
        loop = asyncio.get_running_loop()
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            with self._cond:
                if self._reached(fraction):
                    return
                if self._stopped:
                    raise RuntimeError(
                        f"the subscriber stopped before {fraction:g} of its ranks were SYNCED"
                    )
                entry = (loop, loop.create_future())
                self._futures.append(entry)
            try:
                left = None if deadline is None else max(0.0, deadline - time.monotonic())
                await asyncio.wait_for(entry[1], left)
            except TimeoutError:
                raise TimeoutError(
                    f"fewer than {fraction:g} of the subscriber's ranks were SYNCED "
                    f"within {timeout} s"
                ) from None
            finally:
                with self._cond, contextlib.suppress(ValueError):
                    self._futures.remove(entry)


def _wake(future: asyncio.Future[None]) -> None:
    if not future.done():
        future.set_result(None)
