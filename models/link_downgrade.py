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
  topology file, else from fleet consensus (the most common rate of all NIC ports seen).
  A port that is not ACTIVE is down, not downgraded: that is the flap detector's job.
* NIC PCIe width/gen below the device maximum.
* GPU PCIe width below max, or gen below max **while busy**: NVML documents that an idle
  GPU lowers its PCIe gen to save power, which is not a fault.
* Switch port oper-up with `port_speed_gbps` below the nominal speed of its cable.

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

from collections import Counter
from dataclasses import dataclass, field
from functools import lru_cache

import numpy as np

from .findings import CRITICAL, OPEN, RESOLVED, WARNING, EntityRef, Evidence, Finding
from .frames import GPU, NIC_PORT, SWITCH_PORT, EntityFrame, SourceView
from .linkrate import IbRate, parse_ib_rate
from .topology import DEFAULT_NIC_RATE, Topology

DETECTOR = "link_downgrade/v1"
# A GPU counts as busy (so a lower PCIe gen is a fault, not power saving) above this.
GPU_BUSY_UTILIZATION_PCT = 20.0
# Below this fraction of nominal speed a downgrade is critical (the link carries half or less).
CRITICAL_SPEED_FRACTION = 0.5
# Fleet consensus needs this many NIC ports seen before it overrides the configured default.
MIN_PORTS_FOR_CONSENSUS = 8
ACTIVE_STATE = "4"  # sysfs `state` "4: ACTIVE"


@lru_cache(maxsize=256)
def _parse(rate: str) -> IbRate | None:
    return parse_ib_rate(rate)


