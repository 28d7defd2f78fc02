"""Alert sinks: message building and payloads (unit), then retry, rate limit, Retry-After,
Feishu signing and WeCom errcodes over real HTTP against a local aiohttp server that
stands in for the SaaS endpoints (which are not reachable from tests)."""
from __future__ import annotations

import asyncio
import base64
import hashlib
import hmac
import time
from contextlib import asynccontextmanager
from dataclasses import replace

import pytest
from aiohttp import web

from fabricwatch.actions.alerts.alertmanager import AlertmanagerSink, am_alert, am_labels
from fabricwatch.actions.alerts.base import FIRING, RESOLVED
from fabricwatch.actions.alerts.feishu import FeishuSink, feishu_message
from fabricwatch.actions.alerts.http import JsonPoster, RateLimiter, RetryPolicy, TokenBucket
from fabricwatch.actions.alerts.message import alert_from_anomaly, alertname, truncate_utf8, utc_iso
from fabricwatch.actions.alerts.pagerduty import PagerDutySink, pd_event
from fabricwatch.actions.alerts.slack import SlackSink, slack_message
from fabricwatch.actions.alerts.wecom import WeComSink, wecom_message
from fabricwatch.protos.v1 import events_pb2 as pb
from helpers import FakeTime, free_port

ONSET_NS = 1_764_504_005_123_000_000      # 2025-11-30T12:00:05.123Z
DETECTED_NS = ONSET_NS + 3_000_000_000
FAST = RetryPolicy(timeout_s=2.0, max_attempts=4, backoff_initial_s=0.05, backoff_max_s=0.2, total_budget_s=10.0)


def storm_event(lifecycle=pb.LIFECYCLE_OPEN, n_related=12) -> pb.AnomalyEvent:
    return pb.AnomalyEvent(
        id="ev-1", dedup_key="pfc_storm:c1/node-0003/mlx5_0/1", kind="pfc_storm", severity=pb.SEVERITY_CRITICAL,
        lifecycle=lifecycle, entity=pb.EntityPath(cluster="c1", node="node-0003", device="mlx5_0", port="1"),
        onset_unix_ns=ONSET_NS, detected_unix_ns=DETECTED_NS, confidence=0.9,
        evidence=[pb.Evidence(name="tx_pause_duty", value=0.93, threshold=0.5, unit="ratio", detail="prio 3")],
        probable_cause="NIC mlx5_0 on node-0003 sends PFC pause frames nonstop",
        suggested_action="drain node-0003 and reset mlx5_0", summary="PFC storm from node-0003 mlx5_0",
        related=[pb.EntityPath(cluster="c1", switch=f"leaf-{i}", port=f"Ethernet{i}") for i in range(n_related)],
        detector="storm_locator/1")


def storm_alert(**changes):
    return replace(alert_from_anomaly(storm_event(), ["drained node-0003 (shadow: would have)"],
                                      dashboard_url="http://dash.local/"), **changes)


# ---------------------------------------------------------------- message building (pure)

def test_alert_from_anomaly_says_what_where_since_evidence_cause_action():
    alert = storm_alert()
    assert alert.status == FIRING and alert.severity == "critical" and alert.kind == "pfc_storm"
    assert alert.title == "PFC storm @ c1/node-0003/mlx5_0/1"
    assert alert.dedup_key == "pfc_storm:c1/node-0003/mlx5_0/1" and alert.anomaly_id == "ev-1"
    assert alert.starts_at_ns == ONSET_NS and alert.ends_at_ns == 0
    assert alert.labels == (("cluster", "c1"), ("node", "node-0003"), ("port", "1"), ("device", "mlx5_0"))
    lines = alert.body.splitlines()
    assert lines[0] == "PFC storm from node-0003 mlx5_0"
    assert "Since: 2025-11-30T12:00:05.123Z (confirmed 2025-11-30T12:00:08.123Z)" in lines
    assert "Severity: critical, confidence 0.90" in lines
    assert "  - tx_pause_duty = 0.93 ratio (threshold 0.5) prio 3" in lines
    assert "Probable cause: NIC mlx5_0 on node-0003 sends PFC pause frames nonstop" in lines
    assert "Suggested action: drain node-0003 and reset mlx5_0" in lines
    assert "  - drained node-0003 (shadow: would have)" in lines
    related = next(line for line in lines if line.startswith("Related"))
    assert related.startswith("Related (12): c1/leaf-0/Ethernet0, ") and related.endswith(" and 7 more")
    assert related.count("c1/leaf-") == 5
    assert alert.links == (("dashboard", "http://dash.local/anomalies/pfc_storm%3Ac1%2Fnode-0003%2Fmlx5_0%2F1"),)


