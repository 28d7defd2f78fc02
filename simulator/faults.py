"""Faults the cluster simulator can inject, and the ground-truth records it reports.

Every fault is a frozen dataclass whose times are **seconds of event time after the
simulator's** ``start_unix_ns`` (``onset_s``; ``offset_s`` where the fault clears, ``inf`` =
never within the run). Entities are named as the telemetry names them: a node hostname, a
NIC port id ``"mlx5_2/1"``, a GPU index, a switch and its port name.

`GroundTruth` is what an evaluation compares detector output with. Entity paths:

* NIC port ``"node-0003/mlx5_2/1"``; GPU ``"node-0003/gpu2"``; node ``"node-0003"``
* switch port ``"leaf-u0-r2/Ethernet3"``
* training rank ``"job/<job_id>/rank/<rank>"`` (a hang: its culprit); a whole job ``"job/<job_id>"``

>>> f = PfcStorm(sources=(("node-0003", "mlx5_2/1"),), onset_s=12.0, offset_s=20.0)
>>> f.duration_s, f.kind
(8.0, 'pfc_storm')
>>> nic_path("node-0003", "mlx5_2/1"), rank_path("job-a", 17)
('node-0003/mlx5_2/1', 'job/job-a/rank/17')
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Union

from fabricwatch.xid import CATALOG as XID_CATALOG
from fabricwatch.xid import GPU_LOST_XIDS, PREEMPTIVE_CLEANUP, UNCORRECTABLE_ECC_XIDS, is_gpu_fault

INF = math.inf

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

# SONiC's DEFAULT_DETECTION_TIME: a storm shorter than this is not expected to alert.
STORM_DETECTION_TIME_S = 0.2


def nic_path(node: str, nic: str) -> str:
    return f"{node}/{nic}"


def gpu_path(node: str, gpu: int) -> str:
    return f"{node}/gpu{gpu}"


def port_path(switch: str, port: str) -> str:
    return f"{switch}/{port}"


def rank_path(job_id: str, rank: int) -> str:
    return f"job/{job_id}/rank/{rank}"


def _check_times(onset_s: float, offset_s: float) -> None:
    if not onset_s >= 0.0:
        raise ValueError(f"onset_s must be >= 0, got {onset_s!r}")
    if not offset_s > onset_s:
        raise ValueError(f"offset_s must be > onset_s ({onset_s}), got {offset_s!r}")


@dataclass(frozen=True)
class LinkDowngrade:
    """A NIC port renegotiates to a lower rate (or another lane layout at the same speed).

    The sysfs ``rate`` label becomes ``rate``, ``netdev_speed_mbps`` and the leaf port's
    ``port_speed_gbps`` follow, and the port's traffic is capped at the new speed (which
    slows every collective it takes part in). ``"400 Gb/sec (8X HDR)"`` keeps the speed.
    """
    node: str
    nic: str
    onset_s: float
    offset_s: float = INF
    rate: str = "200 Gb/sec (4X HDR)"
    kind = "link_downgrade"

    def __post_init__(self) -> None:
        _check_times(self.onset_s, self.offset_s)


@dataclass(frozen=True)
class NicPcieDowngrade:
    """The NIC's PCIe link trains at fewer lanes (``pcie_width_current < pcie_width_max``)."""
    node: str
    nic: str
    onset_s: float
    offset_s: float = INF
    width: int = 8
    kind = "nic_pcie_downgrade"

    def __post_init__(self) -> None:
        _check_times(self.onset_s, self.offset_s)
        if self.width not in (1, 2, 4, 8):
            raise ValueError(f"width must be 1, 2, 4 or 8, got {self.width!r}")


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
        _check_times(self.onset_s, self.offset_s)
        if self.width not in (1, 2, 4, 8):
            raise ValueError(f"width must be 1, 2, 4 or 8, got {self.width!r}")


@dataclass(frozen=True)
class LinkFlap:
    """A NIC link goes down ``flaps`` times, ``down_s`` each, every ``period_s``.

    While down: ``state`` "1: DOWN", ``phys_state`` "3: Disabled", ``netdev_speed_mbps`` -1,
    ``rate`` falls back to mlx5's default "40 Gb/sec (4X QDR)", no traffic. Each flap adds
    1 to ``link_downed`` and ``link_down_events_phy`` and 2 to the leaf port's
    ``interface-transitions``.
    """
    node: str
    nic: str
    onset_s: float
    down_s: float = 2.0
    flaps: int = 1
    period_s: float = 10.0
    kind = "link_flap"

    def __post_init__(self) -> None:
        _check_times(self.onset_s, self.onset_s + self.down_s)
        if self.flaps < 1:
            raise ValueError(f"flaps must be >= 1, got {self.flaps!r}")
        if self.flaps > 1 and not self.period_s > self.down_s:
            raise ValueError(f"period_s must exceed down_s, got {self.period_s!r}")

    @property
    def offset_s(self) -> float:
        return self.onset_s + (self.flaps - 1) * self.period_s + self.down_s

    def intervals(self) -> list[tuple[float, float]]:
        return [(self.onset_s + k * self.period_s, self.onset_s + k * self.period_s + self.down_s)
                for k in range(self.flaps)]


