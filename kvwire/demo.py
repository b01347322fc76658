"""``make demo``: KV-aware routing over live engines, against round robin and an oracle.

Starts two reference engine servers with two data-parallel ranks each as
local processes on loopback, a router (a :class:`Subscriber` feeding a
:class:`PrefixIndex`, deciding with :class:`KvRouter`), and replays the same
seeded chat-like workload under three policies:

- ``kv-aware``: :class:`KvRouter` on what the events told the index;
- ``round-robin``: ignores the caches;
- ``oracle``: asks every engine rank directly how much of the prompt it holds,
  with the same cost function as ``kv-aware``.

It prints a live view of the ranks while it runs, then the prefix-cache hit
rate of each policy (share of prompt blocks served from cache), and writes a
plot of hit rate over time. Needs no Docker.
"""

from __future__ import annotations

import argparse
import itertools
import os
import sys
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from pathlib import Path

from kvwire.prefix_index import KvRouter, Load, PrefixIndex
from kvwire.reference.control import ControlClient
from kvwire.reference.launch import EngineProcess
from kvwire.reference.serve import EngineConfig
from kvwire.reference.workload import SyntheticWorkload, WorkloadConfig
from kvwire.subscriber import Subscriber
from kvwire.subscriber.view import WatchView

__all__ = ["main"]

RankKey = tuple[str, int]
BLOCK_SIZE = 16
TARGET = 0.95


@dataclass
class PolicyRun:
    """What one policy achieved on the workload."""

    name: str
    prompt_blocks: int = 0
    cached_blocks: int = 0
    timeline: list[tuple[int, float]] = field(default_factory=list)

    @property
    def hit_rate(self) -> float:
        return self.cached_blocks / self.prompt_blocks if self.prompt_blocks else 0.0


Chooser = Callable[[list[int], dict[RankKey, Load]], RankKey]


class Cluster:
    """The engines (by worker id), their control clients, and the router following them."""

    def __init__(self, engines: dict[str, EngineProcess], clients: dict[str, ControlClient]) -> None:
        self.clients = clients
        self.index = PrefixIndex(BLOCK_SIZE)
        self.subscriber = Subscriber([e.source(w) for w, e in engines.items()], self.index)
        self.keys: list[RankKey] = [
            (w, r) for w, e in engines.items() for r in range(e.config.ranks)
        ]
        self.router = KvRouter(self.index, rank_states=self.subscriber)

    def reset_all(self) -> None:
        """Clear every rank's cache and wait until the index agrees (it holds nothing)."""
        for worker, rank in self.keys:
            self.clients[worker].reset(rank)
        deadline = time.monotonic() + 20.0
        while any(self.index.blocks(*k) for k in self.keys):
            if time.monotonic() > deadline:
                raise RuntimeError("the index did not see the engines' resets in time")
            time.sleep(0.01)


def _run_policy(
    cluster: Cluster,
    name: str,
    choose: Chooser,
    requests: int,
    seed: int,
    in_flight: int,
    view: LiveView,
) -> PolicyRun:
    cluster.reset_all()
    run = PolicyRun(name)
    view.policy = name
    workload = SyntheticWorkload(WorkloadConfig(seed=seed, block_size=BLOCK_SIZE, system_prompt_blocks=4))
    # Requests in flight: each finishes after ``in_flight`` later requests arrive,
    # wherever it was routed; a rank's load is the blocks of its requests in flight.
    flight: deque[tuple[RankKey, str, int]] = deque()
    load: dict[RankKey, int] = dict.fromkeys(cluster.keys, 0)
    window: deque[tuple[int, int]] = deque(maxlen=50)
    for i in range(requests):
        req = workload.next_request()
        while len(flight) >= in_flight:
            done, rid, blocks = flight.popleft()
            cluster.clients[done[0]].release(done[1], rid)
            load[done] -= blocks
        key = choose(req.token_ids, {k: Load(0, load[k]) for k in cluster.keys})
        worker, rank = key
        admitted = cluster.clients[worker].submit(rank, req.request_id, req.token_ids)
        blocks = -(-len(req.token_ids) // BLOCK_SIZE)
        flight.append((key, req.request_id, blocks))
        load[key] += blocks
        run.prompt_blocks += admitted.prompt_blocks
        run.cached_blocks += admitted.cached_blocks
        window.append((admitted.prompt_blocks, admitted.cached_blocks))
        total = sum(p for p, _ in window)
        run.timeline.append((i, sum(c for _, c in window) / total if total else 0.0))
        view.requests += 1
    return run


def _oracle(cluster: Cluster, router: KvRouter) -> Chooser:
    """The same cost as KvRouter, with the cached prefix read from each engine's truth."""

    def choose(tokens: list[int], loads: dict[RankKey, Load]) -> RankKey:
        prompt = len(tokens) // BLOCK_SIZE

        def cost(key: RankKey) -> tuple[float, int, RankKey]:
            cached = cluster.clients[key[0]].probe(key[1], tokens)
            decode = loads[key].decode_blocks
            prefill = router.prefill_weight * max(prompt - router.overlap_credit * cached, 0)
            return prefill + decode, decode, key

        return min(loads, key=cost)

    return choose


class LiveView:
    """Prints ``kvwire watch``'s table of the ranks once a second."""

    def __init__(self, cluster: Cluster, interval: float = 1.0) -> None:
        self.cluster = cluster
        self.interval = interval
        self.policy = "-"
        self.requests = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="kvwire-demo-view", daemon=True)
        self._view = WatchView("")
        self._tty = sys.stdout.isatty()

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)

    def _loop(self) -> None:
        while not self._stop.wait(self.interval):
            self._view.title = f"policy {self.policy:<12} requests {self.requests:>5}"
            lines = self._view.render(self.cluster.subscriber.status(), self.cluster.index.rank_blocks)
            if self._tty:
                self._view.redraw(sys.stdout, lines)
            else:
                sys.stdout.write("\n".join(lines) + "\n")
                sys.stdout.flush()


