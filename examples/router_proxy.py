"""A minimal KV-aware HTTP router: send each prompt to the rank that holds most of it.

It follows every rank of every engine (a :class:`Subscriber` feeding a
:class:`PrefixIndex`) and forwards each ``POST`` (``/v1/completions`` ...) to
the ``(worker, rank)`` that :meth:`KvRouter.choose` picks from the prompt's
token ids (``prompt_token_ids``, or ``prompt`` as token ids; a text prompt is
routed on load alone) and the load this proxy has in flight on each rank. All
ranks of an engine sit behind its one HTTP server; ``X-Data-Parallel-Rank``
(which vLLM honours) names the rank. ``X-Kvwire-Route`` and ``X-Kvwire-Reason``
go with the request and come back with the answer. ``GET /kvwire/status``
shows each rank's state, blocks and load. ``GET /ready`` answers 503 until
``--ready-fraction`` of the ranks (all, by default) are SYNCED, then 200: a
load balancer sends no traffic to a router still recovering its view.

vLLM with two data-parallel ranks (block size 16, its default)::

    vllm serve MODEL --port 8100 --data-parallel-size 2 --kv-events-config \\
      '{"enable_kv_cache_events": true, "publisher": "zmq", "endpoint": "tcp://*:5557", "replay_endpoint": "tcp://*:5657"}'

SGLang (its ``--page-size`` is the block size)::

    python -m sglang.launch_server --model-path MODEL --port 30000 --page-size 16 --kv-events-config \\
      '{"publisher": "zmq", "endpoint": "tcp://*:5557", "replay_endpoint": "tcp://*:5657"}'

Give the proxy the *base* endpoints (rank r publishes on port + r, its replay
socket likewise, so the base ports must be at least ``ranks`` apart)::

    python examples/router_proxy.py --listen 127.0.0.1:8000 --block-size 16 \\
      --engine vllm-a=http://gpu-a:8100,tcp://gpu-a:5557,tcp://gpu-a:5657,ranks=2 \\
      --engine sglang-b=http://gpu-b:30000,tcp://gpu-b:5557,tcp://gpu-b:5657
    curl -s localhost:8000/v1/completions -d '{"model": "MODEL", "prompt": [1, 2, 3]}'

``tcp://*`` binds every interface and events carry users' prompt token ids:
keep those ports on a private network.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import threading
import urllib.error
import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import msgspec

from kvwire.prefix_index import Decision, KvRouter, Load, PrefixIndex
from kvwire.subscriber import EngineSource, Subscriber, SubscriberConfig
from kvwire.subscriber.readiness import check_fraction

__all__ = ["Backend", "RouterProxy", "main", "parse_engine", "prompt_tokens"]

log = logging.getLogger("router_proxy")
RankKey = tuple[str, int]
_HOP = {"connection", "keep-alive", "transfer-encoding", "te", "trailer", "upgrade", "host"}
_NOT_FORWARDED = _HOP | {"content-length"}  # urllib sets it
_NOT_RELAYED = _HOP | {"server", "date"}  # send_response writes its own


@dataclass(frozen=True)
class Backend:
    """One engine: its HTTP server and where its ranks publish KV events."""

    url: str
    source: EngineSource


def parse_engine(spec: str) -> Backend:
    """``worker_id=HTTP_URL,EVENTS_ENDPOINT[,REPLAY_ENDPOINT][,ranks=N]``."""
    worker, _, rest = spec.partition("=")
    parts = [p for p in rest.split(",") if p]
    opts = [p for p in parts if p.startswith("ranks=")]
    parts = [p for p in parts if not p.startswith("ranks=")]
    if not worker or len(parts) not in (2, 3) or len(opts) > 1:
        raise ValueError(
            f"bad --engine {spec!r}: expected worker_id=HTTP_URL,EVENTS_ENDPOINT"
            "[,REPLAY_ENDPOINT][,ranks=N]"
        )
    if not parts[0].startswith(("http://", "https://")):
        raise ValueError(f"bad --engine {spec!r}: {parts[0]!r} is not an http(s) URL")
    ranks = int(opts[0].removeprefix("ranks=")) if opts else 1
    replay = parts[2] if len(parts) == 3 else None
    return Backend(parts[0].rstrip("/"), EngineSource(worker, parts[1], replay, ranks=ranks))


def prompt_tokens(body: Any) -> list[int]:
    """The prompt's token ids from a request body, or ``[]`` when it has none."""
    if isinstance(body, dict):
        for name in ("prompt_token_ids", "prompt"):
            value = body.get(name)
            if isinstance(value, list) and value and all(type(t) is int for t in value):
                return value
    return []


