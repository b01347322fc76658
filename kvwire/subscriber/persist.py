"""A subscriber's view outliving it: restored at start, written out or served while it runs.

Both halves act on the subscriber's links from its loop and leave the format to
:mod:`~kvwire.subscriber.checkpoint` and the transport to
:mod:`~kvwire.subscriber.clone`; the facade only starts, stops and forwards.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, cast

import zmq

from kvwire.security import SecurityError, ServerKeys
from kvwire.subscriber.checkpoint import (
    BackgroundWrite,
    CheckpointError,
    CheckpointInfo,
    Restored,
    RestoreProgress,
    ViewStream,
    load_file,
    write_file,
)
from kvwire.subscriber.clone import CloneServer, clone_view
from kvwire.subscriber.config import SubscriberConfig
from kvwire.subscriber.seq import StreamPosition
from kvwire.subscriber.sink import EventSink, ViewSink

if TYPE_CHECKING:
    from kvwire.subscriber.env import LinkEnv
    from kvwire.subscriber.link import RankLink

__all__ = ["Restore", "ViewExport"]

log = logging.getLogger("kvwire.subscriber")

Key = tuple[str, int]


TURN_WAIT_S = 1.0
"""The longest an import waits for the loop's turn (a loop that is stopping, or busy)."""


def loop_turn(loop: asyncio.AbstractEventLoop, stopping: Callable[[], bool]) -> None:
    """From another thread: return once ``loop`` has run a pass past what was ready at the
    call (its ready sockets read, the callbacks queued before run), or after
    :data:`TURN_WAIT_S`. A load that holds the GIL in long native calls waits here between
    them, so the loop does not only get the interpreter's brief switches meanwhile."""
    if stopping() or loop.is_closed():
        return
    ran = threading.Event()
    try:
        loop.call_soon_threadsafe(loop.call_soon, ran.set)
    except RuntimeError:  # closed meanwhile
        return
    ran.wait(TURN_WAIT_S)


