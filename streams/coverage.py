"""Which input records the worker's detection state already contains, per topic partition.

The worker's state (a `DetectionPipeline`) is built by folding records in. To survive a
crash, a restart or a takeover without re-opening or forgetting anomalies, it must know,
for each partition it reads, the last offset folded in. `Coverage.admit` then sorts every
record into one of three cases:

* **skip**: at or below the covered offset. The state already holds it (Kafka redelivers
  from the last *committed* offset, which may lag the checkpoint); folding it twice would
  count it twice.
* **process**: the next record.
* **gap**: the first record of a partition after start or a rebalance, when it does not
  follow the covered offset: another worker processed the records in between (takeover),
  or this one never had the partition. The state is rebuilt first from those records:
  from the covered offset (replayed, outputs sent again: `streams.rebuild` says why), or,
  when nothing is covered, from a lookback window (outputs suppressed).

Kept free of Kafka so the decisions are tested alone; `streams.rebuild` does the reading.

>>> c = Coverage()
>>> c.admit("telemetry", 0, 10)                          # never had it: rebuild from a lookback
Gap(topic='telemetry', partition=0, start_offset=None, end_offset=10)
>>> c.folded("telemetry", 0, 10); c.admit("telemetry", 0, 11)
'process'
>>> c.folded("telemetry", 0, 11); c.admit("telemetry", 0, 9)     # a redelivery after a restart
'skip'
>>> c.on_assignment(); c.admit("telemetry", 0, 40)       # taken back after another worker had it
Gap(topic='telemetry', partition=0, start_offset=12, end_offset=40)
"""
from __future__ import annotations

from dataclasses import dataclass

SKIP, PROCESS = "skip", "process"


@dataclass(frozen=True)
class Gap:
    """Records [start_offset, end_offset) of one partition to fold in before `end_offset`.

    start_offset None: nothing of this partition is in the state; start a lookback window
    before the record at `end_offset`.
    """
    topic: str
    partition: int
    start_offset: int | None
    end_offset: int


class Coverage:
    """Per partition, the last offset folded into the state (checkpointed with it)."""

    def __init__(self, offsets: dict[tuple[str, int], int] | None = None) -> None:
        self.offsets: dict[tuple[str, int], int] = dict(offsets or {})
        self._checked: set[tuple[str, int]] = set()   # partitions whose first record was checked

    def on_assignment(self) -> None:
        """A rebalance: check the first record of every partition again."""
        self._checked.clear()

    def admit(self, topic: str, partition: int, offset: int) -> str | Gap:
        tp = (topic, partition)
        covered = self.offsets.get(tp)
        if covered is not None and offset <= covered:
            return SKIP
        if tp in self._checked:
            return PROCESS
        self._checked.add(tp)
        if covered is None:
            return Gap(topic, partition, None, offset)
        if offset > covered + 1:
            return Gap(topic, partition, covered + 1, offset)
        return PROCESS

    def folded(self, topic: str, partition: int, offset: int) -> None:
        tp = (topic, partition)
        if offset > self.offsets.get(tp, -1):
            self.offsets[tp] = offset
