"""Render an `AnomalyEvent` as an `Alert` a human on call can act on; pure, no I/O.

The title says what and where ("PFC storm @ c1/node-0003/mlx5_0/1"); the body says since
when, how bad, the evidence against its thresholds, the probable cause, the suggested
action, what fabricwatch did or would have done, and the related entities (victims).
The body is plain text in labelled lines (`SECTION_*`), so a sink can lift one out with
`body_section`. Also here: the text helpers every sink needs (`alertname`, UTC times,
truncation by characters or by UTF-8 bytes).

Every field taken from the event is attacker text (it comes from telemetry): it goes
through `actions.escape.untrusted` here (one line, no control characters, URLs defanged), so the
body's line structure is ours alone; each sink then escapes its own markup.
"""
from __future__ import annotations

from collections.abc import Sequence
from datetime import UTC, datetime
from urllib.parse import quote

from fabricwatch.actions.alerts.base import FIRING, RESOLVED, Alert
from fabricwatch.actions.escape import untrusted
from fabricwatch.models.vocabulary import WARNING
from fabricwatch.protos.v1 import events_pb2 as pb
from fabricwatch.streams.events import SEVERITY_NAME

#: Grouping labels, in this order, taken from the entity when non-empty.
LABEL_NAMES = ("cluster", "node", "switch", "port", "device", "job", "rank")
MAX_RELATED_SHOWN = 5
ELLIPSIS = "…"

SECTION_SINCE = "Since"
SECTION_SEVERITY = "Severity"
SECTION_CAUSE = "Probable cause"
SECTION_ACTION = "Suggested action"
SECTION_IMPACT = "Impact"

# Words that stay upper case (or their usual casing) in titles and alertnames.
_ACRONYMS = {"pfc": "PFC", "pcie": "PCIe", "gpu": "GPU", "nic": "NIC", "xid": "XID", "ecc": "ECC",
             "rdma": "RDMA", "ecn": "ECN", "cnp": "CNP", "ib": "IB", "nvlink": "NVLink"}


def alertname(kind: str) -> str:
    """CamelCase of an anomaly kind, keeping acronyms: the Alertmanager ``alertname``.

    >>> alertname("pfc_storm"), alertname("link_downgrade"), alertname("straggler"), alertname("")
    ('PFCStorm', 'LinkDowngrade', 'Straggler', 'Anomaly')
    """
    words = [w for w in kind.replace("-", "_").split("_") if w]
    return "".join(_ACRONYMS.get(w.lower(), w[:1].upper() + w[1:]) for w in words) or "Anomaly"


def kind_words(kind: str) -> str:
    """A kind as words for a title: "pfc_storm" -> "PFC storm"."""
    words = [_ACRONYMS.get(w.lower(), w.lower()) for w in kind.replace("-", "_").split("_") if w]
    text = " ".join(words) or "anomaly"
    return text[:1].upper() + text[1:]


