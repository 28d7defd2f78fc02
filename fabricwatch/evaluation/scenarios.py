"""The scenarios of `fabricwatch eval` as data: `Scenario`, `SuiteConfig`, the fault classes.

A `Scenario` is everything needed to regenerate one labelled telemetry run: the fabric
size, the sampling interval, the duration, the seed and the injected faults (times in
seconds after the simulator start, as `fabricwatch.simulator` defines them). The
simulator reports each fault as a `GroundTruth` record (source entity, victims, onset,
offset, ``expect_alert``), which `matching` scores detector output against.

The suites themselves are assembled in `suites`, from the builders in `fault_scenarios`
(labelled faults) and `negative_scenarios` (must not fire, healthy). This module is what
they share and what scoring needs: the `Scenario` and `SuiteConfig` records, the fault
classes and the small helpers every builder uses.
"""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from functools import lru_cache

from fabricwatch.simulator.fabric_faults import STORM_DETECTION_TIME_S, LinkDowngrade, PfcStorm
from fabricwatch.simulator.host_faults import GpuXid, Straggler
from fabricwatch.simulator.timeline import INF
from fabricwatch.simulator.host_faults import ApplicationXid, XidCascade
from fabricwatch.simulator.fabric_faults import EcmpPolarization, PfcDeadlock
from fabricwatch.simulator.cluster import ClusterSimulator
from fabricwatch.simulator.encoding import Cadence
from fabricwatch.simulator.timeline import DEFAULT_START_UNIX_NS
from fabricwatch.simulator.workload import Job, auto_jobs
from fabricwatch.models.topology import Topology, rail_optimised
from fabricwatch.models.vocabulary import (ECMP_IMBALANCE, ECN_PFC_MISORDER, GPU_ECC_UNCORRECTABLE, GPU_XID, HANG, LINK_DOWN,
                                           LINK_DOWNGRADE, LINK_FLAP, LOSSLESS_DROP, PCIE_DOWNGRADE, PFC_DEADLOCK,
                                           PFC_STORM, STRAGGLER)

__all__ = ["Scenario", "SuiteConfig", "expected_case_counts", "fault_class", "T_DETECT_S", "FAULT_CLASSES"]

T_DETECT_S = STORM_DETECTION_TIME_S   # SONiC pfcwd DEFAULT_DETECTION_TIME (200 ms)
GPUS = 8

# Ground-truth kind -> the fault class it is scored under.
_CLASS_OF_GT_KIND = {
    "link_downgrade": LINK_DOWNGRADE,
    "nic_pcie_downgrade": PCIE_DOWNGRADE,
    "gpu_pcie_downgrade": PCIE_DOWNGRADE,
    "link_flap": LINK_FLAP,
    "pfc_storm": PFC_STORM,
    "straggler": STRAGGLER,
    "gpu_xid": GPU_XID,
    "ecc_uncorrectable": GPU_ECC_UNCORRECTABLE,
    "link_down": LINK_DOWN,
    "ecmp_imbalance": ECMP_IMBALANCE,
    "pfc_deadlock": PFC_DEADLOCK,
    "ecn_pfc_misorder": ECN_PFC_MISORDER,
    "lossless_drop": LOSSLESS_DROP,
    "hang": HANG,
}
FAULT_CLASSES = (LINK_DOWNGRADE, PCIE_DOWNGRADE, LINK_FLAP, PFC_STORM, STRAGGLER, GPU_XID,
                 GPU_ECC_UNCORRECTABLE, LINK_DOWN, ECMP_IMBALANCE, PFC_DEADLOCK)
FAULT_CLASSES += (ECN_PFC_MISORDER, LOSSLESS_DROP)       # congestion tuning (issue 15)
FAULT_CLASSES += (HANG,)

