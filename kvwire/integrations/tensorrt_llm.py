"""TensorRT-LLM's KV events through kvwire: a relay thread over the pull API.

TensorRT-LLM has no publisher registry. With ``KvCacheConfig(enable_block_reuse=True,
event_buffer_max_size>0)`` its ``LLM.get_kv_cache_events(timeout)`` returns the
events as dictionaries (``KVCacheEventSerializer``'s format); the relay polls
them and publishes through one kvwire :class:`EventPublisher` per
``attention_dp_rank`` (rank ``r`` at base port + ``r``)::

    relay = TrtllmEventRelay(llm, block_size=32, endpoint="tcp://127.0.0.1:5557",
                             replay_endpoint="tcp://127.0.0.1:5657").start()
    ...
    relay.stop()

:class:`RankConverter` is the conversion, without I/O: ``stored`` events
become stores of full blocks only (a partial block ends the chain), ``removed``
events become removals of blocks that were published (the rest are
suppressed), ``created`` and ``updated`` are ignored, only the largest
``window_size`` seen is followed (a larger one clears what a smaller one
published), and a gap in ``event_id`` becomes a visible seq gap, so
subscribers know the rank is no longer exact. Hashes go out as signed 64-bit,
as TensorRT-LLM's own publisher sends them.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from kvwire.integrations.config import RelayConfig
from kvwire.publisher import EventCollector, EventPublisher
from kvwire.wire import WireError, normalise_hash

__all__ = [
    "Clear",
    "ConverterStats",
    "Lost",
    "RankConverter",
    "Remove",
    "Store",
    "TrtllmEventRelay",
]

log = logging.getLogger(__name__)

_MEDIUM = {0: "GPU", 1: "CPU"}
"""TensorRT-LLM's ``cache_level``: 0 primary (device), 1 secondary (host) memory."""


@dataclass
class Store:
    """Full blocks that entered the cache, as one chain under ``parent`` (unsigned hashes)."""

    hashes: list[int]
    parent: int | None
    token_ids: list[int]
    medium: str
    extra_keys: list[Any] | None


@dataclass(frozen=True)
class Remove:
    """Published blocks that left the cache (unsigned hashes)."""

    hashes: list[int]


@dataclass(frozen=True)
class Clear:
    """Everything published so far is void (a larger window, or the engine restarted)."""


@dataclass(frozen=True)
class Lost:
    """Events ``first`` .. ``last`` never arrived, or arrived unreadable."""

    first: int
    last: int


Action = Store | Remove | Clear | Lost


@dataclass
class ConverterStats:
    """What a converter did with the events it was fed."""

    events: int = 0
    stored_blocks: int = 0
    partial_blocks: int = 0
    removed_blocks: int = 0
    suppressed_removals: int = 0
    ignored: int = 0
    other_window: int = 0
    lost_events: int = 0
    malformed: int = 0


@dataclass
class RankConverter:
    """One attention-DP rank's TensorRT-LLM event dictionaries, turned into kvwire actions."""

    block_size: int
    window_size: int | None = None
    """The largest ``window_size`` seen; events of smaller windows are ignored."""
    last_event_id: int | None = None
    stats: ConverterStats = field(default_factory=ConverterStats)
    _published: set[int] = field(default_factory=set)

    def __post_init__(self) -> None:
        if self.block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {self.block_size}")

    @property
    def published(self) -> frozenset[int]:
        """The blocks subscribers were told about and not told to remove (unsigned)."""
        return frozenset(self._published)

    def feed(self, event: Mapping[str, Any]) -> list[Action]:
        """The actions for one event dictionary, in order."""
        self.stats.events += 1
        actions: list[Action] = []
        event_id = event.get("event_id") if isinstance(event, Mapping) else None
        if type(event_id) is not int:
            self.stats.malformed += 1
            log.warning("TensorRT-LLM KV event without an integer event_id: %.200r", event)
            nxt = 0 if self.last_event_id is None else self.last_event_id + 1
            return [Lost(nxt, nxt)]
        last = self.last_event_id
        if last is not None and event_id > last + 1:
            self.stats.lost_events += event_id - last - 1
            actions.append(Lost(last + 1, event_id - 1))
        elif last is not None and event_id <= last:  # ids start over: the engine restarted
            actions.append(self._clear())
            self.window_size = None
        self.last_event_id = event_id
        try:
            actions += self._convert(event)
        except (KeyError, TypeError, ValueError, WireError) as exc:
            self.stats.malformed += 1
            log.warning("unreadable TensorRT-LLM KV event %d (%s): a gap", event_id, exc)
            actions.append(Lost(event_id, event_id))
        return actions

    def _clear(self) -> Clear:
        self._published.clear()
        return Clear()

    def _convert(self, event: Mapping[str, Any]) -> list[Action]:
        data = event["data"]
        kind = data["type"]
        if kind not in ("stored", "removed"):
            self.stats.ignored += 1  # created, updated
            return []
        actions: list[Action] = []
        window = event.get("window_size")
        if window is not None:
            if self.window_size is None or window > self.window_size:
                if self.window_size is not None and self._published:
                    actions.append(self._clear())
                self.window_size = int(window)
            elif window < self.window_size:
                self.stats.other_window += 1
                return []
        if kind == "removed":
            hashes = [normalise_hash(h) for h in data["block_hashes"]]
            gone = [h for h in hashes if h in self._published]
            self._published.difference_update(gone)
            self.stats.removed_blocks += len(gone)
            self.stats.suppressed_removals += len(hashes) - len(gone)
            if gone:
                actions.append(Remove(gone))
            return actions
        parent_raw = data.get("parent_hash")
        parent = None if parent_raw is None else normalise_hash(parent_raw)
        chain: Store | None = None
        for block in data["blocks"]:
            tokens = block["tokens"]
            if len(tokens) != self.block_size:
                self.stats.partial_blocks += 1
                break  # a partial block ends its chain
            h = normalise_hash(block["block_hash"])
            ids = [int(t["token_id"]) for t in tokens]
            extra = [int(t.get("token_extra_id") or 0) for t in tokens]
            medium = _MEDIUM.get(block.get("cache_level", 0), "GPU")
            if chain is None or chain.medium != medium:
                chain = Store([], chain.hashes[-1] if chain else parent, [], medium, None)
                actions.append(chain)
            chain.hashes.append(h)
            chain.token_ids.extend(ids)
            if any(extra):  # multimodal content: the block's identity includes it
                if chain.extra_keys is None:
                    chain.extra_keys = [None] * (len(chain.hashes) - 1)
                chain.extra_keys.append(tuple(extra))
            elif chain.extra_keys is not None:
                chain.extra_keys.append(None)
            self._published.add(h)
            self.stats.stored_blocks += 1
        return actions


