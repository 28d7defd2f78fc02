"""The responder process: anomalies topic -> `actions.responder` -> executors, alerts, audit.

Thin on purpose: the decisions are made by `Responder` (pure); this module moves records.

Alerts never hold up actions: the loop hands each alert to `AlertDispatcher`, whose
per-sink queues send at each sink's pace outside the loop (bounded backlog, drop counter),
so a slow or rate-limited sink can neither delay a drain nor keep the consumer from
polling until the group evicts it. The outcome (ALERTED / ALERT_FAILED) is audited when
every sink has answered.

Delivery: anomalies are consumed in a consumer group with manual commits after each batch
is fully handled, so a crash redelivers the batch. Redelivered anomalies map to the same
idempotency keys, which the responder finds in its ledger; the ledger is rebuilt from the
audit topic at start. An action is audited STARTED (acknowledged by every in-sync
replica) before its executor runs, and EXECUTED/FAILED after: a crash in between leaves
an UNKNOWN record at the next start and the action is not run again.
"""
from __future__ import annotations

import argparse
import asyncio
import logging
import signal
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from fabricwatch import metrics
from fabricwatch.actions.alerts.base import AlertSink, SendResult
from fabricwatch.actions.alerts.dispatch import AlertDispatcher
from fabricwatch.actions.alerts.message import alert_from_anomaly
from fabricwatch.lograte import install_reconnect_log_limits
from fabricwatch.actions.base import ALERT, FAILED, Executor, ExecutionResult
from fabricwatch.actions.policy import Policy, load_policy
from fabricwatch.actions.responder import Decision, Responder
from fabricwatch.actions.wiring import Backends, build
from fabricwatch.protos.v1 import events_pb2 as ev

from . import topics
from .cloudevents import CloudEventError, decision_headers
from .events import entity_ref

log = logging.getLogger("fabricwatch.respond")

GROUP_ID = "fabricwatch-responder"
TICK_S = 1.0                 # alert re-sends and quiet-period undos are checked this often
RESTORE_TIMEOUT_S = 60.0
POLL_TIMEOUT_MS = 500
MAX_BATCH = 200
EXECUTOR_DEADLINE_S = 120.0  # on top of each executor's own per-command timeout

_GUARD_OF = {ev.OUTCOME_REFUSED_KILL_SWITCH: "kill_switch", ev.OUTCOME_REFUSED_BREAKER: "blast_radius",
             ev.OUTCOME_SKIPPED_COOLDOWN: "cooldown", ev.OUTCOME_SKIPPED_DUPLICATE: "idempotency",
             ev.OUTCOME_REFUSED_FLAPPING: "flap_memory", ev.OUTCOME_REFUSED_STALE: "max_anomaly_age"}
# Outcomes that go to the actions topic as well: what was (or would have been) done.
_ACTION_OUTCOMES = (ev.OUTCOME_SHADOW, ev.OUTCOME_EXECUTED, ev.OUTCOME_FAILED)


@dataclass
class ResponderStats:
    anomalies: int = 0
    bad_records: int = 0
    decisions: dict[str, int] = field(default_factory=dict)
    restored_records: int = 0
    unknown_after_restart: int = 0

    def count(self, record: ev.ActionDecision) -> None:
        name = ev.Outcome.Name(record.outcome).removeprefix("OUTCOME_").lower()
        self.decisions[name] = self.decisions.get(name, 0) + 1
        metrics.ACTION_DECISIONS.labels(record.action, name).inc()
        guard = _GUARD_OF.get(record.outcome)
        if guard:
            metrics.GUARD_TRIPS.labels(guard).inc()


def _target_path(record: ev.ActionDecision) -> str:
    return entity_ref(record.target).path()


