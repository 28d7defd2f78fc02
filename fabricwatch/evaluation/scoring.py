"""Score the runs: detections matched to the ground truth, per detector and fault class.

`score` turns `ScenarioRun`s into `Scores`: true and false positives per class, detection
delays against each class's target, false alarms on healthy runs per 1000 node-hours
(with `poisson_upper`'s confidence bound), the straggler causes and hang roots named, and
the impact ranking. The targets the report judges against live here too. Separate from
running (no simulation here) and from the report (no formatting): the numbers, once.
"""
from __future__ import annotations

import math
from collections import Counter, defaultdict
from dataclasses import dataclass, field

from fabricwatch.models.ecmp_imbalance import OPEN_WINDOWS, WINDOW_S
from fabricwatch.models.findings import EntityRef
from fabricwatch.models.impact import projected_gpu_hours
from fabricwatch.models.link_down import LINK_DOWN_HOLD_S
from fabricwatch.models.pfc_deadlock import DEADLOCK_HOLD_MS
from fabricwatch.models.vocabulary import (ECMP_IMBALANCE, HANG, LINK_DOWN, LINK_DOWNGRADE, PCIE_DOWNGRADE,
                                           PFC_DEADLOCK, PFC_STORM, STRAGGLER)
from fabricwatch.streams.replay import WINDOW_S as REPLAY_WINDOW_S

from .impact import ranking
from .matching import Match, match
from .runs import DETECTORS, FABRICWATCH, ScenarioRun
from .scenarios import T_DETECT_S

STEP_TOLERANCE_NS = 10_000_000     # node clocks: +-5 ms

TARGET_F1 = 0.95
TARGET_PRECISION = 0.95
TARGET_FP_PER_1000_NODE_HOURS = 1.0
TARGET_STRAGGLER_STEPS = 3
# Share of injected stragglers named with their true probable cause (issue #14: the cause is
# what on-call acts on; a missed straggler has no cause and counts as wrong).
TARGET_CAUSE_ACCURACY = 0.9
# The simulator's straggler causes -> the cause code fabricwatch should give (the software
# and hardware thermal slowdowns are both "thermal").
STRAGGLER_CAUSE_CODE = {"sw_thermal": "thermal"}
# Issue #15: a hung collective's culprit named within 60 s of the hang (the NCCL watchdog's
# default timeout is 10 min), with its probable root right as often as a straggler's cause.
TARGET_HANG_S = 60.0


@dataclass
class ClassScore:
    tp: int = 0
    fp: int = 0
    fn: int = 0
    duplicates: int = 0
    explained: int = 0
    delays_s: list[float] = field(default_factory=list)
    delay_steps: list[int] = field(default_factory=list)
    within_bound: list[bool] = field(default_factory=list)   # only where a delay target applies
    healthy_fp: int = 0
    fp_reasons: Counter = field(default_factory=Counter)

    @property
    def precision(self) -> float | None:
        return self.tp / (self.tp + self.fp) if self.tp + self.fp else None

    @property
    def recall(self) -> float | None:
        return self.tp / (self.tp + self.fn) if self.tp + self.fn else None

    @property
    def f1(self) -> float | None:
        p, r = self.precision, self.recall
        if p is None or r is None:
            return None
        return 2 * p * r / (p + r) if p + r else 0.0


@dataclass
class Scores:
    classes: dict[str, dict[str, ClassScore]]          # detector -> class -> score
    matches: dict[tuple[str, str], Match]              # (scenario, detector) -> match
    healthy_node_hours: float
    healthy_fp: dict[str, Counter]                     # detector -> kind -> FPs on healthy runs
    healthy_node_hours_by_interval: dict[float, float]
    # fabricwatch: true straggler cause -> Counter(cases, named, correct), and the wrong answers
    straggler_causes: dict[str, Counter] = field(default_factory=dict)
    cause_confusion: Counter = field(default_factory=Counter)   # (true cause, given cause code)
    # fabricwatch's impact against the simulated jobs' loss, per suite (and "all"): `impact.ranking`
    impact_ranking: dict[str, dict] = field(default_factory=dict)
    # fabricwatch: a hang's true root -> Counter(cases, named, correct), and the wrong answers
    hang_roots: dict[str, Counter] = field(default_factory=dict)
    hang_confusion: Counter = field(default_factory=Counter)

    def cause_accuracy(self) -> tuple[int, int]:
        """(correct, cases) over every injected straggler."""
        return (sum(c["correct"] for c in self.straggler_causes.values()),
                sum(c["cases"] for c in self.straggler_causes.values()))


