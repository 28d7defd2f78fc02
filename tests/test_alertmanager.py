"""The Alertmanager sink against a real Alertmanager (Debian's prometheus-alertmanager),
started on 127.0.0.1 by deploy/alertmanager/alertmanager-local.sh (the session fixture
`alertmanager_url` in tests/conftest.py; skipped, saying why, when the binary is missing).

Each test uses its own cluster label, so the tests share one Alertmanager without seeing
each other's alerts."""
from __future__ import annotations

import asyncio
import time
import uuid
from dataclasses import replace
from datetime import datetime

import aiohttp
from fabricwatch.actions.alerts.alertmanager import AlertmanagerSink, am_labels
from fabricwatch.actions.alerts.base import FIRING, RESOLVED, Alert
from fabricwatch.actions.alerts.http import JsonPoster, RetryPolicy
from fabricwatch.actions.alerts.message import utc_iso
from helpers import free_port

FAST = RetryPolicy(timeout_s=2.0, max_attempts=2, backoff_initial_s=0.05, backoff_max_s=0.1, total_budget_s=3.0)


def make_alert(cluster: str, node: str = "node-0003", kind: str = "pfc_storm", switch: str = "") -> Alert:
    labels = tuple((k, v) for k, v in (("cluster", cluster), ("node", node), ("switch", switch)) if v)
    return Alert(dedup_key=f"{kind}:{cluster}/{node}", status=FIRING, kind=kind, severity="critical",
                 title=f"{kind} @ {cluster}/{node}", body=f"Since: now\nSuggested action: drain {node}",
                 labels=labels, starts_at_ns=time.time_ns() - 5 * 10**9, anomaly_id=f"ev-{node}",
                 links=(("dashboard", f"http://dash.local/anomalies/{node}"),))


async def get_json(url: str, path: str, **params: str):
    async with aiohttp.ClientSession() as session, session.get(url + path, params=params) as response:
        assert response.status == 200, await response.text()
        return await response.json()


async def alerts_of(url: str, cluster: str, active_only: bool = True) -> list[dict]:
    params = {"filter": f'cluster="{cluster}"'}
    if active_only:
        params["active"] = "true"
    return await get_json(url, "/api/v2/alerts", **params)


def ts(rfc3339: str) -> float:
    """Unix seconds of an Alertmanager timestamp (its fraction has a varying number of digits)."""
    return datetime.fromisoformat(rfc3339).timestamp()


def new_cluster() -> str:
    return f"test-{uuid.uuid4().hex[:8]}"


async def test_fired_alert_reads_back_with_its_labels_and_annotations(alertmanager_url):
    cluster = new_cluster()
    alert = make_alert(cluster)
    sink = AlertmanagerSink(alertmanager_url, policy=FAST)
    t0 = time.monotonic()
    result = await sink.send(alert)
    send_s = time.monotonic() - t0
    await sink.close()
    assert result.ok and result.attempts == 1, result
    assert send_s < 5.0                         # a real Alertmanager on loopback: one quick POST
    (got,) = await alerts_of(alertmanager_url, cluster)
    assert got["labels"] == am_labels(alert) == {
        "alertname": "PFCStorm", "cluster": cluster, "node": "node-0003", "severity": "critical",
        "dedup_key": f"pfc_storm:{cluster}/node-0003"}
    assert got["annotations"]["summary"] == alert.title and got["annotations"]["description"] == alert.body
    assert got["annotations"]["runbook"] == "drain node-0003"
    assert got["annotations"]["anomaly_id"] == "ev-node-0003"
    assert got["generatorURL"] == "http://dash.local/anomalies/node-0003"
    assert got["startsAt"] == utc_iso(alert.starts_at_ns)
    assert got["status"]["state"] == "active" and sink.firing == (alert,)


