"""Link down: a link that went down and stays down (a dead transceiver, a broken or pulled cable).

Reads NIC ports' sysfs ``state`` / ``phys_state`` labels, ``netdev_speed_mbps`` and
``port_xmit_data``; switch ports' ``oper_up`` and ``admin_up``. One rule:

* a port that is **expected up** (in the topology file, or seen up before: an unused port
  that was never cabled is not a fault) and reads down (NIC ``state`` not ``4: ACTIVE``;
  switch ``oper_up`` 0) on every sample for ``LINK_DOWN_HOLD_S`` opens ``link_down``;
  it resolves once the port has read up for ``LINK_UP_HOLD_S``.

How it shares the work with its neighbours (each down belongs to exactly one of them):

* ``link_flap`` takes the downs that are over within its ``MAX_DOWN_S``; the hold here is
  that same bound, so a down that outlasts it is an outage here and never a flap there
  (the flap detector drops downs longer than ``MAX_DOWN_S``);
* ``link_downgrade`` takes ports that are up but slow; a port that is not up is not its
  business;
* an operator's doing is no fault: a switch port with ``admin_up`` 0, a port whose cable
  peer (topology) is such a switch port, a NIC shut on the host (`link_flap.nic_shut_on_host`:
  ``phys_state`` ``3: Disabled`` with no readable netdev speed, see ``collectors.sysfs_nic``).
* a switch port facing a NIC (topology) is left to that NIC's node, which reports its own
  port: a node that reboots or powers off takes its links down too, and only the node
  itself can tell the two apart (a rebooting node sends nothing).

Evidence: how long it has been down; codewords the FEC could not correct before it died
(`fec.FecMemory`); the GPU the NIC serves (topology); NCCL's failover
to a sibling NIC of the same node, seen as that NIC transmitting about twice the bytes of
the node's other rails (it carries two rails now), or traffic that carries on over the other
rails: then the job runs on at reduced bandwidth (warning); otherwise the node's rails are
quiet, its collectives hang (critical).

Only what a tick carries is judged: a NIC tick without a ``state`` label (a PFC-only tick)
or a switch tick without ``oper_up`` says nothing; samples further apart than
``MAX_SAMPLE_GAP_S`` restart the hold.

>>> import numpy as np
>>> from fabricwatch.models.frames import EntityFrame, SourceView
>>> def nic(t_s, state):
...     f = EntityFrame("nic_port", ("mlx5_0/1",), (), np.zeros((1, 0), np.uint64), ("netdev_speed_mbps",),
...                     np.array([[-1.0 if state != "4: ACTIVE" else 400000.0]]), [{"state": state}])
...     return SourceView("c1", "node-1", "node", int(t_s * 1e9), 0, [f])
>>> det = LinkDownDetector()
>>> [det.update(nic(t, s)) for t, s in ((0, "4: ACTIVE"), (1, "1: DOWN"), (11, "1: DOWN"), (21, "1: DOWN"))]
[[], [], [], []]
>>> [(f.kind, f.state, f.severity) for f in det.update(nic(31, "1: DOWN"))]   # down for 30 s
[('link_down', 'open', 'critical')]
>>> det.update(nic(32, "4: ACTIVE")), [f.state for f in det.update(nic(42, "4: ACTIVE"))]
([], ['resolved'])
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from .detector import Detector, PerTick
from .fec import FecMemory
from .findings import CRITICAL, OPEN, RESOLVED, UPDATE, WARNING, EntityRef, Evidence, Finding
from .frames import NIC_PORT, SWITCH_PORT, EntityFrame, FrameStack, LayoutGroup, SourceBatch, SourceView
from .link_flap import ACTIVE_STATE, MAX_DOWN_S, nic_shut_on_host
from .topology import Topology
from .vocabulary import LINK_DOWN

DETECTOR = "link_down/v1"
# Down on every sample for this long: beyond any flap (the flap detector's bound, so that each
# down is one or the other), beyond link retraining (IB and 400G Ethernet link training takes
# seconds) and beyond NCCL's retry budget (NCCL_IB_TIMEOUT=18 -> 4.096 us * 2^18 = 1.07 s per
# try, NCCL_IB_RETRY_CNT=7 tries: ~7.5 s): the job has failed over or is hung.
LINK_DOWN_HOLD_S = MAX_DOWN_S
# Up on every sample for this long resolves it; a port that drops again sooner stays one episode.
LINK_UP_HOLD_S = 10.0
# Samples of a port further apart than this (a silent or rebooting node) restart the hold:
# the down is only known on the samples that show it.
MAX_SAMPLE_GAP_S = 10.0
# NCCL failover: a sibling NIC carrying two rails sends ~2x the bytes of each other rail over
# the same steps (a synchronous collective moves a fixed volume per rail per step, whatever the
# speed). 1.6 leaves room for uneven rails and the seconds before NCCL moved the traffic.
FAILOVER_TX_RATIO = 1.6
# Time constant of the transmit-bytes averages compared above: several training steps.
FAILOVER_SMOOTHING_S = 10.0
# The other rails must carry real traffic for a ratio to mean anything (0.2 % of a 400G port).
FAILOVER_MIN_TX_BYTES_PER_S = 1e8
# Rails compared with the candidate: at least this many other up NICs on the node.
FAILOVER_MIN_REFERENCE_NICS = 2


@dataclass
class _Down:
    since_ns: int
    last_ns: int
    operator: bool = False


@dataclass
class _Episode:
    finding: Finding
    up_since_ns: int | None = None
    failover: str | None = None     # the sibling, "" for traffic spread over the other rails, None for none


@dataclass
class _Failover:
    """Per node while one of its NICs is down: smoothed transmit bytes/s per NIC."""
    ids: tuple[str, ...]
    tx: np.ndarray
    last_ns: int


@dataclass
class LinkDownDetector(PerTick, Detector):
    topology: Topology | None = None
    hold_s: float = LINK_DOWN_HOLD_S
    up_hold_s: float = LINK_UP_HOLD_S
    _down: dict[tuple[str, str], _Down] = field(default_factory=dict, repr=False)
    _episodes: dict[tuple[str, str], _Episode] = field(default_factory=dict, repr=False)
    _seen_up: dict[tuple[str, str], np.ndarray] = field(default_factory=dict, repr=False)   # (source, kind) -> bool[n]
    _seen_ids: dict[tuple[str, str], tuple[str, ...]] = field(default_factory=dict, repr=False)
    _admin_down: set[tuple[str, str]] = field(default_factory=set, repr=False)   # switch ports shut by an operator
    _failover: dict[str, _Failover] = field(default_factory=dict, repr=False)
    fec: FecMemory = field(default_factory=FecMemory, repr=False)

    def __post_init__(self) -> None:
        for name in ("hold_s", "up_hold_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)!r}")

    def reads(self, kind, counter_names, gauge_names, label_names) -> bool:
        if kind == NIC_PORT:
            return "state" in label_names
        return kind == SWITCH_PORT and bool({"oper_up", "admin_up"} & set(gauge_names))

    def update_batch(self, batch: SourceBatch) -> list[Finding]:
        """Records whose ports all read up, with nothing remembered of the source, only note
        that the ports were seen up; anything else goes tick by tick. FEC errors are noted
        on every record (`fec.FecMemory`)."""
        self.fec.note(batch)
        busy = False
        for stack in batch.stacks:
            if self.reads(stack.kind, stack.counter_names, stack.gauge_names, tuple(stack.labels)):
                if not self._all_up(batch.source, stack):
                    busy = True
        return super().update_batch(batch) if busy else []

    def screen(self, group: LayoutGroup) -> None:
        """Nothing to share across records: a record's check is one scan of its labels."""

    def _all_up(self, source: str, stack: FrameStack) -> bool:
        if any((source, eid) in d for d in (self._down, self._episodes) if d for eid in stack.ids):
            return False
        if stack.kind == NIC_PORT:
            checked = None
            for states in stack.labels.get("state", ()):
                if states is checked:
                    continue                         # one label list shared by the ticks
                checked = states
                if any(not s.startswith(ACTIVE_STATE) for s in states):
                    return False
        else:
            j, a = stack.gauge_column("oper_up"), stack.gauge_column("admin_up")
            if j is not None and (stack.gauges[:, :, j] == 0).any():
                return False
            if a is not None and (stack.gauges[:, :, a] == 0).any():
                return False
            if self._admin_down and any((source, eid) in self._admin_down for eid in stack.ids):
                return False                         # shut by an operator until now
        self._mark_up(source, stack.kind, stack.ids, np.ones(len(stack.ids), dtype=bool))
        return True

    def _mark_up(self, source: str, kind: str, ids: tuple[str, ...], up: np.ndarray) -> None:
        key = (source, kind)
        seen = self._seen_up.get(key)
        if seen is None or self._seen_ids.get(key) != ids:
            self._seen_up[key], self._seen_ids[key] = up.copy(), ids
        elif not seen.all():
            seen |= up

    # -- one tick -------------------------------------------------------------------------------
    def update(self, view: SourceView) -> list[Finding]:
        out: list[Finding] = []
        for frame in view.frames:
            if frame.kind == NIC_PORT:
                judged = self._nic_tick(view, frame)
            elif frame.kind == SWITCH_PORT:
                judged = self._switch_tick(view, frame)
            else:
                continue
            if judged is None:
                continue
            has, down, operator = judged
            self._mark_up(view.source, frame.kind, frame.ids, has & ~down)
            seen = self._seen_up[(view.source, frame.kind)]
            for i in np.flatnonzero(has).tolist():
                key = (view.source, frame.ids[i])
                if down[i]:
                    expected = bool(seen[i]) or self._in_topology(view.source, frame.kind, frame.ids[i])
                    out += self._down_tick(view, frame, i, key, bool(operator[i]), expected)
                else:
                    out += self._up_tick(view, key)
        return out

    def _nic_tick(self, view: SourceView, frame: EntityFrame):
        state = frame.label("state")
        has = np.array([bool(s) for s in state])
        if not has.any():
            return None
        down = has & np.array([not s.startswith(ACTIVE_STATE) for s in state])
        operator = np.zeros(len(frame.ids), dtype=bool)
        if down.any():
            operator |= down & nic_shut_on_host(frame)
            if self.topology is not None and self._admin_down:
                for i in np.flatnonzero(down).tolist():
                    nic = self.topology.nic(view.source, frame.ids[i])
                    operator[i] = operator[i] or (nic is not None and (nic.switch, nic.switch_port) in self._admin_down)
            self._track_failover(view, frame, down)
        elif view.source in self._failover:
            del self._failover[view.source]
        return has, down, operator

    def _switch_tick(self, view: SourceView, frame: EntityFrame):
        admin = frame.gauge("admin_up")
        for i in np.flatnonzero(admin == admin).tolist():      # read this tick (not NaN)
            key = (view.source, frame.ids[i])
            if admin[i] == 0:
                self._admin_down.add(key)
            else:
                self._admin_down.discard(key)
        oper = frame.gauge("oper_up")
        has = oper == oper
        if not has.any():
            return None
        down = has & (oper == 0)
        operator = admin == 0
        for i in np.flatnonzero(down).tolist():
            peer = self.topology.peer_of(view.source, frame.ids[i]) if self.topology is not None else None
            if peer is not None and peer.nic is not None:
                has[i] = False                       # the NIC's node judges this link
            elif peer is not None and (peer.switch, peer.port) in self._admin_down:
                operator[i] = True
        return has, down, operator

    def _in_topology(self, source: str, kind: str, entity_id: str) -> bool:
        if self.topology is None:
            return False
        if kind == NIC_PORT:
            return self.topology.nic(source, entity_id) is not None
        return self.topology.peer_of(source, entity_id) is not None

    def _down_tick(self, view: SourceView, frame: EntityFrame, i: int, key, operator: bool,
                   expected: bool) -> list[Finding]:
        episode = self._episodes.get(key)
        if episode is not None:
            episode.up_since_ns = None
            return self._failover_update(view, frame, i, key, episode)
        if not expected:
            return []
        down = self._down.get(key)
        if down is None or view.time_ns - down.last_ns > MAX_SAMPLE_GAP_S * 1e9:
            down = self._down[key] = _Down(view.time_ns, view.time_ns)
        down.last_ns = view.time_ns
        down.operator |= operator
        if down.operator or view.time_ns - down.since_ns < self.hold_s * 1e9:
            return []
        del self._down[key]
        return [self._open(view, frame, i, key, down)]

    def _up_tick(self, view: SourceView, key) -> list[Finding]:
        self._down.pop(key, None)
        episode = self._episodes.get(key)
        if episode is None:
            return []
        if episode.up_since_ns is None:
            episode.up_since_ns = view.time_ns
        if view.time_ns - episode.up_since_ns < self.up_hold_s * 1e9:
            return []
        del self._episodes[key]
        f = episode.finding
        return [Finding(LINK_DOWN, RESOLVED, f.entity, f.severity, f.onset_ns, view.time_ns, list(f.evidence),
                        summary=f"resolved: {f.summary}; up again for {self.up_hold_s:g} s", detector=DETECTOR,
                        related=list(f.related))]

    # -- findings -------------------------------------------------------------------------------
    def _open(self, view: SourceView, frame: EntityFrame, i: int, key, down: _Down) -> Finding:
        entity, related = self._entity(view, frame, i)
        f = Finding(LINK_DOWN, OPEN, entity, CRITICAL, onset_ns=down.since_ns, detected_ns=view.time_ns,
                    detector=DETECTOR, related=related)
        episode = self._episodes[key] = _Episode(f)
        self._describe(view, frame, i, episode, self._failover_of(view, frame, i))
        return self._emit(f, OPEN, view.time_ns)

    def _failover_update(self, view, frame, i, key, episode: _Episode) -> list[Finding]:
        if frame.kind != NIC_PORT:
            return []
        failover = self._failover_of(view, frame, i)
        if (failover[0] if failover else None) == episode.failover:
            return []
        self._describe(view, frame, i, episode, failover)
        return [self._emit(episode.finding, UPDATE, view.time_ns)]

    def _describe(self, view, frame, i, episode: _Episode, failover: tuple[str, float] | None) -> None:
        f = episode.finding
        down_s = (view.time_ns - f.onset_ns) / 1e9
        what = (f"state {frame.label('state')[i]}, phys_state {frame.label('phys_state')[i] or '?'}"
                if frame.kind == NIC_PORT else "oper-status down, admin-status up")
        f.evidence = [Evidence("down_for_s", round(down_s, 3), self.hold_s, "s", what)]
        nic = self.topology.nic(view.source, frame.ids[i]) if self.topology and frame.kind == NIC_PORT else None
        if nic is not None:
            f.evidence.append(Evidence("gpu_index", float(nic.gpu_index), 0, "index",
                                       f"GPU {nic.gpu_index} of {view.source} reaches the fabric through this NIC"))
        f.evidence += self.fec.evidence(view.source, frame.ids[i], view.time_ns)
        episode.failover = failover[0] if failover else None
        where = f"{view.source} {frame.ids[i]}"
        if failover:
            sibling, ratio = failover
            if sibling:
                f.evidence.append(Evidence("failover_nic", round(ratio, 3), FAILOVER_TX_RATIO, "x",
                                           f"{sibling} transmits {ratio:.2f}x the bytes of the node's other rails"))
                f.summary = f"{where} is down; NCCL failed over to {sibling}, which now carries two rails"
            else:
                f.evidence.append(Evidence("failover_spread", round(ratio, 3), FAILOVER_TX_RATIO, "x",
                                           "no sibling carries two rails, but the node's other rails carry on: "
                                           "the traffic moved to them (or the job does not use this rail)"))
                f.summary = f"{where} is down; the node's other rails carry on"
            f.severity = WARNING
            f.probable_cause = "dead link (cable, transceiver or peer port); traffic failed over, bandwidth reduced"
            f.suggested_action = "replace the cable or transceiver; drain the node after the job"
        elif frame.kind == NIC_PORT:
            f.severity = CRITICAL
            f.summary = (f"{where} has been down for {down_s:.0f} s; the node's rails are quiet: "
                         "no NIC took over its traffic")
            f.probable_cause = "dead link: cable, transceiver or peer port"
            f.suggested_action = "replace the cable or transceiver; jobs using this rail hang: drain the node"
        else:   # a switch-to-switch link is one of several ECMP paths: traffic reroutes, capacity drops
            f.severity = WARNING
            f.summary = f"{where} has been down for {down_s:.0f} s; traffic reroutes over the other links"
            f.probable_cause = "dead link: cable or optics of this switch link, or the peer port"
            f.suggested_action = "replace the cable or optics of this switch link"

    @staticmethod
    def _emit(f: Finding, state: str, now_ns: int) -> Finding:
        return Finding(**{**f.__dict__, "state": state, "detected_ns": now_ns, "evidence": list(f.evidence),
                          "related": list(f.related)})

    def _entity(self, view: SourceView, frame: EntityFrame, i: int) -> tuple[EntityRef, list[EntityRef]]:
        related: list[EntityRef] = []
        if frame.kind == NIC_PORT:
            device, _, port = frame.ids[i].partition("/")
            nic = self.topology.nic(view.source, frame.ids[i]) if self.topology is not None else None
            if nic is not None:
                related = [EntityRef(cluster=view.cluster, switch=nic.switch, port=nic.switch_port),
                           EntityRef(cluster=view.cluster, node=view.source, device=f"gpu{nic.gpu_index}")]
            return EntityRef(cluster=view.cluster, node=view.source, device=device, port=port), related
        peer = self.topology.peer_of(view.source, frame.ids[i]) if self.topology is not None else None
        if peer is not None and peer.switch:
            related = [EntityRef(cluster=view.cluster, switch=peer.switch, port=peer.port)]
        return EntityRef(cluster=view.cluster, switch=view.source, port=frame.ids[i]), related

    # -- NCCL failover ------------------------------------------------------------------------
    def _track_failover(self, view: SourceView, frame: EntityFrame, down: np.ndarray) -> None:
        """Smoothed transmit bytes/s of every NIC of the node while one of them is down."""
        rate = frame.rate("port_xmit_data")
        state = self._failover.get(view.source)
        dt_s = float(frame.dt_s) if np.isfinite(frame.dt_s) else 1.0
        if state is None or state.ids != frame.ids or view.time_ns - state.last_ns > MAX_SAMPLE_GAP_S * 1e9:
            # from 0: what the rails carried before the down fades out of the average
            state = self._failover[view.source] = _Failover(frame.ids, np.zeros(len(frame.ids)), view.time_ns)
        a = 1.0 - np.exp(-max(dt_s, 0.0) / FAILOVER_SMOOTHING_S)
        fresh = np.isfinite(rate)
        state.tx = np.where(fresh, state.tx + a * (rate - state.tx), state.tx)
        state.last_ns = view.time_ns

    def _failover_of(self, view: SourceView, frame: EntityFrame, i: int) -> tuple[str, float] | None:
        """(sibling, its bytes over the median of the other up rails) when a sibling carries two rails;
        ("", that ratio) when none does but the other rails carry on (NCCL spread the traffic: with
        a dead rail and no failover a collective blocks, and every rail of the node goes quiet);
        None when the node's rails are quiet."""
        state = self._failover.get(view.source)
        if state is None or state.ids != frame.ids:
            return None
        states = frame.label("state")
        up = np.array([s.startswith(ACTIVE_STATE) for s in states]) & np.isfinite(state.tx)
        cands = np.flatnonzero(up)
        if len(cands) < FAILOVER_MIN_REFERENCE_NICS + 1:
            return None
        k = int(cands[np.argmax(state.tx[cands])])
        reference = float(np.median(state.tx[cands[cands != k]]))
        if not reference >= FAILOVER_MIN_TX_BYTES_PER_S:
            return None
        ratio = float(state.tx[k]) / reference
        return (frame.ids[k] if ratio >= FAILOVER_TX_RATIO else "", ratio)
