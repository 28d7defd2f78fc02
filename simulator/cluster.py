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
quirk, `fabric.XMIT_WAIT_PINNED_FRACTION`), labels as sysfs prints them. What a NIC transmits its leaf port receives; pause frames a NIC sends its
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

from fabricwatch.counters import NIC_GAUGES
from fabricwatch.models.topology import Topology
from fabricwatch.protos.v1 import telemetry_pb2 as pb
from fabricwatch.simulator.encoding import Cadence, SnapshotEncoder
from fabricwatch.simulator.fabric import FabricModel
from fabricwatch.simulator.fabric_faults import (
    AdminToggle, EcmpPolarization, EcnAfterPause, Incast, LinkDown, LinkDowngrade, LinkFlap, NicAdminDown,
    NicLosslessDrops, NicPcieDowngrade, PfcDeadlock, PfcStorm, PinnedCounter, QueueDrops, SwitchLinkDown,
    SwitchPfcStorm,
)
from fabricwatch.simulator.fault_effects import FaultEffects
from fabricwatch.simulator.gpus import GpuModel
from fabricwatch.simulator.host_faults import (
    ApplicationXid, CheckpointStall, ClockSkew, EccUncorrectable, GpuPcieDowngrade, GpuXid, JobPause, LongStep,
    NodeReboot, RankLost, RankStuck, Straggler, XidCascade,
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


# --------------------------------------------------------------------------- helpers


def _natural_key(name: str) -> list:
    return [int(t) if t.isdigit() else t for t in re.split(r"(\d+)", name)]


# --------------------------------------------------------------------------- simulator


class ClusterSimulator(FaultEffects, Workload, FabricModel, GpuModel, SnapshotEncoder, Labelling):
    """A seeded, deterministic simulated cluster; see the module docstring.

    This class indexes the topology, holds the state and runs the tick; its parts, in the
    order a tick runs them: `FaultEffects` (faults resolved for the tick), `Workload`
    (jobs, ranks, heartbeats), `FabricModel` (traffic, PFC, ECN, ECMP), `GpuModel`,
    `SnapshotEncoder` (the protobuf snapshots); `Labelling` writes the ground truth.

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
        """The index every part reads: nodes, NIC ports (``_p_*``), switch ports (``_sp_*``) and their
        peers, the leaf x spine uplink tables."""
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
