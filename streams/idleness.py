"""Which of this worker's telemetry partitions have nothing left to read.

The stages that join telemetry partitions (storms across sources, stragglers with node
health) wait for every partition's progress: a partition not read yet, because a worker
drains a backlog or has only just been given it, is *behind*, and waiting for it is what
makes a backlog give the live answers. Only the worker that reads a partition can tell
behind from *idle* (no collector writes there any more, or none ever did): it has read
up to the partition's end and nothing came for `IDLE_AFTER_S`. Then stage 1 says so
(`SourceStage.idle`), naming the end offset it read up to, and the others stop waiting
until the partition reports again or is found to end past that offset (its reader died
and more was written: `streams.storm_stage`).

>>> clock = [0.0]
>>> idle = Idleness(idle_after_s=5.0, clock=lambda: clock[0])
>>> idle.read(3, offset=41)
False
>>> clock[0] = 6.0
>>> idle.due({3: 42, 4: 0}, positions={4: 0})      # 3 read to its end, 4 empty: both idle, up to
{3: 42, 4: 0}
>>> idle.due({3: 42, 4: 0}, positions={4: 0})      # said once
{}
>>> idle.read(3, offset=42)                        # it reports again
True
"""
from __future__ import annotations

import time
from collections.abc import Callable, Mapping

# Nothing read for this long, at the partition's end: idle. Longer than a collector's
# linger (2 s), so that a partition of quiet nodes is never declared idle between records.
IDLE_AFTER_S = 5.0


class Idleness:
    """Per telemetry partition: the last offset read and when; which are idle now."""

    def __init__(self, idle_after_s: float = IDLE_AFTER_S, clock: Callable[[], float] = time.monotonic) -> None:
        self.idle_after_s, self.clock = idle_after_s, clock
        self._offset: dict[int, int] = {}
        self._at: dict[int, float] = {}
        self._idle: set[int] = set()
        self._since = clock()

    def read(self, partition: int, offset: int) -> bool:
        """A record of ``partition`` was read; True when the partition had been declared idle."""
        self._offset[partition] = max(offset, self._offset.get(partition, -1))
        self._at[partition] = self.clock()
        if partition in self._idle:
            self._idle.discard(partition)
            return True
        return False

    def has_read(self, partition: int) -> bool:
        return partition in self._offset

    def due(self, highwaters: Mapping[int, int | None], positions: Mapping[int, int | None]) -> dict[int, int]:
        """The assigned partitions to declare idle now (each once until it is read again), with
        the offset each has been read up to (what the declaration holds for).

        ``highwaters``: each assigned partition's end offset (None: not known yet);
        ``positions``: the fetch position of those of them not read in this process.
        """
        now = self.clock()
        out = {}
        for partition, end in sorted(highwaters.items()):
            if partition in self._idle or end is None:
                continue
            read_to = self._offset[partition] + 1 if partition in self._offset else positions.get(partition)
            if read_to is not None and read_to >= end and \
                    now - self._at.get(partition, self._since) >= self.idle_after_s:
                self._idle.add(partition)
                out[partition] = read_to
        return out

    def forget(self, keep: set[int]) -> None:
        """A rebalance: only ``keep`` is still ours (a partition that comes back starts afresh)."""
        for table in (self._offset, self._at):
            for p in [p for p in table if p not in keep]:
                del table[p]
        self._idle &= keep
        self._since = self.clock()
