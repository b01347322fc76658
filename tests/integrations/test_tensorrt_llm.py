"""The TensorRT-LLM relay, on event dictionaries shaped as ``KVCacheEventSerializer`` writes them."""

from __future__ import annotations

import queue
import time
from typing import Any

import msgspec
import pytest
import zmq

from kvwire.integrations.config import RelayConfig
from kvwire.integrations.tensorrt_llm import (
    Clear,
    Lost,
    RankConverter,
    Remove,
    Store,
    TrtllmEventRelay,
)
from kvwire.prefix_index import PrefixIndex
from kvwire.subscriber import EngineSource, RankState, Subscriber

BS = 4
U64 = 1 << 64


def token(t: int, extra: int = 0) -> dict[str, Any]:
    return {"type": "unique_token", "token_id": t, "token_extra_id": extra}


def block(h: int, tokens: list[int], cache_level: int = 0, extra: int = 0) -> dict[str, Any]:
    return {
        "type": "stored_block",
        "block_hash": h,
        "tokens": [token(t, extra) for t in tokens],
        "cache_level": cache_level,
        "priority": 35,
    }


def event(event_id: int, data: dict[str, Any], window: int = 4096, rank: int | None = None) -> dict[str, Any]:
    out: dict[str, Any] = {"event_id": event_id, "data": data, "window_size": window}
    if rank is not None:
        out["attention_dp_rank"] = rank
    return out


def stored(event_id: int, parent: int | None, blocks: list[dict[str, Any]], **kw: Any) -> dict[str, Any]:
    return event(event_id, {"type": "stored", "parent_hash": parent, "blocks": blocks}, **kw)


def removed(event_id: int, hashes: list[int], **kw: Any) -> dict[str, Any]:
    return event(event_id, {"type": "removed", "block_hashes": hashes}, **kw)


def created(event_id: int, **kw: Any) -> dict[str, Any]:
    return event(event_id, {"type": "created", "num_blocks_per_cache_level": [128, 0]}, **kw)


def updated(event_id: int, h: int, **kw: Any) -> dict[str, Any]:
    diff = {"type": "event_diff", "new_value": 1, "old_value": 0}
    return event(event_id, {"type": "updated", "block_hash": h, "cache_level": diff, "priority": diff}, **kw)


def test_full_blocks_only_and_a_partial_block_ends_the_chain() -> None:
    c = RankConverter(BS)
    actions = c.feed(stored(0, None, [block(1, [1, 2, 3, 4]), block(2, [5, 6, 7, 8]), block(3, [9, 10]), block(4, [1, 1, 1, 1])]))
    assert actions == [Store([1, 2], None, [1, 2, 3, 4, 5, 6, 7, 8], "GPU", None)]
    assert c.published == {1, 2} and c.stats.partial_blocks == 1


def test_hashes_are_unsigned_inside_and_parents_chain() -> None:
    c = RankConverter(BS)
    assert c.feed(stored(0, -5, [block(-1, [0] * BS)])) == [Store([U64 - 1], U64 - 5, [0] * BS, "GPU", None)]


def test_cache_level_splits_the_chain_by_medium_and_extra_ids_become_keys() -> None:
    c = RankConverter(BS)
    actions = c.feed(stored(0, 7, [block(1, [1] * BS), block(2, [2] * BS, extra=9), block(3, [3] * BS, cache_level=1)]))
    assert actions == [
        Store([1, 2], 7, [1] * BS + [2] * BS, "GPU", [None, (9, 9, 9, 9)]),
        Store([3], 2, [3] * BS, "CPU", None),
    ]


def test_removal_of_a_never_published_block_is_suppressed() -> None:
    c = RankConverter(BS)
    c.feed(stored(0, None, [block(1, [1] * BS), block(2, [2])]))  # block 2 partial: never published
    assert c.feed(removed(1, [2, 1, 99])) == [Remove([1])]
    assert c.feed(removed(2, [1])) == []
    assert c.stats.suppressed_removals == 3 and c.published == frozenset()


def test_created_and_updated_are_ignored() -> None:
    c = RankConverter(BS)
    assert c.feed(created(0)) == [] and c.feed(updated(1, 5)) == []
    assert c.stats.ignored == 2


def test_only_the_largest_window_is_followed() -> None:
    c = RankConverter(BS)
    assert c.feed(stored(0, None, [block(1, [1] * BS)], window=512)) == [Store([1], None, [1] * BS, "GPU", None)]
    # A larger window appears: what the smaller one published is void.
    assert c.feed(stored(1, None, [block(2, [2] * BS)], window=4096)) == [
        Clear(), Store([2], None, [2] * BS, "GPU", None),
    ]  # fmt: skip
    assert c.feed(stored(2, None, [block(3, [3] * BS)], window=512)) == []
    assert c.feed(removed(3, [2], window=512)) == []
    assert c.published == {2} and c.stats.other_window == 2


def test_an_event_id_gap_is_a_loss_and_restarted_ids_clear() -> None:
    c = RankConverter(BS)
    c.feed(created(0))
    assert c.feed(stored(4, None, [block(1, [1] * BS)])) == [Lost(1, 3), Store([1], None, [1] * BS, "GPU", None)]
    assert c.stats.lost_events == 3
    assert c.feed(created(0)) == [Clear()]
    assert c.published == frozenset()


