"""Straggler detector and node health book, driven by the cluster simulator.

Layout used by the simulator runs (rail-optimised, 8 nodes, 4 per scalable unit):
job-b on node-0001..0002 (16 ranks), job-a on node-0004..0007 (32 ranks; rank = 8 x the
node's position in the job + GPU). node-0004 is job-a's only node on the unit-0 leaves,
so a PFC storm there (from job-b's node-0001) pauses exactly one rank of job-a.
"""
from __future__ import annotations

import pickle
import random
from collections import defaultdict
from dataclasses import dataclass, field

import pytest

from fabricwatch.models.findings import CRITICAL, INFO, OPEN, RESOLVED, WARNING, EntityRef, Finding
from fabricwatch.models.frames import RankStep
from fabricwatch.models.node_health import (
    CAUSE_TEXT, ECC, GPU_PCIE, NIC_DOWN, NIC_DOWNGRADE, NIC_PCIE, NONE, PARTIAL_PAUSE, POWER, STORM_VICTIM, THERMAL,
    UNKNOWN, XID, NodeHealthBook,
)
from fabricwatch.models.straggler import StragglerDetector
from fabricwatch.models.topology import rail_optimised
from fabricwatch.simulator.cluster import ClusterSimulator
from fabricwatch.simulator.host_faults import EccUncorrectable, GpuXid, Straggler
from fabricwatch.simulator.labels import GroundTruth
from fabricwatch.simulator.workload import Job, auto_jobs
from fabricwatch.streams.config import DetectionConfig
from fabricwatch.streams.decode import to_view
from fabricwatch.streams.facts import FactBook, Progress
from fabricwatch.streams.straggler_stage import (MAX_AHEAD_OF_CLOCK_S, PLACEMENT_MIN_INTERVAL_NS, STALLED_S,
                                                 StragglerStage)

S = 10**9
JOB_A_NODES = ("node-0004", "node-0005", "node-0006", "node-0007")
EXPECTED_CAUSE = {"thermal": THERMAL, "sw_thermal": THERMAL, "power": POWER, "none": NONE,
                  "nic_downgrade": NIC_DOWNGRADE, "storm_victim": STORM_VICTIM, "nic_pcie": NIC_PCIE,
                  "partial_pause": PARTIAL_PAUSE, "gpu_pcie": GPU_PCIE, "nic_down": NIC_DOWN}
MAX_DELAY_STEPS = 3


def _jobs(**job_a) -> list[Job]:
    return [Job("job-b", ("node-0001", "node-0002"), step_compute_s=1.0),
            Job("job-a", JOB_A_NODES, step_compute_s=1.2, step_comm_s=0.3, **job_a)]


def _rank(node: str, gpu: int) -> int:
    return JOB_A_NODES.index(node) * 8 + gpu


@dataclass
class Run:
    sim: ClusterSimulator
    det: StragglerDetector
    book: NodeHealthBook | None
    findings: list[Finding] = field(default_factory=list)
    steps: dict = field(default_factory=dict)          # (job, step) -> (start_ns, end_ns)
    busy: dict = field(default_factory=lambda: defaultdict(dict))  # (job, step) -> {rank: busy}

    def opened(self) -> list[Finding]:
        return [f for f in self.findings if f.state == OPEN]

    def steps_between(self, job: str, onset_ns: int, detected_ns: int) -> int:
        """Steps of `job` that started at or after the onset and ended by the detection."""
        return sum(1 for (j, _), (start, end) in self.steps.items()
                   if j == job and start >= onset_ns and end <= detected_ns)


