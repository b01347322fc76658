"""A rank's replay and snapshot requests: the DEALER they go out on, and their turn.

The socket exists only while the stream has a request out or due, and holds one
of the subscriber's request slots (:class:`~kvwire.subscriber.env.ReplaySlots`)
meanwhile; a request that finds no slot (or no file to open a socket with) waits
its turn here, its deadlines started only when it is sent. Its replies are read
a bounded share at a time, so that the ranks recovering share the router's rounds.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

import zmq

from kvwire.subscriber.actions import RequestReplay, RequestSnapshot
from kvwire.wire import replay_request_frames, snapshot_request_frames

if TYPE_CHECKING:
    from kvwire.subscriber.link import RankLink

__all__ = ["ReplayChannel"]

_REPLY_FRAMES = 6  # the longest replay reply (a snapshot chunk)
_REPLAY_HWM = 1024  # replay reply messages queued unread per rank, at most
_REPLY_TURN_BYTES = 256 << 10  # reply bytes one turn reads: about one snapshot chunk


class ReplayChannel:
    """One rank's replay socket, its request slot and the request waiting for one."""

    __slots__ = ("dealer", "fd", "link", "queued", "slot", "token", "worker_id")

    def __init__(self, link: RankLink) -> None:
        self.link = link
        self.worker_id = link.worker_id  # (what ReplaySlots counts per source)
        self.dealer: zmq.Socket[bytes] | None = None
        self.fd = -1
        self.token = 0  # of the request out: replies to an older one are not taken
        self.slot = False  # holds one of the requests in flight
        self.queued: tuple[list[bytes], int] | None = None  # a request waiting for a socket

    @property
    def closed(self) -> bool:
        return self.link.closed

    def request(self, action: RequestReplay | RequestSnapshot) -> None:
        """Send what the stream asked, or queue it for its turn."""
        if isinstance(action, RequestReplay):
            frames = replay_request_frames(action.start_seq)
        else:
            frames = snapshot_request_frames()
        self._send(frames, action.token, action.fresh)

    def _open(self) -> bool:
        """A replay socket, in the rank's request slot (taken here if it holds none)."""
        link = self.link
        env = link.env
        if not self.slot:
            if not env.replays.take(self):
                return False
            self.slot = True
        assert link.endpoints.replay_endpoint is not None
        try:
            dealer = env.socket(zmq.DEALER, link.keys)
        except Exception as exc:  # out of sockets or files: wait for one to close
            self.slot = False
            env.replays.refused(self)
            link.note(
                "replay-socket", f"replay socket not opened ({exc}): waiting for one to close"
            )
            return False
        self.dealer = dealer
        # Bounded: a reply flows as fast as it is read (the publisher waits on a full
        # pipe), and a hostile replay socket cannot queue more than this in the router.
        dealer.setsockopt(zmq.RCVHWM, min(link.hwm, _REPLAY_HWM))
        dealer.connect(link.endpoints.replay_endpoint)
        self.fd = env.reactor.watch(dealer, link)
        return True

    def _close(self, keep_slot: bool = False) -> None:
        """Close the replay socket; its request slot goes too, unless ``keep_slot``."""
        dealer = self.dealer
        env = self.link.env
        if dealer is not None:
            self.dealer = None
            env.reactor.unwatch(self.fd)
            self.fd = -1
            dealer.close(linger=0)
        if self.slot and not keep_slot:
            self.slot = False
            env.replays.release(self)

    def release(self) -> None:
        """Close the replay socket once the stream waits for no reply."""
        if self.dealer is not None and not self.link.stream.replay_pending:
            self._close()

    def close(self) -> None:
        """The rank is done: nothing waits, nothing is sent."""
        self.queued = None
        self._close()

    def _send(self, frames: list[bytes], token: int, fresh: bool) -> bool:
        """Send a request, or queue it for its turn (False); ``fresh`` needs a new socket
        (no late replies). A rank holding a request slot keeps it."""
        self.token = token
        if fresh or self.dealer is None:
            self._close(keep_slot=True)
            if not self._open():
                # Wait for a turn (the bounds on requests in flight, or out of files);
                # the stream's deadlines for it start when it is sent.
                if self.queued is None:
                    self.link.env.replays.wait(self)
                self.queued = (frames, token)
                self.link.stream.request_waiting(token)
                return False
            self.queued = None
        dealer = self.dealer
        assert dealer is not None
        try:
            dealer.send_multipart(frames, zmq.NOBLOCK)
        except zmq.ZMQError as exc:  # the request times out and is retried
            self.link.note("replay-not-sent", f"replay request not sent: {exc}")
        return True

    def send_queued(self) -> None:
        """The rank's turn: send the request that waited for it (if still wanted)."""
        request, self.queued = self.queued, None
        link = self.link
        if request is None or link.closed or self.dealer is not None:
            return
        if not link.stream.replay_pending:
            return  # given up meanwhile (a disconnect): the next one asks anew
        frames, token = request
        if self._send(frames, token, fresh=False):
            link.stream.request_sent(token, time.monotonic())
            link.schedule()

    def read(self) -> None:
        """Read the replies queued, about one snapshot chunk's bytes a turn (at most a
        read chunk): the requests in flight share the router's rounds (``request_limit``)."""
        link = self.link
        applied = False
        dealer = self.dealer
        drain = link.env.receive.drain
        left = max(1, min(link.chunk, _REPLY_TURN_BYTES // link.batch_bytes))
        while dealer is not None and self.dealer is dealer:
            chunk = min(link.chunk, left)
            if chunk < 1:
                link.env.reactor.again(link)  # more may wait: the socket will not signal it
                break
            messages = drain(dealer, chunk, _REPLY_FRAMES)
            left -= len(messages)
            if messages:
                link.fit_read(messages)
            for frames in messages:
                actions = link.stream.replay_reply(frames, self.token, time.monotonic())
                applied = applied or bool(actions)
                link.carry_out(actions)
                if self.dealer is not dealer:
                    break  # a fresh replay socket replaced this one: read it on its own signal
            if len(messages) < chunk:
                break
        if not link.closed:
            self.release()
            if applied:
                link.env.delivery.flush_later(link)