def test_resolved_event_gives_resolved_alert_ending_at_detection():
    alert = alert_from_anomaly(storm_event(pb.LIFECYCLE_RESOLVED, n_related=0))
    assert alert.status == RESOLVED and alert.ends_at_ns == DETECTED_NS
    assert alert.title.startswith("Resolved: PFC storm @ ")
    assert "Resolved at: 2025-11-30T12:00:08.123Z" in alert.body.splitlines()
    assert not any(line.startswith("Related") for line in alert.body.splitlines())


def test_straggler_labels_are_job_and_rank_only_when_set():
    event = pb.AnomalyEvent(id="s-1", kind="straggler", severity=pb.SEVERITY_WARNING,
                            entity=pb.EntityPath(cluster="c1", node="node-0007", job="42", rank="17"),
                            detected_unix_ns=DETECTED_NS)
    alert = alert_from_anomaly(event)
    assert alert.dedup_key == "s-1"          # no dedup_key: falls back to the event id
    assert alert.title == "Straggler @ c1/node-0007 job=42 rank=17"
    assert alert.labels == (("cluster", "c1"), ("node", "node-0007"), ("job", "42"), ("rank", "17"))
    assert alert.starts_at_ns == DETECTED_NS and alert.links == ()


def test_event_without_any_key_is_a_clear_error():
    with pytest.raises(ValueError, match="neither dedup_key nor id"):
        alert_from_anomaly(pb.AnomalyEvent(kind="pfc_storm"))


@pytest.mark.parametrize("kind, name", [("pfc_storm", "PFCStorm"), ("link_downgrade", "LinkDowngrade"),
                                        ("straggler", "Straggler"), ("pcie_downgrade", "PCIeDowngrade"),
                                        ("unknown_anomaly", "UnknownAnomaly")])
def test_alertname_is_camel_case_with_acronyms(kind, name):
    assert alertname(kind) == name


def test_truncate_utf8_cuts_on_a_character_boundary():
    text = "故障" * 3000                           # 3 bytes per character
    for limit in (4096, 4095, 4094, 2048, 10):
        cut = truncate_utf8(text, limit)
        assert len(cut.encode()) <= limit and cut.endswith("…")
        assert cut[:-1] == text[:len(cut) - 1]    # a clean prefix, no replacement characters


# ---------------------------------------------------------------- payloads (pure)

def test_alertmanager_payload_labels_identify_the_anomaly():
    alert = storm_alert()
    item = am_alert(alert)
    assert item["labels"] == {"alertname": "PFCStorm", "cluster": "c1", "node": "node-0003", "port": "1",
                              "device": "mlx5_0", "severity": "critical",
                              "dedup_key": "pfc_storm:c1/node-0003/mlx5_0/1"}
    assert item["annotations"]["summary"] == alert.title and item["annotations"]["description"] == alert.body
    assert item["annotations"]["runbook"] == "drain node-0003 and reset mlx5_0"
    assert item["annotations"]["probable_cause"].startswith("NIC mlx5_0")
    assert item["startsAt"] == "2025-11-30T12:00:05.123Z" and "endsAt" not in item
    assert item["generatorURL"] == alert.links[0][1]
    assert am_alert(alert, ends_at_ns=DETECTED_NS)["endsAt"] == "2025-11-30T12:00:08.123Z"
    # a label name Alertmanager would reject is made valid; empty values are dropped
    odd = replace(alert, labels=(("rail-id", "3"), ("9x", "y"), ("job", "")))
    assert {"rail_id": "3", "_9x": "y"}.items() <= am_labels(odd).items() and "job" not in am_labels(odd)


