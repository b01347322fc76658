"""The plugins' native path: the engines' own structs, read in C and written by kvwire's sender.

Whatever the batch, the bytes are those of the engine's own msgspec encoder: the
native encoder's where it takes the batch, msgspec's (under the GIL) where not.
"""

from __future__ import annotations

import random
import sys
import time
import types
from typing import Any

import msgspec
import pytest
import zmq
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvwire.integrations.adapter import EngineEventPublisher, engine_format, factory_for
from kvwire.integrations.config import IntegrationConfig
from kvwire.integrations.sglang import SglangEventPublisher
from kvwire.integrations.vllm import VllmEventPublisher
from kvwire.publisher._sender import EnginePublish
from kvwire.wire import unpack_seq

from .streams import receive, replay, subscribe

Engine = types.SimpleNamespace
ENCODER = msgspec.msgpack.Encoder()
RANK_FIELD = {"vllm": "data_parallel_rank", "sglang": "attn_dp_rank"}

U64 = st.integers(-(2**63), 2**64 - 1)
ANY_INT = st.one_of(U64, st.integers(-(2**70), 2**70))  # beyond 64 bits msgspec refuses
PLAIN_STR = st.one_of(
    st.none(), st.sampled_from(["GPU", "CPU", "CPU_PINNED"]), st.text("abcxyz_-", max_size=300)
)
ANY_STR = st.one_of(PLAIN_STR, st.text(max_size=8))  # non-ASCII: msgspec's


def _values(plain: bool) -> dict[str, st.SearchStrategy[Any]]:
    """A strategy per field name of the engines' event structs; others get a str or None."""
    ints = U64 if plain else ANY_INT
    hash_ = ints if plain else st.one_of(ints, st.binary(max_size=8))
    opt_int = st.one_of(st.none(), ints)
    lists = {
        "block_hashes": st.lists(hash_, max_size=20),
        "token_ids": st.lists(ints, max_size=40),
    }
    scalars = {
        "parent_block_hash": st.one_of(st.none(), hash_),
        "block_size": ints if plain else st.one_of(ints, st.none()),
        "lora_id": opt_int,
        "group_idx": opt_int,
        "kv_cache_spec_sliding_window": opt_int,
    }
    if plain:
        extra: dict[str, st.SearchStrategy[Any]] = {
            "extra_keys": st.none(),
            "lookahead_token_ids": st.none(),
        }
    else:
        extra = {
            "extra_keys": st.one_of(
                st.none(), st.lists(st.one_of(st.none(), st.tuples(st.text(max_size=3))))
            ),
            "lookahead_token_ids": st.one_of(
                st.none(), st.lists(st.lists(ints, max_size=3), max_size=3)
            ),
        }
    return {**lists, **scalars, **extra}


def _event(kv: Any, plain: bool) -> st.SearchStrategy[Any]:
    values = _values(plain)
    text = PLAIN_STR if plain else ANY_STR

    def of(cls: type) -> st.SearchStrategy[Any]:
        fields: tuple[str, ...] = cls.__struct_fields__  # type: ignore[attr-defined]
        return st.builds(cls, **{f: values.get(f, text) for f in fields})

    return st.one_of(of(kv.BlockStored), of(kv.BlockRemoved), st.just(kv.AllBlocksCleared()))


def _batch(kv: Any, rank_field: str, plain: bool) -> st.SearchStrategy[Any]:
    rank = st.one_of(st.none(), U64) if plain else st.one_of(st.none(), ANY_INT)
    return st.builds(
        lambda ts, events, r: kv.KVEventBatch(ts=ts, events=events, **{rank_field: r}),
        st.floats(),
        st.lists(_event(kv, plain), max_size=6),
        rank,
    )


def _engine(request: pytest.FixtureRequest, name: str) -> Engine:
    engine: Engine = request.getfixturevalue(f"{name}_session")
    return engine


def msgspec_bytes(batch: Any) -> bytes | None:
    try:
        return ENCODER.encode(batch)
    except (OverflowError, TypeError):
        return None


@pytest.mark.parametrize("name", ["vllm", "sglang"])
def test_native_bytes_are_msgspecs_for_any_batch(request: pytest.FixtureRequest, name: str) -> None:
    """Any batch (bytes hashes, extra keys, non-ASCII strs, ints past 64 bits...): the native
    encoder writes msgspec's bytes or leaves the batch to msgspec."""
    kv = _engine(request, name).kv_events
    fmt = engine_format(kv, RANK_FIELD[name], ENCODER)
    assert fmt is not None
    native_taken = 0

    @settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
    @given(_batch(kv, RANK_FIELD[name], plain=False))
    def check(batch: Any) -> None:
        nonlocal native_taken
        ours, theirs = fmt.encode(batch), msgspec_bytes(batch)
        if ours is not None:
            native_taken += 1
            assert ours == theirs

    check()
    assert native_taken > 0


