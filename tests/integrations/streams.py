"""Side-by-side checks of two publishers' streams, and a scheduler-like workload of engine batches."""

from __future__ import annotations

import hashlib
import random
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import zmq

from kvwire.prefix_index import PrefixIndex
from kvwire.subscriber import EngineSource, RankState, RankStatus, Subscriber
from kvwire.wire import END_SEQ, normalise_hash, pack_seq, unpack_seq

BLOCK_SIZE = 4
Frames = list[bytes]


@dataclass
class EngineStructs:
    """How one engine builds its own events and batches."""

    stored: Callable[[list[Any], Any, list[int]], Any]
    removed: Callable[[list[Any]], Any]
    cleared: Callable[[], Any]
    batch: Callable[[list[Any]], Any]
    block_hash: Callable[[int], Any]


@dataclass
class Workload:
    """A seeded scheduler: requests store chains of blocks, evictions remove them, now and then a reset."""

    structs: EngineStructs
    seed: int = 0
    held: dict[Any, None] = field(default_factory=dict)
    _rng: random.Random = field(init=False)
    _next: int = 0

    def __post_init__(self) -> None:
        self._rng = random.Random(self.seed)

    def step(self) -> Any:
        """One iteration's batch of the engine's own events."""
        s, rng, events = self.structs, self._rng, []
        for _ in range(rng.randint(1, 3)):
            roll = rng.random()
            if roll < 0.6 or not self.held:
                n = rng.randint(1, 4)
                hashes = [s.block_hash(self._next + i) for i in range(n)]
                self._next += n
                parent = rng.choice(list(self.held)) if self.held and rng.random() < 0.5 else None
                tokens = [rng.randrange(50_000) for _ in range(n * BLOCK_SIZE)]
                events.append(s.stored(hashes, parent, tokens))
                self.held.update(dict.fromkeys(hashes))
            elif roll < 0.995:
                gone = rng.sample(list(self.held), rng.randint(1, min(3, len(self.held))))
                events.append(s.removed(gone))
                for h in gone:
                    del self.held[h]
            else:
                events.append(s.cleared())
                self.held.clear()
        return s.batch(events)

    def expected(self) -> set[int]:
        return {normalise_hash(h) for h in self.held}


def raw_digest(i: int) -> bytes:
    """A vLLM-style raw-digest block hash (32 bytes)."""
    return hashlib.sha256(i.to_bytes(8, "big")).digest()


def signed_hash(i: int) -> int:
    """An SGLang-style signed 64-bit block hash."""
    return int.from_bytes(raw_digest(i)[:8], "big", signed=True)


def subscribe(ctx: zmq.Context[Any], endpoint: str) -> zmq.Socket[bytes]:
    sub: zmq.Socket[bytes] = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.LINGER, 0)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.connect(endpoint)
    return sub


def join_in_lockstep(
    publishers: Sequence[Any], subs: Sequence[zmq.Socket[bytes]], ping: Callable[[], Any]
) -> int:
    """Publish one ping on every publisher at a time until every subscriber got one.

    Both streams then hold the same number of batches, so their seqs agree;
    returns that number (the seq the next batch gets).
    """
    deadline = time.monotonic() + 20
    got = [False] * len(subs)
    sent = 0
    while not all(got):
        assert time.monotonic() < deadline, "a subscriber never joined"
        for p in publishers:
            p.publish(ping())
        sent += 1
        for i, sub in enumerate(subs):
            while sub.poll(20):
                sub.recv_multipart()
                got[i] = True
    return sent


def receive(sub: zmq.Socket[bytes], n: int, first_seq: int = 0, timeout: float = 20.0) -> list[Frames]:
    """The next ``n`` live messages with seq >= ``first_seq`` (pings still in flight are skipped)."""
    out: list[Frames] = []
    deadline = time.monotonic() + timeout
    while len(out) < n:
        left = deadline - time.monotonic()
        assert left > 0 and sub.poll(int(left * 1000) + 1), f"got {len(out)} of {n} messages"
        frames = sub.recv_multipart()
        if unpack_seq(frames[1]) >= first_seq:
            out.append(frames)
    return out


