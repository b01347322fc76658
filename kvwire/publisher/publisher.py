"""The engine-side event publisher: a live PUB socket and an optional replay ROUTER.

The engine thread only ever reserves a sequence number and appends to a bounded
queue, both under one lock so that seq order is queue order whatever thread
publishes; a background thread encodes, sends, buffers batches for replay,
mirrors the rank's cache for snapshots, heartbeats when idle and serves replay
and snapshot requests (:mod:`kvwire.publisher.replay`). A full queue drops the
batch (counted, logged at a bounded rate) instead of blocking the engine, and
because the seq was reserved first the drop is a visible gap to every consumer.
"""

from __future__ import annotations

import contextlib
import logging
import os
import secrets
import struct
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import asdict, dataclass
from types import TracebackType
from typing import Any, Protocol, cast

import msgspec
import zmq

from kvwire.publisher.mirror import Mirror
from kvwire.publisher.replay import ReplayBuffer, ReplayServer
from kvwire.security import ServerKeys, release_context, secure_server, warn_if_exposed
from kvwire.wire import (
    Dialect,
    KVEventBatch,
    decode_batch,
    encode_batch,
    epoch_topic,
    format_epoch,
    offset_endpoint,
    validate_endpoints,
)
from kvwire.wire.heartbeat import heartbeat_at

__all__ = ["DEFAULT_ENDPOINT", "EventPublisher", "PendingBatch", "PublisherStats"]

log = logging.getLogger(__name__)

DEFAULT_ENDPOINT = "tcp://127.0.0.1:5557"
"""Loopback only: events carry users' prompt token ids, so reaching them from
other hosts must be asked for explicitly (e.g. ``tcp://*:5557``)."""

_LOG_INTERVAL_S = 10.0
_CHUNK_BATCHES = 64  # batches encoded, then sent back to back, per pass
_CHUNK_S = 0.0005  # or fewer, when encoding them takes longer than this
_pack_seq = struct.Struct(">Q").pack


class PendingBatch(Protocol):
    """A batch whose encoding is deferred to the publisher's thread.

    :class:`~kvwire.publisher.EventCollector` hands these over so that the
    conversion and msgpack encoding stay off the engine thread.
    """

    def encode(self, dialect: Dialect) -> bytes:
        """The batch's msgpack payload in ``dialect``."""
        ...


@dataclass(frozen=True)
class PublisherStats:
    """A snapshot of a publisher's counters (batches unless named otherwise)."""

    enqueued: int
    published: int
    dropped_queue_full: int
    dropped_send_error: int
    dropped_encode_error: int
    dropped_closed: int
    replay_served: int
    replay_invalid: int
    replay_dropped: int
    queue_depth: int
    last_seq: int
    heartbeats: int = 0
    snapshots_served: int = 0
    snapshots_refused: int = 0
    mirrored_blocks: int = 0

    def as_dict(self) -> dict[str, int]:
        """The counters by name, e.g. for metrics or a control reply."""
        return asdict(self)