def describe(record: ev.ActionDecision) -> str:
    """One line for alerts and logs: 'drain_node c1/node-7: would have executed (shadow)'."""
    outcome = {
        ev.OUTCOME_SHADOW: "would have executed (shadow mode)",
        ev.OUTCOME_STARTED: "started",
        ev.OUTCOME_EXECUTED: "executed",
        ev.OUTCOME_FAILED: "FAILED",
        ev.OUTCOME_REFUSED_KILL_SWITCH: "refused: kill switch",
        ev.OUTCOME_REFUSED_BREAKER: "refused: blast-radius limit reached, needs a human",
        ev.OUTCOME_SKIPPED_COOLDOWN: "skipped: cooldown",
        ev.OUTCOME_NOT_APPLICABLE: "not applicable",
        ev.OUTCOME_REFUSED_FLAPPING: "refused: target flaps, left for a human",
        ev.OUTCOME_UNKNOWN: "outcome unknown (restart)",
        ev.OUTCOME_REFUSED_STALE: "refused: anomaly too old to act on, needs a human",
    }.get(record.outcome, ev.Outcome.Name(record.outcome))
    detail = f" - {record.reason}" if record.reason and record.outcome != ev.OUTCOME_SHADOW else ""
    return f"{record.action} {_target_path(record) or record.anomaly_dedup_key}: {outcome}{detail}"


def _log_decision(record: ev.ActionDecision) -> None:
    # shadow and duplicate decisions are routine; what acted, failed or was refused is not
    quiet = record.outcome in (ev.OUTCOME_SHADOW, ev.OUTCOME_SKIPPED_DUPLICATE, ev.OUTCOME_NOT_APPLICABLE)
    log.log(logging.INFO if quiet else logging.WARNING, "decision %s", describe(record),
            extra={"action_id": record.idempotency_key, "anomaly_id": record.anomaly_id,
                   "outcome": ev.Outcome.Name(record.outcome)})


