"""The detection pipeline over decoded telemetry: rates, then every detector.

One plain object, driven by the Faust agents in the worker and by `replay` alike, so
what is tested without Kafka is exactly what runs in production.
"""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

from fabricwatch.models.findings import Finding
from fabricwatch.models.gpu_faults import GpuFaultDetector
from fabricwatch.models.link_downgrade import LinkDowngradeDetector
from fabricwatch.models.link_flap import LinkFlapDetector
from fabricwatch.models.rates import RateTracker
from fabricwatch.models.topology import DEFAULT_NIC_RATE, Topology
from fabricwatch.protos.v1 import telemetry_pb2 as pb

from .decode import to_view


@dataclass(frozen=True)
class DetectionConfig:
    default_nic_rate: str = DEFAULT_NIC_RATE
    gpu_busy_utilization_pct: float = 20.0


class DetectionPipeline:
    """Feed it snapshots of many sources in per-source event-time order; get findings."""

    def __init__(self, config: DetectionConfig | None = None, topology: Topology | None = None) -> None:
        self.config = config or DetectionConfig()
        self.topology = topology
        self.rates = RateTracker()
        self.detectors = [
            LinkDowngradeDetector(topology, self.config.default_nic_rate, self.config.gpu_busy_utilization_pct),
            LinkFlapDetector(),
            GpuFaultDetector(),
        ]
        self._last_time_ns: dict[str, int] = {}
        self.stats: Counter[str] = Counter()

    def process(self, snap: pb.Snapshot) -> list[Finding]:
        last = self._last_time_ns.get(snap.source)
        if last is not None and snap.time_unix_ns <= last:
            # A duplicate (at-least-once redelivery, collector resend) or a late sample:
            # rates cannot run backwards, so it is counted and skipped.
            self.stats["duplicate_or_late_snapshots"] += 1
            return []
        self._last_time_ns[snap.source] = snap.time_unix_ns
        self.stats["snapshots"] += 1
        view = to_view(snap)
        for frame in view.frames:
            self.rates.update(view.source, frame, view.time_ns)
        findings: list[Finding] = []
        for detector in self.detectors:
            findings.extend(detector.update(view))
        self.stats["findings"] += len(findings)
        return findings
