"""Who a rank is, and the record of one of its steps.

`RankIdentity` reads the rank, world size, job and node from the launcher's environment
(torchrun, Slurm, Open MPI, PMI); `StepRecord` is one measured step, field for field a
`RankStep`; `clean_name` makes a job or node name the gateway accepts. Separate from the
reporter because the NCCL Inspector ingestion needs the same names and records without a
reporter.
"""
from __future__ import annotations

import os
import re
import socket
from collections.abc import Mapping
from dataclasses import dataclass
from typing import NamedTuple

# Same rule as the gateway's validation of names (streams/validate.py).
_NAME_OK = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._:/@+=-]*$")
_NAME_BAD_CHARS = re.compile(r"[^A-Za-z0-9._:/@+=-]")
MAX_NAME_LEN = 253


class StepRecord(NamedTuple):
    """One rank's timings of one step, field for field a `RankStep` of telemetry.proto."""
    job_id: str
    rank: int
    world_size: int
    node: str
    local_gpu: int
    step: int
    start_unix_ns: int
    step_seconds: float
    busy_seconds: float
    collective_wait_seconds: float


def clean_name(name: str, fallback: str = "unknown") -> str:
    """A job or node name the gateway accepts: odd characters become '-'.

    >>> clean_name("job 12/a#b"), clean_name("_x"), clean_name("")
    ('job-12/a-b', 'x', 'unknown')
    """
    name = _NAME_BAD_CHARS.sub("-", str(name).strip())[:MAX_NAME_LEN]
    name = name.lstrip("._:/@+=-")
    return name if _NAME_OK.match(name) else fallback


# -- identity --------------------------------------------------------------------------------
# (launcher, rank, world size, local rank) variables, first complete set wins. torchrun
# first: under `srun torchrun`, SLURM_PROCID is the launcher's index, RANK the rank's.
_LAUNCHERS = (
    ("torchrun", "RANK", "WORLD_SIZE", "LOCAL_RANK"),
    ("slurm", "SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID"),
    ("openmpi", "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK"),
    ("pmi", "PMI_RANK", "PMI_SIZE", "MPI_LOCALRANKID"),
)
# job id, first present wins; TORCHELASTIC_RUN_ID is "none" when torchrun had no --rdzv-id
JOB_VARS = ("FABRICWATCH_JOB_ID", "SLURM_JOB_ID", "TORCHELASTIC_RUN_ID", "PMIX_NAMESPACE",
             "OMPI_MCA_ess_base_jobid")


def _int_var(env: Mapping[str, str], name: str, minimum: int = 0) -> int:
    raw = env.get(name, "")
    try:
        value = int(raw.strip())
    except ValueError:
        raise ValueError(f"{name}={raw!r} is not an integer") from None
    if value < minimum:
        raise ValueError(f"{name}={value} must be >= {minimum}")
    return value


@dataclass(frozen=True)
class RankIdentity:
    """Who a rank is: job, rank, world size, node and GPU."""
    job_id: str
    rank: int
    world_size: int
    node: str
    local_gpu: int
    launcher: str = "manual"

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> RankIdentity:
        """Read torchrun, Slurm or MPI variables; ValueError if they are inconsistent.

        >>> RankIdentity.from_env({"SLURM_PROCID": "5", "SLURM_NTASKS": "16", "SLURM_LOCALID": "1",
        ...                        "SLURM_JOB_ID": "81234", "SLURMD_NODENAME": "dgx-a17"})
        RankIdentity(job_id='81234', rank=5, world_size=16, node='dgx-a17', local_gpu=1, launcher='slurm')
        """
        env = os.environ if environ is None else environ
        launcher, rank, world, local = "single", 0, 1, 0
        for name, rank_var, world_var, local_var in _LAUNCHERS:
            if rank_var in env and world_var in env:
                launcher = name
                rank = _int_var(env, rank_var)
                world = _int_var(env, world_var, minimum=1)
                local = _int_var(env, local_var) if env.get(local_var, "").strip() else 0
                break
        if rank >= world:
            raise ValueError(f"rank {rank} is outside the world size {world} ({launcher} variables)")
        node = clean_name(env.get("FABRICWATCH_NODE") or env.get("SLURMD_NODENAME") or socket.gethostname(),
                          fallback="localhost")
        gpu = _int_var(env, "FABRICWATCH_LOCAL_GPU") if env.get("FABRICWATCH_LOCAL_GPU", "").strip() else local
        job = ""
        for var in JOB_VARS:
            value = env.get(var, "").strip()
            if value and not (var == "TORCHELASTIC_RUN_ID" and value.lower() == "none"):
                job = value
                break
        if not job:
            # no launcher id: the ranks of one job on one node share the parent (the launcher)
            job = f"{node}-{os.getppid()}" if world > 1 else f"{node}-{os.getpid()}"
        return cls(clean_name(job), rank, world, node, gpu, launcher)

