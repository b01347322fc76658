"""When a kvwire publisher heartbeats, and how long a healthy one can be silent.

A heartbeat is an empty batch on the next seq. Its timing is one rule, shared
by the publisher (which sends by it) and the subscriber (whose silence
thresholds follow from its worst case): :func:`heartbeat_at` is it, and
``docs/wire.md`` section 5 says why. A fleet's idle ranks heartbeat together,
its busy ones apart. Only the wall clock's phase is read: a clock step moves
the grid, never the bound.
"""

from __future__ import annotations

import hashlib
import math

__all__ = [
    "AFTER_BATCH_STEP",
    "DEFAULT_INTERVAL_S",
    "HEARTBEAT_QUIET",
    "MAX_SILENCE",
    "TRAILING_GAP",
    "heartbeat_at",
    "heartbeat_phase",
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
    last_sent: float,
    interval: float,
    now: float,
    wall: float,
    after_batch: bool = False,
    phase: float = 0.0,
) -> float:
    """The monotonic time the next heartbeat is due, if nothing else is sent meanwhile.

    ``last_sent`` and ``now`` are monotonic (``time.monotonic()``), ``wall`` is
    ``time.time()`` read at ``now``; ``after_batch``: the last send was a batch,
    not a heartbeat; ``phase``: where this publisher's after-batch grid falls
    in its step, a fraction in ``[0, 1)`` (see :func:`heartbeat_phase`; the idle
    grid has none). With ``step`` the interval (half of it after a batch): the
    first grid instant (``(k + phase) * step`` in wall-clock time) at or after
    ``last_sent + step / 2``. Due when ``now`` has reached it; the sender then
    sends and the next one is an interval later. Always in
    ``[last_sent + step/2, last_sent + 1.5 step]``, whatever the phase.
    """
    step = interval * AFTER_BATCH_STEP if after_batch else interval
    shift = phase * step if after_batch else 0.0
    earliest = last_sent + HEARTBEAT_QUIET * step
    earliest_wall = wall + (earliest - now) - shift
    grid = math.ceil(earliest_wall / step) * step
    return earliest + min(step, max(0.0, grid - earliest_wall))


def heartbeat_phase(identity: bytes) -> float:
    """A publisher's after-batch grid phase, in ``[0, 1)``, drawn from ``identity`` (bytes
    that tell it from the fleet's other publishers: its endpoint, topic, epoch and rank).

    Deterministic and spread evenly, so that busy ranks' first heartbeats after their
    batches do not all fall on one wall-clock instant (``docs/wire.md`` section 5).
    """
    digest = hashlib.blake2b(identity, digest_size=8).digest()
    return (int.from_bytes(digest, "big") >> 11) / 2.0**53  # 53 bits: exact, below 1
