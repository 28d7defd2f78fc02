"""The protocols detectors implement, and the driver that feeds a per-source one only what it reads.

Every detector declares (subclasses) the one protocol of its input and output, and
tests/test_detector_conformance.py holds each to it (pickling, determinism, bounded state,
silence on a healthy run):

* `Detector`: stage 1, one source's records (`frames.SourceBatch`) in, findings out;
* `Feeder`: stage 1 too, but its output is records for a later stage, not findings (the
  PFC watchdog's pause-state changes for stage 2, the health digests for stage 3);
* `ChangeDetector`: stage 2, the watchdog's `PauseStateChange` records of a cluster in;
* `RankStepDetector`, `RankProgressDetector`: stage 3, a job's rank steps or heartbeats in.

A detector of stage 1 takes one record of one source at a time (`frames.SourceBatch`:
several ticks, one `FrameStack` per block layout) through ``update_batch`` and returns its
findings. Before the records of a batch are judged one by one, a detector may ``screen``
each `frames.LayoutGroup` (one layout's stacks of every record, end to end): a few array
operations that tell, per stack, whether anything in it could concern the detector (a
port near a pause, a down event, a changed picture); the per-record path then reads that
(``stack.screens``) and stops early for the many records where nothing happens. Most rules judge tick by tick: they implement ``update(view)`` for one tick and
``reads(kind, counter_names, gauge_names, label_names)``, and `ticks_of` hands them the
ticks of the stacks they read, and only those: a PFC-only tick carries no sysfs ``rate``
label and so never reaches the downgrade rule, where it would read as "no evidence" at
best and as "healthy" at worst. Rules on the 100 ms path (rates, the PFC watchdog, the
unknown-anomaly baselines, node health) vectorise over the ticks of a record themselves.
"""
from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING, Protocol, runtime_checkable

from .findings import Finding
from .frames import FrameStack, RankProgress, RankStep, SourceBatch, SourceView

if TYPE_CHECKING:           # the models below import this module
    from .pfc_storm import PauseStateChange

# Layout decisions remembered per detector (a fleet has a handful of layouts).
MAX_LAYOUTS = 4096


@runtime_checkable
class Detector(Protocol):
    """The stage-1 detector protocol (`source_stage` drives a list of them).

    ``screen(group)`` is optional: detectors without it see every record whole.
    """

    def update_batch(self, batch: SourceBatch) -> list[Finding]: ...


@runtime_checkable
class Feeder(Protocol):
    """A stage-1 model whose output feeds a later stage (`source_stage` drives each by name):
    records of its own kind, none while the source is healthy. ``screen`` as for `Detector`."""

    def update_batch(self, batch: SourceBatch) -> list: ...


@runtime_checkable
class ChangeDetector(Protocol):
    """Stage 2 (`storm_stage`, one per cluster): the watchdog's changes, in event-time order.

    Each also has its own way to be told that event time moved without a change (the
    locator's ``progress``, the deadlock model's ``advance``)."""

    def update(self, change: PauseStateChange) -> list[Finding]: ...

    def open_findings(self) -> list[Finding]: ...


@runtime_checkable
class RankStepDetector(Protocol):
    """Stage 3 (`straggler_stage`): one record of rank steps (one job's) at a time."""

    def add_steps(self, steps: list[RankStep], cluster: str | None = None) -> list[Finding]: ...


@runtime_checkable
class RankProgressDetector(Protocol):
    """Stage 3: the ranks' progress heartbeats, judged at once; rank steps only teach it."""

    def add_steps(self, steps: list[RankStep]) -> None: ...

    def add_progress(self, reports: list[RankProgress], cluster: str | None = None) -> list[Finding]: ...

    def open_findings(self) -> list[Finding]: ...


PROTOCOLS = (Detector, Feeder, ChangeDetector, RankStepDetector, RankProgressDetector)


def layout_key(stack: FrameStack) -> tuple:
    return (stack.kind, stack.counter_names, stack.gauge_names, tuple(stack.labels))


class PerTick:
    """Mixin: ``update_batch`` from ``update`` (one tick) and ``reads`` (which layouts matter).

    ``READS_EVENTS``: whether device events (XIDs) matter; ticks with events are then
    passed even when they carry no stack the detector reads.
    """

    READS_EVENTS = False

    def reads(self, kind: str, counter_names: tuple[str, ...], gauge_names: tuple[str, ...],
              label_names: tuple[str, ...]) -> bool:
        raise NotImplementedError

    def update(self, view: SourceView) -> list[Finding]:
        raise NotImplementedError

    def update_batch(self, batch: SourceBatch) -> list[Finding]:
        out: list[Finding] = []
        for view in ticks_of(self, batch):
            out += self.update(view)
        return out


def ticks_of(detector: PerTick, batch: SourceBatch) -> Iterator[SourceView]:
    """The ticks of ``batch`` with only the stacks ``detector`` reads (events as it wants)."""
    cache = detector.__dict__.setdefault("_reads_cache", {})
    stacks = []
    for stack in batch.stacks:
        key = layout_key(stack)
        wanted = cache.get(key)
        if wanted is None:
            if len(cache) >= MAX_LAYOUTS:
                cache.clear()
            wanted = cache[key] = bool(detector.reads(*key))
        if wanted:
            stacks.append(stack)
    events = detector.READS_EVENTS and bool(batch.events)
    if not stacks and not events:
        return iter(())
    return batch.views(stacks, events=detector.READS_EVENTS)
