"""The one wait helper of the test suite: poll a condition until a deadline, then fail saying what."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

POLL_S = 0.002


def wait_for(predicate: Callable[[], object], timeout: float = 10.0, what: str = "condition") -> None:
    """Poll ``predicate`` until it is true; fail the test after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        time.sleep(POLL_S)


async def await_for(
    predicate: Callable[[], object], timeout: float = 10.0, what: str = "condition"
) -> None:
    """:func:`wait_for` inside an event loop: the loop runs while it waits."""
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        await asyncio.sleep(POLL_S)
