"""Kubernetes executor: cordon, taint and evict a node with a fabric fault; undo it.

`KubernetesExecutor` carries out four action kinds with the official `kubernetes` client:

* DRAIN_NODE: cordon (``spec.unschedulable``) and taint the node
  ``fabricwatch.io/fabric-fault=<anomaly kind>:NoSchedule``, then evict its pods through
  the Eviction API, so PodDisruptionBudgets hold: a 429 from a budget is reported, never
  forced. DaemonSet pods and mirror (static) pods are skipped, as ``kubectl drain`` does.
* DRAIN_AFTER_JOB: cordon and taint only; the running pods finish.
* RESUME_NODE: remove only our taint and uncordon, unless the node was cordoned before we
  came (remembered in an annotation), so an operator's cordon survives our resume.
* REQUEUE_JOBS: evict the node's pods (their controllers recreate them elsewhere).

Only pods the API server places on the node are touched: the pods are listed by
``spec.nodeName``, and each one's own ``spec.nodeName`` is checked again before its
eviction, so job names an anomaly carries (from telemetry) can never reach a pod elsewhere.
The guard rails count in this executor's `domain`: the API server it talks to.

Why one patch with the whole taint list. ``NodeSpec.taints`` has no patch strategy, so a
strategic-merge patch replaces the list: the executor reads the node, builds the full list
(existing taints kept, ours added once, deduplicated by key and effect as the API requires),
and sends it together with ``metadata.resourceVersion``. A concurrent writer makes the
server answer 409 Conflict; the executor re-reads and tries again. Cordon, taint and the
"cordoned before" note go in that one write, so "our taint present" always means "we
cordoned it" and a resume can never undo a cordon that was not ours.

The client is synchronous (urllib3): every call runs in a thread (`asyncio.to_thread`).
`execute` never raises: API errors come back as FAILED with the HTTP status and reason.
"""
from __future__ import annotations

import asyncio
import json
import re
from dataclasses import dataclass, field
from typing import Any

from kubernetes import client as k8s
from kubernetes import config as k8s_config
from kubernetes.client.exceptions import ApiException

from fabricwatch.actions.base import (
    ALREADY,
    DONE,
    DRAIN_AFTER_JOB,
    DRAIN_NODE,
    FAILED,
    REQUEUE_JOBS,
    RESUME_NODE,
    ActionRequest,
    ExecutionResult,
)

TAINT_KEY = "fabricwatch.io/fabric-fault"
TAINT_EFFECT = "NoSchedule"
#: Set on a node that was already cordoned when we tainted it: resume leaves it cordoned.
CORDONED_BEFORE_ANNOTATION = "fabricwatch.io/cordoned-before"
MIRROR_POD_ANNOTATION = "kubernetes.io/config.mirror"
_LABEL_VALUE_MAX = 63
_LABEL_VALUE_BAD = re.compile(r"[^A-Za-z0-9_.-]+")
_PAGE_SIZE = 500


def taint_value(anomaly_kind: str) -> str:
    """The anomaly kind as a valid label value (<= 63 chars of ``[A-Za-z0-9_.-]``,
    alphanumeric at both ends); ``unknown`` when nothing is left.

    >>> taint_value("pfc_storm"), taint_value("link downgrade/x"), taint_value("")
    ('pfc_storm', 'link-downgrade-x', 'unknown')
    """
    value = _LABEL_VALUE_BAD.sub("-", anomaly_kind)[:_LABEL_VALUE_MAX].strip("-_.")
    return value or "unknown"


def anomaly_kind_of(request: ActionRequest) -> str:
    """Anomaly dedup keys are ``<kind>:<entity path>`` (`Finding.dedup_key`)."""
    return request.anomaly_dedup_key.split(":", 1)[0] if ":" in request.anomaly_dedup_key else ""