DOWNGRADE_RATES = ("200 Gb/sec (4X HDR)", "100 Gb/sec (4X EDR)", "400 Gb/sec (8X HDR)", "200 Gb/sec (2X NDR)")
# Hardware and firmware XIDs of NVIDIA's catalog (`fabricwatch.xid`): the gpu_xid cases.
XID_CODES = (48, 63, 64, 74, 79, 92, 94, 95, 119, 120)
# Application XIDs of user bugs (must not fire): 13 illegal instruction / exception, 31 MMU
# page fault (illegal address), 43 the driver stopped a killed context.
APP_XID_CODES = (13, 31, 43)
# Half the fault-mix XIDs cascade: XID 45 on 1-7 sibling GPUs 0.1-3 s after the root.
CASCADE_FRACTION = 0.5
# Not "storm_victim": the simulator's storm next door has a stuck host, which hangs the source's
# job and pauses the victim's almost completely, so no step of the slow rank ever completes.
STRAGGLER_CAUSES = ("thermal", "power", "none", "nic_downgrade", "sw_thermal", "nic_pcie", "partial_pause",
                    "gpu_pcie", "nic_down")


def fault_class(gt_kind: str) -> str | None:
    """The scored fault class of a ground-truth kind; None for kinds that only must-not-fire."""
    return _CLASS_OF_GT_KIND.get(gt_kind)


@dataclass(frozen=True)
class Scenario:
    """One labelled run: a rail-optimised fabric, a sampling interval, faults, a seed."""
    name: str
    suite: str
    seed: int
    n_nodes: int
    interval_s: float
    duration_s: float
    faults: tuple = ()
    nodes_per_unit: int = 0       # 0: all nodes in one unit (up to 32)
    n_spines: int = 2
    note: str = ""
    switch_tx_pause_duration: bool = False   # switches export pfc<p>-tx-pause-duration-us (SONiC)
    # 0: every tick is a full snapshot, every `interval_s`. > 0: the collectors' cadence,
    # PFC-only ticks every `pfc_interval_s` between full snapshots every `interval_s`.
    pfc_interval_s: float = 0.0
    ecmp_spread: bool = True    # leaves spread their spine traffic over every spine (`ClusterSimulator`)

    def topology(self) -> Topology:
        return _topology(self.n_nodes, self.nodes_per_unit or min(32, self.n_nodes), self.n_spines)

    def simulator(self) -> ClusterSimulator:
        cadence = Cadence(self.pfc_interval_s, self.interval_s) if self.pfc_interval_s else None
        return ClusterSimulator(self.topology(), seed=self.seed, interval_s=self.tick_s, cadence=cadence,
                                faults=list(self.faults), switch_tx_pause_duration=self.switch_tx_pause_duration,
                                ecmp_spread=self.ecmp_spread)

    @property
    def tick_s(self) -> float:
        """Time between two ticks of the simulator (the fastest collector interval)."""
        return self.pfc_interval_s or self.interval_s

    @property
    def simulator_start_ns(self) -> int:
        return DEFAULT_START_UNIX_NS

    @property
    def ticks(self) -> int:
        return int(round(self.duration_s / self.tick_s))

    @property
    def node_hours(self) -> float:
        return self.n_nodes * self.duration_s / 3600.0

    def describe_faults(self) -> str:
        return "; ".join(_describe(f) for f in self.faults) or "none"


@dataclass(frozen=True)
class SuiteConfig:
    """Sizes of the suites. The defaults finish `fabricwatch eval` in ~10 min on 2 cores."""
    quick: bool = False
    seed: int = 0
    mix_scenarios: int = 12          # x 2 rounds: 24 cases of each fault-mix class
    link_down_scenarios: int = 14    # one dead NIC link each, a dead uplink every other: 21 cases
    straggler_scenarios: int = 14    # 1-2 stragglers each (one per multi-node job): >= 3 per cause
    cadence_mix_scenarios: int = 3   # the same kinds of scenario again at the collectors' cadence
    cadence_straggler_scenarios: int = 2
    cadence_link_down_scenarios: int = 2
    hang_scenarios: int = 16         # one hang each (4 per root), a job stall that is no hang on another job
    cadence_hang_scenarios: int = 2
    storm_pair_scenarios: int = 6    # x 2 sequential single-port storms
    healthy_node_hours: float = 8.0  # long healthy runs (1 s sampling) for false alarms
    healthy_nodes: int = 32
    healthy_run_s: float = 300.0     # each healthy run; runs = ceil(node-hours / (nodes x run))
    healthy_fast_s: float = 60.0     # one healthy run at 0.1 s sampling (storm false alarms)
    ecmp_scenarios: int = 12         # x 2 polarized leaves: 24 cases
    deadlock_scenarios: int = 10     # x 2 pause loops: 20 cases
    congestion_scenarios: int = 20   # one misordered leaf and one lossless-drop port each: 20 cases of each


