"""The dashboard's web app (`dashboard/server.py`) over a real aiohttp server on loopback."""
from __future__ import annotations

import asyncio
import json
import re

import pytest
from aiohttp.test_utils import TestClient, TestServer
from test_dashboard_state import decision, storm_event

from fabricwatch.dashboard.server import STATIC_DIR, SseHub, _Client, build_app, parse_listen
from fabricwatch.dashboard.state import FabricState
from fabricwatch.dashboard.views import FeedFilter
from fabricwatch.protos.v1 import events_pb2 as ev


async def client_for(state: FabricState) -> TestClient:
    client = TestClient(TestServer(build_app(state), host="127.0.0.1"))
    await client.start_server()
    return client


async def test_pages_and_assets_are_local_with_a_strict_policy():
    client = await client_for(FabricState())
    try:
        for page in ("/", "/feed", "/jobs", "/entity/node-0001/mlx5_0/1"):
            resp = await client.get(page)
            assert resp.status == 200 and "text/html" in resp.headers["Content-Type"]
            assert resp.headers["Content-Security-Policy"].startswith("default-src 'self'")
            html = await resp.text()
            for asset in re.findall(r'(?:src|href)="([^"#][^"]*)"', html):
                assert asset.startswith("/"), f"{page} loads {asset} from elsewhere"
                assert (await client.get(asset)).status == 200, asset
    finally:
        await client.close()
    # No CDN, no remote import anywhere in the assets (the SVG namespace URI is not a fetch).
    for f in STATIC_DIR.iterdir():
        text = f.read_text(encoding="utf-8").replace("http://www.w3.org/2000/svg", "")
        assert not re.search(r"https?://", text), f"{f.name} refers to a remote URL"


async def test_apis_answer_bad_input_with_clear_errors():
    state = FabricState()
    state.add_anomaly(storm_event())
    client = await client_for(state)
    try:
        resp = await client.get("/api/feed", params={"severity": "urgent"})
        assert resp.status == 400 and "severity must be one of" in (await resp.json())["error"]
        resp = await client.get("/api/fabric", params={"limit": "-3"})
        assert resp.status == 400
        resp = await client.get("/api/entity/nowhere/mlx5_9/1")
        assert resp.status == 404 and "unknown entity" in (await resp.json())["error"]
        entity = await (await client.get("/api/entity/node-0001/mlx5_5/1")).json()
        assert entity["health"]["role"] == "source" and entity["anomalies"][0]["evidence"][0]["name"] == "x"
        feed = await (await client.get("/api/feed", params={"kind": "pfc_storm"})).json()
        assert [i["data"]["kind"] for i in feed["items"]] == ["pfc_storm"] and feed["kinds"] == ["pfc_storm"]
        status = await (await client.get("/api/status")).json()
        assert status["open_anomalies"] == 1
    finally:
        await client.close()


async def read_event(resp, timeout_s=5.0) -> tuple[str, str, dict]:
    """The next `id`, `event`, `data` block of an SSE stream (comments skipped)."""
    fields: dict[str, str] = {}
    while True:
        line = (await asyncio.wait_for(resp.content.readline(), timeout_s)).decode().rstrip("\n")
        if not line:
            if "data" in fields:
                return fields.get("id", ""), fields.get("event", ""), json.loads(fields["data"])
            continue
        if not line.startswith(":"):
            name, _, value = line.partition(": ")
            fields[name] = value


async def test_server_sent_events_push_matching_items_and_replay_after_reconnect():
    state = FabricState()
    client = await client_for(state)
    try:
        resp = await client.get("/api/events", params={"kind": "pfc_storm"})
        assert resp.headers["Content-Type"].startswith("text/event-stream")
        await asyncio.sleep(0.1)                                 # the client is registered
        state.add_anomaly(ev.AnomalyEvent(id="x1", dedup_key="other", kind="gpu_xid", lifecycle=ev.LIFECYCLE_OPEN))
        state.add_anomaly(storm_event())
        state.add_decision(decision())                           # decisions match on their anomaly's kind
        first = await read_event(resp)
        second = await read_event(resp)
        assert (first[1], first[2]["kind"]) == ("anomaly", "pfc_storm")
        assert (second[1], second[2]["would_have"]) == ("decision", True)
        resp.close()
        # A browser reconnecting with Last-Event-ID gets what came after it.
        again = await client.get("/api/events", headers={"Last-Event-ID": first[0]})
        assert (await read_event(again))[1] == "decision"
        again.close()
    finally:
        await client.close()


