"""The view format's sans-I/O reader against its writer, whatever the chunking.

A checkpoint file is read in chunks of any size and a clone's stream a piece
(``feed_parts``) at a time; both must give the items the writer wrote, and
any altered or cut stream must end in ``CheckpointError`` (never another
exception, never a different view).
"""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvwire.subscriber import StreamPosition
from kvwire.subscriber.checkpoint import (
    CheckpointError,
    Decoder,
    Encoder,
    End,
    Header,
    Item,
    Record,
)

_positions = st.builds(
    lambda topic, epoch, next_seq, back, anchor: StreamPosition(
        topic=topic,
        epoch=epoch,
        next_seq=next_seq,
        anchor_seq=max(-1, next_seq - 1 - back),
        anchor=anchor,
    ),
    st.binary(max_size=8),
    st.none() | st.binary(min_size=1, max_size=16),
    st.integers(0, 2**63 - 1),
    st.integers(0, 3),
    st.binary(max_size=64),
)

_records = st.builds(
    lambda w, r, pos, blob: Record(worker_id=w, rank=r, position=pos, blob=blob),
    st.text(min_size=1, max_size=8),
    st.integers(0, 4096),
    _positions,
    # Blobs of every msgpack bin size class (8-, 16- and 32-bit lengths).
    st.binary(max_size=300) | st.integers(65_536, 65_600).map(lambda n: b"\x5a" * n),
)

_headers = st.builds(
    lambda fmt, created, fleet: Header(view_format=fmt, created=created, fleet=fleet),
    st.binary(min_size=1, max_size=24),
    st.floats(0, 2e9, allow_nan=False),
    st.lists(st.tuples(st.text(max_size=6), st.integers(0, 64), st.text(max_size=12)), max_size=4),
)


def _pieces(header: Header, records: list[Record]) -> list[list[bytes]]:
    enc = Encoder()
    return [
        enc.start_parts(header),
        *(enc.record_parts(r) for r in records),
        enc.end_parts(),
    ]


def _plain(items: list[Item]) -> list[Any]:
    """Items with their blobs as bytes (a decoded record may hold a view)."""
    out: list[Any] = []
    for item in items:
        if isinstance(item, Record):
            item = Record(
                worker_id=item.worker_id,
                rank=item.rank,
                position=item.position,
                blob=bytes(item.blob),
            )
        out.append(item)
    return out


def _read_chunks(data: bytes, cuts: list[int]) -> list[Item]:
    dec = Decoder()
    items: list[Item] = []
    start = 0
    for cut in [*sorted({c % (len(data) + 1) for c in cuts}), len(data)]:
        items += _plain(dec.feed(data[start:cut]))
        start = cut
    dec.finish()
    return items


def _read_parts(pieces: list[list[bytes]]) -> list[Item]:
    dec = Decoder()
    items: list[Item] = []
    for piece in pieces:
        items += _plain(dec.feed_parts(piece))
    dec.finish()
    return items


@settings(max_examples=150, suppress_health_check=[HealthCheck.too_slow])
@given(_headers, st.lists(_records, max_size=4), st.lists(st.integers(0, 1 << 20), max_size=12))
def test_any_chunking_and_the_clone_pieces_read_what_was_written(
    header: Header, records: list[Record], cuts: list[int]
) -> None:
    pieces = _pieces(header, records)
    data = b"".join(b"".join(p) for p in pieces)
    want = [header, *records, End(records=len(records))]
    assert _read_chunks(data, cuts) == want
    assert _read_parts(pieces) == want
    dec = Decoder()
    dec.feed(data)
    assert dec.done and dec.nbytes == len(data) and dec.records == len(records)


def _refused(read: Any) -> None:
    with pytest.raises(CheckpointError):
        read()


@settings(max_examples=200, suppress_health_check=[HealthCheck.too_slow])
@given(
    _headers,
    st.lists(_records, min_size=1, max_size=3),
    st.data(),
)
def test_an_altered_or_cut_stream_is_refused_however_it_is_read(
    header: Header, records: list[Record], data: st.DataObject
) -> None:
    pieces = _pieces(header, records)
    whole = b"".join(b"".join(p) for p in pieces)
    how = data.draw(st.sampled_from(["flip", "cut", "insert", "drop"]))
    at = data.draw(st.integers(0, len(whole) - 1))
    if how == "flip":
        bad = bytearray(whole)
        bad[at] ^= data.draw(st.integers(1, 255))
        altered = bytes(bad)
    elif how == "cut":
        altered = whole[:at]
    elif how == "insert":
        altered = whole[:at] + data.draw(st.binary(min_size=1, max_size=9)) + whole[at:]
    else:
        altered = whole[:at] + whole[at + 1 :]
    cuts = data.draw(st.lists(st.integers(0, len(altered)), max_size=6))
    _refused(lambda: _read_chunks(altered, cuts))
    # The same alteration inside a clone's pieces: the piece holding byte `at` is changed.
    if how in ("flip", "insert", "drop"):
        parts = [part for piece in pieces for part in piece]
        offset = 0
        for i, part in enumerate(parts):
            if offset <= at < offset + len(part):
                j = at - offset
                if how == "flip":
                    b = bytearray(part)
                    b[j] ^= altered[at] ^ whole[at]
                    parts[i] = bytes(b)
                elif how == "insert":
                    parts[i] = part[:j] + altered[at : at + len(altered) - len(whole)] + part[j:]
                else:
                    parts[i] = part[:j] + part[j + 1 :]
                break
            offset += len(part)
        regrouped: list[list[bytes]] = []
        k = 0
        for piece in pieces:
            regrouped.append(parts[k : k + len(piece)])
            k += len(piece)
        _refused(lambda: _read_parts(regrouped))
