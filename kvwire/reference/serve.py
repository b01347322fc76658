"""The reference engine server: N data-parallel ranks, each a paged KV cache publishing events.

    python -m kvwire.reference.serve --ranks 2 --port 5557 --replay-port 5657 --control-port 5757

Each rank has its own :class:`PagedKVCache`, :class:`EventCollector` and
:class:`EventPublisher` bound at ``port + rank`` (replay at ``replay_port +
rank``), like vLLM's data-parallel ranks. Every field of the publishers'
:class:`PublisherConfig` has a flag of its name (``--buffer-steps``,
``--heartbeat-s none``, ``--no-snapshot``...); an absent flag leaves the
field's default. Port 0 (the default) gives every
rank and the control socket an ephemeral port; once bound, the server prints
one line, :data:`READY_PREFIX` and the :class:`EngineEndpoints` as JSON, and
answers :class:`Endpoints` with the same. One engine thread runs everything:
it serves the control endpoint (see :mod:`kvwire.reference.control`) and,
when asked, drives itself with the seeded synthetic workload. Each command or
workload step is one scheduler iteration: one flush, at most one batch per rank.

Binds to 127.0.0.1 unless ``--host`` says otherwise (:mod:`kvwire.security` warns
beyond loopback). The control endpoint obeys whoever reaches it unless it has keys
(``--control-secret-key``, ``--control-allow-dir``: only CURVE clients on the
allow-list get in); commands are bounded as :mod:`kvwire.reference.control` says.
"""

from __future__ import annotations

import argparse
import logging
import signal
import sys
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, get_args

import msgspec
import zmq

from kvwire.publisher.collector import EventCollector
from kvwire.publisher.config import PublisherConfig
from kvwire.publisher.publisher import EventPublisher
from kvwire.reference.control import (
    MIN_DRIVE_RATE,
    Admitted,
    Command,
    Drive,
    Endpoints,
    EngineEndpoints,
    Envelope,
    Failed,
    Ok,
    Probe,
    Probed,
    RankBound,
    RankStats,
    Release,
    Reply,
    Reset,
    SetPublisher,
    Shutdown,
    Stats,
    StatsReply,
    Submit,
    Truth,
    TruthReply,
    command_decoder,
    encoder,
    envelope_decoder,
)
from kvwire.reference.paged_cache import CacheFullError, PagedKVCache
from kvwire.reference.workload import SyntheticWorkload, WorkloadConfig
from kvwire.security import ServerKeys, release_context, secure_server, warn_if_exposed
from kvwire.settings import convert_strings, describe
from kvwire.wire import validate_endpoints

__all__ = ["READY_PREFIX", "EngineConfig", "EngineServer", "main"]

log = logging.getLogger("kvwire.serve")

READY_PREFIX = "kvwire-engine-ready "
"""Starts the line a server prints on stdout once bound, followed by its endpoints as JSON."""


@dataclass(frozen=True)
class EngineConfig:
    """Everything an engine server is started with.

    Port 0 binds an ephemeral port (for every rank); ``replay_port=None``
    serves no replay. ``publisher``: every rank's publisher settings.
    """

    ranks: int = 1
    host: str = "127.0.0.1"
    port: int = 0
    replay_port: int | None = 0
    control_port: int = 0
    num_blocks: int = 256
    block_size: int = 16
    publisher: PublisherConfig = field(default_factory=PublisherConfig)
    device: str | None = None
    hash_seed: int = 0
    control_keys: ServerKeys | None = None
    """CURVE keys of the control endpoint; ``None``: anyone who reaches it may command."""

    @property
    def max_prompt_tokens(self) -> int:
        """The longest prompt a rank could ever cache; longer ones are refused unread."""
        return self.num_blocks * self.block_size

    @property
    def control_max_message(self) -> int:
        """The control socket's ``ZMQ_MAXMSGSIZE``: the longest prompt (9 bytes a token) and room."""
        return 65_536 + 9 * self.max_prompt_tokens

    def endpoint(self, port: int) -> str:
        """The bind address of ``port`` on this host (``*`` for port 0)."""
        return f"tcp://{self.host}:{port or '*'}"

    def argv(self) -> list[str]:
        """The ``python -m kvwire.reference.serve`` flags that start this configuration
        (a flag per field that differs from its default)."""
        flags: list[str] = []
        for f in fields(self):
            value = getattr(self, f.name)
            if f.name in ("publisher", "control_keys") or value == f.default:
                continue
            # (the one None that is not a default: replay_port's, no replay)
            flags += ["--no-replay"] if value is None else [_flag(f.name), str(value)]
        flags += _publisher_argv(self.publisher)
        if self.control_keys is not None:
            flags += [
                "--control-secret-key", str(self.control_keys.secret_key_file),
                "--control-allow-dir", str(self.control_keys.allow_dir),
            ]  # fmt: skip
        return flags


