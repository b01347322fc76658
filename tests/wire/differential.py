"""Every reader of a batch payload side by side: one payload, one answer.

The paths: ``decode_batch``; its general path alone (``_decode_generic``);
its typed path (``_decode_typed``, taken only for a payload the native
reader vouches for); the native reader itself (``kvwire.wire._scan``: its
check and its flat view); the subscriber's receive check (``_recv``); the
prefix index's fused apply; the snapshot mirror's native apply. ``check``
runs them all on one payload and raises ``AssertionError`` naming the first
disagreement: each must accept exactly what ``decode_batch`` accepts (or
leave the payload to it, changing nothing) and read the same events, and
the index and the mirror must end as ``decode_batch`` followed by their
general path leaves them.

``payloads`` makes the cases: the captured fixtures (tests/fixtures/wire) in
every envelope and event form, mutated structurally (fields dropped, given
twice, retyped, reordered) and byte-wise. tests/wire/test_differential.py
runs a few thousand; ``benchmarks/fuzz_campaign.py --differential N`` runs N.
"""

from __future__ import annotations

import json
import random
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgspec

from kvwire.prefix_index import PrefixIndex
from kvwire.publisher._mirror import Core
from kvwire.subscriber._recv import check_batch
from kvwire.wire import (
    DEFAULT_LIMITS,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    DecodeLimits,
    KVEventBatch,
    TokenIds,
    WireError,
    _scan,
    decode_batch,
    enc_hook,
)
from kvwire.wire.codec import _decode_generic, _decode_typed

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "wire"
BLOCK = 4  # the fixtures' block size
_enc = msgspec.msgpack.Encoder()
_generic = msgspec.msgpack.Decoder()
_KINDS = {BlockStored: "BlockStored", BlockRemoved: "BlockRemoved", AllBlocksCleared: "AllBlocksCleared"}


def _canon(batch: KVEventBatch) -> bytes:
    """A batch as bytes, token ids as lists (equal bytes: equal batches, NaN timestamps included)."""
    return _enc.encode(msgspec.to_builtins(batch, enc_hook=enc_hook))


def _limits_args(limits: DecodeLimits) -> tuple[int, int, int, int]:
    return limits.max_events, limits.max_blocks, limits.max_block_size, limits.max_tokens


def _view_of(e: Any) -> tuple[Any, ...]:
    """An event as the native reader's flat view shows it (its extras bits aside)."""
    if type(e) is AllBlocksCleared:
        return ("AllBlocksCleared", [], None, None, 0, "GPU", None, None)
    if type(e) is BlockRemoved:
        return ("BlockRemoved", e.block_hashes, None, None, 0, e.medium, None, e.group_idx)
    tokens = e.token_ids.tolist() if type(e.token_ids) is TokenIds else list(e.token_ids)
    return ("BlockStored", e.block_hashes, e.parent_block_hash, tokens, e.block_size, e.medium,
            e.lora_name, e.group_idx)  # fmt: skip


def _chains(core: Core) -> list[tuple[Any, ...]]:
    return [
        (c.hash_list(0, len(c)), c.parent, c.tokens, c.block_size, c.medium, c.lora, c.extra, c.group)
        for c in core.chains()
    ]


def _mirror_general(events: list[Any]) -> Core:
    """The mirror's general path (kvwire.publisher.mirror.Mirror._apply) on a fresh core."""
    core = Core()
    for e in events:
        if type(e) is BlockStored:
            tokens = e.token_ids
            packed = bytes(tokens.raw) if type(tokens) is TokenIds else _enc.encode(list(tokens))
            core.store(e.block_hashes, e.parent_block_hash, packed, e.block_size, e.medium,
                       e.lora_name, e.extra_keys, e.group_idx)  # fmt: skip
        elif type(e) is BlockRemoved:
            core.remove(e.medium, e.block_hashes)
        else:
            core = Core()
    return core


