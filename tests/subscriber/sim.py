"""A simulated publisher and network around one RankStream, for model-based tests.

The publisher model keeps the engine's truth (the set of blocks its cache
holds), a bounded replay buffer, and restarts like a real process (seq back to
0, cache and buffer empty). It is one of two kinds (``docs/wire.md``):

- an engine's own publisher: no epoch, no heartbeat, no snapshot; it assigns
  a seq when it sends, so it never drops a batch whose seq was reserved
  (a batch it fails to deliver is lost on the wire but buffered);
- kvwire's: a new epoch per life on every topic, optionally heartbeats (an
  empty batch on the next seq on the wall-clock grid, ``kvwire.wire.heartbeat``) and
  snapshots; it reserves a seq before queueing, so a dropped batch is a hole
  in its buffer, and its snapshot mirror either still learns what a dropped
  batch carried or refuses to serve.

The network model is the ordered SUB pipe (live frames and connection events,
in the order a transport feeds them), the replay request and reply queues, and
what faults do to each.
"""

from __future__ import annotations

import collections
import random
from dataclasses import dataclass, field

from kvwire.subscriber import (
    Action,
    Apply,
    ApplyPayload,
    ClearRank,
    RankState,
    RankStream,
    RequestReplay,
    RequestSnapshot,
    StateChanged,
    StreamConfig,
)
from kvwire.wire import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEvent,
    KVEventBatch,
    decode_batch,
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
from kvwire.wire.heartbeat import heartbeat_at

TOPIC = b"kv"
BLOCK = 4


def incarnation_of(batch: KVEventBatch) -> int:
    return int(batch.ts) // 1_000_000


def is_snapshot_chunk(batch: KVEventBatch) -> bool:
    """Snapshot chunks carry a ts of ``life * 1e6 + 0.5`` (batches: whole numbers)."""
    return batch.ts % 1 == 0.5


@dataclass(frozen=True)
class PublisherKind:
    """What a simulated publisher promises (``docs/wire.md`` sections 5-7)."""

    epoch: bool = False
    heartbeat: float | None = None
    snapshot: bool = False
    mirror_drops: bool = True
    """A batch dropped before it was sent still reaches the snapshot mirror
    (otherwise the publisher refuses snapshots once it dropped one)."""

    def __post_init__(self) -> None:
        assert self.epoch or (self.heartbeat is None and not self.snapshot), "kvwire-only features"


ENGINE = PublisherKind()


