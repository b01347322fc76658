"""When a kvwire publisher heartbeats, and how long a healthy one can be silent.

A heartbeat is an empty batch on the next seq (``docs/wire.md`` section 5).
Its timing is one rule, shared by the publisher (which sends by it) and the
subscriber (whose silence thresholds follow from its worst case):

    Heartbeats fall on the wall-clock grid of a step (the instants ``k * step``
    of ``time.time()``, the same in every process of a host and, with NTP, of a
    fleet). At each grid instant a publisher sends one if nothing went on the
    wire in the last half step. The step is the interval ``I`` while idle, and
    ``I / 2`` when the last thing sent was a batch.

So a fleet's idle ranks heartbeat together, and a router reads hundreds of
them per wake-up (its thread and libzmq's I/O thread alike) instead of one
wake-up per rank. The first heartbeat after a batch comes twice as soon as
the idle ones: it is the one that shows a dropped last batch, while the idle
ones after it only say the publisher is alive, so idling costs a fleet's
router one heartbeat per rank per interval and a trailing drop still shows
within ``TRAILING_GAP`` (0.75) intervals.

Worst case: the last message went out at ``s``; the next grid instant at or
after ``s + step/2`` is before ``s + 1.5 step``. A healthy publisher's live
stream is therefore never silent for ``MAX_SILENCE`` (1.5) intervals or more,
sender latency aside. A wall-clock step moves the grid, never the bound: the
rule is evaluated against the monotonic time of the last send, and only its
phase is read from the wall clock.
"""

from __future__ import annotations

import math

__all__ = [
    "AFTER_BATCH_STEP",
    "DEFAULT_INTERVAL_S",
    "HEARTBEAT_QUIET",
    "MAX_SILENCE",
    "TRAILING_GAP",
    "heartbeat_at",
]

DEFAULT_INTERVAL_S = 2.0
"""kvwire publishers' heartbeat interval unless told otherwise (a trailing drop shows within 1.5 s)."""

HEARTBEAT_QUIET = 0.5
"""At a grid instant, a heartbeat is sent if nothing was sent for this many steps."""

AFTER_BATCH_STEP = 0.5
"""The grid step after a batch, in intervals (the idle step is one interval)."""

MAX_SILENCE = 1.0 + HEARTBEAT_QUIET
"""A healthy heartbeating publisher is silent for less than this many intervals."""

TRAILING_GAP = AFTER_BATCH_STEP * MAX_SILENCE
"""A batch dropped after the last send shows as a gap within this many intervals."""


def heartbeat_at(
    last_sent: float, interval: float, now: float, wall: float, after_batch: bool = False
) -> float:
    """The monotonic time the next heartbeat is due, if nothing else is sent meanwhile.

    ``last_sent`` and ``now`` are monotonic (``time.monotonic()``), ``wall`` is
    ``time.time()`` read at ``now``; ``after_batch``: the last send was a batch,
    not a heartbeat. With ``step`` the interval (half of it after a batch): the
    first grid instant (a multiple of ``step`` in wall-clock time) at or after
    ``last_sent + step / 2``. Due when ``now`` has reached it; the sender then
    sends and the next one is an interval later. Always in
    ``[last_sent + step/2, last_sent + 1.5 step]``.
    """
    step = interval * AFTER_BATCH_STEP if after_batch else interval
    earliest = last_sent + HEARTBEAT_QUIET * step
    earliest_wall = wall + (earliest - now)
    grid = math.ceil(earliest_wall / step) * step
    return earliest + min(step, max(0.0, grid - earliest_wall))
