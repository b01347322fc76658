"""The ``KVWIRE_*`` environment variables the engine integrations read.

vLLM and SGLang create their publisher from their own ``--kv-events-config``
(endpoints, buffer, queue, topic), and vLLM's config accepts no new fields, so
everything kvwire adds comes from the environment. The variables, their
defaults and what each means are listed once, in ``docs/engines.md``
(Settings). Each is a field of :class:`IntegrationConfig` (the plugins) or
:class:`RelayConfig` (the TensorRT-LLM relay only), with the ranges of
:class:`~kvwire.publisher.PublisherConfig`'s, read by
:func:`kvwire.settings.read_env`.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Annotated, Any, Self

import msgspec
from msgspec import Meta

from kvwire.publisher.config import (
    MAX_SEND_COALESCE_S,
    HeartbeatSeconds,
    Hwm,
    Positive,
    PublisherConfig,
)
from kvwire.publisher.publisher import DEFAULT_ENDPOINT
from kvwire.security import ServerKeys
from kvwire.settings import read_env
from kvwire.wire import local_endpoint

__all__ = [
    "IntegrationConfig", "RelayConfig", "bind_address", "bind_addresses", "plugin_enabled",
]  # fmt: skip

log = logging.getLogger(__name__)

def _variable(field: str) -> str:
    """The environment variable of a setting."""
    return "KVWIRE_PUBLISHER" if field == "enabled" else f"KVWIRE_{field.upper()}"


class _Switch(msgspec.Struct, frozen=True, kw_only=True, rename=_variable):
    enabled: bool = False


class IntegrationConfig(_Switch, frozen=True, kw_only=True, rename=_variable):
    """kvwire's settings inside vLLM and SGLang, one field per ``KVWIRE_*`` variable.

    ``enabled`` is ``KVWIRE_PUBLISHER``; a plugin reads it alone
    (:func:`plugin_enabled`) and everything else only when it is on. Unset
    settings (``None``) take :class:`~kvwire.publisher.PublisherConfig`'s
    defaults; kvwire's additions (epoch, heartbeats) stay off unless asked
    for, and snapshots are not served, so the wire carries the engine's bytes.
    """

    expose: bool = False
    coalesce_ms: Annotated[int, Meta(ge=0, le=MAX_SEND_COALESCE_S * 1000)] | None = None
    max_replay_batches: Positive | None = None
    epoch: bool = False
    heartbeat_s: HeartbeatSeconds | None = None
    secret_key: str | None = None
    allow_dir: str | None = None

    def __post_init__(self) -> None:
        if (self.secret_key is None) != (self.allow_dir is None):
            given, missing = ("SECRET_KEY", "ALLOW_DIR")[:: 1 if self.allow_dir is None else -1]
            raise ValueError(
                f"KVWIRE_SECRET_KEY and KVWIRE_ALLOW_DIR go together: KVWIRE_{given} is set "
                f"and KVWIRE_{missing} is not"
            )

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> Self:
        """Read the variables (``os.environ`` by default); a bad value raises ``ValueError``
        naming the variable, its value and what is allowed, and so does a key file that
        cannot be read."""
        config = read_env(cls, os.environ if env is None else env)
        config.server_keys()
        return config

    @property
    def keyed(self) -> bool:
        """Whether CURVE keys guard the publisher's sockets (``KVWIRE_SECRET_KEY``, which
        comes with ``KVWIRE_ALLOW_DIR``): then the keys, not the bind address, decide
        who reads, and a wildcard host is bound as configured."""
        return self.secret_key is not None

    def server_keys(self) -> ServerKeys | None:
        """The publisher's CURVE keys, loaded from ``KVWIRE_SECRET_KEY`` and
        ``KVWIRE_ALLOW_DIR`` (``None`` without them)."""
        if self.secret_key is None or self.allow_dir is None:
            return None
        try:
            return ServerKeys(Path(self.secret_key), Path(self.allow_dir))
        except ValueError as exc:
            raise ValueError(
                f"KVWIRE_SECRET_KEY={self.secret_key!r} with KVWIRE_ALLOW_DIR="
                f"{self.allow_dir!r} is refused: {exc}"
            ) from None

    def publisher_config(
        self,
        buffer_steps: int | None = None,
        hwm: int | None = None,
        max_queue_size: int | None = None,
        topic: str | None = None,
    ) -> PublisherConfig:
        """The publisher's settings: the engine's own (``None``: not given) and what the
        variables add. What is not given is the relay's own setting (:class:`RelayConfig`)
        or the publisher's default; what the variables do not ask for is off, so the wire
        carries the engine's own bytes."""
        own = msgspec.structs.asdict(self)
        engine = {"buffer_steps": buffer_steps, "hwm": hwm, "max_queue_size": max_queue_size,
                  "topic": topic}  # fmt: skip
        given: dict[str, Any] = {k: own.get(k) if v is None else v for k, v in engine.items()}
        if self.coalesce_ms is not None:
            given["send_coalesce_s"] = self.coalesce_ms / 1000
        return PublisherConfig(
            max_replay_batches=self.max_replay_batches,
            epoch=self.epoch,
            heartbeat_s=self.heartbeat_s,
            snapshot=False,
            **{name: value for name, value in given.items() if value is not None},
        )


