"""Text renderings of a subscriber for the command line: the watch table, dump records."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TextIO

import msgspec

from kvwire.subscriber.state import RankStatus
from kvwire.wire import KVEvent

__all__ = ["BatchRecord", "ClearRecord", "WatchView"]


class BatchRecord(msgspec.Struct, tag="batch", tag_field="type"):
    """One decoded batch, as ``kvwire dump`` prints it (a JSON line)."""

    worker: str
    rank: int
    seq: int
    ts: float
    data_parallel_rank: int | None
    events: list[KVEvent]


class ClearRecord(msgspec.Struct, tag="clear", tag_field="type"):
    """A rank's state was dropped (publisher restart, unrecoverable loss)."""

    worker: str
    rank: int
    reason: str


_COLUMNS = (
    ("WORKER", "<"),
    ("RANK", ">"),
    ("STATE", "<"),
    ("SEQ", ">"),
    ("EVENTS/S", ">"),
    ("GAPS", ">"),
    ("LOST", ">"),
    ("REPLAYS", ">"),
    ("RESTARTS", ">"),
    ("ERRORS", ">"),
    ("BLOCKS", ">"),
    ("WHY", "<"),
)


class WatchView:
    """Renders per-rank rows; events/s comes from the counters between two renders,
    blocks held from ``blocks(worker_id, rank)`` (a sink's or an index's count)."""

    def __init__(self, title: str) -> None:
        self.title = title
        self._last: dict[tuple[str, int], tuple[float, int]] = {}
        self._drawn = 0  # lines of the table on a terminal

    def render(self, statuses: list[RankStatus], blocks: Callable[[str, int], int]) -> list[str]:
        now = time.monotonic()
        rows: list[tuple[str, ...]] = []
        for st in statuses:
            key = (st.worker_id, st.rank)
            c = st.counters
            prev = self._last.get(key)
            self._last[key] = (now, c.events)
            rate = (
                (c.events - prev[1]) / (now - prev[0]) if prev and now > prev[0] else float("nan")
            )
            rows.append(
                (
                    st.worker_id,
                    str(st.rank),
                    st.state.value + ("" if st.connected else " (down)"),
                    str(st.expected_seq),
                    "-" if rate != rate else f"{rate:.1f}",
                    str(c.gaps),
                    str(c.seqs_lost),
                    f"{c.replays_succeeded}/{c.replays_failed}",
                    str(c.restarts),
                    str(c.decode_errors + c.sink_errors),
                    str(blocks(st.worker_id, st.rank)),
                    st.reason,
                )
            )
        widths = [len(name) for name, _ in _COLUMNS]
        for row in rows:
            widths = [max(w, len(cell)) for w, cell in zip(widths, row, strict=True)]
        header = tuple(name for name, _ in _COLUMNS)
        lines = [self.title, ""]
        for row in (header, *rows):
            cells = [
                f"{cell:{align}{w}}" if i < len(_COLUMNS) - 1 else cell
                for i, (cell, (_, align), w) in enumerate(zip(row, _COLUMNS, widths, strict=True))
            ]
            lines.append("  ".join(cells).rstrip())
        if not rows:
            lines.append("(no ranks)")
        lines.append("")
        lines.append("REPLAYS: succeeded/failed.  ERRORS: undecodable frames + sink errors.")
        return lines

    def redraw(self, out: TextIO, lines: list[str]) -> None:
        """Write ``lines`` over the table written last (on a terminal)."""
        if self._drawn:
            out.write(f"\x1b[{self._drawn}F\x1b[J")  # back to the table's top, clear below
        self._drawn = len(lines)
        out.write("\n".join(lines) + "\n")
        out.flush()