@dataclass(frozen=True)
class AdminToggle:
    """An operator shuts a switch port and re-enables it (must not look like a storm or flap).

    ``admin_up`` and ``oper_up`` go 0 for ``down_s``, ``interface-transitions`` +2, and
    the far end sees the link drop (a NIC: "1: DOWN" / "2: Polling", ``link_downed`` +1).
    """
    switch: str
    port: str
    onset_s: float
    down_s: float = 5.0
    kind = "admin_toggle"

    def __post_init__(self) -> None:
        _check_times(self.onset_s, self.onset_s + self.down_s)

    @property
    def offset_s(self) -> float:
        return self.onset_s + self.down_s


@dataclass(frozen=True)
class PfcStorm:
    """NIC ports that keep transmitting PFC pause frames on the lossless priority 3.

    ``sources``: ``(node, nic)`` pairs (two for a two-port storm, every port of a leaf
    for an all-port storm). A source's ``tx_prio3_pause_duration`` grows by ``duty``
    seconds per second; its leaf port is paused (``pfc3-rx-*`` rise, ``queue3`` stops
    transmitting, occupancy high when traffic is queued for the source); the leaf then
    pauses the other ports that feed it (the victims: ``rx_prio3_pause*`` rise, their
    traffic collapses) and its spine uplinks.

    * ``xon_only``: the port sends XON frames (quanta 0), which pause nothing: frame
      counters rise, durations do not (a must-not-fire case).
    * ``stuck_host``: the source's host has stopped consuming, so its own job hangs.
    * ``nic_watchdog_ms``: the NIC's own storm prevention (ethtool ``pfc-prevention-tout``)
      is on: ``tx_pause_storm_warning_events`` +1 at 85 % of the timeout,
      ``tx_pause_storm_error_events`` +1 at the timeout, and the NIC stops pausing.
    * A storm shorter than ``min_alert_s`` (SONiC's default detection time) is recorded
      with ``expect_alert=False``. A source whose node runs no job has nothing queued for
      it: occupancy stays 0 and nobody else is paused (the "no traffic" variant); its
      pauses hold nothing, so it is recorded with ``expect_alert=False`` too (sonic-mgmt
      ``test_pfcwd_no_traffic``: pause frames with nothing queued are not a storm).
    """
    sources: tuple[tuple[str, str], ...]
    onset_s: float
    offset_s: float = INF
    duty: float = 0.999
    xon_only: bool = False
    stuck_host: bool = True
    nic_watchdog_ms: float | None = None
    min_alert_s: float = STORM_DETECTION_TIME_S

    def __post_init__(self) -> None:
        _check_times(self.onset_s, self.offset_s)
        object.__setattr__(self, "sources", tuple((str(n), str(p)) for n, p in self.sources))
        if not self.sources:
            raise ValueError("sources must name at least one (node, nic) port")
        if not 0.0 < self.duty <= 1.0:
            raise ValueError(f"duty must be in (0, 1], got {self.duty!r}")
        if self.nic_watchdog_ms is not None and not 0 < self.nic_watchdog_ms <= 8000:
            raise ValueError(f"nic_watchdog_ms must be in (0, 8000], got {self.nic_watchdog_ms!r}")

    @property
    def kind(self) -> str:
        return "pfc_xon_flood" if self.xon_only else "pfc_storm"

    @property
    def effective_offset_s(self) -> float:
        """When the pausing really stops (the NIC watchdog may end it early)."""
        if self.nic_watchdog_ms is None or self.xon_only:
            return self.offset_s
        return min(self.offset_s, self.onset_s + self.nic_watchdog_ms / 1000.0)

    @property
    def duration_s(self) -> float:
        return self.effective_offset_s - self.onset_s


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
        _check_times(self.onset_s, self.offset_s)
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
        _check_times(self.onset_s, self.offset_s)

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
        _check_times(self.onset_s, self.onset_s + 1e-3)
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
        _check_times(self.onset_s, self.onset_s + self.down_s)
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
        _check_times(self.onset_s, self.offset_s)


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
        _check_times(self.onset_s, self.offset_s)

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
class SwitchPfcStorm:
    """A switch port that keeps transmitting PFC pause frames to its peer on priority 3.

    Nothing on its switch is congested (a buffer or PFC misconfiguration, a switch fault):
    the peer (a NIC, or a spine/leaf port) is held, ``rx_prio3_pause_duration`` (or
    ``pfc3-rx-pause-duration-us``) rises at ``duty`` and its traffic collapses; the port's
    own ``pfc3-tx-pkts`` rise, and ``pfc3-tx-pause-duration-us`` where the switch exports
    it. The source is the switch port, the peer its victim. Recorded with
    ``expect_alert=False`` when shorter than ``min_alert_s`` or when the peer has nothing
    to send (no flows: the pauses hold nothing).
    """
    switch: str
    port: str
    onset_s: float
    offset_s: float = INF
    duty: float = 0.999
    min_alert_s: float = STORM_DETECTION_TIME_S

    def __post_init__(self) -> None:
        _check_times(self.onset_s, self.offset_s)
        if not 0.0 < self.duty <= 1.0:
            raise ValueError(f"duty must be in (0, 1], got {self.duty!r}")

    @property
    def kind(self) -> str:
        return "pfc_storm"

    @property
    def duration_s(self) -> float:
        return self.offset_s - self.onset_s