def _steps_between(run: ScenarioRun, job: str, onset_ns: int, detected_ns: int) -> int | None:
    steps = run.job_steps.get(job)
    if not steps:
        return None
    return sum(1 for s, e in steps if s >= onset_ns - STEP_TOLERANCE_NS and e <= detected_ns + STEP_TOLERANCE_NS)


def _bound_s(cls: str, interval_s: float) -> float | None:
    """The delay target of a class, in seconds, where it is one (else None)."""
    if cls == PFC_STORM:
        return T_DETECT_S + interval_s if interval_s < T_DETECT_S else None   # judged on 0.1 s sampling only
    if cls in (LINK_DOWNGRADE, PCIE_DOWNGRADE):
        return interval_s
    if cls == LINK_DOWN:
        return LINK_DOWN_HOLD_S + 2 * interval_s      # the hold, then a sample or two
    if cls == ECMP_IMBALANCE:
        return (OPEN_WINDOWS + 1) * WINDOW_S + interval_s   # the persistence, a window of alignment, a sample
    if cls == PFC_DEADLOCK:                         # the watchdogs' detection, the hold, the watermark's step
        return T_DETECT_S + DEADLOCK_HOLD_MS / 1e3 + REPLAY_WINDOW_S + interval_s
    if cls == HANG:
        return TARGET_HANG_S
    return None


def score(runs: list[ScenarioRun], detectors: tuple[str, ...] = DETECTORS) -> Scores:
    classes: dict[str, dict[str, ClassScore]] = {d: defaultdict(ClassScore) for d in detectors}
    matches: dict[tuple[str, str], Match] = {}
    healthy_fp: dict[str, Counter] = {d: Counter() for d in detectors}
    nh = 0.0
    nh_by_iv: Counter = Counter()
    for run in runs:
        sc = run.scenario
        if sc.suite == "healthy":
            nh += sc.node_hours
            nh_by_iv[sc.interval_s] += sc.node_hours
        for d in detectors:
            m = match(run.detections.get(d, []), run.truths, sc.interval_s, run.end_ns, run.job_nodes)
            matches[(sc.name, d)] = m
            cs = classes[d]
            if sc.suite == "healthy":
                for fp in m.fps:
                    healthy_fp[d][fp.cls] += 1
                    cs[fp.cls].healthy_fp += 1
                continue
            for tp in m.tps:
                c = cs[tp.cls]
                c.tp += 1
                c.delays_s.append(tp.delay_ns / 1e9)
                if tp.cls == STRAGGLER:
                    job = EntityRef.parse(tp.entity).job
                    n = _steps_between(run, job, tp.onset_ns, tp.detected_ns)
                    if n is not None:
                        c.delay_steps.append(n)
                        c.within_bound.append(n <= TARGET_STRAGGLER_STEPS)
                else:
                    bound = _bound_s(tp.cls, sc.tick_s if tp.cls == PFC_STORM else sc.interval_s)
                    if (tp.detail or {}).get("switch_source"):
                        bound = None       # a switch-port root waits the locator's grace (ORPHAN_GRACE_MS)
                    if bound is not None:
                        c.within_bound.append(tp.delay_ns / 1e9 <= bound + 0.01)
            for fn in m.fns:
                cs[fn.cls].fn += 1
            for fp in m.fps:
                cs[fp.cls].fp += 1
                cs[fp.cls].fp_reasons[fp.fp_reason.split(";")[0]] += 1
            for dup in m.duplicates:
                cs[dup.kind].duplicates += 1
            for ex, _ in m.explained:
                cs[ex.kind].explained += 1
    causes, confusion = _straggler_causes(runs, matches)
    roots, root_confusion = _named_causes(runs, matches, HANG, "root", {})
    return Scores({d: dict(v) for d, v in classes.items()}, matches, nh, healthy_fp, dict(nh_by_iv), causes, confusion,
                  _impact_ranking(runs, matches) if FABRICWATCH in detectors else {}, roots, root_confusion)