class Restore:
    """The view loaded at start (a peer's clone, else the checkpoint), overlapped with
    the ranks' replays: each rank it holds resumes where it was taken as soon as its
    position is read, on hold until the whole view is imported.

    ``replace`` puts a fresh link (a fresh stream) in place of a rank's (None: its
    source is gone); ``find`` is a rank's link now.
    """

    def __init__(
        self,
        config: SubscriberConfig,
        sink: ViewSink | None,
        replace: Callable[[RankLink], RankLink | None],
        find: Callable[[Key], RankLink | None],
    ) -> None:
        self._config = config
        self._sink = sink
        self._replace = replace
        self._find = find
        self.env: LinkEnv | None = None
        """While the subscriber runs: where the ranks resumed connect."""
        # While a view loads: the ranks it may hold (their links wait on hold), those
        # waiting for a position, and those resumed from the view being loaded.
        self._restoring: frozenset[Key] = frozenset()
        self._waiting: dict[Key, RankLink] = {}
        self._resumed: dict[Key, RankLink] = {}
        self.restored: Restored | None = None
        self.progress = RestoreProgress()
        self.refusals: list[str] = []
        self.cancel = threading.Event()

    def begin(self, followed: set[Key]) -> None:
        """The links of these ranks open next, on hold (:meth:`hold`)."""
        self._restoring = frozenset(followed)

    def hold(self, link: RankLink) -> None:
        """A new link: one the loading view may hold waits on hold for its position."""
        key = (link.worker_id, link.rank)
        if key in self._restoring:
            link.hold()
            self._waiting[key] = link

    def stop(self) -> None:
        self.env = None
        self.cancel.set()

    def load(
        self, ctx: zmq.Context[Any], loop: asyncio.AbstractEventLoop, stopping: Callable[[], bool]
    ) -> Restored | None:
        """On a worker thread: clone the peer's view, or else load the checkpoint."""
        config, sink = self._config, self._sink
        assert sink is not None
        followed = self._restoring

        def announce(positions: dict[Key, StreamPosition]) -> None:
            loop.call_soon_threadsafe(self._resume, positions)

        def turn() -> None:
            loop_turn(loop, stopping)

        restored = None
        if config.clone_from is not None:
            try:
                restored = clone_view(
                    ctx,
                    config.clone_from,
                    sink,
                    followed,
                    keys=config.clone_keys,
                    timeout=config.clone_timeout,
                    max_bytes=config.clone_max_bytes,
                    cancel=self.cancel,
                    progress=self.progress,
                    announce=announce,
                    turn=turn,
                )
            except (CheckpointError, SecurityError, zmq.ZMQError) as exc:
                loop.call_soon_threadsafe(self._refused)
                self._refuse(f"clone from {config.clone_from} refused: {exc}")
        if restored is None and config.checkpoint is not None and not stopping():
            try:
                self.progress = RestoreProgress()
                restored = load_file(
                    config.checkpoint,
                    sink,
                    followed,
                    progress=self.progress,
                    announce=announce,
                    turn=turn,
                )
            except FileNotFoundError:
                log.info("no checkpoint at %s yet: starting cold", config.checkpoint)
            except (CheckpointError, OSError) as exc:
                loop.call_soon_threadsafe(self._refused)
                self._refuse(f"checkpoint {config.checkpoint} refused: {exc}")
        self.progress.done = True
        if restored is None:
            return None
        self.restored = restored
        log.info(
            "%s: %d ranks resume from a view %.1f s old (%d bytes in %.3f s, %.3f s of it the "
            "loop's turns; %d records of ranks not followed skipped)",
            restored.source, len(restored.positions), time.time() - restored.created,
            restored.nbytes, restored.seconds, restored.turn_s, restored.skipped,
        )  # fmt: skip
        return restored

    def _refuse(self, why: str) -> None:
        self.refusals.append(why)
        log.warning("%s; nothing applied from it", why)

    def _resume(self, positions: dict[Key, StreamPosition]) -> None:
        """On the loop: these ranks' views are being imported; each resumes at its
        position and connects now, its replay asked at once, on hold."""
        env = self.env
        if env is None:
            return
        ready = []
        for key, pos in positions.items():
            link = self._waiting.get(key)
            if link is None or link.closed:
                continue  # removed meanwhile: its view is cleared at the end
            try:
                link.stream.resume(pos)
            except ValueError as exc:  # the view of the rank is of no position: cold
                env.log.note("resume", f"not resumed ({exc}): starting cold", link.subject)
                continue
            del self._waiting[key]
            self._resumed[key] = link
            ready.append(link)
        env.contacts.add(ready)

    def _refused(self) -> None:
        """On the loop: the view being loaded was refused (and cleared from the sink).
        The ranks resumed from it start over with fresh streams, still on hold (another
        view may follow); nothing they read reached the sink."""
        resumed, self._resumed = self._resumed, {}
        for key, link in resumed.items():
            fresh = None if link.closed else self._replace(link)
            if fresh is not None:
                self._waiting[key] = fresh

    def over(self, restored: Restored | None) -> None:
        """On the loop, the view loaded (or not): the ranks resumed from it give the sink
        what they held and go on; the others start cold (their imported view cleared)."""
        env = self.env
        assert env is not None and self._sink is not None
        clear = cast(EventSink, self._sink).clear  # (the subscriber's sink, a view one too)
        imported = restored.positions if restored is not None else {}
        self._restoring = frozenset()
        waiting, self._waiting = self._waiting, {}
        resumed, self._resumed = self._resumed, {}
        cold = []
        for key, link in resumed.items():
            if key in imported:
                link.release()
            elif not link.closed:  # (a view refused without being told: never applied)
                fresh = self._replace(link)
                if fresh is not None:
                    waiting[key] = fresh
        for key, link in waiting.items():
            if key in imported:
                clear(*key)  # a view it could not resume from
            link.release()
            cold.append(link)
        for key in imported:
            now = self._find(key)
            if now is None or now.closed:
                clear(*key)  # its source was removed meanwhile
        env.contacts.add(cold)


