"""RankStream against the failures of issues #11 and #12, fed plain frames.

Each test is one way a rank could read SYNCED while its view is wrong, or
stay stuck, or lose an action; kvwire's publishers' epochs, heartbeats and
snapshots (``docs/wire.md`` sections 5-7) are built with the wire helpers.
"""

from __future__ import annotations

import itertools
import math
from typing import Any

import msgspec
import pytest

from kvwire.subscriber import (
    Action,
    Apply,
    BlockSetSink,
    ClearRank,
    RankState,
    RankStream,
    Reconnect,
    RequestReplay,
    RequestSnapshot,
    Reserve,
    StateChanged,
    StreamConfig,
    batches,
    recovery,
    timers,
)
from kvwire.subscriber import phases as phases_module
from kvwire.subscriber import stream as stream_module
from kvwire.subscriber.phases import (
    EVENTS,
    HANDLERS,
    TRANSITIONS,
    Event,
    Input,
    Phase,
    event_table,
    input_table,
)
from kvwire.wire import (
    BlockRemoved,
    BlockStored,
    KVEventBatch,
    SnapshotChunk,
    encode_batch,
    epoch_topic,
    format_epoch,
    pack_seq,
    replay_end_frames,
    replay_item_frames,
    snapshot_chunk_frames,
    snapshot_end_frames,
    snapshot_refused_frames,
)
from tests.subscriber.sim import Harness, PublisherKind

TOPIC = b"kv"
CFG = StreamConfig(
    replay_timeout=1.0,
    replay_retries=2,
    backoff_initial=0.1,
    backoff_max=0.4,
    idle_probe=5.0,
    replay_deadline=4.0,
    snapshot_deadline=4.0,
)


def epoch(instance: int = 1, *, hb: float | None = None, snap: bool = False) -> bytes:
    return epoch_topic(TOPIC, format_epoch(instance, heartbeat_s=hb, snapshot=snap))


def store(seq: int, *hashes: int, life: int = 0) -> bytes:
    hs = list(hashes) or [life * 1000 + seq]
    event = BlockStored(
        block_hashes=hs, parent_block_hash=None, token_ids=[1] * (4 * len(hs)), block_size=4
    )
    return encode_batch(KVEventBatch(float(seq), [event], 0))


def remove(seq: int, *hashes: int) -> bytes:
    return encode_batch(KVEventBatch(float(seq), [BlockRemoved(block_hashes=list(hashes))], 0))


def heartbeat(seq: int) -> bytes:
    return encode_batch(KVEventBatch(float(seq), [], 0))


class Rank:
    """A stream and the sink it feeds, with the requests it made."""

    def __init__(self, config: StreamConfig = CFG) -> None:
        self.s = RankStream(0, config)
        self.sink = BlockSetSink()
        self.requests: list[RequestReplay | RequestSnapshot] = []
        self.applied: list[int] = []
        self.clears: list[str] = []

    def run(self, actions: list[Action]) -> list[Action]:
        for a in actions:
            if isinstance(a, Apply):
                self.sink.apply("w", 0, a.batch)
                self.applied.append(a.seq)
            elif isinstance(a, ClearRank):
                self.sink.clear("w", 0)
                self.clears.append(a.reason)
            elif isinstance(a, RequestReplay | RequestSnapshot):
                self.requests.append(a)
        return actions

    @property
    def blocks(self) -> set[int]:
        return self.sink.blocks("w", 0)

    @property
    def last(self) -> Any:
        return self.requests[-1]

    def live(self, topic: bytes, seq: int, payload: bytes, now: float) -> list[Action]:
        return self.run(self.s.live([topic, pack_seq(seq), payload], now))

    def reply(self, frames: list[bytes], now: float, token: int | None = None) -> list[Action]:
        return self.run(
            self.s.replay_reply(frames, self.last.token if token is None else token, now)
        )

    def tick(self, now: float) -> list[Action]:
        return self.run(self.s.tick(now))


