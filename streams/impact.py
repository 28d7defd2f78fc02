"""Each finding's impact in GPU-hours (`models.impact`), from what this worker knows of its jobs.

Every stage runs its findings through `assess` before they go out, so every OPEN, UPDATE and
RESOLVED carries the cost as of its own detection time. The jobs an anomaly touches:

* an anomaly of a job (straggler): that job, with its GPUs (the world size its ranks report);
* of a node's part (NIC, GPU, PCIe): the jobs placed on the node (`JobPlacement` facts);
* of a switch port: the jobs on the node at its far end (topology);
* a storm: the jobs on the source's and the victims' nodes (``related``).

A job that stalls is restarted from its last checkpoint; the work since then is at most what
it did since its first step seen (its placement's ``first_step_ns``), else the model's default.

With no job known there, the node's GPUs (the topology's ``gpus_per_node``; a storm: per
victim node) stand in, and the impact is ``estimated``. Time is event time only (onset
to ``detected_ns``); which jobs are known is this worker's placements, as for the storm
locator's ``affected_jobs``.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

from fabricwatch.models.findings import RESOLVED, EntityRef, Finding
from fabricwatch.models.impact import ImpactModel, JobShare
from fabricwatch.models.topology import Topology

from .facts import FactBook

# Without a topology: the GPUs of one node (the common 8-GPU server).
DEFAULT_GPUS_PER_NODE = 8
# A world size above this is a bad report, not a job (the largest jobs we know: ~100k GPUs).
MAX_JOB_GPUS = 1_000_000

MODEL = ImpactModel()
_NO_FACTS = FactBook()
JobGpus = Callable[[str, str], int]


def _nodes(finding: Finding, topology: Topology | None) -> list[str]:
    refs: list[EntityRef] = [finding.entity, *finding.related]
    nodes: list[str] = []
    for ref in refs:
        node = ref.node
        if not node and ref.switch and ref.port and topology is not None:
            peer = topology.peer_of(ref.switch, ref.port)
            node = peer.nic.node if peer is not None and peer.nic is not None else ""
        if node and node not in nodes:
            nodes.append(node)
    return nodes


def jobs_of(finding: Finding, facts: FactBook | None, topology: Topology | None,
            job_gpus: JobGpus | None = None) -> tuple[list[JobShare], int]:
    """(the jobs ``finding`` touches, the GPUs that stand in when none is known)."""
    per_node = topology.gpus_per_node if topology is not None and topology.gpus_per_node else DEFAULT_GPUS_PER_NODE
    cluster = finding.entity.cluster
    if facts is None:
        facts = _NO_FACTS

    def gpus(job: str) -> int:
        n = (job_gpus(cluster, job) if job_gpus is not None else 0) or facts.job_ranks(cluster, job)
        return min(n or facts.job_nodes(cluster, job) * per_node, MAX_JOB_GPUS)

    if finding.entity.job:
        n = gpus(finding.entity.job)
        return ([JobShare(finding.entity.job, n)] if n else []), per_node
    def since_checkpoint_s(job: str) -> float | None:
        # the work since its last checkpoint is at most what it did since its first step here:
        # what came before was in the checkpoint it started from
        first = facts.job_first_step_ns(cluster, job)
        if not first or first > finding.onset_ns:
            return None
        return min(MODEL.since_checkpoint_s, (finding.onset_ns - first) / 1e9)

    nodes = _nodes(finding, topology)
    ids = sorted(set().union(*(facts.jobs_by_node.get(n, ()) for n in nodes))) if nodes else []
    shares = [JobShare(j, g, since_checkpoint_s(j)) for j in ids if (g := gpus(j))]
    return shares, per_node * max(1, len(nodes))


def assess(findings: list[Finding], facts: FactBook | None, topology: Topology | None,
           job_gpus: JobGpus | None = None) -> list[Finding]:
    """The findings with their impact set (new objects; the detectors' own are not touched)."""
    out = []
    for f in findings:
        jobs, stand_in = jobs_of(f, facts, topology, job_gpus)
        evidence: dict[str, float] = {}
        for e in f.evidence:
            evidence.setdefault(e.name, e.value)
        i = MODEL.assess(f.kind, f.severity, f.onset_ns, f.detected_ns, jobs, stand_in, evidence,
                         open=f.state != RESOLVED)
        out.append(replace(f, impact_gpu_hours=i.gpu_hours_lost, impact_gpu_hours_per_hour=i.gpu_hours_per_hour,
                           impact_basis=i.basis))
    return out
