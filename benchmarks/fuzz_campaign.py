"""A fuzzing campaign against a live router, on loopback: nothing crashes, hangs or grows.

One ``Subscriber`` with a ``PrefixIndex`` sink follows two engines:

- ``legit``: a real ``EventPublisher`` rank (in a process of its own) publishing
  an engine model's batches (stores of chained blocks, removals) throughout;
- ``hostile``: a fake engine (another process): a PUB socket sending mutated and
  generated frames, and a replay ROUTER answering every replay request with junk.

Meanwhile a third process sends malformed requests to the legit publisher's
replay socket, and a fourth to the reference engine's control endpoint.

Pass: the subscriber never dies or stops answering (``status()`` within a
deadline, polled throughout); its RSS stays bounded (printed: start, peak, end);
the legit rank ends SYNCED and exact (at the publisher's last batch, or past it by the
heartbeats sent since, and the index holds exactly the model's blocks);
every bad input is counted (the hostile rank's decode errors cover at least every
frame built to be undecodable, the publisher's ``replay_invalid`` every request
built to be invalid, the engine's control errors every junk request); and the
legit publisher and the reference engine still serve a good request afterwards.
Every loop is bounded; the campaign stops by itself.

The hostile PUB is an XPUB with ``XPUB_NODROP``: it waits for the subscriber instead
of dropping, so every frame sent is received (the counts are exact, not sampled).

    python benchmarks/fuzz_campaign.py [--frames 1000000] [--replay-requests 100000]
        [--control-requests 10000] [--seed 1]

The differential campaign instead (in this process, no sockets): ``--differential N``
runs N payloads (the captured fixtures of every dialect and generated batches, in
every envelope and event form, mutated structurally and byte-wise; one in ten under
tight limits) through every reader of a batch payload: ``decode_batch`` and each of
its paths, the native reader's check and view, the receive check, the index's fused
apply and the mirror's. Pass: all accept exactly the payloads ``decode_batch``
accepts, read the same events and leave the same index and mirror
(tests/wire/differential.py says exactly what is compared).

    python benchmarks/fuzz_campaign.py --differential 100000 [--seed 1]
"""

from __future__ import annotations

import argparse
import contextlib
import multiprocessing as mp
import os
import random
import sys
import time
from collections.abc import Callable
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import msgspec

TOPIC = b""
BLOCK = 16
# The payload of a frame built to be undecodable starts with 0xc1, the one byte
# msgpack never uses.
NEVER_USED = b"\xc1"