def first_contact(r: Rank, topic: bytes, now: float = 0.0) -> None:
    r.run(r.s.connected(now))
    r.reply(replay_end_frames(topic), now)
    assert r.s.state is RankState.SYNCED


# --- the phase table ---------------------------------------------------------------------


def _documented(table: int) -> str:
    """The rows of the docstring's ``table``-th table (from 0)."""
    doc = (phases_module.__doc__ or "").splitlines()
    rules = [i for i, line in enumerate(doc) if line.startswith("============")]
    return "\n".join(doc[rules[3 * table + 1] + 1 : rules[3 * table + 2]])


def test_the_documented_event_table_is_the_one_enforced() -> None:
    assert event_table(_documented(0)) == EVENTS
    assert set(EVENTS) == set(Phase)
    assert {e for moves in EVENTS.values() for e in moves} == set(Event)
    # Every event leads to one phase, wherever it happens; DISCONNECT from anywhere.
    for event in Event:
        assert len({moves[event] for moves in EVENTS.values() if event in moves}) == 1
    assert all(Phase.DISCONNECTED in TRANSITIONS[p] for p in Phase)


def test_the_documented_input_table_is_the_one_dispatched() -> None:
    """Every input has a handler in every phase, a method of RankStream taking what
    the input's public method passes on."""
    import inspect

    assert input_table(_documented(1)) == HANDLERS
    arity = {Input.LIVE: 3, Input.REPLY: 2, Input.SINK_FAILED: 1}
    for phase in Phase:
        assert set(HANDLERS[phase]) == set(Input)
        for inp, name in HANDLERS[phase].items():
            params = inspect.signature(getattr(RankStream, name)).parameters
            assert len(params) - 1 == arity.get(inp, 0), (phase, inp, name)
    with pytest.raises(ValueError, match="without a handler"):
        input_table("LIVE  _on_live  *")


def test_the_phase_is_written_only_by_the_event_table() -> None:
    import inspect

    source = inspect.getsource(stream_module)
    assert source.count("self._phase = ") == 2  # the start, and RankStream._move
    assert source.count("self._phase = to") == 1
    assert not any("._phase = " in inspect.getsource(m) for m in (batches, recovery, timers))


def test_every_phase_is_reached_by_the_model() -> None:
    """The table is not decoration: random schedules visit every phase."""
    import random

    from tests.subscriber.test_stream_model import PUBLISHERS, config, long_schedule

    seen: set[Phase] = set()
    for i in range(300):
        rnd = random.Random(i)
        h = Harness(
            config(rnd.random() < 0.8, rnd.randint(1, 24)),
            buffer_steps=rnd.randint(1, 40),
            seed=i,
            kind=rnd.choice(PUBLISHERS),
        )
        for op in long_schedule(rnd, h.config.replay):
            h.run(op)
            seen.add(h.stream.phase)
        h.settle()
        seen.add(h.stream.phase)
    assert seen == set(Phase)


# --- #11 case 1: a dropped final batch -------------------------------------------------------


def test_heartbeat_reveals_a_dropped_last_batch() -> None:
    """kvwire reserved seq 2 and dropped it; its heartbeat on seq 3 shows the hole."""
    topic = epoch(hb=0.5)
    r = Rank()
    first_contact(r, topic)
    r.live(topic, 0, store(0, 1, 2), 0.1)
    r.live(topic, 1, store(1, 3), 0.2)
    # seq 2 (removing 1, 2, 3) never left the publisher
    r.live(topic, 3, heartbeat(3), 0.7)
    assert isinstance(r.last, RequestReplay) and r.last.start_seq == 1
    r.reply(replay_item_frames(topic, 1, store(1, 3)), 0.8)
    r.reply(replay_item_frames(topic, 3, heartbeat(3)), 0.8)
    r.reply(replay_end_frames(topic), 0.8)
    assert r.s.state is RankState.PARTIAL
    assert r.clears and r.blocks == set()
    assert r.s.counters.seqs_lost == 1


