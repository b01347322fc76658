"""The reference engine server in a container on the project's Docker network."""

from __future__ import annotations

from kvwire.subscriber import EngineSource

from . import docker_env as de
from .harness import Engine, EngineSpec

PORT, REPLAY_PORT, CONTROL_PORT = 5557, 5657, 5757


class DockerEngine(Engine):
    """Faults are Docker's own: SIGKILL, pause, network disconnect."""

    def __init__(self, spec: EngineSpec, net: de.ProjectNetwork) -> None:
        super().__init__(spec)
        self.net = net
        self.node: de.Node | None = None

    @property
    def ip(self) -> str:
        assert self.node is not None, "engine not started"
        return self.node.ip

    @property
    def control_endpoint(self) -> str:
        return f"tcp://{self.ip}:{CONTROL_PORT}"

    def source(self) -> EngineSource:
        return EngineSource(
            self.worker_id,
            f"tcp://{self.ip}:{PORT}",
            f"tcp://{self.ip}:{REPLAY_PORT}",
            ranks=self.spec.ranks,
        )

    def start(self) -> None:
        command = ["python", *self.spec.args("0.0.0.0", PORT, REPLAY_PORT, CONTROL_PORT)]
        self.node = self.net.start(
            self.worker_id, command, env={"PYTHONUNBUFFERED": "1"}, wait_port=CONTROL_PORT, wait_timeout=60
        )
        self.wait_ready()

    def kill(self) -> None:
        assert self.node is not None
        self.node.kill()
        self.reset_client()

    def restart(self) -> None:
        assert self.node is not None
        self.node.start()
        self.node.wait_for_tcp(CONTROL_PORT, 60)
        self.wait_ready()

    def pause(self) -> None:
        assert self.node is not None
        self.node.pause()

    def resume(self) -> None:
        assert self.node is not None
        self.node.unpause()

    def disconnect(self) -> None:
        assert self.node is not None
        self.node.disconnect()

    def reconnect(self) -> None:
        assert self.node is not None
        self.node.connect()

    def logs(self) -> str:
        return "" if self.node is None else self.node.logs()

    def stop(self) -> None:
        self.reset_client()
