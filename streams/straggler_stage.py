"""Stage 3: straggling ranks, per job, joined on event time with the health of their nodes.

A `StragglerStage` holds the `models.straggler.StragglerDetector` state of the jobs of one
rank-steps partition (the topic is keyed by job). A rank's step report explains itself
only next to its node's telemetry (throttled GPU? downgraded NIC? paused port?), which
stage 1 turns into health digests on the facts topic, from every telemetry partition. So
reports are **held** until the facts' low watermark (every live telemetry partition
processed through the step's end plus the health lookahead) has passed them, and released
in event-time order: a worker draining a backlog, reading rank steps minutes ahead of the
telemetry that explains them, gives the answers a live one gives, and so does any number of
workers. Answers read the health *as of* the window's end (`models.node_health`).

Where no telemetry exists at all (a deployment with rank reports only), nothing is held
once the facts have been read to their end. Where the facts' watermark has not moved for
`STALLED_S` of wall time while reports are held (telemetry stopped, or what is on the
facts topic is another run's), they are released with what is known. Nothing is released
on the rank steps' own event time: a backlog's rank steps are read minutes ahead of the
telemetry (a few small records per job against hundreds per node), and that is exactly
when they must wait. Memory bounds the hold instead (`MAX_HELD_RECORDS`).

The same partition's progress heartbeats (`RankProgress`, the rank SDK's) go to the job's
`models.hang.HangDetector` at once, not held: a hang must be named within a minute, and
its root (an XID, a NIC gone down) is in the health digests from before the hang.

The nodes each job reported from are published as `JobPlacement` facts (the storm locator
names the jobs on a storm's victims with them).
"""
from __future__ import annotations

import heapq
import time
from collections import Counter
from dataclasses import dataclass
from operator import attrgetter

from fabricwatch.models.findings import Finding
from fabricwatch.models.frames import RankProgress, RankStep, one_job_step, step_end_ns
from fabricwatch.models.hang import HangDetector
from fabricwatch.models.node_health import LOOKAHEAD_S
from fabricwatch.models.straggler import StragglerDetector

from .accounting import Accounting
from .config import DetectionConfig
from .facts import FactBook, JobPlacement
from .impact import assess

# The facts' watermark did not move for this long on the wall clock while reports were
# held (longer than a partition takes to be declared idle, or to move in a rebalance):
# node health is not coming (collectors down, or the facts are another run's): stop waiting.
STALLED_S = 30.0
# A report ending this far ahead of this worker's clock is implausible (a clock or a forger:
# a step dated 2^62 would resolve every straggler): dropped. Not the facts' watermark: a
# backlog's rank steps are legitimately hours ahead of it.
MAX_AHEAD_OF_CLOCK_S = 600.0
# Reports held at most (records); beyond, the oldest are released early and counted.
MAX_HELD_RECORDS = 200_000
# A job's placement is republished at least this often while it reports (keeps it from expiring).
PLACEMENT_REFRESH_NS = 60 * 10**9
# A job's placement goes out again when its nodes changed, at most this often (event time):
# a 12,500-node job reports from a new node in each of its first 12,500 records.
PLACEMENT_MIN_INTERVAL_NS = 5 * 10**9
MAX_JOBS = 100_000
_LOOKAHEAD_NS = int(LOOKAHEAD_S * 1e9)


_NODE, _WORLD, _RANK, _START = (attrgetter(a) for a in ("node", "world_size", "rank", "start_ns"))


@dataclass(slots=True)
class _Run:
    """Consecutive records of one job's step, gathered before they go on the heap as one entry."""
    end_ns: int
    cluster: str
    job: str
    step: int
    steps: list[RankStep]
    received_ns: int


