"""The dashboard's picture of the fabric: a bounded in-memory model fed record by record.

Pure: no Kafka, no HTTP. `dashboard.feed` hands it decoded records; `dashboard.views`
builds the API's answers from it. It holds

* the topology: nodes with their NIC ports by rail and their GPUs, leaf and spine switches
  with their ports; from a topology file when given, else learnt from the telemetry;
* per entity (NIC port, GPU, switch port) a ring buffer of a few derived values, so an
  entity page can draw its recent history (`dashboard.series.SeriesTable`);
* the open anomalies by dedup key and the latest resolved ones, with their evidence;
* the action decisions (actions and audit topics; shadow "would have done" included);
* the jobs, from rank-step records: ranks, nodes and recent step times.

Health of an entity is derived from the open anomalies that name it: the source of a PFC
storm, its victims (the storm's related entities), a downgraded link, a straggling rank,
any other fault. Every structure is bounded; the size of the series, the only one that
grows with the cluster, is `SeriesTable.bytes_per_entity` per entity (see `DashboardLimits`).

>>> from fabricwatch.protos.v1 import events_pb2 as ev
>>> state = FabricState()
>>> storm = ev.AnomalyEvent(id="e1", dedup_key="pfc:n1", kind="pfc_storm", lifecycle=ev.LIFECYCLE_OPEN,
...                         severity=ev.SEVERITY_CRITICAL,
...                         entity=ev.EntityPath(node="n1", device="mlx5_5", port="1"),
...                         related=[ev.EntityPath(switch="leaf-0", port="Ethernet5")])
>>> state.add_anomaly(storm)
True
>>> state.health("n1/mlx5_5/1").role, state.health("leaf-0/Ethernet5").role, state.health("leaf-0").role
('source', 'victim', 'victim')
"""
from __future__ import annotations

import logging
import re
from collections import Counter, OrderedDict, deque
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from fabricwatch.lograte import RateLimitedLogger
from fabricwatch.models.fabric_summary import FabricSummary
from fabricwatch.models.findings import JOB_KEY
from fabricwatch.models.frames import EntityFrame
from fabricwatch.models.linkrate import parse_ib_rate
from fabricwatch.models.rates import RateTracker
from fabricwatch.models.topology import Topology
from fabricwatch.models.vocabulary import LINK_DOWNGRADE, PCIE_DOWNGRADE, PFC_STORM
from fabricwatch.models.vocabulary import STRAGGLER as STRAGGLER_KIND
from fabricwatch.protos.v1 import events_pb2 as ev
from fabricwatch.protos.v1 import telemetry_pb2 as pb

from .series import SeriesTable
from .shapes import SEVERITY_NAME, anomaly_dict, decision_dict, entity_path, rank_path

log = logging.getLogger("fabricwatch.dashboard")
_limited_log = RateLimitedLogger(log)

# ------------------------------------------------------------------------ vocabulary
NIC_PORT, GPU, SWITCH_PORT, NODE, SWITCH, RANK = "nic_port", "gpu", "switch_port", "node", "switch", "rank"

#: Derived values kept per entity kind, in column order of its `SeriesTable`.
METRICS: dict[str, tuple[str, ...]] = {
    NIC_PORT: ("tx_gbps", "rx_gbps", "rx_pause_duty", "tx_pause_duty", "link_rate_gbps"),
    GPU: ("gpu_util_pct", "sm_clock_mhz", "temperature_c"),
    SWITCH_PORT: ("tx_gbps", "rx_gbps", "rx_pause_duty", "link_rate_gbps"),
}
METRIC_UNITS = {
    "tx_gbps": "Gb/s", "rx_gbps": "Gb/s", "rx_pause_duty": "s/s", "tx_pause_duty": "s/s",
    "link_rate_gbps": "Gb/s", "gpu_util_pct": "%", "sm_clock_mhz": "MHz", "temperature_c": "°C",
}
METRIC_TITLES = {
    "tx_gbps": "transmitted", "rx_gbps": "received", "rx_pause_duty": "PFC pause duty received (paused)",
    "tx_pause_duty": "PFC pause duty sent (pausing its peer)", "link_rate_gbps": "link rate",
    "gpu_util_pct": "GPU utilisation", "sm_clock_mhz": "SM clock", "temperature_c": "temperature",
}

