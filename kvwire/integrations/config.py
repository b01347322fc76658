"""The ``KVWIRE_*`` environment variables the engine integrations read.

vLLM and SGLang create their publisher from their own ``--kv-events-config``
(endpoints, buffer, queue, topic), and vLLM's config accepts no new fields, so
everything kvwire adds comes from the environment:

=============================  =========  ==================================================
variable                       default    meaning
=============================  =========  ==================================================
``KVWIRE_PUBLISHER``           unset      ``1``: the vLLM / SGLang plugins put kvwire's
                                          publisher in place of the engine's ``"zmq"`` one
                                          (and register ``"kvwire"``). Anything else: the
                                          plugins do nothing.
``KVWIRE_EXPOSE``              unset      ``1``: bind wildcard hosts (``tcp://*:5557``) as
                                          configured, with a warning. Unset: bind loopback
                                          instead (events carry prompt token ids).
``KVWIRE_COALESCE_MS``         ``2``      how long the sender waits after a wake-up so the
                                          engine thread keeps the GIL (0: send at once).
``KVWIRE_MAX_REPLAY_BATCHES``  buffer     batches one replay request is answered with
                                          (default: the whole replay buffer, as the engines
                                          do).
``KVWIRE_EPOCH``               unset      ``1``: an epoch id on every topic frame, so
                                          subscribers tell a restart from a gap (changes the
                                          topic frame).
``KVWIRE_HEARTBEAT_S``         unset      heartbeat interval (s): an empty batch on the
                                          wall-clock grid of it (of half of it right after
                                          a batch) when nothing went out meanwhile, so a
                                          trailing loss shows (adds messages;
                                          ``kvwire.wire.heartbeat``).
``KVWIRE_SECRET_KEY``          unset      the publisher's CURVE ``.key_secret`` file
                                          (``kvwire keygen``); with ``KVWIRE_ALLOW_DIR``, only
                                          clients whose public key is in that directory read
                                          the events (add or remove files to rotate keys).
``KVWIRE_ALLOW_DIR``           unset      the directory of allowed client public keys.
``KVWIRE_ENDPOINT``            loopback   TensorRT-LLM relay: base PUB endpoint
                                          (rank ``r`` binds port + ``r``),
                                          ``tcp://127.0.0.1:5557``.
``KVWIRE_REPLAY_ENDPOINT``     unset      TensorRT-LLM relay: base replay endpoint.
``KVWIRE_BLOCK_SIZE``          ``32``     TensorRT-LLM relay: ``tokens_per_block``.
``KVWIRE_BUFFER_STEPS``        ``10000``  TensorRT-LLM relay: batches kept for replay.
``KVWIRE_MAX_QUEUE_SIZE``      ``100000`` TensorRT-LLM relay: batches waiting to be sent.
``KVWIRE_HWM``                 ``100000`` TensorRT-LLM relay: PUB send high-water mark.
``KVWIRE_TOPIC``               empty      TensorRT-LLM relay: topic.
=============================  =========  ==================================================

Everything kvwire adds that would change the bytes on the wire stays off
unless a variable turns it on, so existing consumers of vLLM's and SGLang's
streams keep reading exactly what the engines' own publishers send.
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvwire.security import ServerKeys

__all__ = ["IntegrationConfig", "bind_address"]

_WILDCARDS = {"*": "127.0.0.1", "0.0.0.0": "127.0.0.1", "::": "[::1]", "[::]": "[::1]"}


def _int(env: Mapping[str, str], name: str, default: int, minimum: int) -> int:
    raw = env.get(name)
    if raw is None or raw == "":
        return default
    try:
        value = int(raw)
    except ValueError:
        raise ValueError(f"{name}={raw!r} is not an integer") from None
    if value < minimum:
        raise ValueError(f"{name}={value} must be >= {minimum}")
    return value


def _seconds(env: Mapping[str, str], name: str) -> float | None:
    raw = env.get(name)
    if raw is None or raw == "":
        return None
    try:
        value = float(raw)
    except ValueError:
        raise ValueError(f"{name}={raw!r} is not a number of seconds") from None
    if not math.isfinite(value) or value <= 0:
        raise ValueError(f"{name}={value} must be a positive number of seconds")
    return value


def _flag(env: Mapping[str, str], name: str) -> bool:
    return env.get(name, "").strip().lower() in ("1", "true", "yes", "on")


@dataclass(frozen=True)
class IntegrationConfig:
    """kvwire's settings inside an engine, read once from the environment."""

    enabled: bool = False
    expose: bool = False
    coalesce_ms: int = 2
    max_replay_batches: int | None = None
    epoch: bool = False
    heartbeat_s: float | None = None
    server_keys: ServerKeys | None = None
    endpoint: str = "tcp://127.0.0.1:5557"
    replay_endpoint: str | None = None
    block_size: int = 32
    buffer_steps: int = 10_000
    max_queue_size: int = 100_000
    hwm: int = 100_000
    topic: str = ""

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> IntegrationConfig:
        """Read the ``KVWIRE_*`` variables; a malformed value raises ``ValueError`` naming it."""
        env = os.environ if env is None else env
        replay_max = env.get("KVWIRE_MAX_REPLAY_BATCHES")
        secret, allow = env.get("KVWIRE_SECRET_KEY"), env.get("KVWIRE_ALLOW_DIR")
        if bool(secret) != bool(allow):
            raise ValueError("KVWIRE_SECRET_KEY and KVWIRE_ALLOW_DIR go together")
        return cls(
            enabled=_flag(env, "KVWIRE_PUBLISHER"),
            expose=_flag(env, "KVWIRE_EXPOSE"),
            coalesce_ms=_int(env, "KVWIRE_COALESCE_MS", 2, 0),
            max_replay_batches=(
                _int(env, "KVWIRE_MAX_REPLAY_BATCHES", 1, 1) if replay_max else None
            ),
            epoch=_flag(env, "KVWIRE_EPOCH"),
            heartbeat_s=_seconds(env, "KVWIRE_HEARTBEAT_S"),
            server_keys=ServerKeys(Path(secret), Path(allow)) if secret and allow else None,
            endpoint=env.get("KVWIRE_ENDPOINT") or cls.endpoint,
            replay_endpoint=env.get("KVWIRE_REPLAY_ENDPOINT") or None,
            block_size=_int(env, "KVWIRE_BLOCK_SIZE", 32, 1),
            buffer_steps=_int(env, "KVWIRE_BUFFER_STEPS", 10_000, 1),
            max_queue_size=_int(env, "KVWIRE_MAX_QUEUE_SIZE", 100_000, 1),
            hwm=_int(env, "KVWIRE_HWM", 100_000, 1),
            topic=env.get("KVWIRE_TOPIC", ""),
        )

    def publisher_options(self, buffer_steps: int) -> dict[str, Any]:
        """kvwire-only keywords for :class:`~kvwire.publisher.EventPublisher`.

        Features the environment did not ask for are passed switched off, so
        the wire carries the engines' own bytes.
        """
        return {
            "coalesce_s": self.coalesce_ms / 1000,
            "max_replay_batches": self.max_replay_batches or buffer_steps,
            "epoch": self.epoch,
            "heartbeat": self.heartbeat_s,
            "snapshot": False,
            "server_keys": self.server_keys,
        }


def bind_address(endpoint: str, config: IntegrationConfig) -> str:
    """Where kvwire binds an engine's configured endpoint.

    A wildcard host becomes loopback unless ``KVWIRE_EXPOSE=1``; tcp port 0
    (the engines' "any port") becomes ``*``.
    """
    if not endpoint.startswith("tcp://"):
        return endpoint
    host, _, port = endpoint[len("tcp://") :].rpartition(":")
    if port == "0":
        port = "*"
    if not config.expose:
        host = _WILDCARDS.get(host, host)
    return f"tcp://{host}:{port}"
