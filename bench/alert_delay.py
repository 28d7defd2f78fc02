"""How long a storm's drain waits behind a burst of alerts (issue #13, docs/security.md).

The real responder service on a real broker: N link-downgrade anomalies (alert only), then
one PFC storm (alert + drain_node), with a Slack sink (its own rate limit: 3 at once, then
one a second) posting to a local Slack stand-in. Prints the seconds from the storm reaching
Kafka to its drain starting. Runs against any checkout (it uses only the API that the
responder had before the alert queues), so the same script measures before and after:

    python3 bench/alert_delay.py --broker 127.0.0.1:9092 --downgrades 60
"""
from __future__ import annotations

import argparse
import asyncio
import sys
import time
import uuid
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

from test_respond_queues import POLICY, RecordingExecutor, SlackStandIn, anomaly, produce  # noqa: E402

from fabricwatch.actions.alerts.slack import SlackSink  # noqa: E402
from fabricwatch.actions.base import DRAIN_NODE  # noqa: E402
from fabricwatch.actions.policy import parse_policy  # noqa: E402
from fabricwatch.actions.responder import Responder  # noqa: E402
from fabricwatch.streams import topics  # noqa: E402
from fabricwatch.streams.respond import ResponderService  # noqa: E402


async def measure(bootstrap: str, downgrades: int, timeout_s: float) -> float:
    await topics.ensure_topics(bootstrap, topics.ALL_TOPICS)
    cluster = f"bench-{uuid.uuid4().hex[:6]}"
    executor = RecordingExecutor(f"bench:{cluster}")
    responder = Responder(parse_policy(POLICY.format(cluster=cluster)), {DRAIN_NODE: executor.name})
    async with SlackStandIn() as slack:
        sink = SlackSink(slack.url)
        service = ResponderService(bootstrap, responder, {DRAIN_NODE: executor}, [sink], group_id=f"bench-{cluster}")
        stop = asyncio.Event()
        task = asyncio.create_task(service.run(stop))
        try:
            await service.wait_ready(60)
            now = time.time_ns()
            await produce(bootstrap, [anomaly(cluster, "link_downgrade", f"node-{i}", now) for i in range(downgrades)])
            produced = time.monotonic()
            await produce(bootstrap, [anomaly(cluster, "pfc_storm", f"{cluster}-storm", now)])
            deadline = produced + timeout_s
            while not executor.calls and time.monotonic() < deadline:
                await asyncio.sleep(0.05)
            return executor.calls[0][0] - produced if executor.calls else float("inf")
        finally:
            stop.set()
            await asyncio.wait_for(task, timeout_s)
            await sink.close()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--broker", default="127.0.0.1:9092")
    ap.add_argument("--downgrades", type=int, default=60)
    ap.add_argument("--timeout", type=float, default=300.0)
    args = ap.parse_args()
    delay_s = asyncio.run(measure(args.broker, args.downgrades, args.timeout))
    print(f"storm drain started {delay_s:.2f} s after the storm reached Kafka, behind {args.downgrades} "
          "downgrade alerts to a rate-limited Slack sink")
    return 0


if __name__ == "__main__":
    sys.exit(main())
