"""The Kubernetes executor, driven through the real `kubernetes` client.

No Kubernetes API server can run on the test machines (no container runtime, no etcd), so
the client talks HTTP to `FakeKubeApi`: a small aiohttp server on 127.0.0.1 implementing
only the endpoints the executor uses (GET/PATCH a node, list pods by field selector with
paging, POST a pod eviction). It behaves as the API server does where it matters: a patch
must be a strategic-merge patch, ``metadata.resourceVersion`` is a precondition (409 when
stale), the taint list is replaced whole, annotations merge (null deletes), an eviction
that a PodDisruptionBudget forbids is refused with 429. Tests assert on the exact requests.
"""
from __future__ import annotations

import copy
import json
from dataclasses import dataclass

import pytest
import pytest_asyncio
from aiohttp import web
from kubernetes import client as k8s

from fabricwatch.actions.base import (
    ALREADY,
    DONE,
    DRAIN_AFTER_JOB,
    DRAIN_NODE,
    EXCLUDE_AND_RESTART,
    FAILED,
    REQUEUE_JOBS,
    RESUME_NODE,
    ActionRequest,
)
from fabricwatch.actions.executors.kubernetes import (
    CORDONED_BEFORE_ANNOTATION,
    TAINT_KEY,
    KubernetesExecutor,
)
from fabricwatch.models.findings import EntityRef

SMP = "application/strategic-merge-patch+json"
GPU_TAINT = {"key": "nvidia.com/gpu", "value": "present", "effect": "NoSchedule"}
NOEXEC_TAINT = {"key": "example.com/flaky", "effect": "NoExecute", "timeAdded": "2026-11-01T10:00:00Z"}
OUR_TAINT = {"key": TAINT_KEY, "value": "pfc_storm", "effect": "NoSchedule"}


@dataclass
class Seen:
    method: str
    path: str
    query: dict
    content_type: str
    body: object
    authorization: str


def status(code: int, reason: str, message: str, causes=()) -> web.Response:
    body = {"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure" if code >= 400 else "Success",
            "message": message, "reason": reason, "code": code}
    if causes:
        body["details"] = {"causes": list(causes)}
    return web.json_response(body, status=code)


