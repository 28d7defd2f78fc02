"""Run one scenario, or all, through fabricwatch and both baselines over the same telemetry.

Each scenario is simulated tick by tick; every chunk of ticks goes through
`streams.replay.replay` with one fresh `DetectionPipeline(topology=sim.topology)` per
scenario (validated, sorted by event time, exactly as `fabricwatch replay` does), then the
same (validated) snapshots, decoded with `streams.decode.to_view` and
`models.rates.RateTracker`, go through the static rules and river's HalfSpaceTrees. A
`ScenarioRun` keeps the three detectors' alarms, the ground truth and what scoring needs.
Separate from scoring and the report: this is the only part that simulates and detects
(the slow part, run in worker processes), the rest reads its results.
"""
from __future__ import annotations

import time
from collections import Counter, defaultdict
from dataclasses import dataclass, field, replace

import numpy as np

from fabricwatch.simulator.labels import GroundTruth
from fabricwatch.models.rates import RateTracker
from fabricwatch.streams.decode import to_view
from fabricwatch.streams.events import to_event
from fabricwatch.streams.pipeline import DetectionPipeline
from fabricwatch.streams.replay import replay

from .baselines import HstBaseline, StaticRules, StaticRulesConfig
from .impact import truth_gpu_hours
from .matching import Detection, detection_from_event
from .scenarios import Scenario

FABRICWATCH, STATIC, HST = "fabricwatch", "static rules", "river HST"
DETECTORS = (FABRICWATCH, STATIC, HST)
CHUNK_S = 20.0                     # simulated seconds per replay call (bounds memory)


@dataclass
class ScenarioRun:
    scenario: Scenario
    truths: list[GroundTruth]
    detections: dict[str, list[Detection]]
    lifecycle: dict[str, Counter]
    job_steps: dict[str, list[tuple[int, int]]]
    end_ns: int
    snapshots: int
    seconds: dict[str, float]
    stats: Counter = field(default_factory=Counter)
    hst_scores: np.ndarray | None = None      # histogram of every HST score (SCORE_BINS bins over [0, 1])
    # fabricwatch: dedup key -> its last event's (GPU-hours lost, GPU-hours per hour, detected ns)
    impact: dict[str, tuple[float, float, int]] = field(default_factory=dict)
    job_nodes: dict[str, tuple[str, ...]] = field(default_factory=dict)   # the simulated jobs' placements


