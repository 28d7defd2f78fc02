"""Facts: what one stage tells every worker, on a compacted topic that each reads whole.

Stage 1 runs next to each node's telemetry, but the stages that need what it learns run
wherever their own keys put them: the straggler stage (per job) needs the health of the
nodes its ranks run on, the downgrade rule the fleet's nominal NIC rate, the storm
locator the jobs on its victims' nodes. Those travel as `Fact` records:

=============================  ===============================  ===========================
key                            value                            written by
=============================  ===============================  ===========================
``health/<cluster>/<node>``    `NodeHealth` digest (episodes)   stage 1, node's partition
``nominal/<cluster>/<node>``   the node's nominal-rate vote     stage 1, node's partition
``progress/<topic>/<p>``       stage 1 done with partition p    stage 1 of partition p
``placement/<cluster>/<job>``  the nodes and GPUs of a job      stage 3, the job's partition
=============================  ===============================  ===========================

Each writer sends to the facts partition of the same number as its input partition, so a
partition's facts and its progress stay in order: once a reader has seen partition p's
progress through t, it has seen every fact p wrote about ticks up to t. `FactBook` is
what a reader keeps; `watermark_ns` is the low watermark over the telemetry partitions
(`models.watermark.LowWatermark.partitions`: one not read yet is waited for, one its
reader declared idle is not, as far as a look-up found it still at the end offset it was
read to: `models.watermark.IdleClaims`, `partition_ends`), through which node health is
complete. The topic is compacted: a restarted worker reads it whole and knows every
node's latest digest, vote and placement.

>>> from fabricwatch.models.node_health import NodeHealth
>>> book = FactBook()
>>> key, value = encode(Progress("fw.telemetry.v2", 0, 2, 5_000_000_000))
>>> key
b'progress/fw.telemetry.v2/0'
>>> book.apply(decode(value)); book.watermark_ns        # partition 1 not read yet: waited for
0
>>> book.apply(Progress("fw.telemetry.v2", 1, 2, 4_000_000_000)); book.watermark_ns
4000000000
>>> book.apply(Progress("fw.telemetry.v2", 1, 2, 7_000_000_000)); book.apply(Progress("fw.telemetry.v2", 0, 2, 8_000_000_000))
>>> book.watermark_ns
7000000000
>>> book.apply(Progress("fw.telemetry.v2", 0, 2, 9_000_000_000, idle=True)); book.watermark_ns   # only 1 left
7000000000
>>> book.apply(Progress("fw.telemetry.v2", 1, 2, 12_000_000_000)); book.watermark_ns
12000000000
>>> book.apply(decode(encode(NodeHealth("c1", "n1", 4_000, 1_000, 4_000))[1])); book.health.nodes()
['n1']
"""
from __future__ import annotations

import logging
from collections.abc import Iterable
from dataclasses import dataclass

from google.protobuf.message import DecodeError

from fabricwatch.models.node_health import Episode, HealthBook, HealthEvent, NodeHealth
from fabricwatch.models.nominal import NominalRates
from fabricwatch.models.topology import Topology
from fabricwatch.models.watermark import IdleClaims, LowWatermark
from fabricwatch.protos.v1 import records_pb2 as rec

log = logging.getLogger("fabricwatch.facts")

# Jobs remembered for placements (a job that reported no step for an hour is dropped).
PLACEMENT_IDLE_NS = 3600 * 10**9
MAX_PLACEMENTS = 100_000


class FactError(ValueError):
    """A facts record that does not decode."""


@dataclass(frozen=True)
class Progress:
    """Stage 1 has processed telemetry partition ``partition`` (of ``partitions``) through
    ``through_ns``; ``idle``: and nothing is left to read there for now, as long as it ends
    at ``end_offset`` (None: trusted as made, from an older writer)."""

    topic: str
    partition: int
    partitions: int
    through_ns: int
    idle: bool = False
    end_offset: int | None = None

    @property
    def stream(self) -> str:
        return f"{self.topic}/{self.partition}"


@dataclass(frozen=True)
class NominalVote:
    cluster: str
    node: str
    rate: str          # "" withdraws the node's vote
    weight: int = 0


@dataclass(frozen=True)
class JobPlacement:
    cluster: str
    job_id: str
    nodes: tuple[str, ...]
    last_step_ns: int
    ranks: int = 0          # distinct ranks (one GPU each); 0: not known
    first_step_ns: int = 0  # its first step seen; 0: not known


