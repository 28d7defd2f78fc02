"""The worker's detection state, one stage instance per assigned partition, that moves with it.

`PartitionStates` creates the stage instance of a partition on its first record: the
newest checkpoint from the state topic if there is one (`streams.state_store`), else a
fresh one. Before the record is processed, `admit` asks `streams.coverage.Coverage`
whether the state already holds it (skip: Kafka redelivers from the last commit, which
may lag the checkpoint), holds everything before it (process), or misses records before
it (a gap: the checkpoint is older than the commit, or there is no checkpoint but the
partition was processed before). A gap is folded in from the partition's history
(`streams.rebuild`): after a checkpoint its outputs are returned to be sent again (their
first sending may have been lost with a killed worker), a lookback window's are not. A
partition revoked by a rebalance is checkpointed and dropped; every partition is
checkpointed every ``checkpoint_interval_s``.

`lock` is held by the agents while they fold a batch and send what it produced, and by a
checkpoint while it pickles: a checkpoint never claims a record whose outputs are still
being handed to the producer (the producer is flushed before the checkpoint is written).
"""
from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter
from collections.abc import Callable, Iterable
from typing import NamedTuple

from fabricwatch import metrics
from fabricwatch.models.topology import Topology

from . import topics
from .config import DetectionConfig
from .coverage import Coverage
from .facts import FactBook
from .rebuild import History, StateKeeper
from .source_stage import SourceStage
from .state_store import StateStore, compressed, loads, pickled
from .storm_stage import StormStage
from .straggler_stage import StragglerStage

log = logging.getLogger("fabricwatch.worker")
Stage = SourceStage | StormStage | StragglerStage
STAGE_NAMES = {topics.TELEMETRY: "sources", topics.PAUSE_STATES: "storms", topics.RANK_STEPS: "stragglers"}
# fold(stage, partition, value, replay): one record into the partition's stage; its outputs when
# ``replay`` (`streams.rebuild`)
StageFold = Callable[[Stage, int, bytes, bool], list]


class Admission(NamedTuple):
    """A record's partition stage (None: the state holds it, skip it) and what a gap replayed
    before it produced, to send first."""
    stage: Stage | None
    replayed: list


