"""Clone a running router's view (the ZeroMQ Guide's Clone pattern, with credit-based flow).

The bytes are a checkpoint's (:mod:`kvwire.subscriber.checkpoint`): one
format, two transports. A router that serves its view binds a ROUTER
(:class:`CloneServer`, on the subscriber's loop); a new replica connects a
DEALER (:func:`clone_view`, before it connects to the engines). Messages,
each starting with :data:`PROTOCOL`::

    client -> server   [PROTOCOL, b"OPEN"]             start a session: the view as of now
                       [PROTOCOL, b"CREDIT", u32 n]    n more pieces may be sent
    server -> client   [PROTOCOL, b"DATA", part...]    the next piece (one frame of the format,
                                                       in parts: a record's blob is one, sent
                                                       as the sink made it)
                       [PROTOCOL, b"END"]              no more pieces
                       [PROTOCOL, b"ERROR", text]      refused (too many sessions, no view)

The server makes each piece when a credit allows it, on the subscriber's
thread and one rank at a time (as a background checkpoint does), so a view
of 20 M blocks is never built whole and its ranks are each taken at one
instant between the fleet's inputs. The client keeps at most
``window`` pieces in flight (the Guide's credit-based flow control of its
file-transfer example), stops at ``max_bytes`` in all and at ``timeout``
seconds without a piece, and refuses a truncated or altered stream, another
sink format or another fleet's view, clearing whatever it imported.
"""

from __future__ import annotations

import contextlib
import logging
import struct
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from typing import TYPE_CHECKING, Any, cast

import zmq

from kvwire.security import ClientKeys, ServerKeys, secure_client, secure_server, warn_if_exposed
from kvwire.subscriber.checkpoint import (
    IMPORT_BATCH,
    Announce,
    CheckpointError,
    Decoder,
    Restored,
    RestoreProgress,
    Restorer,
    Turn,
    ViewStream,
)
from kvwire.subscriber.sink import ViewSink

if TYPE_CHECKING:
    import asyncio

    from kvwire.subscriber.link import RankLink

__all__ = ["PROTOCOL", "CloneServer", "clone_view"]

log = logging.getLogger("kvwire.subscriber.clone")

PROTOCOL = b"kvw-clone/2"
_OPEN, _CREDIT, _DATA, _END, _ERROR = b"OPEN", b"CREDIT", b"DATA", b"END", b"ERROR"
_U32 = struct.Struct(">I")
MAX_SESSIONS = 4
"""Clones served at once; a further client is refused (it starts cold or from its checkpoint)."""
SESSION_IDLE_S = 30.0
"""A session whose client sends no credit for this long is dropped."""
_MAX_CREDIT = 256  # pieces one client may have granted at once
MAX_IN_FLIGHT = 64 << 20
"""Bytes of one session sent and not yet acknowledged (a credit returned) at most: the
pieces a client's window allows go out while they fit (and one at least)."""
WINDOW = 256
"""Pieces a client keeps in flight: enough that the peer makes the next ones while a
batch of records is imported (bounded in bytes by the peer's :data:`MAX_IN_FLIGHT`)."""

_CREDIT_BATCH = 16  # credits a replica returns in one message (and whatever it owes when drained)

_SNDHWM = 2 * _MAX_CREDIT


class _Session:
    __slots__ = ("credit", "in_flight", "last", "sent", "view")

    def __init__(self, view: ViewStream, now: float) -> None:
        self.view = view
        self.credit = 0
        self.last = now
        self.sent: deque[int] = deque()  # sizes of the pieces not yet acknowledged
        self.in_flight = 0

    def acknowledged(self, n: int) -> None:
        """``n`` credits came back: the ``n`` oldest pieces sent have arrived."""
        sent = self.sent
        for _ in range(min(n, len(sent))):
            self.in_flight -= sent.popleft()


