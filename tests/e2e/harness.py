"""Fault scenarios shared by the loopback and the containerised end-to-end tests.

An :class:`Engine` is a reference engine server (``python -m
kvwire.reference.serve``) that drives itself with the synthetic workload; a
:class:`Router` follows every rank with a :class:`Subscriber` feeding a
:class:`PrefixIndex`. After each fault the traffic stops and nothing else is
published: the publishers' heartbeats alone must reveal a lost tail. Then
:func:`converge` polls until every rank has caught up with its engine's
latest seq and is either SYNCED with exactly the engine's blocks, or PARTIAL
with no block the engine does not hold; the scenarios ask for SYNCED.
"""

from __future__ import annotations

import abc
import contextlib
import signal
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvwire.prefix_index import PrefixIndex
from kvwire.publisher import PublisherConfig
from kvwire.reference.control import ControlClient, ControlError
from kvwire.reference.launch import EngineProcess
from kvwire.reference.serve import EngineConfig
from kvwire.subscriber import EngineSource, RankState, Subscriber, SubscriberConfig
from tests.waiting import wait_for as wait_for  # the scenarios wait through it

from .faultproxy import FaultProxy

REPO = Path(__file__).resolve().parents[2]
BLOCK_SIZE = 16
CONVERGE_TARGET_S = 2.0


@dataclass(frozen=True)
class EngineSpec:
    """How an engine server is started for a scenario."""

    worker_id: str
    ranks: int = 2
    num_blocks: int = 96
    buffer_steps: int = PublisherConfig().buffer_steps
    hwm: int = PublisherConfig().hwm
    drive_rate: float = 60.0
    drive_seed: int = 0
    drive_hold: int = 3

    def config(self, host: str, port: int = 0, replay_port: int = 0, control_port: int = 0) -> EngineConfig:
        """The engine's configuration; port 0: an ephemeral port, reported once bound."""
        return EngineConfig(
            ranks=self.ranks,
            host=host,
            port=port,
            replay_port=replay_port,
            control_port=control_port,
            num_blocks=self.num_blocks,
            block_size=BLOCK_SIZE,
            publisher=PublisherConfig(buffer_steps=self.buffer_steps, hwm=self.hwm),
            device="cpu",
        )

    def drive_args(self) -> list[str]:
        return [
            "--drive-rate", str(self.drive_rate),
            "--drive-seed", str(self.drive_seed),
            "--drive-hold", str(self.drive_hold),
        ]  # fmt: skip

    def args(self, host: str, port: int, replay_port: int, control_port: int) -> list[str]:
        """``python`` arguments that start the engine on these ports."""
        config = self.config(host, port, replay_port, control_port)
        return ["-m", "kvwire.reference.serve", *config.argv(), *self.drive_args()]


class Engine(abc.ABC):
    """One engine server and the faults that can be done to it."""

    def __init__(self, spec: EngineSpec) -> None:
        self.spec = spec
        self._client: ControlClient | None = None

    @property
    def worker_id(self) -> str:
        return self.spec.worker_id

    @abc.abstractmethod
    def source(self) -> EngineSource:
        """Where a router subscribes to this engine."""

    @property
    @abc.abstractmethod
    def control_endpoint(self) -> str: ...

    def client(self) -> ControlClient:
        if self._client is None:
            self._client = ControlClient(self.control_endpoint, timeout=5.0)
        return self._client

    def reset_client(self) -> None:
        if self._client is not None:
            self._client.close()
            self._client = None

    def wait_ready(self, timeout: float = 60.0) -> None:
        """Poll the control endpoint until the engine answers."""
        try:
            self.client().wait_ready(timeout)
        except ControlError as exc:
            raise RuntimeError(f"engine {self.worker_id} not ready: {exc}\n{self.logs()}") from exc

    @abc.abstractmethod
    def start(self) -> None: ...

    @abc.abstractmethod
    def kill(self) -> None: ...

    @abc.abstractmethod
    def restart(self) -> None:
        """Start again after :meth:`kill` (same ports / address)."""

    @abc.abstractmethod
    def pause(self) -> None: ...

    @abc.abstractmethod
    def resume(self) -> None: ...

    @abc.abstractmethod
    def disconnect(self) -> None: ...

    @abc.abstractmethod
    def reconnect(self) -> None: ...

    @abc.abstractmethod
    def logs(self) -> str: ...

    @abc.abstractmethod
    def stop(self) -> None: ...


class LocalEngine(Engine):
    """An engine server as a local process; network faults cut a TCP proxy in front of it.

    The engine binds ephemeral ports (new ones after a restart); the proxies
    keep theirs and forward to wherever the engine bound last.
    """

    def __init__(self, spec: EngineSpec, log_dir: Path) -> None:
        super().__init__(spec)
        self.process = EngineProcess(
            spec.config("127.0.0.1"), log_dir / f"{spec.worker_id}.log", extra_args=spec.drive_args(), cwd=REPO
        )
        self.proxies = [FaultProxy().start() for _ in range(spec.ranks)]
        self.replay_proxies = [FaultProxy().start() for _ in range(spec.ranks)]

    @property
    def control_endpoint(self) -> str:
        return self.process.control_endpoint

    def source(self) -> EngineSource:
        return EngineSource.from_rank_endpoints(
            self.worker_id,
            [
                (f"tcp://127.0.0.1:{p.listen_port}", f"tcp://127.0.0.1:{q.listen_port}")
                for p, q in zip(self.proxies, self.replay_proxies, strict=True)
            ],
        )

    def start(self) -> None:
        bound = self.process.start()
        for rank, proxy, replay in zip(bound.ranks, self.proxies, self.replay_proxies, strict=True):
            assert rank.replay_endpoint is not None
            proxy.target_port = _port(rank.endpoint)
            replay.target_port = _port(rank.replay_endpoint)
        self.wait_ready()

    def kill(self) -> None:
        self.process.kill()
        self.reset_client()

    def restart(self) -> None:
        self.start()

    def _signal(self, signum: int) -> None:
        assert self.process.proc is not None
        self.process.proc.send_signal(signum)

    def pause(self) -> None:
        self._signal(signal.SIGSTOP)

    def resume(self) -> None:
        self._signal(signal.SIGCONT)

    def disconnect(self) -> None:
        for p in self.proxies + self.replay_proxies:
            p.cut()

    def reconnect(self) -> None:
        for p in self.proxies + self.replay_proxies:
            p.restore()

    def logs(self) -> str:
        return self.process.logs()

    def stop(self) -> None:
        if self.process.running():
            self._signal(signal.SIGCONT)
        self.process.stop()
        self.reset_client()
        for p in self.proxies + self.replay_proxies:
            p.close()