@dataclass
class LinkDowngradeDetector:
    topology: Topology | None = None
    default_nic_rate: str = DEFAULT_NIC_RATE
    gpu_busy_utilization_pct: float = GPU_BUSY_UTILIZATION_PCT
    # open findings by (kind, source, entity id): tuples, so healthy entities cost no strings
    _open: dict[tuple[str, str, str], Finding] = field(default_factory=dict, repr=False)
    _fleet_rates: Counter = field(default_factory=Counter, repr=False)
    _topology_nominal: dict[tuple[str, str], IbRate | None] = field(default_factory=dict, repr=False)
    _switch_nominal: dict[tuple[str, str], float | None] = field(default_factory=dict, repr=False)

    def __post_init__(self) -> None:
        if _parse(self.default_nic_rate) is None:
            raise ValueError(f"default_nic_rate: not a sysfs rate string: {self.default_nic_rate!r}")
        if not 0 <= self.gpu_busy_utilization_pct <= 100:
            raise ValueError("gpu_busy_utilization_pct must be within 0..100")

    # -- public ---------------------------------------------------------------------------
    def update(self, view: SourceView) -> list[Finding]:
        """Findings that opened or resolved with this tick of one source."""
        active: dict[str, Finding] = {}
        checked: set[str] = set()
        for frame in view.frames:
            if frame.kind == NIC_PORT:
                self._nic_ports(view, frame, active, checked)
            elif frame.kind == GPU:
                self._gpus(view, frame, active, checked)
            elif frame.kind == SWITCH_PORT:
                self._switch_ports(view, frame, active, checked)
        return self._transitions(view, active, checked)

    def open_findings(self) -> list[Finding]:
        return list(self._open.values())

    # -- rules ----------------------------------------------------------------------------
    def _fleet_nominal(self) -> IbRate:
        if sum(self._fleet_rates.values()) >= MIN_PORTS_FOR_CONSENSUS:
            return _parse(self._fleet_rates.most_common(1)[0][0])
        return _parse(self.default_nic_rate)

    def _nominal_nic(self, node: str, entity_id: str, fleet: IbRate) -> IbRate:
        key = (node, entity_id)
        if key not in self._topology_nominal:
            nic = self.topology.nic(node, entity_id) if self.topology is not None else None
            self._topology_nominal[key] = _parse(nic.nominal_rate) if nic is not None else None
        return self._topology_nominal[key] or fleet

    def _nic_ports(self, view, frame: EntityFrame, active, checked) -> None:
        rates, states = frame.label("rate"), frame.label("state")
        speed_mbps = frame.gauge("netdev_speed_mbps")
        width, width_max = frame.gauge("pcie_width_current"), frame.gauge("pcie_width_max")
        gen, gen_max = frame.gauge("pcie_gen_current"), frame.gauge("pcie_gen_max")
        if len(self._fleet_rates) < 64:   # bounded: a fleet has a handful of distinct rates
            self._fleet_rates.update(r for r in rates if r and _parse(r) is not None)
        fleet = self._fleet_nominal()
        pcie_low = (width < width_max) | (gen < gen_max)   # NaN compares False
        for i, entity_id in enumerate(frame.ids):
            checked.update((("link_downgrade", view.source, entity_id), ("pcie_downgrade", view.source, entity_id)))
            current = _parse(rates[i])
            link_bad = False
            if states[i].startswith(ACTIVE_STATE) and current is not None:
                nominal = self._nominal_nic(view.source, entity_id, fleet)
                slower = current.gbps < nominal.gbps
                lanes_changed = current.gbps == nominal.gbps and (current.width, current.lane) != (
                    nominal.width, nominal.lane)
                link_bad = slower or lanes_changed
            if not (link_bad or pcie_low[i]):
                continue
            device, _, port = entity_id.partition("/")
            entity = EntityRef(cluster=view.cluster, node=view.source, device=device, port=port)
            link = Finding("link_downgrade", OPEN, entity, detector=DETECTOR)
            pcie = Finding("pcie_downgrade", OPEN, entity, detector=DETECTOR)
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
                active[("link_downgrade", view.source, entity_id)] = link
            if pcie_low[i]:
                pcie.evidence = [Evidence("pcie_width", width[i], width_max[i], "lanes"),
                                 Evidence("pcie_gen", gen[i], gen_max[i], "gen")]
                pcie.summary = (f"{view.source} NIC {entity_id} PCIe at gen{gen[i]:g} x{width[i]:g}, "
                                f"max gen{gen_max[i]:g} x{width_max[i]:g}")
                pcie.probable_cause = "NIC PCIe link trained below its maximum (riser, slot or firmware)"
                pcie.suggested_action = "check the slot/riser; drain the node after the running job"
                active[("pcie_downgrade", view.source, entity_id)] = pcie

    def _gpus(self, view, frame: EntityFrame, active, checked) -> None:
        util = frame.gauge("utilization_gpu_pct")
        width, width_max = frame.gauge("pcie_width_current"), frame.gauge("pcie_width_max")
        gen, gen_max = frame.gauge("pcie_gen_current"), frame.gauge("pcie_gen_max")
        busy = util >= self.gpu_busy_utilization_pct
        narrow = width < width_max
        slow_gen = (gen < gen_max) & busy
        # An idle GPU's width/gen reading is not trusted either way: keep its state as is.
        checked.update(("pcie_downgrade", view.source, frame.ids[i]) for i in np.flatnonzero(narrow | slow_gen | busy))
        for i in np.flatnonzero(narrow | slow_gen):
            gpu = frame.ids[i]
            f = Finding("pcie_downgrade", OPEN, EntityRef(cluster=view.cluster, node=view.source, device=gpu),
                        detector=DETECTOR)
            f.evidence = [Evidence("pcie_width", width[i], width_max[i], "lanes"),
                          Evidence("pcie_gen", gen[i], gen_max[i], "gen"),
                          Evidence("utilization_gpu_pct", util[i], self.gpu_busy_utilization_pct, "%",
                                   "busy: a lower gen is not idle power saving")]
            f.summary = (f"{view.source} {gpu} PCIe at gen{gen[i]:g} x{width[i]:g} under load, "
                         f"max gen{gen_max[i]:g} x{width_max[i]:g}")
            f.probable_cause = "GPU PCIe link trained below its maximum"
            f.suggested_action = "drain the node after the running job; reseat the GPU/riser"
            active[("pcie_downgrade", view.source, gpu)] = f

    def _switch_ports(self, view, frame: EntityFrame, active, checked) -> None:
        speed, oper_up = frame.gauge("port_speed_gbps"), frame.gauge("oper_up")
        for i, port in enumerate(frame.ids):
            checked.add(("link_downgrade", view.source, port))
            nominal = self._nominal_switch_port(view.source, port)
            if nominal is None or oper_up[i] != 1 or not speed[i] < nominal:
                continue
            f = Finding("link_downgrade", OPEN, EntityRef(cluster=view.cluster, switch=view.source, port=port),
                        detector=DETECTOR)
            f.evidence = [Evidence("port_speed_gbps", speed[i], nominal, "Gb/s")]
            f.severity = CRITICAL if speed[i] <= nominal * CRITICAL_SPEED_FRACTION else WARNING
            f.summary = f"{view.source} {port} up at {speed[i]:g} Gb/s, nominal {nominal:g} Gb/s"
            f.probable_cause = "cable, transceiver or port fault; link retrained below nominal"
            f.suggested_action = "replace the cable/transceiver"
            active[("link_downgrade", view.source, port)] = f

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
                self._open[key] = finding
                out.append(finding)
        for key in [k for k in self._open if k in checked and k not in active]:
            opened = self._open.pop(key)
            out.append(Finding(opened.kind, RESOLVED, opened.entity, opened.severity, opened.onset_ns,
                               view.time_ns, opened.evidence, summary=f"resolved: {opened.summary}",
                               detector=DETECTOR))
        return out
