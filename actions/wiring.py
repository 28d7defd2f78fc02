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
from dataclasses import dataclass, field
from typing import Any

from .alerts.base import AlertSink
from .base import ACTION_KINDS, ALERT, UNDO_OF, Executor
from .policy import EXECUTE, AlertsSection, ExecutorsSection, Policy, PolicyError


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


def _secret(path: str, name: str) -> str:
    """The value of environment variable `name` (a policy names secrets, never holds them)."""
    value = os.environ.get(name, "")
    if not value:
        raise PolicyError(f"{path}: environment variable {name} is not set")
    return value


def _built(path: str, factory, *args, **kwargs) -> Any:
    try:
        return factory(*args, **kwargs)
    except (ValueError, OSError) as exc:
        raise PolicyError(f"{path}: {exc}") from None


def _executors(sec: ExecutorsSection) -> dict[str, Executor]:
    by_action: dict[str, Executor] = {}
    if sec.scheduler == "slurm":
        from .executors.slurm import SlurmExecutor

        s = sec.slurm
        executor = _built("executors.slurm", SlurmExecutor, scontrol=s.scontrol, squeue=s.squeue,
                          slurm_conf=s.slurm_conf, command_timeout_s=s.command_timeout_s, cluster_name=s.cluster_name)
        by_action.update({a: executor for a in executor.handles})
    if sec.scheduler == "kubernetes":
        from .executors.kubernetes import KubernetesExecutor

        k = sec.kubernetes
        executor = _built("executors.kubernetes", KubernetesExecutor, kubeconfig=k.kubeconfig, context=k.context,
                          in_cluster=k.in_cluster, request_timeout_s=k.request_timeout_s)
        by_action.update({a: executor for a in executor.handles})
    if sec.restart is not None:
        from .executors.command import CommandExecutor

        r = sec.restart
        if r.webhook_url and not r.webhook_secret_env:
            raise PolicyError("executors.restart.webhook_secret_env: required with webhook_url")
        secret = _secret("executors.restart.webhook_secret_env", r.webhook_secret_env) if r.webhook_url else ""
        executor = _built("executors.restart", CommandExecutor, r.argv or None, webhook_url=r.webhook_url,
                          webhook_secret=secret, timeout_s=r.timeout_s, verify_argv=r.verify_argv or None)
        by_action.update({a: executor for a in executor.handles})
    if sec.switch_collector_config:
        from .executors.switch_port import SwitchPortExecutor

        executor = _built("executors.switch_collector_config", SwitchPortExecutor.from_config,
                          sec.switch_collector_config)
        by_action.update({a: executor for a in executor.handles})
    unknown = set(by_action) - ACTION_KINDS
    assert not unknown, f"executors declare unknown actions {unknown}"
    by_action.pop(ALERT, None)
    return by_action


def _sinks(sec: AlertsSection) -> tuple[list[AlertSink], dict[str, int]]:
    from .alerts.alertmanager import AlertmanagerSink
    from .alerts.feishu import FeishuSink
    from .alerts.pagerduty import PagerDutySink
    from .alerts.slack import SlackSink
    from .alerts.wecom import WeComSink

    built: list[tuple[AlertSink, int]] = []
    if (am := sec.alertmanager) is not None:
        built.append((_built("alerts.alertmanager", AlertmanagerSink, list(am.urls),
                             resend_interval_s=am.resend_interval_s), am.max_backlog))
    if (pd := sec.pagerduty) is not None:
        built.append((_built("alerts.pagerduty", PagerDutySink,
                             _secret("alerts.pagerduty.routing_key_env", pd.routing_key_env), url=pd.url),
                      pd.max_backlog))
    if (slack := sec.slack) is not None:
        built.append((_built("alerts.slack", SlackSink, _secret("alerts.slack.webhook_url_env", slack.webhook_url_env)),
                      slack.max_backlog))
    if (fs := sec.feishu) is not None:
        secret = _secret("alerts.feishu.secret_env", fs.secret_env) if fs.secret_env else ""
        built.append((_built("alerts.feishu", FeishuSink, _secret("alerts.feishu.webhook_url_env", fs.webhook_url_env),
                             secret=secret, msg_type=fs.msg_type), fs.max_backlog))
    if (wc := sec.wecom) is not None:
        built.append((_built("alerts.wecom", WeComSink, _secret("alerts.wecom.webhook_url_env", wc.webhook_url_env),
                             msg_type=wc.msg_type, mentioned=list(wc.mentioned)), wc.max_backlog))
    return [sink for sink, _ in built], {sink.name: backlog for sink, backlog in built}
