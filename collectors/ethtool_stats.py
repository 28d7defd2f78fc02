"""``ethtool -S`` statistics through the SIOCETHTOOL ioctl, and a parser for its text output.

Reading (no subprocess per sample): on an ``AF_INET`` datagram socket,

1. ``ETHTOOL_GSSET_INFO`` with ``ETH_SS_STATS`` gives the number of statistics;
2. ``ETHTOOL_GSTRINGS`` (``ETH_SS_STATS``) their names, 32 bytes each; fetched once per
   interface and again whenever the count changes (mlx5 adds per-channel statistics when
   channels are added);
3. ``ETHTOOL_GSTATS`` the values, one ``u64`` each, in the same order.

The kernel writes as many values as the driver has *now*, whatever size the caller
announced, so the count is checked before every ``GSTATS`` and the buffer has headroom; a
reply whose count differs from the names' is dropped and the names fetched again.

Only the names fabricwatch interprets are kept (docs/schema.md), in two groups:

* **fast** (the PFC interval, 100 ms by default): ``rx/tx_prio<p>_pause``,
  ``rx/tx_prio<p>_pause_duration`` (µs), ``rx_prio<p>_pause_transition``,
  ``rx/tx_prio<p>_bytes``, ``rx/tx_prio<p>_packets``, ``tx_pause_storm_warning_events``,
  ``tx_pause_storm_error_events``;
* **slow** (1 s): phy and buffer health: ``link_down_events_phy``, ``rx_symbol_err_phy``,
  ``rx_pcs_symbol_err_phy``, ``rx_corrected_bits_phy``, ``rx_bits_phy``,
  ``rx_err_lane_<l>_phy``, ``rx_crc_errors_phy``, ``rx_discards_phy``, ``tx_discards_phy``,
  ``rx_buffer_passed_thres_phy``, ``rx/tx_pause_ctrl_phy``, ``rx_prio<p>_discards``,
  ``rx_prio<p>_buf_discard``, ``rx_prio<p>_cong_discard``, ``rx_prio<p>_marked``,
  ``rx_out_of_buffer``, ``rx/tx_pci_signal_integrity``, ``outbound_pci_buffer_overflow``;

plus configurable allow-lists of exact names or ``fnmatch`` globs (``allow`` joins the slow
group, ``allow_fast`` the fast one). On mlx5 the ``*_prio<p>_pause*`` names exist only for
priorities with PFC enabled.

>>> stats = parse_ethtool_s("NIC statistics:\\n     rx_prio3_pause: 123\\n     tx_bytes: 9\\n")
>>> stats
{'rx_prio3_pause': 123, 'tx_bytes': 9}
>>> EthtoolFilter().select(stats, "fast")
{'rx_prio3_pause': 123}
"""
from __future__ import annotations

import array
import ctypes
import errno
import fcntl
import fnmatch
import logging
import operator
import os
import re
import shutil
import socket
import struct
import subprocess
from collections.abc import Iterable

from .sysfs_nic import Problems

log = logging.getLogger("fabricwatch.collectors.ethtool")

# include/uapi/linux/sockios.h, include/uapi/linux/ethtool.h
SIOCETHTOOL = 0x8946
ETHTOOL_GSTRINGS = 0x0000001B
ETHTOOL_GSTATS = 0x0000001D
ETHTOOL_GSSET_INFO = 0x00000037
ETH_SS_STATS = 1
ETH_GSTRING_LEN = 32
IFNAMSIZ = 16
_IFREQ_SIZE = 40               # struct ifreq on 64-bit Linux: 16-byte name + 24-byte union
# Values read beyond the announced count are tolerated up to this headroom (statistics added
# between GSSET_INFO and GSTATS), so the kernel never writes past our buffer.
_HEADROOM = 1024

FAST_PATTERNS = (
    r"(rx|tx)_prio[0-7]_pause",
    r"(rx|tx)_prio[0-7]_pause_duration",
    r"rx_prio[0-7]_pause_transition",
    r"(rx|tx)_prio[0-7]_(bytes|packets)",
    r"tx_pause_storm_(warning|error)_events",
)
SLOW_PATTERNS = (
    r"link_down_events_phy",
    r"rx_(symbol_err|pcs_symbol_err|corrected_bits|bits|crc_errors|discards)_phy",
    r"rx_err_lane_[0-9]+_phy",
    r"tx_discards_phy",
    r"rx_buffer_passed_thres_phy",
    r"(rx|tx)_pause_ctrl_phy",
    r"rx_prio[0-7]_(discards|buf_discard|cong_discard|marked)",
    r"rx_out_of_buffer",
    r"(rx|tx)_pci_signal_integrity",
    r"outbound_pci_buffer_overflow",
)


