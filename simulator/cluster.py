"""A simulated GPU training cluster that emits telemetry exactly as the real collectors do.

Every tick produces one `Snapshot` per node (a GPU block, a NIC_PORT block, XID events,
the `RankStep`s of the training steps that ended in the tick) and one per switch (a
SWITCH_PORT block); with a `Cadence` (``COLLECTOR_CADENCE``: what the real collectors do)
the physics runs at the PFC interval and each 100 ms tick of a node carries only its PFC
columns (the node collector's ``ethtool_pfc`` group, in its layout), while the full node
snapshot (sysfs, ethtool, NVML) and the switches' (gNMI) come every second, the node's
half a PFC interval after its PFC tick as the collector phases them. Counters are RAW: monotonic totals in the source's unit
(``port_xmit_data`` in 4-byte words, pause durations in microseconds, energy in mJ),
32-bit hw counters wrapping, IB PortCounters saturating (16/8-bit error counters and the
32-bit ``port_xmit_wait``, which ~10 % of the NICs start pinned at 2**32 - 1: a long-uptime
quirk, `XMIT_WAIT_PINNED_FRACTION`), labels as sysfs prints them. What a NIC transmits its leaf port receives; pause frames a NIC sends its
leaf port receives; bytes crossing a spine are counted on both ends of each uplink.

Healthy behaviour is deliberately noisy: synchronous data-parallel jobs on ~85 % of the
nodes (per step a compute phase with little traffic, then an all-reduce burst near line
rate over two ring channels), incast congestion with short intermittent PFC pauses and
correlated ECN marks / CNPs, checkpoints (tens of seconds without fabric traffic, a long
step on every rank), eval phases, idle nodes whose GPUs sit at the idle clock and PCIe
gen1 (NVML's power saving, not a downgrade), GPUs that hit their power cap, the odd slow
step, a few marginal links with symbol errors. Faults (`fabric_faults`, `host_faults`)
are layered on top and listed by `ClusterSimulator.ground_truth`.

>>> from fabricwatch.models.topology import rail_optimised
>>> from fabricwatch.simulator.fabric_faults import LinkDowngrade
>>> topo = rail_optimised("sim", n_nodes=4, nodes_per_unit=4, n_spines=2)
>>> sim = ClusterSimulator(topo, seed=1, interval_s=1.0,
...                        faults=[LinkDowngrade("node-0002", "mlx5_3/1", onset_s=2.0)])
>>> snaps = sim.tick()
>>> [s.source for s in snaps][3:6], len(snaps)     # 4 nodes, then the 2 spines and 8 leaves
(['node-0004', 'spine-0', 'spine-1'], 14)
>>> gpu_block, nic_block = snaps[0].blocks
>>> list(nic_block.entity_ids[:2]), nic_block.labels[3].name, nic_block.labels[3].values[0]
(['mlx5_0/1', 'mlx5_1/1'], 'rate', '400 Gb/sec (4X NDR)')
>>> for _ in range(3):
...     snaps = sim.tick()
>>> labels = {c.name: c.values[3] for c in snaps[1].blocks[1].labels}     # port mlx5_3/1
>>> labels["rate"], labels["state"], snaps[1].seq
('200 Gb/sec (4X HDR)', '4: ACTIVE', 4)
>>> [(g.kind, g.entity) for g in sim.ground_truth()]
[('link_downgrade', 'node-0002/mlx5_3/1')]
"""
from __future__ import annotations

import re
from typing import Union

import numpy as np

from fabricwatch.counters import NIC_GAUGES, Overflow, spec_for
from fabricwatch.models.linkrate import parse_ib_rate
from fabricwatch.models.topology import Topology, rail_optimised
from fabricwatch.protos.v1 import telemetry_pb2 as pb
from fabricwatch.simulator.columns import _NC
from fabricwatch.simulator.encoding import Cadence, SnapshotEncoder
from fabricwatch.simulator.fabric import FabricModel
from fabricwatch.simulator.fabric_faults import (
    AdminToggle, EcmpPolarization, EcnAfterPause, Incast, LinkDown, LinkDowngrade, LinkFlap, NicAdminDown,
    NicLosslessDrops, NicPcieDowngrade, PfcDeadlock, PfcStorm, PinnedCounter, QueueDrops, SwitchLinkDown,
    SwitchPfcStorm,
)
from fabricwatch.simulator.fault_effects import _FaultState, _first_effect_s, _overlap
from fabricwatch.simulator.gpus import GPU_TDP_W, GpuModel, _pcie_gbps
from fabricwatch.simulator.host_faults import (
    PARTIAL_PAUSE_DUTY_RANGE, REASON_HW_THERMAL, REASON_SW_POWER_CAP, REASON_SW_THERMAL, XID_GPU_LOST,
    XID_UNCORRECTABLE_ECC, ApplicationXid, CheckpointStall, ClockSkew, EccUncorrectable, GpuPcieDowngrade, GpuXid,
    JobPause, LongStep, NodeReboot, RankLost, RankStuck, Straggler, XidCascade,
)
from fabricwatch.simulator.labelling import Labelling
from fabricwatch.simulator.labels import GroundTruth
from fabricwatch.simulator.timeline import DEFAULT_START_UNIX_NS
from fabricwatch.simulator.workload import Job, Workload, auto_jobs

#: Every fault `ClusterSimulator` injects: the fabric's (`fabric_faults`), the hosts' (`host_faults`).
Fault = Union[LinkDowngrade, NicPcieDowngrade, LinkFlap, AdminToggle, PfcStorm, SwitchPfcStorm, PinnedCounter, LinkDown,
              SwitchLinkDown, NicAdminDown, EcmpPolarization, PfcDeadlock, EcnAfterPause, Incast, QueueDrops,
              NicLosslessDrops, GpuPcieDowngrade, Straggler, GpuXid, XidCascade, ApplicationXid, EccUncorrectable,
              NodeReboot, ClockSkew, RankStuck, RankLost, CheckpointStall, JobPause, LongStep]


XON_FRAMES_PER_S = 20_000.0    # rate of a XON-only flood
FAILOVER_COMM_SPEED = 0.5      # a NIC carrying two rails: that rail's share of a collective takes twice as long
FAILING_LINK_FEC_UNCORRECTABLE_PER_S = 3.0   # post-FEC symbol errors of a link about to die [U]


