"""Hang localisation (models/hang.py): each variant, each negative, the gateway's validation."""
from __future__ import annotations

import time

import pytest

from fabricwatch.models.findings import OPEN, RESOLVED, UPDATE
from fabricwatch.models.frames import RankProgress, RankStep
from fabricwatch.models.hang import (HANG_AFTER_CAP_S, HANG_AFTER_FLOOR_S, HEARTBEAT_LOST_S, JOB_GONE_S,
                                     PROCESS_LOST, STUCK_PROCESS, HangDetector)
from fabricwatch.models.node_health import (NIC_DOWN, STORM_VICTIM, XID, Episode, HealthBook, HealthEvent,
                                            NodeHealth)
from fabricwatch.protos.v1 import telemetry_pb2 as pb
from fabricwatch.streams.validate import validate_snapshot

S = 10**9
T0 = 1_700_000_000 * S          # a plausible wall clock
WORLD = 8


def beat(t_s, rank, entered, completed, last_e_s, last_c_s=None, job="j1", world=WORLD, skew_s=0.0):
    """One heartbeat at job time t_s (the rank's clock skewed by skew_s)."""
    last_c_s = last_e_s if last_c_s is None else last_c_s
    off = int(skew_s * S)
    return RankProgress(job, rank, world, f"node-{rank // 4}", rank % 4, T0 + int(t_s * S) + off, entered, completed,
                        T0 + int(last_e_s * S) + off if entered else 0,
                        T0 + int(last_c_s * S) + off if completed else 0, 3)


def run(det, until_s, state, every_s=5.0, start_s=0.0, ranks=range(WORLD), **kw):
    """Heartbeats of `ranks` every `every_s` from start_s to until_s; state(t, rank) ->
    (entered, completed, last_entered_s, last_completed_s)."""
    out = []
    t = start_s
    while t <= until_s:
        out += det.add_progress([beat(t, r, *state(t, r), **kw) for r in ranks], cluster="c1")
        t += every_s
    return out


def healthy(t, r):
    """One collective per second, every rank in step: #n completed at second n."""
    n = int(t)
    return n, n, float(n), float(n)


def stuck_before(n, culprit, at_s):
    """Healthy until at_s; then `culprit` never enters collective n+1, its peers wait in it."""
    assert n >= at_s - 1, "healthy ticks must not pass collective n before at_s (counters never go back)"

    def state(t, r):
        if t < at_s:
            return healthy(t, r)
        if r == culprit:
            return n, n, at_s - 1, at_s - 1
        return n + 1, n, at_s, at_s - 1
    return state


def opened(out):
    return [f for f in out if f.state == OPEN]


def test_rank_that_never_enters_is_named_within_the_threshold_with_sequence_numbers():
    det = HangDetector()
    out = run(det, 100, stuck_before(40, culprit=5, at_s=41))
    first = opened(out)
    assert len(first) == 1, [f.summary for f in out]
    f = first[0]
    assert (f.kind, f.entity.job, f.entity.rank, f.entity.node, f.entity.device) == ("hang", "j1", "5", "node-1", "gpu1")
    assert f.severity == "critical" and f.cause == STUCK_PROCESS
    named_after_s = (f.detected_ns - f.onset_ns) / S
    assert HANG_AFTER_FLOOR_S <= named_after_s <= HANG_AFTER_FLOOR_S + 5, named_after_s
    ev = {e.name: e for e in f.evidence}
    assert ev["collectives_entered"].value == 40 and ev["collectives_entered"].threshold == 41
    assert ev["ranks_waiting"].value == 7
    assert ev["culprit_rule"].detail == "never_entered"
    assert "entered 40 completed 40: rank 5" in ev["sequence_numbers"].detail
    assert "entered 41 completed 40: ranks 0-4,6-7" in ev["sequence_numbers"].detail
    assert "never entered collective #41" in f.summary
    assert [x.state for x in out].count(UPDATE) == 0     # no re-emission while nothing changes


def test_rank_that_entered_but_never_completed_is_named():
    det = HangDetector()

    def state(t, r):
        if t < 41:
            return healthy(t, r)
        if r == 2:                  # entered 41 with everyone, never left it; peers left and entered 42
            return 41, 40, 40.0, 39.0
        return 42, 41, 41.0, 40.5
    f = opened(run(det, 100, state))
    assert f and f[0].entity.rank == "2"
    ev = {e.name: e for e in f[0].evidence}
    # lowest entered wins first: rank 2 entered 41, peers 42
    assert ev["collectives_entered"].value == 41


def test_all_ranks_inside_one_behind_on_completions():
    det = HangDetector()

    def state(t, r):
        if t < 41:
            return healthy(t, r)
        return (41, 39, 40.0, 38.0) if r == 6 else (41, 40, 40.0, 39.0)
    f = opened(run(det, 100, state))
    assert f and f[0].entity.rank == "6"
    assert {e.name: e.detail for e in f[0].evidence}["culprit_rule"] == "never_completed"


