"""A router's view saved and restored: one record stream, written to a file or sent to a peer.

The same bytes are a checkpoint file and a peer clone's stream
(:mod:`kvwire.subscriber.clone`): one format, two transports. Version 1,
integers big-endian::

    MAGIC    8 bytes  b"KVWVIEW\\n"
    VERSION  u16      1
    frame*            kind (1 byte), length (u64), body (msgpack)
      b"H"  header    Header: view_format, created, fleet [[worker_id, rank, endpoint]]
      b"R"  record    Record: worker_id, rank, position (StreamPosition), blob
      b"E"  end       End: records
    CRC      u32      zlib.crc32 of every byte before it

One header first, a record per rank whose stream had a position (SYNCED, in
sequence, nothing held: :meth:`RankStream.position`), one end last. A
record's position and blob (:meth:`ViewSink.export_rank`) are taken at the
same instant on the subscriber's thread, rank by rank, so the file is
consistent per rank without stopping the fleet; ranks are independent.

Both sides stream: :class:`ViewStream` makes the bytes a piece (a frame) at a
time, a record's blob a part of its own (never copied), and :class:`Decoder`
reads them from chunks of any size holding at most one frame (a record read
from the caller's bytes keeps its blob as a view of them: a file is read
from its mapping, a clone's message as it came), so a 1 GB view is never
built whole. A file or stream that is not
exactly this (another magic or version, a truncated or altered byte, a frame
larger than allowed, a sink of another ``view_format``, no rank this router
follows) raises :class:`CheckpointError` saying why, and nothing of it is
applied: a file is checked whole before a record is imported, a clone's
imports are cleared again (:class:`Restorer`).

Files are written atomically (:func:`write_file`): a temporary file in the
same directory, fsync, rename over the old one, fsync of the directory; a
crash at any point leaves the old checkpoint (or none) in place.
"""

from __future__ import annotations

import contextlib
import logging
import mmap
import os
import queue
import struct
import tempfile
import threading
import time
import zlib
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import Future
from typing import TYPE_CHECKING, cast

import msgspec

from kvwire.subscriber.seq import StreamPosition
from kvwire.subscriber.sink import EventSink, ViewSink

if TYPE_CHECKING:
    from kvwire.subscriber.link import RankLink

__all__ = [
    "MAGIC",
    "VERSION",
    "CheckpointError",
    "CheckpointInfo",
    "Decoder",
    "End",
    "Header",
    "Piece",
    "Record",
    "RestoreProgress",
    "Restored",
    "Restorer",
    "ViewStream",
    "load_file",
    "write_file",
]

log = logging.getLogger("kvwire.subscriber.checkpoint")

MAGIC = b"KVWVIEW\n"
VERSION = 1
_PREAMBLE = struct.Struct(">8sH")
_FRAME = struct.Struct(">cQ")
_CRC = struct.Struct(">I")
_HEADER, _RECORD, _END = b"H", b"R", b"E"
MAX_FRAME = 4 << 30
"""The largest frame a reader accepts unless told less: one rank's blob is at most this."""


class CheckpointError(ValueError):
    """A checkpoint file or clone stream refused; the message says why. Nothing was applied."""


class Header(msgspec.Struct, frozen=True, kw_only=True):
    """What a view holds: the sink's format, when it was taken, and every rank followed."""

    view_format: bytes
    created: float
    """Wall-clock seconds (``time.time()``) when the first record was taken."""
    fleet: list[tuple[str, int, str]]
    """Every rank the router followed: ``(worker_id, rank, endpoint)``."""


class Record(msgspec.Struct, frozen=True, kw_only=True):
    """One rank's view as of one instant: its stream position and the sink's bytes.

    A record read from a file or a clone's message holds its blob as a
    ``memoryview`` of those bytes (no copy of a 20 M-block view on the way in).
    """

    worker_id: str
    rank: int
    position: StreamPosition
    blob: bytes | memoryview


class End(msgspec.Struct, frozen=True, kw_only=True):
    records: int