def _index_state(idx: PrefixIndex, probes: list[list[int]]) -> tuple[Any, ...]:
    return (idx.stats(), idx.blocks("w", 0), idx.over_cap("w", 0), [idx.match_tiers(p) for p in probes])


def check(payload: bytes, limits: DecodeLimits = DEFAULT_LIMITS) -> str:
    """Every path on one payload; the outcome: "native" (a native reader took it), "general", "refused"."""
    try:
        ref: KVEventBatch | None = decode_batch(payload, limits)
    except WireError:
        ref = None
    try:
        generic: KVEventBatch | None = _decode_generic(payload, limits)
    except WireError:
        generic = None
    assert (ref is None) == (generic is None), "decode_batch and its general path disagree on acceptance"
    if ref is not None:
        assert generic is not None and _canon(ref) == _canon(generic), "the general path reads other events"
    typed = _decode_typed(payload, limits)
    if typed is not None:
        assert ref is not None and _canon(typed) == _canon(ref), "the typed path reads other events"

    vouched = _scan.check(payload, limits)
    view = _scan.view(payload, limits)
    assert (vouched is None) == (view is None), "the reader's check and view disagree"
    if vouched is not None and view is not None:
        assert ref is not None, "the native reader vouches for a payload decode_batch refuses"
        assert vouched == (len(ref.events), ref.data_parallel_rank, any(type(e) is AllBlocksCleared for e in ref.events))
        got = [(k, h, p, None if t is None else msgspec.msgpack.decode(t), bs, med, lora, g)
               for k, h, p, t, bs, med, lora, g, _ in view]  # fmt: skip
        want = [_view_of(e) for e in ref.events]
        assert got == want, "the native reader's view differs from decode_batch's events"

    recv = check_batch(payload, *_limits_args(limits))
    if recv is not None:
        assert recv == vouched, "the receive check reads other counts than the native reader"

    native = False
    # The index: its fused apply, or nothing changed and the general way.
    probes = [[], list(range(BLOCK * 3))]
    idx = PrefixIndex(BLOCK, groups=(0, None, 1))
    idx.apply("w", 0, KVEventBatch(0.0, [], 0))
    before = _index_state(idx, probes)
    if idx._core.apply_payload(0, payload, limits):
        native = True
        assert ref is not None, "the index's fused apply took a payload decode_batch refuses"
        general = PrefixIndex(BLOCK, groups=(0, None, 1))
        general.apply("w", 0, ref)
        assert _index_state(idx, probes) == _index_state(general, probes), "the fused apply leaves another index"
    else:
        assert _index_state(idx, probes) == before, "the index's fused apply changed the index and gave up"

    if limits == DEFAULT_LIMITS:
        core = Core()
        if core.apply_payload(payload):
            native = True
            assert ref is not None, "the mirror took a payload decode_batch refuses"
            assert _chains(core) == _chains(_mirror_general(ref.events)), "the mirror's native apply differs"
        else:
            assert core.chains() == [], "the mirror changed and gave up"
    if ref is None:
        return "refused"
    return "native" if native or recv is not None else "general"


# --- the cases -------------------------------------------------------------------


class Pairs(list[tuple[Any, Any]]):
    """A msgpack map as its pairs, so a key may be given twice."""


def _pack(v: Any) -> bytes:
    if isinstance(v, Pairs):
        n = len(v)
        head = bytes([0x80 | n]) if n < 16 else b"\xde" + n.to_bytes(2, "big")
        return head + b"".join(_pack(k) + _pack(x) for k, x in v)
    if isinstance(v, list):
        n = len(v)
        head = bytes([0x90 | n]) if n < 16 else b"\xdc" + n.to_bytes(2, "big")
        return head + b"".join(_pack(x) for x in v)
    if isinstance(v, msgspec.Raw):
        return bytes(v)
    return _enc.encode(v)


def _as_pairs(v: Any) -> Any:
    if isinstance(v, dict):
        return Pairs((k, _as_pairs(x)) for k, x in v.items())
    if isinstance(v, list):
        return [_as_pairs(x) for x in v]
    return v