def test_without_heartbeats_an_idle_probe_of_a_kvwire_publisher_proves_nothing() -> None:
    """The probe finds nothing after seq 1: a reserved seq 2 dropped unbuffered is not ruled out."""
    topic = epoch()  # kvwire, heartbeats off
    r = Rank()
    first_contact(r, topic)
    r.live(topic, 0, store(0, 1, 2), 0.1)
    r.live(topic, 1, store(1, 3), 0.2)
    (probe,) = [a for a in r.tick(5.2) if isinstance(a, RequestReplay)]
    assert probe.start_seq == 1
    r.reply(replay_item_frames(topic, 1, store(1, 3)), 5.3)
    r.reply(replay_end_frames(topic), 5.3)
    assert r.s.state is RankState.STALE, r.s.reason
    assert r.s.counters.stale == 1
    # The engine's next batch settles it: the hole shows, the rank is cleared.
    r.live(topic, 3, store(3, 9), 9.0)
    r.reply(replay_item_frames(topic, 1, store(1, 3)), 9.1)
    r.reply(replay_item_frames(topic, 3, store(3, 9)), 9.1)
    r.reply(replay_end_frames(topic), 9.1)
    assert r.s.state is RankState.PARTIAL and r.blocks == {9}


def test_an_engine_publishers_probe_proves_its_tail() -> None:
    """The engines' publishers assign a seq when they send: the buffer holds every one."""
    r = Rank()
    first_contact(r, TOPIC)
    r.live(TOPIC, 0, store(0), 0.1)
    r.tick(5.2)
    r.reply(replay_item_frames(TOPIC, 0, store(0)), 5.3)
    r.reply(replay_end_frames(), 5.3)
    assert r.s.state is RankState.SYNCED


@pytest.mark.parametrize(
    "kind",
    [
        PublisherKind(epoch=True, heartbeat=0.5),
        PublisherKind(epoch=True, heartbeat=0.5, snapshot=True),
        PublisherKind(epoch=True, heartbeat=0.5, snapshot=True, mirror_drops=False),
        PublisherKind(epoch=True),
        PublisherKind(epoch=True, snapshot=True),
    ],
)
def test_the_issue_scenario_never_ends_synced_with_stale_blocks(kind: PublisherKind) -> None:
    """A store, then a store and its removal back to back, the removal dropped; idle."""
    h = Harness(CFG, kind=kind)
    h.connect()
    h.settle()
    h.publish("store", "deliver")
    h.deliver_live(1)
    h.tick(1.0)
    h.publish("store", "deliver")
    h.publish("remove", "unbuffered")
    h.settle()
    h.check_settled()
    s = h.stream
    assert h.sink.blocks != h.pub.truth or s.state is RankState.SYNCED
    if s.state is RankState.SYNCED:
        assert kind.snapshot and kind.mirror_drops and s.counters.snapshots_applied == 1
    elif kind.heartbeat is not None:
        assert s.state is RankState.PARTIAL and h.sink.blocks <= h.pub.truth
    else:
        assert s.state is RankState.STALE


# --- #11 case 2: a replay socket that only ever answers END ------------------------------


@pytest.mark.parametrize("topic", [TOPIC, epoch(), epoch(hb=0.5)])
def test_a_replay_that_only_answers_end_leaves_the_rank_partial_following_live(
    topic: bytes,
) -> None:
    r = Rank()
    r.run(r.s.connected(0.0))
    r.reply(replay_end_frames(topic), 0.0)
    for seq in range(3):
        r.live(topic, seq, store(seq), 0.1)
    now = 0.2
    for seq in range(5, 40):  # 3 and 4 lost on the way
        r.live(topic, seq, store(seq), now)
        if r.s.replay_pending:
            r.reply(replay_end_frames(topic), now)
        now += 0.01
    s = r.s
    assert s.state is RankState.PARTIAL, s.reason
    assert s.expected_seq == 40 and s.counters.restarts == 0
    assert r.blocks == set(range(5, 40))  # cleared, then following live


