"""Where one rank's stream is: the next seq, the highest known, and what is held meanwhile.

:class:`SeqTracker` is the position half of :class:`~kvwire.subscriber.RankStream`
(the phase and the requests out are the other halves). It decides nothing: the
stream tells it what happened and it keeps the numbers consistent, so that
``expected``, ``horizon`` and the anchor are written here and nowhere else.
"""

from __future__ import annotations

import collections
from typing import Any

import msgspec
from sortedcontainers import SortedDict

from kvwire.wire.framing import Frame

__all__ = ["Held", "SeqTracker", "StreamPosition"]

_LOST_RANGES_KEPT = 64


class StreamPosition(msgspec.Struct, frozen=True, kw_only=True):
    """Where an exact rank's stream was, for a checkpoint or a peer clone to resume from.

    Taken by :meth:`~kvwire.subscriber.RankStream.position` together with the
    sink's contents for the rank; :meth:`~kvwire.subscriber.RankStream.resume`
    starts a new stream there, whose first connect is then a reconnect: an
    anchored replay proves, by ``anchor`` byte for byte, that the publisher is
    the one whose batches built the view.
    """

    topic: bytes
    """The live topic followed (``b""``: none seen yet)."""
    epoch: bytes | None
    """The publisher life's epoch (None: it sends none)."""
    next_seq: int
    """The next seq to apply."""
    anchor_seq: int
    """The last batch applied (-1: none since the view was last rebuilt)."""
    anchor: bytes
    """That batch's payload bytes, which the resumed stream's replay must show."""

    def __post_init__(self) -> None:
        if self.next_seq < 0 or not -1 <= self.anchor_seq < self.next_seq:
            raise ValueError(
                f"need -1 <= anchor_seq < next_seq, got {self.anchor_seq} and {self.next_seq}"
            )


class Held(SortedDict):  # type: ignore[misc]
    """Batches held while a gap is filled, by seq, with their payload bytes counted.

    Values are ``(judged, payload)``; only the payload's length is read here.
    """

    def __init__(self) -> None:
        self.nbytes = 0
        super().__init__()

    def __setitem__(self, seq: int, value: tuple[Any, Frame]) -> None:
        old = self.get(seq)
        if old is not None:
            self.nbytes -= len(old[1])
        super().__setitem__(seq, value)
        self.nbytes += len(value[1])

    def __delitem__(self, seq: int) -> None:
        self.nbytes -= len(self[seq][1])
        super().__delitem__(seq)

    def popitem(self, index: int = -1) -> tuple[int, tuple[Any, Frame]]:
        item: tuple[int, tuple[Any, Frame]] = super().popitem(index)
        self.nbytes -= len(item[1][1])
        return item

    def clear(self) -> None:
        super().clear()
        self.nbytes = 0

    def drop(self, lo: int | None, hi: int) -> None:
        """Forget the batches held at seqs ``lo`` (None: any) up to ``hi`` excluded."""
        for seq in list(self.irange(lo, hi - 1)):
            del self[seq]


