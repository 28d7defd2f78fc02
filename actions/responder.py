"""Decide what to do about each anomaly: policy rules, then the guard rails. No I/O here.

The stream layer (``streams/respond.py``) feeds anomalies in, writes every returned
`ActionDecision` to the audit topic, runs the `ActionRequest`s on executors and reports
their results back through `on_result`. All state (idempotency keys, breaker window,
cooldowns, what is drained, flapping targets) is rebuilt from the audit topic at start by
`restore`, which goes through the same `_apply` as live decisions.

Order of checks for one (rule, action, target), and the outcome each gives:

1. the idempotency key was decided before (redelivery, restart)   -> SKIPPED_DUPLICATE
2. the anomaly names nothing this action can act on                -> NOT_APPLICABLE
3. the anomaly is older than the policy's max_anomaly_age_s        -> REFUSED_STALE (alerted only)
4. execution enabled but the kill switch is engaged                -> REFUSED_KILL_SWITCH
5. same action on the same target within the cooldown              -> SKIPPED_COOLDOWN
6. the executor domain's budget of nodes / jobs / ports is spent   -> REFUSED_BREAKER
7. execution enabled: STARTED + a request to run; otherwise        -> SHADOW ("would have")

The guard rails count in the domain the executor acts on (`domain_for`: a Slurm cluster,
a Kubernetes cluster, a fabric), never in the cluster an anomaly names: that name comes
from telemetry. Cooldowns and held drains are keyed on the target without its cluster
for the same reason.

Shadow decisions go through the same guards with their own state, so a shadow run shows
exactly what execution would have done, refusals included.

>>> from fabricwatch.actions.policy import parse_policy
>>> policy = parse_policy("rules: [{name: storm, match: {kind: pfc_storm}, actions: [drain_node]}]")
>>> responder = Responder(policy)
>>> storm = ev.AnomalyEvent(id="a1", dedup_key="pfc_storm:c1/node-7/mlx5_0/1", kind="pfc_storm",
...     severity=ev.SEVERITY_CRITICAL, lifecycle=ev.LIFECYCLE_OPEN, onset_unix_ns=10**18, detected_unix_ns=10**18,
...     entity=ev.EntityPath(cluster="c1", node="node-7", device="mlx5_0", port="1"))
>>> [(d.record.action, ev.Outcome.Name(d.record.outcome)) for d in responder.on_anomaly(storm, 10**18)]
[('drain_node', 'OUTCOME_SHADOW')]
>>> [ev.Outcome.Name(d.record.outcome) for d in responder.on_anomaly(storm, 10**18)]  # redelivered
['OUTCOME_SKIPPED_DUPLICATE']
"""
from __future__ import annotations

import hashlib
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from fabricwatch.models.findings import EntityRef
from fabricwatch.protos.v1 import events_pb2 as ev
from fabricwatch.streams.events import entity_proto, entity_ref

from .base import (ALERT, DONE, DRAIN_AFTER_JOB, DRAIN_NODE, EXCLUDE_AND_RESTART, FAILED, ISOLATE_PORT,
                   REQUEUE_JOBS, RESTORE_PORT, RESUME_NODE, UNDO_OF, ActionRequest, ExecutionResult)
from .guards import JOBS, NODES, PORTS, ActionBudget, Cooldown, FlapMemory, IdempotencyLedger, KillSwitch
from .policy import Policy