# --- #11 case 3: a restart whose seqs continue the old ones ---------------------------------


def test_a_changed_epoch_is_a_restart_even_when_seqs_continue() -> None:
    r = Rank(StreamConfig(replay=False))
    r.run(r.s.connected(0.0))
    for seq in range(3):
        r.live(epoch(1), seq, store(seq), 0.0)
    r.live(epoch(2), 3, store(3, life=1), 0.1)
    assert r.clears and r.s.counters.restarts == 1
    assert r.s.state is RankState.PARTIAL and r.blocks == {1003}


def test_a_replayed_anchor_of_another_epoch_is_a_restart_even_when_its_bytes_match() -> None:
    """Deterministic: the bytes of a restarted engine's batch 2 may equal the old ones."""
    r = Rank()
    first_contact(r, epoch(1))
    for seq in range(3):
        r.live(epoch(1), seq, store(seq), 0.1)
    r.run(r.s.disconnected(1.0))
    r.run(r.s.connected(1.5))
    assert r.last.start_seq == 2
    out = r.reply(replay_item_frames(epoch(2), 2, store(2)), 1.6)
    assert any(isinstance(a, ClearRank) for a in out) and r.s.counters.restarts == 1
    history = r.last
    assert isinstance(history, RequestReplay) and history.start_seq == 0 and history.fresh
    for seq in range(4):
        r.reply(replay_item_frames(epoch(2), seq, store(seq, life=1)), 1.7)
    r.reply(replay_end_frames(epoch(2)), 1.7)
    assert r.s.state is RankState.SYNCED and r.blocks == {1000, 1001, 1002, 1003}


def test_a_seq_going_back_under_the_same_epoch_is_a_broken_stream_not_a_restart() -> None:
    r = Rank(StreamConfig(replay=False))
    r.run(r.s.connected(0.0))
    for seq in range(5):
        r.live(epoch(1), seq, store(seq), 0.0)
    r.live(epoch(1), 2, store(2, 77), 0.1)
    assert r.s.counters.restarts == 0 and r.s.counters.seq_jumps == 1
    assert r.s.state is RankState.PARTIAL and r.blocks == {77}


# --- #11 case 4: snapshots ------------------------------------------------------------------


def chunk(topic: bytes, next_seq: int, number: int, *hashes: int) -> list[bytes]:
    return snapshot_chunk_frames(topic, next_seq, number, store(next_seq - 1, *hashes))


def late_join(topic: bytes) -> Rank:
    """First contact after the buffer dropped 0..5: the replay starts at 6."""
    r = Rank()
    r.run(r.s.connected(0.0))
    r.reply(replay_item_frames(topic, 6, store(6, 60)), 0.1)
    r.reply(replay_item_frames(topic, 7, remove(7, 1)), 0.1)
    r.reply(replay_end_frames(topic), 0.1)
    return r


def test_a_late_joiner_is_made_exact_by_a_snapshot() -> None:
    topic = epoch(snap=True, hb=0.5)
    r = late_join(topic)
    assert isinstance(r.last, RequestSnapshot)
    assert r.s.state is RankState.PARTIAL
    # Live batches arriving meanwhile are held.
    r.live(topic, 9, store(9, 90), 0.2)
    r.live(topic, 10, store(10, 100), 0.2)
    assert r.applied == [6, 7] and r.s.held == 2
    r.reply(chunk(topic, 9, 0, 1, 2), 0.3)  # the state before batch 9
    r.reply(chunk(topic, 9, 1, 3, 60), 0.3)
    r.reply(snapshot_end_frames(topic, 9, 2), 0.3)
    replay = r.last
    assert isinstance(replay, RequestReplay) and replay.start_seq == 9
    assert r.blocks == {1, 2, 3, 60}
    r.reply(replay_item_frames(topic, 9, store(9, 90)), 0.4)
    r.reply(replay_item_frames(topic, 10, store(10, 100)), 0.4)
    r.reply(replay_end_frames(topic), 0.4)
    assert r.s.state is RankState.SYNCED, r.s.reason
    assert r.blocks == {1, 2, 3, 60, 90, 100} and r.s.expected_seq == 11
    assert r.s.counters.snapshots_applied == 1
    r.live(topic, 11, store(11, 110), 0.5)
    assert r.s.state is RankState.SYNCED and 110 in r.blocks


