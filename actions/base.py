"""The contract between the responder and the executors that carry actions out.

An executor is a small plugin: it declares which action kinds it handles and runs one
`ActionRequest` at a time. It must be idempotent on the target's state (draining a drained
node succeeds as ``already``), because a crash between "started" and "executed" leaves the
outcome unknown and the request may be tried again after a restart.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

from fabricwatch.models.findings import EntityRef

# Action kinds a policy may name. Executors map them onto their system.
ALERT = "alert"                            # tell on-call; handled by alert sinks, not executors
DRAIN_NODE = "drain_node"                  # stop scheduling onto a node (Slurm drain, k8s cordon+taint+evict)
RESUME_NODE = "resume_node"                # undo drain_node after the quiet period
REQUEUE_JOBS = "requeue_jobs"              # requeue the jobs running on a node, keeping them off it
EXCLUDE_AND_RESTART = "exclude_and_restart"  # restart a job from its checkpoint without a node
DRAIN_AFTER_JOB = "drain_after_job"        # drain once the running job ends (Slurm: drain lets jobs finish)
ISOLATE_PORT = "isolate_port"              # admin-down a switch port (explicit opt-in only)
RESTORE_PORT = "restore_port"

ACTION_KINDS = frozenset({ALERT, DRAIN_NODE, RESUME_NODE, REQUEUE_JOBS, EXCLUDE_AND_RESTART,
                          DRAIN_AFTER_JOB, ISOLATE_PORT, RESTORE_PORT})
#: Actions that undo another; they are driven by the quiet-period timer, not by policy rules.
UNDO_OF = {RESUME_NODE: DRAIN_NODE, RESTORE_PORT: ISOLATE_PORT}

# Executor results.
DONE, ALREADY, FAILED = "done", "already", "failed"


@dataclass(frozen=True)
class ActionRequest:
    action: str                  # one of ACTION_KINDS
    target: EntityRef            # node for drains, job (+ node to exclude) for restarts, switch+port
    reason: str                  # short human text; Slurm shows it in `sinfo -R`
    idempotency_key: str
    anomaly_id: str = ""
    anomaly_dedup_key: str = ""
    jobs: tuple[str, ...] = ()   # jobs known to be affected (from the anomaly), may be empty


@dataclass(frozen=True)
class ExecutionResult:
    status: str                  # DONE | ALREADY | FAILED
    detail: str = ""             # command line run and its output, API response, error
    affected: tuple[str, ...] = field(default=())  # e.g. job ids requeued


class Executor(Protocol):
    """One backend. ``execute`` never raises for a refused or failed action: it returns FAILED.

    ``domain`` names what it acts on as it knows it (``slurm:<ClusterName>``,
    ``kubernetes:<API server>``, ``fabric:<switch config>``, ``command:<program>``): the guard
    rails count nodes, jobs and ports per domain, never per a cluster an anomaly names.
    An action on a job runs only once the backend itself confirms the job runs on the node.
    """

    name: str
    handles: frozenset[str]
    domain: str

    async def execute(self, request: ActionRequest) -> ExecutionResult: ...