# --------------------------------------------------------------------------- helpers


def _natural_key(name: str) -> list:
    return [int(t) if t.isdigit() else t for t in re.split(r"(\d+)", name)]


# --------------------------------------------------------------------------- simulator


class ClusterSimulator(SnapshotEncoder, Labelling, Workload, GpuModel, FabricModel):
    """A seeded, deterministic simulated cluster; see the module docstring.

    Parameters
    ----------
    topology : the fabric (`rail_optimised` or a loaded `Topology`), two tiers: NICs to
        leaves (role "leaf"), leaves to spines (role "spine").
    seed : all randomness (job placement when ``jobs`` is None, noise) derives from it.
    start_unix_ns : event time of the start; tick k samples at ``start + k * interval``.
    jobs : the training jobs; None places ~85 % of the nodes in a few jobs (`auto_jobs`).
    faults : `Fault` dataclasses (`fabric_faults`, `host_faults`), times relative to the start.
    interval_s : sampling interval in seconds (0.05 .. 60; 0.1 for PFC-rate sampling).
    rank_steps : emit `RankStep` messages (off for pure fabric benchmarks).
    cadence : sample as the real collectors do (`Cadence`; ``interval_s`` is then its PFC
        interval): PFC-only node ticks between full ones. None: every block every tick.
    switch_tx_pause_duration : the switches export ``pfc3-tx-pause-duration-us`` (SONiC's
        SAI ``PFC_3_TX_PAUSE_DURATION_US``); off: only frame counts, as EOS and Cumulus.
    ecmp_spread : each leaf spreads its spine-bound traffic evenly over the spines, with a
        few per cent of jitter per uplink and tick (a working hash over many QPs: the default,
        as a healthy fabric is); off: each flow takes the one spine of a static (src, dst)
        hash, which sends a rail's remote flows to one spine (a polarized fabric). An
        `EcmpPolarization` implies it.
    """

    def __init__(self, topology: Topology, *, seed: int = 0, start_unix_ns: int = DEFAULT_START_UNIX_NS,
                 jobs: list[Job] | None = None, faults=(), interval_s: float = 1.0,
                 rank_steps: bool = True, cadence: Cadence | None = None,
                 switch_tx_pause_duration: bool = False, ecmp_spread: bool = True) -> None:
        if cadence is not None:
            interval_s = cadence.pfc_interval_s
        self.cadence = cadence
        if not 0.05 <= interval_s <= 60:
            raise ValueError(f"interval_s must be in [0.05, 60], got {interval_s!r}")
        self.topology = topology
        self.seed = seed
        self.start_unix_ns = int(start_unix_ns)
        self.interval_s = float(interval_s)
        self.rank_steps = rank_steps
        self.switch_tx_pause_duration = switch_tx_pause_duration
        self.jobs = list(jobs) if jobs is not None else auto_jobs(topology, seed)
        faults = list(faults)
        self.ecmp_spread = ecmp_spread or any(isinstance(f, EcmpPolarization) for f in faults)
        self._ecmp_rng = np.random.default_rng([seed, 0xEC3F])   # its own stream: the others stay as they were
        self._rng = np.random.default_rng([seed, 0x5EED])
        self._t = 0.0
        self._ticks = 0
        self._index_topology()
        self._index_jobs()
        self._build_flows()
        self.faults = self._expand_faults(list(faults))
        self._init_state()
        self._init_heartbeats()
        self._storm_plan = {id(f): self._plan_storm(f) for f in self.faults if isinstance(f, PfcStorm)}
        self._truth = self._build_truth()
        self._build_static()

    # ---------------------------------------------------------------- public API

    @property
    def now_unix_ns(self) -> int:
        """Event time of the last sample (the start before the first tick)."""
        return self.start_unix_ns + int(round(self._t * 1e9))

    @property
    def idle_nodes(self) -> list[str]:
        """Nodes that run no job (their NICs carry no training traffic)."""
        return [n for i, n in enumerate(self._nodes) if self._node_job[i] < 0]

    def tick(self) -> list[pb.Snapshot]:
        """Advance by ``interval_s``; the snapshots sampled at the end (nodes, then switches)."""
        t0 = self._t
        self._ticks += 1
        t1 = self._ticks * self.interval_s     # no drift from repeated addition
        fs = self._resolve_faults(t0, t1)
        self._resolve_congestion(fs, t0, t1)
        self._resolve_rank_faults(fs, t0, t1)
        self._apply_reboots(fs, t0, t1)
        job_acc, steps = self._advance_jobs(fs, t0, t1)
        self._heartbeats(fs, steps, t0, t1)
        self._simulate_fabric(fs, job_acc, t0, t1)
        self._apply_pins(t0, t1)
        self._simulate_gpus(fs, job_acc, t0, t1)
        self._t = t1
        return self._snapshots(fs, steps, t1)

    def run(self, seconds: float) -> list[list[pb.Snapshot]]:
        """Tick for ``seconds`` of event time; the snapshots of each tick."""
        return [self.tick() for _ in range(int(round(seconds / self.interval_s)))]

    def ground_truth(self) -> list[GroundTruth]:
        """Every injected fault as a labelled record (see `GroundTruth`), in onset order."""
        return list(self._truth)

    # ---------------------------------------------------------------- indexing

    def _index_topology(self) -> None:
        topo = self.topology
        self._cluster = topo.cluster
        self._nodes = list(topo.nodes)
        self._node_idx = {n: i for i, n in enumerate(self._nodes)}
        self.G = G = int(topo.gpus_per_node)
        N = len(self._nodes)
        nics = list(topo.nic_ports)
        for nic in nics:
            if nic.node not in self._node_idx:
                raise ValueError(f"NIC {nic.node}:{nic.entity_id} belongs to no listed node")
        self._nics = nics
        P = len(nics)
        self.P = P
        self._p_node = np.array([self._node_idx[n.node] for n in nics], dtype=np.int64)
        self._p_gpu = np.array([min(max(n.gpu_index, 0), G - 1) for n in nics], dtype=np.int64)
        self._p_eid = [n.entity_id for n in nics]
        self._p_key = {(n.node, n.entity_id): i for i, n in enumerate(nics)}
        self._p_nominal_gbps = np.array([n.nominal_gbps for n in nics])
        self._p_nominal_Bps = self._p_nominal_gbps * 1e9 / 8
        per_node: list[list[int]] = [[] for _ in range(N)]
        for i, n in enumerate(nics):
            per_node[self._node_idx[n.node]].append(i)
        self._node_ports = [np.array(p, dtype=np.int64) for p in per_node]
        # switch ports: from the NIC cabling and the switch links
        sw_names = list(topo.switches)
        self._switches = sw_names
        sw_idx = {s: i for i, s in enumerate(sw_names)}
        self._sw_role = [topo.switches[s].role for s in sw_names]
        ports: dict[str, dict[str, tuple]] = {s: {} for s in sw_names}
        for i, n in enumerate(nics):
            ports[n.switch][n.switch_port] = ("nic", i, n.nominal_gbps)
        for link in topo.links:
            ports[link.a_switch][link.a_port] = ("sw", (link.b_switch, link.b_port), link.nominal_speed_gbps)
            ports[link.b_switch][link.b_port] = ("sw", (link.a_switch, link.a_port), link.nominal_speed_gbps)
        sp_switch, sp_name, sp_kind, sp_ref, sp_speed = [], [], [], [], []
        self._switch_ports: list[np.ndarray] = []
        for s in sw_names:
            start = len(sp_name)
            for pname in sorted(ports[s], key=_natural_key):
                kind, ref, speed = ports[s][pname]
                sp_switch.append(sw_idx[s])
                sp_name.append(pname)
                sp_kind.append(kind)
                sp_ref.append(ref)
                sp_speed.append(speed)
            self._switch_ports.append(np.arange(start, len(sp_name), dtype=np.int64))
        SP = len(sp_name)
        self.SP = SP
        self._sp_switch = np.array(sp_switch, dtype=np.int64)
        self._sp_name = sp_name
        self._sp_key = {(sw_names[sp_switch[i]], sp_name[i]): i for i in range(SP)}
        self._sp_peer_nic = np.full(SP, -1, dtype=np.int64)
        self._sp_peer_sp = np.full(SP, -1, dtype=np.int64)
        for i in range(SP):
            if sp_kind[i] == "nic":
                self._sp_peer_nic[i] = sp_ref[i]
            else:
                self._sp_peer_sp[i] = self._sp_key[sp_ref[i]]
        self._sp_nominal_gbps = np.array(sp_speed, dtype=float)
        self._p_sp = np.zeros(P, dtype=np.int64)
        for i in range(SP):
            if self._sp_peer_nic[i] >= 0:
                self._p_sp[self._sp_peer_nic[i]] = i
        self._p_switch = self._sp_switch[self._p_sp]
        self._is_link_sp = self._sp_peer_sp >= 0
        # leaf x spine uplink tables (for routing flows across the spines)
        leaves = [i for i, r in enumerate(self._sw_role) if r != "spine"]
        spines = [i for i, r in enumerate(self._sw_role) if r == "spine"]
        self._leaf_row = {s: k for k, s in enumerate(leaves)}
        self._spine_col = {s: k for k, s in enumerate(spines)}
        self._lu = np.full((max(len(leaves), 1), max(len(spines), 1)), -1, dtype=np.int64)
        self._sd = np.full_like(self._lu, -1)
        for i in range(SP):
            j = self._sp_peer_sp[i]
            if j < 0:
                continue
            a, b = self._sp_switch[i], self._sp_switch[j]
            if a in self._leaf_row and b in self._spine_col:
                r, c = self._leaf_row[a], self._spine_col[b]
                if self._lu[r, c] < 0:
                    self._lu[r, c] = i
                    self._sd[r, c] = j


    # ---------------------------------------------------------------- faults

    def _nic_index(self, node: str, nic: str, what: str) -> int:
        p = self._p_key.get((node, nic))
        if p is None:
            raise ValueError(f"{what}: unknown NIC port {node}:{nic}")
        return p

    def _gpu_index(self, node: str, gpu: int, what: str) -> int:
        if node not in self._node_idx:
            raise ValueError(f"{what}: unknown node {node!r}")
        if not 0 <= gpu < self.G:
            raise ValueError(f"{what}: GPU index {gpu} out of range 0..{self.G - 1}")
        return self._node_idx[node] * self.G + gpu

    def _nic_of_gpu(self, node: str, gpu: int) -> int:
        ports = self._node_ports[self._node_idx[node]]
        for p in ports:
            if self._p_gpu[p] == gpu:
                return int(p)
        if not len(ports):
            raise ValueError(f"node {node!r} has no NIC")
        return int(ports[min(gpu, len(ports) - 1)])

    def _expand_faults(self, faults: list) -> list:
        """Validate every fault; add the faults that a network-caused straggler implies."""
        out = []
        self._derived: dict[int, object] = {}
        for f in faults:
            if isinstance(f, (LinkDowngrade, NicPcieDowngrade, LinkFlap)):
                self._nic_index(f.node, f.nic, type(f).__name__)
                if isinstance(f, LinkDowngrade) and parse_ib_rate(f.rate) is None:
                    raise ValueError(f"LinkDowngrade: unparseable rate {f.rate!r}")
            elif isinstance(f, (GpuPcieDowngrade, GpuXid, EccUncorrectable)):
                self._gpu_index(f.node, f.gpu, type(f).__name__)
                for g in getattr(f, "victims", ()):
                    self._gpu_index(f.node, g, type(f).__name__)
            elif isinstance(f, ApplicationXid):
                for g in (*f.gpus, *f.cleanup):
                    self._gpu_index(f.node, g, "ApplicationXid")
            elif isinstance(f, (NodeReboot, ClockSkew)):
                if f.node not in self._node_idx:
                    raise ValueError(f"{type(f).__name__}: unknown node {f.node!r}")
            elif isinstance(f, AdminToggle):
                if (f.switch, f.port) not in self._sp_key:
                    raise ValueError(f"AdminToggle: unknown switch port {f.switch}:{f.port}")
            elif isinstance(f, (LinkDown, NicAdminDown)):
                self._nic_index(f.node, f.nic, type(f).__name__)
                if isinstance(f, LinkDown) and f.failover_nic:
                    self._nic_index(f.node, f.failover_nic, "LinkDown.failover_nic")
            elif isinstance(f, SwitchLinkDown):
                sp = self._sp_key.get((f.switch, f.port))
                if sp is None or self._sp_peer_sp[sp] < 0:
                    raise ValueError(f"SwitchLinkDown: not a switch-to-switch port {f.switch}:{f.port}")
            elif isinstance(f, PfcStorm):
                for node, nic in f.sources:
                    self._nic_index(node, nic, "PfcStorm")
            elif isinstance(f, (EcmpPolarization, PfcDeadlock)):
                self._check_fabric_fault(f)
            elif isinstance(f, SwitchPfcStorm):
                if (f.switch, f.port) not in self._sp_key:
                    raise ValueError(f"SwitchPfcStorm: unknown switch port {f.switch}:{f.port}")
            elif isinstance(f, PinnedCounter):
                self._nic_index(f.node, f.nic, "PinnedCounter")
                if f.counter not in _NC or spec_for(f.counter).overflow is not Overflow.SATURATE:
                    raise ValueError(f"PinnedCounter: {f.counter!r} is not a saturating NIC counter")
            elif isinstance(f, Straggler):
                g = self._gpu_index(f.node, f.gpu, "Straggler")
                if self._node_job[g // self.G] < 0:
                    raise ValueError(f"Straggler: node {f.node!r} runs no job")
                p = self._nic_of_gpu(f.node, f.gpu)
                if f.cause == "nic_downgrade":
                    d = LinkDowngrade(f.node, self._p_eid[p], f.onset_s, f.offset_s, "200 Gb/sec (4X HDR)")
                    out.append(d)
                    self._derived[id(d)] = f
                elif f.cause in ("nic_pcie", "gpu_pcie"):
                    d = (NicPcieDowngrade(f.node, self._p_eid[p], f.onset_s, f.offset_s, width=8) if f.cause == "nic_pcie"
                         else GpuPcieDowngrade(f.node, f.gpu, f.onset_s, f.offset_s, width=8))
                    out.append(d)
                    self._derived[id(d)] = f
                elif f.cause == "storm_victim":
                    leaf_sp = self._switch_ports[self._p_switch[p]]
                    cands = [int(self._sp_peer_nic[s]) for s in leaf_sp
                             if self._sp_peer_nic[s] >= 0 and self._p_node[self._sp_peer_nic[s]] != self._p_node[p]]
                    if not cands:
                        raise ValueError(f"Straggler(storm_victim): no other node on the leaf of {f.node}")
                    busy = [c for c in cands if self._node_job[self._p_node[c]] >= 0]
                    q = (busy or cands)[0]
                    d = PfcStorm(((self._nodes[self._p_node[q]], self._p_eid[q]),), f.onset_s, f.offset_s)
                    out.append(d)
                    self._derived[id(d)] = f
            elif isinstance(f, NicLosslessDrops):
                self._nic_index(f.node, f.nic, "NicLosslessDrops")
            elif isinstance(f, (EcnAfterPause, Incast, QueueDrops)):
                self._check_congestion_fault(f)
            elif isinstance(f, (RankStuck, RankLost, CheckpointStall, JobPause, LongStep)):
                self._rank_fault_job(f)
            else:
                raise TypeError(f"not a fault: {f!r}")
            out.append(f)
        return sorted(out, key=_first_effect_s)

    def _plan_storm(self, f: PfcStorm) -> dict:
        """Who a storm pauses: the leaf's other active ports, its spine uplinks, one more hop."""
        src = [self._p_key[(n, p)] for n, p in f.sources]
        src_set = set(src)
        fed = {p: bool(np.any(self._f_dst == p)) for p in src}  # traffic is queued for p
        victims_p: set[int] = set()
        sw1: set[int] = set()
        sw2: set[int] = set()
        if not f.xon_only:
            for p in src:
                if not fed[p]:
                    continue
                leaf = self._p_switch[p]
                for sp in self._switch_ports[leaf]:
                    q = self._sp_peer_nic[sp]
                    if q >= 0:
                        if q not in src_set and self._p_has_flow[q]:
                            victims_p.add(int(q))
                    elif self._sp_peer_sp[sp] >= 0:
                        uses = (self._f_up_src == sp) | (self._f_up_dst == sp)
                        if np.any(uses):
                            sw1.add(int(self._sp_peer_sp[sp]))   # spine port facing the leaf
                            into = self._f_up_dst == sp          # flows arriving via this spine
                            for a in np.unique(self._f_up_src[into]):
                                if self._sp_switch[a] != leaf:
                                    sw2.add(int(a))              # other leaves' uplinks to that spine
        return {"src": src, "fed": fed, "victims": sorted(victims_p), "sw1": sorted(sw1), "sw2": sorted(sw2 - sw1)}

    def _resolve_faults(self, t0: float, t1: float) -> _FaultState:
        rng = self._rng
        P, SP, N, G = self.P, self.SP, len(self._nodes), self.G
        dt = t1 - t0
        nj = len(self._jobs)
        fs = _FaultState(
            cap_ratio=np.ones(P), speed_now=self._p_nominal_gbps.copy(), up_frac=np.ones(P),
            down_now=np.zeros(P, bool), down_events=np.zeros(P), down_phys={}, rate_now={},
            nic_pcie_width=np.full(P, 16.0), tx_duty=np.zeros(P), xon_frames=np.zeros(P), rx_duty=np.zeros(P),
            sw_duty=np.zeros(SP), sw_occ=np.zeros(SP), wd_warn=np.zeros(P), wd_err=np.zeros(P),
            oos_burst=np.zeros(P), sp_admin_down_now=np.zeros(SP, bool), sp_up_frac=np.ones(SP),
            sp_transitions=np.zeros(SP),
            gpu_reason=np.zeros(N * G, dtype=np.int64), gpu_clock_factor=np.ones(N * G),
            gpu_temp_boost=np.zeros(N * G), gpu_power_cap=np.full(N * G, GPU_TDP_W),
            gpu_pcie_width=np.full(N * G, 16.0), gpu_lost=np.zeros(N * G, bool),
            gpu_ecc_unc=np.zeros(N * G), gpu_remap_unc=np.zeros(N * G), rank_factor=np.ones(N * G),
            node_down=np.zeros(N, bool), node_skew_s=np.zeros(N), events={},
            job_stall=np.zeros(nj + 1, bool), job_restart_left={}, job_fault_speed=np.ones(nj + 1),
            sp_down_now=np.zeros(SP, bool), nic_admin_down=np.zeros(P, bool), fec_unc_rate=np.zeros(P),
        )
        failover_jobs: set[int] = set()
        gpu_ratio = np.ones(N * G)
        for f in self.faults:
            if _first_effect_s(f) > t1:
                break
            frac = _overlap(f.onset_s, f.offset_s, t0, t1) / dt
            on_now = f.onset_s <= t1 < f.offset_s
            if isinstance(f, LinkDowngrade):
                p = self._p_key[(f.node, f.nic)]
                r = parse_ib_rate(f.rate)
                ratio = min(1.0, r.gbps / self._p_nominal_gbps[p])
                fs.cap_ratio[p] = min(fs.cap_ratio[p], 1 - frac + frac * ratio)
                if on_now:
                    fs.rate_now[p] = f.rate
                    fs.speed_now[p] = r.gbps
            elif isinstance(f, NicPcieDowngrade):
                p = self._p_key[(f.node, f.nic)]
                ratio = min(1.0, _pcie_gbps(5, f.width) / self._p_nominal_gbps[p])
                fs.cap_ratio[p] = min(fs.cap_ratio[p], 1 - frac + frac * ratio)
                if on_now:
                    fs.nic_pcie_width[p] = f.width
            elif isinstance(f, GpuPcieDowngrade):
                g = self._node_idx[f.node] * G + f.gpu
                gpu_ratio[g] = min(gpu_ratio[g], 1 - frac + frac * min(1.0, _pcie_gbps(5, f.width) / _pcie_gbps(5, 16)))
                if on_now:
                    fs.gpu_pcie_width[g] = f.width
            elif isinstance(f, LinkFlap):
                p = self._p_key[(f.node, f.nic)]
                for a, b in f.intervals():
                    down = _overlap(a, b, t0, t1) / dt
                    if down > 0 or t0 <= a < t1 or t0 <= b < t1:
                        fs.up_frac[p] -= down
                        fs.down_events[p] += 1 if t0 <= a < t1 else 0
                        fs.sp_transitions[self._p_sp[p]] += (t0 <= a < t1) + (t0 <= b < t1)
                        fs.oos_burst[p] += 1 if t0 <= b < t1 else 0
                    if a <= t1 < b:
                        fs.down_now[p] = True
                        fs.down_phys[p] = "3: Disabled"
            elif isinstance(f, AdminToggle):
                sp = self._sp_key[(f.switch, f.port)]
                down = frac
                starts, ends = t0 <= f.onset_s < t1, t0 <= f.offset_s < t1
                if down > 0 or starts or ends:
                    peers = [sp]
                    if self._sp_peer_sp[sp] >= 0:
                        peers.append(int(self._sp_peer_sp[sp]))
                    for s in peers:
                        fs.sp_up_frac[s] -= down
                        fs.sp_transitions[s] += starts + ends
                    q = self._sp_peer_nic[sp]
                    if q >= 0:
                        fs.up_frac[q] -= down
                        fs.down_events[q] += 1 if starts else 0
                        fs.oos_burst[q] += 1 if ends else 0
                if on_now:
                    fs.sp_admin_down_now[sp] = True
                    q = self._sp_peer_nic[sp]
                    if q >= 0:
                        fs.down_now[q] = True
                        fs.down_phys[q] = "2: Polling"
            elif isinstance(f, PfcStorm):
                self._resolve_storm(f, fs, t0, t1, dt, rng)
            elif isinstance(f, (EcmpPolarization, PfcDeadlock)):
                self._resolve_fabric_fault(f, fs, frac, on_now, rng, t1)
            elif isinstance(f, SwitchPfcStorm):
                if frac > 0:
                    sp = self._sp_key[(f.switch, f.port)]
                    duty = frac * f.duty * rng.uniform(0.998, 1.0)
                    q, peer = self._sp_peer_nic[sp], self._sp_peer_sp[sp]
                    if q >= 0:
                        fs.rx_duty[q] = max(fs.rx_duty[q], duty)
                    elif peer >= 0:
                        fs.sw_duty[peer] = max(fs.sw_duty[peer], duty)
            elif isinstance(f, Straggler):
                g = self._node_idx[f.node] * G + f.gpu
                if frac > 0 or on_now:
                    if f.cause in ("thermal", "sw_thermal", "power", "none"):
                        fs.rank_factor[g] = max(fs.rank_factor[g], f.factor)
                    if f.cause in ("thermal", "sw_thermal"):
                        fs.gpu_reason[g] |= REASON_HW_THERMAL if f.cause == "thermal" else REASON_SW_THERMAL
                        fs.gpu_clock_factor[g] = min(fs.gpu_clock_factor[g], 1.0 / f.factor)
                        fs.gpu_temp_boost[g] = max(fs.gpu_temp_boost[g], 18.0)
                    elif f.cause == "power":
                        fs.gpu_reason[g] |= REASON_SW_POWER_CAP
                        fs.gpu_clock_factor[g] = min(fs.gpu_clock_factor[g], 1.0 / f.factor)
                        fs.gpu_power_cap[g] = min(fs.gpu_power_cap[g], GPU_TDP_W * 0.95 / f.factor ** 1.5)
                    elif f.cause in ("partial_pause", "nic_down"):
                        self._straggler_nic(f, fs, frac, on_now, t0, t1, rng)
            elif isinstance(f, GpuXid):
                n = self._node_idx[f.node]
                g = n * G + f.gpu
                for t in f.occurrences(until_s=t1):
                    if t0 <= t < t1:
                        fs.events.setdefault(n, []).append(("xid", f.gpu, f.code, t))
                        if f.code in XID_UNCORRECTABLE_ECC:
                            fs.gpu_ecc_unc[g] += 1
                if f.code in XID_GPU_LOST and f.onset_s < t1:
                    if t1 < f.offset_s:
                        fs.gpu_lost[g] = True
                        fs.job_stall[self._node_job[n]] = True
                    elif t0 <= f.offset_s < t1:   # the GPU is back: its job restarts
                        fs.job_restart_left[self._node_job[n]] = 30.0
                if isinstance(f, XidCascade):   # the driver's cleanup of the contexts that shared it
                    for v, t in f.cleanups():
                        if t0 <= t < t1:
                            fs.events.setdefault(n, []).append(("xid", v, 45, t))
            elif isinstance(f, ApplicationXid):
                n = self._node_idx[f.node]
                for g, code, t in f.occurrences():
                    if t0 <= t < t1:
                        fs.events.setdefault(n, []).append(("xid", g, code, t))
                if f.crash and self._node_job[n] >= 0 and any(t0 <= t < t1 for t in f.burst_times()):
                    fs.job_restart_left[self._node_job[n]] = 30.0   # the job died: restart from its checkpoint
            elif isinstance(f, EccUncorrectable):
                n = self._node_idx[f.node]
                g = n * G + f.gpu
                if t0 <= f.onset_s < t1:
                    fs.gpu_ecc_unc[g] += f.count
                    fs.gpu_remap_unc[g] += 1
                    fs.events.setdefault(n, []).append(("ecc_dbe", f.gpu, f.count, f.onset_s))
            elif isinstance(f, NodeReboot):
                n = self._node_idx[f.node]
                if frac > 0 or on_now or t0 <= f.offset_s < t1:
                    ports = self._node_ports[n]
                    fs.up_frac[ports] -= frac
                    fs.down_now[ports] |= on_now
                    starts, ends = t0 <= f.onset_s < t1, t0 <= f.offset_s < t1
                    fs.sp_transitions[self._p_sp[ports]] += starts + ends
                    if on_now:
                        fs.node_down[n] = True
                if t0 <= f.onset_s < t1 and self._node_job[n] >= 0:
                    fs.job_restart_left[self._node_job[n]] = (f.onset_s + f.down_s - t0) + f.restart_s
            elif isinstance(f, ClockSkew):
                if on_now:
                    fs.node_skew_s[self._node_idx[f.node]] += f.skew_s
            elif isinstance(f, (LinkDown, NicAdminDown, SwitchLinkDown)):
                self._resolve_link_down(f, fs, t0, t1, frac, on_now, failover_jobs)
        np.clip(fs.up_frac, 0.0, 1.0, out=fs.up_frac)
        np.clip(fs.sp_up_frac, 0.0, 1.0, out=fs.sp_up_frac)
        flow_up = fs.up_frac.copy()              # what the flows see: a dead port's rail goes via a sibling
        for q, share in fs.failover.items():
            flow_up[q] = share
        # GPU PCIe limits the NIC that does GPUDirect RDMA for it
        fs.cap_ratio = np.minimum(fs.cap_ratio, gpu_ratio[self._p_node * G + self._p_gpu])
        # the jobs' comm speed limit from faults: slowest link, paused ports, blocked flows
        if self.F:
            f_pass = (flow_up[self._f_src] * flow_up[self._f_dst] * (1 - fs.tx_duty[self._f_dst])
                      * np.minimum(fs.cap_ratio[self._f_src], fs.cap_ratio[self._f_dst])
                      * (1 - fs.rx_duty[self._f_src]))
            rem = self._f_remote
            if np.any(rem):
                f_pass[rem] *= (1 - fs.sw_duty[self._f_up_src[rem]]) * (1 - fs.sw_duty[self._f_sp_b[rem]])
            if fs.carrier:
                carrier = np.arange(self.P)
                carrier[list(fs.carrier)] = list(fs.carrier.values())
                src_c, dst_c = carrier[self._f_src], carrier[self._f_dst]
                moved = (src_c != self._f_src) | (dst_c != self._f_dst)
                both = fs.up_frac[src_c] * fs.up_frac[dst_c] * np.minimum(fs.cap_ratio[src_c], fs.cap_ratio[dst_c])
                f_pass[moved] = both[moved]
            np.minimum.at(fs.job_fault_speed, self._f_job, f_pass)
        for j in failover_jobs:     # one NIC carries two rails: that rail's collectives take twice as long
            fs.job_fault_speed[j] = min(fs.job_fault_speed[j], FAILOVER_COMM_SPEED)
        return fs

    def _straggler_nic(self, f: Straggler, fs: _FaultState, frac: float, on_now: bool, t0: float, t1: float,
                       rng) -> None:
        """A straggler's NIC partly paused by its leaf, or dead with NCCL on a sibling NIC."""
        p = self._nic_of_gpu(f.node, f.gpu)
        if f.cause == "partial_pause":
            lo, hi = PARTIAL_PAUSE_DUTY_RANGE
            duty = min(hi, max(lo, 1.0 - 1.0 / f.factor)) * rng.uniform(0.92, 1.05)
            fs.rx_duty[p] = max(fs.rx_duty[p], frac * duty)
            return
        fs.up_frac[p] -= frac
        fs.down_events[p] += 1 if t0 <= f.onset_s < t1 else 0
        fs.sp_transitions[self._p_sp[p]] += t0 <= f.onset_s < t1
        if on_now:
            fs.down_now[p] = True
            fs.down_phys[p] = "3: Disabled"
        # the sibling carries two rails: half the speed for this one (and the sibling's own)
        fs.failover[p] = min(fs.failover.get(p, 1.0), 1.0 - 0.5 * frac)
    def _failover_port(self, f: LinkDown, p: int) -> int:
        """The NIC that takes over a dead NIC's traffic: the named one, else its PCIe sibling
        (rail ^ 1: DGX-style nodes pair two NICs and two GPUs on one PCIe switch)."""
        if f.failover_nic:
            return self._p_key[(f.node, f.failover_nic)]
        ports = self._node_ports[self._p_node[p]].tolist()
        k = ports.index(p)
        return ports[k ^ 1] if (k ^ 1) < len(ports) else ports[(k + 1) % len(ports)]

    def _resolve_link_down(self, f, fs: _FaultState, t0: float, t1: float, frac: float, on_now: bool,
                           failover_jobs: set) -> None:
        starts, ends = t0 <= f.onset_s < t1, t0 <= f.offset_s < t1
        if isinstance(f, SwitchLinkDown):
            sp = self._sp_key[(f.switch, f.port)]
            for s in (sp, int(self._sp_peer_sp[sp])):
                if frac > 0 or starts or ends:
                    fs.sp_up_frac[s] -= frac
                    fs.sp_transitions[s] += starts + ends
                if on_now:
                    fs.sp_down_now[s] = True
            return
        p = self._p_key[(f.node, f.nic)]
        if isinstance(f, LinkDown) and f.fec_warning_s > 0 and f.onset_s - f.fec_warning_s <= t1 < f.onset_s:
            fs.fec_unc_rate[p] += FAILING_LINK_FEC_UNCORRECTABLE_PER_S
        if frac > 0 or on_now or ends:
            fs.up_frac[p] -= frac
            fs.sp_transitions[self._p_sp[p]] += starts + ends
            fs.oos_burst[p] += 1 if ends else 0
            if isinstance(f, LinkDown):
                fs.down_events[p] += 1 if starts else 0
        if not on_now and frac <= 0:
            return
        if on_now:
            fs.down_now[p] = True
            fs.down_phys[p] = "2: Polling" if isinstance(f, LinkDown) else "3: Disabled"
            fs.nic_admin_down[p] = isinstance(f, NicAdminDown)
        j = int(self._node_job[self._p_node[p]])
        if j < 0:
            return
        if isinstance(f, LinkDown) and f.failover and t1 >= f.onset_s + f.failover_after_s:
            fs.carrier[p] = self._failover_port(f, p)
            failover_jobs.add(j)
        else:
            fs.job_stall[j] = True          # the rail's collectives hang until the link is back

    def _resolve_storm(self, f: PfcStorm, fs: _FaultState, t0: float, t1: float, dt: float, rng) -> None:
        plan = self._storm_plan[id(f)]
        end = f.effective_offset_s
        frac = _overlap(f.onset_s, end, t0, t1) / dt
        on_now = f.onset_s <= t1 < end
        if f.nic_watchdog_ms is not None and not f.xon_only:
            tw = f.nic_watchdog_ms / 1000.0
            warn_t, err_t = f.onset_s + 0.85 * tw, f.onset_s + tw
            for p in plan["src"]:
                if t0 <= warn_t < t1 and warn_t < f.offset_s:
                    fs.wd_warn[p] += 1
                if t0 <= err_t < t1 and err_t < f.offset_s:
                    fs.wd_err[p] += 1
        if frac <= 0 and not on_now:
            return
        if f.xon_only:
            for p in plan["src"]:
                fs.xon_frames[p] += XON_FRAMES_PER_S * frac * dt
            return
        for p in plan["src"]:
            fs.tx_duty[p] = max(fs.tx_duty[p], min(1.0, frac * f.duty * rng.uniform(0.998, 1.0)))
            if on_now and plan["fed"][p]:
                fs.sw_occ[self._p_sp[p]] = max(fs.sw_occ[self._p_sp[p]], rng.uniform(2.5e6, 6e6))
            if f.stuck_host:
                fs.job_stall[self._node_job[self._p_node[p]]] = True
        for q in plan["victims"]:
            fs.rx_duty[q] = max(fs.rx_duty[q], frac * rng.uniform(0.85, 0.99))
        for sp in plan["sw1"]:
            fs.sw_duty[sp] = max(fs.sw_duty[sp], frac * rng.uniform(0.88, 0.99))
            if on_now:
                fs.sw_occ[sp] = max(fs.sw_occ[sp], rng.uniform(1e6, 4e6))
        for sp in plan["sw2"]:
            fs.sw_duty[sp] = max(fs.sw_duty[sp], frac * rng.uniform(0.3, 0.7))
            if on_now:
                fs.sw_occ[sp] = max(fs.sw_occ[sp], rng.uniform(2e5, 1e6))

    # ---------------------------------------------------------------- congestion tuning (issue 15)

    def _check_congestion_fault(self, f) -> None:
        if f.switch not in self._switches:
            raise ValueError(f"{type(f).__name__}: unknown switch {f.switch!r}")
        if isinstance(f, QueueDrops) and (f.switch, f.port) not in self._sp_key:
            raise ValueError(f"QueueDrops: unknown switch port {f.switch}:{f.port}")
        if isinstance(f, EcnAfterPause) and f.priority != 3:
            raise ValueError("EcnAfterPause: the simulator's lossless priority is 3")

    def _resolve_congestion(self, fs: _FaultState, t0: float, t1: float) -> None:
        """`EcnAfterPause`, `Incast`, `QueueDrops` for [t0, t1): per switch, per switch port."""
        faults = [f for f in self.faults if isinstance(f, (EcnAfterPause, Incast, QueueDrops, NicLosslessDrops))]
        if not faults:
            return
        S, dt = len(self._switches), t1 - t0
        index = {s: i for i, s in enumerate(self._switches)}
        fs.sw_ecn_factor, fs.sw_pause_gain = np.ones(S), np.ones(S)
        fs.sw_level_floor, fs.sw_quiet = np.zeros(S), np.zeros(S, bool)
        fs.q_drops = np.zeros((self.SP, 2))
        fs.nic_q_drops = np.zeros(self.P)
        for f in faults:
            frac = _overlap(f.onset_s, f.offset_s, t0, t1) / dt
            if frac <= 0:
                continue
            if isinstance(f, NicLosslessDrops):
                fs.nic_q_drops[self._p_key[(f.node, f.nic)]] += f.drops_per_s * frac
                continue
            if isinstance(f, QueueDrops):
                fs.q_drops[self._sp_key[(f.switch, f.port)], 0 if f.lossless else 1] += f.drops_per_s * frac
                continue
            s = index[f.switch]
            level = f.level if isinstance(f, Incast) else f.incast
            fs.sw_level_floor[s] = max(fs.sw_level_floor[s], level * frac)
            if isinstance(f, EcnAfterPause):
                fs.sw_ecn_factor[s] = min(fs.sw_ecn_factor[s], 1 - frac + frac * f.marking_factor)
                fs.sw_pause_gain[s] = max(fs.sw_pause_gain[s], 1 + frac * (f.pause_gain - 1))
                fs.sw_quiet[s] |= f.quiet and frac >= 0.5


    def _apply_pins(self, t0: float, t1: float) -> None:
        """`PinnedCounter`: stuck at all-ones while on, cleared to 0 at its offset."""
        for f in self.faults:
            if isinstance(f, PinnedCounter) and f.onset_s < t1:
                p, c = self._p_key[(f.node, f.nic)], _NC[f.counter]
                if t1 < f.offset_s:
                    self._nic.values[p, c] = np.uint64((1 << spec_for(f.counter).width_bits) - 1)
                elif t0 <= f.offset_s:
                    self._nic.values[p, c] = 0

    def _apply_reboots(self, fs: _FaultState, t0: float, t1: float) -> None:
        """At the moment a node reboots its totals restart from 0 (the switch keeps counting)."""
        for f in self.faults:
            if isinstance(f, NodeReboot) and t0 <= f.onset_s < t1:
                n = self._node_idx[f.node]
                self._nic.values[self._node_ports[n]] = 0
                rows = np.arange(n * self.G, (n + 1) * self.G)
                self._gpu.values[rows] = 0      # remapped rows live in the InfoROM: kept

    # ---------------------------------------------------------------- state

    def _init_state(self) -> None:
        """The state at the start: every counter's total after days of uptime, the noise processes,
        the clocks, each job at a random point of a step (one random stream: keep the draws' order)."""
        rng = self._rng
        N, G = len(self._nodes), self.G
        uptime = rng.uniform(2, 60, N) * 86400.0
        self._init_nic_state(uptime)
        self._init_gpu_state(uptime)
        self._init_switch_state()
        S, P = len(self._switches), self.P
        # clocks and sequence numbers
        self._node_clock_ns = np.clip(rng.normal(0, 2e6, N), -5e6, 5e6)
        self._seq_node = np.zeros(N, dtype=np.int64)
        self._seq_sw = np.zeros(S, dtype=np.int64)
        self._nic_gauges = np.zeros((P, len(NIC_GAUGES)))
        # jobs start at a random point of a step
        for jr in self._jobs:
            self._start_step(jr, 0.0, np.ones(N * G))
            jr.step_start = -float(rng.uniform(0, jr.comp_len))
            jr.phase_left = max(jr.comp_len + jr.step_start, 1e-3)


    # ---------------------------------------------------------------- ECMP and deadlock faults

    def _check_fabric_fault(self, f) -> None:
        """Validate an `EcmpPolarization` (a leaf and some of its uplinks) or a `PfcDeadlock`
        (switch-to-switch ports)."""
        name = type(f).__name__
        if isinstance(f, EcmpPolarization):
            s = self._switches.index(f.switch) if f.switch in self._switches else -1
            if s < 0 or s not in self._leaf_row:
                raise ValueError(f"{name}: not a leaf {f.switch!r}")
            row = self._lu[self._leaf_row[s]]
            uplinks = {self._sp_name[i] for i in row if i >= 0}
            for port in f.hot_uplinks:
                if port not in uplinks:
                    raise ValueError(f"{name}: {f.switch}:{port} is not an uplink")
            return
        for sw, port in f.ports:
            sp = self._sp_key.get((sw, port))
            if sp is None or self._sp_peer_sp[sp] < 0:
                raise ValueError(f"{name}: not a switch-to-switch port {sw}:{port}")

    def _resolve_fabric_fault(self, f, fs: _FaultState, frac: float, on_now: bool, rng, t1: float) -> None:
        if isinstance(f, EcmpPolarization):
            if frac > 0 or on_now:
                s = self._switches.index(f.switch)
                row = self._lu[self._leaf_row[s]]
                cols = [c for c, i in enumerate(row) if i >= 0]
                hot = [k for k, c in enumerate(cols) if self._sp_name[row[c]] in f.hot_uplinks]
                shift = int((t1 - f.onset_s) // f.rotate_s) if f.rotate_s > 0 else 0
                fs.polarized[self._leaf_row[s]] = [cols[(k + shift) % len(cols)] for k in hot]
            return
        if frac <= 0:
            return
        for sw, port in f.ports:        # held by its peer, its egress queue full behind the pause
            sp = self._sp_key[(sw, port)]
            fs.sw_duty[sp] = max(fs.sw_duty[sp], frac * rng.uniform(0.995, 1.0))
            fs.sw_occ[sp] = max(fs.sw_occ[sp], frac * rng.uniform(3e6, 6e6))


# --------------------------------------------------------------------------- demo


def demo_scenario(n_nodes: int = 64, seed: int = 0) -> tuple[Topology, list[Fault]]:
    """A healthy noisy cluster with three faults in the first ~30 s, for the README demo.

    Pass the same ``seed`` to `ClusterSimulator` (the faults target nodes that run jobs in
    `auto_jobs` for that seed): at 5 s a NIC of the biggest job falls to 200G (that job's
    steps slow down); from 12 s to 20 s a NIC of another job storms PFC pauses (its leaf
    pauses its neighbours and uplinks); from 22 s a GPU of a third job, preferably one with
    no node behind the storming leaf, is thermally throttled and straggles.

    >>> topo, faults = demo_scenario(16, seed=3)
    >>> [type(f).__name__ for f in faults]
    ['LinkDowngrade', 'PfcStorm', 'Straggler']
    """
    if n_nodes < 2:
        raise ValueError("demo_scenario needs at least 2 nodes")
    topo = rail_optimised("sim", n_nodes=n_nodes, nodes_per_unit=min(32, n_nodes),
                          n_spines=8 if n_nodes > 32 else 4)
    jobs = sorted((j for j in auto_jobs(topo, seed) if len(j.nodes) >= 2), key=lambda j: (-len(j.nodes), j.job_id))
    if not jobs:
        raise ValueError("no multi-node job to inject faults into")
    a = jobs[0]
    b = jobs[1] if len(jobs) > 1 else a
    down_node = a.nodes[len(a.nodes) // 2]
    storm_node = b.nodes[-1] if b is not a else a.nodes[-1]
    storm_unit = topo.nic(storm_node, "mlx5_5/1").switch.split("-r")[0]
    others = [j for j in jobs if j is not a and j is not b] or [a]
    clear = [j for j in others
             if all(topo.nic(n, "mlx5_5/1").switch.split("-r")[0] != storm_unit for n in j.nodes)]
    c = (clear or others)[0]
    strag_node = next((n for n in c.nodes if n not in (down_node, storm_node)), c.nodes[0])
    faults: list[Fault] = [
        LinkDowngrade(down_node, "mlx5_3/1", onset_s=5.0, rate="200 Gb/sec (4X HDR)"),
        PfcStorm(sources=((storm_node, "mlx5_5/1"),), onset_s=12.0, offset_s=20.0),
        Straggler(strag_node, gpu=2, onset_s=22.0, factor=1.4, cause="thermal"),
    ]
    return topo, faults
