"""`fabricwatch status`: how far the workers of one consumer group are behind.

Reads, without joining the group, the group's committed offsets and every input
partition's end offset, and prints the lag per topic (total and the worst partition) and
whether the group is caught up: every partition within ``caught_up_lag`` records of its
end. Exit code 0 when caught up, 1 when behind (scripts wait on it after a restart or a
backlog), 2 when the broker or the group cannot be read.
"""
from __future__ import annotations

import json
import sys
from dataclasses import asdict, dataclass

from . import topics
from .topics import partitions_of

INPUTS = (topics.TELEMETRY, topics.RANK_STEPS, topics.PAUSE_STATES)


@dataclass(frozen=True)
class TopicLag:
    topic: str
    partitions: int
    lag: int                   # records between the commits and the ends, all partitions
    worst_partition: int
    worst_lag: int
    uncommitted: int           # partitions the group has not committed anything for yet


async def group_lag(bootstrap: str, group: str, inputs: tuple[str, ...] = INPUTS) -> list[TopicLag]:
    from aiokafka import AIOKafkaConsumer, TopicPartition
    from aiokafka.admin import AIOKafkaAdminClient

    consumer = AIOKafkaConsumer(bootstrap_servers=bootstrap, group_id=None)
    admin = AIOKafkaAdminClient(bootstrap_servers=bootstrap)
    await consumer.start()
    await admin.start()
    try:
        out = []
        for topic in inputs:
            parts = await partitions_of(bootstrap, topic)
            tps = [TopicPartition(topic, p) for p in parts]
            ends = await consumer.end_offsets(tps) if tps else {}
            committed = await admin.list_consumer_group_offsets(group, partitions=tps) if tps else {}
            lags, uncommitted = {}, 0
            for tp in tps:
                c = committed.get(tp)
                offset = c.offset if c is not None and c.offset >= 0 else None
                if offset is None:
                    uncommitted += ends[tp] > 0
                    offset = 0
                lags[tp.partition] = max(0, ends[tp] - offset)
            worst = max(lags, key=lags.get, default=0)
            out.append(TopicLag(topic, len(tps), sum(lags.values()), worst, lags.get(worst, 0), uncommitted))
        return out
    finally:
        await admin.close()
        await consumer.stop()


async def print_status(bootstrap: str, group: str, caught_up_lag: int, as_json: bool = False) -> int:
    try:
        lags = await group_lag(bootstrap, group)
    except Exception as exc:
        print(f"fabricwatch status: cannot read {group!r} at {bootstrap}: {exc}", file=sys.stderr)
        return 2
    caught_up = all(t.worst_lag <= caught_up_lag for t in lags)
    if as_json:
        print(json.dumps({"group": group, "caught_up": caught_up, "caught_up_lag": caught_up_lag,
                          "topics": [asdict(t) for t in lags]}))
    else:
        print(f"group {group}: {'caught up' if caught_up else 'BEHIND'} (caught up = every partition within "
              f"{caught_up_lag} records of its end)")
        print(f"{'topic':<40} {'partitions':>10} {'lag':>10} {'worst partition':>16} {'worst lag':>10}")
        for t in lags:
            note = f"  ({t.uncommitted} partitions never committed)" if t.uncommitted else ""
            print(f"{t.topic:<40} {t.partitions:>10} {t.lag:>10} {t.worst_partition:>16} {t.worst_lag:>10}{note}")
    return 0 if caught_up else 1