class EthtoolError(OSError):
    """An interface whose statistics cannot be read (errno as the kernel answered)."""


# --------------------------------------------------------------------------- text output
def parse_ethtool_s(text: str) -> dict[str, int]:
    """``ethtool -S <if>`` output -> {name: value}; lines that are not ``name: integer`` are skipped.

    ethtool prints each statistic as ``"     %.*s: %llu"`` under a ``NIC statistics:`` header.
    """
    out: dict[str, int] = {}
    for line in text.splitlines():
        name, sep, value = line.strip().rpartition(": ")
        if not sep or not name:
            continue
        try:
            out[name] = int(value)
        except ValueError:
            continue
    return out


# --------------------------------------------------------------------------- the ioctl
class IoctlSource:
    """Statistics of any interface of this network namespace through SIOCETHTOOL.

    The request buffers and their ``ifreq`` are made once per interface and reused: the
    PFC source makes two ioctls per port every 100 ms.
    """

    def __init__(self) -> None:
        self._sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        self._fd = self._sock.fileno()
        self._count_requests: dict[str, tuple[ctypes.Array, bytes]] = {}
        # ifname -> (buffer, its ifreq, capacity in values, the buffer as bytes)
        self._buffers: dict[str, tuple[ctypes.Array, bytes, int, memoryview]] = {}

    def close(self) -> None:
        self._sock.close()

    @staticmethod
    def _ifreq(ifname: str, buf: ctypes.Array) -> bytes:
        """``struct ifreq`` naming the interface, its data pointer at ``buf`` (kept alive by the caller)."""
        name = ifname.encode()
        if len(name) >= IFNAMSIZ:
            raise EthtoolError(errno.ENODEV, f"interface name too long: {ifname!r}")
        return struct.pack(f"{IFNAMSIZ}sP", name, ctypes.addressof(buf)).ljust(_IFREQ_SIZE, b"\0")

    def count(self, ifname: str) -> int:
        # struct ethtool_sset_info { u32 cmd; u32 reserved; u64 sset_mask; u32 data[]; }
        request = self._count_requests.get(ifname)
        if request is None:
            buf = ctypes.create_string_buffer(24)
            request = self._count_requests[ifname] = (buf, self._ifreq(ifname, buf))
        buf, ifreq = request
        struct.pack_into("=IIQI", buf, 0, ETHTOOL_GSSET_INFO, 0, 1 << ETH_SS_STATS, 0)   # the kernel rewrites the mask
        fcntl.ioctl(self._fd, SIOCETHTOOL, ifreq)
        _, _, mask, n = struct.unpack_from("=IIQI", buf)
        return n if mask & (1 << ETH_SS_STATS) else 0

    def names(self, ifname: str, n: int) -> list[str]:
        # struct ethtool_gstrings { u32 cmd; u32 string_set; u32 len; u8 data[]; }
        size = 12 + (n + _HEADROOM) * ETH_GSTRING_LEN
        buf = ctypes.create_string_buffer(struct.pack("=III", ETHTOOL_GSTRINGS, ETH_SS_STATS, n), size)
        fcntl.ioctl(self._fd, SIOCETHTOOL, self._ifreq(ifname, buf))
        got = struct.unpack_from("=I", buf.raw, 8)[0]
        raw = buf.raw[12:12 + got * ETH_GSTRING_LEN]
        return [raw[i:i + ETH_GSTRING_LEN].split(b"\0", 1)[0].decode("ascii", "replace")
                for i in range(0, len(raw), ETH_GSTRING_LEN)]

    def values(self, ifname: str, n: int) -> tuple[int, memoryview]:
        """(count the kernel wrote, the u64 values) from one ETHTOOL_GSTATS."""
        # struct ethtool_stats { u32 cmd; u32 n_stats; u64 data[]; }
        entry = self._buffers.get(ifname)
        if entry is None or entry[2] < n + _HEADROOM:
            capacity = n + _HEADROOM
            buf = ctypes.create_string_buffer(8 + capacity * 8)
            entry = self._buffers[ifname] = (buf, self._ifreq(ifname, buf), capacity, memoryview(buf).cast("B"))
        buf, ifreq, capacity, view = entry
        struct.pack_into("=II", buf, 0, ETHTOOL_GSTATS, n)
        fcntl.ioctl(self._fd, SIOCETHTOOL, ifreq)
        got = struct.unpack_from("=I", buf, 4)[0]
        return got, view[8:8 + 8 * min(got, capacity)].cast("Q")