class RouterProxy:
    """The subscriber, the index, the router, per-rank load, and the HTTP server."""

    def __init__(
        self,
        backends: Sequence[Backend],
        listen: tuple[str, int] = ("127.0.0.1", 8000),
        block_size: int = 16,
        *,
        config: SubscriberConfig | None = None,
        timeout: float = 600.0,
        ready_fraction: float = 1.0,
    ) -> None:
        self.urls = {b.source.worker_id: b.url for b in backends}
        self.block_size = block_size
        self.timeout = timeout
        self.index = PrefixIndex(block_size)
        self.subscriber = Subscriber([b.source for b in backends], self.index, config=config)
        self.ready_fraction = check_fraction(ready_fraction)  # fails here, not per request
        self.router = KvRouter(self.index, rank_states=self.subscriber)
        self.loads = {
            (b.source.worker_id, r): Load() for b in backends for r in range(b.source.ranks)
        }
        self._lock = threading.Lock()
        self.server = ThreadingHTTPServer(listen, _Handler)
        self.server.proxy = self  # type: ignore[attr-defined]
        self._thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    @property
    def url(self) -> str:
        host, port = self.server.server_address[:2]
        return f"http://{host!s}:{port}"

    def start(self) -> RouterProxy:
        self.subscriber.start()
        self._thread.start()
        return self

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()
        self.subscriber.stop()

    def acquire(self, tokens: list[int]) -> tuple[Decision, Load]:
        """Choose a rank and add the request's load to it (see :meth:`release`)."""
        bs = self.block_size
        with self._lock:
            decision = self.router.choose(tokens, self.loads)
            cached = decision.candidates[decision.target].cached.total * bs
            # Prefill: the uncached prompt tokens; decode: the blocks the request holds.
            load = Load(max(len(tokens) - cached, 0), max(1, -(-len(tokens) // bs)))
            now = self.loads[decision.target]
            self.loads[decision.target] = Load(now[0] + load[0], now[1] + load[1])
        return decision, load

    def release(self, key: RankKey, load: Load) -> None:
        with self._lock:
            now = self.loads[key]
            self.loads[key] = Load(now[0] - load[0], now[1] - load[1])

    def ready(self) -> tuple[bool, dict[str, Any]]:
        """Whether enough ranks are SYNCED to route on the index, and the counts."""
        progress = self.subscriber.progress()
        body: dict[str, Any] = msgspec.to_builtins(progress)
        body["fraction"] = self.ready_fraction
        return self.subscriber.is_synced(self.ready_fraction), body

    def status(self) -> dict[str, Any]:
        """Every rank's subscriber status, with its backend, blocks held and load."""
        with self._lock:
            loads = dict(self.loads)
        ranks = []
        for st in self.subscriber.status():
            item: dict[str, Any] = msgspec.to_builtins(st)
            item["backend"] = self.urls[st.worker_id]
            item["blocks"] = len(self.index.blocks(st.worker_id, st.rank))
            item["load"] = loads.get((st.worker_id, st.rank), Load())._asdict()
            ranks.append(item)
        return {"block_size": self.block_size, "ranks": ranks}


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.0"  # one request per connection; streamed answers end at close

    @property
    def proxy(self) -> RouterProxy:
        return self.server.proxy  # type: ignore[attr-defined,no-any-return]

    def do_GET(self) -> None:
        path = self.path.rstrip("/")
        if path == "/kvwire/status":
            self._reply(200, json.dumps(self.proxy.status()).encode())
        elif path == "/ready":
            ready, body = self.proxy.ready()
            self._reply(200 if ready else 503, json.dumps(body).encode())
        else:  # e.g. /v1/models: any engine can answer
            self._forward(next(iter(self.proxy.urls.values())), None, {})

    def do_POST(self) -> None:
        body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
        try:
            tokens = prompt_tokens(json.loads(body)) if body else []
        except ValueError as exc:
            self._reply(400, json.dumps({"error": f"invalid JSON: {exc}"}).encode())
            return
        proxy = self.proxy
        decision, load = proxy.acquire(tokens)
        worker, rank = decision.target
        log.info("%s %d tokens -> %s/%d: %s", self.path, len(tokens), worker, rank, decision.reason)
        extra = {
            "X-Kvwire-Route": f"{worker}/{rank}",
            "X-Kvwire-Reason": decision.reason,
            "X-Data-Parallel-Rank": str(rank),
        }
        try:
            self._forward(proxy.urls[worker], body, extra)
        finally:
            proxy.release(decision.target, load)

    def _forward(self, base: str, body: bytes | None, extra: dict[str, str]) -> None:
        headers = {k: v for k, v in self.headers.items() if k.lower() not in _NOT_FORWARDED}
        headers.update(extra)
        req = urllib.request.Request(base + self.path, data=body, headers=headers)
        try:
            resp: Any = urllib.request.urlopen(req, timeout=self.proxy.timeout)
        except urllib.error.HTTPError as err:
            resp = err  # the backend's own error answer: relay it
        except OSError as exc:
            self._reply(502, json.dumps({"error": f"backend {base}: {exc}"}).encode())
            return
        with resp:
            self.send_response(resp.status)
            for k, v in resp.headers.items():
                if k.lower() not in _NOT_RELAYED:
                    self.send_header(k, v)
            for k, v in extra.items():
                self.send_header(k, v)
            self.end_headers()
            try:
                while chunk := resp.read1(65536):  # streamed answers (SSE) go out as they come
                    self.wfile.write(chunk)
                    self.wfile.flush()
            except ConnectionError:
                log.info("client went away during %s", self.path)

    def _reply(self, code: int, data: bytes) -> None:
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, format: str, *args: Any) -> None:
        log.debug("%s " + format, self.address_string(), *args)


def _engine_arg(spec: str) -> Backend:
    try:
        return parse_engine(spec)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _fraction_arg(text: str) -> float:
    try:
        return check_fraction(float(text))
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"--ready-fraction {text!r}: {exc}") from None


def _listen_arg(text: str) -> tuple[str, int]:
    host, _, port = text.rpartition(":")
    if not host or not port.isdigit():
        raise argparse.ArgumentTypeError(f"--listen {text!r}: expected HOST:PORT")
    return host, int(port)


_ENGINE = "ID=HTTP_URL,EVENTS_ENDPOINT[,REPLAY_ENDPOINT][,ranks=N]; repeat per engine"


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description="A minimal KV-aware HTTP router (kvwire).")
    p.add_argument("--engine", type=_engine_arg, action="append", required=True, help=_ENGINE)
    p.add_argument("--listen", type=_listen_arg, default=("127.0.0.1", 8000), metavar="HOST:PORT")
    p.add_argument("--block-size", type=int, default=16, help="the engines' KV block size")
    p.add_argument(
        "--ready-fraction",
        type=_fraction_arg,
        default=1.0,
        metavar="F",
        help="GET /ready answers 200 once this fraction of the ranks is SYNCED, else 503",
    )
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    proxy = RouterProxy(
        args.engine, args.listen, args.block_size, ready_fraction=args.ready_fraction
    ).start()
    log.info("routing on %s to %s", proxy.url, ", ".join(proxy.urls))
    with contextlib.suppress(KeyboardInterrupt):
        threading.Event().wait()
    proxy.stop()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
