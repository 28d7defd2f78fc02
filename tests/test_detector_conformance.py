"""Conformance: every detector the stages build keeps the promises of its protocol.

As river checks each of its estimators with one suite (`river.utils.estimator_checks`),
this runs one suite over every detector of `models/`, one entry each, each fed what feeds
it live, from the simulator (`Driver`: stage 1's records with their rates and screens,
stage 2's watchdog changes and partition progress, stage 3's rank steps and heartbeats):

1. a pickle taken mid-run (storms, downs and stragglers open) continues with exactly the
   findings of the original;
2. two fresh instances fed the same run give the same findings;
3. memory is bounded: the pickled state after 4N ticks of a healthy run is within a small
   margin of that after N (state per entity, not per tick);
4. a healthy run gives no finding;
5. the detector declares the protocol of `models.detector` it implements, and has its methods.

(1) and (2) run on an eventful run (`FABRIC_FAULTS` or `WORKLOAD_FAULTS`: something for
every detector, so that there are findings to compare), (3) and (4) on a healthy one.
`test_the_suite_fails_*` shows the checks catch a detector that remembers every tick, one
that is not deterministic, and one whose pickle loses state.
"""
from __future__ import annotations

import functools
import pickle
import random
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import pytest

from fabricwatch.models import detector as protocols
from fabricwatch.models.ecmp_imbalance import EcmpImbalanceDetector
from fabricwatch.models.ecn_pfc_misorder import EcnPfcMisorderDetector
from fabricwatch.models.frames import layout_groups
from fabricwatch.models.gpu_faults import GpuFaultDetector
from fabricwatch.models.hang import HangDetector
from fabricwatch.models.health_tracker import HealthTracker
from fabricwatch.models.link_down import LinkDownDetector
from fabricwatch.models.link_downgrade import LinkDowngradeDetector
from fabricwatch.models.link_flap import LinkFlapDetector
from fabricwatch.models.lossless_drop import LosslessDropDetector
from fabricwatch.models.node_health import PARTIAL_PAUSE
from fabricwatch.models.pfc_deadlock import PfcDeadlockDetector
from fabricwatch.models.pfc_storm import PfcWatchdog
from fabricwatch.models.rates import RateTracker
from fabricwatch.models.storm_locator import SourceProgress, StormLocator
from fabricwatch.models.straggler import StragglerDetector
from fabricwatch.models.topology import rail_optimised
from fabricwatch.models.unknown import UnknownAnomalyDetector
from fabricwatch.simulator.cluster import ClusterSimulator
from fabricwatch.simulator.fabric_faults import (EcmpPolarization, EcnAfterPause, Incast, LinkDowngrade, LinkFlap,
                                                 PfcDeadlock, PfcStorm, QueueDrops, SwitchLinkDown)
from fabricwatch.simulator.host_faults import GpuXid, RankStuck, Straggler
from fabricwatch.streams.decode import pack, rank_progress_of, rank_steps_of, to_batch

# 4 nodes of 2 GPUs, two units of 2: leaves leaf-u{0,1}-r{0,1} (downlinks Ethernet0-1,
# uplinks Ethernet2-3 to spine-{0,1}, whose port Ethernet<2u+r> faces leaf-u<u>-r<r>).
TOPO = rail_optimised("c1", n_nodes=4, gpus_per_node=2, nodes_per_unit=2, n_spines=2)
SHORT_S = 150           # N of the memory check (ticks of 1 s); the long run is 4 N
EVENTFUL_S = 150
CLONE_AT = (40, 75)     # ticks after which a pickled copy takes over: before the onsets, in the middle
# Two eventful runs (each fault alone on its part of the fabric; the cluster's one job would
# otherwise be stalled by one fault while another needs its traffic).
FABRIC_FAULTS = (
    PfcStorm(sources=(("node-0003", "mlx5_0/1"),), onset_s=50.0, offset_s=90.0),
    LinkDowngrade("node-0001", "mlx5_1/1", onset_s=45.0, offset_s=100.0),
    LinkFlap("node-0002", "mlx5_1/1", onset_s=55.0, flaps=3),
    SwitchLinkDown("leaf-u1-r1", "Ethernet3", onset_s=60.0, offset_s=110.0),
    GpuXid("node-0004", 1, 48, onset_s=65.0, offset_s=70.0),
    QueueDrops("leaf-u0-r1", "Ethernet1", onset_s=50.0, offset_s=120.0),
    PfcDeadlock((("leaf-u1-r0", "Ethernet3"), ("spine-1", "Ethernet2")), onset_s=70.0, offset_s=95.0),
)
WORKLOAD_FAULTS = (
    EcmpPolarization("leaf-u0-r0", ("Ethernet2",), onset_s=45.0, offset_s=140.0),
    EcnAfterPause("leaf-u1-r1", onset_s=45.0, offset_s=140.0, incast=0.5),
    Incast("leaf-u0-r1", onset_s=45.0, offset_s=140.0),
    Incast("leaf-u1-r0", onset_s=45.0, offset_s=140.0),
    Straggler("node-0002", 1, onset_s=45.0, factor=1.5),
    RankStuck("node-0003", 1, onset_s=110.0, offset_s=135.0),
)


