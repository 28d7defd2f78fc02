"""Link downgrade: a link that trained below its nominal speed or lane width.

Reads, per tick: NIC ports' sysfs `rate`/`state` labels and `netdev_speed_mbps`,
NIC and GPU PCIe gen/width gauges, GPU utilisation, switch ports' `port_speed_gbps`.
Emits `link_downgrade` (network link) and `pcie_downgrade` findings, opened on the first
sample that shows it (a downgrade is a state, not a trend) and resolved on the first
sample back at nominal.

Rules (each threshold named below):

* NIC port ACTIVE and its rate below nominal in Gb/s, **or** at the same speed on other
  lanes (``400 Gb/sec (8X HDR)`` on a 4X NDR port: twice the lanes at half the lane rate,
  which the number alone hides). Nominal comes from the
  topology file, else from the fleet's consensus, one vote per node (`nominal.NominalRates`).
  A port that is not ACTIVE is down, not downgraded: that is the flap detector's job.
* NIC PCIe width/gen below the device maximum.
* GPU PCIe width below max, or gen below max **while busy**: NVML documents that an idle
  GPU lowers its PCIe gen to save power, which is not a fault.
* Switch port oper-up with `port_speed_gbps` below the nominal speed of its cable.

Only what a tick carries is judged: a port without ``rate`` and ``state`` labels (a
PFC-only tick, a partial read) neither opens nor resolves its link finding, nor a block
without PCIe gauges its PCIe finding. A source's tick that looks exactly like its previous
one (the same labels and gauges, the same nominal rates) changes nothing and is skipped.

>>> import numpy as np
>>> from fabricwatch.models.frames import EntityFrame, SourceView
>>> def nic(rate):
...     return EntityFrame("nic_port", ("mlx5_0/1",), (), np.empty((1, 0), np.uint64), (),
...                        np.empty((1, 0)), [{"rate": rate, "state": "4: ACTIVE"}])
>>> det = LinkDowngradeDetector(default_nic_rate="400 Gb/sec (4X NDR)")
>>> det.update(SourceView("c1", "node-1", "node", 0, 0, [nic("400 Gb/sec (4X NDR)")]))
[]
>>> [(f.kind, f.state, f.entity.path()) for f in
...  det.update(SourceView("c1", "node-1", "node", 1, 1, [nic("400 Gb/sec (8X HDR)")]))]
[('link_downgrade', 'open', 'c1/node-1/mlx5_0/1')]
>>> [f.state for f in det.update(SourceView("c1", "node-1", "node", 2, 2, [nic("400 Gb/sec (4X NDR)")]))]
['resolved']
"""
from __future__ import annotations

from dataclasses import dataclass, field
from functools import lru_cache

import numpy as np

from .detector import Detector, PerTick
from .fec import FecMemory
from .findings import CRITICAL, OPEN, RESOLVED, WARNING, EntityRef, Evidence, Finding
from .frames import GPU, NIC_PORT, SWITCH_PORT, EntityFrame, LayoutGroup, SourceBatch, SourceView
from .linkrate import IbRate, parse_ib_rate
from .nominal import NominalRates, node_vote
from .topology import DEFAULT_NIC_RATE, Topology
from .vocabulary import LINK_DOWNGRADE, PCIE_DOWNGRADE

DETECTOR = "link_downgrade/v1"
# A GPU counts as busy (so a lower PCIe gen is a fault, not power saving) above this.
GPU_BUSY_UTILIZATION_PCT = 20.0
# Below this fraction of nominal speed a downgrade is critical (the link carries half or less).
CRITICAL_SPEED_FRACTION = 0.5
ACTIVE_STATE = "4"  # sysfs `state` "4: ACTIVE"
_NIC_GAUGES = ("netdev_speed_mbps", "pcie_width_current", "pcie_width_max", "pcie_gen_current", "pcie_gen_max")
_GPU_GAUGES = ("utilization_gpu_pct", "pcie_width_current", "pcie_width_max", "pcie_gen_current", "pcie_gen_max")
_SWITCH_GAUGES = ("port_speed_gbps", "oper_up")


