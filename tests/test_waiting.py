"""The test wait helper: returns what the condition gave, names what it waited for, and retries
only the exceptions it was told are "not yet"."""

from __future__ import annotations

import asyncio

import pytest

from tests.waiting import await_for, wait_for


def test_returns_the_first_true_value() -> None:
    answers = iter([None, 0, "", "ready"])
    assert wait_for(lambda: next(answers), timeout=5, poll=0) == "ready"


def test_times_out_naming_what_it_waited_for() -> None:
    with pytest.raises(AssertionError, match=r"timed out after 0.05 s waiting for the moon"):
        wait_for(lambda: False, timeout=0.05, what="the moon", poll=0.01)


def test_retries_only_the_named_exceptions() -> None:
    tries = iter([ConnectionRefusedError(), ConnectionRefusedError(), True])

    def attempt() -> bool:
        got = next(tries)
        if isinstance(got, BaseException):
            raise got
        return got

    assert wait_for(attempt, timeout=5, poll=0, retry_on=(OSError,)) is True
    with pytest.raises(ValueError):
        wait_for(lambda: int("x"), timeout=5, retry_on=(OSError,))


def test_timeout_names_the_last_retried_error() -> None:
    def refuse() -> bool:
        raise ConnectionRefusedError("port 7000")

    with pytest.raises(AssertionError, match=r"last error: ConnectionRefusedError\('port 7000'\)"):
        wait_for(refuse, timeout=0.05, what="tcp", poll=0.01, retry_on=(OSError,))


def test_await_for_lets_the_loop_run() -> None:
    async def main() -> None:
        flag: list[bool] = []
        asyncio.get_running_loop().call_later(0.01, flag.append, True)
        await await_for(lambda: flag, timeout=5, what="the callback")
        assert flag == [True]

    asyncio.run(main())