class FakeKubeApi:
    """Just enough of the core/v1 and policy/v1 API for the executor (see the module doc)."""

    def __init__(self, page_size: int = 500):
        self.nodes: dict[str, dict] = {}
        self.pods: list[dict] = []
        self.pdb_protected: dict[str, str] = {}   # "ns/name" -> PDB name
        self.requests: list[Seen] = []
        self.page_size = page_size
        self.conflicts_to_inject = 0              # answer this many patches with 409 after a concurrent write
        self.ignore_node_selector = False         # a broken or hostile API: lists every pod for any node
        self.url = ""
        self._runner: web.AppRunner | None = None

    # -- fixtures -----------------------------------------------------------------------
    def add_node(self, name: str, *, taints=(), unschedulable=False, annotations=None) -> None:
        spec = {"podCIDR": "10.0.0.0/24"}
        if taints:
            spec["taints"] = [dict(t) for t in taints]
        if unschedulable:
            spec["unschedulable"] = True
        self.nodes[name] = {"kind": "Node", "apiVersion": "v1", "spec": spec, "status": {},
                            "metadata": {"name": name, "resourceVersion": "7", "labels": {"kubernetes.io/hostname": name},
                                         "annotations": dict(annotations or {})}}

    def add_pod(self, ns: str, name: str, node: str, *, owner_kind="ReplicaSet", mirror=False, phase="Running",
                labels=None) -> None:
        meta = {"name": name, "namespace": ns, "uid": f"uid-{ns}-{name}", "labels": dict(labels or {}),
                "ownerReferences": [{"apiVersion": "apps/v1", "kind": owner_kind, "name": f"{name}-owner",
                                     "uid": "owner-uid", "controller": True}] if owner_kind else []}
        if mirror:
            meta["annotations"] = {"kubernetes.io/config.mirror": "abc123"}
        self.pods.append({"kind": "Pod", "apiVersion": "v1", "metadata": meta,
                          "spec": {"nodeName": node, "containers": [{"name": "c", "image": "busybox"}]},
                          "status": {"phase": phase}})

    def pod_names(self, node: str) -> list[str]:
        return [f"{p['metadata']['namespace']}/{p['metadata']['name']}" for p in self.pods if p["spec"]["nodeName"] == node]

    def seen(self, method: str, prefix: str = "") -> list[Seen]:
        return [r for r in self.requests if r.method == method and r.path.startswith(prefix)]

    # -- server -------------------------------------------------------------------------
    async def start(self) -> FakeKubeApi:
        app = web.Application()
        app.router.add_get("/api/v1/nodes/{name}", self.get_node)
        app.router.add_patch("/api/v1/nodes/{name}", self.patch_node)
        app.router.add_get("/api/v1/pods", self.list_pods)
        app.router.add_post("/api/v1/namespaces/{ns}/pods/{name}/eviction", self.evict)
        app.middlewares.append(self.record)
        self._runner = web.AppRunner(app)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        port = self._runner.addresses[0][1]
        self.url = f"http://127.0.0.1:{port}"
        return self

    async def stop(self) -> None:
        if self._runner:
            await self._runner.cleanup()

    @web.middleware
    async def record(self, request: web.Request, handler):
        raw = await request.read()
        body = json.loads(raw) if raw else None
        self.requests.append(Seen(request.method, request.path, dict(request.query),
                                  request.headers.get("Content-Type", ""), body,
                                  request.headers.get("Authorization", "")))
        return await handler(request)

    async def get_node(self, request: web.Request) -> web.Response:
        node = self.nodes.get(request.match_info["name"])
        if node is None:
            return status(404, "NotFound", f'nodes "{request.match_info["name"]}" not found')
        return web.json_response(node)

    async def patch_node(self, request: web.Request) -> web.Response:
        name = request.match_info["name"]
        node = self.nodes.get(name)
        if node is None:
            return status(404, "NotFound", f'nodes "{name}" not found')
        if request.content_type != SMP:
            return status(415, "UnsupportedMediaType", f"only {SMP} in this fake, got {request.content_type}")
        patch = self.requests[-1].body
        if self.conflicts_to_inject:
            # Another controller wrote the node between our read and our patch.
            self.conflicts_to_inject -= 1
            node["spec"].setdefault("taints", []).append({"key": "other.io/maintenance", "effect": "NoSchedule"})
            self._bump(node)
        wanted_rv = patch.get("metadata", {}).get("resourceVersion")
        if wanted_rv is not None and wanted_rv != node["metadata"]["resourceVersion"]:
            return status(409, "Conflict", f'Operation cannot be fulfilled on nodes "{name}": the object has been '
                                           "modified; please apply your changes to the latest version and try again")
        spec = patch.get("spec", {})
        if "unschedulable" in spec:
            if spec["unschedulable"]:
                node["spec"]["unschedulable"] = True
            else:
                node["spec"].pop("unschedulable", None)   # omitempty, as the API server serialises it
        if "taints" in spec:   # NodeSpec.taints has no patch strategy: the list is replaced
            node["spec"]["taints"] = copy.deepcopy(spec["taints"])
        for key, value in patch.get("metadata", {}).get("annotations", {}).items():
            if value is None:
                node["metadata"]["annotations"].pop(key, None)
            else:
                node["metadata"]["annotations"][key] = value
        self._bump(node)
        return web.json_response(node)

    @staticmethod
    def _bump(node: dict) -> None:
        node["metadata"]["resourceVersion"] = str(int(node["metadata"]["resourceVersion"]) + 1)

    async def list_pods(self, request: web.Request) -> web.Response:
        selector = request.query.get("fieldSelector", "")
        if not selector.startswith("spec.nodeName="):
            return status(400, "BadRequest", f"this fake needs fieldSelector=spec.nodeName=..., got {selector!r}")
        node = selector.split("=", 1)[1]
        matching = [p for p in self.pods if p["spec"]["nodeName"] == node or self.ignore_node_selector]
        start = int(request.query.get("continue") or 0)
        size = min(int(request.query.get("limit") or len(matching) or 1), self.page_size)
        page = matching[start:start + size]
        meta = {"resourceVersion": "99"}
        if start + size < len(matching):
            meta["continue"] = str(start + size)
        return web.json_response({"kind": "PodList", "apiVersion": "v1", "metadata": meta, "items": page})

    async def evict(self, request: web.Request) -> web.Response:
        ns, name = request.match_info["ns"], request.match_info["name"]
        pod = next((p for p in self.pods if (p["metadata"]["namespace"], p["metadata"]["name"]) == (ns, name)), None)
        if pod is None:
            return status(404, "NotFound", f'pods "{name}" not found')
        pdb = self.pdb_protected.get(f"{ns}/{name}")
        if pdb:
            return status(429, "TooManyRequests", "Cannot evict pod as it would violate the pod's disruption budget.",
                          [{"reason": "DisruptionBudget",
                            "message": f"The disruption budget {pdb} needs 2 healthy pods and has 2 currently"}])
        self.pods.remove(pod)
        return status(201, "", "")


