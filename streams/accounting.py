"""What happens to every finding of a stage: staleness, the open-anomaly book, metrics, logs.

One `Accounting` per stage instance (a partition's stage 1, 2 or 3, or replay's). For each
batch of findings it

* marks **stale** the findings confirmed by a record the gateway received longer ago than
  ``max_sample_age_s`` by this worker's clock (the gateway's receive time travels with the
  record: a node's own clock, however skewed, decides nothing); a stale finding goes out
  as ``info`` with the age as evidence, so a worker draining a backlog pages nobody and no
  automatic action runs on what may no longer hold. Without a receive time (replay) the
  finding's own event time is the sample's age;
* **re-raises** what it demoted: a stale finding that is still open when a live record of
  the same scope (source, cluster or job) is processed is emitted again as an UPDATE at its
  own severity, confirmed live;
* keeps the book of open anomalies (dedup key -> kind, severity), exported as a gauge;
* moves ``fabricwatch_worker_anomalies_emitted_total`` and the event-time-to-emission
  histogram, and logs each finding with its anomaly id; nothing of that while the stage is
  rebuilding its state from history (those findings were emitted when first found).
"""
from __future__ import annotations

import logging
import time
from collections import Counter
from dataclasses import replace

from fabricwatch import metrics
from fabricwatch.models.findings import INFO, RESOLVED, UPDATE, Evidence, Finding

from .events import event_id

log = logging.getLogger("fabricwatch.pipeline")
# Bound once: `.labels()` takes a lock and a dict lookup per call.
_PROCESSING_S = {stage: metrics.DETECTOR_PROCESSING_SECONDS.labels(stage) for stage in metrics.DETECTOR_STAGES}
_EVENT_TO_ANOMALY_S = {stage: metrics.DETECTOR_EVENT_TO_ANOMALY_SECONDS.labels(stage)
                       for stage in metrics.DETECTOR_STAGES}
# Demoted findings remembered per stage instance for re-raising (beyond: the oldest go).
MAX_DEMOTED = 10_000


class Accounting:
    """Staleness, re-raising, the open-anomaly book, metrics and logs of one stage instance."""

    def __init__(self, stage: str, max_sample_age_s: float | None = None) -> None:
        if max_sample_age_s is not None and not max_sample_age_s > 0:
            raise ValueError(f"max_sample_age_s must be > 0 or None, got {max_sample_age_s!r}")
        if stage not in _PROCESSING_S:
            raise ValueError(f"stage must be one of {metrics.DETECTOR_STAGES}, got {stage!r}")
        self.stage = stage
        self.max_sample_age_s = max_sample_age_s
        self.open_anomalies: dict[str, tuple[str, str]] = {}   # dedup key -> (kind, severity)
        self._demoted: dict[str, dict[str, Finding]] = {}      # scope -> dedup key -> the finding as found
        self.rebuilding = False
        self.stats: Counter[str] = Counter()

    def __getstate__(self) -> dict:
        state = self.__dict__.copy()
        state["rebuilding"] = False
        return state

    # -- staleness ------------------------------------------------------------------------
    def _age_s(self, finding: Finding, received_ns: int, now_ns: int) -> float:
        return (now_ns - (received_ns or finding.detected_ns)) / 1e9

    def settle(self, findings: list[Finding], scope: str, received_ns: int, started_s: float | None) -> list[Finding]:
        """The findings of one record as they go out: staleness applied, re-raises added, accounted."""
        limit_s = self.max_sample_age_s
        if limit_s is not None:
            now_ns = time.time_ns()
            live = (now_ns - received_ns) / 1e9 <= limit_s if received_ns else None
            findings = [self._stale(f, scope, received_ns, now_ns) for f in findings]
            if live and self._demoted.get(scope):
                findings += self._reraise(scope, findings)
        self.account(findings, started_s)
        return findings

    def _stale(self, f: Finding, scope: str, received_ns: int, now_ns: int) -> Finding:
        demoted = self._demoted.get(scope)
        if f.state == RESOLVED:
            if demoted:
                demoted.pop(f.dedup_key, None)
            return f
        age_s = self._age_s(f, received_ns, now_ns)
        if age_s <= self.max_sample_age_s:
            if demoted:
                demoted.pop(f.dedup_key, None)          # confirmed live by this very finding
            return f
        self.stats["stale_findings"] += 1
        if f.severity != INFO:
            book = self._demoted.setdefault(scope, {})
            if len(book) >= MAX_DEMOTED:
                book.pop(next(iter(book)))
            book[f.dedup_key] = f
        return replace(f, severity=INFO, summary=f"[stale: {age_s:.0f} s old] {f.summary}",
                       evidence=[*f.evidence, Evidence("sample_age_s", age_s, self.max_sample_age_s, "s",
                                                       "received on a backlog, not live data")])

    def _reraise(self, scope: str, emitted: list[Finding]) -> list[Finding]:
        """Demoted findings of ``scope`` still open, again at their own severity."""
        book = self._demoted.pop(scope)
        just = {f.dedup_key for f in emitted}
        out = []
        for key, f in book.items():
            if key in just or key not in self.open_anomalies:
                continue
            self.stats["reraised_findings"] += 1
            out.append(replace(f, state=UPDATE, summary=f"[confirmed live] {f.summary}",
                               evidence=[*f.evidence, Evidence("reraised", 1.0, 1.0, "bool",
                                                               "demoted as stale, then confirmed by live data")]))
        return out

    # -- the book, metrics and logs -------------------------------------------------------
    def account(self, findings: list[Finding], started_s: float | None, stage: str | None = None) -> None:
        """Count what goes out; ``started_s``: when the record's processing began (None: the
        caller times several records together)."""
        stage = stage or self.stage
        if started_s is not None:
            _PROCESSING_S[stage].observe(time.perf_counter() - started_s)
        if not findings:
            return
        now_ns = time.time_ns()
        for f in findings:
            if f.state == RESOLVED:
                self.open_anomalies.pop(f.dedup_key, None)
            else:
                self.open_anomalies[f.dedup_key] = (f.kind, f.severity)
            if self.rebuilding:
                continue
            _EVENT_TO_ANOMALY_S[stage].observe(max(0, now_ns - f.detected_ns) / 1e9)
            metrics.WORKER_ANOMALIES_EMITTED.labels(f.kind, f.state).inc()
            level = logging.DEBUG if f.state == UPDATE else logging.INFO
            if log.isEnabledFor(level):
                log.log(level, "anomaly %s %s %s: %s", f.state, f.kind, f.entity.path(), f.summary,
                        extra={"anomaly_id": event_id(f), "dedup_key": f.dedup_key, "kind": f.kind,
                               "lifecycle": f.state, "severity": f.severity, "entity": f.entity.path(),
                               "stage": stage})
