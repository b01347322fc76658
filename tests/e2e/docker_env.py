"""Docker helpers for kvwire's containerized end-to-end tests (no tests here).

Typical use (e.g. in a conftest fixture)::

    from tests.e2e import docker_env as de      # or: import docker_env as de

    reason = de.engine_unavailable_reason()      # None when usable
    if reason: pytest.skip(reason)
    de.ensure_engine()                           # starts dockerd if needed
    de.ensure_image(wheel_dir)                   # kvwire-engine:latest, cached
    with de.ProjectNetwork() as net:
        a = net.start("node-a", ["python", "-m", "kvwire.server", "--port", "7000"],
                      env={"KVWIRE_LOG": "debug"})
        de.wait_for_tcp(a.ip, 7000, timeout=30)  # the host reaches a.ip directly
        a.kill(); a.start(); a.pause(); a.unpause()
        a.disconnect(); a.connect()              # same IP again
        print(a.logs())
    # everything created above is removed here, also when the body raised

What was measured on the dev machine (Debian bookworm VM, kernel 6.18,
cgroup v1, Debian's docker.io 20.10, dockerd started by
scripts/docker/ensure-dockerd.sh with --iptables=false --ip-forward=false):

* Host -> container works on every bridge network: the bridge gets the gateway
  address (e.g. 172.18.0.1) on the host, so the host connects to a container's
  IP directly; no port publishing (and no docker-proxy) is needed.
* ``internal=True`` does NOT remove the container's default route when
  dockerd runs with --iptables=false (docker 20.10 implements "internal" with
  iptables rules only): containers still get ``default via <gateway>``.  What
  stops their packets from leaving the machine is that the host does not
  forward (net.ipv4.ip_forward=0, and dockerd is told not to turn it on) and
  there is no NAT.  As a second, independent guard this module deletes the
  default route inside every container it starts, again after every
  start/connect (``nsenter -n ip route del default`` from the host, as root).
  After that a container's routing table holds only its /24 on the project
  network: ``ip route get 1.1.1.1`` says "Network is unreachable" and a
  connect() to any outside address fails at once with ENETUNREACH, while
  container<->container and host<->container traffic work.  A tcpdump on the
  host's uplink during these checks saw no packet from a container address.
  The network is still created with internal=True so that on a daemon with
  iptables enabled docker's own isolation applies too.
* Containers resolve each other by their short name (a network alias) through
  docker's embedded DNS.  A lookup of any OTHER name hangs ~20 s and then
  fails: tests must use the short names or the IPs this module returns.
* kill (SIGKILL) stops the container in ~0.1 s (State.ExitCode 137); the
  kernel closes its sockets, so peers see EOF/RST.  start() restarts the same
  container (same filesystem, same static IP, logs appended) in ~0.3 s.
  Killing a paused container works too.
* pause/unpause use the cgroup freezer; a paused container keeps its IP and
  sockets, connections to it just stall (no RST), like a hung process; new
  connects still complete (the kernel answers into the listen backlog) and
  buffered data is processed after unpause.
* disconnect removes the container's interface (only `lo` is left): its peers
  see silence (no RST, no FIN), their connections stall until their own
  timeouts; inside, connects fail with ENETUNREACH.  connect() puts it back
  with the same IP (interface now named eth1) and established TCP connections
  that have not timed out resume (retransmission).
* Timings (overlay2): create+start+route fix ~0.35 s per container; host sees
  the port ~0.05 s later; pause/unpause/disconnect/connect 0.02-0.06 s.  With
  the vfs storage driver creating a container takes ~5-6 s instead.
"""

from __future__ import annotations

import atexit
import contextlib
import ipaddress
import os
import random
import socket
import subprocess
import threading
import time
import uuid
from collections.abc import Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

from tests.waiting import wait_for

REPO_ROOT = Path(__file__).resolve().parents[2]
SCRIPTS_DIR = REPO_ROOT / "scripts" / "docker"
ENSURE_DOCKERD = SCRIPTS_DIR / "ensure-dockerd.sh"
BUILD_IMAGE = SCRIPTS_DIR / "build-image.sh"

DEFAULT_IMAGE = "kvwire-engine:latest"
LABEL = "kvwire.e2e"              # value "1" on everything this module creates
OWNER_LABEL = "kvwire.e2e.owner"  # "<hostname>:<pid>" of the creating process
NAME_PREFIX = "kvwire-e2e"
# Project networks are /24s picked from here, away from docker's defaults
# (172.17-172.2x) and from anything routed on the host.
SUBNET_POOL = ipaddress.ip_network("172.30.0.0/15")

