"""Link flap: a link that went down and came back quickly, or keeps doing so.

Reads NIC ports' `link_downed` (IB PMA, 8-bit saturating), `link_down_events_phy`
(ethtool) and the sysfs `state` label; switch ports' `interface-transitions` (OpenConfig:
UP<->other, one flap = +2), `oper_up` and `admin_up`.

A flap is a down that is over within `max_down_s`: it opens when the link is seen back
up (or at once when the down and the recovery both fall inside one sampling interval),
updates as more follow, and resolves after `quiet_s` without one. What is not a flap:

* a long outage (a reboot, a pulled cable, a port shut for maintenance): down for longer
  than `max_down_s`. A port that stays down that long is `link_down`'s
  (`models.link_down`, whose hold is this bound), so each down is one or the other;
* a NIC shut on its host (`nic_shut_on_host`);
* an operator's admin toggle of a switch port (`admin_up` changed within `admin_grace_s`),
  seen on the toggled port itself and, given a topology, on the port cabled to it (the NIC
  behind a leaf port, the spine behind an uplink);
* a counter reset after a reboot: no rate, hence no evidence.

Codewords the FEC could not correct on the port within `fec.FEC_MEMORY_S` are added to
the evidence (`fec.FecMemory`).

>>> import numpy as np
>>> from fabricwatch.models.frames import EntityFrame, SourceView
>>> def nic(t_s, state, link_downed_rate=0.0):
...     f = EntityFrame("nic_port", ("mlx5_0/1",), ("link_downed",), np.zeros((1, 1), np.uint64), (),
...                     np.empty((1, 0)), [{"state": state}])
...     f.rates, f.dt_s = np.array([[link_downed_rate]]), 1.0
...     return SourceView("c1", "node-1", "node", int(t_s * 1e9), 0, [f])
>>> det = LinkFlapDetector(quiet_s=30)
>>> det.update(nic(1, "4: ACTIVE")), det.update(nic(2, "1: DOWN", 1.0))   # down: not yet a flap
([], [])
>>> [(f.kind, f.state) for f in det.update(nic(4, "4: ACTIVE"))]        # back 2 s later: a flap
[('link_flap', 'open')]
>>> [f.state for f in det.update(nic(40, "4: ACTIVE"))]
['resolved']
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from .detector import Detector, PerTick
from .fec import FecMemory
from .findings import CRITICAL, OPEN, RESOLVED, UPDATE, WARNING, EntityRef, Evidence, Finding
from .frames import NIC_PORT, SWITCH_PORT, EntityFrame, FrameStack, LayoutGroup, SourceBatch, SourceView
from .topology import Topology
from .vocabulary import LINK_FLAP

DETECTOR = "link_flap/v2"
QUIET_S = 300.0            # resolve after this long without a down event
MAX_DOWN_S = 30.0          # a down that lasts longer is an outage (reboot, maintenance), not a flap
ADMIN_GRACE_S = 30.0       # transitions this soon after an admin_up change are the operator's
SETTLE_S = 5.0             # counter evidence this soon after an outage ended belongs to the outage
FLAPS_FOR_CRITICAL = 3     # down events within one open episode that make it critical
ACTIVE_STATE = "4"
DISABLED_PHYS_STATE = "3"  # sysfs `phys_state` "3: Disabled": the port is shut, not failing to train


def nic_shut_on_host(frame: EntityFrame) -> np.ndarray:
    """NIC ports an operator shut on their host (``ip link set <if> down``): ``phys_state``
    ``3: Disabled`` and no readable netdev speed (the kernel answers EINVAL for an interface
    that is not running). False where the tick does not carry ``netdev_speed_mbps``."""
    if "netdev_speed_mbps" not in frame.gauge_names:
        return np.zeros(len(frame.ids), dtype=bool)
    shut = np.array([p.startswith(DISABLED_PHYS_STATE) for p in frame.label("phys_state")], dtype=bool)
    return shut & np.isnan(frame.gauge("netdev_speed_mbps"))


@dataclass
class _Episode:
    finding: Finding
    downs: float
    last_down_ns: int


@dataclass
class _Down:
    since_ns: int
    events: float


@dataclass
class LinkFlapDetector(PerTick, Detector):
    topology: Topology | None = None
    quiet_s: float = QUIET_S
    max_down_s: float = MAX_DOWN_S
    admin_grace_s: float = ADMIN_GRACE_S
    _episodes: dict[tuple[str, str], _Episode] = field(default_factory=dict, repr=False)
    _down: dict[tuple[str, str], _Down] = field(default_factory=dict, repr=False)
    _outage_ended: dict[tuple[str, str], int] = field(default_factory=dict, repr=False)
    _half_transitions: dict[tuple[str, str], float] = field(default_factory=dict, repr=False)
    # (switch, port ids) -> (admin_up per port as last seen, event time it last changed; 0 = never)
    _admin: dict[tuple[str, tuple[str, ...]], tuple[np.ndarray, np.ndarray]] = field(default_factory=dict, repr=False)
    _recent_admin: dict[tuple[str, str], int] = field(default_factory=dict, repr=False)  # port -> change ns
    fec: FecMemory = field(default_factory=FecMemory, repr=False)   # uncorrectable codewords, as evidence

    def __post_init__(self) -> None:
        for name in ("quiet_s", "max_down_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)!r}")
        if self.admin_grace_s < 0:
            raise ValueError("admin_grace_s must be >= 0")

    def reads(self, kind, counter_names, gauge_names, label_names) -> bool:
        if kind == NIC_PORT:
            return bool({"link_downed", "link_down_events_phy"} & set(counter_names)) or "state" in label_names
        return kind == SWITCH_PORT and bool({"interface-transitions"} & set(counter_names)
                                            or {"oper_up", "admin_up"} & set(gauge_names))

    def update_batch(self, batch: SourceBatch) -> list[Finding]:
        """NIC blocks with no down event, every port ACTIVE and nothing remembered of them
        change nothing: only the source's quiet episodes can resolve. Anything else (and
        every switch block: admin toggles are tracked) goes tick by tick."""
        self.fec.note(batch)
        busy = [s for s in batch.stacks if s.kind == SWITCH_PORT or (s.kind == NIC_PORT and not self._quiet(batch, s))]
        if busy or batch.events:
            return super().update_batch(batch)
        if not self._episodes:
            return []
        return self._resolve_quiet(SourceView(batch.cluster, batch.source, batch.source_kind,
                                              int(batch.times_ns[-1]), 0))

    def screen(self, group: LayoutGroup) -> None:
        """Per NIC stack of a layout group: any down event counted?"""
        kind, _, counter_names, _ = group.key
        if kind != NIC_PORT or group.rates is None:
            return
        cols = [j for j, n in enumerate(counter_names) if n in ("link_downed", "link_down_events_phy")]
        downs = group.segment_any((group.rates[:, :, cols] > 0).reshape(len(group.times_ns), -1).any(axis=1)) \
            if cols else np.zeros(len(group.stacks), dtype=bool)
        for i, stack in enumerate(group.stacks):
            stack.screens["flap"] = bool(downs[i])

    def _quiet(self, batch: SourceBatch, stack: FrameStack) -> bool:
        screened = stack.screens.get("flap")
        if screened:
            return False
        if screened is None and stack.rates is not None:
            for name in ("link_downed", "link_down_events_phy"):
                j = stack.column(name)
                if j is not None and (stack.rates[:, :, j] > 0).any():    # NaN compares False
                    return False
        checked = None
        for states in stack.labels.get("state", ()):
            if states is checked:
                continue                                 # one label list shared by the ticks
            checked = states
            if any(s and not s.startswith(ACTIVE_STATE) for s in states):
                return False
        source = batch.source
        remembered = (self._down, self._outage_ended, self._half_transitions)
        return not any((source, eid) in d for d in remembered if d for eid in stack.ids)

    def update(self, view: SourceView) -> list[Finding]:
        out: list[Finding] = []
        for frame in view.frames:
            if frame.kind == NIC_PORT:
                downs = np.fmax(np.nan_to_num(frame.delta("link_downed")),
                                np.nan_to_num(frame.delta("link_down_events_phy")))
                state = frame.label("state")
                is_down = np.array([bool(s) and not s.startswith(ACTIVE_STATE) for s in state])
                operator = is_down & nic_shut_on_host(frame) if is_down.any() else np.zeros(len(frame.ids), bool)
                if self._recent_admin:
                    operator |= self._peer_admin_toggled(view, frame, downs, is_down)
            elif frame.kind == SWITCH_PORT:
                # UP->DOWN and DOWN->UP each count 1; the two may land in different samples
                downs = np.nan_to_num(frame.delta("interface-transitions")) / 2.0
                is_down = frame.gauge("oper_up") == 0
                operator = self._admin_toggled(view, frame)
                if self._recent_admin:
                    operator |= self._peer_admin_toggled(view, frame, downs, is_down)
            else:
                continue
            # Only ports with something going on (or down until now) cost Python work.
            busy = set(np.flatnonzero((downs > 0) | is_down | operator).tolist())
            if self._down or self._outage_ended:
                busy |= {i for i, eid in enumerate(frame.ids)
                         if (view.source, eid) in self._down or (view.source, eid) in self._outage_ended}
            for i in sorted(busy):
                key = (view.source, frame.ids[i])
                if operator[i]:
                    self._down.pop(key, None)
                    continue
                events = self._flap_events(key, float(downs[i]), bool(is_down[i]), view.time_ns)
                if events:
                    out.extend(self._flapped(view, frame, i, events))
        out.extend(self._resolve_quiet(view))
        return out

    def _flap_events(self, key: tuple[str, str], downs: float, is_down: bool, now_ns: int) -> float:
        """Down events that make a flap now (0 while down, or for a long outage)."""
        ended = self._outage_ended.get(key)
        if ended is not None:
            if now_ns - ended <= SETTLE_S * 1e9:
                return 0.0
            del self._outage_ended[key]
        if downs % 1:   # half a flap (one transition) this sample: wait for its other half
            downs += self._half_transitions.pop(key, 0.0)
            if downs % 1:
                self._half_transitions[key] = downs % 1
                downs -= downs % 1
        down = self._down.get(key)
        if is_down:
            if down is None:
                self._down[key] = _Down(now_ns, max(downs, 1.0))
            else:
                down.events += downs
            return 0.0
        if down is None:
            return downs                      # down and back within one sampling interval
        del self._down[key]
        if now_ns - down.since_ns > self.max_down_s * 1e9:
            self._outage_ended[key] = now_ns
            return 0.0                        # an outage, not a flap
        return down.events + downs

    def _admin_toggled(self, view: SourceView, frame: EntityFrame) -> np.ndarray:
        """Ports whose admin_up changed (an operator's toggle) within the grace time."""
        admin = frame.gauge("admin_up")
        key = (view.source, frame.ids)
        held = self._admin.get(key)
        if held is None:
            values, changed = admin.copy(), np.zeros(len(frame.ids), dtype=np.int64)   # first sight: no change
        else:
            values, changed = held
            moved = (admin == admin) & (admin != values)             # read (not NaN) and different
            if moved.any():
                values, changed = np.where(moved, admin, values), np.where(moved, view.time_ns, changed)
        self._admin[key] = (values, changed)
        toggled = (changed != 0) & (view.time_ns - changed <= self.admin_grace_s * 1e9)
        for i in np.flatnonzero(changed).tolist():
            self._recent_admin[(view.source, frame.ids[i])] = int(changed[i])
        return toggled

    def _peer_admin_toggled(self, view: SourceView, frame: EntityFrame, downs, is_down) -> np.ndarray:
        """Ports whose cable peer is a switch port an operator toggled within the grace time."""
        toggled = np.zeros(len(frame.ids), dtype=bool)
        if self.topology is None:
            return toggled
        grace_ns = self.admin_grace_s * 1e9
        for key, changed_ns in list(self._recent_admin.items()):
            if view.time_ns - changed_ns > 2 * grace_ns:
                del self._recent_admin[key]
        for i in np.flatnonzero((downs > 0) | is_down).tolist():
            peer = self._peer(view.source, frame.kind, frame.ids[i])
            changed_ns = self._recent_admin.get(peer) if peer else None
            toggled[i] = changed_ns is not None and abs(view.time_ns - changed_ns) <= grace_ns
        return toggled

    def _peer(self, source: str, kind: str, entity_id: str) -> tuple[str, str] | None:
        if kind == NIC_PORT:
            nic = self.topology.nic(source, entity_id)
            return (nic.switch, nic.switch_port) if nic else None
        peer = self.topology.peer_of(source, entity_id)
        return (peer.switch, peer.port) if peer is not None and peer.switch else None

    def _entity(self, view: SourceView, frame: EntityFrame, i: int) -> EntityRef:
        if frame.kind == NIC_PORT:
            device, _, port = frame.ids[i].partition("/")
            return EntityRef(cluster=view.cluster, node=view.source, device=device, port=port)
        return EntityRef(cluster=view.cluster, switch=view.source, port=frame.ids[i])

    def _flapped(self, view: SourceView, frame: EntityFrame, i: int, downs: float) -> list[Finding]:
        key = (view.source, frame.ids[i])
        episode = self._episodes.get(key)
        state = UPDATE if episode else OPEN
        if episode is None:
            f = Finding(LINK_FLAP, OPEN, self._entity(view, frame, i), WARNING, onset_ns=view.time_ns,
                        detected_ns=view.time_ns, detector=DETECTOR)
            episode = self._episodes[key] = _Episode(f, 0.0, view.time_ns)
        episode.downs += downs
        episode.last_down_ns = view.time_ns
        f = episode.finding
        f.severity = CRITICAL if episode.downs >= FLAPS_FOR_CRITICAL else WARNING
        f.evidence = [Evidence("link_down_events", episode.downs, 0, "events",
                               f"downs of at most {self.max_down_s:g} s since the first")]
        f.evidence += self.fec.evidence(view.source, frame.ids[i], view.time_ns)
        f.summary = f"{view.source} {frame.ids[i]} went down and came back {episode.downs:g} time(s)"
        f.probable_cause = "unstable link: cable, transceiver or peer port"
        f.suggested_action = ("inspect the cable and transceiver; consider isolating the link"
                              if f.severity == CRITICAL else "watch; clean or reseat the cable if it repeats")
        return [Finding(**{**f.__dict__, "state": state, "detected_ns": view.time_ns, "evidence": list(f.evidence)})]

    def _resolve_quiet(self, view: SourceView) -> list[Finding]:
        out = []
        for key, episode in list(self._episodes.items()):
            if key[0] == view.source and view.time_ns - episode.last_down_ns > self.quiet_s * 1e9:
                del self._episodes[key]
                f = episode.finding
                out.append(Finding(LINK_FLAP, RESOLVED, f.entity, f.severity, f.onset_ns, view.time_ns,
                                   f.evidence, summary=f"resolved: {f.summary}", detector=DETECTOR))
        return out
