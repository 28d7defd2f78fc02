"""Straggler (fail-slow rank) detection in synchronous data-parallel training jobs.

Reads `RankStep` records; emits ``straggler`` findings, one per (job, rank).

In a synchronous job every rank's wall-clock step time is the same: all wait for the
slowest at each collective. A rank whose *own compute* is slow shows only in its
``busy_seconds`` being above its peers' and in its ``collective_wait_seconds`` being the
least (it arrives last and waits least). A rank whose *network* is slow (NIC downgraded,
paused by a PFC storm) does not show in its own timings at all: the collectives of the
whole job get slower, and only node telemetry says whose link it is.

Rules, per (job, step), each threshold named below:

* **Grouping.** Rank reports are grouped per (job, step); a step is evaluated when all
  ``world_size`` ranks reported it or, bounded, once a step at least ``max_step_lag`` newer
  arrived (ranks report from different nodes, out of order). A partial step needs
  `MIN_REPORTED_FRACTION` of the ranks; reports for a step already evaluated are dropped.
* **Compute outlier.** Robust cross-rank comparison of ``busy_seconds``: median and MAD,
  the MAD floored at ``mad_floor_fraction`` of the median (so a perfectly uniform job does
  not divide by ~0). Outlier iff robust z >= ``robust_z`` **and** busy / median >=
  ``min_slowdown`` **and** the rank's collective wait is below the job's median by at least
  `WAIT_CORROBORATION_FRACTION` of its excess busy time (the physics of a late arrival).
* **Network outlier** (needs a `NodeHealthBook`). The job's communication time of a step
  (step time minus the largest busy time: what the last arrival waits) is at least
  ``comm_slowdown`` times its baseline (median of the last ``baseline_steps`` unflagged
  steps), and the book finds a network cause (`NETWORK_CAUSES`) on the NIC serving a
  rank's GPU during that step (looked up again for the window's earlier slow steps, whose
  telemetry may have arrived after their reports). Without a book such slowdowns are not
  attributed to any rank; the baseline needs `MIN_BASELINE_STEPS` healthy steps first.
* **Persistence.** A rank is a straggler once it is an outlier in at least
  ``min_flagged_steps`` (K) of the last ``window_steps`` (M) evaluated steps of its job:
  3 of 5 by default, so it is named on the 3rd slow step (the delay is reported). Counted
  in steps, not seconds: a PFC storm that stretches steps to ~12 s names its victim after
  ~25 s (the `pfc_storm` detector sees the storm itself within seconds). Resolved when it
  has not been an outlier in M evaluated steps. The severity only escalates while open;
  an update is emitted when it does or when the kind of probable cause changes.
* **Bounded state.** Per job: the pending steps (at most ``max_step_lag`` + 1 in a steady
  stream), the last M step results, ``baseline_steps`` comm times; a job silent for
  ``job_idle_s`` of event time is forgotten and its open findings resolved. A job that
  restarts from a checkpoint (old step numbers, `RESTART_MIN_GAP_S` later) starts afresh.

Not a straggler: a whole-job slowdown (checkpoint, eval, data stall: every rank's busy
time grows, the median with it), a single slow step, ordinary jitter, a 1- or 2-rank job
(no majority of peers to compare with).

>>> from fabricwatch.models.frames import RankStep
>>> det = StragglerDetector(cluster="c1")
>>> def step(s, rank, busy):
...     return RankStep("job-a", rank, 4, f"node-{rank // 2}", rank % 2, s, s * 10**9,
...                     1.5, busy, 1.5 - busy)
>>> out = []
>>> for s in range(6):
...     for rank in range(4):
...         out += det.add_step(step(s, rank, 1.3 if (rank == 3 and s >= 2) else 1.0))
>>> [(f.state, f.entity.path(), f.severity) for f in out]
[('open', 'c1/job=job-a/rank=3', 'warning')]
>>> out[0].summary
'job-a rank 3 (node-1 gpu1) is 1.30x slower than its peers for 3 steps'
>>> {e.name: round(e.value, 2) for e in out[0].evidence}["detection_delay_steps"]
3.0
"""
from __future__ import annotations

import bisect
import math
from collections import Counter, deque
from dataclasses import dataclass, field
from operator import attrgetter

import numpy as np

