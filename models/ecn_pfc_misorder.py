"""ECN marking after PFC: a switch that pauses under incast before it marks.

DCQCN (Zhu et al., "Congestion Control for Large-Scale RDMA Deployments", SIGCOMM 2015,
§5) only works when a congested egress queue marks ECN *before* its ingress buffer
reaches the PFC XOFF threshold: the ECN/WRED marking thresholds (Kmin, Kmax) must sit
below XOFF, so that the senders slow down (CNP -> rate cut) and PFC (IEEE 802.1Qbb) stays
the last resort. A switch whose marking thresholds sit above XOFF (a buffer profile
changed without the WRED/ECN profile, a platform default, a typo in ``WRED_PROFILE``
``green_min_threshold``) pauses first: the queue never reaches Kmin because PFC stops the
upstream before it does. Its ports then send pause frames under incast with few or no ECN
marks, while its peers, under the same kind of load, mark first.

Counters read (`fabricwatch.counters`), per switch port and lossless priority ``p``:

* ``pfc<p>-tx-pkts``: pause frames the port *sent* (SAI ``PFC_<p>_TX_PKTS``, OpenConfig /
  Cumulus ``out-pause-pkts``), and ``pfc<p>-tx-pause-duration-us`` where exported;
* ``queue<p>-ecn-marked-pkts``: packets the egress queue marked CE (SONiC COUNTERS_DB
  ``SAI_QUEUE_STAT_WRED_ECN_MARKED_PACKETS``, Cumulus ``ecn-marked-pkts``);
* ``pfc<p>-rx-pause-duration-us``: pauses the port *received*: a switch held by its peer
  (a PFC storm, a paused downstream) sends pauses that are back-pressure, not incast, and
  such windows are no evidence either way.

Per switch and priority, over windows of `WINDOW_S`: whether some port paused for a
meaningful share of the window, no single port sent more than `MAX_TOP_PORT_SHARE` of
the switch's pause frames (incast pauses several senders; one port's pauses are a storm or
a slow peer, `pfc_storm`'s), and then the switch's **ECN marks per pause frame**, over
all its ports (under incast the ports that pause are the ingress ports facing the
senders, the port that marks is the egress port facing the receiver).
A window is *misordered* when that ratio is below `PEER_FRACTION` of its peers' median
(switches of the same role seen by this stage whose own recent windows had pauses) where
the peers mark healthily (a median of at least `MIN_MARKS_PER_PAUSE_FRAME`): its marking
thresholds then sit far above theirs, whatever the floor says; without such peers (too
few, or all marking under the floor: a fleet-wide misconfiguration) the DCQCN floor
`MIN_MARKS_PER_PAUSE_FRAME` decides alone. `PERSIST_WINDOWS`
misordered windows in a row open an ``ecn_pfc_misorder`` (a window without pauses is no
evidence and keeps the count); `CLEAR_WINDOWS` healthy ones resolve it.

Why the peers are the stage's: stage 1 is partitioned by source hash, so the switches of a
partition are a random sample of the fleet (hundreds at 100,000 GPUs; all of them in
replay). No new fact or stage is needed, and the absolute floor keeps a lone switch honest.

>>> import numpy as np
>>> from fabricwatch.models.frames import FrameStack, SourceBatch
>>> names = ("pfc3-tx-pkts", "queue3-ecn-marked-pkts")
>>> def tick(sw, t_s, frames_s, marks_s):        # two sender-facing ports pause alike
...     s = FrameStack("switch_port", ("Ethernet0", "Ethernet1"), names, (), np.array([0]),
...                    np.zeros((1, 2, 2), np.uint64), np.empty((1, 2, 0)))
...     s.rates, s.dt_s = np.array([[[frames_s, marks_s]] * 2]).reshape(1, 2, 2), np.array([1.0])
...     return SourceBatch("c1", sw, "switch", np.array([int(t_s * 1e9)]), [s])
>>> det = EcnPfcMisorderDetector()
>>> found = []
>>> for t in range(1, 62):
...     for sw in ("leaf-1", "leaf-2", "leaf-3"):
...         found += det.update_batch(tick(sw, t, 20_000, 200_000))   # mark first: 10 per pause
...     found += det.update_batch(tick("leaf-4", t, 20_000, 100))       # pauses, hardly marks
>>> [(f.kind, f.state, f.entity.path(), f.evidence[0].name) for f in found]
[('ecn_pfc_misorder', 'open', 'c1/leaf-4/queue3', 'ecn_marks_per_pause_frame')]
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from .detector import Detector
from .findings import OPEN, RESOLVED, WARNING, EntityRef, Evidence, Finding
from .frames import SWITCH_PORT, FrameStack, SourceBatch
from .topology import Topology
from .vocabulary import ECN_PFC_MISORDER, ECN_THRESHOLD_ABOVE_XOFF

DETECTOR = "ecn_pfc_misorder/v1"
KIND = ECN_PFC_MISORDER
CAUSE = ECN_THRESHOLD_ABOVE_XOFF
# PFC-enabled priorities: SONiC's default lossless queues ("pfc_enable": "3,4" in
# PORT_QOS_MAP); RoCE runs on 3 in NVIDIA's and most operators' configurations.
LOSSLESS_PRIORITIES = (3, 4)
# One judgement per switch per window: long enough to hold several incast episodes (a
# collective's burst lasts a fraction of a second), short enough to answer within a minute.
WINDOW_S = 10.0
# A port "pauses" in a window when it sent at least this many pause frames per second: at
# 400G an XOFF is refreshed every ~42 us, so this is ~2.5 % of the time in continuous XOFF
# and more for short XOFF/XON episodes; a few stray pauses are normal and say nothing.
MIN_PAUSE_FRAMES_PER_S = 1000.0
# ... or, where the switch exports how long it paused, at least this share of the window.
MIN_PAUSE_DUTY = 0.01
# A port paused by its own peer this share of the window propagates back-pressure (a PFC
# storm, a paused downstream switch): the pauses this switch then sends are not incast,
# and the window is no evidence.
PROPAGATED_RX_PAUSE_DUTY = 0.1
# Incast is many-to-one: the pauses it causes go out of the ports of several senders. A
# window in which one port sent more than this share of the switch's pause frames is a
# held or storming port (a slow receiver, a PFC storm: pfc_storm's), not incast: no evidence.
MAX_TOP_PORT_SHARE = 0.5
# Below one ECN mark per pause frame sent, marking did not precede pausing: with Kmin <
# XOFF every packet queued between them may be marked (tens of packets before the first
# XOFF of an episode, more while the queue stays above Kmin), i.e. many marks per pause.
MIN_MARKS_PER_PAUSE_FRAME = 1.0
# "Far below its peers": an order of magnitude under their median ratio. Within that, the
# switch marks like its peers do (a floor that does not fit this fleet says nothing).
PEER_FRACTION = 0.1
# Peers needed for their median to say anything; fewer: the absolute floor alone.
MIN_PEERS = 3
# A peer's window counts this long after it closed (peers pause at other moments).
PEER_MEMORY_S = 600.0
# Misordered windows in a row that open a finding: a misconfiguration persists, a chance
# window (an incast burst that began and ended between marks) does not.
PERSIST_WINDOWS = 3
# Healthy windows (pausing and marking) in a row that resolve it.
CLEAR_WINDOWS = 3
# Switches tracked at most, layouts remembered at most (bounded state).
MAX_SWITCHES = 20_000
MAX_LAYOUTS = 4096


@dataclass
class _Window:
    """One switch's sums over the current window, per lossless priority and port."""
    start_ns: int
    ids: tuple[str, ...]
    seconds: float = 0.0
    frames: np.ndarray = field(default=None)      # [prio, port] pause frames sent
    marks: np.ndarray = field(default=None)       # [prio, port] ECN-marked packets
    paused_s: np.ndarray = field(default=None)    # [prio, port] seconds paused (sent); NaN: not exported
    held_s: np.ndarray = field(default=None)      # [prio, port] seconds paused by the peer; NaN: not exported


