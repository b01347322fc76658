"""A publisher process for restart tests: publishes a model engine's batches, then waits.

Run as ``python -m tests.subscriber.publisher_proc ENDPOINT REPLAY SEED LIFE COUNT``.
It prints one JSON line (the blocks its engine holds) once everything is
published, then blocks until killed or its stdin closes.
"""

from __future__ import annotations

import json
import sys

from kvwire.publisher import EventPublisher
from tests.subscriber.helpers import Engine


def main() -> None:
    endpoint, replay, seed, life, count = sys.argv[1:6]
    engine = Engine(int(seed), life=int(life))
    with EventPublisher(endpoint, replay) as pub:
        engine.publish(pub, int(count))
        print(json.dumps(sorted(engine.truth)), flush=True)
        sys.stdin.read()


if __name__ == "__main__":
    main()