def test_a_slow_client_loses_its_oldest_items_not_the_servers_memory():
    state = FabricState()
    hub = SseHub(state, queue_max=3)
    slow = _Client(FeedFilter(), hub.queue_max)
    hub.clients.add(slow)
    for i in range(5):
        state.add_anomaly(ev.AnomalyEvent(id=f"e{i}", dedup_key=f"k{i}", kind="gpu_xid", lifecycle=ev.LIFECYCLE_OPEN))
    assert [item["seq"] for item in slow.queue] == [3, 4, 5]
    assert slow.dropped == 2 and slow.wake.is_set()


@pytest.mark.parametrize("listen", ["0.0.0.0:8080", "10.1.2.3:80", "8080", "127.0.0.1:http"])
def test_listen_is_loopback_host_and_port(listen):
    with pytest.raises(ValueError):
        parse_listen(listen)


async def test_an_unreachable_broker_is_reported_and_retried_while_the_pages_stay_up():
    from fabricwatch.dashboard.server import DashboardSettings, _supervise_feed
    from helpers import free_port

    state, status, stop = FabricState(), {}, asyncio.Event()
    feed = asyncio.create_task(_supervise_feed(DashboardSettings(bootstrap=f"127.0.0.1:{free_port()}"), state,
                                               status, stop))
    try:
        for _ in range(200):
            if status.get("state") == "error":
                break
            await asyncio.sleep(0.05)
        assert status["state"] == "error" and "Kafka" in status["error"], status
        assert not feed.done()                                   # it keeps trying
    finally:
        stop.set()
        await asyncio.wait_for(feed, 10)
    assert status["state"] == "stopped"


async def test_the_report_page_shows_what_the_feed_read_under_the_strict_policy():
    from fabricwatch.dashboard.feed import apply_record
    from fabricwatch.protos.v1 import telemetry_pb2 as pb
    from fabricwatch.streams import topics
    from fabricwatch.streams.decode import pack

    state = FabricState()
    snaps = []
    for i in range(3):
        s = pb.Snapshot(cluster="c1", source="leaf-u0-r2", source_kind=pb.SOURCE_KIND_SWITCH,
                        time_unix_ns=1_790_000_000 * 10**9 + i * 10**9, seq=i)
        b = s.blocks.add(entity_kind=pb.ENTITY_KIND_SWITCH_PORT, entity_ids=["Ethernet4"],
                         counter_names=["pfc3-tx-pkts", "out-octets"])
        b.counters.extend([5000 * i, 10**9 * i])
        snaps.append(s)
    assert apply_record(state, topics.TELEMETRY, pack(snaps).SerializeToString())
    state.add_anomaly(storm_event())
    client = await client_for(state)
    try:
        resp = await client.get("/report")
        assert resp.status == 200 and "text/html" in resp.headers["Content-Type"]
        assert resp.headers["Content-Security-Policy"].startswith("default-src 'self'")
        page = await resp.text()
        assert "<style>" not in page and "href='/report.css'" in page
        switches = page.split("Switches: PFC pauses")[1]
        assert "leaf-u0-r2" in switches and "10000" in switches         # 2 intervals x 5000 pause frames
        assert "data:image/png;base64," in page
        css = await client.get("/report.css")
        assert css.status == 200 and "text/css" in css.headers["Content-Type"]
    finally:
        await client.close()


async def test_a_rank_page_is_addressed_by_the_entity_spelling_as_the_browser_encodes_it():
    state = FabricState()
    state.add_anomaly(ev.AnomalyEvent(id="s1", dedup_key="straggler:c/job=job-7/rank=2", kind="straggler",
                                      severity=ev.SEVERITY_WARNING, lifecycle=ev.LIFECYCLE_OPEN, detected_unix_ns=1,
                                      entity=ev.EntityPath(cluster="c", job="job-7", rank="2")))
    client = await client_for(state)
    try:
        # common.js entityHref: each segment through encodeURIComponent ("=" -> "%3D")
        for url in ("/api/entity/job%3Djob-7/rank%3D2", "/api/entity/job=job-7/rank=2"):
            page = await (await client.get(url)).json()
            assert page["kind"] == "rank" and page["path"] == "job=job-7/rank=2", url
            assert page["health"]["role"] == "straggler" and [a["id"] for a in page["anomalies"]] == ["s1"]
        assert (await client.get("/entity/job%3Djob-7/rank%3D2")).status == 200
    finally:
        await client.close()
