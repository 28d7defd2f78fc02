"""The dashboard's read side: the JSON views of a `FabricState` that the API serves.

The heat map (`fabric_view`), the open anomalies by cost (`open_summary`), an entity page
(`entity_view`), the jobs and their stragglers (`jobs_view`) and the filtered feed
(`feed_view`, `FeedFilter`). Every list an answer carries is capped, with its total.
Separate from the state, which only takes records in and keeps them bounded: these
functions read it and build answers, and change with the browser's needs, not the model's.
"""
from __future__ import annotations

import functools
import heapq
import re
from dataclasses import dataclass

import numpy as np

from fabricwatch.models.event_filter import EventFacts, EventFilter
from fabricwatch.models.findings import JOB_KEY
from fabricwatch.models.impact import projected_gpu_hours
from fabricwatch.models.vocabulary import SEVERITIES
from fabricwatch.models.vocabulary import STRAGGLER as STRAGGLER_KIND
from fabricwatch.protos.v1 import events_pb2 as ev

from .shapes import SEVERITY_NAME, anomaly_dict, decision_dict, entity_path, rank_path, ref_of
from .state import (GPU, GPU_INDEX, HEALTHY, METRIC_TITLES, METRIC_UNITS, METRICS, NIC_PORT, NODE, RANK, SWITCH,
                    SWITCH_PORT, FabricState)

# What one API answer may hold: every list an answer carries is capped, with its total.
MAX_FABRIC_CELLS = 65_536          # node rows x (rails + GPUs) of one /api/fabric page
MAX_SWITCHES_SHOWN = 2_048
MAX_OPEN_SHOWN = 200               # open anomalies listed with the fabric view (most severe, newest first)
MAX_ENTITY_ANOMALIES = 200
MAX_ENTITY_DECISIONS = 200
MAX_CHILDREN_SHOWN = 4_096
MAX_RANKS_SHOWN = 1_024            # per job in /api/jobs (stragglers first)
MAX_JOBS_SHOWN = 500


def _natural_key(name: str) -> list:
    return [int(t) if t.isdigit() else t for t in re.split(r"(\d+)", name)]