@lru_cache(maxsize=64)
def _topology(n_nodes: int, nodes_per_unit: int, n_spines: int) -> Topology:
    return rail_optimised("eval", n_nodes=n_nodes, nodes_per_unit=nodes_per_unit, n_spines=n_spines)


def _jobs(topo: Topology, seed: int) -> tuple[list[Job], list[str], list[str]]:
    """Jobs as the simulator will place them, nodes of multi-node jobs, nodes with no job."""
    jobs = auto_jobs(topo, seed)
    busy = [n for j in jobs if len(j.nodes) >= 2 for n in j.nodes]
    in_job = {n for j in jobs for n in j.nodes}
    idle = [n for n in topo.nodes if n not in in_job]
    return jobs, busy, idle


def _frac(rng, lo: float, hi: float, interval_s: float) -> float:
    """An onset in [lo, hi) that is not on a sampling instant (so delay < one interval is possible)."""
    t = float(rng.uniform(lo, hi))
    k = round(t / interval_s)
    if abs(t - k * interval_s) < 0.05 * interval_s:
        t += 0.37 * interval_s
    return round(t, 3)


def _nic(k: int) -> str:
    return f"mlx5_{k}/1"



def expected_case_counts(scenarios: list[Scenario]) -> Counter:
    """Positive (expect_alert) ground-truth cases per fault class, as the simulator labels them."""
    counts: Counter = Counter()
    for sc in scenarios:
        if not sc.faults:
            continue
        for gt in sc.simulator().ground_truth():
            cls = fault_class(gt.kind)
            if gt.expect_alert and cls:
                counts[cls] += 1
    return counts


def _describe(f) -> str:
    name = type(f).__name__
    if isinstance(f, PfcStorm):
        src = ",".join(f"{n}/{p}" for n, p in f.sources)
        extra = " xon-only" if f.xon_only else ""
        extra += f" nic-wd {f.nic_watchdog_ms:g} ms" if f.nic_watchdog_ms else ""
        return f"{name}[{src}] {f.onset_s:g}-{f.offset_s:g} s{extra}"
    if isinstance(f, PfcDeadlock):
        loop = " > ".join(f"{sw}/{p}" for sw, p in f.ports)
        return f"{name}[{loop}] {f.onset_s:g}-{f.offset_s:g} s"
    who = getattr(f, "node", None) or getattr(f, "switch", "")
    dev = getattr(f, "nic", None) or getattr(f, "port", None)
    if dev is None and hasattr(f, "gpu"):
        dev = f"gpu{f.gpu}"
    off = getattr(f, "offset_s", INF)
    when = f"{f.onset_s:g}" + (f"-{off:g}" if off != INF else "-") + " s"
    extra = ""
    if isinstance(f, LinkDowngrade):
        extra = f" {f.rate}"
    elif isinstance(f, XidCascade):
        extra = f" xid {f.code} + xid 45 on {len(f.victims)} GPU(s)"
    elif isinstance(f, GpuXid):
        extra = f" xid {f.code}"
    elif isinstance(f, ApplicationXid):
        dev = "gpu" + ",".join(map(str, f.gpus))
        extra = f" app xid {f.code} x{f.bursts}" + (f" + xid 45 on {len(f.cleanup)}" if f.cleanup else "") + (
            " crash" if f.crash else "")
    elif isinstance(f, Straggler):
        extra = f" x{f.factor:g} {f.cause}"
    elif isinstance(f, EcmpPolarization):
        extra = " hot " + ",".join(f.hot_uplinks) + (f" moving every {f.rotate_s:g} s" if f.rotate_s else "")
    return f"{name}[{who}/{dev}]{extra} {when}" if dev else f"{name}[{who}]{extra} {when}"

