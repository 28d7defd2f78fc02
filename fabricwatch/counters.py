"""The counter vocabulary: which source names fabricwatch interprets, their width and unit.

Collectors send counters under the names their source uses (sysfs file, `ethtool -S`
key, NVML field, normalised gNMI leaf); this module says how to turn each raw total into
a rate. It imports nothing from the project, so every layer may use it.

Three ways a raw total misbehaves, and what each `CounterSpec` says about it:

* **wrap**: a W-bit counter restarts at 0 after 2**W - 1 (mlx5 q-counters are 32-bit in
  hardware, read with ``be32_to_cpu``: ``out_of_sequence``, ``packet_seq_err`` and the other
  sequence-error counters wrap). 64-bit totals never wrap in a cluster's life.
* **saturate**: the IB PMA **PortCounters** attribute "shall stop at all ones" instead of
  overflowing (IBA 1.8 §16.1.3.5): the 32-bit ``PortXmitWait``, the 16-bit
  ``SymbolErrorCounter``/``PortRcvErrors``/``PortXmitDiscards``..., the 8-bit
  ``LinkDownedCounter``/``LinkErrorRecoveryCounter`` and the 4-bit integrity/overrun
  counters. Pinned at all-ones the value means ">= that": its rate is *unknown* (NaN in
  `models.rates`), never zero, until the counter is cleared (``perfquery -R``) or reset.
  Data and packet counters come from **PortCountersExtended** (64-bit): mlx5 always
  advertises ``IB_PMA_CLASS_CAP_EXT_WIDTH`` (linux ``hw/mlx5/mad.c``, ``core/sysfs.c
  get_counter_table``), so on mlx5 they never saturate.
* **reset**: every counter restarts from 0 when its device restarts (node reboot, driver
  reload, switch reboot or ``sonic-clear counters``); a decrease that is no plausible wrap
  is a reset: no rate for that interval.

Sources per group: ``Documentation/ABI/stable/sysfs-class-infiniband`` (``counters/``: PMA
PortCounters, ``hw_counters/``: driver counters, ``%llu``), linux
``drivers/infiniband/hw/mlx5/counters.c`` (q-counters 32-bit, congestion counters 64-bit),
``Documentation/networking/device_drivers/ethernet/mellanox/mlx5/counters.rst`` (``ethtool
-S``: 64-bit software totals; ``*_pause_duration`` in microseconds), SAI ``saiport.h``
(``SAI_PORT_STAT_*``: uint64; ``PFC_x_RX/TX_PAUSE_DURATION_US`` "duration in micro seconds
converted from quanta" of the pause frames received / sent by the switch), OpenConfig
``counter64`` leaves, NVML (64-bit totals). docs/schema.md has the table.
"""
from __future__ import annotations

from dataclasses import dataclass
from enum import Enum


class Overflow(Enum):
    WRAP = "wrap"
    SATURATE = "saturate"


@dataclass(frozen=True)
class CounterSpec:
    name: str
    width_bits: int
    overflow: Overflow
    unit: str           # unit of the raw total, as the source counts
    scale: float = 1.0  # multiply a delta by this to get `rate_unit` per second
    rate_unit: str = ""


def _spec(name: str, width: int, overflow: Overflow, unit: str, scale: float = 1.0, rate_unit: str = "") -> CounterSpec:
    return CounterSpec(name, width, overflow, unit, scale, rate_unit or f"{unit}/s")


W, S = Overflow.WRAP, Overflow.SATURATE
PFC_PRIORITIES = range(8)

