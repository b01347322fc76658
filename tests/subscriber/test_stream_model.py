"""Property tests: RankStream against a model publisher under random faults.

Once replays settle, every rank either applied exactly the publisher's stream
(SYNCED: same batches, same blocks as the engine), or is PARTIAL and holds no
block the engine does not hold, or is STALE (only where the publisher can
prove nothing about an idle tail) and holds no block beyond the last batch it
applied. Along the way, batches of two publisher lives are never mixed
without a clear, and applies are in seq order. Publishers are the engines'
own (no epoch) or kvwire's, with and without heartbeats and snapshots. A router
may stop and a new one resume from the stream's position and the sink's contents
(a checkpoint): its applies must continue the same sequence.
"""

from __future__ import annotations

import random
from typing import Any

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvwire.subscriber import LossPolicy, RankState, StreamConfig
from tests.subscriber.sim import ENGINE, Harness, PublisherKind

KINDS = st.sampled_from(["store", "store", "store", "remove", "remove", "clear"])
FATES = st.sampled_from(
    ["deliver"] * 8 + ["lose", "lose", "corrupt", "truncate", "unbuffered", "broken"]
)
PUBLISH = st.tuples(st.just("publish"), KINDS, FATES)

PUBLISHERS = [
    ENGINE,
    PublisherKind(epoch=True),
    PublisherKind(epoch=True, heartbeat=0.5),
    PublisherKind(epoch=True, heartbeat=0.5, snapshot=True),
    PublisherKind(epoch=True, heartbeat=0.5, snapshot=True, mirror_drops=False),
    PublisherKind(epoch=True, snapshot=True),
]
PUBLISHER = st.sampled_from(PUBLISHERS)


def ops(replay: bool) -> st.SearchStrategy[list[tuple[Any, ...]]]:
    choices = [
        PUBLISH,
        PUBLISH,
        PUBLISH,
        st.tuples(st.just("deliver_live"), st.integers(1, 6)),
        st.tuples(st.just("deliver_live"), st.integers(1, 6)),
        st.tuples(st.just("tick"), st.sampled_from([0.01, 0.3, 1.2, 2.5])),
        st.just(("disconnect",)),
        st.just(("connect",)),
        st.just(("connect",)),
        st.just(("restart",)),
        st.just(("restart_same_epoch",)),
        st.just(("old_life",)),
        st.just(("early_data",)),
        st.just(("resume",)),
    ]
    if replay:
        choices += [
            st.tuples(st.just("serve"), st.integers(1, 2)),
            st.tuples(st.just("serve"), st.integers(1, 2)),
            st.tuples(st.just("deliver_replies"), st.integers(1, 10)),
            st.tuples(st.just("deliver_replies"), st.integers(1, 10)),
            st.just(("drop_replies",)),
            st.just(("stale_reply",)),
            st.just(("garbage_reply",)),
            st.just(("drop_chunk",)),
        ]
    return st.lists(st.one_of(*choices), min_size=10, max_size=150)


def config(replay: bool, max_held: int, policy: LossPolicy = LossPolicy.CLEAR) -> StreamConfig:
    return StreamConfig(
        replay=replay,
        max_held=max_held,
        replay_timeout=1.0,
        replay_retries=2,
        backoff_initial=0.05,
        backoff_max=0.4,
        idle_probe=2.0,
        loss_policy=policy,
    )


MODEL = settings(
    max_examples=300,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)


@MODEL
@given(
    schedule=ops(replay=True),
    max_held=st.integers(1, 24),
    buffer_steps=st.integers(1, 40),
    max_replay=st.one_of(st.none(), st.integers(2, 12)),
    seed=st.integers(0, 2**16),
    kind=PUBLISHER,
)
def test_with_replay_every_rank_is_exact_or_partial_without_stale_blocks(
    schedule: list[tuple[Any, ...]],
    max_held: int,
    buffer_steps: int,
    max_replay: int | None,
    seed: int,
    kind: PublisherKind,
) -> None:
    h = Harness(
        config(True, max_held),
        buffer_steps=buffer_steps,
        max_replay=max_replay,
        seed=seed,
        kind=kind,
    )
    for op in schedule:
        h.run(op)
    h.settle()
    h.check_settled()