@pytest_asyncio.fixture(loop_scope="function")   # the loop the test runs on serves it
async def api():
    server = await FakeKubeApi().start()
    yield server
    await server.stop()


def executor_for(api: FakeKubeApi, **kwargs) -> KubernetesExecutor:
    configuration = k8s.Configuration(host=api.url)
    return KubernetesExecutor(k8s.ApiClient(configuration), **kwargs)


def request(action: str, node: str = "gpu-node-1", jobs=(), kind="pfc_storm") -> ActionRequest:
    return ActionRequest(action=action, target=EntityRef(cluster="c1", node=node), reason=f"{kind} on {node}",
                         idempotency_key=f"{action}-{node}", anomaly_dedup_key=f"{kind}:c1/{node}", jobs=tuple(jobs))


def populate(api: FakeKubeApi, node="gpu-node-1") -> None:
    api.add_node(node, taints=[GPU_TAINT, NOEXEC_TAINT])
    api.add_pod("train", "trainer-0", node, labels={"job": "j-17"})
    api.add_pod("train", "trainer-1", node, owner_kind="", labels={"job": "j-18"})   # a bare pod
    api.add_pod("kube-system", "nvidia-device-plugin-x", node, owner_kind="DaemonSet")
    api.add_pod("kube-system", "kube-proxy-static", node, owner_kind="Node", mirror=True)
    api.add_pod("batch", "finished", node, owner_kind="Job", phase="Succeeded")
    api.add_pod("train", "elsewhere", "gpu-node-2")