# IB PMA counters in /sys/class/infiniband/<dev>/ports/<n>/counters (widths as on mlx5,
# which always answers with PortCountersExtended for data and packets). PortCounters
# saturate (IBA 1.8 §16.1.3.5 "stop at all ones"), PortXmitWait included: 32-bit, and at
# ~8 ticks/us of waiting a busy port pins it within hours.
_SYSFS = [
    _spec("port_xmit_data", 64, W, "4-byte words", 4.0, "bytes/s"),
    _spec("port_rcv_data", 64, W, "4-byte words", 4.0, "bytes/s"),
    _spec("port_xmit_packets", 64, W, "packets"),
    _spec("port_rcv_packets", 64, W, "packets"),
    _spec("port_xmit_wait", 32, S, "ticks"),
    _spec("symbol_error", 16, S, "errors"),
    _spec("port_rcv_errors", 16, S, "errors"),
    _spec("port_xmit_discards", 16, S, "packets"),
    _spec("port_rcv_remote_physical_errors", 16, S, "errors"),
    _spec("port_rcv_switch_relay_errors", 16, S, "errors"),
    _spec("VL15_dropped", 16, S, "packets"),
    _spec("port_xmit_constraint_errors", 8, S, "packets"),
    _spec("port_rcv_constraint_errors", 8, S, "packets"),
    _spec("link_error_recovery", 8, S, "events"),
    _spec("link_downed", 8, S, "events"),
    _spec("local_link_integrity_errors", 4, S, "errors"),
    _spec("excessive_buffer_overrun_errors", 4, S, "errors"),
]
# mlx5 hw_counters (counters.c): q-counters are 32-bit in hardware and wrap (the driver
# reads them with be32_to_cpu and prints %llu); congestion counters are 64-bit.
_HW = [
    _spec("out_of_buffer", 32, W, "packets"),
    _spec("out_of_sequence", 32, W, "packets"),
    _spec("packet_seq_err", 32, W, "packets"),
    _spec("local_ack_timeout_err", 32, W, "events"),
    _spec("np_cnp_sent", 64, W, "packets"),
    _spec("np_ecn_marked_roce_packets", 64, W, "packets"),
    _spec("rp_cnp_handled", 64, W, "packets"),
]
# `ethtool -S` on mlx5 (counters.rst: 64-bit software totals accumulated by the driver).
_ETHTOOL = [
    _spec("tx_pause_storm_warning_events", 64, W, "events"),
    _spec("tx_pause_storm_error_events", 64, W, "events"),
    _spec("link_down_events_phy", 64, W, "events"),
    _spec("rx_symbol_err_phy", 64, W, "errors"),
    _spec("rx_pcs_symbol_err_phy", 64, W, "errors"),
    _spec("rx_corrected_bits_phy", 64, W, "bits"),
    _spec("rx_bits_phy", 64, W, "bits"),
    _spec("rx_discards_phy", 64, W, "packets"),
    _spec("rx_crc_errors_phy", 64, W, "packets"),
]
for _p in PFC_PRIORITIES:
    _ETHTOOL += [
        _spec(f"rx_prio{_p}_pause", 64, W, "frames"),
        _spec(f"tx_prio{_p}_pause", 64, W, "frames"),
        # microseconds paused; as a rate: paused seconds per second, i.e. the pause duty
        _spec(f"rx_prio{_p}_pause_duration", 64, W, "us", 1e-6, "s/s"),
        _spec(f"tx_prio{_p}_pause_duration", 64, W, "us", 1e-6, "s/s"),
        _spec(f"rx_prio{_p}_pause_transition", 64, W, "transitions"),
        _spec(f"rx_prio{_p}_bytes", 64, W, "bytes"),
        _spec(f"tx_prio{_p}_bytes", 64, W, "bytes"),
        _spec(f"rx_prio{_p}_packets", 64, W, "packets"),
        _spec(f"tx_prio{_p}_packets", 64, W, "packets"),
    ]
# Switch ports, normalised by the switch collector from OpenConfig (counter64) and vendor
# PFC paths (SAI port stats are uint64).
_SWITCH = [
    _spec("in-octets", 64, W, "bytes"),
    _spec("out-octets", 64, W, "bytes"),
    _spec("in-pkts", 64, W, "packets"),
    _spec("out-pkts", 64, W, "packets"),
    _spec("in-errors", 64, W, "packets"),
    _spec("out-errors", 64, W, "packets"),
    _spec("in-discards", 64, W, "packets"),
    _spec("out-discards", 64, W, "packets"),
    _spec("interface-transitions", 64, W, "transitions"),
]
for _p in PFC_PRIORITIES:
    _SWITCH += [
        _spec(f"pfc{_p}-rx-pkts", 64, W, "frames"),
        _spec(f"pfc{_p}-tx-pkts", 64, W, "frames"),
        _spec(f"pfc{_p}-rx-pause-duration-us", 64, W, "us", 1e-6, "s/s"),
        # SAI_PORT_STAT_PFC_x_TX_PAUSE_DURATION_US: pauses the switch *sends* (SONiC)
        _spec(f"pfc{_p}-tx-pause-duration-us", 64, W, "us", 1e-6, "s/s"),
        _spec(f"queue{_p}-transmit-pkts", 64, W, "packets"),
        _spec(f"queue{_p}-transmit-octets", 64, W, "bytes"),
    ]