async def test_tick_reposts_firing_alerts_when_due(alertmanager_url):
    cluster = new_cluster()
    sink = AlertmanagerSink(alertmanager_url, resend_interval_s=1.0, policy=FAST)
    assert (await sink.send(make_alert(cluster))).ok
    (first,) = await alerts_of(alertmanager_url, cluster)
    await asyncio.sleep(0.3)
    await sink.tick(time.time_ns())               # sent 0.3 s ago: not due, nothing posted
    (unchanged,) = await alerts_of(alertmanager_url, cluster)
    await asyncio.sleep(0.8)
    await sink.tick(time.time_ns())               # 1.1 s since the send: re-posted
    (reposted,) = await alerts_of(alertmanager_url, cluster)
    await sink.close()
    assert unchanged["updatedAt"] == first["updatedAt"] and unchanged["endsAt"] == first["endsAt"]
    assert ts(reposted["updatedAt"]) - ts(first["updatedAt"]) >= 0.8
    assert ts(reposted["endsAt"]) - ts(first["endsAt"]) >= 0.8
    # with no endsAt from us, Alertmanager keeps it alive for resolve_timeout (default 5 m)
    assert 299 <= ts(reposted["endsAt"]) - ts(reposted["updatedAt"]) <= 301
    assert reposted["startsAt"] == first["startsAt"] and reposted["fingerprint"] == first["fingerprint"]


async def test_resolve_ends_the_alert_in_alertmanager(alertmanager_url):
    cluster = new_cluster()
    alert = make_alert(cluster)
    sink = AlertmanagerSink(alertmanager_url, policy=FAST)
    assert (await sink.send(alert)).ok
    assert len(await alerts_of(alertmanager_url, cluster)) == 1
    result = await sink.send(replace(alert, status=RESOLVED, ends_at_ns=time.time_ns()))
    await sink.close()
    assert result.ok and sink.firing == ()
    assert await alerts_of(alertmanager_url, cluster) == []


async def test_alertmanager_groups_by_cluster_alertname_job_switch(alertmanager_url):
    cluster = new_cluster()
    alerts = [make_alert(cluster, "node-0001", switch="leaf-1"), make_alert(cluster, "node-0002", switch="leaf-1"),
              make_alert(cluster, "node-0003", switch="leaf-2"),
              make_alert(cluster, "node-0001", kind="link_downgrade", switch="leaf-1")]
    sink = AlertmanagerSink(alertmanager_url, policy=FAST)
    assert all([(await sink.send(a)).ok for a in alerts])
    await sink.close()
    deadline = time.monotonic() + 10
    while True:   # the dispatcher files alerts into groups asynchronously
        groups = await get_json(alertmanager_url, "/api/v2/alerts/groups", filter=f'cluster="{cluster}"')
        if sum(len(g["alerts"]) for g in groups) == len(alerts) or time.monotonic() > deadline:
            break
        await asyncio.sleep(0.1)
    by_labels = {tuple(sorted(g["labels"].items())): sorted(a["labels"]["node"] for a in g["alerts"])
                 for g in groups}
    assert by_labels == {
        (("alertname", "PFCStorm"), ("cluster", cluster), ("switch", "leaf-1")): ["node-0001", "node-0002"],
        (("alertname", "PFCStorm"), ("cluster", cluster), ("switch", "leaf-2")): ["node-0003"],
        (("alertname", "LinkDowngrade"), ("cluster", cluster), ("switch", "leaf-1")): ["node-0001"],
    }


async def test_ha_sends_to_every_alertmanager_and_survives_one_down(alertmanager_url):
    cluster = new_cluster()
    down = f"http://127.0.0.1:{free_port()}"
    sink = AlertmanagerSink([alertmanager_url, down], policy=FAST)
    result = await sink.send(make_alert(cluster))
    await sink.close()
    assert result.ok and result.attempts == 1 + FAST.max_attempts
    assert f"{down}/api/v2/alerts: alertmanager: connection error" in result.detail
    assert len(await alerts_of(alertmanager_url, cluster)) == 1


async def test_rejected_post_is_not_retried_and_says_why(alertmanager_url):
    poster = JsonPoster("alertmanager", FAST)
    result = await poster.post(alertmanager_url + "/api/v2/alerts", [{"annotations": {"summary": "no labels"}}])
    await poster.close()
    assert not result.ok and result.attempts == 1
    assert "HTTP 422" in result.detail and "labels in body is required" in result.detail
