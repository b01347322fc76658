"""The ZeroMQ transport around :class:`RankStream`: sockets, connection events, time.

One asyncio task per rank owns that rank's sockets (a SUB for live batches,
its monitor, and a DEALER per replay chain) and its :class:`RankStream`.
Each wake-up it handles connection events first (draining the SUB before a
disconnect, so the old connection's batches come before it), then live
batches, then replay replies, then time. That order is what RankStream
relies on: a replay reply is never read before a disconnect that came
before it.

Batches go to a sink (:class:`EventSink`) or, without one, to an async
iterator of :data:`SinkItem`. ``Subscriber.start()`` runs the same loop on a
background thread for callers that are not async.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterable
from types import TracebackType
from typing import Any

import msgspec
import zmq
import zmq.asyncio
from zmq.utils.monitor import parse_monitor_message

from kvwire.subscriber.actions import Action, Apply, ClearRank, RequestReplay, StateChanged
from kvwire.subscriber.sink import Applied, Cleared, EventSink, SinkItem
from kvwire.subscriber.source import EngineSource, RankEndpoints
from kvwire.subscriber.state import RankStatus, StreamConfig
from kvwire.subscriber.stream import RankStream
from kvwire.wire import replay_request_frames

__all__ = ["Subscriber"]

log = logging.getLogger("kvwire.subscriber")

_MONITOR_EVENTS = zmq.EVENT_HANDSHAKE_SUCCEEDED | zmq.EVENT_DISCONNECTED
_BURST = 1024  # live messages handled before yielding to other ranks
_DRAIN_BEFORE_DISCONNECT = 1_000_000
_MAX_WAIT_S = 1.0
_LOG_INTERVAL_S = 10.0
_END = object()


class _Link:
    """One rank of one source: its stream, sockets and task."""

    __slots__ = (
        "dealer",
        "dealer_sync",
        "dealer_token",
        "endpoints",
        "monitor",
        "monitor_sync",
        "next_log",
        "poller",
        "rank",
        "stream",
        "sub",
        "sub_sync",
        "task",
        "worker_id",
    )

    def __init__(self, worker_id: str, endpoints: RankEndpoints, stream: RankStream) -> None:
        self.worker_id = worker_id
        self.rank = endpoints.rank
        self.endpoints = endpoints
        self.stream = stream
        self.sub: zmq.asyncio.Socket | None = None
        self.sub_sync: zmq.Socket[bytes] | None = None
        self.monitor: zmq.asyncio.Socket | None = None
        self.monitor_sync: zmq.Socket[bytes] | None = None
        self.dealer: zmq.asyncio.Socket | None = None
        self.dealer_sync: zmq.Socket[bytes] | None = None
        self.dealer_token = 0
        self.poller = zmq.asyncio.Poller()
        self.task: asyncio.Task[None] | None = None
        self.next_log = 0.0


class Subscriber:
    """Follows every rank of every source and feeds an ordered stream to a sink.

    ``sink`` gets ``apply(worker_id, rank, batch)`` for each batch in
    publisher order and ``clear(worker_id, rank)`` when a rank's state must
    go (publisher restart, unrecoverable loss, source removed). Without a
    sink, iterate the subscriber (``async for item in sub``) for the same
    items as :class:`Applied` / :class:`Cleared`.

    Run it with ``await sub.run()``, ``async with sub:``, or ``sub.start()``
    / ``sub.stop()`` on a background thread. ``config`` tunes every rank's
    :class:`RankStream` (its ``replay`` flag is set per source from whether
    the source has a replay endpoint). ``rcvhwm`` bounds each SUB socket's
    queue; ``queue_size`` bounds the iterator's backlog before reading stops
    (and the publisher's high-water mark turns the excess into visible gaps).

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
        context: zmq.asyncio.Context | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._sink = sink
        self._config = config if config is not None else StreamConfig()
        self._rcvhwm = rcvhwm
        self._queue_size = queue_size
        self._heartbeat_ms = None if heartbeat_s is None else max(1, int(heartbeat_s * 1000))
        self._given_ctx = context
        self._ctx: zmq.asyncio.Context | None = None
        self._clock = clock
        self._sources: dict[str, EngineSource] = {}
        self._links: dict[str, list[_Link]] = {}
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
        self._background: set[asyncio.Task[None]] = set()
        self._task: asyncio.Task[None] | None = None
        self._thread: threading.Thread | None = None
        self._thread_ready = threading.Event()
        self._thread_error: BaseException | None = None
        self._lock = threading.Lock()
        for source in sources:
            self._check_new(source)
            self._sources[source.worker_id] = source

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

    def add_source(self, source: EngineSource) -> None:
        """Start following ``source``; safe from any thread, before or during a run."""
        with self._lock:
            self._check_new(source)
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
            task = loop.create_task(self._close_source(worker_id, clear=True))
            self._background.add(task)
            task.add_done_callback(self._background.discard)
            return
        future = asyncio.run_coroutine_threadsafe(self._close_source(worker_id, clear=True), loop)
        future.result(timeout)

    async def aremove_source(self, worker_id: str) -> None:
        """:meth:`remove_source` for coroutines on the subscriber's loop."""
        with self._lock:
            if worker_id not in self._sources:
                raise KeyError(f"no source for worker {worker_id!r}")
            del self._sources[worker_id]
            running = self._running
        if running:
            await self._close_source(worker_id, clear=True)

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
        ctx = self._given_ctx if self._given_ctx is not None else zmq.asyncio.Context()
        self._ctx = ctx
        try:
            for source in self.sources:
                self._open_source(source)
            self._thread_ready.set()
            await self._stop_event.wait()
        finally:
            with self._lock:
                self._running = False
                self._finished = True
                workers = list(self._links)
            for worker_id in workers:
                await self._close_source(worker_id, clear=False)
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
        """Stop and wait until every socket and task is gone."""
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
            yield item  # type: ignore[misc]

    # --- sockets ------------------------------------------------------------------------

    def _open_source(self, source: EngineSource) -> None:
        with self._lock:
            if not self._running or source.worker_id in self._links:
                return
            if self._sources.get(source.worker_id) is not source:
                return  # removed before the loop got to it
        config = msgspec.structs.replace(self._config, replay=source.replay_endpoint is not None)
        links = []
        for endpoints in source.rank_endpoints():
            link = _Link(source.worker_id, endpoints, RankStream(endpoints.rank, config))
            self._open_sub(link, source.topic.encode())
            links.append(link)
        with self._lock:
            self._links[source.worker_id] = links
        for link in links:
            link.task = asyncio.get_running_loop().create_task(
                self._run_link(link), name=f"kvwire-{source.worker_id}-rank{link.rank}"
            )

    def _open_sub(self, link: _Link, topic: bytes) -> None:
        assert self._ctx is not None
        sub = self._ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.LINGER, 0)
        sub.setsockopt(zmq.RCVHWM, self._rcvhwm)
        sub.setsockopt(zmq.RECONNECT_IVL, 100)
        sub.setsockopt(zmq.RECONNECT_IVL_MAX, 1000)
        sub.setsockopt(zmq.TCP_KEEPALIVE, 1)
        sub.setsockopt(zmq.TCP_KEEPALIVE_IDLE, 10)
        sub.setsockopt(zmq.TCP_KEEPALIVE_INTVL, 2)
        sub.setsockopt(zmq.TCP_KEEPALIVE_CNT, 3)
        if self._heartbeat_ms is not None:
            sub.setsockopt(zmq.HEARTBEAT_IVL, self._heartbeat_ms)
            sub.setsockopt(zmq.HEARTBEAT_TIMEOUT, 3 * self._heartbeat_ms)
        sub.setsockopt(zmq.SUBSCRIBE, topic)
        monitor = sub.get_monitor_socket(_MONITOR_EVENTS)
        sub.connect(link.endpoints.endpoint)
        link.sub = sub
        link.sub_sync = zmq.Socket.shadow(sub.underlying)
        link.monitor = monitor
        link.monitor_sync = zmq.Socket.shadow(monitor.underlying)
        link.poller.register(monitor, zmq.POLLIN)
        link.poller.register(sub, zmq.POLLIN)

    def _open_dealer(self, link: _Link) -> None:
        self._close_dealer(link)
        assert self._ctx is not None and link.endpoints.replay_endpoint is not None
        dealer = self._ctx.socket(zmq.DEALER)
        dealer.setsockopt(zmq.LINGER, 0)
        dealer.setsockopt(zmq.RCVHWM, 0)  # a whole reply fits; the publisher caps it
        dealer.setsockopt(zmq.RECONNECT_IVL, 100)
        dealer.setsockopt(zmq.RECONNECT_IVL_MAX, 1000)
        dealer.connect(link.endpoints.replay_endpoint)
        link.dealer = dealer
        link.dealer_sync = zmq.Socket.shadow(dealer.underlying)
        link.poller.register(dealer, zmq.POLLIN)

    def _close_dealer(self, link: _Link) -> None:
        if link.dealer is not None:
            link.poller.unregister(link.dealer)
            link.dealer.close(linger=0)
        link.dealer = None
        link.dealer_sync = None

    def _close_sockets(self, link: _Link) -> None:
        self._close_dealer(link)
        if link.sub is not None:
            with contextlib.suppress(zmq.ZMQError):
                link.sub.disable_monitor()
        for sock in (link.monitor, link.sub):
            if sock is not None:
                sock.close(linger=0)
        link.sub = link.monitor = None
        link.sub_sync = link.monitor_sync = None

    async def _close_source(self, worker_id: str, *, clear: bool) -> None:
        with self._lock:
            links = self._links.pop(worker_id, [])
        for link in links:
            task = link.task
            if task is not None and not task.done():
                task.cancel()
            if task is not None:
                with contextlib.suppress(asyncio.CancelledError):
                    await task
            self._close_sockets(link)
            if clear:
                self._emit_clear(link, "source removed")

    # --- the per-rank loop --------------------------------------------------------------

    async def _run_link(self, link: _Link) -> None:
        clock = self._clock
        stream = link.stream
        while True:
            try:
                deadline = stream.next_deadline()
                wait = _MAX_WAIT_S if deadline is None else deadline - clock()
                wait = min(max(wait, 0.0), _MAX_WAIT_S)
                ready = dict(await link.poller.poll(int(wait * 1000) + 1))
                if link.monitor in ready:
                    self._on_monitor(link)
                burst = self._drain_live(link, _BURST) if link.sub in ready else 0
                if link.dealer is not None and link.dealer in ready:
                    self._drain_replay(link)
                self._deliver(link, stream.tick(clock()))
                if ready and burst < _BURST:
                    self._flush_sink(link)
                if self._space is not None and not self._space.is_set():
                    await self._space.wait()
                elif burst >= _BURST:
                    await asyncio.sleep(0)  # a busy rank must not starve the others
            except asyncio.CancelledError:
                raise
            except Exception:
                # A bug, not bad input (RankStream never raises on input): keep going.
                self._log_limited(link, "subscriber loop error", exc_info=True)
                await asyncio.sleep(0.1)

    def _on_monitor(self, link: _Link) -> None:
        monitor = link.monitor_sync
        assert monitor is not None
        while True:
            try:
                msg = monitor.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            event = parse_monitor_message(msg)["event"]
            if event == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                self._deliver(link, link.stream.connected(self._clock()))
            elif event == zmq.EVENT_DISCONNECTED:
                # The old connection's batches belong before the disconnect.
                self._drain_live(link, _DRAIN_BEFORE_DISCONNECT)
                self._deliver(link, link.stream.disconnected(self._clock()))

    def _drain_live(self, link: _Link, budget: int) -> int:
        sub = link.sub_sync
        assert sub is not None
        live = link.stream.live
        clock = self._clock
        sink = self._sink
        worker_id, rank = link.worker_id, link.rank
        n = 0
        while n < budget:
            try:
                frames = sub.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                break
            n += 1
            actions = live(frames, clock())
            if len(actions) == 1 and sink is not None and type(actions[0]) is Apply:
                try:
                    sink.apply(worker_id, rank, actions[0].batch)
                except Exception as exc:
                    self._sink_failed(link, exc)
            elif actions:
                self._deliver(link, actions)
        return n

    def _flush_sink(self, link: _Link) -> None:
        """The socket is drained: let a buffering sink apply what it holds."""
        flush = getattr(self._sink, "flush", None)
        if flush is None:
            return
        try:
            flush()
        except Exception as exc:
            self._sink_failed(link, exc)

    def _drain_replay(self, link: _Link) -> None:
        while link.dealer_sync is not None:
            dealer = link.dealer_sync
            try:
                frames = dealer.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            token = link.dealer_token
            self._deliver(link, link.stream.replay_reply(frames, token, self._clock()))
            if link.dealer_sync is not dealer:
                return  # a fresh replay socket replaced this one

    # --- carrying out actions -------------------------------------------------------------

    def _deliver(self, link: _Link, actions: list[Action]) -> None:
        for action in actions:
            kind = type(action)
            if kind is Apply:
                self._emit_apply(link, action)  # type: ignore[arg-type]
            elif kind is ClearRank:
                self._emit_clear(link, action.reason)  # type: ignore[union-attr]
            elif kind is RequestReplay:
                self._send_replay(link, action)  # type: ignore[arg-type]
            elif kind is StateChanged:
                assert isinstance(action, StateChanged)
                log.info(
                    "worker %s rank %d: %s -> %s (%s)",
                    link.worker_id,
                    link.rank,
                    action.old.value,
                    action.new.value,
                    action.reason,
                )

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

    def _put(self, item: SinkItem) -> None:
        queue, space = self._queue, self._space
        assert queue is not None and space is not None
        queue.put_nowait(item)
        if queue.qsize() >= self._queue_size:
            space.clear()  # the rank loops wait until the reader catches up

    def _send_replay(self, link: _Link, action: RequestReplay) -> None:
        if action.fresh or link.dealer is None:
            self._open_dealer(link)
        link.dealer_token = action.token
        assert link.dealer_sync is not None
        try:
            link.dealer_sync.send_multipart(replay_request_frames(action.start_seq), zmq.NOBLOCK)
        except zmq.ZMQError as exc:  # the request times out and is retried
            self._log_limited(link, f"replay request not sent: {exc}")

    def _log_limited(self, link: _Link, message: str, exc_info: Any = None) -> None:
        now = time.monotonic()
        if now < link.next_log:
            return
        link.next_log = now + _LOG_INTERVAL_S
        log.warning("worker %s rank %d: %s", link.worker_id, link.rank, message, exc_info=exc_info)


def _in_loop(loop: asyncio.AbstractEventLoop) -> bool:
    try:
        return asyncio.get_running_loop() is loop
    except RuntimeError:
        return False
