"""Score anomaly events against the simulator's `GroundTruth`, per fault class.

Rules (one scenario, one detector at a time; only OPEN events count as alarms):

* **Class of an event** = its kind (``link_downgrade``, ``pcie_downgrade``, ``link_flap``, ``link_down``,
  ``pfc_storm``, ``straggler``, ``gpu_xid``, ``gpu_ecc_uncorrectable``; any other kind is
  its own class, so new detectors show up as they land). Ground-truth kinds map to classes
  with `scenarios.fault_class` (NIC and GPU PCIe downgrades are both ``pcie_downgrade``).
* **TP**: an OPEN event of the fault's class, on the fault's **source** entity, detected
  within ``[onset - CLOCK_TOLERANCE, offset + grace]``. The source entity is the ground
  truth's ``entity``; for a NIC link (downgrade, flap, storm) the leaf port facing it is the
  same link, so an event there is the same incident (counted once, never twice). A storm
  named on a **victim** is a FP, and so is a ``gpu_xid`` on a sibling GPU that only logged
  XID 45 (preemptive cleanup) after the root fault. A straggler matches on job and rank (and on the node, when
  the event names one); a hang on its culprit rank (either, when two ranks hold the job up).
  Delay = ``detected_unix_ns - onset_unix_ns`` of the first TP.
* **Duplicate**: a further OPEN for a fault already detected (the NIC and its leaf port,
  a re-open after a resolve): neither TP nor FP.
* **Explained**: an OPEN of a class that is a known *consequence* of an active fault, on an
  entity the fault touches (a straggler named on the node whose NIC was downgraded or
  paused by a storm, an uncorrectable-ECC event with an XID 48/94/95 on that GPU, a hang of a
  job whose GPU was lost or whose NIC went down too briefly to be labelled one): neither
  TP nor FP, counted separately.
* **FP**: every other OPEN, attributed to the class of its kind. Must-not-fire faults
  (``expect_alert=False``: admin toggle, reboot, XON flood, a storm shorter than T_detect,
  clock skew, application XIDs of a user bug) are never TPs, so whatever opens on them is a FP; `Match.fp_reason` says why.
* **FN**: an ``expect_alert`` fault with no TP.

>>> from fabricwatch.simulator.labels import GroundTruth
>>> from fabricwatch.protos.v1 import events_pb2 as ev
>>> gt = GroundTruth("link_downgrade", "node-0002/mlx5_3/1", 10_000_000_000, None,
...                  related=("leaf-u0-r3/Ethernet1",))
>>> def opened(kind, t_ns, **entity):
...     return ev.AnomalyEvent(kind=kind, lifecycle=ev.LIFECYCLE_OPEN, detected_unix_ns=t_ns,
...                            entity=ev.EntityPath(cluster="c", **entity))
>>> events = [opened("link_downgrade", 10_400_000_000, node="node-0002", device="mlx5_3", port="1"),
...           opened("link_downgrade", 10_500_000_000, switch="leaf-u0-r3", port="Ethernet1"),
...           opened("link_downgrade", 12_000_000_000, node="node-0001", device="mlx5_0", port="1")]
>>> m = match([detection_from_event(e) for e in events], [gt], interval_s=1.0, end_ns=60_000_000_000)
>>> [(t.cls, t.delay_ns) for t in m.tps], len(m.duplicates), [(f.cls, f.entity) for f in m.fps], m.fns
([('link_downgrade', 400000000)], 1, [('link_downgrade', 'node-0001/mlx5_0/1')], [])
"""
from __future__ import annotations

from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass, field, replace

from fabricwatch.models.findings import JOB_KEY, EntityRef
from fabricwatch.models.vocabulary import (GPU_ECC_UNCORRECTABLE, GPU_XID, HANG, LINK_DOWN, LINK_DOWNGRADE, LINK_FLAP,
                                           PCIE_DOWNGRADE, PFC_STORM, STRAGGLER)
from fabricwatch.protos.v1 import events_pb2 as ev
from fabricwatch.simulator.labels import GroundTruth
from fabricwatch.streams.events import entity_ref
from fabricwatch.xid import UNCORRECTABLE_ECC_XIDS

from .scenarios import fault_class

__all__ = ["Detection", "Match", "TruePositive", "FalsePositive", "Missed", "detection_from_event",
           "entity_path", "match", "grace_ns", "CLOCK_TOLERANCE_NS", "CONSEQUENCES"]

# Node clocks in the simulator are off by up to +-5 ms (NTP-grade): a sample stamped just
# before the onset can already show the fault.
CLOCK_TOLERANCE_NS = 10_000_000

