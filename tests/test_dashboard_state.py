"""The dashboard's in-memory model (`dashboard/state.py`, `series.py`), its views (`views.py`) and record
decoding (`dashboard/feed.py`)."""
from __future__ import annotations

import numpy as np
import pytest
from helpers import gpu_block, nic_snapshot, telemetry_value

from fabricwatch.dashboard.feed import apply_record
from fabricwatch.dashboard.series import SeriesTable
from fabricwatch.dashboard.shapes import entity_path
from fabricwatch.dashboard.state import DashboardLimits, FabricState
from fabricwatch.dashboard.views import FeedFilter, entity_view, fabric_view, feed_view, jobs_view
from fabricwatch.models.topology import rail_optimised
from fabricwatch.protos.v1 import events_pb2 as ev
from fabricwatch.protos.v1 import telemetry_pb2 as pb
from fabricwatch.streams import topics

S = 1_000_000_000
T0 = 1_800_000_000 * S
WORDS_PER_S_AT_400G = 12_500_000_000       # 4-byte words: 50 GB/s


def nic_tick(t_s: int, seq: int, xmit_words: int, rcv_words: int, tx_pause_us: int, rx_pause_us: int = 0,
             rates=None, source="node-0001", cluster="c1") -> pb.Snapshot:
    counters = [[xmit_words, rcv_words, 0, tx_pause_us, 0, rx_pause_us]] * 8
    return nic_snapshot(source=source, t_ns=T0 + t_s * S, seq=seq, counters=counters, rates=rates, cluster=cluster)


def path(**kw) -> ev.EntityPath:
    return ev.EntityPath(cluster="c1", **kw)


def anomaly(kind, entity, dedup, lifecycle=ev.LIFECYCLE_OPEN, related=(), t_s=10, severity=ev.SEVERITY_CRITICAL,
            **kw) -> ev.AnomalyEvent:
    return ev.AnomalyEvent(id=f"{dedup}|{lifecycle}|{t_s}", dedup_key=dedup, kind=kind, severity=severity,
                           lifecycle=lifecycle, entity=entity, related=list(related), detected_unix_ns=T0 + t_s * S,
                           evidence=[ev.Evidence(name="x", value=1.0, threshold=0.5, unit="s/s")], **kw)


def storm_event(lifecycle=ev.LIFECYCLE_OPEN, t_s=10) -> ev.AnomalyEvent:
    return anomaly("pfc_storm", path(node="node-0001", device="mlx5_5", port="1"), "pfc_storm:c1/node-0001/mlx5_5/1",
                   lifecycle, t_s=t_s,
                   related=[path(switch="leaf-u0-r5", port="Ethernet1"),
                            path(node="node-0002", device="mlx5_5", port="1")])


