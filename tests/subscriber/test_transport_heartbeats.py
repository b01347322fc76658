"""Heartbeats counted in the native drain: the same stream state as reading each one.

An idle fleet sends nothing but heartbeats; the transport has the native drain
count the in-sequence ones (:func:`receive.drain_beats`) and hands the count to
:meth:`RankStream.beats`. These tests hold that to the general path: which
messages count as heartbeats (exactly kvwire's empty batch of the rank, on the
next seq and topic), and, through random fault schedules, that a stream fed
that way ends every input in the very state of a twin fed message by message.
"""

from __future__ import annotations

import collections
import random
import struct
import time
from collections.abc import Callable
from typing import Any

import pytest
import zmq
from hypothesis import given
from hypothesis import strategies as st

from kvwire.publisher import EventPublisher, PublisherConfig
from kvwire.subscriber import (
    Action,
    Apply,
    EngineSource,
    RankState,
    RankStream,
    StreamConfig,
    StreamPosition,
    Subscriber,
    SubscriberConfig,
    receive,
)
from kvwire.wire import (
    AllBlocksCleared,
    KVEvent,
    KVEventBatch,
    encode_batch,
    epoch_topic,
    format_epoch,
    pack_seq,
)
from tests.subscriber.helpers import EPHEMERAL, Engine, inproc_pair
from tests.subscriber.sim import Harness, PublisherKind
from tests.subscriber.test_stream_model import MODEL, PUBLISHERS, config, ops
from tests.waiting import wait_for

pytestmark = pytest.mark.skipif(not receive.NATIVE, reason="libzmq not reachable")

TOPIC = epoch_topic(b"kv", format_epoch(7, heartbeat_s=1.0, snapshot=False))


def beat(seq: int, rank: int | None = 3, ts: float = 1e9) -> list[bytes]:
    return [TOPIC, pack_seq(seq), encode_batch(KVEventBatch(ts, [], rank))]


# --- which messages count --------------------------------------------------------------


def test_a_run_of_heartbeats_is_counted_and_the_rest_returned_whole(
    pair: tuple[zmq.Socket[bytes], zmq.Socket[bytes]],
) -> None:
    tx, rx = pair
    sent = [beat(10), beat(11, None), beat(12, ts=-0.5), beat(13, ts=float("nan"))]
    after = [beat(15), beat(16)]  # past a gap: the stream's to judge, as is all after it
    for m in sent + after:
        tx.send_multipart(m)
    count, last, rest = receive.drain_beats(rx, 100, TOPIC, 10, 3)
    assert count == 4
    assert last == sent[-1][2]
    assert rest == [tuple(m) for m in after]
    assert receive.drain_beats(rx, 100, TOPIC, 14, 3) == (0, None, [])


@pytest.mark.parametrize(
    "message",
    [
        pytest.param(beat(6), id="not-the-next-seq"),
        pytest.param([b"kv", pack_seq(5), beat(5)[2]], id="other-topic"),
        pytest.param(beat(5, rank=4), id="other-rank"),
        pytest.param(beat(5, rank=300), id="other-rank-uint16"),
        pytest.param(beat(5)[:2], id="two-frames"),
        pytest.param([*beat(5), b""], id="four-frames"),
        pytest.param([TOPIC, b"\x05", beat(5)[2]], id="short-seq"),
        pytest.param([TOPIC, pack_seq(5), beat(5)[2] + b"\x00"], id="trailing-byte"),
        pytest.param(
            [TOPIC, pack_seq(5), b"\x93\xca" + struct.pack(">f", 1.0) + b"\x90\x03"],
            id="float32-ts",
        ),
        pytest.param([TOPIC, pack_seq(5), b"\x93\xcb" + bytes(8) + b"\xdc\x00\x00\x03"], id="array16"),
        pytest.param([TOPIC, pack_seq(5), b"\x92\xcb" + bytes(8) + b"\x90"], id="two-fields"),
        pytest.param([TOPIC, pack_seq(5), b"\x93\xcb" + bytes(8) + b"\x90\xff"], id="negative-rank"),
        pytest.param(
            [TOPIC, pack_seq(5), encode_batch(KVEventBatch(1.0, [], 3))[:-1]], id="truncated"
        ),
    ],
)
def test_anything_but_the_next_heartbeat_is_returned_and_stops_the_count(
    pair: tuple[zmq.Socket[bytes], zmq.Socket[bytes]], message: list[bytes]
) -> None:
    tx, rx = pair
    tx.send_multipart(message)
    tx.send_multipart(beat(5))
    count, last, rest = receive.drain_beats(rx, 10, TOPIC, 5, 3)
    assert (count, last) == (0, None)
    first = () if len(message) > 3 else tuple(message)
    assert rest == [first, tuple(beat(5))]


