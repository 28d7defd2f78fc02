"""Build the executors and alert sinks a policy's `executors:` and `alerts:` sections name.

Validated before anything starts, like the rest of the policy: an unknown backend or
option, a secret variable that is not set, or an action enabled under `execute` with no
executor able to run it is a `PolicyError` naming the path. Secrets never sit in the
policy file: it names environment variables (`routing_key_env: PAGERDUTY_KEY`).

>>> from fabricwatch.actions.policy import parse_policy
>>> build(parse_policy("executors: {scheduler: slurm}")).executor_names()["drain_node"]
'slurm'
>>> try:
...     build(parse_policy("mode: execute\\nexecute: [drain_node]"))
... except PolicyError as err:
...     print(err)
execute: drain_node is enabled but no executor handles it (set executors.scheduler)
"""
from __future__ import annotations

import os
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from .alerts.base import AlertSink
from .alerts.dispatch import DEFAULT_MAX_BACKLOG
from .base import ACTION_KINDS, ALERT, UNDO_OF, Executor
from .policy import EXECUTE, NAME_PATTERN, Policy, PolicyError


@dataclass
class Backends:
    executors: dict[str, Executor] = field(default_factory=dict)   # action kind -> executor
    sinks: list[AlertSink] = field(default_factory=list)
    alert_backlog: dict[str, int] = field(default_factory=dict)    # sink name -> max alerts queued

    def executor_names(self) -> dict[str, str]:
        return {action: executor.name for action, executor in self.executors.items()}

    def executor_domains(self) -> dict[str, str]:
        """What each action kind's guard rails count in: its executor's domain."""
        return {action: executor.domain for action, executor in self.executors.items()}


def build(policy: Policy) -> Backends:
    sinks, backlog = _sinks(policy.alerts)
    backends = Backends(executors=_executors(policy.executors), sinks=sinks, alert_backlog=backlog)
    if policy.mode == EXECUTE:
        for action in sorted(policy.execute):
            if action not in backends.executors:
                raise PolicyError(f"execute: {action} is enabled but no executor handles it "
                                  f"(set executors.scheduler)")
            undo = next((u for u, of in UNDO_OF.items() if of == action), None)
            if undo and undo not in backends.executors:
                raise PolicyError(f"execute: {action} is enabled but nothing can undo it ({undo})")
            executor = backends.executors[action]
            if getattr(executor, "verify_argv", None) == ():
                # it cannot ask a scheduler: without the check it could only refuse every job
                raise PolicyError(f"executors.restart.verify_argv: required to execute {action} through the "
                                  "restart command/webhook: a command that confirms the job runs on the node")
    return backends


def _secret(sec: _Section, key: str) -> str:
    name = sec.text(key, None)
    value = os.environ.get(name, "")
    if not value:
        raise PolicyError(f"{sec._at(key)}: environment variable {name} is not set")
    return value


def _built(path: str, factory, *args, **kwargs) -> Any:
    try:
        return factory(*args, **kwargs)
    except (ValueError, OSError) as exc:
        raise PolicyError(f"{path}: {exc}") from None