@lru_cache(maxsize=256)
def _parse(rate: str) -> IbRate | None:
    return parse_ib_rate(rate)


@dataclass
class LinkDowngradeDetector(PerTick, Detector):
    """Link and PCIe downgrades of NIC ports, GPUs and switch ports; see the module docstring.

    ``nominal`` is the worker's shared `NominalRates` (topology, configured rate, one vote
    per node); without it the detector keeps its own, with ``default_nic_rate``.
    """

    topology: Topology | None = None
    default_nic_rate: str = DEFAULT_NIC_RATE
    gpu_busy_utilization_pct: float = GPU_BUSY_UTILIZATION_PCT
    nominal: NominalRates | None = None
    # open findings by (kind, source, entity id): tuples, so healthy entities cost no strings
    _open: dict[tuple[str, str, str], Finding] = field(default_factory=dict, repr=False)
    _switch_nominal: dict[tuple[str, str], float | None] = field(default_factory=dict, repr=False)
    _last_seen: dict[tuple[str, str], tuple] = field(default_factory=dict, repr=False)   # (source, kind) -> picture
    # (cluster, node, rate, weight) of the votes cast here since `take_votes`, to be published
    _votes: dict[tuple[str, str], tuple[str, int]] = field(default_factory=dict, repr=False)
    fec: FecMemory = field(default_factory=FecMemory, repr=False)   # uncorrectable codewords, as evidence

    def __post_init__(self) -> None:
        if _parse(self.default_nic_rate) is None:
            raise ValueError(f"default_nic_rate: not a sysfs rate string: {self.default_nic_rate!r}")
        if not 0 <= self.gpu_busy_utilization_pct <= 100:
            raise ValueError("gpu_busy_utilization_pct must be within 0..100")
        if self.nominal is None:
            self.nominal = NominalRates(self.topology, default=self.default_nic_rate)

    # -- public ---------------------------------------------------------------------------
    def reads(self, kind, counter_names, gauge_names, label_names) -> bool:
        if kind == NIC_PORT:
            return {"rate", "state"} <= set(label_names) or bool(set(_NIC_GAUGES[1:]) & set(gauge_names))
        if kind == GPU:
            return bool(set(_GPU_GAUGES[1:]) & set(gauge_names))
        return kind == SWITCH_PORT and "port_speed_gbps" in gauge_names

    def update_batch(self, batch: SourceBatch) -> list[Finding]:
        """Only the ticks whose picture (labels, gauges, nominal rates) differs from the tick
        before: a link that keeps its state from one tick to the next changes no finding."""
        self.fec.note(batch)
        out: list[Finding] = []
        for stack in batch.stacks:
            if not self.reads(stack.kind, stack.counter_names, stack.gauge_names, tuple(stack.labels)):
                continue
            for k in self._changed_ticks(batch.source, stack):
                out += self.update(SourceView(batch.cluster, batch.source, batch.source_kind,
                                              int(stack.times_ns[k]), 0, [stack.frame(k)]))
        return out

    def screen(self, group: LayoutGroup) -> None:
        """Per stack of a layout group: which ticks' gauges differ from the tick before (the
        labels and the first tick are compared by `_changed_ticks`)."""
        kind, _, counter_names, gauge_names = group.key
        if not self.reads(kind, counter_names, gauge_names, tuple(group.stacks[0].labels)):
            return
        names = _NIC_GAUGES if kind == NIC_PORT else _GPU_GAUGES[1:] if kind == GPU else _SWITCH_GAUGES
        cols = [j for j, n in enumerate(gauge_names) if n in names]
        g = group.gauges[:, :, cols]
        rows = len(group.times_ns)
        changed = np.ones(rows, dtype=bool)
        if rows > 1:
            a, b = g[1:], g[:-1]
            same = ((a == b) | (np.isnan(a) & np.isnan(b))).reshape(rows - 1, -1).all(axis=1)
            if kind == GPU and "utilization_gpu_pct" in gauge_names:
                busy = group.gauges[:, :, gauge_names.index("utilization_gpu_pct")] >= self.gpu_busy_utilization_pct
                same &= (busy[1:] == busy[:-1]).all(axis=1)
            changed[1:] = ~same
        for i, stack in enumerate(group.stacks):
            start = int(group.starts[i])
            stack.screens["downgrade"] = changed[start:start + len(stack.ticks)]

    def _picture(self, frame_or_stack, k: int | None = None) -> tuple:
        """What the rules read of one tick: labels, the gauges they compare (a GPU's
        utilisation only as busy or not), the nominal rates' version."""
        f = frame_or_stack
        names = _NIC_GAUGES if f.kind == NIC_PORT else _GPU_GAUGES[1:] if f.kind == GPU else _SWITCH_GAUGES
        cols = [j for j, n in enumerate(f.gauge_names) if n in names]
        gauges = f.gauges if k is None else f.gauges[k]
        picture = gauges[:, cols].tobytes()
        if f.kind == GPU:
            j = f.gauge_names.index("utilization_gpu_pct") if "utilization_gpu_pct" in f.gauge_names else None
            if j is not None:
                picture += (gauges[:, j] >= self.gpu_busy_utilization_pct).tobytes()
        rates, states = f.labels.get("rate"), f.labels.get("state")
        if k is not None:
            rates, states = rates[k] if rates is not None else None, states[k] if states is not None else None
        return (f.ids, f.gauge_names, picture, rates, states, self.nominal.version)

    def _changed_ticks(self, source: str, stack) -> list[int]:
        """The stack's ticks whose picture differs from the one before (the first: from the last judged)."""
        screened = stack.screens.get("downgrade")
        if screened is not None:
            changed = [0] if self._picture(stack, 0) != self._last_seen.get((source, stack.kind)) else []
            rates, states = stack.labels.get("rate"), stack.labels.get("state")
            for k in range(1, len(stack.ticks)):
                if screened[k] or any(col is not None and col[k] is not col[k - 1] and col[k] != col[k - 1]
                                      for col in (rates, states)):
                    changed.append(k)
            return changed
        before = self._last_seen.get((source, stack.kind))
        changed = []
        for k in range(len(stack.ticks)):
            picture = self._picture(stack, k)
            if picture != before:
                changed.append(k)
            before = picture
        return changed

    def update(self, view: SourceView) -> list[Finding]:
        """Findings that opened or resolved with this tick of one source."""
        active: dict[str, Finding] = {}
        checked: set[str] = set()
        for frame in view.frames:
            if self._unchanged(view, frame):
                continue
            if frame.kind == NIC_PORT:
                self._nic_ports(view, frame, active, checked)
            elif frame.kind == GPU:
                self._gpus(view, frame, active, checked)
            elif frame.kind == SWITCH_PORT:
                self._switch_ports(view, frame, active, checked)
        return self._transitions(view, active, checked)

    def open_findings(self) -> list[Finding]:
        return list(self._open.values())

    def take_votes(self) -> list[tuple[str, str, str, int]]:
        """The nodes' nominal-rate votes (cluster, node, rate, weight) that changed here."""
        out = [(c, n, rate, weight) for (c, n), (rate, weight) in self._votes.items()]
        self._votes.clear()
        return out

    def forget(self, source: str) -> None:
        for key in [k for k in self._open if k[1] == source]:
            del self._open[key]
        for key in [k for k in self._last_seen if k[0] == source]:
            del self._last_seen[key]

    # -- rules ----------------------------------------------------------------------------
    def _unchanged(self, view: SourceView, frame: EntityFrame) -> bool:
        """The same picture as this source's last tick of this kind: nothing can change."""
        picture = self._picture(frame)
        key = (view.source, frame.kind)
        if self._last_seen.get(key) == picture:
            return True
        self._last_seen[key] = picture
        return False

    def _nic_ports(self, view, frame: EntityFrame, active, checked) -> None:
        rates, states = frame.label("rate"), frame.label("state")
        speed_mbps = frame.gauge("netdev_speed_mbps")
        width, width_max = frame.gauge("pcie_width_current"), frame.gauge("pcie_width_max")
        gen, gen_max = frame.gauge("pcie_gen_current"), frame.gauge("pcie_gen_max")
        pcie_low = (width < width_max) | (gen < gen_max)   # NaN compares False
        pcie_read = (np.isfinite(width) & np.isfinite(width_max)) | (np.isfinite(gen) & np.isfinite(gen_max))
        if "rate" in frame.labels and "state" in frame.labels:
            vote = node_vote(rates, states)
            if self.nominal.vote(view.cluster, view.source, *vote):
                self._votes[(view.cluster, view.source)] = vote
        for i, entity_id in enumerate(frame.ids):
            if rates[i] and states[i]:                  # a tick without the labels says nothing of the link
                checked.add((LINK_DOWNGRADE, view.source, entity_id))
            if pcie_read[i]:
                checked.add((PCIE_DOWNGRADE, view.source, entity_id))
            current = _parse(rates[i])
            link_bad = False
            if states[i].startswith(ACTIVE_STATE) and current is not None:
                nominal = self.nominal.for_port(view.cluster, view.source, entity_id)
                slower = current.gbps < nominal.gbps
                lanes_changed = current.gbps == nominal.gbps and (current.width, current.lane) != (
                    nominal.width, nominal.lane)
                link_bad = slower or lanes_changed
            if not (link_bad or pcie_low[i]):
                continue
            device, _, port = entity_id.partition("/")
            entity = EntityRef(cluster=view.cluster, node=view.source, device=device, port=port)
            link = Finding(LINK_DOWNGRADE, OPEN, entity, detector=DETECTOR)
            pcie = Finding(PCIE_DOWNGRADE, OPEN, entity, detector=DETECTOR)
            if link_bad:
                link.evidence = [
                    Evidence("rate_gbps", current.gbps, nominal.gbps, "Gb/s", f"sysfs rate {rates[i]!r}"),
                    Evidence("lanes", current.width, nominal.width, "lanes",
                             f"nominal {nominal.width}X {nominal.lane}, now {current.width}X {current.lane}"),
                ]
                if speed_mbps[i] == speed_mbps[i]:  # not NaN
                    link.evidence.append(Evidence("netdev_speed_mbps", speed_mbps[i], nominal.gbps * 1000, "Mb/s"))
                link.severity = CRITICAL if current.gbps <= nominal.gbps * CRITICAL_SPEED_FRACTION else WARNING
                what = "speed" if slower else "lane"
                link.summary = (f"{view.source} {entity_id} trained at {rates[i].strip()}, "
                                f"nominal {nominal.gbps:g} Gb/s {nominal.width}X {nominal.lane} ({what} downgrade)")
                link.probable_cause = "cable, transceiver or port fault; link retrained below nominal"
                link.suggested_action = "reseat or replace the cable/transceiver; drain the node after the running job"
                active[(LINK_DOWNGRADE, view.source, entity_id)] = link
            if pcie_low[i]:
                pcie.evidence = [Evidence("pcie_width", width[i], width_max[i], "lanes"),
                                 Evidence("pcie_gen", gen[i], gen_max[i], "gen")]
                pcie.summary = (f"{view.source} NIC {entity_id} PCIe at gen{gen[i]:g} x{width[i]:g}, "
                                f"max gen{gen_max[i]:g} x{width_max[i]:g}")
                pcie.probable_cause = "NIC PCIe link trained below its maximum (riser, slot or firmware)"
                pcie.suggested_action = "check the slot/riser; drain the node after the running job"
                active[(PCIE_DOWNGRADE, view.source, entity_id)] = pcie

    def _gpus(self, view, frame: EntityFrame, active, checked) -> None:
        util = frame.gauge("utilization_gpu_pct")
        width, width_max = frame.gauge("pcie_width_current"), frame.gauge("pcie_width_max")
        gen, gen_max = frame.gauge("pcie_gen_current"), frame.gauge("pcie_gen_max")
        busy = util >= self.gpu_busy_utilization_pct
        narrow = width < width_max
        slow_gen = (gen < gen_max) & busy
        # An idle GPU's width/gen reading is not trusted either way: keep its state as is.
        checked.update((PCIE_DOWNGRADE, view.source, frame.ids[i]) for i in np.flatnonzero(narrow | slow_gen | busy))
        for i in np.flatnonzero(narrow | slow_gen):
            gpu = frame.ids[i]
            f = Finding(PCIE_DOWNGRADE, OPEN, EntityRef(cluster=view.cluster, node=view.source, device=gpu),
                        detector=DETECTOR)
            f.evidence = [Evidence("pcie_width", width[i], width_max[i], "lanes"),
                          Evidence("pcie_gen", gen[i], gen_max[i], "gen"),
                          Evidence("utilization_gpu_pct", util[i], self.gpu_busy_utilization_pct, "%",
                                   "busy: a lower gen is not idle power saving")]
            f.summary = (f"{view.source} {gpu} PCIe at gen{gen[i]:g} x{width[i]:g} under load, "
                         f"max gen{gen_max[i]:g} x{width_max[i]:g}")
            f.probable_cause = "GPU PCIe link trained below its maximum"
            f.suggested_action = "drain the node after the running job; reseat the GPU/riser"
            active[(PCIE_DOWNGRADE, view.source, gpu)] = f

    def _switch_ports(self, view, frame: EntityFrame, active, checked) -> None:
        speed, oper_up = frame.gauge("port_speed_gbps"), frame.gauge("oper_up")
        for i, port in enumerate(frame.ids):
            if speed[i] == speed[i] and oper_up[i] == oper_up[i]:    # read (not NaN) this tick
                checked.add((LINK_DOWNGRADE, view.source, port))
            nominal = self._nominal_switch_port(view.source, port)
            if nominal is None or oper_up[i] != 1 or not speed[i] < nominal:
                continue
            f = Finding(LINK_DOWNGRADE, OPEN, EntityRef(cluster=view.cluster, switch=view.source, port=port),
                        detector=DETECTOR)
            f.evidence = [Evidence("port_speed_gbps", speed[i], nominal, "Gb/s")]
            f.severity = CRITICAL if speed[i] <= nominal * CRITICAL_SPEED_FRACTION else WARNING
            f.summary = f"{view.source} {port} up at {speed[i]:g} Gb/s, nominal {nominal:g} Gb/s"
            f.probable_cause = "cable, transceiver or port fault; link retrained below nominal"
            f.suggested_action = "replace the cable/transceiver"
            active[(LINK_DOWNGRADE, view.source, port)] = f

    def _nominal_switch_port(self, switch: str, port: str) -> float | None:
        key = (switch, port)
        if key not in self._switch_nominal:
            self._switch_nominal[key] = self._switch_port_nominal_from_topology(switch, port)
        return self._switch_nominal[key]

    def _switch_port_nominal_from_topology(self, switch: str, port: str) -> float | None:
        if self.topology is None:
            return None
        peer = self.topology.peer_of(switch, port)
        if peer is None:
            return None
        if peer.nic is not None:
            return peer.nic.nominal_gbps
        for link in self.topology.links:
            if (link.a_switch, link.a_port) == (switch, port) or (link.b_switch, link.b_port) == (switch, port):
                return link.nominal_speed_gbps
        return None

    # -- lifecycle ------------------------------------------------------------------------
    def _transitions(self, view: SourceView, active: dict[tuple, Finding], checked: set[tuple]) -> list[Finding]:
        out: list[Finding] = []
        for key, finding in active.items():
            if key not in self._open:
                finding.onset_ns = finding.detected_ns = view.time_ns
                if key[0] == LINK_DOWNGRADE:
                    finding.evidence += self.fec.evidence(view.source, key[2], view.time_ns)
                self._open[key] = finding
                out.append(finding)
        for key in [k for k in self._open if k in checked and k not in active]:
            opened = self._open.pop(key)
            out.append(Finding(opened.kind, RESOLVED, opened.entity, opened.severity, opened.onset_ns,
                               view.time_ns, opened.evidence, summary=f"resolved: {opened.summary}",
                               detector=DETECTOR))
        return out
