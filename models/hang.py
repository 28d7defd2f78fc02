"""Hang localisation: name the rank behind a collective that stopped progressing.

Reads `RankProgress` heartbeats (the rank SDK sends one per rank every
`fabricwatch.rank.HEARTBEAT_INTERVAL_S`, whether or not a step completes: collectives
entered and completed since the process started, and when it last entered and completed
one) and, optionally, `RankStep` records (their collective wait sets the job's normal
collective time). Emits ``hang`` findings, one per job, on the culprit rank.

An NCCL collective that one rank never joins blocks every other rank inside it until the
watchdog kills the job (``TORCH_NCCL_... timeout``, 10 min by default), and the error it
leaves names every rank alike. The ranks' sequence numbers tell them apart: the same code
runs on every rank, so in a healthy job their ``entered`` counts differ by at most one;
the peers of a rank that never entered collective *n* have entered *n* and completed
*n - 1*, the rank itself has entered *n - 1* only.

Rules, per job, evaluated on each heartbeat (event time: the newest heartbeat of the job;
each rank's own clock is rebased on it at arrival, so a skewed node clock decides nothing):

* **Hung** when no rank has completed a collective for ``hang_after`` seconds **and** at
  least one rank whose heartbeat is alive has been inside a collective (entered >
  completed) for as long. ``hang_after`` = `HANG_MEDIAN_FACTOR` x the job's recent median
  collective wait (from its rank steps), clipped to [`HANG_AFTER_FLOOR_S`,
  `HANG_AFTER_CAP_S`]: above normal long collectives, and with a heartbeat period and the
  pipeline's latency still inside 60 s of the hang.
* **Culprit**: a rank whose heartbeat stopped (`HEARTBEAT_LOST_S`: a dead process),
  else the rank with the lowest entered count (never entered the collective its peers wait
  in), else the lowest completed count (entered, never completed), ties broken by a node
  health cause, then by the earliest last progress, then by the lowest rank.
* **Probable root** (with a `HealthBook`): the GPU lost (a GPU-fault XID such as 79, or
  uncorrectable ECC errors, `fabricwatch.xid`), the rank's NIC link down (without failover:
  the job hangs), its NIC held by PFC pauses (``storm_victim``: a fabric stall; a storm
  holding one node of a job stalls every rank alike, and that node's rank is named), else
  ``stuck_process`` (alive, never enters) or ``process_lost`` (its
  heartbeat stopped, no hardware cause: killed, OOM, segfault). Anomalies already open on
  the culprit's GPU or NIC are cited by id (``related_for``).
* **Resolved** when a completion advances again, when the job's counters restart (a new
  process: the job was restarted) or when the job falls silent for `JOB_GONE_S` (ended).

Silent: a checkpoint or evaluation stall (every rank idle between collectives, nobody
inside one), a job paused or stopped (every heartbeat stops together; after a pause that
long, the waiting is counted from the first heartbeat back), a long but progressing step
(completions advance), a 1-rank job.

>>> from fabricwatch.models.frames import RankProgress
>>> det = HangDetector(cluster="c1")
>>> def beat(t_s, rank, entered, completed, last_s):
...     return RankProgress("job-h", rank, 4, f"node-{rank // 2}", rank % 2, int(t_s * 1e9),
...                         entered, completed, int(last_s * 1e9), int(last_s * 1e9), 7)
>>> out = []
>>> for t in range(0, 60, 5):    # rank 3 sleeps before collective 41; its peers wait inside it
...     out += det.add_progress([beat(t, r, 41 if r != 3 else 40, 40, 1.0) for r in range(4)])
>>> [(f.state, f.entity.path(), f.severity) for f in out]
[('open', 'c1/job=job-h/rank=3', 'critical')]
>>> out[0].summary
'job-h hung for 24 s: rank 3 (node-1 gpu1) never entered collective #41 (entered 40, peers 41); 3 of 4 ranks wait in it; probable root: stuck process'
>>> det.add_progress([beat(61, 3, 41, 41, 61), beat(61, 0, 41, 41, 61)])[0].state
'resolved'
"""
from __future__ import annotations