class ResponderService:
    def __init__(self, bootstrap: str, responder: Responder, executors: Mapping[str, Executor],
                 sinks: Sequence[AlertSink], *, group_id: str = GROUP_ID, dashboard_url: str = "",
                 alert_backlog: Mapping[str, int] | None = None):
        self.bootstrap = bootstrap
        self.responder = responder
        self.executors = dict(executors)   # action kind -> executor
        self.sinks = list(sinks)
        self.group_id = group_id
        self.dashboard_url = dashboard_url
        self.stats = ResponderStats()
        self.alerts = AlertDispatcher(self.sinks, self._alert_done, dict(alert_backlog or {}))
        self._producer = None
        self._ready = asyncio.Event()

    async def run(self, stop: asyncio.Event) -> None:
        from aiokafka import AIOKafkaConsumer, AIOKafkaProducer

        install_reconnect_log_limits()
        await topics.ensure_topics(self.bootstrap, topics.ALL_TOPICS)
        self._producer = AIOKafkaProducer(bootstrap_servers=self.bootstrap, acks="all", enable_idempotence=True,
                                          linger_ms=0)
        await self._producer.start()
        consumer = None
        self.alerts.start()
        try:
            await self._restore()
            consumer = AIOKafkaConsumer(topics.ANOMALIES, bootstrap_servers=self.bootstrap, group_id=self.group_id,
                                        enable_auto_commit=False, auto_offset_reset="earliest",
                                        max_poll_records=MAX_BATCH)
            await consumer.start()
            self._ready.set()
            next_tick = time.monotonic()
            while not stop.is_set():
                batches = await consumer.getmany(timeout_ms=POLL_TIMEOUT_MS)
                for records in batches.values():
                    for record in records:
                        await self._on_record(record.value, record.timestamp * 1_000_000)
                if batches:
                    await consumer.commit()
                if time.monotonic() >= next_tick:
                    next_tick = time.monotonic() + TICK_S
                    await self._tick()
        finally:
            if consumer is not None:
                await consumer.stop()
            await self.alerts.stop()     # a few seconds to send what is queued, then audited as it stands
            await self._producer.stop()

    async def wait_ready(self, timeout_s: float = 60.0) -> None:
        await asyncio.wait_for(self._ready.wait(), timeout_s)

    # -- restore ---------------------------------------------------------------------------------
    async def _restore(self) -> None:
        from aiokafka import AIOKafkaConsumer

        # Without a group, a subscribed consumer is assigned every partition of the topic.
        consumer = AIOKafkaConsumer(topics.AUDIT, bootstrap_servers=self.bootstrap, group_id=None,
                                    enable_auto_commit=False, auto_offset_reset="earliest")
        await consumer.start()
        records: list[ev.ActionDecision] = []
        try:
            deadline = time.monotonic() + RESTORE_TIMEOUT_S
            while not consumer.assignment():
                if time.monotonic() > deadline:
                    raise RuntimeError(f"no partitions of {topics.AUDIT} assigned within {RESTORE_TIMEOUT_S:g} s")
                await asyncio.sleep(0.05)
            parts = sorted(consumer.assignment())
            await consumer.seek_to_beginning(*parts)
            end = await consumer.end_offsets(parts)
            while [tp for tp in parts if await consumer.position(tp) < end[tp]]:
                if time.monotonic() > deadline:
                    raise RuntimeError(f"could not read the audit topic to its end within {RESTORE_TIMEOUT_S:g} s")
                for batch in (await consumer.getmany(timeout_ms=POLL_TIMEOUT_MS)).values():
                    for record in batch:
                        try:
                            records.append(ev.ActionDecision.FromString(record.value))
                        except Exception:  # noqa: BLE001 - a bad audit record must not stop the responder
                            self.stats.bad_records += 1
        finally:
            await consumer.stop()
        records.sort(key=lambda r: r.decided_unix_ns)
        unknown = self.responder.restore(records)
        self.stats.restored_records = len(records)
        self.stats.unknown_after_restart = len(unknown)
        for record in unknown:
            log.warning("action started before a restart has no result; not retried: %s", describe(record))
            await self._audit(record)
        if records:
            log.warning("restored responder state from %d audit records", len(records))

    # -- anomalies -------------------------------------------------------------------------------
    async def _on_record(self, raw: bytes | None, received_ns: int = 0) -> None:
        try:
            event = ev.AnomalyEvent.FromString(raw or b"")
        except Exception:  # noqa: BLE001 - protobuf raises DecodeError and others
            self.stats.bad_records += 1
            log.warning("undecodable record on %s skipped", topics.ANOMALIES)
            return
        if not event.dedup_key or not event.kind:
            self.stats.bad_records += 1
            log.warning("anomaly without dedup_key/kind skipped (id=%r)", event.id)
            return
        self.stats.anomalies += 1
        decisions = self.responder.on_anomaly(event, time.time_ns(), received_ns)
        # actions first, so that the alert can say what was done (or would have been)
        done = [await self._carry_out(d) for d in decisions if not d.alert and d.record.action != ALERT]
        lines = [describe(r) for r in done if r.outcome != ev.OUTCOME_SKIPPED_DUPLICATE]
        for decision in decisions:
            if decision.alert:
                await self._queue_alert(decision, event, lines)
            elif decision.record.action == ALERT:   # a duplicate alert: audited, not sent
                await self._audit(decision.record)

    async def _carry_out(self, decision: Decision) -> ev.ActionDecision:
        await self._audit(decision.record)
        if decision.request is None:
            _log_decision(decision.record)
            return decision.record
        executor = self.executors.get(decision.request.action)
        if executor is None:
            result = ExecutionResult(FAILED, f"no executor configured for {decision.request.action}")
        else:
            try:
                result = await asyncio.wait_for(executor.execute(decision.request), EXECUTOR_DEADLINE_S)
            except Exception as exc:  # noqa: BLE001 - an executor bug must not stop the responder
                result = ExecutionResult(FAILED, f"{type(exc).__name__}: {exc}")
        record = self.responder.on_result(decision, result, time.time_ns())
        await self._audit(record)
        _log_decision(record)
        return record

    async def _queue_alert(self, decision: Decision, event: ev.AnomalyEvent, lines: list[str]) -> None:
        """Hand the alert to the sinks' queues; its outcome is audited by `_alert_done`."""
        self.responder.alert_queued(decision)
        await self.alerts.submit(alert_from_anomaly(event, lines, self.dashboard_url), decision)

    async def _alert_done(self, decision: Decision, results: list[tuple[str, SendResult]]) -> None:
        ok = bool(results) and all(r.ok for _, r in results)
        detail = "; ".join(f"{name}: {'ok' if r.ok else 'failed'} {r.detail}"[:300] for name, r in results) \
            or "no alert sinks configured"
        record = self.responder.on_alert_sent(decision, ok, detail, time.time_ns())
        record.executor = ",".join(name for name, _ in results)
        await self._audit(record)

    async def _tick(self) -> None:
        # The sinks' own ticks (Alertmanager re-sends) run in their queues, off this loop.
        for decision in self.responder.due_undos(time.time_ns()):
            await self._carry_out(decision)

    async def _audit(self, record: ev.ActionDecision) -> None:
        self.stats.count(record)
        key = _target_path(record).encode()
        value = record.SerializeToString()
        await self._producer.send_and_wait(topics.AUDIT, value, key=key, headers=_headers(record, "audit"))
        if record.outcome in _ACTION_OUTCOMES:
            await self._producer.send_and_wait(topics.ACTIONS, value, key=key, headers=_headers(record, "action"))


