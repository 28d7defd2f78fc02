"""What the worker's telemetry stage sends per batch (`StageHandlers.on_telemetry_many`), driven without Kafka.

Every record sent is a Kafka send and, for the pause-states topic, a record every storm
stage reads: a batch's progress goes out once (one record per pause-states partition,
naming every telemetry partition of the batch, after all of its changes), not once per
record and partition. The storm answers are those of the record-by-record path.
"""
from __future__ import annotations

from fabricwatch.models.storm_locator import SourceProgress
from fabricwatch.models.topology import rail_optimised
from fabricwatch.simulator.cluster import ClusterSimulator
from fabricwatch.simulator.fabric_faults import PfcStorm
from fabricwatch.simulator.workload import Job
from fabricwatch.streams.codec import pause_change_from_json
from fabricwatch.streams.config import DetectionConfig
from fabricwatch.streams.decode import pack
from fabricwatch.streams.facts import FactBook
from fabricwatch.streams.handlers import PAUSE_STATES, StageHandlers
from fabricwatch.streams.source_stage import SourceStage
from fabricwatch.streams.storm_stage import StormStage

PARTITIONS, PAUSE_PARTITIONS = 3, 2
TOPO = rail_optimised("sim", n_nodes=8, gpus_per_node=2, nodes_per_unit=4, n_spines=2)


def ticks(seconds=4.0):
    jobs = [Job("job-a", ("node-0001", "node-0002", "node-0003", "node-0004"))]
    storm = PfcStorm(sources=(("node-0003", "mlx5_1/1"),), onset_s=1.0, offset_s=3.0)
    sim = ClusterSimulator(TOPO, seed=5, interval_s=0.1, jobs=jobs, faults=[storm], rank_steps=False)
    for tick in sim.run(seconds):
        yield [(sum(s.source.encode()) % PARTITIONS, pack([s]).SerializeToString())
               for s in sorted(tick, key=lambda s: s.source)]


def run(per_record: bool):
    """(records sent per call, storm answers of one storm stage reading pause-states partition 0)."""
    handlers, facts = StageHandlers(1, PAUSE_PARTITIONS), FactBook(TOPO)
    stages = [SourceStage(DetectionConfig(), TOPO, facts, "t", p, PARTITIONS) for p in range(PARTITIONS)]
    storms = StormStage(DetectionConfig(), TOPO, facts)
    calls, found = [], []
    for tick in ticks():
        items = [(raw, stages[p], p, None) for p, raw in tick]
        for chunk in ([[i] for i in items] if per_record else [items]):
            sent = [r for r in handlers.on_telemetry_many(chunk) if r.topic == PAUSE_STATES]
            calls.append(sent)
            for r in sent:
                if r.partition in (None, 0):
                    found += storms.locate(pause_change_from_json(r.value))
    answers = sorted((f.kind, f.entity.path(), f.state, f.detected_ns, tuple(sorted(r.path() for r in f.related)))
                     for f in found)
    return calls, answers


def test_a_batch_sends_its_progress_once_per_pause_partition_after_its_changes_with_the_same_answers():
    calls, answers = run(per_record=False)
    per_record_calls, per_record_answers = run(per_record=True)
    assert answers and any(a[0] == "pfc_storm" for a in answers)
    assert answers == per_record_answers
    for sent in calls:
        progress = [i for i, r in enumerate(sent) if isinstance(pause_change_from_json(r.value), SourceProgress)]
        assert len(progress) <= PAUSE_PARTITIONS
        assert progress == list(range(len(sent) - len(progress), len(sent)))       # after every change
        assert sorted(sent[i].partition for i in progress) in ([], list(range(PAUSE_PARTITIONS)))
    merged = [pause_change_from_json(sent[-1].value) for sent in calls if sent]
    assert any(len(p.through_ns_by_source) == PARTITIONS for p in merged if isinstance(p, SourceProgress))
    assert sum(map(len, calls)) * 2 < sum(map(len, per_record_calls))