def test_any_rank_is_taken_when_the_stream_has_none_and_large_ranks_compare_whole(
    pair: tuple[zmq.Socket[bytes], zmq.Socket[bytes]],
) -> None:
    tx, rx = pair
    for seq, rank in enumerate([0, 200, 70_000, 2**40]):
        tx.send_multipart(beat(seq, rank))
    assert receive.drain_beats(rx, 10, TOPIC, 0, -1)[0] == 4
    tx.send_multipart(beat(0, 2**40))
    tx.send_multipart(beat(1, 2**40 + 1))
    count, _, rest = receive.drain_beats(rx, 10, TOPIC, 0, 2**40)
    assert count == 1 and rest == [tuple(beat(1, 2**40 + 1))]


def test_the_cap_counts_heartbeats_too(pair: tuple[zmq.Socket[bytes], zmq.Socket[bytes]]) -> None:
    tx, rx = pair
    for seq in range(10):
        tx.send_multipart(beat(seq))
    assert receive.drain_beats(rx, 4, TOPIC, 0, 3)[:2] == (4, beat(3)[2])
    assert receive.drain_beats(rx, 100, TOPIC, 4, 3)[0] == 6


def test_a_seq_past_any_frame_counts_nothing_and_bad_arguments_raise(
    pair: tuple[zmq.Socket[bytes], zmq.Socket[bytes]],
) -> None:
    tx, rx = pair
    tx.send_multipart(beat(0))
    assert receive.drain_beats(rx, 10, TOPIC, 2**64, 3) == (0, None, [tuple(beat(0))])
    with pytest.raises(TypeError):
        receive.drain_beats(rx, 10, "kv", 0, 3)  # type: ignore[arg-type]
    with pytest.raises(ValueError):
        receive.drain_beats(rx, -1, TOPIC, 0, 3)


def test_the_pyzmq_fallback_counts_nothing(
    pair: tuple[zmq.Socket[bytes], zmq.Socket[bytes]],
) -> None:
    tx, rx = pair
    tx.send_multipart(beat(0))
    assert receive._drain_beats_py(rx, 10, TOPIC, 0, 3) == (0, None, [tuple(beat(0))])


def test_beat_key_only_while_in_sequence_and_beats_refuses_otherwise() -> None:
    stream = RankStream(rank=3, config=StreamConfig(replay=False))
    assert stream.beat_key() is None
    stream.connected(0.0)
    stream.live(beat(0), 0.1)  # the first batch: FOLLOWING, SYNCED
    assert stream.state is RankState.SYNCED
    assert stream.beat_key() == (TOPIC, 1, 3)
    stream.beats(2, beat(2)[2], 0.2)
    assert stream.expected_seq == 3 and stream.counters.batches == 3
    stream.live(beat(5), 0.3)  # a gap without replay: PARTIAL, yet in sequence again
    assert stream.state is RankState.PARTIAL and stream.beat_key() is None
    with pytest.raises(ValueError):
        stream.beats(1, beat(6)[2], 0.4)


# --- the model: counted heartbeats against a twin reading each one ---------------------


def _comparable(value: Any) -> Any:
    """A stream's part as plain values (held batches, requests and trackers by their fields)."""
    if isinstance(value, dict):
        return list(value.items())
    if isinstance(value, collections.deque):
        return list(value)
    if hasattr(value, "__slots__") and not hasattr(value, "__struct_fields__"):
        return (type(value), [_comparable(getattr(value, s)) for s in value.__slots__])
    return value


def _state(stream: RankStream) -> dict[str, Any]:
    """Everything a stream holds, comparable."""
    return {n: _comparable(v) for n, v in vars(stream).items() if n not in ("plain", "_out")}


class TwinStream(RankStream):
    """The stream under test, with a twin fed the same inputs through ``live`` alone."""

    def __init__(self, config: StreamConfig) -> None:
        super().__init__(rank=0, config=config)
        self.plain = RankStream(rank=0, config=config)

    def check(self, mine: list[Action], theirs: list[Action]) -> list[Action]:
        assert mine == theirs
        assert _state(self) == _state(self.plain)
        return theirs

    def tick(self, now: float) -> list[Action]:
        return self.check(super().tick(now), self.plain.tick(now))

    def replay_reply(self, frames: Any, token: int, now: float) -> list[Action]:
        return self.check(
            super().replay_reply(frames, token, now), self.plain.replay_reply(frames, token, now)
        )

    def connected(self, now: float) -> list[Action]:
        return self.check(super().connected(now), self.plain.connected(now))

    def disconnected(self, now: float) -> list[Action]:
        return self.check(super().disconnected(now), self.plain.disconnected(now))

    def resume(self, pos: StreamPosition) -> None:
        super().resume(pos)
        self.plain.resume(pos)