def test_a_dead_rank_is_named_by_its_lost_heartbeat():
    det = HangDetector()
    out = run(det, 40, healthy)
    assert not out

    def state(t, r):            # rank 3 died at 41 s (no heartbeat any more); peers wait in #42
        return 42, 41, 41.0, 40.0
    out = run(det, 120, state, start_s=45, ranks=[r for r in range(WORLD) if r != 3])
    f = opened(out)
    assert f and f[0].entity.rank == "3" and f[0].cause == PROCESS_LOST, [x.summary for x in out]
    ev = {e.name: e for e in f[0].evidence}
    assert ev["heartbeat_age_s"].value > HEARTBEAT_LOST_S and ev["culprit_rule"].detail == "heartbeat_lost"


def _book_with(node, events=(), episodes=()):
    book = HealthBook()      # the digest published at the hang; telemetry processed well past it
    book.apply(NodeHealth("c1", node, T0 + 41 * S, T0, T0 + 41 * S, episodes=tuple(episodes), events=tuple(events)))
    book.advance(T0 + 200 * S)
    return book


def test_the_root_is_the_lost_gpu_when_telemetry_shows_an_xid_79():
    book = _book_with("node-1", events=[HealthEvent("gpu1", XID, 79, T0 + 40 * S, "GPU has fallen off the bus")])
    det = HangDetector(health=book)
    f = opened(run(det, 100, stuck_before(40, culprit=5, at_s=41)))
    assert f and f[0].entity.rank == "5" and f[0].cause == XID
    assert "GPU lost" in f[0].probable_cause and "79" in f[0].probable_cause
    assert "probable root: GPU lost" in f[0].summary


def test_the_root_is_the_nic_link_down_and_the_open_link_down_is_cited():
    episodes = [Episode("mlx5_1/1", NIC_DOWN, T0 + 30 * S, T0 + 200 * S, True, 170, 170, value=1,
                        detail="1: DOWN", holding=True),
                Episode("mlx5_1/1", "link_down", T0 + 30 * S, T0 + 200 * S, True, 170, 170, detail="ld42")]
    det = HangDetector(health=_book_with("node-1", episodes=episodes))
    f = opened(run(det, 100, stuck_before(40, culprit=5, at_s=41)))
    assert f and f[0].cause == NIC_DOWN, f and f[0].summary
    assert "ld42" in f[0].summary and any(e.name == "related_anomaly" for e in f[0].evidence)


def test_a_job_stalled_alike_by_a_storm_on_one_nodes_nic_is_a_fabric_stall_on_that_node():
    # every rank entered #41 and none completes: no rank is behind; node-1's NIC of gpu2 (rail 2)
    # has received PFC pauses most of the time since
    storm = Episode("mlx5_2/1", STORM_VICTIM, T0 + 40 * S, T0 + 200 * S, True, 160, 160, value=0.97,
                    detail="pause duty 0.97", holding=True)
    det = HangDetector(health=_book_with("node-1", episodes=[storm]))
    f = opened(run(det, 100, lambda t, r: healthy(t, r) if t < 41 else (41, 40, 41.0, 40.0)))
    assert f and f[0].cause == STORM_VICTIM and f[0].entity.rank == "6", f and f[0].summary   # node-1 gpu2
    assert "stuck alike" in f[0].summary and "probable root: a fabric stall" in f[0].summary
    assert "PFC storm source" in f[0].suggested_action
    # without the pauses the same stall is a stuck process
    f = opened(run(HangDetector(health=_book_with("node-1")), 100,
                   lambda t, r: healthy(t, r) if t < 41 else (41, 40, 41.0, 40.0)))
    assert f and f[0].cause == STUCK_PROCESS


def test_among_ranks_equally_behind_the_one_with_a_hardware_root_is_named():
    book = _book_with("node-1", events=[HealthEvent("gpu2", XID, 79, T0 + 40 * S, "fallen off the bus")])

    def state(t, r):
        if t < 41:
            return healthy(t, r)
        return (40, 40, 40.0, 40.0) if r in (1, 6) else (41, 40, 41.0, 40.0)
    f = opened(run(HangDetector(health=book), 100, state))
    assert f and f[0].entity.rank == "6"     # node-1 gpu2; rank 1 (node-0 gpu1) is healthy hardware


