"""The one wait helper of the test suite: poll a condition until a deadline, then fail saying what."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import TypeVar

POLL_S = 0.002

T = TypeVar("T")


def wait_for(
    predicate: Callable[[], T],
    timeout: float = 10.0,
    what: str = "condition",
    *,
    poll: float = POLL_S,
    retry_on: tuple[type[BaseException], ...] = (),
) -> T:
    """Poll ``predicate`` until it is true and return its value; fail the test after ``timeout`` s.

    ``poll``: seconds between tries, for a predicate that is costly to ask (a container's
    state, a connection attempt). ``retry_on``: exceptions that count as "not yet" (a
    refused connection) rather than failing at once; the last one is named on timeout.
    """
    deadline = time.monotonic() + timeout
    last: BaseException | None = None
    while True:
        try:
            value = predicate()
            if value:
                return value
        except retry_on as exc:
            last = exc
        if time.monotonic() > deadline:
            why = f" (last error: {last!r})" if last is not None else ""
            raise AssertionError(f"timed out after {timeout} s waiting for {what}{why}")
        time.sleep(poll)


async def await_for(
    predicate: Callable[[], object], timeout: float = 10.0, what: str = "condition"
) -> None:
    """:func:`wait_for` inside an event loop: the loop runs while it waits."""
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        await asyncio.sleep(POLL_S)