class CheckpointInfo(msgspec.Struct, frozen=True, kw_only=True):
    """What a write produced."""

    path: str
    nbytes: int
    ranks: int
    """Records written (ranks with a position)."""
    skipped: int
    """Ranks followed but left out (not SYNCED and in sequence): they start cold."""
    seconds: float


class RestoreProgress(msgspec.Struct, kw_only=True):
    """A start-up restore as it goes (the metrics' ``kvwire_subscriber_restore_*``).

    Written by the thread that restores, read by any; ``bytes_expected`` is the
    file's size for a checkpoint and 0 for a clone (its peer makes the view as it
    sends it, so no total is known before the end).
    """

    source: str = ""
    """``"clone"`` or ``"checkpoint"`` while one is read; empty before."""
    bytes_received: int = 0
    bytes_expected: int = 0
    ranks_imported: int = 0
    done: bool = False


class Restored(msgspec.Struct, frozen=True, kw_only=True):
    """What a load or clone applied."""

    source: str
    positions: dict[tuple[str, int], StreamPosition]
    """The ranks whose views were imported, and where their streams resume."""
    skipped: int
    """Records of ranks this router does not follow."""
    nbytes: int
    seconds: float
    created: float
    turn_s: float = 0.0
    """Of ``seconds``, the time the load waited for ``turn`` between import calls: the
    subscriber's loop running (connecting, replaying) while the import held back."""


_enc = msgspec.msgpack.Encoder()
_dec_header = msgspec.msgpack.Decoder(Header)


class _RecordView(Record, frozen=True, kw_only=True):
    """How a record is decoded: its blob a view of the bytes read (no copy)."""

    blob: memoryview


_dec_record = msgspec.msgpack.Decoder(_RecordView)
_dec_end = msgspec.msgpack.Decoder(End)


Piece = list[bytes]
"""One frame of the format as the parts it is made of (written, or sent, one after another):
a record's blob is a part of its own, never copied into the frame."""


def _bin_head(n: int) -> bytes:
    """msgpack's header of a ``bin`` of ``n`` bytes."""
    if n < 1 << 8:
        return b"\xc4" + n.to_bytes(1, "big")
    if n < 1 << 16:
        return b"\xc5" + n.to_bytes(2, "big")
    return b"\xc6" + n.to_bytes(4, "big")


_EMPTY_BIN = _bin_head(0)


class Encoder:
    """Makes the format's pieces (one frame each) and keeps the running CRC."""

    def __init__(self) -> None:
        self.crc = 0
        self.nbytes = 0
        self.records = 0

    def _out(self, parts: Piece) -> Piece:
        for part in parts:
            self.crc = zlib.crc32(part, self.crc)
            self.nbytes += len(part)
        return parts

    def _frame(self, kind: bytes, body: bytes) -> bytes:
        return _FRAME.pack(kind, len(body)) + body

    def start_parts(self, header: Header) -> Piece:
        return self._out(
            [_PREAMBLE.pack(MAGIC, VERSION) + self._frame(_HEADER, _enc.encode(header))]
        )

    def record_parts(self, record: Record) -> Piece:
        """The record's frame as its head (the msgpack up to the blob) and the blob itself:
        the blob is the record's last field, so its bytes end the frame as they are."""
        self.records += 1
        blob = bytes(record.blob) if not isinstance(record.blob, bytes) else record.blob
        meta = _enc.encode(msgspec.structs.replace(record, blob=b""))
        assert meta.endswith(_EMPTY_BIN)
        meta = meta[: -len(_EMPTY_BIN)] + _bin_head(len(blob))
        head = _FRAME.pack(_RECORD, len(meta) + len(blob)) + meta
        return self._out([head, blob] if blob else [head])

    def end_parts(self) -> Piece:
        body = self._out([self._frame(_END, _enc.encode(End(records=self.records)))])
        trailer = _CRC.pack(self.crc)
        self.nbytes += len(trailer)
        return [*body, trailer]


Item = Header | Record | End