@pytest.mark.parametrize("name", ["vllm", "sglang"])
def test_native_encoder_takes_every_plain_batch(request: pytest.FixtureRequest, name: str) -> None:
    """Int hashes, ASCII strs, no extra keys: always written natively, msgspec's bytes."""
    kv = _engine(request, name).kv_events
    fmt = engine_format(kv, RANK_FIELD[name], ENCODER)
    assert fmt is not None

    @settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
    @given(_batch(kv, RANK_FIELD[name], plain=True))
    def check(batch: Any) -> None:
        assert fmt.encode(batch) == ENCODER.encode(batch)

    check()


@pytest.mark.parametrize("n", [1, 63, 64, 65, 129, 300])
def test_any_int_anywhere_in_long_lists_is_msgspecs_bytes(vllm_session: Engine, n: int) -> None:
    """The lists are read prefetching 64 items ahead: ints of every size and sign (and ones
    only msgspec writes, or refuses) first, in the middle and last of lists about that long."""
    kv = vllm_session.kv_events
    fmt = engine_format(kv, RANK_FIELD["vllm"], ENCODER)
    assert fmt is not None
    rng = random.Random(n)
    edges = [0, 1, 2**30 - 1, 2**30, 2**32 - 1, 2**32, 2**60, 2**63 - 1, 2**63, 2**64 - 1, -1,
             -(2**31), -(2**63)]  # fmt: skip
    for at in sorted({0, n // 2, n - 1}):
        for x in [*edges, 2**64, True]:
            hashes = [rng.getrandbits(64) for _ in range(n)]  # about half above 2**63 - 1
            tokens = [rng.randrange(200_000) for _ in range(n)]
            hashes[at] = tokens[at] = x
            stored = kv.BlockStored(
                block_hashes=hashes, parent_block_hash=None, token_ids=tokens, block_size=16,
                lora_id=None, medium="GPU", lora_name=None,
            )  # fmt: skip
            removed = kv.BlockRemoved(block_hashes=hashes[::-1], medium="GPU")
            batch = kv.KVEventBatch(ts=1.0, events=[stored, removed])
            ours, theirs = fmt.encode(batch), msgspec_bytes(batch)
            if x in edges and type(x) is int:
                assert ours == theirs
            else:
                assert ours is None or ours == theirs


def test_subclasses_and_unknown_classes_go_to_msgspec(vllm_session: Engine) -> None:
    kv = vllm_session.kv_events
    fmt = engine_format(kv, "data_parallel_rank", ENCODER)
    assert fmt is not None

    class Removed(kv.BlockRemoved):  # type: ignore[misc,name-defined]
        pass

    removed = kv.BlockRemoved(block_hashes=[1], medium="GPU")
    assert fmt.encode(kv.KVEventBatch(ts=1.0, events=[removed], data_parallel_rank=0)) is not None
    for events in ([Removed(block_hashes=[1], medium="GPU")], [removed, object()]):
        assert fmt.encode(kv.KVEventBatch(ts=1.0, events=events, data_parallel_rank=0)) is None
    assert fmt.encode((1.0, [removed], 0)) is None


def _plain_batch(kv: Any, i: int) -> Any:
    stored = kv.BlockStored(
        block_hashes=[i * 4 + 1, -(i * 4 + 2)], parent_block_hash=None, token_ids=list(range(32)),
        block_size=16, lora_id=None, medium="GPU", lora_name=None,
    )  # fmt: skip
    return kv.KVEventBatch(
        ts=time.time(), events=[stored, kv.BlockRemoved(block_hashes=[i], medium="GPU")]
    )


def stats_reach(sender: Any, key: str, value: int, timeout: float = 20.0) -> dict[str, int]:
    """The sender's counters once ``key`` reached ``value`` (they follow the send)."""
    deadline = time.monotonic() + timeout
    while (stats := sender.stats())[key] < value:
        assert time.monotonic() < deadline, f"{key} stayed at {stats[key]} < {value}"
        time.sleep(0.005)
    assert stats[key] == value, stats
    return dict(stats)


def _publisher(kv: Any, cls: type[EngineEventPublisher], endpoint: str) -> Any:
    return factory_for(kv, cls)(
        endpoint=endpoint, replay_endpoint=endpoint + "-r", config=IntegrationConfig()
    )


def _join(kv: Any, pub: Any, sub: Any) -> int:
    """Ping until the subscription is through, drain; the seq the next batch gets."""
    deadline = time.monotonic() + 20
    while not sub.poll(0):
        assert time.monotonic() < deadline, "the subscriber never joined"
        pub.publish(_plain_batch(kv, 0))
        sub.poll(20)
    while sub.poll(200):
        sub.recv_multipart()
    return int(pub.publisher._sender.stats()["last_seq"]) + 1


@pytest.mark.parametrize(
    ("name", "cls"), [("vllm", VllmEventPublisher), ("sglang", SglangEventPublisher)]
)
def test_plain_batches_never_take_the_gil_on_the_sender(
    request: pytest.FixtureRequest,
    name: str,
    cls: type[EngineEventPublisher],
    ipc_dir: str,
    zctx: zmq.Context[Any],
) -> None:
    """N plain batches through the plugin: sent natively, the sender thread never takes the
    GIL; a batch with a bytes hash is msgspec's, under the GIL. The wire carries the engine's bytes."""
    kv = _engine(request, name).kv_events
    endpoint = f"ipc://{ipc_dir}/native"
    pub = _publisher(kv, cls, endpoint)
    sub = subscribe(zctx, endpoint)
    try:
        sender = pub.publisher._sender
        first = _join(kv, pub, sub)
        before = sender.stats()
        n = 200
        batches = [_plain_batch(kv, i) for i in range(n)]
        for batch in batches:
            pub.publish(batch)
        got = receive(sub, n, first)
        assert isinstance(pub.publish, EnginePublish)  # the scheduler's call runs no frame
        assert {getattr(b, RANK_FIELD[name]) for b in batches} == {pub.rank}  # stamped
        after = stats_reach(sender, "native_encoded", before["native_encoded"] + n)
        assert after["gil_encoded"] == before["gil_encoded"]
        assert after["sender_gil_takes"] == before["sender_gil_takes"]
        assert [m[2] for m in got] == [ENCODER.encode(b) for b in batches]
        replayed = replay(zctx, endpoint + "-r", first)[:-1]  # the end marker left out
        assert [m[1:] for m in replayed[:n]] == got

        odd = _plain_batch(kv, n)
        odd.events[0].block_hashes = [b"\x01" * 8]
        pub.publish(odd)
        (msg,) = receive(sub, 1, first + n)
        assert msg[2] == ENCODER.encode(odd)
        stats_reach(sender, "gil_encoded", before["gil_encoded"] + 1)

        bad = _plain_batch(kv, n + 1)
        bad.events[1].block_hashes = [2**70]  # msgspec refuses it: a counted gap, noted
        pub.publish(bad)
        pub.publish(_plain_batch(kv, n + 2))
        (msg,) = receive(sub, 1, first + n + 1)
        assert unpack_seq(msg[1]) == first + n + 2
        stats_reach(sender, "dropped_encode_error", before["dropped_encode_error"] + 1)

        class Removed(kv.BlockRemoved):  # type: ignore[misc,name-defined]
            pass  # a class the native reader does not know: the Python fallback's

        other = kv.KVEventBatch(ts=1.0, events=[Removed(block_hashes=[7], medium="GPU")])
        pub.publish(other)
        assert getattr(other, RANK_FIELD[name]) == pub.rank
        (msg,) = receive(sub, 1, first + n + 3)
        assert msg[2] == ENCODER.encode(other)
        stats_reach(sender, "gil_encoded", before["gil_encoded"] + 3)
        with pytest.raises(TypeError):
            pub.publish(other, other)
        fmt = engine_format(kv, RANK_FIELD[name], ENCODER)
        assert fmt is not None
        with pytest.raises(ValueError, match="rank field"):
            EnginePublish(sender, fmt, "ts", 0, pub.publisher.publish)
    finally:
        sub.close()
        pub.shutdown()


def test_plain_batches_are_read_during_publish(
    vllm_session: Engine, ipc_dir: str, zctx: zmq.Context[Any]
) -> None:
    """The plugin keeps no reference to a plain batch, its lists or their ints (the engine
    frees them itself): changing them after publish() changes nothing that is sent."""
    kv = vllm_session.kv_events
    endpoint = f"ipc://{ipc_dir}/copied"
    pub = _publisher(kv, VllmEventPublisher, endpoint)
    sub = subscribe(zctx, endpoint)
    try:
        first = _join(kv, pub, sub)
        batch = _plain_batch(kv, 1)
        batch.data_parallel_rank = pub.rank
        expected = ENCODER.encode(batch)
        tokens = batch.events[0].token_ids
        refs = sys.getrefcount(batch), sys.getrefcount(tokens)
        pub.publish(batch)
        assert (sys.getrefcount(batch), sys.getrefcount(tokens)) == refs
        tokens[0] = 99
        batch.events[1].block_hashes.append(5)
        (msg,) = receive(sub, 1, first)
        assert msg[2] == expected
    finally:
        pub.shutdown()
        sub.close(linger=0)
