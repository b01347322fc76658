"""The heartbeat rule: aligned on the wall-clock grid, silence bounded by 1.5 intervals."""

from __future__ import annotations

import itertools
import math

from hypothesis import given, settings
from hypothesis import strategies as st

from kvwire.wire.heartbeat import HEARTBEAT_QUIET, MAX_SILENCE, heartbeat_at

intervals = st.sampled_from([0.001, 0.05, 0.25, 1.0, 3.0, 60.0])
times = st.floats(0.0, 1e6, allow_nan=False)


@given(interval=intervals, last=times, since=st.floats(0.0, 100.0), offset=times)
def test_due_on_the_grid_within_the_bounds(
    interval: float, last: float, since: float, offset: float
) -> None:
    now = last + since
    wall = now + offset  # the wall clock runs offset ahead of the monotonic one
    at = heartbeat_at(last, interval, now, wall)
    slack = 1e-9 * max(1.0, abs(last), abs(wall))
    assert last + HEARTBEAT_QUIET * interval - slack <= at <= last + MAX_SILENCE * interval + slack
    phase = math.remainder(at + offset, interval)  # distance to the nearest grid instant
    assert abs(phase) <= slack + 1e-6 * interval


@given(interval=intervals, last=times, offset=times, a=st.floats(0, 10), b=st.floats(0, 10))
def test_the_same_whenever_it_is_asked(
    interval: float, last: float, offset: float, a: float, b: float
) -> None:
    """Only the wall clock's phase matters, not when the sender wakes to ask."""
    first = heartbeat_at(last, interval, last + a, last + a + offset)
    second = heartbeat_at(last, interval, last + b, last + b + offset)
    assert math.isclose(first, second, rel_tol=0, abs_tol=1e-6 * max(1.0, interval, last))


def test_ranks_idle_since_different_times_heartbeat_together() -> None:
    """Ranks whose last sends spread over an interval meet on one grid instant."""
    interval, offset = 1.0, 1234.25  # wall = monotonic + offset: grid at monotonic k + 0.75
    lasts = [10.0 + i / 100 for i in range(100)]
    dues = {round(heartbeat_at(last, interval, last, last + offset), 9) for last in lasts}
    assert dues == {10.75, 11.75}  # sent at or before 10.25: 10.75; after: 11.75


@settings(max_examples=50)
@given(
    interval=intervals,
    offset=times,
    gaps=st.lists(st.floats(0.0, 5.0), min_size=1, max_size=40),
)
def test_a_sender_following_the_rule_is_never_silent_for_1_5_intervals(
    interval: float, offset: float, gaps: list[float]
) -> None:
    """Batches at arbitrary times, heartbeats by the rule in between: the longest silence."""
    now = last = 0.0
    sends = [0.0]
    for gap in gaps:
        batch = now + gap * interval
        while (at := heartbeat_at(last, interval, now, now + offset)) < batch:
            sends.append(at)
            now = last = at
        sends.append(batch)
        now = last = batch
    longest = max(b - a for a, b in itertools.pairwise(sends))
    assert longest <= MAX_SILENCE * interval * (1 + 1e-9) + 1e-9