def drive(faults=(), seconds=75, jobs=None, seed=3, health=True, delay_ticks=None, shuffle=False,
          n_nodes=8, topology=None) -> Run:
    """Tick the simulator; the book sees each view before the detector sees its steps.

    ``delay_ticks`` maps a node to how many ticks its snapshots arrive late; ``shuffle``
    shuffles the views of a tick and the rank steps within each view.
    """
    topo = topology or rail_optimised("sim", n_nodes=n_nodes, nodes_per_unit=4, n_spines=2)
    sim = ClusterSimulator(topo, seed=seed, jobs=jobs if jobs is not None else _jobs(), faults=list(faults))
    book = NodeHealthBook() if health else None
    run = Run(sim, StragglerDetector(health=book, cluster="sim"), book)
    rng = random.Random(seed)
    delayed: dict[int, list] = defaultdict(list)
    total = int(seconds)
    for k in range(total + max((delay_ticks or {}).values(), default=0) + 1):
        if k < total:
            for snap in sim.tick():
                view = to_view(snap)
                delayed[k + (delay_ticks or {}).get(view.source, 0)].append(view)
        views = delayed.pop(k, [])
        if shuffle:
            rng.shuffle(views)
        for view in views:
            if book is not None:
                book.update(view)
        for view in views:
            steps = list(view.rank_steps)
            if shuffle:
                rng.shuffle(steps)
            for rs in steps:
                run.steps[(rs.job_id, rs.step)] = (rs.start_ns, rs.start_ns + int(rs.step_seconds * S))
                run.busy[(rs.job_id, rs.step)][rs.rank] = rs.busy_seconds
                run.findings += run.det.add_step(rs, cluster=view.cluster)
    return run


def _truth_of(sim: ClusterSimulator) -> dict[str, GroundTruth]:
    return {g.entity: g for g in sim.ground_truth() if g.kind == "straggler"}


def _check_named(run: Run, finding: Finding, node: str, gpu: int, onset_s: float, cause: str) -> int:
    """The finding names the right rank, node, GPU and cause in time; returns the delay in steps."""
    rank = _rank(node, gpu)
    truth = _truth_of(run.sim)[f"job=job-a/rank={rank}"]
    assert truth.detail["node"] == node and truth.detail["gpu"] == gpu
    assert finding.entity == EntityRef(cluster="sim", node=node, device=f"gpu{gpu}", rank=str(rank), job="job-a")
    assert finding.entity.path() == f"sim/job=job-a/rank={rank}"
    assert finding.kind == "straggler" and finding.detector == "straggler/v1"
    assert EntityRef(cluster="sim", node=node, device=f"gpu{gpu}") in finding.related
    assert EntityRef(cluster="sim", node=node, device=f"mlx5_{gpu}", port="1") in finding.related
    assert finding.probable_cause.startswith(CAUSE_TEXT[cause]), finding.probable_cause
    assert f"job-a rank {rank} ({node} gpu{gpu})" in finding.summary
    onset_ns = run.sim.start_unix_ns + int(onset_s * S)
    delay = run.steps_between("job-a", onset_ns, finding.detected_ns)
    assert 1 <= delay <= MAX_DELAY_STEPS, f"named {delay} steps after onset"
    evidence = {e.name: e for e in finding.evidence}
    # the evidence counts from the first flagged step, which may be the one the onset fell in
    assert evidence["detection_delay_steps"].value <= delay + 1
    assert evidence["flagged_steps"].value >= 3
    return delay


# --------------------------------------------------------------------------- named, with cause


@pytest.mark.parametrize("cause", ["thermal", "sw_thermal", "power", "none", "nic_downgrade", "storm_victim",
                                   "nic_pcie", "partial_pause", "gpu_pcie", "nic_down"])
def test_straggler_named_within_three_steps_with_cause_and_resolved(cause):
    node, gpu = ("node-0004", 2) if cause == "storm_victim" else ("node-0005", 1)
    onset, offset = 30.0, 55.0
    run = drive([Straggler(node, gpu, onset_s=onset, offset_s=offset, cause=cause, factor=1.3)], seconds=75)
    opened = run.opened()
    assert len(opened) == 1, [f.summary for f in opened]
    _check_named(run, opened[0], node, gpu, onset, EXPECTED_CAUSE[cause])
    if cause in ("thermal", "sw_thermal"):
        bit = "HwThermalSlowdown" if cause == "thermal" else "SwThermalSlowdown"
        assert f"({bit}, SM clock" in opened[0].probable_cause
    # the whole history of that rank: open (maybe an update), then resolved after the fault
    states = [f.state for f in run.findings if f.entity == opened[0].entity]
    assert states[0] == OPEN and states[-1] == RESOLVED and states.count(RESOLVED) == 1
    resolved = run.findings[-1]
    assert resolved.state == RESOLVED and resolved.detected_ns > run.sim.start_unix_ns + int(offset * S)
    assert not run.det.open_findings()


