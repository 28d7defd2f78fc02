"""The ground truth of a simulated run: each injected fault as the `labels.GroundTruth` records
an evaluation scores detectors against.

Built once, when `ClusterSimulator` starts (every fault is known up front): the faulty
entity, the victims it harms and the entities where it also shows, found in the simulated
topology and jobs; ``expect_alert`` False for the cases a detector must not fire on; plus
the ``hang`` a fault causes on the rank that holds up its job.
"""
from __future__ import annotations

import numpy as np

from fabricwatch.simulator.fabric_faults import (
    AdminToggle, EcmpPolarization, EcnAfterPause, Incast, LinkDown, LinkDowngrade, LinkFlap, NicAdminDown,
    NicLosslessDrops, NicPcieDowngrade, PfcDeadlock, PfcStorm, QueueDrops, SwitchLinkDown, SwitchPfcStorm,
)
from fabricwatch.simulator.host_faults import (
    ApplicationXid, CheckpointStall, ClockSkew, EccUncorrectable, GpuPcieDowngrade, GpuXid, JobPause, LongStep,
    NodeReboot, Straggler,
)
from fabricwatch.simulator.labels import HANG_LABEL_MIN_S, GroundTruth, gpu_path, job_path, nic_path, port_path, rank_path
from fabricwatch.simulator.timeline import INF
from fabricwatch.xid import is_gpu_fault


