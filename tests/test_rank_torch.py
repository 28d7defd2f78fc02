"""`instrument_torch` on a real PyTorch DDP job: gloo on CPU, 4 ranks, one slowed on purpose.

Runs only where torch imports (CI does not install it: the wheels are several GB). Locally::

    python3 -m venv --system-site-packages /tmp/torchvenv && /tmp/torchvenv/bin/pip install torch
    /tmp/torchvenv/bin/python -m pytest -q tests/test_rank_torch.py

The job (tests/dp_torch_job.py) has no timing code of its own in the training loop: the
SDK's hooks on the DDP module and the optimizer produce every record. The records go
SDK -> in-process gateway -> Kafka -> a `fabricwatch worker` process, and the anomalies
topic must name exactly the slowed rank, with its node and GPU.
"""
from __future__ import annotations

import asyncio
import importlib.util
import json
import os
import subprocess
import sys
import time
import uuid

import pytest
from helpers import running_gateway
from test_rank_mpi import TESTS, assert_straggler_named, print_busy_ratios, start_worker_in


TORCH_MISSING = ("needs PyTorch, which CI does not install (several GB of wheels): "
                 "python3 -m venv --system-site-packages /tmp/torchvenv && /tmp/torchvenv/bin/pip install torch; "
                 "then /tmp/torchvenv/bin/python -m pytest tests/test_rank_torch.py")
RANKS, STEPS, SLOW_RANK, SLOW_FROM = 4, 20, 2, 10
# skipped before the Kafka fixture starts a broker for nothing
pytestmark = pytest.mark.skipif(importlib.util.find_spec("torch") is None, reason=TORCH_MISSING)


@pytest.mark.kafka
async def test_torch_ddp_job_with_a_slowed_rank_is_named_a_straggler(kafka_bootstrap, tmp_path, unused_tcp_port):
    """4 gloo ranks under DDP, a real all-reduce of the gradient bucket every step, rank 2
    slowed from step 10; `instrument_torch` -> gateway -> Kafka -> worker -> a straggler
    event naming exactly rank 2 of this job, with its node and GPU."""
    tag = uuid.uuid4().hex[:8]
    app_id, job_id = f"fw-torch-{tag}", f"ddp-{tag}"
    out = tmp_path / "reports"
    out.mkdir()
    worker = start_worker_in(tmp_path, kafka_bootstrap, app_id)
    job = None
    try:
        async with running_gateway(kafka_bootstrap, unused_tcp_port) as listen:
            env = {**os.environ, "FABRICWATCH_GATEWAY": listen, "FABRICWATCH_JOB_ID": job_id,
                   "GLOO_SOCKET_IFNAME": "lo", "OMP_NUM_THREADS": "1"}
            # After start-up the 4 ranks share one core (as the MPI test's): a gloo rank waiting
            # in the all-reduce sleeps, so the rank still computing gets the core and every
            # rank's busy time is fair; the other core stays with broker, worker and gateway.
            cpus = sorted(os.sched_getaffinity(0))
            cmd = [sys.executable, str(TESTS / "dp_torch_job.py"), "--ranks", str(RANKS), "--steps", str(STEPS),
                   "--slow-rank", str(SLOW_RANK), "--slow-from", str(SLOW_FROM), "--eval-every", "5",
                   "--pin-cpu", str(cpus[-1] if len(cpus) > 1 else -1), "--out", str(out)]
            log_path = tmp_path / "dp_torch_job.log"
            with open(log_path, "wb") as log:
                t0 = time.monotonic()
                job = await asyncio.create_subprocess_exec(*cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
                rc = await asyncio.wait_for(job.wait(), 300)
            print(f"torch job: {time.monotonic() - t0:.1f} s")
            assert rc == 0, log_path.read_text()[-4000:]
            reports = [json.loads((out / f"rank{r}.json").read_text()) for r in range(RANKS)]
            print_busy_ratios(reports, STEPS, step_col=4, busy_col=5)
            for r, rep in enumerate(reports):
                ident = rep["identity"]
                assert (ident["job_id"], ident["rank"], ident["world_size"], ident["local_gpu"], ident["launcher"]) == \
                    (job_id, r, RANKS, r, "torchrun")
                assert rep["hooks"] == 3 and rep["weights_equal"], "the all-reduce did not keep the replicas equal"
                assert rep["stats"]["sent"] == STEPS, rep["stats"]       # all acked, the last ones by the exit flush
                assert rep["stats"]["dropped_buffer_full"] == 0 and rep["stats"]["buffered"] == 0
                assert rep["stats"]["misuse"] == 0
                assert len(rep["eval_loss"]) == STEPS // 5
                for step, _, _, sdk_step, step_s, busy_s, wait_s, own_s in rep["steps"]:
                    # the hooks' step is the loop's: forward pre-hook to optimizer post-hook, and the
                    # no-grad evaluation forward between steps is not part of the next one
                    assert sdk_step == step and own_s - 0.1 <= step_s <= own_s + 0.002, (r, step, step_s, own_s)
                    assert busy_s > 0 and wait_s >= 0 and busy_s + wait_s == pytest.approx(step_s)

            opened = await assert_straggler_named(kafka_bootstrap, tmp_path, app_id, job_id, reports, SLOW_RANK,
                                                  SLOW_FROM)
            print(f"torch {reports[0]['torch']}: {opened.summary}")
    finally:
        if job is not None and job.returncode is None:
            job.kill()
            await job.wait()
        worker.terminate()
        worker.wait(30)