def rss_mb(pid: int | None = None) -> float:
    with open(f"/proc/{pid or 'self'}/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


# --- the legit engine -------------------------------------------------------------


class EngineModel:
    """Chains of blocks stored and removed; ``held`` is the truth an exact view equals."""

    def __init__(self, seed: int) -> None:
        self.rnd = random.Random(seed)
        self.keys: list[int] = []  # held hashes, for O(1) sampling and removal
        self.pos: dict[int, int] = {}
        self.next_hash = 1

    @property
    def held(self) -> set[int]:
        return set(self.keys)

    def _drop(self, h: int) -> None:
        i = self.pos.pop(h)
        last = self.keys.pop()
        if last != h:
            self.keys[i] = last
            self.pos[last] = i

    def batch(self) -> Any:
        from kvwire.wire import BlockRemoved, BlockStored, KVEventBatch

        rnd = self.rnd
        events: list[Any] = []
        n = rnd.randint(1, 8)
        parent = rnd.choice(self.keys) if self.keys and rnd.random() < 0.7 else None
        hashes = list(range(self.next_hash, self.next_hash + n))
        self.next_hash += n
        tokens = [rnd.randrange(32_000) for _ in range(n * BLOCK)]
        events.append(BlockStored(hashes, parent, tokens, BLOCK))
        for h in hashes:
            self.pos[h] = len(self.keys)
            self.keys.append(h)
        if len(self.keys) > 2000:
            gone = list({rnd.choice(self.keys) for _ in range(rnd.randint(1, 16))})
            for h in gone:
                self._drop(h)
            events.append(BlockRemoved(gone))
        return KVEventBatch(time.time(), events, 0)


EPHEMERAL = "tcp://127.0.0.1:*"
"""Where the engines bind: ephemeral ports, reported to the campaign once bound."""


def legit_engine(conn: Connection, seed: int) -> None:
    """Publish the model's batches until told to stop; report the truth and stats."""
    from kvwire.publisher import EventPublisher

    model = EngineModel(seed)
    with EventPublisher(EPHEMERAL, EPHEMERAL, rank=0) as publisher:
        conn.send((publisher.bound_endpoint, publisher.bound_replay_endpoint))
        sent = 0
        while not conn.poll(0):
            for _ in range(20):
                publisher.publish(model.batch())
                sent += 1
            time.sleep(0.01)
        conn.recv()
        st = publisher.stats()
        conn.send({"held": sorted(model.held), "last_seq": st.last_seq, "batches": sent,
                   "stats": st.as_dict()})  # fmt: skip
        # Until the verdict (before closing the replay socket), the counters on request:
        # the publisher heartbeats meanwhile, each an empty batch on the next seq.
        while conn.recv() == "stats":
            conn.send(publisher.stats().as_dict())


# --- the hostile engine -------------------------------------------------------------


def _rv(rnd: random.Random, depth: int = 0) -> Any:
    c = rnd.randrange(12 if depth < 4 else 7)
    if c == 0:
        return rnd.randrange(-(2**63), 2**64)
    if c == 1:
        return rnd.choice([None, True, False])
    if c == 2:
        return rnd.random()
    if c == 3:
        return rnd.choice(["BlockStored", "BlockRemoved", "AllBlocksCleared", "GPU", "type"])
    if c == 4:
        return rnd.randbytes(rnd.randrange(10))
    if c == 5:
        return rnd.randrange(-40, 300)
    if c == 6:
        return rnd.choice([0, 1, 2**16, 10**6, 2**40, 2**63 - 1])
    if c in (7, 8):
        return [_rv(rnd, depth + 1) for _ in range(rnd.randrange(6))]
    if c == 9:
        keys = ["type", "block_hashes", "parent_block_hash", "token_ids", "block_size",
                "medium", "lora_name", "extra_keys", "group_idx"]  # fmt: skip
        return {rnd.choice(keys): _rv(rnd, depth + 1) for _ in range(rnd.randrange(6))}
    if c == 10:
        return msgspec.msgpack.Ext(rnd.randrange(-128, 128), rnd.randbytes(3))
    return "x" * rnd.randrange(40)


class FrameMaker:
    """Mutated and generated frames; counts the ones built to be undecodable."""

    def __init__(self, seed: int) -> None:
        self.rnd = random.Random(seed)
        self.model = EngineModel(seed + 1)
        self.seq = 0
        self.undecodable = 0
        self.kinds: dict[str, int] = {}

    def _payload(self) -> bytes:
        from kvwire.wire import encode_batch

        return encode_batch(self.model.batch(), dialect=self.rnd.choice(["map", "array"]))

    def _mutate(self, b: bytes) -> bytes:
        rnd = self.rnd
        out = bytearray(b)
        for _ in range(rnd.randint(1, 6)):
            op = rnd.randrange(5)
            pos = rnd.randrange(len(out)) if out else 0
            if op == 0 and out:
                out[pos] = rnd.randrange(256)
            elif op == 1 and out:
                out[pos] ^= 1 << rnd.randrange(8)
            elif op == 2:
                del out[pos:]
            elif op == 3:
                out[pos:pos] = rnd.randbytes(rnd.randrange(1, 9))
            else:
                out[pos : pos + 2] = rnd.choice([b"\xdd\xff", b"\xdc\xff", b"\xcf\xff", b"\xc0"])
        return bytes(out)

    def _generated(self) -> bytes:
        rnd = self.rnd
        kind = rnd.randrange(5)
        if kind == 0:  # nesting far past any decoder's recursion limit
            return b"\x93\xcb" + b"\0" * 8 + b"\x91" * rnd.randint(500, 20_000) + b"\xc0"
        if kind == 1:  # absurd sizes in an otherwise valid store
            ev = {"type": "BlockStored", "block_hashes": [1, 2], "parent_block_hash": None,
                  "token_ids": [1] * rnd.choice([0, 3, 32]),
                  "block_size": rnd.choice([0, -1, 10**6, 2**40, 2**63 - 1])}  # fmt: skip
            return msgspec.msgpack.encode([0.0, [ev], 0])
        if kind == 2:  # many blocks (within any sane size limit)
            n = 70_000 if rnd.random() < 0.01 else rnd.choice([100, 1000, 10_000])
            ev = {"type": "BlockRemoved", "block_hashes": list(range(n))}
            return msgspec.msgpack.encode([0.0, [ev], 0])
        if kind == 3:  # string token ids, mixed hash forms
            ev = {"type": "BlockStored", "block_hashes": [b"\x01" * 9, -5], "parent_block_hash": -1,
                  "token_ids": ["a"] * 32, "block_size": 16}  # fmt: skip
            return msgspec.msgpack.encode([0.0, [ev], 0])
        try:
            return msgspec.msgpack.encode([_rv(rnd), [_rv(rnd) for _ in range(rnd.randrange(4))], _rv(rnd)])
        except (TypeError, ValueError, OverflowError):
            return NEVER_USED

    def frame(self) -> list[bytes]:
        """One live message, sometimes malformed in its framing or seq."""
        rnd = self.rnd
        r = rnd.random()
        seq = self.seq
        self.seq += 1
        if r < 0.35:
            kind, payload = "mutated", self._mutate(self._payload())
        elif r < 0.55:
            kind, payload = "generated", self._generated()
        elif r < 0.70:
            kind, payload = "undecodable", NEVER_USED + rnd.randbytes(rnd.randrange(40))
        elif r < 0.80:
            self.undecodable += 1
            self._count("framing")
            shape = rnd.randrange(4)
            if shape == 0:
                return [TOPIC]
            if shape == 1:
                return [TOPIC, seq.to_bytes(8, "big")]
            if shape == 2:
                return [TOPIC, rnd.randbytes(rnd.choice([0, 4, 9])), self._payload()]
            return [TOPIC, seq.to_bytes(8, "big"), self._payload(), b"extra"]
        elif r < 0.90:
            # Seq chaos with valid payloads: far jumps, old seqs, the top of the range.
            kind, payload = "seq", self._payload()
            seq = rnd.choice([seq + rnd.randrange(2, 5000), max(0, seq - rnd.randrange(1, 100)),
                              2**63, 2**64 - 2, rnd.randrange(2**64 - 1)])  # fmt: skip
        else:
            kind, payload = "valid", self._payload()
        if payload[:1] == NEVER_USED:
            self.undecodable += 1
        self._count(kind)
        return [TOPIC, seq.to_bytes(8, "big"), payload]

    def replay_reply(self, request: list[bytes]) -> list[list[bytes]]:
        """An answer to one replay request: half plausible (the asked seqs, mutated or
        generated payloads, an END), half junk; zero or more messages."""
        from kvwire.wire import END_SEQ

        rnd = self.rnd
        identity = request[0]
        out: list[list[bytes]] = []
        if len(request) == 3 and len(request[2]) == 8 and rnd.random() < 0.5:
            start = int.from_bytes(request[2], "big")
            for seq in range(start, min(start + rnd.randrange(1, 50), self.seq)):
                payload = self._payload() if rnd.random() < 0.5 else self._mutate(self._payload())
                out.append([identity, b"", TOPIC, seq.to_bytes(8, "big"), payload])
            out.append([identity, b"", TOPIC, END_SEQ, b""])
            return out
        for _ in range(rnd.randrange(0, 6)):
            shape = rnd.randrange(5)
            seq = rnd.randrange(2**64 - 1).to_bytes(8, "big")
            if shape == 0:
                out.append([identity, b"", TOPIC, seq, self._mutate(self._payload())])
            elif shape == 1:
                out.append([identity, b"", seq, NEVER_USED])
            elif shape == 2:
                out.append([identity, *[rnd.randbytes(rnd.randrange(12)) for _ in range(rnd.randrange(1, 6))]])
            elif shape == 3:
                out.append([identity, b"", TOPIC, END_SEQ, rnd.randbytes(rnd.randrange(3))])
            else:
                out.append([identity, b"", TOPIC, seq, self._generated()])
        return out

    def _count(self, kind: str) -> None:
        self.kinds[kind] = self.kinds.get(kind, 0) + 1


def hostile_engine(conn: Connection, frames: int, seed: int) -> None:
    """Send ``frames`` live frames (never dropped) and answer replay requests with junk."""
    import zmq

    ctx = zmq.Context()
    pub = ctx.socket(zmq.XPUB)
    pub.setsockopt(zmq.XPUB_NODROP, 1)
    pub.setsockopt(zmq.SNDHWM, 2000)
    pub.bind(EPHEMERAL)
    router = ctx.socket(zmq.ROUTER)
    router.bind(EPHEMERAL)
    maker = FrameMaker(seed)
    poller = zmq.Poller()
    poller.register(pub, zmq.POLLIN | zmq.POLLOUT)
    poller.register(router, zmq.POLLIN)
    conn.send((pub.getsockopt_string(zmq.LAST_ENDPOINT),
               router.getsockopt_string(zmq.LAST_ENDPOINT)))  # fmt: skip
    subscribed = False
    sent = requests = replies = 0
    pending: list[bytes] | None = None  # made, not sent yet: counted once, sent once
    deadline = time.monotonic() + 3600
    while sent < frames and time.monotonic() < deadline:
        events = dict(poller.poll(1000))
        if pub in events and events[pub] & zmq.POLLIN:
            pub.recv()  # a subscription
            subscribed = True
        if router in events:
            for _ in range(64):
                try:
                    msg = router.recv_multipart(zmq.NOBLOCK)
                except zmq.Again:
                    break
                requests += 1
                for reply in maker.replay_reply(msg):
                    router.send_multipart(reply)
                    replies += 1
        if subscribed and pub in events and events[pub] & zmq.POLLOUT:
            for _ in range(256):
                if sent >= frames:
                    break
                if pending is None:
                    pending = maker.frame()
                try:
                    pub.send_multipart(pending, zmq.NOBLOCK)
                except zmq.Again:
                    break
                pending = None
                sent += 1
    conn.send({"sent": sent, "undecodable": maker.undecodable, "kinds": maker.kinds,
               "replay_requests": requests, "replay_replies": replies})  # fmt: skip
    # Keep answering replay requests with junk until told to stop.
    while not conn.poll(0):
        if router.poll(100):
            msg = router.recv_multipart()
            for reply in maker.replay_reply(msg):
                router.send_multipart(reply)
    pub.close(0)
    router.close(0)
    ctx.term()


# --- malformed replay requests -------------------------------------------------------


def replay_attacker(conn: Connection, replay: str, requests: int, seed: int) -> None:
    """Send malformed requests to a publisher's replay ROUTER from a few DEALERs."""
    import zmq

    rnd = random.Random(seed)
    ctx = zmq.Context()
    dealers = [ctx.socket(zmq.DEALER) for _ in range(4)]
    for d in dealers:
        d.setsockopt(zmq.LINGER, 0)
        d.setsockopt(zmq.SNDHWM, 100_000)
        d.connect(replay)
    time.sleep(0.2)  # let the connections complete before the first send
    invalid = 0
    for i in range(requests):
        shape = rnd.randrange(6)
        if shape == 0:
            frames = [b"", rnd.randbytes(rnd.choice([0, 1, 7, 9, 16]))]
        elif shape == 1:
            frames = [rnd.randbytes(3), (0).to_bytes(8, "big")]
        elif shape == 2:
            frames = [b""] + [b"x"] * rnd.randrange(2, 6)
        elif shape == 3:
            frames = [b"", b"\xff" * 8]  # END_SEQ as a start seq
        elif shape == 4:
            frames = [rnd.randbytes(rnd.randrange(1, 50))]
        else:
            frames = [b"", rnd.randbytes(8), b"trailing"]
        invalid += 1
        dealers[i % len(dealers)].send_multipart(frames)
        if i % 1000 == 999:
            for d in dealers:  # drain any replies so nothing backs up
                while d.poll(0):
                    d.recv_multipart()
            time.sleep(0.001)
    time.sleep(0.5)
    conn.send({"sent": requests, "invalid": invalid})
    for d in dealers:
        d.close(0)
    ctx.term()


# --- the campaign ----------------------------------------------------------------------


def wait_for(cond: Callable[[], bool], timeout: float, step: float = 0.05) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return True
        time.sleep(step)
    return cond()


def _junk_command(rnd: random.Random, control: Any) -> bytes:
    """One malformed control request: never a valid command (so never Shutdown)."""
    enc = msgspec.msgpack.encode
    shape = rnd.randrange(8)
    ident = rnd.randrange(1, 2**31)
    if shape == 0:
        return rnd.randbytes(rnd.randrange(0, 64))
    if shape == 1:
        return enc([ident, {"type": rnd.choice(["Nope", "", "shutdown", 7])}])
    if shape == 2:  # a known command with fields of the wrong type or out of range
        return enc([ident, {"type": "Submit", "rank": rnd.choice([-1, 99, 2**40, "0"]),
                            "request_id": 5, "token_ids": ["a", None]}])  # fmt: skip
    if shape == 3:
        return enc([ident, {"type": "Drive", "rate": rnd.choice([float("nan"), float("inf"), -1.0]),
                            "seed": 0, "hold": rnd.choice([-5, 2**40])}])  # fmt: skip
    if shape == 4:
        return enc([ident, {"type": "Probe", "rank": 0, "token_ids": "not a list"}])
    if shape == 5:
        return b"\x92" + b"\x91" * rnd.randrange(100, 5000) + b"\xc0"
    if shape == 6:
        return enc({"ident": ident, "body": None})
    return enc([ident])


def control_campaign(requests: int, seed: int) -> dict[str, Any]:
    """:func:`control_run` with the engine's log in a temporary directory."""
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        return control_run(requests, seed, Path(tmp) / "engine.log")


def control_run(requests: int, seed: int, log_path: Path) -> dict[str, Any]:
    """Malformed requests to a reference engine's control endpoint, then a good one.

    Every junk request must be answered ``Failed`` (or, for frames that are not
    even a request, counted by the engine and dropped); the engine must stay up
    and answer ``Stats`` and a ``Probe`` afterwards. The engine binds ephemeral
    ports and reports them.
    """
    import subprocess

    import zmq

    from kvwire.reference import control
    from kvwire.reference.launch import EngineProcess
    from kvwire.reference.serve import EngineConfig

    rnd = random.Random(seed)
    engine = EngineProcess(EngineConfig(ranks=1, device="cpu"), log_path)
    failures: list[str] = []
    client: Any = None
    failed = unanswered = 0
    t0 = time.monotonic()
    try:
        engine.start(120)
        endpoint = engine.control_endpoint
        client = control.ControlClient(endpoint, timeout=10)
        client.wait_ready(120, alive=engine.running)
        ctx = zmq.Context.instance()
        dealer = ctx.socket(zmq.DEALER)
        dealer.setsockopt(zmq.LINGER, 0)
        dealer.connect(endpoint)
        window = 64
        pending = sent = 0
        for i in range(requests):
            dealer.send_multipart([b"", _junk_command(rnd, control)])
            pending += 1
            sent += 1
            while pending >= window or (i == requests - 1 and pending):
                if not dealer.poll(10_000):
                    unanswered += pending
                    pending = 0
                    break
                frames = dealer.recv_multipart()
                pending -= 1
                try:
                    _, reply = control.reply_decoder.decode(frames[-1])
                except msgspec.DecodeError:
                    failures.append("the engine sent an unreadable reply")
                    continue
                if isinstance(reply, control.Failed):
                    failed += 1
            if not engine.running():
                code = None if engine.proc is None else engine.proc.returncode
                failures.append(f"the reference engine died (exit {code})")
                break
        dealer.close(0)
        if engine.running():
            client.stats()
            client.probe(0, list(range(64)))
        if unanswered:
            failures.append(f"{unanswered} junk control requests got no reply")
        if failed != sent - unanswered:
            failures.append(f"{sent - unanswered - failed} junk control requests were not refused")
    except (control.ControlError, RuntimeError) as exc:
        failures.append(f"the reference engine stopped answering: {exc}")
    finally:
        if client is not None:
            client.close()
        if engine.proc is not None and engine.running():
            engine.proc.terminate()
            try:
                engine.proc.wait(30)
            except subprocess.TimeoutExpired:
                engine.kill()
                failures.append("the reference engine did not stop on SIGTERM")
        if failures:
            tail = engine.logs().strip().splitlines()[-3:]
            failures.extend(f"engine log: {line}" for line in tail)
    summary = (f"{requests:,} malformed requests to kvwire.reference.serve's control endpoint in "
               f"{time.monotonic() - t0:.0f} s: {failed:,} refused (Failed), {unanswered} unanswered; "
               f"engine {'answered Stats and Probe after' if not failures else 'FAILED'}")  # fmt: skip
    return {"summary": summary, "failures": failures}


def differential(cases: int, seed: int) -> int:
    """Every payload reader on ``cases`` payloads; 0 when they all agree."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from tests.wire.differential import campaign

    t0 = time.monotonic()
    try:
        outcomes = campaign(cases, seed)
    except AssertionError as exc:
        print(f"FAIL: {exc}")
        return 1
    took = time.monotonic() - t0
    print(f"differential: {cases:,} payloads in {took:.0f} s: "
          f"{outcomes['native']:,} read natively, {outcomes['general']:,} only by the general path, "
          f"{outcomes['refused']:,} refused by every path")  # fmt: skip
    print("PASS: every reader accepts the same payloads, reads the same events, leaves the same state")
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--frames", type=int, default=1_000_000)
    ap.add_argument("--replay-requests", type=int, default=100_000)
    ap.add_argument("--control-requests", type=int, default=10_000)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--timeout", type=float, default=3600, help="give up (and fail) after this long")
    ap.add_argument("--rss-limit-mb", type=float, default=1024,
                    help="fail when the subscriber's RSS grows more than this")  # fmt: skip
    ap.add_argument("--max-held", type=int, default=None,
                    help="StreamConfig.max_held (default: the subscriber's)")  # fmt: skip
    ap.add_argument("--differential", type=int, default=0, metavar="N",
                    help="run N cases of the differential campaign instead")  # fmt: skip
    args = ap.parse_args(argv)
    if args.differential:
        return differential(args.differential, args.seed)

    from kvwire.prefix_index import PrefixIndex
    from kvwire.subscriber import (
        EngineSource,
        RankState,
        StreamConfig,
        Subscriber,
        SubscriberConfig,
    )

    spawn = mp.get_context("spawn")
    engine_end, engine_conn = spawn.Pipe()
    hostile_end, hostile_conn = spawn.Pipe()
    attacker_end, attacker_conn = spawn.Pipe()
    procs = [
        spawn.Process(target=legit_engine, args=(engine_end, args.seed)),
        spawn.Process(target=hostile_engine, args=(hostile_end, args.frames, args.seed + 7)),
    ]
    for p in procs:
        p.start()
    bound: list[tuple[str, str]] = []  # each engine's live and replay endpoints
    for c in (engine_conn, hostile_conn):
        if not c.poll(60):
            raise SystemExit("an engine process did not start")
        bound.append(c.recv())
    (legit_ep, legit_replay), (hostile_ep, hostile_replay) = bound

    index = PrefixIndex(BLOCK)
    sources = [
        EngineSource("legit", legit_ep, legit_replay),
        EngineSource("hostile", hostile_ep, hostile_replay),
    ]
    rss0 = rss_mb()
    peak = rss0
    failures: list[str] = []
    t0 = time.monotonic()
    config = (
        None
        if args.max_held is None
        else SubscriberConfig(stream=StreamConfig(max_held=args.max_held))
    )
    sub = Subscriber(sources, index, config=config).start()
    attacker = spawn.Process(target=replay_attacker,
                             args=(attacker_end, legit_replay, args.replay_requests, args.seed + 3))  # fmt: skip
    attacker.start()
    hostile: dict[str, Any] | None = None
    attack: dict[str, Any] | None = None
    truth: dict[str, Any] | None = None
    control: dict[str, Any] = {"summary": "not run", "failures": []}
    elapsed = 0.0
    last_report = t0
    slowest_status = 0.0
    try:
        while time.monotonic() - t0 < args.timeout:
            s0 = time.monotonic()
            status = {(s.worker_id, s.rank): s for s in sub.status()}
            slowest_status = max(slowest_status, time.monotonic() - s0)
            peak = max(peak, rss_mb())
            if hostile is None and hostile_conn.poll(0):
                hostile = hostile_conn.recv()
            if attack is None and attacker_conn.poll(0):
                attack = attacker_conn.recv()
            if time.monotonic() - last_report > 10:
                last_report = time.monotonic()
                h = status[("hostile", 0)].counters
                print(f"  {time.monotonic() - t0:6.0f} s  hostile decode errors {h.decode_errors:,}  "
                      f"RSS {rss_mb():.0f} MB", flush=True)  # fmt: skip
            if hostile is not None and attack is not None:
                break
            if not all(p.is_alive() for p in procs):
                failures.append("an engine process died")
                break
            time.sleep(0.2)
        else:
            failures.append(f"timed out after {args.timeout:.0f} s")
        if args.control_requests:
            control = control_campaign(args.control_requests, args.seed + 5)
        # Stop the legit engine and check the rank ends exact.
        engine_conn.send("stop")
        truth = engine_conn.recv() if engine_conn.poll(60) else None
        if truth is None:
            failures.append("the legit engine did not report")
        else:
            want_next = truth["last_seq"] + 1

            def legit_next() -> int:
                """The legit rank's next seq while it is SYNCED, else -1."""
                s = next(s for s in sub.status() if s.worker_id == "legit")
                return s.expected_seq if s.state is RankState.SYNCED else -1

            # The publisher heartbeats while it waits for the verdict, so the rank may be
            # past want_next by the heartbeats sent since the truth, and by nothing else.
            synced = wait_for(lambda: legit_next() >= want_next, timeout=30)
            seen = legit_next()  # read before the publisher's count, which can only grow
            engine_conn.send("stats")
            now = engine_conn.recv() if engine_conn.poll(60) else None
            beats = None if now is None else now["heartbeats"] - truth["stats"]["heartbeats"]
            if not synced or beats is None or seen > want_next + beats:
                legit = [s for s in sub.status() if s.worker_id == "legit"]
                failures.append(f"the legit rank did not end SYNCED at the publisher's last seq "
                                f"{truth['last_seq']} (+{beats} heartbeats since): {legit}")  # fmt: skip
            held = index.blocks("legit", 0)
            if held != set(truth["held"]):
                failures.append(f"legit rank inexact: {len(held ^ set(truth['held']))} blocks differ")
            invalid = truth["stats"]["replay_invalid"]
            if attack is not None and invalid < attack["invalid"]:
                failures.append(f"publisher counted {invalid} invalid replay requests of {attack['invalid']}")
        if hostile is not None:
            # Every hostile frame sent reaches the subscriber (XPUB_NODROP), which may still
            # be reading them on a loaded host: wait for the count to cover the undecodable.
            undecodable = hostile["undecodable"]
            wait_for(lambda: any(s.worker_id == "hostile" and s.counters.decode_errors >= undecodable
                                 for s in sub.status()), timeout=30)  # fmt: skip
        elapsed = time.monotonic() - t0
        final = {(s.worker_id, s.rank): s for s in sub.status()}
        h = final[("hostile", 0)].counters
        lc = final[("legit", 0)]
        if hostile is not None:
            if hostile["sent"] < args.frames:
                failures.append(f"only {hostile['sent']:,} hostile frames sent")
            if h.decode_errors < hostile["undecodable"]:
                failures.append(f"{h.decode_errors:,} decode errors counted for "
                                f"{hostile['undecodable']:,} undecodable frames")  # fmt: skip
        if peak - rss0 > args.rss_limit_mb:
            failures.append(f"RSS grew {peak - rss0:.0f} MB")
        failures.extend(control["failures"])
    finally:
        sub.stop()
        for c in (engine_conn, hostile_conn):
            with contextlib.suppress(OSError):
                c.send("stop")
        for p in [*procs, attacker]:
            p.join(30)
            if p.is_alive():
                p.kill()
                failures.append(f"{p.name} did not stop")

    print(f"\nfuzz campaign, seed {args.seed}: {elapsed:.0f} s")
    if hostile is not None:
        kinds = ", ".join(f"{k} {v:,}" for k, v in sorted(hostile["kinds"].items()))
        print(f"  hostile live frames sent {hostile['sent']:,} ({kinds}); "
              f"{hostile['undecodable']:,} built undecodable")  # fmt: skip
        print(f"  hostile replay: {hostile['replay_requests']:,} requests answered with "
              f"{hostile['replay_replies']:,} junk messages")  # fmt: skip
    print(f"  hostile rank counted: decode errors {h.decode_errors:,}, batches {h.batches:,}, "
          f"gaps {h.gaps:,}, seqs lost {h.seqs_lost:,}, late {h.late:,}, duplicates "
          f"{h.duplicates:,}, stale replay frames {h.stale_replies:,}, replays requested "
          f"{h.replays_requested:,}, failed {h.replays_failed:,}, resyncs {h.resyncs:,}; "
          f"state {final[('hostile', 0)].state.name}")  # fmt: skip
    if attack is not None and truth is not None:
        print(f"  replay socket: {attack['sent']:,} malformed requests sent, publisher counted "
              f"{truth['stats']['replay_invalid']:,} invalid")  # fmt: skip
    if truth is not None:
        print(f"  legit rank: {truth['batches']:,} batches, state {lc.state.name}, "
              f"{len(truth['held']):,} blocks held, index {'exact' if index.blocks('legit', 0) == set(truth['held']) else 'INEXACT'}; "
              f"gaps {lc.counters.gaps}, replays {lc.counters.replays_requested}; next seq "
              f"{lc.expected_seq:,} (the publisher's last batch {truth['last_seq']:,}, then heartbeats)")  # fmt: skip
    print(f"  control endpoint: {control['summary']}")
    st = index.stats()
    print(f"  index: malformed stores {st.malformed_stores:,}, blocks {st.blocks:,}")
    print(f"  subscriber RSS: start {rss0:.0f} MB, peak {peak:.0f} MB, end {rss_mb():.0f} MB; "
          f"slowest status() {slowest_status * 1e3:.0f} ms")  # fmt: skip
    for f in failures:
        print(f"  FAIL: {f}")
    print("  PASS" if not failures else "  FAILED")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
