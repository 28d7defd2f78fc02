"""Link flap: a link that went down and came back, or keeps doing so.

Reads NIC ports' `link_downed` (IB PMA, 8-bit saturating), `link_down_events_phy`
(ethtool) and the sysfs `state` label; switch ports' `interface-transitions` (OpenConfig:
UP<->other, one flap = +2) and `admin_up`. Opens a `link_flap` on the first down event,
updates it as more arrive, resolves it after `quiet_s` without one. An operator's admin
toggle of a switch port (admin_up changed within `admin_grace_s`) is not a flap, and a
counter reset after a reboot gives no rate, hence no evidence.

>>> import numpy as np
>>> from fabricwatch.models.frames import EntityFrame, SourceView
>>> def nic(t_s, link_downed_rate):
...     f = EntityFrame("nic_port", ("mlx5_0/1",), ("link_downed",), np.zeros((1, 1), np.uint64), (),
...                     np.empty((1, 0)), [{"state": "4: ACTIVE"}])
...     f.rates, f.dt_s = np.array([[link_downed_rate]]), 1.0
...     return SourceView("c1", "node-1", "node", int(t_s * 1e9), 0, [f])
>>> det = LinkFlapDetector(quiet_s=30)
>>> [(f.kind, f.state) for f in det.update(nic(1, 1.0))]
[('link_flap', 'open')]
>>> det.update(nic(2, 0.0)), [f.state for f in det.update(nic(40, 0.0))]
([], ['resolved'])
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from .findings import CRITICAL, OPEN, RESOLVED, UPDATE, WARNING, EntityRef, Evidence, Finding
from .frames import NIC_PORT, SWITCH_PORT, EntityFrame, SourceView

DETECTOR = "link_flap/v1"
QUIET_S = 300.0            # resolve after this long without a down event
ADMIN_GRACE_S = 30.0       # transitions this soon after an admin_up change are the operator's
FLAPS_FOR_CRITICAL = 3     # down events within one open episode that make it critical
ACTIVE_STATE = "4"


@dataclass
class _Episode:
    finding: Finding
    downs: float
    last_down_ns: int


@dataclass
class LinkFlapDetector:
    quiet_s: float = QUIET_S
    admin_grace_s: float = ADMIN_GRACE_S
    _episodes: dict[str, _Episode] = field(default_factory=dict, repr=False)
    _was_active: dict[tuple[str, str], bool] = field(default_factory=dict, repr=False)
    _admin: dict[tuple[str, str], tuple[float, int]] = field(default_factory=dict, repr=False)

    def __post_init__(self) -> None:
        if self.quiet_s <= 0:
            raise ValueError("quiet_s must be > 0")
        if self.admin_grace_s < 0:
            raise ValueError("admin_grace_s must be >= 0")

    def update(self, view: SourceView) -> list[Finding]:
        out: list[Finding] = []
        for frame in view.frames:
            if frame.kind == NIC_PORT:
                downs = self._nic_downs(view, frame)
            elif frame.kind == SWITCH_PORT:
                downs = self._switch_downs(view, frame)
            else:
                continue
            for i in np.flatnonzero(downs > 0):
                out.extend(self._down(view, frame, i, float(downs[i])))
        out.extend(self._resolve_quiet(view))
        return out

    def _nic_downs(self, view: SourceView, frame: EntityFrame) -> np.ndarray:
        # Either counter may be absent (IB vs RoCE); NaN (reset, first sample) is no evidence.
        downs = np.fmax(np.nan_to_num(frame.delta("link_downed")), np.nan_to_num(frame.delta("link_down_events_phy")))
        for i, (entity_id, state) in enumerate(zip(frame.ids, frame.label("state"))):
            active = state.startswith(ACTIVE_STATE) if state else True
            key = (view.source, entity_id)
            if self._was_active.get(key, False) and not active:   # a port first seen down is not a flap
                downs[i] = max(downs[i], 1.0)   # caught while down, before the counter moved
            self._was_active[key] = active
        return downs

    def _switch_downs(self, view: SourceView, frame: EntityFrame) -> np.ndarray:
        transitions = np.nan_to_num(frame.delta("interface-transitions"))
        admin = frame.gauge("admin_up")
        downs = np.ceil(transitions / 2.0)
        for i, port in enumerate(frame.ids):
            key = (view.source, port)
            previous = self._admin.get(key)
            if previous is None or (admin[i] == admin[i] and admin[i] != previous[0]):
                self._admin[key] = (admin[i], view.time_ns if previous is not None else 0)
            _, changed_ns = self._admin[key]
            if changed_ns and view.time_ns - changed_ns <= self.admin_grace_s * 1e9:
                downs[i] = 0.0     # the operator toggled it
        return downs

    def _entity(self, view: SourceView, frame: EntityFrame, i: int) -> EntityRef:
        if frame.kind == NIC_PORT:
            device, _, port = frame.ids[i].partition("/")
            return EntityRef(cluster=view.cluster, node=view.source, device=device, port=port)
        return EntityRef(cluster=view.cluster, switch=view.source, port=frame.ids[i])

    def _down(self, view: SourceView, frame: EntityFrame, i: int, downs: float) -> list[Finding]:
        entity = self._entity(view, frame, i)
        key = f"link_flap:{entity.path()}"
        episode = self._episodes.get(key)
        if episode is None:
            finding = Finding("link_flap", OPEN, entity, WARNING, onset_ns=view.time_ns, detected_ns=view.time_ns,
                              detector=DETECTOR)
            episode = self._episodes[key] = _Episode(finding, 0.0, view.time_ns)
        episode.downs += downs
        episode.last_down_ns = view.time_ns
        f = episode.finding
        f.severity = CRITICAL if episode.downs >= FLAPS_FOR_CRITICAL else WARNING
        f.evidence = [Evidence("link_down_events", episode.downs, 0, "events", f"since {f.onset_ns} ns")]
        name = f"{view.source} {frame.ids[i]}"
        f.summary = f"{name} went down {episode.downs:g} time(s)"
        f.probable_cause = "unstable link: cable, transceiver or peer port"
        f.suggested_action = ("inspect the cable and transceiver; consider isolating the link"
                              if f.severity == CRITICAL else "watch; clean or reseat the cable if it repeats")
        if f.state == OPEN and episode.downs == downs:
            return [f]
        f.state, f.detected_ns = UPDATE, view.time_ns
        return [Finding(**{**f.__dict__, "evidence": list(f.evidence)})]

    def _resolve_quiet(self, view: SourceView) -> list[Finding]:
        out = []
        for key, episode in list(self._episodes.items()):
            f = episode.finding
            mine = f.entity.node == view.source or f.entity.switch == view.source
            if mine and view.time_ns - episode.last_down_ns > self.quiet_s * 1e9:
                del self._episodes[key]
                out.append(Finding("link_flap", RESOLVED, f.entity, f.severity, f.onset_ns, view.time_ns,
                                   f.evidence, summary=f"resolved: {f.summary}", detector=DETECTOR))
        return out
