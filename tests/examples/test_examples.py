"""The examples do what they show: the engine integration's events rebuild its cache,
and the router proxy routes a cached prompt to its holder and a new one by load."""

from __future__ import annotations

import importlib.util
import json
import shutil
import subprocess
import sys
import tempfile
import threading
import urllib.error
import urllib.request
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

from kvwire.prefix_index import PrefixIndex
from kvwire.publisher import EventCollector, EventPublisher
from kvwire.subscriber import BlockSetSink, EngineSource, RankState, Subscriber
from kvwire.wire import KVEventBatch
from tests.waiting import wait_for

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def _load(name: str) -> ModuleType:
    """Import an example by path (``examples/`` is not a package)."""
    spec = importlib.util.spec_from_file_location(f"kvwire_example_{name}", EXAMPLES / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


engine_integration = _load("engine_integration")
router_proxy = _load("router_proxy")


@pytest.fixture
def ipc_dir() -> Iterator[str]:
    path = tempfile.mkdtemp(prefix="kvwx")  # short: ipc paths are length-limited
    yield path
    shutil.rmtree(path, ignore_errors=True)


# --- the engine integration ----------------------------------------------------------------

BS = 4


class Tee:
    """A sink feeding two sinks, so one stream checks both views."""

    def __init__(self, *sinks: Any) -> None:
        self.sinks = sinks

    def apply(self, worker_id: str, rank: int, batch: KVEventBatch) -> None:
        for s in self.sinks:
            s.apply(worker_id, rank, batch)

    def clear(self, worker_id: str, rank: int) -> None:
        for s in self.sinks:
            s.clear(worker_id, rank)


def _caught_up(sub: Subscriber, pub: EventPublisher, worker: str = "toy", rank: int = 0) -> None:
    def done() -> bool:
        st = {(s.worker_id, s.rank): s for s in sub.status()}.get((worker, rank))
        return (
            st is not None and st.state is RankState.SYNCED and st.expected_seq == pub.last_seq + 1
        )

    wait_for(done, what=f"{worker}/{rank} to apply batch {pub.last_seq}")


def test_engine_integration_events_rebuild_the_managers_cache(ipc_dir: str) -> None:
    ev, rp = f"ipc://{ipc_dir}/ev", f"ipc://{ipc_dir}/rp"
    blocks, index = BlockSetSink(), PrefixIndex(BS)
    with EventPublisher(ev, rp) as pub:
        collector = EventCollector(pub, BS)
        manager = engine_integration.KVCacheManager(40, BS, collector)
        engine = engine_integration.ToyEngine(manager, collector, seed=3)
        sub = Subscriber([EngineSource("toy", ev, rp)], Tee(blocks, index)).start()
        try:
            prompts: list[list[int]] = []
            engine_integration.drive(engine, 150, seed=5, prompts=prompts)
            _caught_up(sub, pub)
            truth = manager.held_hashes()
            assert manager.evictions > 0 and truth
            assert blocks.blocks("toy", 0) == truth
            assert index.blocks("toy", 0) == truth
            # The published tokens and parents are right: the index matches what is cached.
            for prompt in prompts[-20:]:
                assert index.match(prompt).get(("toy", 0), 0) == manager.probe(prompt)

            while not engine.idle():
                engine.step()
            assert manager.reset_prefix_cache()
            engine_integration.drive(engine, 60, seed=6, prompts=prompts)
            _caught_up(sub, pub)
            after = manager.held_hashes()
            assert truth - after, "the reset must leave blocks only a clear can remove"
            assert blocks.blocks("toy", 0) == after
            assert index.blocks("toy", 0) == after
            stats = index.stats()
            assert stats.orphan_stores == 0 and stats.malformed_stores == 0
            assert pub.stats().dropped_queue_full == 0
        finally:
            sub.stop()


def test_engine_integration_runs_as_a_script(ipc_dir: str) -> None:
    res = subprocess.run(
        [sys.executable, str(EXAMPLES / "engine_integration.py"),
         "--endpoint", f"ipc://{ipc_dir}/ev", "--replay-endpoint", f"ipc://{ipc_dir}/rp",
         "--iterations", "40", "--num-blocks", "24", "--block-size", "4"],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert res.returncode == 0, res.stderr
    assert "iterations" in res.stdout and "evictions" in res.stdout


# --- the router proxy ---------------------------------------------------------------------


class FakeBackend:
    """An HTTP engine stand-in: records each request; a body with "hold" waits for the gate."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.received: list[tuple[str, dict[str, str], bytes]] = []
        self.gate = threading.Event()
        backend = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers["Content-Length"]))
                backend.received.append((self.path, dict(self.headers.items()), body))
                if json.loads(body).get("hold"):
                    backend.gate.wait(10)
                answer = {"backend": backend.name, "rank": self.headers["X-Data-Parallel-Rank"]}
                data = json.dumps(answer).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, format: str, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"

    def close(self) -> None:
        self.gate.set()
        self.server.shutdown()
        self.server.server_close()


def _post(url: str, payload: Any) -> tuple[int, dict[str, str], Any]:
    data = payload if isinstance(payload, bytes) else json.dumps(payload).encode()
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=15) as resp:
            return resp.status, dict(resp.headers.items()), json.loads(resp.read())
    except urllib.error.HTTPError as err:
        return err.code, dict(err.headers.items()), json.loads(err.read())


IDLE = {"prefill_tokens": 0, "decode_blocks": 0}


def _ranks(proxy_url: str) -> dict[str, Any]:
    """``GET /kvwire/status``, by ``worker/rank``."""
    with urllib.request.urlopen(proxy_url + "/kvwire/status", timeout=15) as resp:
        ranks = json.loads(resp.read())["ranks"]
    return {f"{r['worker_id']}/{r['rank']}": r for r in ranks}


def _idle(proxy_url: str) -> bool:
    return all(r["load"] == IDLE for r in _ranks(proxy_url).values())


def _tokens(seed: int, n: int) -> list[int]:
    return [(seed * 7919 + i * 104729) % 32_000 for i in range(n)]


def test_router_proxy_routes_by_cache_then_by_load(ipc_dir: str) -> None:
    a_ev, a_rp = f"ipc://{ipc_dir}/a-ev", f"ipc://{ipc_dir}/a-rp"
    b_ev, b_rp = f"ipc://{ipc_dir}/b-ev", f"ipc://{ipc_dir}/b-rp"
    backend_a, backend_b = FakeBackend("A"), FakeBackend("B")
    publishers = [
        EventPublisher(a_ev, a_rp, rank=0),
        EventPublisher(b_ev, b_rp, rank=0),
        EventPublisher(b_ev, b_rp, rank=1),
    ]
    proxy = None
    try:
        for p in publishers:
            p.start()
        # Engine b rank 1 caches prompt P (5 full blocks); engine a rank 0 another prompt.
        prompt, other = _tokens(1, 5 * 16 + 7), _tokens(2, 3 * 16)
        caches = {}
        for pub, tokens in ((publishers[2], prompt), (publishers[0], other)):
            collector = EventCollector(pub, 16)
            caches[pub.rank] = engine_integration.KVCacheManager(32, 16, collector)
            caches[pub.rank].allocate("r0", tokens)
            assert collector.flush()

        args = router_proxy.build_parser().parse_args([
            "--engine", f"a={backend_a.url},{a_ev},{a_rp}",
            "--engine", f"b={backend_b.url}/,{b_ev},{b_rp},ranks=2",
            "--listen", "127.0.0.1:0", "--block-size", "16",
        ])  # fmt: skip
        proxy = router_proxy.RouterProxy(args.engine, args.listen, args.block_size).start()
        url = proxy.url
        completions = url + "/v1/completions"

        def ready() -> bool:
            ranks = _ranks(url)
            return (
                sorted(ranks) == ["a/0", "b/0", "b/1"]
                and all(r["state"] == "synced" for r in ranks.values())
                and ranks["b/1"]["blocks"] == 5
                and ranks["a/0"]["blocks"] == 3
            )

        wait_for(ready, what="the proxy's subscriber to apply both engines' stores")
        assert proxy.index.blocks("b", 1) == caches[1].held_hashes()

        # A cached prompt goes to its holder, though a/0 would win a tie.
        for field in ("prompt_token_ids", "prompt"):
            # The proxy frees a request's load just after its answer is sent.
            wait_for(lambda: _idle(url), what="the previous request's load to be released")
            request = {"model": "m", field: prompt, "max_tokens": 4}
            status, headers, answer = _post(completions, request)
            assert status == 200 and answer == {"backend": "B", "rank": "1"}
            assert headers["X-Kvwire-Route"] == "b/1"
            path, sent, body = backend_b.received[-1]
            assert path == "/v1/completions" and json.loads(body) == request
            assert sent["X-Kvwire-Route"] == "b/1" and sent["X-Data-Parallel-Rank"] == "1"
            assert "cached 5 blocks" in sent["X-Kvwire-Reason"]

        # A prompt nobody holds: the rank with a request in flight is passed over.
        held = _tokens(3, 4 * 16)
        first: list[tuple[int, dict[str, str], Any]] = []
        hold = {"prompt": held, "hold": True}
        in_flight = threading.Thread(target=lambda: first.append(_post(completions, hold)))
        in_flight.start()
        wait_for(lambda: len(backend_a.received) + len(backend_b.received) == 3, what="the held request")
        received = backend_a.received + backend_b.received
        busy = next(r[1]["X-Kvwire-Route"] for r in received if b'"hold"' in r[2])
        loads = {k: r["load"] for k, r in _ranks(url).items()}
        assert loads.pop(busy) == {"prefill_tokens": len(held), "decode_blocks": 4}
        assert all(v == IDLE for v in loads.values())
        status, headers, answer = _post(completions, {"prompt_token_ids": _tokens(4, 64)})
        assert status == 200 and headers["X-Kvwire-Route"] != busy
        assert answer["rank"] == headers["X-Kvwire-Route"].split("/")[1]
        backend_a.gate.set()
        backend_b.gate.set()
        in_flight.join(15)
        assert first and first[0][0] == 200 and first[0][1]["X-Kvwire-Route"] == busy
        wait_for(lambda: _idle(url), what="every rank's load to return to zero")

        status, _, answer = _post(completions, b"{not json")
        assert status == 400 and "invalid JSON" in answer["error"]
    finally:
        if proxy is not None:
            proxy.stop()
        for p in publishers:
            p.close(timeout=1)
        backend_a.close()
        backend_b.close()


def test_engine_spec_parsing() -> None:
    b = router_proxy.parse_engine("w=http://h:8000/,tcp://h:5557,tcp://h:5657,ranks=2")
    assert b.url == "http://h:8000"
    assert b.source == EngineSource("w", "tcp://h:5557", "tcp://h:5657", ranks=2)
    b = router_proxy.parse_engine("w=http://h:8000,tcp://h:5557")
    assert b.source.replay_endpoint is None and b.source.ranks == 1
    for bad in ("http://h:8000,tcp://h:5557", "w=tcp://h:5557", "w=http://h,tcp://*:5557"):
        with pytest.raises(ValueError):
            router_proxy.parse_engine(bad)
    assert router_proxy.prompt_tokens({"prompt": "text"}) == []
    assert router_proxy.prompt_tokens({"prompt": [1, 2], "prompt_token_ids": [3]}) == [3]


def _get(url: str) -> tuple[int, Any]:
    try:
        with urllib.request.urlopen(url, timeout=10) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as err:
        with err:
            return err.code, json.loads(err.read())


def test_router_proxy_is_ready_once_its_fraction_of_ranks_is_synced(ipc_dir: str) -> None:
    a_ev, a_rp = f"ipc://{ipc_dir}/a-ev", f"ipc://{ipc_dir}/a-rp"
    b_ev = f"ipc://{ipc_dir}/b-ev"
    assert router_proxy.build_parser().parse_args(["--engine", f"a=http://h,{a_ev}"]).ready_fraction == 1.0
    for bad in ("0", "1.5", "x"):
        with pytest.raises(SystemExit):
            router_proxy.build_parser().parse_args(["--engine", f"a=http://h,{a_ev}", "--ready-fraction", bad])
    args = router_proxy.build_parser().parse_args([
        "--engine", f"a=http://127.0.0.1:9,{a_ev},{a_rp}",
        "--engine", f"b=http://127.0.0.1:9,{b_ev}",
        "--listen", "127.0.0.1:0", "--ready-fraction", "0.5",
    ])  # fmt: skip
    proxy = router_proxy.RouterProxy(
        args.engine, args.listen, ready_fraction=args.ready_fraction
    ).start()
    publisher = None
    try:
        # No engine publishes yet: not ready.
        status, body = _get(proxy.url + "/ready")
        assert status == 503 and body["synced"] == 0 and body["ranks"] == 2
        publisher = EventPublisher(a_ev, a_rp, rank=0).start()
        publisher.publish(KVEventBatch(0.0, []))
        wait_for(lambda: _get(proxy.url + "/ready")[0] == 200, what="/ready to answer 200")
        status, body = _get(proxy.url + "/ready/")
        assert status == 200 and body["synced"] == 1 and body["fraction"] == 0.5
        # Half of the ranks is what it was told: engine b is still down.
        assert proxy.subscriber.rank_state("a", 0) is RankState.SYNCED
        assert not proxy.subscriber.is_synced(1.0)
    finally:
        proxy.stop()
        if publisher is not None:
            publisher.close(timeout=1)
