"""The one rate-limited logger: a kind is logged once per interval, repeats folded into a summary."""

from __future__ import annotations

import logging

import pytest

from kvwire.ratelog import RateLimitedLog


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_first_is_logged_repeats_fold_into_one_summary(caplog: pytest.LogCaptureFixture) -> None:
    clock = Clock()
    log = RateLimitedLog(logging.getLogger("t.ratelog"), interval=10.0, clock=clock)
    with caplog.at_level(logging.WARNING, "t.ratelog"):
        for rank in range(1024):
            log.note("replay-abandoned", "replay abandoned: Host unreachable", f"w/{rank}")
        assert [r.getMessage() for r in caplog.records] == ["w/0: replay abandoned: Host unreachable"]
        assert log.held == 1023
        log.flush()  # not due yet
        assert len(caplog.records) == 1
        clock.now += 10.0
        log.flush()
    assert len(caplog.records) == 2
    summary = caplog.records[1].getMessage()
    assert summary.startswith("replay abandoned: Host unreachable (1023 times")
    assert "from 1023: w/1, w/2, w/3, w/4 and 1019 more" in summary
    assert log.held == 0


def test_kinds_are_independent_and_force_flushes(caplog: pytest.LogCaptureFixture) -> None:
    clock = Clock()
    log = RateLimitedLog(logging.getLogger("t.ratelog2"), interval=10.0, clock=clock)
    with caplog.at_level(logging.WARNING, "t.ratelog2"):
        log.note("a", "first a")
        log.note("b", "first b")
        log.note("a", "second a")
        log.flush(force=True)
    assert [r.getMessage() for r in caplog.records] == [
        "first a",
        "first b",
        "second a (once since the last report)",
    ]


def test_held_repeats_ride_on_the_next_due_line(caplog: pytest.LogCaptureFixture) -> None:
    clock = Clock()
    log = RateLimitedLog(logging.getLogger("t.ratelog3"), interval=1.0, clock=clock)
    with caplog.at_level(logging.WARNING, "t.ratelog3"):
        log.note("k", "boom", "r0")
        log.note("k", "boom", "r1")
        clock.now += 2.0
        log.note("k", "boom", "r2")
    assert caplog.records[-1].getMessage() == "r2: boom (once since the last report, from 1: r1)"
    assert log.held == 0


def test_negative_interval_refused() -> None:
    with pytest.raises(ValueError, match="interval"):
        RateLimitedLog(logging.getLogger("t"), interval=-1.0)