def fixture_payloads() -> list[bytes]:
    """The batch payloads of every captured dialect."""
    out = []
    for path in sorted(FIXTURES.glob("*.json")):
        for frames in json.loads(path.read_text())["live"]:
            out.append(bytes.fromhex(frames[-1]))
    return out


SCALARS: list[Any] = [None, True, False, 0, 1, -1, 2, 4, 255, 65536, 2**63, -(2**63), 1.5, "", "GPU", "CPU",
                      "tape", "BlockStored", "BlockRemoved", "AllBlocksCleared", "type", "é", b"\x01" * 8,
                      [], [1], [None], [1, True], ["a"]]  # fmt: skip
FIELDS = [*list(BlockStored.__struct_fields__), "type", "unknown_field"]


def _tokens_for(rnd: random.Random, n_blocks: int) -> list[int]:
    return [rnd.choice((0, 1, 127, 128, 255, 256, 65535, 65536, 2**32, 2**63)) for _ in range(n_blocks * BLOCK)]


def generated(rnd: random.Random) -> Any:
    """A batch of random events, as plain msgpack values (maps as Pairs)."""
    events: list[Any] = []
    for _ in range(rnd.randrange(0, 6)):
        kind = rnd.random()
        n = rnd.randrange(0, 4)
        hashes = [rnd.choice((rnd.getrandbits(64), rnd.randrange(1, 9), -rnd.randrange(1, 2**63))) for _ in range(n)]
        if kind < 0.6:
            ev = Pairs([("type", "BlockStored"), ("block_hashes", hashes),
                        ("parent_block_hash", rnd.choice((None, rnd.randrange(1, 9)))),
                        ("token_ids", _tokens_for(rnd, n)), ("block_size", rnd.choice((BLOCK, BLOCK, 2, 5000)))])  # fmt: skip
            for name, values in (("lora_id", (None, 3)), ("medium", (None, "GPU", "CPU", "DISK", "tape")),
                                 ("lora_name", (None, "adapter")), ("group_idx", (None, 0, 1, 2, -1)),
                                 ("extra_keys", (None, ["k"])), ("cache_salt", (None, "salt")),
                                 ("kv_cache_spec_kind", (None, "full")), ("locality", (None, "local")),
                                 ("lookahead_token_ids", (None, [1, 2]))):  # fmt: skip
                if rnd.random() < 0.3:
                    ev.append((name, rnd.choice(values)))
        elif kind < 0.9:
            ev = Pairs([("type", "BlockRemoved"), ("block_hashes", hashes)])
            if rnd.random() < 0.5:
                ev.append(("medium", rnd.choice((None, "GPU", "CPU"))))
            if rnd.random() < 0.3:
                ev.append(("group_idx", rnd.choice((None, 0, 1, 3))))
        else:
            ev = Pairs([("type", "AllBlocksCleared")])
        events.append(ev)
    return [rnd.choice((0.0, 1.5)), events, rnd.choice((None, 0, 1))]


def _positional(ev: Pairs) -> Any:
    d = dict(ev)
    kind = d.pop("type", None)
    names = {"BlockStored": BlockStored.__struct_fields__, "BlockRemoved": BlockRemoved.__struct_fields__}.get(
        kind if isinstance(kind, str) else "", ()
    )
    given = [i for i, n in enumerate(names) if n in d]
    upto = max(given) + 1 if given else 0
    return [kind, *[d.get(n) for n in names[:upto]]]


def restyle(rnd: random.Random, batch: Any) -> Any:
    """The same batch in another dialect: events positional, the envelope a map, or as it was."""
    if not (isinstance(batch, list) and len(batch) >= 2 and isinstance(batch[1], list)):
        return batch
    events = batch[1]
    if rnd.random() < 0.3:
        events = [_positional(e) if isinstance(e, Pairs) else e for e in events]
    if rnd.random() < 0.3:
        pairs = Pairs([("ts", batch[0]), ("events", events)])
        if len(batch) > 2 and rnd.random() < 0.8:
            pairs.append(("data_parallel_rank", batch[2]))
        rnd.shuffle(pairs)
        return pairs
    return [batch[0], events, *batch[2:]]