@dataclass(frozen=True)
class PinnedCounter:
    """A counter quirk, not a fault (no ground truth): a NIC's saturating counter stuck at
    all-ones from ``onset_s`` until ``offset_s``, when it is cleared (``perfquery -R``: back
    to 0). A long-uptime port's 32-bit ``port_xmit_wait`` saturates (IBA 1.8 §16.1.3.5 "stop
    at all ones") and reads 2**32 - 1 until someone clears it."""
    node: str
    nic: str
    counter: str = "port_xmit_wait"
    onset_s: float = 0.0
    offset_s: float = INF

    def __post_init__(self) -> None:
        _check_times(self.onset_s, self.offset_s)


@dataclass(frozen=True)
class LinkDown:
    """A NIC link that goes down and stays down (a dead transceiver, a broken cable).

    While down: ``state`` "1: DOWN", ``phys_state`` "2: Polling" (the port keeps trying to
    train), ``netdev_speed_mbps`` -1, no traffic; ``link_downed`` +1 at the onset; the leaf
    port reads ``oper_up`` 0 with ``admin_up`` 1. ``failover``: after ``failover_after_s``
    NCCL moves the rail's traffic to ``failover_nic`` (default: the NIC of the next rail on
    the node), which then carries two rails while the job's collectives run at half speed;
    without failover the job hangs until the link is back. ``fec_warning_s`` > 0: the
    failing link shows post-FEC symbol errors (uncorrectable codewords) for that long first.
    """
    node: str
    nic: str
    onset_s: float
    offset_s: float = INF
    failover: bool = True
    failover_nic: str = ""
    failover_after_s: float = 8.0
    fec_warning_s: float = 0.0
    kind = "link_down"

    def __post_init__(self) -> None:
        _check_times(self.onset_s, self.offset_s)
        if not self.failover_after_s >= 0 or not self.fec_warning_s >= 0:
            raise ValueError("failover_after_s and fec_warning_s must be >= 0")


@dataclass(frozen=True)
class SwitchLinkDown:
    """A switch-to-switch link (a leaf uplink) that goes down and stays down, admin up.

    Both ends read ``oper_up`` 0 (``admin_up`` 1), ``interface-transitions`` +1 at each end
    at the onset and at the offset; flows reroute over the other spines.
    """
    switch: str
    port: str
    onset_s: float
    offset_s: float = INF
    kind = "link_down"

    def __post_init__(self) -> None:
        _check_times(self.onset_s, self.offset_s)


@dataclass(frozen=True)
class NicAdminDown:
    """An operator shuts a NIC on its host (``ip link set <if> down``) for ``down_s``: no fault.

    ``state`` "1: DOWN", ``phys_state`` "3: Disabled", ``netdev_speed_mbps`` NaN (the kernel
    answers EINVAL for an interface that is not running); the leaf port reads oper down,
    admin up. The node's job (if any) hangs on that rail meanwhile.
    """
    node: str
    nic: str
    onset_s: float
    down_s: float = 120.0
    kind = "nic_admin_down"

    def __post_init__(self) -> None:
        _check_times(self.onset_s, self.onset_s + self.down_s)

    @property
    def offset_s(self) -> float:
        return self.onset_s + self.down_s


