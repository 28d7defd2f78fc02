"""The dashboard's picture of the fabric: a bounded in-memory model fed record by record.

Pure: no Kafka, no HTTP. `dashboard.feed` hands it decoded records; `dashboard.server`
reads it. It holds

* the topology: nodes with their NIC ports by rail and their GPUs, leaf and spine switches
  with their ports; from a topology file when given, else learnt from the telemetry;
* per entity (NIC port, GPU, switch port) a ring buffer of a few derived values, so an
  entity page can draw its recent history (`SeriesTable`);
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

import heapq
import logging
import re
from collections import Counter, OrderedDict, deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import numpy as np

from fabricwatch.lograte import RateLimitedLogger
from fabricwatch.models.fabric_summary import FabricSummary
from fabricwatch.models.frames import EntityFrame
from fabricwatch.models.impact import projected_gpu_hours
from fabricwatch.models.linkrate import parse_ib_rate
from fabricwatch.models.rates import RateTracker
from fabricwatch.models.topology import Topology
from fabricwatch.protos.v1 import events_pb2 as ev
from fabricwatch.protos.v1 import telemetry_pb2 as pb

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

SEVERITY_NAME = {ev.SEVERITY_UNSPECIFIED: "unspecified", ev.SEVERITY_INFO: "info",
                 ev.SEVERITY_WARNING: "warning", ev.SEVERITY_CRITICAL: "critical"}
LIFECYCLE_NAME = {ev.LIFECYCLE_UNSPECIFIED: "unspecified", ev.LIFECYCLE_OPEN: "open",
                  ev.LIFECYCLE_UPDATE: "update", ev.LIFECYCLE_RESOLVED: "resolved"}
OUTCOME_NAME = {v.number: v.name.removeprefix("OUTCOME_").lower() for v in ev.Outcome.DESCRIPTOR.values}

# What one API answer may hold: every list an answer carries is capped, with its total.
MAX_FABRIC_CELLS = 65_536          # node rows x (rails + GPUs) of one /api/fabric page
MAX_SWITCHES_SHOWN = 2_048
MAX_OPEN_SHOWN = 200               # open anomalies listed with the fabric view (most severe, newest first)
MAX_RELATED_SHOWN = 64             # related entities of one anomaly (a storm's victims)
MAX_EVIDENCE_SHOWN = 32
MAX_ENTITY_ANOMALIES = 200
MAX_ENTITY_DECISIONS = 200
MAX_CHILDREN_SHOWN = 4_096
MAX_RANKS_SHOWN = 1_024            # per job in /api/jobs (stragglers first)
MAX_JOBS_SHOWN = 500

_BITS_PER_BYTE = 8.0
_NIC_RAIL = re.compile(r"(\d+)(?:/\d+)?$")      # "mlx5_3/1" -> 3: the rail, when no topology says
_GPU_INDEX = re.compile(r"^gpu(\d+)$")
_TIME_UNIT_NS = 100_000_000                      # series times are kept in deciseconds


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


# ------------------------------------------------------------------------ paths
def entity_path(p: ev.EntityPath) -> str:
    """The dashboard's key of an entity: "node/device/port", "switch/port", or "job/<id>/rank/<r>".

    The cluster is left out: one dashboard shows one cluster (`FabricState(cluster=...)`).

    >>> entity_path(ev.EntityPath(cluster="c", node="n1", device="mlx5_0", port="1"))
    'n1/mlx5_0/1'
    >>> entity_path(ev.EntityPath(switch="leaf-0", port="Ethernet8")), entity_path(ev.EntityPath(job="j", rank="3"))
    ('leaf-0/Ethernet8', 'job/j/rank/3')
    """
    base = p.switch or p.node
    if base:
        return "/".join(x for x in (base, p.device, p.port) if x)
    if p.job:
        return f"job/{p.job}/rank/{p.rank}" if p.rank else f"job/{p.job}"
    return ""


def rank_path(job: str, rank: int | str) -> str:
    return f"job/{job}/rank/{rank}"


def _finite(x: float) -> float | None:
    return float(x) if x == x and x not in (float("inf"), float("-inf")) else None


# ------------------------------------------------------------------------ series
class SeriesTable:
    """Ring buffers of recent values for all entities of one kind, in one preallocated block.

    Values are float16 (3 significant digits: enough for a chart, half the memory of
    float32), times int32 deciseconds since the table's first sample (±6.8 years).

    >>> t = SeriesTable(("a", "b"), capacity_points=3, max_entities=2)
    >>> for i in range(5):
    ...     t.append(["x"], 1_000_000_000 * i, np.array([[i, 10 * i]], dtype=float))
    >>> s = t.series("x")
    >>> s["t_ms"], s["a"], s["b"]
    ([2000, 3000, 4000], [2.0, 3.0, 4.0], [20.0, 30.0, 40.0])
    >>> t.append(["y", "z"], 0, np.zeros((2, 2))); t.dropped_entities   # z is past the bound
    1
    >>> t.bytes_per_entity()          # 3 points x (4-byte time + 2 x 2-byte values) + 8
    32
    """

    def __init__(self, metrics: tuple[str, ...], capacity_points: int, max_entities: int) -> None:
        self.metrics = metrics
        self.capacity_points = capacity_points
        self.max_entities = max_entities
        self.dropped_entities = 0
        self._rows: dict[str, int] = {}
        self._free: list[int] = []                 # rows of forgotten entities, reused first
        self._epoch_ns: int | None = None
        self._alloc(0)

    def _alloc(self, n: int) -> None:
        c, m = self.capacity_points, len(self.metrics)
        times = np.zeros((n, c), dtype=np.int32)
        values = np.full((n, c, m), np.nan, dtype=np.float16)
        written = np.zeros(n, dtype=np.int64)
        if n and len(self._rows):
            k = self._times.shape[0]
            times[:k], values[:k], written[:k] = self._times, self._values, self._written
        self._times, self._values, self._written = times, values, written

    def bytes_per_entity(self) -> int:
        """Array bytes per entity (the index adds ~150 bytes: dict slot and key string)."""
        return self.capacity_points * (4 + 2 * len(self.metrics)) + 8

    def nbytes(self) -> int:
        return self._times.nbytes + self._values.nbytes + self._written.nbytes

    def __len__(self) -> int:
        return len(self._rows)

    def __contains__(self, key: str) -> bool:
        return key in self._rows

    def _row(self, key: str) -> int:
        row = self._rows.get(key)
        if row is not None:
            return row
        if len(self._rows) >= self.max_entities:
            self.dropped_entities += 1
            return -1
        if self._free:
            row = self._free.pop()
            self._written[row] = 0
            self._values[row] = np.nan
        else:
            row = len(self._rows)
            if row >= self._times.shape[0]:
                self._alloc(min(self.max_entities, max(16, 2 * row)))
        self._rows[key] = row
        return row

    def forget_prefix(self, prefix: str) -> int:
        """Drop every entity whose key starts with `prefix` (a forgotten source); their rows are reused."""
        gone = [k for k in self._rows if k.startswith(prefix)]
        for key in gone:
            self._free.append(self._rows.pop(key))
        return len(gone)

    def append(self, keys: Iterable[str], time_ns: int, values: np.ndarray) -> None:
        """One sample for each key (values: [len(keys), n_metrics]) at event time `time_ns`."""
        rows = np.array([self._row(k) for k in keys], dtype=np.int64)
        keep = rows >= 0
        if not keep.any():
            return
        rows, values = rows[keep], np.asarray(values, dtype=np.float64)[keep]
        if self._epoch_ns is None:
            self._epoch_ns = time_ns
        slots = self._written[rows] % self.capacity_points
        self._times[rows, slots] = (time_ns - self._epoch_ns) // _TIME_UNIT_NS
        with np.errstate(over="ignore"):   # beyond float16's range reads as inf: shown as a gap
            self._values[rows, slots, :] = values
        self._written[rows] += 1

    def _ordered(self, key: str) -> tuple[np.ndarray, np.ndarray] | None:
        row = self._rows.get(key)
        if row is None:
            return None
        n = int(min(self._written[row], self.capacity_points))
        start = int(self._written[row] - n) % self.capacity_points
        order = (start + np.arange(n)) % self.capacity_points
        return self._times[row, order], self._values[row, order, :]

    def series(self, key: str) -> dict[str, list] | None:
        """Oldest first: ``t_ms`` (unix ms) and one list per metric (None where unknown)."""
        got = self._ordered(key)
        if got is None:
            return None
        times, values = got
        out: dict[str, list] = {"t_ms": [int((self._epoch_ns + int(t) * _TIME_UNIT_NS) // 1_000_000)
                                         for t in times]}
        for j, name in enumerate(self.metrics):
            out[name] = [_finite(float(v)) for v in values[:, j]]
        return out

    def latest(self, key: str) -> dict[str, float | None]:
        got = self._ordered(key)
        if got is None or not len(got[0]):
            return {}
        return {name: _finite(float(got[1][-1, j])) for j, name in enumerate(self.metrics)}


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


def _natural_key(name: str) -> list:
    return [int(t) if t.isdigit() else t for t in re.split(r"(\d+)", name)]


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
    """Everything the dashboard shows; fed by `add_*`, read by the `*_view` methods.

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
            m = _GPU_INDEX.match(eid)
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
    def _roles(self) -> dict[str, Health]:
        if self._health is not None:
            return self._health
        marks: dict[str, list[tuple[str, int, str]]] = {}

        def mark(path: str, role: str, event: ev.AnomalyEvent) -> None:
            if path:
                marks.setdefault(path, []).append((role, event.severity, event.dedup_key))

        for event in self.open.values():
            main = entity_path(event.entity)
            if event.kind.startswith("pfc_storm"):
                mark(main, SOURCE, event)
                for r in event.related:
                    mark(entity_path(r), VICTIM, event)
            elif "downgrade" in event.kind:
                mark(main, DOWNGRADED, event)
            elif event.kind == "straggler":
                mark(main, STRAGGLER, event)
                if event.entity.job and event.entity.rank:
                    mark(rank_path(event.entity.job, event.entity.rank), STRAGGLER, event)
            else:
                mark(main, FAULT, event)
        # Roll up: a node or switch shows the worst of its own and its parts' roles.
        for path in list(marks):
            parts = path.split("/")
            if parts[0] != "job" and len(parts) > 1:
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
        return self._roles().get(path, HEALTHY)

    def silent(self, source: str, now_ns: int) -> bool:
        """A node or switch whose last telemetry is older than `stale_after_s` (or that never reported)."""
        holder = self.nodes.get(source) or self.switches.get(source)
        return holder is None or not holder.last_seen_ns or now_ns - holder.last_seen_ns > self.stale_after_s * 1e9

    # -------------------------------------------------------------- views (JSON-ready)
    def fabric_view(self, now_ns: int, problems_only: bool = False,
                    offset: int = 0, limit: int = 512) -> dict:
        """The heat map: nodes x NIC rails (and GPUs), leaf and spine switches, with health."""
        roles = self._roles()
        rails = sorted({r for n in self.nodes.values() for r in n.nics})
        n_gpus = max((max(n.gpus) + 1 for n in self.nodes.values() if n.gpus), default=0)
        names = sorted(self.nodes, key=_natural_key) if self.topology is None else list(self.nodes)
        if problems_only:
            names = [n for n in names if n in roles or self.silent(n, now_ns)]
        limit = max(1, min(limit, MAX_FABRIC_CELLS // max(1, len(rails) + n_gpus)))
        rows = []
        for name in names[offset:offset + limit]:
            node = self.nodes[name]
            nic_cells = []
            for rail in rails:
                eid = node.nics.get(rail)
                path = f"{name}/{eid}" if eid else ""
                latest = self.series[NIC_PORT].latest(path) if path else {}
                nic_cells.append({"rail": rail, "id": eid or "", "path": path,
                                  "health": roles.get(path, HEALTHY).to_dict() if path else None,
                                  "tx_gbps": latest.get("tx_gbps"), "link_rate_gbps": latest.get("link_rate_gbps"),
                                  "peer": self._peer.get(path, "")})
            gpu_cells = []
            for g in range(n_gpus):
                path = f"{name}/gpu{g}"
                latest = self.series[GPU].latest(path) if g in node.gpus else {}
                gpu_cells.append({"index": g, "path": path if g in node.gpus else "",
                                  "health": roles.get(path, HEALTHY).to_dict() if g in node.gpus else None,
                                  "gpu_util_pct": latest.get("gpu_util_pct")})
            rows.append({"node": name, "health": roles.get(name, HEALTHY).to_dict(),
                         "silent": self.silent(name, now_ns), "nics": nic_cells, "gpus": gpu_cells})
        switches = []
        for name in sorted(self.switches, key=_natural_key)[:MAX_SWITCHES_SHOWN]:
            sw = self.switches[name]
            switches.append({"name": name, "role": sw.role, "ports": len(sw.ports),
                             "health": roles.get(name, HEALTHY).to_dict(),
                             "silent": self.silent(name, now_ns)})
        return {"rails": rails, "gpus": n_gpus, "nodes_total": len(names), "offset": offset, "limit": limit,
                "rows": rows, "switches": switches, "switches_total": len(self.switches),
                "open_anomalies": self.open_summary(now_ns=now_ns), "open_total": len(self.open),
                "topology_source": "file" if self.topology is not None else "telemetry"}

    def open_summary(self, limit: int = MAX_OPEN_SHOWN, now_ns: int | None = None) -> list[dict]:
        """The open anomalies that cost the most first (GPU-hours lost by ``now_ns``: what each one's
        latest event said plus its rate since), then the most severe, newest; at most `limit`.
        Without ``now_ns``: as of the newest event shown."""
        if now_ns is None:
            now_ns = max((e.detected_unix_ns for e in self.open.values()), default=0)

        def cost(e: ev.AnomalyEvent) -> float:
            return projected_gpu_hours(e.impact_gpu_hours, e.impact_gpu_hours_per_hour, e.detected_unix_ns, now_ns)

        ranked = heapq.nsmallest(limit, ((-cost(e), -e.severity, -e.detected_unix_ns, e.dedup_key, e)
                                         for e in self.open.values()), key=lambda t: t[:4])
        return [{**anomaly_dict(e), "impact_gpu_hours_now": round(-c, 6)} for c, _, _, _, e in ranked]

    def entity_kind(self, path: str) -> str:
        parts = path.split("/")
        if parts[0] == "job":
            return RANK
        if len(parts) == 1:
            return SWITCH if path in self.switches else NODE if path in self.nodes else self._kind_from_anomalies(path)
        for kind in (NIC_PORT, GPU, SWITCH_PORT):
            if path in self.series[kind]:
                return kind
        if parts[0] in self.switches:
            return SWITCH_PORT
        if parts[0] in self.nodes:
            return GPU if _GPU_INDEX.match(parts[1]) else NIC_PORT
        return self._kind_from_anomalies(path)

    def _kind_from_anomalies(self, path: str) -> str:
        """An entity known only because an anomaly or decision names it (or one of its parts)."""
        named = [p for e in list(self.open.values()) + list(self.resolved) for p in (e.entity, *e.related)]
        named += [d.target for d in self.decisions.values()]
        for p in named:
            ep = entity_path(p)
            if ep == path:
                if p.switch:
                    return SWITCH_PORT if p.port else SWITCH
                if _GPU_INDEX.match(p.device):
                    return GPU
                return NIC_PORT if p.device else NODE
            if "/" not in path and not path == "job" and ep.startswith(path + "/"):
                return SWITCH if p.switch else NODE
        return ""

    def _touches(self, event: ev.AnomalyEvent, path: str) -> str:
        """How an anomaly concerns an entity: "entity", "related" or "" (also for their parts)."""
        main = entity_path(event.entity)
        if main == path or main.startswith(path + "/"):
            return "entity"
        for r in event.related:
            rp = entity_path(r)
            if rp == path or rp.startswith(path + "/"):
                return "related"
        if path.startswith("job/") and event.entity.job and rank_path(event.entity.job, event.entity.rank) == path:
            return "entity"
        return ""

    def entity_view(self, path: str, now_ns: int) -> dict | None:
        """An entity page: what it is, its series, the anomalies on it and the decisions about it."""
        kind = self.entity_kind(path)
        if not kind:
            return None
        out: dict = {"path": path, "kind": kind, "health": self.health(path).to_dict(),
                     "peer": self._peer.get(path, ""), "parent": path.split("/")[0] if "/" in path else ""}
        if kind in METRICS:
            out["series"] = self.series[kind].series(path) or {"t_ms": []}
            out["metrics"] = [{"name": m, "unit": METRIC_UNITS[m], "title": METRIC_TITLES[m]} for m in METRICS[kind]]
        node = self.nodes.get(path) if kind == NODE else None
        if node is not None:
            out["children"] = ([{"path": f"{path}/{eid}", "label": f"rail {rail}: {eid}",
                                 "health": self.health(f"{path}/{eid}").to_dict()}
                                for rail, eid in sorted(node.nics.items())]
                               + [{"path": f"{path}/gpu{g}", "label": f"gpu{g}",
                                   "health": self.health(f"{path}/gpu{g}").to_dict()} for g in sorted(node.gpus)])
            out["silent"] = self.silent(path, now_ns)
        sw = self.switches.get(path) if kind == SWITCH else None
        if sw is not None:
            out["role"] = sw.role
            out["children"] = [{"path": f"{path}/{p}", "label": p + (f" → {self._peer[f'{path}/{p}']}"
                                                                      if f"{path}/{p}" in self._peer else ""),
                                "health": self.health(f"{path}/{p}").to_dict()}
                               for p in sorted(sw.ports, key=_natural_key)]
            out["silent"] = self.silent(path, now_ns)
        anomalies = []
        for event in list(self.open.values()) + list(self.resolved):
            how = self._touches(event, path)
            if how:
                anomalies.append({**anomaly_dict(event), "relation": how})
        anomalies.sort(key=lambda a: (a["lifecycle"] == "resolved", -a["detected_unix_ms"]))
        out["anomalies"], out["anomalies_total"] = anomalies[:MAX_ENTITY_ANOMALIES], len(anomalies)
        keys = {a["dedup_key"] for a in anomalies}
        decisions = [d for d in reversed(self.decisions.values())
                     if d.anomaly_dedup_key in keys or entity_path(d.target) == path
                     or entity_path(d.target).startswith(path + "/")]
        out["decisions"] = [decision_dict(d) for d in decisions[:MAX_ENTITY_DECISIONS]]
        out["decisions_total"] = len(decisions)
        if len(out.get("children", ())) > MAX_CHILDREN_SHOWN:
            out["children_total"] = len(out["children"])
            out["children"] = out["children"][:MAX_CHILDREN_SHOWN]
        return out

    def jobs_view(self, limit: int = MAX_JOBS_SHOWN) -> list[dict]:
        """Each job's ranks with recent step times, stragglers marked with their probable cause.

        At most `limit` jobs (most recently heard from), and per job at most
        MAX_RANKS_SHOWN ranks, its stragglers first; ``ranks_seen`` tells how many there are.
        """
        stragglers: dict[tuple[str, str], ev.AnomalyEvent] = {
            (e.entity.job, e.entity.rank): e for e in self.open.values() if e.kind == "straggler"}
        out = []
        shown = heapq.nlargest(limit, self.jobs.values(), key=lambda j: j.last_seen_ns)
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

    def nodes_of_job(self, job_id: str) -> set[str]:
        job = self.jobs.get(job_id)
        return {r.node for r in job.ranks.values()} if job else set()

    def feed_view(self, flt: FeedFilter, limit: int = 200) -> list[dict]:
        """The latest feed items (anomalies and decisions) that pass the filter, newest event time first.

        Arrival order is not time order: at start the look-back replays several topics and
        partitions one after another.
        """
        out = []
        for item in reversed(self.feed):
            if flt.matches(item, self):
                out.append(item)
                if len(out) >= limit:
                    break
        out.sort(key=lambda i: (i["data"].get("detected_unix_ms") or i["data"].get("decided_unix_ms", 0), i["seq"]),
                 reverse=True)
        return out

    def memory_bytes(self) -> int:
        """Bytes of the series arrays (the part that grows with the cluster)."""
        return sum(t.nbytes() for t in self.series.values())


# ------------------------------------------------------------------------ JSON shapes
def _path_dict(p: ev.EntityPath) -> dict:
    return {"path": entity_path(p), "cluster": p.cluster, "switch": p.switch, "node": p.node,
            "device": p.device, "port": p.port, "rank": p.rank, "job": p.job}


def anomaly_dict(e: ev.AnomalyEvent) -> dict:
    return {
        "id": e.id, "dedup_key": e.dedup_key, "kind": e.kind,
        "severity": SEVERITY_NAME.get(e.severity, "unspecified"),
        "lifecycle": LIFECYCLE_NAME.get(e.lifecycle, "unspecified"),
        "entity": _path_dict(e.entity), "related": [_path_dict(r) for r in e.related[:MAX_RELATED_SHOWN]],
        "related_total": len(e.related),
        "onset_unix_ms": e.onset_unix_ns // 1_000_000, "detected_unix_ms": e.detected_unix_ns // 1_000_000,
        "evidence": [{"name": x.name, "value": _finite(x.value), "threshold": _finite(x.threshold),
                      "unit": x.unit, "detail": x.detail} for x in e.evidence[:MAX_EVIDENCE_SHOWN]],
        "confidence": _finite(e.confidence), "probable_cause": e.probable_cause,
        "cause_code": getattr(e, "cause_code", ""), "suggested_action": e.suggested_action,
        "summary": e.summary, "detector": e.detector,
        "impact_gpu_hours": _finite(e.impact_gpu_hours),
        "impact_gpu_hours_per_hour": _finite(e.impact_gpu_hours_per_hour),
        "impact_basis": e.impact_basis,
    }


def decision_dict(d: ev.ActionDecision) -> dict:
    outcome = OUTCOME_NAME.get(d.outcome, str(d.outcome))
    return {
        "idempotency_key": d.idempotency_key, "anomaly_id": d.anomaly_id, "anomaly_dedup_key": d.anomaly_dedup_key,
        "anomaly_kind": d.anomaly_kind, "rule": d.rule, "action": d.action, "target": _path_dict(d.target),
        "outcome": outcome, "reason": d.reason, "executor": d.executor,
        "decided_unix_ms": d.decided_unix_ns // 1_000_000, "detail": d.detail,
        # Shadow mode: the policy matched but execution is off; on-call sees "would have".
        "would_have": bool(d.shadow or d.outcome == ev.OUTCOME_SHADOW),
    }


# ------------------------------------------------------------------------ feed filters
SEVERITY_RANK = {"info": 1, "warning": 2, "critical": 3}


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
        if severity and severity not in SEVERITY_RANK:
            raise ValueError(f"severity must be one of {', '.join(SEVERITY_RANK)} (got {severity!r})")
        return cls(kind=str(query.get("kind", "")).strip(), min_severity=severity,
                   job=str(query.get("job", "")).strip(), switch=str(query.get("switch", "")).strip())

    def matches(self, item: dict, state: FabricState) -> bool:
        data = item["data"]
        if item["type"] == "anomaly":
            kind, severity = data["kind"], data["severity"]
            paths = [data["entity"]] + data["related"]
        else:
            kind = data["anomaly_kind"]
            linked = state.open.get(data["anomaly_dedup_key"])
            severity = SEVERITY_NAME.get(linked.severity, "") if linked is not None else ""
            paths = [data["target"]]
        if self.kind and kind != self.kind:
            return False
        if self.min_severity and severity and SEVERITY_RANK.get(severity, 0) < SEVERITY_RANK[self.min_severity]:
            return False
        if self.job and not any(p["job"] == self.job or (p["node"] and p["node"] in state.nodes_of_job(self.job))
                                for p in paths):
            return False
        if self.switch and not any(p["switch"] == self.switch
                                   or state.peer_of(p["path"]).split("/")[0] == self.switch for p in paths):
            return False
        return True
