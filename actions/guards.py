"""Guard rails between a matched rule and a real action, one small class each.

Each guard answers one question with a named threshold and keeps only bounded state, so
the responder can rebuild all of them from the audit topic after a restart.

>>> breaker = BlastRadiusBreaker(limit=2, window_s=600)
>>> [breaker.admit("slurm:a", t, now_s=0.0) for t in ("node-1", "node-2", "node-1", "node-3")]
[True, True, True, False]
>>> breaker.admit("slurm:a", "node-3", now_s=601.0)
True
>>> budget = ActionBudget({NODES: 1, JOBS: 2, PORTS: 1}, window_s=600)
>>> [budget.admit("slurm:a", [(JOBS, j)], now_s=0.0) for j in ("7", "8", "9")]   # one node, many jobs
['', '', 'jobs']
>>> budget.admit("slurm:a", [(NODES, "node-1")], now_s=0.0), budget.admit("slurm:b", [(JOBS, "9")], now_s=0.0)
('', '')
>>> cooldown = Cooldown(cooldown_s=60)
>>> cooldown.ready("drain_node", "c1/node-1", now_s=0.0)
True
>>> cooldown.charge("drain_node", "c1/node-1", now_s=0.0)
>>> cooldown.ready("drain_node", "c1/node-1", now_s=30.0), cooldown.ready("drain_node", "c1/node-1", now_s=61.0)
(False, True)
"""
from __future__ import annotations

import os
from collections import OrderedDict, deque
from dataclasses import dataclass, field
from pathlib import Path

KILL_SWITCH_ENV = "FABRICWATCH_KILL_SWITCH"
LEDGER_MAX_KEYS = 1_000_000     # ~100 MB at worst; years of decisions on a large fleet


@dataclass
class KillSwitch:
    """Stops every execution: set in the policy, by the environment, or by touching a file.

    The file lets an operator stop automation on a running responder without a restart
    (``touch /etc/fabricwatch/STOP``); it is checked before every action.
    """

    in_policy: bool = False
    file: str = ""

    def engaged(self) -> str:
        """Why the switch is engaged, or "" when actions may run."""
        if self.in_policy:
            return "kill switch set in the policy"
        if os.environ.get(KILL_SWITCH_ENV, "").strip() not in ("", "0", "false"):
            return f"kill switch set by ${KILL_SWITCH_ENV}"
        if self.file and Path(self.file).exists():
            return f"kill switch file {self.file} exists"
        return ""


@dataclass
class BlastRadiusBreaker:
    """At most `limit` distinct targets per domain acted on within `window_s`.

    Beyond it the responder alerts instead of acting: a fabric-wide flood of anomalies
    (real or forged) must never turn into draining the fleet. Acting again on a target
    already inside the window is free: draining and requeueing one node is one target.
    The domain is what the executor acts on (a Slurm cluster, a Kubernetes cluster, a
    fabric), never a name an anomaly carries.
    """

    limit: int
    window_s: float
    _acted: dict[str, deque[tuple[float, str]]] = field(default_factory=dict)

    def _current(self, domain: str, now_s: float) -> deque[tuple[float, str]]:
        acted = self._acted.setdefault(domain, deque())
        while acted and acted[0][0] <= now_s - self.window_s:
            acted.popleft()
        return acted

    def has_room(self, domain: str, target: str, now_s: float) -> bool:
        targets = {t for _, t in self._current(domain, now_s)}
        return target in targets or len(targets) < self.limit

    def admit(self, domain: str, target: str, now_s: float) -> bool:
        """Charge `target` if the window has room (or already holds it); False when open."""
        if not self.has_room(domain, target, now_s):
            return False
        self._current(domain, now_s).append((now_s, target))
        return True

    def charge(self, domain: str, target: str, at_s: float) -> None:
        """Record an action taken elsewhere (restore from audit, a result's side effects)."""
        self._acted.setdefault(domain, deque()).append((at_s, target))

    def in_window(self, domain: str, now_s: float) -> int:
        return len({t for _, t in self._current(domain, now_s)})


