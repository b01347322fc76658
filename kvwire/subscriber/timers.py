"""A :class:`~kvwire.subscriber.RankStream`'s deadlines and idle ticks. Functions of the
stream, which keeps the state.

- A request has an overall deadline however its frames trickle.
- Silence: a heartbeating publisher (epoch ``.hb``) sends the next seq at
  least every 1.5 intervals (``kvwire.wire.heartbeat``): 2.5 silent intervals
  ask a fresh connection (once a silence), 3.5 make the rank STALE. Without
  heartbeats the rank is probed after ``idle_probe``: the engines' publishers
  assign a seq as they send, so a probe proves the tail; kvwire's (epoch
  ``kvw1.``) reserve one before queueing, so a batch dropped at the end of a
  burst leaves no trace and the rank is STALE until a live batch. Without
  replay and heartbeats silence makes it STALE too.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvwire.subscriber import recovery
from kvwire.subscriber.actions import Reconnect
from kvwire.subscriber.phases import HANDLERS, Input, Phase
from kvwire.subscriber.recovery import Replay, Snapshot
from kvwire.wire.heartbeat import MAX_SILENCE

if TYPE_CHECKING:
    from kvwire.subscriber.stream import RankStream

# Silence (in heartbeat intervals) after which a fresh connection is tried (once a
# silence), and after which the rank is STALE: one and two intervals past the longest
# a healthy heartbeating publisher is silent (kvwire.wire.heartbeat).
_RECONNECT_HEARTBEATS = MAX_SILENCE + 1
_STALE_HEARTBEATS = MAX_SILENCE + 2
_IDLE_PHASES = frozenset({Phase.FOLLOWING, Phase.STALE, Phase.AWAIT_LIVE})  # probes are made


def tick_request(s: RankStream) -> None:
    """A request is out: has it timed out? Then the phase it leads to has its timers."""
    r = s._req.active
    if r is not None and s._now >= r.deadline:
        _timed_out(s, r)
        getattr(s, HANDLERS[s._phase][Input.TICK])()
    else:
        recovery.ensure_request(s)


def tick_backoff(s: RankStream) -> None:
    if s._now >= s._req.retry_at:
        recovery.ask_replay(s, s._req.resume, anchored=None)
    recovery.ensure_request(s)


def tick_idle(s: RankStream) -> None:
    """Nothing is out: an idle probe, a fresh connection, or STALE, when due."""
    now = s._now
    due = probe_due_at(s)
    if due is not None and now >= due:
        recovery.ask_replay(s, Phase.PROBING, anchored=None)
    due = reconnect_due_at(s)
    if due is not None and now >= due:
        s._reconnected_after = s._last_live_at
        s.counters.silent_reconnects += 1
        s._out.append(Reconnect(f"no message for {_RECONNECT_HEARTBEATS} heartbeat intervals"))
    due = stale_due_at(s)
    if due is not None and now >= due:
        hb = s._epoch_info.heartbeat_s
        s._go_stale(
            f"no message for {_STALE_HEARTBEATS} heartbeat intervals ({hb} s)"
            if hb is not None
            else "idle, and nothing can ask the publisher what the silence hid"
        )
    recovery.ensure_request(s)


def _timed_out(s: RankStream, r: Replay | Snapshot) -> None:
    s.counters.replay_timeouts += 1
    overall = s._now >= r.hard_deadline
    s._req.abandon()
    if isinstance(r, Snapshot):
        recovery.snapshot_failed(s, "overall deadline passed" if overall else "timed out")
    elif r.kind is Phase.PROBING:
        s._settle()
    elif overall:
        recovery.give_up(
            s, f"replay from {r.start} unfinished after {s.config.replay_deadline} s", r.kind
        )
    else:
        recovery.retry_or_give_up(s, f"replay from {r.start} timed out", r.kind)


def probe_due_at(s: RankStream) -> float | None:
    idle = s.config.idle_probe
    if (
        idle is None
        or not s.config.replay
        or s._epoch_info.heartbeat_s is not None
        or s._phase not in _IDLE_PHASES
        or s._seq.gap
    ):
        return None
    return max(s._last_live_at, s._req.last_probe_at) + idle


def reconnect_due_at(s: RankStream) -> float | None:
    """When a heartbeating publisher's silence asks for a fresh connection (once a silence)."""
    hb = s._epoch_info.heartbeat_s
    if hb is None or s._phase not in _IDLE_PHASES or s._reconnected_after == s._last_live_at:
        return None
    return s._last_live_at + _RECONNECT_HEARTBEATS * hb


def stale_due_at(s: RankStream) -> float | None:
    """When silence makes a rank STALE (nothing can prove it current)."""
    if s._phase is not Phase.FOLLOWING and s._phase is not Phase.AWAIT_LIVE:
        return None
    hb = s._epoch_info.heartbeat_s
    if hb is not None:
        return s._last_live_at + _STALE_HEARTBEATS * hb
    if not s.config.replay and s.config.idle_probe is not None:
        return s._last_live_at + s.config.idle_probe
    return None


def snapshot_due_at(s: RankStream) -> float | None:
    """When a failed snapshot is asked again (only where nothing else is asked)."""
    if s._phase not in _IDLE_PHASES or not recovery.wants_snapshot(s):
        return None
    return s._req.recovery_after
