"""Link flaps through the pipeline on simulated telemetry: flaps yes, outages and admin toggles no."""
import pytest

from fabricwatch.models.topology import rail_optimised
from fabricwatch.simulator.cluster import ClusterSimulator
from fabricwatch.simulator.fabric_faults import AdminToggle, LinkFlap
from fabricwatch.simulator.host_faults import NodeReboot
from fabricwatch.streams.pipeline import DetectionPipeline


def flaps(faults, seconds=120, seed=4):
    topo = rail_optimised("c1", n_nodes=8, nodes_per_unit=8, n_spines=2)
    sim = ClusterSimulator(topo, seed=seed, faults=faults)
    pipeline = DetectionPipeline(topology=topo)
    out = []
    for _ in range(seconds):
        for snap in sim.tick():
            out += [(f.state, f.entity.path(), f.severity, (f.detected_ns - sim.start_unix_ns) / 1e9)
                    for f in pipeline.process(snap) if f.kind == "link_flap"]
    return topo, out


@pytest.mark.slow
def test_flap_is_flagged_on_both_ends_once_the_link_is_back():
    topo, out = flaps([LinkFlap("node-0003", "mlx5_2/1", onset_s=20.5, down_s=2.0)], seconds=40)
    leaf = topo.nic("node-0003", "mlx5_2/1")
    opened = {path: t for state, path, _, t in out if state == "open"}
    assert set(opened) == {"c1/node-0003/mlx5_2/1", f"c1/{leaf.switch}/{leaf.switch_port}"}
    assert all(22.0 <= t <= 24.0 for t in opened.values())   # after the 2 s down, within a sample


@pytest.mark.slow
def test_repeated_flaps_update_and_become_critical():
    _, out = flaps([LinkFlap("node-0003", "mlx5_2/1", onset_s=10.5, down_s=1.0, flaps=4, period_s=8.0)],
                   seconds=60)
    nic = [(state, severity) for state, path, severity, _ in out if path == "c1/node-0003/mlx5_2/1"]
    assert nic[0] == ("open", "warning") and ("update", "critical") in nic
    assert [s for s, _ in nic].count("open") == 1


@pytest.mark.slow
def test_reboot_is_an_outage_not_a_flap():
    _, out = flaps([NodeReboot("node-0002", onset_s=10.0, down_s=60.0, restart_s=20.0)], seconds=120)
    assert out == []


def test_admin_toggle_is_not_a_flap_on_either_end():
    topo, out = flaps([AdminToggle("leaf-u0-r1", "Ethernet4", onset_s=10.5, down_s=5.0),     # to node-0005
                       AdminToggle("leaf-u0-r2", "Ethernet8", onset_s=12.5, down_s=5.0)],    # uplink to a spine
                      seconds=50)
    assert out == []


@pytest.mark.slow
def test_quiet_link_resolves():
    _, out = flaps([LinkFlap("node-0003", "mlx5_2/1", onset_s=5.5, down_s=1.0)], seconds=320)
    states = [s for s, path, _, _ in out if path == "c1/node-0003/mlx5_2/1"]
    assert states == ["open", "resolved"]