class TwinHarness(Harness):
    """Live messages go through a real socket and drain_beats, as the transport reads them."""

    def __init__(
        self, cfg: StreamConfig, sockets: tuple[zmq.Socket[bytes], zmq.Socket[bytes]], **kw: Any
    ) -> None:
        super().__init__(cfg, **kw)
        self.tx, self.rx = sockets
        self.rng = random.Random(kw.get("seed", 0))
        self.counted = 0

    def make_stream(self) -> RankStream:
        self.twin = TwinStream(self.config)
        return self.twin

    def deliver_live(self, n: int) -> None:
        while n > 0 and self.pipe:
            if self.pipe[0][0] != "live":
                super().deliver_live(1)
                n -= 1
                continue
            group: list[list[bytes]] = []
            while n > 0 and self.pipe and self.pipe[0][0] == "live":
                group.append(self.pipe.popleft()[1])
                n -= 1
            self._deliver(group)

    def _deliver(self, group: list[list[bytes]]) -> None:
        twin, now = self.twin, self.now
        for frames in group:
            self.tx.send_multipart(frames)
        expected = [twin.plain.live(frames, now) for frames in group]
        done = 0
        while done < len(group):
            cap = self.rng.randint(1, len(group) - done)  # reads split as the transport's may be
            key = twin.beat_key()
            if key is None:
                count, last, messages = 0, None, receive.drain(self.rx, cap, 3)
            else:
                count, last, messages = receive.drain_beats(self.rx, cap, *key)
            assert count + len(messages) == cap
            if last is not None:
                twin.beats(count, last, now)
                for actions in expected[done : done + count]:
                    # What the twin did with each: apply an empty batch, nothing else.
                    assert len(actions) == 1 and type(actions[0]) is Apply
                    assert actions[0].batch.events == []
                self.counted += count
                done += count
            for frames in messages:
                assert twin.live(frames, now) == expected[done]
                done += 1
        assert _state(twin) == _state(twin.plain)
        for actions in expected:
            self.feed(actions)


HEARTBEATING = [k for k in PUBLISHERS if k.heartbeat is not None]


@MODEL
@given(
    schedule=ops(replay=True),
    replay=st.booleans(),
    max_held=st.integers(1, 24),
    buffer_steps=st.integers(1, 40),
    seed=st.integers(0, 2**16),
    kind=st.sampled_from(HEARTBEATING),
)
def test_counted_heartbeats_leave_the_state_of_reading_each_one(
    schedule: list[tuple[Any, ...]],
    replay: bool,
    max_held: int,
    buffer_steps: int,
    seed: int,
    kind: PublisherKind,
) -> None:
    with inproc_pair() as sockets:
        h = TwinHarness(
            config(replay, max_held), sockets, buffer_steps=buffer_steps, seed=seed, kind=kind
        )
        for op in schedule:
            h.run(op)
        h.settle()
        h.check_settled()
        assert _state(h.twin) == _state(h.twin.plain)


def test_an_idle_heartbeating_stream_is_counted_not_read(
    pair: tuple[zmq.Socket[bytes], zmq.Socket[bytes]],
) -> None:
    """The model above must exercise the count: a quiet stream is all heartbeats."""
    kind = PublisherKind(epoch=True, heartbeat=0.5)
    h = TwinHarness(config(True, 8), pair, seed=1, kind=kind)
    h.connect()
    h.settle()
    for _ in range(3):
        h.run(("publish", "store", "deliver"))
    for _ in range(20):
        h.tick(0.5)
        h.deliver_live(len(h.pipe))
    h.settle()
    h.check_settled()
    assert h.twin.state is RankState.SYNCED
    assert h.counted >= 15


# --- through the Subscriber --------------------------------------------------------------


class RecordingSink:
    def __init__(self) -> None:
        self.applied: list[tuple[int, KVEventBatch]] = []

    def apply(self, worker_id: str, rank: int, batch: KVEventBatch) -> None:
        self.applied.append((rank, batch))

    def clear(self, worker_id: str, rank: int) -> None:
        self.applied.clear()


