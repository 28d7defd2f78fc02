"""The storm locator's low watermark: grace periods run on how far every live source has been
processed (stage 1's `SourceProgress` records), not on the newest record; a silent source is
dropped from it after the liveness window; stage 1 batches its progress at a bounded rate; the
record crosses the pause-states topic as JSON."""
from __future__ import annotations

import itertools
import random

import pytest
from helpers import nic_snapshot

from fabricwatch.models.findings import OPEN, EntityRef, Evidence
from fabricwatch.models.pfc_storm import PAUSED, PAUSING, PauseStateChange
from fabricwatch.models.storm_locator import (
    NIC_SOURCE_CONFIDENCE,
    ORPHAN_GRACE_MS,
    RESTORATION_LAG_MS,
    SILENT_SOURCE_CONFIDENCE,
    SOURCE_LIVENESS_MS,
    SOURCE_MAX_LAG_MS,
    SWITCH_SOURCE_CONFIDENCE,
    SourceProgress,
    StormLocator,
)
from fabricwatch.models.topology import rail_optimised
from fabricwatch.models.watermark import BUCKET_MS as WATERMARK_BUCKET_MS
from fabricwatch.models.watermark import LowWatermark as _LowWatermark
from fabricwatch.simulator.cluster import ClusterSimulator
from fabricwatch.simulator.fabric_faults import PfcStorm
from fabricwatch.simulator.workload import Job
from fabricwatch.streams import source_stage
from fabricwatch.streams.config import DetectionConfig
from fabricwatch.streams.decode import snapshot_batch
from fabricwatch.streams.facts import FactBook, Progress
from fabricwatch.streams.facts import decode as facts_decode
from fabricwatch.streams.facts import encode as facts_encode
from fabricwatch.streams.storm_stage import StormStage
from fabricwatch.streams.codec import RecordError, pause_change_from_json, pause_change_to_json
from fabricwatch.streams.pipeline import DetectionPipeline

MS = 1_000_000
T0 = 1_700_000_000_000 * MS              # a realistic event time: nothing may assume it starts at 0
TOPO = rail_optimised("c1", n_nodes=8, nodes_per_unit=4, n_spines=2)
NODES = list(TOPO.nodes)
SWITCHES = list(TOPO.switches)
SOURCE_NIC = EntityRef("c1", node="node-0003", device="mlx5_2", port="1")       # on leaf-u0-r2 Ethernet2
HELD_LEAF_PORT = EntityRef("c1", switch="leaf-u0-r2", port="Ethernet2")
VICTIM_NIC = EntityRef("c1", node="node-0001", device="mlx5_2", port="1")


def change(ref, role, at_ms, active=True):
    name = "rx_pause_duty" if role == PAUSED else "tx_pause_duty"
    return PauseStateChange(ref, 3, role, active, T0 + (at_ms - 200) * MS, T0 + at_ms * MS,
                            [Evidence(name, 0.99, 0.8, "s/s")])


def progress(sources, at_ms):
    return SourceProgress("c1", {s: T0 + at_ms * MS for s in sources})


def opened(findings):
    return [(f.entity.path(), f.confidence) for f in findings if f.state == OPEN]


# ----------------------------------------------------------------------- the locator
@pytest.mark.parametrize("on_watermark", [False, True])
def test_switches_read_ahead_of_the_nodes_name_the_nic_only_on_the_watermark(on_watermark):
    """The catch-up of issue #7 with hand-built records: the switches' backlog (up to 6 s) is
    processed before the nodes' (at 1 s). On the newest record the held leaf port's grace
    runs out and it is named a silent source; on the watermark the nodes hold the clock back
    until the pausing NIC arrives."""
    loc = StormLocator(TOPO)
    out = []
    if on_watermark:
        out += loc.progress(progress(NODES + SWITCHES, 1_000))
    out += loc.update(change(HELD_LEAF_PORT, PAUSED, 1_100))
    for at_ms in range(1_100, 6_001, 100):                       # the switches' backlog
        if on_watermark:
            out += loc.progress(progress(SWITCHES, at_ms))
        out += loc.poll(T0 + at_ms * MS)                          # the cluster timer meanwhile
    if on_watermark:
        assert loc.watermark_ns < T0 + 1_100 * MS
    out += loc.update(change(VICTIM_NIC, PAUSED, 1_150))           # then the nodes' backlog
    out += loc.update(change(SOURCE_NIC, PAUSING, 1_200))
    for at_ms in range(1_200, 3_001, 100):
        if on_watermark:
            out += loc.progress(progress(NODES, at_ms))
        out += loc.poll(T0 + at_ms * MS)
    nic_root = ("c1/node-0003/mlx5_2/1", NIC_SOURCE_CONFIDENCE)
    if on_watermark:
        assert opened(out) == [nic_root]
    else:
        assert opened(out) == [("c1/leaf-u0-r2/Ethernet2", SILENT_SOURCE_CONFIDENCE), nic_root]