def test_storm_victim_is_context_not_a_page():
    run = drive([Straggler("node-0004", 2, onset_s=20.0, cause="storm_victim")], seconds=60)
    (finding,) = run.opened()
    # paused ~90 % of the time, steps several times longer: the storm itself is the page
    assert finding.severity == INFO
    assert {e.name for e in finding.evidence} >= {"comm_seconds", "slowdown", "rx_pause_duty"}


def test_two_stragglers_in_one_job():
    run = drive([Straggler("node-0005", 1, onset_s=25.0, cause="thermal", factor=1.3),
                 Straggler("node-0007", 6, onset_s=25.0, cause="power", factor=1.6)], seconds=50)
    by_rank = {f.entity.rank: f for f in run.opened()}
    assert set(by_rank) == {str(_rank("node-0005", 1)), str(_rank("node-0007", 6))}
    thermal, power = by_rank[str(_rank("node-0005", 1))], by_rank[str(_rank("node-0007", 6))]
    _check_named(run, thermal, "node-0005", 1, 25.0, THERMAL)
    _check_named(run, power, "node-0007", 6, 25.0, POWER)
    assert thermal.severity == WARNING and power.severity == CRITICAL     # 1.6x >= 1.5x


def test_out_of_order_and_late_node_reports():
    # node-0005 (the straggler's) arrives 2 ticks late, node-0006 8 ticks late (beyond the
    # step lag: its ranks miss the evaluation of those steps), everything shuffled.
    run = drive([Straggler("node-0005", 3, onset_s=30.0, cause="thermal")], seconds=50,
                delay_ticks={"node-0005": 2, "node-0006": 8}, shuffle=True)
    (finding,) = run.opened()
    assert finding.entity.rank == str(_rank("node-0005", 3))
    evidence = {e.name: e.value for e in finding.evidence}
    assert evidence["detection_delay_steps"] <= MAX_DELAY_STEPS
    assert run.det.stats["steps_partial"] > 0 and run.det.stats["late_reports"] > 0


# --------------------------------------------------------------------------- must not fire


@pytest.mark.slow
def test_healthy_noisy_cluster_for_minutes_raises_nothing():
    topo = rail_optimised("sim", n_nodes=16, nodes_per_unit=8, n_spines=2)
    # checkpoints and evals every few minutes, so that several fall into the run
    jobs = [Job(j.job_id, j.nodes, j.step_compute_s, j.step_comm_s, j.bw_efficiency,
                checkpoint_every_s=90.0, checkpoint_s=j.checkpoint_s, eval_every_s=150.0, eval_s=j.eval_s,
                first_step=j.first_step, since_checkpoint_s=60.0, since_eval_s=60.0)
            for j in auto_jobs(topo, seed=1)]
    run = drive(seconds=300, jobs=jobs, seed=1, topology=topo)
    assert run.findings == []
    assert run.det.stats["steps_evaluated"] > 200
    long_steps = [k for k, (a, b) in run.steps.items() if b - a > 10 * S]
    assert len(long_steps) >= 3        # checkpoint steps were in the run


def test_whole_job_slowdown_and_checkpoints_raise_nothing():
    # a data stall slows every rank of job-a 1.5x for 20 s; job-a checkpoints every 20 s
    stall = [Straggler(node, gpu, onset_s=25.0, offset_s=45.0, cause="none", factor=1.5)
             for node in JOB_A_NODES for gpu in range(8)]
    run = drive(stall, seconds=70, jobs=_jobs(checkpoint_every_s=20.0, checkpoint_s=8.0))
    assert run.findings == []
    durations = [b - a for (j, _), (a, b) in run.steps.items() if j == "job-a"]
    assert max(durations) > 8 * S                                  # checkpoint steps happened
    stalled = [b - a for (j, _), (a, b) in run.steps.items()
               if j == "job-a" and a > run.sim.start_unix_ns + 27 * S and b < run.sim.start_unix_ns + 44 * S]
    assert stalled and min(stalled) > 1.7 * S                      # the stall happened


def test_single_slow_step_raises_nothing():
    run = drive([Straggler("node-0005", 1, onset_s=30.2, offset_s=30.4, cause="none", factor=2.5)], seconds=50)
    assert run.findings == []
    rank = _rank("node-0005", 1)
    slow = [s for (j, s), ranks in run.busy.items() if j == "job-a" and ranks.get(rank, 0) > 2.0]
    assert len(slow) == 1                                          # the fault did slow one step


