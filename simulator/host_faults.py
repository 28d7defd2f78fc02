"""Faults of the hosts the simulator can inject: GPUs (XIDs, ECC, PCIe, throttling), nodes
(reboot, clock skew), and the training processes (stragglers, hangs and the job stalls that
are no hang).

Times and entities as in `fabric_faults` (seconds after the simulator's start; a node
hostname, a GPU index, ``(node, gpu)`` for a rank). `ClusterSimulator` reports each as a
`labels.GroundTruth`.

>>> Straggler("node-0001", gpu=2, onset_s=22.0, factor=1.4).kind
'straggler'
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from fabricwatch.simulator.labels import HANG_PROCESS_LOST, HANG_STUCK_PROCESS
from fabricwatch.simulator.timeline import INF, check_times
from fabricwatch.xid import GPU_LOST_XIDS, PREEMPTIVE_CLEANUP, UNCORRECTABLE_ECC_XIDS, is_gpu_fault
from fabricwatch.xid import CATALOG as XID_CATALOG

# XID facts from NVIDIA's Xid catalog, one source for the simulator and the detectors
# (`fabricwatch.xid`): the text the driver logs, which XIDs raise the DBE counter, which lose the GPU.
XID_TEXT = {code: info.text for code, info in XID_CATALOG.items()}
XID_UNCORRECTABLE_ECC = UNCORRECTABLE_ECC_XIDS
XID_GPU_LOST = GPU_LOST_XIDS

# NVML clocks-event reason bits.
REASON_GPU_IDLE = 0x1
REASON_SW_POWER_CAP = 0x4
REASON_SW_THERMAL = 0x20
REASON_HW_THERMAL = 0x40

STRAGGLER_CAUSES = ("thermal", "sw_thermal", "power", "none", "nic_downgrade", "storm_victim",
                    "nic_pcie", "partial_pause", "gpu_pcie", "nic_down")
# A partial pause's received duty, from the straggler's factor (a NIC paused d of the time
# sends 1 - d of it), kept between a noticeable pause and a storm's.
PARTIAL_PAUSE_DUTY_RANGE = (0.3, 0.6)


@dataclass(frozen=True)
class GpuPcieDowngrade:
    """A GPU's PCIe link at fewer lanes, visible while it is busy (idle GPUs drop gen anyway)."""
    node: str
    gpu: int
    onset_s: float
    offset_s: float = INF
    width: int = 8
    kind = "gpu_pcie_downgrade"

    def __post_init__(self) -> None:
        check_times(self.onset_s, self.offset_s)
        if self.width not in (1, 2, 4, 8):
            raise ValueError(f"width must be 1, 2, 4 or 8, got {self.width!r}")


@dataclass(frozen=True)
class Straggler:
    """The rank on ``(node, gpu)`` is persistently slower.

    Compute causes multiply the rank's ``busy_seconds`` by ``factor`` (every other rank
    waits that much longer in the collectives) and show on the GPU:

    * ``"thermal"``: HwThermalSlowdown (0x40), SM clock / factor, temperature up;
    * ``"sw_thermal"``: SwThermalSlowdown (0x20), same;
    * ``"power"``: SwPowerCap (0x4), power pinned at a lowered cap, SM clock / factor;
    * ``"none"``: nothing visible on the node (e.g. a slow data loader).

    Network causes slow the rank's NIC instead, which stretches the communication
    phase of every rank (``busy_seconds`` unchanged, ``collective_wait_seconds`` up on all):
    ``"nic_downgrade"`` adds a `LinkDowngrade` of that GPU's NIC to 200G, ``"storm_victim"``
    adds a `PfcStorm` from another node's port on the same leaf, ``"nic_pcie"`` a
    `NicPcieDowngrade` of the NIC to x8 (about half its line rate at gen5), ``"gpu_pcie"`` a
    `GpuPcieDowngrade` of the GPU to x8 (its NIC's GPUDirect RDMA traffic crosses that link).
    ``"partial_pause"``: the leaf port pauses the NIC at a duty of ``1 - 1/factor`` within
    `PARTIAL_PAUSE_DUTY_RANGE` (rx pause durations rise, its traffic loses that share; no
    storm: nothing else is paused). ``"nic_down"``: the NIC's link goes down for good
    (``state`` "1: DOWN", ``link_downed`` +1, no traffic on it) and NCCL fails over to a
    sibling NIC, which carries both rails: the job's collectives run at half speed.
    """
    node: str
    gpu: int
    onset_s: float
    offset_s: float = INF
    factor: float = 1.3
    cause: str = "thermal"
    kind = "straggler"

    def __post_init__(self) -> None:
        check_times(self.onset_s, self.offset_s)
        if self.cause not in STRAGGLER_CAUSES:
            raise ValueError(f"cause must be one of {STRAGGLER_CAUSES}, got {self.cause!r}")
        if not 1.0 <= self.factor <= 10.0:
            raise ValueError(f"factor must be in [1, 10], got {self.factor!r}")