from .detector import RankStepDetector
from .findings import CRITICAL, INFO, OPEN, RESOLVED, UPDATE, WARNING, EntityRef, Evidence, Finding
from .frames import RankStep, SourceView, one_job_step, step_end_ns
from .node_health import (CAUSE_ACTION, GPU_CAUSES, NETWORK_CAUSES, NIC_DOWN, NIC_DOWNGRADE, NIC_PCIE, NONE,
                          PARTIAL_PAUSE, STORM_VICTIM, NodeHealthBook, describe_cause, rail_nic)
from .vocabulary import STRAGGLER

DETECTOR = "straggler/v1"
KIND = STRAGGLER

# -- defaults (every one a constructor keyword) ------------------------------------------
ROBUST_Z = 4.0              # robust z of busy_seconds (MAD scaled to a normal sigma)
MIN_SLOWDOWN = 1.10         # busy / job median busy; below this a rank is jitter, not a straggler
MAD_FLOOR_FRACTION = 0.02   # the MAD is at least this share of the median busy time
WINDOW_STEPS = 5            # M: persistence window, in evaluated steps of the job
MIN_FLAGGED_STEPS = 3       # K: outlier steps needed in the window to name a straggler
MAX_STEP_LAG = 4            # evaluate a step once one this much newer arrived
CRITICAL_SLOWDOWN = 1.5     # at or above this slowdown the finding is critical
COMM_SLOWDOWN = 1.25        # job comm time / its baseline that counts as a slowed collective
BASELINE_STEPS = 20         # unflagged steps whose median comm time is the baseline
JOB_IDLE_S = 600.0          # a job with no step for this long (event time) is forgotten

# -- fixed rules -----------------------------------------------------------------------------
MAD_TO_SIGMA = 1.4826        # MAD of a normal distribution times this is its sigma
WAIT_CORROBORATION_FRACTION = 0.5  # wait deficit vs median >= this share of the busy excess
MIN_WORLD_SIZE = 3           # fewer ranks have no majority of peers to compare with
MIN_RANKS = 3                # a (partial) step needs this many ranks to be evaluated
MIN_REPORTED_FRACTION = 0.5  # ... and this share of world_size
MIN_BASELINE_STEPS = 5       # comm baseline needs this many steps before network rules apply
JOB_SWEEP_S = 10.0           # look for inactive jobs at most this often (event time)
RESTART_MIN_GAP_S = 10.0     # a step behind the lag that starts this much after the newest: restart
# A compute outlier with no GPU cause: the hardware states of its NIC path can still explain
# it (where the rank's own transfers count in its busy time); pauses received from the switch
# cannot (they delay the collectives, which every rank waits for alike).
COMPUTE_FALLBACK_CAUSES = (NIC_DOWN, NIC_DOWNGRADE, NIC_PCIE)
# A partial pause on the rail NIC of more than this share of a job's nodes (and more than one
# node) is congestion the job shares (incast on a rail's leaf pauses that rail on every node),
# not one rank's path: nobody is named for it.
SHARED_PAUSE_NODE_FRACTION = 0.25


_RANK, _WORLD = attrgetter("rank"), attrgetter("world_size")


@dataclass
class _Flag:
    """Why one rank was an outlier in one step."""
    mode: str                 # "compute" | "network"
    node: str
    gpu: int
    slowdown: float
    busy: float = math.nan
    median_busy: float = math.nan
    z: float = math.nan
    wait: float = math.nan
    median_wait: float = math.nan
    least_wait: bool = False
    comm_s: float = math.nan
    baseline_comm_s: float = math.nan
    step_s: float = math.nan
    cause: str = ""
    cause_evidence: list[Evidence] = field(default_factory=list)


@dataclass
class _Comm:
    """A step whose collectives were slower than the job's baseline."""
    comm_s: float
    baseline_comm_s: float
    step_s: float
    slowdown: float           # step time / (median busy + baseline comm)


@dataclass
class _StepResult:
    step: int
    start_ns: int
    end_ns: int
    flags: dict[int, _Flag]
    comm: _Comm | None = None


@dataclass
class _Pending:
    world: int = 0
    reports: dict[int, RankStep] = field(default_factory=dict)