@functools.cache
def healthy_run(seconds: int) -> tuple:
    return tuple(ClusterSimulator(TOPO, seed=7, interval_s=1.0).run(seconds))


@functools.cache
def eventful_run(faults: tuple) -> tuple:
    return tuple(ClusterSimulator(TOPO, seed=7, interval_s=1.0, faults=faults).run(EVENTFUL_S))


# ---------------------------------------------------------------------------------- drivers
class Driver:
    """Turns simulator ticks into one detector's input, as its stage does, and feeds it.

    ``steps(ticks)`` builds fresh input objects on every call (a screen writes into the
    stacks it screens), so two detectors fed one run do not share anything.
    """

    def steps(self, ticks) -> Iterator:
        raise NotImplementedError

    def feed(self, det, step) -> list:
        raise NotImplementedError

    def alarms(self, out: list) -> list:
        """What, of the detector's output, a healthy run must not produce."""
        return out


class SourceRecords(Driver):
    """Stage 1: each source's tick as one record, rates for every layout, then the screens
    over every record of the tick (`streams.source_stage.SourceStage.observe_many`)."""

    def steps(self, ticks):
        rates = RateTracker()
        for tick in ticks:
            batches = [to_batch(pack([s])) for s in tick if s.blocks or s.events]
            groups = layout_groups(batches)
            for group in groups:
                rates.update_group(group)
            yield groups, batches

    def feed(self, det, step):
        groups, batches = step
        if hasattr(det, "screen"):
            for group in groups:
                det.screen(group)
        return [f for batch in batches for f in det.update_batch(batch)]


class WatchdogRecords(SourceRecords):
    """The PFC watchdog's onsets and restorations: a healthy fabric sends none (stage 2's load)."""


class HealthRecords(SourceRecords):
    """Health digests: a healthy node's digest names no event and no episode but partial
    pauses (a healthy fabric's incast pauses ports at a duty below `STORM_VICTIM_PAUSE_DUTY`)."""

    def alarms(self, out):
        return [d for d in out if d.events or any(e.condition != PARTIAL_PAUSE for e in d.episodes)]


class PauseChanges(Driver):
    """Stage 2: the watchdog's changes of every source, then the progress through the tick."""

    def steps(self, ticks):
        watchdog = PfcWatchdog()
        for (groups, batches), tick in zip(SourceRecords().steps(ticks), ticks):
            changes = WatchdogRecords().feed(watchdog, (groups, batches))
            yield changes, max(s.time_unix_ns for s in tick)

    def feed(self, det, step):
        changes, through_ns = step
        out = [f for change in sorted(changes, key=lambda c: c.at_ns) for f in det.update(change)]
        if isinstance(det, StormLocator):
            return out + det.progress(SourceProgress("c1", {"replay/0": through_ns}, ("replay/0",)))
        return out + det.advance(through_ns)


class RankReports(Driver):
    """Stage 3: each node's rank steps and progress heartbeats of the tick."""

    def steps(self, ticks):
        for tick in ticks:
            yield ([rank_steps_of(s) for s in tick if s.rank_steps],
                   [rank_progress_of(s) for s in tick if s.rank_progress])

    def feed(self, det, step):
        steps, progress = step
        out: list = []
        for record in steps:
            found = det.add_steps(record)
            out += found or []          # the hang detector learns from steps, reports on progress
        if isinstance(det, protocols.RankProgressDetector):
            for record in progress:
                out += det.add_progress(record, cluster="c1")
        return out