@dataclass
class _Rank:
    rank: int
    cache: PagedKVCache
    collector: EventCollector
    publisher: EventPublisher
    active: deque[str] = field(default_factory=deque)


class EngineServer:
    """The engine thread: control commands and the self-driven workload, one at a time."""

    def __init__(self, config: EngineConfig, context: zmq.Context[Any] | None = None) -> None:
        self.config = config
        self._ctx = context or zmq.Context.instance()
        self.ranks: list[_Rank] = []
        live = config.endpoint(config.port)
        replay = None if config.replay_port is None else config.endpoint(config.replay_port)
        validate_endpoints(live, replay, config.ranks)  # every rank's ports, before any binds
        for r in range(config.ranks):
            publisher = EventPublisher(live, replay, config.publisher, rank=r, context=self._ctx)
            collector = EventCollector(publisher, config.block_size)
            cache = PagedKVCache(
                config.num_blocks,
                config.block_size,
                collector,
                device=config.device,
                hash_seed=config.hash_seed,
            )
            self.ranks.append(_Rank(r, cache, collector, publisher))
        self._control: zmq.Socket[bytes] | None = None
        self._bound_control: str | None = None
        self._workload: SyntheticWorkload | None = None
        self._drive_interval = 0.0
        self._drive_hold = 8
        self._next_drive = 0.0
        self._drive_rank = 0
        self._running = False

    # --- commands ------------------------------------------------------------------

    def _rank(self, rank: int) -> _Rank:
        if not 0 <= rank < len(self.ranks):
            raise ValueError(f"rank {rank} is outside 0..{len(self.ranks) - 1}")
        return self.ranks[rank]

    def _check_prompt(self, token_ids: Sequence[int]) -> None:
        limit = self.config.max_prompt_tokens
        if len(token_ids) > limit:
            raise ValueError(
                f"{len(token_ids)} token ids exceed the {limit} this engine's cache can hold"
            )

    def admit(self, rank: int, request_id: str, token_ids: Sequence[int]) -> Admitted:
        """Admit a request, releasing this rank's oldest requests while out of blocks.

        A prompt longer than the whole cache is refused before any work.
        """
        r = self._rank(rank)
        self._check_prompt(token_ids)
        while True:
            try:
                result = r.cache.admit(request_id, token_ids)
                break
            except CacheFullError:
                if not r.active:
                    raise
                r.cache.release(r.active.popleft())
        r.active.append(request_id)
        r.collector.flush()
        return Admitted(result.prompt_blocks, result.cached_blocks)

    def release(self, rank: int, request_id: str) -> None:
        r = self._rank(rank)
        if request_id in r.active:
            r.active.remove(request_id)
            r.cache.release(request_id)
            r.collector.flush()

    def handle(self, command: Command) -> Reply:
        """Execute one control command as one scheduler iteration."""
        if isinstance(command, Submit):
            return self.admit(command.rank, command.request_id, command.token_ids)
        if isinstance(command, Release):
            self.release(command.rank, command.request_id)
            return Ok()
        if isinstance(command, Probe):
            self._check_prompt(command.token_ids)
            return Probed(self._rank(command.rank).cache.probe(command.token_ids))
        if isinstance(command, Reset):
            r = self._rank(command.rank)
            r.active.clear()
            r.cache.reset()
            r.collector.flush()
            return Ok()
        if isinstance(command, Truth):
            r = self._rank(command.rank)
            return TruthReply(sorted(r.cache.held_hashes()), r.publisher.last_seq)
        if isinstance(command, SetPublisher):
            publisher = self._rank(command.rank).publisher
            publisher.max_queue_size = command.max_queue_size
            if command.coalesce_s is not None:
                publisher.send_coalesce_s = command.coalesce_s
            return Ok()
        if isinstance(command, Drive):
            self.drive(command.rate, seed=command.seed, hold=command.hold)
            return Ok()
        if isinstance(command, Stats):
            return StatsReply([self._stats(r) for r in self.ranks])
        if isinstance(command, Shutdown):
            self.stop()
            return Ok()
        if isinstance(command, Endpoints):
            return self.endpoints()
        raise ValueError(f"unknown command {type(command).__name__}")

    def _stats(self, r: _Rank) -> RankStats:
        return RankStats(
            r.rank,
            r.cache.held_blocks,
            r.cache.free_blocks,
            r.cache.active_requests,
            r.publisher.stats().as_dict(),
        )

    # --- the self-driven workload ------------------------------------------------------

    def drive(self, rate: float, *, seed: int = 0, hold: int = 8) -> None:
        """Admit ``rate`` synthetic requests per second round-robin over ranks (0 stops).

        Each rank keeps its ``hold`` most recent requests active; older ones
        are released, so blocks become evictable and eviction happens. Values
        outside :class:`Drive`'s bounds, or a rate below ``MIN_DRIVE_RATE``
        (0 aside), raise ``ValueError`` and change nothing, however it is called.
        """
        try:
            msgspec.convert({"rate": rate, "seed": seed, "hold": hold}, Drive)
        except msgspec.ValidationError as exc:
            raise ValueError(f"drive rate {rate!r}, seed {seed}, hold {hold}: {exc}") from None
        if 0 < rate < MIN_DRIVE_RATE:
            raise ValueError(f"drive rate {rate!r} must be 0 or at least {MIN_DRIVE_RATE}")
        if rate == 0:
            self._workload = None
            return
        cfg = WorkloadConfig(seed=seed, block_size=self.config.block_size)
        self._workload = SyntheticWorkload(cfg)
        self._drive_interval = 1.0 / rate
        self._drive_hold = hold
        self._next_drive = time.monotonic()

    def step(self) -> None:
        """One self-driven iteration: admit the next request on the next rank."""
        if self._workload is None:
            return
        request = self._workload.next_request()
        r = self.ranks[self._drive_rank]
        self._drive_rank = (self._drive_rank + 1) % len(self.ranks)
        while len(r.active) >= self._drive_hold:
            r.cache.release(r.active.popleft())
        self.admit(r.rank, request.request_id, request.token_ids)

    # --- the loop ----------------------------------------------------------------------

    def start(self) -> None:
        """Bind every publisher and the control socket."""
        for r in self.ranks:
            r.publisher.start()
        sock: zmq.Socket[bytes] = self._ctx.socket(zmq.ROUTER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.MAXMSGSIZE, self.config.control_max_message)
        sock.setsockopt(zmq.RCVHWM, 1000)
        keys = self.config.control_keys
        if keys is not None:
            secure_server(sock, keys)
        address = self.config.endpoint(self.config.control_port)
        warn_if_exposed(log, address, "reference engine control endpoint", secured=keys is not None)
        sock.bind(address)
        self._bound_control = sock.getsockopt_string(zmq.LAST_ENDPOINT)
        self._control = sock
        self._running = True

    def endpoints(self) -> EngineEndpoints:
        """What every socket bound (ephemeral ports resolved); requires :meth:`start`."""
        if self._bound_control is None:
            raise RuntimeError("call start() first")
        return EngineEndpoints(
            self._bound_control,
            [
                RankBound(r.rank, r.publisher.bound_endpoint, r.publisher.bound_replay_endpoint)
                for r in self.ranks
            ],
        )

    def serve(self, until: float | None = None) -> None:
        """Run the engine loop until a Shutdown command, a signal or ``until`` (monotonic)."""
        sock = self._control
        if sock is None:
            raise RuntimeError("call start() first")
        poller = zmq.Poller()
        poller.register(sock, zmq.POLLIN)
        while self._running:
            now = time.monotonic()
            if until is not None and now >= until:
                break
            timeout = 200
            if self._workload is not None:
                timeout = max(0, int((self._next_drive - now) * 1000))
            if poller.poll(timeout):
                self._serve_one(sock)
            if self._workload is not None and time.monotonic() >= self._next_drive:
                try:
                    self.step()
                except CacheFullError as exc:  # a request larger than the cache: skip it
                    log.warning("self-driven request skipped: %s", exc)
                self._next_drive += self._drive_interval
                # Fall behind gracefully instead of bursting to catch up.
                self._next_drive = max(self._next_drive, time.monotonic() - self._drive_interval)

    def _serve_one(self, sock: zmq.Socket[bytes]) -> None:
        frames = sock.recv_multipart()
        ident = 0
        try:
            ident, body = envelope_decoder.decode(frames[-1])
            reply = self.handle(command_decoder.decode(body))
        except Exception as exc:  # a bad command is answered, never fatal
            log.warning("control command failed: %s", exc)
            reply = Failed(f"{type(exc).__name__}: {exc}")
        sock.send_multipart([*frames[:-1], encoder.encode(Envelope(ident, reply))])

    def stop(self) -> None:
        """Make :meth:`serve` return after the current iteration (signal-safe)."""
        self._running = False

    def close(self) -> None:
        """Flush and close every publisher, then the control socket."""
        self._running = False
        for r in self.ranks:
            r.publisher.close()
        if self._control is not None:
            self._control.close(0)
            self._control = None
            if self.config.control_keys is not None:
                release_context(self._ctx)