_LONG_OPS = (
    ["publish"] * 3
    + ["deliver_live"] * 2
    + ["tick", "disconnect", "connect", "connect", "restart", "early_data"]
    + ["restart_same_epoch", "old_life", "resume"]
)
_REPLAY_OPS = ["serve", "serve", "deliver_replies", "deliver_replies"]
_REPLAY_OPS += ["drop_replies", "stale_reply", "garbage_reply", "drop_chunk"]


LONG_FATES = ["deliver"] * 8 + ["lose", "lose", "corrupt", "truncate", "unbuffered", "broken"]


def long_schedule(
    rnd: random.Random, replay: bool, fates: list[str] = LONG_FATES
) -> list[tuple[Any, ...]]:
    """Long random schedules: deep fault sequences that short lists rarely reach."""
    names = _LONG_OPS + (_REPLAY_OPS if replay else [])
    kinds = ["store", "store", "store", "remove", "remove", "clear"]
    out: list[tuple[Any, ...]] = []
    for _ in range(rnd.randint(0, 150)):
        name = rnd.choice(names)
        if name == "publish":
            out.append((name, rnd.choice(kinds), rnd.choice(fates)))
        elif name in ("deliver_live", "deliver_replies"):
            out.append((name, rnd.randint(1, 8)))
        elif name == "serve":
            out.append((name, rnd.randint(1, 2)))
        elif name == "tick":
            out.append((name, rnd.choice([0.01, 0.3, 1.2, 2.5])))
        else:
            out.append((name,))
    return out


@settings(MODEL, max_examples=1000)
@given(rnd=st.randoms(use_true_random=False), replay=st.booleans())
def test_long_random_fault_schedules_end_exact_or_partial(rnd: random.Random, replay: bool) -> None:
    h = Harness(
        config(replay, rnd.randint(1, 24)),
        buffer_steps=rnd.randint(1, 40),
        max_replay=rnd.choice([None, rnd.randint(2, 12)]),
        seed=rnd.randrange(2**16),
        kind=rnd.choice(PUBLISHERS),
    )
    for op in long_schedule(rnd, replay):
        h.run(op)
    h.settle()
    h.check_settled()


@MODEL
@given(schedule=ops(replay=False), seed=st.integers(0, 2**16), kind=PUBLISHER)
def test_without_replay_every_gap_is_a_loss_and_nothing_stale_survives(
    schedule: list[tuple[Any, ...]], seed: int, kind: PublisherKind
) -> None:
    h = Harness(config(False, 8), seed=seed, kind=kind)
    for op in schedule:
        h.run(op)
    h.settle()
    h.check_settled()


@settings(MODEL, max_examples=120)
@given(
    schedule=ops(replay=True),
    buffer_steps=st.integers(1, 40),
    seed=st.integers(0, 2**16),
    kind=PUBLISHER,
)
def test_keep_policy_never_claims_synced_unless_exact(
    schedule: list[tuple[Any, ...]], buffer_steps: int, seed: int, kind: PublisherKind
) -> None:
    h = Harness(
        config(True, 8, LossPolicy.KEEP),
        buffer_steps=buffer_steps,
        seed=seed,
        contiguous=False,
        kind=kind,
    )
    for op in schedule:
        h.run(op)
    h.settle()
    h.check_settled(subset=False)


@settings(MODEL, max_examples=60)
@given(
    lossless=st.lists(st.tuples(st.just("publish"), KINDS, st.just("deliver")), max_size=30),
    seed=st.integers(0, 2**16),
    kind=st.sampled_from([k for k in PUBLISHERS if k.heartbeat is not None or not k.epoch]),
)
def test_a_clean_stream_is_applied_exactly_and_synced(
    lossless: list[tuple[Any, ...]], seed: int, kind: PublisherKind
) -> None:
    h = Harness(config(True, 8), buffer_steps=100, seed=seed, kind=kind)
    h.connect()
    h.settle()
    for op in lossless:
        h.run(op)
        h.deliver_live(1)
    h.settle()
    h.check_settled()
    assert h.stream.state is RankState.SYNCED
    assert [s for s, _ in h.sink.since_clear] == list(range(h.pub.seq))
    beats = sum(1 for b in h.pub.batches.values() if not b.events)
    assert h.pub.seq == len(lossless) + beats
    c = h.stream.counters
    assert (c.gaps, c.seqs_lost, c.resyncs, c.restarts, c.decode_errors) == (0, 0, 0, 0, 0)