class SimPublisher:
    """An engine plus its publisher: truth, seq, replay buffer, restarts."""

    def __init__(
        self, buffer_steps: int, max_replay: int | None, seed: int, kind: PublisherKind = ENGINE
    ) -> None:
        self.rng = random.Random(seed)
        self.kind = kind
        self.buffer: collections.deque[tuple[int, bytes]] = collections.deque(maxlen=buffer_steps)
        self.max_replay = max_replay
        self.incarnation = 0
        self.seq = 0
        self.truth: set[int] = set()
        self.truth_after: dict[int, frozenset[int]] = {}
        self.batches: dict[int, KVEventBatch] = {}
        self.next_block = 1
        # Every life's batches and truths, by incarnation (a STALE rank may still
        # show an old life that restarted silently).
        self.lives = [(self.batches, self.truth_after)]
        self.dropped = False  # this life dropped a batch after reserving its seq
        self.sent: dict[int, bytes] = {}  # this life's live frames' payloads, by seq
        self.old_sent: dict[int, bytes] = {}  # the previous life's, and its topic:
        self.last_sent = 0.0
        self.last_was_batch = False
        self.topic = TOPIC
        self._new_epoch()
        self.old_topic = self.topic
        self.wall_offset = self.rng.uniform(0.0, 1e6)  # the wall clock, against sim time

    def _new_epoch(self) -> None:
        k = self.kind
        if k.epoch:
            epoch = format_epoch(
                self.rng.randrange(1 << 64), heartbeat_s=k.heartbeat, snapshot=k.snapshot
            )
            self.topic = epoch_topic(TOPIC, epoch)

    def make_batch(self, kind: str) -> KVEventBatch:
        events: list[KVEvent] = []
        if kind == "clear":
            if self.rng.random() < 0.5:
                events.append(self._store())
            events.append(AllBlocksCleared())
            self.truth.clear()
            if self.rng.random() < 0.5:
                events.append(self._store())
        elif kind == "remove" and self.truth:
            victims = self.rng.sample(sorted(self.truth), k=min(len(self.truth), 3))
            events.append(BlockRemoved(block_hashes=victims))
            self.truth.difference_update(victims)
            events.append(self._store())
        else:
            events.append(self._store())
        ts = float(self.incarnation * 1_000_000 + self.seq)
        return KVEventBatch(ts, events, 0)

    def _store(self) -> BlockStored:
        n = self.rng.randint(1, 3)
        hashes = list(range(self.next_block, self.next_block + n))
        self.next_block += n
        self.truth.update(hashes)
        tokens = [self.rng.randrange(50_000) for _ in range(n * BLOCK)]
        return BlockStored(
            block_hashes=hashes, parent_block_hash=None, token_ids=tokens, block_size=BLOCK
        )

    def publish(
        self, kind: str, now: float, buffered: bool = True, broken: bool = False
    ) -> tuple[int, bytes]:
        """The next batch; ``buffered=False`` is a batch dropped before it reached the
        buffer (after its seq was reserved), ``broken=True`` one the publisher itself
        encoded wrongly. ``kind="heartbeat"``: an empty batch."""
        seq = self.seq
        if kind == "heartbeat":
            batch = KVEventBatch(float(self.incarnation * 1_000_000 + seq), [], 0)
        else:
            batch = self.make_batch(kind)
        payload = encode_batch(batch)
        if broken:
            payload = b"\xc1" + payload[1:]
        self.batches[seq] = batch
        self.sent[seq] = payload
        self.truth_after[seq] = frozenset(self.truth)
        self.seq += 1
        self.last_sent = now
        self.last_was_batch = kind != "heartbeat"
        if buffered:
            self.buffer.append((seq, payload))
        else:
            self.dropped = True
        return seq, payload

    def heartbeat_at(self, now: float) -> float | None:
        """When the next heartbeat goes out (kvwire's own rule), if nothing else does."""
        hb = self.kind.heartbeat
        if hb is None:
            return None
        return heartbeat_at(
            self.last_sent, hb, now, now + self.wall_offset, self.last_was_batch
        )

    def restart(self, now: float, same_epoch: bool = False) -> None:
        """A new life: seq 0, empty cache and buffer, a new epoch unless ``same_epoch``
        (a publisher whose epoch is configured, not drawn: the epoch no longer tells)."""
        self.old_topic, self.old_sent, self.sent = self.topic, self.sent, {}
        self.incarnation += 1
        self.seq = 0
        self.buffer.clear()
        self.truth.clear()
        self.truth_after = {}
        self.batches = {}
        self.lives.append((self.batches, self.truth_after))
        self.dropped = False
        self.last_sent = now
        self.last_was_batch = False
        if not same_epoch:
            self._new_epoch()

    def serve(self, start: int) -> list[list[bytes]]:
        items = [(s, p) for s, p in self.buffer if s >= start]
        if self.max_replay is not None:
            items = items[: self.max_replay]
        end = replay_end_frames(self.topic if self.kind.epoch else b"")
        return [replay_item_frames(self.topic, s, p) for s, p in items] + [end]

    def serve_snapshot(self) -> list[list[bytes]]:
        if not self.kind.snapshot:
            return [replay_end_frames()]  # read as a start seq past anything buffered
        if self.dropped and not self.kind.mirror_drops:
            return [
                snapshot_refused_frames(self.topic, "a batch was dropped before it was mirrored")
            ]
        blocks = sorted(self.truth)
        ts = self.incarnation * 1_000_000 + 0.5
        out: list[list[bytes]] = []
        while blocks:
            n = self.rng.randint(1, 4)
            part, blocks = blocks[:n], blocks[n:]
            event = BlockStored(
                block_hashes=part,
                parent_block_hash=None,
                token_ids=[0] * (len(part) * BLOCK),
                block_size=BLOCK,
            )
            payload = encode_batch(KVEventBatch(ts, [event], 0))
            out.append(snapshot_chunk_frames(self.topic, self.seq, len(out), payload))
        return [*out, snapshot_end_frames(self.topic, self.seq, len(out))]