# Health roles, worst first: the colour of an entity is that of its worst open role.
SOURCE, DOWNGRADED, STRAGGLER, FAULT, VICTIM, OK = "source", "downgraded", "straggler", "fault", "victim", "ok"
ROLE_ORDER = (SOURCE, DOWNGRADED, STRAGGLER, FAULT, VICTIM, OK)
ROLE_LABEL = {SOURCE: "storm source", DOWNGRADED: "downgraded link", STRAGGLER: "straggler",
              FAULT: "fault", VICTIM: "storm victim", OK: "healthy"}


_BITS_PER_BYTE = 8.0
_NIC_RAIL = re.compile(r"(\d+)(?:/\d+)?$")      # "mlx5_3/1" -> 3: the rail, when no topology says
GPU_INDEX = re.compile(r"^gpu(\d+)$")


@dataclass(frozen=True)
class DashboardLimits:
    """Bounds on everything the dashboard keeps.

    Memory of the series: ``history_points * (4 + 2 * n_metrics) + 8`` bytes per entity plus
    ~150 bytes of index (`SeriesTable.bytes_per_entity`): with 120 points, 1.8 KB per NIC
    port, 1.3 KB per GPU, 1.6 KB per switch port. A 10k-node cluster (80k NIC ports, 80k
    GPUs, ~100k switch ports) then needs ~410 MB; `history_points=60` halves it. Past
    ``max_entities_per_kind`` new entities get no series (counted, still shown by health).
    """

    history_points: int = 120
    max_entities_per_kind: int = 200_000
    max_sources: int = 40_000          # nodes + switches in the topology view
    max_open_anomalies: int = 20_000
    max_resolved_anomalies: int = 500
    max_decisions: int = 2_000
    max_feed_items: int = 1_000
    max_jobs: int = 2_000
    max_ranks_per_job: int = 100_000
    max_ranks: int = 200_000           # all jobs together
    step_history: int = 30             # recent steps kept per rank
    # Per source: ids are the sender's choice, so each source gets a bounded share.
    max_gpus_per_node: int = 64        # GPU ids gpu0 .. gpu63; "gpu20000" once made /api/fabric 27 MB
    max_rails_per_node: int = 64       # NIC ports of one node
    max_ports_per_switch: int = 4_096
    max_layouts_per_source: int = 16   # distinct block layouts whose counters are kept for rates
    source_expiry_s: float = 3_600.0   # a node or switch learnt from telemetry, silent this long, is forgotten

    def __post_init__(self) -> None:
        for name, minimum in (("history_points", 2), ("max_entities_per_kind", 1), ("max_sources", 1),
                              ("max_open_anomalies", 1), ("max_resolved_anomalies", 1), ("max_decisions", 1),
                              ("max_feed_items", 1), ("max_jobs", 1), ("max_ranks_per_job", 1), ("max_ranks", 1),
                              ("step_history", 2), ("max_gpus_per_node", 1), ("max_rails_per_node", 1),
                              ("max_ports_per_switch", 1), ("max_layouts_per_source", 1)):
            value = getattr(self, name)
            if not isinstance(value, int) or value < minimum:
                raise ValueError(f"{name} must be an integer >= {minimum}, got {value!r}")
        if not self.source_expiry_s > 0:
            raise ValueError(f"source_expiry_s must be > 0, got {self.source_expiry_s!r}")



# ------------------------------------------------------------------------ topology
@dataclass
class NodeView:
    name: str
    nics: dict[int, str] = field(default_factory=dict)       # rail -> NIC entity id ("mlx5_3/1")
    gpus: set[int] = field(default_factory=set)
    last_seen_ns: int = 0


@dataclass
class SwitchView:
    name: str
    role: str                                                 # "leaf" | "spine"
    ports: set[str] = field(default_factory=set)
    last_seen_ns: int = 0


@dataclass(frozen=True)
class Health:
    role: str
    severity: str = ""
    anomalies: tuple[str, ...] = ()                           # dedup keys behind the role

    def to_dict(self) -> dict:
        return {"role": self.role, "label": ROLE_LABEL[self.role], "severity": self.severity,
                "anomalies": list(self.anomalies)}


HEALTHY = Health(OK)


def _switch_role(name: str) -> str:
    return "spine" if "spine" in name.lower() else "leaf"




# ------------------------------------------------------------------------ jobs
@dataclass
class RankView:
    rank: int
    node: str
    local_gpu: int
    steps: deque                                              # (step, step_s, busy_s, wait_s)
    last_seen_ns: int = 0