@dataclass
class EvictionReport:
    evicted: list[str] = field(default_factory=list)          # "namespace/name"
    gone: list[str] = field(default_factory=list)             # 404: left between list and evict
    blocked_by_budget: list[str] = field(default_factory=list)  # 429 from a PodDisruptionBudget
    failed: list[str] = field(default_factory=list)           # "ns/name: 500 reason"
    skipped: list[str] = field(default_factory=list)          # DaemonSet, mirror, finished, terminating

    def summary(self) -> str:
        parts = [f"evicted {len(self.evicted)}"]
        if self.gone:
            parts.append(f"already gone {len(self.gone)}")
        if self.skipped:
            parts.append(f"skipped {len(self.skipped)} (DaemonSet/mirror/finished/terminating)")
        if self.blocked_by_budget:
            parts.append(f"blocked by a PodDisruptionBudget (429, not forced): {', '.join(self.blocked_by_budget)}")
        if self.failed:
            parts.append(f"eviction failed: {'; '.join(self.failed)}")
        return "; ".join(parts)

    @property
    def complete(self) -> bool:
        return not self.blocked_by_budget and not self.failed


class KubernetesExecutor:
    """Node drain, drain-after-job, resume and pod requeue on a Kubernetes cluster.

    Parameters
    ----------
    api_client
        A ready `kubernetes.client.ApiClient` (tests, or a caller that built its own).
    kubeconfig, context
        Load credentials from this kubeconfig file (``""``: ``$KUBECONFIG`` or
        ``~/.kube/config``) and context (``""``: the current one).
    in_cluster
        Use the pod's service account instead of a kubeconfig.
    eviction_grace_period_s
        ``deleteOptions.gracePeriodSeconds`` of each eviction; None keeps each pod's own.
    job_label
        If set and the request names jobs, REQUEUE_JOBS evicts only pods whose label
        ``job_label`` is one of them; otherwise every evictable pod on the node.
    request_timeout_s
        Per API call (connect and read).
    conflict_retries
        How often a node patch is re-read and retried after a 409 Conflict.
    """

    name = "kubernetes"
    handles = frozenset({DRAIN_NODE, DRAIN_AFTER_JOB, RESUME_NODE, REQUEUE_JOBS})

    def __init__(self, api_client: k8s.ApiClient | None = None, *, kubeconfig: str = "", context: str = "",
                 in_cluster: bool = False, eviction_grace_period_s: int | None = None, job_label: str = "",
                 request_timeout_s: float = 30.0, conflict_retries: int = 5) -> None:
        if request_timeout_s <= 0:
            raise ValueError(f"request_timeout_s must be > 0, got {request_timeout_s}")
        if conflict_retries < 0:
            raise ValueError(f"conflict_retries must be >= 0, got {conflict_retries}")
        if eviction_grace_period_s is not None and eviction_grace_period_s < 0:
            raise ValueError(f"eviction_grace_period_s must be >= 0 or None, got {eviction_grace_period_s}")
        if api_client is not None and (kubeconfig or context or in_cluster):
            raise ValueError("give either api_client or kubeconfig/context/in_cluster, not both")
        if in_cluster and (kubeconfig or context):
            raise ValueError("in_cluster=True takes no kubeconfig or context")
        self.kubeconfig = kubeconfig
        self.context = context
        self.in_cluster = in_cluster
        self.eviction_grace_period_s = eviction_grace_period_s
        self.job_label = job_label
        self.request_timeout_s = request_timeout_s
        self.conflict_retries = conflict_retries
        self._api_client = api_client or self._load_client()
        self._core = k8s.CoreV1Api(self._api_client)
        #: What the guard rails count in: the Kubernetes cluster, named by its API server.
        self.domain = f"kubernetes:{self._api_client.configuration.host}"

    def _load_client(self) -> k8s.ApiClient:
        configuration = k8s.Configuration()
        try:
            if self.in_cluster:
                k8s_config.load_incluster_config(client_configuration=configuration)
            else:
                k8s_config.load_kube_config(config_file=self.kubeconfig or None, context=self.context or None,
                                            client_configuration=configuration, persist_config=False)
        except (k8s_config.ConfigException, OSError, ValueError) as exc:
            where = "in-cluster service account" if self.in_cluster else f"kubeconfig {self.kubeconfig or '(default)'}"
            raise ValueError(f"cannot load Kubernetes credentials from the {where}: {exc}") from exc
        return k8s.ApiClient(configuration)

    def close(self) -> None:
        self._api_client.close()

    # -- entry point --------------------------------------------------------------------------
    async def execute(self, request: ActionRequest) -> ExecutionResult:
        node = request.target.node
        if request.action not in self.handles:
            return ExecutionResult(FAILED, f"kubernetes executor does not handle {request.action!r}")
        if not node:
            return ExecutionResult(FAILED, f"{request.action}: the request names no node")
        try:
            if request.action == DRAIN_NODE:
                return await self._drain(node, request, evict=True)
            if request.action == DRAIN_AFTER_JOB:
                return await self._drain(node, request, evict=False)
            if request.action == RESUME_NODE:
                return await self._resume(node)
            return await self._requeue(node, request)
        except ApiException as exc:
            return ExecutionResult(FAILED, f"{request.action} {node}: {api_error(exc)}")
        except Exception as exc:   # connection refused, TLS, a malformed answer: reported, never raised
            return ExecutionResult(FAILED, f"{request.action} {node}: {type(exc).__name__}: {exc}")

    # -- actions ------------------------------------------------------------------------------
    async def _drain(self, node: str, request: ActionRequest, *, evict: bool) -> ExecutionResult:
        value = taint_value(anomaly_kind_of(request))

        def plan(current: k8s.V1Node) -> dict[str, Any] | None:
            spec = current.spec or k8s.V1NodeSpec()
            taints = list(spec.taints or [])
            has_taint = any(_is_ours(t) for t in taints)
            if spec.unschedulable and has_taint:
                return None
            patch: dict[str, Any] = {"spec": {"unschedulable": True}}
            if not has_taint:
                ours = k8s.V1Taint(key=TAINT_KEY, value=value, effect=TAINT_EFFECT)
                patch["spec"]["taints"] = self._serialize(taints + [ours])
                if spec.unschedulable:   # someone else cordoned it: resume must leave it cordoned
                    patch["metadata"] = {"annotations": {CORDONED_BEFORE_ANNOTATION: "true"}}
            return patch

        changed = await self._patch_node(node, plan)
        marked = f"cordoned and tainted {TAINT_KEY}={value}:{TAINT_EFFECT}" if changed else \
            "already cordoned and tainted"
        if not evict:
            return ExecutionResult(DONE if changed else ALREADY, f"{node}: {marked}")
        report = await self._evict_pods(node, request)
        detail = f"{node}: {marked}; {report.summary()}"
        if not report.complete:
            return ExecutionResult(FAILED, f"partial drain: {detail}", tuple(report.evicted))
        if not changed and not report.evicted:
            return ExecutionResult(ALREADY, detail)
        return ExecutionResult(DONE, detail, tuple(report.evicted))

    async def _resume(self, node: str) -> ExecutionResult:
        def plan(current: k8s.V1Node) -> dict[str, Any] | None:
            spec = current.spec or k8s.V1NodeSpec()
            taints = list(spec.taints or [])
            if not any(_is_ours(t) for t in taints):
                return None   # not ours to resume: a cordon without our taint is someone else's
            annotations = (current.metadata.annotations if current.metadata else None) or {}
            patch: dict[str, Any] = {"spec": {"taints": self._serialize([t for t in taints if not _is_ours(t)])}}
            if annotations.get(CORDONED_BEFORE_ANNOTATION) == "true":
                patch["metadata"] = {"annotations": {CORDONED_BEFORE_ANNOTATION: None}}   # null deletes the key
            else:
                patch["spec"]["unschedulable"] = False
            return patch

        changed = await self._patch_node(node, plan)
        if not changed:
            return ExecutionResult(ALREADY, f"{node}: no {TAINT_KEY} taint, nothing to resume")
        return ExecutionResult(DONE, f"{node}: removed taint {TAINT_KEY}, uncordoned unless cordoned before")

    async def _requeue(self, node: str, request: ActionRequest) -> ExecutionResult:
        report = await self._evict_pods(node, request)
        detail = f"{node}: {report.summary()}"
        if not report.complete:
            return ExecutionResult(FAILED, f"partial requeue: {detail}", tuple(report.evicted))
        return ExecutionResult(DONE if report.evicted else ALREADY, detail, tuple(report.evicted))

    # -- node patching with optimistic concurrency --------------------------------------------
    async def _patch_node(self, node: str, plan) -> bool:
        """Read, plan, patch with ``metadata.resourceVersion``; on 409 read again. Returns
        whether a patch was sent (False: the node already was as wanted)."""
        conflicts = 0
        while True:
            current = await self._call(self._core.read_node, node)
            patch = plan(current)
            if patch is None:
                return False
            patch.setdefault("metadata", {})["resourceVersion"] = current.metadata.resource_version
            try:
                await self._call(self._core.patch_node, node, patch)
                return True
            except ApiException as exc:
                if exc.status != 409 or conflicts >= self.conflict_retries:
                    raise
                conflicts += 1

    # -- evictions ----------------------------------------------------------------------------
    async def _evict_pods(self, node: str, request: ActionRequest) -> EvictionReport:
        report = EvictionReport()
        wanted_jobs = set(request.jobs) if self.job_label and request.jobs else None
        for pod in await self._pods_on(node):
            ref = f"{pod.metadata.namespace}/{pod.metadata.name}"
            if pod.spec is None or pod.spec.node_name != node:
                report.skipped.append(f"{ref} (not on {node})")   # the API answered for another node
                continue
            if _not_evictable(pod):
                report.skipped.append(ref)
                continue
            if wanted_jobs is not None and (pod.metadata.labels or {}).get(self.job_label) not in wanted_jobs:
                continue
            body = k8s.V1Eviction(
                api_version="policy/v1", kind="Eviction",
                metadata=k8s.V1ObjectMeta(name=pod.metadata.name, namespace=pod.metadata.namespace),
                delete_options=(k8s.V1DeleteOptions(grace_period_seconds=self.eviction_grace_period_s)
                                if self.eviction_grace_period_s is not None else None))
            try:
                await self._call(self._core.create_namespaced_pod_eviction, pod.metadata.name,
                                 pod.metadata.namespace, body)
                report.evicted.append(ref)
            except ApiException as exc:
                if exc.status == 404:
                    report.gone.append(ref)
                elif exc.status == 429:
                    report.blocked_by_budget.append(f"{ref} ({_status_message(exc) or 'TooManyRequests'})")
                else:
                    report.failed.append(f"{ref}: {api_error(exc)}")
        return report

    async def _pods_on(self, node: str) -> list[k8s.V1Pod]:
        pods: list[k8s.V1Pod] = []
        token = None
        while True:
            page = await self._call(self._core.list_pod_for_all_namespaces, field_selector=f"spec.nodeName={node}",
                                    limit=_PAGE_SIZE, _continue=token)
            pods.extend(page.items or [])
            token = page.metadata.var_continue if page.metadata else None
            if not token:
                return pods

    # -- plumbing -----------------------------------------------------------------------------
    async def _call(self, method, *args, **kwargs):
        kwargs["_request_timeout"] = self.request_timeout_s
        return await asyncio.to_thread(method, *args, **kwargs)

    def _serialize(self, taints: list[k8s.V1Taint]) -> list[dict[str, Any]]:
        return [self._api_client.sanitize_for_serialization(t) for t in taints]