def test_network_slowdown_is_not_attributed_without_a_book():
    run = drive([Straggler("node-0005", 1, onset_s=30.0, cause="nic_downgrade")], seconds=50, health=False)
    assert run.findings == []
    assert run.det.stats["steps_comm_slow"] >= 3


def test_compute_straggler_without_a_book_has_no_cause():
    run = drive([Straggler("node-0006", 0, onset_s=20.0, cause="thermal")], seconds=35, health=False)
    (finding,) = run.opened()
    assert finding.entity.rank == str(_rank("node-0006", 0)) and finding.probable_cause == ""


# --------------------------------------------------------------------------- synthetic edge cases


def _steps(job="j", world=8, n_steps=10, slow=None, factor=1.4, first=0, t0_s=0.0, step_s=1.5):
    """Rank steps of a clean synchronous job; ``slow`` ranks are `factor` slower from step 2."""
    out = []
    for s in range(first, first + n_steps):
        busy = {r: 1.0 * (factor if slow and r in slow and s - first >= 2 else 1.0) for r in range(world)}
        total = max(busy.values()) + 0.3
        for r in range(world):
            out.append(RankStep(job, r, world, f"n{r // 4}", r % 4, s, int((t0_s + (s - first) * step_s * 2) * S),
                                total, busy[r], total - busy[r]))
    return out


def _feed(det, steps):
    return [f for rs in steps for f in det.add_step(rs)]


def test_uniform_job_does_not_divide_by_zero_and_finds_the_straggler():
    det = StragglerDetector()
    out = _feed(det, _steps(slow={5}))
    assert [(f.state, f.entity.rank, f.severity) for f in out] == [("open", "5", WARNING)]
    assert _feed(StragglerDetector(), _steps()) == []


def test_jobs_of_one_or_two_ranks_are_never_judged():
    for world in (1, 2):
        det = StragglerDetector()
        assert _feed(det, _steps(world=world, slow={world - 1}, factor=3.0)) == []
        assert det.stats["steps_evaluated"] == 0


def test_reverse_order_reports_within_the_lag():
    steps = _steps(slow={3}, n_steps=12)
    by_step = defaultdict(list)
    for rs in steps:
        by_step[rs.step].append(rs)
    # steps arrive two at a time in reverse order, ranks reversed
    order = []
    for s in range(0, 12, 2):
        order += reversed(by_step[s + 1] + by_step[s])
    out = _feed(StragglerDetector(), order)
    assert [(f.state, f.entity.rank) for f in out] == [("open", "3")]


def test_memory_is_bounded_and_idle_jobs_are_forgotten():
    det = StragglerDetector(job_idle_s=60.0)
    opened = _feed(det, _steps(job="old", slow={1}, n_steps=6))
    assert [f.state for f in opened] == [OPEN]
    out = _feed(det, _steps(job="new", n_steps=2000, t0_s=10.0))
    job = det._jobs["new"]
    assert len(job.window) <= det.window_steps and len(job.pending) <= det.max_step_lag + 1
    assert len(job.done) <= 4 * (det.window_steps + det.max_step_lag)
    assert len(job.comm_baseline) <= det.baseline_steps
    assert det.jobs() == ["new"]
    assert [(f.state, f.entity.job, f.entity.rank) for f in out] == [(RESOLVED, "old", "1")]


def test_restarted_job_is_judged_again():
    det = StragglerDetector()
    _feed(det, _steps(n_steps=20, first=100))
    # restart from the checkpoint at step 90, 120 s later, now with a straggler
    out = _feed(det, _steps(n_steps=8, first=90, t0_s=200.0, slow={6}))
    assert [(f.state, f.entity.rank) for f in out] == [("open", "6")]
    assert det.stats["job_restarts"] == 1


@pytest.mark.parametrize("kwargs, name", [
    ({"robust_z": 0}, "robust_z"),
    ({"min_slowdown": 1.0}, "min_slowdown"),
    ({"mad_floor_fraction": 0.0}, "mad_floor_fraction"),
    ({"window_steps": 0}, "window_steps"),
    ({"window_steps": 3, "min_flagged_steps": 4}, "min_flagged_steps"),
    ({"min_flagged_steps": 1}, "min_flagged_steps"),
    ({"max_step_lag": 2.5}, "max_step_lag"),
    ({"critical_slowdown": 1.05}, "critical_slowdown"),
    ({"comm_slowdown": 0.9}, "comm_slowdown"),
    ({"baseline_steps": 2}, "baseline_steps"),
    ({"job_idle_s": 0}, "job_idle_s"),
    ({"health": object()}, "health"),
])
def test_bad_detector_config_raises(kwargs, name):
    with pytest.raises(ValueError, match=name):
        StragglerDetector(**kwargs)


