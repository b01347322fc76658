"""Helpers for socket tests: endpoints, an engine model, settings, rank status."""

from __future__ import annotations

import contextlib
import random
import shutil
import tempfile
import time
from collections.abc import Iterator, Sequence
from typing import Any

import msgspec
import zmq

from kvwire.publisher import EventPublisher
from kvwire.subscriber import EngineSource, RankState, RankStatus, StreamConfig, SubscriberConfig
from kvwire.wire import AllBlocksCleared, BlockRemoved, BlockStored, KVEvent, KVEventBatch

# Small timeouts so fault tests converge fast; still far above loopback latency.
FAST = SubscriberConfig(
    stream=StreamConfig(
        replay_timeout=0.5,
        replay_retries=2,
        backoff_initial=0.05,
        backoff_max=0.2,
        idle_probe=0.3,
    )
)


def fast(**kw: Any) -> SubscriberConfig:
    """:data:`FAST` with the subscriber settings ``kw`` changed."""
    return msgspec.structs.replace(FAST, **kw)


def streams(config: StreamConfig) -> SubscriberConfig:
    """The default subscriber settings with every rank's stream tuned as ``config``."""
    return SubscriberConfig(stream=config)


EPHEMERAL = "tcp://127.0.0.1:*"
"""Bind address for every test publisher on tcp: each rank gets its own ephemeral port."""


def bound_source(worker_id: str, pubs: Sequence[EventPublisher], **kw: Any) -> EngineSource:
    """An engine following what started publishers bound, rank ``r`` = ``pubs[r]``."""
    ranks = [(p.bound_endpoint, p.bound_replay_endpoint) for p in pubs]
    return EngineSource.from_rank_endpoints(worker_id, ranks, **kw)


@contextlib.contextmanager
def ipc_endpoints() -> Iterator[tuple[str, str]]:
    """Publish and replay base endpoints as ipc paths in a short private directory."""
    d = tempfile.mkdtemp(prefix="kvw")
    try:
        yield f"ipc://{d}/ev", f"ipc://{d}/rp"
    finally:
        shutil.rmtree(d, ignore_errors=True)


@contextlib.contextmanager
def inproc_pair() -> Iterator[tuple[zmq.Socket[bytes], zmq.Socket[bytes]]]:
    """Two connected inproc PAIR sockets without limits: a sender and the socket under test."""
    ctx = zmq.Context()
    a: zmq.Socket[bytes] = ctx.socket(zmq.PAIR)
    b: zmq.Socket[bytes] = ctx.socket(zmq.PAIR)
    for s in (a, b):
        s.setsockopt(zmq.SNDHWM, 0)
        s.setsockopt(zmq.RCVHWM, 0)
        s.setsockopt(zmq.LINGER, 0)
    a.bind("inproc://pair")
    b.connect("inproc://pair")
    try:
        yield a, b
    finally:
        a.close()
        b.close()
        ctx.term()


class Engine:
    """A model engine: makes batches and keeps the truth (the blocks its cache holds)."""

    def __init__(self, seed: int, rank: int = 0, life: int = 0) -> None:
        self.rng = random.Random(seed)
        self.rank = rank
        self.life = life
        self.truth: set[int] = set()
        self.recent: list[int] = []  # the last stored blocks: removal candidates
        self.next_block = (seed % 1000 + 1) * 10_000_000 + life * 1_000_000 + 1

    def batch(self, *, clear: bool = False, blocks: int = 2) -> KVEventBatch:
        events: list[KVEvent] = []
        if clear:
            events.append(AllBlocksCleared())
            self.truth.clear()
            self.recent = []
        recent = [h for h in self.recent if h in self.truth]
        if recent and self.rng.random() < 0.4:
            victims = self.rng.sample(recent, k=min(2, len(recent)))
            events.append(BlockRemoved(block_hashes=victims))
            self.truth.difference_update(victims)
        hashes = list(range(self.next_block, self.next_block + blocks))
        self.next_block += blocks
        self.truth.update(hashes)
        self.recent = hashes
        events.append(
            BlockStored(
                block_hashes=hashes,
                parent_block_hash=None,
                token_ids=[(h * 31 + i) % 50_000 for h in hashes for i in range(4)],
                block_size=4,
            )
        )
        return KVEventBatch(time.time(), events, self.rank)

    def publish(self, pub: EventPublisher, n: int, **kw: Any) -> None:
        for _ in range(n):
            assert pub.publish(self.batch(**kw)), "the publisher queue overflowed"


def rank_status(statuses: list[RankStatus], worker: str, rank: int) -> RankStatus:
    for st in statuses:
        if st.worker_id == worker and st.rank == rank:
            return st
    raise AssertionError(f"no status for {worker} rank {rank}")


def settled(statuses: list[RankStatus], worker: str, rank: int, next_seq: int) -> bool:
    """The rank has dealt with every batch up to ``next_seq`` and is not mid-repair."""
    if not any(s.worker_id == worker and s.rank == rank for s in statuses):
        return False
    st = rank_status(statuses, worker, rank)
    return (
        st.expected_seq == next_seq
        and st.state is not RankState.SYNCING
        and not st.replay_pending
        and st.held == 0
    )
