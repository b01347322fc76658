"""The engines' live delay floor: kvwire publishers followed by routers that catch up nothing.

``fleet_lifecycle.py`` case 5 measures the live delay while four routers catch
up; this isolates what is left without the catch-up: the fleet's engine
processes (the same ones, one traffic thread each, one batch per rank per
second, snapshots and heartbeats on, no history), the same delay probe (a
plain SUB on 64 ranks whose batches come at 64 distinct moments of the
second; batches and heartbeats apart), and 0, then 1, then 4 routers (those
of ``fleet_lifecycle.py``) that are SYNCED before the window starts.

Besides the whole window, the batches are split by when they were sent: in
the first 50 ms after a whole second of the wall clock (where the after-batch
heartbeats of every busy rank fall, when they share the grid) and the rest.

Run: ``.venv/bin/python benchmarks/live_floor.py`` (1,024 ranks: 8 engine
processes x 128); ``--ranks-per-engine 32`` for a small one.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _fleet import percentile
from fleet_lifecycle import LOG, DelayProbe, Fleet, Router

AFTER_SECOND_S = 0.05  # batches sent this soon after a whole second: "at the second"


class SplitProbe(DelayProbe):
    """The delay probe, also keeping each batch's send time (its ts) to split by."""

    def __init__(self, endpoints: list[str]) -> None:
        self.sent: list[tuple[float, float]] = []  # (ts, delay) of batches
        super().__init__(endpoints)

    def _record(self, ts: float, delay: float, beat: bool) -> None:
        super()._record(ts, delay, beat)
        if not beat:
            self.sent.append((ts, delay))

    def start(self) -> None:
        self.sent = []
        super().start()

    def split(self) -> str:
        """Batches' p99 sent just after a whole second vs the rest."""
        at = [d for ts, d in self.sent if ts % 1.0 < AFTER_SECOND_S]
        rest = [d for ts, d in self.sent if ts % 1.0 >= AFTER_SECOND_S]

        def p99(xs: list[float]) -> str:
            p = percentile(xs, 0.99)
            return "-" if p is None else f"{1000 * p:.1f} ms ({len(xs)})"

        return f"p99 at the second {p99(at)}, else {p99(rest)}"


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--engines", type=int, default=8, help="engine processes")
    parser.add_argument("--ranks-per-engine", type=int, default=128)
    parser.add_argument("--rate", type=float, default=1.0, help="batches per rank per second")
    parser.add_argument("--routers", default="0,1,4", help="router counts, in rising order")
    parser.add_argument("--seconds", type=float, default=8.0, help="each window")
    parser.add_argument("--repeat", type=int, default=2, help="windows per router count")
    args = parser.parse_args()
    # What Fleet reads from fleet_lifecycle's options.
    args.run, args.pending = 16, False
    counts = [int(c) for c in args.routers.split(",") if c]
    tmp = Path(tempfile.mkdtemp(prefix="kvwire-floor-"))
    LOG.file = open(tmp / "children.log", "w")  # noqa: SIM115 (open for the whole run)
    fleet = Fleet(
        "kvwire", args.engines, 1, args.ranks_per_engine, args,
        blocks=0, buffer=64, preload_runs=1, tag="kv", taken=set(),
    )  # fmt: skip
    print(
        f"live floor: {fleet.ranks} ranks ({args.engines} processes x {args.ranks_per_engine}), "
        f"{args.rate:g} batch/rank/s; delay p50/p99/max ms (samples)",
        flush=True,
    )
    probe = SplitProbe(fleet.live_endpoints(64))
    routers: list[Router] = []
    try:
        fleet.ask_all("run")
        time.sleep(2.0)  # the probe's connections made, the traffic steady
        for n in counts:
            while len(routers) < n:
                routers.append(Router(f"router-{len(routers)}", fleet, 60.0))
            for r in routers:
                if not r.result:
                    r.wait()
            for _ in range(args.repeat):
                got = probe.window(args.seconds)
                print(f"{n} routers: batches {got}; {probe.split()}", flush=True)
    finally:
        stop = [threading.Thread(target=r.stop) for r in routers]
        for t in stop:
            t.start()
        for t in stop:
            t.join()
        probe.close()
        fleet.close()
        LOG.file.close()


if __name__ == "__main__":
    main()
