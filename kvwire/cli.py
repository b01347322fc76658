"""The ``kvwire`` command line: ``watch``, ``dump`` and ``keygen`` (each one's help says what
it does). ``watch`` and ``dump`` follow any engine publishing KV events (vLLM, SGLang,
TensorRT-LLM, kvwire's publisher). Subcommands register themselves on the parser, so more
can be added next to these.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import BinaryIO, TextIO

import msgspec

from kvwire.security import ClientKeys, SecurityError, generate_keypair
from kvwire.subscriber import Applied, BlockSetSink, EngineSource, Subscriber, SubscriberConfig
from kvwire.subscriber.view import BatchRecord, ClearRecord, WatchView
from kvwire.wire import EndpointError, WireError, enc_hook

__all__ = ["build_parser", "main"]

Command = Callable[[argparse.Namespace], int]


def _add_source_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "endpoint",
        metavar="ENDPOINT",
        nargs="?",
        help="the engine's base publish endpoint, e.g. tcp://host:5557",
    )
    parser.add_argument(
        "--rank-endpoint",
        metavar="EP",
        nargs="+",
        action="append",
        default=[],
        help="one rank's publish endpoint and, optionally, its replay endpoint; repeat it for "
        "every rank, in rank order (instead of ENDPOINT, --replay and --ranks: for ranks "
        "that bound unrelated ports, such as ephemeral ones)",
    )
    parser.add_argument(
        "--replay",
        metavar="ENDPOINT",
        help="the engine's base replay endpoint (lets gaps be repaired)",
    )
    parser.add_argument(
        "--ranks",
        type=int,
        help="data-parallel ranks: rank r is at port + r (default 1)",
    )
    parser.add_argument(
        "--worker", default="engine", help="a name for the engine (default: engine)"
    )
    parser.add_argument("--topic", default="", help="subscription topic prefix (default: all)")
    parser.add_argument(
        "--duration", type=float, metavar="S", help="stop after S seconds (default: run until ^C)"
    )
    parser.add_argument("-v", "--verbose", action="store_true", help="log state changes to stderr")
    parser.add_argument(
        "--server-key",
        metavar="FILE",
        type=Path,
        help="the engine's public CURVE key (NAME.key): its sockets are CURVE servers",
    )
    parser.add_argument(
        "--client-key",
        metavar="FILE",
        type=Path,
        help="this client's secret key (NAME.key_secret, from kvwire keygen); its public half "
        "must be in the engine's allow-list",
    )


def _source(args: argparse.Namespace) -> EngineSource:
    keys = None
    if args.server_key is not None or args.client_key is not None:
        if args.server_key is None or args.client_key is None:
            raise SecurityError("--server-key and --client-key go together")
        keys = ClientKeys(args.server_key, args.client_key)
    if not args.rank_endpoint:
        if args.endpoint is None:
            raise ValueError("give the engine's ENDPOINT or every rank's --rank-endpoint")
        ranks = 1 if args.ranks is None else args.ranks
        return EngineSource(args.worker, args.endpoint, args.replay, ranks, args.topic, keys=keys)
    if args.endpoint is not None or args.replay is not None or args.ranks is not None:
        raise ValueError("--rank-endpoint replaces ENDPOINT, --replay and --ranks")
    per_rank: list[tuple[str, str | None]] = []
    for rank, endpoints in enumerate(args.rank_endpoint):
        if len(endpoints) > 2:
            raise ValueError(f"--rank-endpoint of rank {rank}: at most ENDPOINT and REPLAY")
        per_rank.append((endpoints[0], endpoints[1] if len(endpoints) == 2 else None))
    return EngineSource.from_rank_endpoints(args.worker, per_rank, args.topic, keys)


# --- watch ---------------------------------------------------------------------------------


def add_watch_command(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = commands.add_parser(
        "watch",
        help="live per-rank view of an engine's KV events",
        description="Follow every rank of an engine and show, refreshed in place, each rank's "
        "state, next seq, events/s, gaps, lost seqs, replays, restarts and blocks held.",
    )
    _add_source_arguments(p)
    p.add_argument(
        "--interval", type=float, default=1.0, metavar="S", help="refresh every S s (default 1)"
    )
    p.add_argument(
        "--once",
        action="store_true",
        help="print one table when --duration (default 2 s) ends, without refreshing",
    )
    p.add_argument(
        "--checkpoint",
        metavar="FILE",
        help="start from the view saved in FILE when it is valid (each rank replays only what "
        "it missed since), and save the view there on exit",
    )
    p.set_defaults(func=_run_watch)


def _run_watch(args: argparse.Namespace) -> int:
    if args.interval <= 0:
        raise SystemExit("kvwire watch: --interval must be > 0")
    if args.once and args.duration is None:
        args.duration = 2.0
    return asyncio.run(_watch(args, sys.stdout))


async def _watch(args: argparse.Namespace, out: TextIO) -> int:
    source = _source(args)
    replay = f", replay {source.replay_endpoint}" if source.replay_endpoint else ", no replay"
    view = WatchView(f"kvwire watch  {source.endpoint}{replay}  ranks {source.ranks}")
    sink = BlockSetSink()
    in_place = out.isatty() and not args.once
    loop = asyncio.get_running_loop()
    end = None if args.duration is None else loop.time() + args.duration
    config = SubscriberConfig(checkpoint=args.checkpoint)
    async with Subscriber([source], sink, config=config) as sub:
        view.render(sub.status(), sink.count)  # the baseline for events/s
        while True:
            wait = args.interval if end is None else min(args.interval, end - loop.time())
            await asyncio.sleep(max(wait, 0.0))
            done = end is not None and loop.time() >= end
            if args.once and not done:
                continue
            lines = view.render(sub.status(), sink.count)
            if in_place:
                view.redraw(out, lines)
            else:
                out.write("\n".join(lines) + "\n\n")
                out.flush()
            if done:
                return 0


# --- dump ----------------------------------------------------------------------------------


def add_dump_command(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = commands.add_parser(
        "dump",
        help="print an engine's decoded KV-event batches as JSON lines",
        description="Print every batch, in order per rank, as one JSON object per line "
        '({"type": "batch", "worker", "rank", "seq", "ts", "data_parallel_rank", "events"}), '
        'and a {"type": "clear", ...} line where a rank\'s state had to be dropped. '
        "With a replay endpoint the engine's buffered history comes first.",
    )
    _add_source_arguments(p)
    p.add_argument("--count", type=int, metavar="N", help="stop after N batches")
    p.set_defaults(func=_run_dump)


def _run_dump(args: argparse.Namespace) -> int:
    with contextlib.suppress(BrokenPipeError):
        return asyncio.run(_dump(args, sys.stdout.buffer, sys.stderr))
    return 0  # the reader went away (kvwire dump ... | head)


async def _dump(args: argparse.Namespace, out: BinaryIO, err: TextIO) -> int:
    """Print batches as they come; one that cannot be printed is reported and skipped."""
    encoder = msgspec.json.Encoder(enc_hook=enc_hook)
    batches = 0
    bad = 0
    async with Subscriber([_source(args)]) as sub:

        async def consume() -> None:
            nonlocal batches, bad
            async for item in sub:
                record: BatchRecord | ClearRecord
                if isinstance(item, Applied):
                    b = item.batch
                    record = BatchRecord(
                        item.worker_id, item.rank, item.seq, b.ts, b.data_parallel_rank, b.events
                    )
                    batches += 1
                else:
                    record = ClearRecord(item.worker_id, item.rank, item.reason)
                try:
                    line = encoder.encode(record)
                except WireError as exc:
                    # Token ids are decoded lazily: content the decoder let
                    # through can still be refused here.
                    bad += 1
                    seq = item.seq if isinstance(item, Applied) else None
                    print(f"kvwire dump: {item.worker_id}/{item.rank} seq {seq}: "
                          f"batch skipped: {exc}", file=err, flush=True)  # fmt: skip
                else:
                    out.write(line + b"\n")
                    out.flush()
                if args.count is not None and batches >= args.count:
                    return

        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(consume(), args.duration)
    if bad:
        print(f"kvwire dump: {bad} batch(es) could not be printed", file=err)
    return 0


# --- keygen --------------------------------------------------------------------------------


def add_keygen_command(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = commands.add_parser(
        "keygen",
        help="write a CURVE key pair (zmq.auth certificate files)",
        description="Write NAME.key (the public key: give it to the other side; a client's goes "
        "into the server's allow-list directory) and NAME.key_secret (keep it private; "
        "written with mode 0600) in zmq.auth's certificate format.",
    )
    p.add_argument("name", metavar="NAME", help="the key pair's file name, without suffix")
    p.add_argument("--dir", default=".", metavar="D", help="directory to write to (default: .)")
    p.set_defaults(func=_run_keygen)


def _run_keygen(args: argparse.Namespace) -> int:
    public, secret = generate_keypair(args.dir, args.name)
    print(f"public key: {public}\nsecret key: {secret}")
    return 0


# --- entry point ---------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="kvwire", description="KV-cache events from inference engines, over ZeroMQ."
    )
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    add_watch_command(commands)
    add_dump_command(commands)
    add_keygen_command(commands)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(
        level=logging.INFO if getattr(args, "verbose", False) else logging.WARNING,
        format="%(asctime)s %(name)s %(levelname)s %(message)s",
        stream=sys.stderr,
    )
    command: Command = args.func
    try:
        return command(args)
    except (EndpointError, SecurityError, ValueError) as exc:
        print(f"kvwire {args.command}: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 0


if __name__ == "__main__":
    sys.exit(main())