import math
from collections import Counter, deque
from dataclasses import dataclass, field

import numpy as np

from fabricwatch.rank import HEARTBEAT_INTERVAL_S

from .detector import RankProgressDetector
from .findings import CRITICAL, OPEN, RESOLVED, UPDATE, EntityRef, Evidence, Finding
from .frames import RankProgress, RankStep
from .node_health import CAUSE_ACTION, ECC, NIC_DOWN, STORM_VICTIM, XID, HealthBook, rail_nic
from .vocabulary import HANG, PROCESS_LOST, STUCK_PROCESS

DETECTOR = "hang/v1"
KIND = HANG

# -- thresholds ------------------------------------------------------------------------------
# Collectives of big jobs legitimately take seconds (multi-GB all-reduces on a congested
# fabric, the first call that sets up NCCL's communicators): a hang is 20 s without a
# completion at least. 20 s + one heartbeat (5 s) + the pipeline (~2-5 s) names it in ~30 s.
HANG_AFTER_FLOOR_S = 20.0
# ... and at least this many times the job's recent median collective wait per step (a job
# whose steps normally wait 3 s in their collectives gets 30 s).
HANG_MEDIAN_FACTOR = 10.0
# ... but never more: the 60 s target minus a heartbeat period and the pipeline's latency.
HANG_AFTER_CAP_S = 45.0
# A rank whose heartbeat is this old is lost (a dead or stopped process): one or two missed
# heartbeats are a slow send or a busy gateway, three are not.
HEARTBEAT_LOST_S = 3 * HEARTBEAT_INTERVAL_S
# A job none of whose ranks reported for this long (event time) has ended (or was stopped by
# its scheduler): forgotten, its open hang resolved. Many heartbeat periods: a gateway outage
# of a minute loses no job.
JOB_GONE_S = 120.0
# Collective waits (one per rank step) kept per job for its median.
WAIT_HISTORY = 64
JOB_SWEEP_S = 10.0          # look for ended jobs at most this often (event time)
# A job past its hang threshold is looked at (every rank) at most this often, in its event
# time: a hung 100,000-rank job sends 20,000 heartbeat records a second, and looking at
# every rank on each of them is quadratic. Healthy jobs never get that far (one comparison).
CHECK_INTERVAL_S = 1.0
MAX_JOBS = 100_000          # jobs followed per detector; beyond, new ones are refused (counted)
# Ranks followed per detector, all jobs together (about 500 B each): four per GPU of a
# 100,000-GPU cluster. A node may claim any rank of any job (its token binds only the node),
# so without a bound fresh (job, rank) pairs would grow the worker and its checkpoint.
MAX_RANKS = 400_000
MAX_GROUPS_SHOWN = 4        # (entered, completed) groups spelled out in the evidence
MIN_WORLD_SIZE = 2          # one rank waits for nobody
# Causes a hang's culprit is looked up for, in order: the GPU lost, its NIC link down, its NIC
# held by PFC pauses (a storm holding one node's NIC stalls every rank of the job alike: no
# rank is behind, and the fabric, not a process, is the root).
HANG_CAUSES = (XID, ECC, NIC_DOWN, STORM_VICTIM)
ROOT_TEXT = {
    XID: "GPU lost",
    ECC: "GPU lost to uncorrectable memory errors",
    NIC_DOWN: "the rank's NIC link down, NCCL did not fail over",
    STORM_VICTIM: "a fabric stall: the rank's NIC is held by PFC pauses (a PFC storm; its pfc_storm anomaly "
                  "names the source)",
    STUCK_PROCESS: "stuck process (alive, its heartbeat goes on, it never enters the collective: data loader, "
                   "deadlock, a rank-dependent branch; py-spy dump it)",
    PROCESS_LOST: "process lost (its heartbeat stopped and no hardware cause shows: killed, OOM, segfault)",
}
ROOT_ACTION = {
    XID: "drain the node; restart the job from its checkpoint without it",
    ECC: CAUSE_ACTION[ECC] + "; restart the job from its checkpoint",
    NIC_DOWN: CAUSE_ACTION[NIC_DOWN] + "; restart the job from its checkpoint (NCCL_IB_HCA without that NIC)",
    STORM_VICTIM: CAUSE_ACTION[STORM_VICTIM] + "; the job resumes when the pauses stop (restart it from its "
                  "checkpoint if NCCL's watchdog killed it)",
    STUCK_PROCESS: "dump the rank's stacks (py-spy dump --pid, or the NCCL flight recorder), then restart the job",
    PROCESS_LOST: "read the rank's exit (dmesg for the OOM killer, the scheduler's log), then restart the job",
}


