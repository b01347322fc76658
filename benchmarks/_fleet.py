"""Shared parts of the fleet benchmarks (``fleet_bench.py``, ``fleet_lifecycle.py``).

Child processes that answer one JSON line per command, free port ranges on
loopback, polling with a deadline, and the process's own CPU and memory: kept
here once so that both scripts measure the same way.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import resource
import signal
import socket
import subprocess
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import IO, Any

ROOT = Path(__file__).resolve().parents[1]
MASK = (1 << 64) - 1


class Child:
    """A child process driven by lines on its stdin, answering one JSON line each."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.proc: subprocess.Popen[str] | None = None

    def spawn(self, argv: Sequence[str], stderr: IO[Any] | None = None) -> None:
        """Start it; ``stderr``: where its log goes (by default this process's stderr)."""
        self.proc = subprocess.Popen(
            list(argv),
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=stderr,
            text=True,
            cwd=ROOT,
        )

    def send(self, command: str) -> None:
        """Send ``command`` without waiting for its answer (see :meth:`reply`)."""
        assert self.proc is not None and self.proc.stdin
        self.proc.stdin.write(command + "\n")
        self.proc.stdin.flush()

    def reply(self) -> dict[str, Any]:
        """The next JSON line the child writes."""
        assert self.proc is not None and self.proc.stdout
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"{self.name} died")
        answer: dict[str, Any] = json.loads(line)
        return answer

    def ask(self, command: str) -> dict[str, Any]:
        """Send ``command`` (nothing when empty) and read its answer."""
        if command:
            self.send(command)
        return self.reply()

    def kill(self) -> None:
        if self.proc is not None:
            with contextlib.suppress(ProcessLookupError):
                self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(10)
            for f in (self.proc.stdin, self.proc.stdout):
                if f is not None:
                    with contextlib.suppress(BrokenPipeError, OSError):
                        f.close()
            self.proc = None

    def close(self, timeout: float = 10.0) -> None:
        """Ask it to quit, then make sure it is gone."""
        if self.proc is None:
            return
        with contextlib.suppress(RuntimeError, BrokenPipeError, ValueError, OSError):
            self.send("quit")
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(timeout)
        self.kill()


def free_base(span: int, taken: set[int]) -> int:
    """A base port with ``span`` consecutive free ports, none in ``taken``."""
    for _ in range(500):
        base = random.randrange(10_000, 32_768 - span)  # below the ephemeral range
        if any(p in taken for p in range(base, base + span)):
            continue
        socks = []
        try:
            for port in range(base, base + span):
                s = socket.socket()
                socks.append(s)
                s.bind(("127.0.0.1", port))
        except OSError:
            continue
        finally:
            for s in socks:
                s.close()
        taken.update(range(base, base + span))
        return base
    raise RuntimeError("no free port range")


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def cpu_s() -> float:
    """CPU seconds this process used so far, every thread."""
    ru = resource.getrusage(resource.RUSAGE_SELF)
    return ru.ru_utime + ru.ru_stime


def wait_for(predicate: Callable[[], bool], timeout: float, poll: float = 0.02) -> float | None:
    """Seconds until ``predicate`` held, or None after ``timeout``."""
    start = time.monotonic()
    while True:
        if predicate():
            return time.monotonic() - start
        if time.monotonic() - start > timeout:
            return None
        time.sleep(poll)


def percentile(values: Sequence[float], q: float) -> float | None:
    """The ``q`` quantile (0..1) of ``values`` (nearest rank), None when empty."""
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]