def _headers(record: ev.ActionDecision, topic_kind: str) -> list[tuple[str, bytes]]:
    # A decision is audited even if it cannot be a CloudEvent (a bug upstream): losing it is worse.
    try:
        return decision_headers(record, topic_kind)
    except CloudEventError as exc:
        log.error("decision %s audited without CloudEvents headers: %s", record.idempotency_key, exc)
        return []



# -- command line ------------------------------------------------------------------------------
def add_parser(subparsers) -> argparse.ArgumentParser:
    """``fabricwatch respond`` and ``fabricwatch policy-check``."""
    sp = subparsers.add_parser("respond", help="responder: anomalies -> policy -> actions, alerts, audit")
    sp.add_argument("--broker", default="127.0.0.1:9092")
    sp.add_argument("--policy", default=None,
                    help="response policy YAML (docs/actions.md); default deploy/policy.example.yaml (shadow)")
    sp.add_argument("--group-id", default=GROUP_ID, help="consumer group of the anomalies topic")
    sp.add_argument("--duration", type=float, default=0.0, help="stop after this many seconds (0 = until signalled)")
    sp.set_defaults(func=run_command)
    check = subparsers.add_parser("policy-check", help="validate a response policy and print what it would do")
    check.add_argument("policy")
    check.set_defaults(func=check_command)
    return sp


def default_policy_path() -> Path:
    return Path(__file__).resolve().parent.parent / "deploy" / "policy.example.yaml"


def load(policy_path: str | None) -> tuple[Policy, Backends]:
    policy = load_policy(policy_path or default_policy_path())
    return policy, build(policy)


# A PolicyError is a ValueError: the CLI prints it as "fabricwatch <command>: error: ..." (exit 2).
def check_command(args) -> int:
    policy, backends = load(args.policy)
    enabled = sorted(policy.execute) if policy.mode == "execute" else []
    print(f"{args.policy}: valid; mode {policy.mode}; executes {', '.join(enabled) or 'nothing (shadow)'}")
    for rule in policy.rules:
        print(f"  {rule.name}: {', '.join(rule.actions)}")
    print(f"  executors: {', '.join(f'{a}->{n}' for a, n in sorted(backends.executor_names().items())) or 'none'}")
    print(f"  alert sinks: {', '.join(s.name for s in backends.sinks) or 'none'}")
    breaker = policy.guards.breaker
    print(f"  blast radius per executor domain and {breaker.window_s:g} s: {breaker.limit} nodes, "
          f"{breaker.max_jobs_restarted} jobs, {breaker.max_ports_isolated} ports")
    print(f"  domains: {', '.join(sorted(set(backends.executor_domains().values()))) or 'none'}")
    print(f"  acts only on anomalies younger than {policy.guards.max_anomaly_age_s:g} s")
    return 0


def run_command(args) -> int:
    policy, backends = load(args.policy)
    responder = Responder(policy, backends.executor_names(), backends.executor_domains())
    service = ResponderService(args.broker, responder, backends.executors, backends.sinks,
                               group_id=args.group_id, dashboard_url=policy.dashboard_url,
                               alert_backlog=backends.alert_backlog)
    log.warning("responder: mode %s, executes %s", policy.mode, sorted(policy.execute) or "nothing (shadow)")

    async def main() -> None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        if args.duration:
            loop.call_later(args.duration, stop.set)
        await service.run(stop)

    asyncio.run(main())
    return 0
