"""How well fabricwatch ranks anomalies by cost: its impact against what the simulated jobs lost.

**Truth.** The simulator's jobs are synchronous: every rank reports the same step. A fault's
cost is measured on the jobs it touches (the job of its node or rank, the jobs of its
victims' nodes), from their own progress: over the fault's window (onset to offset, or the
run's end, plus `TAIL_S` for a restart after it), a job of ``g`` GPUs that a healthy rate of
``r`` steps/s would have advanced ``r x window`` steps advanced ``p`` (net: steps redone
after a restart from a checkpoint count against it), so it lost
``g x (window - p / r)`` GPU-seconds. ``r`` is the job's rate outside every fault window
touching it (the whole run's when it has no such time). Two faults on one job in the same
time both carry its loss.

**Ranking.** Over the true positives of a suite: Spearman's rank correlation between
fabricwatch's impact (the last event of the anomaly: its `impact_gpu_hours`) and the
truth, and the top-5 overlap (how many of the five costliest by truth are among our five
costliest, over 5, or over the count when fewer).

>>> round(spearman([1.0, 2.0, 3.0, 4.0], [10.0, 30.0, 20.0, 40.0]), 3)
0.8
>>> top_overlap([5.0, 1.0, 4.0], [3.0, 9.0, 2.0], k=2)    # ours: 0 and 2; truth: 1 and 0
0.5
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np

from fabricwatch.models.findings import JOB_KEY, EntityRef
from fabricwatch.simulator.labels import GroundTruth

# After a fault clears, a stalled job restarts from its checkpoint: count this much more.
TAIL_S = 60.0
TOP_K = 5
# Fewer pairs than this: no correlation is reported.
MIN_PAIRS = 3


def _ranks(x: np.ndarray) -> np.ndarray:
    order = np.argsort(x, kind="mergesort")
    ranks = np.empty(len(x))
    ranks[order] = np.arange(len(x), dtype=float)
    # average ranks over ties
    for v in np.unique(x):
        tie = x == v
        if tie.sum() > 1:
            ranks[tie] = ranks[tie].mean()
    return ranks


def spearman(ours: Sequence[float], truth: Sequence[float]) -> float | None:
    """Spearman's rho (ties averaged); None with fewer than `MIN_PAIRS` pairs or no spread."""
    if len(ours) != len(truth):
        raise ValueError("ours and truth must be the same length")
    if len(ours) < MIN_PAIRS:
        return None
    a, b = _ranks(np.asarray(ours, float)), _ranks(np.asarray(truth, float))
    if a.std() == 0 or b.std() == 0:
        return None
    return float(np.corrcoef(a, b)[0, 1])


def top_overlap(ours: Sequence[float], truth: Sequence[float], k: int = TOP_K) -> float | None:
    """Share of the ``k`` costliest by truth that are among our ``k`` costliest (ties: by index)."""
    n = min(k, len(ours))
    if n == 0:
        return None
    top = lambda v: set(sorted(range(len(v)), key=lambda i: (-v[i], i))[:n])   # noqa: E731
    return len(top(ours) & top(truth)) / n


def _jobs_of(gt: GroundTruth, job_of_node: Mapping[str, str]) -> set[str]:
    jobs: set[str] = set()
    for path in (gt.entity, *gt.victims):
        head = path.split("/")[0]
        if path.startswith(JOB_KEY):
            jobs.add(EntityRef.parse(path).job)
        elif head in job_of_node:
            jobs.add(job_of_node[head])
    return jobs


def _step_at(progress: list[tuple[int, int]], t_ns: int) -> int | None:
    """The step index of the latest step started by ``t_ns`` (progress sorted by start)."""
    starts = [s for s, _ in progress]
    i = int(np.searchsorted(starts, t_ns, side="right")) - 1
    return progress[i][1] if i >= 0 else None


def truth_gpu_hours(truths: Sequence[GroundTruth], jobs: Mapping[str, tuple[str, ...]], gpus_per_node: int,
                    progress: Mapping[str, list[tuple[int, int]]], start_ns: int, end_ns: int) -> list[float | None]:
    """Per ground truth, the GPU-hours its jobs lost (None: it touched no job that reported steps)."""
    job_of_node = {n: j for j, nodes in jobs.items() for n in nodes}
    touched = [_jobs_of(gt, job_of_node) for gt in truths]
    tail_ns = int(TAIL_S * 1e9)
    windows = [(gt.onset_unix_ns, min(end_ns, (gt.offset_unix_ns or end_ns) + tail_ns)) for gt in truths]
    rates: dict[str, float] = {}
    for job, steps in progress.items():
        starts = np.array([s for s, _ in steps], dtype=np.int64)
        spans = [w for w, ts in zip(windows, touched) if job in ts]
        healthy = np.ones(len(starts), bool)
        busy_ns = 0
        for lo, hi in _merged(spans):
            healthy &= ~((starts >= lo) & (starts < hi))
            busy_ns += max(0, min(hi, end_ns) - max(lo, start_ns))
        free_s = (end_ns - start_ns - busy_ns) / 1e9
        if free_s > 0 and healthy.sum() >= 2:
            rates[job] = healthy.sum() / free_s
        elif len(starts) >= 2:
            rates[job] = len(starts) / ((end_ns - start_ns) / 1e9)
    out: list[float | None] = []
    for (lo, hi), ts in zip(windows, touched):
        lost_s, any_job = 0.0, False
        for job in sorted(ts):
            steps, rate = progress.get(job), rates.get(job)
            if not steps or not rate:
                continue
            any_job = True
            before = _step_at(steps, lo)
            after = _step_at(steps, hi)
            done = (after if after is not None else 0) - (before if before is not None else 0)
            gpus = len(jobs.get(job, ())) * gpus_per_node
            lost_s += gpus * max(0.0, (hi - lo) / 1e9 - done / rate)
        out.append(float(lost_s / 3600.0) if any_job else None)
    return out


def _merged(spans: list[tuple[int, int]]) -> list[tuple[int, int]]:
    out: list[tuple[int, int]] = []
    for lo, hi in sorted(spans):
        if out and lo <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], hi))
        else:
            out.append((lo, hi))
    return out


def ranking(pairs: Sequence[tuple[float, float]]) -> dict:
    """{"pairs", "spearman", "top5"} of (ours, truth) pairs."""
    ours, truth = [p[0] for p in pairs], [p[1] for p in pairs]
    return {"pairs": len(pairs), "spearman": spearman(ours, truth), "top5": top_overlap(ours, truth)}