@dataclass
class _Rank:
    last: RankProgress
    seen_ns: int              # job event time when its newest heartbeat arrived
    offset_ns: int            # job clock - the rank's clock, at that arrival

    def job_time(self, t_ns: int) -> int:
        """A time of the rank's clock on the job's clock (0 stays 0: never)."""
        return t_ns + self.offset_ns if t_ns else 0


@dataclass
class _Job:
    ranks: dict[int, _Rank] = field(default_factory=dict)
    world: int = 0
    now_ns: int = 0
    epoch_ns: int | None = None   # first heartbeat after a job-wide silence (a pause, the start)
    waits: deque = field(default_factory=lambda: deque(maxlen=WAIT_HISTORY))
    hang_after_ns: int | None = None   # from `waits`, recomputed after they change
    # Running over the ranks' heartbeats (the counters only grow within one process):
    max_completed: int = -1
    last_completion_ns: int = 0        # the newest completion of any rank, on the job's clock
    checked_ns: int = 0                # when every rank was last looked at
    open: Finding | None = None
    open_cause: str = ""
    open_completed: int = -1   # the job's highest completed count when it was opened


@dataclass
class HangDetector(RankProgressDetector):
    """Names the rank that holds up a hung collective, from the ranks' progress heartbeats.

    Parameters
    ----------
    health : optional `HealthBook` (or `NodeHealthBook`): the probable root from the
        culprit's node telemetry (GPU lost, NIC down) and anomalies open on its GPU or NIC.
    cluster : cluster name for the findings' entities (or per call).
    hang_after_floor_s, hang_median_factor, hang_after_cap_s : the hang threshold.
    heartbeat_lost_s : a rank's heartbeat this old means its process is gone.
    job_gone_s : a job silent this long has ended.
    max_ranks : ranks followed at most, all jobs together; beyond, new ones are refused
        (``stats["ranks_refused"]``).
    """

    health: HealthBook | None = None
    cluster: str = ""
    hang_after_floor_s: float = HANG_AFTER_FLOOR_S
    hang_median_factor: float = HANG_MEDIAN_FACTOR
    hang_after_cap_s: float = HANG_AFTER_CAP_S
    heartbeat_lost_s: float = HEARTBEAT_LOST_S
    job_gone_s: float = JOB_GONE_S
    max_ranks: int = MAX_RANKS
    stats: Counter = field(default_factory=Counter, repr=False)
    _jobs: dict[str, _Job] = field(default_factory=dict, repr=False)
    _clusters: dict[str, str] = field(default_factory=dict, repr=False)
    _now_ns: int = field(default=0, repr=False)
    _last_sweep_ns: int = field(default=0, repr=False)
    _ranks_followed: int = field(default=0, repr=False)

    def __post_init__(self) -> None:
        if not 0 < self.hang_after_floor_s <= self.hang_after_cap_s:
            raise ValueError(f"need 0 < hang_after_floor_s <= hang_after_cap_s, got {self.hang_after_floor_s!r}, "
                             f"{self.hang_after_cap_s!r}")
        if not self.hang_median_factor >= 1:
            raise ValueError(f"hang_median_factor must be >= 1, got {self.hang_median_factor!r}")
        if not self.heartbeat_lost_s > HEARTBEAT_INTERVAL_S:
            raise ValueError(f"heartbeat_lost_s must exceed the heartbeat period {HEARTBEAT_INTERVAL_S} s, "
                             f"got {self.heartbeat_lost_s!r}")
        if not self.job_gone_s > self.heartbeat_lost_s:
            raise ValueError(f"job_gone_s must exceed heartbeat_lost_s, got {self.job_gone_s!r}")

    # -- public ---------------------------------------------------------------------------
    def add_steps(self, steps: list[RankStep]) -> None:
        """Rank steps of known jobs: their collective waits set the jobs' hang thresholds."""
        for step in steps:
            job = self._jobs.get(step.job_id)
            if job is not None and math.isfinite(step.collective_wait_seconds):
                job.waits.append(step.collective_wait_seconds)
                job.hang_after_ns = None

    def add_progress(self, reports: list[RankProgress], cluster: str | None = None) -> list[Finding]:
        """Heartbeats (any jobs, any order within a record); findings opened, updated or resolved."""
        by_job: dict[str, list[RankProgress]] = {}
        for p in reports:
            by_job.setdefault(p.job_id, []).append(p)
        out: list[Finding] = []
        for job_id, mine in by_job.items():
            out += self._add_job(job_id, sorted(mine, key=lambda p: p.time_ns), cluster)
        if self._now_ns - self._last_sweep_ns >= JOB_SWEEP_S * 1e9:
            out += self.expire(self._now_ns)
        return out

    def expire(self, now_ns: int) -> list[Finding]:
        """Forget jobs silent for ``job_gone_s`` before ``now_ns``; their open hangs resolve."""
        self._now_ns = max(self._now_ns, now_ns)
        self._last_sweep_ns = self._now_ns
        out: list[Finding] = []
        horizon = self._now_ns - int(self.job_gone_s * 1e9)
        for job_id in [j for j, job in self._jobs.items() if job.now_ns < horizon]:
            job = self._jobs.pop(job_id)
            self._ranks_followed -= len(job.ranks)
            self.stats["jobs_forgotten"] += 1
            if job.open is not None:
                out.append(self._resolved(job, job.now_ns, "job ended"))
            self._clusters.pop(job_id, None)
        return out

    def open_findings(self) -> list[Finding]:
        return [job.open for job in self._jobs.values() if job.open is not None]

    def hang_after_s(self, job_id: str) -> float:
        """The hang threshold of a job now (seconds without a completion)."""
        job = self._jobs.get(job_id)
        median = float(np.median(job.waits)) if job is not None and job.waits else 0.0
        return min(max(self.hang_median_factor * median, self.hang_after_floor_s), self.hang_after_cap_s)

    def _hang_after_ns(self, job_id: str, job: _Job) -> int:
        if job.hang_after_ns is None:
            job.hang_after_ns = int(self.hang_after_s(job_id) * 1e9)
        return job.hang_after_ns

    # -- one job ----------------------------------------------------------------------------
    def _add_job(self, job_id: str, reports: list[RankProgress], cluster: str | None) -> list[Finding]:
        job = self._jobs.get(job_id)
        if job is None:
            if len(self._jobs) >= MAX_JOBS:
                self.stats["jobs_refused"] += 1
                return []
            job = self._jobs[job_id] = _Job()
        self._clusters[job_id] = cluster if cluster is not None else self._clusters.get(job_id, self.cluster)
        out: list[Finding] = []
        lost_ns = int(self.heartbeat_lost_s * 1e9)
        for p in reports:
            if p.world_size < 1 or p.rank >= p.world_size or p.completed > p.entered:
                self.stats["bad_progress"] += 1       # the gateway refuses these; a replay may not
                continue
            prev = job.ranks.get(p.rank)
            if prev is not None and p.time_ns < prev.last.time_ns:
                self.stats["late_progress"] += 1
                continue
            if prev is not None and (p.entered < prev.last.entered or p.completed < prev.last.completed):
                # counters went back: a new process (the job restarted from a checkpoint)
                self.stats["counter_restarts"] += 1
                if job.open is not None:
                    out.append(self._resolved(job, max(job.now_ns, p.time_ns), "the job restarted"))
                self._ranks_followed -= len(job.ranks)
                job.ranks.clear()
                prev = None
                job.epoch_ns, job.max_completed, job.last_completion_ns = None, -1, 0
            if prev is None:
                if self._ranks_followed >= self.max_ranks:
                    self.stats["ranks_refused"] += 1
                    self._now_ns = max(self._now_ns, p.time_ns)     # time still passes: jobs end
                    continue
                self._ranks_followed += 1
            if job.ranks and p.time_ns - job.now_ns > lost_ns:
                # the job's newest heartbeat before this one is that old: every heartbeat had
                # stopped (SIGSTOP, preemption) and this is the first one back
                job.epoch_ns = None
            job.now_ns = max(job.now_ns, p.time_ns)
            if job.epoch_ns is None:
                job.epoch_ns = job.now_ns
            rank = job.ranks[p.rank] = _Rank(p, job.now_ns, job.now_ns - p.time_ns)
            job.max_completed = max(job.max_completed, p.completed)
            job.last_completion_ns = max(job.last_completion_ns, rank.job_time(p.last_completed_ns))
            job.world = max(job.world, p.world_size)
        self._now_ns = max(self._now_ns, job.now_ns)
        if job.ranks:
            out += self._evaluate(job_id, job)
        return out

    def _evaluate(self, job_id: str, job: _Job) -> list[Finding]:
        now, lost_ns = job.now_ns, int(self.heartbeat_lost_s * 1e9)
        completed = job.max_completed
        if job.open is not None and completed > job.open_completed:
            return [self._resolved(job, now, "collectives complete again")]
        if job.world < MIN_WORLD_SIZE:
            return []
        hang_after_ns = self._hang_after_ns(job_id, job)
        quiet_since = max(job.last_completion_ns, job.epoch_ns)
        if now - quiet_since < hang_after_ns or now - job.checked_ns < CHECK_INTERVAL_S * 1e9:
            return []
        job.checked_ns = now
        alive = [r for r in job.ranks.values() if now - r.seen_ns <= lost_ns]
        waiting = [r for r in alive if r.last.entered > r.last.completed
                   and now - max(r.job_time(r.last.last_entered_ns), job.epoch_ns) >= hang_after_ns]
        if not waiting:
            return []
        culprit, why, cause, cause_evidence = self._culprit(job, now, lost_ns)
        finding = self._finding(job_id, job, culprit, why, cause, cause_evidence, waiting, quiet_since,
                                hang_after_ns, OPEN if job.open is None else UPDATE)
        if job.open is None:
            job.open, job.open_cause, job.open_completed = finding, cause, completed
            self.stats["hangs"] += 1
            return [finding]
        if cause != job.open_cause:               # the root became visible (an XID digest came in)
            job.open, job.open_cause = finding, cause
            return [finding]
        return []

    def _culprit(self, job: _Job, now: int, lost_ns: int) -> tuple[_Rank, str, str, list[Evidence]]:
        ranks = job.ranks
        if job.open is not None:                  # the same anomaly: keep naming the same rank
            rank = ranks.get(int(job.open.entity.rank))
            if rank is not None:
                why = next((e.detail for e in job.open.evidence if e.name == "culprit_rule"), "")
                return (rank, why, *self._root(rank, now, lost_ns))
        lost = [r for r in ranks.values() if now - r.seen_ns > lost_ns]
        if lost:
            first = min(r.seen_ns for r in lost)
            candidates, why = [r for r in lost if r.seen_ns == first], "heartbeat_lost"
        else:
            low = min(r.last.entered for r in ranks.values())
            candidates = [r for r in ranks.values() if r.last.entered == low]
            why = "never_entered"
            if len(candidates) == len(ranks):
                low = min(r.last.completed for r in ranks.values())
                candidates = [r for r in ranks.values() if r.last.completed == low]
                why = "never_completed" if len(candidates) < len(ranks) else "ambiguous"
        scored = []
        for r in candidates:
            cause, evidence = self._root(r, now, lost_ns)
            hardware = cause in HANG_CAUSES
            progress = max(r.job_time(r.last.last_entered_ns), r.job_time(r.last.last_completed_ns))
            scored.append((not hardware, progress, r.last.rank, r, cause, evidence))
        _, _, _, rank, cause, evidence = min(scored, key=lambda s: s[:3])
        return rank, why, cause, evidence

    def _root(self, r: _Rank, now: int, lost_ns: int) -> tuple[str, list[Evidence]]:
        p = r.last
        if self.health is not None:
            cause, evidence = self.health.cause_for(p.node, p.local_gpu, r.seen_ns, candidates=HANG_CAUSES)
            if cause in HANG_CAUSES:
                return cause, evidence
        if now - r.seen_ns > lost_ns:
            return PROCESS_LOST, []
        return STUCK_PROCESS, []

    def _finding(self, job_id: str, job: _Job, culprit: _Rank, why: str, cause: str, cause_evidence: list[Evidence],
                 waiting: list[_Rank], quiet_since: int, hang_after_ns: int, state: str) -> Finding:
        p = culprit.last
        now = job.now_ns
        cluster = self._clusters.get(job_id, self.cluster)
        ranks = job.ranks
        entered = np.array([r.last.entered for r in ranks.values()], dtype=np.float64)
        completed = np.array([r.last.completed for r in ranks.values()], dtype=np.float64)
        peers_entered = int(max(entered))
        stalled_s = (now - quiet_since) / 1e9
        n_wait, world = len(waiting), max(job.world, len(ranks))
        if why == "never_entered":
            what = f"never entered collective #{p.entered + 1} (entered {p.entered}, peers {peers_entered})"
        elif why == "never_completed":
            what = f"never completed collective #{p.completed + 1} (completed {p.completed}, " \
                   f"peers {int(max(completed))})"
        elif why == "heartbeat_lost":
            what = f"stopped sending heartbeats {(now - culprit.seen_ns) / 1e9:.0f} s ago " \
                   f"(entered {p.entered}, completed {p.completed})"
        else:
            what = f"is one of {len(ranks)} ranks stuck alike in collective #{p.entered} (no rank behind)"
        summary = f"{job_id} hung for {stalled_s:.0f} s: rank {p.rank} ({p.node} gpu{p.local_gpu}) " \
                  f"{what}; {n_wait} of {world} ranks wait in it"
        if cause in HANG_CAUSES and cause_evidence and cause_evidence[0].detail:
            probable = f"{ROOT_TEXT[cause]} ({cause_evidence[0].detail})"
        else:
            probable = ROOT_TEXT.get(cause, cause)
        summary += f"; probable root: {probable.split(' (')[0] if cause not in HANG_CAUSES else probable}"
        last_progress = max(culprit.job_time(p.last_entered_ns), culprit.job_time(p.last_completed_ns))
        evidence = [
            Evidence("seconds_since_progress", stalled_s, hang_after_ns / 1e9, "s",
                     "no rank completed a collective since; threshold "
                     f"{HANG_MEDIAN_FACTOR:g}x the job's median collective wait, in [{self.hang_after_floor_s:g}, "
                     f"{self.hang_after_cap_s:g}] s"),
            Evidence("collectives_entered", float(p.entered), float(np.median(entered)), "seq",
                     f"culprit vs job median; lowest {int(min(entered))}, highest {peers_entered}"),
            Evidence("collectives_completed", float(p.completed), float(np.median(completed)), "seq",
                     f"culprit vs job median; lowest {int(min(completed))}, highest {int(max(completed))}"),
            Evidence("ranks_waiting", float(n_wait), float(world), "ranks",
                     f"alive and inside a collective for {hang_after_ns / 1e9:g} s or more"),
            Evidence("heartbeat_age_s", (now - culprit.seen_ns) / 1e9, self.heartbeat_lost_s, "s",
                     "culprit's newest heartbeat"),
            Evidence("last_progress_unix_s", last_progress / 1e9 if last_progress else math.nan, math.nan, "s",
                     f"culprit last entered or completed a collective {(now - last_progress) / 1e9:.0f} s ago"
                     if last_progress else "culprit never entered a collective"),
            Evidence("sequence_numbers", float(len(ranks)), float(world), "ranks", _groups(ranks)),
            Evidence("culprit_rule", 1.0, math.nan, "rule", why),
        ]
        missing = world - len(ranks)
        if missing > 0:
            evidence.append(Evidence("ranks_never_reported", float(missing), 0.0, "ranks",
                                     "no heartbeat at all from these ranks (SDK off, or never started)"))
        evidence += cause_evidence
        node, gpu = p.node, p.local_gpu
        related = self._related(node, gpu, culprit.seen_ns, quiet_since)
        if related:
            summary += "; see " + ", ".join(f"{kind} {ident}" for kind, _, ident in related)
            evidence += [Evidence("related_anomaly", 1.0, math.nan, "id", f"{ident} {kind} on {node} {entity}")
                         for kind, entity, ident in related]
        nic = self.health.nic_for(node, gpu) if self.health is not None else rail_nic(gpu)
        device, _, port = nic.partition("/")
        opened = job.open
        return Finding(
            KIND, state,
            EntityRef(cluster=cluster, node=node, device=f"gpu{gpu}", rank=str(p.rank), job=job_id),
            severity=CRITICAL,
            onset_ns=opened.onset_ns if opened is not None else quiet_since,
            detected_ns=now,
            evidence=evidence,
            confidence=0.5 if why == "ambiguous" else 1.0,
            probable_cause=probable,
            cause=cause,
            suggested_action=ROOT_ACTION.get(cause, ""),
            summary=summary,
            detector=DETECTOR,
            related=[EntityRef(cluster=cluster, node=node),
                     EntityRef(cluster=cluster, node=node, device=f"gpu{gpu}"),
                     EntityRef(cluster=cluster, node=node, device=device, port=port)],
        )

    def _related(self, node: str, gpu: int, at_ns: int, since_ns: int) -> list[tuple[str, str, str]]:
        related_for = getattr(self.health, "related_for", None)
        return related_for(node, gpu, at_ns, since_ns=since_ns) if related_for is not None else []

    def _resolved(self, job: _Job, at_ns: int, why: str) -> Finding:
        opened = job.open
        job.open, job.open_cause, job.open_completed = None, "", -1
        return Finding(KIND, RESOLVED, opened.entity, opened.severity, opened.onset_ns, at_ns, opened.evidence,
                       summary=f"resolved ({why}): {opened.summary}", detector=DETECTOR, related=opened.related)


