"""The heartbeat rule: aligned on the wall-clock grid, silence bounded by 1.5 intervals,
a trailing drop shown within 0.75 of one."""

from __future__ import annotations

import itertools
import math

from hypothesis import given, settings
from hypothesis import strategies as st

from kvwire.wire.heartbeat import (
    AFTER_BATCH_STEP,
    HEARTBEAT_QUIET,
    MAX_SILENCE,
    TRAILING_GAP,
    heartbeat_at,
    heartbeat_phase,
)

intervals = st.sampled_from([0.001, 0.05, 0.25, 1.0, 3.0, 60.0])
times = st.floats(0.0, 1e6, allow_nan=False)
phases = st.one_of(st.sampled_from([0.0, 0.5, 1 - 2**-53]), st.floats(0.0, 1.0, exclude_max=True))


@given(
    interval=intervals, last=times, since=st.floats(0.0, 100.0), offset=times,
    after_batch=st.booleans(),
)  # fmt: skip
def test_due_on_the_grid_within_the_bounds(
    interval: float, last: float, since: float, offset: float, after_batch: bool
) -> None:
    now = last + since
    wall = now + offset  # the wall clock runs offset ahead of the monotonic one
    at = heartbeat_at(last, interval, now, wall, after_batch)
    step = interval * (AFTER_BATCH_STEP if after_batch else 1.0)
    slack = 1e-9 * max(1.0, abs(last), abs(wall))
    assert last + HEARTBEAT_QUIET * step - slack <= at <= last + MAX_SILENCE * step + slack
    phase = math.remainder(at + offset, step)  # distance to the nearest grid instant
    assert abs(phase) <= slack + 1e-6 * step


@given(
    interval=intervals, last=times, offset=times, a=st.floats(0, 10), b=st.floats(0, 10),
    after_batch=st.booleans(),
)  # fmt: skip
def test_the_same_whenever_it_is_asked(
    interval: float, last: float, offset: float, a: float, b: float, after_batch: bool
) -> None:
    """Only the wall clock's phase matters, not when the sender wakes to ask."""
    first = heartbeat_at(last, interval, last + a, last + a + offset, after_batch)
    second = heartbeat_at(last, interval, last + b, last + b + offset, after_batch)
    assert math.isclose(first, second, rel_tol=0, abs_tol=1e-6 * max(1.0, interval, last))


def test_ranks_idle_since_different_times_heartbeat_together() -> None:
    """Ranks whose last sends spread over an interval meet on one grid instant."""
    interval, offset = 1.0, 1234.25  # wall = monotonic + offset: grid at monotonic k + 0.75
    lasts = [10.0 + i / 100 for i in range(100)]
    dues = {round(heartbeat_at(last, interval, last, last + offset), 9) for last in lasts}
    assert dues == {10.75, 11.75}  # sent at or before 10.25: 10.75; after: 11.75
    # After a batch, on the half-interval grid, which holds the idle one.
    dues = {round(heartbeat_at(last, interval, last, last + offset, True), 9) for last in lasts}
    # Half-interval grid at monotonic 10.25, 10.75, 11.25: sent at 10.0 -> 10.25, in
    # (10.0, 10.5] -> 10.75, after -> 11.25.
    assert dues == {10.25, 10.75, 11.25}


def assert_bounds_hold(interval: float, offset: float, gaps: list[float], phase: float) -> None:
    """A sender by the rule between batches at ``gaps`` (in intervals): silences and
    trailing drops stay within MAX_SILENCE and TRAILING_GAP."""
    now = last = 0.0
    after_batch = False
    sends = [0.0]
    trailing = []  # from each batch to the next send
    for gap in gaps:
        batch = now + gap * interval
        while (at := heartbeat_at(last, interval, now, now + offset, after_batch, phase)) < batch:
            if after_batch:
                trailing.append(at - last)
            sends.append(at)
            now = last = at
            after_batch = False
        if after_batch:
            trailing.append(batch - last)
        sends.append(batch)
        now = last = batch
        after_batch = True
    longest = max(b - a for a, b in itertools.pairwise(sends))
    assert longest <= MAX_SILENCE * interval * (1 + 1e-9) + 1e-9
    assert all(t <= TRAILING_GAP * interval * (1 + 1e-9) + 1e-9 for t in trailing)