def _parse(argv: Sequence[str] | None) -> tuple[EngineConfig, argparse.Namespace]:
    p = argparse.ArgumentParser(
        prog="python -m kvwire.reference.serve", description="kvwire reference engine server"
    )
    # EngineConfig's fields: an absent flag leaves the field's default (not restated here).
    e = p.add_argument_group("the engine (EngineConfig)", argument_default=argparse.SUPPRESS)
    e.add_argument("--ranks", type=int)
    e.add_argument("--host", help="address to bind (default loopback only)")
    e.add_argument("--port", type=int, help="event PUB base port (rank r: port + r); 0: ephemeral")
    e.add_argument("--replay-port", type=int, help="replay ROUTER base port; 0: ephemeral")
    e.add_argument("--no-replay", dest="replay_port", action="store_const", const=None,
                   help="serve no replay")  # fmt: skip
    e.add_argument("--control-port", type=int, help="control ROUTER port; 0: ephemeral")
    e.add_argument("--num-blocks", type=int)
    e.add_argument("--block-size", type=int)
    e.add_argument("--device", help="torch device (default: cuda when available)")
    e.add_argument("--hash-seed", type=int)
    p.add_argument("--drive-rate", type=float, default=0.0, help="self-driven requests per second")
    p.add_argument("--drive-seed", type=int, default=0)
    p.add_argument("--drive-hold", type=int, default=8)
    p.add_argument("--duration", type=float, default=None, help="exit after this many seconds")
    p.add_argument("--control-secret-key", type=Path, default=None,
                   help="the control endpoint's CURVE secret key file (kvwire keygen)")
    p.add_argument("--control-allow-dir", type=Path, default=None,
                   help="directory of the public keys of clients allowed to control the engine")
    _add_publisher_flags(p)
    args = p.parse_args(argv)
    given = {f.name: getattr(args, f.name) for f in fields(EngineConfig) if hasattr(args, f.name)}
    config = EngineConfig(
        **given, publisher=_publisher_config(p, args), control_keys=_control_keys(p, args)
    )
    return config, args


