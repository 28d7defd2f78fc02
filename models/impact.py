"""What an anomaly costs, in GPU-hours: lost so far, and the rate while it stays open.

A synchronous training job goes at the pace of its slowest rank, so an anomaly that slows
one GPU of a job slows every GPU of it. The cost rate of an open anomaly is

    gpu_hours_per_hour = sum over the jobs it touches of (job GPUs x lost fraction)

where the lost fraction is ``1 - 1/slowdown`` for a job whose steps take ``slowdown`` times
as long (the straggler's own evidence), the pause duty of a storm's victims (a paused port
sends nothing), or 1 while the job is **stalled** (a GPU off the bus, a rail down without
failover: the collective hangs until the NCCL watchdog kills the job). A stalled job is
then restarted from its last checkpoint: the work since then is done again, once,
``job GPUs x time since the checkpoint`` (`DEFAULT_SINCE_CHECKPOINT_S` when unknown).
Lost so far is the rate times the anomaly's age in **event time** (onset to the sample
that confirmed or cleared it), never the wall clock: a replay, and any number of workers,
give the same numbers.

``basis`` says how much of that is known: ``measured`` when the jobs (and their GPU
counts) come from the jobs themselves (rank steps, placements), ``estimated`` when nobody
reported a job on the entity and the node's GPUs stand in for it, with the per-kind prior
of `SLOWDOWN_PRIOR` where no evidence measured the slowdown.

>>> m = ImpactModel()
>>> hour = 3600 * 10**9
>>> i = m.assess("straggler", "warning", 0, hour, jobs=(JobShare("job-7", 16),), evidence={"slowdown": 2.0})
>>> i.gpu_hours_per_hour, i.gpu_hours_lost, i.basis
(8.0, 8.0, 'measured')
>>> i = m.assess("link_downgrade", "warning", 0, hour // 2, jobs=None, node_gpus=8)
>>> i.gpu_hours_per_hour, i.gpu_hours_lost, i.basis      # half of one node's GPUs, for half an hour
(4.0, 2.0, 'estimated')
>>> i = m.assess("link_down", "critical", 0, hour // 4, jobs=(JobShare("job-9", 32),))
>>> i.gpu_hours_per_hour, i.gpu_hours_lost, i.restarted  # stalled: 32 x 0.25 h, + 32 x 0.25 h redone
(32.0, 16.0, True)
>>> m.assess("link_down", "critical", 0, hour // 4, jobs=(JobShare("job-9", 32),), open=False).gpu_hours_per_hour
0.0
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from .vocabulary import (CRITICAL, ECMP_IMBALANCE, GPU_ECC_UNCORRECTABLE, GPU_XID, HANG, LINK_DOWN, LINK_DOWNGRADE,
                         LINK_FLAP, PCIE_DOWNGRADE, PFC_DEADLOCK, PFC_STORM, STRAGGLER, UNKNOWN_ANOMALY)

MEASURED, ESTIMATED = "measured", "estimated"
BASES = (MEASURED, ESTIMATED)

# Fraction of a job's throughput lost while an anomaly of this kind is open, where no
# evidence measured it (docs/schema.md, "Impact"):
SLOWDOWN_PRIOR = {
    # a NIC at half its rate: the ring's slowest rail sets the pace of every all-reduce
    LINK_DOWNGRADE: 0.5,
    # a PCIe link at reduced width/gen throttles its GPU's host and NIC traffic alike
    PCIE_DOWNGRADE: 0.5,
    # each flap drops the rail for seconds (retransmits, QP timeouts); between flaps it runs
    LINK_FLAP: 0.25,
    # a rail down with failover: its traffic doubles up on another rail
    LINK_DOWN: 0.5,
    # victims paused about half the time in the storms we replay
    PFC_STORM: 0.5,
    # a straggler without a measured slowdown: the detector's own minimum (1.5x -> 1/3 lost)
    STRAGGLER: 1.0 / 3.0,
    # an XID the job survived (warning): retries, a slower step or two
    GPU_XID: 0.1,
    GPU_ECC_UNCORRECTABLE: 0.1,
    # something unlike the baseline, unexplained: a small cost until measured
    UNKNOWN_ANOMALY: 0.1,
    # a polarized leaf: the flows on its hot uplinks share one link (typically 2x their fair share)
    ECMP_IMBALANCE: 0.25,
    # a deadlocked loop moves nothing on the lossless priority: the jobs across it stall while it
    # lasts (no redo counted: broken within seconds, by a watchdog or an operator, they go on)
    PFC_DEADLOCK: 1.0,
}
# Kinds that, at critical severity, stall the whole job (the collective cannot complete).
STALLING_KINDS = frozenset({LINK_DOWN, GPU_XID, GPU_ECC_UNCORRECTABLE, HANG})
# Without a reported checkpoint time: jobs checkpoint every 30 min in the fleets we know,
# a failure lands on average halfway between two checkpoints.
DEFAULT_SINCE_CHECKPOINT_S = 15 * 60.0
# A slowdown ratio above this is a stall in all but name (and a guard against 1/0).
MAX_SLOWDOWN_RATIO = 1000.0
_NS_PER_HOUR = 3600 * 10**9


@dataclass(frozen=True)
class JobShare:
    """One job an anomaly touches, with all its GPUs (a synchronous job goes at its slowest rank's pace)."""

    job_id: str
    gpus: int
    since_checkpoint_s: float | None = None    # time since its last checkpoint, if it reported one


@dataclass(frozen=True)
class Impact:
    gpu_hours_lost: float        # through the anomaly's latest event time, redone work included
    gpu_hours_per_hour: float    # the rate while it stays open (0 once resolved)
    basis: str                   # MEASURED | ESTIMATED
    gpus: int                    # GPUs of the jobs touched (or that stand in for them)
    restarted: bool = False      # the jobs are expected to restart from a checkpoint


def projected_gpu_hours(lost: float, per_hour: float, as_of_ns: int, now_ns: int) -> float:
    """An open anomaly's cost by ``now_ns``: what its latest event said, plus the rate since then
    (for display and ordering of what is still open; events themselves stay on event time).

    >>> projected_gpu_hours(2.0, 8.0, 0, 1800 * 10**9)
    6.0
    """
    return lost + per_hour * max(0, now_ns - as_of_ns) / _NS_PER_HOUR


class ImpactModel:
    """Turns an anomaly and what is known about its jobs into an `Impact` (pure, no state)."""

    def __init__(self, since_checkpoint_s: float = DEFAULT_SINCE_CHECKPOINT_S) -> None:
        if not since_checkpoint_s >= 0:
            raise ValueError(f"since_checkpoint_s must be >= 0, got {since_checkpoint_s!r}")
        self.since_checkpoint_s = since_checkpoint_s

    def lost_fraction(self, kind: str, severity: str, evidence: Mapping[str, float]) -> tuple[float, bool]:
        """(fraction of the jobs' throughput lost, stalled)."""
        if severity == CRITICAL and kind in STALLING_KINDS:
            return 1.0, True
        ratio = evidence.get("slowdown")
        if ratio is not None and ratio == ratio and ratio > 1.0:
            return 1.0 - 1.0 / min(ratio, MAX_SLOWDOWN_RATIO), False
        for name in ("leaf_port_rx_pause_duty", "rx_pause_duty", "tx_pause_duty"):
            duty = evidence.get(name)
            if duty is not None and duty == duty and duty > 0:
                return min(duty, 1.0), False
        return SLOWDOWN_PRIOR.get(kind, SLOWDOWN_PRIOR[UNKNOWN_ANOMALY]), False

    def assess(self, kind: str, severity: str, onset_ns: int, at_ns: int, jobs: Sequence[JobShare] | None,
               node_gpus: int = 0, evidence: Mapping[str, float] | None = None, open: bool = True) -> Impact:
        """The impact of one anomaly as of ``at_ns`` (event time). ``jobs``: the jobs it touches,
        None or empty when unknown (then ``node_gpus`` stand in, and the basis is estimated)."""
        fraction, stalled = self.lost_fraction(kind, severity, evidence or {})
        basis = MEASURED if jobs else ESTIMATED
        shares = list(jobs) if jobs else [JobShare("", max(0, int(node_gpus)))]
        gpus = sum(max(0, s.gpus) for s in shares)
        hours = max(0, at_ns - onset_ns) / _NS_PER_HOUR
        rate = gpus * fraction
        redo = 0.0
        if stalled:
            redo = sum(max(0, s.gpus) * (s.since_checkpoint_s if s.since_checkpoint_s is not None
                                         else self.since_checkpoint_s) / 3600.0 for s in shares)
        return Impact(round(rate * hours + redo, 6), round(rate, 6) if open else 0.0, basis, gpus, stalled)