class CloneServer:
    """Serves the subscriber's view on ``endpoint`` to cloning peers, on ``loop``.

    ``links``: the ranks followed now (called at each session's start);
    ``keys``: CURVE server keys (:class:`kvwire.security.ServerKeys`). The
    endpoint binds as given: a bind reachable beyond this host logs a warning
    (:func:`kvwire.security.warn_if_exposed`), a loud one without keys.
    """

    def __init__(
        self,
        loop: asyncio.AbstractEventLoop,
        ctx: zmq.Context[Any],
        endpoint: str,
        links: Callable[[], Sequence[RankLink]],
        sink: ViewSink,
        keys: ServerKeys | None = None,
        flush: Callable[[], object] | None = None,
    ) -> None:
        self._loop = loop
        self._flush = flush
        self._links = links
        self._sink = sink
        self._sessions: dict[bytes, _Session] = {}
        self.keyed = keys is not None
        sock: zmq.Socket[bytes] = ctx.socket(zmq.ROUTER)
        try:
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
            sock.setsockopt(zmq.SNDHWM, _SNDHWM)
            sock.setsockopt(zmq.RCVHWM, 1000)
            sock.setsockopt(zmq.MAXMSGSIZE, 1024)  # clients send only small requests
            if keys is not None:
                secure_server(sock, keys)
            sock.bind(endpoint)
        except BaseException:
            sock.close(linger=0)
            raise
        self._sock = sock
        self.endpoint: str = sock.getsockopt_string(zmq.LAST_ENDPOINT)
        warn_if_exposed(log, self.endpoint, "clone service (Subscriber.serve_view)",
                        secured=keys is not None)  # fmt: skip
        self._fd = cast(int, sock.getsockopt(zmq.FD))
        loop.add_reader(self._fd, self._readable)
        self._timer = loop.call_later(SESSION_IDLE_S, self._expire)
        self._closed = False
        loop.call_soon(self._readable)  # (a ZeroMQ descriptor signals edges only)

    def _readable(self) -> None:
        sock = self._sock
        while not self._closed and cast(int, sock.getsockopt(zmq.EVENTS)) & zmq.POLLIN:
            try:
                frames = sock.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                break
            try:
                self._on_request(frames)
            except Exception:
                log.exception("clone service: request failed")

    def _send(self, ident: bytes, *frames: bytes) -> bool:
        try:
            self._sock.send_multipart([ident, PROTOCOL, *frames], zmq.NOBLOCK, copy=False)
        except zmq.ZMQError:  # the client went away (or cannot take more): its session ends
            self._sessions.pop(ident, None)
            return False
        return True

    def _on_request(self, frames: list[bytes]) -> None:
        if len(frames) < 3 or frames[1] != PROTOCOL:
            return  # not a clone client's: nothing to answer
        ident, verb = frames[0], frames[2]
        now = time.monotonic()
        if verb == _OPEN:
            self._sessions.pop(ident, None)
            if len(self._sessions) >= MAX_SESSIONS:
                self._send(ident, _ERROR, b"busy: too many clones served at once")
                return
            try:
                view = ViewStream(self._links(), self._sink, self._flush)
            except Exception as exc:
                self._send(ident, _ERROR, f"no view to serve: {exc}".encode())
                return
            self._sessions[ident] = _Session(view, now)
        elif verb == _CREDIT and len(frames) == 4 and len(frames[3]) == _U32.size:
            session = self._sessions.get(ident)
            if session is None:
                return
            n = _U32.unpack(frames[3])[0]
            session.credit = min(_MAX_CREDIT, session.credit + n)
            session.acknowledged(n)
            session.last = now
            self._pump(ident, session)

    def _pump(self, ident: bytes, session: _Session) -> None:
        """Send what the client's credit allows (within :data:`MAX_IN_FLIGHT`), each piece
        made now."""
        while session.credit > 0 and (not session.sent or session.in_flight < MAX_IN_FLIGHT):
            try:
                piece = session.view.next()
            except CheckpointError as exc:
                self._sessions.pop(ident, None)
                self._send(ident, _ERROR, str(exc).encode())
                return
            if piece is None:
                self._sessions.pop(ident, None)
                self._send(ident, _END)
                return
            if not self._send(ident, _DATA, *piece):
                return
            session.credit -= 1
            size = sum(len(part) for part in piece)
            session.sent.append(size)
            session.in_flight += size

    def _expire(self) -> None:
        now = time.monotonic()
        for ident, session in list(self._sessions.items()):
            if now - session.last > SESSION_IDLE_S:
                del self._sessions[ident]
        self._timer = self._loop.call_later(SESSION_IDLE_S, self._expire)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._timer.cancel()
        self._loop.remove_reader(self._fd)
        self._sessions.clear()
        self._sock.close(linger=0)


