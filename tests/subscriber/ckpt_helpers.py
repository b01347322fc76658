"""Helpers of the checkpoint and clone tests: a view sink, publisher fleets, a built view."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

from kvwire.publisher import EventPublisher, PublisherConfig
from kvwire.subscriber import BlockSetSink, StreamPosition
from kvwire.subscriber.checkpoint import Encoder, Header, Record
from tests.subscriber.helpers import EPHEMERAL, Engine

FORMAT = BlockSetSink().view_format()

PUBLISHERS: dict[str, dict[str, Any]] = {
    # The engines' stock wire: no epoch, no heartbeat, no snapshot; a replay buffer only.
    "stock": {"epoch": False, "heartbeat_s": None, "snapshot": False},
    # kvwire's: an epoch and heartbeats, but no snapshot (the buffer must cover the gap).
    "kvwire": {"epoch": True, "snapshot": False},
}


class ViewSet(BlockSetSink):
    """The reference view (its rank views are BlockSetSink's), counting imports and clears."""

    def __init__(self) -> None:
        super().__init__()
        self.imports = 0
        self.clears = 0

    def import_rank(self, worker_id: str, rank: int, view: bytes | bytearray | memoryview) -> None:
        super().import_rank(worker_id, rank, view)
        self.imports += 1

    def clear(self, worker_id: str, rank: int) -> None:
        self.clears += 1
        super().clear(worker_id, rank)


@contextlib.contextmanager
def fleet(ranks: int, kind: str, **kw: Any) -> Iterator[list[EventPublisher]]:
    config = PublisherConfig(**{**PUBLISHERS[kind], **kw})
    pubs = [EventPublisher(EPHEMERAL, EPHEMERAL, config, rank=r).start() for r in range(ranks)]
    try:
        yield pubs
    finally:
        for p in pubs:
            p.close(timeout=1.0)


def engines(ranks: int, seed: int = 0) -> list[Engine]:
    return [Engine(seed=seed + r, rank=r) for r in range(ranks)]


def built_view(
    ranks: list[tuple[str, int]],
    *,
    fmt: bytes = FORMAT,
    fleet_ranks: list[tuple[str, int]] | None = None,
) -> bytes:
    """A valid view file's bytes: each rank holds a few blocks at seq 5."""
    enc = Encoder()
    fleet_of = ranks if fleet_ranks is None else fleet_ranks
    out = [
        *enc.start_parts(
            Header(
                view_format=fmt,
                created=1.0,
                fleet=[(w, r, f"tcp://e/{w}/{r}") for w, r in fleet_of],
            )
        )
    ]
    for i, (w, r) in enumerate(ranks):
        pos = StreamPosition(topic=b"", epoch=None, next_seq=5, anchor_seq=4, anchor=b"x%d" % i)
        view = BlockSetSink()
        view._blocks[(w, r)] = {i * 10 + k for k in range(3)}
        blob = view.export_rank(w, r)
        out += enc.record_parts(Record(worker_id=w, rank=r, position=pos, blob=blob))
    out += enc.end_parts()
    return b"".join(out)
