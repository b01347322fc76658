"""Types of the one native batch payload reader (``_scan.c``, ``kvwire/_native/scan.h``)."""

from collections.abc import Callable
from typing import Any

from kvwire.wire.events import KVEventBatch

def check(payload: Any, limits: Any, /) -> tuple[int, int | None, bool] | None: ...
def view(
    payload: Any, limits: Any, /
) -> (
    list[tuple[str, list[int], int | None, bytes | None, int, str | None, str | None, int | None, int]]
    | None
): ...
def fields() -> tuple[tuple[str, ...], tuple[str, ...]]: ...
def bind(
    maps: Callable[[Any], KVEventBatch],
    arrays: Callable[[Any], KVEventBatch],
    map_envelope: Callable[[Any], KVEventBatch],
    errors: tuple[type[BaseException], ...],
    token_ids: type,
    raw: type,
    batch: type,
    stored: type,
    removed: type,
    cleared: type,
    /,
) -> None: ...
def typed(payload: Any, limits: Any, /) -> KVEventBatch | None: ...