# Classes an expected fault explains when they open on an entity it touches.
CONSEQUENCES: dict[str, frozenset[str]] = {
    LINK_DOWNGRADE: frozenset({STRAGGLER}),
    PCIE_DOWNGRADE: frozenset({STRAGGLER}),
    LINK_FLAP: frozenset({STRAGGLER}),
    LINK_DOWN: frozenset({STRAGGLER, HANG}),
    PFC_STORM: frozenset({STRAGGLER, HANG}),
    GPU_XID: frozenset({STRAGGLER, HANG}),
    GPU_ECC_UNCORRECTABLE: frozenset(),
    # the straggler's own cause, where it is an anomaly of its own on its node (its dead NIC)
    STRAGGLER: frozenset({LINK_FLAP, LINK_DOWN}),
}

# Classes whose ground truth names victims that are not at fault (storm-paused ports; the
# sibling GPUs whose contexts an XID cascade cleaned up with XID 45): an alarm there is a FP.
_VICTIM_CLASSES = frozenset({PFC_STORM, GPU_XID})

# Kinds whose source is a NIC link: the leaf port facing it is the same incident.
_LINK_CLASSES = frozenset({LINK_DOWNGRADE, LINK_FLAP, PFC_STORM, LINK_DOWN})


def grace_ns(cls: str | None, interval_s: float, expect_alert: bool = True) -> int:
    """How long after a fault's offset an alarm is still attributed to it.

    Expected faults: a first detection until then still detects it (stragglers need several
    slow steps). Must-not-fire faults: alarms until then are charged to them.
    """
    if not expect_alert:
        return int(max(2.0, 10 * interval_s) * 1e9)
    if cls == STRAGGLER:
        return int(60e9)
    return int(max(5.0, 10 * interval_s) * 1e9)


@dataclass(frozen=True)
class Detection:
    """An OPEN event reduced to what scoring needs (picklable, detector-agnostic)."""
    kind: str
    entity: str                 # `entity_path`: node/device/port, switch/port, job=<id>/rank=<r>
    detected_ns: int
    node: str = ""
    device: str = ""
    job: str = ""
    rank: str = ""
    detector: str = ""
    summary: str = ""
    cause: str = ""             # the event's cause code (a straggler's probable cause)
    dedup_key: str = ""


def entity_path(e: ev.EntityPath) -> str:
    """An event entity as the ground truth names it ("node-0003/mlx5_2/1", "leaf-u0-r2/Ethernet3",
    "job=j/rank=3"): its `EntityRef.local_path`, without a switch queue (the truth names the port)."""
    ref = entity_ref(e)
    if ref.switch and not ref.job:
        ref = replace(ref, device="")
    return ref.local_path()


def detection_from_event(event: ev.AnomalyEvent) -> Detection | None:
    """A `Detection` for an OPEN event; None for UPDATE / RESOLVED."""
    if event.lifecycle != ev.LIFECYCLE_OPEN:
        return None
    e = event.entity
    return Detection(kind=event.kind, entity=entity_path(e), detected_ns=int(event.detected_unix_ns),
                     node=e.node, device=e.device, job=e.job, rank=e.rank, detector=event.detector,
                     summary=event.summary, cause=event.cause_code, dedup_key=event.dedup_key)


@dataclass(frozen=True)
class TruePositive:
    cls: str
    entity: str
    onset_ns: int
    detected_ns: int
    delay_ns: int
    gt_index: int
    detail: dict = field(default_factory=dict, compare=False, hash=False)
    cause: str = ""             # the detection's cause code
    dedup_key: str = ""         # the detection's anomaly


@dataclass(frozen=True)
class FalsePositive:
    cls: str
    entity: str
    detected_ns: int
    fp_reason: str
    summary: str = ""


@dataclass(frozen=True)
class Missed:
    cls: str
    entity: str
    onset_ns: int
    gt_index: int


@dataclass
class Match:
    tps: list[TruePositive] = field(default_factory=list)
    fps: list[FalsePositive] = field(default_factory=list)
    fns: list[Missed] = field(default_factory=list)
    duplicates: list[Detection] = field(default_factory=list)
    explained: list[tuple[Detection, int]] = field(default_factory=list)   # (event, ground-truth index)
    mnf_hits: dict[int, Counter] = field(default_factory=dict)             # must-not-fire gt index -> FP kinds


def _node_of(path: str) -> str:
    head = path.split("/", 1)[0]
    return head if head and not head.startswith(("leaf", "spine", JOB_KEY)) else ""


@dataclass(frozen=True)
class _Truth:
    index: int
    gt: GroundTruth
    cls: str | None
    lo: int
    hi: int
    sources: frozenset[str]
    footprint_nodes: frozenset[str]
    footprint: frozenset[str]
    victims: frozenset[str]
    job: str = ""
    rank: str = ""
    node: str = ""