class Decoder:
    """Reads the format from chunks of any size (sans-I/O): :meth:`feed` returns what completed.

    Holds at most one frame (``max_frame`` bytes) and the chunk being read.
    Raises :class:`CheckpointError`.
    """

    def __init__(self, *, max_frame: int = MAX_FRAME) -> None:
        self._buf = bytearray()
        self._view = False
        self._crc = 0
        self._stage = 0  # 0 preamble, 1 header frame, 2 records/end, 3 crc, 4 done
        self._max_frame = max_frame
        self.records = 0
        self.nbytes = 0

    @property
    def done(self) -> bool:
        """The whole stream was read and its CRC matched."""
        return self._stage == 4

    def feed(self, data: bytes | bytearray | memoryview | mmap.mmap) -> list[Item]:
        if self._stage == 4:
            if len(data):
                raise CheckpointError("bytes after the end of the view")
            return []
        self.nbytes += len(data)
        if self._buf:
            buf: bytearray | memoryview = self._buf
            self._buf += data
            self._view = False
        else:
            # Nothing buffered: frames are read where they lie, and a record's blob
            # is a view of ``data`` (which it keeps alive); only a partial frame at
            # the end is copied, to wait for the rest.
            buf = memoryview(data).cast("B")
            self._view = True
        out: list[Item] = []
        pos = 0
        while True:
            if self._stage == 0:
                if len(buf) - pos < _PREAMBLE.size:
                    if not MAGIC.startswith(bytes(buf[: len(MAGIC)])):
                        raise CheckpointError("not a kvwire view (checkpoint) file: wrong magic")
                    break
                magic, version = _PREAMBLE.unpack_from(buf, pos)
                if magic != MAGIC:
                    raise CheckpointError("not a kvwire view (checkpoint) file: wrong magic")
                if version != VERSION:
                    raise CheckpointError(
                        f"format version {version}, this kvwire reads version {VERSION} only"
                    )
                self._crc = zlib.crc32(buf[pos : pos + _PREAMBLE.size], self._crc)
                pos += _PREAMBLE.size
                self._stage = 1
            elif self._stage == 3:
                if len(buf) - pos < _CRC.size:
                    break
                (crc,) = _CRC.unpack_from(buf, pos)
                pos += _CRC.size
                if crc != self._crc:
                    raise CheckpointError("checksum mismatch: the view was altered or damaged")
                if len(buf) > pos:
                    raise CheckpointError("bytes after the end of the view")
                self._stage = 4
                break
            else:
                if len(buf) - pos < _FRAME.size:
                    break
                kind, length = _FRAME.unpack_from(buf, pos)
                if length > self._max_frame:
                    raise CheckpointError(
                        f"a frame of {length} bytes, more than the {self._max_frame} allowed "
                        "(damaged, or another router's limits)"
                    )
                end = pos + _FRAME.size + length
                if len(buf) < end:
                    break
                body = memoryview(buf)[pos + _FRAME.size : end]
                try:
                    item = self._frame(kind, body)
                finally:
                    if not self._view:
                        body.release()
                self._crc = zlib.crc32(memoryview(buf)[pos:end], self._crc)
                pos = end
                out.append(item)
        if self._view:
            self._buf = bytearray(buf[pos:])
        else:
            del self._buf[:pos]
        return out

    def feed_parts(self, parts: Sequence[bytes | memoryview]) -> list[Item]:
        """:meth:`feed` of the parts of one piece (as :class:`Encoder` made them and a
        clone sends them). A record's head and blob are read where they lie: its blob
        is the second part itself, never joined to the first (a copy of every blob)."""
        if len(parts) == 2 and not self._buf and self._stage == 2:
            record = self._record_parts(memoryview(parts[0]), memoryview(parts[1]))
            if record is not None:
                return [record]
        if len(parts) == 1:
            return self.feed(parts[0])
        return self.feed(b"".join(parts))

    def _record_parts(self, head: memoryview, blob: memoryview) -> Record | None:
        """A record frame in two parts, or None where they are anything else (the general
        path then reads the joined bytes and says what is wrong). The head must be exactly
        what :meth:`Encoder.record_parts` makes of the record it decodes to, so the blob is
        the frame's last field and the bytes are the ones the general path would read."""
        bin_head = _bin_head(len(blob))
        if len(head) < _FRAME.size + len(bin_head) or head[:1] != _RECORD:
            return None
        length = _FRAME.unpack_from(head)[1]
        if length != len(head) - _FRAME.size + len(blob) or length > self._max_frame:
            return None
        if head[len(head) - len(bin_head) :] != bin_head:
            return None
        meta = bytes(head[_FRAME.size : len(head) - len(bin_head)]) + _EMPTY_BIN
        try:
            r = _dec_record.decode(meta)
        except msgspec.DecodeError:
            return None
        record = Record(worker_id=r.worker_id, rank=r.rank, position=r.position, blob=b"")
        if _enc.encode(record) != meta:
            return None  # not the canonical layout: read it the general way
        self._crc = zlib.crc32(blob, zlib.crc32(head, self._crc))
        self.nbytes += len(head) + len(blob)
        self.records += 1
        return Record(worker_id=r.worker_id, rank=r.rank, position=r.position, blob=blob)

    def _frame(self, kind: bytes, body: memoryview) -> Item:
        try:
            if self._stage == 1:
                if kind != _HEADER:
                    raise CheckpointError("no header at the start of the view")
                self._stage = 2
                return _dec_header.decode(body)
            if kind == _RECORD:
                self.records += 1
                # From the caller's bytes the blob is a view of them; from the buffer (which
                # moves on), a copy.
                r = _dec_record.decode(body)
                blob: bytes | memoryview = r.blob
                if not self._view:
                    blob = bytes(r.blob)
                    r.blob.release()
                return Record(**{**msgspec.structs.asdict(r), "blob": blob})
            if kind == _END:
                end = _dec_end.decode(body)
                if end.records != self.records:
                    raise CheckpointError(
                        f"the end says {end.records} records, {self.records} were read"
                    )
                self._stage = 3
                return end
        except msgspec.DecodeError as exc:
            raise CheckpointError(f"an unreadable {kind!r} frame: {exc}") from None
        raise CheckpointError(f"an unknown frame kind {kind!r}")

    def finish(self) -> None:
        """The input ended: raise unless the stream was complete."""
        if self._stage != 4:
            raise CheckpointError(
                f"truncated: the view ends after {self.nbytes} bytes, before its end"
            )