def run_scenario(sc: Scenario, detectors: tuple[str, ...] = DETECTORS) -> ScenarioRun:
    """Simulate one scenario and run every detector over the same telemetry."""
    t_start = time.perf_counter()
    sim = sc.simulator()
    topo = sim.topology
    pipeline = DetectionPipeline(topology=topo)
    static = StaticRules(topo, StaticRulesConfig()) if STATIC in detectors else None
    hst = HstBaseline(topo, seed=sc.seed) if HST in detectors else None
    rates = RateTracker()
    seconds: Counter = Counter()
    dets: dict[str, list[Detection]] = {d: [] for d in detectors}
    life: dict[str, Counter] = {d: Counter() for d in detectors}
    steps: dict[str, list[tuple[int, int]]] = defaultdict(list)
    stats: Counter = Counter()
    n_snap = 0
    per_chunk = max(1, int(round(CHUNK_S / sc.tick_s)))
    left = sc.ticks

    impact: dict[str, tuple[float, float, int]] = {}
    progress: dict[str, list[tuple[int, int]]] = defaultdict(list)

    def keep(name: str, events) -> None:
        for e in events:
            life[name][e.lifecycle] += 1
            if name == FABRICWATCH:
                impact[e.dedup_key] = (e.impact_gpu_hours, e.impact_gpu_hours_per_hour, e.detected_unix_ns)
            d = detection_from_event(e)
            if d is not None:
                dets[name].append(d)

    while left > 0:
        k = min(per_chunk, left)
        left -= k
        t0 = time.perf_counter()
        snaps = [s for _ in range(k) for s in sim.tick()]
        seconds["simulator"] += time.perf_counter() - t0
        n_snap += len(snaps)
        if FABRICWATCH in detectors:
            t0 = time.perf_counter()
            result = replay(snaps, pipeline, finish=left == 0)
            seconds[FABRICWATCH] += time.perf_counter() - t0
            keep(FABRICWATCH, result.events)
            stats.update({k_: v for k_, v in result.stats.items() if k_.startswith("problem:")})
            stats["rejected_snapshots"] += result.stats.get("rejected_snapshots", 0)
        # The baselines see the snapshots as replay left them (validated in place), in its order.
        ordered = sorted(snaps, key=lambda s: (s.time_unix_ns, s.source, s.seq))
        t_dec = t_static = t_hst = 0.0
        last: dict[str, int] = {}
        for snap in ordered:
            for rs in snap.rank_steps:
                if rs.rank == 0:
                    steps[rs.job_id].append((rs.start_unix_ns, rs.start_unix_ns + int(rs.step_seconds * 1e9)))
                    progress[rs.job_id].append((rs.start_unix_ns, rs.step))
            if static is None and hst is None:
                continue
            prev = last.get(snap.source)
            if prev is not None and snap.time_unix_ns <= prev:
                continue                               # late / duplicate: skipped like the pipeline does
            last[snap.source] = snap.time_unix_ns
            t0 = time.perf_counter()
            view = to_view(snap)
            for frame in view.frames:
                rates.update(view.source, frame, view.time_ns)
            t1 = time.perf_counter()
            t_dec += t1 - t0
            if static is not None:
                keep(STATIC, [to_event(f, f.detected_ns) for f in static.update(view)])
                t2 = time.perf_counter()
                t_static += t2 - t1
                t1 = t2
            if hst is not None:
                keep(HST, [to_event(f, f.detected_ns) for f in hst.update(view)])
                t_hst += time.perf_counter() - t1
        # decoding is shared by both baselines: charge half to each
        if static is not None:
            seconds[STATIC] += t_static + (t_dec / 2 if hst is not None else t_dec)
        if hst is not None:
            seconds[HST] += t_hst + (t_dec / 2 if static is not None else t_dec)
        del snaps, ordered
    seconds["total"] = time.perf_counter() - t_start
    stats.update({f"pipeline:{k_}": v for k_, v in pipeline.counters().items()})
    truths = sim.ground_truth()
    lost = truth_gpu_hours(truths, {j.job_id: tuple(j.nodes) for j in sim.jobs}, topo.gpus_per_node,
                           {j: sorted(p) for j, p in progress.items()}, sc.simulator_start_ns, sim.now_unix_ns)
    truths = [replace(gt, gpu_hours_lost=x) for gt, x in zip(truths, lost)]
    return ScenarioRun(sc, truths, dets, life, dict(steps), sim.now_unix_ns, n_snap, dict(seconds), stats,
                       hst.score_hist if hst is not None else None, impact,
                       {j.job_id: tuple(j.nodes) for j in sim.jobs})


def _run_one(args) -> ScenarioRun:
    sc, detectors = args
    return run_scenario(sc, detectors)


def run_all(scenarios: list[Scenario], detectors: tuple[str, ...] = DETECTORS, jobs: int = 1,
            progress=None) -> list[ScenarioRun]:
    """Every scenario, in order; ``jobs`` > 1 runs scenarios in that many processes."""
    out: list[ScenarioRun] = []
    work = [(sc, detectors) for sc in scenarios]
    if jobs <= 1:
        for i, w in enumerate(work):
            out.append(_run_one(w))
            if progress:
                progress(i + 1, len(work), out[-1])
        return out
    import multiprocessing as mp

    ctx = mp.get_context("fork") if "fork" in mp.get_all_start_methods() else mp.get_context()
    # longest first, so the pool does not end on one straggling scenario
    order = sorted(range(len(work)), key=lambda i: -scenarios[i].ticks * (scenarios[i].n_nodes + 10))
    results: dict[int, ScenarioRun] = {}
    with ctx.Pool(jobs) as pool:
        for n, (i, run) in enumerate(pool.imap_unordered(_indexed, [(i, work[i]) for i in order]), 1):
            results[i] = run
            if progress:
                progress(n, len(work), run)
    return [results[i] for i in range(len(work))]


def _indexed(item):
    i, w = item
    return i, _run_one(w)