Fact = NodeHealth | Progress | NominalVote | JobPlacement


class FactBook:
    """Every fact a worker has read: node health, nominal votes, placements, progress."""

    def __init__(self, topology: Topology | None = None, nominal: NominalRates | None = None,
                 health: HealthBook | None = None) -> None:
        self.nominal = nominal if nominal is not None else NominalRates(topology)
        self.health = health if health is not None else HealthBook(topology=topology)
        self._progress = LowWatermark.partitions()
        self._claims = IdleClaims()
        self._expected: set[str] = set()
        self._placements: dict[tuple[str, str], JobPlacement] = {}
        self.jobs_by_node: dict[str, set[str]] = {}
        self.placements_version = 0
        self.watermark_ns = 0
        self.heard_progress = False

    def apply(self, fact: Fact) -> None:
        if isinstance(fact, NodeHealth):
            self.health.apply(fact)
        elif isinstance(fact, Progress):
            self._apply_progress(fact)
        elif isinstance(fact, NominalVote):
            self.nominal.vote(fact.cluster, fact.node, fact.rate, fact.weight)
        elif isinstance(fact, JobPlacement):
            self._apply_placement(fact)

    def apply_all(self, facts: Iterable[Fact]) -> None:
        for fact in facts:
            self.apply(fact)

    def _apply_progress(self, p: Progress) -> None:
        names = [f"{p.topic}/{i}" for i in range(p.partitions)]
        new = [n for n in names if n not in self._expected]
        if new:
            self._expected.update(new)
            # Not read yet, they may be anywhere behind: a worker draining a backlog reads its
            # partitions in any order, and node health judged before theirs arrived would
            # name other causes than live telemetry does.
            self._progress.expect(new, self.watermark_ns)
        self.heard_progress = True
        if p.idle:
            self._progress.idle(p.stream)
            self._claims.claim(p.stream, p.end_offset)
        else:
            self._progress.advance(((p.stream, p.through_ns),))
            self._claims.heard((p.stream,))
        self._moved()

    def partition_ends(self) -> list[str]:
        """The idle partitions whose end offsets to look up now (`IdleClaims.ask`)."""
        return self._claims.ask(self._progress.minimum_ns(), self.watermark_ns)

    def on_partition_ends(self, ends_by_stream: dict[str, int]) -> bool:
        """Their end offsets, looked up after `partition_ends`; True when the watermark moved."""
        before = self.watermark_ns
        self._claims.answer(ends_by_stream, self._progress)
        self._moved()
        return self.watermark_ns > before

    def _moved(self) -> None:
        self.watermark_ns = max(self.watermark_ns, self._claims.cap(self._progress.minimum_ns()))
        self.health.advance(self.watermark_ns)

    def _apply_placement(self, p: JobPlacement) -> None:
        key = (p.cluster, p.job_id)
        before = self._placements.get(key)
        if before is not None and before.last_step_ns > p.last_step_ns:
            return
        if before is None and len(self._placements) >= MAX_PLACEMENTS:
            self._expire_placements(p.last_step_ns)
            if len(self._placements) >= MAX_PLACEMENTS:
                return
        self._placements[key] = p
        if before is None or before.nodes != p.nodes or before.ranks != p.ranks:
            for node in before.nodes if before else ():
                jobs = self.jobs_by_node.get(node)
                if jobs is not None:
                    jobs.discard(p.job_id)
                    if not jobs:
                        del self.jobs_by_node[node]
            for node in p.nodes:
                self.jobs_by_node.setdefault(node, set()).add(p.job_id)
            self.placements_version += 1

    def job_ranks(self, cluster: str, job_id: str) -> int:
        """The GPUs (ranks) of a placed job; 0 when its placement says nothing of them."""
        p = self._placements.get((cluster, job_id))
        return p.ranks if p is not None else 0

    def job_first_step_ns(self, cluster: str, job_id: str) -> int:
        """When a placed job's first step was seen (0: not known)."""
        p = self._placements.get((cluster, job_id))
        return p.first_step_ns if p is not None else 0

    def job_nodes(self, cluster: str, job_id: str) -> int:
        p = self._placements.get((cluster, job_id))
        return len(p.nodes) if p is not None else 0

    def _expire_placements(self, now_ns: int) -> None:
        for key, p in list(self._placements.items()):
            if now_ns - p.last_step_ns > PLACEMENT_IDLE_NS:
                self._apply_placement(JobPlacement(p.cluster, p.job_id, (), now_ns))
                del self._placements[key]


