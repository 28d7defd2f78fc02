"""Ground truth: the record the simulator reports for each injected fault, and the entity paths.

`GroundTruth` is what an evaluation compares detector output with. Entity paths:

* NIC port ``"node-0003/mlx5_2/1"``; GPU ``"node-0003/gpu2"``; node ``"node-0003"``
* switch port ``"leaf-u0-r2/Ethernet3"``
* training rank ``"job=<job_id>/rank=<rank>"`` (a hang: its culprit); a whole job ``"job=<job_id>"``

the `EntityRef.local_path` spelling of the same entities (a detector's event reads the same).

>>> nic_path("node-0003", "mlx5_2/1"), rank_path("job-a", 17), job_path("job-a")
('node-0003/mlx5_2/1', 'job=job-a/rank=17', 'job=job-a')
"""
from __future__ import annotations

from dataclasses import dataclass, field

from fabricwatch.models.findings import EntityRef
from fabricwatch.models.vocabulary import HANG_ROOTS as HANG_ROOTS   # re-exported: the ground truth's roots
from fabricwatch.models.vocabulary import NIC_DOWN, PROCESS_LOST, STUCK_PROCESS, XID


def nic_path(node: str, nic: str) -> str:
    """``nic``: the NIC port's entity id, ``"<device>/<port>"``."""
    device, _, port = nic.partition("/")
    return EntityRef(node=node, device=device, port=port).local_path()


def gpu_path(node: str, gpu: int) -> str:
    return EntityRef(node=node, device=f"gpu{gpu}").local_path()


def port_path(switch: str, port: str) -> str:
    return EntityRef(switch=switch, port=port).local_path()


def rank_path(job_id: str, rank: int) -> str:
    return EntityRef(job=job_id, rank=str(rank)).local_path()


def job_path(job_id: str) -> str:
    return EntityRef(job=job_id).local_path()


# -- hangs: one rank holds up its job's collective (rank side; labelled ``hang``) -------------
# The probable roots of a hang, as the ground truth names them (and `models.hang` codes them).
HANG_STUCK_PROCESS, HANG_PROCESS_LOST, HANG_XID, HANG_NIC_DOWN = STUCK_PROCESS, PROCESS_LOST, XID, NIC_DOWN
# A job stalled at least this long is labelled a hang (the NCCL watchdog's victims see one):
# the longest normal stall of a collective, and long enough for a heartbeat-based detector
# (5 s heartbeats) to tell. A shorter stall is labelled nothing: an alarm there is explained
# by its root fault, where it has one.
HANG_LABEL_MIN_S = 30.0


@dataclass(frozen=True)
class GroundTruth:
    """One injected fault, labelled for evaluation.

    ``entity`` is the source (the port that storms, the degraded link, the slow rank);
    ``victims`` are the entities it harms without being at fault (storm-paused ports,
    the other ranks of a straggler's job as ``"job=<id>"``); ``related`` are entities where
    the fault is also visible (the leaf port facing a NIC, the straggler's GPU). Times are
    absolute event time; ``offset_unix_ns`` is None when the fault outlives the run.
    ``expect_alert`` is False for the must-not-fire cases (admin toggle, reboot, XON
    flood, a storm shorter than the detection time, clock skew, application XIDs of a user
    bug, an XID of the catalog's application category).
    """
    kind: str
    entity: str
    onset_unix_ns: int
    offset_unix_ns: int | None
    victims: tuple[str, ...] = ()
    related: tuple[str, ...] = ()
    expect_alert: bool = True
    detail: dict = field(default_factory=dict, compare=False, hash=False)
    # GPU-hours the fault cost its jobs, measured on the simulated jobs' progress
    # (`fabricwatch.evaluation.impact`); None until measured, or when it touched no job.
    gpu_hours_lost: float | None = field(default=None, compare=False, hash=False)

    def active_at(self, unix_ns: int) -> bool:
        return self.onset_unix_ns <= unix_ns and (self.offset_unix_ns is None or unix_ns < self.offset_unix_ns)