class RecordedSource:
    """``ethtool -S`` text files as a statistics source (tests, the overhead bench, demos).

    ``files`` is a directory, where ``<ifname>.txt`` is read when present and else
    ``default.txt``, or a mapping {ifname: file}. Each file is parsed once.
    """

    def __init__(self, files: str | dict[str, str]) -> None:
        self.files = files
        self._cache: dict[str, tuple[list[str], array.array]] = {}

    def _path(self, ifname: str) -> str | None:
        if isinstance(self.files, dict):
            return self.files.get(ifname)
        for name in (f"{ifname}.txt", "default.txt"):
            path = os.path.join(self.files, name)
            if os.path.exists(path):
                return path
        return None

    def _load(self, ifname: str) -> tuple[list[str], array.array]:
        got = self._cache.get(ifname)
        if got is None:
            path = self._path(ifname)
            if path is None:
                raise EthtoolError(errno.ENODEV, f"no recorded statistics for {ifname} in {self.files}")
            with open(path, encoding="utf-8") as fh:
                stats = parse_ethtool_s(fh.read())
            got = self._cache[ifname] = (list(stats), array.array("Q", stats.values()))
        return got

    def count(self, ifname: str) -> int:
        return len(self._load(ifname)[0])

    def names(self, ifname: str, n: int) -> list[str]:
        return self._load(ifname)[0]

    def values(self, ifname: str, n: int) -> tuple[int, memoryview]:
        values = self._load(ifname)[1]
        return len(values), memoryview(values)

    def close(self) -> None:
        pass


class CommandSource(RecordedSource):
    """Fallback: runs ``ethtool -S <if>`` (a process per read: only where the ioctl is refused).

    ``count()`` runs it once per read; ``names()`` and ``values()`` answer from that output.
    """

    def __init__(self, binary: str = "ethtool") -> None:
        super().__init__({})
        self.binary = binary

    def count(self, ifname: str) -> int:
        proc = subprocess.run([self.binary, "-S", ifname], capture_output=True, text=True, timeout=5)
        if proc.returncode != 0:
            raise EthtoolError(errno.EIO, f"{self.binary} -S {ifname}: {proc.stderr.strip()[:200]}")
        stats = parse_ethtool_s(proc.stdout)
        self._cache[ifname] = (list(stats), array.array("Q", stats.values()))
        return len(stats)


def read_ethtool_stats(ifname: str) -> dict[str, int]:
    """Every statistic of one interface through the ioctl, as ``ethtool -S`` shows them."""
    src = IoctlSource()
    try:
        n = src.count(ifname)
        names = src.names(ifname, n)
        got, values = src.values(ifname, len(names))
        if got != len(names):
            raise EthtoolError(errno.EAGAIN, f"{ifname}: statistics changed while reading")
        return dict(zip(names, values.tolist()))
    finally:
        src.close()


# --------------------------------------------------------------------------- selection
class EthtoolFilter:
    """Which names are kept, and in which group ("fast" = the PFC interval, "slow")."""

    def __init__(self, allow: Iterable[str] = (), allow_fast: Iterable[str] = ()) -> None:
        self.allow = tuple(allow)
        self.allow_fast = tuple(allow_fast)
        self._fast = re.compile("|".join(f"(?:{p})" for p in FAST_PATTERNS) + "$")
        self._slow = re.compile("|".join(f"(?:{p})" for p in SLOW_PATTERNS) + "$")

    def group(self, name: str) -> str | None:
        if self._fast.match(name) or any(fnmatch.fnmatchcase(name, g) for g in self.allow_fast):
            return "fast"
        if self._slow.match(name) or any(fnmatch.fnmatchcase(name, g) for g in self.allow):
            return "slow"
        return None

    def select(self, stats: dict[str, int], group: str) -> dict[str, int]:
        return {k: v for k, v in stats.items() if self.group(k) == group}


class _Layout:
    """One interface's names and the positions of the kept ones, per group."""

    def __init__(self, names: list[str], flt: EthtoolFilter) -> None:
        self.n = len(names)
        self.index: dict[str, list[tuple[str, int]]] = {"fast": [], "slow": []}
        seen: set[str] = set()
        for i, name in enumerate(names):
            group = flt.group(name)
            if group and name not in seen:   # a repeated name keeps its first position
                seen.add(name)
                self.index[group].append((name, i))
        self.index["all"] = sorted(self.index["fast"] + self.index["slow"], key=lambda t: t[1])
        # the same for the columnar fast path: (names tuple, a picker that takes the kept
        # values out of the raw ones in one C call instead of a Python loop per value)
        self.columns = {g: (tuple(n for n, _ in idx), picker([i for _, i in idx])) for g, idx in self.index.items()}