def test_alertmanager_sink_rejects_bad_config():
    with pytest.raises(ValueError, match="resolve_timeout_s"):
        AlertmanagerSink("http://127.0.0.1:9093", resend_interval_s=300)
    with pytest.raises(ValueError, match="http"):
        AlertmanagerSink(["http://127.0.0.1:9093", "127.0.0.1:9094"])
    with pytest.raises(ValueError):
        AlertmanagerSink([])


def test_pagerduty_event_fields_and_limits():
    alert = storm_alert(title="x" * 5000, dedup_key="k" * 400)
    event = pd_event(alert, "R" * 32)
    assert event["routing_key"] == "R" * 32 and event["event_action"] == "trigger"
    assert len(event["dedup_key"]) == 255 and event["dedup_key"] == pd_event(alert, "R" * 32)["dedup_key"]
    assert pd_event(replace(alert, dedup_key="k" * 401), "R")["dedup_key"] != event["dedup_key"]
    payload = event["payload"]
    assert len(payload["summary"]) == 1024
    assert payload["severity"] == "critical" and payload["source"] == "node-0003"
    assert payload["component"] == "mlx5_0/1" and payload["group"] == "c1" and payload["class"] == "pfc_storm"
    assert payload["timestamp"] == "2025-11-30T12:00:05.123Z"
    assert payload["custom_details"]["labels"]["node"] == "node-0003"
    assert event["links"] == [{"href": alert.links[0][1], "text": "dashboard"}]
    assert pd_event(replace(alert, status=RESOLVED), "R")["event_action"] == "resolve"
    assert pd_event(replace(alert, severity="bogus"), "R")["payload"]["severity"] == "error"
    with pytest.raises(ValueError, match="routing_key"):
        PagerDutySink("")


def test_slack_sections_stay_below_3000_chars_and_are_escaped():
    alert = storm_alert(title="a <b> & c", body="line & <tag>\n" * 1000)
    message = slack_message(alert)
    assert message["text"] == "a &lt;b&gt; &amp; c" and message["mrkdwn"] is False
    sections = [b["text"] for b in message["blocks"] if b["type"] == "section"]
    texts = [t["text"] for t in sections]
    assert all(len(t) < 3000 for t in texts) and texts[1].endswith("…")
    assert {t["type"] for t in sections} == {"plain_text"}      # shown as it is: nothing in it is markup
    assert texts[0].endswith("a <b> & c") and "line & <tag>" in texts[1]
    assert message["blocks"][-1]["elements"][0]["text"].startswith("<http://dash.local/anomalies/")


def test_wecom_markdown_and_text_limits_in_utf8_bytes():
    alert = storm_alert(body="交换机端口拥塞 " * 2000)
    markdown = wecom_message(alert)["markdown"]["content"]
    assert 4090 <= len(markdown.encode()) <= 4096 and markdown.endswith("…")
    text = wecom_message(alert, "text", mentioned=["@all"])["text"]
    assert len(text["content"].encode()) <= 2048 and text["mentioned_list"] == ["@all"]
    assert '<font color="warning">' in wecom_message(storm_alert())["markdown"]["content"]


def test_feishu_message_shapes():
    post = feishu_message(storm_alert())
    assert post["msg_type"] == "post"
    paragraphs = post["content"]["post"]["zh_cn"]["content"]
    assert paragraphs[-1] == [{"tag": "a", "text": "dashboard", "href": storm_alert().links[0][1]}]
    text = feishu_message(storm_alert(), "text")
    assert text["msg_type"] == "text" and text["content"]["text"].startswith("PFC storm ＠ ")
    with pytest.raises(ValueError, match="msg_type"):
        FeishuSink("http://127.0.0.1:1/hook", msg_type="interactive")