class StragglerStage:
    """The straggler detector of the jobs of one rank-steps partition, behind an event-time hold."""

    def __init__(self, config: DetectionConfig, facts: FactBook) -> None:
        self.facts = facts
        self.detector = StragglerDetector(health=facts.health)
        self.hangs = HangDetector(health=facts.health)
        self.accounting = Accounting("rank_steps", config.max_sample_age_s)
        self._held: list[tuple[int, int, str, str, list[RankStep], int]] = []   # heap
        # The run of records being gathered: a 100,000-rank job sends 12,500 records a step,
        # held, released and judged as one.
        self._forming: _Run | None = None
        self._seq = 0
        # (facts watermark, wall clock when it was first seen)
        self._watermark_seen: tuple[int, float] | None = None
        self.clock = time.monotonic
        self.wall_clock_ns = time.time_ns
        # (cluster, job) -> [nodes, newest step start, when last sent, nodes changed since]
        self._placements: dict[tuple[str, str], list] = {}
        # False until the worker has read the facts topic to its end once (before, "no
        # telemetry at all" cannot be told from "not read yet").
        self.facts_ready = True
        self.stats: Counter[str] = Counter()

    def rebind(self, facts: FactBook) -> None:
        self.facts = facts
        self.detector.health = facts.health
        self.hangs.health = facts.health

    def __getstate__(self) -> dict:
        state = self.__dict__.copy()
        state["facts_ready"] = True
        del state["clock"], state["wall_clock_ns"]
        return state

    def __setstate__(self, state: dict) -> None:
        state.setdefault("_forming", None)
        self.__dict__.update(state)
        if "hangs" not in state:               # a state saved before hang detection existed
            self.hangs = HangDetector(health=self.detector.health)
        self.clock, self.wall_clock_ns = time.monotonic, time.time_ns
        if self._watermark_seen is not None:    # the wall clock of another process: wait from now
            self._watermark_seen = (self._watermark_seen[0], self.clock())

    @property
    def held(self) -> int:
        """Groups of reports held (a record, or a run of records of one job's step)."""
        return len(self._held) + (self._forming is not None)

    def add(self, steps: list[RankStep], cluster: str, received_ns: int = 0) -> tuple[list[Finding], list[JobPlacement]]:
        """Hold one record of rank steps (one job's); release what the watermark allows."""
        if steps:
            latest_ns = self.wall_clock_ns() + int(MAX_AHEAD_OF_CLOCK_S * 1e9)
            end = max(map(step_end_ns, steps))
            if end > latest_ns:
                plausible = [s for s in steps if step_end_ns(s) <= latest_ns]
                self.stats["implausible_rank_steps"] += len(steps) - len(plausible)
                steps = plausible
                end = max(map(step_end_ns, steps), default=0)
        if steps:
            self.hangs.add_steps(steps)
            self._hold(steps, end, cluster, received_ns)
            self.stats["held_records"] += 1
        if self.accounting.rebuilding:
            # Refolding history after a move: what the previous owner had released depends on
            # its facts then, not on these records, so nothing is released (and suppressed)
            # now; the next release emits, again, what it had emitted (same event ids).
            return [], []
        return self.release()

    def add_progress(self, progress: list[RankProgress], cluster: str, received_ns: int = 0) -> list[Finding]:
        """Progress heartbeats of one record (one job's): judged at once, never held."""
        if not progress:
            return []
        latest_ns = self.wall_clock_ns() + int(MAX_AHEAD_OF_CLOCK_S * 1e9)
        plausible = [p for p in progress if p.time_ns <= latest_ns]
        self.stats["implausible_rank_progress"] += len(progress) - len(plausible)
        started = time.perf_counter()
        found = self.hangs.add_progress(plausible, cluster=cluster)
        if self.accounting.rebuilding:
            return []            # the state is refolded; what it found was emitted by the previous owner
        if found:
            found = assess(found, self.facts, None, self._job_gpus)     # a hang stalls its whole job
        return self.accounting.settle(found, progress[0].job_id, received_ns, started)

    def _hold(self, steps: list[RankStep], end: int, cluster: str, received_ns: int) -> None:
        """A record joins the run of its job's step, or starts a run (the one before goes on the heap)."""
        first, run = steps[0], self._forming
        one_step = one_job_step(steps)
        if run is not None and one_step and (run.step, run.job, run.cluster) == (first.step, first.job_id, cluster):
            run.steps.extend(steps)
            run.end_ns = max(run.end_ns, end)
            return
        self._push_forming()
        if one_step:
            self._forming = _Run(end, cluster, first.job_id, first.step, list(steps), received_ns)
        else:
            self._seq += 1
            heapq.heappush(self._held, (end, self._seq, cluster, first.job_id, steps, received_ns))

    def _push_forming(self) -> None:
        run, self._forming = self._forming, None
        if run is not None:
            self._seq += 1
            heapq.heappush(self._held, (run.end_ns, self._seq, run.cluster, run.job, run.steps, run.received_ns))

    def release(self, everything: bool = False) -> tuple[list[Finding], list[JobPlacement]]:
        """Feed the detector every held report the watermark has passed (or ``everything``), oldest first."""
        findings: list[Finding] = []
        placements: list[JobPlacement] = []
        wm, now_s = self.facts.watermark_ns, self.clock()
        if self._watermark_seen is None or wm != self._watermark_seen[0]:
            self._watermark_seen = (wm, now_s)
        stalled = bool(self.held) and now_s - self._watermark_seen[1] > STALLED_S
        free = everything or (self.facts_ready and (not self.facts.heard_progress or stalled))
        if self._forming is not None and (free or self._forming.end_ns + _LOOKAHEAD_NS <= wm):
            self._push_forming()            # its run is over or releasable: released in end order
        if free and stalled and not everything and self._held:
            self.stats["released_health_stalled"] += len(self._held)
        touched: set[tuple[str, str]] = set()
        started = time.perf_counter()
        released = 0
        while self._held:
            end, _, cluster, job, steps, received_ns = self._held[0]
            if not (free or end + _LOOKAHEAD_NS <= wm or len(self._held) > MAX_HELD_RECORDS):
                break
            heapq.heappop(self._held)
            released += 1
            if not free and end + _LOOKAHEAD_NS > wm:
                self.stats["released_before_health"] += 1     # held too long, or too many held
            found = self.detector.add_steps(steps, cluster=cluster)
            if self._place(cluster, job, steps):
                touched.add((cluster, job))
            if found:
                found = assess(found, self.facts, None, self._job_gpus)
                findings += self.accounting.settle(found, job, received_ns, None)
        if released:        # the processing time of the records released together, as one
            self.accounting.account([], started)
        for key in sorted(touched):
            placement = self._placement_due(key)
            if placement is not None:
                placements.append(placement)
        return findings, placements

    def _place(self, cluster: str, job: str, steps: list[RankStep]) -> bool:
        """Note the nodes of a released record; False when the job is refused (too many)."""
        key = (cluster, job)
        entry = self._placements.get(key)
        if entry is None:
            if len(self._placements) >= MAX_JOBS:
                self.stats["jobs_refused"] += 1
                return False
            entry = self._placements[key] = [set(), 0, -(2**62), False, 0, 0]
        if len(entry) < 6:                              # a checkpoint from before ranks were placed
            entry += [0, 0][len(entry) - 4:]
        nodes, before, ranks_before = entry[0], len(entry[0]), entry[4]
        # C-level passes (map, attrgetter): a giant job sends 12,500 of these records a step
        nodes.update(map(_NODE, steps))
        ranks = max(ranks_before, max(map(_WORLD, steps)), max(map(_RANK, steps)) + 1)   # the job's GPUs
        starts = list(map(_START, steps))
        entry[4], entry[1] = ranks, max(entry[1], max(starts))
        entry[3] = entry[3] or len(nodes) != before or ranks != ranks_before
        first = min(starts)
        entry[5] = min(entry[5], first) if entry[5] else first
        return True

    def _job_gpus(self, cluster: str, job: str) -> int:
        """The GPUs of a job of this stage, from its own ranks' world size (0: not seen)."""
        entry = self._placements.get((cluster, job))
        return entry[4] if entry is not None and len(entry) > 4 else 0

    def _placement_due(self, key: tuple[str, str]) -> JobPlacement | None:
        nodes, last_ns, sent_ns, changed, ranks, first_ns = self._placements[key][:6]
        since = last_ns - sent_ns
        if not (changed and since >= PLACEMENT_MIN_INTERVAL_NS) and since < PLACEMENT_REFRESH_NS:
            return None
        self._placements[key][2:4] = [last_ns, False]
        return JobPlacement(key[0], key[1], tuple(sorted(nodes)), last_ns, ranks, first_ns)

    def flush(self) -> tuple[list[Finding], list[JobPlacement]]:
        """Release everything held (the end of a replay)."""
        return self.release(everything=True)

    @property
    def open_anomalies(self) -> dict[str, tuple[str, str]]:
        return self.accounting.open_anomalies
