"""Row S1's slot process: ``python -m tests.chaos.pickle_slot URL QUEUE EXPECTED_DEAD``.

It turns kombu's insecure serializers on first (``kombu.enable_insecure_serializers()``:
pickle, yaml, msgpack accepted by any kombu consumer of this process), then does all a
qcluster process does with a message: a real slot loop (SlotRunner of tests.chaos.apps)
takes until ``EXPECTED_DEAD`` messages are dead-lettered, then the operator's reads and
requeue (dead_jobs, requeue_dead, stats) and the slot again. Prints one JSON line: what
it saw. Pickle payloads given to it create a marker file if anything unpickles them.
"""

from __future__ import annotations

import json
import sys
import time

import kombu


def main(url: str, queue: str, expected: int) -> dict[str, object]:
    kombu.enable_insecure_serializers()
    from qcluster import Client
    from qcluster.broker import open_broker
    from qcluster.slot.runtime import SlotRunner
    from tests.chaos.apps import app

    client = Client(url)
    seen: dict[str, object] = {}

    def run_slot_until_dead(count: int) -> None:
        runner = SlotRunner(app, queue, open_broker(url))
        deadline = time.monotonic() + 120
        while client.stats(queue)["dead"] < count and time.monotonic() < deadline:
            runner.step()
        runner._flush()
        runner.broker.close()

    run_slot_until_dead(expected)
    seen["reasons"] = sorted({d.reason.split(":")[0] for d in client.dead_jobs(queue)})
    seen["requeued"] = client.requeue_dead(queue)
    run_slot_until_dead(expected)
    seen["dead"] = client.stats(queue)["dead"]
    seen["bodies_are_text"] = all(isinstance(d.body, str) for d in client.dead_jobs(queue))
    client.close()
    return seen


if __name__ == "__main__":
    print(json.dumps(main(sys.argv[1], sys.argv[2], int(sys.argv[3]))))
