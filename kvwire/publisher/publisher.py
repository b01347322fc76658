"""The engine-side event publisher: a live PUB socket and an optional replay ROUTER.

The engine thread only reserves a seq and queues (:meth:`EventPublisher.publish`);
a native sender thread (:mod:`kvwire.publisher._sender`) encodes and sends; a Python
service thread serves replay and snapshots (:mod:`kvwire.publisher.replay`) and
keeps the mirror. The class docstring says what each costs.
"""

from __future__ import annotations

import logging
import secrets
import threading
import time
from dataclasses import asdict, dataclass, fields
from typing import Any, Protocol

import msgspec
import zmq

from kvwire._native import libzmq_path
from kvwire.publisher._sender import Replies, Sender
from kvwire.publisher.batch import CollectedBatch
from kvwire.publisher.config import PublisherConfig
from kvwire.publisher.mirror import Mirror
from kvwire.publisher.replay import ReplayServer, replay_share
from kvwire.ratelog import RateLimitedLog
from kvwire.security import ServerKeys, release_context, secure_server, warn_if_exposed
from kvwire.wire import (
    Dialect,
    KVEventBatch,
    encode_batch,
    epoch_topic,
    format_epoch,
    offset_endpoint,
    validate_endpoints,
)
from kvwire.wire.heartbeat import heartbeat_phase

__all__ = ["DEFAULT_ENDPOINT", "EventPublisher", "PendingBatch", "PublisherStats"]

log = logging.getLogger(__name__)

DEFAULT_ENDPOINT = "tcp://127.0.0.1:5557"
"""Loopback only: events carry users' prompt token ids, so reaching them from
other hosts must be asked for explicitly (e.g. ``tcp://*:5557``)."""

_DEFAULTS = PublisherConfig()
_LOG_INTERVAL_S = 10.0
_PROBLEMS = RateLimitedLog(log, _LOG_INTERVAL_S)
"""The process's publishers share one: a router going away from many ranks at once (a
process serving several ranks) is one line a kind, naming the ranks, not a line a rank."""
_PROBLEMS_LOCK = threading.Lock()  # noted by every publisher's sender and service threads
_MIRROR_EVERY_S = 0.08  # the service thread applies the mirror feed at most this often
_WAIT_FIRST_S = 0.002
_WAIT_MAX_S = 0.25
"""Replies waiting on their clients are looked at again when a client takes something
(libzmq's release of a message wakes the thread: :meth:`ReplayServer.arm`), else after
_WAIT_FIRST_S, then twice as long each time nothing moved, up to this or a quarter of
``replay_stall_s`` (so that a client that stopped reading is cut off on time): 128 ranks
of a process looking every 2 ms while slow routers read took the engine's cores and
GIL."""


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
    """A snapshot of a publisher's counters (batches unless named otherwise).

    ``native_encoded`` batches were encoded by the sender thread without the
    GIL, ``gil_encoded`` by Python with it; ``sender_gil_takes`` counts every
    time the sender thread took the GIL (once at start, then only for
    ``gil_encoded`` batches or a long-unreleased backlog of finished batches).
    ``mirror_pending``: batches encoded but not yet applied to the snapshot
    mirror (it takes them in batches, a few times a second; heartbeats, with
    nothing to mirror, are not counted). ``skipped``: seqs
    left empty by :meth:`EventPublisher.skip`. ``replay_bytes_in_flight``: reply bytes
    handed to ZeroMQ and not yet taken by their clients (at most
    ``max_replay_bytes``); ``replay_disconnects``: clients whose connection was shut
    down because they took nothing for ``replay_stall_s``; ``snapshots_built``:
    snapshots made (requests that came while one was fresh shared its chunks).
    """

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
    native_encoded: int = 0
    gil_encoded: int = 0
    sender_gil_takes: int = 0
    mirror_pending: int = 0
    skipped: int = 0
    replay_bytes_in_flight: int = 0
    replay_disconnects: int = 0
    snapshots_built: int = 0

    def as_dict(self) -> dict[str, int]:
        """The counters by name, e.g. for metrics or a control reply."""
        return asdict(self)