IMPORT_BATCH = 16
"""Records imported in one call of a sink's ``import_ranks`` (a file's, once it is checked;
a clone's, as they arrive): about 0.3 M blocks, 15-40 ms, at 20,000 blocks a rank. The GIL
is held that long; the subscriber's loop takes a turn between calls (``turn``), in which
the announced ranks connect and their replays are asked and read, so that a warm start's
catch-up runs while its view loads, not after."""

Announce = Callable[[dict[tuple[str, int], StreamPosition]], object]
"""Told the positions of records read, before their views are imported (any thread)."""

Turn = Callable[[], object]
"""Called between import calls: returns once the router's loop has had its turn."""


class Restorer:
    """Applies a view's items to a sink as they are read, or undoes them all.

    ``followed``: the (worker_id, rank) this router follows; records of other
    ranks are skipped and counted, and a view with none of these is another
    fleet's and refused. ``announce`` is told each record's position before its
    view is imported (:meth:`announce`; the subscriber connects those ranks
    meanwhile, holding what they read until the view is in). Records are
    imported ``batch`` at a time (None: all at :meth:`finish`, :data:`IMPORT_BATCH`
    a call), in one call of a
    sink's ``import_ranks`` where it has one (:meth:`PrefixIndex.import_ranks
    <kvwire.prefix_index.PrefixIndex.import_ranks>`: one native pass, its
    tables sized once), else rank by rank; ``turn`` is called after each. On any
    refusal :meth:`rollback` clears the ranks imported so far, leaving the sink as it
    was at start.
    """

    def __init__(
        self,
        sink: ViewSink,
        followed: Iterable[tuple[str, int]],
        source: str,
        progress: RestoreProgress | None = None,
        batch: int | None = None,
        announce: Announce | None = None,
        turn: Turn | None = None,
    ) -> None:
        self._sink = sink
        self._turn = turn
        self._progress = progress if progress is not None else RestoreProgress()
        self._followed = frozenset(followed)
        self._source = source
        self._batch = batch
        self._announce = announce
        self._told: dict[tuple[str, int], StreamPosition] = {}  # positions not yet announced
        self._pending: list[Record] = []
        self._seen: set[tuple[str, int]] = set()
        self._imported: dict[tuple[str, int], StreamPosition] = {}
        self._skipped = 0
        self._header: Header | None = None
        self._start = time.monotonic()
        self._turn_s = 0.0
        self._end: End | None = None

    def check_header(self, header: Header) -> None:
        want = self._sink.view_format()
        if header.view_format != want:
            raise CheckpointError(
                f"written by a sink of view format {header.view_format!r}, this router's "
                f"is {want!r}"
            )
        fleet = {(w, r) for w, r, _ in header.fleet}
        if not fleet & self._followed:
            raise CheckpointError(
                f"another fleet's view: none of its {len(fleet)} ranks is followed here"
            )
        self._header = header

    def take(self, item: Item) -> None:
        if isinstance(item, Header):
            self.check_header(item)
        elif isinstance(item, Record):
            key = (item.worker_id, item.rank)
            if key not in self._followed:
                self._skipped += 1
                return
            if key in self._seen:
                raise CheckpointError(f"two records of worker {key[0]} rank {key[1]}")
            self._seen.add(key)
            self._pending.append(item)
            if self._announce is not None:
                self._told[key] = item.position
            if self._batch is not None and len(self._pending) >= self._batch:
                self._import()
        else:
            self._end = item

    def announce(self) -> None:
        """Tell ``announce`` the positions of the records taken since it was last told:
        their ranks may connect and ask their replays while the view is imported."""
        told, self._told = self._told, {}
        if told and self._announce is not None:
            self._announce(told)

    def _import(self) -> None:
        """Import the pending records, :data:`IMPORT_BATCH` a call (the GIL is free between)."""
        self.announce()  # before the imports hold the GIL
        pending, self._pending = self._pending, []
        for i in range(0, len(pending), IMPORT_BATCH):
            self._import_some(pending[i : i + IMPORT_BATCH])
            if self._turn is not None:
                t = time.monotonic()
                self._turn()
                self._turn_s += time.monotonic() - t

    def _import_some(self, records: list[Record]) -> None:
        if not records:
            return
        bulk = getattr(self._sink, "import_ranks", None)
        if bulk is not None:
            try:
                bulk([(r.worker_id, r.rank, r.blob) for r in records])
            except ValueError as exc:
                why, i = exc.args if len(exc.args) == 2 else (exc, None)
                r = None if i is None else records[i]
                whose = "a rank" if r is None else f"worker {r.worker_id} rank {r.rank}"
                raise CheckpointError(f"the sink refused {whose}'s view: {why}") from None
            for r in records:
                self._imported[(r.worker_id, r.rank)] = r.position
            self._progress.ranks_imported += len(records)
            return
        for r in records:
            try:
                self._sink.import_rank(r.worker_id, r.rank, r.blob)  # type: ignore[arg-type]
            except ValueError as exc:
                raise CheckpointError(
                    f"the sink refused worker {r.worker_id} rank {r.rank}'s view: {exc}"
                ) from None
            self._imported[(r.worker_id, r.rank)] = r.position
            self._progress.ranks_imported += 1

    def rollback(self) -> None:
        self._pending.clear()
        for worker_id, rank in self._imported:
            with contextlib.suppress(Exception):
                cast(EventSink, self._sink).clear(worker_id, rank)
        self._imported.clear()
        self._progress.ranks_imported = 0

    def finish(self, nbytes: int) -> Restored:
        if self._header is None or self._end is None:
            raise CheckpointError("truncated: the view has no end")
        if not self._seen and self._end.records:
            raise CheckpointError(
                f"another fleet's view: none of its {self._end.records} records is of a rank "
                "followed here"
            )
        self._import()
        return Restored(
            source=self._source,
            positions=dict(self._imported),
            skipped=self._skipped,
            nbytes=nbytes,
            seconds=time.monotonic() - self._start,
            created=self._header.created,
            turn_s=self._turn_s,
        )


