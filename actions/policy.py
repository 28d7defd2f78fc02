"""The response policy: which anomalies lead to which actions, and whether they execute.

A policy file is YAML, checked completely before anything starts against its schema
(`PolicyFile`, `fabricwatch.config_schema` sections); every mistake is named with its path
(``rules[2].match.kind: unknown anomaly kind 'pfc'``). Nothing executes
unless the file says so twice: ``mode: execute`` *and* the action kind listed under
``execute``. Otherwise each decision is recorded as "would have done X" (shadow mode).
Alerts are not actions on the cluster: they are sent in both modes.

>>> policy = parse_policy('''
... rules:
...   - name: storm-source
...     match: {kind: pfc_storm, scope: node}
...     actions: [alert, drain_node, requeue_jobs]
... ''')
>>> policy.mode, policy.executes("drain_node")
('shadow', False)
>>> policy.rules[0].actions
('alert', 'drain_node', 'requeue_jobs')
>>> try:
...     parse_policy("rules: [{name: x, match: {kind: pfc}, actions: [alert]}]")
... except PolicyError as err:
...     print(err)
rules[0].match.kind: unknown anomaly kind 'pfc'; known: ecmp_imbalance, ecn_pfc_misorder, ..., straggler, unknown_anomaly
"""
from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Any

import yaml
from pydantic import AfterValidator, BeforeValidator, Field, field_validator, model_validator

from fabricwatch.config_schema import Section, Within, validate

from fabricwatch.models.event_filter import EventFilter
from fabricwatch.models.vocabulary import ANOMALY_KINDS, CAUSE_CODES, INFO, SEVERITIES, WARNING
from fabricwatch.protos.v1 import events_pb2 as ev
from fabricwatch.streams.events import anomaly_facts

from .alerts.dispatch import DEFAULT_MAX_BACKLOG
from .base import ACTION_KINDS, ALERT, UNDO_OF
from .guards import JOBS, NODES, PORTS

MAX_POLICY_BYTES = 256 * 1024      # a policy is a page of YAML; anything bigger is a mistake or an attack
MAX_RULES = 200
NAME_PATTERN = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")


# Which entity field an anomaly must carry for a rule of this scope to match.
SCOPE_ANY, SCOPE_NODE, SCOPE_SWITCH, SCOPE_JOB = "any", "node", "switch", "job"
SCOPES = (SCOPE_ANY, SCOPE_NODE, SCOPE_SWITCH, SCOPE_JOB)

SHADOW, EXECUTE = "shadow", "execute"

# Guard-rail defaults (docs/actions.md): production tools act on at most a few percent of a
# fleet at once, and a wrong drain costs more than a missed one.
BREAKER_MAX_FRACTION = 0.01
BREAKER_MIN_COUNT = 2
BREAKER_MAX_JOBS_RESTARTED = 2     # per domain and window: a restart costs every rank of the job
BREAKER_MAX_PORTS_ISOLATED = 2
BREAKER_WINDOW_S = 600.0
# Act only on fresh evidence: an anomaly older than this (a backlog after an outage, a
# replayed or back-dated one) is alerted on, never executed.
MAX_ANOMALY_AGE_S = 600.0
COOLDOWN_S = 1800.0
# Impact thresholds above this are typos: a week of a 100,000-GPU fleet is ~1.7e7 GPU-hours.
MAX_IMPACT_GPU_HOURS = 1e9
QUIET_PERIOD_S = 3600.0
FLAP_WINDOW_S = 86400.0
FLAP_MAX_UNDOS = 2


class PolicyError(ValueError):
    """A policy file that must not be used; the message names the offending path."""


