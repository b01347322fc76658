"""Where a subscriber's batches go: a sink, or the async iterator's queue.

One :class:`Delivery` per subscriber. With a sink, batches are applied as the
links read them, and a buffering sink (one with ``flush()``) is flushed once a
round of reading is over. Without one, :data:`SinkItem` values are queued for
``async for``; when ``backlog`` are waiting, reading stops (the links defer
themselves here) until the reader has taken half of them, so the publishers'
high-water marks turn a slow reader into visible gaps rather than memory.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from typing import TYPE_CHECKING, Any

from kvwire.subscriber.actions import Apply, ApplyPayload
from kvwire.subscriber.sink import Applied, Cleared, EventSink, PayloadSink, SinkItem

if TYPE_CHECKING:
    from kvwire.subscriber.link import RankLink

__all__ = ["Delivery"]

_END = object()


class Delivery:
    """A subscriber's output: sink calls, flushes, or the iterator's queue with backpressure."""

    def __init__(self, sink: EventSink | None, backlog: int) -> None:
        self.sink = sink
        self.payload_sink = sink if isinstance(sink, PayloadSink) else None
        self.sink_flush: Callable[[], Any] | None = getattr(sink, "flush", None)
        self._backlog = backlog
        # (an asyncio.Queue binds to the running loop on first use)
        self._queue: asyncio.Queue[SinkItem | object] | None = (
            asyncio.Queue() if sink is None else None
        )
        self.paused = False
        """Whether the iterator's reader is behind: links defer their reading."""
        self._deferred: dict[RankLink, None] = {}  # ranks waiting for the iterator's reader
        self._pause: Callable[[], None] | None = None
        self._resume: Callable[[list[RankLink]], None] | None = None
        self.to_flush: dict[RankLink, None] = {}  # ranks whose batches a flush would apply

    # --- the sink ------------------------------------------------------------------------

    def apply(self, link: RankLink, action: Apply) -> None:
        sink = self.sink
        if sink is None:
            self._put(Applied(link.worker_id, link.rank, action.seq, action.batch))
            return
        try:
            sink.apply(link.worker_id, link.rank, action.batch)
        except Exception as exc:
            link.sink_failed(exc)

    def apply_payload(self, link: RankLink, action: ApplyPayload) -> None:
        sink = self.payload_sink
        assert sink is not None  # only a PayloadSink's streams make them
        try:
            sink.apply_payload(
                link.worker_id, link.rank, action.payload, link.stream.config.decode_limits
            )
        except Exception as exc:
            link.sink_failed(exc)

    def clear(self, link: RankLink, reason: str) -> None:
        sink = self.sink
        if sink is None:
            self._put(Cleared(link.worker_id, link.rank, reason))
            return
        try:
            sink.clear(link.worker_id, link.rank)
        except Exception:
            link.stream.counters.sink_errors += 1
            link.note("sink-clear", "sink.clear raised", exc_info=True)

    def hint(self, link: RankLink, name: str, *args: object) -> None:
        """Call the sink's optional ``name(worker_id, rank, *args)`` where it has one: only
        a hint (room to make, blocks to come), so a failure is logged and nothing more."""
        method = getattr(self.sink, name, None)
        if method is None:
            return
        try:
            method(link.worker_id, link.rank, *args)
        except Exception as exc:
            kind = "sink-" + name.replace("_", "-")
            link.note(kind, f"sink.{name} raised {exc!r}", exc_info=exc)

    def flush_later(self, link: RankLink) -> None:
        """``link`` gave the sink batches: flush a buffering sink once the round is over."""
        if self.sink_flush is not None:
            self.to_flush[link] = None

    def flush(self) -> None:
        """The round of reading is over: let a buffering sink apply what it holds."""
        if not self.to_flush:
            return
        links, self.to_flush = self.to_flush, {}
        flush = self.sink_flush
        if flush is None:
            return
        try:
            flush()
        except Exception as exc:
            # What the flush held came from these ranks: each view is suspect.
            for link in links:
                if not link.closed:
                    link.sink_failed(exc)

    def forget(self, link: RankLink) -> None:
        """The rank is gone: nothing of it is flushed or resumed."""
        self._deferred.pop(link, None)
        self.to_flush.pop(link, None)

    # --- the iterator --------------------------------------------------------------------

    def defer(self, link: RankLink) -> None:
        self._deferred[link] = None

    def on_backpressure(
        self, pause: Callable[[], None], resume: Callable[[list[RankLink]], None]
    ) -> None:
        """Who stops reading when the iterator's reader falls behind, and reads on from
        the deferred ranks once it catches up."""
        self._pause, self._resume = pause, resume

    def _put(self, item: SinkItem) -> None:
        queue = self._queue
        assert queue is not None
        queue.put_nowait(item)
        if queue.qsize() >= self._backlog and not self.paused:
            self.paused = True  # reading stops until the reader catches up
            if self._pause is not None:
                self._pause()

    def end(self) -> None:
        """No more items: the iterator ends once it has given the queued ones."""
        if self._queue is not None:
            self._queue.put_nowait(_END)

    async def items(self) -> AsyncIterator[SinkItem]:
        queue = self._queue
        assert queue is not None
        while True:
            item = await queue.get()
            if item is _END:
                queue.put_nowait(_END)  # for any other reader
                return
            if self.paused and queue.qsize() <= self._backlog // 2:
                self.paused = False
                if self._resume is not None:
                    deferred, self._deferred = list(self._deferred), {}
                    self._resume(deferred)
            yield item  # type: ignore[misc]
