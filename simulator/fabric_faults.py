"""Faults of the fabric the simulator can inject: links, switch ports, PFC, ECMP, ECN and queues.

Every fault is a frozen dataclass whose times are **seconds of event time after the
simulator's** ``start_unix_ns`` (``onset_s``; ``offset_s`` where the fault clears, `INF` =
never within the run; `timeline`). Entities are named as the telemetry names them: a node
hostname, a NIC port id ``"mlx5_2/1"``, a switch and its port name. The faults of GPUs,
nodes and training processes are in `host_faults`; `ClusterSimulator` reports each as a
`labels.GroundTruth`.

>>> f = PfcStorm(sources=(("node-0003", "mlx5_2/1"),), onset_s=12.0, offset_s=20.0)
>>> f.duration_s, f.kind
(8.0, 'pfc_storm')
"""
from __future__ import annotations

from dataclasses import dataclass

from fabricwatch.simulator.timeline import INF, check_times

# SONiC's DEFAULT_DETECTION_TIME: a storm shorter than this is not expected to alert.
STORM_DETECTION_TIME_S = 0.2


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
        check_times(self.onset_s, self.offset_s)


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
        check_times(self.onset_s, self.offset_s)
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
        check_times(self.onset_s, self.onset_s + self.down_s)
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
        check_times(self.onset_s, self.onset_s + self.down_s)

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
        check_times(self.onset_s, self.offset_s)
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
        check_times(self.onset_s, self.offset_s)
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
        check_times(self.onset_s, self.offset_s)


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
        check_times(self.onset_s, self.offset_s)
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
        check_times(self.onset_s, self.offset_s)


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
        check_times(self.onset_s, self.onset_s + self.down_s)

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
        check_times(self.onset_s, self.offset_s)
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
        check_times(self.onset_s, self.offset_s)


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
        check_times(self.onset_s, self.offset_s)
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
        check_times(self.onset_s, self.offset_s)
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
        check_times(self.onset_s, self.offset_s)
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
        check_times(self.onset_s, self.offset_s)
        if not self.drops_per_s > 0:
            raise ValueError("NicLosslessDrops: drops_per_s must be > 0")