class RelayConfig(IntegrationConfig, frozen=True, kw_only=True, rename=_variable):
    """The TensorRT-LLM relay's settings: the plugins' and what the engine's own
    configuration would give (the relay has none to read), from ``KVWIRE_*``
    variables only the relay reads. ``enabled`` does not apply to the relay."""

    endpoint: str = DEFAULT_ENDPOINT
    replay_endpoint: str | None = None
    block_size: Positive = 32
    buffer_steps: Positive | None = None
    max_queue_size: Positive | None = None
    hwm: Hwm | None = None
    topic: str = ""


def plugin_enabled(engine: str, env: Mapping[str, str] | None = None) -> bool:
    """Whether ``KVWIRE_PUBLISHER`` turns an engine plugin on; reads no other variable.

    Never raises: an engine calls its plugins without a guard (vLLM 0.33's
    ``load_general_plugins``), and the plugins promise to change nothing until
    asked. A value that is neither on nor off is logged as an error, naming
    the variable, and leaves the plugin off.
    """
    try:
        return read_env(_Switch, os.environ if env is None else env).enabled
    except ValueError as exc:
        log.error("kvwire's %s plugin stays off: %s", engine, exc)
        return False


def bind_address(endpoint: str, config: IntegrationConfig) -> str:
    """Where kvwire binds an engine's configured endpoint.

    A wildcard host becomes loopback unless ``KVWIRE_EXPOSE=1`` or CURVE keys
    guard the socket (:attr:`IntegrationConfig.keyed`: the keys decide who
    reads); tcp port 0 (the engines' "any port") becomes ``*``.
    """
    if not endpoint.startswith("tcp://"):
        return endpoint
    if endpoint.endswith(":0"):
        endpoint = endpoint[:-1] + "*"
    return endpoint if config.expose or config.keyed else local_endpoint(endpoint)


def bind_addresses(
    endpoint: str, replay_endpoint: str | None, config: IntegrationConfig
) -> tuple[str, str | None]:
    """:func:`bind_address` of an engine's live and replay endpoints, and the log line
    that says why when a wildcard is narrowed or kept.

    Narrowed to loopback: a warning naming ``KVWIRE_EXPOSE``. Kept because
    keys are set: one line naming the endpoints and that CURVE keys guard them
    (the publisher still warns, per socket, that it is reachable beyond this host).
    """
    pub = bind_address(endpoint, config)
    replay = None if replay_endpoint is None else bind_address(replay_endpoint, config)
    given = [e for e in (endpoint, replay_endpoint) if e is not None]
    if all(local_endpoint(e) == e for e in given):  # no wildcard host
        return pub, replay
    if config.keyed:
        log.info(
            "kvwire binds %s (replay %s) as configured: CURVE keys (KVWIRE_SECRET_KEY) guard "
            "it, only clients whose public key is in KVWIRE_ALLOW_DIR=%s read the events",
            pub, replay, config.allow_dir,
        )  # fmt: skip
    elif not config.expose:
        log.warning(
            "kvwire binds %s (replay %s) for the configured %s (replay %s): KV events "
            "carry prompt token ids; set KVWIRE_EXPOSE=1 to bind as configured, or give "
            "CURVE keys (KVWIRE_SECRET_KEY, KVWIRE_ALLOW_DIR)",
            pub, replay, endpoint, replay_endpoint,
        )  # fmt: skip
    return pub, replay