@dataclass
class _Job:
    pending: dict[int, _Pending] = field(default_factory=dict)
    newest_step: int = -1
    newest_start_ns: int = 0
    last_seen_ns: int = 0
    done: deque = field(default_factory=deque)        # recently evaluated step numbers
    done_set: set = field(default_factory=set)
    window: list[_StepResult] = field(default_factory=list)   # sorted by step, <= M
    comm_baseline: deque = field(default_factory=deque)
    open: dict[int, Finding] = field(default_factory=dict)
    open_cause: dict[int, str] = field(default_factory=dict)   # cause code of each open finding


@dataclass
class StragglerDetector(RankStepDetector):
    """Names the persistently slow ranks of synchronous training jobs.

    Parameters
    ----------
    health : optional `NodeHealthBook`; gives each straggler a probable cause and lets
        network-caused slowdowns be attributed to the rank whose NIC is degraded.
    cluster : cluster name for the findings' entities (or per call, see `add_step`).
    robust_z, min_slowdown, mad_floor_fraction : the per-step compute-outlier test.
    window_steps, min_flagged_steps : persistence, K of the last M evaluated steps.
    max_step_lag : how many steps newer must arrive before an incomplete step is evaluated.
    critical_slowdown : slowdown at or above which a straggler is critical.
    comm_slowdown, baseline_steps : the job-level slowed-collective test.
    job_idle_s : seconds of event time after which a silent job is forgotten (its open
        findings resolved).
    """

    health: NodeHealthBook | None = None
    cluster: str = ""
    robust_z: float = ROBUST_Z
    min_slowdown: float = MIN_SLOWDOWN
    mad_floor_fraction: float = MAD_FLOOR_FRACTION
    window_steps: int = WINDOW_STEPS
    min_flagged_steps: int = MIN_FLAGGED_STEPS
    max_step_lag: int = MAX_STEP_LAG
    critical_slowdown: float = CRITICAL_SLOWDOWN
    comm_slowdown: float = COMM_SLOWDOWN
    baseline_steps: int = BASELINE_STEPS
    job_idle_s: float = JOB_IDLE_S
    stats: Counter = field(default_factory=Counter, repr=False)
    _jobs: dict[str, _Job] = field(default_factory=dict, repr=False)
    _clusters: dict[str, str] = field(default_factory=dict, repr=False)
    _now_ns: int = field(default=0, repr=False)
    _last_sweep_ns: int = field(default=0, repr=False)

    def __post_init__(self) -> None:
        if not self.robust_z > 0:
            raise ValueError(f"robust_z must be > 0, got {self.robust_z!r}")
        if not self.min_slowdown > 1:
            raise ValueError(f"min_slowdown must be > 1, got {self.min_slowdown!r}")
        if not 0 < self.mad_floor_fraction < 1:
            raise ValueError(f"mad_floor_fraction must be in (0, 1), got {self.mad_floor_fraction!r}")
        for name in ("window_steps", "min_flagged_steps", "max_step_lag", "baseline_steps"):
            value = getattr(self, name)
            if not (isinstance(value, int) and not isinstance(value, bool) and value >= 1):
                raise ValueError(f"{name} must be an int >= 1, got {value!r}")
        if self.min_flagged_steps > self.window_steps:
            raise ValueError(f"min_flagged_steps ({self.min_flagged_steps}) must not exceed "
                             f"window_steps ({self.window_steps})")
        if self.min_flagged_steps < 2:
            raise ValueError(f"min_flagged_steps must be >= 2 (one slow step is not a straggler), "
                             f"got {self.min_flagged_steps!r}")
        if self.baseline_steps < MIN_BASELINE_STEPS:
            raise ValueError(f"baseline_steps must be >= {MIN_BASELINE_STEPS}, got {self.baseline_steps!r}")
        if not self.critical_slowdown >= self.min_slowdown:
            raise ValueError(f"critical_slowdown must be >= min_slowdown ({self.min_slowdown}), "
                             f"got {self.critical_slowdown!r}")
        if not self.comm_slowdown > 1:
            raise ValueError(f"comm_slowdown must be > 1, got {self.comm_slowdown!r}")
        if not self.job_idle_s > 0:
            raise ValueError(f"job_idle_s must be > 0, got {self.job_idle_s!r}")
        if self.health is not None and not all(callable(getattr(self.health, m, None))
                                               for m in ("cause_for", "nic_for")):
            raise ValueError("health must provide cause_for() and nic_for(), like NodeHealthBook")

    # -- public ---------------------------------------------------------------------------
    def update(self, view: SourceView) -> list[Finding]:
        """Feed every rank step of one tick (the cluster name taken from the view)."""
        out: list[Finding] = []
        for step in view.rank_steps:
            out += self.add_step(step, cluster=view.cluster)
        return out

    def add_step(self, step: RankStep, cluster: str | None = None) -> list[Finding]:
        """Add one rank's report of one step; findings opened, updated or resolved by it."""
        return self._add_group(step.job_id, step.step, [step], cluster)

    def add_steps(self, steps: list[RankStep], cluster: str | None = None) -> list[Finding]:
        """`add_step` for many reports (a node's, one record): grouped by job and step, the
        per-report work is a dictionary insert (a 100,000-rank job reports 100,000 a step)."""
        first = steps[0] if steps else None
        if first is not None and one_job_step(steps):
            return self._add_group(first.job_id, first.step, steps, cluster)   # the usual record
        groups: dict[tuple[str, int], list[RankStep]] = {}
        for step in steps:
            groups.setdefault((step.job_id, step.step), []).append(step)
        out: list[Finding] = []
        for (job_id, number), group in sorted(groups.items()):
            out += self._add_group(job_id, number, group, cluster)
        return out

    def _add_group(self, job_id: str, number: int, group: list[RankStep], cluster: str | None) -> list[Finding]:
        job = self._jobs.get(job_id)
        if job is None:
            job = self._jobs[job_id] = _Job(comm_baseline=deque(maxlen=self.baseline_steps))
        self._clusters[job_id] = cluster if cluster is not None else self.cluster
        first = group[0]
        end_ns = max(map(step_end_ns, group)) if len(group) > 1 else step_end_ns(first)
        job.last_seen_ns = max(job.last_seen_ns, end_ns)
        self._now_ns = max(self._now_ns, end_ns)
        out: list[Finding] = []
        if self._restarted(job, first):
            self.stats["job_restarts"] += 1
            self._reset(job)
        if number in job.done_set or (job.done and number < job.done[0] and number not in job.pending):
            self.stats["late_reports"] += len(group)
        else:
            pending = job.pending.get(number)
            if pending is None:
                pending = job.pending[number] = _Pending()
            reports = pending.reports
            reports.update(zip(map(_RANK, group), group))
            pending.world = max(pending.world, max(map(_WORLD, group)))
            due = [number] if len(reports) >= pending.world else []
            if number > job.newest_step:
                job.newest_step, job.newest_start_ns = number, first.start_ns
                due = sorted(s for s in job.pending if s <= job.newest_step - self.max_step_lag) + due
            out += self._evaluate_due(job_id, job, due)
        if self._now_ns - self._last_sweep_ns >= JOB_SWEEP_S * 1e9:
            out += self.expire(self._now_ns)
        return out

    def expire(self, now_ns: int) -> list[Finding]:
        """Forget jobs silent for ``job_idle_s`` before ``now_ns``; their findings resolve.

        Called from `add_step` as event time advances; a timer may call it when no job
        reports at all any more.
        """
        self._now_ns = max(self._now_ns, now_ns)
        self._last_sweep_ns = self._now_ns
        return self._sweep()

    def open_findings(self) -> list[Finding]:
        return [f for job in self._jobs.values() for f in job.open.values()]

    def jobs(self) -> list[str]:
        return list(self._jobs)

    # -- grouping -------------------------------------------------------------------------
    def _restarted(self, job: _Job, step: RankStep) -> bool:
        """A job restarted from a checkpoint re-runs old step numbers, later in time.

        A late report of an old step started *before* the newest step; a re-run starts after
        it, by at least the restart time (a node clock skew of seconds cannot fake that).
        """
        behind = job.newest_step - step.step > self.max_step_lag
        return job.newest_step >= 0 and behind and step.start_ns > job.newest_start_ns + RESTART_MIN_GAP_S * 1e9

    def _reset(self, job: _Job) -> None:
        job.pending.clear()
        job.done.clear()
        job.done_set.clear()
        job.window.clear()
        job.newest_step = -1

    def _evaluate_due(self, job_id: str, job: _Job, due: list[int]) -> list[Finding]:
        out: list[Finding] = []
        for s in due:
            pending = job.pending.pop(s, None)
            if pending is None:
                continue
            self._mark_done(job, s)
            n = len(pending.reports)
            if pending.world < MIN_WORLD_SIZE:
                continue
            if n < pending.world:
                if n < max(MIN_RANKS, math.ceil(pending.world * MIN_REPORTED_FRACTION)):
                    self.stats["steps_dropped_incomplete"] += 1
                    continue
                self.stats["steps_partial"] += 1
            self.stats["steps_evaluated"] += 1
            out += self._evaluate(job_id, job, s, list(pending.reports.values()))
        return out

    def _mark_done(self, job: _Job, s: int) -> None:
        job.done.append(s)
        job.done_set.add(s)
        limit = 4 * (self.window_steps + self.max_step_lag)
        while len(job.done) > limit:
            job.done_set.discard(job.done.popleft())
        if len(job.done) > 1 and job.done[-1] < job.done[-2]:   # keep done[0] the oldest
            job.done = deque(sorted(job.done))

    # -- one step -------------------------------------------------------------------------
    def _evaluate(self, job_id: str, job: _Job, s: int, reports: list[RankStep]) -> list[Finding]:
        ranks = np.fromiter((r.rank for r in reports), np.int64, len(reports))
        busy = np.fromiter((r.busy_seconds for r in reports), np.float64, len(reports))
        wait = np.fromiter((r.collective_wait_seconds for r in reports), np.float64, len(reports))
        step_s = float(np.median([r.step_seconds for r in reports]))
        start_ns = int(np.median([r.start_ns for r in reports]))
        end_ns = start_ns + int(step_s * 1e9)
        med = float(np.median(busy))
        mad = float(np.median(np.abs(busy - med)))
        scale = max(MAD_TO_SIGMA * mad, self.mad_floor_fraction * med, 1e-9)
        z = (busy - med) / scale
        ratio = busy / med if med > 0 else np.ones_like(busy)
        med_wait = float(np.median(wait))
        corroborated = (med_wait - wait) >= WAIT_CORROBORATION_FRACTION * (busy - med)
        outlier = (z >= self.robust_z) & (ratio >= self.min_slowdown) & corroborated
        least_wait = float(wait.min())
        flags: dict[int, _Flag] = {}
        for i in np.flatnonzero(outlier):
            r = reports[i]
            flags[int(ranks[i])] = _Flag("compute", r.node, r.local_gpu, float(ratio[i]), busy=float(busy[i]),
                                         median_busy=med, z=float(z[i]), wait=float(wait[i]),
                                         median_wait=med_wait, least_wait=bool(wait[i] <= least_wait))
        # the job's collectives: what the last arrival waits
        comm_s = step_s - float(busy.max())
        baseline = float(np.median(job.comm_baseline)) if len(job.comm_baseline) >= MIN_BASELINE_STEPS else math.nan
        comm_slow = baseline > 0 and comm_s >= self.comm_slowdown * baseline
        comm = None
        if comm_slow:
            self.stats["steps_comm_slow"] += 1
            comm = _Comm(comm_s, baseline, step_s, step_s / (med + baseline))
        elif comm_s > 0:
            job.comm_baseline.append(comm_s)
        result = _StepResult(s, start_ns, end_ns, flags, comm)
        if comm is not None and self.health is not None:
            self._network_flags(job, result, reports)
        keys = [w.step for w in job.window]
        job.window.insert(bisect.bisect(keys, s), result)
        del job.window[:-self.window_steps]
        return self._transitions(job_id, job, result)

    def _network_flags(self, job: _Job, result: _StepResult, reports: list[RankStep]) -> None:
        """Ranks whose NIC shows a network cause during a step with slow collectives.

        Telemetry of the end of a step may arrive after the step's report, so a rank found
        now is looked up again in the window's earlier slow steps that did not name it.
        """
        seen: dict[tuple[str, int], _Flag | None] = {}
        for r in reports:
            key = (r.node, r.local_gpu)
            if r.rank not in result.flags and key not in seen:
                seen[key] = self._network_cause(result, r.node, r.local_gpu)
        paused = {node for (node, _), f in seen.items() if f is not None and f.cause == PARTIAL_PAUSE}
        nodes = len({r.node for r in reports})
        if len(paused) > max(1, SHARED_PAUSE_NODE_FRACTION * nodes):
            self.stats["shared_pause_steps"] += 1
            seen = {k: (None if f is not None and f.cause == PARTIAL_PAUSE else f) for k, f in seen.items()}
        for r in reports:
            flag = None if r.rank in result.flags else seen.get((r.node, r.local_gpu))
            if flag is not None:
                result.flags[r.rank] = flag
        found = {rank: f for rank, f in result.flags.items() if f.mode == "network"}
        for earlier in job.window:
            if earlier.comm is None:
                continue
            for rank, f in found.items():
                if rank not in earlier.flags:
                    flag = self._network_cause(earlier, f.node, f.gpu, read_at_ns=result.end_ns)
                    if flag is not None:
                        earlier.flags[rank] = flag

    def _network_cause(self, step: _StepResult, node: str, gpu: int, read_at_ns: int | None = None) -> _Flag | None:
        c = step.comm
        cause, evidence = self.health.cause_for(node, gpu, step.end_ns, since_ns=step.start_ns,
                                                slowdown=c.comm_s / c.baseline_comm_s, candidates=NETWORK_CAUSES,
                                                read_at_ns=read_at_ns)
        if cause not in NETWORK_CAUSES:
            return None
        return _Flag("network", node, gpu, c.slowdown, comm_s=c.comm_s, baseline_comm_s=c.baseline_comm_s,
                     step_s=c.step_s, cause=cause, cause_evidence=evidence)

    # -- lifecycle ------------------------------------------------------------------------
    def _transitions(self, job_id: str, job: _Job, latest: _StepResult) -> list[Finding]:
        out: list[Finding] = []
        candidates = set(job.open) | {rank for w in job.window for rank in w.flags}
        for rank in sorted(candidates):
            flagged = [w for w in job.window if rank in w.flags]
            opened = job.open.get(rank)
            if opened is None:
                if len(flagged) >= self.min_flagged_steps:
                    finding, cause = self._finding(job_id, rank, flagged, len(job.window), OPEN)
                    job.open[rank], job.open_cause[rank] = finding, cause
                    out.append(finding)
            elif not flagged:
                if len(job.window) >= self.window_steps:
                    del job.open[rank]
                    job.open_cause.pop(rank, None)
                    out.append(Finding(KIND, RESOLVED, opened.entity, opened.severity, opened.onset_ns,
                                       latest.end_ns, opened.evidence, summary=f"resolved: {opened.summary}",
                                       detector=DETECTOR, related=opened.related))
            elif rank in latest.flags:
                # re-reported only when the severity or the kind of cause changes, not every step
                finding, cause = self._finding(job_id, rank, flagged, len(job.window), UPDATE, opened)
                if (finding.severity, cause) != (opened.severity, job.open_cause.get(rank)):
                    job.open[rank], job.open_cause[rank] = finding, cause
                    out.append(finding)
        return out

    def _finding(self, job_id: str, rank: int, flagged: list[_StepResult], window_len: int, state: str,
                 opened: Finding | None = None) -> tuple[Finding, str]:
        last = flagged[-1].flags[rank]
        first = flagged[0]
        cluster = self._clusters.get(job_id, self.cluster)
        delay = flagged[-1].step - first.step + 1
        slowdown = float(np.median([w.flags[rank].slowdown for w in flagged]))
        cause, cause_evidence = last.cause, last.cause_evidence
        if last.mode == "compute" and self.health is not None:
            cause, cause_evidence = self.health.cause_for(last.node, last.gpu, flagged[-1].end_ns,
                                                          since_ns=first.start_ns, slowdown=slowdown,
                                                          candidates=GPU_CAUSES)
            if cause == NONE:
                path = self.health.cause_for(last.node, last.gpu, flagged[-1].end_ns, since_ns=first.start_ns,
                                             candidates=COMPUTE_FALLBACK_CAUSES)
                if path[0] in COMPUTE_FALLBACK_CAUSES:
                    cause, cause_evidence = path
        who = f"{job_id} rank {rank} ({last.node} gpu{last.gpu})"
        n = len(flagged)
        if last.mode == "compute":
            summary = f"{who} is {slowdown:.2f}x slower than its peers for {n} steps"
            evidence = [
                Evidence("busy_seconds", last.busy, last.median_busy, "s", "rank compute vs job median"),
                Evidence("slowdown", slowdown, self.min_slowdown, "x", "busy / job median busy"),
                Evidence("robust_z", last.z, self.robust_z, "sigma", "(busy - median) / max(1.4826 MAD, floor)"),
                Evidence("collective_wait_seconds", last.wait, last.median_wait, "s",
                         "least wait in the job (arrives last)" if last.least_wait else "below the job median"),
            ]
        else:
            comm_s = float(np.median([w.flags[rank].comm_s for w in flagged]))
            summary = (f"{who} slows its job's collectives: step {slowdown:.2f}x longer "
                       f"(comm {comm_s:.2f} s vs {last.baseline_comm_s:.2f} s baseline) for {n} steps")
            evidence = [
                Evidence("comm_seconds", last.comm_s, last.baseline_comm_s * self.comm_slowdown, "s",
                         f"job collective time, baseline {last.baseline_comm_s:.3f} s"),
                Evidence("slowdown", slowdown, self.comm_slowdown, "x", "step time / expected step time"),
            ]
        evidence.append(Evidence("flagged_steps", float(n), float(self.min_flagged_steps), "steps",
                                 f"outlier in {n} of the last {window_len} evaluated steps"))
        named = [e for e in opened.evidence if e.name == "detection_delay_steps"] if opened else []
        evidence += named or [Evidence("detection_delay_steps", float(delay), float(self.min_flagged_steps), "steps",
                                       f"first flagged step {first.step}, named at step {flagged[-1].step}")]
        probable = ""
        action = ""
        if cause:
            probable = describe_cause(cause, cause_evidence)
            summary += f"; probable cause: {probable}"
            action = CAUSE_ACTION.get(cause, "")
            evidence += cause_evidence
        elif self.health is None:
            action = "attach a NodeHealthBook for a probable cause"
        related = self._related(last.node, last.gpu, flagged[-1].end_ns, first.start_ns)
        if related:
            summary += "; see " + ", ".join(f"{kind} {ident}" for kind, _, ident in related)
            evidence += [Evidence("related_anomaly", 1.0, math.nan, "id", f"{ident} {kind} on {last.node} {entity}")
                         for kind, entity, ident in related]
        nic = self.health.nic_for(last.node, last.gpu) if self.health is not None else rail_nic(last.gpu)
        device, _, port = nic.partition("/")
        finding = Finding(
            KIND, state,
            EntityRef(cluster=cluster, node=last.node, device=f"gpu{last.gpu}", rank=str(rank), job=job_id),
            severity=self._severity(slowdown, cause, opened),
            onset_ns=opened.onset_ns if opened else first.start_ns,
            detected_ns=flagged[-1].end_ns,
            evidence=evidence,
            confidence=min(1.0, n / window_len) if window_len else 0.0,
            probable_cause=probable,
            cause=cause,
            suggested_action=action,
            summary=summary,
            detector=DETECTOR,
            related=[EntityRef(cluster=cluster, node=last.node),
                     EntityRef(cluster=cluster, node=last.node, device=f"gpu{last.gpu}"),
                     EntityRef(cluster=cluster, node=last.node, device=device, port=port)],
        )
        return finding, cause

    def _related(self, node: str, gpu: int, at_ns: int, since_ns: int) -> list[tuple[str, str, str]]:
        """Anomalies already open on the rank's GPU or NIC (kind, entity, open event id)."""
        related_for = getattr(self.health, "related_for", None)
        return related_for(node, gpu, at_ns, since_ns=since_ns) if related_for is not None else []

    def _severity(self, slowdown: float, cause: str, opened: Finding | None) -> str:
        # A rank slowed because its NIC is paused by a PFC storm is a symptom: the storm
        # locator already pages for the storm, naming the affected jobs. Keep it as context.
        if cause == STORM_VICTIM:
            return INFO
        # escalate only: a slowdown hovering at the critical factor must not flap the severity
        if slowdown >= self.critical_slowdown or (opened is not None and opened.severity == CRITICAL):
            return CRITICAL
        return WARNING

    def _sweep(self) -> list[Finding]:
        out: list[Finding] = []
        horizon = self._now_ns - int(self.job_idle_s * 1e9)
        for job_id in [j for j, job in self._jobs.items() if job.last_seen_ns < horizon]:
            job = self._jobs.pop(job_id)
            self._clusters.pop(job_id, None)
            self.stats["jobs_forgotten"] += 1
            for opened in job.open.values():
                out.append(Finding(KIND, RESOLVED, opened.entity, opened.severity, opened.onset_ns, self._now_ns,
                                   opened.evidence, summary=f"resolved (job inactive): {opened.summary}",
                                   detector=DETECTOR, related=opened.related))
        return out