@dataclass
class JobView:
    job_id: str
    world_size: int = 0
    ranks: dict[int, RankView] = field(default_factory=dict)
    last_seen_ns: int = 0
    dropped_ranks: int = 0


# ------------------------------------------------------------------------ the state
class FabricState:
    """Everything the dashboard shows; fed by `add_*`, read by `dashboard.views`.

    Parameters
    ----------
    topology : the fabric from a topology file; None to learn it from the telemetry.
    cluster : show only records of this cluster ("" = all; entity keys then ignore it).
    limits : the bounds of every structure.
    stale_after_s : a node or switch without telemetry for this long is shown as silent.
    """

    def __init__(self, topology: Topology | None = None, cluster: str = "",
                 limits: DashboardLimits = DashboardLimits(), stale_after_s: float = 30.0) -> None:
        if not stale_after_s > 0:
            raise ValueError(f"stale_after_s must be > 0, got {stale_after_s!r}")
        self.topology = topology
        self.cluster = cluster
        self.stale_after_s = stale_after_s
        self.limits = limits
        self.stats: Counter[str] = Counter()
        self.nodes: dict[str, NodeView] = {}
        self.switches: dict[str, SwitchView] = {}
        self._peer: dict[str, str] = {}                       # NIC path <-> leaf port path
        self.series = {kind: SeriesTable(metrics, limits.history_points, limits.max_entities_per_kind)
                       for kind, metrics in METRICS.items()}
        # One RateTracker per source, reset when the source churns through block layouts: the
        # tracker keeps the previous counters of every layout, and layouts hold the sender's ids.
        self._rates: dict[str, RateTracker] = {}
        self._layouts: dict[str, set[tuple]] = {}
        self._from_topology: set[str] = set()
        self._next_expiry_ns = 0
        self._ranks_total = 0
        self.open: dict[str, ev.AnomalyEvent] = {}
        self.resolved: deque[ev.AnomalyEvent] = deque(maxlen=limits.max_resolved_anomalies)
        self.decisions: OrderedDict[str, ev.ActionDecision] = OrderedDict()
        self.jobs: OrderedDict[str, JobView] = OrderedDict()
        self.feed: deque[dict] = deque(maxlen=limits.max_feed_items)
        self._seen_event_ids: OrderedDict[str, None] = OrderedDict()
        self._seq = 0
        self._health: dict[str, Health] | None = None        # cache, dropped on every anomaly change
        self.listeners: list[Callable[[dict], None]] = []
        self.latest_event_ns = 0
        # what the fabric did since the dashboard started reading (`fabricwatch report`'s numbers)
        self.fabric = FabricSummary(topology)
        if topology is not None:
            self._load_topology(topology)

    # -------------------------------------------------------------- topology
    def _limit_hit(self, stat: str, what: str) -> None:
        """Count a refusal of one of `DashboardLimits`, and say so in the log (rate-limited)."""
        self.stats[stat] += 1
        _limited_log.warning("dashboard: %s (%s, %d so far)", what, stat, self.stats[stat])

    def _load_topology(self, topo: Topology) -> None:
        self._from_topology = set(topo.switches) | set(topo.nodes)
        for name, sw in topo.switches.items():
            self.switches[name] = SwitchView(name, sw.role, set(topo.ports_of(name)))
        for name in topo.nodes:
            self.nodes[name] = NodeView(name, gpus=set(range(topo.gpus_per_node)))
        for nic in topo.nic_ports:
            node = self.nodes.setdefault(nic.node, NodeView(nic.node))
            node.nics[nic.rail] = nic.entity_id
            nic_path, port_path = f"{nic.node}/{nic.entity_id}", f"{nic.switch}/{nic.switch_port}"
            self._peer[nic_path], self._peer[port_path] = port_path, nic_path

    def _node(self, name: str) -> NodeView | None:
        node = self.nodes.get(name)
        if node is None:
            if len(self.nodes) + len(self.switches) >= self.limits.max_sources:
                self._limit_hit("sources_over_limit", f"node {name[:64]!r} not shown: "
                                                      f"{self.limits.max_sources} sources already")
                return None
            node = self.nodes[name] = NodeView(name)
        return node

    def _switch(self, name: str) -> SwitchView | None:
        sw = self.switches.get(name)
        if sw is None:
            if len(self.nodes) + len(self.switches) >= self.limits.max_sources:
                self._limit_hit("sources_over_limit", f"switch {name[:64]!r} not shown: "
                                                      f"{self.limits.max_sources} sources already")
                return None
            sw = self.switches[name] = SwitchView(name, _switch_role(name))
        return sw

    def expire(self, now_ns: int) -> int:
        """Forget nodes and switches learnt from telemetry and silent for `source_expiry_s`:
        their series rows, rate state and place in the views. Topology sources stay."""
        cutoff = now_ns - int(self.limits.source_expiry_s * 1e9)
        gone = [name for book in (self.nodes, self.switches) for name, holder in book.items()
                if name not in self._from_topology and holder.last_seen_ns and holder.last_seen_ns < cutoff]
        for name in gone:
            self.nodes.pop(name, None)
            self.switches.pop(name, None)
            self._rates.pop(name, None)
            self._layouts.pop(name, None)
            for table in self.series.values():
                table.forget_prefix(f"{name}/")
        if gone:
            self.stats["sources_expired"] += len(gone)
            log.info("dashboard: forgot %d sources silent for over %g s", len(gone), self.limits.source_expiry_s)
        return len(gone)

    def peer_of(self, path: str) -> str:
        """The other end of a NIC port / leaf port cable ("" when the topology does not say)."""
        return self._peer.get(path, "")

    # -------------------------------------------------------------- telemetry
    def _wants(self, cluster: str) -> bool:
        return not self.cluster or cluster == self.cluster

    def add_snapshot(self, snap: pb.Snapshot) -> bool:
        """One telemetry snapshot of a node or switch; False if it was not used (and why is counted)."""
        if not self._wants(snap.cluster):
            self.stats["other_cluster_records"] += 1
            return False
        if not snap.source:
            self.stats["bad_records:no_source"] += 1
            return False
        is_switch = snap.source_kind == pb.SOURCE_KIND_SWITCH
        holder = self._switch(snap.source) if is_switch else self._node(snap.source)
        if holder is None:
            return False
        if snap.time_unix_ns <= holder.last_seen_ns:
            self.stats["stale_snapshots"] += 1     # redelivered or out of order: rates would be wrong
            return False
        holder.last_seen_ns = snap.time_unix_ns
        self.latest_event_ns = max(self.latest_event_ns, snap.time_unix_ns)
        if snap.time_unix_ns >= self._next_expiry_ns:       # at most once a minute of event time
            self._next_expiry_ns = snap.time_unix_ns + 60 * 10**9
            self.expire(snap.time_unix_ns)
        for block in snap.blocks:
            n, m, k = len(block.entity_ids), len(block.counter_names), len(block.gauge_names)
            if n == 0 or len(block.counters) != n * m or len(block.gauges) != n * k:
                self.stats["bad_blocks"] += 1
                continue
            frame = EntityFrame(
                kind={pb.ENTITY_KIND_GPU: GPU, pb.ENTITY_KIND_NIC_PORT: NIC_PORT,
                      pb.ENTITY_KIND_SWITCH_PORT: SWITCH_PORT}.get(block.entity_kind, ""),
                ids=tuple(block.entity_ids), counter_names=tuple(block.counter_names),
                counters=np.array(block.counters, dtype=np.uint64).reshape(n, m),
                gauge_names=tuple(block.gauge_names),
                gauges=np.array(block.gauges, dtype=np.float64).reshape(n, k),
                labels={c.name: list(c.values) for c in block.labels if len(c.values) == n})
            if frame.kind == NIC_PORT and not is_switch:
                self._nic_frame(holder, frame, snap.time_unix_ns)
            elif frame.kind == GPU and not is_switch:
                self._gpu_frame(holder, frame, snap.time_unix_ns)
            elif frame.kind == SWITCH_PORT and is_switch:
                self._switch_frame(holder, frame, snap.time_unix_ns)
            else:
                self.stats["unused_blocks"] += 1
        self.stats["snapshots"] += 1
        return True

    def _rates_of(self, source: str, frame: EntityFrame, names: list[str], time_ns: int) -> np.ndarray:
        """Per-second rates of `names` (NaN columns for absent ones), from a frame of only those."""
        present = [c for c in names if frame.column(c) is not None]
        out = np.full((len(frame.ids), len(names)), np.nan)
        if not present:
            return out
        # Track only the columns we chart: a node's full counter set would cost ~10x the memory.
        small = EntityFrame(frame.kind, frame.ids, tuple(present),
                            frame.counters[:, [frame.column(c) for c in present]], (), np.empty((len(frame.ids), 0)),
                            {})
        self._tracker(source, (frame.kind, frame.ids, tuple(present))).update(source, small, time_ns)
        for j, name in enumerate(present):
            out[:, names.index(name)] = small.rates[:, j]
        return out

    def _tracker(self, source: str, layout: tuple) -> RateTracker:
        layouts = self._layouts.setdefault(source, set())
        if layout not in layouts and len(layouts) >= self.limits.max_layouts_per_source:
            self._limit_hit("rate_state_resets", f"{source[:64]}: over {self.limits.max_layouts_per_source} "
                                                 "block layouts; its rate state starts over")
            layouts.clear()
            self._rates.pop(source, None)
        layouts.add(layout)
        tracker = self._rates.get(source)
        if tracker is None:
            tracker = self._rates[source] = RateTracker()
        return tracker

    def _bounded(self, frame: EntityFrame, keep: list[int]) -> EntityFrame:
        """The frame's entities at `keep` only (the others are over a per-source limit)."""
        if len(keep) == len(frame.ids):
            return frame
        return EntityFrame(frame.kind, tuple(frame.ids[i] for i in keep), frame.counter_names, frame.counters[keep],
                           frame.gauge_names, frame.gauges[keep],
                           {name: [values[i] for i in keep] for name, values in frame.labels.items()})

    def _nic_frame(self, node: NodeView, frame: EntityFrame, time_ns: int) -> None:
        keep = []
        for i, eid in enumerate(frame.ids):
            if eid not in node.nics.values():
                if len(node.nics) >= self.limits.max_rails_per_node:
                    continue
                m = _NIC_RAIL.search(eid.split("/")[0])
                rail = min(int(m.group(1)) if m else i, self.limits.max_rails_per_node - 1)
                while rail in node.nics:                      # a rail taken by another id: next free slot
                    rail = (rail + 1) % self.limits.max_rails_per_node
                node.nics[rail] = eid
            keep.append(i)
        if len(keep) < len(frame.ids):
            self._limit_hit("nic_ports_over_limit", f"{node.name[:64]}: {len(frame.ids) - len(keep)} NIC ports "
                                                    f"past {self.limits.max_rails_per_node} rails not shown")
        frame = self._bounded(frame, keep)
        self._nic_series(node, frame, time_ns)

    def _nic_series(self, node: NodeView, frame: EntityFrame, time_ns: int) -> None:
        prios = range(8)
        names = (["port_xmit_data", "port_rcv_data"] + [f"rx_prio{p}_pause_duration" for p in prios]
                 + [f"tx_prio{p}_pause_duration" for p in prios])
        r = self._rates_of(node.name, frame, names, time_ns)
        tx_gbps, rx_gbps = r[:, 0] * _BITS_PER_BYTE / 1e9, r[:, 1] * _BITS_PER_BYTE / 1e9
        rx_duty = np.fmax.reduce(r[:, 2:10], axis=1)          # the most-paused priority; NaN if none known
        tx_duty = np.fmax.reduce(r[:, 10:18], axis=1)
        rate_gbps = np.array([(parse_ib_rate(s).gbps if parse_ib_rate(s) else np.nan) for s in frame.label("rate")])
        speed_mbps = frame.gauge("netdev_speed_mbps")
        rate_gbps = np.where(np.isnan(rate_gbps) & (speed_mbps > 0), speed_mbps / 1000.0, rate_gbps)
        keys = [f"{node.name}/{eid}" for eid in frame.ids]
        self.series[NIC_PORT].append(keys, time_ns, np.column_stack([tx_gbps, rx_gbps, rx_duty, tx_duty, rate_gbps]))

    def _gpu_frame(self, node: NodeView, frame: EntityFrame, time_ns: int) -> None:
        keep = []
        for i, eid in enumerate(frame.ids):
            m = GPU_INDEX.match(eid)
            if m and int(m.group(1)) < self.limits.max_gpus_per_node:
                node.gpus.add(int(m.group(1)))
                keep.append(i)
        if len(keep) < len(frame.ids):
            self._limit_hit("gpus_over_limit", f"{node.name[:64]}: {len(frame.ids) - len(keep)} GPU ids not gpu0.."
                                               f"gpu{self.limits.max_gpus_per_node - 1}, not shown")
        frame = self._bounded(frame, keep)
        values = np.column_stack([frame.gauge("utilization_gpu_pct"), frame.gauge("sm_clock_mhz"),
                                  frame.gauge("temperature_c")])
        self.series[GPU].append([f"{node.name}/{eid}" for eid in frame.ids], time_ns, values)

    def _switch_frame(self, sw: SwitchView, frame: EntityFrame, time_ns: int) -> None:
        prios = range(8)
        names = ["out-octets", "in-octets"] + [f"pfc{p}-rx-pause-duration-us" for p in prios]
        keep = []
        for i, port in enumerate(frame.ids):
            if port not in sw.ports and len(sw.ports) >= self.limits.max_ports_per_switch:
                continue
            sw.ports.add(port)
            keep.append(i)
        if len(keep) < len(frame.ids):
            self._limit_hit("switch_ports_over_limit", f"{sw.name[:64]}: {len(frame.ids) - len(keep)} ports past "
                                                       f"{self.limits.max_ports_per_switch} not shown")
        frame = self._bounded(frame, keep)
        r = self._rates_of(sw.name, frame, names, time_ns)
        values = np.column_stack([r[:, 0] * _BITS_PER_BYTE / 1e9, r[:, 1] * _BITS_PER_BYTE / 1e9,
                                  np.fmax.reduce(r[:, 2:10], axis=1), frame.gauge("port_speed_gbps")])
        self.series[SWITCH_PORT].append([f"{sw.name}/{p}" for p in frame.ids], time_ns, values)

    # -------------------------------------------------------------- rank steps
    def add_rank_steps(self, snap: pb.Snapshot) -> bool:
        """A rank-steps record (a `Snapshot` carrying only `rank_steps`)."""
        if not self._wants(snap.cluster):
            self.stats["other_cluster_records"] += 1
            return False
        used = 0
        for rs in snap.rank_steps:
            if not rs.job_id:
                self.stats["bad_rank_steps"] += 1
                continue
            job = self.jobs.get(rs.job_id)
            if job is None:
                if len(self.jobs) >= self.limits.max_jobs:   # forget the job not heard from longest
                    oldest = min(self.jobs.values(), key=lambda j: j.last_seen_ns)
                    del self.jobs[oldest.job_id]
                    self._ranks_total -= len(oldest.ranks)
                    self._limit_hit("jobs_evicted", f"{self.limits.max_jobs} jobs: forgot {oldest.job_id[:64]}")
                job = self.jobs[rs.job_id] = JobView(rs.job_id)
            job.world_size = max(job.world_size, rs.world_size)
            end_ns = rs.start_unix_ns + int(rs.step_seconds * 1e9)
            job.last_seen_ns = max(job.last_seen_ns, end_ns)
            rank = job.ranks.get(rs.rank)
            if rank is None:
                if len(job.ranks) >= self.limits.max_ranks_per_job or self._ranks_total >= self.limits.max_ranks:
                    job.dropped_ranks += 1
                    self._limit_hit("ranks_over_limit", f"job {rs.job_id[:64]}: rank {rs.rank} not shown "
                                                        "(ranks per job or in all over the limit)")
                    continue
                rank = job.ranks[rs.rank] = RankView(rs.rank, rs.node, rs.local_gpu,
                                                     deque(maxlen=self.limits.step_history))
                self._ranks_total += 1
            if rank.steps and rs.step <= rank.steps[-1][0]:
                self.stats["stale_rank_steps"] += 1
                continue
            rank.node, rank.local_gpu, rank.last_seen_ns = rs.node, rs.local_gpu, end_ns
            rank.steps.append((int(rs.step), float(rs.step_seconds), float(rs.busy_seconds),
                               float(rs.collective_wait_seconds)))
            used += 1
        self.stats["rank_steps"] += used
        return used > 0

    # -------------------------------------------------------------- anomalies
    def add_anomaly(self, event: ev.AnomalyEvent) -> bool:
        """One anomaly event; False if it is a duplicate, stale or of another cluster."""
        if not self._wants(event.entity.cluster):
            self.stats["other_cluster_records"] += 1
            return False
        if not event.dedup_key:
            self.stats["bad_records:anomaly_without_dedup_key"] += 1
            return False
        if event.id and event.id in self._seen_event_ids:
            self.stats["duplicate_anomaly_events"] += 1
            return False
        current = self.open.get(event.dedup_key)
        if current is not None and event.detected_unix_ns < current.detected_unix_ns:
            self.stats["stale_anomaly_events"] += 1
            return False
        self._remember(event.id)
        if event.lifecycle == ev.LIFECYCLE_RESOLVED:
            self.open.pop(event.dedup_key, None)
            self.resolved.append(event)
        else:
            if current is None and len(self.open) >= self.limits.max_open_anomalies:
                oldest = min(self.open.values(), key=lambda e: e.detected_unix_ns)
                del self.open[oldest.dedup_key]
                self._limit_hit("open_anomalies_evicted", f"{self.limits.max_open_anomalies} open anomalies: "
                                                          "the oldest not shown any more")
            self.open[event.dedup_key] = event
        self._health = None
        self.stats["anomaly_events"] += 1
        self._publish("anomaly", anomaly_dict(event))
        return True

    def _remember(self, event_id: str) -> None:
        if not event_id:
            return
        self._seen_event_ids[event_id] = None
        while len(self._seen_event_ids) > 4 * self.limits.max_feed_items:
            self._seen_event_ids.popitem(last=False)

    def add_decision(self, decision: ev.ActionDecision) -> bool:
        """An action decision from the actions or audit topic (each decision may come from both)."""
        if not self._wants(decision.target.cluster):
            self.stats["other_cluster_records"] += 1
            return False
        key = f"{decision.idempotency_key}|{decision.outcome}|{decision.decided_unix_ns}"
        if key in self.decisions:
            self.stats["duplicate_decisions"] += 1
            return False
        self.decisions[key] = decision
        while len(self.decisions) > self.limits.max_decisions:
            self.decisions.popitem(last=False)
        self.stats["decisions"] += 1
        self._publish("decision", decision_dict(decision))
        return True

    def _publish(self, kind: str, data: dict) -> None:
        self._seq += 1
        item = {"seq": self._seq, "type": kind, "data": data}
        self.feed.append(item)
        for listener in list(self.listeners):
            listener(item)

    # -------------------------------------------------------------- health
    def roles(self) -> dict[str, Health]:
        """The health of every entity an open anomaly names (and of their nodes and switches)."""
        if self._health is not None:
            return self._health
        marks: dict[str, list[tuple[str, int, str]]] = {}

        def mark(path: str, role: str, event: ev.AnomalyEvent) -> None:
            if path:
                marks.setdefault(path, []).append((role, event.severity, event.dedup_key))

        for event in self.open.values():
            main = entity_path(event.entity)
            if event.kind == PFC_STORM:
                mark(main, SOURCE, event)
                for r in event.related:
                    mark(entity_path(r), VICTIM, event)
            elif event.kind in (LINK_DOWNGRADE, PCIE_DOWNGRADE):
                mark(main, DOWNGRADED, event)
            elif event.kind == STRAGGLER_KIND:
                mark(main, STRAGGLER, event)
                if event.entity.job and event.entity.rank:
                    mark(rank_path(event.entity.job, event.entity.rank), STRAGGLER, event)
            else:
                mark(main, FAULT, event)
        # Roll up: a node or switch shows the worst of its own and its parts' roles.
        for path in list(marks):
            parts = path.split("/")
            if not path.startswith(JOB_KEY) and len(parts) > 1:
                for role, sev, key in marks[path]:
                    marks.setdefault(parts[0], []).append((role, sev, key))
        health = {}
        for path, found in marks.items():
            worst = min(ROLE_ORDER.index(r) for r, _, _ in found)
            keys = tuple(dict.fromkeys(k for r, _, k in found if ROLE_ORDER.index(r) == worst))
            sev = max(s for r, s, _ in found if ROLE_ORDER.index(r) == worst)
            health[path] = Health(ROLE_ORDER[worst], SEVERITY_NAME.get(sev, ""), keys)
        self._health = health
        return health

    def health(self, path: str) -> Health:
        return self.roles().get(path, HEALTHY)

    def silent(self, source: str, now_ns: int) -> bool:
        """A node or switch whose last telemetry is older than `stale_after_s` (or that never reported)."""
        holder = self.nodes.get(source) or self.switches.get(source)
        return holder is None or not holder.last_seen_ns or now_ns - holder.last_seen_ns > self.stale_after_s * 1e9

    def memory_bytes(self) -> int:
        """Bytes of the series arrays (the part that grows with the cluster)."""
        return sum(t.nbytes() for t in self.series.values())