def utc_iso(t_ns: int) -> str:
    """RFC 3339 in UTC with milliseconds: 2026-11-30T12:00:05.123Z.

    >>> utc_iso(1_764_504_005_123_456_789)
    '2025-11-30T12:00:05.123Z'
    """
    t = datetime.fromtimestamp(t_ns // 1_000_000_000, tz=UTC)
    return t.strftime("%Y-%m-%dT%H:%M:%S") + f".{t_ns % 1_000_000_000 // 1_000_000:03d}Z"


def truncate_chars(text: str, max_chars: int) -> str:
    """At most max_chars characters, ending in "…" when cut."""
    if len(text) <= max_chars:
        return text
    return text[:max(0, max_chars - len(ELLIPSIS))] + ELLIPSIS


def truncate_utf8(text: str, max_bytes: int) -> str:
    """At most max_bytes of UTF-8, cut on a character boundary, ending in "…" when cut.

    >>> truncate_utf8("故障节点", 10), len(truncate_utf8("故障节点", 10).encode())
    ('故障…', 9)
    """
    data = text.encode()
    if len(data) <= max_bytes:
        return text
    room = max(0, max_bytes - len(ELLIPSIS.encode()))
    # errors="ignore" drops the partial character the byte cut may leave at the end.
    return data[:room].decode(errors="ignore") + ELLIPSIS


def body_section(body: str, section: str) -> str:
    """The text of a one-line section ("Probable cause: ...") of an alert body, or ""."""
    prefix = f"{section}: "
    for line in body.splitlines():
        if line.startswith(prefix):
            return line[len(prefix):]
    return ""


def entity_where(entity: pb.EntityPath) -> str:
    """cluster/switch-or-node/device/port, then job and rank: "c1/node-0003/gpu3 job=42 rank=17"."""
    path = "/".join(p for p in (entity.cluster, entity.switch, entity.node, entity.device, entity.port) if p)
    extra = " ".join(f"{name}={value}" for name, value in (("job", entity.job), ("rank", entity.rank)) if value)
    return untrusted(" ".join(p for p in (path, extra) if p)) or "(no entity)"


def impact_words(event: pb.AnomalyEvent) -> str:
    """"12.5 GPU-hours lost, 64 GPU-hours/h while open (measured)": the anomaly's cost in one line."""
    text = f"{event.impact_gpu_hours:.3g} GPU-hours lost"
    if event.lifecycle != pb.LIFECYCLE_RESOLVED:
        text += f", {event.impact_gpu_hours_per_hour:.3g} GPU-hours/h while open"
    return f"{text} ({untrusted(event.impact_basis, 20)})"


def evidence_line(evidence: pb.Evidence) -> str:
    """name = value unit (threshold t) detail."""
    line = f"{untrusted(evidence.name, 200)} = {evidence.value:.4g}"
    if evidence.unit:
        line += f" {untrusted(evidence.unit, 50)}"
    line += f" (threshold {evidence.threshold:.4g})"
    if evidence.detail:
        line += f" {untrusted(evidence.detail, 500)}"
    return line


def alert_from_anomaly(event: pb.AnomalyEvent, decisions: Sequence[str] = (), dashboard_url: str = "",
                       max_related: int = MAX_RELATED_SHOWN) -> Alert:
    """The `Alert` for one anomaly event; `decisions` are lines like "drained node-0003 (shadow: would have)".

    A RESOLVED event gives a resolved alert that ends at its detection time. An event with
    neither dedup_key nor id cannot be tracked and raises ValueError.
    """
    dedup_key = event.dedup_key or event.id
    if not dedup_key:
        raise ValueError("anomaly event has neither dedup_key nor id; cannot build an alert for it")
    resolved = event.lifecycle == pb.LIFECYCLE_RESOLVED
    severity = SEVERITY_NAME.get(event.severity, WARNING)
    starts_at_ns = event.onset_unix_ns or event.detected_unix_ns
    kind = untrusted(event.kind, 100)
    title = f"{kind_words(kind)} @ {entity_where(event.entity)}"
    if resolved:
        title = f"Resolved: {title}"

    lines = [untrusted(event.summary)] if event.summary else []
    since = utc_iso(starts_at_ns) if starts_at_ns else "unknown"
    if event.detected_unix_ns and event.detected_unix_ns != starts_at_ns:
        since += f" (confirmed {utc_iso(event.detected_unix_ns)})"
    lines.append(f"{SECTION_SINCE}: {since}")
    if resolved and event.detected_unix_ns:
        lines.append(f"Resolved at: {utc_iso(event.detected_unix_ns)}")
    confidence = f", confidence {event.confidence:.2f}" if event.confidence else ""
    lines.append(f"{SECTION_SEVERITY}: {severity}{confidence}")
    if event.impact_basis:
        lines.append(f"{SECTION_IMPACT}: {impact_words(event)}")
    if event.evidence:
        lines.append("Evidence:")
        lines.extend(f"  - {evidence_line(e)}" for e in event.evidence)
    if event.probable_cause:
        lines.append(f"{SECTION_CAUSE}: {untrusted(event.probable_cause)}")
    if event.suggested_action:
        lines.append(f"{SECTION_ACTION}: {untrusted(event.suggested_action)}")
    if decisions:
        lines.append("Actions taken/proposed:")
        lines.extend(f"  - {untrusted(d)}" for d in decisions)
    if event.related:
        shown = ", ".join(entity_where(r) for r in event.related[:max_related])
        more = len(event.related) - max_related
        lines.append(f"Related ({len(event.related)}): {shown}" + (f" and {more} more" if more > 0 else ""))
    if event.detector:
        lines.append(f"Detector: {untrusted(event.detector, 200)}")

    labels = tuple((name, untrusted(getattr(event.entity, name), 253)) for name in LABEL_NAMES
                   if getattr(event.entity, name))
    links: tuple[tuple[str, str], ...] = ()
    if dashboard_url:
        links = (("dashboard", f"{dashboard_url.rstrip('/')}/anomalies/{quote(dedup_key, safe='')}"),)
    return Alert(dedup_key=dedup_key, status=RESOLVED if resolved else FIRING, kind=kind or "anomaly",
                 severity=severity, title=title, body="\n".join(lines), labels=labels,
                 starts_at_ns=starts_at_ns, ends_at_ns=event.detected_unix_ns if resolved else 0,
                 anomaly_id=event.id, links=links, impact_gpu_hours=event.impact_gpu_hours,
                 impact_gpu_hours_per_hour=event.impact_gpu_hours_per_hour)
