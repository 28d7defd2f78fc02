"""Property tests: hostile input never crashes validation, decoding or the detectors.

Each surface runs FABRICWATCH_FUZZ_EXAMPLES generated inputs (default 200 in the suite;
`FABRICWATCH_FUZZ_EXAMPLES=100000 python3 -m pytest tests/test_fuzz_ingest.py` for a long
run). A crash here is a bug: bad input must become a counted rejection.
"""
import io
import math
import os
import time

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fabricwatch.counters import GPU_GAUGES, NIC_GAUGES
from fabricwatch.protos.v1 import telemetry_pb2 as pb
from fabricwatch.simulator.columns import GPU_COUNTERS, NIC_COUNTERS
from fabricwatch.streams.handlers import StageHandlers
from fabricwatch.streams.pipeline import DetectionPipeline
from fabricwatch.streams.replay import read_snapshots
from fabricwatch.streams.validate import validate_snapshot

EXAMPLES = int(os.environ.get("FABRICWATCH_FUZZ_EXAMPLES", "200"))
FUZZ = settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=list(HealthCheck))
NOW = time.time_ns()

names = st.one_of(st.sampled_from(["mlx5_0/1", "gpu0", "Ethernet8", "node-0001", ""]), st.text(max_size=12))
floats = st.one_of(st.floats(allow_nan=True, allow_infinity=True), st.sampled_from([0.0, -1.0, 400000.0, 1e300]))
counters = st.integers(min_value=0, max_value=2**64 - 1)


@st.composite
def blocks(draw):
    kind = draw(st.sampled_from([pb.ENTITY_KIND_GPU, pb.ENTITY_KIND_NIC_PORT, pb.ENTITY_KIND_SWITCH_PORT, 0, 77]))
    cnames = draw(st.one_of(st.just(list(NIC_COUNTERS)), st.just(list(GPU_COUNTERS)),
                            st.lists(names, max_size=5)))
    gnames = draw(st.one_of(st.just(list(NIC_GAUGES)), st.just(list(GPU_GAUGES)), st.lists(names, max_size=4)))
    ids = draw(st.lists(names, max_size=6))
    n = len(ids)
    exact = draw(st.booleans())
    cvals = draw(st.lists(counters, min_size=n * len(cnames) if exact else 0,
                          max_size=n * len(cnames) if exact else 40))
    gvals = draw(st.lists(floats, min_size=n * len(gnames) if exact else 0,
                          max_size=n * len(gnames) if exact else 30))
    block = pb.CounterBlock(entity_kind=kind, entity_ids=ids, counter_names=cnames, gauge_names=gnames,
                            counters=cvals, gauges=gvals)
    for label in draw(st.lists(st.sampled_from(["rate", "state", "netdev", ""]), max_size=3)):
        block.labels.add(name=label, values=draw(st.lists(
            st.sampled_from(["400 Gb/sec (4X NDR)", "4: ACTIVE", "1: DOWN", "garbage", ""]),
            min_size=n if exact else 0, max_size=n if exact else 8)))
    return block


@st.composite
def snapshots(draw):
    snap = pb.Snapshot(
        cluster=draw(st.sampled_from(["", "c1", "bad cluster!"])),
        source=draw(st.one_of(st.sampled_from(["node-0001", "leaf-u0-r0"]), names)),
        source_kind=draw(st.sampled_from([pb.SOURCE_KIND_NODE, pb.SOURCE_KIND_SWITCH, 0, 9])),
        time_unix_ns=draw(st.one_of(st.just(NOW), st.integers(min_value=-2**63, max_value=2**63 - 1),
                                    st.integers(min_value=NOW - 10**12, max_value=NOW + 10**12))),
        seq=draw(st.integers(min_value=0, max_value=2**64 - 1)),
        blocks=draw(st.lists(blocks(), max_size=3)),
    )
    for _ in range(draw(st.integers(min_value=0, max_value=3))):
        snap.rank_steps.add(job_id=draw(names), rank=draw(st.integers(0, 2**32 - 1)),
                            world_size=draw(st.integers(0, 2**32 - 1)), node=draw(names),
                            step=draw(st.integers(0, 2**64 - 1)), step_seconds=draw(floats),
                            busy_seconds=draw(floats), collective_wait_seconds=draw(floats))
    for _ in range(draw(st.integers(min_value=0, max_value=2))):
        snap.events.add(entity_id=draw(names), kind=draw(st.sampled_from(["xid", "", "ecc_dbe"])),
                        code=draw(st.integers(-2**63, 2**63 - 1)), time_unix_ns=NOW)
    return snap


@FUZZ
@given(snapshots())
@pytest.mark.slow
def test_validation_then_detection_never_crashes_on_generated_snapshots(snap):
    verdict = validate_snapshot(snap, NOW)
    assert all(reason and detail for reason, detail in verdict.problems)
    if not verdict.accepted:
        assert verdict.problems
        return
    for block in snap.blocks:   # what validation accepts is well formed
        assert len(block.counters) == len(block.entity_ids) * len(block.counter_names)
        assert len(block.gauges) == len(block.entity_ids) * len(block.gauge_names)
        assert not any(math.isinf(g) for g in block.gauges)
    pipeline = DetectionPipeline()
    pipeline.process(snap)                                  # must not raise
    later = pb.Snapshot()
    later.CopyFrom(snap)
    later.time_unix_ns = snap.time_unix_ns + 10**9
    pipeline.process(later)                                 # rates over two samples too


@FUZZ
@given(st.binary(max_size=2048))
def test_worker_skips_malformed_records(raw):
    stages, pipeline = StageHandlers(), DetectionPipeline()
    stages.on_telemetry(raw, pipeline.sources, 0)           # never raises
    stages.on_rank_steps(raw, pipeline.stragglers, 0)
    stages.on_pause_state(raw, pipeline.storms)
    assert stages.stats["processing_errors"] == 0


@FUZZ
@given(st.lists(st.text(max_size=200), max_size=5))
def test_replay_input_lines_never_crash(lines):
    from collections import Counter

    stats = Counter()
    data = io.BytesIO("\n".join(lines).encode(errors="surrogatepass"))
    assert all(isinstance(s, pb.Snapshot) for s in read_snapshots(data, stats))


@FUZZ
@given(st.binary(max_size=4096))
def test_binary_recordings_never_crash(tail):
    from collections import Counter

    from fabricwatch.recording import MAGIC

    stats = Counter()
    assert all(isinstance(s, pb.Snapshot) for s in read_snapshots(io.BytesIO(MAGIC + tail), stats))