@dataclass(frozen=True)
class Entry:
    name: str
    make: Callable[[], object]
    driver: Driver
    protocol: type
    faults: tuple = FABRIC_FAULTS   # the eventful run's
    eventful: bool = True           # the eventful run gives it findings to compare


DETECTORS = [
    Entry("link_downgrade", lambda: LinkDowngradeDetector(TOPO), SourceRecords(), protocols.Detector),
    Entry("link_flap", lambda: LinkFlapDetector(TOPO), SourceRecords(), protocols.Detector),
    Entry("link_down", lambda: LinkDownDetector(TOPO), SourceRecords(), protocols.Detector),
    Entry("gpu_faults", GpuFaultDetector, SourceRecords(), protocols.Detector),
    # its reports need 1000 windows of baseline (2.8 h): its learning is what is compared
    Entry("unknown", lambda: UnknownAnomalyDetector(), SourceRecords(), protocols.Detector, eventful=False),
    Entry("ecmp_imbalance", lambda: EcmpImbalanceDetector(TOPO), SourceRecords(), protocols.Detector,
          faults=WORKLOAD_FAULTS),
    Entry("ecn_pfc_misorder", lambda: EcnPfcMisorderDetector(TOPO), SourceRecords(), protocols.Detector,
          faults=WORKLOAD_FAULTS),
    Entry("lossless_drop", LosslessDropDetector, SourceRecords(), protocols.Detector),
    Entry("pfc_watchdog", PfcWatchdog, WatchdogRecords(), protocols.Feeder),
    Entry("health_tracker", lambda: HealthTracker(TOPO), HealthRecords(), protocols.Feeder),
    Entry("storm_locator", lambda: StormLocator(TOPO, cluster="c1"), PauseChanges(), protocols.ChangeDetector),
    Entry("pfc_deadlock", lambda: PfcDeadlockDetector(TOPO, cluster="c1"), PauseChanges(), protocols.ChangeDetector),
    Entry("straggler", lambda: StragglerDetector(cluster="c1"), RankReports(), protocols.RankStepDetector,
          faults=WORKLOAD_FAULTS),
    Entry("hang", lambda: HangDetector(cluster="c1"), RankReports(), protocols.RankProgressDetector,
          faults=WORKLOAD_FAULTS),
]
IDS = [e.name for e in DETECTORS]


def run(entry: Entry, ticks, det=None, clone_at: int | None = None):
    """Feed ``ticks``; the output per tick, and the pickled copies taken after ``clone_at``."""
    det = entry.make() if det is None else det
    outputs, clone = [], None
    for i, step in enumerate(entry.driver.steps(ticks)):
        outputs.append(entry.driver.feed(det, step))
        if clone_at is not None and i + 1 == clone_at:
            clone = pickle.loads(pickle.dumps(det))
    return det, outputs, clone


def continued(entry: Entry, ticks, det, start: int) -> list:
    """The output per tick of ``det`` fed ``ticks`` from tick ``start`` on (the input
    before it built as well: rates and the watchdog need the history)."""
    return [entry.driver.feed(det, step) for i, step in enumerate(entry.driver.steps(ticks)) if i >= start]


def comparable(outputs: list) -> list:
    """Findings (and records) as comparable values: their reprs, every field, where a NaN
    in the evidence (a value not read) equals itself."""
    return [[repr(f) for f in out] for out in outputs]


# ---------------------------------------------------------------------------------- the checks
@pytest.mark.parametrize("entry", DETECTORS, ids=IDS)
def test_it_declares_and_implements_its_protocol(entry):
    det = entry.make()
    assert isinstance(det, entry.protocol)
    assert entry.protocol in type(det).__mro__, f"{type(det).__name__} does not declare {entry.protocol.__name__}"
    others = [p for p in protocols.PROTOCOLS if p is not entry.protocol and p in type(det).__mro__]
    assert others == []


