"""A publisher process for restart tests: publishes a model engine's batches, then waits.

Run as ``python -m tests.subscriber.publisher_proc ENDPOINT REPLAY SEED LIFE COUNT``.
It prints one JSON line once everything is published (the blocks its engine
holds and the endpoints it bound: ``tcp://127.0.0.1:*`` binds ephemeral ports),
then blocks until killed or its stdin closes.
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
        report = {
            "blocks": sorted(engine.truth),
            "endpoint": pub.bound_endpoint,
            "replay_endpoint": pub.bound_replay_endpoint,
        }
        print(json.dumps(report), flush=True)
        sys.stdin.read()


if __name__ == "__main__":
    main()