class TrtllmEventRelay:
    """Polls ``get_kv_cache_events`` on a thread and publishes each rank's events through kvwire.

    ``llm`` is a TensorRT-LLM ``LLM`` (anything with ``get_kv_cache_events(timeout)``).
    Settings left ``None`` come from ``config`` (by default :class:`RelayConfig`
    read from the ``KVWIRE_*`` variables; endpoints loopback by default). Each
    poll publishes at most one batch per rank.
    """

    def __init__(
        self,
        llm: Any,
        *,
        block_size: int | None = None,
        endpoint: str | None = None,
        replay_endpoint: str | None = None,
        ranks: int = 1,
        poll_timeout_s: float = 0.1,
        config: RelayConfig | None = None,
    ) -> None:
        self.config = config or RelayConfig.from_env()
        self.block_size = block_size or self.config.block_size
        self.endpoint = endpoint or self.config.endpoint
        self.replay_endpoint = replay_endpoint or self.config.replay_endpoint
        if ranks < 1:
            raise ValueError(f"ranks must be >= 1, got {ranks}")
        self.ranks = ranks
        self.poll_timeout_s = poll_timeout_s
        self._publisher_config = self.config.publisher_config()
        self._server_keys = self.config.server_keys()
        self._poll: Callable[[float], Sequence[Mapping[str, Any]] | None] = llm.get_kv_cache_events
        self.converters: dict[int, RankConverter] = {}
        self.publishers: dict[int, EventPublisher] = {}
        self._collectors: dict[int, EventCollector] = {}
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.poll_errors = 0

    def _rank(self, rank: int) -> tuple[RankConverter, EventCollector]:
        if rank not in self.converters:
            publisher = EventPublisher(
                self.endpoint,
                self.replay_endpoint,
                self._publisher_config,
                rank=rank,
                server_keys=self._server_keys,
            ).start()
            self.publishers[rank] = publisher
            self._collectors[rank] = EventCollector(publisher, self.block_size, hash_format="signed")
            self.converters[rank] = RankConverter(self.block_size)
        return self.converters[rank], self._collectors[rank]

    def bound_endpoints(self) -> list[tuple[str, str | None]]:
        """(live, replay) endpoints every rank bound, in rank order."""
        return [
            (p.bound_endpoint, p.bound_replay_endpoint)
            for _, p in sorted(self.publishers.items())
        ]

    def handle(self, events: Iterable[Mapping[str, Any]]) -> None:
        """Convert and publish one poll's events (at most one batch per rank, gaps between).

        The relay thread calls this after each poll; call it directly only on
        a relay that was not started (one caller at a time).
        """
        touched: set[int] = set()
        for event in events:
            rank = event.get("attention_dp_rank") if isinstance(event, Mapping) else None
            rank = rank if type(rank) is int and rank >= 0 else 0
            converter, collector = self._rank(rank)
            touched.add(rank)
            for action in converter.feed(event):
                if isinstance(action, Store):
                    collector.stored(
                        action.hashes, action.parent, action.token_ids,
                        medium=action.medium, extra_keys=action.extra_keys,
                    )  # fmt: skip
                elif isinstance(action, Remove):
                    collector.removed(action.hashes)
                elif isinstance(action, Clear):
                    collector.cleared()
                else:
                    collector.flush()
                    self.publishers[rank].skip()
                    log.warning(
                        "TensorRT-LLM KV events %d..%d of rank %d were lost: a gap in its seqs",
                        action.first, action.last, rank,
                    )  # fmt: skip
        for rank in touched:
            self._collectors[rank].flush()

    def start(self) -> TrtllmEventRelay:
        """Bind every rank's sockets and start polling."""
        for rank in range(self.ranks):
            self._rank(rank)
        self._thread = threading.Thread(target=self._run, name="kvwire-trtllm-relay", daemon=True)
        self._thread.start()
        log.info("kvwire relays TensorRT-LLM KV events on %s", self.bound_endpoints())
        return self

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                events = self._poll(self.poll_timeout_s)
            except Exception as exc:  # the engine shutting down, or a bad poll: keep going
                self.poll_errors += 1
                log.warning("get_kv_cache_events failed: %s", exc)
                self._stop.wait(self.poll_timeout_s)
                continue
            if events:
                self.handle(events)

    def stop(self, timeout: float = 5.0) -> None:
        """Stop polling, then flush and close every publisher."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout + self.poll_timeout_s)
        deadline = time.monotonic() + timeout
        for publisher in self.publishers.values():
            publisher.close(max(0.0, deadline - time.monotonic()))

    def __enter__(self) -> TrtllmEventRelay:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