_OWNER = f"{socket.gethostname()}:{os.getpid()}"
_lock = threading.Lock()
_client = None
_live_networks: set[ProjectNetwork] = set()


# --------------------------------------------------------------------------- engine / image


def _run_script(args: Sequence[str], timeout: float, what: str) -> str:
    try:
        proc = subprocess.run(
            ["bash", *map(str, args)],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            timeout=timeout,
        )
    except subprocess.TimeoutExpired as exc:
        out = exc.stdout or ""
        if isinstance(out, bytes):
            out = out.decode(errors="replace")
        raise RuntimeError(f"{what} timed out after {timeout:.0f}s:\n{out[-4000:]}") from None
    except OSError as exc:
        raise RuntimeError(f"{what} could not run: {exc}") from None
    if proc.returncode != 0:
        raise RuntimeError(f"{what} failed (exit {proc.returncode}):\n{proc.stdout[-4000:]}")
    return proc.stdout


def ensure_engine(timeout: float = 300) -> None:
    """Make sure a docker engine answers (installs/starts dockerd if needed).

    Raises RuntimeError with the script's output (incl. the tail of the
    dockerd log) when it cannot.
    """
    _run_script([ENSURE_DOCKERD], timeout, "scripts/docker/ensure-dockerd.sh")
    try:
        client().ping()
    except Exception as exc:
        raise RuntimeError(f"docker engine started but the Python SDK cannot talk to it: {exc}") from exc


def ensure_image(wheel_dir: os.PathLike | str, image: str = DEFAULT_IMAGE, timeout: float = 1200) -> str:
    """Build (or reuse the cached) test image with every wheel in wheel_dir.

    Returns the image name.  Raises RuntimeError on failure.
    """
    wheel_dir = Path(wheel_dir)
    if not wheel_dir.is_dir():
        raise RuntimeError(f"wheel dir {wheel_dir} does not exist")
    _run_script([BUILD_IMAGE, wheel_dir, image], timeout, "scripts/docker/build-image.sh")
    return image


def engine_unavailable_reason() -> str | None:
    """None when containerized tests can run here, else a reason to skip them."""
    try:
        import docker  # noqa: F401
    except ImportError:
        return "the 'docker' Python package is not installed"
    if os.geteuid() != 0:
        return "containerized e2e tests need root (dockerd, nsenter)"
    if not ENSURE_DOCKERD.exists():
        return f"{ENSURE_DOCKERD} is missing"
    return None


def client():
    """Shared docker SDK client (API version negotiated with the daemon)."""
    global _client
    with _lock:
        if _client is None:
            import docker

            # Generous timeout: creating a container on the vfs driver copies
            # the whole image and takes seconds.
            _client = docker.from_env(timeout=180)
        return _client


# --------------------------------------------------------------------------- cleanup


def _pid_alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            state = f.read().rsplit(")", 1)[1].split()[0]
        return state not in ("Z", "X")
    except (OSError, IndexError):
        return False


def _is_leftover(labels: Mapping[str, str] | None) -> bool:
    """Created by a kvwire e2e process that is gone (or by an unknown one)."""
    owner = (labels or {}).get(OWNER_LABEL, "")
    host, _, pid = owner.rpartition(":")
    if host != socket.gethostname() or not pid.isdigit():
        return True
    return not _pid_alive(int(pid))


def sweep_leftovers(everything: bool = False) -> list[str]:
    """Remove containers and networks labelled kvwire.e2e=1 whose creating
    process is gone (all of them with everything=True).  Returns their names."""
    c = client()
    removed: list[str] = []
    for ctr in c.containers.list(all=True, filters={"label": f"{LABEL}=1"}):
        if everything or _is_leftover(ctr.labels):
            with contextlib.suppress(Exception):
                ctr.remove(force=True, v=True)
                removed.append(ctr.name)
    for net in c.networks.list(filters={"label": f"{LABEL}=1"}):
        net_labels = net.attrs.get("Labels") or {}
        if everything or _is_leftover(net_labels):
            with contextlib.suppress(Exception):
                net.reload()
                for ctr in net.containers:
                    with contextlib.suppress(Exception):
                        net.disconnect(ctr, force=True)
                net.remove()
                removed.append(net.name)
    return removed


