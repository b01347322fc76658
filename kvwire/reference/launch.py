"""Start a reference engine server as a child process and learn where it bound.

The server binds ephemeral ports by default and prints its endpoints on one
ready line; :class:`EngineProcess` waits for that line (with a deadline),
copies everything else the server prints to a log file, and builds the
:class:`~kvwire.subscriber.EngineSource` a router follows it with. No port is
chosen, or guessed, ahead of time. The publishers' settings travel as
:attr:`EngineConfig.publisher <kvwire.reference.serve.EngineConfig>`, turned into
the server's flags by :meth:`EngineConfig.argv` and back into the same
:class:`~kvwire.publisher.PublisherConfig` by the server.
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import IO

import msgspec

from kvwire.reference.control import EngineEndpoints
from kvwire.reference.serve import READY_PREFIX, EngineConfig
from kvwire.subscriber import EngineSource
from kvwire.wire import local_endpoint

__all__ = ["EngineProcess"]


class EngineProcess:
    """One ``python -m kvwire.reference.serve`` process."""

    def __init__(
        self,
        config: EngineConfig,
        log_path: Path,
        *,
        extra_args: Sequence[str] = (),
        env: Mapping[str, str] | None = None,
        cwd: Path | None = None,
    ) -> None:
        self.config = config
        self.log_path = log_path
        self.extra_args = list(extra_args)
        self.env = {**os.environ, **(env or {}), "PYTHONUNBUFFERED": "1"}
        self.cwd = cwd
        self.proc: subprocess.Popen[bytes] | None = None
        self._endpoints: EngineEndpoints | None = None
        self._found: list[EngineEndpoints] = []
        self._settled = threading.Event()

    @property
    def argv(self) -> list[str]:
        return [sys.executable, "-m", "kvwire.reference.serve", *self.config.argv(), *self.extra_args]

    def start(self, timeout: float = 60.0) -> EngineEndpoints:
        """Start the server and wait until it printed its endpoints (or exited)."""
        self.spawn()
        return self.wait_ready(timeout)

    def spawn(self) -> None:
        """Start the server without waiting (several engines start side by side)."""
        proc = subprocess.Popen(
            self.argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=self.env, cwd=self.cwd
        )
        self.proc = proc
        self._endpoints = None
        self._found.clear()
        self._settled = threading.Event()
        assert proc.stdout is not None
        threading.Thread(
            target=self._tee, args=(proc.stdout, self._found, self._settled), daemon=True
        ).start()

    def wait_ready(self, timeout: float = 60.0) -> EngineEndpoints:
        """Wait for the ready line of :meth:`spawn`; kills the server and raises without it."""
        if self.proc is None:
            raise RuntimeError("the engine is not started")
        if not self._settled.wait(timeout) or not self._found:
            self.kill()
            raise RuntimeError(
                f"the engine did not report its endpoints within {timeout} s "
                f"(exit status {self.proc.poll()}):\n{self.logs()[-4000:]}"
            )
        self._endpoints = self._found[0]
        return self._endpoints

    def _tee(self, stream: IO[bytes], found: list[EngineEndpoints], settled: threading.Event) -> None:
        """Copy the server's output to the log; pick out the ready line."""
        with stream, self.log_path.open("ab") as log:
            for line in stream:
                log.write(line)
                log.flush()
                if not found and line.startswith(READY_PREFIX.encode()):
                    body = line[len(READY_PREFIX) :]
                    found.append(msgspec.json.decode(body, type=EngineEndpoints))
                    settled.set()
        settled.set()  # end of output: the server exited

    @property
    def endpoints(self) -> EngineEndpoints:
        """What the server bound; requires :meth:`start`."""
        if self._endpoints is None:
            raise RuntimeError("the engine is not started")
        return self._endpoints

    @property
    def control_endpoint(self) -> str:
        return local_endpoint(self.endpoints.control)

    def source(self, worker_id: str, topic: str = "") -> EngineSource:
        """Where a router subscribes to every rank of this engine."""
        return EngineSource.from_rank_endpoints(
            worker_id,
            [
                (local_endpoint(r.endpoint), None if r.replay_endpoint is None else local_endpoint(r.replay_endpoint))
                for r in self.endpoints.ranks
            ],
            topic,
        )

    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def logs(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def kill(self) -> None:
        """SIGKILL, and reap."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=10)

    def stop(self, timeout: float = 10.0) -> None:
        """SIGTERM (the server flushes its publishers), SIGKILL past ``timeout``."""
        proc = self.proc
        if proc is None or proc.poll() is not None:
            return
        proc.terminate()
        try:
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.kill()