class PartitionStates:
    """Stage instances by (topic, partition), their coverage, checkpoints and rebuilds."""

    def __init__(self, config: DetectionConfig, topology: Topology | None, facts: FactBook,
                 store: StateStore | None, history: History, lookback_s: dict[str, float],
                 flush: Callable[[], object] | None = None, telemetry_partitions: int | None = None) -> None:
        self.config, self.topology, self.facts, self.store = config, topology, facts, store
        self.telemetry_partitions = telemetry_partitions or topics.SPECS[topics.TELEMETRY].partitions
        self.coverage = Coverage()
        self.keeper = StateKeeper(self.coverage, history, lookback_s)
        self.stages: dict[tuple[str, int], Stage] = {}
        self._flush = flush
        self._externals = {"topology": topology, "facts": facts, "nominal": facts.nominal, "health": facts.health}
        self.facts_ready = False
        self.checkpointed_at_s = float("nan")
        self.stats: Counter[str] = Counter()

    @property
    def lock(self) -> asyncio.Lock:
        return self.keeper.lock

    @property
    def rebuilding(self) -> int:
        return self.keeper.rebuilding

    def of_kind(self, kind: type) -> Iterable[tuple[int, Stage]]:
        return [(p, s) for (_, p), s in self.stages.items() if isinstance(s, kind)]

    def _new(self, topic: str, partition: int) -> Stage:
        if topic == topics.TELEMETRY:
            return SourceStage(self.config, self.topology, self.facts, topic, partition, self.telemetry_partitions)
        if topic == topics.PAUSE_STATES:
            return StormStage(self.config, self.topology, self.facts)
        stage = StragglerStage(self.config, self.facts)
        stage.facts_ready = self.facts_ready
        return stage

    async def stage(self, topic: str, partition: int) -> Stage:
        """The partition's stage instance, restored from its checkpoint on first use."""
        key = (topic, partition)
        stage = self.stages.get(key)
        if stage is not None:
            return stage
        loaded = None
        if self.store is not None:
            started = time.perf_counter()
            try:
                loaded = await self.store.load(STAGE_NAMES[topic], topic, partition)
            except Exception as exc:        # the state topic unreadable: rebuild from history instead
                self.stats["state_load_failures"] += 1
                log.warning("loading the checkpoint of %s[%d] failed: %s", topic, partition, exc)
            if loaded is not None:
                try:
                    stage = loads(loaded.payload, self._externals)
                except Exception as exc:
                    self.stats["state_load_failures"] += 1
                    log.warning("ignoring an unreadable checkpoint of %s[%d]: %s", topic, partition, exc)
                    stage, loaded = None, None
            if loaded is not None:
                if isinstance(stage, StragglerStage):
                    stage.facts_ready = self.facts_ready
                if key not in self.coverage.offsets:
                    self.coverage.offsets[key] = loaded.covered_offset
                self.stats["states_loaded"] += 1
                metrics.WORKER_STATE_LOAD_SECONDS.observe(time.perf_counter() - started)
                log.warning("restored %s[%d] from its checkpoint (%d bytes, offset %d) in %.2f s", topic, partition,
                            loaded.size_bytes, loaded.covered_offset, time.perf_counter() - started)
        if stage is None:
            stage = self._new(topic, partition)
        self.stages[key] = stage
        return stage

    async def admit(self, topic: str, partition: int, offset: int, timestamp_s: float,
                    fold: StageFold) -> Admission:
        """The stage to process this record with, after filling a gap before it."""
        stage = await self.stage(topic, partition)
        ok, replayed = await self.keeper.admit(topic, partition, offset, timestamp_s,
                                               lambda raw, replay: fold(stage, partition, raw, replay))
        return Admission(stage if ok else None, replayed)

    async def resume(self, topic: str, partition: int, next_offset: int, fold: StageFold) -> list:
        """A partition just assigned, before (or without) its next record: its checkpoint
        loaded and any gap before ``next_offset`` refolded now, so that what its state holds
        (rank steps and changes waiting for the watermark, open anomalies) resumes even when
        no record follows. Returns what the gap replayed, to send."""
        stage = await self.stage(topic, partition)
        _, replayed = await self.keeper.admit(topic, partition, next_offset, time.time(),
                                              lambda raw, replay: fold(stage, partition, raw, replay))
        return replayed

    def folded(self, topic: str, partition: int, offset: int) -> None:
        self.keeper.folded(topic, partition, offset)

    # -- checkpoints ------------------------------------------------------------------------
    async def checkpoint(self, keys: Iterable[tuple[str, int]] | None = None) -> int:
        """Write the checkpoints of ``keys`` (default: every partition owned); bytes written."""
        if self.store is None:
            return 0
        payloads = []
        for key in list(keys if keys is not None else self.stages):
            # One partition at a time under the lock, compressed outside it: the records of
            # the other partitions are not held for the whole worker's state (a tail of
            # seconds in the sample-to-anomaly latency at thousands of nodes).
            async with self.lock:
                stage, covered = self.stages.get(key), self.coverage.offsets.get(key)
                if stage is None or covered is None:
                    continue
                raw = pickled(stage, self._externals)
            payloads.append((key, covered, compressed(raw)))
            await asyncio.sleep(0)
        if self._flush is not None:
            await self._flush()                  # what a checkpoint covers is delivered before it is written
        written = 0
        for (topic, partition), covered, payload in payloads:
            written += await self.store.save(STAGE_NAMES[topic], topic, partition, covered, payload)
        if self._flush is not None and payloads:
            await self._flush()
        if payloads:
            metrics.WORKER_CHECKPOINT_BYTES.set(written)
            log.info("checkpointed %d partitions: %d bytes (%s)", len(payloads), written,
                     ", ".join(f"{STAGE_NAMES[t]} {sum(len(p) for (tt, _), _, p in payloads if tt == t)}"
                               for t in STAGE_NAMES))
            self.checkpointed_at_s = time.time()
        return written

    async def revoke_maybe(self, keys: Iterable[tuple[str, int]]) -> None:
        """A rebalance revokes these: checkpoint them for whoever gets them next.

        They stay in memory: a rebalance revokes every partition and hands most of them
        straight back (`assigned` forgets those that went elsewhere).
        """
        keys = [k for k in keys if k in self.stages]
        if not keys:
            return
        try:
            await self.checkpoint(keys)
        except Exception as exc:
            log.warning("checkpointing revoked partitions failed: %s", exc)

    def assigned(self, keys: set[tuple[str, int]]) -> None:
        """The new assignment: forget the partitions that went to another worker."""
        for key in [k for k in self.stages if k not in keys]:
            self.stages.pop(key, None)
            self.coverage.offsets.pop(key, None)
            self.stats["partitions_moved_away"] += 1
        self.coverage.on_assignment()

    def set_facts_ready(self) -> None:
        self.facts_ready = True
        for _, stage in self.of_kind(StragglerStage):
            stage.facts_ready = True

    @property
    def open_anomalies(self) -> dict[str, tuple[str, str]]:
        out: dict[str, tuple[str, str]] = {}
        for stage in self.stages.values():
            out.update(stage.open_anomalies)
        return out