_PUBLISHER_FIELDS = msgspec.structs.fields(PublisherConfig)


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def _add_publisher_flags(p: argparse.ArgumentParser) -> None:
    """One flag per :class:`PublisherConfig` field; absent, the field keeps its default."""
    group = p.add_argument_group("every rank's publisher (kvwire.publisher.PublisherConfig)")
    for f in _PUBLISHER_FIELDS:
        if f.type is bool:
            group.add_argument(
                _flag(f.name), action=argparse.BooleanOptionalAction, default=None,
                help=f"default: {'on' if f.default else 'off'}",
            )  # fmt: skip
        else:
            group.add_argument(
                _flag(f.name), default=None, metavar="VALUE",
                help=f"{describe(f.type, 'none')}; default: "
                + ("none" if f.default is None else repr(f.default)),
            )  # fmt: skip


def _publisher_config(p: argparse.ArgumentParser, args: argparse.Namespace) -> PublisherConfig:
    given: dict[str, object] = {}
    for f in _PUBLISHER_FIELDS:
        value = getattr(args, f.name)
        if value is None:
            continue
        none = type(None) in get_args(f.type) and str(value).lower() == "none"
        given[f.name] = None if none else value
    try:
        return convert_strings(PublisherConfig, given, _flag, "none")
    except ValueError as exc:
        p.error(str(exc))