def test_a_sink_gets_every_batch_and_no_heartbeat_while_the_rank_follows_them() -> None:
    pub = EventPublisher(EPHEMERAL, EPHEMERAL, PublisherConfig(heartbeat_s=0.05), rank=0).start()
    sink = RecordingSink()
    engine = Engine(seed=5)
    source = EngineSource.from_rank_endpoints(
        "w", [(pub.bound_endpoint, pub.bound_replay_endpoint)]
    )
    try:
        with Subscriber([source], sink, config=SubscriberConfig(stream=StreamConfig(replay_timeout=0.5))) as sub:
            wait_for(lambda: sub.rank_state("w", 0) is RankState.SYNCED, 10, "SYNCED")
            before = sub.status()[0].counters
            mark = len(sink.applied)
            sent = [engine.batch() for _ in range(5)]
            for batch in sent:
                assert pub.publish(batch)
            last = pub.last_seq
            wait_for(
                lambda: sub.status()[0].expected_seq > last + 20, 10, "twenty heartbeats followed"
            )
            sent += [engine.batch() for _ in range(3)]
            for batch in sent[5:]:
                assert pub.publish(batch)
            last = pub.last_seq
            wait_for(lambda: sub.status()[0].expected_seq > last, 10, "the last batch")
            st = sub.status()[0]
            assert st.state is RankState.SYNCED
            # Every seq was taken, the heartbeats counted; the sink got the batches, and an
            # empty one only where a replay brought it (a stalled machine may cost a reconnect).
            assert st.counters.batches - before.batches >= 8 + 20
            applied = sink.applied[mark:]
            assert [(r, b.ts) for r, b in applied if b.events] == [(0, b.ts) for b in sent]
            empty = sum(1 for _, b in applied if not b.events)
            assert empty <= st.counters.replayed - before.replayed
    finally:
        pub.close()


def test_a_swept_rank_that_falls_silent_is_reconnected_and_stale_on_time_then_follows_again() -> (
    None
):
    """Ranks in sequence have no timer (their silence is swept): silence must still count."""
    hb = 0.1
    topic = epoch_topic(b"", format_epoch(9, heartbeat_s=hb, snapshot=False))
    ctx: zmq.Context[Any] = zmq.Context()
    pub: zmq.Socket[bytes] = ctx.socket(zmq.PUB)
    pub.setsockopt(zmq.LINGER, 0)
    pub.bind("tcp://127.0.0.1:*")
    endpoint = pub.getsockopt_string(zmq.LAST_ENDPOINT)
    seq = 0

    def send(events: list[KVEvent] | None = None) -> float:
        nonlocal seq
        batch = KVEventBatch(1.0, events or [], 0)
        sent = time.monotonic()  # before: the subscriber cannot read it earlier
        pub.send_multipart([topic, pack_seq(seq), encode_batch(batch)])
        seq += 1
        return sent

    source = EngineSource.from_rank_endpoints("w", [(endpoint, None)])
    try:
        with Subscriber([source], RecordingSink()) as sub:

            def beat_until(done: Callable[[], bool], what: str, clear: bool = False) -> None:
                deadline = time.monotonic() + 10
                while not done():
                    assert time.monotonic() < deadline, f"timed out waiting for {what}"
                    # (Batches sent before the subscription took are lost: a clear
                    # makes the rank exact again.)
                    send([AllBlocksCleared()] if clear else None)
                    time.sleep(hb)  # the publisher's cadence, not a synchronisation

            synced = lambda: sub.rank_state("w", 0) is RankState.SYNCED  # noqa: E731
            beat_until(synced, "SYNCED", clear=True)
            beat_until(lambda: sub.status()[0].expected_seq >= seq - 1 > 20, "a run of beats")
            # A stalled host may already have cost a reconnect above: count from here.
            before = sub.status()[0].counters.silent_reconnects
            last = send()
            wait_for(lambda: sub.status()[0].expected_seq == seq, 5, "the last heartbeat")
            wait_for(
                lambda: sub.status()[0].counters.silent_reconnects == before + 1, 5, "a reconnect"
            )
            reconnected = time.monotonic() - last
            wait_for(lambda: sub.rank_state("w", 0) is RankState.STALE, 5, "STALE")
            stale = time.monotonic() - last
            assert 2.5 * hb <= reconnected < 2.5 * hb + 2.0
            assert 3.5 * hb <= stale < 4.5 * hb + 2.0  # counted from the reconnect at worst
            lost = sub.status()[0].counters.seqs_lost
            beat_until(synced, "SYNCED again")
            assert sub.status()[0].counters.seqs_lost == lost
    finally:
        pub.close()
        ctx.term()
