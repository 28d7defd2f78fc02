"""Fault injection on the real local stack, the worker's side: a `fabricwatch worker` killed with -9
(exactly-once findings after the restart), and a worker that falls behind.

The scenarios run against a broker of their module and real gateway and worker processes, and
assert what on-call and the telemetry topic see. Numbers are written up in docs/reliability.md.
"""
from __future__ import annotations

import asyncio
import time
import uuid
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import yaml
from helpers import (CATCH_UP_TIMEOUT_S, FAST_GROUP_ENV, AnomalyReader, S, Worker, gateway_and_sender, nic_snapshot,
                     summary, wait_caught_up)

from fabricwatch.collectors.sender import GatewaySender
from fabricwatch.localkafka import LocalKafka
from fabricwatch.models.topology import rail_optimised
from fabricwatch.protos.v1 import events_pb2 as ev
from fabricwatch.protos.v1 import telemetry_pb2 as pb
from fabricwatch.simulator.cluster import ClusterSimulator
from fabricwatch.simulator.fabric_faults import PfcStorm
from fabricwatch.simulator.host_faults import Straggler
from fabricwatch.simulator.workload import Job
from fabricwatch.streams.events import to_event
from fabricwatch.streams.pipeline import DetectionPipeline

pytestmark = pytest.mark.kafka


# ---------------------------------------------------------------------- processes


async def send(sender: GatewaySender, snapshots, timeout_s: float = 60) -> None:
    for snap in snapshots:
        sender.submit(snap)
    assert await sender.drain(timeout_s), f"{sender.buffered} snapshots not acked in {timeout_s} s"


# ---------------------------------------------------------------------- 1. kill -9 of a worker
@dataclass
class Episode:
    """The storm-then-straggler run and what detection must say about it (the offline oracle)."""
    cluster: str
    topology_file: Path
    ticks: list[list[pb.Snapshot]]
    first_tick: dict[tuple[str, int], int] = field(default_factory=dict)   # (dedup key, lifecycle) -> tick
    ids: dict[tuple[str, int], set[str]] = field(default_factory=lambda: defaultdict(set))

    def key(self, kind: str) -> str:
        return next(k for k, _ in self.first_tick if k.startswith(kind + ":"))


def storm_then_straggler(tmp_path: Path, seconds: float = 22.0) -> Episode:
    """8 nodes x 2 GPUs, 0.2 s sampling: a PFC storm from node-0005 (1-3 s), then a thermal
    straggler on node-0006 gpu1 (5-11 s). Event time starts now."""
    cluster = f"kill-{uuid.uuid4().hex[:6]}"
    topo = rail_optimised(cluster, n_nodes=8, gpus_per_node=2, nodes_per_unit=4, n_spines=2)
    jobs = [Job("job-b", ("node-0001", "node-0002"), step_compute_s=1.0),
            Job("job-a", ("node-0004", "node-0005", "node-0006", "node-0007"), step_compute_s=1.2, step_comm_s=0.3)]
    faults = [PfcStorm(sources=(("node-0005", "mlx5_1/1"),), onset_s=1.0, offset_s=3.0),
              Straggler(node="node-0006", gpu=1, onset_s=5.0, offset_s=11.0, cause="thermal", factor=1.5)]
    sim = ClusterSimulator(topo, seed=3, interval_s=0.2, jobs=jobs, faults=faults, start_unix_ns=time.time_ns())
    topology_file = tmp_path / "topology.yaml"
    topology_file.write_text(yaml.safe_dump(topo.to_dict(), sort_keys=False), encoding="utf-8")
    episode = Episode(cluster, topology_file, sim.run(seconds))
    oracle = DetectionPipeline(topology=topo)
    for i, tick in enumerate(episode.ticks):
        for snap in tick:
            for finding in oracle.process(snap):
                event = to_event(finding, 0)
                slot = (event.dedup_key, event.lifecycle)
                episode.first_tick.setdefault(slot, i)
                episode.ids[slot].add(event.id)
    return episode


def assert_exactly_once(episode: Episode, events: list[ev.AnomalyEvent], *, oracle_ids: bool) -> list[str]:
    """Per injected fault: one distinct OPEN and one distinct RESOLVED id.

    With `oracle_ids`, each must be the oracle's (any number of workers gives the answer
    of one: node health travels as facts, joins run on event time). Returns the other keys
    opened (storm roots the oracle did not name).
    """
    seen: dict[tuple[str, int], set[str]] = defaultdict(set)
    for e in events:
        seen[(e.dedup_key, e.lifecycle)].add(e.id)
    expected_keys = {k for k, _ in episode.first_tick}
    for key in expected_keys:
        for lifecycle in (ev.LIFECYCLE_OPEN, ev.LIFECYCLE_RESOLVED):
            got, want = seen[(key, lifecycle)], episode.ids[(key, lifecycle)]
            assert (got == want) if oracle_ids else (len(got) == len(want) == 1), \
                (key, ev.Lifecycle.Name(lifecycle), "seen", got, "oracle", want, summary(events))
    return sorted({k for k, lc in seen if lc == ev.LIFECYCLE_OPEN} - expected_keys)


