"""Types of the subscriber's native receive drain (``_recv.c``)."""

from typing import Any

def load(path: str) -> None: ...
def drain(socket: Any, cap: int, max_frames: int) -> list[tuple[bytes, ...]]: ...
def drain_beats(
    socket: Any, cap: int, topic: bytes, expected: int, rank: int
) -> tuple[int, bytes | None, list[tuple[bytes, ...]]]: ...
def check_batch(
    payload: bytes | bytearray | memoryview,
    max_events: int,
    max_blocks: int,
    max_block_size: int,
    max_tokens: int,
) -> tuple[int, int | None, bool] | None: ...