# ------------------------------------------------------------------------ series
def test_nic_rates_and_pause_duty_from_raw_counters():
    state = FabricState(cluster="c1")
    state.add_snapshot(nic_tick(0, 1, 0, 0, 0))
    state.add_snapshot(nic_tick(1, 2, WORDS_PER_S_AT_400G, WORDS_PER_S_AT_400G // 2, 500_000, 250_000,
                                rates={3: "200 Gb/sec (4X HDR)"}))
    s = state.series["nic_port"].series("node-0001/mlx5_0/1")
    assert s["t_ms"] == [(T0 + i * S) // 1_000_000 for i in (0, 1)]
    assert s["tx_gbps"] == [None, 400.0]          # no honest rate from the first sample
    assert s["rx_gbps"] == [None, 200.0]
    assert s["tx_pause_duty"] == [None, 0.5] and s["rx_pause_duty"] == [None, 0.25]
    assert s["link_rate_gbps"] == [400.0, 400.0]
    assert state.series["nic_port"].latest("node-0001/mlx5_3/1")["link_rate_gbps"] == 200.0
    assert state.nodes["node-0001"].nics == {r: f"mlx5_{r}/1" for r in range(8)}   # rails learnt from the names


def test_a_counter_reset_leaves_a_gap_not_a_negative_rate():
    state = FabricState()
    state.add_snapshot(nic_tick(0, 1, 10 * WORDS_PER_S_AT_400G, 0, 0))
    state.add_snapshot(nic_tick(1, 2, 5, 0, 0))                       # reboot: totals restart
    state.add_snapshot(nic_tick(2, 3, 5 + WORDS_PER_S_AT_400G // 4, 0, 0))
    assert state.series["nic_port"].series("node-0001/mlx5_0/1")["tx_gbps"] == [None, None, 100.0]


def test_gpu_and_switch_series_and_learnt_switch_roles():
    state = FabricState()
    snap = nic_tick(0, 1, 0, 0, 0)
    gpu_block(snap, util=37.0)
    state.add_snapshot(snap)
    assert state.series["gpu"].latest("node-0001/gpu5")["gpu_util_pct"] == 37.0
    assert state.nodes["node-0001"].gpus == set(range(8))
    for name, t in (("spine-3", 0), ("leaf-u0-r1", 0), ("spine-3", 1)):
        sw = pb.Snapshot(cluster="c1", source=name, source_kind=pb.SOURCE_KIND_SWITCH, time_unix_ns=T0 + t * S)
        sw.blocks.add(entity_kind=pb.ENTITY_KIND_SWITCH_PORT, entity_ids=["Ethernet0"],
                      counter_names=["out-octets", "in-octets", "pfc3-rx-pause-duration-us"],
                      gauge_names=["port_speed_gbps"], counters=[t * 25_000_000_000, 0, t * 900_000], gauges=[400.0])
        state.add_snapshot(sw)
    assert (state.switches["spine-3"].role, state.switches["leaf-u0-r1"].role) == ("spine", "leaf")
    latest = state.series["switch_port"].latest("spine-3/Ethernet0")
    assert latest["tx_gbps"] == 200.0 and latest["link_rate_gbps"] == 400.0
    assert latest["rx_pause_duty"] == pytest.approx(0.9, abs=1e-3)


def test_ring_buffer_keeps_the_latest_points_only():
    state = FabricState(limits=DashboardLimits(history_points=4))
    for i in range(10):
        state.add_snapshot(nic_tick(i, i + 1, i * WORDS_PER_S_AT_400G, 0, 0))
    s = state.series["nic_port"].series("node-0001/mlx5_0/1")
    assert s["t_ms"] == [(T0 + i * S) // 1_000_000 for i in range(6, 10)]
    assert s["tx_gbps"] == [400.0] * 4


def test_series_memory_is_bounded_per_entity_and_in_entities():
    table = SeriesTable(("a", "b", "c", "d", "e"), capacity_points=120, max_entities=1000)
    assert table.bytes_per_entity() == 120 * (4 + 2 * 5) + 8        # 1688 B per NIC port
    for chunk in range(3):
        keys = [f"n{chunk}-{i}" for i in range(500)]
        table.append(keys, T0, np.ones((500, 5)))
    assert len(table) == 1000 and table.dropped_entities == 500
    assert table.nbytes() <= 1000 * table.bytes_per_entity()
    # 10k nodes: 80k NIC ports + 80k GPUs + ~100k switch ports, with the default 120 points
    per_node = 8 * table.bytes_per_entity() + 8 * SeriesTable(("a", "b", "c"), 120, 1).bytes_per_entity()
    assert 10_000 * per_node < 300e6


def test_stale_and_other_cluster_snapshots_are_counted_not_used():
    state = FabricState(cluster="c1")
    assert state.add_snapshot(nic_tick(1, 1, 0, 0, 0))
    assert not state.add_snapshot(nic_tick(1, 1, 0, 0, 0))          # redelivered
    assert not state.add_snapshot(nic_tick(2, 2, 0, 0, 0, cluster="other"))
    assert state.stats["stale_snapshots"] == 1 and state.stats["other_cluster_records"] == 1
    assert "node-0001" in state.nodes and len(state.nodes) == 1


def test_a_malformed_block_is_skipped():
    state = FabricState()
    snap = nic_tick(0, 1, 0, 0, 0)
    del snap.blocks[0].counters[-1]
    assert state.add_snapshot(snap)
    assert state.stats["bad_blocks"] == 1


# ------------------------------------------------------------------------ health
def test_health_roles_source_victims_downgraded_straggler_and_rollup():
    state = FabricState()
    state.add_anomaly(storm_event())
    state.add_anomaly(anomaly("link_downgrade", path(node="node-0002", device="mlx5_3", port="1"), "down:2"))
    state.add_anomaly(anomaly("straggler", path(node="node-0003", device="gpu2", rank="2", job="job-7"), "strag:7/2",
                              probable_cause="thermal throttling"))
    state.add_anomaly(anomaly("gpu_xid", path(node="node-0004", device="gpu1"), "xid:4"))
    role = lambda p: state.health(p).role
    assert role("node-0001/mlx5_5/1") == "source"
    assert role("node-0002/mlx5_5/1") == "victim" and role("leaf-u0-r5/Ethernet1") == "victim"
    assert role("leaf-u0-r5") == "victim"                         # a switch shows its ports' worst role
    assert role("node-0002/mlx5_3/1") == "downgraded"
    assert role("node-0002") == "downgraded"                      # downgraded is worse than victim
    assert role("node-0003/gpu2") == "straggler" and role("job=job-7/rank=2") == "straggler"
    assert role("node-0004") == "fault" and role("node-0009") == "ok"
    assert state.health("node-0001/mlx5_5/1").anomalies == ("pfc_storm:c1/node-0001/mlx5_5/1",)


def test_resolution_clears_the_health_and_keeps_the_episode():
    state = FabricState()
    state.add_anomaly(storm_event())
    assert state.add_anomaly(storm_event(ev.LIFECYCLE_RESOLVED, t_s=20))
    assert state.health("node-0001/mlx5_5/1").role == "ok" and not state.open
    view = entity_view(state, "node-0001/mlx5_5/1", T0)
    assert [a["lifecycle"] for a in view["anomalies"]] == ["resolved"]
    victim = entity_view(state, "node-0002/mlx5_5/1", T0)
    assert victim["anomalies"][0]["relation"] == "related"


def test_duplicate_and_stale_events_are_ignored():
    state = FabricState()
    assert state.add_anomaly(storm_event(ev.LIFECYCLE_UPDATE, t_s=15))
    assert not state.add_anomaly(storm_event(ev.LIFECYCLE_UPDATE, t_s=15))   # same id: redelivery
    assert not state.add_anomaly(storm_event(ev.LIFECYCLE_OPEN, t_s=10))     # older than what we show
    assert state.stats["duplicate_anomaly_events"] == 1 and state.stats["stale_anomaly_events"] == 1
    assert len(state.feed) == 1


def test_open_anomalies_are_bounded():
    state = FabricState(limits=DashboardLimits(max_open_anomalies=3))
    for i in range(5):
        state.add_anomaly(anomaly("gpu_xid", path(node=f"n{i}", device="gpu0"), f"xid:{i}", t_s=i))
    assert sorted(state.open) == ["xid:2", "xid:3", "xid:4"]
    assert state.stats["open_anomalies_evicted"] == 2


# ------------------------------------------------------------------------ decisions, jobs, feed
def decision(outcome=ev.OUTCOME_SHADOW, shadow=True) -> ev.ActionDecision:
    return ev.ActionDecision(idempotency_key="k1", anomaly_id="a", anomaly_dedup_key="pfc_storm:c1/node-0001/mlx5_5/1",
                             anomaly_kind="pfc_storm", rule="drain", action="drain_node",
                             target=path(node="node-0001"), outcome=outcome, shadow=shadow, decided_unix_ns=T0 + 11 * S)


def test_decisions_from_actions_and_audit_count_once_and_shadow_reads_would_have():
    state = FabricState()
    state.add_anomaly(storm_event())
    assert state.add_decision(decision())
    assert not state.add_decision(decision())                    # the same decision from the audit topic
    assert state.add_decision(decision(ev.OUTCOME_EXECUTED, shadow=False))
    on_port = entity_view(state, "node-0001/mlx5_5/1", T0)["decisions"]   # matched through the anomaly
    assert [(d["outcome"], d["would_have"]) for d in on_port] == [("executed", False), ("shadow", True)]
    assert [d["action"] for d in entity_view(state, "node-0001", T0)["decisions"]] == ["drain_node"] * 2


def rank_steps(job, steps, t_s=0) -> pb.Snapshot:
    snap = pb.Snapshot(cluster="c1", source="node-0003", time_unix_ns=T0 + t_s * S)
    for rank, step, step_s, busy in steps:
        snap.rank_steps.add(job_id=job, rank=rank, world_size=4, node=f"node-000{3 + rank // 2}",
                            local_gpu=rank % 2, step=step, start_unix_ns=T0 + t_s * S, step_seconds=step_s,
                            busy_seconds=busy, collective_wait_seconds=step_s - busy)
    return snap


def test_jobs_show_ranks_step_times_and_stragglers_with_cause():
    state = FabricState(limits=DashboardLimits(step_history=3))
    for step in range(1, 6):
        steps = [(r, step, 1.0 + step / 10, 0.8 if r != 2 else 1.1) for r in range(4)]
        state.add_rank_steps(rank_steps("job-7", steps))
    assert not state.add_rank_steps(rank_steps("job-7", [(0, 3, 9.0, 1.0)]))        # an old step
    state.add_anomaly(anomaly("straggler", path(node="node-0004", device="gpu0", rank="2", job="job-7"), "strag",
                              probable_cause="thermal throttling (HwThermalSlowdown)", severity=ev.SEVERITY_WARNING))
    (job,) = jobs_view(state)
    assert job["world_size"] == 4 and job["nodes"] == ["node-0003", "node-0004"]
    assert job["stragglers"] == [2]
    rank2 = job["ranks"][2]
    assert rank2["step_s"] == pytest.approx([1.3, 1.4, 1.5]) and rank2["last_step"] == 5
    assert rank2["straggler"]["probable_cause"].startswith("thermal")
    assert job["ranks"][0]["straggler"] is None and state.stats["stale_rank_steps"] == 1


def test_jobs_are_bounded():
    state = FabricState(limits=DashboardLimits(max_jobs=2, max_ranks_per_job=2))
    for i in range(3):
        state.add_rank_steps(rank_steps(f"job-{i}", [(0, 1, 1.0, 0.5), (1, 1, 1.0, 0.5), (2, 1, 1.0, 0.5)], t_s=i))
    assert sorted(state.jobs) == ["job-1", "job-2"] and state.jobs["job-2"].dropped_ranks == 1


def test_feed_filters_by_kind_severity_job_and_switch():
    topo = rail_optimised("c1", n_nodes=4, nodes_per_unit=4, n_spines=1)
    state = FabricState(topo)
    state.add_rank_steps(rank_steps("job-7", [(0, 1, 1.0, 0.5)]))                # job-7 runs on node-0003
    state.add_anomaly(anomaly("link_downgrade", path(node="node-0003", device="mlx5_2", port="1"), "d",
                              severity=ev.SEVERITY_WARNING))
    state.add_anomaly(anomaly("gpu_xid", path(node="node-0001", device="gpu0"), "x", severity=ev.SEVERITY_INFO))
    state.add_decision(ev.ActionDecision(idempotency_key="k", anomaly_dedup_key="d", anomaly_kind="link_downgrade",
                                         action="alert", target=path(node="node-0003", device="mlx5_2", port="1"),
                                         outcome=ev.OUTCOME_ALERTED, decided_unix_ns=T0 + 11 * S))
    # Arrival order is not event order (look-back over several topics): the feed sorts by time.
    state.add_anomaly(anomaly("gpu_xid", path(node="node-0002", device="gpu1"), "early", t_s=1,
                              severity=ev.SEVERITY_INFO))

    def kinds(**q):
        return [(i["type"], i["data"].get("kind") or i["data"]["anomaly_kind"])
                for i in feed_view(state, FeedFilter.parse(q))]

    assert kinds(kind="gpu_xid") == [("anomaly", "gpu_xid")] * 2
    assert [i["data"]["dedup_key"] for i in feed_view(state, FeedFilter(kind="gpu_xid"))] == ["x", "early"]
    assert kinds(severity="warning") == [("decision", "link_downgrade"), ("anomaly", "link_downgrade")]
    assert kinds(job="job-7") == [("decision", "link_downgrade"), ("anomaly", "link_downgrade")]
    assert kinds(switch="leaf-u0-r2") == [("decision", "link_downgrade"), ("anomaly", "link_downgrade")]
    assert kinds(switch="leaf-u0-r0") == []
    with pytest.raises(ValueError, match="severity must be one of"):
        FeedFilter.parse({"severity": "urgent"})


def test_listeners_get_each_new_feed_item():
    state = FabricState()
    got = []
    state.listeners.append(got.append)
    state.add_anomaly(storm_event())
    state.add_decision(decision())
    assert [(i["seq"], i["type"]) for i in got] == [(1, "anomaly"), (2, "decision")]
    assert got[1]["data"]["would_have"] is True


# ------------------------------------------------------------------------ topology and the fabric view
def test_fabric_view_from_a_topology_file_with_cabling_and_silence():
    topo = rail_optimised("c1", n_nodes=4, nodes_per_unit=4, n_spines=2)
    state = FabricState(topo, stale_after_s=30)
    state.add_snapshot(nic_tick(0, 1, 0, 0, 0, source="node-0002"))
    state.add_anomaly(storm_event())
    view = fabric_view(state, now_ns=T0 + 10 * S)
    assert view["rails"] == list(range(8)) and view["gpus"] == 8 and view["topology_source"] == "file"
    rows = {r["node"]: r for r in view["rows"]}
    assert rows["node-0001"]["nics"][5]["health"]["role"] == "source"
    assert rows["node-0001"]["nics"][5]["peer"] == "leaf-u0-r5/Ethernet0"
    assert rows["node-0001"]["silent"] and not rows["node-0002"]["silent"]      # node-0001 never reported
    assert not fabric_view(state, now_ns=T0 + 10 * S)["rows"][1]["silent"]
    assert fabric_view(state, now_ns=T0 + 60 * S)["rows"][1]["silent"]           # quiet for 60 s > 30 s
    assert {s["name"]: s["role"] for s in view["switches"]}["spine-1"] == "spine"
    problems = fabric_view(state, T0, problems_only=True, limit=3)     # source, victim, silent; node-0004 on page 2
    assert [r["node"] for r in problems["rows"]] == ["node-0001", "node-0002", "node-0003"]
    assert problems["nodes_total"] == 4
    assert entity_view(state, "leaf-u0-r5/Ethernet0", T0)["peer"] == "node-0001/mlx5_5/1"
    assert entity_view(state, "no-such-thing", T0) is None


def test_limits_and_paths_refuse_bad_values():
    with pytest.raises(ValueError, match="history_points"):
        DashboardLimits(history_points=1)
    with pytest.raises(ValueError, match="stale_after_s"):
        FabricState(stale_after_s=0)
    assert entity_path(ev.EntityPath()) == ""


# ------------------------------------------------------------------------ record decoding
def test_bad_records_are_counted_never_raised():
    state = FabricState()
    assert not apply_record(state, topics.ANOMALIES, b"\x0a\xff\x01")              # truncated protobuf
    assert not apply_record(state, topics.TELEMETRY, None)
    assert not apply_record(state, "fabricwatch.unknown.v1", b"")
    assert apply_record(state, topics.ANOMALIES, storm_event().SerializeToString())
    assert apply_record(state, topics.AUDIT, decision().SerializeToString())
    assert apply_record(state, topics.TELEMETRY, telemetry_value(nic_tick(0, 1, 0, 0, 0)))
    assert apply_record(state, topics.RANK_STEPS, rank_steps("j", [(0, 1, 1.0, 0.5)]).SerializeToString())
    assert {k: v for k, v in state.stats.items() if k.startswith("bad_records")} == {
        "bad_records:fabricwatch.anomalies.v1": 1, f"bad_records:{topics.TELEMETRY}": 1,
        "bad_records:fabricwatch.unknown.v1": 1}