async def run_kill_scenario(broker: LocalKafka, tmp_path: Path, *, takeover: bool) -> dict:
    episode = storm_then_straggler(tmp_path)
    storm, straggler = episode.key("pfc_storm"), episode.key("straggler")
    storm_open = episode.first_tick[(storm, ev.LIFECYCLE_OPEN)]
    straggler_open = episode.first_tick[(straggler, ev.LIFECYCLE_OPEN)]
    app_id = f"fw-kill-{uuid.uuid4().hex[:6]}"

    def worker(name: str) -> Worker:
        return Worker(broker.bootstrap, tmp_path, app_id, name, "--topology", str(episode.topology_file),
                      "--state-dir", str(tmp_path / f"state-{name}"), "--checkpoint-interval", "1",
                      env=FAST_GROUP_ENV if takeover else {})

    a = worker("a").start()
    b = worker("b").start() if takeover else None
    kills = 0
    try:
        async with AnomalyReader(broker.bootstrap, episode.cluster) as reader, \
                gateway_and_sender(broker.bootstrap, cluster=episode.cluster) as sender:
            # mid-storm: the storm has just been opened, its restoration is still to come
            await send(sender, [s for tick in episode.ticks[:storm_open + 3] for s in tick])
            await reader.wait_for("storm OPEN", reader.has(storm, ev.LIFECYCLE_OPEN))
            a.kill()
            kills += 1
            await send(sender, [s for tick in episode.ticks[storm_open + 3:straggler_open + 2] for s in tick])
            if not takeover:
                a.start()            # restart on its own state dir; b (takeover) needs no restart
            await reader.wait_for("storm RESOLVED", reader.has(storm, ev.LIFECYCLE_RESOLVED))
            await reader.wait_for("straggler OPEN", reader.has(straggler, ev.LIFECYCLE_OPEN))
            # mid-straggler: kill the worker doing the work now
            if takeover:
                a.start()            # back as a second member; then b dies and a takes everything
                b.kill()
            else:
                a.kill()
                a.start()
            kills += 1
            await send(sender, [s for tick in episode.ticks[straggler_open + 2:] for s in tick])
            await reader.wait_for("straggler RESOLVED", reader.has(straggler, ev.LIFECYCLE_RESOLVED),
                                  timeout_s=20 if takeover else 90)
            await asyncio.sleep(3)   # late duplicates would arrive now
            events = list(reader.events)
    finally:
        for w in (a, b):
            if w is not None:
                w.stop()
    extra = assert_exactly_once(episode, events, oracle_ids=True)
    assert not extra, f"storm roots the oracle does not name: {extra}"   # the catch-up watermark
    return {"kills": kills, "events": len(events), "distinct_ids": len({e.id for e in events}), "extra_opened": extra}


async def test_worker_killed_mid_storm_and_mid_straggler_restarts_without_loss_or_second_open(broker, tmp_path):
    numbers = await run_kill_scenario(broker, tmp_path, takeover=False)
    print("kill -9 + restart:", numbers)


async def test_second_worker_takes_over_a_killed_workers_partitions(broker, tmp_path):
    numbers = await run_kill_scenario(broker, tmp_path, takeover=True)
    print("kill -9 + takeover:", numbers)


# ---------------------------------------------------------------------- 4. a worker that falls behind
STALE_AFTER_S = 6.0