class _Wakeup:
    """A file descriptor the engine thread makes readable to wake the sender.

    Closed once, by whichever side finishes last; a ``set()`` after that does
    nothing, so a descriptor number the system has since given to another
    file is never written.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._closed = False
        if hasattr(os, "eventfd"):
            self.fd = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)
            self._write_fd = self.fd
            self._eventfd = True
        else:  # pragma: no cover - non-Linux
            self.fd, self._write_fd = os.pipe()
            os.set_blocking(self.fd, False)
            os.set_blocking(self._write_fd, False)
            self._eventfd = False

    def set(self) -> None:
        with self._lock:
            if self._closed:
                return
            with contextlib.suppress(BlockingIOError):
                if self._eventfd:
                    os.eventfd_write(self.fd, 1)
                else:  # pragma: no cover - non-Linux
                    os.write(self._write_fd, b"\0")

    def clear(self) -> None:
        with contextlib.suppress(BlockingIOError):
            if self._eventfd:
                os.eventfd_read(self.fd)
            else:  # pragma: no cover - non-Linux
                os.read(self.fd, 4096)

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            os.close(self.fd)
            if self._write_fd != self.fd:  # pragma: no cover - non-Linux
                os.close(self._write_fd)


def _fast_send(sock: zmq.Socket[bytes]) -> Callable[[bytes | zmq.Frame, int], Any]:
    """``sock.send`` without the Python-level convenience layer (a third of the cost)."""
    base = getattr(zmq.backend, "Socket", None)
    if base is not None and isinstance(sock, base):
        bound: Callable[[bytes | zmq.Frame, int], Any] = base.send.__get__(sock)
        return bound
    return cast("Callable[[bytes | zmq.Frame, int], Any]", sock.send)


class EventPublisher:
    """Publishes KV-event batches on a ZeroMQ PUB socket, with optional replay.

    ``endpoint`` and ``replay_endpoint`` are base endpoints: rank ``r`` binds
    ``offset_endpoint(endpoint, r)`` (tcp port + r, ipc/inproc ``_dp{r}``); a
    port of ``*`` binds an ephemeral port for every rank, reported by
    :attr:`bound_endpoint` and :attr:`bound_replay_endpoint`. The default binds
    loopback only; binding other interfaces (``tcp://*:5557``, a host address)
    exposes prompt token ids to the network, must be asked for explicitly and is
    logged as a warning for each socket. Live messages are ``[topic, seq,
    payload]``; replay and snapshots follow ``docs/wire.md`` (DEALER and REQ
    clients).

    ``publish()`` never blocks: at most ``max_queue_size`` batches wait for the
    sender thread, beyond that a batch is dropped and counted. ``hwm`` is the
    PUB socket's per-subscriber send high-water mark; a subscriber that falls
    that far behind loses messages inside ZeroMQ and sees a seq gap.
    ``buffer_steps`` batches are kept for replay; one replay request is answered
    with at most ``max_replay_batches`` of them, served in chunks between live
    sends, at most ``max_replay_jobs`` at once, each cut off after
    ``replay_stall_s`` seconds without progress.

    kvwire's additions, each switchable so that an engine integration can stay
    byte-identical to the engine's own publisher:

    - ``epoch``: a random 64-bit id per instance, appended to every topic frame
      (live, replay, snapshot) as ``\\x00sgl-kv-epoch=kvw1.<hex>[.hb<ms>][.snap]``.
    - ``heartbeat``: the interval (s) of the wall-clock grid on which the sender
      thread publishes an empty batch on the next seq when nothing went out in
      the last half interval (:mod:`kvwire.wire.heartbeat`), so a trailing drop
      is a visible gap within 1.5 intervals and a fleet's heartbeats arrive
      together (``None``: never).
    - ``snapshot``: with a replay endpoint, keep a mirror of the rank's cache
      and serve snapshots of it (``[b"", b"kvwire-snapshot"]`` requests), in
      chunks of at most ``snapshot_chunk_blocks`` blocks. Batches dropped on a
      full queue are still mirrored (up to ``mirror_backlog`` of them held for
      that, apart from the queue), so a snapshot repairs the gap they leave;
      see :mod:`kvwire.publisher.mirror`.
    - ``server_keys``: make both sockets CURVE servers admitting only the
      allow-listed client keys (:mod:`kvwire.security`). The publisher stops
      the ZAP handler of a context it made; with a ``context`` passed in, that
      is the caller's (``kvwire.security.release_context``).

    ``coalesce_s``: when a batch arrives at an idle sender, the sender waits
    this long (not holding the GIL) before encoding and sending. The engine
    thread that just published is then usually waiting on the GPU rather than
    launching kernels, so the two threads do not fight over the GIL, and batches
    that arrive meanwhile share one wake-up. It delays each batch by at most
    that much; 0 sends at once. Under a backlog there is no waiting.
    """

    def __init__(
        self,
        endpoint: str = DEFAULT_ENDPOINT,
        replay_endpoint: str | None = None,
        *,
        rank: int = 0,
        buffer_steps: int = 10_000,
        hwm: int = 100_000,
        max_queue_size: int = 100_000,
        topic: str = "",
        max_replay_batches: int = 10_000,
        dialect: Dialect = "map",
        ranks_per_host: int | None = None,
        coalesce_s: float = 0.002,
        epoch: bool = True,
        heartbeat: float | None = 1.0,
        snapshot: bool = True,
        server_keys: ServerKeys | None = None,
        max_replay_jobs: int = 64,
        replay_stall_s: float = 2.0,
        snapshot_chunk_blocks: int = 4096,
        mirror_backlog: int = 100_000,
        context: zmq.Context[Any] | None = None,
    ) -> None:
        if rank < 0:
            raise ValueError(f"rank must be >= 0, got {rank}")
        for name, value in (
            ("buffer_steps", buffer_steps),
            ("hwm", hwm),
            ("max_queue_size", max_queue_size),
            ("mirror_backlog", mirror_backlog),
            ("max_replay_batches", max_replay_batches),
            ("max_replay_jobs", max_replay_jobs),
            ("snapshot_chunk_blocks", snapshot_chunk_blocks),
        ):
            if value < 1:
                raise ValueError(f"{name} must be >= 1, got {value}")
        if dialect not in ("map", "array"):
            raise ValueError(f"unknown dialect {dialect!r}: expected 'map' or 'array'")
        if coalesce_s < 0:
            raise ValueError(f"coalesce_s must be >= 0, got {coalesce_s}")
        if heartbeat is not None and not 0.001 <= heartbeat <= 3600:
            raise ValueError(f"heartbeat must be None or 0.001..3600 s, got {heartbeat}")
        if not replay_stall_s > 0:
            raise ValueError(f"replay_stall_s must be > 0, got {replay_stall_s}")
        validate_endpoints(endpoint, replay_endpoint, ranks_per_host or rank + 1)
        self.endpoint = endpoint
        self.replay_endpoint = replay_endpoint
        self.rank = rank
        self.buffer_steps = buffer_steps
        self.hwm = hwm
        self.topic = topic
        self.max_replay_batches = max_replay_batches
        self.dialect: Dialect = dialect
        self.coalesce_s = coalesce_s
        self.heartbeat = heartbeat
        self.snapshot = snapshot and replay_endpoint is not None
        self.server_keys = server_keys
        self.max_replay_jobs = max_replay_jobs
        self.replay_stall_s = replay_stall_s
        self.snapshot_chunk_blocks = snapshot_chunk_blocks
        self.epoch: bytes | None = (
            format_epoch(secrets.randbits(64), heartbeat_s=heartbeat, snapshot=self.snapshot)
            if epoch
            else None
        )
        """This instance's epoch (``None`` without one): a new value means a restart."""
        self._topic = epoch_topic(topic.encode(), self.epoch)
        self._max_queue = max_queue_size
        self._own_context = context is None
        self._ctx = context
        self._pub: zmq.Socket[bytes] | None = None
        self._router: zmq.Socket[bytes] | None = None
        self._bound: str | None = None
        self._bound_replay: str | None = None

        self._queue: deque[tuple[int, KVEventBatch | PendingBatch]] = deque()
        self._seq_lock = threading.Lock()
        self._next_seq = 0
        self._wakeup: _Wakeup | None = None
        self._idle = False  # True while the sender waits; the next publish wakes it
        self._started = False
        self._closed = False
        self._stopping = False
        self._flushed = True
        self._thread: threading.Thread | None = None
        self._lifecycle = threading.Lock()
        self._buffer: ReplayBuffer = deque(maxlen=buffer_steps)
        self._mirror = Mirror() if self.snapshot else None
        # Batches dropped on a full queue, kept (up to mirror_backlog) for the mirror alone.
        self._mirror_backlog = mirror_backlog
        self._unsent: deque[tuple[int, KVEventBatch | PendingBatch]] | None = (
            deque() if self._mirror is not None else None
        )
        self._replay: ReplayServer | None = None

        self._dropped_queue_full = 0
        self._dropped_closed = 0
        self._published = 0
        self._heartbeats = 0
        self._dropped_send_error = 0
        self._dropped_encode_error = 0
        self._problems = _RateLimitedLog(rank)
        self._next_log = 0.0
        self._logged_queue_full = 0
        self._queue_full_logged_at = -_LOG_INTERVAL_S
        self._deadline = 0.0
        self._last_sent = 0.0

    # --- engine-thread API -----------------------------------------------------

    def publish(self, batch: KVEventBatch | PendingBatch) -> bool:
        """Queue ``batch`` for sending; never blocks (beyond a lock held for a few bytecodes).

        The seq is reserved first, so a batch dropped here (queue full, or the
        publisher closed) leaves a gap consumers can see. Returns whether the
        batch was queued. A batch whose ``data_parallel_rank`` is ``None`` is
        sent with this publisher's rank. Safe to call from several threads: the
        seq is reserved and the batch queued atomically, so seq order is queue
        order, wire order and replay order.
        """
        lock = self._seq_lock
        lock.acquire()
        seq = self._next_seq
        self._next_seq = seq + 1
        queue = self._queue
        if self._closed:
            self._dropped_closed += 1
            lock.release()
            return False
        if len(queue) >= self._max_queue:
            self._dropped_queue_full += 1
            unsent = self._unsent
            if unsent is not None and len(unsent) < self._mirror_backlog:
                unsent.append((seq, batch))  # never sent, but the mirror learns it
            lock.release()
            return False
        queue.append((seq, batch))
        lock.release()
        if self._idle:
            self._idle = False
            wakeup = self._wakeup
            if wakeup is not None:
                wakeup.set()
        return True

    @property
    def max_queue_size(self) -> int:
        """How many batches may wait for the sender before ``publish()`` drops."""
        return self._max_queue

    @max_queue_size.setter
    def max_queue_size(self, value: int) -> None:
        if value < 1:
            raise ValueError(f"max_queue_size must be >= 1, got {value}")
        self._max_queue = value

    @property
    def queue_depth(self) -> int:
        """Batches waiting for the sender thread."""
        return len(self._queue)

    @property
    def last_seq(self) -> int:
        """The seq reserved by the latest ``publish()`` call (or heartbeat); -1 before the first."""
        return self._next_seq - 1

    def stats(self) -> PublisherStats:
        """Current counters; cheap, callable from any thread at any time."""
        with self._seq_lock:
            last = self._next_seq - 1
            depth = len(self._queue)
            dropped = self._dropped_queue_full + self._dropped_closed
            full = self._dropped_queue_full
            closed = self._dropped_closed
        replay = self._replay
        mirror = self._mirror
        return PublisherStats(
            enqueued=last + 1 - dropped,
            published=self._published,
            dropped_queue_full=full,
            dropped_send_error=self._dropped_send_error,
            dropped_encode_error=self._dropped_encode_error,
            dropped_closed=closed,
            replay_served=replay.served if replay else 0,
            replay_invalid=replay.invalid if replay else 0,
            replay_dropped=replay.dropped if replay else 0,
            queue_depth=depth,
            last_seq=last,
            heartbeats=self._heartbeats,
            snapshots_served=replay.snapshots_served if replay else 0,
            snapshots_refused=replay.snapshots_refused if replay else 0,
            mirrored_blocks=mirror.approx_blocks if mirror else 0,
        )

    @property
    def bound_endpoint(self) -> str:
        """The endpoint the PUB socket is bound to (resolved); requires ``start()``."""
        if self._bound is None:
            raise RuntimeError("publisher is not started")
        return self._bound

    @property
    def bound_replay_endpoint(self) -> str | None:
        """The replay ROUTER's bound endpoint, or ``None`` without replay."""
        if not self._started:
            raise RuntimeError("publisher is not started")
        return self._bound_replay

    # --- lifecycle ---------------------------------------------------------------

    def start(self) -> EventPublisher:
        """Bind the sockets and start the sender thread; raises if a bind fails."""
        with self._lifecycle:
            if self._closed:
                raise RuntimeError("publisher is closed")
            if self._started:
                return self
            ctx = self._ctx if self._ctx is not None else zmq.Context(io_threads=1)
            keys = self.server_keys
            pub: zmq.Socket[bytes] | None = None
            router: zmq.Socket[bytes] | None = None
            try:
                pub = ctx.socket(zmq.PUB)
                pub.setsockopt(zmq.SNDHWM, self.hwm)
                pub.setsockopt(zmq.LINGER, 0)
                if keys is not None:
                    secure_server(pub, keys)
                address = offset_endpoint(self.endpoint, self.rank)
                warn_if_exposed(log, address, "KV event PUB socket", secured=keys is not None)
                pub.bind(address)
                self._bound = pub.getsockopt_string(zmq.LAST_ENDPOINT)
                if self.replay_endpoint is not None:
                    router = ctx.socket(zmq.ROUTER)
                    # Replies go at the client's pace: a never-reading client holds
                    # at most this many (shared) messages in its pipe.
                    router.setsockopt(zmq.SNDHWM, min(self.max_replay_batches + 2, 256))
                    router.setsockopt(zmq.RCVHWM, 1000)
                    router.setsockopt(zmq.MAXMSGSIZE, 1024)
                    router.setsockopt(zmq.ROUTER_MANDATORY, 1)
                    router.setsockopt(zmq.LINGER, 0)
                    if keys is not None:
                        secure_server(router, keys)
                    address = offset_endpoint(self.replay_endpoint, self.rank)
                    warn_if_exposed(
                        log, address, "KV event replay socket", secured=keys is not None
                    )
                    router.bind(address)
                    self._bound_replay = router.getsockopt_string(zmq.LAST_ENDPOINT)
            except BaseException:
                for sock in (pub, router):
                    if sock is not None:
                        sock.close(linger=0)
                if self._own_context:
                    release_context(ctx)
                    ctx.term()
                raise
            self._ctx = ctx
            self._pub = pub
            self._send = _fast_send(pub)
            self._router = router
            if router is not None:
                self._replay = ReplayServer(
                    router,
                    self._buffer,
                    self._topic,
                    # Engines close a replay with an empty topic; kvwire with its epoch.
                    end_topic=self._topic if self.epoch is not None else b"",
                    max_batches=self.max_replay_batches,
                    mirror=self._mirror,
                    rank=self.rank,
                    dialect=self.dialect,
                    note_error=self._note_error,
                    max_jobs=self.max_replay_jobs,
                    stall_s=self.replay_stall_s,
                    snapshot_chunk_blocks=self.snapshot_chunk_blocks,
                )
            self._wakeup = _Wakeup()
            self._thread = threading.Thread(
                target=self._run, name=f"kvwire-publisher-{self.rank}", daemon=True
            )
            self._started = True
            self._last_sent = time.monotonic()
            self._thread.start()
            return self

    def close(self, timeout: float = 5.0) -> bool:
        """Stop accepting batches, flush the queue and close, within ``timeout`` s.

        Returns whether every queued batch was handed to ZeroMQ (and, within
        the same deadline, to connected subscribers' sockets). Idempotent.
        """
        with self._lifecycle:
            if self._closed:
                return self._flushed
            with self._seq_lock:
                self._closed = True
            if not self._started or self._thread is None:
                self._flushed = not self._queue
                self._queue.clear()
                return self._flushed
            self._deadline = time.monotonic() + max(0.0, timeout)
            self._stopping = True
            assert self._wakeup is not None
            self._wakeup.set()
            self._thread.join(max(0.0, timeout) + 1.0)
            if self._thread.is_alive():  # pragma: no cover - a wedged libzmq
                log.error("publisher thread for rank %d did not stop in time", self.rank)
                self._flushed = False
            return self._flushed

    def __enter__(self) -> EventPublisher:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    # --- sender thread -------------------------------------------------------------

    def _run(self) -> None:
        pub = self._pub
        replay = self._replay
        wakeup = self._wakeup
        assert pub is not None and wakeup is not None
        poller = zmq.Poller()
        poller.register(wakeup.fd, zmq.POLLIN)
        if replay is not None:
            poller.register(replay.router, zmq.POLLIN)
        queue = self._queue
        heartbeat = self.heartbeat
        try:
            while True:
                busy = self._send_live()
                if replay is not None:
                    busy = replay.serve() or busy
                self._maybe_log()
                if self._stopping and (not queue or time.monotonic() >= self._deadline):
                    break
                if busy:
                    continue
                timeout = 500.0
                if heartbeat is not None and not self._stopping:
                    now = time.monotonic()
                    due = heartbeat_at(self._last_sent, heartbeat, now, time.time()) - now
                    if due <= 0:
                        self._heartbeat()
                        continue
                    timeout = min(timeout, due * 1000 + 1)
                self._idle = True
                if queue or self._stopping:
                    self._idle = False
                    continue
                poller.poll(2 if replay is not None and replay.jobs else int(timeout))
                self._idle = False
                wakeup.clear()
                if self.coalesce_s and queue and not self._stopping:
                    time.sleep(self.coalesce_s)
        except Exception:  # pragma: no cover - a bug; keep the engine alive
            log.exception("publisher thread for rank %d failed", self.rank)
        finally:
            self._idle = False
            with self._seq_lock:
                self._flushed = not queue
                if queue:
                    self._dropped_closed += len(queue)
                    self._note_error("closed", f"{len(queue)} queued batches dropped at close")
                    queue.clear()
            remaining = max(0.0, self._deadline - time.monotonic()) if self._stopping else 0.0
            pub.close(linger=int(remaining * 1000))
            if replay is not None:
                replay.close()
                replay.router.close(linger=0)
            if self._own_context and self._ctx is not None:
                release_context(self._ctx)
                self._ctx.term()
            wakeup.close()
            self._maybe_log(force=True)

    def _heartbeat(self) -> None:
        """Publish an empty batch on the next seq, through ``publish()``'s own atomic path."""
        self._last_sent = time.monotonic()
        if self.publish(KVEventBatch(time.time(), [], self.rank)):
            self._heartbeats += 1

    def _send_live(self) -> bool:
        """Encode, then send, up to one chunk of queued batches; returns whether more wait.

        Sending a chunk back to back lets libzmq's I/O thread write many
        messages per wake-up instead of one. Each payload becomes one
        ``zmq.Frame`` that the PUB socket, the replay buffer and every replay
        share.
        """
        queue = self._queue
        unsent = self._unsent
        if unsent:
            self._mirror_unsent(None)
        if not queue:
            return bool(unsent)
        mirror = self._mirror
        ready: list[tuple[int, zmq.Frame]] = []
        deadline = time.perf_counter() + _CHUNK_S
        while queue and len(ready) < _CHUNK_BATCHES:
            seq, item = queue.popleft()
            if unsent and unsent[0][0] < seq:
                self._mirror_unsent(seq)
            try:
                payload = self._encode(item)
            except Exception as exc:
                self._dropped_encode_error += 1
                self._note_error("encode", f"batch seq {seq} could not be encoded: {exc}")
                if mirror is not None:
                    mirror.skip(seq, "it could not be encoded")
                continue
            if mirror is not None:
                self._mirror_batch(mirror, seq, item, payload)
            ready.append((seq, zmq.Frame(payload)))
            if self._stopping and time.monotonic() >= self._deadline:
                break
            if not len(ready) & 7 and time.perf_counter() >= deadline:
                break
        topic = self._topic
        more = zmq.SNDMORE | zmq.NOBLOCK
        noblock = zmq.NOBLOCK
        pack = _pack_seq
        send = self._send
        failed = 0
        for seq, frame in ready:
            try:
                send(topic, more)
                send(pack(seq), more)
                send(frame, noblock)
            except zmq.ZMQError as exc:
                failed += 1
                self._note_error("send", f"batch seq {seq} not sent: {exc}")
        self._published += len(ready) - failed
        self._dropped_send_error += failed
        self._buffer.extend(ready)
        if ready:
            self._last_sent = time.monotonic()
        return bool(queue)

    def _encode(self, item: KVEventBatch | PendingBatch) -> bytes:
        if type(item) is KVEventBatch:
            if item.data_parallel_rank is None:
                item = msgspec.structs.replace(item, data_parallel_rank=self.rank)
            return encode_batch(item, dialect=self.dialect)
        return item.encode(self.dialect)  # type: ignore[union-attr]

    def _mirror_unsent(self, before: int | None) -> None:
        """Mirror, in seq order, the dropped batches below ``before`` (``None``: below every
        batch still queued or yet to come)."""
        unsent = self._unsent
        mirror = self._mirror
        assert unsent is not None and mirror is not None
        if before is None:
            with self._seq_lock:  # a consistent bound: queue head, or the next seq
                before = self._queue[0][0] if self._queue else self._next_seq
        while unsent and unsent[0][0] < before:
            seq, item = unsent.popleft()
            try:
                payload = self._encode(item)
            except Exception:
                mirror.skip(seq, "it could not be encoded")
                continue
            self._mirror_batch(mirror, seq, item, payload)

    def _mirror_batch(
        self, mirror: Mirror, seq: int, item: KVEventBatch | PendingBatch, payload: bytes
    ) -> None:
        """Feed the mirror what subscribers will decode (hashes normalised as they see them).

        A collector's batch hands over the parts it just encoded when they are
        already in that form; anything else is decoded from its payload.
        """
        events = None
        if type(item) is not KVEventBatch:
            take = getattr(item, "mirror_events", None)
            if take is not None:
                events = take()
        if events is None:
            try:
                events = decode_batch(payload).events
            except Exception as exc:  # pragma: no cover - encode and decode disagree
                mirror.skip(seq, f"its payload did not decode: {exc}")
                return
        mirror.apply_events(seq, events)

    # --- bounded-rate logging ------------------------------------------------------

    def _note_error(self, kind: str, message: str) -> None:
        self._problems.note(kind, message)

    def _maybe_log(self, force: bool = False) -> None:
        now = time.monotonic()
        if not force and now < self._next_log:
            return
        self._next_log = now + 0.5
        dropped = self._dropped_queue_full
        if dropped != self._logged_queue_full and (
            force or now - self._queue_full_logged_at >= _LOG_INTERVAL_S
        ):
            log.warning(
                "rank %d: %d batches dropped because the queue was full "
                "(max_queue_size=%d; %d since start)",
                self.rank,
                dropped - self._logged_queue_full,
                self._max_queue,
                dropped,
            )
            self._logged_queue_full = dropped
            self._queue_full_logged_at = now
        self._problems.emit(now, force)


class _RateLimitedLog:
    """Logs each kind of problem at most once per interval, with a count of repeats."""

    def __init__(self, rank: int, interval: float = _LOG_INTERVAL_S) -> None:
        self._rank = rank
        self._interval = interval
        self._pending: dict[str, tuple[str, int]] = {}
        self._last: dict[str, float] = {}

    def note(self, kind: str, message: str, count: int = 1) -> None:
        _, seen = self._pending.get(kind, ("", 0))
        self._pending[kind] = (message, seen + count)

    def emit(self, now: float, force: bool = False) -> None:
        for kind in list(self._pending):
            if not force and now - self._last.get(kind, -self._interval) < self._interval:
                continue
            message, count = self._pending.pop(kind)
            self._last[kind] = now
            suffix = f" ({count} such problems since the last report)" if count > 1 else ""
            log.warning("rank %d: %s%s", self._rank, message, suffix)