def test_resolved_when_completions_advance_and_when_the_job_restarts_or_ends():
    det = HangDetector()
    run(det, 80, stuck_before(40, culprit=5, at_s=41))
    out = det.add_progress([beat(81, r, 41, 41, 81) for r in range(WORLD)])
    assert [f.state for f in out] == [RESOLVED] and "collectives complete again" in out[0].summary

    det = HangDetector()
    run(det, 80, stuck_before(40, culprit=5, at_s=41))
    out = det.add_progress([beat(90, 0, 2, 2, 89)])       # counters back to 2: a new process
    assert [f.state for f in out] == [RESOLVED] and "restarted" in out[0].summary

    det = HangDetector()
    run(det, 80, stuck_before(40, culprit=5, at_s=41))
    out = det.add_progress([beat(80 + JOB_GONE_S + 15, 0, 3, 3, 10, job="other")])
    assert [(f.state, f.entity.job) for f in out] == [(RESOLVED, "j1")] and "job ended" in out[0].summary


# -- negatives ----------------------------------------------------------------------------------
def test_checkpoint_stall_with_every_rank_idle_is_silent():
    def state(t, r):        # 90 s of checkpointing: everyone completed #40 and entered nothing
        return healthy(t, r) if t < 41 else (40, 40, 39.0, 39.0)
    assert run(HangDetector(), 200, state) == []


def test_paused_job_is_silent_while_paused_and_after_it_resumes():
    det = HangDetector()
    paused = stuck_before(40, culprit=-1, at_s=41)     # every rank inside #41 when SIGSTOP came
    out = run(det, 41, paused)
    # 5 minutes with no heartbeat at all (SIGSTOP, a preempted job); then SIGCONT: #41 completes 3 s later
    out += run(det, 341 + 15, lambda t, r: (41, 40, 41.0, 40.0), start_s=341)
    out += run(det, 400, lambda t, r: healthy(t - 300, r), start_s=361)
    assert out == [], [f.summary for f in out]


def test_long_but_progressing_step_is_silent():
    def state(t, r):        # a step of 3 minutes: 40 collectives a second keep completing
        n = int(t * 40)
        return n + (r % 2), n, t, t - 0.01
    assert run(HangDetector(), 180, state, every_s=5) == []


def test_long_compute_without_collectives_then_a_normal_one_is_silent():
    def state(t, r):        # 60 s of compute outside collectives, then a collective that takes 2 s
        if t < 40:
            return healthy(t, r)
        if t < 100:
            return 40, 40, 39.0, 39.0
        return (41, 40, 100.0, 39.0) if t < 102 else (41, 41, 100.0, 102.0)
    assert run(HangDetector(), 150, state, every_s=1) == []


def test_one_rank_job_and_a_skewed_node_clock_raise_nothing():
    assert run(HangDetector(), 120, lambda t, r: (5, 4, 1.0, 1.0), ranks=[0], world=1) == []

    det = HangDetector()            # node-1's clock is 40 s behind: its heartbeats are not "lost"
    out = []
    for t in range(0, 120, 5):
        out += det.add_progress([beat(t, r, *healthy(t, r), skew_s=-40.0 if r >= 4 else 0.0) for r in range(WORLD)])
    assert out == []


def test_the_threshold_follows_the_jobs_collective_time_within_bounds():
    det = HangDetector()
    det.add_progress([beat(0, r, 1, 1, 0) for r in range(WORLD)])
    assert det.hang_after_s("j1") == HANG_AFTER_FLOOR_S
    det.add_steps([RankStep("j1", r, WORLD, "n", 0, s, T0, 6.0, 3.0, 3.0) for r in range(WORLD) for s in range(3)])
    assert det.hang_after_s("j1") == pytest.approx(30.0)
    det.add_steps([RankStep("j1", r, WORLD, "n", 0, 9, T0, 60.0, 0.0, 60.0) for r in range(WORLD) for _ in range(8)])
    assert det.hang_after_s("j1") == HANG_AFTER_CAP_S


@pytest.mark.parametrize("kwargs", [dict(hang_after_floor_s=0), dict(hang_after_floor_s=50, hang_after_cap_s=40),
                                    dict(hang_median_factor=0.5), dict(heartbeat_lost_s=1.0),
                                    dict(job_gone_s=10.0)])
def test_bad_config_raises(kwargs):
    with pytest.raises(ValueError):
        HangDetector(**kwargs)


def test_bad_reports_are_counted_never_raise():
    det = HangDetector()
    out = det.add_progress([RankProgress("j", 5, 4, "n", 0, T0, 3, 3, T0, T0),    # rank outside world
                            RankProgress("j", 0, 4, "n", 0, T0, 3, 4, T0, T0)])   # completed > entered
    assert out == [] and det.stats["bad_progress"] == 2