def test_a_refused_snapshot_is_asked_again_after_a_backoff() -> None:
    topic = epoch(snap=True, hb=0.5)
    r = late_join(topic)
    first = r.last
    r.reply(snapshot_refused_frames(topic, "busy"), 0.2)
    assert r.s.state is RankState.PARTIAL and r.last is first
    assert r.s.next_deadline() == pytest.approx(0.3)
    r.tick(0.31)
    again = r.last
    assert isinstance(again, RequestSnapshot) and again.token != first.token
    r.reply(chunk(topic, 8, 0, 1, 60), 0.4)
    r.reply(snapshot_end_frames(topic, 8, 1), 0.4)
    r.reply(replay_end_frames(topic), 0.4)
    assert r.s.state is RankState.SYNCED and r.blocks == {1, 60}
    c = r.s.counters
    assert (c.snapshots_requested, c.snapshots_failed, c.snapshots_applied) == (2, 1, 1)


def test_a_live_copy_the_snapshot_already_covers_is_late_not_a_break() -> None:
    """Live and replay are two sockets: batch 8 may arrive after a snapshot as of 9."""
    topic = epoch(snap=True, hb=0.5)
    r = late_join(topic)
    r.reply(chunk(topic, 9, 0, 1, 60), 0.3)
    r.reply(snapshot_end_frames(topic, 9, 1), 0.3)
    out = r.live(topic, 8, store(8, 80), 0.35)
    assert not [a for a in out if isinstance(a, ClearRank)] and r.s.counters.late == 1
    r.reply(replay_end_frames(topic), 0.4)
    r.live(topic, 9, store(9, 90), 0.45)
    assert r.s.state is RankState.SYNCED and r.blocks == {1, 60, 90}
    assert r.s.counters.seq_jumps == 0 and r.s.counters.restarts == 0


@pytest.mark.parametrize(
    "failure",
    [
        [snapshot_refused_frames(epoch(snap=True), "busy")],
        [chunk(epoch(snap=True), 9, 1, 5), snapshot_end_frames(epoch(snap=True), 9, 2)],
        [chunk(epoch(snap=True), 9, 0, 5), snapshot_end_frames(epoch(snap=True), 9, 2)],
        [chunk(epoch(2, snap=True), 9, 0, 5), snapshot_end_frames(epoch(2, snap=True), 9, 1)],
        [snapshot_chunk_frames(epoch(snap=True), 9, 0, b"\xc1")],
        [replay_end_frames()],  # a publisher that does not serve snapshots
        [],  # no answer: the snapshot times out
    ],
    ids=["refused", "missing", "short", "epoch", "undecodable", "engine", "timeout"],
)
def test_a_failed_snapshot_leaves_the_rank_partial_without_stale_blocks(
    failure: list[list[bytes]],
) -> None:
    topic = epoch(snap=True)
    r = late_join(topic)
    snap = r.last
    assert isinstance(snap, RequestSnapshot)
    r.live(topic, 8, store(8, 80), 0.2)
    for frames in failure:
        r.reply(frames, 0.3, token=snap.token)
    r.tick(10.0)  # timeouts, and the snapshot's overall deadline
    assert 5 not in r.blocks, "a chunk of a failed snapshot was applied"
    s = r.s
    assert s.state in (RankState.PARTIAL, RankState.SYNCING), s.reason
    assert s.state is not RankState.SYNCED
    if failure and failure[0][2] == epoch(2, snap=True):
        assert s.counters.restarts == 1 and r.blocks == set()  # a new life: its history next
    else:
        assert s.counters.snapshots_failed == 1
        assert r.blocks <= {60, 80}