NODE_ACTIONS = frozenset({DRAIN_NODE, DRAIN_AFTER_JOB, REQUEUE_JOBS, RESUME_NODE})
#: Actions that disturb running work; they count against the blast-radius breaker.
DISRUPTIVE = frozenset({DRAIN_NODE, DRAIN_AFTER_JOB, REQUEUE_JOBS, EXCLUDE_AND_RESTART, ISOLATE_PORT})
#: Actions whose effect lasts until undone; the responder undoes them after a quiet period.
HELD = {DRAIN_NODE: RESUME_NODE, DRAIN_AFTER_JOB: RESUME_NODE, ISOLATE_PORT: RESTORE_PORT}
#: Actions whose result may name jobs it restarted (requeued off a drained node): charged as jobs.
RESTARTS_JOBS = frozenset({DRAIN_NODE, REQUEUE_JOBS, EXCLUDE_AND_RESTART})
_ACTING = (ev.OUTCOME_STARTED, ev.OUTCOME_EXECUTED, ev.OUTCOME_SHADOW, ev.OUTCOME_UNKNOWN)
_LIVE = (ev.LIFECYCLE_OPEN, ev.LIFECYCLE_UPDATE)
#: Targets (nodes, ports) whose last anomaly time is kept for the quiet period; beyond, the
#: oldest quiet ones are forgotten (their names come from telemetry).
MAX_TRACKED_TARGETS = 100_000
#: The domain of actions without an executor (shadow mode): one budget for all of them.
UNCONFIGURED_DOMAIN = "unconfigured"
#: Jobs an action charges that its target does not name are kept in the decision's detail,
#: so that a restart rebuilds the same budget from the audit topic.
JOBS_DETAIL_PREFIX = "jobs: "


@dataclass
class Decision:
    record: ev.ActionDecision            # goes to the audit topic as it is
    request: ActionRequest | None = None  # set when it must be executed now (record outcome STARTED)
    alert: str = ""                       # "firing" / "resolved" when an alert must be sent


@dataclass
class _Held:
    """Something drained or isolated (really, or in shadow) that may be undone later."""

    action: str
    target: EntityRef
    key: str
    shadow: bool
    cause_dedup_key: str


@dataclass
class _Mode:
    """Guard state of one mode; execution and shadow never share a window or a cooldown."""

    breaker: ActionBudget
    cooldown: Cooldown
    flaps: FlapMemory
    held: dict[tuple[str, str], _Held] = field(default_factory=dict)


def idempotency_key(*parts: object) -> str:
    return hashlib.sha256("|".join(str(p) for p in parts).encode()).hexdigest()[:24]


def action_target(action: str, event: ev.AnomalyEvent) -> EntityRef | None:
    """The entity `action` acts on for this anomaly, or None when it names none."""
    e = event.entity
    if action == ALERT:
        return entity_ref(e)
    if action in NODE_ACTIONS:
        return EntityRef(cluster=e.cluster, node=e.node) if e.node and not e.switch else None
    if action == EXCLUDE_AND_RESTART:
        if not e.node or not (e.job or any(r.job for r in event.related)):
            return None
        return EntityRef(cluster=e.cluster, node=e.node, job=e.job, rank=e.rank)
    if action == ISOLATE_PORT:
        return EntityRef(cluster=e.cluster, switch=e.switch, port=e.port) if e.switch and e.port else None
    return None


def guard_path(target: EntityRef) -> str:
    """The target as the guards key it: without the cluster, which an anomaly only claims."""
    return target.local_path()


def breaker_units(action: str, target: EntityRef, jobs: Iterable[str] = ()) -> list[tuple[str, str]]:
    """What `action` on `target` disturbs, as the breaker counts it: nodes drained, jobs
    restarted (the target's job, else the anomaly's `jobs`), ports isolated.

    >>> breaker_units(EXCLUDE_AND_RESTART, EntityRef(cluster="c", node="n7", job="42"))
    [('jobs', '42')]
    >>> breaker_units(DRAIN_NODE, EntityRef(cluster="anything", node="n7"))
    [('nodes', 'n7')]
    """
    if action == EXCLUDE_AND_RESTART:
        return [(JOBS, job) for job in ([target.job] if target.job else sorted(set(jobs) - {""}))]
    if action == ISOLATE_PORT:
        return [(PORTS, f"{target.switch}/{target.port}")]
    if action in NODE_ACTIONS and target.node:
        return [(NODES, target.node)]
    return []


def anomaly_age_s(event: ev.AnomalyEvent, now_ns: int, received_ns: int = 0) -> float:
    """How old the anomaly's evidence is: from the oldest of its detection time, its emission
    and its arrival on Kafka (`received_ns`); infinite when it carries no time at all."""
    times = [t for t in (event.detected_unix_ns, event.emitted_unix_ns, received_ns) if t > 0]
    return (now_ns - min(times)) / 1e9 if times else float("inf")


