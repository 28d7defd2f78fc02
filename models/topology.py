"""The fabric topology: which NIC port meets which switch port, and how switches connect.

Detectors need it to tell a PFC storm's source from its victims and to know each link's
nominal rate. It is read from a YAML file (format in docs/topology.md, loaded by
`fabricwatch.topology_file`, whose schema keeps pydantic out of models/) or generated for a
rail-optimised leaf/spine cluster (the layout of DGX SuperPODs: NIC rail r of every node
in a scalable unit goes to leaf r of that unit; every leaf goes to every spine).

>>> topo = rail_optimised("sim", n_nodes=4, nodes_per_unit=2, n_spines=2)
>>> len(topo.nodes), len(topo.nic_ports), len(topo.switches)
(4, 32, 18)
>>> nic = topo.nic("node-0003", "mlx5_2/1")
>>> nic.switch, nic.switch_port, nic.rail
('leaf-u1-r2', 'Ethernet0', 2)
>>> topo.peer_of("leaf-u1-r2", "Ethernet0").node
'node-0003'
"""
from __future__ import annotations

from dataclasses import dataclass, field

from .linkrate import parse_ib_rate

DEFAULT_NIC_RATE = "400 Gb/sec (4X NDR)"


class TopologyError(ValueError):
    """A topology file that does not describe a usable fabric."""


@dataclass(frozen=True)
class NicPort:
    node: str
    device: str            # "mlx5_0"
    port: int              # 1
    rail: int
    gpu_index: int         # the GPU this NIC serves (PCIe affinity)
    netdev: str            # "eth0" / "ibp12s0"
    switch: str            # leaf the port is cabled to
    switch_port: str       # leaf port name
    nominal_rate: str = DEFAULT_NIC_RATE  # sysfs `rate` string expected when healthy

    @property
    def entity_id(self) -> str:
        return f"{self.device}/{self.port}"

    @property
    def nominal_gbps(self) -> float:
        parsed = parse_ib_rate(self.nominal_rate)
        return parsed.gbps if parsed else 0.0


@dataclass(frozen=True)
class SwitchLink:
    """A switch-to-switch cable (leaf uplink to spine)."""
    a_switch: str
    a_port: str
    b_switch: str
    b_port: str
    nominal_speed_gbps: float = 400.0


@dataclass(frozen=True)
class Switch:
    name: str
    role: str  # "leaf" | "spine"


@dataclass(frozen=True)
class SwitchPortPeer:
    """What is at the far end of a switch port: a NIC, or another switch's port."""
    nic: NicPort | None = None
    switch: str = ""
    port: str = ""

    @property
    def node(self) -> str:
        return self.nic.node if self.nic else ""