def _executors(doc: Mapping[str, Any]) -> dict[str, Executor]:
    sec = _Section(doc, "executors")
    scheduler = sec.choice("scheduler", "none", ("none", "slurm", "kubernetes"))
    by_action: dict[str, Executor] = {}
    slurm = _Section(sec.mapping("slurm"), "executors.slurm")
    if scheduler == "slurm":
        from .executors.slurm import SlurmExecutor

        executor = _built("executors.slurm", SlurmExecutor, scontrol=slurm.text("scontrol", "scontrol"),
                          squeue=slurm.text("squeue", "squeue"), slurm_conf=slurm.text("slurm_conf", ""),
                          command_timeout_s=slurm.number("command_timeout_s", 10.0, low=0.1, high=600.0),
                          cluster_name=slurm.text("cluster_name", ""))
        by_action.update({a: executor for a in executor.handles})
        slurm.finish()
    k8s = _Section(sec.mapping("kubernetes"), "executors.kubernetes")
    if scheduler == "kubernetes":
        from .executors.kubernetes import KubernetesExecutor

        executor = _built("executors.kubernetes", KubernetesExecutor, kubeconfig=k8s.text("kubeconfig", ""),
                          context=k8s.text("context", ""), in_cluster=k8s.boolean("in_cluster", False),
                          request_timeout_s=k8s.number("request_timeout_s", 30.0, low=1.0, high=600.0))
        by_action.update({a: executor for a in executor.handles})
        k8s.finish()
    restart = sec.mapping("restart")
    if restart:
        from .executors.command import CommandExecutor

        r = _Section(restart, "executors.restart")
        argv = r.sequence("argv", 64) or None
        if argv is not None and not all(isinstance(a, str) for a in argv):
            raise PolicyError("executors.restart.argv: expected a list of strings")
        verify_argv = r.sequence("verify_argv", 64) or None
        if verify_argv is not None and not all(isinstance(a, str) for a in verify_argv):
            raise PolicyError("executors.restart.verify_argv: expected a list of strings")
        webhook_url = r.text("webhook_url", "")
        secret = _secret(r, "webhook_secret_env") if webhook_url else ""
        executor = _built("executors.restart", CommandExecutor, argv, webhook_url=webhook_url,
                          webhook_secret=secret, timeout_s=r.number("timeout_s", 60.0, low=0.1, high=3600.0),
                          verify_argv=verify_argv)
        r.finish()
        by_action.update({a: executor for a in executor.handles})
    switches = sec.text("switch_collector_config", "")
    if switches:
        from .executors.switch_port import SwitchPortExecutor

        executor = _built("executors.switch_collector_config", SwitchPortExecutor.from_config, switches)
        by_action.update({a: executor for a in executor.handles})
    sec.finish()
    unknown = set(by_action) - ACTION_KINDS
    assert not unknown, f"executors declare unknown actions {unknown}"
    by_action.pop(ALERT, None)
    return by_action


def _backlog(s: _Section, name: str, backlog: dict[str, int]) -> None:
    """A sink's `max_backlog`: alerts queued for it before the oldest are dropped (counted)."""
    backlog[name] = s.integer("max_backlog", DEFAULT_MAX_BACKLOG, low=1, high=1_000_000)


def _sinks(doc: Mapping[str, Any]) -> tuple[list[AlertSink], dict[str, int]]:
    from .alerts.alertmanager import AlertmanagerSink
    from .alerts.feishu import FeishuSink
    from .alerts.pagerduty import PagerDutySink
    from .alerts.slack import SlackSink
    from .alerts.wecom import WeComSink

    sec = _Section(doc, "alerts")
    sinks: list[AlertSink] = []
    backlog: dict[str, int] = {}
    am = sec.mapping("alertmanager")
    if am:
        s = _Section(am, "alerts.alertmanager")
        urls = s.sequence("urls", 16)
        if not urls or not all(isinstance(u, str) for u in urls):
            raise PolicyError("alerts.alertmanager.urls: expected a list of URLs")
        sinks.append(_built("alerts.alertmanager", AlertmanagerSink, urls,
                            resend_interval_s=s.number("resend_interval_s", 60.0, low=1.0, high=3600.0)))
        _backlog(s, sinks[-1].name, backlog)
        s.finish()
    pd = sec.mapping("pagerduty")
    if pd:
        s = _Section(pd, "alerts.pagerduty")
        url = s.text("url", "https://events.pagerduty.com/v2/enqueue")
        sinks.append(_built("alerts.pagerduty", PagerDutySink, _secret(s, "routing_key_env"), url=url))
        _backlog(s, sinks[-1].name, backlog)
        s.finish()
    slack = sec.mapping("slack")
    if slack:
        s = _Section(slack, "alerts.slack")
        sinks.append(_built("alerts.slack", SlackSink, _secret(s, "webhook_url_env")))
        _backlog(s, sinks[-1].name, backlog)
        s.finish()
    feishu = sec.mapping("feishu")
    if feishu:
        s = _Section(feishu, "alerts.feishu")
        secret = _secret(s, "secret_env") if "secret_env" in feishu else ""
        sinks.append(_built("alerts.feishu", FeishuSink, _secret(s, "webhook_url_env"), secret=secret,
                            msg_type=s.text("msg_type", "post")))
        _backlog(s, sinks[-1].name, backlog)
        s.finish()
    wecom = sec.mapping("wecom")
    if wecom:
        s = _Section(wecom, "alerts.wecom")
        sinks.append(_built("alerts.wecom", WeComSink, _secret(s, "webhook_url_env"),
                            msg_type=s.text("msg_type", "markdown"),
                            mentioned=s.names("mentioned", None, what="user id")))
        _backlog(s, sinks[-1].name, backlog)
        s.finish()
    sec.finish()
    return sinks, backlog


# The executors and alerts sections are backend-specific (each backend's own keys), read
# here with typed, path-aware reads; the rest of the policy is the schema in `.policy`.
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