# An ECMP imbalance must last this long to be expected to alert: three 10 s windows in a row
# (the detector's persistence) plus one window of alignment.
ECMP_MIN_ALERT_S = 45.0
# A pause cycle must last this long to be expected to alert: the deadlock hold (1 s, five SONiC
# pfcwd detection times) plus the watchdogs' own detection (200 ms) and a sample of slack.
DEADLOCK_MIN_ALERT_S = 1.5


@dataclass(frozen=True)
class EcmpPolarization:
    """A leaf whose ECMP hash sends its spine-bound flows over ``hot_uplinks`` only (hash
    polarization: the hash ignores the RoCE UDP source port, or shares its seed with the tier
    before). The other uplinks carry next to nothing; traffic totals are unchanged.
    Recorded with ``expect_alert=False`` when shorter than ``min_alert_s`` or when the leaf
    sends nothing to the spines (an idle leaf: no flows to polarize). The simulator must
    spread flows over the spines (``ClusterSimulator(ecmp_spread=True)``) for the healthy
    picture to be balanced; the fault implies it. ``rotate_s`` > 0: the hot set moves to the
    next uplinks every ``rotate_s`` (flowlets or adaptive routing moving the big flows: ECMP
    jitter, recorded with ``expect_alert=False``).
    """
    switch: str
    hot_uplinks: tuple[str, ...]
    onset_s: float
    offset_s: float = INF
    min_alert_s: float = ECMP_MIN_ALERT_S
    rotate_s: float = 0.0
    kind = "ecmp_imbalance"

    def __post_init__(self) -> None:
        _check_times(self.onset_s, self.offset_s)
        if not self.hot_uplinks:
            raise ValueError("hot_uplinks must name at least one uplink")

    @property
    def duration_s(self) -> float:
        return self.offset_s - self.onset_s


@dataclass(frozen=True)
class PfcDeadlock:
    """A cycle of switch ports that pause each other on priority 3 (a PFC deadlock).

    ``ports``: the held switch-to-switch ports, in cycle order (each is paused by its cable
    peer, and the peer's switch holds the next one): while on, each reads
    ``pfc3-rx-pause-duration-us`` at ~100 % with its egress queue full, its peer's
    ``pfc3-tx-pkts`` (and TX pause duration where exported) rise. Ends all at once at
    ``offset_s`` (a watchdog drops, a link flaps). Recorded with ``expect_alert=False`` when
    shorter than ``min_alert_s`` (a transient cycle).
    """
    ports: tuple[tuple[str, str], ...]
    onset_s: float
    offset_s: float = INF
    min_alert_s: float = DEADLOCK_MIN_ALERT_S
    kind = "pfc_deadlock"

    def __post_init__(self) -> None:
        switches = {sw for sw, _ in self.ports}
        if len(switches) < 2:
            raise ValueError(f"a deadlock cycle spans at least two switches, got {sorted(switches)}")
        _check_times(self.onset_s, self.offset_s)


@dataclass(frozen=True)
class EcnAfterPause:
    """A switch whose ECN (WRED) marking thresholds of queue ``priority`` sit above its PFC
    XOFF threshold (issue 15): under incast it pauses its upstream before the queue ever
    reaches Kmin, so ``queue<p>-ecn-marked-pkts`` (and the CE marks / CNPs of the NICs behind
    it) fall to ``marking_factor`` of a healthy switch's, and, with no DCQCN rate cut, it
    pauses ``pause_gain`` times as much. ``incast``: a forced incast level (0..0.9, the pause
    duty during bursts) on the switch while on; 0 keeps its own episodes. ``quiet``: the
    switch carries no incast at all while on (nothing pauses): a labelled negative, the
    misconfiguration cannot be seen (``expect_alert=False``).
    """
    switch: str
    onset_s: float
    offset_s: float = INF
    priority: int = 3
    marking_factor: float = 0.01
    pause_gain: float = 1.5
    incast: float = 0.0
    quiet: bool = False
    kind = "ecn_pfc_misorder"

    def __post_init__(self) -> None:
        _check_times(self.onset_s, self.offset_s)
        if not 0.0 <= self.marking_factor < 1.0 or not self.pause_gain >= 1.0 or not 0.0 <= self.incast <= 0.9:
            raise ValueError("marking_factor must be in [0, 1), pause_gain >= 1, incast in [0, 0.9]")