@dataclass
class Topology:
    cluster: str
    nodes: list[str]
    gpus_per_node: int
    switches: dict[str, Switch]
    nic_ports: list[NicPort]
    links: list[SwitchLink]
    _nic_by_id: dict[tuple[str, str], NicPort] = field(default_factory=dict, repr=False)
    _peer: dict[tuple[str, str], SwitchPortPeer] = field(default_factory=dict, repr=False)

    def __post_init__(self) -> None:
        for nic in self.nic_ports:
            key = (nic.node, nic.entity_id)
            if key in self._nic_by_id:
                raise TopologyError(f"NIC port {nic.node}:{nic.entity_id} is listed twice")
            if nic.switch not in self.switches:
                raise TopologyError(f"NIC port {nic.node}:{nic.entity_id} is cabled to unknown switch {nic.switch!r}")
            if parse_ib_rate(nic.nominal_rate) is None:
                raise TopologyError(f"NIC port {nic.node}:{nic.entity_id}: bad nominal_rate {nic.nominal_rate!r}")
            self._nic_by_id[key] = nic
            self._claim(nic.switch, nic.switch_port, SwitchPortPeer(nic=nic))
        for link in self.links:
            for sw in (link.a_switch, link.b_switch):
                if sw not in self.switches:
                    raise TopologyError(f"link {link} names unknown switch {sw!r}")
            self._claim(link.a_switch, link.a_port, SwitchPortPeer(switch=link.b_switch, port=link.b_port))
            self._claim(link.b_switch, link.b_port, SwitchPortPeer(switch=link.a_switch, port=link.a_port))

    def _claim(self, switch: str, port: str, peer: SwitchPortPeer) -> None:
        if (switch, port) in self._peer:
            raise TopologyError(f"switch port {switch}:{port} is cabled twice")
        self._peer[(switch, port)] = peer

    def nic(self, node: str, entity_id: str) -> NicPort | None:
        return self._nic_by_id.get((node, entity_id))

    def nics_of(self, node: str) -> list[NicPort]:
        return [n for n in self.nic_ports if n.node == node]

    def peer_of(self, switch: str, port: str) -> SwitchPortPeer | None:
        return self._peer.get((switch, port))

    def ports_of(self, switch: str) -> list[str]:
        return [p for (s, p) in self._peer if s == switch]

    def to_dict(self) -> dict:
        return {
            "cluster": self.cluster,
            "gpus_per_node": self.gpus_per_node,
            "nodes": list(self.nodes),
            "switches": [{"name": s.name, "role": s.role} for s in self.switches.values()],
            "nic_ports": [
                {
                    "node": n.node, "device": n.device, "port": n.port, "rail": n.rail,
                    "gpu_index": n.gpu_index, "netdev": n.netdev, "switch": n.switch,
                    "switch_port": n.switch_port, "nominal_rate": n.nominal_rate,
                }
                for n in self.nic_ports
            ],
            "links": [
                {"a_switch": l.a_switch, "a_port": l.a_port, "b_switch": l.b_switch,
                 "b_port": l.b_port, "nominal_speed_gbps": l.nominal_speed_gbps}
                for l in self.links
            ],
        }


def rail_optimised(
    cluster: str,
    n_nodes: int,
    gpus_per_node: int = 8,
    nodes_per_unit: int = 32,
    n_spines: int = 8,
    nic_rate: str = DEFAULT_NIC_RATE,
) -> Topology:
    """A rail-optimised two-tier fabric: one NIC per GPU, leaf (unit, rail), full spine mesh."""
    if n_nodes < 1 or gpus_per_node < 1 or nodes_per_unit < 1 or n_spines < 1:
        raise TopologyError("n_nodes, gpus_per_node, nodes_per_unit and n_spines must be >= 1")
    nodes = [f"node-{i + 1:04d}" for i in range(n_nodes)]
    n_units = (n_nodes + nodes_per_unit - 1) // nodes_per_unit
    switches: dict[str, Switch] = {}
    nics: list[NicPort] = []
    links: list[SwitchLink] = []
    for s in range(n_spines):
        switches[f"spine-{s}"] = Switch(f"spine-{s}", "spine")
    for u in range(n_units):
        for r in range(gpus_per_node):
            leaf = f"leaf-u{u}-r{r}"
            switches[leaf] = Switch(leaf, "leaf")
            for s in range(n_spines):
                # uplinks numbered after the downlinks; spine ports by (unit, rail)
                links.append(SwitchLink(leaf, f"Ethernet{nodes_per_unit + s}", f"spine-{s}",
                                        f"Ethernet{u * gpus_per_node + r}"))
    for i, node in enumerate(nodes):
        u, slot = divmod(i, nodes_per_unit)
        for r in range(gpus_per_node):
            nics.append(NicPort(node=node, device=f"mlx5_{r}", port=1, rail=r, gpu_index=r,
                                netdev=f"eth{r}", switch=f"leaf-u{u}-r{r}",
                                switch_port=f"Ethernet{slot}", nominal_rate=nic_rate))
    return Topology(cluster, nodes, gpus_per_node, switches, nics, links)
