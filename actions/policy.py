"""The response policy: which anomalies lead to which actions, and whether they execute.

A policy file is YAML, checked completely before anything starts; every mistake is named
with its path (``rules[2].match.kind: unknown anomaly kind 'pfc'``). Nothing executes
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
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from fabricwatch.models.event_filter import EventFilter
from fabricwatch.models.vocabulary import ANOMALY_KINDS, CAUSE_CODES, INFO, SEVERITIES, WARNING
from fabricwatch.protos.v1 import events_pb2 as ev
from fabricwatch.streams.events import anomaly_facts

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


@dataclass(frozen=True)
class BreakerConfig:
    """Blast-radius limits per executor domain (a Slurm cluster, a Kubernetes cluster, a
    fabric) and window: nodes drained, jobs restarted, ports isolated, each counted apart."""

    max_fraction: float = BREAKER_MAX_FRACTION
    min_count: int = BREAKER_MIN_COUNT
    window_s: float = BREAKER_WINDOW_S
    fleet_size: int = 0          # nodes in the domain; 0: unknown, the node limit is min_count
    max_jobs_restarted: int = BREAKER_MAX_JOBS_RESTARTED
    max_ports_isolated: int = BREAKER_MAX_PORTS_ISOLATED

    @property
    def limit(self) -> int:
        """Nodes drained (or requeued) per domain and window."""
        return max(self.min_count, math.floor(self.max_fraction * self.fleet_size))

    @property
    def limits(self) -> dict[str, int]:
        return {NODES: self.limit, JOBS: self.max_jobs_restarted, PORTS: self.max_ports_isolated}


@dataclass(frozen=True)
class Guards:
    breaker: BreakerConfig = BreakerConfig()
    cooldown_s: float = COOLDOWN_S
    quiet_period_s: float = QUIET_PERIOD_S        # undo a drain after this long without anomalies on it
    flap_window_s: float = FLAP_WINDOW_S
    flap_max_undos: int = FLAP_MAX_UNDOS          # beyond this many undos in the window: stays drained
    kill_switch: bool = False
    kill_switch_file: str = ""                    # its existence stops every execution
    max_anomaly_age_s: float = MAX_ANOMALY_AGE_S  # older anomalies are alerted on, not executed


@dataclass(frozen=True)
class Policy:
    rules: tuple[Rule, ...] = ()
    mode: str = SHADOW
    execute: frozenset[str] = frozenset()
    guards: Guards = Guards()
    # Backend settings, validated by `actions.wiring` which knows each backend's options.
    executors: Mapping[str, Any] = field(default_factory=dict)
    alerts: Mapping[str, Any] = field(default_factory=dict)
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


def parse_policy(text: str) -> Policy:
    if len(text.encode("utf-8", "replace")) > MAX_POLICY_BYTES:
        raise PolicyError(f"policy larger than {MAX_POLICY_BYTES} bytes")
    try:
        doc = yaml.load(text, Loader=_NoAliasLoader)  # noqa: S506 - a SafeLoader subclass
    except yaml.YAMLError as exc:
        raise PolicyError(f"not valid YAML: {exc}") from None
    if doc is None:
        doc = {}
    top = _Section(doc, "")
    version = top.integer("version", 1, low=1, high=1)
    del version
    mode = top.choice("mode", SHADOW, (SHADOW, EXECUTE))
    execute = frozenset(top.names("execute", ACTION_KINDS - {ALERT} - set(UNDO_OF), what="action kind"))
    rules = tuple(_rule(item, f"rules[{i}]") for i, item in enumerate(top.sequence("rules", MAX_RULES)))
    seen: set[str] = set()
    for i, rule in enumerate(rules):
        if rule.name in seen:
            raise PolicyError(f"rules[{i}].name: duplicate rule name {rule.name!r}")
        seen.add(rule.name)
    guards = _guards(top.mapping("guards"), "guards")
    executors = top.mapping("executors")
    alerts = top.mapping("alerts")
    dashboard_url = top.text("dashboard_url", "")
    top.finish()
    return Policy(rules=rules, mode=mode, execute=execute, guards=guards, executors=executors, alerts=alerts,
                  dashboard_url=dashboard_url)


def _rule(item: Any, path: str) -> Rule:
    sec = _Section(item, path)
    name = sec.text("name", None)
    if not NAME_PATTERN.match(name):
        raise PolicyError(f"{path}.name: {name!r} must match {NAME_PATTERN.pattern}")
    m = _Section(sec.mapping("match"), f"{path}.match")
    kinds = m.names("kind", ANOMALY_KINDS, what="anomaly kind", one_or_many=True)
    match = Match(
        kinds=frozenset(kinds),
        min_severity=m.choice("min_severity", WARNING, SEVERITIES),
        scope=m.choice("scope", SCOPE_ANY, SCOPES),
        causes=frozenset(m.names("cause", CAUSE_CODES, what="cause code", one_or_many=True)),
        clusters=frozenset(m.names("cluster", None, what="cluster", one_or_many=True)),
        min_impact_gpu_hours=m.number("min_impact_gpu_hours", 0.0, low=0.0, high=MAX_IMPACT_GPU_HOURS),
        min_impact_gpu_hours_per_hour=m.number("min_impact_gpu_hours_per_hour", 0.0, low=0.0,
                                               high=MAX_IMPACT_GPU_HOURS),
    )
    m.finish()
    actions = tuple(sec.names("actions", ACTION_KINDS - set(UNDO_OF), what="action kind"))
    if not actions:
        raise PolicyError(f"{path}.actions: at least one action is required")
    if len(set(actions)) != len(actions):
        raise PolicyError(f"{path}.actions: an action is listed twice")
    sec.finish()
    return Rule(name=name, match=match, actions=actions)


def _guards(doc: Mapping[str, Any], path: str) -> Guards:
    sec = _Section(doc, path)
    b = _Section(sec.mapping("breaker"), f"{path}.breaker")
    breaker = BreakerConfig(
        max_fraction=b.number("max_fraction", BREAKER_MAX_FRACTION, low=0.0, high=1.0),
        min_count=b.integer("min_count", BREAKER_MIN_COUNT, low=0, high=100_000),
        window_s=b.number("window_s", BREAKER_WINDOW_S, low=1.0, high=7 * 86400.0),
        fleet_size=b.integer("fleet_size", 0, low=0, high=10_000_000),
        max_jobs_restarted=b.integer("max_jobs_restarted", BREAKER_MAX_JOBS_RESTARTED, low=0, high=100_000),
        max_ports_isolated=b.integer("max_ports_isolated", BREAKER_MAX_PORTS_ISOLATED, low=0, high=100_000),
    )
    b.finish()
    guards = Guards(
        breaker=breaker,
        cooldown_s=sec.number("cooldown_s", COOLDOWN_S, low=0.0, high=30 * 86400.0),
        quiet_period_s=sec.number("quiet_period_s", QUIET_PERIOD_S, low=0.0, high=30 * 86400.0),
        flap_window_s=sec.number("flap_window_s", FLAP_WINDOW_S, low=0.0, high=90 * 86400.0),
        flap_max_undos=sec.integer("flap_max_undos", FLAP_MAX_UNDOS, low=0, high=1000),
        kill_switch=sec.boolean("kill_switch", False),
        kill_switch_file=sec.text("kill_switch_file", ""),
        max_anomaly_age_s=sec.number("max_anomaly_age_s", MAX_ANOMALY_AGE_S, low=1.0, high=7 * 86400.0),
    )
    sec.finish()
    return guards


class _Section:
    """Typed, path-aware reads from one YAML mapping; `finish` refuses keys nobody read."""

    def __init__(self, doc: Any, path: str):
        if not isinstance(doc, Mapping):
            raise PolicyError(f"{path or 'policy'}: expected a mapping, got {type(doc).__name__}")
        for key in doc:
            if not isinstance(key, str):
                raise PolicyError(f"{path or 'policy'}: keys must be strings, got {key!r}")
        self.doc, self.path, self.read = doc, path, set()

    def _at(self, key: str) -> str:
        return f"{self.path}.{key}" if self.path else key

    def _get(self, key: str, default: Any) -> Any:
        self.read.add(key)
        if key not in self.doc or self.doc[key] is None:
            if default is None:
                raise PolicyError(f"{self._at(key)}: required")
            return default
        return self.doc[key]

    def text(self, key: str, default: str | None) -> str:
        value = self._get(key, default)
        if not isinstance(value, str) or len(value) > 1024 or not value.isprintable():
            raise PolicyError(f"{self._at(key)}: expected a printable string of at most 1024 characters")
        return value

    def choice(self, key: str, default: str, choices: tuple[str, ...]) -> str:
        value = self._get(key, default)
        if value not in choices:
            raise PolicyError(f"{self._at(key)}: {value!r} is not one of {', '.join(choices)}")
        return value

    def boolean(self, key: str, default: bool) -> bool:
        value = self._get(key, default)
        if not isinstance(value, bool):
            raise PolicyError(f"{self._at(key)}: expected true or false, got {value!r}")
        return value

    def number(self, key: str, default: float, *, low: float, high: float) -> float:
        value = self._get(key, default)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) \
                or not low <= value <= high:
            raise PolicyError(f"{self._at(key)}: expected a number in [{low:g}, {high:g}], got {value!r}")
        return float(value)

    def integer(self, key: str, default: int, *, low: int, high: int) -> int:
        value = self._get(key, default)
        if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
            raise PolicyError(f"{self._at(key)}: expected an integer in [{low}, {high}], got {value!r}")
        return value

    def mapping(self, key: str) -> Mapping[str, Any]:
        value = self._get(key, {})
        if not isinstance(value, Mapping):
            raise PolicyError(f"{self._at(key)}: expected a mapping, got {type(value).__name__}")
        return value

    def sequence(self, key: str, max_len: int) -> list[Any]:
        value = self._get(key, [])
        if not isinstance(value, list):
            raise PolicyError(f"{self._at(key)}: expected a list, got {type(value).__name__}")
        if len(value) > max_len:
            raise PolicyError(f"{self._at(key)}: {len(value)} entries; at most {max_len}")
        return value

    def names(self, key: str, known: frozenset[str] | set[str] | None, *, what: str,
              one_or_many: bool = False) -> list[str]:
        value = self._get(key, [])
        if one_or_many and isinstance(value, str):
            value = [value]
        if not isinstance(value, list) or len(value) > 1000:
            raise PolicyError(f"{self._at(key)}: expected a list of {what}s")
        for item in value:
            if not isinstance(item, str) or not NAME_PATTERN.match(item):
                raise PolicyError(f"{self._at(key)}: {item!r} is not a valid {what}")
            if known is not None and item not in known:
                raise PolicyError(f"{self._at(key)}: unknown {what} {item!r}; known: {', '.join(sorted(known))}")
        return list(value)

    def finish(self) -> None:
        unknown = sorted(set(self.doc) - self.read)
        if unknown:
            raise PolicyError(f"{self._at(unknown[0])}: unknown key (misspelt?)")