class SeqTracker:
    """The position of one rank's stream under the publisher life it follows.

    ``expected`` is the next seq to apply; ``horizon`` one past the highest seq
    known to exist (``expected < horizon``: a gap); ``held`` the later batches
    waiting for it; the anchor the last batch applied (its seq and bytes, which
    a reconnect replay compares); ``window`` the replayed batches whose live copy
    may still come (seq, payload hash); ``lost`` the seq ranges given up on, so a
    late live copy is known for one.
    """

    __slots__ = (
        "anchor_payload",
        "anchor_seq",
        "expected",
        "held",
        "horizon",
        "last_live",
        "lost",
        "window",
    )

    def __init__(self, dedup_window: int) -> None:
        self.expected = 0
        self.horizon = 0
        self.held = Held()
        self.last_live = -1  # the highest live seq seen in this life
        self.anchor_seq = -1
        self.anchor_payload: Frame = b""
        self.window: collections.deque[tuple[int, int]] = collections.deque(maxlen=dedup_window)
        self.lost: collections.deque[tuple[int, int]] = collections.deque(maxlen=_LOST_RANGES_KEPT)

    @property
    def gap(self) -> bool:
        """Whether a seq below the horizon is still missing."""
        return self.expected < self.horizon

    def advance(self, seq: int, payload: Frame) -> None:
        """Batch ``seq`` (``payload``) was applied: it is the anchor; ``seq + 1`` is next."""
        self.anchor_seq = seq
        self.anchor_payload = payload
        self.expected = seq + 1
        if seq >= self.horizon:
            self.horizon = seq + 1

    def follow(self, seq: int, payload: Frame) -> None:
        """Live batch ``seq`` was applied in sequence: no replayed copy is awaited."""
        if self.window:
            self.window.clear()
        self.last_live = seq
        self.advance(seq, payload)

    def replayed(self, seq: int, payload: Frame) -> None:
        """Batch ``seq`` was applied from a replay: its live copy may still come."""
        if seq > self.last_live:
            self.window.append((seq, hash(bytes(payload))))

    def live_copy(self, seq: int, payload: Frame) -> bool | None:
        """Live batch ``seq`` arrived: whether it equals the replayed copy applied (None:
        none was); the window forgets every seq up to it."""
        window = self.window
        while window and window[0][0] < seq:
            window.popleft()
        if window and window[0][0] == seq:
            return window.popleft()[1] == hash(bytes(payload))
        return None

    def see(self, seq: int) -> None:
        """Batch ``seq`` exists (a live or replayed copy was read)."""
        if seq >= self.horizon:
            self.horizon = seq + 1

    def skip_to(self, target: int) -> int:
        """Give up on every seq from ``expected`` below ``target``: how many."""
        start = self.expected
        if target <= start:
            return 0
        self.held.drop(start, target)
        self.lost.append((start, target))
        self.expected = target
        self.see(target - 1)
        return target - start

    def lowest_held(self) -> int:
        """Where live goes on after a loss: the first batch held, else the horizon."""
        return self.held.peekitem(0)[0] if self.held else self.horizon

    def resume(self, pos: StreamPosition) -> None:
        """Take up ``pos``: as if its batches had been applied by this tracker."""
        self.jump(pos.next_seq)
        self.last_live = pos.next_seq - 1
        if pos.anchor_seq >= 0:
            self.anchor_seq = pos.anchor_seq
            self.anchor_payload = pos.anchor

    def forget_anchor(self) -> None:
        self.anchor_seq = -1
        self.anchor_payload = b""

    def forget_ahead(self) -> None:
        """What was seen past ``expected`` is not evidence any more (a new connection)."""
        self.held.clear()
        self.horizon = self.expected

    def jump(self, seq: int) -> None:
        """The stream broke: follow it from ``seq``, with nothing held or remembered."""
        self.held.clear()
        self.window.clear()
        self.lost.clear()
        self.expected = self.horizon = seq
        self.forget_anchor()

    def new_life(self, horizon: int) -> None:
        """A publisher life begins: from seq 0, ``horizon`` known to exist."""
        self.jump(0)
        self.horizon = horizon
        self.last_live = -1

    def rebase(self, next_seq: int, known_before: int) -> None:
        """A snapshot as of ``next_seq`` was applied.

        It proves the publisher's next seq was ``next_seq`` when it was served,
        after ``known_before`` (the horizon when it was asked) was known: a seq
        seen at or above ``next_seq`` before the request went out is not this
        publisher's any more, and held copies of it are dropped. Live copies of
        the batches the snapshot covers may still arrive: they read as lost.
        """
        seen_since = self.horizon if self.horizon > known_before else 0
        self.held.drop(None, max(next_seq, known_before))
        self.expected = next_seq
        self.horizon = max(next_seq, seen_since)
        if self.last_live >= self.horizon:
            self.last_live = self.horizon - 1
        self.forget_anchor()
        self.window.clear()
        self.lost.clear()
        self.lost.append((0, next_seq))

    def is_lost(self, seq: int) -> bool:
        return any(lo <= seq < hi for lo, hi in self.lost)
