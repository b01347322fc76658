"""How a :class:`~kvwire.subscriber.Subscriber` is tuned: one struct, each default written once.

``Subscriber(sources, sink, config=SubscriberConfig(...))``. A struct, so that
a router reading its settings from a file or the environment builds it with
``msgspec.convert`` and gets the same checks as a caller constructing it.
A name shared with the publisher's settings means the same there: ``hwm`` is
the ZeroMQ high-water mark of this side's socket (the SUB's receive queue, as
the publisher's is its PUB's send queue).
"""

from __future__ import annotations

import msgspec

from kvwire.subscriber.state import StreamConfig

__all__ = ["SubscriberConfig"]


class SubscriberConfig(msgspec.Struct, frozen=True, kw_only=True):
    """Settings of a :class:`~kvwire.subscriber.Subscriber`; times are in seconds."""

    stream: StreamConfig = StreamConfig()
    """Every rank's sequencing (:class:`RankStream`); its ``replay`` flag is set per
    source from whether the source has a replay endpoint."""
    hwm: int = 100_000
    """Live messages each rank's SUB socket queues unread; past it ZeroMQ drops them,
    which the rank sees as a gap (repaired by replay)."""
    max_message_size: int = 64 << 20
    """ZeroMQ's size limit on every receiving socket (SUB and replay DEALER), in
    bytes: libzmq drops a larger message with its connection, which the rank sees as
    a lost seq."""
    max_replays: int = 128
    """Replay sockets open at once (further requests wait for one to close), and
    ranks making first contact at once (the others connect as those settle, or after
    5 s)."""
    probe_rate: float = 16.0
    """Idle probes of all ranks together, per second: each rank's
    ``stream.idle_probe`` interval is stretched to ``ranks / probe_rate`` when that
    is longer, so probing a large fleet at rest costs a bounded amount."""
    backlog: int = 10_000
    """Items the async iterator (a Subscriber without a sink) holds before reading
    stops; the publishers' high-water marks then turn the excess into gaps."""

    def __post_init__(self) -> None:
        for name in ("hwm", "max_message_size", "max_replays", "backlog"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if not self.probe_rate > 0:
            raise ValueError(f"probe_rate must be > 0, got {self.probe_rate}")