def picker(positions: list[int]):
    """values -> tuple of ``values[i]`` for i in positions (itemgetter returns a bare value for one)."""
    if len(positions) >= 2:
        return operator.itemgetter(*positions)
    if positions:
        only = positions[0]
        return lambda values: (values[only],)
    return lambda values: ()


class EthtoolReader:
    """Kept ``ethtool -S`` counters of NIC interfaces, by group.

    Parameters
    ----------
    allow, allow_fast : extra names or globs to keep (slow / fast group).
    source : "auto" (the ioctl; falls back to running ``ethtool -S`` where the ioctl is
        refused as a whole), "ioctl", "command", a directory of recorded ``ethtool -S``
        text files (``<ifname>.txt`` or ``default.txt``), a mapping {ifname: file}, or a
        source object (``count``/``names``/``values``/``close``).

    Examples
    --------
    >>> import os
    >>> here = os.path.dirname(os.path.abspath(__file__))
    >>> reader = EthtoolReader(source=os.path.join(here, "..", "tests", "fixtures", "ethtool"))
    >>> fast = reader.read("mlx5_cx7", "fast")
    >>> fast["rx_prio3_pause"], fast["tx_prio3_pause_duration"]
    (123, 48211)
    """

    def __init__(self, allow: Iterable[str] = (), allow_fast: Iterable[str] = (), source="auto") -> None:
        self.filter = EthtoolFilter(allow, allow_fast)
        self.problems = Problems(log)
        self._layouts: dict[str, _Layout] = {}
        if isinstance(source, dict) or (isinstance(source, str) and source not in ("auto", "ioctl", "command")):
            self._source = RecordedSource(source)
        elif source == "command":
            self._source = CommandSource()
        elif source in ("auto", "ioctl"):
            self._source = IoctlSource()
        else:
            self._source = source
        self._auto = source == "auto"

    def close(self) -> None:
        self._source.close()

    def read(self, ifname: str, group: str = "all") -> dict[str, int] | None:
        """Kept counters of one interface ("fast", "slow" or "all"); None if unreadable."""
        try:
            try:
                return self._read(ifname, group)
            except EthtoolError as exc:
                if exc.errno != errno.EAGAIN:
                    raise
                return self._read(ifname, group)     # the layout changed: names were re-read
        except OSError as exc:
            self._layouts.pop(ifname, None)
            if self._auto and exc.errno in (errno.EPERM, errno.EACCES, errno.ENOTTY, errno.ENOSYS) \
                    and isinstance(self._source, IoctlSource) and shutil.which("ethtool"):
                log.warning("SIOCETHTOOL refused (%s); falling back to running `ethtool -S` per read "
                            "(a process per interface and tick: costly at 100 ms)", exc)
                self._source = CommandSource()
                self._auto = False
                return self.read(ifname, group)
            kind = "no_ethtool_stats" if exc.errno == errno.EOPNOTSUPP else "ethtool_error"
            self.problems.report(kind, (ifname, exc.errno), f"ethtool statistics of {ifname}: {exc}")
            return None

    def read_columns(self, ifname: str, group: str = "fast") -> tuple[tuple[str, ...], tuple[int, ...]] | None:
        """Like `read`, as (names, values): the names tuple is the same object every tick."""
        try:
            try:
                return self._read(ifname, group, columns=True)
            except EthtoolError as exc:
                if exc.errno != errno.EAGAIN:
                    raise
                return self._read(ifname, group, columns=True)
        except OSError:
            return None if self.read(ifname, group) is None else self._read(ifname, group, columns=True)

    def _read(self, ifname: str, group: str, columns: bool = False):
        src = self._source
        n = src.count(ifname)
        layout = self._layouts.get(ifname)
        if layout is None or layout.n != n:
            names = src.names(ifname, n)
            layout = self._layouts[ifname] = _Layout(names, self.filter)
            if not layout.index["all"]:
                self.problems.report("no_interpreted_stats", ifname,
                                     f"{ifname}: none of its {len(names)} ethtool statistics is interpreted",
                                     logging.INFO)
        got, values = src.values(ifname, layout.n)
        if got != layout.n:           # statistics were added or removed since the names were read
            self._layouts.pop(ifname, None)
            self.problems.counts["ethtool_layout_changed"] += 1
            raise EthtoolError(errno.EAGAIN, f"{ifname}: {got} statistics, expected {layout.n}; names re-read next time")
        if columns:
            names, pick = layout.columns[group]
            return names, pick(values)
        return {name: values[i] for name, i in layout.index[group]}
