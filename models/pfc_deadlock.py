"""PFC deadlock: a cycle of switches that pause each other, and that persists.

PFC (IEEE 802.1Qbb) is hop by hop: a switch whose ingress buffer for a lossless priority
fills pauses the port that feeds it, and that port's switch stops sending on the priority;
its own buffers fill behind the paused egress, and it pauses whoever feeds *it*. When the
chain of "who pauses whom" closes on itself, no buffer on the loop can ever drain: every
switch waits for the next one (a cyclic buffer dependency, Hu et al., "Deadlocks in
Datacenter Networks: Why Do They Form, and How to Avoid Them", HotNets 2016; Tagger,
CoNEXT 2016). In a Clos fabric with up-down routing no such loop can form; one forms after a
link failure reroutes traffic down-up (a flow that bounces leaf -> spine -> leaf -> spine)
or a transient routing loop, and it outlives the loop that made it: pauses alone sustain it.

Input: the watchdogs' `pfc_storm.PauseStateChange` records (the same stream, in the same
event-time order, that `storm_locator.StormLocator` reads) and the fabric `Topology`. The
model keeps, per priority, the directed graph of *holds* between switch ports: an edge
``(A, a) -> (B, b)`` when port ``a`` of switch ``A`` is held by its cable peer ``b`` of
switch ``B`` (A's watchdog says ``a`` is "paused", or B's says ``b`` is "pausing" it: SONiC
exports the pauses a port sends). Ports facing NICs are no part of a loop (a NIC has no
buffer that a switch's pause fills: a NIC that pauses its leaf is a storm's source, which
the locator names). A **deadlock** is a cycle in the switch graph of these holds that spans
at least two switches and has been present, every edge of it, for ``hold_ms``. It opens
naming the cycle's switches and ports; it resolves as soon as any edge of the cycle breaks.
One cycle per strongly connected set of switches is reported (the shortest through its
first switch): a larger knot is one deadlock to break, and breaking any edge of the named
cycle changes it.

>>> from fabricwatch.models.topology import rail_optimised
>>> from fabricwatch.models.findings import EntityRef
>>> from fabricwatch.models.pfc_storm import PauseStateChange
>>> topo = rail_optimised("c1", n_nodes=4, nodes_per_unit=2, n_spines=2)
>>> det = PfcDeadlockDetector(topo, cluster="c1")
>>> held = lambda sw, port, at_ms, active=True: PauseStateChange(
...     EntityRef("c1", switch=sw, port=port), 3, "paused", active, at_ms * 1_000_000, at_ms * 1_000_000)
>>> # leaf-u0-r0 -> spine-0 -> leaf-u1-r0 -> spine-1 -> leaf-u0-r0: a down-up loop
>>> loop = [held("leaf-u0-r0", "Ethernet2", 0), held("spine-0", "Ethernet8", 10),
...         held("leaf-u1-r0", "Ethernet3", 20), held("spine-1", "Ethernet0", 30)]
>>> [f for c in loop for f in det.update(c)]
[]
>>> [(f.kind, f.state, f.entity.switch) for f in det.advance(1_100_000_000)]   # 1 s after the loop closed
[('pfc_deadlock', 'open', 'leaf-u0-r0')]
>>> [(f.state, len(f.related)) for f in det.update(held("spine-0", "Ethernet8", 1200, active=False))]
[('resolved', 7)]
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from .detector import ChangeDetector
from .findings import CRITICAL, OPEN, RESOLVED, EntityRef, Evidence, Finding
from .pfc_storm import DEFAULT_DETECTION_TIME_MS, PAUSED, PAUSING, PauseStateChange
from .topology import Topology
from .vocabulary import PFC_DEADLOCK, PFC_DEADLOCK_CAUSE

DETECTOR = "pfc_deadlock/v1"
KIND = PFC_DEADLOCK
# A cycle of holds must last this long: five SONiC pfcwd detection times (DEFAULT_DETECTION_TIME
# 200 ms; the watchdog's own restoration time is 200 ms too, so a loop that the watchdogs break
# or that clears by itself is gone well within it). Transient cycles do form while a storm's
# tree grows and shrinks (two ports of a link held in turn, a change of one watchdog arriving one
# sample after the other's); a second of every edge held at once is no transient.
DEADLOCK_HOLD_MS = 5 * DEFAULT_DETECTION_TIME_MS
# A cycle through fewer switches is none: a single switch cannot hold itself.
MIN_CYCLE_SWITCHES = 2

Port = tuple[str, str]          # (switch, port)


@dataclass
class _Cycle:
    edges: tuple[tuple[Port, Port], ...]      # (held port, the peer port holding it), in cycle order
    since_ns: int
    priority: int
    finding: Finding | None = None


@dataclass
class PfcDeadlockDetector(ChangeDetector):
    """Per cluster: the holds between switch ports, per priority, and the cycles among them."""
    topology: Topology
    cluster: str = ""
    hold_ms: float = DEADLOCK_HOLD_MS
    _paused: dict[int, set[Port]] = field(default_factory=dict, repr=False)    # held ports (paused role)
    _pausing: dict[int, set[Port]] = field(default_factory=dict, repr=False)   # ports that pause their peer
    _cycles: dict[tuple[int, frozenset], _Cycle] = field(default_factory=dict, repr=False)
    # (switch, port, priority, role) -> event time of its newest change applied
    _last_ns: dict[tuple[str, str, int, str], int] = field(default_factory=dict, repr=False)
    _now_ns: int = 0
    stats: dict[str, int] = field(default_factory=dict, repr=False)

    def __post_init__(self) -> None:
        if not self.hold_ms > 0:
            raise ValueError(f"hold_ms must be > 0, got {self.hold_ms!r}")

    def __setstate__(self, state: dict) -> None:
        state.setdefault("_last_ns", {})           # a checkpoint from before stale changes were refused
        self.__dict__.update(state)

    # -- input ----------------------------------------------------------------------------------
    def update(self, change: PauseStateChange) -> list[Finding]:
        """One watchdog change (event-time order); findings of cycles it closes, breaks or ages.

        The clock moves to the change first: a cycle that has held for ``hold_ms`` by then opens
        before the change can break it (a backlog read at once delivers the change that breaks a
        loop with no other record in between)."""
        out = self.advance(change.at_ns)
        ref = change.entity
        if not ref.switch or not ref.port or change.role not in (PAUSED, PAUSING):
            return out                                # a NIC's change: no part of a switch loop
        peer = self.topology.peer_of(ref.switch, ref.port)
        if peer is None or not peer.switch:
            if peer is None:
                self.stats["unknown_port"] = self.stats.get("unknown_port", 0) + 1
            return out
        # Older than what this port last said: a redelivery (a worker took over a dead one's
        # partition and re-sent the changes after its last commit). Applied, an old restoration
        # would break a loop that holds, an old onset restore one that broke.
        slot = (ref.switch, ref.port, change.priority, change.role)
        if change.at_ns < self._last_ns.get(slot, change.at_ns):
            self.stats["stale_changes"] = self.stats.get("stale_changes", 0) + 1
            return out
        self._last_ns[slot] = change.at_ns
        table = self._paused if change.role == PAUSED else self._pausing
        ports = table.setdefault(change.priority, set())
        if change.active:
            ports.add((ref.switch, ref.port))
        else:
            ports.discard((ref.switch, ref.port))
        return out + self._judge(change.priority)

    def advance(self, now_ns: int) -> list[Finding]:
        """The event-time clock moved (the stage's watermark): open cycles that have held long enough."""
        self._now_ns = max(self._now_ns, now_ns)
        out: list[Finding] = []
        for c in self._cycles.values():
            if c.finding is None and self._now_ns - c.since_ns >= self.hold_ms * 1e6:
                c.finding = self._open(c)
                out.append(c.finding)
        return out

    def open_findings(self) -> list[Finding]:
        return [c.finding for c in self._cycles.values() if c.finding is not None]

    # -- graph ------------------------------------------------------------------------------------
    def _holds(self, priority: int) -> dict[Port, Port]:
        """Held switch port -> the peer switch port that holds it, on ``priority``."""
        holds: dict[Port, Port] = {}
        for sw, port in self._paused.get(priority, ()):
            peer = self.topology.peer_of(sw, port)
            holds[(sw, port)] = (peer.switch, peer.port)
        for sw, port in self._pausing.get(priority, ()):
            peer = self.topology.peer_of(sw, port)
            holds[(peer.switch, peer.port)] = (sw, port)
        return holds

    def _judge(self, priority: int) -> list[Finding]:
        found = {frozenset(edges): edges for edges in find_cycles(self._holds(priority))}
        out: list[Finding] = []
        for key in [k for k in self._cycles if k[0] == priority and k[1] not in found]:
            c = self._cycles.pop(key)
            if c.finding is not None:
                out.append(self._resolved(c))
        for edges_key, edges in found.items():
            # a new cycle closed with this change: from now on its edges are all held at once
            self._cycles.setdefault((priority, edges_key), _Cycle(edges, self._now_ns, priority))
        return out + self.advance(self._now_ns)

    # -- findings ---------------------------------------------------------------------------------
    def _open(self, c: _Cycle) -> Finding:
        switches = [a[0] for a, _ in c.edges]
        held_ports = [f"{a[0]} {a[1]} (held by {b[0]} {b[1]})" for a, b in c.edges]
        first = c.edges[0][0]
        related = [EntityRef(cluster=self.cluster, switch=p[0], port=p[1])
                   for a, b in c.edges for p in (a, b) if p != first]
        age_ms = (self._now_ns - c.since_ns) / 1e6
        loop = " -> ".join(switches + [switches[0]])
        drop_on = ", ".join(f"{a[0]} {a[1]}" for a, _ in c.edges)
        return Finding(
            KIND, OPEN, EntityRef(cluster=self.cluster, switch=first[0], port=first[1]), CRITICAL,
            onset_ns=c.since_ns, detected_ns=self._now_ns,
            evidence=[Evidence("cycle_switches", float(len(switches)), MIN_CYCLE_SWITCHES, "switches", loop),
                      Evidence("cycle_held_for_ms", round(age_ms, 1), self.hold_ms, "ms",
                               f"prio {c.priority}: every port of the loop held at once: " + "; ".join(held_ports))],
            probable_cause=("cyclic buffer dependency: a routing loop or down-up routing (after a link failure) "
                            "closed a loop of PFC pauses that no buffer on it can drain"),
            cause=PFC_DEADLOCK_CAUSE,
            suggested_action=(f"break the cycle: enable the PFC watchdog with action drop on {drop_on} "
                              f"(SONiC `pfcwd start --action drop`), and check routing for up-down violations "
                              f"or a routing loop through {', '.join(dict.fromkeys(switches))} (after a link failure)"),
            summary=f"PFC deadlock on prio {c.priority}: {loop} pause each other for {age_ms / 1e3:.1f} s",
            detector=DETECTOR, related=related)

    def _resolved(self, c: _Cycle) -> Finding:
        f = c.finding
        return Finding(**{**f.__dict__, "state": RESOLVED, "detected_ns": self._now_ns,
                          "evidence": list(f.evidence), "related": list(f.related),
                          "summary": f"resolved: {f.summary}; an edge of the loop broke"})


def find_cycles(holds: dict[Port, Port]) -> list[tuple[tuple[Port, Port], ...]]:
    """One cycle of at least `MIN_CYCLE_SWITCHES` switches per strongly connected set of switches.

    ``holds`` maps a held port to the port holding it; the switch graph has an edge A -> B per
    held port of A whose holder is on B. The cycle returned for a set is the shortest through
    its smallest switch (breadth first), as (held port, holder) pairs in order.

    >>> find_cycles({("a", "1"): ("b", "1"), ("b", "2"): ("a", "2")})
    [((('a', '1'), ('b', '1')), (('b', '2'), ('a', '2')))]
    >>> find_cycles({("a", "1"): ("b", "1"), ("b", "2"): ("c", "1")})      # a tree: no cycle
    []
    """
    out_edges: dict[str, list[tuple[Port, Port]]] = {}
    for held, holder in sorted(holds.items()):
        if held[0] != holder[0]:
            out_edges.setdefault(held[0], []).append((held, holder))
    done: set[str] = set()
    cycles = []
    for start in sorted(out_edges):
        if start in done:
            continue
        # breadth first from start until it comes back: the shortest cycle through start
        prev: dict[str, tuple[Port, Port]] = {}
        queue = deque([start])
        closing = None
        while queue and closing is None:
            sw = queue.popleft()
            for edge in out_edges.get(sw, ()):
                nxt = edge[1][0]
                if nxt == start:
                    closing = edge
                    break
                if nxt not in prev and nxt != start:
                    prev[nxt] = edge
                    queue.append(nxt)
        if closing is None:
            continue
        path = [closing]
        sw = closing[0][0]
        while sw != start:
            edge = prev[sw]
            path.append(edge)
            sw = edge[0][0]
        path.reverse()
        members = {e[0][0] for e in path}
        if len(members) >= MIN_CYCLE_SWITCHES:
            cycles.append(tuple(path))
            done |= _reachable_both_ways(out_edges, start)
    return cycles


def _reachable_both_ways(out_edges: dict[str, list[tuple[Port, Port]]], start: str) -> set[str]:
    """The strongly connected set of ``start``: reached from it and reaching it."""
    def reach(adj: dict[str, set[str]]) -> set[str]:
        seen, stack = {start}, [start]
        while stack:
            for n in adj.get(stack.pop(), ()):
                if n not in seen:
                    seen.add(n)
                    stack.append(n)
        return seen
    fwd: dict[str, set[str]] = {}
    rev: dict[str, set[str]] = {}
    for a, edges in out_edges.items():
        for e in edges:
            fwd.setdefault(a, set()).add(e[1][0])
            rev.setdefault(e[1][0], set()).add(a)
    return reach(fwd) & reach(rev)