def test_fresh_job_and_rank_ids_are_bounded_and_counted_and_freed_when_jobs_end():
    # a node's token binds the node, not the (job, rank) it claims: fresh pairs must not grow
    # the detector (and the worker's checkpoint) without bound
    det = HangDetector(max_ranks=50)
    for j in range(20):                       # 20 jobs x 8 ranks claimed: 160 ranks, 50 followed
        det.add_progress([beat(0, r, 1, 1, 0, job=f"forged-{j}") for r in range(WORLD)])
    assert sum(len(job.ranks) for job in det._jobs.values()) == 50
    assert det.stats["ranks_refused"] == 110
    # the followed ranks' jobs still work: a hang on one of them is named
    out = run(det, 80, stuck_before(40, culprit=3, at_s=41), job="forged-0")
    assert [(f.state, f.entity.rank) for f in opened(out)] == [(OPEN, "3")]
    # every job silent for JOB_GONE_S is forgotten, and its ranks' room is free again
    det.add_progress([beat(80 + JOB_GONE_S + 15, 0, 1, 1, 0, job="later")])
    det.add_progress([beat(80 + JOB_GONE_S + 16, r, 1, 1, 0, job="new") for r in range(WORLD)])
    assert len(det._jobs["new"].ranks) == WORLD and det.stats["ranks_refused"] == 111   # "later" came first


# -- the gateway's validation ----------------------------------------------------------------
def _snap(now, *progress):
    snap = pb.Snapshot(cluster="c1", source="node-0", source_kind=pb.SOURCE_KIND_NODE, time_unix_ns=now, seq=1)
    for kw in progress:
        fields = dict(job_id="j", rank=0, world_size=4, node="node-0", local_gpu=0, time_unix_ns=now,
                      collectives_entered=10, collectives_completed=9, last_entered_unix_ns=now - S,
                      last_completed_unix_ns=now - 2 * S, step=3)
        fields.update(kw)
        snap.rank_progress.add(**fields)
    return snap


def test_validation_keeps_good_heartbeats_and_drops_each_kind_of_bad_one_with_a_reason():
    now = time.time_ns()
    snap = _snap(now, {}, dict(rank=1, time_unix_ns=now + 1), dict(rank=4), dict(job_id="bad job"),
                 dict(rank=2, collectives_completed=11), dict(rank=2, collectives_entered=1 << 50),
                 dict(rank=2, time_unix_ns=now + 3600 * S, last_entered_unix_ns=now + 3600 * S),
                 dict(rank=2, last_entered_unix_ns=now + S), dict(rank=2, last_completed_unix_ns=0),
                 dict(rank=3, node="node-9"),
                 # rank 0 again, later but its counters went back within the snapshot
                 dict(time_unix_ns=now + 2, collectives_entered=5, collectives_completed=5))
    v = validate_snapshot(snap, now, may_report=lambda node: node == "node-0")
    assert v.accepted
    assert [(p.rank, p.collectives_entered) for p in snap.rank_progress] == [(0, 10), (1, 10)]
    assert v.reasons() == {"bad_rank_progress": 5, "rank_progress_time_out_of_range": 2,
                           "rank_progress_not_allowed": 1, "rank_progress_not_monotone": 1}


def test_gateway_routes_heartbeats_to_the_rank_steps_topic_keyed_by_job():
    from fabricwatch.streams import topics
    from fabricwatch.streams.decode import rank_progress_of
    from fabricwatch.streams.gateway import split_records

    now = time.time_ns()
    records = split_records([_snap(now, {}, dict(job_id="k", rank=1))])
    assert sorted((t, k) for t, k, _ in records) == [(topics.RANK_STEPS, b"j"), (topics.RANK_STEPS, b"k")]
    carried = {k: rank_progress_of(pb.Snapshot.FromString(v)) for _, k, v in records}
    assert [(p.job_id, p.rank, p.entered, p.completed) for p in carried[b"k"]] == [("k", 1, 10, 9)]


def test_stage_judges_heartbeats_at_once_and_names_the_hang():
    from fabricwatch.streams.config import DetectionConfig
    from fabricwatch.streams.facts import FactBook
    from fabricwatch.streams.straggler_stage import StragglerStage

    stage = StragglerStage(DetectionConfig(), FactBook())
    now_s = time.time() - 120
    state = stuck_before(40, culprit=5, at_s=41)
    found = []
    for t in range(0, 100, 5):
        found += stage.add_progress([RankProgress("jj", r, WORLD, f"node-{r // 4}", r % 4, int((now_s + t) * S),
                                                  *(x if i < 2 else int((now_s + x) * S)
                                                    for i, x in enumerate(state(t, r))), 3)
                                     for r in range(WORLD)], "c1")
    assert [(f.kind, f.state, f.entity.rank) for f in found] == [("hang", OPEN, "5")]
    # priced like every finding: the whole job stalls, every GPU of it (no ranks reported: none known)
    assert found[0].impact_gpu_hours_per_hour > 0 and found[0].impact_basis in ("measured", "estimated")
    assert stage.open_anomalies