def mutate_value(rnd: random.Random, v: Any, depth: int = 0) -> Any:
    """One structural change somewhere in v: a pair dropped, doubled or retyped, an item changed."""
    if isinstance(v, Pairs) and v and rnd.random() < 0.7:
        i = rnd.randrange(len(v))
        k, x = v[i]
        op = rnd.random()
        out = Pairs(v)
        if op < 0.15:
            del out[i]
        elif op < 0.3:
            out.insert(rnd.randrange(len(out) + 1), (k, rnd.choice((x, *SCALARS))))
        elif op < 0.4:
            out[i] = (rnd.choice([*FIELDS, 7]), x)
        elif op < 0.5:
            rnd.shuffle(out)
        else:
            out[i] = (k, mutate_value(rnd, x, depth + 1))
        return out
    if isinstance(v, list) and v and rnd.random() < 0.8:
        out2 = list(v)
        i = rnd.randrange(len(out2))
        op = rnd.random()
        if op < 0.15:
            del out2[i]
        elif op < 0.25:
            out2.append(rnd.choice(SCALARS))
        else:
            out2[i] = mutate_value(rnd, out2[i], depth + 1)
        return out2
    return rnd.choice(SCALARS) if depth < 6 or rnd.random() < 0.5 else v


INTERESTING = [0x00, 0x7F, 0x80, 0x90, 0xA0, 0xC0, 0xC1, 0xC2, 0xC3, 0xCA, 0xCB, 0xCC, 0xCD, 0xCE, 0xCF,
               0xD0, 0xD3, 0xD9, 0xDC, 0xDD, 0xDE, 0xDF, 0xFF]  # fmt: skip


def mutate_bytes(rnd: random.Random, b: bytes) -> bytes:
    """One byte-level change: a byte set, flipped, inserted or dropped, a cut, a slice doubled."""
    if not b:
        return bytes([rnd.choice(INTERESTING)])
    a = bytearray(b)
    i = rnd.randrange(len(a))
    op = rnd.random()
    if op < 0.3:
        a[i] = rnd.choice(INTERESTING)
    elif op < 0.5:
        a[i] ^= 1 << rnd.randrange(8)
    elif op < 0.6:
        a.insert(i, rnd.choice(INTERESTING))
    elif op < 0.7:
        del a[i]
    elif op < 0.8:
        del a[i:]
    else:
        j = min(len(a), i + rnd.randrange(1, 16))
        a[i:i] = a[i:j]
    return bytes(a)


def payloads(seed: int) -> Iterator[bytes]:
    """Endless cases: fixtures and generated batches, restyled, mutated structurally and byte-wise."""
    rnd = random.Random(seed)
    bases = [_as_pairs(_generic.decode(p)) for p in fixture_payloads()]
    while True:
        base = rnd.choice(bases) if rnd.random() < 0.5 else generated(rnd)
        value = restyle(rnd, base)
        for _ in range(rnd.choice((0, 0, 0, 1, 1, 2, 3))):
            value = mutate_value(rnd, value)
        payload = _pack(value)
        for _ in range(rnd.choice((0, 0, 0, 0, 0, 1, 2))):
            payload = mutate_bytes(rnd, payload)
        yield payload


def campaign(cases: int, seed: int) -> Counter[str]:
    """``cases`` payloads through every path; the outcomes counted (AssertionError on a disagreement)."""
    outcomes: Counter[str] = Counter()
    small = DecodeLimits(max_events=3, max_blocks=2, max_block_size=BLOCK, max_tokens=8)
    for n, payload in zip(range(cases), payloads(seed), strict=False):
        limits = small if n % 10 == 9 else DEFAULT_LIMITS
        try:
            outcomes[check(payload, limits)] += 1
        except AssertionError as exc:
            raise AssertionError(f"case {n} (seed {seed}), payload {payload.hex()}: {exc}") from None
    return outcomes
