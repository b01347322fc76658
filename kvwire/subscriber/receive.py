"""Reading a socket's ready messages in one call: native where libzmq can be reached.

:func:`drain` returns up to ``cap`` messages ready on a ZeroMQ socket (each a
tuple of frames as ``bytes``) without blocking, and stops when the socket has
nothing more, so that its edge-triggered descriptor signals the next arrival;
at the cap the caller reads on without waiting for a signal. A message of
more than ``max_frames`` frames is read to its end and returned as ``()``:
the caller counts it as malformed, and nothing of it is kept. The socket's own
size limit (``ZMQ_MAXMSGSIZE``) stays libzmq's to enforce.

The native drain (``_recv.c``) calls libzmq directly, one C call for all the
messages instead of pyzmq's call per frame and an exception at the end; it
needs the shared libzmq pyzmq loaded (:func:`kvwire._native.libzmq_path`).
Where that cannot be found (no ``/proc/self/maps``, a static libzmq, the
extension not built), the same contract is kept in Python; :func:`load` says
which a subscriber gets.

:func:`drain_beats` is :func:`drain` for a live SUB socket whose stream is in
sequence (:meth:`RankStream.beat_key`): the heartbeats at the head of the
socket (the next seqs, each an empty batch of the rank, exactly as kvwire's
publishers send them) are counted rather than returned, and the stream takes
them in one call (:meth:`RankStream.beats`). The first other message stops
the counting; it and the rest are returned for the stream to judge. The
pyzmq fallback counts none: every heartbeat then takes the general path.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from typing import Any, NamedTuple, TypeAlias

import zmq

from kvwire._native import libzmq_path

__all__ = ["NATIVE", "PORTABLE", "Receive", "drain", "drain_beats", "load"]

log = logging.getLogger("kvwire.subscriber")


def _drain_py(sock: zmq.Socket[Any], cap: int, max_frames: int) -> list[tuple[bytes, ...]]:
    """:func:`drain` through pyzmq, for a pyzmq whose libzmq cannot be reached."""
    if cap < 0 or not 1 <= max_frames <= 64:
        raise ValueError("cap must be >= 0, max_frames in 1..64")
    out: list[tuple[bytes, ...]] = []
    recv = sock.recv_multipart
    while len(out) < cap:
        try:
            frames = recv(zmq.NOBLOCK)
        except zmq.Again:
            break
        out.append(tuple(frames) if len(frames) <= max_frames else ())
    return out


Beats: TypeAlias = tuple[int, bytes | None, list[tuple[bytes, ...]]]
"""What :func:`drain_beats` returns: (heartbeats counted, the last one's payload, the rest)."""


def _drain_beats_py(
    sock: zmq.Socket[Any], cap: int, topic: bytes, expected: int, rank: int
) -> Beats:
    """:func:`drain_beats` through pyzmq: counts nothing, returns every message."""
    return 0, None, _drain_py(sock, cap, 3)


class Receive(NamedTuple):
    """The drains a subscriber reads with: native where they can be, else pyzmq's."""

    drain: Callable[[zmq.Socket[Any], int, int], list[tuple[bytes, ...]]]
    drain_beats: Callable[[zmq.Socket[Any], int, bytes, int, int], Beats]
    native: bool


PORTABLE = Receive(_drain_py, _drain_beats_py, False)
"""The pyzmq drains: wherever pyzmq runs."""


@functools.cache
def load() -> Receive:
    """The native drains if ``_recv`` is built and finds pyzmq's libzmq, else :data:`PORTABLE`.

    Resolved once a process (``load.cache_clear()`` resolves it again).
    """
    try:
        from kvwire.subscriber import _recv

        _recv.load(libzmq_path())
    except (ImportError, RuntimeError) as exc:
        log.info("native receive drain unavailable (%s): reading through pyzmq", exc)
        return PORTABLE
    return Receive(_recv.drain, _recv.drain_beats, True)


NATIVE = load().native
"""Whether :func:`drain` and :func:`drain_beats` are the native ones."""

drain = load().drain
drain_beats = load().drain_beats
