"""The training jobs of the simulated cluster: their steps, their ranks' heartbeats, their hangs.

A `Job` is synchronous data-parallel training, one rank per GPU of its nodes; `auto_jobs`
places a few of mixed size on ~85 % of the nodes. `Workload` runs each job's phase machine
over event time (compute, all-reduce, checkpoint, eval, restart; slower where faults slow
its links or GPUs), emits the `RankStep` of every finished step and every rank's
`RankProgress` heartbeat (`fabricwatch.rank`), and resolves the rank-side faults of
`host_faults` (a rank stuck or lost, a job paused, a long checkpoint or step).

>>> Job("job-a", ("node-0001", "node-0002")).step_comm_s
0.3
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from fabricwatch.models.topology import Topology
from fabricwatch.rank import HEARTBEAT_INTERVAL_S
from fabricwatch.simulator.fabric_faults import AdminToggle, LinkDown, NicAdminDown, PfcStorm
from fabricwatch.simulator.fault_effects import _first_effect_s, _overlap
from fabricwatch.simulator.fault_state import _FaultState
from fabricwatch.simulator.host_faults import (
    XID_GPU_LOST, CheckpointStall, GpuXid, JobPause, LongStep, RankLost, RankStuck,
)
from fabricwatch.simulator.labels import HANG_NIC_DOWN, HANG_STUCK_PROCESS, HANG_XID
from fabricwatch.simulator.timeline import INF


NEVER_STEP = 1 << 62           # a step number no job reaches: "not blocked"
# A small collective inside a long step (`LongStep`) completes this long after the ranks enter it.
INNER_COLLECTIVE_S = 0.2
# A job whose rank died (`RankLost`) is restarted by its scheduler from its checkpoint in this
# long after the fault's offset (as a job is after an XID 79 or a crash).
RANK_LOST_RESTART_S = 30.0


@dataclass(frozen=True)
class Job:
    """A synchronous data-parallel training job: one rank per GPU of each of its nodes.

    Per step: ``step_compute_s`` of compute (per-rank jitter), then an all-reduce that
    takes ``step_comm_s`` at ``bw_efficiency`` of line rate (longer when a link is slow or
    paused). Every ``checkpoint_every_s`` the next step starts with a ``checkpoint_s`` save
    (no fabric traffic, every rank slow); every ``eval_every_s`` an ``eval_s`` evaluation runs
    between steps (no RankSteps). ``since_*_s`` place the job within those cycles at start.
    """
    job_id: str
    nodes: tuple[str, ...]
    step_compute_s: float = 0.9
    step_comm_s: float = 0.3
    bw_efficiency: float = 0.88
    checkpoint_every_s: float = 1800.0
    checkpoint_s: float = 40.0
    eval_every_s: float = 3600.0
    eval_s: float = 60.0
    first_step: int = 1
    since_checkpoint_s: float = 0.0
    since_eval_s: float = 0.0

    def __post_init__(self) -> None:
        object.__setattr__(self, "nodes", tuple(self.nodes))
        if not self.nodes:
            raise ValueError(f"job {self.job_id!r} has no nodes")
        if len(set(self.nodes)) != len(self.nodes):
            raise ValueError(f"job {self.job_id!r} lists a node twice")
        for name in ("step_compute_s", "step_comm_s", "checkpoint_every_s", "checkpoint_s", "eval_every_s", "eval_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"job {self.job_id!r}: {name} must be > 0")
        if not 0 < self.bw_efficiency <= 1:
            raise ValueError(f"job {self.job_id!r}: bw_efficiency must be in (0, 1]")


def auto_jobs(topology: Topology, seed: int = 0, fill: float = 0.85) -> list[Job]:
    """A few jobs of mixed size on ``fill`` of the nodes, in contiguous blocks (idle nodes between).

    Deterministic in (topology, seed): `ClusterSimulator` uses it when ``jobs=None``, so
    fault helpers such as `demo_scenario` can pick nodes that are known to be busy.
    """
    if not 0 < fill <= 1:
        raise ValueError(f"fill must be in (0, 1], got {fill!r}")
    rng = np.random.default_rng([seed, 0xA11C])
    nodes = list(topology.nodes)
    n = len(nodes)
    target = max(1, int(round(fill * n)))
    n_jobs = int(np.clip(round(math.log2(max(n, 2))) - 1, 1, 8))
    n_jobs = max(1, min(n_jobs, target // 2 if target >= 2 else 1))
    if n_jobs == 1:
        sizes = [target]
    else:
        share = rng.dirichlet(np.full(n_jobs, 1.2))
        sizes = np.maximum(2, np.floor(share * target).astype(int))
        while sizes.sum() > target:
            sizes[int(np.argmax(sizes))] -= 1
        sizes[int(np.argmax(sizes))] += target - int(sizes.sum())
        sizes = [int(s) for s in sizes if s > 0]
    items: list[int] = list(range(len(sizes))) + [-1] * (n - target)
    order = rng.permutation(len(items))
    jobs_nodes: list[list[str]] = [[] for _ in sizes]
    pos = 0
    for it in (items[i] for i in order):
        if it < 0:
            pos += 1
        else:
            jobs_nodes[it] = nodes[pos:pos + sizes[it]]
            pos += sizes[it]
    jobs = []
    for j, members in enumerate(jobs_nodes):
        ckpt_every = float(rng.uniform(900, 2400))
        eval_every = float(rng.uniform(1800, 5400))
        jobs.append(Job(
            job_id=f"job-{j + 1:03d}", nodes=tuple(members),
            step_compute_s=float(rng.uniform(0.35, 2.2)), step_comm_s=float(rng.uniform(0.12, 0.65)),
            bw_efficiency=float(rng.uniform(0.82, 0.93)),
            checkpoint_every_s=ckpt_every, checkpoint_s=float(rng.uniform(15, 60)),
            eval_every_s=eval_every, eval_s=float(rng.uniform(20, 90)),
            first_step=int(rng.integers(1_000, 200_000)),
            since_checkpoint_s=float(rng.uniform(0, ckpt_every)), since_eval_s=float(rng.uniform(0, eval_every)),
        ))
    return jobs


class _JobRun:
    """Mutable run state of one job (phase machine over continuous event time)."""

    def __init__(self, job: Job, index: int, node_idx: np.ndarray, gpus: int) -> None:
        self.job = job
        self.index = index
        self.node_idx = node_idx
        self.world = len(node_idx) * gpus
        self.rank_node = np.repeat(node_idx, gpus)
        self.rank_gpu = np.tile(np.arange(gpus), len(node_idx))
        self.rank_flat = self.rank_node * gpus + self.rank_gpu
        self.ports = np.zeros(0, dtype=np.int64)
        self.phase = "compute"
        self.phase_left = 0.0
        self.step = job.first_step - 1
        self.step_start = 0.0
        self.busy = np.zeros(self.world)
        self.ckpt_len = 0.0
        self.comp_len = 0.0
        self.comm_work = 0.0
        self.next_ckpt_t = job.checkpoint_every_s - job.since_checkpoint_s
        self.next_eval_t = job.eval_every_s - job.since_eval_s
        self.last_ckpt_step = job.first_step - 1
        self.restart_pending = False
        # rank-side faults (`ClusterSimulator._resolve_rank_faults`): the step whose collective
        # the job cannot complete (a rank never joins it), a checkpoint or a long step to come
        self.block_step = NEVER_STEP
        self.ckpt_override_s = 0.0
        self.long_extra_s = 0.0
        self.long_every_s = 0.0
        self.long_window: tuple[float, float, float] | None = None


class _Beats:
    """One job's `RankProgress` state (the counters of its current processes)."""

    def __init__(self, world: int, rng) -> None:
        self.next_t = rng.uniform(0.0, HEARTBEAT_INTERVAL_S, world)   # each rank's next heartbeat
        self.no_entry = np.full(world, NEVER_STEP, dtype=np.int64)    # a culprit never enters from this step
        self.silent_from = np.full(world, INF)                         # a dead process sends nothing
        self.pauses: list[tuple[float, float]] = []                    # the job stopped: nothing sent
        self.restart()

    def restart(self) -> None:
        """New processes: counters from 0, nothing entered or completed yet."""
        self.done = 0                     # collectives every rank completed (one per finished step)
        self.done_t: float | None = None  # when the last of them completed
        self.entered_t = np.full(len(self.next_t), np.nan)   # each rank's entry into it
        self.windows: list[tuple[float, float, float]] = []  # long steps' small collectives
        self.no_entry[:] = NEVER_STEP
        self.silent_from[:] = INF

    def count_finished(self, finished) -> None:
        for start, busy, end, _ in finished:
            self.done += 1
            self.done_t = end
            self.entered_t = start + np.asarray(busy, dtype=float)

    def counters(self, r: int, tb: float, finished: list, open_) -> tuple:
        """(entered, completed, last entered, last completed, step) of rank ``r`` at ``tb``."""
        completed, last_c = self.done, self.done_t
        last_e = None if np.isnan(self.entered_t[r]) else float(self.entered_t[r])
        cur = open_
        for start, busy, end, step in finished:
            if end <= tb:
                completed, last_c, last_e = completed + 1, end, start + float(busy[r])
            else:
                cur = (start, busy, end, step)
                break
        entered, step = completed, (cur[3] if cur is not None else (open_[3] if open_ is not None else 0))
        if cur is not None and cur[0] + float(cur[1][r]) <= tb and cur[3] < self.no_entry[r]:
            entered += 1
            last_e = cur[0] + float(cur[1][r])
        for w0, w1, every in self.windows:
            k_max = int((w1 - w0) // every)
            n_e = min(k_max, max(0, int(math.floor((tb - w0) / every - 0.5)) + 1))
            n_c = min(k_max, max(0, int(math.floor((tb - INNER_COLLECTIVE_S - w0) / every - 0.5)) + 1))
            entered, completed = entered + n_e, completed + n_c
            if n_e:
                last_e = max(last_e if last_e is not None else -INF, w0 + (n_e - 0.5) * every)
            if n_c:
                last_c = max(last_c if last_c is not None else -INF, w0 + (n_c - 0.5) * every + INNER_COLLECTIVE_S)
        return entered, completed, last_e, last_c, step


class Workload:
    """`ClusterSimulator`'s jobs: phase machines, finished steps, heartbeats, rank-side faults."""

    def _index_jobs(self) -> None:
        N = len(self._nodes)
        self._node_job = np.full(N, -1, dtype=np.int64)
        self._jobs: list[_JobRun] = []
        seen: set[str] = set()
        for j, job in enumerate(self.jobs):
            if job.job_id in seen:
                raise ValueError(f"job id {job.job_id!r} is used twice")
            seen.add(job.job_id)
            idx = []
            for n in job.nodes:
                if n not in self._node_idx:
                    raise ValueError(f"job {job.job_id!r}: unknown node {n!r}")
                k = self._node_idx[n]
                if self._node_job[k] >= 0:
                    raise ValueError(f"node {n!r} is in two jobs")
                self._node_job[k] = j
                idx.append(k)
            jr = _JobRun(job, j, np.array(idx, dtype=np.int64), self.G)
            jr.ports = np.concatenate([self._node_ports[k] for k in idx]) if idx else np.zeros(0, np.int64)
            self._jobs.append(jr)
        self._job_id_idx = {jr.job.job_id: jr.index for jr in self._jobs}
        self._job_eff = np.array([jr.job.bw_efficiency for jr in self._jobs] + [0.0])

    def _start_step(self, jr: _JobRun, t: float, rank_factor: np.ndarray) -> None:
        rng = self._rng
        job = jr.job
        jr.step += 1
        jr.step_start = t
        common = 1.0 + rng.normal(0, 0.02)
        busy = job.step_compute_s * common * (1.0 + rng.normal(0, 0.012, jr.world)) * rank_factor[jr.rank_flat]
        if rng.random() < 0.004:     # a rank hiccups once (GC pause, data loader)
            busy[rng.integers(jr.world)] *= rng.uniform(1.5, 3.0)
        busy = np.maximum(busy, 1e-3)
        ckpt_len = 0.0
        if t >= jr.next_ckpt_t:
            ck = (jr.ckpt_override_s or job.checkpoint_s) * rng.uniform(0.9, 1.1) * rng.uniform(0.97, 1.0, jr.world)
            jr.ckpt_override_s = 0.0
            ckpt_len = float(ck.max())
            busy = busy + ck
            jr.next_ckpt_t = t + job.checkpoint_every_s
            jr.last_ckpt_step = jr.step - 1
        if jr.long_extra_s:          # a long step (`LongStep`): more compute on every rank
            busy = busy + jr.long_extra_s
            jr.long_window = (t + ckpt_len, t + ckpt_len + jr.long_extra_s, jr.long_every_s)
            jr.long_extra_s = 0.0
        jr.busy = busy
        jr.ckpt_len = ckpt_len
        jr.comp_len = float(busy.max()) - ckpt_len
        slow_net = rng.uniform(2.0, 4.0) if rng.random() < 0.003 else 1.0
        jr.comm_work = job.step_comm_s * rng.uniform(0.95, 1.05) * slow_net
        jr.phase = "ckpt" if ckpt_len > 0 else "compute"
        jr.phase_left = ckpt_len if ckpt_len > 0 else jr.comp_len

    def _advance_jobs(self, fs: _FaultState, t0: float, t1: float):
        """Run every job's phase machine over [t0, t1); phase seconds per job, finished steps."""
        nj = len(self._jobs)
        acc = np.zeros((nj + 1, 6))   # ckpt, compute, comm(incl. hung), eval, restart, comm work
        col = {"ckpt": 0, "compute": 1, "comm": 2, "eval": 3, "restart": 4}
        # healthy congestion slows the collective a little
        lvl = self._leaf_level[self._p_switch]
        steps = []
        for jr in self._jobs:
            j = jr.index
            if j in fs.job_restart_left:
                jr.phase = "restart"
                jr.phase_left = fs.job_restart_left[j]
                jr.step = jr.last_ckpt_step
            speed_comm = float(fs.job_fault_speed[j])
            if len(jr.ports):
                speed_comm *= 1.0 - 0.6 * float(lvl[jr.ports].mean())
            stalled = bool(fs.job_stall[j])
            t = t0
            guard = 0
            while t < t1 - 1e-12 and guard < 10_000:
                guard += 1
                if (stalled or (jr.phase == "comm" and jr.step >= jr.block_step)) and jr.phase != "restart":
                    acc[j, 2] += t1 - t          # hung in (or waiting for) the collective
                    break
                speed = speed_comm if jr.phase == "comm" else 1.0
                if speed <= 1e-9:
                    acc[j, col[jr.phase]] += t1 - t
                    break
                need = jr.phase_left / speed
                if need > t1 - t:
                    jr.phase_left -= (t1 - t) * speed
                    acc[j, col[jr.phase]] += t1 - t
                    if jr.phase == "comm":
                        acc[j, 5] += (t1 - t) * speed
                    break
                acc[j, col[jr.phase]] += need
                if jr.phase == "comm":
                    acc[j, 5] += jr.phase_left
                t += need
                jr.phase_left = 0.0
                self._next_phase(jr, t, fs, steps)
        return acc, steps

    def _next_phase(self, jr: _JobRun, t: float, fs: _FaultState, steps: list) -> None:
        if jr.phase == "ckpt":
            jr.phase, jr.phase_left = "compute", jr.comp_len
        elif jr.phase == "compute":
            jr.phase, jr.phase_left = "comm", jr.comm_work
        elif jr.phase == "comm":
            steps.append((jr, jr.step, jr.step_start, t - jr.step_start, jr.busy))
            if t >= jr.next_eval_t:
                jr.phase = "eval"
                jr.phase_left = jr.job.eval_s * self._rng.uniform(0.9, 1.1)
                jr.next_eval_t = t + jr.phase_left + jr.job.eval_every_s
            else:
                self._start_step(jr, t, fs.rank_factor)
        else:  # eval, restart
            self._start_step(jr, t, fs.rank_factor)

    # ---------------------------------------------------------------- ranks: heartbeats, hangs

    def _init_heartbeats(self) -> None:
        """Each job's `RankProgress` state; heartbeats spread over the period (own random stream)."""
        rng = np.random.default_rng([self.seed, 0x4EA7])
        self._hb = [_Beats(jr.world, rng) for jr in self._jobs]
        self._beats_out: list = []

    def _rank_of(self, node: str, gpu: int, what: str) -> tuple[_JobRun, int]:
        """The job run and rank on (node, gpu)."""
        g = self._gpu_index(node, gpu, what)
        j = self._node_job[g // self.G]
        if j < 0:
            raise ValueError(f"{what}: node {node!r} runs no job")
        jr = self._jobs[j]
        k = int(np.nonzero(jr.node_idx == g // self.G)[0][0])
        return jr, k * self.G + gpu

    def _rank_fault_job(self, f) -> _JobRun:
        if isinstance(f, (RankStuck, RankLost)):
            return self._rank_of(f.node, f.gpu, type(f).__name__)[0]
        n = self._node_idx.get(f.node)
        if n is None or self._node_job[n] < 0:
            raise ValueError(f"{type(f).__name__}: node {f.node!r} runs no job")
        return self._jobs[self._node_job[n]]

    def _no_entry_step(self, jr: _JobRun, rank: int, t: float) -> int:
        """The first step whose collective ``rank`` had not entered by ``t``."""
        if jr.phase in ("ckpt", "compute") and jr.step_start + jr.busy[rank] > t:
            return jr.step
        return jr.step + 1

    def _culprits(self, f) -> list[tuple[_JobRun, int, str]]:
        """(job run, rank, root) of the ranks that hold up their job's collective under ``f``."""
        if isinstance(f, (RankStuck, RankLost)):
            return [(*self._rank_of(f.node, f.gpu, type(f).__name__), f.root)]
        if isinstance(f, GpuXid) and f.code in XID_GPU_LOST and self._node_job[self._node_idx[f.node]] >= 0:
            return [(*self._rank_of(f.node, f.gpu, "GpuXid"), HANG_XID)]
        if isinstance(f, (LinkDown, NicAdminDown)) and not (isinstance(f, LinkDown) and f.failover):
            p = self._p_key[(f.node, f.nic)]
            if self._node_job[self._p_node[p]] >= 0:
                return [(*self._rank_of(f.node, int(self._p_gpu[p]), type(f).__name__), HANG_NIC_DOWN)]
        if isinstance(f, AdminToggle):      # an operator shuts the leaf port of a busy NIC: no failover either
            q = int(self._sp_peer_nic[self._sp_key[(f.switch, f.port)]])
            if q >= 0 and self._node_job[self._p_node[q]] >= 0:
                return [(*self._rank_of(self._nodes[self._p_node[q]], int(self._p_gpu[q]), "AdminToggle"),
                         HANG_NIC_DOWN)]
            return []
        if isinstance(f, PfcStorm) and f.stuck_host and not f.xon_only:
            out = []
            for p in self._storm_plan[id(f)]["src"]:
                if self._node_job[self._p_node[p]] >= 0:
                    out.append((*self._rank_of(self._nodes[self._p_node[p]], int(self._p_gpu[p]), "PfcStorm"),
                                HANG_STUCK_PROCESS))
            return out
        return []

    def _resolve_rank_faults(self, fs: _FaultState, t0: float, t1: float) -> None:
        """Rank-side faults for [t0, t1): a rank that never enters (or completes) its job's next
        collective, a dead process, a job paused, a long checkpoint or step to come."""
        for f in self.faults:
            if _first_effect_s(f) > t1:
                break
            starts = t0 <= f.onset_s < t1
            ends = t0 <= getattr(f, "effective_offset_s", f.offset_s) < t1
            if isinstance(f, (CheckpointStall, LongStep, JobPause)):
                jr = self._rank_fault_job(f)
                if isinstance(f, JobPause):
                    if _overlap(f.onset_s, f.offset_s, t0, t1) > 0:
                        fs.job_stall[jr.index] = True      # stopped: nothing runs, nothing is sent
                    if starts:
                        self._hb[jr.index].pauses.append((f.onset_s, f.offset_s))
                elif starts and isinstance(f, CheckpointStall):
                    jr.next_ckpt_t = min(jr.next_ckpt_t, f.onset_s)
                    jr.ckpt_override_s = f.duration_s
                elif starts:
                    jr.long_extra_s, jr.long_every_s = f.duration_s, f.collective_every_s
                continue
            if not (starts or ends):
                continue
            for jr, rank, root in self._culprits(f):
                hb = self._hb[jr.index]
                if starts and root != HANG_NIC_DOWN:
                    # a rank that is not there never enters the collectives it had not entered yet
                    # (one whose NIC is down enters them, and nobody completes them)
                    hb.no_entry[rank] = min(hb.no_entry[rank], self._no_entry_step(jr, rank, f.onset_s))
                    if isinstance(f, RankStuck):      # the job stops at that collective
                        jr.block_step = min(jr.block_step, int(hb.no_entry[rank]))
                    elif isinstance(f, RankLost):     # ... or at the one it died in
                        jr.block_step = min(jr.block_step, jr.step + (jr.phase in ("eval", "restart")))
                        hb.silent_from[rank] = f.onset_s
                if ends:
                    hb.no_entry[rank] = NEVER_STEP
                    hb.silent_from[rank] = INF
                    if isinstance(f, (RankStuck, RankLost)):
                        jr.block_step = NEVER_STEP
                    if isinstance(f, RankLost):       # the scheduler restarts the job from its checkpoint
                        fs.job_restart_left[jr.index] = RANK_LOST_RESTART_S

    def _heartbeats(self, fs: _FaultState, steps: list, t0: float, t1: float) -> None:
        """Every rank's heartbeats due in [t0, t1) (every `HEARTBEAT_INTERVAL_S`, each rank at its
        own phase), from the collectives its job entered and completed: one all-reduce per step
        (a rank enters it when its compute ends, every rank completes it when the step ends),
        plus a long step's small collectives."""
        self._beats_out = []
        finished: dict[int, list] = {}
        for jr, step, start, seconds, busy in steps:
            finished.setdefault(jr.index, []).append((start, busy, start + seconds, step))
        for jr in self._jobs:
            hb = self._hb[jr.index]
            due = hb.next_t < t1
            if not due.any():
                hb.count_finished(finished.get(jr.index, ()))
                continue
            if jr.index in fs.job_restart_left or jr.phase == "restart":
                hb.restart()                      # the processes are restarting: new counters, nothing sent
                jr.block_step, jr.long_window = NEVER_STEP, None
                hb.next_t[due] += HEARTBEAT_INTERVAL_S * np.ceil((t1 - hb.next_t[due]) / HEARTBEAT_INTERVAL_S)
                continue
            done = finished.get(jr.index, [])
            if jr.long_window is not None and jr.long_window not in hb.windows:
                hb.windows.append(jr.long_window)
            open_ = (jr.step_start, jr.busy, None, jr.step) if jr.phase in ("ckpt", "compute", "comm") else None
            for r in np.nonzero(due)[0].tolist():
                while hb.next_t[r] < t1:
                    tb = float(hb.next_t[r])
                    hb.next_t[r] += HEARTBEAT_INTERVAL_S
                    if tb >= hb.silent_from[r] or any(a <= tb < b for a, b in hb.pauses):
                        continue
                    self._beats_out.append((jr, r, tb, *hb.counters(r, tb, done, open_)))
            hb.count_finished(done)