@settings(max_examples=50)
@given(
    interval=intervals,
    offset=times,
    gaps=st.lists(st.floats(0.0, 5.0), min_size=1, max_size=40),
)
def test_a_sender_following_the_rule_bounds_silence_and_trailing_drops(
    interval: float, offset: float, gaps: list[float]
) -> None:
    """Batches at arbitrary times, heartbeats by the rule in between: the longest silence
    is under 1.5 intervals, and the first send after each batch comes within 0.75."""
    assert_bounds_hold(interval, offset, gaps, 0.0)


def test_idle_heartbeats_come_once_an_interval_after_the_first() -> None:
    """After a batch: one heartbeat on the half grid, then one per interval."""
    interval, offset = 2.0, 0.0
    last, after_batch, sends = 0.1, True, []
    for _ in range(4):
        last = heartbeat_at(last, interval, last, last + offset, after_batch)
        after_batch = False
        sends.append(round(last, 9))
    assert sends == [1.0, 2.0, 4.0, 6.0]


@given(
    interval=intervals, last=times, since=st.floats(0.0, 100.0), offset=times,
    after_batch=st.booleans(), phase=phases,
)  # fmt: skip
def test_any_phase_keeps_the_window_and_shifts_only_the_after_batch_grid(
    interval: float, last: float, since: float, offset: float, after_batch: bool, phase: float
) -> None:
    now = last + since
    wall = now + offset
    at = heartbeat_at(last, interval, now, wall, after_batch, phase)
    step = interval * (AFTER_BATCH_STEP if after_batch else 1.0)
    slack = 1e-9 * max(1.0, abs(last), abs(wall))
    assert last + HEARTBEAT_QUIET * step - slack <= at <= last + MAX_SILENCE * step + slack
    shift = phase * step if after_batch else 0.0  # the idle grid stays the fleet's
    off = math.remainder(at + offset - shift, step)  # to the nearest shifted grid instant
    assert abs(off) <= slack + 1e-6 * step


@settings(max_examples=50)
@given(
    interval=intervals,
    offset=times,
    phase=phases,
    gaps=st.lists(st.floats(0.0, 5.0), min_size=1, max_size=40),
)
def test_with_a_phase_silence_and_trailing_drops_keep_their_bounds(
    interval: float, offset: float, phase: float, gaps: list[float]
) -> None:
    """MAX_SILENCE and TRAILING_GAP, derived without a phase, hold for every phase."""
    assert_bounds_hold(interval, offset, gaps, phase)


def test_busy_ranks_after_batch_heartbeats_spread_idle_ones_meet() -> None:
    """Ranks whose batches went out at one instant heartbeat after them at their own phases,
    then idle together on the interval's grid."""
    interval, offset = 1.0, 1000.0  # the grids at whole monotonic seconds
    ids = [b"tcp://127.0.0.1:%d\0kv\0%d" % (5557 + r, r) for r in range(1024)]
    ps = [heartbeat_phase(i) for i in ids]
    assert all(0.0 <= p < 1.0 for p in ps)
    assert ps == [heartbeat_phase(i) for i in ids]  # deterministic
    after = [heartbeat_at(10.0, interval, 10.0, 10.0 + offset, True, p) for p in ps]
    # Spread over the half-interval step: no 50th of it holds more than 5 % of the ranks
    # (2 % on average; on a shared grid, all of them).
    bins = [0] * 50
    for at in after:
        bins[min(49, int((at - 10.5) / 0.5 * 50))] += 1
    assert max(bins) <= 0.05 * len(ps), bins
    idle = {
        round(heartbeat_at(at, interval, at, at + offset, False, p), 9)
        for at, p in zip(after, ps, strict=True)
    }
    assert idle <= {11.0, 12.0} and 12.0 in idle