# ----------------------------------------------------------------------------- drain
async def test_drain_cordons_taints_with_the_full_list_and_evicts_only_evictable_pods(api):
    populate(api)
    ex = executor_for(api)
    result = await ex.execute(request(DRAIN_NODE))

    assert result.status == DONE, result.detail
    assert sorted(result.affected) == ["train/trainer-0", "train/trainer-1"]
    [read, patch] = [r for r in api.requests if r.path == "/api/v1/nodes/gpu-node-1"]
    assert (read.method, patch.method) == ("GET", "PATCH")
    assert patch.content_type == SMP
    assert patch.body == {"spec": {"unschedulable": True, "taints": [
        GPU_TAINT, {"key": "example.com/flaky", "effect": "NoExecute", "timeAdded": "2026-11-01T10:00:00+00:00"},
        OUR_TAINT]}, "metadata": {"resourceVersion": "7"}}
    [listing] = api.seen("GET", "/api/v1/pods")
    assert listing.query["fieldSelector"] == "spec.nodeName=gpu-node-1"
    evictions = api.seen("POST")
    assert [r.path for r in evictions] == ["/api/v1/namespaces/train/pods/trainer-0/eviction",
                                           "/api/v1/namespaces/train/pods/trainer-1/eviction"]
    assert evictions[0].body == {"apiVersion": "policy/v1", "kind": "Eviction",
                                 "metadata": {"name": "trainer-0", "namespace": "train"}}
    assert api.nodes["gpu-node-1"]["spec"]["unschedulable"] is True
    assert sorted(api.pod_names("gpu-node-1")) == ["batch/finished", "kube-system/kube-proxy-static",
                                                    "kube-system/nvidia-device-plugin-x"]
    assert "skipped 3" in result.detail


async def test_a_second_drain_is_already_and_writes_nothing(api):
    populate(api)
    ex = executor_for(api)
    assert (await ex.execute(request(DRAIN_NODE))).status == DONE
    api.requests.clear()

    again = await ex.execute(request(DRAIN_NODE))

    assert again.status == ALREADY, again.detail
    assert [(r.method, r.path) for r in api.requests] == [("GET", "/api/v1/nodes/gpu-node-1"), ("GET", "/api/v1/pods")]
    assert [t["key"] for t in api.nodes["gpu-node-1"]["spec"]["taints"]].count(TAINT_KEY) == 1


async def test_an_existing_fabric_taint_is_not_duplicated_only_the_cordon_is_patched(api):
    api.add_node("gpu-node-1", taints=[GPU_TAINT, {**OUR_TAINT, "value": "link_downgrade"}])
    result = await executor_for(api).execute(request(DRAIN_AFTER_JOB))
    assert result.status == DONE
    [patch] = api.seen("PATCH")
    assert patch.body == {"spec": {"unschedulable": True}, "metadata": {"resourceVersion": "7"}}
    assert api.nodes["gpu-node-1"]["spec"]["taints"] == [GPU_TAINT, {**OUR_TAINT, "value": "link_downgrade"}]


async def test_a_pdb_429_is_reported_not_forced_and_the_other_pods_still_go(api):
    populate(api)
    api.pdb_protected["train/trainer-0"] = "trainer-pdb"
    result = await executor_for(api).execute(request(DRAIN_NODE))

    assert result.status == FAILED
    assert result.affected == ("train/trainer-1",)
    assert "trainer-pdb" in result.detail and "not forced" in result.detail and "train/trainer-0" in result.detail
    assert "cordoned and tainted" in result.detail
    assert len([r for r in api.seen("POST") if "trainer-0" in r.path]) == 1   # asked once, no retry, no delete
    assert "train/trainer-0" in api.pod_names("gpu-node-1")
    assert not api.seen("DELETE")


async def test_a_conflict_re_reads_and_keeps_the_concurrently_added_taint(api):
    api.add_node("gpu-node-1", taints=[GPU_TAINT])
    api.conflicts_to_inject = 1
    result = await executor_for(api).execute(request(DRAIN_AFTER_JOB))

    assert result.status == DONE, result.detail
    first, second = api.seen("PATCH")
    assert first.body["metadata"]["resourceVersion"] == "7"
    assert second.body["metadata"]["resourceVersion"] == "8"
    assert second.body["spec"]["taints"] == [GPU_TAINT, {"key": "other.io/maintenance", "effect": "NoSchedule"},
                                             OUR_TAINT]
    assert len(api.seen("GET", "/api/v1/nodes/")) == 2
    assert api.nodes["gpu-node-1"]["spec"]["taints"][-1] == OUR_TAINT


