"""PagerDuty sink: Events API v2 trigger and resolve, keyed by the anomaly's dedup_key.

A trigger with an open dedup_key updates that incident instead of opening a new one;
resolve closes it (a later trigger with the same key opens a new incident). Success is
HTTP 202; 429 and 5xx are retried, 400 is not.
"""
from __future__ import annotations

import hashlib
from typing import Any

from fabricwatch.actions.alerts.base import RESOLVED, Alert, SendResult
from fabricwatch.actions.alerts.http import FAIL, OK, JsonPoster, RetryPolicy, judge_http_status
from fabricwatch.actions.alerts.message import truncate_chars, utc_iso

DEFAULT_URL = "https://events.pagerduty.com/v2/enqueue"
MAX_SUMMARY_CHARS = 1024
MAX_DEDUP_KEY_CHARS = 255
PD_SEVERITIES = frozenset({"critical", "error", "warning", "info"})


def pd_dedup_key(dedup_key: str) -> str:
    """The key itself, or when over 255 chars its head plus a hash, still stable per anomaly."""
    if len(dedup_key) <= MAX_DEDUP_KEY_CHARS:
        return dedup_key
    digest = hashlib.sha256(dedup_key.encode()).hexdigest()[:16]
    return f"{dedup_key[:MAX_DEDUP_KEY_CHARS - 17]}~{digest}"


def pd_event(alert: Alert, routing_key: str, client: str = "fabricwatch") -> dict[str, Any]:
    """The Events API v2 body for one alert."""
    source = alert.label("node") or alert.label("switch") or alert.label("cluster") or "fabricwatch"
    component = "/".join(p for p in (alert.label("device"), alert.label("port")) if p) or alert.label("job")
    details: dict[str, Any] = {"description": alert.body, "labels": dict(alert.labels)}
    if alert.anomaly_id:
        details["anomaly_id"] = alert.anomaly_id
    payload: dict[str, Any] = {
        "summary": truncate_chars(alert.title, MAX_SUMMARY_CHARS),
        "source": source,
        "severity": alert.severity if alert.severity in PD_SEVERITIES else "error",
        "class": alert.kind,
        "custom_details": details,
    }
    if alert.starts_at_ns:
        payload["timestamp"] = utc_iso(alert.starts_at_ns)
    if component:
        payload["component"] = component
    if group := alert.label("cluster"):
        payload["group"] = group
    return {
        "routing_key": routing_key,
        "event_action": "resolve" if alert.status == RESOLVED else "trigger",
        "dedup_key": pd_dedup_key(alert.dedup_key),
        "payload": payload,
        "links": [{"href": url, "text": text} for text, url in alert.links],
        "client": client,
    }


def _judge(status: int, body: str) -> tuple[str, str]:
    # 202 Accepted is PagerDuty's success; any other 2xx means we are not talking to it.
    verdict, why = judge_http_status(status, body)
    if verdict == OK and status != 202:
        return FAIL, f"HTTP {status}, expected 202"
    return verdict, why


class PagerDutySink:
    """Sends alerts to one PagerDuty service (its Events API v2 integration key)."""

    name = "pagerduty"

    def __init__(self, routing_key: str, url: str = DEFAULT_URL, policy: RetryPolicy | None = None):
        if not routing_key or not isinstance(routing_key, str):
            raise ValueError("PagerDutySink routing_key (the Events API v2 integration key) must be set")
        if not url.startswith(("http://", "https://")):
            raise ValueError(f"PagerDutySink url must be http(s), got {url!r}")
        self.routing_key = routing_key
        self.url = url
        self._poster = JsonPoster(self.name, policy)

    async def send(self, alert: Alert) -> SendResult:
        return await self._poster.post(self.url, pd_event(alert, self.routing_key), _judge)

    async def tick(self, now_ns: int) -> None:
        """Nothing to do: PagerDuty keeps an incident open until it is resolved."""

    async def close(self) -> None:
        await self._poster.close()