@pytest.mark.parametrize("how", ["refused", "timeout", "short"])
def test_failed_snapshots_are_asked_again_with_backoff_until_one_is_served(how: str) -> None:
    """Issue 24 item 5: six snapshots fail, the seventh is served: the rank ends SYNCED and
    exact. Never abandoned; the asks are spaced by a doubling backoff (the rank follows
    live, PARTIAL, meanwhile)."""
    topic = epoch(snap=True)
    cfg = msgspec.structs.replace(
        CFG, backoff_initial=0.1, snapshot_backoff_max=1.0, idle_probe=None
    )
    r = Rank(cfg)
    r.run(r.s.connected(0.0))
    r.reply(replay_item_frames(topic, 6, store(6, 60)), 0.1)
    r.reply(replay_end_frames(topic), 0.1)  # 0..5 are gone: PARTIAL, a snapshot asked
    asked: list[tuple[float, int]] = []  # (when, token)
    now = 0.1
    while len(asked) < 7 and now < 60:
        snap = r.last
        if isinstance(snap, RequestSnapshot) and (not asked or asked[-1][1] != snap.token):
            asked.append((now, snap.token))
            if len(asked) < 7:
                assert r.s.state is RankState.PARTIAL
                if how == "refused":
                    r.reply(snapshot_refused_frames(topic, "busy"), now)
                elif how == "short":
                    r.reply(chunk(topic, 7, 0, 1), now)
                    r.reply(snapshot_end_frames(topic, 7, 2), now)
                # "timeout": no answer
            else:
                r.reply(chunk(topic, 7, 0, 1, 60), now)
                r.reply(snapshot_end_frames(topic, 7, 1), now)
                r.reply(replay_end_frames(topic), now)
        now = round(now + 0.01, 2)
        r.tick(now)
    assert len(asked) == 7, asked
    r.live(topic, 7, store(7, 70), now)  # (idle, kvwire's publisher proves its tail live)
    assert r.s.state is RankState.SYNCED and r.blocks == {1, 60, 70}, r.s.reason
    c = r.s.counters
    assert (c.snapshots_requested, c.snapshots_failed, c.snapshots_applied) == (7, 6, 1)
    times = [t for t, _ in asked]
    spacing = [b - a for a, b in itertools.pairwise(times)]
    # After each failure the wait doubles from 0.1 s up to 1 s (a timeout fails 1 s later).
    late = 1.0 if how == "timeout" else 0.0
    for i, gap in enumerate(spacing):
        assert gap == pytest.approx(late + min(1.0, 0.1 * 2**i), abs=0.02), spacing


def test_a_publisher_that_never_serves_its_snapshot_is_asked_ever_less_often() -> None:
    """Ten minutes of refusals, at the defaults: the asks grow with the log of the
    backoff, then one per ``snapshot_backoff_max``, never a flood and never given up."""
    topic = epoch(snap=True)
    cfg = StreamConfig(idle_probe=None)
    r = Rank(cfg)
    r.run(r.s.connected(0.0))
    r.reply(replay_item_frames(topic, 6, store(6, 60)), 0.0)
    r.reply(replay_end_frames(topic), 0.0)
    now, seen = 0.0, 0
    while now < 600.0:
        if len(r.requests) > seen:
            seen = len(r.requests)
            assert isinstance(r.last, RequestSnapshot)
            r.reply(snapshot_refused_frames(topic, "busy"), now)
        now += 0.05
        r.tick(now)
    asks = r.s.counters.snapshots_requested
    doubling = math.ceil(math.log2(cfg.snapshot_backoff_max / cfg.backoff_initial)) + 1
    assert 600 / cfg.snapshot_backoff_max - 2 <= asks <= doubling + 600 / cfg.snapshot_backoff_max
    assert r.s.state is RankState.PARTIAL and r.blocks == {60}


