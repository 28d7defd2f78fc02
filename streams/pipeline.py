"""The three detection stages in one process: what replay, eval and the tests run.

1. per source (`source_stage.SourceStage`): rates, the per-entity rules, the learned
   baseline, the PFC watchdog (whose records feed stage 2) and node health (facts);
2. per cluster (`storm_stage.StormStage`): the storm locator names each storm's source;
3. per job (`straggler_stage.StragglerStage`): stragglers, held until node health has
   been processed past their steps.

The worker runs each stage in the agent of the topic keyed for it, one instance per
partition, with the facts going through a topic that every worker reads; here they pass
straight from stage to stage, in event-time order, so the same telemetry gives the same
findings. What is tested is what runs: the stage classes are the worker's.
"""
from __future__ import annotations

from collections import Counter

from fabricwatch.models.findings import Finding
from fabricwatch.models.frames import RankProgress, RankStep, SourceBatch
from fabricwatch.models.node_health import HealthBook
from fabricwatch.models.nominal import NominalRates
from fabricwatch.models.pfc_storm import PauseStateChange
from fabricwatch.models.storm_locator import SourceProgress
from fabricwatch.models.topology import Topology
from fabricwatch.protos.v1 import telemetry_pb2 as pb

from .config import DetectionConfig
from .decode import rank_progress_of, rank_steps_of, snapshot_batch
from .facts import FactBook
from .source_stage import SourceOutput, SourceStage
from .storm_stage import StormStage
from .straggler_stage import StragglerStage

__all__ = ["DetectionConfig", "DetectionPipeline", "SourceOutput", "detection_config_of"]


def detection_config_of(args) -> DetectionConfig:
    """The detection settings of the command line (`detection_opts`), every threshold checked
    now (a pipeline is built with them) before anything starts."""
    config = DetectionConfig(default_nic_rate=args.default_nic_rate, pfc_detection_time_ms=args.pfc_detection_ms,
                             pfc_restoration_time_ms=args.pfc_restoration_ms, collector_linger_s=args.collector_linger)
    DetectionPipeline(config)
    return config


class DetectionPipeline:
    """Feed it records (or single snapshots) of many sources in event-time order; get findings."""

    def __init__(self, config: DetectionConfig | None = None, topology: Topology | None = None) -> None:
        self.config = config or DetectionConfig()
        self.topology = topology
        self.facts = FactBook(topology, NominalRates(topology, default=self.config.default_nic_rate),
                              HealthBook(topology=topology))
        self.sources = SourceStage(self.config, topology, self.facts)
        self.storms = StormStage(self.config, topology, self.facts)
        self.stragglers = StragglerStage(self.config, self.facts)
        self.stats: Counter[str] = Counter()

    # -- the stages, chained ----------------------------------------------------------------
    def observe(self, batch: SourceBatch | pb.Snapshot) -> SourceOutput:
        """Stage 1 alone (its facts applied); stage 2's records are returned, not fed."""
        if isinstance(batch, pb.Snapshot):
            batch = snapshot_batch(batch)
        out = self.sources.observe(batch)
        self.facts.apply_all(out.facts)
        return out

    def locate(self, record: PauseStateChange | SourceProgress) -> list[Finding]:
        return self.storms.locate(record)

    def process_batch(self, batch: SourceBatch) -> list[Finding]:
        """One record of one source through every stage."""
        return self.process_batches([batch])

    def process_batches(self, batches: list[SourceBatch]) -> list[Finding]:
        """Records of many sources (read together, in this order) through every stage."""
        findings: list[Finding] = []
        for out in self.sources.observe_many(batches):
            self.facts.apply_all(out.facts)
            findings += out.findings
            for record in out.pause_records:
                findings += self.storms.locate(record)
        if batches:
            findings += self.storms.poll(max(int(b.times_ns[-1]) for b in batches))
        findings += self._release()
        self.stats["findings"] += len(findings)
        return findings

    def add_rank_steps(self, steps: list[RankStep], cluster: str) -> list[Finding]:
        """Rank steps (any jobs): held per job until node health covers them."""
        by_job: dict[str, list[RankStep]] = {}
        for step in steps:
            by_job.setdefault(step.job_id, []).append(step)
        findings: list[Finding] = []
        for job_steps in by_job.values():
            found, placements = self.stragglers.add(job_steps, cluster)
            self.facts.apply_all(placements)
            findings += found
        self.stats["findings"] += len(findings)
        return findings

    def add_rank_progress(self, progress: list[RankProgress], cluster: str) -> list[Finding]:
        """Progress heartbeats (any jobs): the hang detector, per job, at once."""
        by_job: dict[str, list[RankProgress]] = {}
        for p in progress:
            by_job.setdefault(p.job_id, []).append(p)
        findings: list[Finding] = []
        for job_progress in by_job.values():
            findings += self.stragglers.add_progress(job_progress, cluster)
        self.stats["findings"] += len(findings)
        return findings

    def process(self, snap: pb.Snapshot) -> list[Finding]:
        """One snapshot: its counters through stages 1 and 2, then its rank steps."""
        findings: list[Finding] = []
        if snap.blocks or snap.events:
            findings += self.process_batch(snapshot_batch(snap))
        if snap.rank_steps:
            findings += self.add_rank_steps(rank_steps_of(snap), snap.cluster)
        if snap.rank_progress:
            findings += self.add_rank_progress(rank_progress_of(snap), snap.cluster)
        return findings

    def tick_cluster(self, now_ns: int) -> list[Finding]:
        """Let time-based state expire without records (the storm locators' grace periods)."""
        return self.storms.poll(now_ns) + self._release()

    def finish(self) -> list[Finding]:
        """The end of the input: release every rank step still held."""
        findings, placements = self.stragglers.flush()
        self.facts.apply_all(placements)
        self.stats["findings"] += len(findings)
        return findings

    def _release(self) -> list[Finding]:
        findings, placements = self.stragglers.release()
        self.facts.apply_all(placements)
        return findings

    # -- what the stages hold ----------------------------------------------------------------
    @property
    def open_anomalies(self) -> dict[str, tuple[str, str]]:
        return {**self.sources.open_anomalies, **self.storms.open_anomalies, **self.stragglers.open_anomalies}

    def counters(self) -> Counter[str]:
        """Every stage's counters together (replay's report)."""
        total: Counter[str] = Counter(self.stats)
        total.update(self.sources.stats)
        total.update(self.sources.rates.stats)
        total.update(self.sources.gpu_faults.stats)
        total.update(self.stragglers.stats)
        for acct in (self.sources.accounting, self.storms.accounting, self.stragglers.accounting):
            total.update(acct.stats)
        return total
