"""The replay ROUTER's server: replays from the shared buffer, and snapshots of the mirror.

Runs on the publisher's service thread, which sleeps in a poll without the GIL
until a request comes, then serves a bounded slice at a time. What keeps a
hostile or stalled client from costing more than a slot:

- a replay sends the sender's own payload buffers (zero-copy: libzmq holds a
  reference to the one buffer every client shares), never a copy per client;
- at most one job per client identity (a new request replaces the old job);
- at most ``max_replay_jobs`` jobs (:class:`~kvwire.publisher.PublisherConfig`),
  served round robin; when all are taken, a job that has made no progress the
  longest is cut off to admit the new request;
- a job that cannot send for ``replay_stall_s`` (its client stopped reading) is cut off.
"""

from __future__ import annotations

import contextlib
import time
from collections import deque
from collections.abc import Callable
from typing import Any

import zmq

from kvwire.publisher.config import PublisherConfig
from kvwire.publisher.mirror import Mirror, SnapshotCursor
from kvwire.wire import (
    ReplayRequest,
    WireError,
    pack_seq,
    parse_request,
    replay_end_frames,
    snapshot_chunk_frames,
    snapshot_end_frames,
    snapshot_refused_frames,
)

__all__ = ["ReplayRange", "ReplayServer"]

ReplayRange = Callable[[int, int], list[tuple[int, Any]]]
"""``(start_seq, n)`` -> up to ``n`` buffered batches ``(seq, payload)`` from the
first whose seq is ``>= start_seq``, oldest first; a payload is any
read-only buffer ZeroMQ can send without copying."""

_REQUESTS_PER_PASS = 16
_REPLAY_CHUNK = 32  # replay messages per job per pass
_MAX_SNAPSHOTS = 2  # served at once (each logs the changes made while it runs)
_FLAGS = zmq.SNDMORE | zmq.NOBLOCK


class _Job:
    __slots__ = ("identity", "stalled_since")

    def __init__(self, identity: bytes) -> None:
        self.identity = identity
        self.stalled_since: float | None = None

    def close(self) -> None:
        """Release what the job holds (it is finished or cut off)."""


class _ReplayJob(_Job):
    __slots__ = ("next_seq", "remaining")

    def __init__(self, identity: bytes, next_seq: int, remaining: int) -> None:
        super().__init__(identity)
        self.next_seq = next_seq
        self.remaining = remaining


class _SnapshotJob(_Job):
    __slots__ = ("cursor", "pending", "started")

    def __init__(self, identity: bytes, cursor: SnapshotCursor) -> None:
        super().__init__(identity)
        self.cursor = cursor
        self.pending: list[bytes] | None = None  # built, not yet accepted by the socket
        self.started = False  # the first chunk waits a pass: starting one did work already

    def close(self) -> None:
        self.cursor.close()