def fabric_view(state: FabricState, now_ns: int, problems_only: bool = False,
                offset: int = 0, limit: int = 512) -> dict:
    """The heat map: nodes x NIC rails (and GPUs), leaf and spine switches, with health."""
    roles = state.roles()
    rails = sorted({r for n in state.nodes.values() for r in n.nics})
    n_gpus = max((max(n.gpus) + 1 for n in state.nodes.values() if n.gpus), default=0)
    names = sorted(state.nodes, key=_natural_key) if state.topology is None else list(state.nodes)
    if problems_only:
        names = [n for n in names if n in roles or state.silent(n, now_ns)]
    limit = max(1, min(limit, MAX_FABRIC_CELLS // max(1, len(rails) + n_gpus)))
    rows = []
    for name in names[offset:offset + limit]:
        node = state.nodes[name]
        nic_cells = []
        for rail in rails:
            eid = node.nics.get(rail)
            path = f"{name}/{eid}" if eid else ""
            latest = state.series[NIC_PORT].latest(path) if path else {}
            nic_cells.append({"rail": rail, "id": eid or "", "path": path,
                              "health": roles.get(path, HEALTHY).to_dict() if path else None,
                              "tx_gbps": latest.get("tx_gbps"), "link_rate_gbps": latest.get("link_rate_gbps"),
                              "peer": state.peer_of(path)})
        gpu_cells = []
        for g in range(n_gpus):
            path = f"{name}/gpu{g}"
            latest = state.series[GPU].latest(path) if g in node.gpus else {}
            gpu_cells.append({"index": g, "path": path if g in node.gpus else "",
                              "health": roles.get(path, HEALTHY).to_dict() if g in node.gpus else None,
                              "gpu_util_pct": latest.get("gpu_util_pct")})
        rows.append({"node": name, "health": roles.get(name, HEALTHY).to_dict(),
                     "silent": state.silent(name, now_ns), "nics": nic_cells, "gpus": gpu_cells})
    switches = []
    for name in sorted(state.switches, key=_natural_key)[:MAX_SWITCHES_SHOWN]:
        sw = state.switches[name]
        switches.append({"name": name, "role": sw.role, "ports": len(sw.ports),
                         "health": roles.get(name, HEALTHY).to_dict(),
                         "silent": state.silent(name, now_ns)})
    return {"rails": rails, "gpus": n_gpus, "nodes_total": len(names), "offset": offset, "limit": limit,
            "rows": rows, "switches": switches, "switches_total": len(state.switches),
            "open_anomalies": open_summary(state, now_ns=now_ns), "open_total": len(state.open),
            "topology_source": "file" if state.topology is not None else "telemetry"}


def open_summary(state: FabricState, limit: int = MAX_OPEN_SHOWN, now_ns: int | None = None) -> list[dict]:
    """The open anomalies that cost the most first (GPU-hours lost by ``now_ns``: what each one's
    latest event said plus its rate since), then the most severe, newest; at most `limit`.
    Without ``now_ns``: as of the newest event shown."""
    if now_ns is None:
        now_ns = max((e.detected_unix_ns for e in state.open.values()), default=0)

    def cost(e: ev.AnomalyEvent) -> float:
        return projected_gpu_hours(e.impact_gpu_hours, e.impact_gpu_hours_per_hour, e.detected_unix_ns, now_ns)

    ranked = heapq.nsmallest(limit, ((-cost(e), -e.severity, -e.detected_unix_ns, e.dedup_key, e)
                                     for e in state.open.values()), key=lambda t: t[:4])
    return [{**anomaly_dict(e), "impact_gpu_hours_now": round(-c, 6)} for c, _, _, _, e in ranked]


def entity_kind(state: FabricState, path: str) -> str:
    parts = path.split("/")
    if path.startswith(JOB_KEY):
        return RANK
    if len(parts) == 1:
        return SWITCH if path in state.switches else NODE if path in state.nodes else _kind_from_anomalies(state, path)
    for kind in (NIC_PORT, GPU, SWITCH_PORT):
        if path in state.series[kind]:
            return kind
    if parts[0] in state.switches:
        return SWITCH_PORT
    if parts[0] in state.nodes:
        return GPU if GPU_INDEX.match(parts[1]) else NIC_PORT
    return _kind_from_anomalies(state, path)


def _kind_from_anomalies(state: FabricState, path: str) -> str:
    """An entity known only because an anomaly or decision names it (or one of its parts)."""
    named = [p for e in list(state.open.values()) + list(state.resolved) for p in (e.entity, *e.related)]
    named += [d.target for d in state.decisions.values()]
    for p in named:
        ep = entity_path(p)
        if ep == path:
            if p.switch:
                return SWITCH_PORT if p.port else SWITCH
            if GPU_INDEX.match(p.device):
                return GPU
            return NIC_PORT if p.device else NODE
        if "/" not in path and ep.startswith(path + "/"):
            return SWITCH if p.switch else NODE
    return ""


def _touches(event: ev.AnomalyEvent, path: str) -> str:
    """How an anomaly concerns an entity: "entity", "related" or "" (also for their parts)."""
    main = entity_path(event.entity)
    if main == path or main.startswith(path + "/"):
        return "entity"
    for r in event.related:
        rp = entity_path(r)
        if rp == path or rp.startswith(path + "/"):
            return "related"
    if path.startswith(JOB_KEY) and event.entity.job and rank_path(event.entity.job, event.entity.rank) == path:
        return "entity"
    return ""


def entity_view(state: FabricState, path: str, now_ns: int) -> dict | None:
    """An entity page: what it is, its series, the anomalies on it and the decisions about it."""
    kind = entity_kind(state, path)
    if not kind:
        return None
    out: dict = {"path": path, "kind": kind, "health": state.health(path).to_dict(),
                 "peer": state.peer_of(path), "parent": path.split("/")[0] if "/" in path else ""}
    if kind in METRICS:
        out["series"] = state.series[kind].series(path) or {"t_ms": []}
        out["metrics"] = [{"name": m, "unit": METRIC_UNITS[m], "title": METRIC_TITLES[m]} for m in METRICS[kind]]
    node = state.nodes.get(path) if kind == NODE else None
    if node is not None:
        out["children"] = ([{"path": f"{path}/{eid}", "label": f"rail {rail}: {eid}",
                             "health": state.health(f"{path}/{eid}").to_dict()}
                            for rail, eid in sorted(node.nics.items())]
                           + [{"path": f"{path}/gpu{g}", "label": f"gpu{g}",
                               "health": state.health(f"{path}/gpu{g}").to_dict()} for g in sorted(node.gpus)])
        out["silent"] = state.silent(path, now_ns)
    sw = state.switches.get(path) if kind == SWITCH else None
    if sw is not None:
        out["role"] = sw.role
        out["children"] = [{"path": f"{path}/{p}", "label": p + (f" → {state.peer_of(f'{path}/{p}')}"
                                                                  if state.peer_of(f"{path}/{p}") else ""),
                            "health": state.health(f"{path}/{p}").to_dict()}
                           for p in sorted(sw.ports, key=_natural_key)]
        out["silent"] = state.silent(path, now_ns)
    anomalies = []
    for event in list(state.open.values()) + list(state.resolved):
        how = _touches(event, path)
        if how:
            anomalies.append({**anomaly_dict(event), "relation": how})
    anomalies.sort(key=lambda a: (a["lifecycle"] == "resolved", -a["detected_unix_ms"]))
    out["anomalies"], out["anomalies_total"] = anomalies[:MAX_ENTITY_ANOMALIES], len(anomalies)
    keys = {a["dedup_key"] for a in anomalies}
    decisions = [d for d in reversed(state.decisions.values())
                 if d.anomaly_dedup_key in keys or entity_path(d.target) == path
                 or entity_path(d.target).startswith(path + "/")]
    out["decisions"] = [decision_dict(d) for d in decisions[:MAX_ENTITY_DECISIONS]]
    out["decisions_total"] = len(decisions)
    if len(out.get("children", ())) > MAX_CHILDREN_SHOWN:
        out["children_total"] = len(out["children"])
        out["children"] = out["children"][:MAX_CHILDREN_SHOWN]
    return out


def jobs_view(state: FabricState, limit: int = MAX_JOBS_SHOWN) -> list[dict]:
    """Each job's ranks with recent step times, stragglers marked with their probable cause.

    At most `limit` jobs (most recently heard from), and per job at most
    MAX_RANKS_SHOWN ranks, its stragglers first; ``ranks_seen`` tells how many there are.
    """
    stragglers: dict[tuple[str, str], ev.AnomalyEvent] = {
        (e.entity.job, e.entity.rank): e for e in state.open.values() if e.kind == STRAGGLER_KIND}
    out = []
    shown = heapq.nlargest(limit, state.jobs.values(), key=lambda j: j.last_seen_ns)
    for job in sorted(shown, key=lambda j: j.job_id):
        slow = {int(rank) for job_id, rank in stragglers if job_id == job.job_id and rank.isdigit()}
        picked = heapq.nsmallest(MAX_RANKS_SHOWN, job.ranks.values(), key=lambda r: (r.rank not in slow, r.rank))
        ranks = []
        for r in sorted(picked, key=lambda r: r.rank):
            event = stragglers.get((job.job_id, str(r.rank)))
            steps = list(r.steps)
            ranks.append({
                "rank": r.rank, "node": r.node, "local_gpu": r.local_gpu,
                "gpu_path": f"{r.node}/gpu{r.local_gpu}", "last_step": steps[-1][0] if steps else None,
                "step_s": [s[1] for s in steps], "busy_s": steps[-1][2] if steps else None,
                "wait_s": steps[-1][3] if steps else None,
                "straggler": None if event is None else {
                    "summary": event.summary, "probable_cause": event.probable_cause,
                    "cause_code": getattr(event, "cause_code", ""), "dedup_key": event.dedup_key,
                    "severity": SEVERITY_NAME.get(event.severity, "")},
            })
        last = [r["step_s"][-1] for r in ranks if r["step_s"]]
        out.append({"job": job.job_id, "world_size": job.world_size, "ranks_seen": len(job.ranks),
                    "nodes": sorted({r.node for r in job.ranks.values()}, key=_natural_key),
                    "median_step_s": float(np.median(last)) if last else None,
                    "stragglers": [r["rank"] for r in ranks if r["straggler"]],
                    "ranks": ranks, "dropped_ranks": job.dropped_ranks})
    return out


def nodes_of_job(state: FabricState, job_id: str) -> set[str]:
    job = state.jobs.get(job_id)
    return {r.node for r in job.ranks.values()} if job else set()


def feed_view(state: FabricState, flt: FeedFilter, limit: int = 200) -> list[dict]:
    """The latest feed items (anomalies and decisions) that pass the filter, newest event time first.

    Arrival order is not time order: at start the look-back replays several topics and
    partitions one after another.
    """
    out = []
    for item in reversed(state.feed):
        if flt.matches(item, state):
            out.append(item)
            if len(out) >= limit:
                break
    out.sort(key=lambda i: (i["data"].get("detected_unix_ms") or i["data"].get("decided_unix_ms", 0), i["seq"]),
             reverse=True)
    return out


@dataclass(frozen=True)


class FeedFilter:
    """The feed's filters; empty fields match everything. Decisions match on their anomaly's kind.

    >>> FeedFilter.parse({"severity": "loud"})
    Traceback (most recent call last):
    ...
    ValueError: severity must be one of info, warning, critical (got 'loud')
    """

    kind: str = ""
    min_severity: str = ""
    job: str = ""
    switch: str = ""

    @classmethod
    def parse(cls, query: dict) -> FeedFilter:
        severity = str(query.get("severity", "")).strip().lower()
        if severity and severity not in SEVERITIES:
            raise ValueError(f"severity must be one of {', '.join(SEVERITIES)} (got {severity!r})")
        return cls(kind=str(query.get("kind", "")).strip(), min_severity=severity,
                   job=str(query.get("job", "")).strip(), switch=str(query.get("switch", "")).strip())

    @functools.cached_property
    def event_filter(self) -> EventFilter:
        """This filter as the shared core; the state adds what it knows (a job's nodes, switch peers)."""
        return EventFilter(kinds=frozenset({self.kind} - {""}), min_severity=self.min_severity, job=self.job,
                           switch=self.switch)

    def matches(self, item: dict, state: FabricState) -> bool:
        data = item["data"]
        if item["type"] == "anomaly":
            paths = [data["entity"]] + data["related"]
            facts = EventFacts(kind=data["kind"], severity=data["severity"], entities=tuple(map(ref_of, paths)))
        else:
            paths = [data["target"]]
            linked = state.open.get(data["anomaly_dedup_key"])
            severity = SEVERITY_NAME.get(linked.severity, "") if linked is not None else ""
            facts = EventFacts(kind=data["anomaly_kind"], severity=severity, entities=(ref_of(data["target"]),))
        job_nodes = nodes_of_job(state, self.job) if self.job else ()
        # A NIC port's leaf: the switch side of its link counts as on that switch.
        peers = {state.peer_of(p["path"]).split("/")[0] for p in paths} if self.switch else ()
        return self.event_filter.admits(facts, job_nodes=job_nodes, peer_switches=peers)
