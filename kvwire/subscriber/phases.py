"""The phases of a :class:`~kvwire.subscriber.RankStream`, what moves them, and who handles what.

Two tables, each written once below and rendered into this docstring:
:data:`EVENTS`, which :class:`Event` moves which :class:`Phase` where (like
h11's ``EVENT_TRIGGERED_TRANSITIONS``: ``RankStream._move`` is the only writer
of a phase, and a move outside the table is a bug, counted in
``internal_errors``); and :data:`HANDLERS`, which ``RankStream`` method
handles each :class:`Input` in each phase (``RankStream._step`` dispatches
every input through it, after ``live`` and ``tick`` checked their fast paths).

Phases
------

The :class:`~kvwire.subscriber.RankState` a router reads is derived: STALE in
phase STALE, else PARTIAL when not exact, else SYNCED in FOLLOWING, else
SYNCING. A probe proves nothing until it ends: in PROBING the rank reads what
it read when the probe began (SYNCED, STALE, or SYNCING when waiting for a
live batch), until a live batch shows where the stream is.

{EVENT_TABLE}

Events: CONNECT, CONNECT_LIVE: the SUB socket connected, with and without a
replay endpoint. ASK_START: a replay that must prove continuity before any
live batch applies (a reconnect, a restart seen). ASK_GAP: a replay of a hole,
later live batches held. ASK_PROBE: a replay asked while idle. ASK_SNAPSHOT:
the view is lost. RETRY_LATER: a failed replay is asked again at a set time.
FOLLOW: in sequence with nothing asked. WAIT_LIVE: only the next live batch
can show the position. GO_STALE: nothing proves the view current. RESET: a
bug met an input (the rank was cleared). DISCONNECT: the connection was lost.

Phases (the table says what moves each):

- DISCONNECTED: no connection (the start); nothing is asked.
- AWAIT_LIVE: connected, but only the next live batch tells where the stream
  is (no replay endpoint, or a start replay gave up).
- STARTING: a (re)connect or post-restart replay is out; every live batch is
  held until it proves continuity.
- REPLAYING: a gap replay is out; later live batches are held. Giving up
  follows live from the first held batch.
- PROBING: idle; a replay asks what the silence hid while live batches apply.
  It proves nothing until it ends.
- SNAPSHOTTING: a snapshot is out; every live batch is held.
- BACKOFF: a replay failed and is asked again at a set time.
- FOLLOWING: in sequence, nothing asked.
- STALE: nothing proves the view current; probing goes on for publishers
  without heartbeats.

Inputs
------

One per public method of ``RankStream``: ``live``, ``replay_reply``, ``tick``,
``connected``, ``disconnected``, ``sink_failed``. ``*`` stands for every phase
no other row of that input names.

{INPUT_TABLE}
"""

from __future__ import annotations

import enum
from collections.abc import Iterator

__all__ = [
    "EVENTS",
    "HANDLERS",
    "TRANSITIONS",
    "Event",
    "Input",
    "Phase",
    "event_table",
    "input_table",
]


class Phase(enum.Enum):
    """Where a rank's stream is; see the module's table."""

    DISCONNECTED = "disconnected"
    AWAIT_LIVE = "await_live"
    STARTING = "starting"
    REPLAYING = "replaying"
    PROBING = "probing"
    SNAPSHOTTING = "snapshotting"
    BACKOFF = "backoff"
    FOLLOWING = "following"
    STALE = "stale"


class Event(enum.Enum):
    """What moves a stream from one phase to another; see the module's table."""

    CONNECT = "connect"
    CONNECT_LIVE = "connect_live"
    ASK_START = "ask_start"
    ASK_GAP = "ask_gap"
    ASK_PROBE = "ask_probe"
    ASK_SNAPSHOT = "ask_snapshot"
    RETRY_LATER = "retry_later"
    FOLLOW = "follow"
    WAIT_LIVE = "wait_live"
    GO_STALE = "go_stale"
    RESET = "reset"
    DISCONNECT = "disconnect"


_EVENT_TABLE = """
CONNECT       STARTING      DISCONNECTED
CONNECT_LIVE  AWAIT_LIVE    DISCONNECTED
ASK_START     STARTING      AWAIT_LIVE STARTING REPLAYING PROBING SNAPSHOTTING
                            BACKOFF FOLLOWING STALE
ASK_GAP       REPLAYING     STARTING REPLAYING PROBING SNAPSHOTTING BACKOFF
                            FOLLOWING STALE
ASK_PROBE     PROBING       AWAIT_LIVE STARTING REPLAYING PROBING FOLLOWING STALE
ASK_SNAPSHOT  SNAPSHOTTING  AWAIT_LIVE PROBING FOLLOWING STALE
RETRY_LATER   BACKOFF       STARTING REPLAYING
FOLLOW        FOLLOWING     AWAIT_LIVE STARTING REPLAYING PROBING SNAPSHOTTING
                            BACKOFF FOLLOWING STALE
WAIT_LIVE     AWAIT_LIVE    STARTING
GO_STALE      STALE         AWAIT_LIVE STARTING REPLAYING PROBING FOLLOWING
RESET         AWAIT_LIVE    AWAIT_LIVE STARTING REPLAYING PROBING SNAPSHOTTING
                            BACKOFF FOLLOWING STALE
DISCONNECT    DISCONNECTED  DISCONNECTED AWAIT_LIVE STARTING REPLAYING PROBING
                            SNAPSHOTTING BACKOFF FOLLOWING STALE
"""