def _impact_ranking(runs: list[ScenarioRun], matches: dict) -> dict[str, dict]:
    """Per labelled suite (and "all"): our impact vs the truth's over fabricwatch's true positives."""
    pairs: dict[str, list[tuple[float, float]]] = defaultdict(list)
    for run in runs:
        m = matches.get((run.scenario.name, FABRICWATCH))
        if m is None or run.scenario.suite == "healthy":
            continue
        for tp in m.tps:
            truth = run.truths[tp.gt_index].gpu_hours_lost
            last = run.impact.get(tp.dedup_key)
            if truth is None or last is None:
                continue
            ours = projected_gpu_hours(*last, run.end_ns)      # still open at the end: its cost by then
            pairs[run.scenario.suite].append((ours, truth))
            pairs["all"].append((ours, truth))
    return {suite: {**ranking(p), "ours_gpu_hours": sum(o for o, _ in p), "truth_gpu_hours": sum(t for _, t in p)}
            for suite, p in pairs.items()}


def _straggler_causes(runs: list[ScenarioRun], matches: dict) -> tuple[dict[str, Counter], Counter]:
    """Per true cause of the injected stragglers: how many, how many named, how many with that cause."""
    return _named_causes(runs, matches, STRAGGLER, "cause", STRAGGLER_CAUSE_CODE)


def _named_causes(runs: list[ScenarioRun], matches: dict, cls: str, key: str,
                  code_of: dict[str, str]) -> tuple[dict[str, Counter], Counter]:
    """Per true cause (``detail[key]``) of the expected faults of ``cls``: how many, how many
    fabricwatch named, how many with that cause code (``code_of`` maps the truth's names)."""
    causes: dict[str, Counter] = defaultdict(Counter)
    confusion: Counter = Counter()
    for run in runs:
        m = matches.get((run.scenario.name, FABRICWATCH))
        if m is None or run.scenario.suite == "healthy":
            continue
        given = {tp.gt_index: tp.cause for tp in m.tps if tp.cls == cls}
        for i, gt in enumerate(run.truths):
            if gt.kind != cls or not gt.expect_alert:
                continue
            true = str(gt.detail.get(key, ""))
            c = causes[true]
            c["cases"] += 1
            if i in given:
                c["named"] += 1
                ok = given[i] == code_of.get(true, true)
                c["correct"] += ok
                if not ok:
                    confusion[(true, given[i] or "-")] += 1
            else:
                confusion[(true, "not named")] += 1
    return dict(causes), confusion


def poisson_upper(k: int) -> float:
    """One-sided 95% upper confidence bound of a Poisson mean after observing k events.

    Exact (bisection on the CDF) for small k, Wilson-Hilferty's chi-square approximation above.

    >>> round(poisson_upper(0), 2), round(poisson_upper(3), 2), round(poisson_upper(5000))
    (3.0, 7.75, 5118)
    """
    if k > 50:
        n = k + 1
        return n * (1 - 1 / (9 * n) + 1.6449 / (3 * math.sqrt(n))) ** 3

    def cdf(mu: float) -> float:
        term = total = math.exp(-mu)
        for i in range(1, k + 1):
            term *= mu / i
            total += term
        return total

    lo, hi = float(k), float(k) + 20.0 * math.sqrt(k + 1) + 10.0
    for _ in range(100):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if cdf(mid) > 0.05 else (lo, mid)
    return (lo + hi) / 2


def per_1000(n: int, node_hours: float) -> float | None:
    """``n`` events per 1000 node-hours (None without node-hours)."""
    return 1000.0 * n / node_hours if node_hours > 0 else None