@pytest.mark.parametrize("entry", DETECTORS, ids=IDS)
def test_two_fresh_instances_give_the_same_findings(entry):
    ticks = eventful_run(entry.faults)
    _, first, _ = run(entry, ticks)
    _, second, _ = run(entry, ticks)
    assert comparable(first) == comparable(second)
    if entry.eventful:
        assert sum(map(len, first)) > 0, "the eventful run gives it nothing to compare"


@pytest.mark.parametrize("entry", DETECTORS, ids=IDS)
def test_a_pickle_taken_mid_run_continues_as_the_original(entry):
    ticks = eventful_run(entry.faults)
    for at in CLONE_AT:
        _, outputs, clone = run(entry, ticks, clone_at=at)
        assert comparable(continued(entry, ticks, clone, at)) == comparable(outputs[at:]), f"pickled after {at} s"


def healthy(entry: Entry, det=None) -> tuple[list, int, int]:
    """The output per tick of 4 N ticks of the healthy run, and the pickled state after N and after 4 N."""
    det = entry.make() if det is None else det
    outputs, sizes = [], []
    for i, step in enumerate(entry.driver.steps(healthy_run(4 * SHORT_S))):
        outputs.append(entry.driver.feed(det, step))
        if i + 1 in (SHORT_S, 4 * SHORT_S):
            sizes.append(len(pickle.dumps(det)))
    return outputs, *sizes


@functools.cache
def healthy_of(name: str) -> tuple[list, int, int]:
    return healthy(next(e for e in DETECTORS if e.name == name))


def bounded(short: int, long: int) -> bool:
    """Flat within 10 % plus 2 kB (counters and clocks grow by digits, not by ticks)."""
    return long <= 1.1 * short + 2048


@pytest.mark.parametrize("entry", DETECTORS, ids=IDS)
def test_a_healthy_run_gives_no_finding(entry):
    outputs, _, _ = healthy_of(entry.name)
    alarms = [f for out in outputs for f in entry.driver.alarms(out)]
    assert alarms == []


@pytest.mark.parametrize("entry", DETECTORS, ids=IDS)
def test_state_does_not_grow_with_the_length_of_a_healthy_run(entry):
    _, short, long = healthy_of(entry.name)
    assert bounded(short, long), f"{short} B after {SHORT_S} s, {long} B after {4 * SHORT_S} s"


# ---------------------------------------------------------------------------------- the suite can fail
class _Hoarder(protocols.Detector):
    """A detector that remembers every record it saw (the bug the memory check is for)."""

    def __init__(self):
        self.seen: list[tuple[str, int]] = []

    def update_batch(self, batch):
        self.seen += [(batch.source, int(t)) for t in batch.times_ns]
        return []


class _Dice(protocols.Detector):
    """A detector whose findings depend on a process-wide random state, not on its input."""

    def update_batch(self, batch):
        return [batch.source] if random.random() < 0.05 else []


def test_the_suite_fails_a_detector_that_remembers_every_tick():
    entry = Entry("hoarder", _Hoarder, SourceRecords(), protocols.Detector)
    assert isinstance(entry.make(), protocols.Detector)
    _, short, long = healthy(entry)
    assert not bounded(short, long)


def test_the_suite_fails_a_detector_that_is_not_deterministic():
    entry = Entry("dice", _Dice, SourceRecords(), protocols.Detector)
    ticks = eventful_run(FABRIC_FAULTS)
    _, first, _ = run(entry, ticks)
    _, second, _ = run(entry, ticks)
    assert comparable(first) != comparable(second)


class _Forgetful(protocols.Detector):
    """A detector whose pickle leaves out what it counts (a checkpoint that loses state)."""

    def __init__(self):
        self.records: dict[str, int] = {}

    def update_batch(self, batch):
        n = self.records[batch.source] = self.records.get(batch.source, 0) + 1
        return [f"{batch.source} #{n}"] if n % 50 == 0 else []

    def __getstate__(self):
        return {"records": {}}


def test_the_suite_fails_a_detector_that_loses_state_in_its_pickle():
    entry = Entry("forgetful", _Forgetful, SourceRecords(), protocols.Detector)
    ticks = eventful_run(FABRIC_FAULTS)
    _, outputs, clone = run(entry, ticks, clone_at=CLONE_AT[1])
    assert comparable(continued(entry, ticks, clone, CLONE_AT[1])) != comparable(outputs[CLONE_AT[1]:])
