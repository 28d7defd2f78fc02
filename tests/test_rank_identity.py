"""The training-rank SDK's identity from the launcher's environment (torchrun, Slurm, manual).
"""
from __future__ import annotations

import logging
import os
import socket

import pytest

from helpers import closed_port

from fabricwatch.rank import RankIdentity, RankReporter
from fabricwatch.rank.identity import clean_name


# -- helpers --------------------------------------------------------------------------------


# -- identity from the environment ------------------------------------------------------------
def test_torchrun_variables():
    ident = RankIdentity.from_env({"RANK": "5", "WORLD_SIZE": "16", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "8",
                                   "TORCHELASTIC_RUN_ID": "llm-run-7", "FABRICWATCH_NODE": "gpu-12"})
    assert ident == RankIdentity("llm-run-7", 5, 16, "gpu-12", 1, "torchrun")


def test_slurm_variables():
    ident = RankIdentity.from_env({"SLURM_PROCID": "9", "SLURM_NTASKS": "32", "SLURM_LOCALID": "1",
                                   "SLURM_JOB_ID": "771234", "SLURMD_NODENAME": "dgx-b07"})
    assert ident == RankIdentity("771234", 9, 32, "dgx-b07", 1, "slurm")


def test_torchrun_under_slurm_takes_torchrun_rank_and_slurm_job():
    # `srun torchrun ...`: SLURM_PROCID is the launcher's index, RANK the training rank
    ident = RankIdentity.from_env({"SLURM_PROCID": "1", "SLURM_NTASKS": "2", "SLURM_LOCALID": "0",
                                   "SLURM_JOB_ID": "5521", "SLURMD_NODENAME": "n2",
                                   "RANK": "11", "WORLD_SIZE": "16", "LOCAL_RANK": "3",
                                   "TORCHELASTIC_RUN_ID": "none"})
    assert (ident.job_id, ident.rank, ident.world_size, ident.node, ident.local_gpu, ident.launcher) == \
        ("5521", 11, 16, "n2", 3, "torchrun")


def test_job_id_precedence_and_fallbacks():
    base = {"RANK": "0", "WORLD_SIZE": "2", "FABRICWATCH_NODE": "n1"}
    assert RankIdentity.from_env({**base, "SLURM_JOB_ID": "1", "FABRICWATCH_JOB_ID": "mine"}).job_id == "mine"
    assert RankIdentity.from_env({**base, "TORCHELASTIC_RUN_ID": "abc"}).job_id == "abc"
    # torchrun without --rdzv-id says "none": not a job id; the launcher's pid is shared by the job's ranks
    fallback = RankIdentity.from_env({**base, "TORCHELASTIC_RUN_ID": "none"}).job_id
    assert fallback == f"n1-{os.getppid()}"
    assert RankIdentity.from_env({**base, "FABRICWATCH_JOB_ID": "my job#3"}).job_id == "my-job-3"
    assert RankIdentity.from_env({"OMPI_COMM_WORLD_RANK": "2", "OMPI_COMM_WORLD_SIZE": "4",
                                  "OMPI_COMM_WORLD_LOCAL_RANK": "2", "PMIX_NAMESPACE": "1444282369"}) \
        .job_id == "1444282369"


def test_node_gpu_and_single_process_defaults():
    ident = RankIdentity.from_env({})
    assert (ident.rank, ident.world_size, ident.local_gpu, ident.launcher) == (0, 1, 0, "single")
    assert ident.node == clean_name(socket.gethostname())
    ident = RankIdentity.from_env({"RANK": "1", "WORLD_SIZE": "4", "LOCAL_RANK": "1", "FABRICWATCH_LOCAL_GPU": "6"})
    assert ident.local_gpu == 6


@pytest.mark.parametrize("env, message", [
    ({"RANK": "4", "WORLD_SIZE": "4"}, "outside the world size"),
    ({"RANK": "x", "WORLD_SIZE": "4"}, "not an integer"),
    ({"SLURM_PROCID": "0", "SLURM_NTASKS": "0"}, "must be >= 1"),
])
def test_inconsistent_environment(env, message, caplog):
    with pytest.raises(ValueError, match=message):
        RankIdentity.from_env(env)
    # the reporter never raises: it is disabled, with one warning
    with caplog.at_level(logging.WARNING, logger="fabricwatch.rank"):
        reporter = RankReporter.from_env({**env, "FABRICWATCH_GATEWAY": "127.0.0.1:1"})
    assert not reporter.enabled
    assert message in caplog.text
    with reporter.step():
        pass


def test_reporter_from_env_reads_gateway_settings():
    env = {"RANK": "0", "WORLD_SIZE": "1", "FABRICWATCH_GATEWAY": f"127.0.0.1:{closed_port()}",
           "FABRICWATCH_TOKEN": "t0k", "FABRICWATCH_CLUSTER": "c9", "FABRICWATCH_CA_CERT": ""}
    reporter = RankReporter.from_env(env, flush_interval_s=30.0)
    try:
        assert reporter.enabled and reporter.token == "t0k" and reporter.cluster == "c9"
        assert reporter.flush_interval_s == 30.0
    finally:
        reporter.close(0.1)
    assert not RankReporter.from_env({**env, "FABRICWATCH_DISABLE": "1"}).enabled
    assert not RankReporter.from_env({"RANK": "0", "WORLD_SIZE": "1"}).enabled   # no gateway: no-op