@pytest.mark.parametrize("leaf_restores_at_ms", [3_500, None])
def test_a_leaf_port_still_held_after_its_nic_stopped_is_a_restoration_lag_not_a_silent_node(leaf_restores_at_ms):
    """At a storm's end the NIC's watchdog restores first; its leaf port, sampled every
    second by the switch, restores up to a sampling interval plus the restoration time
    later. That lag is not a silent node (the NIC reports); a hold that outlasts
    `RESTORATION_LAG_MS` after the NIC stopped is."""
    loc = StormLocator(TOPO)
    found = []
    for at_ms in range(0, 8_001, 100):
        found += [(at_ms, f) for f in loc.progress(progress(NODES + SWITCHES, at_ms))]
        if at_ms == 200:
            found += [(at_ms, f) for f in loc.update(change(SOURCE_NIC, PAUSING, 200))]
        if at_ms == 300:
            found += [(at_ms, f) for f in loc.update(change(HELD_LEAF_PORT, PAUSED, 300))]
        if at_ms == 2_000:
            found += [(at_ms, f) for f in loc.update(change(SOURCE_NIC, PAUSING, 2_000, active=False))]
        if at_ms == leaf_restores_at_ms:
            found += [(at_ms, f) for f in loc.update(change(HELD_LEAF_PORT, PAUSED, at_ms, active=False))]
    silent = [(at_ms, f.entity.path()) for at_ms, f in found if f.state == OPEN and f.confidence == SILENT_SOURCE_CONFIDENCE]
    assert [f.entity.path() for _, f in found if f.state == OPEN][:1] == ["c1/node-0003/mlx5_2/1"]
    if leaf_restores_at_ms is not None:
        assert silent == []
    else:
        assert silent == [(2_000 + RESTORATION_LAG_MS, "c1/leaf-u0-r2/Ethernet2")]


def test_a_node_silent_mid_storm_is_named_through_its_leaf_port_after_grace_and_liveness():
    """node-0003 stops reporting at 500 ms, just before its NIC would confirm pausing; its leaf
    port is held from 600 ms. It holds the watermark until it has been silent for the
    liveness window; then its silent-source root is named, not never."""
    loc = StormLocator(TOPO)
    found = []
    for at_ms in range(0, 13_001, 100):
        alive = [s for s in NODES + SWITCHES if s != "node-0003" or at_ms <= 500]
        found += [(at_ms, f) for f in loc.progress(progress(alive, at_ms))]
        if at_ms == 600:
            found += [(at_ms, f) for c in (change(HELD_LEAF_PORT, PAUSED, 600), change(VICTIM_NIC, PAUSED, 600))
                      for f in loc.update(c)]
        if at_ms == 10_000:                                   # 9.5 s silent: still waited for
            assert loc.watermark_ns <= T0 + 500 * MS
    assert [(at, path, conf) for at, f in found for path, conf in opened([f])] == [
        (10_600, "c1/leaf-u0-r2/Ethernet2", SILENT_SOURCE_CONFIDENCE)]
    f = next(f for _, f in found if f.state == OPEN)
    assert 500 + SOURCE_LIVENESS_MS < (f.detected_ns - T0) / MS <= 500 + SOURCE_LIVENESS_MS + 200
    assert "node-0003 mlx5_2/1" in f.summary and [r.path() for r in f.related] == ["c1/node-0001/mlx5_2/1"]


def test_a_source_far_behind_but_progressing_is_still_waited_for():
    """Uneven catch-up: the switches run 1 s per step, the nodes 0.1 s; after 40 steps the
    nodes are 36 s behind (far more than the liveness window) yet still progressing, so the
    grace waits for them and the pausing NIC explains the held leaf port when it arrives."""
    loc = StormLocator(TOPO)
    out = loc.update(change(HELD_LEAF_PORT, PAUSED, 1_100))
    for step in range(40):
        out += loc.progress(progress(SWITCHES, 1_000 + 1_000 * step))
        out += loc.progress(progress(NODES, 1_000 + 100 * step))
        if step == 2:
            out += loc.update(change(SOURCE_NIC, PAUSING, 1_200))
    assert (loc._watermark.newest_ns - loc.watermark_ns) / MS > SOURCE_LIVENESS_MS
    assert opened(out) == [("c1/node-0003/mlx5_2/1", NIC_SOURCE_CONFIDENCE)]


