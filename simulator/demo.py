"""The README demo's scenario: a healthy noisy cluster with three faults in its first ~30 s
(`fabricwatch up --simulate`, `fabricwatch simulate --scenario demo`)."""
from __future__ import annotations

from fabricwatch.models.topology import Topology, rail_optimised
from fabricwatch.simulator.cluster import Fault
from fabricwatch.simulator.fabric_faults import LinkDowngrade, PfcStorm
from fabricwatch.simulator.host_faults import Straggler
from fabricwatch.simulator.workload import auto_jobs


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