@dataclass
class RecordingSink:
    """Blocks per the applied stream, and the batches applied since the last clear."""

    blocks: set[int] = field(default_factory=set)
    since_clear: list[tuple[int, KVEventBatch]] = field(default_factory=list)
    clears: list[str] = field(default_factory=list)

    def apply(self, seq: int, batch: KVEventBatch) -> None:
        for e in batch.events:
            if isinstance(e, BlockStored):
                self.blocks.update(e.block_hashes)
            elif isinstance(e, BlockRemoved):
                self.blocks.difference_update(e.block_hashes)
            else:
                self.blocks.clear()
        self.since_clear.append((seq, batch))

    def clear(self, reason: str) -> None:
        self.blocks.clear()
        self.since_clear.clear()
        self.clears.append(reason)


class Harness:
    """Drives a RankStream through a schedule of publisher and network events."""

    def __init__(
        self,
        config: StreamConfig,
        *,
        buffer_steps: int = 16,
        max_replay: int | None = None,
        seed: int = 0,
        contiguous: bool = True,
        # False for the KEEP policy: it may keep a view across an unconfirmed restart.
        kind: PublisherKind = ENGINE,
        payloads: bool = False,
    ) -> None:
        self.config = config
        self.pub = SimPublisher(buffer_steps, max_replay, seed, kind)
        self.payloads = payloads
        self.stream = RankStream(rank=0, config=config, payloads=payloads)
        self.sink = RecordingSink()
        self.contiguous = contiguous
        self.now = 0.0
        self.up = False  # the network path to the publisher
        self.pipe: collections.deque[tuple[str, list[bytes]]] = collections.deque()
        self.requests: collections.deque[int | None] = collections.deque()  # None: a snapshot
        self.replies: collections.deque[list[bytes]] = collections.deque()
        self.channel_token = 0
        self.states: list[StateChanged] = []

    # --- feeding the stream ---------------------------------------------------------

    def feed(self, actions: list[Action]) -> None:
        for a in actions:
            if isinstance(a, Apply | ApplyPayload):
                self.apply(a)
            elif isinstance(a, ClearRank):
                self.clear(a.reason)
            elif isinstance(a, RequestReplay | RequestSnapshot):
                assert self.config.replay, "replay requested without a replay endpoint"
                if a.fresh:
                    self.requests.clear()
                    self.replies.clear()
                self.channel_token = a.token
                self.requests.append(a.start_seq if isinstance(a, RequestReplay) else None)
            else:
                self.states.append(a)
        assert self.stream.counters.internal_errors == 0, self.stream.reason

    def apply(self, action: Apply | ApplyPayload) -> None:
        """Carry out an Apply (a payload is one the stream vouched decodes)."""
        if isinstance(action, Apply):
            batch = action.batch
        else:
            batch = decode_batch(action.payload, self.config.decode_limits)
        self._check_apply(action.seq, batch)
        self.sink.apply(action.seq, batch)

    def clear(self, reason: str) -> None:
        self.sink.clear(reason)

    def _check_apply(self, seq: int, batch: KVEventBatch) -> None:
        log = self.sink.since_clear
        if log and self.contiguous:
            prev_seq, prev = log[-1]
            assert incarnation_of(prev) == incarnation_of(batch), (
                f"batches of two publisher lives applied without a clear between: {prev_seq} {seq}"
            )
            if is_snapshot_chunk(batch):
                assert is_snapshot_chunk(prev) and prev_seq == seq, "a snapshot chunk out of place"
            else:
                assert seq == prev_seq + 1, f"applied {seq} after {prev_seq} without a clear"

    # --- operations ------------------------------------------------------------------

    def publish(self, kind: str, fate: str) -> None:
        if fate == "unbuffered" and not self.pub.kind.epoch:
            # An engine's publisher assigns the seq when it sends: it never leaves a
            # reserved seq out of its buffer. What it fails to deliver is lost on the wire.
            fate = "lose"
        buffered = fate != "unbuffered"
        seq, payload = self.pub.publish(kind, self.now, buffered, broken=fate == "broken")
        if not self.up or fate in ("lose", "unbuffered"):
            return
        if fate == "corrupt":
            payload = b"\xc1" + payload[1:]
        elif fate == "mutate":
            payload = self._mutate(payload)
        frames = [self.pub.topic, pack_seq(seq), payload]
        if fate == "truncate":
            frames = frames[:2]
        self.pipe.append(("live", frames))

    def _mutate(self, payload: bytes) -> bytes:
        """A byte changed, dropped or added: valid or not, whatever it reads as."""
        rng = self.pub.rng
        at = rng.randrange(len(payload))
        how = rng.choice(["set", "set", "drop", "insert", "cut"])
        byte = bytes([rng.choice([rng.randrange(256), 0xC0, 0xCD, 0xA1, 0x90, 0x80, 0x00])])
        if how == "set":
            return payload[:at] + byte + payload[at + 1 :]
        if how == "drop":
            return payload[:at] + payload[at + 1 :]
        if how == "insert":
            return payload[:at] + byte + payload[at:]
        return payload[:at]

    def deliver_live(self, n: int) -> None:
        for _ in range(n):
            if not self.pipe:
                return
            kind, frames = self.pipe.popleft()
            if kind == "live":
                self.feed(self.stream.live(frames, self.now))
            elif kind == "connected":
                self.feed(self.stream.connected(self.now))
            else:
                self.feed(self.stream.disconnected(self.now))

    def serve(self, n: int) -> None:
        if not self.config.replay:
            return
        for _ in range(n):
            if not self.requests or not self.up:
                return
            start = self.requests.popleft()
            self.replies.extend(
                self.pub.serve_snapshot() if start is None else self.pub.serve(start)
            )

    def deliver_replies(self, n: int) -> None:
        # A transport handles connection events (draining the live socket first)
        # before replay replies: a reply never overtakes a disconnect before it.
        last = max((i for i, (k, _) in enumerate(self.pipe) if k == "disconnected"), default=-1)
        self.deliver_live(last + 1)
        for _ in range(n):
            if not self.replies:
                return
            self.feed(
                self.stream.replay_reply(self.replies.popleft(), self.channel_token, self.now)
            )

    def drop_replies(self) -> None:
        self.requests.clear()
        self.replies.clear()

    def drop_chunk(self) -> None:
        """The replay socket drops one snapshot chunk (high-water mark)."""
        for i, frames in enumerate(self.replies):
            if len(frames) == 6 and frames[4] != b"\xff" * 8:
                del self.replies[i]
                return

    def garbage_reply(self) -> None:
        self.feed(self.stream.replay_reply([b"", b"\x00"], self.channel_token, self.now))

    def early_data(self) -> None:
        """The first batch of a connection overtakes its connection event."""
        for i in range(len(self.pipe) - 1):
            if self.pipe[i][0] == "connected" and self.pipe[i + 1][0] == "live":
                self.pipe[i], self.pipe[i + 1] = self.pipe[i + 1], self.pipe[i]
                return

    def stale_reply(self) -> None:
        frames = replay_item_frames(TOPIC, 0, b"\x93\x00\x90\x00")
        self.feed(self.stream.replay_reply(frames, self.channel_token - 1, self.now))

    def tick(self, dt: float) -> None:
        """Time passes: the publisher heartbeats on time, then the stream's timers run."""
        end = self.now + dt
        while (at := self.pub.heartbeat_at(self.now)) is not None and at <= end:
            self.now = max(self.now, at)
            self.publish("heartbeat", "deliver")
        self.now = end
        self.feed(self.stream.tick(self.now))

    def disconnect(self) -> None:
        if self.up:
            self.up = False
            self.pipe.append(("disconnected", []))
            self.drop_replies()

    def connect(self) -> None:
        if not self.up:
            self.up = True
            self.pipe.append(("connected", []))

    def restart(self, same_epoch: bool = False) -> None:
        self.disconnect()
        same_epoch = same_epoch and self.pub.kind.epoch
        self.pub.restart(self.now, same_epoch)
        if not self.config.replay and (same_epoch or not self.pub.kind.epoch):
            # Without replay and without a new epoch a restart can only be seen in
            # its first batch (a documented blind spot): deliver that one.
            self.connect()
            self.publish("store", "deliver")

    def resume(self) -> None:
        """The router stops and a new one starts from a checkpoint: the stream's position
        and the sink's contents as of one instant, or cold (an empty view) where the
        stream has no position. The new one connects afresh.

        Without replay a restart under the same topic shows only in its first batch
        (see :meth:`restart`): there the old router reads what reached it before it stops.
        """
        if not self.config.replay:
            self.deliver_live(len(self.pipe))
        pos = self.stream.position()
        self.up = False
        self.pipe.clear()
        self.drop_replies()
        self.stream = RankStream(rank=0, config=self.config, payloads=self.payloads)
        if pos is None:
            self.clear("a cold start")
        else:
            self.stream.resume(pos)
        self.connect()

    def old_life(self) -> None:
        """A live message of the publisher's previous life arrives now (a half-open
        connection, a proxy in between): the one at the stream's next seq if that
        life sent one, its last otherwise.

        Only where the new life has a new epoch. Under the same topic (no epoch,
        or a restart that kept its epoch) an old life's live batch reads as the
        new life's batch at that seq, and the stream follows live once a replay
        gives up (the module docstring of ``kvwire.subscriber.stream``, "Not
        detectable"); a horizon above the publisher's next seq comes from
        ``restart(same_epoch=True)`` instead.
        """
        old = self.pub.old_sent
        if not self.up or not old or self.pub.old_topic == self.pub.topic:
            return
        seq = self.stream.expected_seq
        if seq not in old:
            seq = max(old)
        self.pipe.append(("live", [self.pub.old_topic, pack_seq(seq), old[seq]]))

    def run(self, op: tuple[object, ...]) -> None:
        name = op[0]
        if name == "publish":
            self.publish(str(op[1]), str(op[2]))
        elif name == "deliver_live":
            self.deliver_live(int(op[1]))  # type: ignore[call-overload]
        elif name == "serve":
            self.serve(int(op[1]))  # type: ignore[call-overload]
        elif name == "deliver_replies":
            self.deliver_replies(int(op[1]))  # type: ignore[call-overload]
        elif name == "drop_replies":
            self.drop_replies()
        elif name == "drop_chunk":
            self.drop_chunk()
        elif name == "stale_reply":
            self.stale_reply()
        elif name == "garbage_reply":
            self.garbage_reply()
        elif name == "early_data":
            self.early_data()
        elif name == "tick":
            self.tick(float(op[1]))  # type: ignore[arg-type]
        elif name == "disconnect":
            self.disconnect()
        elif name == "connect":
            self.connect()
        elif name == "restart":
            self.restart()
        elif name == "restart_same_epoch":
            self.restart(same_epoch=True)
        elif name == "old_life":
            self.old_life()
        elif name == "resume":
            self.resume()
        else:
            raise AssertionError(f"unknown op {op!r}")

    # --- settling and checking ---------------------------------------------------------

    def quiet(self) -> bool:
        return not self.pipe and not self.requests and not self.replies

    def settle(self) -> None:
        """Heal the network and let replies, timeouts, heartbeats and idle probes run.

        Nothing is published beyond what the schedule did (heartbeats aside, which
        the publisher sends by itself): a lost last batch must be found by the
        stream, or left visible.
        """
        self.connect()
        hb = self.pub.kind.heartbeat
        step = hb * 1.01 if hb is not None else (self.config.idle_probe or 1.0) + 0.01
        unchanged = 0
        for _ in range(100):
            self._run_until_quiet()
            before = self._position()
            self.tick(step)  # an idle probe, a heartbeat, a timeout
            self._run_until_quiet()
            unchanged = unchanged + 1 if before == self._position() else 0
            if unchanged >= 2:
                return
        raise AssertionError("idle probes kept changing the stream")

    def _position(self) -> tuple[object, ...]:
        s = self.stream
        return (self.pub.seq - s.expected_seq, s.state, len(self.sink.clears))

    def _run_until_quiet(self) -> None:
        for _ in range(400):
            self.deliver_live(len(self.pipe))
            self.serve(len(self.requests))
            self.deliver_replies(len(self.replies))
            if self.quiet() and not self.stream.replay_pending:
                return
            self.tick(0.05)
        raise AssertionError("the stream never settled")

    def check_settled(self, *, exact_when_synced: bool = True, subset: bool = True) -> None:
        stream, pub, sink = self.stream, self.pub, self.sink
        assert stream.state in (RankState.SYNCED, RankState.PARTIAL, RankState.STALE), (
            stream.state,
            stream.reason,
        )
        assert stream.counters.internal_errors == 0
        log = sink.since_clear
        life = incarnation_of(log[-1][1]) if log else pub.incarnation
        batches_of, truth_after = pub.lives[life]
        if stream.state is RankState.STALE:
            # Only a publisher that cannot prove its tail leaves a rank STALE once
            # the network healed: no heartbeats, and either no replay or a kvwire
            # publisher (which may drop a reserved seq without a trace).
            assert pub.kind.heartbeat is None, stream.reason
            assert not self.config.replay or pub.kind.epoch, stream.reason
            assert not log or stream.expected_seq <= len(batches_of)
        elif stream.state is RankState.SYNCED or (sink.since_clear and self.contiguous):
            # (A PARTIAL rank cleared after a restart it could not anchor may wait
            # for the engine's next batch to learn where the new stream is; under
            # the KEEP policy it keeps the old view meanwhile.)
            assert stream.expected_seq == pub.seq, (stream.expected_seq, pub.seq, stream.reason)
        if stream.state is RankState.SYNCED:
            # The view is exact from its last clear: a clear by the subscriber (a
            # snapshot, or nothing before), or the last AllBlocksCleared the engine sent.
            resets = [
                i
                for i, (_, b) in enumerate(log)
                if any(isinstance(e, AllBlocksCleared) for e in b.events)
            ]
            log = log[resets[-1] :] if resets else log
            if log and not resets:
                first, batch = log[0]
                # (A snapshot of an empty cache has no chunk.)
                empty_before = not pub.truth_after.get(first - 1)
                assert first == 0 or is_snapshot_chunk(batch) or empty_before, (
                    "SYNCED although the history before the last clear is missing"
                )
        batches = [(seq, b) for seq, b in log if not is_snapshot_chunk(b)]
        if self.contiguous or stream.state is RankState.SYNCED:
            for seq, batch in batches:
                assert batches_of.get(seq) == batch, f"applied batch {seq} is not the publisher's"
            seqs = [seq for seq, _ in batches]
            assert seqs == list(range(seqs[0], seqs[0] + len(seqs))) if seqs else True
        if stream.state is RankState.STALE:
            # Exact or a subset as of the last batch applied, never ahead of it.
            then = truth_after.get(stream.expected_seq - 1, frozenset())
            if subset and sink.since_clear:
                assert sink.blocks <= then, (sorted(sink.blocks - then), stream.reason)
        elif stream.state is RankState.SYNCED and exact_when_synced:
            assert sink.blocks == pub.truth, (sorted(sink.blocks ^ pub.truth), stream.reason)
        elif subset:
            assert sink.blocks <= pub.truth, (sorted(sink.blocks - pub.truth), stream.reason)
