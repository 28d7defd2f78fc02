"""The training-rank SDK: each rank reports its step timings to the ingest gateway.

In synchronous data-parallel training every rank's wall-clock step time is the same (all
wait for the slowest at the gradient collectives), so step time alone never names a
straggler. What does is the split of each step into the rank's own compute (``busy``)
and the time it then spends inside the collectives (``wait``): a slow rank is busy longer
and waits least, its peers wait for it. The straggler detector (`models.straggler`)
compares these across the ranks of a job. A few lines in the training loop::

    from fabricwatch.rank import RankReporter

    reporter = RankReporter.from_env()          # torchrun / Slurm / mpirun variables
    for batch in loader:
        with reporter.step():
            loss = forward_backward(batch)       # own compute: busy
            with reporter.collectives():
                allreduce(gradients)             # inside the collectives: wait
            optimizer.step()                     # own compute again: busy

or the same with ``reporter.step_begin()``, ``reporter.collectives_begin()``,
``reporter.collectives_end()`` (optional) and ``reporter.step_end()``. Per step it
records the wall-clock step time, the time inside the collectives and the rest as busy
time (monotonic clock), with the step's start from the wall clock.

It never slows or breaks training: the hot path reads the clock and appends one tuple to
a bounded deque (past ``max_buffered`` the oldest is dropped and counted); a daemon
thread sends batches to the gateway with the unary ``Ingest.Send`` RPC, keeps unacked
steps (bounded) across outages and retries with backoff; a gateway that is down or
refuses us costs one warning, nothing raises into the training loop; at exit the thread
gets ``exit_flush_s`` to send what is left.

Configuration (environment):

=========================== ================================================================
``FABRICWATCH_GATEWAY``     ``host:port`` of the ingest gateway; unset = reporting disabled
``FABRICWATCH_TOKEN``       bearer token (the gateway's token file must allow this node)
``FABRICWATCH_CA_CERT``     PEM of the gateway's CA: TLS; unset = plaintext
``FABRICWATCH_TLS_SERVER_NAME`` expected name in the gateway's certificate, if not the host
``FABRICWATCH_CLUSTER``     cluster name (else the gateway's default)
``FABRICWATCH_JOB_ID``      job id override (else ``SLURM_JOB_ID``, ``TORCHELASTIC_RUN_ID``,
                            the MPI job namespace)
``FABRICWATCH_NODE``        node name override (else ``SLURMD_NODENAME``, the hostname); must
                            be the name the node collector reports as its ``source``
``FABRICWATCH_LOCAL_GPU``   GPU index override (else the local rank)
``FABRICWATCH_DISABLE``     ``1`` turns the reporter into a no-op
=========================== ================================================================

Rank, world size and local rank come from torchrun (``RANK``, ``WORLD_SIZE``,
``LOCAL_RANK``), else Slurm (``SLURM_PROCID``, ``SLURM_NTASKS``, ``SLURM_LOCALID``), else
Open MPI (``OMPI_COMM_WORLD_RANK``...), else PMI (``PMI_RANK``, ``PMI_SIZE``).

Also here: `instrument_torch` (PyTorch DDP comm hook and optimizer hooks, torch imported
only when called) and `ingest_nccl_inspector` (per-step records from the JSON output of
NCCL's Inspector profiler plugin). See docs/rank-sdk.md.

The package is the SDK's public import path; its modules each do one job: `identity`
(who the rank is, `StepRecord`), `reporter` (the hot path and the sender thread),
`client` (the gRPC client, grpc imported only there), `pytorch` (`instrument_torch`),
`inspector` (`ingest_nccl_inspector`).

>>> identity = RankIdentity.from_env({"RANK": "3", "WORLD_SIZE": "8", "LOCAL_RANK": "3",
...                                   "TORCHELASTIC_RUN_ID": "run-42", "FABRICWATCH_NODE": "gpu-07"})
>>> identity
RankIdentity(job_id='run-42', rank=3, world_size=8, node='gpu-07', local_gpu=3, launcher='torchrun')
>>> r = RankReporter(identity, gateway="")       # no gateway: every call is a no-op
>>> with r.step():
...     with r.collectives():
...         pass
>>> r.enabled, r.stats["steps"]
(False, 0)
"""
from __future__ import annotations

from .identity import RankIdentity, StepRecord
from .inspector import InspectorSteps, ingest_nccl_inspector
from .pytorch import instrument_torch
from .reporter import HEARTBEAT_INTERVAL_S, RankReporter, default_reporter

__all__ = ["RankIdentity", "RankReporter", "StepRecord", "InspectorSteps", "default_reporter",
           "instrument_torch", "ingest_nccl_inspector", "HEARTBEAT_INTERVAL_S"]