class Labelling:
    """`ClusterSimulator`'s ground truth (`ground_truth()`), from its faults, topology index and jobs."""

    def _build_truth(self) -> list[GroundTruth]:
        out = []
        for f in self.faults:
            via = self._derived.get(id(f))
            detail = {"via": f"straggler {via.node}/gpu{via.gpu}"} if via is not None else {}
            if isinstance(f, LinkDowngrade):
                p = self._p_key[(f.node, f.nic)]
                out.append(GroundTruth(f.kind, nic_path(f.node, f.nic), self._ns(f.onset_s), self._ns(f.offset_s),
                                       related=(port_path(self._switches[self._p_switch[p]], self._sp_name[self._p_sp[p]]),),
                                       detail={"rate": f.rate, "nominal_rate": self._nics[p].nominal_rate, **detail}))
            elif isinstance(f, NicPcieDowngrade):
                out.append(GroundTruth(f.kind, nic_path(f.node, f.nic), self._ns(f.onset_s), self._ns(f.offset_s),
                                       detail={"pcie_width": f.width}))
            elif isinstance(f, GpuPcieDowngrade):
                out.append(GroundTruth(f.kind, gpu_path(f.node, f.gpu), self._ns(f.onset_s), self._ns(f.offset_s),
                                       detail={"pcie_width": f.width}))
            elif isinstance(f, LinkFlap):
                p = self._p_key[(f.node, f.nic)]
                out.append(GroundTruth(f.kind, nic_path(f.node, f.nic), self._ns(f.onset_s), self._ns(f.offset_s),
                                       related=(port_path(self._switches[self._p_switch[p]], self._sp_name[self._p_sp[p]]),),
                                       detail={"flaps": f.flaps, "down_s": f.down_s}))
            elif isinstance(f, AdminToggle):
                sp = self._sp_key[(f.switch, f.port)]
                rel = ()
                if self._sp_peer_nic[sp] >= 0:
                    q = self._sp_peer_nic[sp]
                    rel = (nic_path(self._nodes[self._p_node[q]], self._p_eid[q]),)
                elif self._sp_peer_sp[sp] >= 0:
                    j = self._sp_peer_sp[sp]
                    rel = (port_path(self._switches[self._sp_switch[j]], self._sp_name[j]),)
                out.append(GroundTruth(f.kind, port_path(f.switch, f.port), self._ns(f.onset_s), self._ns(f.offset_s),
                                       related=rel, expect_alert=False, detail={"down_s": f.down_s}))
            elif isinstance(f, PfcStorm):
                plan = self._storm_plan[id(f)]
                victims = tuple(nic_path(self._nodes[self._p_node[q]], self._p_eid[q]) for q in plan["victims"])
                victims += tuple(port_path(self._switches[self._sp_switch[s]], self._sp_name[s])
                                 for s in plan["sw1"] + plan["sw2"])
                for k, (node, nic) in enumerate(f.sources):
                    p = plan["src"][k]
                    out.append(GroundTruth(
                        f.kind, nic_path(node, nic), self._ns(f.onset_s), self._ns(f.effective_offset_s),
                        victims=victims,
                        related=(port_path(self._switches[self._p_switch[p]], self._sp_name[self._p_sp[p]]),),
                        # nothing queued for an idle source: its pauses hold nothing, not a storm
                        # (sonic-mgmt test_pfcwd_no_traffic)
                        expect_alert=(not f.xon_only) and f.duration_s >= f.min_alert_s and plan["fed"][p],
                        detail={"priority": 3, "traffic_to_source": plan["fed"][p], "sources": len(f.sources),
                                "stuck_host": f.stuck_host, "nic_watchdog_ms": f.nic_watchdog_ms, **detail}))
            elif isinstance(f, SwitchPfcStorm):
                sp = self._sp_key[(f.switch, f.port)]
                q, peer = int(self._sp_peer_nic[sp]), int(self._sp_peer_sp[sp])
                if q >= 0:
                    victim, busy = nic_path(self._nodes[self._p_node[q]], self._p_eid[q]), bool(self._p_has_flow[q])
                else:
                    victim = port_path(self._switches[self._sp_switch[peer]], self._sp_name[peer])
                    busy = bool(np.any((self._f_up_src == peer) | (self._f_up_dst == peer)))
                out.append(GroundTruth(
                    f.kind, port_path(f.switch, f.port), self._ns(f.onset_s), self._ns(f.offset_s), victims=(victim,),
                    # the peer has data to send, or the pauses hold nothing (test_pfcwd_no_traffic)
                    expect_alert=f.duration_s >= f.min_alert_s and busy,
                    detail={"priority": 3, "switch_source": True, "traffic_from_peer": busy,
                            "tx_pause_duration_exported": self.switch_tx_pause_duration}))
            elif isinstance(f, Straggler):
                n = self._node_idx[f.node]
                jr = self._jobs[self._node_job[n]]
                k = int(np.nonzero(jr.node_idx == n)[0][0])
                rank = k * self.G + f.gpu
                p = self._nic_of_gpu(f.node, f.gpu)
                related = (gpu_path(f.node, f.gpu),)
                if f.cause in ("nic_downgrade", "storm_victim", "nic_pcie", "partial_pause", "nic_down"):
                    related += (nic_path(f.node, self._p_eid[p]),)
                out.append(GroundTruth(f.kind, rank_path(jr.job.job_id, rank), self._ns(f.onset_s), self._ns(f.offset_s),
                                       victims=(job_path(jr.job.job_id),), related=related,
                                       detail={"cause": f.cause, "factor": f.factor, "node": f.node, "gpu": f.gpu}))
            elif isinstance(f, GpuXid):
                occ = f.occurrences(until_s=f.offset_s if f.offset_s != INF else f.onset_s + 3600)
                victims = tuple(gpu_path(f.node, g) for g in getattr(f, "victims", ()))
                out.append(GroundTruth(f.kind, gpu_path(f.node, f.gpu), self._ns(f.onset_s), self._ns(f.offset_s),
                                       victims=victims, expect_alert=is_gpu_fault(f.code),
                                       detail={"code": f.code, "occurrences": len(occ), "repeat_s": f.repeat_s,
                                               "cleanup_xid45": len(victims)}))
            elif isinstance(f, ApplicationXid):
                out.append(GroundTruth(f.kind, gpu_path(f.node, f.gpus[0]), self._ns(f.onset_s), self._ns(f.offset_s),
                                       victims=tuple(gpu_path(f.node, g) for g in f.cleanup),
                                       related=tuple(gpu_path(f.node, g) for g in f.gpus[1:]), expect_alert=False,
                                       detail={"code": f.code, "bursts": f.bursts, "crash": f.crash}))
            elif isinstance(f, EccUncorrectable):
                out.append(GroundTruth(f.kind, gpu_path(f.node, f.gpu), self._ns(f.onset_s), self._ns(f.offset_s),
                                       detail={"count": f.count}))
            elif isinstance(f, NodeReboot):
                ports = self._node_ports[self._node_idx[f.node]]
                rel = tuple(port_path(self._switches[self._p_switch[p]], self._sp_name[self._p_sp[p]]) for p in ports)
                out.append(GroundTruth(f.kind, f.node, self._ns(f.onset_s), self._ns(f.offset_s), related=rel,
                                       expect_alert=False, detail={"down_s": f.down_s}))
            elif isinstance(f, ClockSkew):
                out.append(GroundTruth(f.kind, f.node, self._ns(f.onset_s), self._ns(f.offset_s),
                                       expect_alert=False, detail={"skew_s": f.skew_s}))
            elif isinstance(f, (LinkDown, NicAdminDown)):
                p = self._p_key[(f.node, f.nic)]
                j = self._node_job[self._p_node[p]]
                leaf = port_path(self._switches[self._p_switch[p]], self._sp_name[self._p_sp[p]])
                detail = {"down_s": None if f.offset_s == INF else f.offset_s - f.onset_s}
                if isinstance(f, LinkDown):
                    q = self._failover_port(f, p) if f.failover and j >= 0 else None
                    detail.update(failover_nic=self._p_eid[q] if q is not None else "", fec_warning_s=f.fec_warning_s)
                out.append(GroundTruth(f.kind, nic_path(f.node, f.nic), self._ns(f.onset_s), self._ns(f.offset_s),
                                       victims=(job_path(self._jobs[j].job.job_id),) if j >= 0 else (), related=(leaf,),
                                       expect_alert=isinstance(f, LinkDown), detail=detail))
            elif isinstance(f, (EcmpPolarization, PfcDeadlock)):
                out.append(self._fabric_fault_truth(f))
            elif isinstance(f, SwitchLinkDown):
                peer = self._sp_peer_sp[self._sp_key[(f.switch, f.port)]]
                far = port_path(self._switches[self._sp_switch[peer]], self._sp_name[peer])
                out.append(GroundTruth(f.kind, port_path(f.switch, f.port), self._ns(f.onset_s), self._ns(f.offset_s),
                                       related=(far,)))
            elif isinstance(f, (EcnAfterPause, Incast, QueueDrops, NicLosslessDrops)):
                out.append(self._congestion_truth(f))
            out += self._hang_truth(f)
        return out

    def _hang_truth(self, f) -> list[GroundTruth]:
        """The hang a fault causes, on the rank that holds up its job (consequence of a GPU lost,
        a NIC down without failover, a stuck storm source; or the rank fault itself), and the
        must-not-fire job stalls (checkpoint, pause, long step)."""
        if isinstance(f, (CheckpointStall, JobPause, LongStep)):
            jr = self._rank_fault_job(f)
            return [GroundTruth(f.kind, job_path(jr.job.job_id), self._ns(f.onset_s), self._ns(f.offset_s),
                                expect_alert=False, detail={"duration_s": f.duration_s, "node": f.node})]
        out: list[GroundTruth] = []
        end = getattr(f, "effective_offset_s", f.offset_s)
        if end - f.onset_s < HANG_LABEL_MIN_S:     # too short to call a hang: no label
            return out
        by_job: dict[int, list] = {}
        for jr, rank, root in self._culprits(f):
            by_job.setdefault(jr.index, []).append((jr, rank, root))
        for culprits in by_job.values():     # one hang per job (a storm from two of its ranks: either)
            jr, rank, root = culprits[0]
            node, gpu = self._nodes[int(jr.rank_node[rank])], int(jr.rank_gpu[rank])
            p = self._nic_of_gpu(node, gpu)
            out.append(GroundTruth(
                "hang", rank_path(jr.job.job_id, rank), self._ns(f.onset_s), self._ns(end),
                victims=(job_path(jr.job.job_id),), related=(gpu_path(node, gpu), nic_path(node, self._p_eid[p])),
                detail={"root": root, "node": node, "gpu": gpu, "rank": rank, "via": f.kind,
                        "culprits": tuple(rank_path(jr.job.job_id, r) for _, r, _ in culprits)}))
        return out

    def _congestion_truth(self, f) -> GroundTruth:
        if isinstance(f, NicLosslessDrops):
            return GroundTruth(f.kind, nic_path(f.node, f.nic), self._ns(f.onset_s), self._ns(f.offset_s),
                               detail={"priority": 3, "lossless": True, "drops_per_s": f.drops_per_s, "nic": True})
        if isinstance(f, QueueDrops):
            return GroundTruth(f.kind, port_path(f.switch, f.port), self._ns(f.onset_s), self._ns(f.offset_s),
                               expect_alert=f.lossless,
                               detail={"priority": f.priority, "lossless": f.lossless, "drops_per_s": f.drops_per_s})
        ports = self._switch_ports[self._switches.index(f.switch)]
        nic = self._sp_peer_nic[ports]
        busy = bool(np.any(self._p_has_flow[nic[nic >= 0]]))
        if isinstance(f, Incast):
            return GroundTruth(f.kind, f.switch, self._ns(f.onset_s), self._ns(f.offset_s), expect_alert=False,
                               detail={"level": f.level, "busy": busy})
        return GroundTruth(f.kind, f.switch, self._ns(f.onset_s), self._ns(f.offset_s),
                           # a switch without incast never pauses: the misconfiguration cannot show
                           expect_alert=busy and not f.quiet,
                           detail={"priority": f.priority, "marking_factor": f.marking_factor, "quiet": f.quiet,
                                   "incast": f.incast, "busy": busy})

    def _fabric_fault_truth(self, f) -> GroundTruth:
        if isinstance(f, EcmpPolarization):
            s = self._switches.index(f.switch)
            sends = bool(np.any((self._f_la == self._leaf_row[s]) & (self._routes_base >= 0)))   # to a spine
            return GroundTruth(f.kind, f.switch, self._ns(f.onset_s), self._ns(f.offset_s),
                               related=tuple(port_path(f.switch, p) for p in f.hot_uplinks),
                               expect_alert=f.duration_s >= f.min_alert_s and sends and not f.rotate_s > 0,
                               detail={"hot_uplinks": list(f.hot_uplinks), "leaf_sends": sends, "rotate_s": f.rotate_s})
        ports = tuple(port_path(sw, p) for sw, p in f.ports)
        holders = []
        for sw, p in f.ports:
            j = self._sp_peer_sp[self._sp_key[(sw, p)]]
            holders.append(port_path(self._switches[self._sp_switch[j]], self._sp_name[j]))
        return GroundTruth(f.kind, ports[0], self._ns(f.onset_s), self._ns(f.offset_s),
                           related=ports[1:] + tuple(holders), expect_alert=f.offset_s - f.onset_s >= f.min_alert_s,
                           detail={"priority": 3, "switches": len({sw for sw, _ in f.ports}),
                                   "duration_s": f.offset_s - f.onset_s})

    def _ns(self, t: float) -> int | None:
        return None if t == INF else self.start_unix_ns + int(round(t * 1e9))
