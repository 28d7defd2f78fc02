"""The counters and gauges each simulated block carries, in column order, and the matrices of raw totals.

The column orders are the snapshots' (`encoding`) and index the simulator's state: one
`_Counters` matrix per entity kind (NIC ports, GPUs, switch ports), uint64 totals that wrap
or saturate as each counter's width says (`fabricwatch.counters`). ``_NC``, ``_GC`` and
``_SC`` map a counter's name to its column.

>>> c = _Counters(("symbol_error",), rows=1)     # a 16-bit IB error counter saturates
>>> c.add(np.array([[70_000.0]]))
>>> int(c.values[0, 0])
65535
"""
from __future__ import annotations

import re

import numpy as np

from fabricwatch.counters import SWITCH_GAUGES, Overflow, spec_for


# Column order of each block (names exactly as fabricwatch.counters knows them).
NIC_COUNTERS = (
    "port_xmit_data", "port_rcv_data", "port_xmit_packets", "port_rcv_packets", "port_xmit_wait",
    "symbol_error", "port_rcv_errors", "link_downed", "link_error_recovery",
    "out_of_sequence", "np_cnp_sent", "np_ecn_marked_roce_packets", "rp_cnp_handled",
    "rx_prio3_pause", "tx_prio3_pause", "rx_prio3_pause_duration", "tx_prio3_pause_duration",
    "rx_prio3_bytes", "tx_prio3_bytes", "rx_prio3_packets", "tx_prio3_packets",
    "tx_pause_storm_warning_events", "tx_pause_storm_error_events", "link_down_events_phy",
    "rx_corrected_bits_phy", "rx_bits_phy", "rx_pcs_symbol_err_phy",
)
# Receive discards on lossless priority 3 (mlx5 ethtool -S, the slow group): lossless_drop reads them.
NIC_QUEUE_COUNTERS = ("rx_prio3_buf_discard",)
NIC_COUNTERS = NIC_COUNTERS + NIC_QUEUE_COUNTERS
GPU_COUNTERS = ("ecc_corrected_volatile_total", "ecc_uncorrected_volatile_total", "pcie_replay_total", "energy_mj")
SWITCH_COUNTERS = (
    "in-octets", "out-octets", "in-pkts", "out-pkts", "in-errors", "in-discards", "out-discards",
    "interface-transitions", "pfc3-rx-pkts", "pfc3-tx-pkts", "pfc3-rx-pause-duration-us",
    "queue3-transmit-pkts", "queue3-transmit-octets",
)
# FEC codewords per switch port (SONiC's SAI names, normalised): a healthy link corrects
# codewords all the time and loses none.
SWITCH_FEC_COUNTERS = ("in-fec-correctable-frames", "in-fec-uncorrectable-frames")
SWITCH_COUNTERS = SWITCH_COUNTERS + SWITCH_FEC_COUNTERS
# Egress-queue ECN marks and drops (SONiC SAI queue stats, normalised): queue 3 is lossless
# (PFC), queue 0 lossy best effort; issue 15's ecn_pfc_misorder and lossless_drop read them.
SWITCH_QUEUE_COUNTERS = ("queue3-ecn-marked-pkts", "queue3-dropped-pkts", "queue0-dropped-pkts")
SWITCH_COUNTERS = SWITCH_COUNTERS + SWITCH_QUEUE_COUNTERS
SWITCH_PORT_GAUGES = tuple(SWITCH_GAUGES) + ("queue3-occupancy-bytes",)
# SAI_PORT_STAT_PFC_3_TX_PAUSE_DURATION_US: SONiC exports it, EOS and Cumulus do not; the
# simulator counts it always and exports it with ``switch_tx_pause_duration=True``.
SWITCH_TX_PAUSE_DURATION = "pfc3-tx-pause-duration-us"
_SWITCH_ALL = SWITCH_COUNTERS + (SWITCH_TX_PAUSE_DURATION,)

# The node collector's fast (PFC) group of ethtool -S, as `collectors.ethtool_stats.FAST_PATTERNS`
# keeps it, in NIC_COUNTERS order; the 1 s tick carries the other NIC counters.
NIC_PFC_COUNTERS = tuple(n for n in NIC_COUNTERS if re.fullmatch(
    r"(rx|tx)_prio[0-7]_(pause|pause_duration|bytes|packets)|rx_prio[0-7]_pause_transition"
    r"|tx_pause_storm_(warning|error)_events", n))
NIC_FULL_COUNTERS = tuple(n for n in NIC_COUNTERS if n not in NIC_PFC_COUNTERS)
NIC_PFC_GAUGES = ("netdev_speed_mbps",)

_NC = {n: i for i, n in enumerate(NIC_COUNTERS)}
_GC = {n: i for i, n in enumerate(GPU_COUNTERS)}
_SC = {n: i for i, n in enumerate(_SWITCH_ALL)}


class _Counters:
    """A (rows, columns) uint64 matrix of raw totals honouring each column's width/overflow."""

    def __init__(self, names: tuple[str, ...], rows: int) -> None:
        self.values = np.zeros((rows, len(names)), dtype=np.uint64)
        specs = [spec_for(n) for n in names]
        self._wrap = [(i, np.uint64((1 << s.width_bits) - 1)) for i, s in enumerate(specs)
                      if s.overflow is Overflow.WRAP and s.width_bits < 64]
        self._sat = [(i, np.uint64((1 << s.width_bits) - 1)) for i, s in enumerate(specs)
                     if s.overflow is Overflow.SATURATE]

    def clamp(self) -> None:
        v = self.values
        for i, m in self._wrap:
            v[:, i] &= m
        for i, m in self._sat:
            np.minimum(v[:, i], m, out=v[:, i])

    def add(self, inc: np.ndarray, rows: np.ndarray | None = None) -> None:
        inc = np.rint(np.clip(np.nan_to_num(inc, nan=0.0, posinf=0.0), 0.0, 1.8e19)).astype(np.uint64)
        if rows is None:
            self.values += inc
        else:
            self.values[rows] += inc[rows]
        self.clamp()
