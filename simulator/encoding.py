"""The simulated cluster's state as the snapshots the real collectors would send, and when.

A node's tick is one `Snapshot` (a GPU block, a NIC_PORT block, XID and ECC events, the
`RankStep` and `RankProgress` messages of its ranks, on the node's own clock); a switch's
one SWITCH_PORT block. With a `Cadence` (``COLLECTOR_CADENCE``: what the collectors do)
a node's 100 ms tick carries only its PFC columns (the node collector's ``ethtool_pfc``
group, in its layout) and every second a second snapshot half a PFC interval later carries
the rest, the switches' (gNMI) with it. Labels are the strings sysfs and NVML print.

>>> COLLECTOR_CADENCE.full_every, Cadence(0.2, 1.0).full_every
(10, 5)
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass

import numpy as np

from fabricwatch.counters import GPU_GAUGES, NIC_GAUGES
from fabricwatch.protos.v1 import telemetry_pb2 as pb
from fabricwatch.simulator.columns import (
    _NC, _SWITCH_ALL, GPU_COUNTERS, NIC_COUNTERS, NIC_FULL_COUNTERS, NIC_PFC_COUNTERS, NIC_PFC_GAUGES, SWITCH_COUNTERS,
    SWITCH_PORT_GAUGES,
)
from fabricwatch.simulator.fault_state import _FaultState
from fabricwatch.simulator.host_faults import XID_TEXT


_DOWN_RATE = "40 Gb/sec (4X QDR)"  # what mlx5 prints for a RoCE port with no operational mode

_DGX_NIC_BDF = ("0000:18:00.0", "0000:40:00.0", "0000:4f:00.0", "0000:5e:00.0",
                "0000:9a:00.0", "0000:c0:00.0", "0000:ce:00.0", "0000:dc:00.0")
_DGX_GPU_BDF = ("0000:1b:00.0", "0000:43:00.0", "0000:52:00.0", "0000:61:00.0",
                "0000:9d:00.0", "0000:c3:00.0", "0000:d1:00.0", "0000:df:00.0")


@dataclass(frozen=True)
class Cadence:
    """When the real collectors read what (seconds): PFC counters fast, the rest slower."""

    pfc_interval_s: float = 0.1      # the node collector's `intervals.ethtool_pfc`
    full_interval_s: float = 1.0     # its sysfs / ethtool / NVML intervals, and the switches' gNMI SAMPLE

    def __post_init__(self) -> None:
        ratio = self.full_interval_s / self.pfc_interval_s
        if not (0.05 <= self.pfc_interval_s <= self.full_interval_s and abs(ratio - round(ratio)) < 1e-9):
            raise ValueError(f"cadence: the full interval ({self.full_interval_s}) must be a whole multiple of "
                             f"the PFC interval ({self.pfc_interval_s}), which is >= 0.05 s")

    @property
    def full_every(self) -> int:
        return int(round(self.full_interval_s / self.pfc_interval_s))


#: The collectors' defaults (docs/collectors.md): PFC every 100 ms, everything else every second.
COLLECTOR_CADENCE = Cadence()


def _gpu_uuid(cluster: str, node: str, gpu: int) -> str:
    h = hashlib.md5(f"{cluster}/{node}/{gpu}".encode()).hexdigest()
    return f"GPU-{h[:8]}-{h[8:12]}-{h[12:16]}-{h[16:20]}-{h[20:32]}"


class SnapshotEncoder:
    """`ClusterSimulator`'s snapshots: its state matrices and this tick's faults, ranks and events as protobuf."""

    def _nic_link_labels(self, p: int, rate_now: dict, down_now: np.ndarray, down_phys: dict) -> tuple[str, str, str]:
        """The sysfs ``rate``, ``state`` and ``phys_state`` strings of NIC port p now."""
        if down_now[p]:
            return _DOWN_RATE, "1: DOWN", down_phys.get(p, "3: Disabled")
        return rate_now.get(p, self._nics[p].nominal_rate), "4: ACTIVE", "5: LinkUp"

    def _build_static(self) -> None:
        """The parts of every snapshot that never change: ids and static label columns."""
        nics, G = self._nics, self.G
        # static identity labels
        self._nic_bdf = [(_DGX_NIC_BDF[k] if k < 8 else f"0000:{(0x18 + 16 * k) % 256:02x}:00.0")
                         for k in (n.rail for n in nics)]
        self._nic_netdev = [n.netdev or f"eth{n.rail}" for n in nics]
        self._gpu_ids = [f"gpu{g}" for g in range(G)]
        self._gpu_bdf = [(_DGX_GPU_BDF[g] if g < 8 else f"0000:{(0x1b + 16 * g) % 256:02x}:00.0") for g in range(G)]
        self._gpu_labels = [[{"uuid": _gpu_uuid(self._cluster, node, g), "pci_bdf": self._gpu_bdf[g]}
                             for g in range(G)] for node in self._nodes]
        self._nic_ids_of_node = [[self._p_eid[p] for p in ports.tolist()] for ports in self._node_ports]
        self._nic_static_labels = [
            [pb.LabelColumn(name="link_layer", values=["Ethernet"] * len(ports)),
             pb.LabelColumn(name="netdev", values=[self._nic_netdev[p] for p in ports.tolist()]),
             pb.LabelColumn(name="pci_bdf", values=[self._nic_bdf[p] for p in ports.tolist()])]
            for ports in self._node_ports]
        self._nic_netdev_labels = [[pb.LabelColumn(name="netdev", values=[self._nic_netdev[p] for p in ports.tolist()])]
                                   for ports in self._node_ports]
        self._nic_pfc_cols = np.array([_NC[c] for c in NIC_PFC_COUNTERS], dtype=np.intp)
        self._nic_full_cols = np.array([_NC[c] for c in NIC_FULL_COUNTERS], dtype=np.intp)
        self._nic_speed_col = np.array([NIC_GAUGES.index(g) for g in NIC_PFC_GAUGES], dtype=np.intp)
        self._gpu_static_labels = [
            [pb.LabelColumn(name=name, values=[lab[name] for lab in node]) for name in ("uuid", "pci_bdf")]
            for node in self._gpu_labels]
        self._sw_ids = [[self._sp_name[p] for p in ports.tolist()] for ports in self._switch_ports]

    def _snapshots(self, fs: _FaultState, steps: list, t1: float) -> list[pb.Snapshot]:
        """Every snapshot of this tick: columnar blocks filled straight from the state matrices.

        With a cadence, a node's tick carries its PFC columns, and every `Cadence.full_every`
        ticks a second snapshot half a PFC interval later carries the rest; switches report
        on those ticks only.
        """
        rng = self._rng
        N, G = len(self._nodes), self.G
        t1_ns = self.start_unix_ns + int(round(t1 * 1e9))
        node_off = self._node_clock_ns + rng.normal(0, 3e5, N) + fs.node_skew_s * 1e9
        skew_ns = np.round(node_off).astype(np.int64)
        node_ts = (t1_ns + skew_ns).tolist()
        steps_by_node = self._rank_steps_by_node(steps, skew_ns) if self.rank_steps else {}
        beats_by_node = self._heartbeats_by_node(skew_ns) if self.rank_steps else {}
        rate_now, down_now, down_phys = self._fs_labels
        cadence = self.cadence
        full = cadence is None or self._ticks % cadence.full_every == 0
        out: list[pb.Snapshot] = []
        live = ~fs.node_down
        self._seq_node += live * (1 + (cadence is not None and full))
        seq = self._seq_node.tolist()
        half_ns = int(round(self.interval_s * 5e8))
        for n in np.nonzero(live)[0].tolist():
            ports = self._node_ports[n]
            if cadence is not None:
                pfc = pb.Snapshot(cluster=self._cluster, source=self._nodes[n], source_kind=pb.SOURCE_KIND_NODE,
                                  time_unix_ns=node_ts[n], seq=seq[n] - full)
                pfc.blocks.add(entity_kind=pb.ENTITY_KIND_NIC_PORT, entity_ids=self._nic_ids_of_node[n],
                               counter_names=NIC_PFC_COUNTERS, gauge_names=NIC_PFC_GAUGES,
                               counters=self._nic.values[ports][:, self._nic_pfc_cols].ravel().tolist(),
                               gauges=self._nic_gauges[ports][:, self._nic_speed_col].ravel().tolist(),
                               labels=self._nic_netdev_labels[n])
                self._events_into(pfc, fs, n, skew_ns)
                pfc.rank_steps.extend(steps_by_node.get(n, ()))
                pfc.rank_progress.extend(beats_by_node.get(n, ()))
                out.append(pfc)
                if not full:
                    continue
            snap = pb.Snapshot(cluster=self._cluster, source=self._nodes[n], source_kind=pb.SOURCE_KIND_NODE,
                               time_unix_ns=node_ts[n] + (half_ns if cadence is not None else 0), seq=seq[n])
            rows = slice(n * G, (n + 1) * G)
            snap.blocks.add(entity_kind=pb.ENTITY_KIND_GPU, entity_ids=self._gpu_ids, counter_names=GPU_COUNTERS,
                            gauge_names=GPU_GAUGES, counters=self._gpu.values[rows].ravel().tolist(),
                            gauges=self._gpu_gauges[rows].ravel().tolist(), labels=self._gpu_static_labels[n])
            names, values = NIC_COUNTERS, self._nic.values[ports]
            if cadence is not None:
                names, values = NIC_FULL_COUNTERS, values[:, self._nic_full_cols]
            nic = snap.blocks.add(entity_kind=pb.ENTITY_KIND_NIC_PORT, entity_ids=self._nic_ids_of_node[n],
                                  counter_names=names, gauge_names=NIC_GAUGES, counters=values.ravel().tolist(),
                                  gauges=self._nic_gauges[ports].ravel().tolist(), labels=self._nic_static_labels[n])
            links = [self._nic_link_labels(p, rate_now, down_now, down_phys) for p in ports.tolist()]
            for name, values in zip(("rate", "state", "phys_state"), zip(*links)):
                nic.labels.add(name=name, values=values)
            if cadence is None:
                self._events_into(snap, fs, n, skew_ns)
                snap.rank_steps.extend(steps_by_node.get(n, ()))
                snap.rank_progress.extend(beats_by_node.get(n, ()))
            out.append(snap)
        if not full:
            return out
        S = len(self._switches)
        sw_ts = (t1_ns + np.round(rng.normal(0, 2e5, S)).astype(np.int64)).tolist()
        self._seq_sw += 1
        seq = self._seq_sw.tolist()
        for s in range(S):
            rows = self._switch_ports[s]
            snap = pb.Snapshot(cluster=self._cluster, source=self._switches[s], source_kind=pb.SOURCE_KIND_SWITCH,
                               time_unix_ns=sw_ts[s], seq=seq[s])
            names = _SWITCH_ALL if self.switch_tx_pause_duration else SWITCH_COUNTERS
            snap.blocks.add(entity_kind=pb.ENTITY_KIND_SWITCH_PORT, entity_ids=self._sw_ids[s],
                            counter_names=names, gauge_names=SWITCH_PORT_GAUGES,
                            counters=self._sw.values[rows][:, :len(names)].ravel().tolist(),
                            gauges=self._sw_gauges[rows].ravel().tolist())
            out.append(snap)
        return out

    def _events_into(self, snap: pb.Snapshot, fs: _FaultState, n: int, skew_ns: np.ndarray) -> None:
        for kind, gpu, code, t in fs.events.get(n, ()):
            if kind == "xid":
                detail = f"Xid (PCI:{self._gpu_bdf[gpu][:-2]}): {code}, {XID_TEXT.get(code, 'Unknown Xid')}"
            else:
                detail = f"{code} double-bit ECC error(s)"
            snap.events.add(entity_id=self._gpu_ids[gpu], kind=kind, code=code if kind == "xid" else 0,
                            time_unix_ns=self.start_unix_ns + int(round(t * 1e9)) + int(skew_ns[n]), detail=detail)

    def _rank_steps_by_node(self, steps: list, skew_ns: np.ndarray) -> dict[int, list[pb.RankStep]]:
        """`RankStep` messages of the steps that ended this tick, grouped by node index."""
        out: dict[int, list[pb.RankStep]] = {}
        for jr, step, start, seconds, busy in steps:
            world = jr.world
            start_ns = (self.start_unix_ns + int(round(start * 1e9)) + skew_ns[jr.rank_node]).tolist()
            step_s = np.broadcast_to(seconds, (world,)).tolist()
            busy_s = np.broadcast_to(busy, (world,)).tolist()
            for r, (node, gpu) in enumerate(zip(jr.rank_node.tolist(), jr.rank_gpu.tolist())):
                out.setdefault(node, []).append(pb.RankStep(
                    job_id=jr.job.job_id, rank=r, world_size=world, node=self._nodes[node], local_gpu=gpu, step=step,
                    start_unix_ns=start_ns[r], step_seconds=step_s[r], busy_seconds=busy_s[r],
                    collective_wait_seconds=step_s[r] - busy_s[r]))
        return out

    def _heartbeats_by_node(self, skew_ns: np.ndarray) -> dict[int, list[pb.RankProgress]]:
        """This tick's heartbeats as `RankProgress` messages, on their node's clock, by node index."""
        out: dict[int, list[pb.RankProgress]] = {}
        base = self.start_unix_ns
        for jr, r, tb, entered, completed, last_e, last_c, step in self._beats_out:
            node = int(jr.rank_node[r])
            skew = int(skew_ns[node])
            out.setdefault(node, []).append(pb.RankProgress(
                job_id=jr.job.job_id, rank=r, world_size=jr.world, node=self._nodes[node],
                local_gpu=int(jr.rank_gpu[r]), time_unix_ns=base + int(round(tb * 1e9)) + skew,
                collectives_entered=entered, collectives_completed=completed,
                last_entered_unix_ns=base + int(round(last_e * 1e9)) + skew if last_e is not None else 0,
                last_completed_unix_ns=base + int(round(last_c * 1e9)) + skew if last_c is not None else 0,
                step=max(step, 0)))
        return out