async def test_worker_catching_up_on_a_backlog_marks_stale_findings_and_reraises_them_live(broker, tmp_path):
    """Telemetry piles up while the worker is away; once back, what the backlog shows is still
    reported, but as info with its age on the gateway's clock (``--stale-after``), while the
    same fault on live data keeps its severity, and a demoted fault that live samples confirm
    is raised again at its own severity. A node whose clock is far behind is not stale: its
    records were received now."""
    app_id = f"fw-behind-{uuid.uuid4().hex[:6]}"
    tag = uuid.uuid4().hex[:6]
    old_node, live_node, skewed_node = f"node-{tag}-old", f"node-{tag}-live", f"node-{tag}-skewed"

    def downgrade(node: str, t0: int, ticks=range(4)) -> list[pb.Snapshot]:
        return [nic_snapshot(source=node, t_ns=t0 + i * S, seq=i, cluster="faults",
                             rates={1: "200 Gb/sec (4X HDR)"} if i >= 2 else {}) for i in ticks]

    old_t0 = time.time_ns() - 4 * S
    async with AnomalyReader(broker.bootstrap, "faults") as reader, \
            gateway_and_sender(broker.bootstrap, cluster="faults") as sender:
        await send(sender, downgrade(old_node, old_t0))          # the backlog: no worker consumes it yet
        await asyncio.sleep(STALE_AFTER_S + 2)
        worker = Worker(broker.bootstrap, tmp_path, app_id, "behind-worker", "--stale-after",
                        str(STALE_AFTER_S)).start()
        try:
            # the backlog (and the module's earlier scenarios) drained first: what comes next is
            # live, whatever ran before in this module
            await wait_caught_up(broker.bootstrap, app_id, [worker], CATCH_UP_TIMEOUT_S)
            await send(sender, downgrade(live_node, time.time_ns())
                       + downgrade(skewed_node, time.time_ns() - 150 * S))
            nodes = {old_node, live_node, skewed_node}
            await reader.wait_for("three downgrades", lambda events: {e.entity.node for e in events} >= nodes)
            # the old node's link is still down, seen live now
            await send(sender, downgrade(old_node, time.time_ns() - 10 * S, range(4, 6)))
            await reader.wait_for("the re-raise", lambda events: any(
                e.entity.node == old_node and e.lifecycle == ev.LIFECYCLE_UPDATE for e in events))
        finally:
            worker.stop()
    events = [e for e in reader.events if e.entity.node in nodes]
    opened = {e.entity.node: e for e in events if e.lifecycle == ev.LIFECYCLE_OPEN}
    stale, live, skewed = opened[old_node], opened[live_node], opened[skewed_node]
    assert stale.severity == ev.SEVERITY_INFO and stale.summary.startswith("[stale: ")
    age = {e.name: e for e in stale.evidence}["sample_age_s"]
    assert age.value > STALE_AFTER_S and age.threshold == STALE_AFTER_S
    for fresh in (live, skewed):
        assert fresh.severity == ev.SEVERITY_CRITICAL and "sample_age_s" not in {e.name for e in fresh.evidence}
    raised = next(e for e in events if e.entity.node == old_node and e.lifecycle == ev.LIFECYCLE_UPDATE)
    assert raised.severity == ev.SEVERITY_CRITICAL and raised.summary.startswith("[confirmed live] ")
    assert raised.onset_unix_ns == stale.onset_unix_ns
    assert "[stale: " in worker.log_path.read_text()             # and the worker's log says so
    print(f"behind: backlog finding {age.value:.0f} s old -> info, re-raised live; "
          f"live and skewed findings {ev.Severity.Name(live.severity)}")


def test_backlog_read_switches_first_names_no_switch_root(tmp_path):
    """What the worker does when catching up: stage 1 reads partitions at different paces; here
    the partition of the switches is processed before the nodes'. The storm must still be the
    NIC's alone: the locator's grace periods run on the partitions' low watermark, which the
    nodes' partition holds back."""
    episode = storm_then_straggler(tmp_path, seconds=6)
    from fabricwatch.streams.codec import pause_change_from_json, pause_change_to_json
    from fabricwatch.streams.decode import snapshot_batch
    from fabricwatch.streams.source_stage import SourceStage
    from fabricwatch.topology_file import load_topology

    pipeline = DetectionPipeline(topology=load_topology(episode.topology_file))
    switches, nodes = (SourceStage(pipeline.config, pipeline.topology, pipeline.facts, "telemetry", p, 2)
                       for p in (0, 1))
    flat = [s for tick in episode.ticks for s in tick]
    opened = set()
    for stage, snaps in ((switches, [s for s in flat if s.source_kind == pb.SOURCE_KIND_SWITCH]),
                         (nodes, [s for s in flat if s.source_kind == pb.SOURCE_KIND_NODE])):
        for snap in snaps:
            # as the worker: stage 1's records cross the pause-states topic as JSON, and the
            # cluster timer runs on the wall clock meanwhile
            for record in stage.observe(snapshot_batch(snap)).pause_records:
                found = pipeline.locate(pause_change_from_json(pause_change_to_json(record)))
                opened |= {f.dedup_key for f in found if f.state == "open"}
            opened |= {f.dedup_key for f in pipeline.tick_cluster(time.time_ns()) if f.state == "open"}
    assert opened == {episode.key("pfc_storm")}