@dataclass(frozen=True)
class Match(EventFilter):
    """A rule's match: the shared event filter (kinds, causes, clusters, GPU-hours lost so far
    and their rate while open; empty: any) at `WARNING` or worse by default, plus a scope."""

    min_severity: str = WARNING
    scope: str = SCOPE_ANY

    def matches(self, event: ev.AnomalyEvent) -> bool:
        # A severity the policy does not know counts as the lowest, info.
        if not self.admits(anomaly_facts(event, unknown_severity=INFO)):
            return False
        entity = event.entity
        return {SCOPE_ANY: True, SCOPE_NODE: bool(entity.node) and not entity.switch,
                SCOPE_SWITCH: bool(entity.switch), SCOPE_JOB: bool(entity.job)}[self.scope]


@dataclass(frozen=True)
class Rule:
    name: str
    match: Match
    actions: tuple[str, ...]


Seconds = Annotated[float, Within(0.0, 30 * 86400.0)]


class BreakerConfig(Section):
    """Blast-radius limits per executor domain (a Slurm cluster, a Kubernetes cluster, a
    fabric) and window: nodes drained, jobs restarted, ports isolated, each counted apart."""

    max_fraction: Annotated[float, Within(0.0, 1.0)] = Field(
        BREAKER_MAX_FRACTION, description="nodes drained per executor domain and window: this fraction of "
                                          "`fleet_size`")
    min_count: Annotated[int, Within(0, 100_000)] = Field(BREAKER_MIN_COUNT,
                                                          description="... but at least this many nodes")
    window_s: Annotated[float, Within(1.0, 7 * 86400.0)] = Field(BREAKER_WINDOW_S,
                                                                 description="the blast-radius window, seconds")
    fleet_size: Annotated[int, Within(0, 10_000_000)] = Field(
        0, description="nodes in the executor's domain (0: unknown, the node limit is `min_count`)")
    max_jobs_restarted: Annotated[int, Within(0, 100_000)] = Field(
        BREAKER_MAX_JOBS_RESTARTED, description="jobs restarted (exclude_and_restart, and jobs a drain or requeue "
                                                "moved) per executor domain and window")
    max_ports_isolated: Annotated[int, Within(0, 100_000)] = Field(
        BREAKER_MAX_PORTS_ISOLATED, description="switch ports isolated per fabric and window")

    @property
    def limit(self) -> int:
        """Nodes drained (or requeued) per domain and window."""
        return max(self.min_count, math.floor(self.max_fraction * self.fleet_size))

    @property
    def limits(self) -> dict[str, int]:
        return {NODES: self.limit, JOBS: self.max_jobs_restarted, PORTS: self.max_ports_isolated}


class Guards(Section):
    breaker: BreakerConfig = Field(default_factory=BreakerConfig)
    cooldown_s: Seconds = Field(COOLDOWN_S, description="the same action on the same target (its cluster "
                                                        "ignored) at most once in this long")
    quiet_period_s: Seconds = Field(QUIET_PERIOD_S, description="undo a drain or isolation after this long "
                                                                "without anomalies on it")
    flap_window_s: Annotated[float, Within(0.0, 90 * 86400.0)] = Field(
        FLAP_WINDOW_S, description="window of `flap_max_undos`")
    flap_max_undos: Annotated[int, Within(0, 1000)] = Field(
        FLAP_MAX_UNDOS, description="undos within `flap_window_s` after which a target stays drained for a human")
    kill_switch: bool = Field(False, description="stop all execution")
    kill_switch_file: Text = Field("", description="stop all execution while this file exists")
    max_anomaly_age_s: Annotated[float, Within(1.0, 7 * 86400.0)] = Field(
        MAX_ANOMALY_AGE_S, description="anomalies older than this (detection, emission or arrival) are alerted "
                                       "on, never acted on (`REFUSED_STALE`)")


@dataclass(frozen=True)
class Policy:
    rules: tuple[Rule, ...] = ()
    mode: str = SHADOW
    execute: frozenset[str] = frozenset()
    guards: Guards = field(default_factory=Guards)
    # Backend settings: `actions.wiring` builds the executors and sinks they name.
    executors: ExecutorsSection = field(default_factory=lambda: ExecutorsSection())
    alerts: AlertsSection = field(default_factory=lambda: AlertsSection())
    dashboard_url: str = ""

    def executes(self, action: str) -> bool:
        """True only when the operator enabled execution of this action kind."""
        return action == ALERT or (self.mode == EXECUTE and action in self.execute)

    def rules_for(self, event: ev.AnomalyEvent) -> list[Rule]:
        return [rule for rule in self.rules if rule.match.matches(event)]


