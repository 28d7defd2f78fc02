"""The training-rank SDK end to end: real 4-rank MPI data-parallel jobs, one slowed rank or one
stuck rank, through the gateway, Kafka and a `fabricwatch worker` process, named as a straggler
or a hang.
"""
from __future__ import annotations

import asyncio
import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
from helpers import running_gateway

from fabricwatch.protos.v1 import events_pb2 as ev

TESTS = Path(__file__).resolve().parent


# -- helpers --------------------------------------------------------------------------------


# -- end to end: a real MPI data-parallel job --------------------------------------------------
MPI_MISSING = ("needs Open MPI and mpi4py (apt-get install -y openmpi-bin libopenmpi-dev; "
               "pip install mpi4py)")


# 4 ranks on one shared core: waiting ranks yield inside Allreduce (mpi_yield_when_idle).
MPIRUN_4_RANKS = ["mpirun", "-np", "4", "--oversubscribe", "--bind-to", "none",
                  "--mca", "mpi_yield_when_idle", "1", "--mca", "btl_vader_single_copy_mechanism", "none"]


def mpi_job_env(gateway: str, job_id: str) -> dict[str, str]:
    """The environment of an MPI job run as root in a test: its gateway, its job id, one thread a rank."""
    return {**os.environ, "FABRICWATCH_GATEWAY": gateway, "FABRICWATCH_JOB_ID": job_id,
            "OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1",
            "OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}


def _mpi_available() -> bool:
    return shutil.which("mpirun") is not None and importlib.util.find_spec("mpi4py") is not None


def start_worker_in(tmp_path: Path, bootstrap: str, app_id: str) -> subprocess.Popen:
    """`fabricwatch worker` as deployed, run in tmp_path (its Faust data dir goes there)."""
    from test_pipeline_kafka import start_worker

    return start_worker(bootstrap, tmp_path, app_id, cwd=tmp_path)


def print_busy_ratios(reports: list[dict], steps: int, step_col: int, busy_col: int) -> None:
    """Busy time / job median, per rank and step: shown with -s, and on failure."""
    for s in range(steps):
        busy = [rep["steps"][s][busy_col] for rep in reports]
        median = sorted(busy)[1:3]
        print(f"step {s:2d}: {reports[0]['steps'][s][step_col]:.2f} s, busy/median",
              " ".join(f"{b / (sum(median) / 2):.2f}" for b in busy))


async def assert_straggler_named(bootstrap: str, tmp_path: Path, app_id: str, job_id: str, reports: list[dict],
                                 slow_rank: int, slow_from: int) -> ev.AnomalyEvent:
    """The job's straggler events name exactly `slow_rank`, its node and GPU, within a few steps."""
    from test_pipeline_kafka import collect_anomalies

    def named(found):
        return any(e.kind == "straggler" and e.entity.job == job_id for _, e in found)

    found = await collect_anomalies(bootstrap, named, 90, group=f"reader-{app_id}")
    mine = [e for _, e in found if e.kind == "straggler" and e.entity.job == job_id]
    assert mine, f"no straggler event for {job_id}; worker log:\n" + \
        (tmp_path / f"{app_id}.log").read_text()[-3000:]
    assert {e.entity.rank for e in mine} == {str(slow_rank)}, [e.summary for e in mine]
    opened = mine[0]
    assert opened.lifecycle == ev.LIFECYCLE_OPEN and opened.entity.cluster == "it"
    slow_ident = reports[slow_rank]["identity"]
    assert opened.entity.node == slow_ident["node"] and opened.entity.device == f"gpu{slow_ident['local_gpu']}"
    delay = {e.name: e for e in opened.evidence}["detection_delay_steps"]
    first, named_at = map(int, re.search(r"first flagged step (\d+), named at step (\d+)", delay.detail).groups())
    assert slow_from <= first <= slow_from + 2 and named_at <= slow_from + 5, delay.detail
    starts = {s[0]: s[1] for s in reports[0]["steps"]}
    assert opened.onset_unix_ns >= starts[slow_from] - 500_000_000
    print(f"straggler named: {opened.summary} (first flagged step {first}, named at step {named_at})")
    return opened


@pytest.mark.kafka
async def test_mpi_job_with_a_slowed_rank_is_named_a_straggler(kafka_bootstrap, tmp_path, unused_tcp_port):
    """4 MPI ranks, real Allreduce every step, rank 2 slowed from step 10; SDK -> gateway ->
    Kafka -> `fabricwatch worker` -> a straggler event naming exactly rank 2 of this job."""
    if not _mpi_available():
        pytest.skip(MPI_MISSING)

    steps, slow_rank, slow_from = 20, 2, 10
    tag = uuid.uuid4().hex[:8]
    app_id, job_id = f"fw-rank-{tag}", f"dp-{tag}"
    out = tmp_path / "reports"
    out.mkdir()
    worker = start_worker_in(tmp_path, kafka_bootstrap, app_id)
    job = None
    try:
        async with running_gateway(kafka_bootstrap, unused_tcp_port) as listen:
            env = mpi_job_env(listen, job_id)
            # The 4 ranks share one core: waiting ranks poll inside Allreduce, and with
            # mpi_yield_when_idle they yield to the computing rank on that core, so every rank's
            # busy time is fair and repeatable; the other core stays with broker, worker, gateway.
            cpus = sorted(os.sched_getaffinity(0))
            pin = ["taskset", "-c", str(cpus[-1])] if len(cpus) > 1 and shutil.which("taskset") else []
            cmd = [*pin, *MPIRUN_4_RANKS,
                   "-x", "FABRICWATCH_GATEWAY", "-x", "FABRICWATCH_JOB_ID",
                   sys.executable, str(TESTS / "dp_job.py"), "--steps", str(steps), "--slow-rank", str(slow_rank),
                   "--slow-from", str(slow_from), "--slow-factor", "6", "--micro", "24", "--out", str(out)]
            log_path = tmp_path / "mpirun.log"
            with open(log_path, "wb") as log:
                t0 = time.monotonic()
                job = await asyncio.create_subprocess_exec(*cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
                rc = await asyncio.wait_for(job.wait(), 240)
            print(f"mpirun job: {time.monotonic() - t0:.1f} s")
            assert rc == 0, log_path.read_text()[-4000:]
            reports = [json.loads((out / f"rank{r}.json").read_text()) for r in range(4)]
            print_busy_ratios(reports, steps, step_col=3, busy_col=4)
            for r, rep in enumerate(reports):
                assert rep["identity"]["rank"] == r and rep["identity"]["job_id"] == job_id
                assert rep["identity"]["launcher"] == "openmpi"
                assert rep["stats"]["sent"] == steps, rep["stats"]       # all acked, the last ones by the exit flush
                assert rep["stats"]["dropped_buffer_full"] == 0 and rep["stats"]["buffered"] == 0
            await assert_straggler_named(kafka_bootstrap, tmp_path, app_id, job_id, reports, slow_rank, slow_from)
    finally:
        if job is not None and job.returncode is None:
            job.kill()
            await job.wait()
        worker.terminate()
        worker.wait(30)


@pytest.mark.kafka
async def test_mpi_job_with_a_rank_stuck_before_its_allreduce_is_named_a_hang_within_60_s(
        kafka_bootstrap, tmp_path, unused_tcp_port):
    """4 MPI ranks, real Allreduce every step; rank 1 sleeps forever before the all-reduce of
    step 6 (its peers wait inside it). SDK heartbeats -> gateway -> Kafka -> `fabricwatch worker`
    -> a `hang` event naming exactly rank 1, its node and GPU, within 60 s of the last completion."""
    if not _mpi_available():
        pytest.skip(MPI_MISSING)

    hang_rank, hang_at = 1, 6
    tag = uuid.uuid4().hex[:8]
    app_id, job_id = f"fw-hang-{tag}", f"hang-{tag}"
    worker = start_worker_in(tmp_path, kafka_bootstrap, app_id)
    job = None
    try:
        async with running_gateway(kafka_bootstrap, unused_tcp_port) as listen:
            env = mpi_job_env(listen, job_id)
            cmd = [*MPIRUN_4_RANKS,
                   "-x", "FABRICWATCH_GATEWAY", "-x", "FABRICWATCH_JOB_ID",
                   sys.executable, str(TESTS / "dp_job.py"), "--steps", "1000", "--slow-rank", "-1",
                   "--micro", "2", "--hang-rank", str(hang_rank), "--hang-at", str(hang_at)]
            log_path = tmp_path / "mpirun.log"
            with open(log_path, "wb") as log:
                job = await asyncio.create_subprocess_exec(*cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
                from test_pipeline_kafka import collect_anomalies

                def named(found):
                    return any(e.kind == "hang" and e.entity.job == job_id for _, e in found)

                found = await collect_anomalies(kafka_bootstrap, named, 150, group=f"reader-{app_id}")
                received_ns = time.time_ns()
            mine = [e for _, e in found if e.kind == "hang" and e.entity.job == job_id]
            assert mine, "no hang event; mpirun log:\n" + log_path.read_text()[-2000:] + "\nworker log:\n" + \
                (tmp_path / f"{app_id}.log").read_text()[-3000:]
            opened = mine[0]
            assert opened.lifecycle == ev.LIFECYCLE_OPEN and opened.entity.rank == str(hang_rank), opened.summary
            assert opened.entity.node and opened.entity.device.startswith("gpu")
            assert "hanging before the all-reduce" in log_path.read_text()
            evidence = {e.name: e for e in opened.evidence}
            assert evidence["culprit_rule"].detail == "never_entered"
            assert evidence["ranks_waiting"].value == 3
            delay_s = (received_ns - opened.onset_unix_ns) / 1e9
            print(f"hang named {delay_s:.1f} s after the last completion: {opened.summary}")
            assert delay_s <= 60, delay_s
    finally:
        if job is not None and job.returncode is None:
            job.terminate()
            try:
                await asyncio.wait_for(job.wait(), 15)
            except asyncio.TimeoutError:
                job.kill()
                await job.wait()
        worker.terminate()
        worker.wait(30)
