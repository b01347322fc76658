"""The reference engine server's control protocol: typed messages and a client.

One request, one reply, msgpack over a ZeroMQ ROUTER (server) / DEALER
(client). Each request carries an id so a reply that arrives after its
caller gave up (an engine paused mid-call) is recognised and dropped.

Every field is bounded where it is declared: a command outside the bounds
(a NaN rate, a negative rank, a ten-million-token prompt) fails to decode and
is answered with :class:`Failed`, before the engine does any work. The
server adds the bounds that depend on its configuration (ranks, cache size)
and, with keys, admits only CURVE clients on its allow-list.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable
from typing import Annotated, Any, TypeAlias, TypeVar

import msgspec
import zmq

from kvwire.security import ClientKeys, secure_client

__all__ = [
    "MAX_DRIVE_RATE",
    "MAX_PROMPT_TOKENS",
    "MIN_DRIVE_RATE",
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


MAX_PROMPT_TOKENS = 1 << 20
"""The most token ids one command may carry (the server's cache usually allows far fewer)."""
MAX_DRIVE_RATE = 10_000.0
"""Self-driven requests per second, at most."""
MIN_DRIVE_RATE = 0.001
"""The slowest self-driven workload (one request in about 17 minutes); 0 stops it."""

Rank = Annotated[int, msgspec.Meta(ge=0, le=65_535)]
RequestId = Annotated[str, msgspec.Meta(min_length=1, max_length=256)]
TokenIds = Annotated[
    list[Annotated[int, msgspec.Meta(ge=0, le=0xFFFF_FFFF)]], msgspec.Meta(max_length=MAX_PROMPT_TOKENS)
]


class Submit(msgspec.Struct, tag=True):
    """Admit a request: reuse its cached prefix, prefill and cache the rest."""

    rank: Rank
    request_id: RequestId
    token_ids: TokenIds


class Release(msgspec.Struct, tag=True):
    """The request finished: its blocks become evictable."""

    rank: Rank
    request_id: RequestId


class Probe(msgspec.Struct, tag=True):
    """How many leading full blocks of ``token_ids`` the rank holds (no side effects)."""

    rank: Rank
    token_ids: TokenIds


class Reset(msgspec.Struct, tag=True):
    """Drop the rank's whole prefix cache (publishes AllBlocksCleared)."""

    rank: Rank


class Truth(msgspec.Struct, tag=True):
    """The block hashes the rank holds, and the seq of its last published batch."""

    rank: Rank


class SetPublisher(msgspec.Struct, tag=True):
    """Change a rank's publisher at run time (fault tests shrink the queue, slow the sender).

    ``coalesce_s``: how long the sender waits after a wake-up; ``None`` leaves it.
    """

    rank: Rank
    max_queue_size: Annotated[int, msgspec.Meta(ge=1, le=10_000_000)]
    coalesce_s: Annotated[float, msgspec.Meta(ge=0.0, le=1.0)] | None = None


class Drive(msgspec.Struct, tag=True):
    """Start (``rate > 0``, at least :data:`MIN_DRIVE_RATE`) or stop (``rate == 0``) the workload."""

    rate: Annotated[float, msgspec.Meta(ge=0.0, le=MAX_DRIVE_RATE)]
    seed: Annotated[int, msgspec.Meta(ge=0, le=(1 << 63) - 1)] = 0
    hold: Annotated[int, msgspec.Meta(ge=1, le=100_000)] = 8


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


envelope_decoder = msgspec.msgpack.Decoder(tuple[int, msgspec.Raw])
"""A request's id, read first so that even a refused command is answered to its caller."""
command_decoder = msgspec.msgpack.Decoder(Command)
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
        self,
        endpoint: str,
        *,
        timeout: float = 5.0,
        context: zmq.Context[Any] | None = None,
        keys: ClientKeys | None = None,
    ):
        """``keys``: the server's public key and this client's key pair, for a CURVE server."""
        self.endpoint = endpoint
        self.timeout = timeout
        self.keys = keys
        self._ctx = context or zmq.Context.instance()
        self._ids = itertools.count(1)
        self._sock: zmq.Socket[bytes] = self._ctx.socket(zmq.DEALER)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.setsockopt(zmq.MAXMSGSIZE, 256 << 20)  # a Truth reply of a large cache fits
        if keys is not None:
            secure_client(self._sock, keys)
        self._sock.connect(endpoint)

    def call(self, command: Command, *, timeout: float | None = None) -> Reply:
        """Send ``command`` and wait for its reply; raises :class:`ControlError`."""
        ident = next(self._ids)
        deadline_ms = int(1000 * (self.timeout if timeout is None else timeout))
        end = time.monotonic() + deadline_ms / 1000
        # A DEALER with no live connection (the server refused our keys) blocks on send.
        if not self._sock.poll(deadline_ms + 1, zmq.POLLOUT):
            raise ControlError(
                f"{type(command).__name__} to {self.endpoint} could not be sent within "
                f"{deadline_ms / 1000:.1f} s: no connection (engine down, or keys refused)"
            )
        try:
            self._sock.send_multipart([b"", encoder.encode((ident, command))], zmq.NOBLOCK)
        except zmq.Again:
            raise ControlError(f"{type(command).__name__} to {self.endpoint}: connection lost") from None
        poller = zmq.Poller()
        poller.register(self._sock, zmq.POLLIN)
        while True:
            left = end - time.monotonic()
            if left <= 0 or not poller.poll(int(left * 1000) + 1):
                raise ControlError(
                    f"{type(command).__name__} to {self.endpoint} got no reply within "
                    f"{deadline_ms / 1000:.1f} s"
                )
            frames = self._sock.recv_multipart()
            try:
                got, reply = reply_decoder.decode(frames[-1])
            except msgspec.DecodeError as exc:
                raise ControlError(f"unreadable reply from {self.endpoint}: {exc}") from None
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

    def set_publisher(
        self, rank: int, *, max_queue_size: int, coalesce_s: float | None = None
    ) -> None:
        self.call(SetPublisher(rank, max_queue_size, coalesce_s))

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