@atexit.register
def _cleanup_at_exit() -> None:
    for net in list(_live_networks):
        with contextlib.suppress(Exception):
            net.close()


# --------------------------------------------------------------------------- waiting


def wait_for_tcp(host: str, port: int, timeout: float = 30.0) -> float:
    """Wait until host:port accepts a TCP connection (deadline-based poll).
    Returns the seconds it took."""
    t0 = time.monotonic()

    def attempt() -> bool:
        with socket.create_connection((host, port), timeout=1.0):
            return True

    wait_for(attempt, timeout, f"tcp {host}:{port}", poll=0.05, retry_on=(OSError,))
    return time.monotonic() - t0


# --------------------------------------------------------------------------- containers


class Node:
    """A container on a ProjectNetwork, with a static IP on that network."""

    def __init__(self, net: ProjectNetwork, name: str, container, ip: str):
        self.net = net
        self.name = name                # short name == DNS alias on the network
        self.container = container      # docker.models.containers.Container
        self.ip = ip                    # static, kept across restarts/reconnects
        self.connected = True

    def __repr__(self) -> str:
        return f"<Node {self.name} {self.ip} {self.status}>"

    # -- state
    def reload(self) -> None:
        self.container.reload()

    @property
    def status(self) -> str:
        """created / running / paused / exited / ..."""
        with contextlib.suppress(Exception):
            self.container.reload()
        return self.container.status

    @property
    def exit_code(self) -> int | None:
        self.container.reload()
        st = self.container.attrs["State"]
        return None if st.get("Running") else st.get("ExitCode")

    @property
    def pid(self) -> int:
        """Host pid of the container's init process (0 when not running)."""
        self.container.reload()
        return int(self.container.attrs["State"]["Pid"])

    def wait_status(self, *statuses: str, timeout: float = 30.0) -> str:
        return wait_for(lambda: self.status in statuses and self.status, timeout,
                        f"{self.name} status in {statuses}", poll=0.05, retry_on=(Exception,))

    # -- lifecycle
    def start(self, timeout: float = 60.0, expect_running: bool = True) -> Node:
        """(Re)start this same container (after kill/stop or when created).

        Raises RuntimeError (with the container's logs) when expect_running and
        the command has already exited."""
        self.container.start()
        status = self.wait_status("running", "exited", "dead", timeout=timeout)
        if status == "running" and self.connected:
            self.net._harden(self)
        elif status != "running" and expect_running:
            raise RuntimeError(f"container {self.name} exited at once (code {self.exit_code}):\n"
                               f"{self.logs(tail=50)}")
        return self

    def kill(self, signal: str | int = "SIGKILL", timeout: float = 30.0) -> None:
        """Send a signal (SIGKILL by default) and, for SIGKILL, wait until exited."""
        self.container.kill(signal=signal)
        if signal in ("SIGKILL", "KILL", 9):
            self.wait_status("exited", "dead", timeout=timeout)

    def stop(self, timeout: int = 10) -> None:
        """SIGTERM, then SIGKILL after `timeout` seconds."""
        self.container.stop(timeout=timeout)

    def restart(self, timeout: float = 60.0) -> Node:
        if self.status in ("running", "paused", "restarting"):
            if self.status == "paused":
                self.unpause()
            self.kill()
        return self.start(timeout=timeout)

    def pause(self) -> None:
        self.container.pause()

    def unpause(self) -> None:
        self.container.unpause()

    # -- network partitions
    def disconnect(self) -> None:
        """Detach from the project network (the container keeps running)."""
        self.net.network.disconnect(self.container, force=True)
        self.connected = False

    def connect(self) -> None:
        """Re-attach with the same IP and alias."""
        self.net.network.connect(self.container, ipv4_address=self.ip, aliases=[self.name])
        self.connected = True
        if self.status == "running":
            self.net._harden(self)

    # -- I/O
    def logs(self, tail: int | str = "all") -> str:
        return self.container.logs(stdout=True, stderr=True, tail=tail).decode(errors="replace")

    def exec(self, cmd: str | Sequence[str], env: Mapping[str, str] | None = None,
             user: str = "") -> tuple[int, str]:
        """Run cmd inside the (running) container; returns (exit code, output)."""
        res = self.container.exec_run(cmd, environment=dict(env or {}), user=user, demux=False)
        return res.exit_code, (res.output or b"").decode(errors="replace")

    def wait_for_tcp(self, port: int, timeout: float = 30.0) -> float:
        return wait_for_tcp(self.ip, port, timeout)

    def remove(self) -> None:
        with contextlib.suppress(Exception):
            self.container.remove(force=True, v=True)
        self.net.nodes.pop(self.name, None)