@pytest.mark.parametrize(
    "bad",
    [
        {"data": {"type": "removed", "block_hashes": [1]}},
        {"event_id": 1, "data": {"type": "stored", "parent_hash": None}},
        {"event_id": 1, "data": {"type": "removed", "block_hashes": ["x"]}},
        {"event_id": 1, "data": {"type": "stored", "parent_hash": None, "blocks": [{"tokens": [1, 2, 3, 4]}]}},
        {"event_id": 1, "data": {"type": "removed", "block_hashes": [1 << 64]}},
        "not a dict",
    ],
)
def test_a_malformed_event_is_a_visible_loss(bad: Any) -> None:
    c = RankConverter(BS)
    c.feed(created(0))
    actions = c.feed(bad)
    assert actions and isinstance(actions[-1], Lost)
    assert c.stats.malformed == 1


class FakeLLM:
    """The pull API of a TensorRT-LLM ``LLM``: each poll drains what the engine queued."""

    def __init__(self) -> None:
        self.queue: queue.Queue[list[dict[str, Any]]] = queue.Queue()

    def get_kv_cache_events(self, timeout: float | None = 2) -> list[dict[str, Any]]:
        try:
            return self.queue.get(timeout=timeout)
        except queue.Empty:
            return []


def wait_exact(sub: Subscriber, index: PrefixIndex, relay: TrtllmEventRelay, state: RankState) -> None:
    deadline = time.monotonic() + 20
    while True:
        status = {s.rank: s for s in sub.status()}
        ok = all(
            status[r].state is state
            and status[r].expected_seq == relay.publishers[r].last_seq + 1
            and index.blocks("trt", r) == set(relay.converters[r].published)
            for r in relay.converters
        )
        if ok:
            return
        assert time.monotonic() < deadline, status
        time.sleep(0.02)  # a poll under a deadline


def test_relay_publishes_per_rank_and_a_router_ends_exact(zctx: zmq.Context[Any]) -> None:
    llm = FakeLLM()
    config = RelayConfig(endpoint="tcp://127.0.0.1:*", replay_endpoint="tcp://127.0.0.1:*")
    relay = TrtllmEventRelay(llm, block_size=BS, ranks=2, poll_timeout_s=0.05, config=config).start()
    try:
        eps = relay.bound_endpoints()
        assert len(eps) == 2 and len({e for pair in eps for e in pair}) == 4
        # Before any router: served by replay later.
        llm.queue.put([
            created(0, rank=0), created(0, rank=1),
            stored(1, None, [block(-3, [1] * BS), block(4, [2] * BS)], rank=0),
            stored(1, None, [block(10, [5] * BS), block(11, [6, 6])], rank=1),
        ])  # fmt: skip
        index = PrefixIndex(BS)
        sub = Subscriber([EngineSource.from_rank_endpoints("trt", eps)], index).start()
        try:
            raw: zmq.Socket[bytes] = zctx.socket(zmq.SUB)
            raw.setsockopt(zmq.SUBSCRIBE, b"")
            raw.connect(eps[0][0])
            llm.queue.put([removed(2, [-3, 999], rank=0), stored(3, 4, [block(5, [3] * BS)], rank=0)])
            wait_exact(sub, index, relay, RankState.SYNCED)
            assert index.blocks("trt", 0) == {4, 5} and index.blocks("trt", 1) == {10}
            # On the wire hashes are signed 64-bit, as TensorRT-LLM's own publisher sends them.
            llm.queue.put([stored(4, None, [block(-7, [4] * BS)], rank=0)])
            deadline = time.monotonic() + 10
            stores: list[Any] = []
            while not stores:
                assert raw.poll(int(max(0.0, deadline - time.monotonic()) * 1000) + 1), "no live batch"
                _ts, events, rank = msgspec.msgpack.decode(raw.recv_multipart()[2])
                # Unsigned on the wire, 2**64 - 7 would never match.
                stores = [e for e in events if e["type"] == "BlockStored" and e["block_hashes"] == [-7]]
            assert rank == 0
            raw.close(0)
            # Events lost inside TensorRT-LLM: the rank must stop claiming exactness.
            llm.queue.put([stored(9, None, [block(20, [7] * BS)], rank=1)])
            deadline = time.monotonic() + 20
            while True:
                st = {s.rank: s for s in sub.status()}[1]
                if st.state is RankState.PARTIAL and st.expected_seq == relay.publishers[1].last_seq + 1:
                    break
                assert time.monotonic() < deadline, st
                time.sleep(0.02)  # a poll under a deadline
            assert st.counters.seqs_lost >= 1
            assert index.blocks("trt", 1) <= set(relay.converters[1].published)
            stats = relay.publishers[1].stats()
            assert (stats.skipped, stats.dropped_encode_error) == (1, 0)
        finally:
            sub.stop()
    finally:
        relay.stop()
    assert relay.poll_errors == 0


def test_relay_keeps_polling_through_errors() -> None:
    class Flaky(FakeLLM):
        calls = 0

        def get_kv_cache_events(self, timeout: float | None = 2) -> list[dict[str, Any]]:
            self.calls += 1
            if self.calls == 1:
                raise RuntimeError("executor is shutting down")
            return super().get_kv_cache_events(timeout)

    llm = Flaky()
    config = RelayConfig(endpoint="tcp://127.0.0.1:*")
    relay = TrtllmEventRelay(llm, block_size=BS, poll_timeout_s=0.02, config=config).start()
    try:
        llm.queue.put([stored(0, None, [block(1, [1] * BS)])])
        deadline = time.monotonic() + 10
        while relay.publishers[0].stats().published < 1:
            assert time.monotonic() < deadline, "the relay stopped after a failed poll"
            time.sleep(0.01)  # a poll under a deadline
    finally:
        relay.stop()
    assert relay.poll_errors == 1
