"""The worker's state is bounded whatever ids the senders choose (issue #13, item 4).

A token binds a collector to its nodes, not to the entity ids, jobs or ranks it names: a
sender naming fresh ids in every snapshot must not grow the worker or its checkpoint
without bound, and each cap says so (a counter, a metric, a log line).
"""
from __future__ import annotations

import logging
import pickle
import time
from collections import Counter

from helpers import gpu_block, nic_snapshot

from fabricwatch.models.fabric_summary import MAX_PORTS_PER_SOURCE, FabricSummary
from fabricwatch.models.rates import MAX_LAYOUTS_PER_SOURCE
from fabricwatch.protos.v1 import telemetry_pb2 as pb
from fabricwatch.streams import source_stage, worker_metrics
from fabricwatch.streams.config import DetectionConfig
from fabricwatch.streams.decode import snapshot_batch
from fabricwatch.streams.facts import FactBook
from fabricwatch.streams.source_stage import SourceStage
from fabricwatch.streams.worker_metrics import WorkerMetrics, state_refusals

S = 10**9


def churning_switch(tick: int, t0: int, ports: int = 64) -> pb.Snapshot:
    """A switch naming `ports` port ids never seen before in every snapshot."""
    snap = pb.Snapshot(cluster="c1", source="leaf-churn", source_kind=pb.SOURCE_KIND_SWITCH,
                       time_unix_ns=t0 + tick * S // 10, seq=tick)
    snap.blocks.add(entity_kind=pb.ENTITY_KIND_SWITCH_PORT, entity_ids=[f"Ethernet{tick}_{j}" for j in range(ports)],
                    counter_names=["out-octets", "in-octets"], counters=[tick * 1000] * (2 * ports))
    return snap


def test_fresh_port_ids_every_tick_keep_the_checkpoint_bounded_and_honest_rates_intact():
    stage = SourceStage(DetectionConfig(), None, FactBook())
    t0 = time.time_ns() - 600 * S
    sizes = []
    for tick in range(1_200):
        stage.observe(snapshot_batch(churning_switch(tick, t0)))
        if tick % 10 == 0:        # an honest node alongside, every second
            snap = nic_snapshot(source="node-honest", t_ns=t0 + tick * S // 10, seq=tick // 10 + 1)
            gpu_block(snap)
            stage.observe(snapshot_batch(snap))
        if tick in (300, 1_199):
            sizes.append(len(pickle.dumps(stage)))
    # before the bound: ~2.2 KB more per snapshot (2.6 MB here), growing for ever
    assert sizes[1] < sizes[0] * 1.2, sizes
    assert sizes[1] < 200_000, sizes
    assert len(stage.rates._layouts["leaf-churn"]) == MAX_LAYOUTS_PER_SOURCE
    assert stage.rates.stats["layouts_evicted"] == 1_200 - MAX_LAYOUTS_PER_SOURCE
    honest = [k for k in stage.rates._last if k[0] == "node-honest"]
    assert honest and all(stage.rates._last[k][0] == t0 + 1_190 * S // 10 for k in honest)   # still followed


def test_a_checkpoint_from_before_the_layout_bound_restores_and_is_bounded_from_then_on():
    stage = SourceStage(DetectionConfig(), None, FactBook())
    t0 = time.time_ns() - 600 * S
    for tick in range(50):
        stage.observe(snapshot_batch(churning_switch(tick, t0)))
    old = stage.rates.__dict__
    del old["_layouts"], old["max_layouts_per_source"]        # what an older worker pickled
    old_stage = pickle.loads(pickle.dumps(stage))
    for tick in range(50, 100):
        old_stage.observe(snapshot_batch(churning_switch(tick, t0)))
    assert len(old_stage.rates._last) == MAX_LAYOUTS_PER_SOURCE


def test_sources_past_the_cap_are_refused_counted_exported_and_logged(monkeypatch, caplog):
    monkeypatch.setattr(source_stage, "MAX_SOURCES", 3)
    stage = SourceStage(DetectionConfig(), None, FactBook())
    t0 = time.time_ns()
    for i in range(5):
        stage.observe(snapshot_batch(nic_snapshot(source=f"node-{i}", t_ns=t0, seq=1)))
    assert stage.stats["sources_refused"] == 2

    class States:                         # the worker's PartitionStates, as WorkerMetrics reads it
        def of_kind(self, kind):
            return [(0, stage)] if kind is SourceStage else []

    metrics = WorkerMetrics.__new__(WorkerMetrics)
    metrics.states = States()
    metrics._refused = worker_metrics.CounterMirror(worker_metrics.metrics.WORKER_STATE_REFUSED)
    metrics._refused_logged = Counter()
    assert state_refusals(metrics.states)["sources"] == 2

    def exported():
        samples = [x for m in worker_metrics.metrics.WORKER_STATE_REFUSED.collect() for x in m.samples]
        return sum(x.value for x in samples if x.name.endswith("_total") and x.labels == {"bound": "sources"})

    before = exported()
    with caplog.at_level(logging.WARNING, logger="fabricwatch.worker"):
        metrics.export_refusals()
        metrics.export_refusals()                  # nothing new: no second line, nothing added
    assert exported() - before == 2
    lines = [r.getMessage() for r in caplog.records if "state cap" in r.getMessage()]
    assert len(lines) == 1 and "'sources': 2 more refused" in lines[0]


def test_the_fabric_summary_gives_each_source_a_bounded_share_of_ports_and_timeline():
    summary = FabricSummary()
    t0 = time.time_ns()
    for tick in range(3):
        summary.add(snapshot_batch(churning_switch(tick, t0, ports=4_000)))      # 12,000 fresh ports
        summary.add(snapshot_batch(nic_snapshot(source="node-honest", t_ns=t0 + tick * S // 10, seq=tick + 1)))
    per_source = Counter(source for _, source, _ in summary.ports)
    assert per_source["leaf-churn"] == MAX_PORTS_PER_SOURCE and per_source["node-honest"] == 8
    assert summary.stats["ports_refused"] > 0
    assert len(summary._rates._last) <= 2 * MAX_LAYOUTS_PER_SOURCE