class ProjectNetwork:
    """Context manager: a uniquely named bridge network (internal=True) plus the
    containers started on it; all of them are removed on exit, also after a
    failure, and at interpreter exit as a last resort.  Leftovers of earlier,
    dead test processes (label kvwire.e2e=1) are swept on entry."""

    def __init__(self, image: str = DEFAULT_IMAGE, prefix: str = NAME_PREFIX,
                 sweep: bool = True, internal: bool = True):
        self.image = image
        self.prefix = prefix
        self.sweep = sweep
        self.internal = internal
        self.name = f"{prefix}-{uuid.uuid4().hex[:8]}"
        self.network = None
        self.subnet: ipaddress.IPv4Network | None = None
        self.gateway: str | None = None
        self.nodes: dict[str, Node] = {}
        self._next_host = 2

    # -- context
    def __enter__(self) -> ProjectNetwork:
        try:
            self.open()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _labels(self) -> dict[str, str]:
        return {LABEL: "1", OWNER_LABEL: _OWNER, f"{LABEL}.network": self.name}

    def open(self) -> None:
        c = client()
        if self.sweep:
            sweep_leftovers()
        try:
            c.images.get(self.image)
        except Exception as exc:  # docker.errors.ImageNotFound; never pull
            raise RuntimeError(
                f"image {self.image} not found locally; build it with ensure_image() "
                f"(nothing is ever pulled): {exc}") from None
        import docker

        last: Exception | None = None
        for subnet in self._candidate_subnets():
            ipam = docker.types.IPAMConfig(pool_configs=[docker.types.IPAMPool(
                subnet=str(subnet), gateway=str(subnet.network_address + 1))])
            try:
                self.network = c.networks.create(
                    self.name, driver="bridge", internal=self.internal, ipam=ipam,
                    labels=self._labels(), check_duplicate=True)
            except docker.errors.APIError as exc:  # pool overlaps (racing runs)
                last = exc
                continue
            self.subnet = subnet
            self.gateway = str(subnet.network_address + 1)
            _live_networks.add(self)
            return
        raise RuntimeError(f"could not create a project network: {last}")

    def close(self) -> None:
        for node in list(self.nodes.values()):
            with contextlib.suppress(Exception):
                node.container.remove(force=True, v=True)
        self.nodes.clear()
        if self.network is not None:
            with contextlib.suppress(Exception):
                self.network.remove()
            self.network = None
        _live_networks.discard(self)

    def _candidate_subnets(self) -> Iterable[ipaddress.IPv4Network]:
        used: list[ipaddress.IPv4Network] = []
        for net in client().networks.list():
            for cfg in (net.attrs.get("IPAM") or {}).get("Config") or []:
                with contextlib.suppress(Exception):
                    net_ = ipaddress.ip_network(cfg["Subnet"], strict=False)
                    if net_.version == 4:
                        used.append(net_)
        used.extend(_host_routes())
        subnets = list(SUBNET_POOL.subnets(new_prefix=24))
        random.shuffle(subnets)
        return (s for s in subnets if not any(s.overlaps(u) for u in used if u.prefixlen > 0))

    # -- containers
    def start(self, name: str, command: str | Sequence[str] | None = None,
              env: Mapping[str, str] | None = None, *, image: str | None = None,
              volumes: Mapping[str, Mapping[str, str]] | None = None,
              workdir: str | None = None, init: bool = True,
              wait_port: int | None = None, wait_timeout: float = 30.0,
              expect_running: bool = True, **create_kwargs: Any) -> Node:
        """Create and start a container `name` on this network; returns its Node
        (node.ip is its static address, reachable from the host).

        `volumes` is the docker SDK's {host_path: {"bind": path, "mode": "ro"}}.
        `init=True` runs docker's tini as PID 1 (signals forwarded, zombies
        reaped).  With wait_port, also waits until node.ip:wait_port accepts TCP.
        Extra keyword arguments go to docker's containers.create (e.g.
        mem_limit, cap_add, stop_signal).  A command that exits at once raises
        RuntimeError with its logs unless expect_running=False.
        """
        if self.network is None:
            raise RuntimeError("network is not open (use `with ProjectNetwork() as net:`)")
        if name in self.nodes:
            raise ValueError(f"a container named {name!r} already exists on {self.name}")
        assert self.subnet is not None
        ip = str(self.subnet.network_address + self._next_host)
        self._next_host += 1
        # testcontainers creates and starts the container (its Ryuk reaper is
        # off: it would pull an image; this module labels and sweeps instead).
        os.environ.setdefault("TESTCONTAINERS_RYUK_DISABLED", "true")
        from testcontainers.core.container import DockerContainer

        c = client()
        endpoint = c.api.create_endpoint_config(aliases=[name], ipv4_address=ip)
        tc = DockerContainer(image or self.image)
        tc.with_name(f"{self.name}-{name}")
        if command is not None:
            tc.with_command(command)
        for key, value in (env or {}).items():
            tc.with_env(key, value)
        tc.with_kwargs(
            hostname=name,
            labels={**self._labels(), f"{LABEL}.node": name},
            network=self.network.name,
            networking_config={self.network.name: endpoint},
            working_dir=workdir,
            init=init,
            **create_kwargs,
        )
        for host_path, mount in (volumes or {}).items():
            tc.with_volume_mapping(host_path, mount["bind"], mount.get("mode", "ro"))
        tc.start()
        node = Node(self, name, tc.get_wrapped_container(), ip)
        self.nodes[name] = node
        status = node.wait_status("running", "exited", "dead", timeout=60)
        if status == "running":
            self._harden(node)
        elif expect_running:
            raise RuntimeError(f"container {node.name} exited at once (code {node.exit_code}):\n"
                               f"{node.logs(tail=50)}")
        if wait_port is not None:
            node.wait_for_tcp(wait_port, wait_timeout)
        return node

    def __getitem__(self, name: str) -> Node:
        return self.nodes[name]

    def logs(self) -> dict[str, str]:
        """All containers' logs, e.g. to print when a test failed."""
        out = {}
        for name, node in self.nodes.items():
            try:
                out[name] = node.logs()
            except Exception as exc:
                out[name] = f"<no logs: {exc}>"
        return out

    def _harden(self, node: Node) -> None:
        """Delete the default route inside the container, so that nothing it
        sends can be routed off this machine (see module docstring)."""
        pid = node.pid
        if not pid:
            return
        cmd = ["nsenter", "-t", str(pid), "-n", "ip", "-4", "route", "del", "default"]
        res = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        check = subprocess.run(["nsenter", "-t", str(pid), "-n", "ip", "-4", "route", "show", "default"],
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        if check.returncode != 0:
            if not _pid_alive(pid):
                return  # the container exited meanwhile
            raise RuntimeError(f"cannot inspect routes of {node.name}: {check.stdout.strip()}")
        if check.stdout.strip():
            raise RuntimeError(f"could not remove the default route of {node.name}: "
                               f"{res.stdout.strip()} / {check.stdout.strip()}")


def _host_routes() -> list[ipaddress.IPv4Network]:
    """IPv4 destinations routed on the host (from /proc/net/route)."""
    nets = []
    with contextlib.suppress(OSError), open("/proc/net/route") as f:
        next(f)
        for line in f:
            parts = line.split()
            dest = socket.inet_ntoa(int(parts[1], 16).to_bytes(4, "little"))
            mask = socket.inet_ntoa(int(parts[7], 16).to_bytes(4, "little"))
            with contextlib.suppress(ValueError):
                nets.append(ipaddress.ip_network(f"{dest}/{mask}", strict=False))
    # plus the host's DNS servers (they may sit behind the default route)
    with contextlib.suppress(OSError), open("/etc/resolv.conf") as f:
        for line in f:
            parts = line.split()
            if len(parts) >= 2 and parts[0] == "nameserver":
                with contextlib.suppress(ValueError):
                    net = ipaddress.ip_network(parts[1])
                    if net.version == 4:
                        nets.append(net)
    return nets


@contextlib.contextmanager
def project_network(image: str = DEFAULT_IMAGE, **kwargs: Any) -> Iterator[ProjectNetwork]:
    """Function form of ProjectNetwork."""
    with ProjectNetwork(image, **kwargs) as net:
        yield net
