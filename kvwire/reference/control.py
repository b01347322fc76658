"""The reference engine server's control protocol: typed messages and a client.

One request, one reply, msgpack over a ZeroMQ ROUTER (server) / DEALER
(client). Each request carries an id so a reply that arrives after its
caller gave up (an engine paused mid-call) is recognised and dropped.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable
from typing import Any, TypeAlias, TypeVar

import msgspec
import zmq

__all__ = [
    "Admitted",
    "ControlClient",
    "ControlError",
    "Drive",
    "Endpoints",
    "EngineEndpoints",
    "Ok",
    "Probe",
    "Probed",
    "RankBound",
    "RankStats",
    "Release",
    "Reset",
    "SetPublisher",
    "Shutdown",
    "Stats",
    "StatsReply",
    "Submit",
    "Truth",
    "TruthReply",
]


class Submit(msgspec.Struct, tag=True):
    """Admit a request: reuse its cached prefix, prefill and cache the rest."""

    rank: int
    request_id: str
    token_ids: list[int]


class Release(msgspec.Struct, tag=True):
    """The request finished: its blocks become evictable."""

    rank: int
    request_id: str


class Probe(msgspec.Struct, tag=True):
    """How many leading full blocks of ``token_ids`` the rank holds (no side effects)."""

    rank: int
    token_ids: list[int]


class Reset(msgspec.Struct, tag=True):
    """Drop the rank's whole prefix cache (publishes AllBlocksCleared)."""

    rank: int


class Truth(msgspec.Struct, tag=True):
    """The block hashes the rank holds, and the seq of its last published batch."""

    rank: int


class SetPublisher(msgspec.Struct, tag=True):
    """Change a rank's publisher at run time (fault tests shrink the queue)."""

    rank: int
    max_queue_size: int


class Drive(msgspec.Struct, tag=True):
    """Start (``rate > 0``) or stop (``rate == 0``) the seeded synthetic workload."""

    rate: float
    seed: int = 0
    hold: int = 8


class Stats(msgspec.Struct, tag=True):
    """Per-rank cache and publisher figures."""


class Shutdown(msgspec.Struct, tag=True):
    """Close the publishers (flushing them) and exit."""


class Endpoints(msgspec.Struct, tag=True):
    """Where every rank and the control socket are bound."""


Command: TypeAlias = (
    Submit | Release | Probe | Reset | Truth | SetPublisher | Drive | Stats | Shutdown | Endpoints
)


class Ok(msgspec.Struct, tag=True):
    pass


class Failed(msgspec.Struct, tag=True):
    error: str


class Admitted(msgspec.Struct, tag=True):
    prompt_blocks: int
    cached_blocks: int


class Probed(msgspec.Struct, tag=True):
    cached_blocks: int


class TruthReply(msgspec.Struct, tag=True):
    hashes: list[int]
    last_seq: int
    """The seq of the rank's last published batch; -1 before the first."""


class RankStats(msgspec.Struct):
    rank: int
    blocks_held: int
    blocks_free: int
    active_requests: int
    publisher: dict[str, int]


class StatsReply(msgspec.Struct, tag=True):
    ranks: list[RankStats]


class RankBound(msgspec.Struct):
    """The endpoints one rank's publisher bound (ephemeral ports resolved)."""

    rank: int
    endpoint: str
    replay_endpoint: str | None


class EngineEndpoints(msgspec.Struct, tag=True):
    """Every bound endpoint of an engine server: its ready line and its Endpoints reply."""

    control: str
    ranks: list[RankBound]


Reply: TypeAlias = Ok | Failed | Admitted | Probed | TruthReply | StatsReply | EngineEndpoints


class Envelope(msgspec.Struct, array_like=True):
    """``[request_id, body]`` on the wire, both ways."""

    ident: int
    body: Any


request_decoder = msgspec.msgpack.Decoder(tuple[int, Command])
reply_decoder = msgspec.msgpack.Decoder(tuple[int, Reply])
_R = TypeVar("_R")