def test_a_snapshot_that_announces_its_block_count_reserves_before_applying(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Issue 24 item 6: chunk 0's block count becomes one Reserve, after the clear and
    before the first Apply; a chunk without one reserves nothing."""

    class Announced(SnapshotChunk):
        __slots__ = ()
        blocks = 4

    parse = recovery.parse_replay_reply

    def parse_with_count(frames: Any) -> Any:
        msg = parse(frames)
        if isinstance(msg, SnapshotChunk) and msg.number == 0:
            return Announced(*msg)
        return msg

    topic = epoch(snap=True)
    r = late_join(topic)
    monkeypatch.setattr(recovery, "parse_replay_reply", parse_with_count)
    out = r.reply(chunk(topic, 9, 0, 1, 2), 0.3)
    out += r.reply(chunk(topic, 9, 1, 3, 4), 0.3)
    out += r.reply(snapshot_end_frames(topic, 9, 2), 0.3)
    kinds = [type(a) for a in out if not isinstance(a, StateChanged | RequestReplay)]
    assert kinds == [ClearRank, Reserve, Apply, Apply], kinds
    assert [a for a in out if isinstance(a, Reserve)] == [Reserve(4)]
    monkeypatch.setattr(recovery, "parse_replay_reply", parse)
    plain = late_join(topic)
    out = plain.reply(chunk(topic, 9, 0, 1, 2), 0.3)
    out += plain.reply(snapshot_end_frames(topic, 9, 1), 0.3)
    assert not [a for a in out if isinstance(a, Reserve)]


# --- heartbeats -------------------------------------------------------------------------------


def test_a_silent_heartbeat_publisher_goes_stale_and_comes_back() -> None:
    topic = epoch(hb=0.1)
    r = Rank()
    first_contact(r, topic)
    r.live(topic, 0, store(0), 0.0)
    r.live(topic, 1, heartbeat(1), 0.1)
    # A healthy publisher is silent for under 1.5 intervals (kvwire.wire.heartbeat):
    assert r.s.next_deadline() == pytest.approx(0.35)  # 2.5 intervals: a fresh connection
    assert r.tick(0.34) == []
    (reconnect,) = r.tick(0.36)
    assert isinstance(reconnect, Reconnect) and r.s.state is RankState.SYNCED
    assert r.s.next_deadline() == pytest.approx(0.45)  # 3.5 intervals: STALE
    assert r.tick(0.44) == [] and r.s.state is RankState.SYNCED
    r.tick(0.46)
    assert r.s.state is RankState.STALE and r.s.counters.probes == 0
    assert r.tick(5.0) == [] and r.s.counters.silent_reconnects == 1  # once a silence
    r.live(topic, 2, heartbeat(2), 0.5)
    assert r.s.state is RankState.SYNCED
    # Silence, then a message past a hole: the gap is replayed as usual.
    r.tick(1.0)
    assert r.s.state is RankState.STALE
    r.live(topic, 5, heartbeat(5), 1.1)
    assert r.s.state is RankState.SYNCING and r.last.start_seq == 2


@pytest.mark.parametrize("topic", [TOPIC, epoch(), epoch(snap=True)])
def test_only_a_heartbeating_publishers_silence_asks_for_a_fresh_connection(topic: bytes) -> None:
    r = Rank()
    first_contact(r, topic)
    r.live(topic, 0, store(0), 0.0)
    for now in (1.0, 3.0, 6.0, 12.0, 30.0):
        actions = r.tick(now)
        assert not any(isinstance(a, Reconnect) for a in actions), actions
        if r.s.replay_pending:  # an idle probe: nothing new
            r.reply(replay_end_frames(topic), now)
    assert r.s.counters.silent_reconnects == 0


def test_without_replay_or_heartbeats_silence_is_stale() -> None:
    """A lost last batch cannot be asked for: an idle rank is not proven current."""
    r = Rank(StreamConfig(replay=False, idle_probe=1.0))
    r.run(r.s.connected(0.0))
    r.live(TOPIC, 0, store(0), 0.0)
    assert r.s.state is RankState.SYNCED and r.s.next_deadline() == pytest.approx(1.0)
    r.tick(1.0)
    assert r.s.state is RankState.STALE
    r.live(TOPIC, 1, store(1), 1.5)
    assert r.s.state is RankState.SYNCED
    r.tick(3.0)
    r.live(TOPIC, 3, store(3), 3.1)  # 2 was the lost last batch
    assert r.s.state is RankState.PARTIAL and r.blocks == {3}


# --- #12 row 2: an error while decoding never loses an action --------------------------------


def test_a_decode_exception_after_a_queued_clear_keeps_the_clear(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    r = Rank(StreamConfig(replay=False))
    r.run(r.s.connected(0.0))
    r.live(epoch(1), 0, store(0, 5), 0.0)
    real = batches.decode_batch

    def deep(payload: Any) -> KVEventBatch:
        if bytes(payload) == b"deep":
            raise RecursionError("maximum recursion depth exceeded")
        return real(payload)

    monkeypatch.setattr(batches, "decode_batch", deep)
    out = r.live(epoch(2), 0, b"deep", 0.1)  # a restart, then an undecodable batch
    assert any(isinstance(a, ClearRank) for a in out)
    assert r.blocks == set() and r.s.counters.decode_errors == 1
    assert r.s.counters.internal_errors == 0


def test_an_internal_error_returns_what_was_queued_and_clears(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    r = Rank(StreamConfig(replay=False))
    r.run(r.s.connected(0.0))
    r.live(epoch(1), 0, store(0, 5), 0.0)

    def broken(*args: Any, **kwargs: Any) -> None:
        raise RuntimeError("a bug")

    monkeypatch.setattr(batches, "apply", broken)
    out = r.live(epoch(2), 0, store(0, 6), 0.1)  # the restart's clear is queued first
    assert [a for a in out if isinstance(a, ClearRank)]
    assert r.s.counters.internal_errors == 1 and r.s.state is RankState.PARTIAL
    monkeypatch.undo()
    r.live(epoch(2), 1, store(1, 7), 0.2)
    assert r.blocks == {7}


# --- #12 row 5: counters that cannot go absurd ------------------------------------------------


def test_a_seq_jump_to_2_63_and_back_is_not_counted_as_lost_seqs() -> None:
    r = Rank()
    first_contact(r, TOPIC)
    for seq in range(5):
        r.live(TOPIC, seq, store(seq), 0.1)
    r.live(TOPIC, 1 << 63, store(7, 70), 0.2)
    now = 0.3
    for seq in range(5, 8):
        r.live(TOPIC, seq, store(seq), now)
        for _ in range(8):
            if r.s.replay_pending and r.requests:
                r.reply(replay_end_frames(), now)
            now += 1.0
            r.tick(now)
    c = r.s.counters
    assert c.seq_jumps >= 1 and 0 <= c.seqs_lost <= 8, c
    assert all(v < 1 << 32 for v in msgspec_values(c)), c
    assert r.s.state is not RankState.SYNCED


def msgspec_values(obj: Any) -> list[int]:
    return [getattr(obj, f) for f in obj.__struct_fields__]


# --- #12 row 6: an overall deadline per replay ------------------------------------------------


def test_a_reply_that_trickles_junk_fails_at_its_overall_deadline() -> None:
    r = Rank()
    first_contact(r, TOPIC)
    for seq in range(3):
        r.live(TOPIC, seq, store(seq), 0.1)
    r.live(TOPIC, 5, store(5), 1.0)
    token = r.last.token
    now = 1.0
    while now < 30.0:
        now += 0.5
        r.reply([b"", b"junk"], now, token=token)
        r.tick(now)
        if r.s.state is not RankState.SYNCING:
            break
    assert now <= 1.0 + CFG.replay_deadline + 0.5
    assert r.s.state is RankState.PARTIAL and r.s.counters.replays_failed == 1
    assert r.blocks == {5}