def _port(endpoint: str) -> int:
    return int(endpoint.rpartition(":")[2])


@dataclass
class Router:
    """The router under test: a subscriber feeding a prefix index, on its own thread."""

    engines: list[Engine]
    config: SubscriberConfig = field(default_factory=SubscriberConfig)
    index: PrefixIndex = field(init=False)
    subscriber: Subscriber = field(init=False)

    def __post_init__(self) -> None:
        self.index = PrefixIndex(BLOCK_SIZE)
        self.subscriber = Subscriber([e.source() for e in self.engines], self.index, config=self.config)

    started: bool = field(init=False, default=False)

    def start(self) -> Router:
        self.subscriber.start()
        self.started = True
        return self

    def stop(self) -> None:
        if self.started:
            self.subscriber.stop()
            self.started = False

    def status(self) -> dict[tuple[str, int], Any]:
        return {(s.worker_id, s.rank): s for s in self.subscriber.status()}


@dataclass
class Convergence:
    worker_id: str
    rank: int
    state: RankState
    seconds: float
    blocks: int


def quiesce(engines: list[Engine]) -> None:
    """Stop the traffic. Nothing more is published: a lost tail must show by itself."""
    for e in engines:
        e.client().drive(0)


def converge(router: Router, engines: list[Engine], since: float, timeout: float = 30.0) -> list[Convergence]:
    """Poll until every rank agrees with its engine; returns how long each took from ``since``."""
    done: dict[tuple[str, int], Convergence] = {}
    deadline = time.monotonic() + timeout
    problems: dict[tuple[str, int], str] = {}
    while time.monotonic() < deadline:
        status = router.status()
        for e in engines:
            for rank in range(e.spec.ranks):
                key = (e.worker_id, rank)
                if key in done:
                    continue
                truth = e.client().truth(rank)
                st = status.get(key)
                if st is None:
                    problems[key] = "the router reports no such rank"
                    continue
                held = router.index.blocks(e.worker_id, rank)
                engine_blocks = set(truth.hashes)
                caught_up = st.expected_seq == truth.last_seq + 1 and not st.replay_pending
                agrees = (st.state is RankState.SYNCED and held == engine_blocks) or (
                    st.state is RankState.PARTIAL and held <= engine_blocks
                )
                ok = caught_up and agrees
                if not ok:
                    problems[key] = (
                        f"state={st.state.name} expected_seq={st.expected_seq} "
                        f"engine_last_seq={truth.last_seq} index={len(held)} engine={len(engine_blocks)} "
                        f"extra={len(held - engine_blocks)} missing={len(engine_blocks - held)} "
                        f"reason={st.reason!r}"
                    )
                if ok:
                    done[key] = Convergence(e.worker_id, rank, st.state, time.monotonic() - since, len(held))
                    problems.pop(key, None)
        if len(done) == sum(e.spec.ranks for e in engines):
            return sorted(done.values(), key=lambda c: (c.worker_id, c.rank))
        time.sleep(0.05)  # a poll interval under a deadline, not synchronisation
    raise AssertionError(f"ranks did not converge within {timeout} s: {problems}")


REPORTS: list[str] = []
"""Every convergence line of this run; the e2e conftest prints them in pytest's summary."""


def report(name: str, results: list[Convergence]) -> None:
    for c in results:
        flag = "" if c.seconds <= CONVERGE_TARGET_S else f"  (over the {CONVERGE_TARGET_S} s target)"
        line = (
            f"[{name}] {c.worker_id}/rank{c.rank}: {c.state.name} after {c.seconds:.2f} s, "
            f"{c.blocks} blocks{flag}"
        )
        REPORTS.append(line)
        print(line)


def applied(router: Router, engine: Engine, batches: int) -> Callable[[], bool]:
    """True once the router applied at least ``batches`` batches of every rank of ``engine``."""

    def check() -> bool:
        st = router.status()
        return all(st[(engine.worker_id, r)].expected_seq >= batches for r in range(engine.spec.ranks))

    return check


@contextlib.contextmanager
def cluster(make: Callable[[EngineSpec], Engine], specs: list[EngineSpec], *, start_router: bool = True) -> Iterator[tuple[list[Engine], Router]]:
    engines: list[Engine] = []
    router: Router | None = None
    try:
        for spec in specs:
            engines.append(make(spec))
        for e in engines:
            e.start()
        router = Router(engines)
        if start_router:
            router.start()
        yield engines, router
    except BaseException:
        for e in engines:
            print(f"----- logs of {e.worker_id} -----\n{e.logs()[-4000:]}")
        raise
    finally:
        if router is not None:
            router.stop()
        for e in engines:
            e.stop()