async def test_conflicts_beyond_the_retries_fail_with_the_status(api):
    api.add_node("gpu-node-1")
    api.conflicts_to_inject = 10
    result = await executor_for(api, conflict_retries=2).execute(request(DRAIN_AFTER_JOB))
    assert result.status == FAILED
    assert "HTTP 409" in result.detail and "has been modified" in result.detail
    assert len(api.seen("PATCH")) == 3


async def test_drain_after_job_only_cordons_and_taints(api):
    populate(api)
    result = await executor_for(api).execute(request(DRAIN_AFTER_JOB, kind="link downgrade"))
    assert result.status == DONE
    assert api.nodes["gpu-node-1"]["spec"]["taints"][-1] == {**OUR_TAINT, "value": "link-downgrade"}
    assert not api.seen("GET", "/api/v1/pods") and not api.seen("POST")
    assert (await executor_for(api).execute(request(DRAIN_AFTER_JOB))).status == ALREADY


# ----------------------------------------------------------------------------- resume
async def test_resume_removes_only_our_taint_and_uncordons(api):
    populate(api)
    ex = executor_for(api)
    await ex.execute(request(DRAIN_AFTER_JOB))
    api.requests.clear()

    result = await ex.execute(request(RESUME_NODE))

    assert result.status == DONE, result.detail
    [patch] = api.seen("PATCH")
    assert patch.content_type == SMP
    assert patch.body["spec"]["unschedulable"] is False
    assert [t["key"] for t in patch.body["spec"]["taints"]] == ["nvidia.com/gpu", "example.com/flaky"]
    assert "unschedulable" not in api.nodes["gpu-node-1"]["spec"]
    assert (await ex.execute(request(RESUME_NODE))).status == ALREADY
    assert len(api.seen("PATCH")) == 1


async def test_an_operator_cordon_survives_drain_and_resume(api):
    api.add_node("gpu-node-1", unschedulable=True)
    ex = executor_for(api)
    drained = await ex.execute(request(DRAIN_AFTER_JOB))
    assert drained.status == DONE
    assert api.nodes["gpu-node-1"]["metadata"]["annotations"] == {CORDONED_BEFORE_ANNOTATION: "true"}

    resumed = await ex.execute(request(RESUME_NODE))

    assert resumed.status == DONE
    assert api.seen("PATCH")[-1].body == {"spec": {"taints": []},
                                          "metadata": {"annotations": {CORDONED_BEFORE_ANNOTATION: None},
                                                       "resourceVersion": "8"}}
    assert api.nodes["gpu-node-1"]["spec"]["unschedulable"] is True
    assert api.nodes["gpu-node-1"]["metadata"]["annotations"] == {}


async def test_resume_never_uncordons_a_node_without_our_taint(api):
    api.add_node("gpu-node-1", unschedulable=True, taints=[GPU_TAINT])
    result = await executor_for(api).execute(request(RESUME_NODE))
    assert result.status == ALREADY
    assert not api.seen("PATCH")


# ----------------------------------------------------------------------------- requeue
async def test_requeue_evicts_pods_across_pages(api):
    api.page_size = 2
    api.add_node("gpu-node-1")
    for i in range(5):
        api.add_pod("train", f"w-{i}", "gpu-node-1")
    result = await executor_for(api).execute(request(REQUEUE_JOBS))

    assert result.status == DONE
    assert result.affected == tuple(f"train/w-{i}" for i in range(5))
    assert [r.query.get("continue") for r in api.seen("GET", "/api/v1/pods")] == [None, "2", "4"]
    assert not api.seen("PATCH")


async def test_requeue_with_a_job_label_evicts_only_the_named_jobs(api):
    populate(api)
    result = await executor_for(api, job_label="job").execute(request(REQUEUE_JOBS, jobs=["j-18"]))
    assert result.status == DONE
    assert result.affected == ("train/trainer-1",)
    assert "train/trainer-0" in api.pod_names("gpu-node-1")