def load_file(
    path: str,
    sink: ViewSink,
    followed: Iterable[tuple[str, int]],
    *,
    max_frame: int = MAX_FRAME,
    progress: RestoreProgress | None = None,
    announce: Announce | None = None,
    turn: Turn | None = None,
) -> Restored:
    """Check the checkpoint at ``path`` whole (framing and CRC), then import its records.

    One pass over a mapping of the file (its records' blobs are views of it,
    never copied); once the whole file is checked, its records are imported
    :data:`IMPORT_BATCH` at a time (each import holds the GIL, so a router's
    other threads go on between them; a sink that refuses a view, a file
    that passed its CRC, clears those imported before it). ``announce`` is
    told every record's position once the file is checked, before the imports,
    and ``turn`` is called between them (:class:`Restorer`). Raises
    :class:`CheckpointError` (nothing applied) for a file that
    is not a valid checkpoint of this sink's format holding a rank in
    ``followed``, and ``OSError`` when it cannot be read (``FileNotFoundError``:
    there is none).
    """
    if progress is None:
        progress = RestoreProgress()
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        progress.source, progress.bytes_expected = "checkpoint", size
        decoder = Decoder(max_frame=min(max_frame, size))
        # Every record is taken (its position announced) before any is imported.
        restorer = Restorer(
            sink, followed, f"checkpoint {path}", progress, announce=announce, turn=turn
        )
        data: mmap.mmap | bytes = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) if size else b""
    items: list[Item] = []
    try:
        items = decoder.feed(data)
        decoder.finish()
        progress.bytes_received = size
        for item in items:
            restorer.take(item)
        return restorer.finish(decoder.nbytes)
    except BaseException:
        restorer.rollback()
        raise
    finally:
        del items  # (the records' views of the mapping go before it does)
        if isinstance(data, mmap.mmap):
            with contextlib.suppress(BufferError):  # a view still held: freed with it
                data.close()