# -- parsing ----------------------------------------------------------------------------------
class _NoAliasLoader(yaml.SafeLoader):
    """Safe YAML without anchors/aliases: they add nothing to a policy and enable 'billion laughs'."""

    def compose_node(self, parent, index):  # noqa: ANN001 - PyYAML's signature
        if self.check_event(yaml.AliasEvent):
            event = self.peek_event()
            raise PolicyError(f"line {event.start_mark.line + 1}: YAML aliases are not allowed in a policy")
        return super().compose_node(parent, index)


def load_policy(path: str | Path) -> Policy:
    path = Path(path)
    try:
        size = path.stat().st_size
        if size > MAX_POLICY_BYTES:
            raise PolicyError(f"{path}: {size} bytes; a policy is at most {MAX_POLICY_BYTES}")
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise PolicyError(f"{path}: cannot read: {exc.strerror or exc}") from None
    except UnicodeDecodeError:
        raise PolicyError(f"{path}: not UTF-8 text") from None
    try:
        return parse_policy(text)
    except PolicyError as exc:
        raise PolicyError(f"{path}: {exc}") from None


def _printable(value: str) -> str:
    if len(value) > 1024 or not value.isprintable():
        raise ValueError("expected a printable string of at most 1024 characters")
    return value


def _one_of(*choices: str):
    def check(value: str) -> str:
        if value not in choices:
            raise ValueError(f"{value!r} is not one of {', '.join(choices)}")
        return value
    return AfterValidator(check)


def _names(known: frozenset[str] | None, what: str):
    """A list of names (each NAME_PATTERN), all in `known` when given."""
    def check(value: list[str]) -> list[str]:
        if len(value) > 1000:
            raise ValueError(f"expected a list of {what}s")
        for item in value:
            if not NAME_PATTERN.match(item):
                raise ValueError(f"{item!r} is not a valid {what}")
            if known is not None and item not in known:
                raise ValueError(f"unknown {what} {item!r}; known: {', '.join(sorted(known))}")
        return value
    return AfterValidator(check)


def _rule_name(value: str) -> str:
    if not NAME_PATTERN.match(value):
        raise ValueError(f"{value!r} must match {NAME_PATTERN.pattern}")
    return value


def _one_or_many(value: Any) -> Any:
    return [value] if isinstance(value, str) else value


Text = Annotated[str, AfterValidator(_printable)]
OneOrMany = BeforeValidator(_one_or_many)
GpuHours = Annotated[float, Within(0.0, MAX_IMPACT_GPU_HOURS)]
ActionKinds = Annotated[list[str], _names(ACTION_KINDS - set(UNDO_OF), "action kind")]


class MatchSection(Section):
    kind: Annotated[list[str], OneOrMany, _names(ANOMALY_KINDS, "anomaly kind")] = Field(
        default_factory=list, description="anomaly kinds (one or a list; none: any)")
    min_severity: Annotated[str, _one_of(*SEVERITIES)] = Field(WARNING, description="least severity")
    scope: Annotated[str, _one_of(*SCOPES)] = Field(SCOPE_ANY, description="the entity the anomaly must name")
    cause: Annotated[list[str], OneOrMany, _names(CAUSE_CODES, "cause code")] = Field(
        default_factory=list, description="cause codes (none: any)")
    cluster: Annotated[list[str], OneOrMany, _names(None, "cluster")] = Field(
        default_factory=list, description="clusters (none: any)")
    min_impact_gpu_hours: GpuHours = Field(0.0, description="GPU-hours lost so far")
    min_impact_gpu_hours_per_hour: GpuHours = Field(0.0, description="GPU-hours lost per hour while open")