#: What the breaker counts, each with its own limit: what the actions disturb.
NODES, JOBS, PORTS = "nodes", "jobs", "ports"
UNIT_KINDS = (NODES, JOBS, PORTS)


@dataclass
class ActionBudget:
    """Nodes drained, jobs restarted and ports isolated, each bounded per domain and window.

    One node restarting any number of jobs, or six nodes under six invented cluster names,
    must stay within the same budget: the units are the things an action disturbs, the
    domain is the executor's (see `BlastRadiusBreaker`). An action is admitted only when
    every unit it charges has room (all or nothing).
    """

    limits: dict[str, int]
    window_s: float
    _windows: dict[str, BlastRadiusBreaker] = field(default_factory=dict)

    def __post_init__(self) -> None:
        unknown = set(self.limits) - set(UNIT_KINDS)
        if unknown:
            raise ValueError(f"ActionBudget limits for unknown units {sorted(unknown)}")
        self._windows = {kind: BlastRadiusBreaker(self.limits.get(kind, 0), self.window_s) for kind in UNIT_KINDS}

    def admit(self, domain: str, units: list[tuple[str, str]], now_s: float) -> str:
        """"" and all `units` charged, or the kind of unit whose window is full (nothing charged)."""
        for kind, unit in units:
            if not self._windows[kind].has_room(domain, unit, now_s):
                return kind
        for kind, unit in units:
            self._windows[kind].admit(domain, unit, now_s)
        return ""

    def charge(self, domain: str, units: list[tuple[str, str]], at_s: float) -> None:
        for kind, unit in units:
            self._windows[kind].charge(domain, unit, at_s)

    def in_window(self, domain: str, kind: str, now_s: float) -> int:
        return self._windows[kind].in_window(domain, now_s)

    def limit(self, kind: str) -> int:
        return self._windows[kind].limit


@dataclass
class Cooldown:
    """The same action on the same target at most once per `cooldown_s`."""

    cooldown_s: float
    _last: dict[tuple[str, str], float] = field(default_factory=dict)

    def ready(self, action: str, target: str, now_s: float) -> bool:
        last = self._last.get((action, target))
        return last is None or now_s - last >= self.cooldown_s

    def charge(self, action: str, target: str, now_s: float) -> None:
        self._last[(action, target)] = now_s
        if len(self._last) > LEDGER_MAX_KEYS:
            self._last = {k: v for k, v in self._last.items() if now_s - v < self.cooldown_s}


@dataclass
class IdempotencyLedger:
    """Idempotency keys already decided. At-least-once delivery (a redelivered anomaly, a
    worker that restarted and re-emitted) must find its key here and do nothing."""

    max_keys: int = LEDGER_MAX_KEYS
    _keys: OrderedDict[str, None] = field(default_factory=OrderedDict)

    def __contains__(self, key: str) -> bool:
        return key in self._keys

    def add(self, key: str) -> None:
        self._keys[key] = None
        self._keys.move_to_end(key)
        while len(self._keys) > self.max_keys:
            self._keys.popitem(last=False)

    def __len__(self) -> int:
        return len(self._keys)


@dataclass
class FlapMemory:
    """Targets that keep coming back: after `max_undos` automatic undos within `window_s`
    a target stays drained/isolated until a human looks at it."""

    max_undos: int
    window_s: float
    _undos: dict[str, deque[float]] = field(default_factory=dict)

    def record_undo(self, target: str, at_s: float) -> None:
        self._undos.setdefault(target, deque()).append(at_s)

    def may_undo(self, target: str, now_s: float) -> bool:
        undos = self._undos.get(target)
        if not undos:
            return True
        while undos and undos[0] <= now_s - self.window_s:
            undos.popleft()
        return len(undos) < self.max_undos
