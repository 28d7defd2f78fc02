"""A partition's stage state survives a move: checkpoint mid-storm, restore, continue.

The state store's chunks, slots and fingerprints are driven on an in-memory log here;
tests/test_pipeline_kafka.py moves partitions between real workers on a real broker.
"""
import asyncio

import pytest

from fabricwatch.models.topology import rail_optimised
from fabricwatch.simulator.cluster import ClusterSimulator
from fabricwatch.simulator.fabric_faults import PfcStorm
from fabricwatch.streams import state_store
from fabricwatch.streams.pipeline import DetectionConfig, DetectionPipeline
from fabricwatch.streams.state_store import MemoryStateLog, StateStore, dumps, fingerprint, loads


def storm_ticks():
    topo = rail_optimised("c1", n_nodes=8, nodes_per_unit=8, n_spines=2)
    sim = ClusterSimulator(topo, seed=3, interval_s=0.1,
                           faults=[PfcStorm(sources=(("node-0003", "mlx5_2/1"),), onset_s=2.0, offset_s=4.0)])
    return topo, [sim.tick() for _ in range(60)]


def run(pipeline, ticks):
    return [(f.kind, f.state) for tick in ticks for s in tick for f in pipeline.process(s)
            if f.kind == "pfc_storm"]


def externals(p: DetectionPipeline) -> dict:
    return {"topology": p.topology, "facts": p.facts, "nominal": p.facts.nominal, "health": p.facts.health}


@pytest.mark.slow
def test_a_stage_moved_mid_storm_neither_reopens_nor_loses_the_resolution():
    topo, ticks = storm_ticks()
    uninterrupted = run(DetectionPipeline(topology=topo), ticks)
    assert [s for _, s in uninterrupted][0] == "open" and uninterrupted[-1] == ("pfc_storm", "resolved")

    first = DetectionPipeline(topology=topo)
    before = run(first, ticks[:30])                       # the storm is open at 3.0 s
    # the new owner has its own copy of the shared facts (read from the facts topic)
    second = DetectionPipeline(topology=topo)
    second.facts = first.facts
    for name in ("sources", "storms", "stragglers"):
        setattr(second, name, loads(dumps(getattr(first, name), externals(first)), externals(second)))
    after = run(second, ticks[30:])
    assert before + after == uninterrupted
    assert ("pfc_storm", "open") not in after


def test_shared_objects_are_stored_by_reference_not_copied():
    topo, ticks = storm_ticks()
    p = DetectionPipeline(topology=topo)
    run(p, ticks[:5])
    with_refs, without = len(dumps(p.sources, externals(p))), len(dumps(p.sources, {}))
    restored = loads(dumps(p.sources, externals(p)), externals(p))
    assert restored.downgrade.nominal is p.facts.nominal and restored.downgrade.topology is topo
    # the topology is not in the payload: a 12,500-node one would be megabytes per partition
    assert without - with_refs >= 0.8 * len(dumps(topo, {}))
    with pytest.raises(Exception, match="does not share"):
        loads(dumps(p.sources, externals(p)), {})


def save_and_load(store, payload, covered=41, stage="sources", topic="t", partition=3):
    async def go():
        await store.save(stage, topic, partition, covered, payload)
        return await store.load(stage, topic, partition)
    return asyncio.run(go())


def test_big_states_go_in_chunks_and_come_back_whole(monkeypatch):
    monkeypatch.setattr(state_store, "CHUNK_BYTES", 1000)
    log = MemoryStateLog()
    store = StateStore(log, partitions=4, fingerprint="f1", interval_s=30)
    payload = bytes(range(250)) * 40                        # 10,000 bytes: 10 chunks
    loaded = save_and_load(store, payload)
    assert loaded.payload == payload and loaded.covered_offset == 41
    assert len(log.records[3]) == 11                        # 10 chunks + the manifest, on partition 3 % 4


def test_a_torn_checkpoint_leaves_the_previous_one_readable(monkeypatch):
    monkeypatch.setattr(state_store, "CHUNK_BYTES", 100)
    log = MemoryStateLog()
    store = StateStore(log, partitions=2, fingerprint="f1", interval_s=30)
    first = save_and_load(store, b"a" * 350, covered=10)
    assert first.payload == b"a" * 350

    async def torn():
        # the next generation dies after two of its chunks: no manifest
        real = log.send
        sent = 0

        async def dying(key, value, partition):
            nonlocal sent
            sent += 1
            if sent > 2:
                raise ConnectionError("worker killed")
            await real(key, value, partition)
        log.send = dying
        with pytest.raises(ConnectionError):
            await store.save("sources", "t", 3, 20, b"b" * 350)
        log.send = real
        return await store.load("sources", "t", 3)
    again = asyncio.run(torn())
    assert again.payload == b"a" * 350 and again.covered_offset == 10
    # and a later complete one wins
    assert save_and_load(store, b"c" * 10, covered=30).payload == b"c" * 10


def test_a_checkpoint_for_another_configuration_or_garbage_is_ignored():
    log = MemoryStateLog()
    saver = StateStore(log, partitions=1, fingerprint=fingerprint(DetectionConfig(), None), interval_s=30)
    asyncio.run(saver.save("sources", "t", 0, 5, b"state"))
    other = StateStore(log, partitions=1, fingerprint=fingerprint(DetectionConfig(pfc_detection_time_ms=400), None),
                       interval_s=30)
    assert asyncio.run(other.load("sources", "t", 0)) is None and other.stats["ignored"] >= 2
    asyncio.run(log.send(b"fabricwatch-worker/sources/t/0/manifest", b"\x80garbage", 0))
    assert asyncio.run(saver.load("sources", "t", 0)).payload == b"state"
    assert asyncio.run(saver.load("sources", "t", 1)) is None                 # never checkpointed
    other_group = StateStore(log, partitions=1, fingerprint=saver.fingerprint, interval_s=30, namespace="other")
    assert asyncio.run(other_group.load("sources", "t", 0)) is None           # another consumer group's