@pytest.mark.parametrize("kwargs, name", [
    ({"nominal_nic_rate": "fast"}, "nominal_nic_rate"),
    ({"history_s": 0}, "history_s"),
    ({"lookback_s": 200.0}, "lookback_s"),
    ({"lookahead_s": -1}, "lookahead_s"),
    ({"cause_min_fraction": 0}, "cause_min_fraction"),
    ({"storm_victim_pause_duty": 1.5}, "storm_victim_pause_duty"),
    ({"throttle_clock_ratio": 0}, "throttle_clock_ratio"),
])
def test_bad_book_config_raises(kwargs, name):
    with pytest.raises(ValueError, match=name):
        NodeHealthBook(**kwargs)


# --------------------------------------------------------------------------- node health book


def test_book_names_xid_and_ecc_and_stays_bounded():
    topo = rail_optimised("sim", n_nodes=8, nodes_per_unit=4, n_spines=2)
    sim = ClusterSimulator(topo, seed=3, jobs=_jobs(), faults=[
        GpuXid("node-0005", 4, code=74, onset_s=10.5), GpuXid("node-0005", 5, code=13, onset_s=10.5),
        EccUncorrectable("node-0006", 2, onset_s=12.5, count=2)])
    book = NodeHealthBook(history_s=20.0)
    for _ in range(40):
        for snap in sim.tick():
            book.update(to_view(snap))
    at = sim.now_unix_ns
    cause, evidence = book.cause_for("node-0005", 4, at)
    assert cause == XID and "XID 74" in evidence[0].detail
    # an application XID (13: the user's kernel) is not the GPU's fault: weak evidence only
    cause, evidence = book.cause_for("node-0005", 5, at)
    assert cause == NONE and any(e.name == "application_xid" and "XID 13" in e.detail for e in evidence)
    assert book.cause_for("node-0006", 2, at)[0] == ECC
    assert book.cause_for("node-0006", 3, at)[0] == NONE
    assert book.cause_for("node-0099", 0, at)[0] == UNKNOWN
    assert book.cause_for("node-0005", 4, at - 45 * S)[0] == UNKNOWN       # before the node was seen
    # no per-sample history: a few digests per node, and a tracker state that does not grow
    # (first sight, an event, an episode opening, stopping to hold and closing: 5 at most)
    assert all(len(book.book._digests[n]) <= 5 for n in book.nodes())
    size = len(pickle.dumps(book.tracker))
    for _ in range(40):
        for snap in sim.tick():
            book.update(to_view(snap))
    assert len(pickle.dumps(book.tracker)) <= size + 1024
    assert "switch" not in " ".join(book.nodes()) and len(book.nodes()) == 8


def test_book_ordinary_power_capping_does_not_explain_a_large_slowdown():
    # GPUs that touch their power cap (clock ~0.9 of max) are common in the simulator
    topo = rail_optimised("sim", n_nodes=8, nodes_per_unit=4, n_spines=2)
    sim = ClusterSimulator(topo, seed=3, jobs=_jobs())
    book = NodeHealthBook()
    for _ in range(30):
        for snap in sim.tick():
            book.update(to_view(snap))
    causes = {book.cause_for(n, g, sim.now_unix_ns, slowdown=1.3)[0] for n in JOB_A_NODES for g in range(8)}
    assert causes == {NONE}


# --------------------------------------------------------------------------- stage 3: the event-time hold
def _stage_and_book():
    book = FactBook()
    return StragglerStage(DetectionConfig(), book), book


def _progress(book: FactBook, through_s: float) -> None:
    book.apply(Progress("t", 0, 1, int(through_s * S)))


def _slow_job(n_steps=12, t0_s=1000.0):
    by_step = defaultdict(list)
    for s in _steps(world=8, n_steps=n_steps, slow={5}, t0_s=t0_s):
        by_step[s.step].append(s)
    return [by_step[k] for k in sorted(by_step)]


