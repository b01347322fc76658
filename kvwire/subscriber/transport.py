"""The ZeroMQ transport around :class:`RankStream`: sockets, connection events, time.

One event loop serves every rank. Each rank has a SUB socket for live batches
and its monitor (connection events); a replay DEALER exists only while a
replay or snapshot request is out, and is closed once the stream has nothing
pending, so a rank at rest holds three sockets (one TCP connection). Every
socket's ZeroMQ file descriptor is registered with the asyncio loop's
selector (epoll), so a wake-up costs in proportion to the ranks that have
something to read, not to the ranks followed; a ready socket is read to the
end in one native call (:mod:`kvwire.subscriber.receive`), and a monitor only
when its descriptor signalled; the heartbeats at the head of a SUB in sequence
are only counted there (:func:`~kvwire.subscriber.receive.drain_beats`). One
timer heap holds every rank's next deadline (replay timeouts, retries, idle
probes) behind a single loop timer, except the deadline of a rank in sequence
that only waits for its publisher's next heartbeat: live messages keep moving
it, so a sweep once a heartbeat interval reads those, and only a rank gone
silent gets a timer.

A rank is always serviced in the same order: connection events first
(draining the SUB before a disconnect, so the old connection's batches come
before it), then live batches, then replay replies. That order is what
RankStream relies on: a replay reply is never read before a disconnect that
came before it, and a connection event comes before the live batches and
replies that follow it.

Batches go to a sink (:class:`EventSink`) or, without one, to an async
iterator of :data:`SinkItem`; a sink that reads payload bytes itself
(:class:`PayloadSink`) gets them for every batch its stream vouched for.
``Subscriber.start()`` runs the same loop on a background thread for callers
that are not async.
"""

from __future__ import annotations

import asyncio
import contextlib
import heapq
import itertools
import logging
import resource
import select
import threading
import time
from collections import deque
from collections.abc import AsyncIterator, Callable, Iterable
from types import TracebackType
from typing import Any, cast

import msgspec
import zmq
from zmq.utils.monitor import parse_monitor_message

from kvwire.security import secure_client
from kvwire.subscriber.actions import (
    Action,
    Apply,
    ApplyPayload,
    ClearRank,
    Reconnect,
    RequestReplay,
    RequestSnapshot,
    StateChanged,
)
from kvwire.subscriber.receive import drain, drain_beats
from kvwire.subscriber.sink import Applied, Cleared, EventSink, PayloadSink, SinkItem
from kvwire.subscriber.source import EngineSource, RankEndpoints
from kvwire.subscriber.state import RankState, RankStatus, StreamConfig
from kvwire.subscriber.stream import RankStream
from kvwire.wire import replay_request_frames, snapshot_request_frames

__all__ = ["ResourceLimitError", "Subscriber"]

log = logging.getLogger("kvwire.subscriber")

_MONITOR_EVENTS = zmq.EVENT_HANDSHAKE_SUCCEEDED | zmq.EVENT_DISCONNECTED
_BURST = 256  # live messages read from one rank before the others get a turn
_LIVE_FRAMES = 3  # [topic, seq, payload]; a longer message is read as () and counted
_REPLY_FRAMES = 6  # the longest replay reply (a snapshot chunk)
_MONITOR_FRAMES = 2  # [event and value, endpoint]
_DRAIN_BEFORE_DISCONNECT = 1_000_000
_REPLAY_RCVHWM = 1024  # replay reply messages queued unread per rank
_MAX_TIMER_S = 5.0  # a rank's deadline is re-read at least this often
_CONTACT_S = 5.0  # a first contact holds its slot at most this long
_RECONNECT_MIN_S = 0.1  # the SUB's own reconnect interval, and its maximum
_RECONNECT_MAX_S = 1.0
_LOG_INTERVAL_S = 10.0
_END = object()

# Resources per followed rank: SUB and the two ends of its monitor are three
# ZeroMQ sockets, each with a mailbox file descriptor, plus the TCP connection.
_SOCKETS_PER_RANK = 3
_FDS_PER_RANK = 4
_FDS_PER_REPLAY = 2  # a replay DEALER's mailbox and its connection
_FD_MARGIN = 256  # the rest of the process: Python, logs, the sink, libzmq's own
_SOCKET_MARGIN = 64

DEFAULT_MAX_MESSAGE_SIZE = 64 << 20


class ResourceLimitError(RuntimeError):
    """The process or ZeroMQ context cannot open the sockets the sources need."""


class _Link:
    """One rank of one source: its stream, sockets and timer."""

    __slots__ = (
        "closed",
        "connecting_since",
        "dealer",
        "dealer_fd",
        "dealer_token",
        "endpoints",
        "keys",
        "monitor",
        "monitor_fd",
        "next_log",
        "queued",
        "rank",
        "reconnect_at",
        "reconnect_delay",
        "stream",
        "sub",
        "sub_fd",
        "timer_at",
        "topic",
        "worker_id",
    )

    def __init__(self, source: EngineSource, endpoints: RankEndpoints, stream: RankStream) -> None:
        self.worker_id = source.worker_id
        self.keys = source.keys
        self.topic = source.topic.encode()
        self.rank = endpoints.rank
        self.endpoints = endpoints
        self.stream = stream
        self.sub: zmq.Socket[bytes] | None = None
        self.sub_fd = -1
        self.monitor: zmq.Socket[bytes] | None = None
        self.monitor_fd = -1
        self.dealer: zmq.Socket[bytes] | None = None
        self.dealer_fd = -1
        self.dealer_token = 0
        self.queued: tuple[list[bytes], int] | None = None  # a request waiting for a socket
        self.timer_at: float | None = None
        self.closed = False
        self.connecting_since: float | None = None  # holds a first-contact slot
        self.reconnect_at: float | None = None  # when to connect the SUB again ourselves
        self.reconnect_delay = 0.0  # grows while connections fail before their handshake
        self.next_log = 0.0


