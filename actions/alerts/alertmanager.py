"""Alertmanager sink: POST /api/v2/alerts, keep firing alerts alive, resolve them.

An alert's identity in Alertmanager is its label set, so the labels are chosen to name
the anomaly: ``alertname`` (the kind in CamelCase: PFCStorm, LinkDowngrade, Straggler),
the grouping labels (cluster, node, switch, port, device, job, rank), ``severity`` and
``dedup_key``. Alertmanager then groups, silences, inhibits and routes them.
"""
from __future__ import annotations

import asyncio
import re
import time
from collections.abc import Callable, Sequence
from typing import Any

from fabricwatch.actions.alerts.base import RESOLVED, Alert, SendResult
from fabricwatch.actions.alerts.http import JsonPoster, RetryPolicy
from fabricwatch.actions.alerts.message import (SECTION_ACTION, SECTION_CAUSE, SECTION_IMPACT, alertname, body_section,
                                                utc_iso)

API_PATH = "/api/v2/alerts"
#: Alertmanager's default ``resolve_timeout``: a firing alert not re-posted within it resolves itself.
DEFAULT_RESOLVE_TIMEOUT_S = 300.0
_LABEL_NAME_BAD_CHARS = re.compile(r"[^a-zA-Z0-9_]")


def _label_name(name: str) -> str:
    """A valid Prometheus label name ([a-zA-Z_][a-zA-Z0-9_]*)."""
    name = _LABEL_NAME_BAD_CHARS.sub("_", name) or "_"
    return f"_{name}" if name[0].isdigit() else name


def am_labels(alert: Alert) -> dict[str, str]:
    """The label set that identifies this anomaly in Alertmanager (empty values dropped)."""
    labels = {_label_name(name): value for name, value in alert.labels if value}
    labels.update(alertname=alertname(alert.kind), severity=alert.severity, dedup_key=alert.dedup_key)
    return {name: value for name, value in labels.items() if value}


def am_alert(alert: Alert, ends_at_ns: int = 0) -> dict[str, Any]:
    """One element of the POST /api/v2/alerts array. ends_at_ns=0 leaves endsAt to Alertmanager."""
    annotations = {"summary": alert.title, "description": alert.body}
    for name, section in (("probable_cause", SECTION_CAUSE), ("runbook", SECTION_ACTION)):
        if text := body_section(alert.body, section):
            annotations[name] = text
    if alert.anomaly_id:
        annotations["anomaly_id"] = alert.anomaly_id
    if text := body_section(alert.body, SECTION_IMPACT):
        # annotations, not labels: a label is the alert's identity, and the cost grows while it fires
        annotations.update(impact=text, impact_gpu_hours=f"{alert.impact_gpu_hours:.6g}",
                           impact_gpu_hours_per_hour=f"{alert.impact_gpu_hours_per_hour:.6g}")
    item: dict[str, Any] = {"labels": am_labels(alert), "annotations": annotations}
    if alert.starts_at_ns:
        item["startsAt"] = utc_iso(alert.starts_at_ns)
    if ends_at_ns:
        item["endsAt"] = utc_iso(ends_at_ns)
    if alert.links:
        item["generatorURL"] = alert.links[0][1]
    return item


class AlertmanagerSink:
    """Sends alerts to one or more Alertmanagers (an HA cluster: every member gets every alert).

    Alertmanager resolves a firing alert by itself ``resolve_timeout`` (default 5 m) after its
    last update when the post carried no endsAt, so this sink remembers the firing alerts and
    re-posts them from `tick` every ``resend_interval_s``, which must be shorter than the
    Alertmanagers' ``resolve_timeout`` (checked against ``resolve_timeout_s``; Prometheus
    itself re-sends every minute). A resolved alert is posted with the same labels and
    endsAt = now (never before its start), then forgotten.

    A send succeeds when at least one Alertmanager accepted it; the failing ones get the
    alert again on the next `tick`, since re-posting is idempotent.

    Parameters
    ----------
    url
        Base URL (``http://127.0.0.1:9093``) or a list of them.
    resend_interval_s
        How often `tick` re-posts firing alerts.
    resolve_timeout_s
        The Alertmanagers' ``resolve_timeout``; resend_interval_s must be below it.
    """

    name = "alertmanager"

    def __init__(self, url: str | Sequence[str], resend_interval_s: float = 60.0,
                 resolve_timeout_s: float = DEFAULT_RESOLVE_TIMEOUT_S, policy: RetryPolicy | None = None,
                 clock_ns: Callable[[], int] = time.time_ns):
        urls = [url] if isinstance(url, str) else list(url)
        if not urls or not all(isinstance(u, str) and u.startswith(("http://", "https://")) for u in urls):
            raise ValueError(f"AlertmanagerSink url must be one or more http(s) URLs, got {url!r}")
        if not 0 < resend_interval_s < resolve_timeout_s:
            raise ValueError(f"resend_interval_s must be > 0 and below resolve_timeout_s "
                             f"({resolve_timeout_s:g} s), got {resend_interval_s!r}")
        self.url = url
        self.resend_interval_s = resend_interval_s
        self.resolve_timeout_s = resolve_timeout_s
        self.clock_ns = clock_ns
        self._endpoints = [u.rstrip("/") + API_PATH for u in urls]
        # Re-sends happen every resend_interval_s, so one try must not take longer than that.
        self._poster = JsonPoster(self.name, policy or RetryPolicy(
            timeout_s=min(10.0, resend_interval_s), total_budget_s=min(30.0, resend_interval_s)))
        self._firing: dict[str, Alert] = {}
        self._last_sent_ns: dict[str, int] = {}

    @property
    def firing(self) -> tuple[Alert, ...]:
        return tuple(self._firing.values())

    async def send(self, alert: Alert) -> SendResult:
        now_ns = self.clock_ns()
        if alert.status == RESOLVED:
            self._firing.pop(alert.dedup_key, None)
            self._last_sent_ns.pop(alert.dedup_key, None)
            ends_at_ns = max(alert.starts_at_ns, min(alert.ends_at_ns or now_ns, now_ns))
            return await self._post([am_alert(alert, ends_at_ns)])
        # Kept even when the post fails: the next tick tries again.
        self._firing[alert.dedup_key] = alert
        result = await self._post([am_alert(alert)])
        if result.ok:
            self._last_sent_ns[alert.dedup_key] = now_ns
        return result

    async def tick(self, now_ns: int) -> None:
        """Re-post, in one request, every firing alert not sent for resend_interval_s."""
        due_ns = now_ns - int(self.resend_interval_s * 1e9)
        due = [a for key, a in self._firing.items() if self._last_sent_ns.get(key, 0) <= due_ns]
        if not due:
            return
        result = await self._post([am_alert(a) for a in due])
        if result.ok:
            for a in due:
                self._last_sent_ns[a.dedup_key] = now_ns

    async def close(self) -> None:
        await self._poster.close()

    async def _post(self, items: list[dict[str, Any]]) -> SendResult:
        # Concurrently: one Alertmanager that is down must not delay the others.
        results = await asyncio.gather(*(self._poster.post(endpoint, items) for endpoint in self._endpoints))
        if len(results) == 1:
            return results[0]
        detail = "; ".join(f"{endpoint}: {r.detail}" for endpoint, r in zip(self._endpoints, results, strict=True))
        return SendResult(any(r.ok for r in results), detail, attempts=sum(r.attempts for r in results))
