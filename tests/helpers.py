"""Small builders of wire-format snapshots for tests."""
from __future__ import annotations

import time

from fabricwatch.protos.v1 import telemetry_pb2 as pb

NIC_COUNTERS = ["port_xmit_data", "port_rcv_data", "tx_prio3_pause", "tx_prio3_pause_duration",
                "rx_prio3_pause", "rx_prio3_pause_duration"]
NIC_GAUGES = ["netdev_speed_mbps", "pcie_width_current", "pcie_width_max", "pcie_gen_current", "pcie_gen_max"]


def nic_snapshot(source="node-0001", t_ns=None, seq=1, rates=None, n_ports=8, counters=None, cluster="c1",
                 state="4: ACTIVE") -> pb.Snapshot:
    """A node snapshot with one NIC block; `rates` maps port index -> sysfs rate string."""
    t_ns = time.time_ns() if t_ns is None else t_ns
    rates = rates or {}
    snap = pb.Snapshot(cluster=cluster, source=source, source_kind=pb.SOURCE_KIND_NODE, time_unix_ns=t_ns, seq=seq)
    block = snap.blocks.add(entity_kind=pb.ENTITY_KIND_NIC_PORT, counter_names=NIC_COUNTERS, gauge_names=NIC_GAUGES)
    for i in range(n_ports):
        rate = rates.get(i, "400 Gb/sec (4X NDR)")
        speed = float(rate.split()[0]) * 1000
        block.entities.add(
            id=f"mlx5_{i}/1",
            counters=counters[i] if counters else [seq * 1000 + i] * len(NIC_COUNTERS),
            gauges=[speed, 16, 16, 5, 5],
            labels={"rate": rate, "state": state, "phys_state": "5: LinkUp", "link_layer": "Ethernet",
                    "netdev": f"eth{i}"},
        )
    return snap


def gpu_block(snap: pb.Snapshot, util=90.0, gen=5, gen_max=5, width=16, width_max=16, n=8) -> None:
    names = ["utilization_gpu_pct", "pcie_gen_current", "pcie_gen_max", "pcie_width_current", "pcie_width_max",
             "temperature_c", "power_mw"]
    block = snap.blocks.add(entity_kind=pb.ENTITY_KIND_GPU, counter_names=["ecc_uncorrected_volatile_total"],
                            gauge_names=names)
    for i in range(n):
        block.entities.add(id=f"gpu{i}", counters=[0], gauges=[util, gen, gen_max, width, width_max, 60, 500_000])
