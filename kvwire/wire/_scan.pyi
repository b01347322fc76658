"""Types of the one native batch payload reader (``_scan.c``, ``kvwire/_native/scan.h``)."""

from typing import Any

def check(payload: Any, limits: Any, /) -> tuple[int, int | None, bool] | None: ...
def view(
    payload: Any, limits: Any, /
) -> (
    list[tuple[str, list[int], int | None, bytes | None, int, str | None, str | None, int | None, int]]
    | None
): ...
def fields() -> tuple[tuple[str, ...], tuple[str, ...]]: ...