def write_file(path: str, pieces: Iterable[bytes | Piece]) -> int:
    """Write ``pieces`` to ``path`` atomically; the bytes written.

    A temporary file in the same directory, fsync, rename over ``path``,
    fsync of the directory. Any failure (or a crash) leaves what was at
    ``path`` before; the temporary file is removed unless the process died.
    """
    directory = os.path.dirname(os.path.abspath(path))
    fd, tmp = tempfile.mkstemp(prefix=f".{os.path.basename(path)}.", suffix=".tmp", dir=directory)
    nbytes = 0
    try:
        with os.fdopen(fd, "wb") as f:
            for piece in pieces:
                for part in [piece] if isinstance(piece, bytes) else piece:
                    f.write(part)
                    nbytes += len(part)
            f.flush()
            os.fsync(f.fileno())
        _rename(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    dfd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(dfd)
    finally:
        os.close(dfd)
    return nbytes


def _rename(tmp: str, path: str) -> None:
    os.replace(tmp, path)


class ViewStream:
    """The view of ``ranks`` as the format's pieces, made one at a time on the subscriber's thread.

    Each :meth:`next` takes at most one rank: its position and the sink's
    bytes for it at that instant (``flush``: the subscriber's, so a buffering
    sink has applied every batch the position counts). A rank without a position (not SYNCED in
    sequence), or closed meanwhile, or whose export raises, is left out; a view
    with no rank at all raises :class:`CheckpointError` at its end (so no empty
    checkpoint replaces a useful one).
    """

    def __init__(
        self,
        ranks: Sequence[RankLink],
        sink: ViewSink,
        flush: Callable[[], object] | None = None,
    ) -> None:
        self._ranks = list(ranks)
        self._sink = sink
        self._flush = flush
        self._enc = Encoder()
        self._i = 0
        self._stage = 0
        self.skipped = 0
        self.header = Header(
            view_format=sink.view_format(),
            created=time.time(),
            fleet=[(r.worker_id, r.rank, r.endpoints.endpoint) for r in self._ranks],
        )

    @property
    def records(self) -> int:
        return self._enc.records

    def next(self) -> Piece | None:
        """The next piece, or None after the last (the end and its CRC)."""
        if self._stage == 0:
            self._stage = 1
            return self._enc.start_parts(self.header)
        while self._i < len(self._ranks):
            link = self._ranks[self._i]
            self._i += 1
            if self._flush is not None:
                self._flush()  # a buffering sink's batches belong to the position
            # (a rank on hold has not given the sink what its position counts)
            pos = None if link.closed or link.on_hold else link.stream.position()
            if pos is None:
                self.skipped += 1
                continue
            try:
                blob = self._sink.export_rank(link.worker_id, link.rank)
            except Exception:
                log.exception("export_rank failed for worker %s rank %s", link.worker_id, link.rank)
                self.skipped += 1
                continue
            return self._enc.record_parts(
                Record(worker_id=link.worker_id, rank=link.rank, position=pos, blob=blob)
            )
        if self._stage == 1:
            self._stage = 2
            if not self._enc.records:
                raise CheckpointError(
                    f"no rank is SYNCED in sequence ({self.skipped} followed): nothing to save"
                )
            return self._enc.end_parts()
        return None

    def __iter__(self) -> Iterator[Piece]:
        while (piece := self.next()) is not None:
            yield piece


_SLICE_S = 0.002
"""How long one slice of a background checkpoint takes ranks on the subscriber's thread."""
_PENDING_BYTES = 64 << 20
"""Bytes taken but not yet written, at most: past it, slices wait for the writer."""
_WAIT_S = 0.005


class BackgroundWrite:
    """A checkpoint taken in slices on the loop and written by a thread of its own.

    Each slice takes ranks for :data:`_SLICE_S` at most (between the
    subscriber's inputs, so each rank's position and bytes are of one
    instant); the writer thread writes them as they come (:func:`write_file`)
    and at most :data:`_PENDING_BYTES` wait between the two. ``future``
    gets the :class:`CheckpointInfo` or the error.
    """

    def __init__(
        self,
        call_later: Callable[[float, Callable[[], None]], object],
        view: ViewStream,
        path: str,
    ) -> None:
        self.future: Future[CheckpointInfo] = Future()
        self._call_later = call_later
        self._view = view
        self._path = path
        self._queue: queue.SimpleQueue[Piece | None] = queue.SimpleQueue()
        self._pending = 0
        self._lock = threading.Lock()
        self._aborted = False
        self._error: Exception | None = None
        self._start = time.monotonic()
        self._thread = threading.Thread(target=self._write, name="kvwire-checkpoint", daemon=True)
        self._thread.start()

    def step(self) -> None:
        """One slice on the loop; schedules the next until the view is taken."""
        if self._aborted:
            return
        deadline = time.monotonic() + _SLICE_S
        while True:
            with self._lock:
                if self._pending > _PENDING_BYTES:
                    break
            try:
                piece = self._view.next()
            except Exception as exc:  # (no rank to save): the writer removes its file
                self._error = exc
                piece = None
            if piece is None:
                self._queue.put(None)
                return
            with self._lock:
                self._pending += sum(len(part) for part in piece)
            self._queue.put(piece)
            if time.monotonic() >= deadline:
                break
        self._call_later(_WAIT_S if self._pending > _PENDING_BYTES else 0.0, self.step)

    def abort(self) -> None:
        """Stop taking ranks; the writer removes its temporary file."""
        if not self._aborted:
            self._aborted = True
            self._queue.put(None)

    def _pieces(self) -> Iterator[Piece]:
        while (piece := self._queue.get()) is not None:
            with self._lock:
                self._pending -= sum(len(part) for part in piece)
            yield piece
        if self._error is not None:
            raise self._error
        if self._aborted:
            raise CheckpointError("the checkpoint was abandoned (the subscriber stopped)")

    def _write(self) -> None:
        try:
            nbytes = write_file(self._path, self._pieces())
        except BaseException as exc:
            self.future.set_exception(exc)
            return
        self.future.set_result(
            CheckpointInfo(
                path=self._path,
                nbytes=nbytes,
                ranks=self._view.records,
                skipped=self._view.skipped,
                seconds=time.monotonic() - self._start,
            )
        )