def _publisher_argv(config: PublisherConfig) -> list[str]:
    """The flags that give ``config`` (its fields that differ from the defaults)."""
    flags: list[str] = []
    for f in _PUBLISHER_FIELDS:
        value = getattr(config, f.name)
        if value == f.default:
            continue
        if f.type is bool:
            flags.append(_flag(f.name) if value else "--no-" + _flag(f.name)[2:])
        else:
            flags += [_flag(f.name), "none" if value is None else str(value)]
    return flags


def _control_keys(p: argparse.ArgumentParser, args: argparse.Namespace) -> ServerKeys | None:
    if args.control_secret_key is None and args.control_allow_dir is None:
        return None
    if args.control_secret_key is None or args.control_allow_dir is None:
        p.error("--control-secret-key and --control-allow-dir go together")
    return ServerKeys(args.control_secret_key, args.control_allow_dir)


def main(argv: Sequence[str] | None = None) -> None:
    """Entry point of ``python -m kvwire.reference.serve``."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    config, args = _parse(argv)
    server = EngineServer(config)

    def _on_signal(signum: int, _frame: object) -> None:
        server.stop()

    signal.signal(signal.SIGTERM, _on_signal)
    signal.signal(signal.SIGINT, _on_signal)
    server.start()
    if args.drive_rate > 0:
        server.drive(args.drive_rate, seed=args.drive_seed, hold=args.drive_hold)
    bound = server.endpoints()
    log.info(
        "engine up: %d ranks, events %s, replay %s, control %s",
        config.ranks,
        [r.endpoint for r in bound.ranks],
        [r.replay_endpoint for r in bound.ranks],
        bound.control,
    )
    sys.stdout.write(READY_PREFIX + msgspec.json.encode(bound).decode() + "\n")
    sys.stdout.flush()
    until = None if args.duration is None else time.monotonic() + args.duration
    try:
        server.serve(until)
    finally:
        server.close()


if __name__ == "__main__":
    main()
