"""Gateway validation: bad input gets a reason and a count, valid parts are kept."""
import math
import time

from helpers import NIC_COUNTERS, gpu_block, nic_snapshot

from fabricwatch.protos.v1 import telemetry_pb2 as pb
from fabricwatch.streams.validate import validate_snapshot

NOW = time.time_ns()


def reasons(verdict):
    return sorted(verdict.reasons())


def test_valid_snapshot_passes_untouched():
    snap = nic_snapshot(t_ns=NOW)
    gpu_block(snap)
    before = snap.SerializeToString()
    v = validate_snapshot(snap, NOW)
    assert v.accepted and v.problems == []
    assert snap.SerializeToString() == before


def test_missing_source_rejects_whole_snapshot():
    snap = nic_snapshot(source="", t_ns=NOW)
    v = validate_snapshot(snap, NOW)
    assert not v.accepted and reasons(v) == ["bad_source"]


def test_hostile_source_name_is_rejected():
    snap = nic_snapshot(source="node-1\n; rm -rf /", t_ns=NOW)
    assert reasons(validate_snapshot(snap, NOW)) == ["bad_source"]


def test_absurd_timestamps_are_rejected():
    for t in (NOW + 3600 * 10**9, 0, -5):
        snap = nic_snapshot(t_ns=t)
        v = validate_snapshot(snap, NOW)
        assert not v.accepted and reasons(v) == ["timestamp_out_of_range"]


def test_small_clock_skew_is_accepted():
    assert validate_snapshot(nic_snapshot(t_ns=NOW + 30 * 10**9), NOW).accepted


def test_entity_with_wrong_counter_count_is_dropped_rest_kept():
    snap = nic_snapshot(t_ns=NOW)
    del snap.blocks[0].entities[3].counters[-1]
    v = validate_snapshot(snap, NOW)
    assert v.accepted and reasons(v) == ["bad_counter_count"]
    ids = [e.id for e in snap.blocks[0].entities]
    assert len(ids) == 7 and "mlx5_3/1" not in ids


def test_nan_gauge_is_kept_as_not_read_and_inf_is_cleared():
    snap = nic_snapshot(t_ns=NOW)
    snap.blocks[0].entities[0].gauges[0] = math.nan
    snap.blocks[0].entities[1].gauges[0] = math.inf
    v = validate_snapshot(snap, NOW)
    assert v.accepted and reasons(v) == ["non_finite_gauge"]
    assert math.isnan(snap.blocks[0].entities[1].gauges[0])
    assert len(snap.blocks[0].entities) == 8


def test_wrong_unit_gauge_is_cleared_and_counted():
    snap = nic_snapshot(t_ns=NOW)
    gpu_block(snap, util=9000.0)   # percent sent as basis points
    v = validate_snapshot(snap, NOW)
    assert v.accepted
    assert v.reasons()["gauge_out_of_range"] == 8
    assert all(math.isnan(e.gauges[0]) for e in snap.blocks[1].entities)
    assert all(e.gauges[5] == 60 for e in snap.blocks[1].entities)   # the rest of the GPU row kept


def test_repeated_entity_ids_and_column_names():
    snap = nic_snapshot(t_ns=NOW)
    snap.blocks[0].entities[1].id = "mlx5_0/1"
    v = validate_snapshot(snap, NOW)
    assert reasons(v) == ["bad_entity_id"] and len(snap.blocks[0].entities) == 7
    snap = nic_snapshot(t_ns=NOW)
    snap.blocks[0].counter_names[1] = NIC_COUNTERS[0]
    v = validate_snapshot(snap, NOW)
    assert v.accepted and reasons(v) == ["bad_column_names"] and len(snap.blocks) == 0


def test_bad_rank_steps_are_dropped_good_ones_kept():
    snap = nic_snapshot(t_ns=NOW)
    good = dict(job_id="job-1", world_size=4, node="node-0001", step=10, step_seconds=1.0, busy_seconds=0.7,
                collective_wait_seconds=0.3)
    snap.rank_steps.add(rank=0, **good)
    snap.rank_steps.add(rank=9, **good)                                  # rank >= world size
    snap.rank_steps.add(rank=1, **{**good, "step_seconds": math.nan})    # NaN timing
    snap.rank_steps.add(rank=2, **{**good, "busy_seconds": -1.0})        # negative
    v = validate_snapshot(snap, NOW)
    assert v.accepted and v.reasons()["bad_rank_step"] == 3
    assert [r.rank for r in snap.rank_steps] == [0]


def test_unknown_entity_kind_block_is_dropped():
    snap = nic_snapshot(t_ns=NOW)
    snap.blocks.add(entity_kind=99, counter_names=["x"])
    v = validate_snapshot(snap, NOW)
    assert v.accepted and reasons(v) == ["bad_entity_kind"] and len(snap.blocks) == 1


def test_oversized_snapshot_is_rejected():
    snap = nic_snapshot(t_ns=NOW)
    for _ in range(40):
        snap.blocks.add(entity_kind=pb.ENTITY_KIND_GPU)
    assert reasons(validate_snapshot(snap, NOW)) == ["too_large"]
