"""A payload stream (ApplyPayload to PrefixIndex.apply_payload) against the decoding one.

Twin streams, each with its own prefix index, are fed the same random
schedules (valid batches, lost, corrupted, mutated and truncated frames,
gaps, duplicates, restarts, replays, snapshots, tight decode limits): one
decodes every batch and gives it to ``apply``, the other gives the bytes it
vouched for to ``apply_payload``. Step by step they must do the same (the
same actions, Apply and ApplyPayload alike), and end with the same counters,
states and index contents.
"""

from __future__ import annotations

import dataclasses
import random
from typing import Any

import msgspec
from hypothesis import given, settings
from hypothesis import strategies as st

from kvwire.prefix_index import PrefixIndex
from kvwire.subscriber import (
    Action,
    Apply,
    ApplyPayload,
    RankState,
    RankStream,
    StreamConfig,
)
from kvwire.wire import (
    DEFAULT_LIMITS,
    AllBlocksCleared,
    BlockStored,
    DecodeLimits,
    KVEventBatch,
    encode_batch,
    pack_seq,
)
from tests.budget import examples
from tests.subscriber.sim import BLOCK, TOPIC, Harness
from tests.subscriber.test_stream_model import LONG_FATES, MODEL, PUBLISHERS, config, long_schedule

FATES = [*LONG_FATES, "mutate", "mutate", "mutate"]
LIMITS = [
    DEFAULT_LIMITS,
    DecodeLimits(max_blocks=2),  # some stores (1 to 3 blocks) refused
    DecodeLimits(max_events=2),  # some batches (1 to 3 events) refused
    DecodeLimits(max_tokens=8),
]


class IndexHarness(Harness):
    """The model harness around a prefix index, as a Subscriber carries actions out."""

    def __init__(self, cfg: StreamConfig, *, payloads: bool, **kw: Any) -> None:
        super().__init__(cfg, payloads=payloads, **kw)
        self.index = PrefixIndex(BLOCK)
        self.log: list[object] = []  # every action, an ApplyPayload read as its Apply
        self.by_payload = self.by_batch = 0

    def feed(self, actions: list[Action]) -> None:
        for a in actions:
            self.log.append(("apply", a.seq) if isinstance(a, Apply | ApplyPayload) else a)
        super().feed(actions)

    def apply(self, action: Apply | ApplyPayload) -> None:
        try:
            if isinstance(action, ApplyPayload):
                self.by_payload += 1
                self.index.apply_payload("w", 0, action.payload, self.config.decode_limits)
            else:
                self.by_batch += 1
                self.index.apply("w", 0, action.batch)
        except Exception as exc:  # what the transport does with a sink that raised
            self.log.append(("sink failed", type(exc).__name__))
            self.feed(self.stream.sink_failed(self.now, repr(exc)))

    def clear(self, reason: str) -> None:
        self.index.clear("w", 0)
        super().clear(reason)


def assert_twins(plain: IndexHarness, fast: IndexHarness) -> None:
    assert fast.log == plain.log
    a, b = plain.stream, fast.stream
    assert (b.state, b.phase, b.expected_seq, b.held, b.reason) == (
        a.state,
        a.phase,
        a.expected_seq,
        a.held,
        a.reason,
    )
    assert b.counters == a.counters


def assert_same_index(plain: IndexHarness, fast: IndexHarness) -> None:
    x, y = plain.index, fast.index
    assert y.blocks("w", 0) == x.blocks("w", 0)
    assert dataclasses.replace(y.stats(), memory_bytes=0) == dataclasses.replace(
        x.stats(), memory_bytes=0
    )
    # The same keys too: every store's tokens, of every life, match alike.
    for batches, _ in plain.pub.lives:
        for batch in batches.values():
            for e in batch.events:
                if isinstance(e, BlockStored):
                    tokens = list(e.token_ids)
                    assert y.match(tokens) == x.match(tokens)


def twins(rnd: random.Random, replay: bool) -> tuple[IndexHarness, IndexHarness]:
    cfg = msgspec.structs.replace(
        config(replay, rnd.randint(1, 24)), decode_limits=rnd.choice(LIMITS)
    )
    kw: dict[str, Any] = {
        "buffer_steps": rnd.randint(1, 40),
        "max_replay": rnd.choice([None, rnd.randint(2, 12)]),
        "seed": rnd.randrange(2**16),
        "kind": rnd.choice(PUBLISHERS),
    }
    pair = IndexHarness(cfg, payloads=False, **kw), IndexHarness(cfg, payloads=True, **kw)
    rank = rnd.choice([0, 1])  # 1: the publisher's envelopes name another rank, counted
    for h in pair:
        h.stream.rank = rank
    return pair