def test_a_clock_minutes_behind_does_not_hold_the_grace_back():
    """node-0008's clock is 2 min behind; every other source is current. A switch-root picture
    (spine-0 held, nothing congested on the leaf that pauses it) is named after the grace
    as it would be without node-0008."""
    loc = StormLocator(TOPO)
    others = [s for s in NODES + SWITCHES if s != "node-0008"]
    out = loc.update(change(EntityRef("c1", switch="spine-0", port="Ethernet2"), PAUSED, 200))
    at_open = None
    for at_ms in range(0, 2_001, 100):
        found = loc.progress(progress(others, at_ms)) + loc.progress(progress(["node-0008"], at_ms - 120_000))
        if found and at_open is None:
            at_open = at_ms
        out += found
    assert opened(out) == [("c1/leaf-u0-r2/Ethernet4", SWITCH_SOURCE_CONFIDENCE)]
    assert at_open == 1_200


def test_sources_of_the_topology_that_never_reported_hold_the_watermark():
    loc = StormLocator(TOPO)
    loc.progress(SourceProgress("c1", {}))           # names nobody: the clock does not switch yet
    assert loc.watermark_ns is None
    loc.progress(progress(SWITCHES, 0))
    loc.progress(progress(SWITCHES, 5_000))
    assert loc.watermark_ns == T0                    # the nodes were expected from the first record on
    loc.progress(progress(NODES, 4_000))
    assert loc.watermark_ns == T0 + 4_000 * MS


def test_without_progress_records_the_clock_is_the_newest_record():
    """A producer that sends no progress (an older stage 1) keeps the old behaviour."""
    loc = StormLocator(TOPO)
    loc.update(change(HELD_LEAF_PORT, PAUSED, 200))
    assert loc.watermark_ns is None
    assert opened(loc.poll(T0 + 1_200 * MS)) == [("c1/leaf-u0-r2/Ethernet2", SILENT_SOURCE_CONFIDENCE)]


