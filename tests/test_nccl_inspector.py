"""NCCL Inspector ingestion by the training-rank SDK: dump formats, the busy/wait split, shipping.
"""
from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from helpers import IDENT, fake_gateway

from fabricwatch.models.frames import RankStep
from fabricwatch.models.straggler import StragglerDetector
from fabricwatch.rank import RankReporter, ingest_nccl_inspector


# -- helpers --------------------------------------------------------------------------------


# -- NCCL Inspector --------------------------------------------------------------------------
# ten minutes ago, in microseconds: the gateway accepts rank steps within its clock window only
T0_US = time.time_ns() // 1000 - 600_000_000
BUSY_US = {0: 200_000, 1: 205_000, 2: 420_000, 3: 198_000}   # rank 2: a slow GPU
XFER_US = 30_000


def inspector_dump(tmp_path: Path, *, verbose: bool = True, steps: int = 8, per_step: int = 2,
                   v43: bool = True, pretty_rank: int | None = None) -> Path:
    """Synthetic Inspector output of a 4-rank, 2-node job: each step, every rank computes
    for BUSY_US then runs `per_step` AllReduce kernels; a kernel ends for everyone when the
    last rank arrived plus XFER_US. Another (2-rank) communicator and P2P records as noise."""
    out = tmp_path / "nccl-inspector-4242"
    out.mkdir()
    ranks = sorted(BUSY_US)
    end = {r: T0_US for r in ranks}
    lines: dict[int, list[dict]] = {r: [] for r in ranks}
    sn = 100
    for _step in range(steps):
        for i in range(per_step):
            arrive = {r: end[r] + (BUSY_US[r] if i == 0 else 0) for r in ranks}
            done = max(arrive.values()) + XFER_US
            for r in ranks:
                perf = {"coll": "AllReduce", "coll_sn": sn, "coll_msg_size_bytes": 25 << 20,
                        "coll_exec_time_us": done - arrive[r], "coll_timing_source": "kernel_gpu",
                        "coll_algobw_gbs": 100.0, "coll_busbw_gbs": 150.0}
                if verbose:
                    perf["event_trace_ts"] = {"coll_start_ts": arrive[r] - 50, "coll_stop_ts": arrive[r] - 45,
                                              "kernel_events": [
                                                  {"channel_id": 0, "kernel_start_ts": arrive[r],
                                                   "kernel_stop_ts": done - 3},
                                                  {"channel_id": 1, "kernel_start_ts": arrive[r] + 2,
                                                   "kernel_stop_ts": done}]}
                lines[r].append({"coll_perf": perf})
                end[r] = done
            sn += 1
    for r in ranks:
        header = {"id": "0xdp", "rank": r, "n_ranks": 4, "nnodes": 2}
        metadata = {"inspector_output_format_version": "v4.3" if v43 else "v4.0", "git_rev": "",
                    "rec_mechanism": "nccl_profiler_interface", "dump_timestamp_us": end[r] + 500,
                    "hostname": f"node-{r // 2}", "pid": 1000 + r}
        objs: list[dict] = []
        if v43:
            objs.append({"header": header, "metadata": metadata,
                         "dump_stats": {"coll_records": len(lines[r]), "coll_dropped_total": 0,
                                        "coll_dropped_since_last_dump": 0, "p2p_records": 1}})
            objs += lines[r]
            objs.append({"p2p_perf": {"p2p_operation": "Send", "p2p_sn": 1, "p2p_exec_time_us": 5}})
        else:
            objs += [{"header": header, "metadata": metadata, **rec} for rec in lines[r]]
        if r < 2:   # a 2-rank tensor-parallel communicator on node-0
            objs.append({"header": {"id": "0xtp", "rank": r, "n_ranks": 2, "nnodes": 1}, "metadata": metadata,
                         "coll_perf": {"coll": "AllGather", "coll_sn": 1, "coll_exec_time_us": 10}})
        path = out / f"node-{r // 2}-pid{1000 + r}.log"
        with open(path, "w") as fh:
            for obj in objs:
                fh.write(json.dumps(obj, indent=2 if r == pretty_rank else None) + "\n")
    return out