@dataclass(frozen=True)
class GpuXid:
    """An NVML XID on a GPU, repeated every ``repeat_s`` until ``offset_s`` (each sent).

    48/94/95 also raise ``ecc_uncorrected_volatile_total``; 79 (fallen off the bus) makes
    the GPU unreadable (gauges NaN, counters frozen) and hangs its job until ``offset_s``.
    """
    node: str
    gpu: int
    code: int
    onset_s: float
    repeat_s: float | None = None
    offset_s: float = INF
    kind = "gpu_xid"

    def __post_init__(self) -> None:
        if self.repeat_s is not None and not self.repeat_s > 0:
            raise ValueError(f"repeat_s must be > 0, got {self.repeat_s!r}")
        if self.repeat_s is None and self.offset_s == INF and self.code not in XID_GPU_LOST:
            object.__setattr__(self, "offset_s", self.onset_s + 1e-3)
        check_times(self.onset_s, self.offset_s)

    def occurrences(self, until_s: float = INF) -> list[float]:
        if self.repeat_s is None:
            return [self.onset_s]
        end = min(self.offset_s, until_s)
        n = int(math.floor((end - self.onset_s) / self.repeat_s - 1e-12)) + 1
        return [self.onset_s + k * self.repeat_s for k in range(max(n, 0))]


@dataclass(frozen=True)
class EccUncorrectable:
    """``count`` uncorrectable (double-bit) ECC errors on a GPU at ``onset_s``.

    ``ecc_uncorrected_volatile_total`` rises by ``count`` and one row is queued for
    remapping (``remapped_rows_uncorrectable`` +1).
    """
    node: str
    gpu: int
    onset_s: float
    count: int = 1
    kind = "ecc_uncorrectable"

    def __post_init__(self) -> None:
        check_times(self.onset_s, self.onset_s + 1e-3)
        if self.count < 1:
            raise ValueError(f"count must be >= 1, got {self.count!r}")

    @property
    def offset_s(self) -> float:
        return self.onset_s + 1e-3


@dataclass(frozen=True)
class NodeReboot:
    """A node reboots: no snapshots for ``down_s``, then every counter restarts near 0.

    Its NIC links go down (leaf ``oper_up`` 0, ``interface-transitions`` +2, no pause
    frames); its job hangs, then restarts from its last checkpoint step. Must not fire
    storm or downgrade detectors.
    """
    node: str
    onset_s: float
    down_s: float = 60.0
    restart_s: float = 30.0
    kind = "node_reboot"

    def __post_init__(self) -> None:
        check_times(self.onset_s, self.onset_s + self.down_s)
        if self.restart_s < 0:
            raise ValueError(f"restart_s must be >= 0, got {self.restart_s!r}")

    @property
    def offset_s(self) -> float:
        return self.onset_s + self.down_s


@dataclass(frozen=True)
class ClockSkew:
    """A node's clock is off by ``skew_s`` seconds (its snapshot and step timestamps)."""
    node: str
    onset_s: float
    offset_s: float = INF
    skew_s: float = 5.0
    kind = "clock_skew"

    def __post_init__(self) -> None:
        check_times(self.onset_s, self.offset_s)


@dataclass(frozen=True)
class XidCascade(GpuXid):
    """A hardware XID on one GPU, then XID 45 (preemptive cleanup) on sibling GPUs of its node.

    The driver tears down the channels of every context that shared the failing GPU (the
    job's other ranks on the node) and logs 45 for each: ``victims`` are those GPU indices,
    ``delays_s`` when each logs it after ``onset_s`` (NVIDIA driver: within ms to a few s).
    Ground truth: one ``gpu_xid`` on the root GPU; the siblings are victims, not faults.

    >>> c = XidCascade("node-0001", 2, 79, onset_s=10.0, offset_s=20.0, victims=(0, 5), delays_s=(0.2, 1.5))
    >>> c.cleanups()
    [(0, 10.2), (5, 11.5)]
    """
    victims: tuple[int, ...] = ()
    delays_s: tuple[float, ...] = ()

    def __post_init__(self) -> None:
        super().__post_init__()
        if not is_gpu_fault(self.code):
            raise ValueError(f"XidCascade: root XID {self.code} is not a GPU fault in the Xid catalog")
        if len(self.delays_s) != len(self.victims):
            raise ValueError("XidCascade: one delay per victim GPU")
        if self.gpu in self.victims or len(set(self.victims)) != len(self.victims):
            raise ValueError("XidCascade: victims are distinct sibling GPUs")
        if any(not 0 <= d <= 10 for d in self.delays_s):
            raise ValueError(f"XidCascade: delays_s must be in [0, 10], got {self.delays_s!r}")

    def cleanups(self) -> list[tuple[int, float]]:
        """(victim GPU, time) of each XID 45."""
        return [(g, round(self.onset_s + d, 6)) for g, d in zip(self.victims, self.delays_s)]