@pytest.mark.parametrize("seed", range(5))
def test_the_bucketed_minimum_equals_a_brute_force_one(seed):
    """Random progress, deaths, revivals, lagging clocks: the incremental minimum is the
    minimum over the live sources (to the bucket), never moving back."""
    rng = random.Random(seed)
    liveness_ns, max_lag_ns, bucket_ns = 3_000 * MS, 20_000 * MS, WATERMARK_BUCKET_MS * MS
    wm = _LowWatermark(liveness_ns, max_lag_ns)
    sources = [f"s{i}" for i in range(30)]
    through: dict[str, int] = {}
    heard: dict[str, int] = {}
    newest = value = 0
    clock = {s: T0 + rng.randrange(0, 2_000) * MS for s in sources}
    offset = {s: -rng.choice([0, 0, 0, 25_000]) * MS for s in sources}     # a few clocks far behind
    for _ in range(400):
        batch = []
        for s in rng.sample(sources, rng.randrange(1, len(sources))):
            if rng.random() < 0.05:
                continue                                  # s is silent this round
            clock[s] += rng.randrange(0, 300) * MS
            batch.append((s, clock[s] + offset[s] - rng.choice([0, 0, 0, 50 * MS])))   # some redeliveries
        wm.advance(batch)
        for s, t in batch:
            if t > through.get(s, -1):
                through[s] = t
                newest = max(newest, t)
                heard[s] = newest
        live = [t // bucket_ns for s, t in through.items()
                if heard[s] >= newest - liveness_ns and t // bucket_ns >= (newest - max_lag_ns) // bucket_ns]
        value = max(value, min(live) * bucket_ns if live else newest)
        assert wm.settle() == value


# ----------------------------------------------------------------------- stage 1 -> stage 2
def run_pipeline(seconds, drop=None, interval_s=0.1, faults=()):
    """Simulated telemetry through `DetectionPipeline.process` in live order; ``drop``:
    (node, from_s) whose snapshots stop. Returns the pipeline, findings with their tick
    time, the largest lag of the watermark behind the newest sample after a tick, and every
    record stage 1 produced."""
    topo = rail_optimised("sim", n_nodes=8, gpus_per_node=2, nodes_per_unit=4, n_spines=2)
    jobs = [Job("job-a", ("node-0001", "node-0002", "node-0003", "node-0004"))]
    sim = ClusterSimulator(topo, seed=5, interval_s=interval_s, jobs=jobs, faults=list(faults), rank_steps=False)
    pipeline = DetectionPipeline(topology=topo)
    findings, records, max_lag_ns = [], [], 0
    observe_many = pipeline.sources.observe_many

    def observe(batches):                                 # keep what stage 1 emits, in order
        outs = observe_many(batches)
        for out in outs:
            records.extend(out.pause_records)
        return outs

    pipeline.sources.observe_many = observe
    for _ in range(int(round(seconds / interval_s))):
        snaps = sim.tick()
        tick_ns = sim.now_unix_ns
        for snap in sorted(snaps, key=lambda s: (s.time_unix_ns, s.source)):
            if drop and snap.source == drop[0] and snap.time_unix_ns >= sim.start_unix_ns + drop[1] * 1e9:
                continue
            findings += [(tick_ns - sim.start_unix_ns, f) for f in pipeline.process(snap)]
        newest = max(s.time_unix_ns for s in snaps)
        max_lag_ns = max(max_lag_ns, newest - pipeline.storms.watermark_ns)
    return pipeline, findings, max_lag_ns, records


def test_live_order_watermark_trails_the_newest_sample_by_one_interval():
    _, _, max_lag_ns, records = run_pipeline(3.0)
    # one sampling interval, plus the simulated clocks' +-5 ms offsets and the bucket
    assert max_lag_ns <= (100 + 2 * 5 + WATERMARK_BUCKET_MS) * MS
    assert any(isinstance(r, SourceProgress) for r in records)


def test_pipeline_node_silent_mid_storm_gets_its_silent_source_root_after_grace_within_the_linger():
    """End to end: node-0003 (its NIC mlx5_1/1 the storm's source from 1.0 s) stops reporting
    at 1.05 s, before its watchdog confirms. A pausing port is handed over at once, so the
    storm stage need not wait for a silent node longer than a collector's linger: its leaf
    port is named once held for the grace period (not after the 10 s liveness window that
    node health waits), and not before."""
    storm = PfcStorm(sources=(("node-0003", "mlx5_1/1"),), onset_s=1.0, offset_s=20.0)
    _, findings, _, _ = run_pipeline(12.5, drop=("node-0003", 1.05), faults=[storm])
    storms = [(t, f) for t, f in findings if f.kind == "pfc_storm" and f.state == OPEN]
    assert [(f.entity.path(), f.confidence) for _, f in storms] == [
        ("sim/leaf-u0-r1/Ethernet2", SILENT_SOURCE_CONFIDENCE)]
    t_ns, f = storms[0]
    assert 1_000 + ORPHAN_GRACE_MS <= t_ns / MS <= 1_050 + DetectionConfig().collector_linger_s * 1000 + 400
    assert "node-0003 mlx5_1/1" in f.summary


def test_stage_1_sends_its_partitions_progress_in_order_at_a_bounded_rate(monkeypatch):
    """Sampling (50 ms) faster than the progress interval (here 120 ms): the partition's first
    record is sent at once; afterwards its entries are at least the interval apart (not one
    per sample) and never much further; each names the partition and the partitions to wait
    for; per source, changes come in event-time order, and before the progress that covers them."""
    interval_ms = 120
    monkeypatch.setattr(source_stage, "_PROGRESS_INTERVAL_NS", interval_ms * MS)
    storm = PfcStorm(sources=(("node-0003", "mlx5_1/1"),), onset_s=0.5, offset_s=1.5)
    _, _, _, records = run_pipeline(2.0, interval_s=0.05, faults=[storm])
    progress_records = [r for r in records if isinstance(r, SourceProgress)]
    assert {tuple(r.through_ns_by_source) for r in progress_records} == {("replay/0",)}
    assert all(r.expect == ("replay/0",) for r in progress_records)
    through = [r.through_ns_by_source["replay/0"] for r in progress_records]
    gaps_ms = [(b - a) / MS for a, b in zip(through, through[1:])]
    assert min(gaps_ms) >= interval_ms and max(gaps_ms) <= interval_ms + 2 * 50
    assert len(through) <= 2_000 / interval_ms + 1
    changes = [r for r in records if not isinstance(r, SourceProgress)]
    assert changes                                                            # the storm's changes
    by_source: dict[str, list[int]] = {}
    for r in changes:
        by_source.setdefault(r.entity.switch or r.entity.node, []).append(r.at_ns)
    assert all(ts == sorted(ts) for ts in by_source.values())
    for i, r in enumerate(records):                   # no change is older than progress sent before it
        if not isinstance(r, SourceProgress):
            sent = [p.through_ns_by_source["replay/0"] for p in records[:i] if isinstance(p, SourceProgress)]
            assert not sent or r.at_ns > max(sent) - SOURCE_LIVENESS_MS * MS


# ----------------------------------------------------------------------- partitions drained unevenly
def stage_1_by_partition(partitions=3, seconds=4.0):
    """A storm cluster's telemetry through one stage 1 per partition (sources by hash, as Kafka
    keys them): per partition, the records it sends to stage 2, in its order."""
    topo = rail_optimised("sim", n_nodes=8, gpus_per_node=2, nodes_per_unit=4, n_spines=2)
    jobs = [Job("job-a", ("node-0001", "node-0002", "node-0003", "node-0004"))]
    storm = PfcStorm(sources=(("node-0003", "mlx5_1/1"),), onset_s=1.0, offset_s=3.0)
    sim = ClusterSimulator(topo, seed=5, interval_s=0.1, jobs=jobs, faults=[storm], rank_steps=False)
    pipeline = DetectionPipeline(topology=topo)
    stages = [source_stage.SourceStage(pipeline.config, topo, pipeline.facts, "t", p, partitions)
              for p in range(partitions)]
    sent: list[list] = [[] for _ in range(partitions)]
    for tick in sim.run(seconds):
        for snap in sorted(tick, key=lambda s: s.source):
            p = sum(snap.source.encode()) % partitions
            sent[p] += stages[p].observe(snapshot_batch(snap)).pause_records
    return topo, pipeline.facts, sent


def storm_answers(findings):
    return sorted((f.entity.path(), f.state, tuple(sorted(r.path() for r in f.related))) for f in findings)


def storm_judge():
    """(the storm answers of one fresh stage 2 reading records in a given order, stage 1's
    records per partition, the answers when the partitions are read side by side)."""
    topo, facts, sent = stage_1_by_partition()
    config = DetectionPipeline().config

    def judged(order):
        stage = StormStage(config, topo, facts)
        return storm_answers([f for r in order for f in stage.locate(r)])

    return judged, sent, judged([r for rs in itertools.zip_longest(*sent) for r in rs if r is not None])


def test_a_partition_drained_far_ahead_of_the_others_does_not_move_the_storm_clock():
    """A backlog: stage 2 reads one partition's records whole before the others' (the worker
    that holds them is slow, or started late). The clock runs on the partitions' watermark,
    so the storm is judged as when the partitions are read side by side: same source,
    same victims, no victim named a root."""
    judged, sent, side_by_side = storm_judge()
    assert any(path.endswith("node-0003/mlx5_1/1") for path, _, _ in side_by_side)
    assert not [p for p, _, _ in side_by_side if "leaf" in p]
    for first in range(len(sent)):                   # each partition in turn read whole first
        order = sent[first] + [r for i, rs in enumerate(sent) if i != first for r in rs]
        assert judged(order) == side_by_side, first


def test_a_first_batch_of_every_partition_before_any_progress_gives_the_same_storm():
    """A worker's first batch of a backlog can hold seconds of every partition's changes,
    partition after partition, before the progress that follows them: those changes wait
    for it as later ones wait for the watermark (applied at once they would be judged in
    the order of the partitions: a victim read late missed from the storm's victims)."""
    judged, sent, side_by_side = storm_judge()
    for first in range(len(sent)):
        reading = sent[first:] + sent[:first]
        changes = [r for rs in reading for r in rs if not isinstance(r, SourceProgress)]
        progress = [r for rs in reading for r in rs if isinstance(r, SourceProgress)]
        assert judged(changes + progress) == side_by_side, first


def test_a_partition_read_late_is_waited_for_from_the_start():
    """The partitions' watermark does not start at the first progress read: a partition not
    read yet may be anywhere behind it (a backlog, a worker that started late)."""
    topo, facts, sent = stage_1_by_partition()
    stage = StormStage(DetectionPipeline().config, topo, facts)
    for r in sent[0]:
        stage.locate(r)
    assert stage.watermark_ns == 0                   # 1 and 2 not read yet: nothing judged
    first_1 = next(r for r in sent[1] if isinstance(r, SourceProgress))
    stage.locate(first_1)
    assert stage.watermark_ns == 0                   # 2 still


def test_an_idle_partition_is_not_waited_for_and_one_never_heard_is():
    topo, facts, sent = stage_1_by_partition()
    stage = StormStage(DetectionPipeline().config, topo, facts)
    for r in sent[0]:
        stage.locate(r)
    held = stage.watermark_ns
    assert held is not None and held < max(r.through_ns_by_source["t/0"] for r in sent[0]
                                           if isinstance(r, SourceProgress))     # 1 and 2 not read yet
    _, idle_1 = source_stage.partition_idle("t", 1, 3)
    _, idle_2 = source_stage.partition_idle("t", 2, 3)
    stage.locate(idle_1)
    assert stage.watermark_ns == held                # 2 still to be read
    stage.locate(idle_2)
    assert stage.watermark_ns > held                 # only 0 is waited for now
    assert pause_change_from_json(pause_change_to_json(idle_2)) == idle_2


def test_an_idle_claim_is_passed_only_as_far_as_a_look_up_found_the_partition_still_at_its_end():
    """An idle partition's reader may die right after its claim: what is written there next
    waits for the partition's new reader. The watermark passes the claim only up to where it
    stood when a look-up of the end offsets was asked for that found it unchanged; a
    partition written past its claim is waited for again, its changes judged in order."""
    stage = StormStage(DetectionPipeline().config, TOPO, DetectionPipeline().facts)
    streams = ("t/0", "t/1", "t/2")

    def through(at_ms, *parts):
        return stage.locate(SourceProgress("", {f"t/{p}": T0 + at_ms * MS for p in parts}, streams))

    through(1_000, 0, 1)
    assert stage.watermark_ns == 0                          # t/2 not read yet
    stage.locate(SourceProgress("", {"t/2": T0}, streams, idle=True, end_offset=10))
    assert stage.watermark_ns == 0                          # the claim not confirmed yet
    assert stage.partition_ends() == ["t/2"]
    through(2_000, 0, 1)                                    # read after the asking: not confirmed by it
    stage.on_partition_ends({"t/2": 10})
    assert stage.watermark_ns == T0 + 1_000 * MS
    assert stage.partition_ends() == ["t/2"]                # 2 s is still to be confirmed
    stage.on_partition_ends({"t/2": 12})                    # written since (its reader died): waited for
    assert stage.watermark_ns == T0 + 1_000 * MS and stage.partition_ends() == []
    through(4_000, 0, 1)
    assert stage.watermark_ns == T0 + 1_000 * MS
    late = change(SOURCE_NIC, PAUSING, 1_500)               # t/2's new reader: a change the others passed
    assert stage.locate(late) == [] and stage.stats["changes_behind_watermark"] == 0
    through(4_000, 2)
    assert stage.watermark_ns == T0 + 4_000 * MS
    assert stage.stats["idle_partitions_written_since"] == 1


def test_a_stalled_watermark_is_reported_with_the_partitions_that_hold_it():
    """An operator's view of a stall: the watermark 10 s behind the newest progress names the
    slowest live partitions and the idle claims not confirmed yet; a current one says nothing."""
    stage = StormStage(DetectionPipeline().config, TOPO, DetectionPipeline().facts)
    streams = ("t/0", "t/1", "t/2")
    stage.locate(SourceProgress("", {"t/0": T0 + 1_000 * MS, "t/1": T0 + 1_000 * MS}, streams))
    stage.locate(SourceProgress("", {"t/2": T0 + 1_000 * MS}, streams))
    assert stage.stalled() is None                          # all current
    stage.locate(SourceProgress("", {"t/2": T0}, streams, idle=True, end_offset=7))
    stage.locate(SourceProgress("", {"t/0": T0 + 13_000 * MS}, streams))
    report = stage.stalled()
    assert report is not None and report.startswith("storm watermark: 12.0 s behind")
    assert "t/1 12.0 s behind, t/0 0.0 s behind" in report and "idle claims: t/2 at offset 7" in report


def test_a_partition_whose_reader_died_after_its_idle_claim_gives_the_same_storm():
    """The storm source's partition goes idle before the storm, its reader dies, and the rest of
    it is written while the others are read whole; the worker looks the ends up every few
    records. Its changes are waited for (not judged behind the watermark): the same storm
    as when the partitions are read side by side."""
    _, sent, side_by_side = storm_judge()
    topo, facts, _ = stage_1_by_partition()
    config = DetectionPipeline().config
    p = next(i for i, rs in enumerate(sent) if any(getattr(r, "entity", None) and r.entity.node == "node-0003"
                                                    for r in rs))
    first_change = next(i for i, r in enumerate(sent[p]) if not isinstance(r, SourceProgress))
    stream = f"t/{p}"
    claim = SourceProgress("", {stream: max(r.through_ns_by_source[stream] for r in sent[p][:first_change]
                                            if isinstance(r, SourceProgress))},
                           tuple(f"t/{i}" for i in range(len(sent))), idle=True, end_offset=first_change)
    order = sent[p][:first_change] + [claim] + [r for i, rs in enumerate(sent) if i != p for r in rs] \
        + sent[p][first_change:]
    stage, found = StormStage(config, topo, facts), []
    for n, r in enumerate(order):
        found += stage.locate(r)
        if n % 5 == 0 and stage.partition_ends():
            found += stage.on_partition_ends({stream: len(sent[p])})     # all of it written by now
    assert storm_answers(found) == side_by_side
    assert stage.stats["changes_behind_watermark"] == 0


def test_the_facts_watermark_passes_an_idle_claim_only_as_far_as_a_look_up_confirmed():
    """Node health likewise: the facts' watermark passes a partition declared idle only up to
    where it stood when a look-up found it still at its claim; one written since (its reader
    died) is waited for again."""
    topic, second = "fw.telemetry.v2", 1_000_000_000
    book = FactBook()
    book.apply(Progress(topic, 0, 2, 5 * second))
    claim = Progress(topic, 1, 2, 1 * second, idle=True, end_offset=7)
    assert facts_decode(facts_encode(claim)[1]) == claim
    book.apply(facts_decode(facts_encode(claim)[1]))
    assert book.watermark_ns == 0                           # not confirmed yet
    assert book.partition_ends() == [f"{topic}/1"]
    assert book.on_partition_ends({f"{topic}/1": 7}) and book.watermark_ns == 5 * second
    book.apply(Progress(topic, 0, 2, 9 * second))
    assert book.partition_ends() == [f"{topic}/1"]
    assert not book.on_partition_ends({f"{topic}/1": 9})    # written since: waited for again
    assert book.watermark_ns == 5 * second and book.partition_ends() == []
    book.apply(Progress(topic, 1, 2, 9 * second))
    assert book.watermark_ns == 9 * second
    old = Progress(topic, 1, 2, 1 * second, idle=True)      # an older writer's claim: trusted as made
    assert facts_decode(facts_encode(old)[1]) == old


def test_lingering_collectors_do_not_hold_the_storm_clock_back_but_node_health_waits_for_them():
    """Live, each node's ticks arrive up to its linger (2 s) late; a pausing port is handed
    over at once. Stage 1's progress for the storm stage runs at the newest tick (within
    the linger of the slowest source); its progress for node health (the facts) waits for
    the slowest source."""
    from fabricwatch.collectors.node_config import GatewaySettings

    assert DetectionConfig().collector_linger_s >= GatewaySettings().linger_s
    stage = source_stage.SourceStage(DetectionConfig(), TOPO, DetectionPipeline().facts, "t", 0, 1)
    lingering = nic_snapshot(source="node-0001", t_ns=T0, seq=1, cluster="c1")      # held since T0
    pause_through, health_through = [], []
    for i, at_ms in enumerate(range(0, 1_600, 100)):                            # another node, every tick
        out = stage.observe(snapshot_batch(lingering) if i == 0 else
                            snapshot_batch(nic_snapshot(source="node-0002", t_ns=T0 + at_ms * MS, seq=i, cluster="c1")))
        pause_through += [r.through_ns_by_source["t/0"] for r in out.pause_records if isinstance(r, SourceProgress)]
        health_through += [f.through_ns for f in out.facts if isinstance(f, Progress)]
    assert max(pause_through) >= T0 + 1_400 * MS                                # the newest tick
    assert max(health_through) == T0                                            # node-0001's last tick


# ----------------------------------------------------------------------- the wire and old state
def test_progress_and_change_records_round_trip_and_old_change_records_decode():
    p = SourceProgress("c1", {"node-0001": T0, "leaf-u0-r2": T0 + 5})
    assert pause_change_from_json(pause_change_to_json(p)) == p
    c = change(SOURCE_NIC, PAUSING, 200)
    assert pause_change_from_json(pause_change_to_json(c)) == c
    old = (b'{"entity":{"cluster":"c1","node":"node-0003","device":"mlx5_2","port":"1"},"priority":3,'
           b'"role":"pausing","active":true,"onset_ns":5,"at_ns":9,"evidence":[]}')
    assert pause_change_from_json(old).at_ns == 9


@pytest.mark.parametrize("raw", [
    b'{"type":"source_progress","cluster":"c1","through_ns_by_source":{"n1":true}}',
    b'{"type":"source_progress","cluster":"c1","through_ns_by_source":{"n1":-5}}',
    b'{"type":"source_progress","cluster":"c1","through_ns_by_source":{"n1":"12"}}',
    b'{"type":"source_progress","cluster":"c1","through_ns_by_source":{"":12}}',
    b'{"type":"source_progress","cluster":"c1","through_ns_by_source":[["n1",12]]}',
    b'{"type":"source_progress","cluster":7,"through_ns_by_source":{}}',
    b'{"type":"source_progress","through_ns_by_source":{}}',
    b'{"type":"source_progress","cluster":"","through_ns_by_source":{"t/0":1},"idle":true,"end_offset":-1}',
    b'{"type":"source_progress","cluster":"","through_ns_by_source":{"t/0":1},"idle":true,"end_offset":true}',
    b'{"type":"pause_state_summary","cluster":"c1"}',
    b'["not", "an", "object"]',
])
def test_malformed_progress_records_are_a_record_error(raw):
    with pytest.raises(RecordError):
        pause_change_from_json(raw)


@pytest.mark.parametrize("kwargs, name", [
    ({"source_liveness_ms": 0}, "source_liveness_ms"),
    ({"source_liveness_ms": 700_000, "source_max_lag_ms": 800_000}, "source_liveness_ms"),
    ({"source_max_lag_ms": SOURCE_LIVENESS_MS - 1}, "source_max_lag_ms"),
    ({"source_max_lag_ms": 4_000_000}, "source_max_lag_ms"),
])
def test_watermark_settings_are_validated_with_the_parameter_named(kwargs, name):
    with pytest.raises(ValueError, match=name):
        StormLocator(TOPO, **kwargs)


def test_a_locator_checkpointed_before_the_watermark_loads_on_the_newest_record_clock():
    loc = StormLocator(TOPO)
    loc.update(change(HELD_LEAF_PORT, PAUSED, 200))
    state = {k: v for k, v in loc.__dict__.items()
             if k not in ("source_liveness_ms", "source_max_lag_ms", "_watermark", "_on_watermark")}
    old = StormLocator.__new__(StormLocator)
    old.__setstate__(state)
    assert old.watermark_ns is None and old.source_max_lag_ms == SOURCE_MAX_LAG_MS
    assert opened(old.poll(T0 + 1_200 * MS)) == [("c1/leaf-u0-r2/Ethernet2", SILENT_SOURCE_CONFIDENCE)]
    assert old.progress(progress(NODES + SWITCHES, 1_300)) == [] and old.watermark_ns == T0 + 1_300 * MS


# ----------------------------------------------------------------------- switch ports that say they pause
LEAF_PORT_TO_VICTIM = EntityRef("c1", switch="leaf-u0-r2", port="Ethernet0")     # faces node-0001 mlx5_2/1


def test_switch_port_reporting_its_own_pauses_is_a_root_on_the_watermark_after_the_grace():
    """A SONiC leaf port whose TX pause duration says it holds its NIC, on a leaf with
    nothing held and no pausing peer: a switch root, once the picture lasted the grace on
    the watermark (the NIC's paused record may never come: its port_xmit_wait is pinned
    and it sent nothing lately)."""
    loc = StormLocator(TOPO)
    out = loc.progress(progress(NODES + SWITCHES, 1_000))
    out += loc.update(change(LEAF_PORT_TO_VICTIM, PAUSING, 1_200))
    for at_ms in range(1_300, 2_201, 100):
        out += loc.progress(progress(NODES + SWITCHES, at_ms))
        if at_ms < 2_200:
            assert opened(out) == []
    assert opened(out) == [("c1/leaf-u0-r2/Ethernet0", SWITCH_SOURCE_CONFIDENCE)]
    [f] = [f for f in out if f.state == OPEN]
    assert f.cause == "switch_port" and "pausing node-0001 mlx5_2/1" in f.summary


def test_switch_port_pausing_on_a_congested_leaf_is_propagation_not_a_root():
    """The leaf pauses its other NICs because a stuck host holds it: the NIC is the root,
    the leaf's own pausing report is propagation."""
    loc = StormLocator(TOPO)
    out = loc.update(change(SOURCE_NIC, PAUSING, 200))
    out += loc.update(change(LEAF_PORT_TO_VICTIM, PAUSING, 1_100))
    out += loc.update(change(VICTIM_NIC, PAUSED, 1_150))
    for at_ms in range(1_200, 5_001, 100):
        out += loc.poll(T0 + at_ms * MS)
    assert opened(out) == [("c1/node-0003/mlx5_2/1", NIC_SOURCE_CONFIDENCE)]