def _ask(sock: zmq.Socket[bytes], *frames: bytes) -> None:
    """Send a client message without blocking. A DEALER's pipe to the peer is made at
    ``connect``; a peer that refuses the handshake (keys, or none where it wants them)
    ends it, and a blocking send would then wait forever, past ``timeout`` and
    ``cancel``: the refusal comes before the OPEN whenever this thread runs late."""
    try:
        sock.send_multipart([PROTOCOL, *frames], zmq.NOBLOCK)
    except zmq.Again:
        raise CheckpointError(
            "the peer closed the connection during the handshake (wrong or missing keys?)"
        ) from None


def clone_view(
    ctx: zmq.Context[Any],
    endpoint: str,
    sink: ViewSink,
    followed: Iterable[tuple[str, int]],
    *,
    keys: ClientKeys | None = None,
    timeout: float = 10.0,
    max_bytes: int = 4 << 30,
    window: int = WINDOW,
    cancel: threading.Event | None = None,
    progress: RestoreProgress | None = None,
    announce: Announce | None = None,
    turn: Turn | None = None,
) -> Restored:
    """Copy the view served at ``endpoint`` into ``sink`` (blocking; not on a loop).

    Returns the positions the ranks resume from. Raises
    :class:`~kvwire.subscriber.checkpoint.CheckpointError` (with every rank it
    imported cleared again) when the peer is silent for ``timeout`` seconds,
    refuses, sends more than ``max_bytes``, or sends anything but a complete
    view of this sink's format holding a rank in ``followed``.
    """
    sock: zmq.Socket[bytes] = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.MAXMSGSIZE, min(max_bytes + 64, 2**63 - 1))
    sock.setsockopt(zmq.RCVHWM, window + 2)
    if progress is None:
        progress = RestoreProgress()
    progress.source = "clone"
    restorer = Restorer(
        sink,
        followed,
        f"clone from {endpoint}",
        progress,
        batch=IMPORT_BATCH,
        announce=announce,
        turn=turn,
    )
    decoder = Decoder(max_frame=max_bytes)
    received = 0
    try:
        if keys is not None:
            secure_client(sock, keys)
        sock.connect(endpoint)
        _ask(sock, _OPEN)
        _ask(sock, _CREDIT, _U32.pack(window))
        silent_since = time.monotonic()
        owed = 0  # credits for pieces received, not yet returned
        while True:
            if cancel is not None and cancel.is_set():
                raise CheckpointError("the clone was abandoned (the subscriber stopped)")
            try:
                # (not copied: a record's blob is imported from the message it came in)
                msg = sock.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                # Drained: return the credit owed, let the ranks read so far connect, wait.
                # (Each call here lets the subscriber's loop take the GIL: once a drain,
                # not a few times a piece.)
                if owed:
                    _ask(sock, _CREDIT, _U32.pack(owed))
                    owed = 0
                restorer.announce()
                if not sock.poll(100) and time.monotonic() - silent_since > timeout:
                    raise CheckpointError(
                        f"the peer sent nothing for {timeout} s after {received} bytes "
                        "(it died, stalled or is not serving its view)"
                    ) from None
                continue
            silent_since = time.monotonic()
            if len(msg) < 2 or msg[0].bytes != PROTOCOL:
                raise CheckpointError("the peer does not speak the clone protocol")
            verb = msg[1].bytes
            if verb == _DATA and len(msg) >= 3:
                parts = [frame.buffer for frame in msg[2:]]
                received += sum(len(part) for part in parts)
                progress.bytes_received = received
                if received > max_bytes:
                    raise CheckpointError(f"the view is larger than clone_max_bytes={max_bytes}")
                # The credit first: the peer makes the next pieces while this one (and, every
                # IMPORT_BATCH records, a batch of them) is imported here.
                owed += 1
                if owed >= _CREDIT_BATCH:
                    _ask(sock, _CREDIT, _U32.pack(owed))
                    owed = 0
                for item in decoder.feed_parts(parts):
                    restorer.take(item)
            elif verb == _END:
                decoder.finish()
                return restorer.finish(received)
            elif verb == _ERROR:
                text = msg[2].bytes.decode(errors="replace") if len(msg) > 2 else ""
                raise CheckpointError(f"the peer refused: {text}")
            else:
                raise CheckpointError(f"an unknown clone message {verb!r}")
    except BaseException:
        restorer.rollback()
        raise
    finally:
        with contextlib.suppress(zmq.ZMQError):
            sock.close(linger=0)
