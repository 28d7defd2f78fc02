"""Alerts off the decision loop: one bounded queue and one sending task per sink.

The responder used to send every alert inside its only loop, waiting on each sink's rate
limit: 60 link downgrades delayed an unrelated storm's drain by 118 s, and 250 anomalies
kept the loop from polling Kafka until the consumer group evicted it. Now the loop only
`submit`s an alert; each sink's `SinkQueue` sends at that sink's own pace (its rate
limiter and retries, as before), keeps at most `max_backlog` alerts waiting (the oldest
are dropped, counted and logged, rate-limited), and runs the sink's `tick` (Alertmanager
re-sends) between sends. When every sink has answered for an alert (sent, failed or
dropped), `on_done` gets the results: the responder audits ALERTED / ALERT_FAILED then.
"""
from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import deque
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from fabricwatch import metrics
from fabricwatch.lograte import RateLimitedLogger

from .base import Alert, AlertSink, SendResult

log = logging.getLogger("fabricwatch.alerts")
_limited_log = RateLimitedLogger(log)

DEFAULT_MAX_BACKLOG = 1000        # alerts waiting per sink; a burst beyond it loses its oldest
TICK_S = 1.0                      # how often an idle sink's tick (e.g. Alertmanager re-sends) runs
STOP_GRACE_S = 5.0                # at shutdown, time left to send what is queued


@dataclass
class _Pending:
    """One alert on its way to every sink; done when each has answered."""

    alert: Alert
    token: Any                                     # the caller's handle (the responder's Decision)
    waiting: set[str]
    results: list[tuple[str, SendResult]] = field(default_factory=list)


class SinkQueue:
    """A sink's backlog and the task that drains it."""

    def __init__(self, sink: AlertSink, max_backlog: int, report: Callable[[_Pending, str, SendResult], Awaitable]):
        if max_backlog < 1:
            raise ValueError(f"max_backlog must be >= 1, got {max_backlog}")
        self.sink = sink
        self.max_backlog = max_backlog
        self._report = report
        self._queue: deque[_Pending] = deque()
        self._wake = asyncio.Event()
        self.dropped = 0
        self.sent = 0

    def offer(self, pending: _Pending) -> _Pending | None:
        """Queue `pending`; returns the oldest one pushed out when the backlog was full."""
        dropped = self._queue.popleft() if len(self._queue) >= self.max_backlog else None
        self._queue.append(pending)
        metrics.ALERT_BACKLOG.labels(self.sink.name).set(len(self._queue))
        self._wake.set()
        if dropped is not None:
            self.dropped += 1
            metrics.ALERTS_DROPPED.labels(self.sink.name).inc()
            _limited_log.warning("alert sink %s: backlog of %d full, oldest alert dropped (%s)", self.sink.name,
                                 self.max_backlog, dropped.alert.dedup_key[:200])
        return dropped

    def __len__(self) -> int:
        return len(self._queue)

    async def run(self, stop: asyncio.Event) -> None:
        next_tick = time.monotonic()
        while not (stop.is_set() and not self._queue):
            if not self._queue:
                self._wake.clear()
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(self._wake.wait(), max(0.0, next_tick - time.monotonic()))
            if time.monotonic() >= next_tick:
                next_tick = time.monotonic() + TICK_S
                await self._tick()
            if self._queue:
                pending = self._queue.popleft()
                metrics.ALERT_BACKLOG.labels(self.sink.name).set(len(self._queue))
                await self._report(pending, self.sink.name, await self._send(pending.alert))

    async def _send(self, alert: Alert) -> SendResult:
        try:
            result = await self.sink.send(alert)
        except Exception as exc:  # noqa: BLE001 - a sink must not stop its queue
            _limited_log.warning("alert sink %s raised: %s", self.sink.name, exc)
            result = SendResult(ok=False, detail=f"{type(exc).__name__}: {exc}")
        self.sent += 1
        metrics.ALERTS_SENT.labels(self.sink.name, "ok" if result.ok else "failed").inc()
        return result

    async def _tick(self) -> None:
        try:
            await self.sink.tick(time.time_ns())
        except Exception as exc:  # noqa: BLE001
            _limited_log.warning("alert sink %s tick raised: %s", self.sink.name, exc)


class AlertDispatcher:
    """Fans each alert out to every sink's queue; never waits on a sink.

    ``on_done(token, results)`` runs once per alert, after every sink answered for it;
    with no sinks at all it runs at once with no results.
    """

    def __init__(self, sinks: Sequence[AlertSink], on_done: Callable[[Any, list[tuple[str, SendResult]]], Awaitable],
                 max_backlog: dict[str, int] | None = None) -> None:
        backlog = max_backlog or {}
        self.queues = [SinkQueue(sink, backlog.get(sink.name, DEFAULT_MAX_BACKLOG), self._answered)
                       for sink in sinks]
        self._on_done = on_done
        self._stop = asyncio.Event()
        self._tasks: list[asyncio.Task] = []

    def start(self) -> None:
        self._tasks = [asyncio.create_task(q.run(self._stop), name=f"alerts-{q.sink.name}") for q in self.queues]

    async def stop(self, grace_s: float = STOP_GRACE_S) -> None:
        self._stop.set()
        for q in self.queues:
            q._wake.set()
        if self._tasks:
            _, late = await asyncio.wait(self._tasks, timeout=grace_s)
            for task in late:
                task.cancel()
            await asyncio.gather(*late, return_exceptions=True)

    async def submit(self, alert: Alert, token: Any) -> None:
        """Queue `alert` for every sink (returns at once); a full backlog answers for its oldest."""
        pending = _Pending(alert, token, {q.sink.name for q in self.queues})
        if not self.queues:
            await self._on_done(token, [])
            return
        for q in self.queues:
            dropped = q.offer(pending)
            if dropped is not None:
                await self._answered(dropped, q.sink.name, SendResult(False, f"{q.sink.name}: dropped, backlog of "
                                                                             f"{q.max_backlog} alerts full",
                                                                      attempts=0))

    async def _answered(self, pending: _Pending, sink: str, result: SendResult) -> None:
        pending.results.append((sink, result))
        pending.waiting.discard(sink)
        if not pending.waiting:
            try:
                await self._on_done(pending.token, pending.results)
            except Exception:  # noqa: BLE001 - auditing one alert must not stop a sink's queue
                log.exception("recording the outcome of alert %s failed", pending.alert.dedup_key[:200])

    def backlog(self) -> dict[str, int]:
        return {q.sink.name: len(q) for q in self.queues}

    def dropped(self) -> dict[str, int]:
        return {q.sink.name: q.dropped for q in self.queues}
