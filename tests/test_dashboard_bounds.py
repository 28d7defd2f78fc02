"""Issue #13 in the dashboard: ids a collector invents cannot grow its state or its answers,
and only its own names may be used in the Host header.

Before: one GPU id ``gpu20000`` made ``/api/fabric`` 27 MB (every row got 20,001 GPU
cells); fresh entity ids grew the dashboard without bound; any ``Host`` was served.
The first test goes through the real broker and the dashboard's real Kafka feed.
"""
from __future__ import annotations

import asyncio
import json
import time
import uuid

import numpy as np
import pytest
from aiohttp.test_utils import TestClient, TestServer
from helpers import gateway_and_sender, gpu_block, nic_snapshot

from fabricwatch.dashboard.feed import FeedSettings, follow
from fabricwatch.dashboard.server import MAX_RESPONSE_BYTES, build_app, host_names
from fabricwatch.dashboard.shapes import MAX_RELATED_SHOWN
from fabricwatch.dashboard.state import DashboardLimits, FabricState
from fabricwatch.dashboard.views import (MAX_OPEN_SHOWN, MAX_RANKS_SHOWN, MAX_SWITCHES_SHOWN, entity_view, fabric_view,
                                        jobs_view)
from fabricwatch.protos.v1 import events_pb2 as ev
from fabricwatch.protos.v1 import telemetry_pb2 as pb

S = 10**9


async def client_for(state: FabricState, **app_options) -> TestClient:
    client = TestClient(TestServer(build_app(state, **app_options), host="127.0.0.1"))
    await client.start_server()
    return client


def with_gpus(source: str, ids: list[str], t_ns: int, seq: int = 1) -> pb.Snapshot:
    snap = nic_snapshot(source=source, t_ns=t_ns, seq=seq)
    block = gpu_block(snap, n=len(ids))
    block.entity_ids[:] = ids
    return snap


@pytest.mark.kafka
async def test_one_gpu_id_gpu20000_no_longer_makes_the_fabric_answer_huge(kafka_bootstrap):
    """Through the real gateway, broker and the dashboard's Kafka feed."""
    cluster = f"dash-{uuid.uuid4().hex[:6]}"
    now = time.time_ns()
    async with gateway_and_sender(kafka_bootstrap, cluster=cluster) as sender:
        for i in range(64):
            ids = [f"gpu{g}" for g in range(8)] if i != 7 else [*(f"gpu{g}" for g in range(7)), "gpu20000"]
            sender.submit(with_gpus(f"node-{cluster}-{i:04d}", ids, now))
        assert await sender.drain(30)
    state, stop = FabricState(cluster=cluster), asyncio.Event()
    feed = asyncio.create_task(follow(FeedSettings(kafka_bootstrap, telemetry_lookback_s=60), state, stop))
    client = await client_for(state)
    try:
        deadline = time.monotonic() + 30
        while len(state.nodes) < 64 and time.monotonic() < deadline:
            await asyncio.sleep(0.1)
        resp = await client.get("/api/fabric")
        body = await resp.read()
    finally:
        stop.set()
        await asyncio.wait_for(feed, 10)
        await client.close()
    view = json.loads(body)
    assert resp.status == 200 and view["nodes_total"] == 64 and view["gpus"] == 8
    assert state.stats["gpus_over_limit"] == 1
    assert len(body) < 500_000, len(body)             # was 27 MB
    print(f"/api/fabric of 64 nodes with one gpu20000: {len(body)} bytes")


def test_fresh_ids_every_tick_do_not_grow_series_rows_or_rate_state():
    """A node that names 4,096 new NIC ports and GPUs in every snapshot keeps a bounded share."""
    limits = DashboardLimits(max_rails_per_node=16, max_gpus_per_node=16)
    state = FabricState(limits=limits)
    t0 = time.time_ns()
    for tick in range(40):
        snap = nic_snapshot(source="node-churn", t_ns=t0 + tick * S, seq=tick, n_ports=2)
        block = snap.blocks[0]
        block.entity_ids[:] = [f"mlx5_{tick * 2 + i}/1" for i in range(2)]
        gpus = gpu_block(snap, n=64)
        gpus.entity_ids[:] = [f"gpu{(tick * 64 + i) % 5000}" for i in range(64)]
        state.add_snapshot(snap)
        state.add_snapshot(nic_snapshot(source="node-honest", t_ns=t0 + tick * S, seq=tick))
    assert len(state.nodes["node-churn"].nics) == 16 and len(state.nodes["node-churn"].gpus) <= 16
    churned = sum(1 for key in state.series["nic_port"]._rows if key.startswith("node-churn/"))
    assert churned == 16 and len(state.series["gpu"]) <= 16
    assert len(state._layouts["node-churn"]) <= limits.max_layouts_per_source
    assert state.stats["nic_ports_over_limit"] > 0 and state.stats["gpus_over_limit"] > 0
    assert state.series["nic_port"].latest("node-honest/mlx5_3/1")["tx_gbps"] is not None   # others unharmed