@dataclass(frozen=True)
class Incast:
    """Heavy, healthy incast on a correctly configured switch: its incast level (pause duty
    during bursts) is at least ``level`` while on; it marks ECN first, as DCQCN wants, and
    pauses too. A labelled negative for ``ecn_pfc_misorder`` (``expect_alert=False``)."""
    switch: str
    onset_s: float
    offset_s: float = INF
    level: float = 0.6
    kind = "incast"

    def __post_init__(self) -> None:
        _check_times(self.onset_s, self.offset_s)
        if not 0.0 < self.level <= 0.9:
            raise ValueError(f"level must be in (0, 0.9], got {self.level!r}")


@dataclass(frozen=True)
class QueueDrops:
    """A switch port's egress queue ``priority`` drops ``drops_per_s`` packets per second on a
    live link (``queue<p>-dropped-pkts``). On a lossless priority (3: PFC-enabled) that is a
    headroom or buffer misconfiguration, kind ``lossless_drop``; on a lossy one (0) it is
    normal (``expect_alert=False``). (Drops that come with a link event, frames in flight
    lost as a link goes down or up, the simulator adds to every port transition.)"""
    switch: str
    port: str
    onset_s: float
    offset_s: float = INF
    priority: int = 3
    drops_per_s: float = 50.0
    kind = "lossless_drop"

    def __post_init__(self) -> None:
        _check_times(self.onset_s, self.offset_s)
        if self.priority not in (0, 3) or not self.drops_per_s > 0:
            raise ValueError("QueueDrops: priority must be 0 (lossy) or 3 (lossless), drops_per_s > 0")

    @property
    def lossless(self) -> bool:
        return self.priority == 3


@dataclass(frozen=True)
class NicLosslessDrops:
    """A NIC that discards ``drops_per_s`` received packets per second on lossless priority 3
    (``rx_prio3_buf_discard``) on a live link: its receive buffer for the priority is too
    small or PFC is off for it on the NIC (``mlnx_qos``), kind ``lossless_drop``."""
    node: str
    nic: str
    onset_s: float
    offset_s: float = INF
    drops_per_s: float = 20.0
    kind = "lossless_drop"

    def __post_init__(self) -> None:
        _check_times(self.onset_s, self.offset_s)
        if not self.drops_per_s > 0:
            raise ValueError("NicLosslessDrops: drops_per_s must be > 0")


Fault = Union[LinkDowngrade, NicPcieDowngrade, GpuPcieDowngrade, LinkFlap, AdminToggle, PfcStorm,
              Straggler, GpuXid, EccUncorrectable, NodeReboot, ClockSkew, XidCascade, ApplicationXid,
              SwitchPfcStorm, PinnedCounter, LinkDown, SwitchLinkDown, NicAdminDown, EcmpPolarization, PfcDeadlock]
Fault = Union[Fault, EcnAfterPause, Incast, QueueDrops, NicLosslessDrops]      # congestion tuning (issue 15)


# -- hangs: one rank holds up its job's collective (rank side; labelled ``hang``) -------------
# The probable roots of a hang, as the ground truth names them (and `models.hang` codes them).
HANG_STUCK_PROCESS, HANG_PROCESS_LOST, HANG_XID, HANG_NIC_DOWN = "stuck_process", "process_lost", "xid", "nic_down"
HANG_ROOTS = (HANG_STUCK_PROCESS, HANG_PROCESS_LOST, HANG_XID, HANG_NIC_DOWN)
# A job stalled at least this long is labelled a hang (the NCCL watchdog's victims see one):
# the longest normal stall of a collective, and long enough for a heartbeat-based detector
# (5 s heartbeats) to tell. A shorter stall is labelled nothing: an alarm there is explained
# by its root fault, where it has one.
HANG_LABEL_MIN_S = 30.0


@dataclass(frozen=True)
class _RankFault:
    """A fault of the training process on ``(node, gpu)`` from ``onset_s`` to ``offset_s``."""
    node: str
    gpu: int
    onset_s: float
    offset_s: float = INF

    def __post_init__(self) -> None:
        _check_times(self.onset_s, self.offset_s)


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
        _check_times(self.onset_s, self.onset_s + self.duration_s)

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

Fault = Union[Fault, RankStuck, RankLost, CheckpointStall, JobPause, LongStep]      # hangs and their negatives


@dataclass(frozen=True)
class GroundTruth:
    """One injected fault, labelled for evaluation.

    ``entity`` is the source (the port that storms, the degraded link, the slow rank);
    ``victims`` are the entities it harms without being at fault (storm-paused ports,
    the other ranks of a straggler's job as ``"job/<id>"``); ``related`` are entities where
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