# ---- ECN marks and drops per queue / priority (ecn_pfc_misorder, lossless_drop; issue 15) ----
# Switch egress queues: SONiC COUNTERS_DB SAI_QUEUE_STAT_WRED_ECN_MARKED_PACKETS and
# SAI_QUEUE_STAT_DROPPED_PACKETS (uint64), OpenConfig qos ``dropped-pkts`` (counter64),
# Cumulus ``ecn-marked-pkts`` / ``no-buffer-uc-dropped-pkts`` / ``wred-dropped-pkts``.
# NIC: mlx5 ``ethtool -S`` per-priority receive discards and marks (64-bit software totals).
for _p in PFC_PRIORITIES:
    _SWITCH += [
        _spec(f"queue{_p}-ecn-marked-pkts", 64, W, "packets"),
        _spec(f"queue{_p}-dropped-pkts", 64, W, "packets"),
        _spec(f"queue{_p}-no-buffer-dropped-pkts", 64, W, "packets"),
        _spec(f"queue{_p}-wred-dropped-pkts", 64, W, "packets"),
    ]
    _ETHTOOL += [
        _spec(f"rx_prio{_p}_buf_discard", 64, W, "packets"),
        _spec(f"rx_prio{_p}_cong_discard", 64, W, "packets"),
        _spec(f"rx_prio{_p}_discards", 64, W, "packets"),
        _spec(f"rx_prio{_p}_marked", 64, W, "packets"),
    ]
# ---- end ECN marks and drops ------------------------------------------------------------------
# ---- FEC (link_down helper, issue #14) ------------------------------------------------------
# Forward error correction, IEEE 802.3 30.5.1.1.17/18 aFECCorrectedBlocks /
# aFECUncorrectableBlocks. Switch: SAI port stats as SONiC's COUNTERS_DB names them
# (SAI_PORT_STAT_IF_IN_FEC_CORRECTABLE_FRAMES, _NOT_CORRECTABLE_FRAMES, _SYMBOL_ERRORS).
# NIC: mlx5 `ethtool -S` per-lane pre-FEC errors (rx_corrected_bits_phy, rx_bits_phy and
# rx_pcs_symbol_err_phy, the post-FEC symbol errors, are in _ETHTOOL above).
_FEC = [
    _spec("in-fec-correctable-frames", 64, W, "codewords"),
    _spec("in-fec-uncorrectable-frames", 64, W, "codewords"),
    _spec("in-fec-symbol-errors", 64, W, "symbols"),
] + [_spec(f"rx_err_lane_{_lane}_phy", 64, W, "errors") for _lane in range(8)]
# ---- end FEC ----------------------------------------------------------------------------------
# GPUs through NVML.
_GPU = [
    _spec("ecc_corrected_volatile_total", 64, W, "errors"),
    _spec("ecc_uncorrected_volatile_total", 64, W, "errors"),
    _spec("pcie_replay_total", 64, W, "events"),
    _spec("energy_mj", 64, W, "mJ", 1e-3, "W"),
    _spec("nvlink_crc_flit_errors_total", 64, W, "errors"),
]

KNOWN: dict[str, CounterSpec] = {s.name: s for s in _SYSFS + _HW + _ETHTOOL + _SWITCH + _FEC + _GPU}


def spec_for(name: str) -> CounterSpec:
    """The spec of a counter; unknown names are treated as 64-bit wrapping totals."""
    return KNOWN.get(name) or CounterSpec(name, 64, Overflow.WRAP, "count", 1.0, "count/s")


# Gauges interpreted by the models (NaN = not read this tick).
GPU_GAUGES = (
    "utilization_gpu_pct",
    "sm_clock_mhz",
    "sm_clock_max_mhz",
    "clocks_event_reasons",  # NVML bitmask, exact in a double
    "power_mw",
    "temperature_c",
    "pcie_gen_current",
    "pcie_gen_max",
    "pcie_width_current",
    "pcie_width_max",
    "remapped_rows_correctable",
    "remapped_rows_uncorrectable",
)
NIC_GAUGES = (
    "netdev_speed_mbps",     # /sys/class/net/<if>/speed; -1 without carrier
    "pcie_width_current",    # /sys/bus/pci/devices/<bdf>/current_link_width
    "pcie_width_max",
    "pcie_gen_current",      # parsed from current_link_speed ("32.0 GT/s PCIe" -> 5)
    "pcie_gen_max",
)
SWITCH_GAUGES = (
    "port_speed_gbps",       # from OpenConfig port-speed identityref (SPEED_400GB -> 400)
    "oper_up",               # 1 when oper-status is UP
    "admin_up",
)
# Labels: strings read as-is.
NIC_LABELS = ("rate", "state", "phys_state", "link_layer", "netdev", "pci_bdf")
