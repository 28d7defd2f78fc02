"""How each injected fault changes the simulated cluster, tick by tick.

`FaultEffects` validates the faults against the topology (and adds the faults a
network-caused straggler implies), then per tick [t0, t1) resolves every active fault into
one `fault_state._FaultState` (traffic caps, link states, pause duties, GPU throttling,
XID events, stalled jobs) that the fabric, GPU and workload models read. The rank-side
faults (a rank stuck or lost, a job paused) are the workload's (`workload`).
"""
from __future__ import annotations

import numpy as np

from fabricwatch.counters import Overflow, spec_for
from fabricwatch.models.linkrate import parse_ib_rate
from fabricwatch.simulator.columns import _NC
from fabricwatch.simulator.fabric_faults import (
    AdminToggle, EcmpPolarization, EcnAfterPause, Incast, LinkDown, LinkDowngrade, LinkFlap, NicAdminDown,
    NicLosslessDrops, NicPcieDowngrade, PfcDeadlock, PfcStorm, PinnedCounter, QueueDrops, SwitchLinkDown,
    SwitchPfcStorm,
)
from fabricwatch.simulator.fault_state import _FaultState
from fabricwatch.simulator.gpus import GPU_TDP_W, _pcie_gbps
from fabricwatch.simulator.host_faults import (
    PARTIAL_PAUSE_DUTY_RANGE, REASON_HW_THERMAL, REASON_SW_POWER_CAP, REASON_SW_THERMAL, XID_GPU_LOST,
    XID_UNCORRECTABLE_ECC, ApplicationXid, CheckpointStall, ClockSkew, EccUncorrectable, GpuPcieDowngrade, GpuXid,
    JobPause, LongStep, NodeReboot, RankLost, RankStuck, Straggler, XidCascade,
)

XON_FRAMES_PER_S = 20_000.0    # rate of a XON-only flood
FAILOVER_COMM_SPEED = 0.5      # a NIC carrying two rails: that rail's share of a collective takes twice as long
FAILING_LINK_FEC_UNCORRECTABLE_PER_S = 3.0   # post-FEC symbol errors of a link about to die [U]


def _first_effect_s(f) -> float:
    """When a fault first shows: its onset, or the FEC errors of a link about to die before it."""
    return f.onset_s - getattr(f, "fec_warning_s", 0.0)


def _overlap(a: float, b: float, t0: float, t1: float) -> float:
    return max(0.0, min(b, t1) - max(a, t0))


class FaultEffects:
    """`ClusterSimulator`'s faults: checked against its topology and jobs, then resolved tick by tick."""

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

    def _check_congestion_fault(self, f) -> None:
        if f.switch not in self._switches:
            raise ValueError(f"{type(f).__name__}: unknown switch {f.switch!r}")
        if isinstance(f, QueueDrops) and (f.switch, f.port) not in self._sp_key:
            raise ValueError(f"QueueDrops: unknown switch port {f.switch}:{f.port}")
        if isinstance(f, EcnAfterPause) and f.priority != 3:
            raise ValueError("EcnAfterPause: the simulator's lossless priority is 3")

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
