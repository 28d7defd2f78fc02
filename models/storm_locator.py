"""PFC storm source localisation: which port started it, which ports it holds.

Reads `pfc_storm.PauseStateChange` records from every node's and switch's watchdog, in
any order across sources, and the fabric `Topology` (NIC port <-> leaf port <-> spine).
Emits `pfc_storm` findings named after the storm's **source**, with its victims in
``related``: OPEN as soon as a source is confirmed (victims are not waited for), UPDATE
when the victim set grows materially, RESOLVED when the source restores.

How the source is found, per priority:

* A port is *held* when its watchdog says "paused". A switch port *pauses its peer*
  when its watchdog says "pausing" (a SONiC switch exports the duration of the pauses it
  sends, SAI ``PFC_x_TX_PAUSE_DURATION_US``), or when that peer is held (EOS and Cumulus
  export no such duration: the peer's received-pause duty is the measurement). A switch
  is *congested* on p when one of its own ports is held, or faces a port that is pausing:
  its ingress buffers fill and it pauses whoever feeds it. That is how a storm propagates
  upstream. Neither role is confirmed without something stuck behind it (the watchdog's
  demand evidence), so an idle node is never named.
* **NIC root** (confidence 1.0): a NIC whose watchdog says "pausing". A NIC that keeps
  its leaf silent while receiving ~nothing is the classic stuck host.
* **Silent-source root** (`SILENT_SOURCE_CONFIDENCE`): a leaf port held by its NIC peer,
  when that NIC has not been confirmed pausing for `orphan_grace_ms` (its node is silent,
  or its NIC exports no transmitted-pause duration). The leaf port is the most upstream
  port the telemetry shows; the NIC is named in the summary and evidence.
* **Switch root** (`SWITCH_SOURCE_CONFIDENCE`): a switch port pausing its peer, on a switch
  that has not been congested on p for `orphan_grace_ms`: nothing explains the pauses.
  A pausing switch port on a congested switch is propagation, never a root.
* **Victims** of a root: the held ports reached from it, walking upstream: its leaf port,
  then the held peers of the congested leaf's ports (NICs, spine ports), then the held
  peers of those spines' ports, and so on. Blast radius: victim ports, their nodes and,
  after `set_jobs`, the jobs running on the source's and the victims' nodes.

The grace period keeps a half-arrived picture (a victim's node reported before the
congested switch did, a victim restored one sample after its source) from inventing a
root. It runs on event time: the **low watermark** of the sources once the producer sends
`SourceProgress` records (stage 1 of the pipeline does), else the largest ``at_ns`` seen.

Low watermark. While a worker catches up on a backlog, the switches' telemetry may be
processed seconds ahead of the nodes'; judged on the newest record, the grace of a picture
whose pausing NIC has not been read yet would expire and name a leaf port. So the grace
runs on the minimum, over the *live* sources, of how far each has been processed
(`SourceProgress`, and every change's ``at_ns``); until a source has reported, it counts as
not processed past the first record the locator saw (every node and switch of the topology
is expected). A source is live while it progresses: one that has not advanced while the
newest source advanced `SOURCE_LIVENESS_MS` (a dead or partitioned node) is dropped from
the minimum, so its silent-source root is named after grace + liveness, not never; one
more than `SOURCE_MAX_LAG_MS` behind the newest (a clock far behind) is not waited for
either. Cost: a few dict operations per source and record (~0.7 µs), and a scan of the
occupied `watermark.BUCKET_MS` buckets per record (a handful while sources are current).
Limits: a backlog read so unevenly that a source is not read at all while another advances
by the liveness window still expires graces early; a source whose clock lags (within the
maximum lag) delays silent-source and switch roots by its lag (NIC roots never wait); one
whose clock runs more than the maximum lag ahead makes every other source look lagging,
and the clock is then that source's, as it was before the watermark.

>>> from fabricwatch.models.topology import rail_optimised
>>> from fabricwatch.models.findings import EntityRef
>>> from fabricwatch.models.pfc_storm import PauseStateChange
>>> topo = rail_optimised("c1", n_nodes=4, nodes_per_unit=4, n_spines=1)
>>> loc = StormLocator(topo)
>>> loc.set_jobs({"node-0001": {"job-7"}, "node-0003": {"job-9"}})
>>> nic = lambda n, d: EntityRef("c1", node=n, device=d, port="1")
>>> src = PauseStateChange(nic("node-0003", "mlx5_2"), 3, "pausing", True, 0, 200_000_000)
>>> [(f.state, f.entity.path(), f.related) for f in loc.update(src)]
[('open', 'c1/node-0003/mlx5_2/1', [])]
>>> leaf = PauseStateChange(EntityRef("c1", switch="leaf-u0-r2", port="Ethernet2"), 3, "paused", True,
...                         0, 200_000_000)
>>> victim = PauseStateChange(nic("node-0001", "mlx5_2"), 3, "paused", True, 0, 210_000_000)
>>> [(f.state, f.summary) for c in (leaf, victim) for f in loc.update(c)]     # victims: 0 -> 1 -> 2
[('update', 'PFC storm on prio 3 from node-0003 mlx5_2/1: 1 victim port behind leaf-u0-r2; job job-9'),
 ('update', 'PFC storm on prio 3 from node-0003 mlx5_2/1: 2 victim ports behind leaf-u0-r2 on 1 node;
  jobs job-7, job-9')]
>>> [r.path() for r in loc.open_findings()[0].related]
['c1/leaf-u0-r2/Ethernet2', 'c1/node-0001/mlx5_2/1']
>>> [(f.state, f.entity.path()) for f in loc.update(PauseStateChange(src.entity, 3, "pausing", False, 0, 900_000_000))]
[('resolved', 'c1/node-0003/mlx5_2/1')]
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

from .detector import ChangeDetector
from .findings import CRITICAL, OPEN, RESOLVED, UPDATE, EntityRef, Evidence, Finding
from .pfc_storm import PAUSED, PAUSING, PauseStateChange
from .topology import Topology
from .watermark import LowWatermark
from .vocabulary import PFC_STORM, SILENT_HOST, STUCK_HOST, SWITCH_PORT

DETECTOR = "pfc_storm/v1"
KIND = PFC_STORM
# Cause codes of a storm source (AnomalyEvent.cause_code), by how the source was found.
CAUSE_STUCK_HOST, CAUSE_SILENT_HOST, CAUSE_SWITCH_PORT = STUCK_HOST, SILENT_HOST, SWITCH_PORT
NIC_SOURCE_CONFIDENCE = 1.0
# The source's own NIC is not reporting: the leaf port it holds is named instead.
SILENT_SOURCE_CONFIDENCE = 0.6
# No NIC or held port explains a switch port's pausing (buffer/config fault, or a blind spot).
SWITCH_SOURCE_CONFIDENCE = 0.8
# How long an unexplained picture must last before it is believed (event time). The
# watchdogs of a source's node and of its leaf confirm within one sampling interval of
# each other; a second without the source is a silent node, not a race.
ORPHAN_GRACE_MS = 1000
# A leaf port still held after its NIC, which paused during the hold, stopped: the leaf's
# restoration lags the NIC's by up to a switch sampling interval (1 s) plus the restoration
# time; the NIC reports, so it is not silent unless the hold outlasts this.
RESTORATION_LAG_MS = 3000
# A source that has not progressed while the newest source advanced this much (event
# time) is not waited for: dead, partitioned, or its partition is not being read. Several
# seconds of uneven catch-up must fit; a silent source root waits this much longer.
SOURCE_LIVENESS_MS = 10_000
# A source this far behind the newest is not waited for even while it progresses (a clock
# minutes behind must not hold every grace period back by as much).
SOURCE_MAX_LAG_MS = 60_000
# UPDATE when the victim count reaches this multiple of the last reported count (or
# goes from none to some): a storm's victims confirm over a few samples, so smaller
# steps would only repeat the OPEN.
UPDATE_GROWTH_FACTOR = 1.5
# Longest list of names written into a summary or evidence detail.
MAX_NAMES = 8

_NIC, _PORT = "nic", "port"
NodeKey = tuple[str, str, str]      # ("nic", node, "mlx5_2/1") | ("port", switch, "Ethernet3")


@dataclass
class SourceProgress:
    """Stage 1 has processed each of these streams of ``cluster`` through the given event time.

    Every `PauseStateChange` of those streams up to that time was emitted before this
    record, on the same partition: the locator may judge them complete up to there. A
    stream is a source (one node or switch) or, from the worker, a whole telemetry
    partition (the low watermark of its sources); ``expect`` then names every stream the
    locator must wait for (each partition of the topic) instead of the topology's sources.
    A partition's progress is about every cluster (``cluster`` empty: the storm stage
    keeps the watermark over partitions, `streams.storm_stage`); ``idle``: the partition
    has nothing left to read, not to be waited for until it reports again, as long as it
    still ends at ``end_offset`` (its reader has read every record before that offset; None:
    trusted as it stands, a record from before end offsets were sent).
    """

    cluster: str
    through_ns_by_source: dict[str, int]
    expect: tuple[str, ...] = ()
    idle: bool = False
    end_offset: int | None = None


def _source(ref: EntityRef) -> str:
    return ref.switch or ref.node


def _key(ref: EntityRef) -> NodeKey:
    if ref.switch:
        return (_PORT, ref.switch, ref.port)
    return (_NIC, ref.node, f"{ref.device}/{ref.port}" if ref.port else ref.device)


def _name(key: NodeKey) -> str:
    return f"{key[1]} {key[2]}"


def _count(n: int, what: str) -> str:
    return f"{n} {what}" + ("" if n == 1 else "s")


@dataclass
class _Root:
    key: NodeKey
    prio: int
    how: str                        # "nic" | "silent" | "switch"
    entity: EntityRef
    onset_ns: int
    confidence: float
    peer: NodeKey | None = None     # silent: the NIC suspected; switch: the port it pauses
    evidence_from: PauseStateChange | None = None


@dataclass
class _Storm:
    root: _Root
    reported: set = field(default_factory=set)
    last: Finding | None = None


class StormLocator(ChangeDetector):
    """Cluster-level PFC storm correlation over `PauseStateChange` records.

    Parameters
    ----------
    topology : the fabric; ports it does not know are still reported, without a walk.
    cluster : cluster name for the entities the locator names itself (default: the topology's).
    orphan_grace_ms : how long a silent-source or switch-root picture must hold (event time).
    source_liveness_ms : a source that has not progressed while the newest source advanced
        this much is dropped from the low watermark.
    source_max_lag_ms : a source further behind the newest than this is dropped from it too.
    """

    def __init__(self, topology: Topology, cluster: str = "", orphan_grace_ms: int = ORPHAN_GRACE_MS,
                 source_liveness_ms: int = SOURCE_LIVENESS_MS, source_max_lag_ms: int = SOURCE_MAX_LAG_MS) -> None:
        self.topology = topology
        self.cluster = cluster
        self.orphan_grace_ms = orphan_grace_ms
        self.source_liveness_ms = source_liveness_ms
        self.source_max_lag_ms = source_max_lag_ms
        if not 0 <= orphan_grace_ms <= 60_000:
            raise ValueError(f"orphan_grace_ms must be within 0..60000, got {orphan_grace_ms!r}")
        if not 0 < source_liveness_ms <= 600_000:
            raise ValueError(f"source_liveness_ms must be within 1..600000, got {source_liveness_ms!r}")
        if not source_liveness_ms <= source_max_lag_ms <= 3_600_000:
            raise ValueError(f"source_max_lag_ms must be within source_liveness_ms..3600000, "
                             f"got {source_max_lag_ms!r}")
        self._cluster = cluster or topology.cluster
        self._grace_ns = orphan_grace_ms * 1_000_000
        self._restoration_lag_ns = max(0, RESTORATION_LAG_MS * 1_000_000 - self._grace_ns)
        self._peer: dict[NodeKey, NodeKey] = {}
        self._switch_ports: dict[str, list[str]] = {}
        for nic in topology.nic_ports:
            a, b = (_NIC, nic.node, nic.entity_id), (_PORT, nic.switch, nic.switch_port)
            self._peer[a], self._peer[b] = b, a
            self._switch_ports.setdefault(nic.switch, []).append(nic.switch_port)
        for link in topology.links:
            a, b = (_PORT, link.a_switch, link.a_port), (_PORT, link.b_switch, link.b_port)
            self._peer[a], self._peer[b] = b, a
            self._switch_ports.setdefault(link.a_switch, []).append(link.a_port)
            self._switch_ports.setdefault(link.b_switch, []).append(link.b_port)
        self._jobs: dict[str, frozenset[str]] = {}
        self._reset()

    def _reset(self) -> None:
        # latest transition per (entity, priority, role), active or not (drops stale records)
        self._last: dict[tuple[NodeKey, int, str], PauseStateChange] = {}
        self._held: dict[int, dict[NodeKey, PauseStateChange]] = {}
        self._pausing: dict[int, dict[NodeKey, PauseStateChange]] = {}
        self._storms: dict[tuple[NodeKey, int], _Storm] = {}
        self._now_ns = 0                # the clock grace periods run on
        self._watermark = LowWatermark(self.source_liveness_ms * 1_000_000, self.source_max_lag_ms * 1_000_000)
        self._on_watermark = False      # set by the first SourceProgress
        self._by_stream = False         # progress per stream (partition), not per source

    def __setstate__(self, state: dict) -> None:
        # Checkpoints written before the watermark existed load on the newest-record clock.
        state.setdefault("source_liveness_ms", SOURCE_LIVENESS_MS)
        state.setdefault("source_max_lag_ms", SOURCE_MAX_LAG_MS)
        state.setdefault("_watermark", LowWatermark(state["source_liveness_ms"] * 1_000_000,
                                                     state["source_max_lag_ms"] * 1_000_000))
        state.setdefault("_on_watermark", False)
        state.setdefault("_by_stream", False)
        state.setdefault("_restoration_lag_ns", max(0, RESTORATION_LAG_MS * 1_000_000 - state["_grace_ns"]))
        self.__dict__.update(state)

    @property
    def watermark_ns(self) -> int | None:
        """The low watermark grace periods run on (None until a `SourceProgress` arrived)."""
        return self._watermark.value_ns if self._on_watermark else None

    # -- public ---------------------------------------------------------------------------
    def set_jobs(self, jobs_by_node: dict[str, set[str]]) -> None:
        """Which jobs run on which node (for the blast radius); replaces the previous map."""
        self._jobs = {node: frozenset(ids) for node, ids in jobs_by_node.items()}

    def update(self, change: PauseStateChange) -> list[Finding]:
        """Findings opened, updated or resolved by one watchdog record."""
        if change.role not in (PAUSED, PAUSING):
            raise ValueError(f"change.role must be {PAUSED!r} or {PAUSING!r}, got {change.role!r}")
        key = _key(change.entity)
        slot = (key, change.priority, change.role)
        prev = self._last.get(slot)
        if prev is not None and change.at_ns < prev.at_ns:
            return []                                   # older than what we know: stale
        self._last[slot] = change
        table = (self._held if change.role == PAUSED else self._pausing).setdefault(change.priority, {})
        if change.active:
            table[key] = change
        else:
            table.pop(key, None)
        if not self._by_stream:                         # per-source progress: the change is progress too
            self._watermark.advance(((_source(change.entity), change.at_ns),))
        if not self._on_watermark:
            self._now_ns = max(self._now_ns, change.at_ns)
            return self._evaluate(change.priority, change.at_ns)
        before, self._now_ns = self._now_ns, self._watermark.settle()
        out = self._evaluate(change.priority, change.at_ns)
        if self._now_ns > before:                       # other priorities' graces may have run out
            out += [f for p in self._priorities() if p != change.priority for f in self._evaluate(p, self._now_ns)]
        return out

    def progress(self, record: SourceProgress) -> list[Finding]:
        """Stage 1 has processed these sources this far: the low watermark may advance.

        The first record that names a source switches the clock from the newest record to
        the watermark, and from then on every stream it expects (default: every node and
        switch of the topology) is waited for.
        """
        self._watermark.advance(record.through_ns_by_source.items())
        known = self._watermark.through_ns
        if not self._on_watermark and known:
            self._on_watermark = True
            self._by_stream = bool(record.expect)
            expected = record.expect or list(self.topology.nodes) + list(self.topology.switches)
            self._watermark.expect(expected, min(known.values()))
        before, self._now_ns = self._now_ns, self._watermark.settle()
        if self._now_ns <= before:
            return []
        return [f for p in self._priorities() for f in self._evaluate(p, self._now_ns)]

    def poll(self, now_ns: int) -> list[Finding]:
        """Re-evaluate at event time ``now_ns`` (lets a grace period expire without new records).

        On the watermark, ``now_ns`` cannot push the clock: only the sources' progress does.
        """
        if self._on_watermark:
            self._now_ns = self._watermark.settle()
        else:
            self._now_ns = max(self._now_ns, now_ns)
        return [f for p in self._priorities() for f in self._evaluate(p, self._now_ns)]

    def open_findings(self) -> list[Finding]:
        """Every open storm as known now (current victims), in the state last emitted."""
        return [self._finding(s, s.last.state, self._victims(s.root), s.last.detected_ns, commit=False)
                for s in self._storms.values() if s.last is not None]

    # -- topology helpers -----------------------------------------------------------------
    def _priorities(self) -> list[int]:
        return sorted(set(self._held) | set(self._pausing) | {p for _, p in self._storms})

    def _congested(self, switch: str, prio: int) -> bool:
        held, pausing = self._held.get(prio, {}), self._pausing.get(prio, {})
        for port in self._switch_ports.get(switch, ()):
            key = (_PORT, switch, port)
            if key in held or self._peer.get(key) in pausing:
                return True
        return False

    def _calm_since(self, switch: str, prio: int) -> int:
        """Event time at which the switch last stopped being congested (0: never seen so)."""
        since = 0
        for port in self._switch_ports.get(switch, ()):
            key = (_PORT, switch, port)
            for k, role in ((key, PAUSED), (self._peer.get(key), PAUSING)):
                c = self._last.get((k, prio, role))
                if c is not None and not c.active:
                    since = max(since, c.at_ns)
        return since

    def _victims(self, root: _Root) -> list[NodeKey]:
        held = self._held.get(root.prio, {})
        out: list[NodeKey] = []
        seen: set[NodeKey] = {root.key}
        switches: list[str] = []
        if root.how == "nic":
            leaf = self._peer.get(root.key)
            if leaf is not None:
                if leaf in held:
                    out.append(leaf)
                seen.add(leaf)
                switches.append(leaf[1])
        elif root.how == "silent":
            switches.append(root.key[1])
        else:                                           # a switch port pausing its peer
            peer = root.peer
            if peer is not None and peer in held:
                out.append(peer)
                seen.add(peer)
                if peer[0] == _PORT:
                    switches.append(peer[1])
        visited: set[str] = set()
        while switches:
            sw = switches.pop()
            if sw in visited:
                continue
            visited.add(sw)
            for port in self._switch_ports.get(sw, ()):
                peer = self._peer.get((_PORT, sw, port))
                if peer is None or peer in seen or peer not in held:
                    continue
                seen.add(peer)
                out.append(peer)
                if peer[0] == _PORT:
                    switches.append(peer[1])
        return out

    # -- roots ----------------------------------------------------------------------------
    def _believed(self, key: NodeKey, prio: int, since_ns: int) -> bool:
        """An unexplained picture counts once it has lasted the grace period (or is already open)."""
        return (key, prio) in self._storms or self._now_ns - since_ns >= self._grace_ns

    def _roots(self, prio: int) -> dict[NodeKey, _Root]:
        held, pausing = self._held.get(prio, {}), self._pausing.get(prio, {})
        roots: dict[NodeKey, _Root] = {}
        for key, c in pausing.items():
            if key[0] == _NIC:
                roots[key] = _Root(key, prio, "nic", c.entity, c.onset_ns, NIC_SOURCE_CONFIDENCE, evidence_from=c)
            elif not self._congested(key[1], prio):   # a switch port whose TX pause duration says it pauses
                since = max(c.at_ns, self._calm_since(key[1], prio))
                if self._believed(key, prio, since):
                    roots[key] = _Root(key, prio, "switch", c.entity, c.onset_ns, SWITCH_SOURCE_CONFIDENCE,
                                       peer=self._peer.get(key), evidence_from=c)
        for key, c in held.items():
            pauser = self._peer.get(key)
            if pauser is None or pauser in roots:
                continue
            if pauser[0] == _NIC:
                if pauser in pausing:
                    continue
                # a leaf port held by a NIC that does not say it pauses: the source is silent
                last = self._last.get((pauser, prio, PAUSING))
                since = max(c.at_ns, last.at_ns if last is not None else 0)
                if last is not None and last.at_ns >= c.onset_ns:
                    since += self._restoration_lag_ns      # it paused in this hold and stopped: a lag
                if self._believed(key, prio, since):
                    roots[key] = _Root(key, prio, "silent", c.entity, c.onset_ns, SILENT_SOURCE_CONFIDENCE,
                                       peer=pauser, evidence_from=c)
            else:
                # the pauser is a switch port: propagation when its switch is congested
                if self._congested(pauser[1], prio):
                    continue
                since = max(c.at_ns, self._calm_since(pauser[1], prio))
                if self._believed(pauser, prio, since):
                    ref = EntityRef(cluster=self._cluster, switch=pauser[1], port=pauser[2])
                    roots[pauser] = _Root(pauser, prio, "switch", ref, c.onset_ns, SWITCH_SOURCE_CONFIDENCE,
                                          peer=key)
        return roots

    def _evaluate(self, prio: int, at_ns: int) -> list[Finding]:
        roots = self._roots(prio)
        out: list[Finding] = []
        for (key, p), storm in list(self._storms.items()):
            if p != prio:
                continue
            root = roots.get(key)
            if root is None or root.how != storm.root.how:
                out.append(self._resolved(storm, at_ns))
                del self._storms[(key, p)]
        for key, root in roots.items():
            storm = self._storms.get((key, prio))
            victims = self._victims(root)
            if storm is None:
                storm = self._storms[(key, prio)] = _Storm(root)
                out.append(self._finding(storm, OPEN, victims, at_ns))
                continue
            storm.root = root
            before, now = len(storm.reported), len(victims)
            grew = (before == 0 and now > 0) or now >= math.ceil(before * UPDATE_GROWTH_FACTOR) > before
            if grew and not set(victims) <= storm.reported:
                out.append(self._finding(storm, UPDATE, victims, at_ns))
        return out

    # -- findings -------------------------------------------------------------------------
    def _ref(self, key: NodeKey, prio: int) -> EntityRef:
        c = self._held.get(prio, {}).get(key) or self._pausing.get(prio, {}).get(key)
        if c is not None:
            return c.entity
        if key[0] == _PORT:
            return EntityRef(cluster=self._cluster, switch=key[1], port=key[2])
        device, _, port = key[2].partition("/")
        return EntityRef(cluster=self._cluster, node=key[1], device=device, port=port)

    def _finding(self, storm: _Storm, state: str, victims: list[NodeKey], at_ns: int,
                 commit: bool = True) -> Finding:
        root, prio = storm.root, storm.root.prio
        held = self._held.get(prio, {})
        related = sorted((self._ref(v, prio) for v in victims), key=EntityRef.path)
        nodes = sorted({v[1] for v in victims if v[0] == _NIC})
        uplinks = [v for v in victims if v[0] == _PORT and self._peer.get(v, (_NIC,))[0] == _PORT]
        jobs = sorted(set().union(*(self._jobs.get(n, frozenset()) for n in nodes + self._root_nodes(root))))
        leaf = self._peer.get(root.key) if root.how == "nic" else (root.key if root.how == "silent" else None)
        ev: list[Evidence] = []
        src = root.evidence_from
        if src is not None:
            ev += [e for e in src.evidence if e.name in ("tx_pause_duty", "rx_bytes_per_s", "rx_pause_duty",
                                                        "tx_bytes_per_s", "queue_occupancy_bytes")
                   or e.name.startswith("tx_pause_storm")]
        ev.append(Evidence("victim_ports", float(len(victims)), 0.0, "ports",
                           ", ".join(v.path() for v in related[:MAX_NAMES])))
        if leaf is not None:
            c = held.get(leaf)
            ev.append(Evidence("leaf_port_rx_pause_duty", c.value("rx_pause_duty") if c else float("nan"),
                               0.0, "s/s", f"{leaf[1]}/{leaf[2]}" + ("" if c else " (not confirmed held)")))
        ev.append(Evidence("victim_nodes", float(len(nodes)), 0.0, "nodes", ", ".join(nodes[:MAX_NAMES])))
        ev.append(Evidence("paused_uplinks", float(len(uplinks)), 0.0, "ports",
                           ", ".join(_name(u) for u in uplinks[:MAX_NAMES])))
        if self._jobs:
            ev.append(Evidence("affected_jobs", float(len(jobs)), 0.0, "jobs", ", ".join(jobs[:MAX_NAMES])))
        if root.how == "silent" and root.peer is not None:
            ev.append(Evidence("suspected_source", 1.0, 1.0, "bool",
                               f"{_name(root.peer)} holds this port but reports no pausing"))
        f = Finding(KIND, state, root.entity, CRITICAL, onset_ns=root.onset_ns, detected_ns=at_ns, evidence=ev,
                    confidence=root.confidence, detector=DETECTOR, related=related,
                    summary=self._summary(root, len(victims), leaf, nodes, uplinks, jobs),
                    **self._advice(root))
        if commit:
            storm.reported, storm.last = set(victims), f
        return f

    def _root_nodes(self, root: _Root) -> list[str]:
        if root.how == "nic":
            return [root.key[1]]
        if root.how == "silent" and root.peer is not None:
            return [root.peer[1]]
        return []

    def _summary(self, root: _Root, n: int, leaf, nodes: list[str], uplinks: list, jobs: list[str]) -> str:
        behind = f" behind {leaf[1]}" if leaf is not None else ""
        tail = " (spine uplinks paused)" if uplinks else ""
        blast = f" on {_count(len(nodes), 'node')}" if nodes else ""
        if jobs:
            blast += f"; {'job' if len(jobs) == 1 else 'jobs'} {', '.join(jobs[:MAX_NAMES])}"
        if root.how == "nic":
            head = f"PFC storm on prio {root.prio} from {_name(root.key)}"
        elif root.how == "silent":
            suspect = f" held by {_name(root.peer)}, which reports no pausing" if root.peer else ""
            head = f"PFC storm on prio {root.prio} at {_name(root.key)}{suspect}"
            behind = ""
        else:
            pauses = f" pausing {_name(root.peer)}" if root.peer else ""
            head = f"PFC storm on prio {root.prio} from switch port {_name(root.key)}{pauses} (switch not congested)"
            behind = ""
        return f"{head}: {_count(n, 'victim port')}{behind}{tail}{blast}"

    @staticmethod
    def _advice(root: _Root) -> dict:
        if root.how == "nic":
            return {"cause": CAUSE_STUCK_HOST,
                    "probable_cause": "host stopped draining its receive queue (stuck host/NIC)",
                    "suggested_action": "isolate the source port (PFC watchdog drop) and drain the node"}
        if root.how == "silent":
            return {"cause": CAUSE_SILENT_HOST,
                    "probable_cause": "the NIC behind this leaf port keeps it paused; its node reports nothing "
                                      "(down, partitioned or stuck host)",
                    "suggested_action": "isolate this leaf port; check and drain the node behind it"}
        return {"cause": CAUSE_SWITCH_PORT,
                "probable_cause": "a switch port pauses its peer with no congested egress on its switch "
                                  "(buffer/PFC misconfiguration or switch fault)",
                "suggested_action": "isolate the switch port; check the switch's PFC and buffer configuration"}

    def _resolved(self, storm: _Storm, at_ns: int) -> Finding:
        last = storm.last
        root = storm.root
        return Finding(KIND, RESOLVED, root.entity, CRITICAL, onset_ns=root.onset_ns, detected_ns=at_ns,
                       evidence=list(last.evidence) if last else [], confidence=root.confidence, detector=DETECTOR,
                       related=list(last.related) if last else [],
                       summary=f"resolved: {last.summary}" if last else "resolved")