async def test_rate_limiter_keeps_every_window_within_its_bucket():
    now = [0.0]

    async def fake_sleep(s):
        now[0] += s

    clock = lambda: now[0]  # noqa: E731
    limiter = RateLimiter(TokenBucket(5, 5 / 1.0, clock), TokenBucket(100, 100 / 60.0, clock), sleep=fake_sleep)
    times = []
    for _ in range(250):
        assert await limiter.acquire(max_wait_s=3600)
        times.append(now[0])
    for window_s, cap, rate in ((1.0, 5, 5.0), (60.0, 100, 100 / 60)):
        worst = max(sum(1 for t in times if start <= t < start + window_s) for start in times)
        assert worst <= cap + rate * window_s + 1e-9
    assert times[4] == 0 and times[5] > 0                    # the burst, then waiting
    assert times[-1] >= (250 - 100) / (100 / 60) - 1e-6     # the minute bucket dominates in the long run
    assert not await limiter.acquire(max_wait_s=0.01)        # would have to wait: refused, not blocked


# ---------------------------------------------------------------- real HTTP against a local stand-in

class FakeEndpoint:
    """Stand-in webhook on 127.0.0.1: answers each path from a script, records every request.

    A script entry is (status, body: dict | str, headers, delay_s); the last entry repeats.
    """

    def __init__(self):
        self.scripts: dict[str, list[tuple]] = {}
        self.requests: list[tuple[str, dict, float]] = []   # (path, JSON body, monotonic time)
        self.url = ""

    def script(self, path: str, *answers: tuple) -> str:
        self.scripts[path] = list(answers)
        return self.url + path

    def hits(self, path: str) -> list[tuple[str, dict, float]]:
        return [r for r in self.requests if r[0] == path]

    async def handle(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        self.requests.append((request.path, body, time.monotonic()))
        script = self.scripts.get(request.path) or [(404, "no such hook", {}, 0)]
        status, reply, headers, delay_s = script.pop(0) if len(script) > 1 else script[0]
        if callable(reply):
            reply = reply(body)
        if delay_s:
            await asyncio.sleep(delay_s)
        if isinstance(reply, dict):
            return web.json_response(reply, status=status, headers=headers)
        return web.Response(text=reply, status=status, headers=headers)


@asynccontextmanager
async def fake_endpoint():
    endpoint = FakeEndpoint()
    app = web.Application()
    app.router.add_post("/{tail:.*}", endpoint.handle)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = runner.addresses[0][1]
    endpoint.url = f"http://127.0.0.1:{port}"
    try:
        yield endpoint
    finally:
        await runner.cleanup()


async def test_retries_5xx_then_succeeds_with_the_same_body():
    async with fake_endpoint() as ep:
        url = ep.script("/pd", (503, "busy", {}, 0), (500, {"x": 1}, {}, 0), (202, {"status": "success"}, {}, 0))
        sink = PagerDutySink("R" * 32, url=url, policy=FAST)
        result = await sink.send(storm_alert())
        await sink.close()
    assert result.ok and result.attempts == 3, result
    bodies = [body for _, body, _ in ep.hits("/pd")]
    assert len(bodies) == 3 and bodies[0] == bodies[2] and bodies[0]["routing_key"] == "R" * 32
    assert bodies[0]["payload"]["summary"] == storm_alert().title


async def test_429_honours_retry_after():
    fake = FakeTime()
    async with fake_endpoint() as ep:
        url = ep.script("/slack", (429, "rate_limited", {"Retry-After": "1"}, 0), (200, "ok", {}, 0))
        sink = SlackSink(url, policy=FAST, clock=fake, sleep=fake.sleep)
        result = await sink.send(storm_alert())
        await sink.close()
    assert result.ok and result.attempts == 2 and len(ep.hits("/slack")) == 2
    assert fake.slept == [1.0]                 # backoff alone would have waited <= 0.05 s


async def test_other_4xx_is_not_retried_and_the_body_is_reported():
    async with fake_endpoint() as ep:
        url = ep.script("/pd", (400, {"status": "invalid event", "errors": ["routing_key bad"]}, {}, 0))
        sink = PagerDutySink("R", url=url, policy=FAST)
        result = await sink.send(storm_alert())
        await sink.close()
    assert not result.ok and result.attempts == 1 and len(ep.hits("/pd")) == 1
    assert "HTTP 400" in result.detail and "routing_key bad" in result.detail


async def test_connection_refused_is_retried_then_reported_never_raised():
    policy = RetryPolicy(timeout_s=1.0, max_attempts=3, backoff_initial_s=0.05, backoff_max_s=0.1, total_budget_s=5)
    fake = FakeTime()
    poster = JsonPoster("test", policy, clock=fake, sleep=fake.sleep)
    result = await poster.post(f"http://127.0.0.1:{free_port()}/hook", {"a": 1})
    assert not result.ok and result.attempts == 3 and "connection error" in result.detail
    # backoff between the attempts: half fixed, half jitter, of 0.05 s then 0.1 s (backoff_max_s)
    assert len(fake.slept) == 2 and 0.025 <= fake.slept[0] <= 0.05 and 0.05 <= fake.slept[1] <= 0.1, fake.slept
    bad = [await poster.post("http://127.0.0.1:99999/x", {"a": 1}), await poster.post("nota url", {"a": 1}),
           await poster.post("http://127.0.0.1:1/x", {"a": object()})]
    await poster.close()
    assert [r.ok for r in bad] == [False, False, False] and [r.attempts for r in bad] == [1, 1, 0]
    assert "not JSON" in bad[2].detail


async def test_timeouts_and_the_total_budget_bound_the_time():
    async with fake_endpoint() as ep:
        slow = ep.script("/slow", (200, "ok", {}, 1.0))
        poster = JsonPoster("test", RetryPolicy(timeout_s=0.3, max_attempts=2, backoff_initial_s=0.05,
                                                backoff_max_s=0.1, total_budget_s=5))
        t0 = time.monotonic()
        result = await poster.post(slow, {"a": 1})
        timed_out_s = time.monotonic() - t0
        # Retry-After beyond the budget: give up now rather than overrun it
        far = ep.script("/far", (503, "down", {"Retry-After": "30"}, 0))
        fake = FakeTime()
        poster_2s = JsonPoster("test", RetryPolicy(max_attempts=5, total_budget_s=2.0), clock=fake, sleep=fake.sleep)
        gave_up = await poster_2s.post(far, {"a": 1})
        await poster.close()
        await poster_2s.close()
    # real aiohttp timeouts: two answered attempts would take >= 2 s (the endpoint answers after 1 s)
    assert not result.ok and result.attempts == 2 and "timeout after 0.3 s" in result.detail and timed_out_s < 1.9
    assert not gave_up.ok and gave_up.attempts == 1 and "budget" in gave_up.detail and fake.slept == []


async def test_slack_rate_limit_spaces_requests_after_the_burst():
    fake = FakeTime()
    async with fake_endpoint() as ep:
        url = ep.script("/slack", (200, "ok", {}, 0))
        sink = SlackSink(url, policy=FAST, burst=2, per_second=5.0, clock=fake, sleep=fake.sleep)
        results = await asyncio.gather(*(sink.send(storm_alert(dedup_key=f"k{i}")) for i in range(6)))
        await sink.close()
    assert all(r.ok for r in results) and len(ep.hits("/slack")) == 6
    # the burst of 2 goes at once, then 5/s: 4 waits of 0.2 s (and no retry waits)
    assert fake.slept == pytest.approx([0.2] * 4)


def _feishu_server_check(secret: str):
    """What Feishu does with a signed body: recompute the signature from its timestamp."""

    def check(body: dict) -> dict:
        timestamp = body.get("timestamp", "")
        key = f"{timestamp}\n{secret}".encode()
        expected = base64.b64encode(hmac.new(key, digestmod=hashlib.sha256).digest()).decode()
        if body.get("sign") != expected or abs(time.time() - int(timestamp or 0)) > 3600:
            return {"code": 19021, "msg": "sign match fail or timestamp is not within one hour from current time"}
        return {"StatusCode": 0, "StatusMessage": "success", "code": 0, "data": {}, "msg": "success"}

    return check


async def test_feishu_signature_and_body_code():
    async with fake_endpoint() as ep:
        signed = ep.script("/feishu/signed", (200, _feishu_server_check("s3cret"), {}, 0))
        good = FeishuSink(signed, secret="s3cret", policy=FAST)
        wrong = FeishuSink(signed, secret="other", policy=FAST)
        ok, bad_sign = await good.send(storm_alert()), await wrong.send(storm_alert())
        bad = FeishuSink(ep.script("/feishu/bad", (200, {"code": 9499, "msg": "Bad Request"}, {}, 0)), policy=FAST)
        rejected = await bad.send(storm_alert())
        limited = FeishuSink(ep.script("/feishu/limited", (200, {"code": 11232, "msg": "frequency limited"}, {}, 0),
                                       (200, {"code": 0, "msg": "success"}, {}, 0)), msg_type="text", policy=FAST)
        recovered = await limited.send(storm_alert())
        for sink in (good, wrong, bad, limited):
            await sink.close()
    assert ok.ok and ok.attempts == 1, ok
    sent = ep.hits("/feishu/signed")[0][1]
    assert sent["timestamp"].isdigit() and sent["msg_type"] == "post"
    assert not bad_sign.ok and bad_sign.attempts == 1 and "code 19021" in bad_sign.detail
    assert not rejected.ok and rejected.attempts == 1 and "code 9499" in rejected.detail   # HTTP 200 is not enough
    assert recovered.ok and recovered.attempts == 2
    assert ep.hits("/feishu/limited")[0][1]["msg_type"] == "text"


async def test_wecom_errcode_decides_success():
    async with fake_endpoint() as ep:
        ok_url = ep.script("/wecom/ok", (200, {"errcode": 0, "errmsg": "ok"}, {}, 0))
        bad_url = ep.script("/wecom/bad", (200, {"errcode": 93000, "errmsg": "invalid webhook url"}, {}, 0))
        busy_url = ep.script("/wecom/busy", (200, {"errcode": 45009, "errmsg": "api freq out of limit"}, {}, 0),
                             (200, {"errcode": 0, "errmsg": "ok"}, {}, 0))
        sinks = [WeComSink(u, policy=FAST) for u in (ok_url, bad_url, busy_url)]
        ok, bad, busy = [await s.send(storm_alert(body="拥塞 " * 3000)) for s in sinks]
        for sink in sinks:
            await sink.close()
    assert ok.ok and ok.attempts == 1
    assert not bad.ok and bad.attempts == 1 and "errcode 93000" in bad.detail
    assert busy.ok and busy.attempts == 2
    content = ep.hits("/wecom/ok")[0][1]["markdown"]["content"]
    assert len(content.encode()) <= 4096


async def test_alertmanager_sink_resends_only_when_due_and_forgets_resolved():
    now_ns = [DETECTED_NS]
    async with fake_endpoint() as ep:
        url = ep.script("/api/v2/alerts", (200, "", {}, 0))
        sink = AlertmanagerSink(ep.url, resend_interval_s=60, clock_ns=lambda: now_ns[0], policy=FAST)
        assert (await sink.send(storm_alert())).ok
        await sink.tick(DETECTED_NS + 30 * 10**9)       # not due yet
        await sink.tick(DETECTED_NS + 61 * 10**9)       # due: re-posted
        now_ns[0] = DETECTED_NS + 90 * 10**9
        assert (await sink.send(storm_alert(status=RESOLVED, ends_at_ns=DETECTED_NS + 80 * 10**9))).ok
        await sink.tick(DETECTED_NS + 200 * 10**9)      # nothing firing any more
        await sink.close()
    bodies = [body for _, body, _ in ep.hits("/api/v2/alerts")]
    assert url.endswith("/api/v2/alerts") and len(bodies) == 3
    assert bodies[0] == bodies[1] and "endsAt" not in bodies[1][0]
    assert bodies[2][0]["labels"] == bodies[0][0]["labels"]
    assert bodies[2][0]["endsAt"] == utc_iso(DETECTED_NS + 80 * 10**9) and sink.firing == ()