@dataclass
class _State:
    window: _Window | None = None
    streak: np.ndarray = field(default_factory=lambda: np.zeros(len(LOSSLESS_PRIORITIES), np.int64))
    healthy: np.ndarray = field(default_factory=lambda: np.zeros(len(LOSSLESS_PRIORITIES), np.int64))
    open: dict = field(default_factory=dict)      # prio index -> open Finding


_COLUMNS = [(f"pfc{p}-tx-pkts", f"queue{p}-ecn-marked-pkts", f"pfc{p}-tx-pause-duration-us",
             f"pfc{p}-rx-pause-duration-us") for p in LOSSLESS_PRIORITIES]


def _cols(stack: FrameStack) -> list[tuple[int, int, int | None, int | None] | None]:
    out = []
    for frames, marks, paused, held in _COLUMNS:
        f, m = stack.column(frames), stack.column(marks)
        out.append(None if f is None or m is None else (f, m, stack.column(paused), stack.column(held)))
    return out


class EcnPfcMisorderDetector(Detector):
    """Stage-1 rule over switch sources; the peers are the switches this stage sees."""

    def __init__(self, topology: Topology | None = None) -> None:
        self.topology = topology
        self._state: dict[str, _State] = {}
        # (cluster, role, prio index) -> {switch: (ratio, window end ns)}
        self._ratios: dict[tuple[str, str, int], dict[str, tuple[float, int]]] = {}
        self._layouts: dict[tuple[str, ...], list] = {}      # counter names -> columns read

    def screen(self, group) -> None:
        """Nothing to share across records: a record costs a layout lookup and a few sums."""

    def update_batch(self, batch: SourceBatch) -> list[Finding]:
        if batch.source_kind != "switch":
            return []
        for stack in batch.stacks:
            if stack.kind != SWITCH_PORT or stack.rates is None or stack.dt_s is None:
                continue
            cols = self._layouts.get(stack.counter_names)
            if cols is None:
                if len(self._layouts) >= MAX_LAYOUTS:
                    self._layouts.clear()
                cols = self._layouts[stack.counter_names] = _cols(stack)
            if any(c is not None for c in cols):
                return self._update(batch, stack, cols)
        return []

    # -- windows ------------------------------------------------------------------------------
    def _update(self, batch: SourceBatch, stack: FrameStack, cols: list) -> list[Finding]:
        state = self._state.get(batch.source)
        if state is None:
            if len(self._state) >= MAX_SWITCHES:
                self._state.pop(next(iter(self._state)))
            state = self._state[batch.source] = _State()
        out: list[Finding] = []
        dt = np.nan_to_num(np.asarray(stack.dt_s, float))
        # only the columns read, NaN (a reset, the first tick) as no evidence; columns renumbered
        used = sorted({c for col in cols if col is not None for c in col if c is not None})
        rates = np.nan_to_num(stack.rates[:, :, used])
        at = {c: k for k, c in enumerate(used)}
        cols = [None if col is None else tuple(None if c is None else at[c] for c in col) for col in cols]
        times = stack.times_ns if stack.times_ns is not None else batch.times_ns
        for k in range(len(dt)):
            w = state.window
            if w is None or w.ids != stack.ids:
                w = state.window = self._new_window(int(times[k]), stack.ids)
            w.seconds += dt[k]
            for j, c in enumerate(cols):
                if c is None:
                    continue
                f, m, paused, held = c
                w.frames[j] += rates[k, :, f] * dt[k]
                w.marks[j] += rates[k, :, m] * dt[k]
                if paused is not None:
                    w.paused_s[j] = np.nan_to_num(w.paused_s[j]) + rates[k, :, paused] * dt[k]
                if held is not None:
                    w.held_s[j] = np.nan_to_num(w.held_s[j]) + rates[k, :, held] * dt[k]
            if int(times[k]) - w.start_ns >= WINDOW_S * 1e9:
                out += self._judge(batch.cluster, batch.source, state, int(times[k]))
                state.window = None
        return out

    @staticmethod
    def _new_window(start_ns: int, ids: tuple[str, ...]) -> _Window:
        shape = (len(LOSSLESS_PRIORITIES), len(ids))
        return _Window(start_ns, ids, 0.0, np.zeros(shape), np.zeros(shape), np.full(shape, np.nan),
                       np.full(shape, np.nan))

    def _role(self, switch: str) -> str:
        sw = self.topology.switches.get(switch) if self.topology is not None else None
        return sw.role if sw is not None else ""

    def _judge(self, cluster: str, switch: str, state: _State, now_ns: int) -> list[Finding]:
        w = state.window
        out: list[Finding] = []
        if w is None or w.seconds <= 0:
            return out
        frames_s, marks_s = w.frames / w.seconds, w.marks / w.seconds
        duty = w.paused_s / w.seconds
        pausing = (frames_s >= MIN_PAUSE_FRAMES_PER_S) | (np.nan_to_num(duty) >= MIN_PAUSE_DUTY)
        held = np.nan_to_num(w.held_s / w.seconds) >= PROPAGATED_RX_PAUSE_DUTY
        for j, prio in enumerate(LOSSLESS_PRIORITIES):
            ports = pausing[j]
            if not ports.any() or held[j].any():
                continue                                   # no incast, or back-pressure: no evidence
            # the whole switch: the ports that pause (ingress, toward the senders) are not the
            # ports that mark (egress, toward the incast's receiver)
            frames, marks = float(frames_s[j].sum()), float(marks_s[j].sum())
            if frames_s[j].max() > MAX_TOP_PORT_SHARE * frames:
                continue                                   # one port's pauses: a storm or a slow peer, not incast
            ratio = marks / frames
            peers_key = (cluster, self._role(switch), j)
            table = self._ratios.setdefault(peers_key, {})
            peers = [r for s, (r, t) in table.items() if s != switch and now_ns - t <= PEER_MEMORY_S * 1e9]
            table[switch] = (ratio, now_ns)
            if len(table) > MAX_SWITCHES:
                table.pop(next(iter(table)))
            median = float(np.median(peers)) if len(peers) >= MIN_PEERS else float("nan")
            # healthy peers decide where they exist (an order of magnitude under them, whatever
            # the floor); without them (or if they too mark under the floor) the floor does
            healthy_peers = median >= MIN_MARKS_PER_PAUSE_FRAME
            below = ratio < PEER_FRACTION * median if healthy_peers else ratio < MIN_MARKS_PER_PAUSE_FRAME
            if below:
                state.streak[j] += 1
                state.healthy[j] = 0
                if state.streak[j] >= PERSIST_WINDOWS and j not in state.open:
                    worst = int(np.argmax(frames_s[j]))
                    f = self._finding(cluster, switch, prio, now_ns, w, ratio, median, frames, marks,
                                      int(ports.sum()), w.ids[worst], len(peers))
                    state.open[j] = f
                    out.append(f)
            else:
                state.streak[j] = 0
                state.healthy[j] += 1
                if j in state.open and state.healthy[j] >= CLEAR_WINDOWS:
                    f = state.open.pop(j)
                    out.append(Finding(**{**f.__dict__, "state": RESOLVED, "detected_ns": now_ns,
                                          "evidence": list(f.evidence), "related": list(f.related)}))
        return out

    def _finding(self, cluster: str, switch: str, prio: int, now_ns: int, w: _Window, ratio: float,
                 median: float, frames_s: float, marks_s: float, n_ports: int, worst: str,
                 n_peers: int) -> Finding:
        peer_text = (f"{median:.3g} on its {n_peers} peers" if median == median
                     else f"no peers to compare ({n_peers} < {MIN_PEERS}): the DCQCN floor alone")
        evidence = [
            Evidence("ecn_marks_per_pause_frame", round(ratio, 4), MIN_MARKS_PER_PAUSE_FRAME, "marks/frame",
                     f"ECN marks of queue {prio} per PFC pause frame sent, over the switch ({n_ports} ports pausing); "
                     f"{peer_text}"),
            Evidence("pause_frames_per_s", round(frames_s, 1), MIN_PAUSE_FRAMES_PER_S, "frames/s",
                     f"priority-{prio} pause frames the switch sent per second"),
            Evidence("ecn_marks_per_s", round(marks_s, 1), 0, "packets/s",
                     f"packets its queues {prio} marked CE per second"),
            Evidence("misordered_windows", PERSIST_WINDOWS, PERSIST_WINDOWS, "windows",
                     f"{WINDOW_S:g} s windows in a row that paused before marking"),
        ]
        if median == median:
            evidence.append(Evidence("peer_ecn_marks_per_pause_frame", round(median, 4),
                                     round(PEER_FRACTION * median, 4), "marks/frame",
                                     f"median over {n_peers} switches of the same role that paused recently"))
        return Finding(
            KIND, OPEN, EntityRef(cluster=cluster, switch=switch, device=f"queue{prio}"), severity=WARNING,
            onset_ns=w.start_ns - int((PERSIST_WINDOWS - 1) * WINDOW_S * 1e9), detected_ns=now_ns,
            evidence=evidence, confidence=0.9 if median == median else 0.7,
            probable_cause=(f"the ECN (WRED) marking thresholds of queue {prio} sit above the PFC XOFF threshold: "
                            "the switch pauses its upstream before it marks, so DCQCN senders never slow down"),
            cause=CAUSE,
            suggested_action=(f"lower the ECN (WRED) min/max marking thresholds of queue {prio} on {switch} below "
                              f"the PFC XOFF threshold (or raise XOFF: the PG headroom xoff / buffer profile of "
                              f"priority {prio}); worst port {worst}"),
            summary=(f"{switch} pauses priority {prio} under incast before marking ECN: {ratio:.3g} marks per pause "
                     f"frame on {n_ports} ports ({peer_text})"),
            detector=DETECTOR,
            related=[EntityRef(cluster=cluster, switch=switch, port=worst)])