@dataclass(frozen=True)
class ApplicationXid:
    """A user bug: application-level XIDs (13, 31, 43, ...) on a job's GPUs of one node.

    Each burst logs ``code`` on every GPU of ``gpus`` at ``onset_s + k * period_s``
    (``bursts`` times), then XID 45 on ``cleanup`` GPUs ``cleanup_delay_s`` later (the
    driver stopping the job's other contexts). With ``crash`` the job dies and restarts
    from its checkpoint after each burst. Not a GPU fault: must not fire (``expect_alert``
    False).
    """
    node: str
    gpus: tuple[int, ...]
    onset_s: float
    code: int = 13
    bursts: int = 1
    period_s: float = 180.0
    cleanup: tuple[int, ...] = ()
    cleanup_delay_s: float = 0.5
    crash: bool = False
    kind = "application_xid"

    def __post_init__(self) -> None:
        if is_gpu_fault(self.code) or self.code == PREEMPTIVE_CLEANUP:
            raise ValueError(f"ApplicationXid: XID {self.code} is not application-level in the Xid catalog")
        if not self.gpus or self.bursts < 1 or not self.period_s > 0 or not 0 <= self.cleanup_delay_s <= 10:
            raise ValueError("ApplicationXid: needs gpus, bursts >= 1, period_s > 0, cleanup_delay_s in [0, 10]")
        if set(self.gpus) & set(self.cleanup):
            raise ValueError("ApplicationXid: cleanup GPUs are the job's other GPUs")
        check_times(self.onset_s, self.offset_s)

    @property
    def offset_s(self) -> float:
        return self.onset_s + (self.bursts - 1) * self.period_s + self.cleanup_delay_s + 1e-3

    def occurrences(self) -> list[tuple[int, int, float]]:
        """(GPU, code, time) of every XID this bug logs, in time order."""
        out = []
        for k in range(self.bursts):
            t = self.onset_s + k * self.period_s
            out += [(g, self.code, round(t, 6)) for g in self.gpus]
            out += [(g, PREEMPTIVE_CLEANUP, round(t + self.cleanup_delay_s, 6)) for g in self.cleanup]
        return out

    def burst_times(self) -> list[float]:
        return [self.onset_s + k * self.period_s for k in range(self.bursts)]


@dataclass(frozen=True)
class _RankFault:
    """A fault of the training process on ``(node, gpu)`` from ``onset_s`` to ``offset_s``."""
    node: str
    gpu: int
    onset_s: float
    offset_s: float = INF

    def __post_init__(self) -> None:
        check_times(self.onset_s, self.offset_s)


@dataclass(frozen=True)
class RankStuck(_RankFault):
    """The rank on ``(node, gpu)`` stops entering collectives (a data-loader or Python deadlock,
    a rank-dependent branch): it never enters the collective after the ones it had entered at
    ``onset_s``; its peers enter it and wait inside; its heartbeats go on. At ``offset_s`` it
    goes on (the job completes the collective)."""
    kind = "rank_stuck"
    root = HANG_STUCK_PROCESS


@dataclass(frozen=True)
class RankLost(_RankFault):
    """The rank's process on ``(node, gpu)`` dies at ``onset_s`` (killed, OOM, segfault): its
    heartbeats stop, it never completes its open collective; its peers wait in it. At
    ``offset_s`` the scheduler restarts the job from its checkpoint (new processes)."""
    kind = "rank_lost"
    root = HANG_PROCESS_LOST


@dataclass(frozen=True)
class _JobStall:
    """Something the job on ``node`` does for ``duration_s`` from ``onset_s`` that is no hang."""
    node: str
    onset_s: float
    duration_s: float = 240.0

    def __post_init__(self) -> None:
        check_times(self.onset_s, self.onset_s + self.duration_s)

    @property
    def offset_s(self) -> float:
        return self.onset_s + self.duration_s


@dataclass(frozen=True)
class CheckpointStall(_JobStall):
    """Not a hang: the job on ``node`` writes a checkpoint of ``duration_s`` from its first step
    start at or after ``onset_s``: every rank is idle between collectives meanwhile."""
    kind = "checkpoint_stall"


@dataclass(frozen=True)
class JobPause(_JobStall):
    """Not a hang: the scheduler pauses the job on ``node`` (SIGSTOP, preemption) for
    ``duration_s``: every rank's heartbeat stops together, then resumes where it was."""
    duration_s: float = 120.0
    kind = "job_pause"


@dataclass(frozen=True)
class LongStep(_JobStall):
    """Not a hang: the job on ``node`` runs one long step of ``duration_s`` more compute from its
    first step start at or after ``onset_s`` (gradient accumulation, a pipeline flush), with
    small collectives completing every ``collective_every_s`` inside it."""
    duration_s: float = 180.0
    collective_every_s: float = 3.0
    kind = "long_step"

    def __post_init__(self) -> None:
        super().__post_init__()
        if not 0 < self.collective_every_s < self.duration_s:
            raise ValueError(f"collective_every_s must be in (0, duration_s), got {self.collective_every_s!r}")
