"""Parse the link-rate strings that sysfs and OpenConfig report.

The sysfs `rate` of an RDMA port is ``"%d%s Gb/sec (%dX%s)"``: speed, then lane count and
lane generation. A 400G port that falls from 4 NDR lanes to 8 HDR lanes still reads 400,
so a downgrade check must compare the width too, not only the number.

>>> parse_ib_rate("400 Gb/sec (4X NDR)")
IbRate(gbps=400.0, width=4, lane='NDR')
>>> parse_ib_rate("2.5 Gb/sec (1X)")       # old kernels print SDR with no suffix
IbRate(gbps=2.5, width=1, lane='SDR')
>>> parse_openconfig_speed("openconfig-if-ethernet:SPEED_400GB")
400.0
>>> pcie_gen_from_speed("32.0 GT/s PCIe"), pcie_gen_from_speed("8 GT/s")
(5, 3)
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from functools import lru_cache

_IB_RATE = re.compile(r"^\s*(\d+(?:\.\d+)?) Gb/sec \((\d+)X(?: ?([A-Z0-9]+))?\)\s*$")
_OC_SPEED = re.compile(r"SPEED_(\d+(?:\.\d+)?)(MB|GB)$")
_PCIE_GTS_TO_GEN = {2.5: 1, 5.0: 2, 8.0: 3, 16.0: 4, 32.0: 5, 64.0: 6}


@dataclass(frozen=True)
class IbRate:
    gbps: float
    width: int   # lanes
    lane: str    # SDR, DDR, QDR, FDR10, FDR, EDR, HDR, NDR, XDR


@lru_cache(maxsize=1024)   # a fleet reports a handful of distinct strings, every tick
def parse_ib_rate(text: str) -> IbRate | None:
    """The sysfs `rate` string as (Gb/s, lanes, lane generation); None if unparseable."""
    m = _IB_RATE.match(text or "")
    if not m:
        return None
    return IbRate(float(m.group(1)), int(m.group(2)), m.group(3) or "SDR")


def parse_openconfig_speed(text: str) -> float | None:
    """OpenConfig `port-speed` identityref (``SPEED_400GB``) in Gb/s; None if unknown."""
    m = _OC_SPEED.search(text or "")
    if not m:
        return None
    value = float(m.group(1))
    return value / 1000.0 if m.group(2) == "MB" else value


def pcie_gen_from_speed(text: str) -> int | None:
    """PCIe generation from a sysfs link speed ("16.0 GT/s PCIe", or "8 GT/s" on old kernels)."""
    m = re.match(r"^\s*(\d+(?:\.\d+)?) GT/s", text or "")
    return _PCIE_GTS_TO_GEN.get(float(m.group(1))) if m else None