class RuleSection(Section):
    name: Annotated[str, AfterValidator(_rule_name)] = Field(description="rule name, unique")
    match: MatchSection = Field(default_factory=MatchSection)
    actions: ActionKinds = Field(description="what to do, in order")

    @field_validator("actions")
    @classmethod
    def _some_action(cls, actions: list[str]) -> list[str]:
        if not actions:
            raise ValueError("at least one action is required")
        if len(set(actions)) != len(actions):
            raise ValueError("an action is listed twice")
        return actions


# -- backends: each executor's and alert sink's own keys (built by `actions.wiring`) ---------
Argv = Annotated[list[str], Field(max_length=64)]
Backlog = Annotated[int, Within(1, 1_000_000)]   # default: DEFAULT_MAX_BACKLOG
BACKLOG_MEANING = "alerts queued for this sink before the oldest are dropped (counted)"


class SlurmSection(Section):
    scontrol: Text = Field("scontrol", description="the `scontrol` command")
    squeue: Text = Field("squeue", description="the `squeue` command")
    slurm_conf: Text = Field("", description="`SLURM_CONF` for the commands (empty: the environment's)")
    command_timeout_s: Annotated[float, Within(0.1, 600.0)] = Field(10.0, description="one command's deadline, s")
    cluster_name: Text = Field("", description="the breaker domain's name (empty: the cluster name in `slurm.conf`)")


class KubernetesSection(Section):
    kubeconfig: Text = Field("", description="kubeconfig file (empty: `$KUBECONFIG` or `~/.kube/config`)")
    context: Text = Field("", description="kubeconfig context (empty: the current one)")
    in_cluster: bool = Field(False, description="use the pod's service account instead of a kubeconfig")
    request_timeout_s: Annotated[float, Within(1.0, 600.0)] = Field(30.0, description="one API call's deadline, s")


class RestartSection(Section):
    argv: Argv = Field(default_factory=list, description="argv template (no shell) that restarts a job without a node: "
                                                         "`{job}`, `{node}`, `{rank}`, `{reason}`, "
                                                         "`{idempotency_key}` filled in")
    verify_argv: Argv = Field(default_factory=list, description="argv template (`{job}`, `{node}`) that confirms the job "
                                                                "runs on the node; required to execute through "
                                                                "this executor")
    webhook_url: Text = Field("", description="instead of `argv`: POST the request here, HMAC-signed (https, "
                                                 "or http to loopback)")
    webhook_secret_env: Text = Field("", description="environment variable holding the webhook's HMAC secret "
                                                     "(required with `webhook_url`)")
    timeout_s: Annotated[float, Within(0.1, 3600.0)] = Field(60.0, description="one restart's deadline, s")


class ExecutorsSection(Section):
    scheduler: Annotated[str, _one_of("none", "slurm", "kubernetes")] = Field(
        "none", description="who drains nodes and requeues jobs: `none`, `slurm` or `kubernetes`")
    slurm: SlurmSection = Field(default_factory=SlurmSection, description="with `scheduler: slurm`")
    kubernetes: KubernetesSection = Field(default_factory=KubernetesSection,
                                          description="with `scheduler: kubernetes`")
    restart: RestartSection | None = Field(None, description="the exclude_and_restart executor (a command or "
                                                             "a webhook)")
    switch_collector_config: Text = Field("", description="a switch collector config: isolate_port sets ports "
                                                          "down on its switches over gNMI")


class AlertmanagerSection(Section):
    urls: Annotated[list[Text], Field(min_length=1, max_length=16)] = Field(
        description="Alertmanager base URLs (each gets every alert)")
    resend_interval_s: Annotated[float, Within(1.0, 3600.0)] = Field(
        60.0, description="re-post firing alerts this often, s")
    max_backlog: Backlog = Field(DEFAULT_MAX_BACKLOG, description=BACKLOG_MEANING)


class PagerDutySection(Section):
    routing_key_env: Text = Field(description="environment variable holding the routing key")
    url: Text = Field("https://events.pagerduty.com/v2/enqueue", description="Events API v2 endpoint")
    max_backlog: Backlog = Field(DEFAULT_MAX_BACKLOG, description=BACKLOG_MEANING)