_STATS_FIELDS = {f.name for f in fields(PublisherStats)}
"""What ``stats()`` takes from the sender's counters as they are: those of the same names."""


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

    ``config`` (:class:`~kvwire.publisher.PublisherConfig`) holds every
    setting: the queue bound, replay limits, and kvwire's additions (epoch,
    heartbeats, snapshots), each switchable so that an engine integration can
    stay byte-identical to the engine's own publisher. Snapshots need a replay
    endpoint: without one, ``config.snapshot`` is ignored.

    ``server_keys``: make both sockets CURVE servers admitting only the
    allow-listed client keys (:mod:`kvwire.security`). The publisher stops the
    ZAP handler of a context it made; with a ``context`` passed in (several
    ranks of a process sharing its I/O thread), that is the caller's
    (``kvwire.security.release_context``).

    ``publish()`` never blocks (a batch past ``config.max_queue_size`` is dropped,
    counted and logged at a bounded rate). The sender holds the oldest queued batch
    ``config.send_coalesce_s`` (see there); none waits longer, and a backlog does not wait
    at all (nor does a burst: 64 batches queued wake the sender). While batches
    keep coming (each within 50 ms of the previous one, until 50 ms after the
    last) it looks at the queue every ``send_coalesce_s`` instead of being
    woken, so that ``publish()`` makes no system call at a steady pace; a rank
    publishing now and then, or only heartbeats, is woken instead of polling
    for nothing.

    The sender is a native thread (:mod:`kvwire.publisher._sender`) that encodes a
    collector's batch without the GIL when it keeps the collector's contract
    (:mod:`kvwire.publisher.collector`), byte for byte as :meth:`CollectedBatch.encode`
    would, and copies ``bytes`` already encoded as they are; anything else (a
    ``KVEventBatch``, an engine plugin's batch) is encoded by Python with the GIL taken;
    :meth:`stats` counts both (``native_encoded``, ``gil_encoded``,
    ``sender_gil_takes``). Replay, snapshots and the mirror run on a Python
    thread that sleeps in a poll without the GIL and wakes for requests, and,
    with the mirror on, a few times a second to apply the batches sent since.
    """

    def __init__(
        self,
        endpoint: str = DEFAULT_ENDPOINT,
        replay_endpoint: str | None = None,
        config: PublisherConfig = _DEFAULTS,
        *,
        rank: int = 0,
        server_keys: ServerKeys | None = None,
        context: zmq.Context[Any] | None = None,
    ) -> None:
        if rank < 0:
            raise ValueError(f"rank must be >= 0, got {rank}")
        if not isinstance(config, PublisherConfig):
            raise TypeError(f"config must be a PublisherConfig, got {type(config).__name__}")
        validate_endpoints(endpoint, replay_endpoint, rank + 1)
        self.endpoint = endpoint
        self.replay_endpoint = replay_endpoint
        self.rank = rank
        self.snapshot = config.snapshot and replay_endpoint is not None
        """Whether this publisher serves snapshots (asked for, and a replay endpoint to serve on)."""
        self._config = config
        self.server_keys = server_keys
        self.epoch: bytes | None = (
            format_epoch(
                secrets.randbits(64), heartbeat_s=config.heartbeat_s, snapshot=self.snapshot
            )
            if config.epoch
            else None
        )
        """This instance's epoch (``None`` without one): a new value means a restart."""
        self._topic = epoch_topic(config.topic.encode(), self.epoch)
        self._own_context = context is None
        self._ctx = context
        self._pub: zmq.Socket[bytes] | None = None
        self._router: zmq.Socket[bytes] | None = None
        self._bound: str | None = None
        self._bound_replay: str | None = None
        self._mirror = Mirror() if self.snapshot else None
        self.heartbeat_phase = heartbeat_phase(
            b"%s\0%s\0%d" % (endpoint.encode(), self._topic, rank)
        )
        """Where this publisher's heartbeats after a batch fall in the grid's step, in [0, 1):
        drawn from its endpoint, topic, epoch and rank, so that busy ranks' are spread."""
        # Batches dropped on a full queue still reach the mirror, up to mirror_backlog.
        self._sender = Sender(
            topic=self._topic,
            dialect=config.dialect,
            rank=rank,
            max_queue=config.max_queue_size,
            buffer_steps=config.buffer_steps,
            coalesce_s=config.send_coalesce_s,
            heartbeat_s=config.heartbeat_s or 0.0,
            mirror=self._mirror is not None,
            mirror_backlog=config.mirror_backlog,
            batch_type=CollectedBatch,
            encode=self._encode,
        )
        self._sender.set_heartbeat_phase(self.heartbeat_phase)
        self.publish = self._sender.publish  # type: ignore[method-assign,assignment]
        self._started = False
        self._closed = False
        self._flushed = True
        self._service: threading.Thread | None = None
        self._service_stop = False
        self._lifecycle = threading.Lock()
        self._replay: ReplayServer | None = None
        self._mirror_in_hand = 0  # taken from the feed, being applied
        self._next_log = 0.0
        self._logged_queue_full = 0
        self._logged_send_error = 0
        self._queue_full_logged_at = -_LOG_INTERVAL_S

    # --- engine-thread API -----------------------------------------------------

    def publish(self, batch: KVEventBatch | PendingBatch | bytes) -> bool:
        """Queue ``batch`` for sending; never blocks (beyond a mutex held for a few stores).

        ``bytes`` are a payload already encoded in the publisher's dialect (a relay's, a
        replayed recording's): sent as they are, copied by the sender thread without the
        GIL; the mirror decodes them like any batch (one it cannot read makes it refuse
        snapshots until an ``AllBlocksCleared``).

        The seq is reserved first, so a batch dropped here (queue full, or the
        publisher closed) leaves a gap consumers can see. Returns whether the
        batch was queued. A batch whose ``data_parallel_rank`` is ``None`` is
        sent with this publisher's rank. Safe to call from several threads: the
        seq is reserved and the batch queued atomically, so seq order is queue
        order, wire order and replay order. The call also releases the batches
        the sender has finished with (it cannot without the GIL).

        (Bound to the native sender's ``publish`` on each instance; this body
        documents it.)
        """
        return bool(self._sender.publish(batch))

    def skip(self) -> bool:
        """Leave a gap: reserve the next seq and send nothing under it; never blocks.

        For a producer that knows it lost events it cannot publish (a relay
        whose source dropped some): subscribers see the missing seq as a loss
        that replay cannot fill, and the snapshot mirror stops vouching for
        itself until an ``AllBlocksCleared``. The heartbeat after it comes as
        soon as after a batch, so a gap with nothing after it shows as quickly.
        Returns whether the gap was queued (a drop leaves the same gap).
        """
        return bool(self._sender.skip())

    def direct_sender(self) -> Sender | None:
        """The native sender, for producers that queue on it without ``publish()``
        (the collector's hooks, the engine plugins); ``None`` when ``publish`` was
        replaced on this instance, so that a wrapper still sees every batch."""
        return self._sender if self.publish == self._sender.publish else None

    @property
    def config(self) -> PublisherConfig:
        """The settings in force (``max_queue_size`` and ``send_coalesce_s`` change at run time)."""
        return self._config

    @property
    def send_coalesce_s(self) -> float:
        """How long the sender holds the oldest queued batch (see the class docstring); settable."""
        return self._config.send_coalesce_s

    @send_coalesce_s.setter
    def send_coalesce_s(self, value: float) -> None:
        self._config = msgspec.structs.replace(self._config, send_coalesce_s=value)
        self._sender.set_coalesce(value)

    @property
    def max_queue_size(self) -> int:
        """How many batches may wait for the sender before ``publish()`` drops; settable."""
        return self._config.max_queue_size

    @max_queue_size.setter
    def max_queue_size(self, value: int) -> None:
        self._config = msgspec.structs.replace(self._config, max_queue_size=value)
        self._sender.set_max_queue(value)

    @property
    def queue_depth(self) -> int:
        """Batches waiting for the sender thread."""
        return int(self._sender.stats()["queue_depth"])

    @property
    def last_seq(self) -> int:
        """The seq reserved by the latest ``publish()`` call (or heartbeat); -1 before the first."""
        return int(self._sender.stats()["last_seq"])

    def stats(self) -> PublisherStats:
        """Current counters; cheap, callable from any thread at any time."""
        c = self._sender.stats()
        replay = self._replay
        mirror = self._mirror
        return PublisherStats(
            **{name: n for name, n in c.items() if name in _STATS_FIELDS},
            enqueued=c["last_seq"] + 1 - c["dropped_queue_full"] - c["dropped_closed"],
            replay_served=replay.served if replay else 0,
            replay_invalid=replay.invalid if replay else 0,
            replay_dropped=replay.dropped if replay else 0,
            snapshots_served=replay.snapshots_served if replay else 0,
            snapshots_refused=replay.snapshots_refused if replay else 0,
            mirrored_blocks=mirror.count_blocks() if mirror else 0,
            mirror_pending=c["mirror_feed"] + self._mirror_in_hand,
            replay_bytes_in_flight=replay.bytes_in_flight if replay else 0,
            replay_disconnects=replay.disconnects if replay else 0,
            snapshots_built=replay.snapshots_built if replay else 0,
        )

    def replayable_seqs(self) -> list[int]:
        """The seqs the replay buffer holds, oldest first (for tests and diagnostics)."""
        return list(self._sender.seqs(True))

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
        """Bind the sockets and start the sender and service threads; raises if a bind fails."""
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
                pub.setsockopt(zmq.SNDHWM, self._config.hwm)
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
                    router.setsockopt(zmq.SNDHWM, min(self._config.replay_batches + 2, 256))
                    # And at most a client's share of max_replay_bytes in the kernel's buffer
                    # (autotuned, loopback's took megabytes unread): past that, a client that
                    # does not read shows as one (replay.py).
                    router.setsockopt(zmq.SNDBUF, replay_share(self._config))
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
                # From here on the sender thread is the PUB socket's only user.
                self._sender.start(pub.underlying, libzmq_path())
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
            self._router = router
            if router is not None:
                self._replay = ReplayServer(
                    router,
                    Replies(self._sender, router.underlying, libzmq_path()),
                    self._topic,
                    # Engines close a replay with an empty topic; kvwire with its epoch.
                    end_topic=self._topic if self.epoch is not None else b"",
                    config=self._config,
                    mirror=self._mirror,
                    sync_mirror=self._apply_mirror_feed,
                    rank=self.rank,
                    note_error=self._note_error,
                )
            self._service = threading.Thread(
                target=self._serve, name=f"kvwire-publisher-{self.rank}", daemon=True
            )
            self._started = True
            self._service.start()
            return self

    def close(self, timeout: float = 5.0) -> bool:
        """Stop accepting batches, flush the queue and close, within ``timeout`` s.

        Returns whether every queued batch was handed to ZeroMQ (and, within
        the same deadline, to connected subscribers' sockets). Idempotent.
        """
        with self._lifecycle:
            if self._closed:
                return self._flushed
            self._closed = True
            deadline = time.monotonic() + max(0.0, timeout)
            flushed, joined = self._sender.close(max(0.0, timeout))
            self._flushed = bool(flushed)
            if not self._started:
                return self._flushed
            if joined:
                self._shut_down(deadline)
            else:  # pragma: no cover - timing; a Python encoder stuck past the deadline
                log.error("publisher thread for rank %d did not stop in time", self.rank)
                threading.Thread(
                    target=self._shut_down,
                    args=(deadline,),
                    name="kvwire-publisher-close",
                    daemon=True,
                ).start()
            return self._flushed

    def _shut_down(self, deadline: float) -> None:
        """Once the sender thread ended: stop the service thread, close the sockets."""
        self._sender.join()
        dropped = self._sender.stats()["dropped_closed"]
        if dropped:
            self._note_error("closed", f"{dropped} batches dropped at or after close")
        self._service_stop = True
        self._sender.wake()
        if self._service is not None:
            self._service.join(max(0.0, deadline - time.monotonic()) + 1.0)
            if self._service.is_alive():  # pragma: no cover - a wedged libzmq
                log.error("publisher service thread for rank %d did not stop", self.rank)
        remaining = max(0.0, deadline - time.monotonic())
        assert self._pub is not None
        self._pub.close(linger=int(remaining * 1000))
        if self._replay is not None:
            self._replay.close()
        if self._router is not None:
            self._router.close(linger=0)
        if self._own_context and self._ctx is not None:
            release_context(self._ctx)
            self._ctx.term()
        self._maybe_log(force=True)

    def __enter__(self) -> EventPublisher:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    # --- the sender's Python encoder ------------------------------------------------

    def _encode(self, item: KVEventBatch | PendingBatch | bytes) -> bytes | None:
        """Encode what the native sender leaves to Python (it holds the GIL for this);
        ``None`` when the batch cannot be encoded (counted, logged, a gap)."""
        try:
            if isinstance(item, bytes):  # the sender copies exact bytes itself; a subclass
                return bytes(item)
            if type(item) is KVEventBatch:
                if item.data_parallel_rank is None:
                    item = msgspec.structs.replace(item, data_parallel_rank=self.rank)
                return encode_batch(item, dialect=self._config.dialect)
            return bytes(item.encode(self._config.dialect))  # type: ignore[union-attr]
        except Exception as exc:
            self._note_error("encode", f"a batch could not be encoded: {exc}")
            return None

    # --- service thread: replay, snapshots, the mirror, logging ----------------------

    def _serve(self) -> None:
        sender = self._sender
        replay = self._replay
        mirror = self._mirror
        poller = zmq.Poller()
        poller.register(sender.service_fd, zmq.POLLIN)
        if replay is not None:
            poller.register(replay.router, zmq.POLLIN)
        next_apply = 0.0
        waits = 0  # consecutive waits on clients with nothing moved
        try:
            while not self._service_stop:
                now = time.monotonic()
                if mirror is not None and now >= next_apply:
                    if self._apply_mirror_feed():
                        next_apply = now + _MIRROR_EVERY_S
                    else:
                        sender.arm_feed()  # the next batch sent wakes this thread
                busy = replay.serve() if replay is not None else False
                self._maybe_log()
                if busy:
                    # Served in slices, each followed by a pause without the GIL (replay.py).
                    waits = 0
                    continue
                timeout = _LOG_INTERVAL_S
                if mirror is not None and next_apply > now:
                    timeout = min(timeout, next_apply - now)
                if replay is not None and replay.busy:
                    if not replay.arm():  # a client took something since the last look
                        waits = 0
                        continue
                    wait_max = min(_WAIT_MAX_S, self._config.replay_stall_s / 4)
                    timeout = min(timeout, _WAIT_FIRST_S * 2**waits, wait_max)
                    waits = min(waits + 1, 8)
                else:
                    waits = 0
                if poller.poll(int(timeout * 1000) + 1):
                    sender.clear_wake()
        except Exception:  # pragma: no cover - a bug; keep the engine alive
            log.exception("publisher service thread for rank %d failed", self.rank)

    def _apply_mirror_feed(self) -> bool:
        """Apply the batches the sender encoded since the last call to the mirror, in
        seq order; returns whether there were any. Runs before a snapshot starts, so a
        snapshot is the state as of every batch encoded so far."""
        mirror = self._mirror
        if mirror is None:
            return False
        self._mirror_in_hand = 1  # never 0 while taking: stats() may read in between
        feed = self._sender.take_feed()
        self._mirror_in_hand = len(feed)
        mirror.apply_feed(feed)
        self._mirror_in_hand = 0
        return bool(feed)

    # --- bounded-rate logging ------------------------------------------------------

    def _note_error(self, kind: str, message: str) -> None:
        with _PROBLEMS_LOCK:
            _PROBLEMS.note(kind, message, f"rank {self.rank}")

    def _maybe_log(self, force: bool = False) -> None:
        now = time.monotonic()
        if not force and now < self._next_log:
            return
        self._next_log = now + 0.5
        counts = self._sender.stats()
        dropped = counts["dropped_queue_full"]
        if dropped != self._logged_queue_full and (
            force or now - self._queue_full_logged_at >= _LOG_INTERVAL_S
        ):
            log.warning(
                "rank %d: %d batches dropped because the queue was full "
                "(max_queue_size=%d; %d since start)",
                self.rank,
                dropped - self._logged_queue_full,
                self._config.max_queue_size,
                dropped,
            )
            self._logged_queue_full = dropped
            self._queue_full_logged_at = now
        failed = counts["dropped_send_error"]
        if failed != self._logged_send_error:
            self._note_error(
                "send", f"{failed - self._logged_send_error} batches not sent (libzmq refused them)"
            )
            self._logged_send_error = failed
        with _PROBLEMS_LOCK:
            _PROBLEMS.flush(force)
