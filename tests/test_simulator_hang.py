"""The simulator's rank side: `RankProgress` heartbeats, hang faults and their labels, hang scenarios."""
from __future__ import annotations

from collections import defaultdict

import pytest

from fabricwatch.models import hang, node_health
from fabricwatch.models.topology import rail_optimised
from fabricwatch.protos.v1 import telemetry_pb2 as pb
from fabricwatch.rank import HEARTBEAT_INTERVAL_S
from fabricwatch.simulator.cluster import ClusterSimulator
from fabricwatch.simulator.fabric_faults import AdminToggle, LinkDown
from fabricwatch.simulator.host_faults import CheckpointStall, GpuXid, JobPause, LongStep, RankLost, RankStuck
from fabricwatch.simulator.labels import HANG_LABEL_MIN_S, HANG_ROOTS
from fabricwatch.simulator.workload import Job
from fabricwatch.streams import topics
from fabricwatch.streams.decode import rank_progress_of
from fabricwatch.streams.gateway import split_records
from fabricwatch.streams.validate import validate_snapshot

START = 1_800_000_000_000_000_000
G = 8


def topo():
    return rail_optimised("t", n_nodes=8, nodes_per_unit=4, n_spines=2)


def jobs(t):
    n = t.nodes
    return [Job("job-a", tuple(n[0:3]), step_compute_s=0.6, step_comm_s=0.3),
            Job("job-b", tuple(n[4:7]), step_compute_s=0.8, step_comm_s=0.25)]


def run(faults=(), seconds=60.0, interval_s=1.0, **kw):
    """(simulator, snapshots, per (job, rank) its heartbeats in time order as (t_s, entered, completed, msg))."""
    t = topo()
    sim = ClusterSimulator(t, seed=3, start_unix_ns=START, jobs=jobs(t), faults=list(faults), interval_s=interval_s,
                           **kw)
    snaps = [s for tick in sim.run(seconds) for s in tick]
    beats = defaultdict(list)
    for s in snaps:
        for b in s.rank_progress:
            beats[(b.job_id, b.rank)].append(((b.time_unix_ns - START) / 1e9, b.collectives_entered,
                                              b.collectives_completed, b))
    for v in beats.values():
        v.sort(key=lambda x: x[0])
    return sim, snaps, beats


def hangs(sim):
    return [g for g in sim.ground_truth() if g.kind == "hang"]


# -------------------------------------------------------------------------------- heartbeats


def test_every_rank_beats_every_5_s_spread_over_the_period_and_the_gateway_accepts_them():
    sim, snaps, beats = run(seconds=60.0)
    assert set(beats) == {(j, r) for j in ("job-a", "job-b") for r in range(3 * G)}
    firsts = []
    for key, v in beats.items():
        times = [x[0] for x in v]
        assert len(times) == 12, key
        gaps = [b - a for a, b in zip(times, times[1:])]
        assert all(abs(g - HEARTBEAT_INTERVAL_S) < 0.02 for g in gaps), key   # node clocks jitter < 1 ms
        firsts.append(times[0])
    assert max(firsts) - min(firsts) > 3.0          # spread over the period, not all at once
    carriers = [s for s in snaps if s.rank_progress]
    for s in carriers:
        assert {b.node for b in s.rank_progress} == {s.source}        # each node carries its own ranks'
        before = len(s.rank_progress)
        verdict = validate_snapshot(s, s.time_unix_ns)
        assert len(s.rank_progress) == before, verdict


def test_counters_are_monotone_and_grow_with_the_rank_steps():
    sim, snaps, beats = run(seconds=60.0)
    steps = defaultdict(list)        # (job, rank) -> step end times (s)
    for s in snaps:
        for st in s.rank_steps:
            steps[(st.job_id, st.rank)].append((st.start_unix_ns - START) / 1e9 + st.step_seconds)
    for key, v in beats.items():
        for (t0, e0, c0, _), (t1, e1, c1, m1) in zip(v, v[1:]):
            assert e1 >= e0 and c1 >= c0 and c1 <= e1 <= c1 + 1, key
            assert m1.last_entered_unix_ns <= m1.time_unix_ns and m1.last_completed_unix_ns <= m1.time_unix_ns
            ended = sum(1 for e in steps[key] if t0 < e <= t1)
            assert abs((c1 - c0) - ended) <= 1, key     # one all-reduce per step (a step ending at the edge)
        last_t, _, last_c, _ = v[-1]
        assert abs(last_c - sum(1 for e in steps[key] if e <= last_t)) <= 1    # counted from the start