class SlackSection(Section):
    webhook_url_env: Text = Field(description="environment variable holding the incoming-webhook URL")
    max_backlog: Backlog = Field(DEFAULT_MAX_BACKLOG, description=BACKLOG_MEANING)


class FeishuSection(Section):
    webhook_url_env: Text = Field(description="environment variable holding the bot webhook URL")
    secret_env: Text = Field("", description="environment variable holding the signing secret (optional)")
    msg_type: Text = Field("post", description="Feishu message type")
    max_backlog: Backlog = Field(DEFAULT_MAX_BACKLOG, description=BACKLOG_MEANING)


class WeComSection(Section):
    webhook_url_env: Text = Field(description="environment variable holding the bot webhook URL")
    msg_type: Text = Field("markdown", description="WeCom message type")
    mentioned: Annotated[list[str], _names(None, "user id")] = Field(default_factory=list,
                                                                     description="user ids to @-mention")
    max_backlog: Backlog = Field(DEFAULT_MAX_BACKLOG, description=BACKLOG_MEANING)


class AlertsSection(Section):
    alertmanager: AlertmanagerSection | None = Field(None, description="Prometheus Alertmanager")
    pagerduty: PagerDutySection | None = Field(None, description="PagerDuty Events API v2")
    slack: SlackSection | None = Field(None, description="Slack incoming webhook")
    feishu: FeishuSection | None = Field(None, description="Feishu (Lark) bot")
    wecom: WeComSection | None = Field(None, description="WeCom bot")


class PolicyFile(Section):
    version: Annotated[int, Within(1, 1)] = Field(1, description="policy format version")
    mode: Annotated[str, _one_of(SHADOW, EXECUTE)] = Field(
        SHADOW, description="`shadow` (record what would be done) or `execute`")
    execute: Annotated[list[str], _names(ACTION_KINDS - {ALERT} - set(UNDO_OF), "action kind")] = Field(
        default_factory=list, description="action kinds allowed to run when `mode: execute`")
    rules: Annotated[list[RuleSection], Field(max_length=MAX_RULES)] = Field(default_factory=list)
    guards: Guards = Field(default_factory=Guards)
    executors: ExecutorsSection = Field(default_factory=ExecutorsSection)
    alerts: AlertsSection = Field(default_factory=AlertsSection)
    dashboard_url: Text = Field("", description="links in alerts")

    @model_validator(mode="after")
    def _unique_rule_names(self) -> PolicyFile:
        seen: set[str] = set()
        for i, rule in enumerate(self.rules):
            if rule.name in seen:
                raise ValueError(f"rules[{i}].name: duplicate rule name {rule.name!r}")
            seen.add(rule.name)
        return self


def parse_policy(text: str) -> Policy:
    if len(text.encode("utf-8", "replace")) > MAX_POLICY_BYTES:
        raise PolicyError(f"policy larger than {MAX_POLICY_BYTES} bytes")
    try:
        doc = yaml.load(text, Loader=_NoAliasLoader)  # noqa: S506 - a SafeLoader subclass
    except yaml.YAMLError as exc:
        raise PolicyError(f"not valid YAML: {exc}") from None
    f = validate(PolicyFile, doc, error=PolicyError, root="policy", name_items=False)
    rules = tuple(Rule(name=r.name, actions=tuple(r.actions), match=Match(
        kinds=frozenset(r.match.kind), min_severity=r.match.min_severity, scope=r.match.scope,
        causes=frozenset(r.match.cause), clusters=frozenset(r.match.cluster),
        min_impact_gpu_hours=r.match.min_impact_gpu_hours,
        min_impact_gpu_hours_per_hour=r.match.min_impact_gpu_hours_per_hour)) for r in f.rules)
    return Policy(rules=rules, mode=f.mode, execute=frozenset(f.execute), guards=f.guards, executors=f.executors,
                  alerts=f.alerts, dashboard_url=f.dashboard_url)
