"""One rate-limited logger for every component: a problem is logged at most once per interval.

A fleet going away makes every rank fail the same way at once (1,024 ranks, 1,024 "replay
abandoned: Host unreachable"). :class:`RateLimitedLog` keys problems by *kind*, not by the rank
that saw them: the first occurrence of a kind is logged at once, later ones within the interval
are counted with the subjects that saw them, and :meth:`RateLimitedLog.flush` (called from the
owner's timer, and with ``force=True`` on close) writes one summary line per kind.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

DEFAULT_INTERVAL_S = 10.0
"""How often one kind of problem may reach the log."""

_NAMED_SUBJECTS = 4
"""Subjects named in a summary line; the rest are counted."""


class _Pending:
    __slots__ = ("count", "level", "message", "subjects")

    def __init__(self) -> None:
        self.count = 0
        self.level = logging.WARNING
        self.message = ""
        self.subjects: dict[str, None] = {}  # insertion-ordered set


class RateLimitedLog:
    """Warnings keyed by kind, each kind at most once per ``interval`` seconds.

    ``note(kind, message, subject)`` logs ``"subject: message"`` when the kind was not logged
    within the interval; otherwise it is held, and ``flush`` logs one line for all held
    occurrences of that kind: ``"message (N times since the last report, from M subjects: a, b, ...)"``.
    Not thread-safe: one owner (a loop or a thread) notes and flushes.
    """

    def __init__(
        self,
        logger: logging.Logger,
        interval: float = DEFAULT_INTERVAL_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if not interval >= 0:
            raise ValueError(f"interval must be >= 0 s, got {interval!r}")
        self._logger = logger
        self._interval = interval
        self._clock = clock
        self._last: dict[str, float] = {}
        self._pending: dict[str, _Pending] = {}

    def note(
        self,
        kind: str,
        message: str,
        subject: str | None = None,
        *,
        exc_info: Any = None,
        level: int = logging.WARNING,
    ) -> None:
        """Record one occurrence; log it now if its kind is due, else hold it for ``flush``."""
        now = self._clock()
        last = self._last.get(kind)
        if last is None or now - last >= self._interval:
            self._last[kind] = now
            pending = self._pending.pop(kind, None)
            text = message if subject is None else f"{subject}: {message}"
            if pending is not None:
                text += self._suffix(pending)
            self._logger.log(level, "%s", text, exc_info=exc_info)
            return
        pending = self._pending.get(kind)
        if pending is None:
            pending = self._pending[kind] = _Pending()
        pending.count += 1
        pending.message = message
        pending.level = level
        if subject is not None:
            pending.subjects[subject] = None

    def flush(self, force: bool = False) -> None:
        """Log one summary line for each held kind whose interval has passed (all with ``force``)."""
        if not self._pending:
            return
        now = self._clock()
        for kind in list(self._pending):
            if not force and now - self._last.get(kind, -self._interval) < self._interval:
                continue
            pending = self._pending.pop(kind)
            self._last[kind] = now
            self._logger.log(pending.level, "%s%s", pending.message, self._suffix(pending))

    @property
    def held(self) -> int:
        """Occurrences noted but not yet logged."""
        return sum(p.count for p in self._pending.values())

    @staticmethod
    def _suffix(pending: _Pending) -> str:
        times = "once" if pending.count == 1 else f"{pending.count} times"
        subjects = list(pending.subjects)
        if not subjects:
            return f" ({times} since the last report)"
        named = ", ".join(subjects[:_NAMED_SUBJECTS])
        more = len(subjects) - _NAMED_SUBJECTS
        if more > 0:
            named += f" and {more} more"
        return f" ({times} since the last report, from {len(subjects)}: {named})"