class ViewExport:
    """The view written out (a checkpoint: asked, periodic, at stop) or served to clones,
    from the loop, a few ranks at a time (:class:`ViewStream`)."""

    def __init__(
        self,
        config: SubscriberConfig,
        sink: ViewSink | None,
        links: Callable[[], list[RankLink]],
        flush: Callable[[], None],
    ) -> None:
        self._config = config
        self._sink = sink
        self._links = links
        self._flush = flush
        self._loop: asyncio.AbstractEventLoop | None = None  # while the subscriber runs
        self._ctx: zmq.Context[Any] | None = None
        self._writing: BackgroundWrite | None = None
        self._periodic: asyncio.TimerHandle | None = None
        self._servers: list[CloneServer] = []

    def start(self, loop: asyncio.AbstractEventLoop, ctx: zmq.Context[Any]) -> None:
        self._loop, self._ctx = loop, ctx

    def start_periodic(self) -> None:
        """Write every ``config.checkpoint_every`` seconds from now (once the view is whole)."""
        every = self._config.checkpoint_every
        if every is not None and self._loop is not None:
            self._periodic = self._loop.call_later(every, self._due)

    @property
    def keyed(self) -> bool:
        """Whether a clone service authenticated its peers (the context's ZAP handler)."""
        return any(server.keyed for server in self._servers)

    def begin(
        self, path: str | None, out: concurrent.futures.Future[CheckpointInfo] | None
    ) -> None:
        """On the loop: start a background write, or queue behind the one under way."""
        loop, sink = self._loop, self._sink
        try:
            target = path if path is not None else self._config.checkpoint
            if target is None:
                raise ValueError("no checkpoint path: give one, or set config.checkpoint")
            if sink is None:
                raise TypeError("checkpoints need a ViewSink (export_rank, import_rank)")
            if loop is None:
                raise RuntimeError("the subscriber stopped")
        except Exception as exc:
            if out is not None:
                out.set_exception(exc)
            return
        busy = self._writing
        if busy is not None:
            if out is None:
                return  # a periodic write while one is under way: skipped
            busy.future.add_done_callback(
                lambda _: loop.call_soon_threadsafe(self.begin, target, out)
            )
            return
        write = BackgroundWrite(
            loop.call_later, ViewStream(self._links(), sink, self._flush), target
        )
        self._writing = write

        def done(f: concurrent.futures.Future[CheckpointInfo]) -> None:
            loop.call_soon_threadsafe(self._written, write)
            if out is not None:
                exc = f.exception()
                if exc is not None:
                    out.set_exception(exc)
                else:
                    out.set_result(f.result())

        write.future.add_done_callback(done)
        write.step()

    def _written(self, write: BackgroundWrite) -> None:
        if self._writing is write:
            self._writing = None
        exc = write.future.exception()
        if exc is not None:
            log.warning("checkpoint not written: %s", exc)
        else:
            info = write.future.result()
            log.info(
                "checkpoint %s written: %d ranks (%d left out), %d bytes in %.3f s",
                info.path, info.ranks, info.skipped, info.nbytes, info.seconds,
            )  # fmt: skip

    def _due(self) -> None:
        if self._loop is None:
            return
        self.begin(None, None)
        self.start_periodic()

    def serve(self, endpoint: str, keys: ServerKeys | None) -> str:
        """On the loop: a clone service on ``endpoint``; the endpoint bound."""
        loop, ctx, sink = self._loop, self._ctx, self._sink
        if loop is None or ctx is None or sink is None:
            raise RuntimeError("the subscriber stopped")
        server = CloneServer(loop, ctx, endpoint, self._links, sink, keys, self._flush)
        self._servers.append(server)
        return server.endpoint

    def stop(self) -> None:
        """On a clean stop, on the loop: no more clones or periodic writes, then the view
        of every rank written (``config.checkpoint``) before the links close."""
        self._loop = None
        for server in self._servers:
            server.close()
        if self._periodic is not None:
            self._periodic.cancel()
        path = self._config.checkpoint
        if path is not None:
            self._final(path)

    def _final(self, path: str) -> None:
        writing, self._writing = self._writing, None
        if writing is not None:
            writing.abort()
            # (it may be renaming a whole view already: that older one must not land last)
            with contextlib.suppress(Exception):
                writing.future.exception(timeout=30)
        sink = self._sink
        if sink is None:
            return
        start = time.monotonic()
        view = ViewStream(self._links(), sink, self._flush)
        try:
            nbytes = write_file(path, view)
        except (CheckpointError, OSError) as exc:
            log.warning("checkpoint %s not written at stop: %s", path, exc)
            return
        log.info(
            "checkpoint %s written at stop: %d ranks (%d left out), %d bytes in %.3f s",
            path, view.records, view.skipped, nbytes, time.monotonic() - start,
        )  # fmt: skip
