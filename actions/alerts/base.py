"""The contract between the responder and the places alerts go.

An `Alert` carries everything a human needs (what, where, since when, evidence, probable
cause, action taken or proposed) already rendered; sinks only map it onto their API,
respect its rate limits and retry on 429/5xx.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

FIRING, RESOLVED = "firing", "resolved"


@dataclass(frozen=True)
class Alert:
    dedup_key: str               # stable for one anomaly: PagerDuty dedup_key, AM label-set identity
    status: str                  # FIRING | RESOLVED
    kind: str                    # anomaly kind, e.g. "pfc_storm"
    severity: str                # "info" | "warning" | "critical"
    title: str                   # one line: what and where
    body: str                    # several lines: since when, evidence, cause, action
    labels: tuple[tuple[str, str], ...]  # grouping labels: cluster, node, switch, port, job, rank
    starts_at_ns: int
    ends_at_ns: int = 0          # set when RESOLVED
    anomaly_id: str = ""
    links: tuple[tuple[str, str], ...] = field(default=())  # (text, url), e.g. the dashboard page
    impact_gpu_hours: float = 0.0           # lost so far when the alert was built (docs/schema.md, "Impact")
    impact_gpu_hours_per_hour: float = 0.0

    def label(self, name: str) -> str:
        return dict(self.labels).get(name, "")


@dataclass(frozen=True)
class SendResult:
    ok: bool
    detail: str = ""             # HTTP status and body excerpt, or the error
    attempts: int = 1
    answer: str = ""             # the start of the last HTTP answer's body ("" without one)


class AlertSink(Protocol):
    """One destination. ``send`` never raises: it returns ``SendResult(ok=False, ...)``."""

    name: str

    async def send(self, alert: Alert) -> SendResult: ...

    async def tick(self, now_ns: int) -> None:
        """Periodic housekeeping, e.g. Alertmanager re-sends firing alerts before resolve_timeout."""
