"""Detection state survives a restart: checkpoint mid-storm, restore, continue."""
import pickle

from fabricwatch.collectors.faults import PfcStorm
from fabricwatch.collectors.simulator import ClusterSimulator
from fabricwatch.models.topology import rail_optimised
from fabricwatch.streams import checkpoint
from fabricwatch.streams.pipeline import DetectionConfig, DetectionPipeline


def storm_ticks():
    topo = rail_optimised("c1", n_nodes=8, nodes_per_unit=8, n_spines=2)
    sim = ClusterSimulator(topo, seed=3, interval_s=0.1,
                           faults=[PfcStorm(sources=(("node-0003", "mlx5_2/1"),), onset_s=2.0, offset_s=4.0)])
    return topo, [sim.tick() for _ in range(60)]


def run(pipeline, ticks):
    return [(f.kind, f.state) for tick in ticks for s in tick for f in pipeline.process(s)
            if f.kind == "pfc_storm"]


def test_restart_mid_storm_neither_reopens_nor_loses_the_resolution(tmp_path):
    topo, ticks = storm_ticks()
    uninterrupted = run(DetectionPipeline(topology=topo), ticks)
    assert [s for _, s in uninterrupted][0] == "open" and uninterrupted[-1] == ("pfc_storm", "resolved")

    first = DetectionPipeline(topology=topo)
    before = run(first, ticks[:30])                       # the storm is open at 3.0 s
    path = tmp_path / "w.checkpoint"
    assert checkpoint.save(first, path, {("fabricwatch.telemetry.v1", 3): 41}) > 0
    restored = checkpoint.load(path, DetectionPipeline(topology=topo))
    assert restored is not None and restored.offsets == {("fabricwatch.telemetry.v1", 3): 41}
    after = run(restored.pipeline, ticks[30:])
    assert before + after == uninterrupted
    assert ("pfc_storm", "open") not in after


def test_checkpoint_for_another_configuration_or_garbage_is_ignored(tmp_path):
    topo, ticks = storm_ticks()
    p = DetectionPipeline(topology=topo)
    run(p, ticks[:5])
    path = tmp_path / "w.checkpoint"
    checkpoint.save(p, path)
    other = DetectionPipeline(DetectionConfig(pfc_detection_time_ms=400), topology=topo)
    assert checkpoint.load(path, other) is None
    path.write_bytes(b"\x80garbage")
    assert checkpoint.load(path, DetectionPipeline(topology=topo)) is None
    path.write_bytes(pickle.dumps(("someone-else/1", "x", object())))
    assert checkpoint.load(path, DetectionPipeline(topology=topo)) is None
    # the format before offsets were recorded: ignored, never half-loaded
    path.write_bytes(pickle.dumps(("fabricwatch-pipeline-checkpoint/1", checkpoint._fingerprint(p), p)))
    assert checkpoint.load(path, DetectionPipeline(topology=topo)) is None
    # offsets that are not (topic, partition) -> non-negative offset
    path.write_bytes(pickle.dumps((checkpoint.FORMAT, checkpoint._fingerprint(p), p, {("t", 0): -5})))
    assert checkpoint.load(path, DetectionPipeline(topology=topo)) is None