@settings(MODEL, max_examples=examples(1000))
@given(rnd=st.randoms(use_true_random=False), replay=st.booleans())
def test_payload_and_decoding_streams_end_with_the_same_index_counters_and_states(
    rnd: random.Random, replay: bool
) -> None:
    plain, fast = twins(rnd, replay)
    schedule = long_schedule(rnd, replay, FATES)
    for op in schedule:
        plain.run(op)
        fast.run(op)
        assert_twins(plain, fast)
    plain.settle()
    fast.settle()
    assert_twins(plain, fast)
    assert_same_index(plain, fast)
    # Only a mutated payload may be one the check leaves to decode_batch.
    assert plain.by_payload == 0
    assert fast.by_batch <= sum(1 for op in schedule if op[0] == "publish" and op[2] == "mutate")
    assert fast.by_payload + fast.by_batch == plain.by_batch


# --- single cases -------------------------------------------------------------------


def live(seq: int, batch: KVEventBatch | bytes) -> list[bytes]:
    payload = batch if isinstance(batch, bytes) else encode_batch(batch)
    return [TOPIC, pack_seq(seq), payload]


def store(h: int, **kw: Any) -> BlockStored:
    return BlockStored(
        block_hashes=[h], parent_block_hash=None, token_ids=[h] * BLOCK, block_size=BLOCK, **kw
    )


def stream(**kw: Any) -> RankStream:
    s = RankStream(0, StreamConfig(replay=False, idle_probe=None, **kw), payloads=True)
    s.connected(0.0)
    return s


def test_a_vouched_batch_goes_as_its_bytes_and_is_counted_from_them() -> None:
    s = stream()
    frames = live(0, KVEventBatch(0.0, [store(1), store(2)], 3))  # another rank's envelope
    out = s.live(frames, 1.0)
    assert [a for a in out if isinstance(a, Apply | ApplyPayload)] == [ApplyPayload(0, frames[2])]
    c = s.counters
    assert (c.batches, c.events, c.rank_mismatches) == (1, 2, 1)
    # The fast path (in sequence, exact) counts alike.
    assert s.live(live(1, KVEventBatch(0.0, [store(3)], 5)), 1.0) == [
        ApplyPayload(1, encode_batch(KVEventBatch(0.0, [store(3)], 5)))
    ]
    assert (c.batches, c.events, c.rank_mismatches) == (2, 3, 2)


def test_a_batch_the_check_does_not_read_is_decoded_and_applied_as_a_batch() -> None:
    s = stream()
    batch = KVEventBatch(0.0, [store(1, lora_name="adapter")], 0)
    assert [a for a in s.live(live(0, batch), 1.0) if isinstance(a, Apply | ApplyPayload)] == [
        Apply(0, batch)
    ]


def test_a_refused_payload_is_counted_and_lost_as_without_payloads() -> None:
    limits = DecodeLimits(max_blocks=1)
    for payloads in (False, True):
        s = RankStream(
            0, StreamConfig(replay=False, idle_probe=None, decode_limits=limits), payloads=payloads
        )
        s.connected(0.0)
        s.live(live(0, KVEventBatch(0.0, [store(1)], 0)), 1.0)
        two = BlockStored(
            block_hashes=[2, 3], parent_block_hash=1, token_ids=[0] * 8, block_size=BLOCK
        )
        out = s.live(live(1, KVEventBatch(0.0, [two], 0)), 1.0)
        assert not [a for a in out if isinstance(a, Apply | ApplyPayload)]
        assert s.counters.decode_errors == 1
        assert s.state is RankState.PARTIAL  # no replay: the batch is lost for good


def test_a_clear_in_the_bytes_makes_a_partial_rank_exact_again() -> None:
    s = stream()
    s.live(live(0, KVEventBatch(0.0, [store(1)], 0)), 1.0)
    s.live(live(2, KVEventBatch(0.0, [store(3)], 0)), 1.0)  # 1 lost: PARTIAL
    before = s.state
    out = s.live(live(3, KVEventBatch(0.0, [AllBlocksCleared(), store(4)], 0)), 1.0)
    assert any(isinstance(a, ApplyPayload) for a in out)
    assert (before, s.state) == (RankState.PARTIAL, RankState.SYNCED)