def _truths(gts: list[GroundTruth], interval_s: float, end_ns: int) -> list[_Truth]:
    out = []
    for i, gt in enumerate(gts):
        cls = fault_class(gt.kind)
        off = gt.offset_unix_ns if gt.offset_unix_ns is not None else end_ns
        hi = off + grace_ns(cls, interval_s, gt.expect_alert)
        sources = {gt.entity}
        if cls in _LINK_CLASSES:
            sources.update(gt.related)
        if cls == HANG:                 # a job held up by two ranks at once (a two-port storm): either
            sources.update(gt.detail.get("culprits", ()))
        job = rank = ""
        node = str(gt.detail.get("node", "")) if gt.detail else ""
        if gt.entity.startswith(JOB_KEY):
            ref = EntityRef.parse(gt.entity)
            job, rank = ref.job, ref.rank
        paths = (gt.entity, *gt.related, *gt.victims)
        nodes = {n for n in (_node_of(p) for p in paths) if n}
        if node:
            nodes.add(node)
        out.append(_Truth(i, gt, cls, gt.onset_unix_ns - CLOCK_TOLERANCE_NS, hi, frozenset(sources),
                          frozenset(nodes), frozenset(paths), frozenset(gt.victims), job, rank, node))
    return out


def _is_source(t: _Truth, d: Detection) -> bool:
    if t.cls == STRAGGLER:
        if not (d.job == t.job and d.rank == t.rank):
            return False
        return not d.node or not t.node or d.node == t.node
    return d.entity in t.sources


def _explains(t: _Truth, d: Detection, cls: str, job_nodes: Mapping[str, tuple[str, ...]]) -> bool:
    if not t.gt.expect_alert or t.cls is None:
        return False
    if t.cls == GPU_XID and cls == GPU_ECC_UNCORRECTABLE:
        return d.entity == t.gt.entity and int(t.gt.detail.get("code", 0)) in UNCORRECTABLE_ECC_XIDS
    if cls not in CONSEQUENCES.get(t.cls, ()):
        return False
    node = d.node or _node_of(d.entity)
    if cls == HANG and d.job in job_nodes:
        # a fault that stalls one node stalls its whole job's collective: when every rank is
        # stuck alike the detector names one of them, not necessarily the fault's node
        return any(n in t.footprint_nodes for n in job_nodes[d.job])
    return bool(node) and node in t.footprint_nodes


def match(detections: list[Detection | None], gts: list[GroundTruth], interval_s: float, end_ns: int,
          job_nodes: Mapping[str, tuple[str, ...]] | None = None) -> Match:
    """Score one scenario's OPEN detections (None entries are skipped) against its ground truth;
    ``job_nodes``: the jobs' nodes (a hang is explained by a fault on any node of its job)."""
    job_nodes = job_nodes or {}
    truths = _truths(gts, interval_s, end_ns)
    m = Match()
    detected: dict[int, TruePositive] = {}
    for d in sorted((d for d in detections if d is not None), key=lambda d: (d.detected_ns, d.entity, d.kind)):
        cls = d.kind
        active = [t for t in truths if t.lo <= d.detected_ns <= t.hi]
        cands = [t for t in active if t.gt.expect_alert and t.cls == cls and _is_source(t, d)]
        if cands:
            fresh = [t for t in cands if t.index not in detected]
            if fresh:
                t = min(fresh, key=lambda t: (t.gt.onset_unix_ns, t.index))
                detail = {"scenario_interval_s": interval_s, **(t.gt.detail or {})}
                tp = TruePositive(cls, t.gt.entity, t.gt.onset_unix_ns, d.detected_ns,
                                  d.detected_ns - t.gt.onset_unix_ns, t.index, detail, d.cause, d.dedup_key)
                detected[t.index] = tp
                m.tps.append(tp)
            else:
                m.duplicates.append(d)
            continue
        why = next((t for t in active if _explains(t, d, cls, job_nodes)), None)
        if why is not None:
            m.explained.append((d, why.index))
            continue
        reason = "unexplained"
        if cls in _VICTIM_CLASSES and any(d.entity in t.victims for t in active if t.cls == cls):
            reason = "victim named as source"
        mnf = [t for t in active if not t.gt.expect_alert]
        if mnf:
            node = d.node or _node_of(d.entity)
            touching = [t for t in mnf if node in t.footprint_nodes or d.entity in t.footprint] or mnf
            # charged to one fault: the latest onset before the alarm
            t = max(touching, key=lambda t: (t.gt.onset_unix_ns <= d.detected_ns, t.gt.onset_unix_ns))
            m.mnf_hits.setdefault(t.index, Counter())[cls] += 1
            reason = f"must-not-fire: {t.gt.kind}" + ("" if reason == "unexplained" else f"; {reason}")
        elif reason == "unexplained" and any(t.cls == cls and t.gt.expect_alert for t in active):
            reason = "wrong entity"
        m.fps.append(FalsePositive(cls, d.entity, d.detected_ns, reason, d.summary))
    for t in truths:
        if t.gt.expect_alert and t.cls is not None and t.index not in detected:
            m.fns.append(Missed(t.cls, t.gt.entity, t.gt.onset_unix_ns, t.index))
        if not t.gt.expect_alert:
            m.mnf_hits.setdefault(t.index, Counter())
    return m
