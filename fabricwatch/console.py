"""The terminal view of anomalies: `fabricwatch tail` and the screen of `fabricwatch up`."""
from __future__ import annotations

import asyncio
import sys
import time
from collections import Counter, deque
from collections.abc import Callable
from datetime import datetime, timezone

from fabricwatch.models.impact import ESTIMATED, projected_gpu_hours
from fabricwatch.protos.v1 import events_pb2 as ev

_SEVERITY = {ev.SEVERITY_INFO: "INFO", ev.SEVERITY_WARNING: "WARN", ev.SEVERITY_CRITICAL: "CRIT"}
_LIFECYCLE = {ev.LIFECYCLE_OPEN: "OPEN", ev.LIFECYCLE_UPDATE: "UPDATE", ev.LIFECYCLE_RESOLVED: "RESOLVED"}
_COLOUR = {ev.SEVERITY_INFO: "\033[36m", ev.SEVERITY_WARNING: "\033[33m", ev.SEVERITY_CRITICAL: "\033[31;1m"}
_RESET = "\033[0m"


def _clock(ns: int) -> str:
    return datetime.fromtimestamp(ns / 1e9, tz=timezone.utc).strftime("%H:%M:%S.%f")[:-3]


def impact_text(event: ev.AnomalyEvent) -> str:
    """"12.3 GPU-h +64/h~": lost so far (as of the event), the rate while open; ~ when estimated."""
    if not event.impact_basis:
        return ""
    rate = f" +{event.impact_gpu_hours_per_hour:.3g}/h" if event.lifecycle != ev.LIFECYCLE_RESOLVED else ""
    return f"{event.impact_gpu_hours:.3g} GPU-h{rate}{'~' if event.impact_basis == ESTIMATED else ''}"


def format_event(event: ev.AnomalyEvent, colour: bool = False) -> str:
    """One line per event: event time, lifecycle, severity, kind, impact, summary, detection delay."""
    delay_s = (event.emitted_unix_ns - event.detected_unix_ns) / 1e9 if event.emitted_unix_ns else 0.0
    sev = _SEVERITY.get(event.severity, "?")
    if colour:
        sev = f"{_COLOUR.get(event.severity, '')}{sev}{_RESET}"
    return (f"{_clock(event.detected_unix_ns)} {_LIFECYCLE.get(event.lifecycle, '?'):8} {sev:4} "
            f"{event.kind:16} {impact_text(event):18} {event.summary}  [+{delay_s:.2f}s]")


class LiveView:
    """Open anomalies plus the latest events, redrawn in place on a terminal."""

    def __init__(self, title: str, out=sys.stdout, max_recent: int = 12) -> None:
        self.title = title
        self.out = out
        self.tty = out.isatty()
        self.open: dict[str, ev.AnomalyEvent] = {}
        self.recent: deque[str] = deque(maxlen=max_recent)
        self.counts: Counter[str] = Counter()
        self.status = ""
        self._seen_ids: deque[str] = deque(maxlen=4096)   # at-least-once delivery: show each event once

    def add(self, event: ev.AnomalyEvent) -> None:
        if event.id and event.id in self._seen_ids:
            return
        self._seen_ids.append(event.id)
        self.counts[event.kind] += event.lifecycle == ev.LIFECYCLE_OPEN
        if event.lifecycle == ev.LIFECYCLE_RESOLVED:
            self.open.pop(event.dedup_key, None)
        else:
            self.open[event.dedup_key] = event
        line = format_event(event, colour=self.tty)
        self.recent.append(line)
        if not self.tty:
            print(line, file=self.out, flush=True)

    def render(self) -> None:
        if not self.tty:
            return
        rows = [f"\033[H\033[2J\033[1m{self.title}\033[0m   {time.strftime('%H:%M:%S')}   {self.status}", ""]
        rows.append(f"\033[1mOPEN ANOMALIES ({len(self.open)})\033[0m")
        now_ns = time.time_ns()
        by_cost = sorted(self.open.values(), key=lambda e: (-projected_gpu_hours(
            e.impact_gpu_hours, e.impact_gpu_hours_per_hour, e.detected_unix_ns, now_ns), -e.severity,
            e.detected_unix_ns))
        for e in by_cost[:20]:
            rows.append("  " + format_event(e, colour=True))
        rows += ["", "\033[1mLATEST EVENTS\033[0m"] + ["  " + r for r in self.recent]
        rows += ["", "opened so far: " + (", ".join(f"{k}={v}" for k, v in sorted(self.counts.items())) or "none"),
                 "Ctrl-C to stop"]
        self.out.write("\n".join(rows) + "\n")
        self.out.flush()


async def follow_anomalies(bootstrap: str, on_event: Callable[[ev.AnomalyEvent], None], stop: asyncio.Event,
                           from_beginning: bool = False) -> None:
    """Call `on_event` for each anomaly event on the topic until `stop` is set."""
    from aiokafka import AIOKafkaConsumer

    from fabricwatch.streams import topics

    consumer = AIOKafkaConsumer(topics.ANOMALIES, bootstrap_servers=bootstrap, group_id=None,
                                auto_offset_reset="earliest" if from_beginning else "latest")
    await consumer.start()
    try:
        while not stop.is_set():
            batches = await consumer.getmany(timeout_ms=200)
            for records in batches.values():
                for record in records:
                    try:
                        on_event(ev.AnomalyEvent.FromString(record.value))
                    except Exception as exc:  # a malformed event must not end the view
                        print(f"skipping a malformed anomaly record: {exc}", file=sys.stderr)
    finally:
        await consumer.stop()
