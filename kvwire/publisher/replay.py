"""The replay ROUTER's server: replays from the shared buffer, and snapshots of the mirror.

Runs on the publisher's service thread, which sleeps in a poll without the GIL
until a request comes, then serves a bounded slice at a time. What keeps a
hostile or stalled client from costing more than a slot:

- nothing is copied per client: a replay sends the sender's own payload
  buffers, a snapshot the chunks of one shared :class:`_Snapshot` (built once,
  as the first reply reaches each chunk, and sent by every reply that joins it
  while the mirror has not moved far), all zero-copy: libzmq holds a
  reference to the one buffer every client's pipe shares;
- the messages are sent in C (:class:`~kvwire.publisher._sender.Replies`): a
  replay slice is one call that sends its batches straight from the sender's
  ring, with no Python object per message;
- bytes in flight are bounded: a message counts from the moment it is handed
  to ZeroMQ until libzmq releases it (written to the kernel, or its pipe torn
  down), as its free function tells the job's :class:`Account` (and wakes
  this thread, when it waits with a reply that has more to send). A pipe that took a whole
  reply is not a served reply: a job stays open until all it sent was taken. At most
  ``max_replay_bytes`` are in flight across all clients, and each job at most
  ``max_replay_bytes / max_replay_jobs`` (a message bigger than that goes alone);
- at most one job per client identity (a new request replaces the old job),
  at most ``max_replay_jobs`` jobs, served round robin; when all are taken, the
  job waiting on its client the longest is cut off to admit the new request;
- a job whose client takes nothing for ``replay_stall_s`` (whatever its pipe
  holds, finished sending or not) is cut off, and its connection shut down
  (through a duplicate of the descriptor its request came on), so that libzmq
  drops the pipe and what it held; where there is no descriptor (inproc), its
  bytes stay counted until the peer goes.

Memory freed by a flood goes back to the system once the service is idle
(:class:`~kvwire.subscriber.memory.TrimAfter`).
"""

from __future__ import annotations

import contextlib
import os
import socket
import threading
import time
from collections import deque
from collections.abc import Callable

import zmq

from kvwire.publisher._sender import RING_TAKE_MAX, Account, Payload, Replies, payload_of
from kvwire.publisher.config import PublisherConfig
from kvwire.publisher.mirror import Mirror, SnapshotCursor
from kvwire.subscriber.memory import TrimAfter
from kvwire.wire import (
    SNAPSHOT_MARK,
    Dialect,
    ReplayRequest,
    WireError,
    pack_seq,
    parse_request,
    replay_end_frames,
    snapshot_end_frames,
    snapshot_refused_frames,
)
from kvwire.wire.codec import encode_parts
from kvwire.wire.framing import announce_blocks

__all__ = ["ReplayServer", "replay_share"]

_REQUESTS_PER_PASS = 16
_SNAPSHOT_CHUNKS = 8  # snapshot messages per job per pass (at most one of them built)
_MAX_SNAPSHOTS = 2  # built at once (each logs the changes made while it runs)
_NO_ROOM = -1
"""What a native send returns when the message does not fit the byte bounds now."""


class _Turns:
    """A lock handed over in the order it was asked for (``threading.Lock`` is not fair:
    a thread that releases and asks again at once usually gets it back)."""

    __slots__ = ("_held", "_mu", "_waiting")

    def __init__(self) -> None:
        self._mu = threading.Lock()
        self._held = False
        self._waiting: deque[threading.Lock] = deque()

    def __enter__(self) -> None:
        with self._mu:
            if not self._held:
                self._held = True
                return
            gate = threading.Lock()
            gate.acquire()
            self._waiting.append(gate)
        try:
            gate.acquire()  # the holder hands the turn over; waiting here holds no GIL
        except BaseException:  # interrupted: leave the line, or pass on a turn handed over
            with self._mu:
                if gate in self._waiting:
                    self._waiting.remove(gate)
                    raise
            self.__exit__()
            raise

    def __exit__(self, *exc: object) -> None:
        with self._mu:
            if self._waiting:
                self._waiting.popleft().release()  # still held: it is the next thread's
            else:
                self._held = False