def test_rank_steps_wait_for_the_telemetry_watermark_then_come_out_in_event_time_order():
    stage, book = _stage_and_book()
    _progress(book, 999.0)
    records = _slow_job()
    found = [f for r in reversed(records) for f in stage.add(r, "c")[0]]   # read newest first (a backlog)
    assert not found and stage.held == len(records)
    end_s = (records[-1][0].start_ns + records[-1][0].step_seconds * S) / S
    _progress(book, end_s - 1.0)                     # not yet through the last step + the lookahead
    found = stage.release()[0]
    assert stage.held >= 1
    _progress(book, end_s + 2.5)
    found += stage.release()[0]
    assert stage.held == 0
    assert [(f.kind, f.state, f.entity.rank) for f in found][:1] == [("straggler", OPEN, "5")]
    replayed = StragglerDetector()                   # the same as feeding them in order, live
    live = [f for r in records for s in sorted(r, key=lambda s: s.rank) for f in replayed.add_step(s, cluster="c")]
    assert [(f.state, f.entity.rank, f.detected_ns) for f in found] == \
        [(f.state, f.entity.rank, f.detected_ns) for f in live]


def test_held_rank_steps_are_released_when_the_watermark_stalls_on_the_wall_clock_not_on_event_time():
    stage, book = _stage_and_book()
    _progress(book, 999.0)
    wall = [0.0]
    stage.clock = lambda: wall[0]
    records = _slow_job(n_steps=4)
    for r in records:
        stage.add(r, "c")
    assert stage.held == 4
    wall[0] = STALLED_S - 1
    stage.release()
    assert stage.held == 4                           # not stalled for long enough
    wall[0] = STALLED_S + 1
    stage.release()
    assert stage.held == 0 and stage.stats["released_health_stalled"] == 4

    stage, book = _stage_and_book()                  # not on event time: a backlog's steps run far ahead
    _progress(book, 999.0)
    stage.clock = lambda: 0.0
    records = _slow_job(n_steps=100)
    for r in records:
        stage.add(r, "c")
    assert stage.held == len(records)


def test_without_any_telemetry_nothing_is_held_and_steps_from_the_future_are_dropped():
    stage, book = _stage_and_book()
    stage.wall_clock_ns = lambda: 5000 * S
    stage.add(_slow_job(n_steps=1)[0], "c")
    assert stage.held == 0                           # no partition ever reported progress
    _progress(book, 1000.0)
    stage.add(_slow_job(n_steps=1, t0_s=4000.0)[0], "c")
    assert stage.held == 1                           # hours ahead of the watermark: a backlog, kept
    far = _slow_job(n_steps=1, t0_s=5000.0 + 2 * MAX_AHEAD_OF_CLOCK_S)[0]
    stage.add(far, "c")
    assert stage.held == 1 and stage.stats["implausible_rank_steps"] == len(far)


def test_a_restored_stage_waits_from_its_own_wall_clock():
    stage, book = _stage_and_book()
    _progress(book, 999.0)
    stage.clock = lambda: 1e9                        # another process, long running
    stage.add(_slow_job(n_steps=1)[0], "c")
    restored = pickle.loads(pickle.dumps(stage))
    restored.release()
    assert restored.held == 1                        # not "stalled for 1e9 s"


def test_a_jobs_placement_goes_out_when_its_nodes_change_at_most_every_few_seconds():
    stage, book = _stage_and_book()                  # no telemetry: released at once
    sent = []
    for r in _slow_job(n_steps=12, t0_s=1000.0):     # 8 ranks on nodes n0, n1; steps 3 s apart
        for rank_step in r:                          # one record per rank: a new node now and then
            sent += stage.add([rank_step], "c")[1]
    assert [p.nodes for p in sent][:2] == [("n0",), ("n0", "n1")]
    assert sent[1].last_step_ns - sent[0].last_step_ns >= PLACEMENT_MIN_INTERVAL_NS
    assert len(sent) == 2                            # nothing new, and no refresh within 36 s
    big = StragglerStage(DetectionConfig(), FactBook())
    many = [RankStep("big", r, 4096, f"n{r // 8}", r % 8, 0, 1000 * S, 1.0, 0.8, 0.2) for r in range(4096)]
    placements = [p for i in range(0, 4096, 8) for p in big.add(many[i:i + 8], "c")[1]]
    assert len(placements) == 1                      # not one per node of a 512-node job



