"""The topology file (docs/topology.md): its schema, and the plain `Topology` it loads into.

The schema is a tree of `fabricwatch.config_schema.Section` models, kept out of models/
(which stays free of pydantic): this module checks each entry's keys and types, naming the
entry (``nic_ports[3].port: expected an integer, got 'one'``); `models.topology.Topology`
then checks the cabling as a whole (a switch port cabled twice, an unknown switch).

>>> topo = topology_from_dict({"switches": [{"name": "leaf-0"}], "nic_ports": [
...     {"node": "n1", "device": "mlx5_0", "switch": "leaf-0", "switch_port": "Ethernet0"}]})
>>> topo.nodes, topo.nic("n1", "mlx5_0/1").switch_port
(['n1'], 'Ethernet0')
>>> topology_from_dict({"switches": [{"name": "leaf-0", "rol": "leaf"}]})
Traceback (most recent call last):
fabricwatch.models.topology.TopologyError: switches[0] (leaf-0): unknown key 'rol' (allowed: name, role)
"""
from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any

import yaml
from pydantic import Field

from fabricwatch.config_schema import Name, Section, Within, validate
from fabricwatch.models.topology import DEFAULT_NIC_RATE, NicPort, Switch, SwitchLink, Topology, TopologyError


class SwitchEntry(Section):
    name: Name = Field(description="switch name, as its collector reports it")
    role: str = Field("leaf", description="`leaf` or `spine`")


class NicPortEntry(Section):
    node: Name = Field(description="the node, as its collector reports it")
    device: Name = Field(description="IB device name (`mlx5_0`); the entity id is `<device>/<port>`")
    port: Annotated[int, Within(1, 255)] = Field(1, description="IB port number of the device")
    rail: Annotated[int, Within(0, 1023)] = Field(0, description="the rail (leaf) this NIC belongs to")
    gpu_index: Annotated[int, Within(0, 1023)] | None = Field(
        None, description="the GPU this NIC serves (PCIe affinity); default: the rail")
    netdev: str = Field("", description="its network interface (`eth0`)")
    switch: Name = Field(description="the leaf the port is cabled to")
    switch_port: Name = Field(description="the leaf's port")
    nominal_rate: str = Field(DEFAULT_NIC_RATE, description="the sysfs `rate` string of a healthy port")


class LinkEntry(Section):
    a_switch: Name = Field(description="one end's switch")
    a_port: Name = Field(description="its port")
    b_switch: Name = Field(description="the other end's switch")
    b_port: Name = Field(description="its port")
    nominal_speed_gbps: Annotated[float, Within(0.0, 100_000.0)] = Field(400.0, description="link speed, Gb/s")


class TopologyFile(Section):
    cluster: str = Field("default", description="the cluster's name")
    gpus_per_node: Annotated[int, Within(1, 1024)] = Field(8, description="GPUs per node")
    nodes: list[Name] | None = Field(None, description="the nodes; default: those of `nic_ports`")
    switches: list[SwitchEntry] = Field(description="every leaf and spine")
    nic_ports: list[NicPortEntry] = Field(default_factory=list, description="one entry per NIC port: which "
                                                                           "switch port it is cabled to")
    links: list[LinkEntry] = Field(default_factory=list, description="switch-to-switch cables")


def topology_from_dict(doc: Any) -> Topology:
    """A `Topology` from a parsed topology document; `TopologyError` names the bad entry."""
    f = validate(TopologyFile, doc, error=TopologyError)
    nics = [NicPort(node=n.node, device=n.device, port=n.port, rail=n.rail,
                    gpu_index=n.rail if n.gpu_index is None else n.gpu_index, netdev=n.netdev, switch=n.switch,
                    switch_port=n.switch_port, nominal_rate=n.nominal_rate) for n in f.nic_ports]
    links = [SwitchLink(link.a_switch, link.a_port, link.b_switch, link.b_port, link.nominal_speed_gbps)
             for link in f.links]
    nodes = list(f.nodes) if f.nodes is not None else sorted({n.node for n in nics})
    return Topology(f.cluster, nodes, f.gpus_per_node, {s.name: Switch(s.name, s.role) for s in f.switches},
                    nics, links)


def load_topology(path: str | Path) -> Topology:
    try:
        with open(path, encoding="utf-8") as fh:
            doc = yaml.safe_load(fh)
    except (OSError, yaml.YAMLError) as exc:
        raise TopologyError(f"{path}: cannot read the topology: {exc}") from None
    try:
        return topology_from_dict(doc)
    except TopologyError as exc:
        raise TopologyError(f"{path}: {exc}") from None