_TURN = _Turns()
"""One reply slice at a time in this process, whatever publisher serves it, ranks in turn.

Every rank of an engine process has a service thread; when a fleet of routers
restarts, most of them have requests to serve at once. Waiting for a turn costs
no GIL, so the engine's own threads compete for the GIL with one serving thread
instead of one per rank."""
_YIELD_MAX_S = 0.001
"""After a slice, its thread keeps the turn and sleeps as long as the slice took, up to
this: an engine thread waiting for the GIL then takes it within about one slice."""


_MAX_SNDBUF = 2**31 - 1


def replay_share(config: PublisherConfig) -> int:
    """The bytes one reply may have in flight: ``max_replay_bytes / max_replay_jobs``
    (also the replay socket's kernel send buffer, an int for libzmq)."""
    return max(1, min(_MAX_SNDBUF, config.max_replay_bytes // config.max_replay_jobs))


class _Snapshot:
    """One snapshot's chunks, shared by every reply serving it.

    Chunk 0 is an empty batch announcing the rank's block count (so that a
    router can size its tables first; tiny, so that even a decoder's slow
    path reads it at once); the others are built lazily, in order, as the
    first reply reaches each. Immutable once built: each client's pipe
    references the same bytes objects.
    """

    __slots__ = ("blocks", "built", "chunks", "cursor", "next_seq", "users")

    def __init__(self, cursor: SnapshotCursor, rank: int, dialect: Dialect) -> None:
        self.cursor: SnapshotCursor | None = cursor
        self.next_seq = cursor.next_seq
        self.blocks = cursor.announced
        empty = encode_parts(time.time(), [], rank, dialect=dialect)
        self.chunks: list[Payload] = [payload_of(announce_blocks(empty, self.blocks))]
        self.users = 0
        self.built = len(self.chunks[0])  # bytes of the chunks made (once, whoever sends them)

    @property
    def complete(self) -> bool:
        return self.cursor is None

    def chunk(self, i: int) -> tuple[Payload | None, bool]:
        """Chunk ``i`` (``None`` past the last) and whether it was built by this call."""
        if i < len(self.chunks):
            return self.chunks[i], False
        cursor = self.cursor
        if cursor is None:
            return None, False
        encoded = cursor.next_chunk()
        if encoded is None:
            self.release_cursor()
            return None, False
        payload = payload_of(encoded)  # one buffer every client's pipe references
        self.chunks.append(payload)
        self.built += len(payload)
        return payload, True

    def release_cursor(self) -> None:
        """Stop building (complete, or nobody serves it any more): the mirror stops logging for it."""
        if self.cursor is not None:
            self.cursor.close()
            self.cursor = None


class _Job:
    __slots__ = ("account", "conn", "identity", "sent_all", "stalled_since", "taken")

    def __init__(self, identity: bytes, conn: socket.socket | None, account: Account) -> None:
        self.identity = identity
        self.stalled_since: float | None = None
        """Since when the job waits on its client (bytes not taken, or a full pipe)."""
        self.account = account  # its bytes in flight (a new request by the client takes it over)
        self.taken = account.taken  # what the client had taken when last looked at
        self.sent_all = False  # every message handed over; complete once all are taken
        self.conn = conn  # a duplicate of the peer's connection, to drop it (None: cannot)

    def close(self) -> None:
        """Release what the job holds (it is finished or cut off)."""
        conn = self.conn
        if conn is not None:
            self.conn = None
            conn.close()


class _ReplayJob(_Job):
    __slots__ = ("next_seq", "remaining")

    def __init__(
        self,
        identity: bytes,
        conn: socket.socket | None,
        account: Account,
        next_seq: int,
        remaining: int,
    ) -> None:
        super().__init__(identity, conn, account)
        self.next_seq = next_seq
        self.remaining = remaining


class _SnapshotJob(_Job):
    __slots__ = ("index", "snap", "started")

    def __init__(
        self,
        identity: bytes,
        conn: socket.socket | None,
        account: Account,
        snap: _Snapshot,
        fresh: bool,
    ) -> None:
        super().__init__(identity, conn, account)
        self.snap = snap
        self.index = 0  # the next chunk to send
        # A fresh snapshot's first chunk waits a pass: starting it did work.
        self.started = not fresh
        snap.users += 1


class ReplayServer:
    """Answers replay and snapshot requests on ``router`` (one thread only).

    ``replies`` sends on that same socket, in C (replay items from the sender's ring).
    ``sync_mirror`` brings the mirror up to date before a snapshot starts.
    """

    def __init__(
        self,
        router: zmq.Socket[bytes],
        replies: Replies,
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
        self.replies = replies
        self.topic = topic
        self.end_topic = end_topic
        self.config = config
        self.mirror = mirror
        self.sync_mirror = sync_mirror
        self.rank = rank
        self.max_bytes = config.max_replay_bytes
        self.job_bytes = replay_share(config)
        # A shared snapshot is joined while the replay buffer surely covers what followed it.
        self.reuse_seqs = config.buffer_steps // 2
        self._note = note_error
        self._jobs: dict[bytes, _Job] = {}
        self._order: deque[bytes] = deque()
        self._taken = 0  # replies.taken when last looked at (for the trim)
        self._current: _Snapshot | None = None  # the snapshot new requests join
        self._trim = TrimAfter(config.max_replay_bytes)
        self._sent = False  # the current step sent something
        self.requests = 0
        self.served = 0
        self.invalid = 0
        self.dropped = 0
        self.disconnects = 0
        """Clients whose connection was shut down because they took nothing in time."""
        self.snapshots_served = 0
        self.snapshots_refused = 0
        self.snapshots_built = 0
        """Snapshots made; the requests that joined one share its chunks."""
        self.snapshot_bytes_built = 0
        self.bytes_sent = 0
        """Bytes handed to ZeroMQ, counted once per client (shared buffers included)."""

    @property
    def bytes_in_flight(self) -> int:
        """Bytes sent and not yet known to be taken (the bound is ``max_replay_bytes``)."""
        return self.replies.in_flight

    @property
    def peak_bytes_in_flight(self) -> int:
        """The most bytes ever in flight at once."""
        return self.replies.peak

    @property
    def jobs(self) -> int:
        """Replies in progress."""
        return len(self._jobs)

    @property
    def busy(self) -> bool:
        """Whether anything is being served or is still in flight."""
        return bool(self._jobs) or self.replies.in_flight > 0

    def arm(self) -> bool:
        """Before the service thread waits: have it woken (its sender's eventfd) when a client
        next takes something, if a reply has more to send (one that sent all only waits to be
        counted: the timer will do, and 128 ranks' threads woken by every take would compete
        for the GIL with the engine's). Returns whether to wait: ``False`` when a client took
        something since the last look."""
        if any(not job.sent_all for job in self._jobs.values()):
            self.replies.arm()
        return self.replies.taken == self._taken

    def serve(self) -> bool:
        """Read pending requests, then send one slice of the next job that can take one.

        Returns whether anything moved. Jobs whose clients are not reading, or
        that wait for room in the byte budget, are skipped in turn; when none
        can send, the caller waits a moment instead of spinning (holding the
        GIL) over them. One slice at a time in the process (:data:`_TURN`), each
        followed by as long without the GIL.
        """
        with _TURN:
            start = time.perf_counter()
            moved = self._serve()
            if moved:
                time.sleep(min(_YIELD_MAX_S, time.perf_counter() - start))
        return moved

    def _serve(self) -> bool:
        router = self.router
        moved = False
        # Also processes libzmq's commands: pipes of departed or dropped peers go.
        if int(router.getsockopt(zmq.EVENTS)) & zmq.POLLIN:
            for _ in range(_REQUESTS_PER_PASS):
                try:
                    frames = router.recv_multipart(zmq.NOBLOCK, copy=False)
                except zmq.Again:
                    break
                self._request(frames)
                moved = True
        now = time.monotonic()
        taken = self.replies.taken
        self._trim.pending += taken - self._taken
        self._taken = taken
        order = self._order
        for _ in range(len(order)):
            identity = order[0]
            job = self._jobs[identity]
            self._sent = False
            if self._step(job, now):
                order.popleft()
                del self._jobs[identity]
                self._end(job)
                return True
            order.rotate(-1)
            if self._sent:
                return True
        if not self.busy:
            self._trim.idle()
        return moved

    def close(self) -> None:
        """Drop every job (the publisher is closing)."""
        for job in list(self._jobs.values()):
            self._end(job)
        self._jobs.clear()
        self._order.clear()
        self.replies.close()

    # --- accounting ------------------------------------------------------------------

    def _send_payload(self, job: _Job, head: tuple[bytes, ...], payload: Payload) -> bool:
        """Send ``[identity, *head, payload]`` (zero-copy, counted) if it fits the bounds now;
        returns whether it did. Raises ``zmq.Again`` on a full pipe, before anything was sent."""
        rc = self.replies.send(
            job.account, job.identity, head, payload, self.job_bytes, self.max_bytes
        )
        if rc == _NO_ROOM:
            return False
        _raise_for(rc)
        self.bytes_sent += len(payload)
        self._sent = True
        return True

    def _settle(self, job: _Job, now: float) -> None:
        """Count what the job's client took as progress."""
        account = job.account
        taken = account.taken
        if taken != job.taken or not account.in_flight:
            job.taken = taken
            # progress, or nothing the client owes (a full pipe re-marks it)
            job.stalled_since = None
        if job.stalled_since is None and account.in_flight:
            job.stalled_since = now

    def _end(self, job: _Job) -> None:
        """The job leaves; what it sent and is not taken yet stays counted until it is."""
        job.close()
        if isinstance(job, _SnapshotJob):
            snap = job.snap
            snap.users -= 1
            if snap.users == 0:
                snap.release_cursor()
                if self._current is snap:
                    self._current = None

    def _drop_peer(self, job: _Job) -> None:
        """Shut the client's connection down: libzmq then drops its pipe and what it holds."""
        conn = job.conn
        if conn is None:
            return
        with contextlib.suppress(OSError):
            conn.shutdown(socket.SHUT_RDWR)
            self.disconnects += 1

    # --- requests --------------------------------------------------------------------

    def _request(self, frames: list[zmq.Frame]) -> None:
        try:
            request = parse_request([f.buffer for f in frames])
        except WireError as exc:
            self.invalid += 1
            self._note("replay_invalid", f"ignored replay request: {exc}")
            return
        self.requests += 1
        identity = request.identity
        old = self._jobs.pop(identity, None)
        account: Account | None = None
        if old is not None:
            # The client asked again: its new request replaces the old job, and takes over
            # what that sent and its client has not taken (the same pipe, the same account).
            # A reply sent whole counts as served: a subscriber asks for the replay after a
            # snapshot's end at once.
            if old.sent_all:
                self._count_served(old)
            account = old.account
            self._end(old)
        elif len(self._jobs) >= self.config.max_replay_jobs and not self._evict():
            self.dropped += 1
            self._note("replay_busy", "replay request dropped: every replay slot is busy")
            return
        if account is None:
            account = self.replies.account()
        job: _Job
        if isinstance(request, ReplayRequest):
            job = _ReplayJob(identity, _peer(frames), account, request.start_seq, self.config.replay_batches)
        else:
            found = self._join_snapshot(identity)
            if found is None:
                self._remove_from_order(identity)
                return
            snap, fresh = found
            job = _SnapshotJob(identity, _peer(frames), account, snap, fresh)
        self._jobs[identity] = job
        if old is None:
            self._order.append(identity)

    def _evict(self) -> bool:
        """Cut off the job waiting on its client the longest, if any is; returns whether one was."""
        stalled = [j for j in self._jobs.values() if j.stalled_since is not None]
        if not stalled:
            return False
        job = min(stalled, key=lambda j: j.stalled_since or 0.0)
        self._cut(job, "every replay slot is busy and its client is not reading", drop=True)
        del self._jobs[job.identity]
        self._remove_from_order(job.identity)
        self._end(job)
        return True

    def _remove_from_order(self, identity: bytes) -> None:
        with contextlib.suppress(ValueError):
            self._order.remove(identity)

    def _join_snapshot(self, identity: bytes) -> tuple[_Snapshot, bool] | None:
        """The shared snapshot this request is served from, and whether it was just made."""
        mirror = self.mirror
        if mirror is None:  # as the engines' own publishers answer it: a start seq past the buffer
            self._refuse(identity, replay_end_frames(self.end_topic))
            return None
        self.sync_mirror()
        current = self._current
        if mirror.distrust_reason is not None:
            why = f"state cannot be vouched for: {mirror.distrust_reason}"
            self._refuse(identity, snapshot_refused_frames(self.topic, why))
            return None
        if current is not None and mirror.next_seq - current.next_seq <= self.reuse_seqs:
            return current, False
        if mirror.snapshots_in_progress >= _MAX_SNAPSHOTS:
            why = "busy: too many snapshots in progress"
            self._refuse(identity, snapshot_refused_frames(self.topic, why))
            return None
        config = self.config
        cursor = mirror.snapshot(
            self.rank, chunk_blocks=config.snapshot_chunk_blocks, dialect=config.dialect
        )
        snap = _Snapshot(cursor, self.rank, config.dialect)
        self.snapshot_bytes_built += snap.built
        self.snapshots_built += 1
        self._current = snap
        return snap, True

    def _refuse(self, identity: bytes, frames: list[bytes]) -> None:
        self.snapshots_refused += 1
        with contextlib.suppress(zmq.ZMQError):
            self.router.send_multipart([identity, *frames], zmq.NOBLOCK)

    # --- sending -----------------------------------------------------------------------

    def _step(self, job: _Job, now: float) -> bool:
        """Send one slice of ``job``; returns whether the job is finished (or cut off)."""
        self._settle(job, now)
        if job.stalled_since is not None and now - job.stalled_since > self.config.replay_stall_s:
            return self._cut(job, "its client stopped reading", drop=True)
        if job.sent_all:
            if job.account.in_flight:
                return False
            self._count_served(job)
            return True
        try:
            if type(job) is _ReplayJob:
                self._replay_slice(job)
            else:
                assert isinstance(job, _SnapshotJob)
                self._snapshot_slice(job)
        except zmq.Again:  # the pipe is full: the client is not reading
            if job.stalled_since is None:
                job.stalled_since = now
        except zmq.ZMQError as exc:  # EHOSTUNREACH: the client went away
            return self._cut(job, str(exc), drop=False)
        return False

    def _count_served(self, job: _Job) -> None:
        if type(job) is _ReplayJob:
            self.served += 1
        else:
            self.snapshots_served += 1

    def _cut(self, job: _Job, why: str, *, drop: bool) -> bool:
        self.dropped += 1
        self._note("replay_dropped", f"replay abandoned: {why}")
        if drop:
            self._drop_peer(job)
        return True

    def _replay_slice(self, job: _ReplayJob) -> None:
        want = min(RING_TAKE_MAX, job.remaining)  # a pass: one native call
        rc, sent, nbytes, found, next_seq = self.replies.send_range(
            job.account, job.identity, self.topic, job.next_seq, want,
            self.job_bytes, self.max_bytes,
        )  # fmt: skip
        if sent:
            job.next_seq = next_seq
            job.remaining -= sent
            self.bytes_sent += nbytes
            self._sent = True
        _raise_for(rc)
        if sent == found and (job.remaining == 0 or found < want):  # room, and nothing more
            self._send_end(job, replay_end_frames(self.end_topic))

    def _snapshot_slice(self, job: _SnapshotJob) -> None:
        if not job.started:
            job.started = True
            self._sent = True  # it did work: starting the snapshot
            return
        snap = job.snap
        head = (b"", SNAPSHOT_MARK, self.topic, pack_seq(snap.next_seq))
        for _ in range(_SNAPSHOT_CHUNKS):
            if job.index == len(snap.chunks) and self._sent and not snap.complete:
                return  # one chunk built per pass at most
            payload, made = snap.chunk(job.index)
            if made:
                self.snapshot_bytes_built += len(payload or b"")
            if payload is None:
                self._send_end(job, snapshot_end_frames(self.topic, snap.next_seq, len(snap.chunks)))
                return
            if not self._send_payload(job, (*head, pack_seq(job.index)), payload):
                return
            job.index += 1

    def _send_end(self, job: _Job, frames: list[bytes]) -> None:
        """The marker that closes a reply; the job is complete once its client took all."""
        self.router.send_multipart([job.identity, *frames], zmq.NOBLOCK)
        job.sent_all = True
        self._sent = True


def _raise_for(rc: int) -> None:
    """A native send's libzmq errno as pyzmq would raise it (0: none)."""
    if rc == 0:
        return
    if rc == zmq.EAGAIN:
        raise zmq.Again(rc)
    raise zmq.ZMQError(rc)


def _peer(frames: list[zmq.Frame]) -> socket.socket | None:
    """A duplicate of the connection a request came on (so that it can be shut down), or
    ``None`` (inproc, or libzmq does not say)."""
    try:
        fd = int(frames[-1].get(zmq.SRCFD))
    except (zmq.ZMQError, AttributeError, TypeError, ValueError):
        return None
    if fd < 0:
        return None
    try:
        return socket.socket(fileno=os.dup(fd))
    except OSError:
        return None