def _groups(ranks: dict[int, _Rank]) -> str:
    """The ranks' (entered, completed) sequence numbers, grouped: the smallest groups first.

    >>> from fabricwatch.models.frames import RankProgress
    >>> rs = {r: _Rank(RankProgress("j", r, 4, "n", r, 0, 41 - (r == 3), 40, 0, 0), 0, 0) for r in range(4)}
    >>> _groups(rs)
    'entered 40 completed 40: rank 3; entered 41 completed 40: ranks 0-2'
    """
    groups: dict[tuple[int, int], list[int]] = {}
    for rank, r in ranks.items():
        groups.setdefault((r.last.entered, r.last.completed), []).append(rank)
    parts = []
    for (e, c), members in sorted(groups.items(), key=lambda g: (len(g[1]), g[0]))[:MAX_GROUPS_SHOWN]:
        label = f"rank {members[0]}" if len(members) == 1 else f"ranks {_spans(sorted(members))}"
        parts.append(f"entered {e} completed {c}: {label}")
    if len(groups) > MAX_GROUPS_SHOWN:
        parts.append(f"{len(groups) - MAX_GROUPS_SHOWN} more groups")
    return "; ".join(parts)


def _spans(numbers: list[int], limit: int = 8) -> str:
    """'0-2,4,6-7' for sorted rank numbers (at most ``limit`` spans, then '...')."""
    spans: list[list[int]] = []
    for n in numbers:
        if spans and n == spans[-1][1] + 1:
            spans[-1][1] = n
        else:
            spans.append([n, n])
    text = ",".join(f"{a}-{b}" if b > a else f"{a}" for a, b in spans[:limit])
    return text + (",..." if len(spans) > limit else "")