def test_a_switch_rotating_its_port_subsets_keeps_bounded_rate_state():
    """Within its port cap a switch may still name a new subset of ports every tick: each is a
    layout whose counters the rate tracker would keep; past the limit its state starts over."""
    state = FabricState()
    t0 = time.time_ns()
    for tick in range(100):
        ports = [f"Ethernet{(tick + j) % 200}" for j in range(50)]
        snap = pb.Snapshot(source="leaf-churn", source_kind=pb.SOURCE_KIND_SWITCH, time_unix_ns=t0 + tick * S)
        snap.blocks.add(entity_kind=pb.ENTITY_KIND_SWITCH_PORT, entity_ids=ports, counter_names=["out-octets"],
                        counters=[tick * 1000] * 50)
        state.add_snapshot(snap)
    assert len(state._layouts["leaf-churn"]) <= state.limits.max_layouts_per_source
    assert state.stats["rate_state_resets"] >= 100 // state.limits.max_layouts_per_source - 1


def test_sources_learnt_from_telemetry_expire_and_their_rows_are_reused():
    state = FabricState(limits=DashboardLimits(source_expiry_s=600))
    t0 = time.time_ns()
    for i in range(50):
        state.add_snapshot(nic_snapshot(source=f"node-old-{i}", t_ns=t0, seq=1))
    rows_before = state.series["nic_port"]._times.shape[0]
    for i in range(50):
        state.add_snapshot(nic_snapshot(source=f"node-new-{i}", t_ns=t0 + 700 * S, seq=1))
    assert not any(name.startswith("node-old") for name in state.nodes) and state.stats["sources_expired"] == 50
    assert len(state.nodes) == 50 and state.series["nic_port"]._times.shape[0] == rows_before   # rows reused
    assert len(state._rates) == 50


@pytest.mark.slow
def test_every_api_answer_is_bounded_whatever_the_lists_hold():
    state = FabricState(limits=DashboardLimits(max_ranks_per_job=200_000, max_ranks=200_000))
    t0 = time.time_ns()
    for i in range(5000):
        sw = pb.Snapshot(cluster="", source=f"leaf-{i}", source_kind=pb.SOURCE_KIND_SWITCH, time_unix_ns=t0)
        state.add_snapshot(sw)
    victims = [ev.EntityPath(switch=f"leaf-{i}", port=f"Ethernet{j}") for i in range(100) for j in range(100)]
    for i in range(3000):
        state.add_anomaly(ev.AnomalyEvent(id=f"a{i}", dedup_key=f"pfc_storm:n{i}", kind="pfc_storm",
                                          lifecycle=ev.LIFECYCLE_OPEN, severity=ev.SEVERITY_CRITICAL,
                                          detected_unix_ns=t0, entity=ev.EntityPath(node=f"node-{i}"),
                                          related=victims if i < 3 else []))
    big = pb.Snapshot(source="node-0", source_kind=pb.SOURCE_KIND_NODE, time_unix_ns=t0)
    for r in range(100_000):
        big.rank_steps.add(job_id="huge", rank=r, world_size=100_000, node=f"node-{r // 8}", step=1,
                           start_unix_ns=t0, step_seconds=1.0, busy_seconds=0.5, collective_wait_seconds=0.5)
    state.add_rank_steps(big)
    fabric = fabric_view(state, t0)
    assert len(fabric["switches"]) == MAX_SWITCHES_SHOWN and fabric["switches_total"] == 5000
    assert len(fabric["open_anomalies"]) == MAX_OPEN_SHOWN and fabric["open_total"] == 3000
    assert max(len(a["related"]) for a in fabric["open_anomalies"]) == MAX_RELATED_SHOWN
    [job] = jobs_view(state)
    assert len(job["ranks"]) == MAX_RANKS_SHOWN and job["ranks_seen"] == 100_000
    for view in (fabric, jobs_view(state), entity_view(state, "node-1", t0)):
        assert len(json.dumps(view)) < MAX_RESPONSE_BYTES


async def test_the_host_header_must_name_this_dashboard():
    """DNS rebinding: a page on evil.example resolving to 127.0.0.1 must not read the API."""
    state = FabricState()
    client = await client_for(state, allowed_hosts=host_names("127.0.0.1", ("dash.example",)))
    try:
        for host, status in (("evil.example", 421), ("evil.example:8080", 421), ("127.0.0.1.evil.example", 421),
                             ("", 421), ("localhost:8080", 200), ("[::1]:8080", 200), ("dash.example", 200),
                             ("DASH.example:443", 200)):
            resp = await client.get("/api/status", headers={"Host": host})
            assert resp.status == status, (host, resp.status)
        assert (await client.get("/", headers={"Host": "evil.example"})).status == 421
    finally:
        await client.close()
    assert state.stats["bad_host_requests"] == 5


def test_caps_refuse_bad_values():
    with pytest.raises(ValueError, match="max_gpus_per_node"):
        DashboardLimits(max_gpus_per_node=0)
    with pytest.raises(ValueError, match="source_expiry_s"):
        DashboardLimits(source_expiry_s=0)
    assert np.isfinite(DashboardLimits().source_expiry_s)


async def test_event_streams_are_bounded_in_number():
    from fabricwatch.dashboard.server import SSE_MAX_CLIENTS

    state = FabricState()
    client = await client_for(state)
    try:
        streams = [await client.get("/api/events") for _ in range(SSE_MAX_CLIENTS)]
        await asyncio.sleep(0.2)
        assert all(r.status == 200 for r in streams)
        assert (await client.get("/api/events")).status == 503
        for r in streams:
            r.close()
    finally:
        await client.close()
    assert state.stats["sse_clients_refused"] == 1
