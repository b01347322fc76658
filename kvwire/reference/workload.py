"""A seeded synthetic request stream shaped like chat traffic.

Shared system prompts, multi-turn conversations whose every prompt extends
the previous one, and one-off prompts. The same seed always yields the same
stream, so routing policies can be compared on identical traffic and engines
can drive themselves reproducibly.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

__all__ = ["SyntheticWorkload", "WorkloadConfig", "WorkloadRequest"]


@dataclass(frozen=True)
class WorkloadConfig:
    """Shape of the stream. Sizes are in tokens unless named ``*_blocks``."""

    seed: int = 0
    block_size: int = 16
    vocab_size: int = 32_000
    system_prompts: int = 6
    system_prompt_blocks: int = 12
    live_conversations: int = 24
    max_turns: int = 8
    user_turn_tokens: tuple[int, int] = (16, 96)
    reply_tokens: tuple[int, int] = (16, 64)
    oneoff_share: float = 0.15
    oneoff_tokens: tuple[int, int] = (32, 160)


@dataclass(frozen=True)
class WorkloadRequest:
    """One prompt to prefill."""

    request_id: str
    token_ids: list[int]


@dataclass
class _Conversation:
    tokens: list[int]
    turns: int = 0


@dataclass
class SyntheticWorkload:
    """``next_request()`` gives the stream's requests one at a time."""

    config: WorkloadConfig = field(default_factory=WorkloadConfig)

    def __post_init__(self) -> None:
        cfg = self.config
        self._rng = random.Random(cfg.seed)
        self._systems = [
            self._tokens(cfg.system_prompt_blocks * cfg.block_size)
            for _ in range(cfg.system_prompts)
        ]
        self._live: list[_Conversation] = []
        self._count = 0

    def _tokens(self, n: int) -> list[int]:
        rand = self._rng.randrange
        vocab = self.config.vocab_size
        return [rand(vocab) for _ in range(n)]

    def _span(self, bounds: tuple[int, int]) -> int:
        return self._rng.randint(bounds[0], bounds[1])

    def _new_conversation(self) -> _Conversation:
        # A few system prompts are far more popular than the rest (Zipf-like).
        weights = [1.0 / (i + 1) for i in range(len(self._systems))]
        system = self._rng.choices(self._systems, weights)[0]
        return _Conversation(list(system))

    def next_request(self) -> WorkloadRequest:
        """The next prompt of the stream."""
        cfg = self.config
        self._count += 1
        rid = f"r{cfg.seed}-{self._count}"
        if self._rng.random() < cfg.oneoff_share:
            return WorkloadRequest(rid, self._tokens(self._span(cfg.oneoff_tokens)))
        while len(self._live) < cfg.live_conversations:
            self._live.append(self._new_conversation())
        conv = self._rng.choice(self._live)
        if conv.turns:
            conv.tokens.extend(self._tokens(self._span(cfg.reply_tokens)))
        conv.tokens.extend(self._tokens(self._span(cfg.user_turn_tokens)))
        conv.turns += 1
        request = WorkloadRequest(rid, list(conv.tokens))
        if conv.turns >= cfg.max_turns:
            self._live.remove(conv)
        return request
