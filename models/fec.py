"""FEC health of a link, remembered per port as evidence for the link findings.

Corrected codewords are normal: the FEC is doing its job. RS(544,514) ("KP4", the FEC of
200G/400G/800G PAM4 Ethernet and of HDR/NDR InfiniBand) corrects a pre-FEC bit error ratio
up to 2.4e-4 (IEEE 802.3 clause 120/121 link budget) to a negligible frame loss, so a
healthy link counts corrected codewords all day. A codeword the FEC could *not* correct on
an up link is not normal: it is a lost frame, and sonic-mgmt's
``test_verify_fec_stats_counters`` fails a port on any. Counters read
(`fabricwatch.counters`):

* NIC (mlx5 ``ethtool -S``): ``rx_pcs_symbol_err_phy`` (symbol errors that FEC did not
  correct), pre-FEC BER = ``rx_corrected_bits_phy / rx_bits_phy``;
* switch (SAI, SONiC COUNTERS_DB): ``in-fec-uncorrectable-frames``
  (``SAI_PORT_STAT_IF_IN_FEC_NOT_CORRECTABLE_FRAMES``), IEEE 802.3 30.5.1.1.18
  aFECUncorrectableBlocks.

What a port showed within ``FEC_MEMORY_S`` is kept (only ports with something to show
cost memory) and given as `Evidence` on a `link_down`, `link_flap` or `link_downgrade` of
that port: a link that dies, flaps or retrains slower after losing codewords suffers from
its cable or optics. No finding is made on FEC alone. The stage's link detectors share one
memory; each notes every record, and a record is noted once.

>>> import numpy as np
>>> from fabricwatch.models.frames import FrameStack, SourceBatch
>>> s = FrameStack("nic_port", ("mlx5_0/1",), ("rx_pcs_symbol_err_phy",), (), np.array([0]),
...                np.zeros((1, 1, 1), np.uint64), np.empty((1, 1, 0)))
>>> s.rates, s.dt_s = np.array([[[3.0]]]), np.array([1.0])
>>> fec = FecMemory()
>>> fec.note(SourceBatch("c1", "node-1", "node", np.array([5_000_000_000]), [s]))
>>> [(e.name, e.value) for e in fec.evidence("node-1", "mlx5_0/1", 6_000_000_000)]
[('fec_uncorrectable', 3.0)]
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from .findings import Evidence
from .frames import FrameStack, SourceBatch

# Counters of codewords (or symbols) the FEC could not correct, NIC and switch names.
UNCORRECTABLE_COUNTERS = ("rx_pcs_symbol_err_phy", "in-fec-uncorrectable-frames")
# The KP4 RS(544,514) correction limit (IEEE 802.3 400GBASE-R link budget): above it the FEC
# starts to lose frames.
PRE_FEC_BER_LIMIT = 2.4e-4
# Errors this long before a link finding are its evidence (a failing transceiver loses
# codewords for minutes before the link drops).
FEC_MEMORY_S = 600.0
# Ports remembered at most (bounded state; the oldest go first).
MAX_PORTS = 100_000
MAX_LAYOUTS = 4096

# counter names of a block layout -> (uncorrectable columns, corrected-bits column, bits column)
_LAYOUTS: dict[tuple[str, ...], tuple[list[int], int | None, int | None]] = {}


def _layout(names: tuple[str, ...]) -> tuple[list[int], int | None, int | None]:
    cols = [j for j, n in enumerate(names) if n in UNCORRECTABLE_COUNTERS]
    corrected = names.index("rx_corrected_bits_phy") if "rx_corrected_bits_phy" in names else None
    bits = names.index("rx_bits_phy") if "rx_bits_phy" in names else None
    return cols, (corrected if bits is not None else None), bits


@dataclass
class _Seen:
    uncorrectable: float = 0.0
    worst_ber: float = 0.0
    last_ns: int = 0


@dataclass
class FecMemory:
    """Per port: uncorrectable codewords and the worst pre-FEC BER seen recently."""
    memory_s: float = FEC_MEMORY_S
    _ports: dict[tuple[str, str], _Seen] = field(default_factory=dict, repr=False)
    _noted_ns: dict[str, int] = field(default_factory=dict, repr=False)   # source -> newest tick noted

    def note(self, batch: SourceBatch) -> None:
        """Remember what the ticks of ``batch`` carry (a few array operations per stack). The
        detectors that share one memory each call it; a record is noted once."""
        newest = int(batch.times_ns[-1])
        if self._noted_ns.get(batch.source, newest - 1) >= newest:
            return
        self._noted_ns[batch.source] = newest
        for stack in batch.stacks:
            if stack.rates is not None and stack.dt_s is not None:
                self._note(batch.source, stack)

    def _note(self, source: str, stack: FrameStack) -> None:
        layout = _LAYOUTS.get(stack.counter_names)
        if layout is None:
            if len(_LAYOUTS) >= MAX_LAYOUTS:
                _LAYOUTS.clear()
            layout = _LAYOUTS[stack.counter_names] = _layout(stack.counter_names)
        cols, corrected, bits = layout
        if not cols and corrected is None:
            return                                   # a layout without FEC counters (PFC-only ticks)
        rates = stack.rates
        lost = rates[:, :, cols].sum(axis=2) * stack.dt_s[:, None] if cols else None
        hit = lost > 0 if lost is not None else np.zeros(rates.shape[:2], dtype=bool)   # NaN compares False
        if corrected is not None:
            hit |= rates[:, :, corrected] > PRE_FEC_BER_LIMIT * rates[:, :, bits]
        if not hit.any():
            return
        for k, i in zip(*np.nonzero(hit)):
            key = (source, stack.ids[i])
            seen = self._ports.get(key)
            now = int(stack.times_ns[k]) if stack.times_ns is not None else 0
            if seen is None or now - seen.last_ns > self.memory_s * 1e9:
                if seen is None and len(self._ports) >= MAX_PORTS:
                    self._ports.pop(next(iter(self._ports)))
                seen = self._ports[key] = _Seen()
            if lost is not None and lost[k, i] > 0:
                seen.uncorrectable += float(lost[k, i])
            if corrected is not None and rates[k, i, bits] > 0:
                seen.worst_ber = max(seen.worst_ber, float(rates[k, i, corrected] / rates[k, i, bits]))
            seen.last_ns = now

    def evidence(self, source: str, entity_id: str, now_ns: int) -> list[Evidence]:
        """What the port showed within the memory before ``now_ns`` (empty when nothing)."""
        seen = self._ports.get((source, entity_id))
        if seen is None or now_ns - seen.last_ns > self.memory_s * 1e9:
            return []
        out = []
        if seen.uncorrectable > 0:
            out.append(Evidence("fec_uncorrectable", round(seen.uncorrectable, 3), 0, "codewords",
                                f"codewords FEC could not correct within {self.memory_s:g} s: the cable or optics "
                                "was failing"))
        if seen.worst_ber > PRE_FEC_BER_LIMIT:
            out.append(Evidence("pre_fec_ber", seen.worst_ber, PRE_FEC_BER_LIMIT, "ratio",
                                "pre-FEC bit error ratio above the KP4 FEC's correction limit"))
        return out