def test_heartbeats_ride_with_the_rank_steps_to_the_rank_steps_topic():
    _, snaps, _ = run(seconds=10.0)
    records = split_records(snaps)
    carried = [rank_progress_of(pb.Snapshot.FromString(v)) for t, k, v in records if t == topics.RANK_STEPS]
    assert {p.job_id for part in carried for p in part} == {"job-a", "job-b"}


def test_no_heartbeats_without_rank_steps():
    _, snaps, beats = run(seconds=10.0, rank_steps=False)
    assert not beats


# -------------------------------------------------------------------------------- hang faults


def test_stuck_rank_never_enters_the_next_collective_its_peers_wait_in_it_and_it_keeps_beating():
    t = topo()
    node = t.nodes[1]                       # job-a, node index 1: ranks 8..15
    sim, _, beats = run([RankStuck(node, 3, onset_s=20.4)], seconds=70.0)
    culprit = beats[("job-a", 11)]
    late = [x for x in culprit if x[0] > 35]
    assert late and all(e == c for _, e, c, _ in late)                     # alive, between collectives
    e_stuck = late[-1][1]
    for r in (0, 10, 23):
        peer = [x for x in beats[("job-a", r)] if x[0] > 35]
        assert all(e == e_stuck + 1 and c == e_stuck for _, e, c, _ in peer), r   # inside the next one
    other = beats[("job-b", 0)]
    assert other[-1][2] > other[len(other) // 2][2]                       # the other job goes on
    (gt,) = hangs(sim)
    assert gt.entity == "job=job-a/rank=11" and gt.expect_alert and gt.detail["root"] == "stuck_process"
    assert gt.victims == ("job=job-a",) and f"{node}/gpu3" in gt.related


def test_dead_rank_stops_beating_and_its_job_restarts_at_the_offset():
    t = topo()
    sim, _, beats = run([RankLost(t.nodes[0], 5, onset_s=20.4, offset_s=60.4)], seconds=120.0)
    dead = beats[("job-a", 5)]
    assert not [x for x in dead if 20.4 <= x[0] < 60.4]
    before, after = [x for x in dead if x[0] < 20.4], [x for x in dead if x[0] > 60.4]
    assert after and after[0][0] > 60.4 + 30 - 1.5          # nothing while the job restarts (30 s)
    assert after[0][2] < before[-1][2] and after[-1][2] > after[0][2]   # a new process, counting from 0
    peers = [x for x in beats[("job-a", 0)] if 30 < x[0] < 60]
    assert len({c for _, _, c, _ in peers}) == 1            # nothing completes while it is gone
    (gt,) = hangs(sim)
    assert gt.entity == "job=job-a/rank=5" and gt.detail["root"] == "process_lost"


def test_gpu_lost_and_nic_down_label_the_root_and_the_hang_as_its_consequence():
    t = topo()
    sim, _, _ = run([GpuXid(t.nodes[5], 2, 79, onset_s=10.4),
                     LinkDown(t.nodes[2], "mlx5_6/1", onset_s=12.4, failover=False)], seconds=5.0)
    kinds = sorted((g.kind, g.entity, g.detail.get("root")) for g in sim.ground_truth())
    assert kinds == [("gpu_xid", f"{t.nodes[5]}/gpu2", None), ("hang", "job=job-a/rank=22", "nic_down"),
                     ("hang", "job=job-b/rank=10", "xid"), ("link_down", f"{t.nodes[2]}/mlx5_6/1", None)]
    assert all(g.expect_alert for g in sim.ground_truth())


def test_no_hang_label_for_a_short_stall_a_failover_or_an_idle_node():
    t = topo()
    sim, _, _ = run([GpuXid(t.nodes[0], 1, 79, onset_s=5.4, offset_s=5.4 + HANG_LABEL_MIN_S - 10),
                     LinkDown(t.nodes[1], "mlx5_2/1", onset_s=5.4, failover=True),
                     GpuXid(t.nodes[3], 1, 79, onset_s=5.4)], seconds=2.0)     # node 3 runs no job
    assert not hangs(sim)


def test_an_operator_shutting_a_busy_nics_leaf_port_for_minutes_hangs_its_job():
    t = topo()
    leaf = t.nic(t.nodes[4], "mlx5_3/1")
    sim, _, _ = run([AdminToggle(leaf.switch, leaf.switch_port, onset_s=5.4, down_s=90.0)], seconds=2.0)
    (gt,) = hangs(sim)
    assert gt.entity == "job=job-b/rank=3" and gt.detail["root"] == "nic_down"


def test_negatives_are_labelled_must_not_fire_and_look_as_they_should():
    t = topo()
    faults = [CheckpointStall(t.nodes[0], onset_s=10.4, duration_s=60.0), JobPause(t.nodes[4], onset_s=10.4,
                                                                                   duration_s=40.0)]
    sim, _, beats = run(faults, seconds=90.0)
    labels = {g.kind: g for g in sim.ground_truth()}
    assert set(labels) == {"checkpoint_stall", "job_pause"}
    assert all(not g.expect_alert and g.entity.startswith("job=") for g in labels.values())
    ckpt = [x for x in beats[("job-a", 7)] if 20 < x[0] < 65]
    assert len({c for _, _, c, _ in ckpt}) == 1 and all(e == c for _, e, c, _ in ckpt)   # idle, nobody inside
    paused = beats[("job-b", 3)]
    assert not [x for x in paused if 10.4 <= x[0] < 50.4] and [x for x in paused if x[0] > 55]
    sim, _, beats = run([LongStep(t.nodes[0], onset_s=10.4, duration_s=60.0)], seconds=90.0)
    inside = [x for x in beats[("job-a", 0)] if 20 < x[0] < 65]
    assert all(b[2] > a[2] for a, b in zip(inside, inside[1:]))      # small collectives keep completing
    steps_during = [g for g in sim.ground_truth()]
    assert [g.kind for g in steps_during] == ["long_step"]


def test_rank_faults_need_a_rank_that_runs_a_job():
    t = topo()
    with pytest.raises(ValueError, match="runs no job"):
        run([RankStuck(t.nodes[3], 0, onset_s=1.0)], seconds=1.0)
    with pytest.raises(ValueError):
        RankLost("n", 0, onset_s=5.0, offset_s=4.0)
    with pytest.raises(ValueError):
        LongStep("n", onset_s=1.0, duration_s=10.0, collective_every_s=20.0)


def test_hang_roots_are_spelled_as_the_hang_detector_codes_them():
    assert set(HANG_ROOTS) == {hang.STUCK_PROCESS, hang.PROCESS_LOST, node_health.XID, node_health.NIC_DOWN}


# -------------------------------------------------------------------------------- evaluation


def test_hang_scenarios_cover_every_root_and_negative_with_enough_cases():
    from fabricwatch.evaluation.fault_scenarios import HANG_NEGATIVES, HANG_VARIANTS
    from fabricwatch.evaluation.scenarios import SuiteConfig
    from fabricwatch.evaluation.suites import build_suites

    suites = [s for s in build_suites(SuiteConfig(healthy_node_hours=0.0)) if s.suite == "hang"]
    roots, negatives = defaultdict(int), set()
    for sc in suites:
        for g in sc.simulator().ground_truth():
            if g.kind == "hang":
                roots[g.detail["root"]] += g.expect_alert
            elif not g.expect_alert:
                negatives.add(g.kind)
    assert set(roots) == set(HANG_VARIANTS) and min(roots.values()) >= 4
    assert negatives == set(HANG_NEGATIVES)


@pytest.mark.slow
def test_the_pipeline_names_the_stuck_rank_and_stays_silent_on_the_paused_job():
    from fabricwatch.evaluation.matching import match
    from fabricwatch.evaluation.runs import FABRICWATCH, run_scenario
    from fabricwatch.evaluation.fault_scenarios import _hang

    sc = _hang(8, 808)                      # stuck process; the other job paused
    assert [type(f).__name__ for f in sc.faults] == ["RankStuck", "JobPause"]
    r = run_scenario(sc, (FABRICWATCH,))
    m = match(r.detections[FABRICWATCH], r.truths, sc.interval_s, r.end_ns)
    assert [(tp.cls, tp.cause) for tp in m.tps] == [("hang", "stuck_process")] and not m.fps and not m.fns
    assert m.tps[0].delay_ns < 60e9


def test_a_hang_held_up_by_two_ranks_matches_either():
    from fabricwatch.simulator.labels import GroundTruth
    from fabricwatch.evaluation.matching import Detection, match

    gt = GroundTruth("hang", "job=j/rank=3", 10, None, victims=("job=j",),
                     detail={"root": "stuck_process", "culprits": ("job=j/rank=3", "job=j/rank=12")})
    d = Detection("hang", "job=j/rank=12", 5_000_000_000, job="j", rank="12")
    m = match([d], [gt], interval_s=1.0, end_ns=60_000_000_000)
    assert len(m.tps) == 1 and not m.fps
