"""What following many ranks costs the process: open files and ZeroMQ sockets.

Per followed rank a SUB socket and the two ends of its monitor are three ZeroMQ
sockets, each with a mailbox file descriptor, plus the TCP connection; a
replay DEALER, open only while a request is out, adds two descriptors. Checked
up front (a clear :class:`ResourceLimitError`) rather than discovered as a
socket that fails to open at rank 900.
"""

from __future__ import annotations

import logging
from types import ModuleType
from typing import Any

import zmq

resource: ModuleType | None
try:
    import resource
except ImportError:  # not a Unix: no soft limit to raise
    resource = None

__all__ = ["ResourceLimitError", "check_sockets", "ensure_capacity"]

log = logging.getLogger("kvwire.subscriber")

SOCKETS_PER_RANK = 3
FDS_PER_RANK = 4
FDS_PER_REPLAY = 2  # a replay DEALER's mailbox and its connection
_FD_MARGIN = 256  # the rest of the process: Python, logs, the sink, libzmq's own
_SOCKET_MARGIN = 64


class ResourceLimitError(RuntimeError):
    """The process or ZeroMQ context cannot open the sockets the sources need."""


def ensure_capacity(ranks: int, max_replays: int) -> None:
    """Raise the open-file soft limit to what ``ranks`` need, or say which limit is short."""
    if resource is None:
        return
    replays = min(ranks, max_replays)
    need = ranks * FDS_PER_RANK + replays * FDS_PER_REPLAY + _FD_MARGIN
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY or soft >= need:
        return
    if hard != resource.RLIM_INFINITY and hard < need:
        raise ResourceLimitError(
            f"following {ranks} ranks needs about {need} open files "
            f"({FDS_PER_RANK} per rank, {FDS_PER_REPLAY} per replay socket, "
            f"max_replays={max_replays}), but this process may open at most {hard} "
            "(RLIMIT_NOFILE hard limit): raise it (ulimit -Hn as root, LimitNOFILE= in a "
            "systemd unit, docker run --ulimit nofile=N:N) or split the sources across "
            "subscriber processes"
        )
    resource.setrlimit(resource.RLIMIT_NOFILE, (need, hard))
    log.info("raised the open-file soft limit from %d to %d for %d ranks", soft, need, ranks)


def check_sockets(ctx: zmq.Context[Any], ranks: int, max_replays: int) -> None:
    """Refuse a context that cannot open the sockets ``ranks`` need."""
    need = ranks * SOCKETS_PER_RANK + min(ranks, max_replays) + _SOCKET_MARGIN
    have = ctx.get(zmq.MAX_SOCKETS)
    if have < need:
        raise ResourceLimitError(
            f"following {ranks} ranks needs about {need} ZeroMQ sockets "
            f"({SOCKETS_PER_RANK} per rank, max_replays={max_replays}), but the "
            f"given context allows {have}: set context.MAX_SOCKETS = {need} (or more) "
            "before it opens any socket, or let the Subscriber make its own context"
        )
