"""Every reader of a batch payload accepts the same payloads and reads the same events."""

from __future__ import annotations

import random

import msgspec
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.budget import examples
from tests.wire.differential import (
    Pairs,
    _pack,
    campaign,
    check,
    fixture_payloads,
    generated,
    mutate_bytes,
    mutate_value,
    restyle,
)


def test_every_captured_payload_is_read_alike_by_every_path() -> None:
    for payload in fixture_payloads():
        assert check(payload) in ("native", "general")


def test_a_short_campaign_of_mutated_fixtures_and_generated_batches() -> None:
    outcomes = campaign(3000, seed=11)
    # Each outcome is reached (the cases are neither all refused nor all clean).
    assert outcomes["native"] > 300 and outcomes["general"] > 50 and outcomes["refused"] > 300, outcomes


@settings(max_examples=examples(300), deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.randoms(use_true_random=False), st.integers(0, 3), st.integers(0, 2))
def test_generated_and_mutated_batches(rnd: random.Random, structural: int, bytewise: int) -> None:
    value = restyle(rnd, generated(rnd))
    for _ in range(structural):
        value = mutate_value(rnd, value)
    payload = _pack(value)
    for _ in range(bytewise):
        payload = mutate_bytes(rnd, payload)
    check(payload)


@settings(max_examples=examples(200), deadline=None)
@given(st.binary(max_size=64))
def test_random_bytes(data: bytes) -> None:
    check(data)


def test_pairs_pack_as_msgpack() -> None:
    assert _pack(Pairs([("a", 1), ("a", 2)])) == b"\x82\xa1a\x01\xa1a\x02"
    assert msgspec.msgpack.decode(_pack([1, Pairs([("b", [2])])])) == [1, {"b": [2]}]