class Subscriber:
    """Follows every rank of every source and feeds an ordered stream to a sink.

    ``sink`` gets ``apply(worker_id, rank, batch)`` for each batch in
    publisher order and ``clear(worker_id, rank)`` when a rank's state must
    go (publisher restart, unrecoverable loss, source removed); a
    :class:`PayloadSink` (such as ``PrefixIndex``) gets
    ``apply_payload(worker_id, rank, payload, limits)`` instead for each batch
    whose bytes its stream vouched ``decode_batch`` accepts. Without a
    sink, iterate the subscriber (``async for item in sub``) for the same
    items as :class:`Applied` / :class:`Cleared`.

    Run it with ``await sub.run()``, ``async with sub:``, or ``sub.start()``
    / ``sub.stop()`` on a background thread. ``config`` tunes every rank's
    :class:`RankStream` (its ``replay`` flag is set per source from whether
    the source has a replay endpoint). ``rcvhwm`` bounds each SUB socket's
    queue; ``queue_size`` bounds the iterator's backlog before reading stops
    (and the publisher's high-water mark turns the excess into visible gaps).

    Scale: one process follows thousands of ranks. At start (and in
    :meth:`add_source`) the process's open-file soft limit is raised to what
    the ranks need (about four descriptors per rank), and a clear
    :class:`ResourceLimitError` says so when the hard limit is too low; a
    context made here allows every socket ZeroMQ can. ``probe_rate`` caps the
    idle probes of all ranks together (per second): each rank's
    ``idle_probe`` interval is stretched to ``ranks / probe_rate`` when that
    is longer, so probing a large fleet at rest costs a bounded amount.
    ``max_replays`` bounds the replay sockets open at once (further requests
    wait for one to close) and the ranks making first contact at once (the
    others connect as those settle, or after 5 s).

    ``coalesce_s``: after a round of reading the loop waits this long before
    it listens again (2 ms by default; 0 reads at once): batches of many ranks
    are then read in one wake-up, which is what keeps a large, lightly loaded
    fleet cheap. It delays a batch by at most that much.

    ``max_message_size`` (bytes, default 64 MiB) is the ZeroMQ size limit on
    every receiving socket (SUB and replay DEALER): a larger message is
    dropped by libzmq with its connection, which the rank sees as a lost seq.

    Dead publishers are noticed through TCP keepalive. ZMTP heartbeats
    (``heartbeat_s``) are off by default: libzmq 4.3 aborts the process when a
    heartbeat times out on a connection whose receive queue is full (a slow
    sink), then reconnects (zeromq/libzmq#3937).
    """

    def __init__(
        self,
        sources: Iterable[EngineSource] = (),
        sink: EventSink | None = None,
        *,
        config: StreamConfig | None = None,
        rcvhwm: int = 100_000,
        queue_size: int = 10_000,
        heartbeat_s: float | None = None,
        context: zmq.Context[Any] | None = None,
        clock: Callable[[], float] = time.monotonic,
        max_message_size: int = DEFAULT_MAX_MESSAGE_SIZE,
        probe_rate: float = 16.0,
        max_replays: int = 128,
        coalesce_s: float = 0.002,
    ) -> None:
        if max_message_size < 1:
            raise ValueError(f"max_message_size must be >= 1, got {max_message_size}")
        if probe_rate <= 0:
            raise ValueError(f"probe_rate must be > 0, got {probe_rate}")
        if max_replays < 1:
            raise ValueError(f"max_replays must be >= 1, got {max_replays}")
        if not 0 <= coalesce_s <= 1:
            raise ValueError(f"coalesce_s must be in [0, 1], got {coalesce_s}")
        self._sink = sink
        self._sink_flush: Callable[[], Any] | None = getattr(sink, "flush", None)
        self._sink_payload = sink if isinstance(sink, PayloadSink) else None
        self._config = config if config is not None else StreamConfig()
        self._rcvhwm = rcvhwm
        self._queue_size = queue_size
        self._heartbeat_ms = None if heartbeat_s is None else max(1, int(heartbeat_s * 1000))
        self._max_message_size = max_message_size
        self._probe_rate = probe_rate
        self._max_replays = max_replays
        self._given_ctx = context
        self._ctx: zmq.Context[Any] | None = None
        self._clock = clock
        self._sources: dict[str, EngineSource] = {}
        self._links: dict[str, list[_Link]] = {}
        self._by_rank: dict[tuple[str, int], _Link] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop_event: asyncio.Event | None = None
        self._stop_requested = False
        self._running = False
        self._finished = False
        # (asyncio.Queue and Event bind to the running loop on first use.)
        self._queue: asyncio.Queue[SinkItem | object] | None = (
            asyncio.Queue() if sink is None else None
        )
        self._space: asyncio.Event | None = asyncio.Event() if sink is None else None
        if self._space is not None:
            self._space.set()
        self._deferred: dict[_Link, None] = {}  # ranks waiting for the iterator's reader
        self._timers: list[tuple[float, int, _Link]] = []
        self._timer_seq = itertools.count()
        self._timer_handle: asyncio.TimerHandle | None = None
        self._timer_due: float | None = None
        self._swept: dict[_Link, None] = {}  # ranks whose only deadline is a silence: swept
        self._sweep_s = _MAX_TIMER_S
        self._sweep_at = 0.0
        self._sweep_handle: asyncio.TimerHandle | None = None
        self._replays_open = 0
        self._replay_cap = max_replays  # lowered while the process is out of files
        self._replay_waiting: deque[_Link] = deque()
        self._flush_links: dict[_Link, None] = {}
        self._to_connect: deque[_Link] = deque()  # ranks waiting for a first-contact slot
        self._first_contacts = 0
        self._epoll = select.epoll()
        self._fd_links: dict[int, _Link] = {}
        self._continue: dict[_Link, bool] = {}  # ranks with more to read than one burst
        self._armed = False
        self._followup: asyncio.Handle | None = None
        self._coalesce_s = coalesce_s
        self._private = False  # the loop is the background thread's own
        self._background: set[asyncio.Task[None]] = set()
        self._task: asyncio.Task[None] | None = None
        self._thread: threading.Thread | None = None
        self._thread_ready = threading.Event()
        self._thread_error: BaseException | None = None
        self._lock = threading.Lock()
        for source in sources:
            self._check_new(source)
            self._sources[source.worker_id] = source
        self._ensure_capacity(self._total_ranks())
        if context is not None:
            self._check_sockets(context, self._total_ranks())

    # --- sources ----------------------------------------------------------------------

    @property
    def sources(self) -> list[EngineSource]:
        with self._lock:
            return list(self._sources.values())

    def _check_new(self, source: EngineSource) -> None:
        if not isinstance(source, EngineSource):
            raise TypeError(f"expected an EngineSource, got {type(source).__name__}")
        if source.worker_id in self._sources:
            raise ValueError(f"a source for worker {source.worker_id!r} is already added")

    def _total_ranks(self) -> int:
        return sum(s.ranks for s in self._sources.values())

    def add_source(self, source: EngineSource) -> None:
        """Start following ``source``; safe from any thread, before or during a run.

        Raises :class:`ResourceLimitError` when the process cannot open the
        sockets the new total of ranks needs.
        """
        with self._lock:
            self._check_new(source)
            self._ensure_capacity(self._total_ranks() + source.ranks)
            ctx = self._ctx if self._ctx is not None else self._given_ctx
            if ctx is not None:
                self._check_sockets(ctx, self._total_ranks() + source.ranks)
            self._sources[source.worker_id] = source
            loop = self._loop if self._running else None
        if loop is not None:
            if _in_loop(loop):
                self._open_source(source)
            else:
                loop.call_soon_threadsafe(self._open_source, source)

    def remove_source(self, worker_id: str, timeout: float = 5.0) -> None:
        """Stop following a worker and clear its ranks downstream.

        From the subscriber's own event loop use :meth:`aremove_source`
        instead (this one only schedules the removal there).
        """
        with self._lock:
            if worker_id not in self._sources:
                raise KeyError(f"no source for worker {worker_id!r}")
            del self._sources[worker_id]
            loop = self._loop if self._running else None
        if loop is None:
            return
        if _in_loop(loop):
            loop.call_soon(self._close_source, worker_id, True)
            return
        future = asyncio.run_coroutine_threadsafe(self._aclose_source(worker_id), loop)
        future.result(timeout)

    async def aremove_source(self, worker_id: str) -> None:
        """:meth:`remove_source` for coroutines on the subscriber's loop."""
        with self._lock:
            if worker_id not in self._sources:
                raise KeyError(f"no source for worker {worker_id!r}")
            del self._sources[worker_id]
            running = self._running
        if running:
            self._close_source(worker_id, True)

    async def _aclose_source(self, worker_id: str) -> None:
        self._close_source(worker_id, True)

    # --- limits -----------------------------------------------------------------------

    def _ensure_capacity(self, ranks: int) -> None:
        """Raise the open-file soft limit to what ``ranks`` need, or say which limit is short."""
        replays = min(ranks, self._max_replays)
        need = ranks * _FDS_PER_RANK + replays * _FDS_PER_REPLAY + _FD_MARGIN
        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        if soft == resource.RLIM_INFINITY or soft >= need:
            return
        if hard != resource.RLIM_INFINITY and hard < need:
            raise ResourceLimitError(
                f"following {ranks} ranks needs about {need} open files "
                f"({_FDS_PER_RANK} per rank, {_FDS_PER_REPLAY} per replay socket, "
                f"max_replays={self._max_replays}), but this process may open at most {hard} "
                "(RLIMIT_NOFILE hard limit): raise it (ulimit -Hn as root, LimitNOFILE= in a "
                "systemd unit, docker run --ulimit nofile=N:N) or split the sources across "
                "subscriber processes"
            )
        resource.setrlimit(resource.RLIMIT_NOFILE, (need, hard))
        log.info("raised the open-file soft limit from %d to %d for %d ranks", soft, need, ranks)

    def _socket_budget(self, ranks: int) -> int:
        return ranks * _SOCKETS_PER_RANK + min(ranks, self._max_replays) + _SOCKET_MARGIN

    def _check_sockets(self, ctx: zmq.Context[Any], ranks: int) -> None:
        need = self._socket_budget(ranks)
        have = ctx.get(zmq.MAX_SOCKETS)
        if have < need:
            raise ResourceLimitError(
                f"following {ranks} ranks needs about {need} ZeroMQ sockets "
                f"({_SOCKETS_PER_RANK} per rank, max_replays={self._max_replays}), but the "
                f"given context allows {have}: set context.MAX_SOCKETS = {need} (or more) "
                "before it opens any socket, or let the Subscriber make its own context"
            )

    # --- status -----------------------------------------------------------------------

    def status(self) -> list[RankStatus]:
        """Every rank's state, position and counters (a snapshot; any thread)."""
        with self._lock:
            links = [link for links in self._links.values() for link in links]
        return sorted(
            (
                link.stream.status(
                    link.worker_id,
                    link.rank,
                    link.endpoints.endpoint,
                    link.endpoints.replay_endpoint,
                )
                for link in links
            ),
            key=lambda s: (s.worker_id, s.rank),
        )

    def rank_state(self, worker_id: str, rank: int) -> RankState | None:
        """The rank's state now, or None if it is not followed (yet); cheap, any thread."""
        link = self._by_rank.get((worker_id, rank))
        return None if link is None else link.stream.state

    # --- running ----------------------------------------------------------------------

    async def run(self) -> None:
        """Follow every source until :meth:`stop` / :meth:`aclose` (or cancellation)."""
        with self._lock:
            if self._running or self._finished:
                raise RuntimeError("a Subscriber runs once")
            self._running = True
            self._loop = asyncio.get_running_loop()
        self._stop_event = asyncio.Event()
        if self._stop_requested:
            self._stop_event.set()
        ctx = self._given_ctx
        if ctx is None:
            ctx = zmq.Context()
            ctx.set(zmq.MAX_SOCKETS, ctx.get(zmq.SOCKET_LIMIT))
        self._ctx = ctx
        try:
            self._check_sockets(ctx, self._total_ranks())
            for source in self.sources:
                self._open_source(source)
            self._arm()
            self._thread_ready.set()
            await self._stop_event.wait()
        finally:
            with self._lock:
                self._running = False
                self._finished = True
                workers = list(self._links)
            for worker_id in workers:
                self._close_source(worker_id, False)
            for handle in (self._timer_handle, self._sweep_handle):
                if handle is not None:
                    handle.cancel()
            self._timer_handle = self._sweep_handle = None
            self._disarm()
            self._epoll.close()
            if self._given_ctx is None:
                ctx.destroy(linger=0)
            if self._queue is not None:
                self._queue.put_nowait(_END)
            self._thread_ready.set()

    def _request_stop(self) -> None:
        self._stop_requested = True
        if self._stop_event is not None:
            self._stop_event.set()

    async def aclose(self) -> None:
        """Stop and wait until every socket is closed."""
        self._request_stop()
        task = self._task
        if task is not None:
            self._task = None
            await task

    async def __aenter__(self) -> Subscriber:
        self._task = asyncio.get_running_loop().create_task(self.run())
        await asyncio.sleep(0)  # let run() open the sockets
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.aclose()

    def start(self, timeout: float = 5.0) -> Subscriber:
        """Run on a background thread (with its own event loop); needs a sink."""
        if self._sink is None:
            raise ValueError("a background-thread Subscriber needs a sink")
        if self._thread is not None:
            raise RuntimeError("already started")
        self._thread = threading.Thread(
            target=self._thread_main, name="kvwire-subscriber", daemon=True
        )
        self._thread.start()
        if not self._thread_ready.wait(timeout):
            raise TimeoutError("the subscriber thread did not start in time")
        if self._thread_error is not None:
            raise RuntimeError("the subscriber thread failed") from self._thread_error
        return self

    def _thread_main(self) -> None:
        self._private = True
        try:
            asyncio.run(self.run())
        except BaseException as exc:
            self._thread_error = exc
            log.exception("subscriber thread failed")
            self._thread_ready.set()

    def stop(self, timeout: float = 5.0) -> None:
        """Stop from any thread; with ``start()`` also joins the thread (bounded)."""
        self._stop_requested = True
        loop = self._loop
        if loop is not None and not loop.is_closed():
            with contextlib.suppress(RuntimeError):  # the loop closed meanwhile
                loop.call_soon_threadsafe(self._request_stop)
        thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout)
            if thread.is_alive():
                raise TimeoutError(f"the subscriber thread did not stop within {timeout} s")

    def __enter__(self) -> Subscriber:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()

    # --- iterator output ----------------------------------------------------------------

    def __aiter__(self) -> AsyncIterator[SinkItem]:
        if self._sink is not None:
            raise TypeError("this Subscriber delivers to its sink, not to an iterator")
        return self._items()

    async def _items(self) -> AsyncIterator[SinkItem]:
        queue, space = self._queue, self._space
        assert queue is not None and space is not None
        while True:
            item = await queue.get()
            if item is _END:
                queue.put_nowait(_END)  # for any other reader
                return
            if not space.is_set() and queue.qsize() <= self._queue_size // 2:
                space.set()
                if self._deferred and self._loop is not None:
                    self._loop.call_soon(self._resume_deferred)
            yield item  # type: ignore[misc]

    def _resume_deferred(self) -> None:
        """The reader caught up: read on from the ranks that waited (their sockets won't signal)."""
        deferred, self._deferred = self._deferred, {}
        self._continue.update(dict.fromkeys(deferred, True))
        if self._running and self._loop is not None:
            self._disarm()
            self._followup = self._loop.call_soon(self._wake)

    # --- sockets ------------------------------------------------------------------------

    def _rank_config(self, source: EngineSource) -> StreamConfig:
        """The source's stream settings: replay as available, probes within the rate budget."""
        cfg = self._config
        idle = cfg.idle_probe
        if idle is not None:
            idle = max(idle, self._total_ranks() / self._probe_rate)
        return msgspec.structs.replace(
            cfg, replay=source.replay_endpoint is not None, idle_probe=idle
        )

    def _open_source(self, source: EngineSource) -> None:
        with self._lock:
            if not self._running or source.worker_id in self._links:
                return
            if self._sources.get(source.worker_id) is not source:
                return  # removed before the loop got to it
        assert self._ctx is not None
        self._check_sockets(self._ctx, self._total_ranks())
        config = self._rank_config(source)
        links = [
            _Link(
                source,
                endpoints,
                RankStream(endpoints.rank, config, payloads=self._sink_payload is not None),
            )
            for endpoints in source.rank_endpoints()
        ]
        with self._lock:
            self._links[source.worker_id] = links
            for link in links:
                self._by_rank[(link.worker_id, link.rank)] = link
        self._to_connect.extend(links)
        self._connect_more()

    def _connect_more(self) -> None:
        """Connect waiting ranks while fewer than ``max_replays`` are making first contact.

        A rank's first contact is a replay of the publisher's history; thousands
        at once would only queue for replay sockets and time out.
        """
        while self._to_connect and self._first_contacts < self._max_replays and self._running:
            link = self._to_connect.popleft()
            if link.closed:
                continue
            try:
                self._open_sub(link, link.topic)
            except Exception as exc:  # out of files: try again later (a timer, a settled rank)
                self._close_sub(link)
                self._to_connect.appendleft(link)
                self._log_limited(link, f"not connected yet: {exc}")
                return
            link.connecting_since = self._clock()
            self._first_contacts += 1
            self._schedule(link)

    def _contacted(self, link: _Link) -> None:
        """The rank's first contact is over (or taking too long): let another one start."""
        if link.connecting_since is not None:
            link.connecting_since = None
            self._first_contacts -= 1
            self._connect_more()

    def _socket(self, kind: int, link: _Link) -> zmq.Socket[bytes]:
        assert self._ctx is not None
        sock: zmq.Socket[bytes] = zmq.Socket(self._ctx, kind)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.MAXMSGSIZE, self._max_message_size)
        sock.setsockopt(zmq.RECONNECT_IVL, 100)
        sock.setsockopt(zmq.RECONNECT_IVL_MAX, 1000)
        if link.keys is not None:
            try:
                secure_client(sock, link.keys)
            except BaseException:
                sock.close(linger=0)
                raise
        return sock

    def _open_sub(self, link: _Link, topic: bytes) -> None:
        assert self._loop is not None
        sub = self._socket(zmq.SUB, link)
        sub.setsockopt(zmq.RCVHWM, self._rcvhwm)
        sub.setsockopt(zmq.TCP_KEEPALIVE, 1)
        sub.setsockopt(zmq.TCP_KEEPALIVE_IDLE, 10)
        sub.setsockopt(zmq.TCP_KEEPALIVE_INTVL, 2)
        sub.setsockopt(zmq.TCP_KEEPALIVE_CNT, 3)
        if self._heartbeat_ms is not None:
            sub.setsockopt(zmq.HEARTBEAT_IVL, self._heartbeat_ms)
            sub.setsockopt(zmq.HEARTBEAT_TIMEOUT, 3 * self._heartbeat_ms)
        sub.setsockopt(zmq.SUBSCRIBE, topic)
        link.sub = sub
        monitor = sub.get_monitor_socket(_MONITOR_EVENTS)
        link.monitor = monitor
        # A fresh inproc pipe does not signal its first message: one read (of nothing,
        # before the SUB connects) makes it signal from then on.
        drain(monitor, 1, _MONITOR_FRAMES)
        sub.connect(link.endpoints.endpoint)
        link.sub_fd = _fd(sub)
        link.monitor_fd = _fd(monitor)
        self._watch(link.monitor_fd, link)
        self._watch(link.sub_fd, link)

    def _open_dealer(self, link: _Link) -> bool:
        assert self._loop is not None and link.endpoints.replay_endpoint is not None
        try:
            dealer = self._socket(zmq.DEALER, link)
        except Exception as exc:  # out of sockets or files: wait for one to close
            self._replay_cap = max(1, self._replays_open)
            self._log_limited(link, f"replay socket not opened ({exc}): waiting for one to close")
            return False
        # Bounded: a reply flows as fast as it is read (the publisher waits on a full
        # pipe), and a hostile replay socket cannot queue more than this in the router.
        dealer.setsockopt(zmq.RCVHWM, _REPLAY_RCVHWM)
        dealer.connect(link.endpoints.replay_endpoint)
        link.dealer = dealer
        link.dealer_fd = _fd(dealer)
        self._replays_open += 1
        self._watch(link.dealer_fd, link)
        return True

    def _close_dealer(self, link: _Link) -> None:
        dealer = link.dealer
        if dealer is None:
            return
        link.dealer = None
        self._unwatch(link.dealer_fd)
        link.dealer_fd = -1
        dealer.close(linger=0)
        self._replays_open -= 1
        if self._replay_cap < self._max_replays:
            self._replay_cap += 1
        self._next_waiting()

    def _next_waiting(self) -> None:
        """A replay socket closed: send the oldest request that waited for one."""
        waiting = self._replay_waiting
        while waiting and self._replays_open < self._replay_cap:
            link = waiting.popleft()
            request, link.queued = link.queued, None
            if request is None or link.closed or link.dealer is not None:
                continue
            frames, token = request
            self._send_request(link, frames, token, fresh=False)

    def _release_dealer(self, link: _Link) -> None:
        """Close the rank's replay socket once its stream waits for no reply."""
        if link.dealer is not None and not link.stream.replay_pending:
            self._close_dealer(link)

    def _close_sockets(self, link: _Link) -> None:
        link.closed = True
        self._swept.pop(link, None)
        link.queued = None
        self._contacted(link)
        self._close_dealer(link)
        self._close_sub(link)

    def _close_sub(self, link: _Link) -> None:
        for fd in (link.sub_fd, link.monitor_fd):
            if fd >= 0:
                self._unwatch(fd)
        link.sub_fd = link.monitor_fd = -1
        if link.sub is not None:
            with contextlib.suppress(zmq.ZMQError):
                link.sub.disable_monitor()
        for sock in (link.monitor, link.sub):
            if sock is not None:
                sock.close(linger=0)
        link.sub = link.monitor = None

    def _close_source(self, worker_id: str, clear: bool) -> None:
        with self._lock:
            links = self._links.pop(worker_id, [])
            for link in links:
                self._by_rank.pop((link.worker_id, link.rank), None)
        for link in links:
            self._close_sockets(link)
            self._deferred.pop(link, None)
            self._flush_links.pop(link, None)
            if clear:
                self._emit_clear(link, "source removed")

    # --- reading ------------------------------------------------------------------------

    def _watch(self, fd: int, link: _Link) -> None:
        self._fd_links[fd] = link
        self._epoll.register(fd, select.EPOLLIN)

    def _unwatch(self, fd: int) -> None:
        if self._fd_links.pop(fd, None) is not None:
            with contextlib.suppress(OSError):
                self._epoll.unregister(fd)

    def _arm(self) -> None:
        """Wake when any rank's socket signals."""
        self._followup = None
        if not self._armed and self._loop is not None and self._running:
            self._loop.add_reader(self._epoll.fileno(), self._wake)
            self._armed = True

    def _disarm(self) -> None:
        if self._followup is not None:
            self._followup.cancel()
            self._followup = None
        if self._armed and self._loop is not None:
            self._loop.remove_reader(self._epoll.fileno())
            self._armed = False

    def _wake(self) -> None:
        """One round of reading: every rank whose socket signalled, and those left unfinished.

        Afterwards the loop sleeps ``coalesce_s`` before it listens again, so
        that a fleet of ranks sending a batch each now and then is read a
        handful at a time instead of one wake-up per batch.
        """
        if self._private:
            self._followup = None  # the loop is ours: stay registered
        else:
            self._disarm()
        ready = self._continue  # rank -> whether its monitor signalled
        self._continue = {}
        fd_links = self._fd_links
        for fd, _ in self._epoll.poll(0):
            link = fd_links.get(fd)
            if link is not None:
                if fd == link.monitor_fd:
                    ready[link] = True
                elif link not in ready:
                    ready[link] = False
        for link, monitor in ready.items():
            self._service(link, monitor)
        if self._flush_links:
            self._flush()
        if not self._running or self._loop is None:
            return
        if self._continue:
            if self._followup is None:
                self._followup = self._loop.call_soon(self._wake)
        elif self._private:
            if self._coalesce_s > 0:
                time.sleep(self._coalesce_s)  # nothing else runs on this loop
        elif self._coalesce_s > 0:
            self._followup = self._loop.call_later(self._coalesce_s, self._arm)
        else:
            self._arm()

    def _service(self, link: _Link, monitor: bool) -> None:
        """Everything the rank's sockets hold, in order: connection events, live, replies.

        ``monitor``: its monitor's descriptor signalled. Otherwise the monitor is
        not read: it was read to the end before, so nothing waits there unless
        it signals (an event arriving meanwhile is read in the next round, before
        the fresh connection it announces can deliver: libzmq reconnects 100 ms
        after a disconnect at the earliest).
        """
        if link.closed:
            return
        space = self._space
        if space is not None and not space.is_set():
            self._deferred[link] = None  # read on when the iterator's reader catches up
            return
        burst = 0
        try:
            if monitor and link.monitor is not None:
                self._on_monitor(link)
            if link.sub is not None:
                burst = self._drain_live(link, _BURST)
            if link.dealer is not None:
                self._drain_replay(link)
                self._schedule(link)
        except Exception:
            # A bug, not bad input (RankStream never raises on input): keep going.
            self._log_limited(link, "subscriber loop error", exc_info=True)
        if burst >= _BURST and not link.closed:
            # More may be queued, and the socket will not signal it again.
            self._continue[link] = False

    def _on_monitor(self, link: _Link) -> None:
        monitor = link.monitor
        assert monitor is not None
        # Read to the end: the monitor signals again only once it has been found empty.
        events: list[tuple[bytes, ...]] = []
        while len(batch := drain(monitor, _BURST, _MONITOR_FRAMES)) == _BURST:
            events += batch
        events += batch
        for msg in events:
            if link.monitor is not monitor:
                return  # the rank was removed by what it delivered
            if len(msg) != _MONITOR_FRAMES:
                continue  # not libzmq's: nothing to go by
            event = parse_monitor_message(list(msg))["event"]
            if event == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                link.reconnect_delay = 0.0
                link.reconnect_at = None
                self._deliver(link, link.stream.connected(self._clock()))
            elif event == zmq.EVENT_DISCONNECTED:
                # The old connection's batches belong before the disconnect.
                sub = link.sub
                if sub is not None:
                    self._drain_live(link, _DRAIN_BEFORE_DISCONNECT)
                self._deliver(link, link.stream.disconnected(self._clock()))
                # libzmq does not reconnect after a protocol error (a message over
                # max_message_size, a refused handshake): connect again ourselves, at
                # once after a connection that worked, then backing off.
                delay = link.reconnect_delay
                link.reconnect_delay = min(_RECONNECT_MAX_S, max(_RECONNECT_MIN_S, 2 * delay))
                link.reconnect_at = self._clock() + delay
                if delay == 0:
                    self._reconnect(link)
            else:
                continue
            self._schedule(link)

    def _reconnect(self, link: _Link) -> None:
        link.reconnect_at = None
        sub = link.sub
        if sub is None:
            return
        with contextlib.suppress(zmq.ZMQError):
            sub.disconnect(link.endpoints.endpoint)
        sub.connect(link.endpoints.endpoint)

    def _drain_live(self, link: _Link, budget: int) -> int:
        """Read up to ``budget`` live messages into the stream; how many were read.

        With a sink, the heartbeats in sequence at the head of the socket are
        counted by the native drain and taken by the stream in one call (they
        change nothing a sink holds); everything else goes through ``live``.
        """
        sub = link.sub
        assert sub is not None
        stream = link.stream
        live = stream.live
        clock = self._clock
        sink = self._sink
        payload_sink = self._sink_payload
        limits = stream.config.decode_limits
        worker_id, rank = link.worker_id, link.rank
        n = 0
        while n < budget:
            chunk = min(_BURST, budget - n)
            key = stream.beat_key() if sink is not None else None
            if key is None:
                beats, last, messages = 0, None, drain(sub, chunk, _LIVE_FRAMES)
            else:
                beats, last, messages = drain_beats(sub, chunk, *key)
            if not beats and not messages:
                break
            now = clock()
            if last is not None:
                stream.beats(beats, last, now)
                n += beats
            for frames in messages:
                n += 1
                actions = live(frames, now)
                kind = type(actions[0]) if len(actions) == 1 and sink is not None else None
                if kind is ApplyPayload:
                    assert payload_sink is not None  # only a PayloadSink's streams make them
                    try:
                        payload_sink.apply_payload(worker_id, rank, actions[0].payload, limits)  # type: ignore[union-attr]
                    except Exception as exc:
                        self._sink_failed(link, exc)
                elif kind is Apply:
                    assert sink is not None
                    try:
                        sink.apply(worker_id, rank, actions[0].batch)  # type: ignore[union-attr]
                    except Exception as exc:
                        self._sink_failed(link, exc)
                elif actions:
                    self._deliver(link, actions)
                if link.sub is not sub:
                    return n  # the rank was removed by what it delivered
            if messages and self._sink_flush is not None:
                self._flush_links[link] = None
            if beats + len(messages) < chunk:
                break  # the socket is empty
        return n

    def _drain_replay(self, link: _Link) -> None:
        applied = False
        dealer = link.dealer
        while dealer is not None and link.dealer is dealer:
            messages = drain(dealer, _BURST, _REPLY_FRAMES)
            for frames in messages:
                actions = link.stream.replay_reply(frames, link.dealer_token, self._clock())
                applied = applied or bool(actions)
                self._deliver(link, actions)
                if link.dealer is not dealer:
                    break  # a fresh replay socket replaced this one: read it on its own signal
            if len(messages) < _BURST:
                break
        if not link.closed:
            self._release_dealer(link)
            if applied and self._sink_flush is not None:
                self._flush_links[link] = None

    # --- time ---------------------------------------------------------------------------

    def _schedule(self, link: _Link, now: float | None = None) -> None:
        """Put the rank's next deadline on the heap (re-read at least every few seconds),
        or leave it to the sweeps when it is only a silence that live messages keep moving."""
        if link.closed:
            return
        if now is None:
            now = self._clock()
        stream = link.stream
        quiet = stream.silence_deadline()
        if (
            quiet is not None
            and link.reconnect_at is None
            and link.connecting_since is None
            and self._sweep_later(link, quiet, now)
        ):
            return
        self._swept.pop(link, None)
        deadline = stream.next_deadline()
        cap = now + _MAX_TIMER_S
        at = cap if deadline is None or deadline > cap else deadline
        if link.reconnect_at is not None and link.reconnect_at < at:
            at = link.reconnect_at
        if link.timer_at is not None and link.timer_at <= at:
            return  # an earlier wake-up is already due; it re-reads the deadline
        link.timer_at = at
        heapq.heappush(self._timers, (at, next(self._timer_seq), link))
        if self._timer_due is None or at < self._timer_due:
            self._arm_timer(at, now)

    def _sweep_later(self, link: _Link, deadline: float, now: float) -> bool:
        """Leave the rank's silence deadline to the sweeps, unless it falls before the next one.

        Sweeps run every heartbeat interval (the shortest among the swept ranks,
        at most ``_MAX_TIMER_S``): a rank heard from meanwhile has had its
        deadline moved past the following sweep and costs no timer; one whose
        silence falls due before the following sweep is put back on the heap, at
        its exact deadline.
        """
        epoch = link.stream.epoch
        assert epoch is not None and epoch.heartbeat_s is not None
        period = min(epoch.heartbeat_s, _MAX_TIMER_S)
        if self._sweep_handle is None:
            self._sweep_s = period
            self._arm_sweep(now)
        elif period < self._sweep_s:
            self._sweep_s = period
            if self._sweep_at > now + period:
                self._arm_sweep(now)
        if deadline <= self._sweep_at:
            return False
        link.timer_at = None  # an entry on the heap is superseded
        self._swept[link] = None
        return True

    def _arm_sweep(self, now: float) -> None:
        assert self._loop is not None
        if self._sweep_handle is not None:
            self._sweep_handle.cancel()
        self._sweep_at = now + self._sweep_s
        self._sweep_handle = self._loop.call_later(self._sweep_s, self._sweep)

    def _sweep(self) -> None:
        """The swept ranks whose silence falls due before the next sweep get a timer.

        The stream's own deadline is read, so live messages cost the sweep
        nothing. Only ranks in sequence are swept, and every way out of sequence
        passes through :meth:`_schedule`, which takes the rank off the sweep (one
        found out of it anyway, with no silence deadline, is scheduled here).
        """
        self._sweep_handle = None
        if not self._swept or not self._running:
            return
        now = self._clock()
        self._arm_sweep(now)
        horizon = self._sweep_at
        due: list[_Link] = []
        for link in self._swept:
            at = link.stream.silence_deadline()
            if at is None or at <= horizon:
                due.append(link)
        for link in due:
            del self._swept[link]
            self._schedule(link, now)

    def _arm_timer(self, at: float, now: float) -> None:
        assert self._loop is not None
        if self._timer_handle is not None:
            self._timer_handle.cancel()
        self._timer_due = at
        self._timer_handle = self._loop.call_later(max(0.0, at - now), self._on_timer)

    def _on_timer(self) -> None:
        self._timer_handle = None
        self._timer_due = None
        timers = self._timers
        now = self._clock()
        due: list[_Link] = []
        while timers and timers[0][0] <= now:
            at, _, link = heapq.heappop(timers)
            if link.timer_at == at and not link.closed:
                link.timer_at = None
                due.append(link)
        for link in due:
            if link.connecting_since is not None and now - link.connecting_since > _CONTACT_S:
                self._contacted(link)  # its publisher may be down: others go on meanwhile
            if link.reconnect_at is not None and now >= link.reconnect_at:
                self._reconnect(link)
            try:
                actions = link.stream.tick(now)
                if actions:
                    self._deliver(link, actions)
                if not link.closed:
                    self._release_dealer(link)
            except Exception:
                self._log_limited(link, "subscriber timer error", exc_info=True)
            self._schedule(link, now)
        while timers and (timers[0][2].timer_at != timers[0][0] or timers[0][2].closed):
            heapq.heappop(timers)  # superseded entries
        if timers and (self._timer_due is None or timers[0][0] < self._timer_due):
            self._arm_timer(timers[0][0], now)
        if self._to_connect:
            self._connect_more()
        if self._flush_links:
            self._flush()

    # --- carrying out actions -------------------------------------------------------------

    def _deliver(self, link: _Link, actions: list[Action]) -> None:
        timed = False  # anything but an Apply may have moved the rank's deadline
        for action in actions:
            kind = type(action)
            if kind is Apply:
                self._emit_apply(link, action)  # type: ignore[arg-type]
                continue
            if kind is ApplyPayload:
                self._emit_apply_payload(link, action)  # type: ignore[arg-type]
                continue
            timed = True
            if kind is ClearRank:
                self._emit_clear(link, action.reason)  # type: ignore[union-attr]
            elif kind is RequestReplay:
                assert isinstance(action, RequestReplay)
                frames = replay_request_frames(action.start_seq)
                self._send_request(link, frames, action.token, action.fresh)
            elif kind is RequestSnapshot:
                assert isinstance(action, RequestSnapshot)
                self._send_request(link, snapshot_request_frames(), action.token, action.fresh)
            elif kind is Reconnect:
                self._reconnect(link)
            elif kind is StateChanged:
                assert isinstance(action, StateChanged)
                if link.connecting_since is not None and action.new is not RankState.SYNCING:
                    self._contacted(link)
                log.info(
                    "worker %s rank %d: %s -> %s (%s)",
                    link.worker_id,
                    link.rank,
                    action.old.value,
                    action.new.value,
                    action.reason,
                )
        if timed:
            self._schedule(link)

    def _emit_apply(self, link: _Link, action: Apply) -> None:
        sink = self._sink
        if sink is None:
            assert self._queue is not None
            self._put(Applied(link.worker_id, link.rank, action.seq, action.batch))
            return
        try:
            sink.apply(link.worker_id, link.rank, action.batch)
        except Exception as exc:
            self._sink_failed(link, exc)

    def _emit_apply_payload(self, link: _Link, action: ApplyPayload) -> None:
        sink = self._sink_payload
        assert sink is not None  # only a PayloadSink's streams make them
        try:
            sink.apply_payload(
                link.worker_id, link.rank, action.payload, link.stream.config.decode_limits
            )
        except Exception as exc:
            self._sink_failed(link, exc)

    def _emit_clear(self, link: _Link, reason: str) -> None:
        sink = self._sink
        if sink is None:
            if self._queue is not None:
                self._put(Cleared(link.worker_id, link.rank, reason))
            return
        try:
            sink.clear(link.worker_id, link.rank)
        except Exception:
            link.stream.counters.sink_errors += 1
            self._log_limited(link, "sink.clear raised", exc_info=True)

    def _sink_failed(self, link: _Link, exc: Exception) -> None:
        self._log_limited(link, f"sink.apply raised {exc!r}", exc_info=exc)
        self._deliver(link, link.stream.sink_failed(self._clock(), repr(exc)))

    def _flush(self) -> None:
        """The round of reading is over: let a buffering sink apply what it holds."""
        links, self._flush_links = self._flush_links, {}
        flush = self._sink_flush
        if flush is None:
            return
        try:
            flush()
        except Exception as exc:
            # What the flush held came from these ranks: each view is suspect.
            for link in links:
                if not link.closed:
                    self._sink_failed(link, exc)

    def _put(self, item: SinkItem) -> None:
        queue, space = self._queue, self._space
        assert queue is not None and space is not None
        queue.put_nowait(item)
        if queue.qsize() >= self._queue_size:
            space.clear()  # reading stops until the reader catches up

    def _send_request(self, link: _Link, frames: list[bytes], token: int, fresh: bool) -> None:
        """Send a replay or snapshot request; ``fresh`` needs a new socket (no late replies)."""
        link.dealer_token = token
        if fresh or link.dealer is None:
            self._close_dealer(link)
            if self._replays_open >= self._replay_cap or not self._open_dealer(link):
                # Wait for a replay socket to close (at the cap, or out of files).
                if link.queued is None:
                    self._replay_waiting.append(link)
                link.queued = (frames, token)
                return
            link.queued = None
        dealer = link.dealer
        assert dealer is not None
        try:
            dealer.send_multipart(frames, zmq.NOBLOCK)
        except zmq.ZMQError as exc:  # the request times out and is retried
            self._log_limited(link, f"replay request not sent: {exc}")

    def _log_limited(self, link: _Link, message: str, exc_info: Any = None) -> None:
        now = time.monotonic()
        if now < link.next_log:
            return
        link.next_log = now + _LOG_INTERVAL_S
        log.warning("worker %s rank %d: %s", link.worker_id, link.rank, message, exc_info=exc_info)


def _fd(sock: zmq.Socket[bytes]) -> int:
    return cast(int, sock.getsockopt(zmq.FD))


def _in_loop(loop: asyncio.AbstractEventLoop) -> bool:
    try:
        return asyncio.get_running_loop() is loop
    except RuntimeError:
        return False