def _plot(runs: list[PolicyRun], path: Path) -> Path | None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no plot (pip install 'kvwire[demo]')")
        return None
    fig, ax = plt.subplots(figsize=(8, 4.5))
    for run in runs:
        xs = [i for i, _ in run.timeline]
        ys = [100 * h for _, h in run.timeline]
        ax.plot(xs, ys, label=f"{run.name} ({100 * run.hit_rate:.1f}%)")
    ax.set_xlabel("request")
    ax.set_ylabel("prefix-cache hit rate, last 50 requests (%)")
    ax.set_title("kvwire demo: 2 engines x 2 ranks, same seeded workload")
    ax.set_ylim(0, 100)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


@contextmanager
def _cluster(workers: list[str], num_blocks: int, log_dir: Path) -> Iterator[Cluster]:
    """Two-rank engine servers on loopback, on ports they pick themselves, and the router."""
    config = EngineConfig(ranks=2, num_blocks=num_blocks, block_size=BLOCK_SIZE)
    engines = {w: EngineProcess(config, log_dir / f"{w}.log") for w in workers}
    with ExitStack() as stack:
        for e in engines.values():
            e.spawn()
            stack.callback(e.stop)
        clients = {}
        for worker, e in engines.items():
            e.wait_ready(60.0)
            client = ControlClient(e.control_endpoint, timeout=10.0)
            stack.callback(client.close)
            clients[worker] = client
        cluster = Cluster(engines, clients)
        cluster.subscriber.start()
        stack.callback(cluster.subscriber.stop)
        yield cluster


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m kvwire.demo", description="kvwire routing demo")
    p.add_argument("--requests", type=int, default=500, help="requests per policy")
    p.add_argument("--seed", type=int, default=7)
    p.add_argument("--num-blocks", type=int, default=512, help="KV blocks per rank")
    p.add_argument("--in-flight", type=int, default=8, help="requests being decoded at once")
    p.add_argument("--out", type=Path, default=Path("out"), help="where the plot and logs go")
    args = p.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    print("starting 2 engines x 2 ranks on loopback, and the router ...", flush=True)
    with _cluster(["engine-a", "engine-b"], args.num_blocks, args.out) as cluster:
        view = LiveView(cluster)
        view.start()
        turn = itertools.cycle(cluster.keys)
        try:
            policies: list[tuple[str, Chooser]] = [
                ("kv-aware", lambda tokens, loads: cluster.router.choose(tokens, loads).target),
                ("round-robin", lambda tokens, loads: next(turn)),
                ("oracle", _oracle(cluster, cluster.router)),
            ]
            runs = [
                _run_policy(cluster, name, choose, args.requests, args.seed, args.in_flight, view)
                for name, choose in policies
            ]
        finally:
            view.stop()
        final = cluster.subscriber.status()
    oracle = runs[-1].hit_rate or 1.0
    print(f"\nprefix-cache hit rate over {args.requests} requests per policy (same workload):")
    print(f"{'policy':<13}{'hit rate':>9}{'of oracle':>11}")
    for run in runs:
        print(f"{run.name:<13}{100 * run.hit_rate:>8.1f}%{100 * run.hit_rate / oracle:>10.1f}%")
    kv = runs[0].hit_rate / oracle
    verdict = "met" if kv >= TARGET else "MISSED"
    print(f"target: kv-aware >= {100 * TARGET:.0f}% of the oracle: {verdict} ({100 * kv:.1f}%)")
    gaps = sum(s.counters.gaps for s in final)
    print(f"ranks: {', '.join(f'{s.worker_id}/{s.rank} {s.state.name}' for s in final)}; gaps seen: {gaps}")
    plot = _plot(runs, args.out / "demo-hit-rate.png")
    if plot is not None:
        print(f"plot: {plot}")
    print(f"done in {time.monotonic() - started:.1f} s")
    return 0 if kv >= TARGET else 1


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    raise SystemExit(main())