def test_inspector_counts_a_number_past_the_digit_limit_as_malformed(tmp_path):
    # json raises a plain ValueError (no .pos) for an integer of more than 4300 digits
    out = inspector_dump(tmp_path)
    with (out / "node-1-pid1003.log").open("a") as fh:
        fh.write('{"coll_perf": {"coll_sn": ' + "1" * 5000 + "}}\n")
    steps = ingest_nccl_inspector(out, collectives_per_step=2)
    assert steps.stats["malformed_lines"] == 1 and len(steps) == 4 * 7


def test_inspector_v43_verbose_gives_the_busy_wait_split(tmp_path):
    out = inspector_dump(tmp_path, pretty_rank=3)
    with (out / "node-1-pid1003.log").open("a") as fh:
        fh.write("{not json\n")
    steps = ingest_nccl_inspector(out, collectives_per_step=2)
    assert steps.comm_id == "0xdp"
    assert steps.stats["steps_anchor_only"] == 4 and steps.stats["malformed_lines"] == 1
    assert steps.stats["other_communicators"] == 2 and steps.stats["other_records"] == 4
    assert {s.job_id for s in steps} == {"4242"}                    # from the directory name
    assert len(steps) == 4 * 7                                      # each rank's first step only anchors
    step_us = max(BUSY_US.values()) + 2 * XFER_US
    for s in steps:
        assert s.world_size == 4 and s.node == f"node-{s.rank // 2}" and s.local_gpu == s.rank % 2
        assert s.step_seconds == pytest.approx(step_us / 1e6)
        assert s.busy_seconds == pytest.approx(BUSY_US[s.rank] / 1e6)
        assert s.busy_seconds + s.collective_wait_seconds == pytest.approx(s.step_seconds)
    # the straggler detector names rank 2 from these records
    det = StragglerDetector(cluster="c")
    found = [f for s in steps for f in det.add_step(RankStep(s.job_id, s.rank, s.world_size, s.node, s.local_gpu,
                                                              s.step, s.start_unix_ns, s.step_seconds,
                                                              s.busy_seconds, s.collective_wait_seconds))]
    assert [(f.kind, f.state, f.entity.rank, f.entity.node, f.entity.device) for f in found] == \
        [("straggler", "open", "2", "node-1", "gpu0")]


def test_inspector_older_format_and_non_verbose(tmp_path):
    out = inspector_dump(tmp_path, v43=False)
    steps = ingest_nccl_inspector(out / "node-1-pid1002.log", job_id="j", collectives_per_step=2)
    assert len(steps) == 7 and {s.rank for s in steps} == {2}
    assert steps[0].busy_seconds == pytest.approx(BUSY_US[2] / 1e6) and steps[0].local_gpu == 0

    (tmp_path / "plain").mkdir()
    plain = inspector_dump(tmp_path / "plain", verbose=False)
    skipped = ingest_nccl_inspector(plain, job_id="j", collectives_per_step=2)
    assert list(skipped) == [] and skipped.stats["steps_without_times"] == 32
    given = ingest_nccl_inspector(plain, job_id="j", collectives_per_step=2, step_seconds=0.5)
    assert len(given) == 32
    slow = [s for s in given if s.rank == 2][0]
    assert slow.step_seconds == 0.5 and slow.collective_wait_seconds == pytest.approx(2 * XFER_US / 1e6)
    fast = [s for s in given if s.rank == 3][0]
    assert fast.busy_seconds < slow.busy_seconds


def test_inspector_records_can_be_shipped(tmp_path):
    out = inspector_dump(tmp_path)
    with fake_gateway() as (gw, target):
        r = RankReporter(IDENT, target, flush_interval_s=0.05)
        try:
            steps = ingest_nccl_inspector(out, job_id="insp-1", collectives_per_step=2, reporter=r)
            assert r.flush(10)
        finally:
            r.close(1)
    assert len(gw.steps) == len(steps) == 28
    assert {snap.source for snap in gw.snapshots} == {"node-0", "node-1"}   # one snapshot per node
    with pytest.raises(FileNotFoundError):
        ingest_nccl_inspector(tmp_path / "missing", job_id="x")
    with pytest.raises(ValueError, match="job id"):
        ingest_nccl_inspector(tmp_path, environ={})