def test_records_of_one_steps_run_are_held_as_one_group_and_judged_as_record_by_record():
    """A big job sends one record per node a step: consecutive records of the same step are
    held as one group (cheap to release), and what comes out equals the detector fed record
    by record, also where two jobs' records interleave and break the runs."""
    def records():
        for job, world in (("a", 64), ("b", 16)):
            by_node = defaultdict(list)
            for rs in _steps(job=job, world=world, n_steps=12, slow={13} if job == "a" else None, t0_s=1000.0):
                by_node[(rs.step, rs.node)].append(rs)          # one record per node (4 ranks) a step
            yield from ((job, steps) for steps in by_node.values())

    ordered = sorted(records(), key=lambda r: (r[1][0].step, r[0] == "b"))   # a's run, then b's, per step
    stage, book = _stage_and_book()
    _progress(book, 900.0)                           # every report held
    for _, steps in ordered:
        stage.add(steps, "c")
    assert stage.held == 2 * 12                      # one group per job and step, not 12 * (16 + 4) records
    _progress(book, 2000.0)
    found, _ = stage.release()
    direct = StragglerDetector()
    expected = [f for _, steps in ordered for f in direct.add_steps(steps, cluster="c")]
    assert [(f.dedup_key, f.state, f.detected_ns) for f in found] == \
        [(f.dedup_key, f.state, f.detected_ns) for f in expected]
    assert any(f.state == OPEN and f.entity.rank == "13" for f in found)


# --------------------------------------------------------------------------- the rank's whole path


def test_compute_straggler_without_a_gpu_cause_gets_its_nics_hardware_state():
    # a rank whose own busy time is slow (its transfers counted as its work) and whose NIC
    # trains at 200G: not "no local cause", the NIC downgrade
    from fabricwatch.simulator.fabric_faults import LinkDowngrade
    run = drive([Straggler("node-0005", 1, onset_s=30.0, cause="none", factor=1.4),
                 LinkDowngrade("node-0005", "mlx5_1/1", onset_s=25.0)], seconds=50)
    opened = run.opened()
    assert len(opened) == 1 and opened[0].cause == NIC_DOWNGRADE, [f.summary for f in opened]


def test_healthy_nic_with_ordinary_incast_pauses_gives_no_cause():
    # a compute straggler on a node whose NICs see the simulator's healthy incast: the pauses
    # are not its cause (and a cause from pauses is never taken for a compute outlier)
    run = drive([Straggler("node-0005", 1, onset_s=30.0, cause="none", factor=1.4)], seconds=50)
    opened = run.opened()
    assert len(opened) == 1 and opened[0].cause == NONE
    book = run.book
    at = run.sim.now_unix_ns
    for node in JOB_A_NODES:
        for gpu in range(8):
            cause, _ = book.cause_for(node, gpu, at, slowdown=1.3, candidates=(PARTIAL_PAUSE, STORM_VICTIM))
            assert cause == NONE, (node, gpu)


def test_a_straggler_cites_the_anomaly_already_open_on_its_nic_by_id():
    from fabricwatch.evaluation.scenarios import Scenario
    from fabricwatch.streams.pipeline import DetectionPipeline
    from fabricwatch.streams.replay import replay
    sc = Scenario("t", "straggler", 5, 8, 1.0, 70.0, (Straggler("node-0005", 3, onset_s=30.0, cause="nic_downgrade",
                                                                  factor=1.5),))
    sim = sc.simulator()
    snaps = [s for _ in range(sc.ticks) for s in sim.tick()]
    events = replay(snaps, DetectionPipeline(topology=sim.topology), finish=True).events
    downgrade = [e for e in events if e.kind == "link_downgrade" and e.lifecycle == 1 and e.entity.node]
    straggler = [e for e in events if e.kind == "straggler" and e.lifecycle == 1]
    assert len(downgrade) == 1 and len(straggler) == 1     # (the leaf port's downgrade is the switch's)
    assert downgrade[0].entity.node == "node-0005" and straggler[0].cause_code == NIC_DOWNGRADE
    cited = [e for e in straggler[0].evidence if e.name == "related_anomaly"]
    assert [e.detail.split()[:2] for e in cited] == [[downgrade[0].id, "link_downgrade"]]
    assert f"see link_downgrade {downgrade[0].id}" in straggler[0].summary