def _is_ours(taint: k8s.V1Taint) -> bool:
    return taint.key == TAINT_KEY and taint.effect == TAINT_EFFECT


def _not_evictable(pod: k8s.V1Pod) -> bool:
    """DaemonSet pods come straight back (their controller ignores cordons); mirror pods
    belong to the kubelet and cannot be evicted; finished or terminating pods need nothing."""
    meta = pod.metadata
    if any(ref.kind == "DaemonSet" for ref in (meta.owner_references or [])):
        return True
    if MIRROR_POD_ANNOTATION in (meta.annotations or {}):
        return True
    if meta.deletion_timestamp is not None:
        return True
    return bool(pod.status and pod.status.phase in ("Succeeded", "Failed"))


def _status_message(exc: ApiException) -> str:
    """The ``message`` of the API's Status body, plus the first cause (the PDB's name)."""
    try:
        status = json.loads(exc.body or "")
    except ValueError:
        return ""
    if not isinstance(status, dict):
        return ""
    message = str(status.get("message", ""))
    causes = (status.get("details") or {}).get("causes") or []
    if causes and isinstance(causes[0], dict) and causes[0].get("message"):
        message = f"{message} {causes[0]['message']}".strip()
    return message


def api_error(exc: ApiException) -> str:
    """``HTTP 409 Conflict: <Status.message>`` (status 0: no HTTP answer at all)."""
    message = _status_message(exc)
    text = f"HTTP {exc.status} {exc.reason or ''}".rstrip()
    return f"{text}: {message}" if message else text
