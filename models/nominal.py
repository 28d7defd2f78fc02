"""The nominal rate of each NIC port: what a healthy link of it trains at.

In order: the topology file's ``nominal_rate`` for the port; the configured rate; the
fleet's consensus; the default (`topology.DEFAULT_NIC_RATE`). The consensus is **one vote
per node**: its most common rate among its active ports (`node_vote`), weighted by how
many ports agree but never more than `MAX_VOTE_WEIGHT` (a node's NICs), so a node that
claims thousands of ports, or lies about all of them, weighs what one honest node does.
The winner is the rate with the most weight once the cluster's votes weigh at least
`MIN_CONSENSUS_WEIGHT` (one full node); ties go to the faster rate, then the name.
Votes travel as facts (`NominalVote`) so every worker counts the same ballot; a node's
vote is replaced by its next one, or withdrawn with "".

>>> nominal = NominalRates()
>>> for node, rate in [("n1", "400 Gb/sec (4X NDR)"), ("n2", "400 Gb/sec (4X NDR)")]:
...     _ = nominal.vote("c1", node, rate, 8)
>>> nominal.vote("c1", "liar", *node_vote(["800 Gb/sec (8X NDR)"] * 5000, ["4: ACTIVE"] * 5000))
True
>>> nominal.for_port("c1", "n3", "mlx5_0/1")
IbRate(gbps=400.0, width=4, lane='NDR')
>>> node_vote(["800 Gb/sec (8X NDR)"] * 5000, ["4: ACTIVE"] * 5000)      # many ports, one vote
('800 Gb/sec (8X NDR)', 8)
"""
from __future__ import annotations

from collections import Counter
from collections.abc import Sequence

from .linkrate import IbRate, parse_ib_rate
from .topology import DEFAULT_NIC_RATE, Topology

# A node's vote weighs the ports that agree with it, at most this many (8 NICs per node).
MAX_VOTE_WEIGHT = 8
# Weight a cluster's votes need before the consensus replaces the default: one full node.
MIN_CONSENSUS_WEIGHT = 8
# Clusters and voters remembered (id churn beyond this is refused and counted).
MAX_CLUSTERS = 1024
MAX_VOTERS_PER_CLUSTER = 200_000
ACTIVE_STATE = "4"


def node_vote(rates: Sequence[str], states: Sequence[str]) -> tuple[str, int]:
    """A node's vote: the most common parseable rate of its active ports and its weight ("", 0 if none)."""
    counts = Counter(r for r, s in zip(rates, states) if s.startswith(ACTIVE_STATE) and parse_ib_rate(r))
    if not counts:
        return "", 0
    rate, n = max(counts.items(), key=lambda kv: (kv[1], _order(kv[0])))
    return rate, min(n, MAX_VOTE_WEIGHT)


def _order(rate: str) -> tuple[float, str]:
    parsed = parse_ib_rate(rate)
    return (parsed.gbps if parsed else 0.0, rate)


class NominalRates:
    """Per-port nominal NIC rates: topology, configured, one-vote-per-node consensus, default."""

    def __init__(self, topology: Topology | None = None, configured: str = "", default: str = DEFAULT_NIC_RATE) -> None:
        for name, rate in (("configured", configured), ("default", default)):
            if rate and parse_ib_rate(rate) is None:
                raise ValueError(f"{name} nominal rate: not a sysfs rate string: {rate!r}")
        self.topology = topology
        self.configured = configured
        self.default = default
        self._votes: dict[str, dict[str, tuple[str, int]]] = {}   # cluster -> node -> (rate, weight)
        self._tally: dict[str, Counter] = {}
        self._consensus: dict[str, IbRate | None] = {}
        self.version = 0                                 # moves whenever a consensus may have changed
        self.refused_votes = 0

    def vote(self, cluster: str, node: str, rate: str, weight: int = MAX_VOTE_WEIGHT) -> bool:
        """Record (or replace; "" withdraws) one node's vote; True if it changed."""
        weight = max(0, min(int(weight), MAX_VOTE_WEIGHT))
        if not rate or parse_ib_rate(rate) is None or not weight:
            rate, weight = "", 0
        votes = self._votes.get(cluster)
        if votes is None:
            if not rate:
                return False
            if len(self._votes) >= MAX_CLUSTERS:
                self.refused_votes += 1
                return False
            votes, self._tally[cluster] = self._votes.setdefault(cluster, {}), Counter()
        before = votes.get(node)
        if before == ((rate, weight) if rate else None):
            return False
        if before is None and len(votes) >= MAX_VOTERS_PER_CLUSTER:
            self.refused_votes += 1
            return False
        tally = self._tally[cluster]
        if before is not None:
            tally[before[0]] -= before[1]
            if tally[before[0]] <= 0:
                del tally[before[0]]
        if rate:
            votes[node] = (rate, weight)
            tally[rate] += weight
        else:
            votes.pop(node, None)
        self._consensus.pop(cluster, None)
        self.version += 1
        return True

    def fleet(self, cluster: str) -> IbRate | None:
        """The cluster's consensus rate, or None before its votes weigh `MIN_CONSENSUS_WEIGHT`."""
        if cluster in self._consensus:
            return self._consensus[cluster]
        tally = self._tally.get(cluster)
        rate = None
        if tally and sum(tally.values()) >= MIN_CONSENSUS_WEIGHT:
            rate = parse_ib_rate(max(tally.items(), key=lambda kv: (kv[1], _order(kv[0])))[0])
        self._consensus[cluster] = rate
        return rate

    def for_port(self, cluster: str, node: str, entity_id: str) -> IbRate:
        """What this port should train at."""
        if self.topology is not None:
            nic = self.topology.nic(node, entity_id)
            if nic is not None:
                parsed = parse_ib_rate(nic.nominal_rate)
                if parsed is not None:
                    return parsed
        if self.configured:
            return parse_ib_rate(self.configured)
        return self.fleet(cluster) or parse_ib_rate(self.default)

    def voters(self, cluster: str) -> int:
        return len(self._votes.get(cluster, ()))