# -- the wire ---------------------------------------------------------------------------------
def key_of(fact: Fact) -> bytes:
    if isinstance(fact, NodeHealth):
        return f"health/{fact.cluster}/{fact.node}".encode()
    if isinstance(fact, Progress):
        return f"progress/{fact.topic}/{fact.partition}".encode()
    if isinstance(fact, NominalVote):
        return f"nominal/{fact.cluster}/{fact.node}".encode()
    return f"placement/{fact.cluster}/{fact.job_id}".encode()


def encode(fact: Fact) -> tuple[bytes, bytes]:
    """(key, value) of a facts record."""
    msg = rec.Fact()
    if isinstance(fact, NodeHealth):
        h = msg.health
        h.cluster, h.node, h.as_of_unix_ns = fact.cluster, fact.node, fact.as_of_ns
        h.observed_since_unix_ns, h.observed_until_unix_ns, h.silent = (fact.observed_since_ns,
                                                                       fact.observed_until_ns, fact.silent)
        for e in fact.episodes:
            h.episodes.add(entity_id=e.entity_id, condition=e.condition, start_unix_ns=e.start_ns,
                           end_unix_ns=e.end_ns, open=e.open, samples_on=e.samples_on,
                           samples_total=e.samples_total, value=e.value, reference=e.reference,
                           temperature_c=e.temperature_c, power_w=e.power_w, reasons=e.reasons, detail=e.detail,
                           sample_interval_ns=e.sample_interval_ns, holding=e.holding)
        for e in fact.events:
            h.events.add(entity_id=e.entity_id, kind=e.kind, code=e.code, time_unix_ns=e.time_ns, detail=e.detail)
    elif isinstance(fact, Progress):
        msg.progress.topic, msg.progress.partition = fact.topic, fact.partition
        msg.progress.partitions, msg.progress.through_unix_ns = fact.partitions, fact.through_ns
        msg.progress.idle = fact.idle
        if fact.end_offset is not None:
            msg.progress.end_offset = fact.end_offset
    elif isinstance(fact, NominalVote):
        msg.vote.cluster, msg.vote.node, msg.vote.rate, msg.vote.weight = fact.cluster, fact.node, fact.rate, fact.weight
    else:
        msg.placement.cluster, msg.placement.job_id = fact.cluster, fact.job_id
        msg.placement.nodes.extend(fact.nodes)
        msg.placement.last_step_unix_ns = fact.last_step_ns
        msg.placement.ranks = fact.ranks
        msg.placement.first_step_unix_ns = fact.first_step_ns
    return key_of(fact), msg.SerializeToString()


def decode(value: bytes) -> Fact:
    """A facts record's value as its model; `FactError` for anything else."""
    try:
        msg = rec.Fact.FromString(value)
    except DecodeError as exc:
        raise FactError(f"not a facts record: {exc}") from exc
    which = msg.WhichOneof("fact")
    if which == "health":
        h = msg.health
        if not h.node:
            raise FactError("a health fact without a node")
        return NodeHealth(h.cluster, h.node, h.as_of_unix_ns, h.observed_since_unix_ns, h.observed_until_unix_ns,
                          h.silent,
                          tuple(Episode(e.entity_id, e.condition, e.start_unix_ns, e.end_unix_ns, e.open, e.samples_on,
                                        e.samples_total, e.value, e.reference, e.temperature_c, e.power_w, e.reasons,
                                        e.detail, e.sample_interval_ns or 1_000_000_000, e.holding)
                                for e in h.episodes),
                          tuple(HealthEvent(e.entity_id, e.kind, e.code, e.time_unix_ns, e.detail) for e in h.events))
    if which == "progress":
        p = msg.progress
        if not p.topic or p.partition >= max(p.partitions, 1):
            raise FactError(f"progress of partition {p.partition} of {p.partitions} of {p.topic!r}")
        return Progress(p.topic, p.partition, p.partitions, p.through_unix_ns, p.idle,
                        p.end_offset if p.HasField("end_offset") else None)
    if which == "vote":
        return NominalVote(msg.vote.cluster, msg.vote.node, msg.vote.rate, msg.vote.weight)
    if which == "placement":
        return JobPlacement(msg.placement.cluster, msg.placement.job_id, tuple(msg.placement.nodes),
                            msg.placement.last_step_unix_ns, msg.placement.ranks, msg.placement.first_step_unix_ns)
    raise FactError("an empty facts record")
