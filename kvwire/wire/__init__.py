"""The wire contract both sides share: event structs, msgpack codec, frames, endpoints."""

from kvwire.wire.codec import Dialect, decode_batch, encode_batch, normalise_hash
from kvwire.wire.endpoints import (
    EndpointError,
    is_ephemeral,
    offset_endpoint,
    validate_endpoint,
    validate_endpoints,
)
from kvwire.wire.errors import WireError
from kvwire.wire.events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEvent,
    KVEventBatch,
    TokenIds,
    enc_hook,
)
from kvwire.wire.framing import (
    END_SEQ,
    LiveMessage,
    ReplayEnd,
    ReplayItem,
    pack_seq,
    parse_live,
    parse_replay_reply,
    parse_replay_request,
    replay_end_frames,
    replay_item_frames,
    replay_request_frames,
    unpack_seq,
)

__all__ = [
    "END_SEQ",
    "AllBlocksCleared",
    "BlockRemoved",
    "BlockStored",
    "Dialect",
    "EndpointError",
    "KVEvent",
    "KVEventBatch",
    "LiveMessage",
    "ReplayEnd",
    "ReplayItem",
    "TokenIds",
    "WireError",
    "decode_batch",
    "enc_hook",
    "encode_batch",
    "is_ephemeral",
    "normalise_hash",
    "offset_endpoint",
    "pack_seq",
    "parse_live",
    "parse_replay_reply",
    "parse_replay_request",
    "replay_end_frames",
    "replay_item_frames",
    "replay_request_frames",
    "unpack_seq",
    "validate_endpoint",
    "validate_endpoints",
]