def affected_jobs(event: ev.AnomalyEvent) -> tuple[str, ...]:
    return tuple(sorted({event.entity.job, *(r.job for r in event.related)} - {""}))


class Responder:
    """`executor_for` names the executor of each action kind; `domain_for` the domain it acts
    on (`Executor.domain`: ``slurm:<ClusterName>``, ``kubernetes:<API server>``, ...)."""

    def __init__(self, policy: Policy, executor_for: Mapping[str, str] | None = None,
                 domain_for: Mapping[str, str] | None = None):
        self.policy = policy
        self.executor_for = dict(executor_for or {})
        self.domain_for = dict(domain_for or {})
        g = policy.guards
        self.kill_switch = KillSwitch(in_policy=g.kill_switch, file=g.kill_switch_file)
        self.ledger = IdempotencyLedger()
        self.modes = {shadow: _Mode(ActionBudget(g.breaker.limits, g.breaker.window_s),
                                    Cooldown(g.cooldown_s), FlapMemory(g.flap_max_undos, g.flap_window_s))
                      for shadow in (False, True)}
        self.alerted: dict[str, str] = {}        # anomaly dedup key -> idempotency key of its last alert
        self.open_on: dict[str, set[str]] = {}   # target path -> open anomaly dedup keys on it
        self.last_anomaly_s: dict[str, float] = {}
        self.forgotten_targets = 0               # quiet targets dropped past MAX_TRACKED_TARGETS

    # -- anomalies ----------------------------------------------------------------------------
    def domain(self, action: str) -> str:
        return self.domain_for.get(action) or UNCONFIGURED_DOMAIN

    def on_anomaly(self, event: ev.AnomalyEvent, now_ns: int, received_ns: int = 0) -> list[Decision]:
        """Decisions for one anomaly; `received_ns` is when it reached Kafka (0: unknown)."""
        now_s = now_ns / 1e9
        self._track(event, now_s)
        if event.lifecycle == ev.LIFECYCLE_RESOLVED:
            return self._resolve_alert(event, now_ns)
        if event.lifecycle not in _LIVE:
            return []
        age_s = anomaly_age_s(event, now_ns, received_ns)
        decisions: list[Decision] = []
        for rule in self.policy.rules_for(event):
            for action in rule.actions:
                if action == ALERT:
                    decisions += self._fire_alert(event, rule.name, now_ns)
                else:
                    decisions.append(self._decide(event, rule.name, action, now_ns, age_s))
        return decisions

    def _decide(self, event: ev.AnomalyEvent, rule: str, action: str, now_ns: int, age_s: float = 0.0) -> Decision:
        target = action_target(action, event)
        key = idempotency_key(rule, action, target.path() if target else "-", event.dedup_key, event.onset_unix_ns)
        executing = self.policy.executes(action)
        record = ev.ActionDecision(
            idempotency_key=key, anomaly_id=event.id, anomaly_dedup_key=event.dedup_key,
            anomaly_kind=event.kind, rule=rule, action=action, decided_unix_ns=now_ns, shadow=not executing,
            executor=self.executor_for.get(action, ""), target=entity_proto(target) if target else None)
        if key in self.ledger:
            record.outcome, record.reason = ev.OUTCOME_SKIPPED_DUPLICATE, "already decided (redelivered anomaly)"
            return Decision(record)
        jobs = affected_jobs(event)
        record.outcome, record.reason = self._guard(action, target, executing, now_ns / 1e9, age_s, jobs)
        if target is not None and not target.job and any(k == JOBS for k, _ in breaker_units(action, target, jobs)):
            record.detail = JOBS_DETAIL_PREFIX + ",".join(jobs)
        decision = Decision(record)
        if record.outcome == ev.OUTCOME_STARTED:
            decision.request = ActionRequest(action=action, target=target, reason=_reason(event),
                                             idempotency_key=key, anomaly_id=event.id,
                                             anomaly_dedup_key=event.dedup_key, jobs=jobs)
        self._apply(record)
        return decision

    def _guard(self, action: str, target: EntityRef | None, executing: bool, now_s: float, age_s: float = 0.0,
               jobs: tuple[str, ...] = ()) -> tuple[int, str]:
        if target is None:
            return ev.OUTCOME_NOT_APPLICABLE, f"the anomaly names no target for {action}"
        max_age_s = self.policy.guards.max_anomaly_age_s
        if age_s > max_age_s:
            return (ev.OUTCOME_REFUSED_STALE, f"the anomaly is {age_s:.0f} s old (at most {max_age_s:g} s to act on): "
                                              "alerted, not acted on")
        mode = self.modes[not executing]
        if executing:
            why = self.kill_switch.engaged()
            if why:
                return ev.OUTCOME_REFUSED_KILL_SWITCH, why
        key = guard_path(target)
        if not mode.cooldown.ready(action, key, now_s):
            return ev.OUTCOME_SKIPPED_COOLDOWN, f"{action} on {key} within the last {mode.cooldown.cooldown_s:g} s"
        domain = self.domain(action)
        if action in DISRUPTIVE:
            full = mode.breaker.admit(domain, breaker_units(action, target, jobs), now_s)
            if full:
                return (ev.OUTCOME_REFUSED_BREAKER,
                        f"blast-radius limit: {mode.breaker.in_window(domain, full, now_s)} {full} of {domain} "
                        f"acted on within {mode.breaker.window_s:g} s (limit {mode.breaker.limit(full)}); "
                        "alert instead of act")
        if executing:
            return ev.OUTCOME_STARTED, ""
        return ev.OUTCOME_SHADOW, "shadow mode: would have executed" if self.policy.mode == "shadow" else \
            f"execution of {action} not enabled in the policy: would have executed"

    # -- results ------------------------------------------------------------------------------
    def on_result(self, decision: Decision, result: ExecutionResult, now_ns: int) -> ev.ActionDecision:
        record = ev.ActionDecision()
        record.CopyFrom(decision.record)
        record.decided_unix_ns = now_ns
        record.outcome = ev.OUTCOME_FAILED if result.status == FAILED else ev.OUTCOME_EXECUTED
        record.reason = "" if result.status == DONE else result.status
        record.detail = result.detail[:4000]
        self._apply(record)
        if decision.request is not None and decision.request.action in RESTARTS_JOBS and result.affected:
            # jobs a drain or requeue moved off the node were restarted too: they count
            self.modes[record.shadow].breaker.charge(self.domain(record.action),
                                                     [(JOBS, job) for job in result.affected], now_ns / 1e9)
        return record

    def alert_queued(self, decision: Decision) -> None:
        """An alert was handed to the sinks' queues; its outcome comes later (`on_alert_sent`).
        Until then a redelivered anomaly must find it decided, and a RESOLVED must follow it."""
        self.ledger.add(decision.record.idempotency_key)
        if decision.alert == "resolved":
            self.alerted.pop(decision.record.anomaly_dedup_key, None)
        else:
            self.alerted[decision.record.anomaly_dedup_key] = decision.record.idempotency_key

    def on_alert_sent(self, decision: Decision, ok: bool, detail: str, now_ns: int) -> ev.ActionDecision:
        record = ev.ActionDecision()
        record.CopyFrom(decision.record)
        record.decided_unix_ns = now_ns
        record.outcome = ev.OUTCOME_ALERTED if ok else ev.OUTCOME_ALERT_FAILED
        record.detail = detail[:4000]
        self._apply(record)
        return record

    # -- alerts -------------------------------------------------------------------------------
    def _fire_alert(self, event: ev.AnomalyEvent, rule: str, now_ns: int) -> list[Decision]:
        # One alert per anomaly and severity: a redelivery is a duplicate, an escalation re-alerts,
        # an UPDATE with the same severity is nothing new for on-call.
        key = idempotency_key("alert", event.dedup_key, event.onset_unix_ns, event.severity)
        if self.alerted.get(event.dedup_key) == key and event.lifecycle == ev.LIFECYCLE_UPDATE:
            return []
        record = ev.ActionDecision(idempotency_key=key, anomaly_id=event.id, anomaly_dedup_key=event.dedup_key,
                                   anomaly_kind=event.kind, rule=rule, action=ALERT, target=event.entity,
                                   decided_unix_ns=now_ns)
        if key in self.ledger:
            record.outcome, record.reason = ev.OUTCOME_SKIPPED_DUPLICATE, "alert already sent (redelivered anomaly)"
            return [Decision(record)]
        return [Decision(record, alert="firing")]

    def _resolve_alert(self, event: ev.AnomalyEvent, now_ns: int) -> list[Decision]:
        if event.dedup_key not in self.alerted:
            return []
        key = idempotency_key("alert-resolved", event.dedup_key, event.onset_unix_ns)
        record = ev.ActionDecision(idempotency_key=key, anomaly_id=event.id, anomaly_dedup_key=event.dedup_key,
                                   anomaly_kind=event.kind, action=ALERT, target=event.entity,
                                   decided_unix_ns=now_ns, reason="resolved")
        if key in self.ledger:
            record.outcome = ev.OUTCOME_SKIPPED_DUPLICATE
            return [Decision(record)]
        return [Decision(record, alert="resolved")]

    # -- undo after a quiet period -------------------------------------------------------------
    def due_undos(self, now_ns: int) -> list[Decision]:
        now_s = now_ns / 1e9
        quiet = self.policy.guards.quiet_period_s
        decisions = []
        for shadow, mode in self.modes.items():
            for held in list(mode.held.values()):
                path = guard_path(held.target)
                if self.open_on.get(path) or now_s - self.last_anomaly_s.get(path, now_s) < quiet:
                    continue
                undo = HELD[held.action]
                executing = not shadow
                record = ev.ActionDecision(
                    idempotency_key=idempotency_key("undo", held.key), anomaly_dedup_key=held.cause_dedup_key,
                    rule="quiet-period", action=undo, target=entity_proto(held.target), decided_unix_ns=now_ns,
                    shadow=shadow, executor=self.executor_for.get(undo, ""))
                why = self.kill_switch.engaged() if executing else ""
                if why:
                    # retry after another quiet period rather than every tick
                    self.last_anomaly_s[path] = now_s
                    record.outcome, record.reason = ev.OUTCOME_REFUSED_KILL_SWITCH, why
                elif not mode.flaps.may_undo(path, now_s):
                    record.outcome = ev.OUTCOME_REFUSED_FLAPPING
                    record.reason = (f"{path} was restored {mode.flaps.max_undos} times within "
                                     f"{mode.flaps.window_s:g} s: left {held.action} for a human")
                else:
                    record.outcome = ev.OUTCOME_STARTED if executing else ev.OUTCOME_SHADOW
                    record.reason = f"no anomaly on {path} for {quiet:g} s"
                decision = Decision(record)
                if record.outcome == ev.OUTCOME_STARTED:
                    decision.request = ActionRequest(action=undo, target=held.target, reason=record.reason,
                                                     idempotency_key=record.idempotency_key,
                                                     anomaly_dedup_key=held.cause_dedup_key)
                self._apply(record)
                decisions.append(decision)
        return decisions

    # -- state --------------------------------------------------------------------------------
    def restore(self, records: Iterable[ev.ActionDecision]) -> list[ev.ActionDecision]:
        """Rebuild the guard state from audit records, oldest first.

        Returns the actions a crash left between STARTED and a result, as UNKNOWN records
        for the caller to audit: they may have run, so they are never run again.
        """
        started: dict[str, ev.ActionDecision] = {}
        for record in records:
            if record.outcome == ev.OUTCOME_STARTED:
                started[record.idempotency_key] = record
            elif record.outcome in (ev.OUTCOME_EXECUTED, ev.OUTCOME_FAILED, ev.OUTCOME_UNKNOWN):
                started.pop(record.idempotency_key, None)
            self._apply(record, restoring=True)
        return [_with_outcome(r, ev.OUTCOME_UNKNOWN) for r in started.values()]

    def _apply(self, record: ev.ActionDecision, restoring: bool = False) -> None:
        """The one place decisions change state, live and when restoring from the audit topic."""
        if record.outcome == ev.OUTCOME_SKIPPED_DUPLICATE:
            return
        self.ledger.add(record.idempotency_key)
        if record.action == ALERT:
            if record.outcome == ev.OUTCOME_ALERTED and record.reason == "resolved":
                self.alerted.pop(record.anomaly_dedup_key, None)
            elif record.outcome == ev.OUTCOME_ALERTED:
                self.alerted[record.anomaly_dedup_key] = record.idempotency_key
            return
        at_s = record.decided_unix_ns / 1e9
        target = entity_ref(record.target)
        path = guard_path(target)
        mode = self.modes[record.shadow]
        # EXECUTED / FAILED follow a STARTED that was applied already; refusals change nothing
        acted = record.outcome in (ev.OUTCOME_STARTED, ev.OUTCOME_SHADOW, ev.OUTCOME_UNKNOWN)
        if record.action in UNDO_OF:
            if acted or record.outcome == ev.OUTCOME_REFUSED_FLAPPING:
                for action in [a for a, undo in HELD.items() if undo == record.action]:
                    mode.held.pop((action, path), None)
            if acted:
                mode.flaps.record_undo(path, at_s)
            return
        if not acted:
            return
        mode.cooldown.charge(record.action, path, at_s)
        if restoring and record.action in DISRUPTIVE:   # live decisions were admitted by the breaker
            jobs = record.detail[len(JOBS_DETAIL_PREFIX):].split(",") if record.detail.startswith(
                JOBS_DETAIL_PREFIX) else ()
            mode.breaker.charge(self.domain(record.action), breaker_units(record.action, target, jobs), at_s)
        if record.action in HELD:
            mode.held[(record.action, path)] = _Held(record.action, target, record.idempotency_key, record.shadow,
                                                     record.anomaly_dedup_key)
            # the quiet period counts from the action at the earliest
            self.last_anomaly_s[path] = max(self.last_anomaly_s.get(path, 0.0), at_s)

    def _track(self, event: ev.AnomalyEvent, now_s: float) -> None:
        e = event.entity
        paths = []
        if e.node and not e.switch:
            paths.append(guard_path(EntityRef(node=e.node)))
        if e.switch and e.port:
            paths.append(guard_path(EntityRef(switch=e.switch, port=e.port)))
        for path in paths:
            self.last_anomaly_s[path] = now_s
            keys = self.open_on.setdefault(path, set())
            if event.lifecycle == ev.LIFECYCLE_RESOLVED:
                keys.discard(event.dedup_key)
                if not keys:
                    del self.open_on[path]
            else:
                keys.add(event.dedup_key)
        if len(self.last_anomaly_s) > MAX_TRACKED_TARGETS:
            self._forget_quiet_targets()

    def _forget_quiet_targets(self) -> None:
        """Node and port names come from telemetry: forget the oldest that have nothing open and
        nothing held, so that fresh names cannot grow the responder without bound."""
        held = {guard_path(h.target) for mode in self.modes.values() for h in mode.held.values()}
        quiet = sorted((t, path) for path, t in self.last_anomaly_s.items()
                       if path not in held and not self.open_on.get(path))
        drop = quiet[: len(self.last_anomaly_s) - MAX_TRACKED_TARGETS // 2]
        for _, path in drop:
            del self.last_anomaly_s[path]
            self.open_on.pop(path, None)
        self.forgotten_targets += len(drop)

    def held(self, shadow: bool) -> list[str]:
        """Targets currently drained/isolated by us (or in shadow), for status pages and tests."""
        return sorted(f"{held.action}:{held.target.path()}" for held in self.modes[shadow].held.values())


def _with_outcome(record: ev.ActionDecision, outcome: int) -> ev.ActionDecision:
    copy = ev.ActionDecision()
    copy.CopyFrom(record)
    copy.outcome = outcome
    copy.reason = "started before a restart; no result recorded: not retried"
    return copy


def _reason(event: ev.AnomalyEvent) -> str:
    cause = f" ({event.cause_code})" if event.cause_code else ""
    return f"{event.kind}{cause} on {entity_ref(event.entity).path()}"
