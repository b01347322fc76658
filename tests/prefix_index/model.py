"""A brute-force model of the prefix index: dicts of exact token contents, no hashing.

Each held engine hash carries its content identity: the namespace and the
exact tokens (and extra keys) of every block from the root, or a detached
identity rooted at the unknown parent. A prompt matches a rank up to the first
block whose identity no held hash of that rank has.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import msgspec

from kvwire.prefix_index import TierDepths, tier_of
from kvwire.wire import AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch

Ident = tuple[Any, ...]
MASK = (1 << 64) - 1


def _extra(e: Any) -> bytes | None:
    return None if e is None else msgspec.msgpack.encode(e)


@dataclass
class Entry:
    ident: Ident
    counts: list[int] = field(default_factory=lambda: [0, 0, 0])


class ModelIndex:
    def __init__(self, block_size: int, groups: tuple[int | None, ...] = (0, None)) -> None:
        self.block_size = block_size
        self.groups = groups
        self.ranks: dict[tuple[str, int], dict[int, Entry]] = {}
        self.orphan_stores = 0
        self.unknown_removals = 0
        self.ignored = 0
        self.malformed = 0

    # --- events ---
    def apply(self, worker: str, rank: int, batch: KVEventBatch) -> None:
        entries = self.ranks.setdefault((worker, rank), {})
        for ev in batch.events:
            if isinstance(ev, BlockStored):
                if ev.group_idx not in self.groups:
                    self.ignored += 1
                else:
                    self._store(entries, ev)
            elif isinstance(ev, BlockRemoved):
                if ev.group_idx not in self.groups:
                    self.ignored += 1
                else:
                    tier = tier_of(ev.medium)
                    for h in ev.block_hashes:
                        e = entries.get(h & MASK)
                        if e is None or e.counts[tier] == 0:
                            self.unknown_removals += 1
                            continue
                        e.counts[tier] -= 1
                        if not any(e.counts):
                            del entries[h & MASK]
            elif isinstance(ev, AllBlocksCleared):
                entries.clear()

    def _store(self, entries: dict[int, Entry], ev: BlockStored) -> None:
        n = len(ev.block_hashes)
        if n == 0:
            return
        bs = ev.block_size
        parent = ev.parent_block_hash
        if parent is None:
            base: Ident = ("root", ev.lora_name, _extra(ev.cache_salt))
        elif (parent & MASK) in entries:
            base = entries[parent & MASK].ident
        else:
            self.orphan_stores += 1
            base = ("detached", parent & MASK)
        ok = bs >= 1 and len(ev.token_ids) == n * bs
        if ok and ev.extra_keys is not None and len(ev.extra_keys) < n:
            ok = False
        tier = tier_of(ev.medium)
        for i, h in enumerate(ev.block_hashes):
            h &= MASK
            if ok:
                extra = _extra(ev.extra_keys[i]) if ev.extra_keys is not None else None
                base = (base, tuple(ev.token_ids[i * bs : (i + 1) * bs]), extra)
            else:
                base = ("malformed", h)
            e = entries.get(h)
            if e is None:
                e = entries[h] = Entry(base)
            e.counts[tier] += 1
        if not ok:
            self.malformed += 1

    def clear(self, worker: str, rank: int) -> None:
        if (worker, rank) in self.ranks:
            self.ranks[(worker, rank)].clear()

    def remove_worker(self, worker: str) -> None:
        for key in [k for k in self.ranks if k[0] == worker]:
            del self.ranks[key]

    # --- queries ---
    def prompt_idents(
        self, tokens: list[int], lora_name: str | None, extra_keys: list[Any] | None,
        cache_salt: Any,
    ) -> list[Ident]:
        bs = self.block_size
        base: Ident = ("root", lora_name, _extra(cache_salt))
        out = []
        for i in range(len(tokens) // bs):
            extra = _extra(extra_keys[i]) if extra_keys is not None else None
            base = (base, tuple(tokens[i * bs : (i + 1) * bs]), extra)
            out.append(base)
        return out

    def match_tiers(
        self, tokens: list[int], lora_name: str | None = None,
        extra_keys: list[Any] | None = None, cache_salt: Any = None,
    ) -> dict[tuple[str, int], TierDepths]:
        idents = self.prompt_idents(tokens, lora_name, extra_keys, cache_salt)
        out = {}
        for name, entries in self.ranks.items():
            held: dict[Ident, list[int]] = {}
            for e in entries.values():
                c = held.setdefault(e.ident, [0, 0, 0])
                for t in range(3):
                    c[t] += e.counts[t]

            def depth(tiers: tuple[int, ...], held: dict[Ident, list[int]] = held) -> int:
                d = 0
                for ident in idents:
                    c = held.get(ident)
                    if c is None or not any(c[t] for t in tiers):
                        break
                    d += 1
                return d

            total = depth((0, 1, 2))
            if total:
                g = depth((0,))
                f = depth((0, 1))
                out[name] = TierDepths(g, f - g, total - f)
        return out

    def match(self, tokens: list[int], **kw: Any) -> dict[tuple[str, int], int]:
        return {k: v.total for k, v in self.match_tiers(tokens, **kw).items()}

    def blocks(self, worker: str, rank: int) -> set[int]:
        return set(self.ranks.get((worker, rank), {}))

    def holders(self) -> int:
        return sum(len(e) for e in self.ranks.values())

    def distinct_blocks(self) -> int:
        return len({e.ident for es in self.ranks.values() for e in es.values()})

    def detached(self) -> int:
        def is_detached(ident: Ident) -> bool:
            while ident and isinstance(ident[0], tuple):
                ident = ident[0]
            return ident[0] != "root"

        return sum(is_detached(e.ident) for es in self.ranks.values() for e in es.values())
