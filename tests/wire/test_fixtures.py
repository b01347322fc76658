"""Decode every captured dialect and compare with what the engines meant."""

from __future__ import annotations

from typing import Any

import msgspec

from kvwire.wire import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    ReplayEnd,
    ReplayItem,
    decode_batch,
    enc_hook,
    encode_batch,
    parse_live,
    parse_replay_reply,
)
from tests.conftest import FIXTURE_DIR, FIXTURE_FILES, hex_frames, load_fixture

# The endpoint a capture came from is rank 0; legacy envelopes carry no rank.
ENDPOINT_RANK = 0


def test_every_captured_dialect_is_present() -> None:
    names = {p.name for p in FIXTURE_FILES}
    assert {
        "vllm-0.33.0.json",
        "vllm-0.33.0-bytes-hashes.json",
        "sglang-0.5.23.json",
        "trtllm-streaming.json",
        "vllm-legacy-array.json",
    } <= names, f"wire fixtures missing from {FIXTURE_DIR}"


def _as_expected(seq: int, batch: Any, expected: dict[str, Any]) -> dict[str, Any]:
    """Project a decoded batch onto the keys the fixture lists."""
    events = []
    for event, want in zip(batch.events, expected["events"], strict=True):
        d = msgspec.to_builtins(event, enc_hook=enc_hook)
        events.append({k: d.get(k, getattr(event, k, None)) for k in want})
    rank = batch.data_parallel_rank
    return {
        "seq": seq,
        "data_parallel_rank": ENDPOINT_RANK if rank is None else rank,
        "events": events,
    }


def test_every_live_message_decodes_to_expected(wire_fixture: dict[str, Any]) -> None:
    live = wire_fixture["live"]
    expected = wire_fixture["expected_batches"]
    assert len(live) == len(expected)
    for message, want in zip(live, expected, strict=True):
        msg = parse_live(hex_frames(message))
        batch = decode_batch(msg.payload)
        assert _as_expected(msg.seq, batch, want) == want


def test_replay_reply_decodes_to_the_same_batches(wire_fixture: dict[str, Any]) -> None:
    start = wire_fixture["replay_request_start_seq"]
    replies = [parse_replay_reply(hex_frames(m)) for m in wire_fixture["replay_reply_via_dealer"]]
    assert isinstance(replies[-1], ReplayEnd)
    items = replies[:-1]
    assert all(isinstance(i, ReplayItem) for i in items)
    expected = [b for b in wire_fixture["expected_batches"] if b["seq"] >= start]
    got = []
    for item, want in zip(items, expected, strict=True):
        assert isinstance(item, ReplayItem)
        got.append(_as_expected(item.seq, decode_batch(item.payload), want))
    assert got == expected


def test_replaying_events_reproduces_final_blocks(wire_fixture: dict[str, Any]) -> None:
    held: set[int] = set()
    for message in wire_fixture["live"]:
        for event in decode_batch(parse_live(hex_frames(message)).payload).events:
            if isinstance(event, BlockStored):
                held.update(event.block_hashes)
            elif isinstance(event, BlockRemoved):
                held.difference_update(event.block_hashes)
            elif isinstance(event, AllBlocksCleared):
                held.clear()
    assert held == set(wire_fixture["expected_final_blocks"])


def test_map_encoding_is_byte_identical_to_vllm_0_33() -> None:
    data = load_fixture(FIXTURE_DIR / "vllm-0.33.0.json")
    for message in data["live"]:
        payload = parse_live(hex_frames(message)).payload
        assert encode_batch(decode_batch(payload), dialect="map") == payload


def test_legacy_topicless_replay_layout_has_no_topic() -> None:
    data = load_fixture(FIXTURE_DIR / "vllm-legacy-array.json")
    item = parse_replay_reply(hex_frames(data["replay_reply_via_dealer"][0]))
    assert isinstance(item, ReplayItem)
    assert item.topic is None
    assert item.seq == data["replay_request_start_seq"]