class ReplayServer:
    """Answers replay and snapshot requests on ``router`` (one thread only).

    ``sync_mirror`` brings the mirror up to date before a snapshot starts.
    """

    def __init__(
        self,
        router: zmq.Socket[bytes],
        buffer: ReplayRange,
        topic: bytes,
        *,
        end_topic: bytes,
        config: PublisherConfig,
        mirror: Mirror | None,
        sync_mirror: Callable[[], object] = lambda: None,
        rank: int,
        note_error: Callable[[str, str], None],
    ) -> None:
        self.router = router
        self.buffer = buffer
        self.topic = topic
        self.end_topic = end_topic
        self.max_batches = config.replay_batches
        self.mirror = mirror
        self.sync_mirror = sync_mirror
        self.rank = rank
        self.dialect = config.dialect
        self.max_jobs = config.max_replay_jobs
        self.stall_s = config.replay_stall_s
        self.snapshot_chunk_blocks = config.snapshot_chunk_blocks
        self._note = note_error
        self._jobs: dict[bytes, _Job] = {}
        self._order: deque[bytes] = deque()
        self._sent = False  # the current step sent something
        self.requests = 0
        self.served = 0
        self.invalid = 0
        self.dropped = 0
        self.snapshots_served = 0
        self.snapshots_refused = 0

    @property
    def jobs(self) -> int:
        """Replies in progress."""
        return len(self._jobs)

    def serve(self) -> bool:
        """Read pending requests, then send one slice of the next job that can take one.

        Returns whether anything moved. Jobs whose clients are not reading are
        skipped in turn; when none can send, the caller waits a moment instead
        of spinning (holding the GIL) over them.
        """
        router = self.router
        moved = False
        if int(router.getsockopt(zmq.EVENTS)) & zmq.POLLIN:
            for _ in range(_REQUESTS_PER_PASS):
                try:
                    frames = router.recv_multipart(zmq.NOBLOCK)
                except zmq.Again:
                    break
                self._request(frames)
                moved = True
        order = self._order
        for _ in range(len(order)):
            identity = order[0]
            job = self._jobs[identity]
            self._sent = False
            if self._step(job):
                order.popleft()
                del self._jobs[identity]
                job.close()
                return True
            order.rotate(-1)
            if self._sent:
                return True
        return moved

    def close(self) -> None:
        """Drop every job (the publisher is closing)."""
        for job in self._jobs.values():
            job.close()
        self._jobs.clear()
        self._order.clear()

    # --- requests --------------------------------------------------------------------

    def _request(self, frames: list[bytes]) -> None:
        try:
            request = parse_request(frames)
        except WireError as exc:
            self.invalid += 1
            self._note("replay_invalid", f"ignored replay request: {exc}")
            return
        self.requests += 1
        identity = request.identity
        old = self._jobs.pop(identity, None)
        if old is not None:
            old.close()  # the client asked again: its new request replaces the old one
        elif len(self._jobs) >= self.max_jobs and not self._evict():
            self.dropped += 1
            self._note("replay_busy", "replay request dropped: every replay slot is busy")
            return
        job: _Job
        if isinstance(request, ReplayRequest):
            job = _ReplayJob(identity, request.start_seq, self.max_batches)
        else:
            cursor = self._start_snapshot(identity)
            if cursor is None:
                self._remove_from_order(identity)
                return
            job = _SnapshotJob(identity, cursor)
        self._jobs[identity] = job
        if old is None:
            self._order.append(identity)

    def _evict(self) -> bool:
        """Cut off the job stalled the longest, if any is stalled; returns whether one was."""
        stalled = [j for j in self._jobs.values() if j.stalled_since is not None]
        if not stalled:
            return False
        job = min(stalled, key=lambda j: j.stalled_since or 0.0)
        self._cut(job, "every replay slot is busy and its client is not reading")
        del self._jobs[job.identity]
        self._remove_from_order(job.identity)
        return True

    def _remove_from_order(self, identity: bytes) -> None:
        with contextlib.suppress(ValueError):
            self._order.remove(identity)

    def _start_snapshot(self, identity: bytes) -> SnapshotCursor | None:
        mirror = self.mirror
        reason: str | None
        if mirror is None:
            # As the engines' own publishers answer it: a start seq past the buffer.
            self.snapshots_refused += 1
            with contextlib.suppress(zmq.ZMQError):
                self.router.send_multipart(
                    [identity, *replay_end_frames(self.end_topic)], zmq.NOBLOCK
                )
            return None
        self.sync_mirror()
        if mirror.distrust_reason is not None:
            reason = f"state cannot be vouched for: {mirror.distrust_reason}"
        elif mirror.snapshots_in_progress >= _MAX_SNAPSHOTS:
            reason = "busy: too many snapshots in progress"
        else:
            reason = None
        if reason is not None:
            self.snapshots_refused += 1
            frames = snapshot_refused_frames(self.topic, reason)
            with contextlib.suppress(zmq.ZMQError):
                self.router.send_multipart([identity, *frames], zmq.NOBLOCK)
            return None
        return mirror.snapshot(
            self.rank, chunk_blocks=self.snapshot_chunk_blocks, dialect=self.dialect
        )

    # --- sending -----------------------------------------------------------------------

    def _step(self, job: _Job) -> bool:
        """Send one slice of ``job``; returns whether the job is finished (or cut off)."""
        try:
            if type(job) is _ReplayJob:
                return self._replay_slice(job)
            assert isinstance(job, _SnapshotJob)
            return self._snapshot_slice(job)
        except zmq.Again:
            now = time.monotonic()
            if job.stalled_since is None:
                job.stalled_since = now
            elif now - job.stalled_since > self.stall_s:
                return self._cut(job, "its client stopped reading")
            return False
        except zmq.ZMQError as exc:  # EHOSTUNREACH: the client went away
            return self._cut(job, str(exc))

    def _cut(self, job: _Job, why: str) -> bool:
        self.dropped += 1
        self._note("replay_dropped", f"replay abandoned: {why}")
        job.close()
        return True

    def _replay_slice(self, job: _ReplayJob) -> bool:
        send = self.router.send
        identity = job.identity
        topic = self.topic
        want = min(_REPLAY_CHUNK, job.remaining)
        items = self.buffer(job.next_seq, want)
        for seq, payload in items:
            send(identity, _FLAGS)  # raises Again here only, before any other part
            send(b"", _FLAGS)
            send(topic, _FLAGS)
            send(pack_seq(seq), _FLAGS)
            send(zmq.Frame(payload, copy=False), zmq.NOBLOCK, copy=False)
            job.next_seq = seq + 1
            job.remaining -= 1
            job.stalled_since = None
            self._sent = True
        if job.remaining > 0 and len(items) == want:
            return False
        self.router.send_multipart([identity, *replay_end_frames(self.end_topic)], zmq.NOBLOCK)
        self.served += 1
        return True

    def _snapshot_slice(self, job: _SnapshotJob) -> bool:
        if not job.started:
            job.started = True
            self._sent = True  # it did work: starting the snapshot
            return False
        cursor = job.cursor
        if job.pending is None:
            payload = cursor.next_chunk()
            if payload is None:
                frames = snapshot_end_frames(self.topic, cursor.next_seq, cursor.chunks)
                self.router.send_multipart([job.identity, *frames], zmq.NOBLOCK)
                self.snapshots_served += 1
                return True
            frames = snapshot_chunk_frames(self.topic, cursor.next_seq, cursor.chunks - 1, payload)
            job.pending = [job.identity, *frames]
        self.router.send_multipart(job.pending, zmq.NOBLOCK)
        job.pending = None
        job.stalled_since = None
        self._sent = True
        return False
