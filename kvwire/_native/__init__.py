"""Shared support for kvwire's native threads: where pyzmq's libzmq lives.

kvwire's C extensions call libzmq directly (a sender or receiver loop that
never takes the GIL). pyzmq ships no header and may bundle its own copy of
libzmq, so the extensions resolve the calls they need from the very library
pyzmq loaded (``libzmq.h``); :func:`libzmq_path` finds it.
"""

from __future__ import annotations

import functools
import os

import zmq

__all__ = ["libzmq_path"]


@functools.cache
def libzmq_path() -> str:
    """The file of the libzmq that pyzmq loaded into this process.

    Read from ``/proc/self/maps`` (Linux), so it is the same library instance
    whether pyzmq bundles libzmq or links a system copy. Raises ``RuntimeError``
    when it cannot be found (another platform, or a statically linked pyzmq).
    """
    zmq.zmq_version_info()  # the backend, hence libzmq, is loaded by now
    try:
        with open("/proc/self/maps", encoding="utf-8", errors="replace") as maps:
            for line in maps:
                path = line.rstrip("\n").split(maxsplit=5)[-1]
                if os.path.basename(path).startswith("libzmq") and ".so" in path:
                    return path
    except OSError as exc:
        raise RuntimeError(f"cannot read /proc/self/maps to find libzmq: {exc}") from None
    raise RuntimeError(
        "libzmq is not a shared library mapped into this process (pyzmq linked it "
        "statically?): kvwire's native sender and receiver need pyzmq with a shared libzmq"
    )
