"""The :class:`Subscriber`: follow every rank of every source, feed an ordered stream to a sink.

A thin facade. It keeps the sources and their links (:mod:`kvwire.subscriber.link`,
one per rank), runs them on the asyncio loop it is given (or one of its own on
a background thread) through one :class:`~kvwire.subscriber.reactor.Reactor`,
and says where each rank stands; a view restored or exported is
:mod:`kvwire.subscriber.persist`'s. It runs wherever pyzmq runs: on any event loop
with ``add_reader`` (any selector loop: epoll, kqueue, poll, select), with the
native receive drain where it is built and finds pyzmq's libzmq and pyzmq's own
reads elsewhere (:func:`kvwire.subscriber.receive.load`).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
import sys
import threading
from collections.abc import AsyncIterator, Iterable
from typing import Any

import msgspec
import zmq

from kvwire.ratelog import RateLimitedLog
from kvwire.security import ServerKeys, release_context
from kvwire.subscriber import receive
from kvwire.subscriber.checkpoint import CheckpointInfo, Restored, RestoreProgress
from kvwire.subscriber.config import SubscriberConfig
from kvwire.subscriber.delivery import Delivery
from kvwire.subscriber.env import LinkEnv, ResourceLimitError, check_sockets, ensure_capacity
from kvwire.subscriber.link import RankLink
from kvwire.subscriber.persist import Restore, ViewExport
from kvwire.subscriber.reactor import Reactor, watches_descriptors
from kvwire.subscriber.readiness import Readiness, SyncProgress
from kvwire.subscriber.sink import EventSink, SinkItem, ViewSink
from kvwire.subscriber.source import EngineSource, RankEndpoints
from kvwire.subscriber.state import RankState, RankStatus, StreamConfig
from kvwire.subscriber.stream import Phase, RankStream

__all__ = ["ResourceLimitError", "Subscriber"]

log = logging.getLogger("kvwire.subscriber")


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
    / ``sub.stop()`` on a background thread. ``config`` tunes it
    (:class:`SubscriberConfig`); ``context``, a ZeroMQ context to open the
    sockets in (by default one of its own, allowing every socket ZeroMQ can).

    Scale: one process follows thousands of ranks. At start (and in
    :meth:`add_source`) the process's open-file soft limit is raised to what
    the ranks need (about four descriptors per rank), and a clear
    :class:`ResourceLimitError` says so when the hard limit (or a given
    context's socket limit) is too low.

    Dead publishers are noticed through TCP keepalive, and heartbeating
    publishers by their silence. Problems are logged at most once per kind and
    interval, however many ranks see them: a fleet going away is one line and
    a summary, not one per rank.

    Readiness: :meth:`wait_synced` (a thread) or :meth:`synced` (a coroutine)
    waits until a fraction of the ranks are SYNCED, :meth:`is_synced` says
    whether they are now, and :meth:`progress` counts the ranks per state and
    the recoveries still to come.

    A view that outlives the process (a :class:`ViewSink`, ``docs/scaling.md``):
    ``config.checkpoint`` is loaded at start when valid and written on
    :meth:`stop` (and every ``config.checkpoint_every`` seconds, and when
    :meth:`checkpoint` asks); ``config.clone_from`` copies a running peer's view
    (:meth:`serve_view`) at start. Either way each rank resumes from where the
    view was taken and asks its publisher's replay buffer only for what it
    missed since; where the buffer no longer covers that, the rank recovers as
    a fresh one would (snapshot, or PARTIAL).
    """

    def __init__(
        self,
        sources: Iterable[EngineSource] = (),
        sink: EventSink | None = None,
        *,
        config: SubscriberConfig | None = None,
        context: zmq.Context[Any] | None = None,
    ) -> None:
        self._config = config = config if config is not None else SubscriberConfig()
        if not isinstance(config, SubscriberConfig):
            raise TypeError(f"config must be a SubscriberConfig, got {type(config).__name__}")
        self._delivery = Delivery(sink, config.backlog)
        self._log = RateLimitedLog(log)
        self._given_ctx = context
        self._env: LinkEnv | None = None
        self._sources: dict[str, EngineSource] = {}
        self._links: dict[str, list[RankLink]] = {}
        self._by_rank: dict[tuple[str, int], RankLink] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop_event: asyncio.Event | None = None
        self._stop_requested = False
        self._running = False
        self._finished = False
        self._task: asyncio.Task[None] | None = None
        self._thread: threading.Thread | None = None
        self._thread_ready = threading.Event()
        self._thread_error: BaseException | None = None
        self._lock = threading.Lock()
        for source in sources:
            self._check_new(source)
            self._sources[source.worker_id] = source
        ensure_capacity(self._total_ranks(), config.max_replays)
        if context is not None:
            check_sockets(context, self._total_ranks(), config.max_replays)
        self._readiness = Readiness(self._total_ranks())
        self._view_sink: ViewSink | None = sink if isinstance(sink, ViewSink) else None
        if (config.checkpoint or config.clone_from) and self._view_sink is None:
            raise TypeError(
                "checkpoint and clone_from need a sink that exports and imports its view "
                f"(a ViewSink: export_rank, import_rank, view_format), got {type(sink).__name__}"
            )
        view_sink = self._view_sink
        self._restore = Restore(config, view_sink, self._replace, self._by_rank.get)
        self._export = ViewExport(config, view_sink, self._all_links, self._delivery.flush)

    @property
    def config(self) -> SubscriberConfig:
        return self._config

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
        max_replays = self._config.max_replays
        with self._lock:
            self._check_new(source)
            ensure_capacity(self._total_ranks() + source.ranks, max_replays)
            ctx = self._env.ctx if self._env is not None else self._given_ctx
            if ctx is not None:
                check_sockets(ctx, self._total_ranks() + source.ranks, max_replays)
            self._sources[source.worker_id] = source
            self._readiness.resize(self._total_ranks())
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
        loop = self._drop(worker_id)
        if loop is None:
            return
        if _in_loop(loop):
            loop.call_soon(self._close_source, worker_id, True)
            return
        future = asyncio.run_coroutine_threadsafe(self._aclose_source(worker_id), loop)
        future.result(timeout)

    async def aremove_source(self, worker_id: str) -> None:
        """:meth:`remove_source` for coroutines on the subscriber's loop."""
        if self._drop(worker_id) is not None:
            self._close_source(worker_id, True)

    def _drop(self, worker_id: str) -> asyncio.AbstractEventLoop | None:
        """Follow ``worker_id`` no more; the loop its links close on (None: not running)."""
        with self._lock:
            if worker_id not in self._sources:
                raise KeyError(f"no source for worker {worker_id!r}")
            del self._sources[worker_id]
            self._readiness.resize(self._total_ranks())
            return self._loop if self._running else None

    async def _aclose_source(self, worker_id: str) -> None:
        self._close_source(worker_id, True)

    def _rank_config(self, source: EngineSource) -> StreamConfig:
        """The source's stream settings: replay as available, probes within the rate budget."""
        cfg = self._config.stream
        idle = cfg.idle_probe
        if idle is not None:
            idle = max(idle, self._total_ranks() / self._config.probe_rate)
        return msgspec.structs.replace(
            cfg, replay=source.replay_endpoint is not None, idle_probe=idle
        )

    def _open_source(self, source: EngineSource) -> None:
        with self._lock:
            if not self._running or source.worker_id in self._links:
                return
            if self._sources.get(source.worker_id) is not source:
                return  # removed before the loop got to it
        env = self._env
        assert env is not None
        check_sockets(env.ctx, self._total_ranks(), self._config.max_replays)
        links = [self._new_link(source, endpoints) for endpoints in source.rank_endpoints()]
        with self._lock:
            self._links[source.worker_id] = links
            for link in links:
                self._by_rank[(link.worker_id, link.rank)] = link
        for link in links:
            self._readiness.moved(link, link.stream.state)
        env.contacts.add([link for link in links if not link.on_hold])

    def _new_link(self, source: EngineSource, endpoints: RankEndpoints) -> RankLink:
        """A rank's link; one a loading view may hold waits on hold for its position."""
        env = self._env
        assert env is not None
        payloads = self._delivery.payload_sink is not None
        stream = RankStream(endpoints.rank, self._rank_config(source), payloads=payloads)
        link = RankLink(source, endpoints, stream, env)
        self._restore.hold(link)
        return link

    def _replace(self, old: RankLink) -> RankLink | None:
        """Close ``old`` and put a fresh link (a fresh stream) for its rank in its place;
        None when its source was removed meanwhile (its links close with it)."""
        old.close()
        self._readiness.closed(old)
        with self._lock:
            source = self._sources.get(old.worker_id)
            links = self._links.get(old.worker_id, [])
            if source is None or old not in links:
                return None
        new = self._new_link(source, old.endpoints)
        with self._lock:
            links[links.index(old)] = new
            self._by_rank[(new.worker_id, new.rank)] = new
        self._readiness.moved(new, new.stream.state)
        return new

    def _close_source(self, worker_id: str, clear: bool) -> None:
        with self._lock:
            links = self._links.pop(worker_id, [])
            for link in links:
                self._by_rank.pop((link.worker_id, link.rank), None)
        for link in links:
            link.close()
            self._readiness.closed(link)
            if clear:
                self._delivery.clear(link, "source removed")

    # --- status -----------------------------------------------------------------------

    def status(self) -> list[RankStatus]:
        """Every rank's state, position and counters (a snapshot; any thread)."""
        return sorted(
            (_status(link) for link in self._all_links()), key=lambda s: (s.worker_id, s.rank)
        )

    def rank_state(self, worker_id: str, rank: int) -> RankState | None:
        """The rank's state now, or None if it is not followed (yet); cheap, any thread."""
        link = self._by_rank.get((worker_id, rank))
        if link is None:
            return None
        return RankState.SYNCING if link.on_hold else link.stream.state

    # --- readiness --------------------------------------------------------------------

    def _state_changed(self, link: RankLink) -> None:
        if not link.closed:
            self._readiness.moved(link, link.stream.state)

    def is_synced(self, fraction: float = 1.0) -> bool:
        """Whether at least ``fraction`` (in (0, 1]) of all ranks are SYNCED now; cheap,
        any thread. Ranks not contacted yet count as not SYNCED; with no ranks, True."""
        return self._readiness.reached(fraction)

    def wait_synced(self, fraction: float = 1.0, timeout: float | None = None) -> bool:
        """Block until at least ``fraction`` (in (0, 1]) of all ranks are SYNCED.

        For a router that must not answer (or route) before it has recovered its
        view: True once they are, False when ``timeout`` seconds pass first or the
        subscriber stops (like :meth:`threading.Event.wait`). It wakes when rank
        states change; it does not poll. Call it from another thread than the
        subscriber's loop (:meth:`start` runs it on its own); on a loop use
        :meth:`synced`.
        """
        loop = self._loop
        if loop is not None and self._running and _in_loop(loop):
            raise RuntimeError("wait_synced() would block the subscriber's loop: await synced()")
        return self._readiness.wait(fraction, timeout)

    async def synced(self, fraction: float = 1.0, timeout: float | None = None) -> None:
        """:meth:`wait_synced` for coroutines, on any event loop (the subscriber's or another).

        Returns once at least ``fraction`` of all ranks are SYNCED; raises
        :class:`TimeoutError` when ``timeout`` seconds pass first (as
        :func:`asyncio.wait_for` does; ``None``: no limit) and :class:`RuntimeError`
        when the subscriber stops first.
        """
        await self._readiness.wait_async(fraction, timeout)

    def progress(self) -> SyncProgress:
        """The ranks per state and the replays and snapshots still out (any thread).

        A rank not contacted yet counts as SYNCING. Reads every rank's phase: meant
        for a metrics scrape or a status page, not a hot path (:meth:`is_synced` is
        the cheap question).
        """
        ranks, counts = self._readiness.counts()
        phases = [link.stream.phase for link in self._all_links()]
        return SyncProgress(
            ranks=ranks,
            synced=counts[RankState.SYNCED],
            syncing=counts[RankState.SYNCING],
            partial=counts[RankState.PARTIAL],
            stale=counts[RankState.STALE],
            replaying=sum(1 for p in phases if p in _REPLAYING),
            snapshotting=sum(1 for p in phases if p is Phase.SNAPSHOTTING),
        )

    # --- running ----------------------------------------------------------------------

    async def run(self) -> None:
        """Follow every source until :meth:`stop` / :meth:`aclose` (or cancellation).

        Needs a loop with ``add_reader`` (every selector loop; on Windows,
        ``asyncio.WindowsSelectorEventLoopPolicy``): :meth:`start` makes one.
        """
        loop = asyncio.get_running_loop()
        with self._lock:
            if self._running or self._finished:
                raise RuntimeError("a Subscriber runs once")
            self._running = True
            self._loop = loop
        self._stop_event = asyncio.Event()
        if self._stop_requested:
            self._stop_event.set()
        if not watches_descriptors(loop):
            with self._lock:
                self._running, self._finished = False, True
            raise RuntimeError(
                "the Subscriber needs an event loop with add_reader (a selector loop; on "
                "Windows set asyncio.WindowsSelectorEventLoopPolicy, or use start())"
            )
        reactor = Reactor(loop, self._after_round)
        ctx = self._given_ctx
        if ctx is None:
            ctx = zmq.Context()
            ctx.set(zmq.MAX_SOCKETS, ctx.get(zmq.SOCKET_LIMIT))
        delivery = self._delivery
        self._env = env = LinkEnv(self._config, ctx, reactor, delivery, receive.load(), self._log)
        env.on_state = self._state_changed
        self._restore.env = env
        self._export.start(loop, ctx)
        delivery.on_backpressure(reactor.hold, self._read_on)
        config = self._config
        try:
            check_sockets(ctx, self._total_ranks(), config.max_replays)
            if config.checkpoint or config.clone_from:
                self._thread_ready.set()  # start() returns; readiness says when it recovered
                # The ranks' links open now, on hold: each connects and asks its replay
                # once its position is read, while the view is imported.
                self._restore.begin(self._followed())
                for source in self.sources:
                    self._open_source(source)
                restored = await asyncio.to_thread(
                    self._restore.load, ctx, loop, lambda: self._stop_requested
                )
                if not self._stop_requested:
                    self._restore.over(restored)
            else:
                for source in self.sources:
                    self._open_source(source)
            self._thread_ready.set()
            self._export.start_periodic()
            await self._stop_event.wait()
        finally:
            with self._lock:
                self._running = False
                self._finished = True
                workers = list(self._links)
            self._restore.stop()
            self._export.stop()
            env.contacts.running = False
            for worker_id in workers:
                self._close_source(worker_id, False)
            reactor.close()
            self._log.flush(force=True)
            if self._given_ctx is None:
                if self._export.keyed:
                    release_context(ctx)  # the clone service's ZAP handler
                ctx.destroy(linger=0)
            delivery.end()
            self._readiness.stopped()
            self._thread_ready.set()

    def _after_round(self) -> None:
        """After a round of reading or a timer: flush a buffering sink, admit waiting
        ranks, log what the rate limit held once its interval has passed."""
        env = self._env
        assert env is not None
        env.delivery.flush()
        env.contacts.more()
        self._log.flush()

    def _read_on(self, links: list[RankLink]) -> None:
        """The iterator's reader caught up: read on from the ranks that waited (their
        monitors too: a signal taken before the wait is not given again)."""
        env = self._env
        if env is not None and self._running:
            env.reactor.release()
            for link in links:
                if not link.closed:
                    env.reactor.again(link, monitor=True)

    def _request_stop(self) -> None:
        self._stop_requested = True
        self._restore.cancel.set()
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

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    def start(self, timeout: float = 5.0) -> Subscriber:
        """Run on a background thread (with its own event loop); needs a sink."""
        if self._delivery.sink is None:
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
        # A selector loop everywhere (Windows' default proactor has no add_reader).
        factory = asyncio.SelectorEventLoop if sys.platform == "win32" else None
        try:
            with asyncio.Runner(loop_factory=factory) as runner:
                runner.run(self.run())
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

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # --- checkpoints and clones ---------------------------------------------------------

    @property
    def restored(self) -> Restored | None:
        """What was loaded at start (a checkpoint or a peer's clone), or None: started cold."""
        return self._restore.restored

    @property
    def restore_refusals(self) -> list[str]:
        """Why each checkpoint or clone offered at start was refused (nothing applied from it)."""
        return list(self._restore.refusals)

    def restore_progress(self) -> RestoreProgress:
        """The start-up restore (clone or checkpoint) as it goes: bytes read and expected,
        ranks imported, whether it is over (a copy; any thread)."""
        return msgspec.structs.replace(self._restore.progress)

    def _followed(self) -> set[tuple[str, int]]:
        return {(s.worker_id, e.rank) for s in self.sources for e in s.rank_endpoints()}

    def _all_links(self) -> list[RankLink]:
        with self._lock:
            return [link for links in self._links.values() for link in links]

    def checkpoint(self, path: str | None = None, timeout: float | None = 60.0) -> CheckpointInfo:
        """Write a checkpoint now (to ``path``, else ``config.checkpoint``); from any thread
        but the subscriber's loop (there: :meth:`acheckpoint`).

        Every rank SYNCED in sequence is written with the sink's view of it, taken at
        one instant between the subscriber's inputs, a few ranks at a time, and a
        thread writes the file (atomically): the live path is not stalled. Returns
        its size, ranks and duration; raises :class:`CheckpointError` when no rank
        could be written (the previous checkpoint is kept).
        """
        loop = self._loop
        if loop is None or not self._running:
            raise RuntimeError("the subscriber is not running")
        if _in_loop(loop):
            raise RuntimeError(
                "checkpoint() would block the subscriber's loop: await acheckpoint()"
            )
        out: concurrent.futures.Future[CheckpointInfo] = concurrent.futures.Future()
        loop.call_soon_threadsafe(self._export.begin, path, out)
        return out.result(timeout)

    async def acheckpoint(self, path: str | None = None) -> CheckpointInfo:
        """:meth:`checkpoint` for coroutines, on any event loop."""
        loop = self._loop
        if loop is None or not self._running:
            raise RuntimeError("the subscriber is not running")
        out: concurrent.futures.Future[CheckpointInfo] = concurrent.futures.Future()
        if _in_loop(loop):
            self._export.begin(path, out)
        else:
            loop.call_soon_threadsafe(self._export.begin, path, out)
        return await asyncio.wrap_future(out)

    def serve_view(
        self, endpoint: str = "tcp://127.0.0.1:*", keys: ServerKeys | None = None,
        timeout: float = 5.0,
    ) -> str:  # fmt: skip
        """Let peers clone this router's view (``config.clone_from``); returns the bound endpoint.

        Binds a ROUTER on ``endpoint`` (loopback by default; anything reachable
        beyond this host logs a warning, a loud one without ``keys``, the CURVE
        server keys of :mod:`kvwire.security`). Each clone gets the checkpoint's
        record stream, made a rank at a time as its credit allows; the engines pay
        only the replay of what the clone missed. While running; any thread.
        """
        loop = self._loop
        if loop is None or not self._running:
            raise RuntimeError("serve_view() needs a running subscriber")
        if self._view_sink is None:
            raise TypeError("serving a view needs a ViewSink (export_rank, import_rank)")
        if _in_loop(loop):
            return self._export.serve(endpoint, keys)
        out: concurrent.futures.Future[str] = concurrent.futures.Future()

        def serve() -> None:
            try:
                out.set_result(self._export.serve(endpoint, keys))
            except BaseException as exc:
                out.set_exception(exc)

        loop.call_soon_threadsafe(serve)
        return out.result(timeout)

    # --- iterator output ----------------------------------------------------------------

    def __aiter__(self) -> AsyncIterator[SinkItem]:
        if self._delivery.sink is None:
            return self._delivery.items()
        raise TypeError("this Subscriber delivers to its sink, not to an iterator")


_REPLAYING = frozenset({Phase.STARTING, Phase.REPLAYING, Phase.BACKOFF})
"""Phases with a replay out or due that must end before the rank is in sequence."""


def _status(link: RankLink) -> RankStatus:
    st = link.stream.status(
        link.worker_id, link.rank, link.endpoints.endpoint, link.endpoints.replay_endpoint
    )
    if link.on_hold:  # its view is still loading: whatever the stream read, not SYNCED yet
        st = msgspec.structs.replace(
            st, state=RankState.SYNCING, reason=f"the view is loading; {st.reason}"
        )
    return st


def _in_loop(loop: asyncio.AbstractEventLoop) -> bool:
    try:
        return asyncio.get_running_loop() is loop
    except RuntimeError:
        return False