def replay(ctx: zmq.Context[Any], endpoint: str, start: int = 0, timeout: float = 20.0) -> list[Frames]:
    """Every reply message of one replay request, its end marker included."""
    dealer: zmq.Socket[bytes] = ctx.socket(zmq.DEALER)
    dealer.setsockopt(zmq.LINGER, 0)
    dealer.connect(endpoint)
    try:
        dealer.send_multipart([b"", pack_seq(start)])
        out: list[Frames] = []
        deadline = time.monotonic() + timeout
        while True:
            left = deadline - time.monotonic()
            assert left > 0 and dealer.poll(int(left * 1000) + 1), f"replay stopped after {len(out)}"
            frames = dealer.recv_multipart()
            out.append(frames)
            if len(frames) >= 3 and frames[-2] == END_SEQ:
                return out
    finally:
        dealer.close(0)


def follow_until_exact(
    source: EngineSource, expected: Callable[[], set[int]], last_seq: int, timeout: float = 20.0
) -> RankStatus:
    """A Subscriber with a PrefixIndex, run until rank 0 is SYNCED holding exactly ``expected()``."""
    index = PrefixIndex(BLOCK_SIZE)
    sub = Subscriber([source], index).start()
    try:
        deadline = time.monotonic() + timeout
        while True:
            st = {s.rank: s for s in sub.status()}[0]
            held = index.blocks(source.worker_id, 0)
            if st.state is RankState.SYNCED and st.expected_seq == last_seq + 1 and held == expected():
                return st
            assert time.monotonic() < deadline, (
                f"state={st.state.name} expected_seq={st.expected_seq} last_seq={last_seq} "
                f"held={len(held)} engine={len(expected())} reason={st.reason!r}"
            )
            time.sleep(0.02)  # a poll under a deadline
    finally:
        sub.stop()


def assert_same_streams(
    zctx: zmq.Context[Any],
    own: Any,
    ours: Any,
    endpoints: tuple[tuple[str, str], tuple[str, str]],
    structs: EngineStructs,
    batches: int = 200,
) -> list[Frames]:
    """Feed the engine's own publisher and kvwire's the same batches; their bytes must match.

    ``endpoints``: (live, replay) of ``own``, then of ``ours``. Returns kvwire's
    live messages.
    """
    (own_live, own_replay), (ours_live, ours_replay) = endpoints
    subs = [subscribe(zctx, own_live), subscribe(zctx, ours_live)]
    try:
        first = join_in_lockstep([own, ours], subs, lambda: structs.batch([structs.cleared()]))
        a, b = Workload(structs, seed=3), Workload(structs, seed=3)
        for _ in range(batches):
            batch_a, batch_b = a.step(), b.step()
            batch_b.ts = batch_a.ts
            own.publish(batch_a)
            ours.publish(batch_b)
        live_own, live_ours = receive(subs[0], batches, first), receive(subs[1], batches, first)
        assert live_ours == live_own
        replay_own, replay_ours = replay(zctx, own_replay, start=5), replay(zctx, ours_replay, start=5)
        assert replay_ours == replay_own
        assert len(replay_ours) == ours.publisher.last_seq - 5 + 2  # seqs 5.., then the end marker
        return live_ours
    finally:
        for sub in subs:
            sub.close(0)


def assert_late_join_exact(pub: Any, structs: EngineStructs, source: EngineSource) -> None:
    """A scheduler publishes; a router that joins late is served by replay, then follows live; shutdown is clean."""
    workload = Workload(structs, seed=11)
    try:
        for _ in range(300):
            pub.publish(workload.step())
        joined = follow_until_exact(source, workload.expected, last_seq=pub.publisher.last_seq)
        assert joined.counters.replayed >= 300
        for _ in range(100):
            pub.publish(workload.step())
        follow_until_exact(source, workload.expected, last_seq=pub.publisher.last_seq)
        assert len(workload.held) > 5
    finally:
        pub.shutdown()
    stats = pub.publisher.stats()
    assert stats.published == 400 and stats.dropped_closed == 0 and stats.queue_depth == 0
    pub.shutdown()  # idempotent
    pub.publish(workload.step())  # after shutdown: counted, never raised into the scheduler
    assert pub.publisher.stats().dropped_closed == 1