async def test_requeue_on_an_empty_node_is_already(api):
    api.add_node("gpu-node-1")
    api.add_pod("kube-system", "ds", "gpu-node-1", owner_kind="DaemonSet")
    result = await executor_for(api).execute(request(REQUEUE_JOBS))
    assert result.status == ALREADY
    assert not api.seen("POST")


# ----------------------------------------------------------------------------- errors, config
async def test_api_errors_and_bad_requests_come_back_as_failed(api):
    ex = executor_for(api)
    missing = await ex.execute(request(DRAIN_NODE, node="nope"))
    assert missing.status == FAILED and "HTTP 404" in missing.detail and 'nodes "nope" not found' in missing.detail
    assert (await ex.execute(request(EXCLUDE_AND_RESTART))).status == FAILED
    assert "names no node" in (await ex.execute(request(DRAIN_NODE, node=""))).detail


async def test_an_unreachable_api_server_is_failed_not_raised(api):
    url = api.url
    await api.stop()
    configuration = k8s.Configuration(host=url, retries=False)
    result = await KubernetesExecutor(k8s.ApiClient(configuration), request_timeout_s=2).execute(request(DRAIN_NODE))
    assert result.status == FAILED
    assert "gpu-node-1" in result.detail and ("Connection" in result.detail or "refused" in result.detail)


async def test_a_kubeconfig_file_with_a_bearer_token(api, tmp_path):
    api.add_node("gpu-node-1")
    kubeconfig = tmp_path / "kubeconfig"
    kubeconfig.write_text(json.dumps({
        "apiVersion": "v1", "kind": "Config", "current-context": "fw",
        "clusters": [{"name": "local", "cluster": {"server": api.url}}],
        "users": [{"name": "fabricwatch", "user": {"token": "s3cret-token"}}],
        "contexts": [{"name": "fw", "context": {"cluster": "local", "user": "fabricwatch"}}]}))
    ex = KubernetesExecutor(kubeconfig=str(kubeconfig))
    try:
        assert (await ex.execute(request(DRAIN_AFTER_JOB))).status == DONE
    finally:
        ex.close()
    assert {r.authorization for r in api.requests} == {"Bearer s3cret-token"}


def test_construction_errors_are_clear(tmp_path):
    with pytest.raises(ValueError, match="cannot load Kubernetes credentials"):
        KubernetesExecutor(kubeconfig=str(tmp_path / "missing"))
    with pytest.raises(ValueError, match="not both"):
        KubernetesExecutor(k8s.ApiClient(), kubeconfig="x")
    with pytest.raises(ValueError, match="request_timeout_s"):
        KubernetesExecutor(k8s.ApiClient(), request_timeout_s=0)
    with pytest.raises(ValueError, match="in-cluster"):
        KubernetesExecutor(in_cluster=True)   # no service account on a test machine


# ----------------------------------------------------------------------------- #13: jobs where the API puts them
async def test_requeue_of_named_jobs_never_evicts_a_pod_on_another_node(api):
    """The job names come from an anomaly (telemetry); only pods the API server places on the
    node are evicted, even when the listing answers with pods of other nodes."""
    populate(api)
    api.add_pod("train", "j-17-elsewhere", "gpu-node-2", labels={"job": "j-17"})
    api.ignore_node_selector = True
    result = await executor_for(api, job_label="job").execute(request(REQUEUE_JOBS, jobs=["j-17", "j-99"]))
    assert result.status == DONE and result.affected == ("train/trainer-0",), result.detail
    assert [r.path for r in api.seen("POST")] == ["/api/v1/namespaces/train/pods/trainer-0/eviction"]
    assert "train/j-17-elsewhere" in api.pod_names("gpu-node-2") and "train/elsewhere" in api.pod_names("gpu-node-2")


async def test_the_kubernetes_domain_is_its_api_server(api):
    assert executor_for(api).domain == f"kubernetes:{api.url}"
