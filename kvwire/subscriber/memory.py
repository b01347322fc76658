"""Giving freed receive buffers back to the system once a flood has drained.

glibc keeps memory freed by large batches in its arenas (its mmap threshold
rises after the first large free, so later batches come from the heap), and a
router that took a flood would keep that peak for good. :func:`release` asks
glibc (``malloc_trim``) to return the free pages; elsewhere it does nothing,
and :class:`TrimAfter` calls it once enough bytes have passed through and the
sockets were found empty.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import sys
import time
from collections.abc import Callable

__all__ = ["TrimAfter", "release"]


def _malloc_trim() -> Callable[[int], int] | None:
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        trim = libc.malloc_trim
    except (OSError, AttributeError):  # musl and others: no malloc_trim
        return None
    trim.argtypes = [ctypes.c_size_t]
    trim.restype = ctypes.c_int
    return trim


_TRIM = _malloc_trim()


def release() -> bool:
    """Return the allocator's free pages to the system; whether it could be asked."""
    if _TRIM is None:
        return False
    _TRIM(0)
    return True


_SETTLE_BYTES = 1 << 20  # less than this since the last trim is not worth one
_SETTLE_S = 1.0


class TrimAfter:
    """Calls :func:`release` when a socket is found empty (a flood, or part of it, has
    drained) and either ``threshold`` bytes were received since the last call, or
    a megabyte and a second: trims stay rare during a flood, and the last one comes
    with the first read after it (a heartbeat, the next batch)."""

    __slots__ = ("last", "pending", "threshold")

    def __init__(self, threshold: int) -> None:
        self.threshold = threshold
        self.pending = 0
        self.last = time.monotonic()

    def idle(self) -> None:
        """A socket was read to its end: trim if enough went through since the last trim."""
        pending = self.pending
        if pending < self.threshold:
            if pending < _SETTLE_BYTES:
                return
            now = time.monotonic()
            if now - self.last < _SETTLE_S:
                return
        self.pending = 0
        self.last = time.monotonic()
        release()
