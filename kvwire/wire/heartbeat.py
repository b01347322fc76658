"""When a kvwire publisher heartbeats, and how long a healthy one can be silent.

A heartbeat is an empty batch on the next seq (``docs/wire.md`` section 5).
Its timing is one rule, shared by the publisher (which sends by it) and the
subscriber (whose silence thresholds follow from its worst case):

    Heartbeats fall on the wall-clock grid of the interval ``I`` (the instants
    ``k * I`` of ``time.time()``, the same in every process of a host and, with
    NTP, of a fleet). At each grid instant a publisher sends one if nothing
    went on the wire in the last ``I / 2``.

So a fleet's idle ranks heartbeat together, and a router reads hundreds of
them per wake-up (its thread and libzmq's I/O thread alike) instead of one
wake-up per rank. A rank publishing about once an interval heartbeats between
its batches only when they leave more than half an interval free before a
grid instant.

Worst case: the last message went out at ``s``; the next grid instant at or
after ``s + I/2`` is before ``s + 1.5 I``. A healthy publisher's live stream is
therefore never silent for ``MAX_SILENCE`` (1.5) intervals or more, sender
latency aside, and a batch dropped after the last send shows as a gap at most
1.5 intervals after that send. A wall-clock step moves the grid, never the
bound: the rule is evaluated against the monotonic time of the last send, and
only its phase is read from the wall clock.
"""

from __future__ import annotations

import math

__all__ = ["HEARTBEAT_QUIET", "MAX_SILENCE", "heartbeat_at"]

HEARTBEAT_QUIET = 0.5
"""At a grid instant, a heartbeat is sent if nothing was sent for this many intervals."""

MAX_SILENCE = 1.0 + HEARTBEAT_QUIET
"""A healthy heartbeating publisher is silent for less than this many intervals."""


def heartbeat_at(last_sent: float, interval: float, now: float, wall: float) -> float:
    """The monotonic time the next heartbeat is due, if nothing else is sent meanwhile.

    ``last_sent`` and ``now`` are monotonic (``time.monotonic()``), ``wall`` is
    ``time.time()`` read at ``now``: the first grid instant (a multiple of
    ``interval`` in wall-clock time) at or after ``last_sent + interval / 2``.
    Due when ``now`` has reached it; the sender then sends and the next one is
    a grid instant later. Always in ``[last_sent + I/2, last_sent + 1.5 I]``.
    """
    earliest = last_sent + HEARTBEAT_QUIET * interval
    earliest_wall = wall + (earliest - now)
    grid = math.ceil(earliest_wall / interval) * interval
    return earliest + min(interval, max(0.0, grid - earliest_wall))
