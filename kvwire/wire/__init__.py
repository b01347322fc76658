"""The wire contract both sides share: event structs, msgpack codec, frames, endpoints."""

from kvwire.wire import endpoints, events, framing
from kvwire.wire.codec import (
    DEFAULT_LIMITS,
    DecodeLimits,
    Dialect,
    decode_batch,
    encode_batch,
    normalise_hash,
)
from kvwire.wire.endpoints import *  # noqa: F403
from kvwire.wire.events import *  # noqa: F403
from kvwire.wire.framing import *  # noqa: F403

__all__ = [
    "DEFAULT_LIMITS",
    "DecodeLimits",
    "Dialect",
    "decode_batch",
    "encode_batch",
    "normalise_hash",
    *endpoints.__all__,
    *events.__all__,
    *framing.__all__,
]