def _rows(text: str) -> Iterator[tuple[str, str, list[str]]]:
    """A table's rows: two words, then phase names; a row that starts with a blank
    continues the one above."""
    head: tuple[str, str] | None = None
    for row in text.strip("\n").splitlines():
        words = row.split()
        if not row.startswith(" "):
            head, words = (words[0], words[1]), words[2:]
        if head is None:
            raise ValueError(f"a continuation row without a row above: {row!r}")
        yield head[0], head[1], words


def event_table(rows: str) -> dict[Phase, dict[Event, Phase]]:
    """``_EVENT_TABLE``'s rows (the module docstring shows them), read: phase -> event -> phase.

    A row names an event, the phase it moves to, then the phases it may happen in.
    """
    out: dict[Phase, dict[Event, Phase]] = {p: {} for p in Phase}
    for event, to, names in _rows(rows):
        for name in names:
            out[Phase[name]][Event[event]] = Phase[to]
    return out


class Input(enum.Enum):
    """What is fed to a stream (one public method each); see the module's input table."""

    LIVE = "live"
    REPLY = "reply"
    TICK = "tick"
    CONNECT = "connect"
    DISCONNECT = "disconnect"
    SINK_FAILED = "sink_failed"


_INPUT_TABLE = """
LIVE          _live_first       DISCONNECTED
LIVE          _on_live          *
REPLY         _replay_reply     STARTING REPLAYING PROBING
REPLY         _snapshot_reply   SNAPSHOTTING
REPLY         _no_request       *
TICK          _tick_request     STARTING REPLAYING PROBING SNAPSHOTTING
TICK          _tick_backoff     BACKOFF
TICK          _tick_idle        AWAIT_LIVE FOLLOWING STALE
TICK          _nothing          DISCONNECTED
CONNECT       _on_connect       DISCONNECTED
CONNECT       _nothing          *
DISCONNECT    _nothing          DISCONNECTED
DISCONNECT    _on_disconnect    *
SINK_FAILED   _on_sink_failed   *
"""


def input_table(rows: str) -> dict[Phase, dict[Input, str]]:
    """``_INPUT_TABLE``'s rows, read: phase -> input -> the name of its handler.

    A row names an input, its handler, then the phases it handles it in
    (``*``: every phase no other row of that input names). Every phase must
    have a handler for every input.
    """
    out: dict[Phase, dict[Input, str]] = {p: {} for p in Phase}
    rest: dict[Input, str] = {}
    for name, handler, phases in _rows(rows):
        for phase in phases:
            if phase == "*":
                rest[Input[name]] = handler
            else:
                out[Phase[phase]][Input[name]] = handler
    for handlers in out.values():
        for inp, handler in rest.items():
            handlers.setdefault(inp, handler)
        if len(handlers) != len(Input):
            raise ValueError(f"inputs without a handler: {set(Input) - set(handlers)}")
    return out


def _render(rows: str, *head: str) -> str:
    """A table as the docstring shows it (an RST simple table, columns as ``head``'s)."""
    rule = "  ".join("=" * (len(h) - 2) for h in head[:-1]) + "  " + "=" * 53
    return "\n".join((rule, "".join(head), rule, rows.strip("\n"), rule))


if __doc__ is not None:  # the tables are written once, above; the docstring shows them
    __doc__ = __doc__.replace(
        "{EVENT_TABLE}", _render(_EVENT_TABLE, f"{'event':<14}", f"{'moves to':<14}", "from")
    ).replace("{INPUT_TABLE}", _render(_INPUT_TABLE, f"{'input':<14}", f"{'handler':<18}", "in"))

EVENTS: dict[Phase, dict[Event, Phase]] = event_table(_EVENT_TABLE)
"""Where each event moves each phase it may happen in: the table of the module's
docstring (rendered from ``_EVENT_TABLE``). Like h11's ``EVENT_TRIGGERED_TRANSITIONS``;
``RankStream._move`` is the only writer of a stream's phase, and reads only this."""

TRANSITIONS: dict[Phase, frozenset[Phase]] = {
    p: frozenset(moves.values()) for p, moves in EVENTS.items()
}
"""Which phase may follow which (derived from :data:`EVENTS`)."""

HANDLERS: dict[Phase, dict[Input, str]] = input_table(_INPUT_TABLE)
"""Which :class:`~kvwire.subscriber.RankStream` method handles each input in each phase (the input
table of the module's docstring, rendered from ``_INPUT_TABLE``)."""