def _expect(reply: Reply, cls: type[_R]) -> _R:
    if not isinstance(reply, cls):
        raise ControlError(f"expected {cls.__name__}, got {type(reply).__name__}")
    return reply


encoder = msgspec.msgpack.Encoder()


class ControlError(RuntimeError):
    """The engine refused a command, or did not answer before the deadline."""


class ControlClient:
    """Blocking client for one engine server's control endpoint."""

    def __init__(
        self, endpoint: str, *, timeout: float = 5.0, context: zmq.Context[Any] | None = None
    ):
        self.endpoint = endpoint
        self.timeout = timeout
        self._ctx = context or zmq.Context.instance()
        self._ids = itertools.count(1)
        self._sock = self._connect()

    def _connect(self) -> zmq.Socket[bytes]:
        sock: zmq.Socket[bytes] = self._ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(self.endpoint)
        return sock

    def call(self, command: Command, *, timeout: float | None = None) -> Reply:
        """Send ``command`` and wait for its reply; raises :class:`ControlError`."""
        ident = next(self._ids)
        self._sock.send_multipart([b"", encoder.encode((ident, command))])
        deadline_ms = int(1000 * (self.timeout if timeout is None else timeout))
        poller = zmq.Poller()
        poller.register(self._sock, zmq.POLLIN)
        end = time.monotonic() + deadline_ms / 1000
        while True:
            left = end - time.monotonic()
            if left <= 0 or not poller.poll(int(left * 1000) + 1):
                raise ControlError(
                    f"{type(command).__name__} to {self.endpoint} got no reply within "
                    f"{deadline_ms / 1000:.1f} s"
                )
            frames = self._sock.recv_multipart()
            got, reply = reply_decoder.decode(frames[-1])
            if got != ident:
                continue  # a late answer to a call that already timed out
            if isinstance(reply, Failed):
                raise ControlError(f"{type(command).__name__} failed: {reply.error}")
            return reply

    def wait_ready(self, timeout: float = 60.0, *, alive: Callable[[], bool] | None = None) -> None:
        """Poll until the engine answers (it may still be starting).

        ``alive`` (e.g. a process check) stops the wait early when it says no.
        """
        deadline = time.monotonic() + timeout
        while True:
            if alive is not None and not alive():
                raise ControlError(f"the engine at {self.endpoint} exited before it answered")
            try:
                self.call(Stats(), timeout=min(1.0, max(deadline - time.monotonic(), 0.01)))
                return
            except ControlError:
                if time.monotonic() >= deadline:
                    raise

    def submit(self, rank: int, request_id: str, token_ids: list[int]) -> Admitted:
        return _expect(self.call(Submit(rank, request_id, list(token_ids))), Admitted)

    def release(self, rank: int, request_id: str) -> None:
        self.call(Release(rank, request_id))

    def probe(self, rank: int, token_ids: list[int]) -> int:
        return _expect(self.call(Probe(rank, list(token_ids))), Probed).cached_blocks

    def reset(self, rank: int) -> None:
        self.call(Reset(rank))

    def truth(self, rank: int) -> TruthReply:
        return _expect(self.call(Truth(rank)), TruthReply)

    def set_publisher(self, rank: int, *, max_queue_size: int) -> None:
        self.call(SetPublisher(rank, max_queue_size))

    def drive(self, rate: float, *, seed: int = 0, hold: int = 8) -> None:
        self.call(Drive(rate, seed, hold))

    def stats(self) -> StatsReply:
        return _expect(self.call(Stats()), StatsReply)

    def shutdown(self) -> None:
        self.call(Shutdown())

    def endpoints(self) -> EngineEndpoints:
        return _expect(self.call(Endpoints()), EngineEndpoints)

    def close(self) -> None:
        self._sock.close(0)

    def __enter__(self) -> ControlClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
