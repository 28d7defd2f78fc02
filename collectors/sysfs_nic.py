"""RDMA NIC ports from sysfs: link state, PMA and driver counters, netdev speed, PCIe link.

What is read, per port ``<dev>/<n>`` found under ``<sys_root>/class/infiniband/<dev>/ports/<n>/``
(formats as the kernel prints them, see docs/collectors.md):

* labels, as-is: ``rate`` ("400 Gb/sec (4X NDR)"), ``state`` ("4: ACTIVE"), ``phys_state``
  ("5: LinkUp"), ``link_layer`` ("Ethernet" / "InfiniBand"), plus ``netdev`` and ``pci_bdf``;
* counters, raw totals named as the files: every file of ``counters/`` (IB PMA; on mlx5 the
  data/packet counters are 64-bit, ``port_*_data`` in 4-byte words) and of ``hw_counters/``
  (driver counters; the ``lifespan`` file is the cache time, not a counter, and is skipped);
* gauges (``fabricwatch.counters.NIC_GAUGES``): ``netdev_speed_mbps`` from
  ``<sys_root>/class/net/<netdev>/speed`` (-1 without carrier; the kernel answers EINVAL
  when the interface is admin-down: NaN), and ``pcie_{gen,width}_{current,max}`` from
  ``<sys_root>/bus/pci/devices/<bdf>/{current,max}_link_{speed,width}``.

The port's netdev is the PCI function's own netdev, ``<dev>/device/net/<if>`` (when the
function has several, the one whose ``dev_port`` is ``n - 1``): that is the interface whose
``ethtool -S`` carries the port's PFC and phy counters, even when RoCE runs over a bond.
Without one, ``ports/<n>/gid_attrs/ndevs/0`` (the netdev of GID 0; may name a bond or
VLAN) is used. The PCI address is the target of the ``<dev>/device`` link (or
``PCI_SLOT_NAME`` of ``device/uevent``).

Degrading, per file (``prometheus_client``'s process collector habit): a missing optional
counter is simply an absent column; a file that cannot be read is logged once, counted in
``NicReader.problems``, and the rest of the port is still sampled (a gauge reads NaN, a
label "", a counter column is left out). Ports whose column sets are equal share a block.

This module also holds the two small pieces every node source shares: `EntityRow` (one
entity's columns of one tick) and `rows_to_blocks` (rows -> columnar ``CounterBlock``s).
It imports nothing from ``models`` or ``streams``; protobuf is imported only when blocks
are built, so the readers run where the generated wire-format modules are absent.
"""
from __future__ import annotations

import errno
import logging
import math
import os
import time
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, field

from fabricwatch.counters import NIC_GAUGES, NIC_LABELS

log = logging.getLogger("fabricwatch.collectors.sysfs_nic")

# PCIe generation by transfer rate. A copy of models/linkrate.py's table: collectors do not
# import models. Kernels <= 5.6 print "8 GT/s" without " PCIe"; both parse.
PCIE_GEN_BY_GTS = {2.5: 1, 5.0: 2, 8.0: 3, 16.0: 4, 32.0: 5, 64.0: 6}
# Files of hw_counters/ that are not counters.
NOT_COUNTERS = frozenset({"lifespan"})
MAX_U64 = 2**64 - 1
NAN = float("nan")


# --------------------------------------------------------------------------- shared pieces
@dataclass
class EntityRow:
    """One entity's readings of one tick: raw counters, gauges (NaN = not read), labels."""

    entity_id: str
    counters: dict[str, int] = field(default_factory=dict)
    gauges: dict[str, float] = field(default_factory=dict)
    labels: dict[str, str] = field(default_factory=dict)

    def merge(self, other: EntityRow) -> None:
        """Add another source's columns of the same entity (first reading of a name wins)."""
        for mine, theirs in ((self.counters, other.counters), (self.gauges, other.gauges),
                             (self.labels, other.labels)):
            for name, value in theirs.items():
                mine.setdefault(name, value)


def rows_to_blocks(entity_kind: int, rows: Iterable[EntityRow], into=None) -> list:
    """Group rows with identical column names into columnar ``pb.CounterBlock``s, in order.

    With ``into`` (a snapshot's ``blocks`` field) the blocks are built in place there (no copy).

    >>> from fabricwatch.protos.v1 import telemetry_pb2 as pb
    >>> a = EntityRow("mlx5_0/1", {"port_xmit_data": 7}, {"netdev_speed_mbps": 400000.0}, {"rate": "400 Gb/sec (4X NDR)"})
    >>> b = EntityRow("mlx5_1/1", {"port_xmit_data": 9}, {"netdev_speed_mbps": -1.0}, {"rate": "400 Gb/sec (4X NDR)"})
    >>> [block] = rows_to_blocks(pb.ENTITY_KIND_NIC_PORT, [a, b])
    >>> list(block.entity_ids), list(block.counters), list(block.gauges)
    (['mlx5_0/1', 'mlx5_1/1'], [7, 9], [400000.0, -1.0])
    """
    from fabricwatch.protos.v1 import telemetry_pb2 as pb

    groups: dict[tuple, list[EntityRow]] = {}
    for row in rows:
        key = (tuple(row.counters), tuple(row.gauges), tuple(row.labels))
        groups.setdefault(key, []).append(row)
    blocks = []
    for (counter_names, gauge_names, label_names), members in groups.items():
        counters: list[int] = []
        gauges: list[float] = []
        for row in members:
            counters.extend(row.counters.values())
            gauges.extend(row.gauges.values())
        make = into.add if into is not None else pb.CounterBlock
        blocks.append(make(
            entity_kind=entity_kind, entity_ids=[r.entity_id for r in members], counter_names=counter_names,
            gauge_names=gauge_names, counters=counters, gauges=gauges,
            labels=[pb.LabelColumn(name=n, values=[r.labels[n] for r in members]) for n in label_names]))
    return blocks


class Problems:
    """Counts every failure by kind; logs each distinct (thing, failure) once."""

    def __init__(self, logger: logging.Logger) -> None:
        self._log = logger
        self.counts: Counter[str] = Counter()
        self._seen: set[tuple] = set()

    def report(self, kind: str, key: object, message: str, level: int = logging.WARNING) -> None:
        self.counts[kind] += 1
        if (kind, key) not in self._seen:
            self._seen.add((kind, key))
            self._log.log(level, "%s (reported once)", message)


# --------------------------------------------------------------------------- file reading
def read_text(path: str) -> str:
    """A sysfs attribute, newline stripped. Raises OSError as the kernel answers."""
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        return os.read(fd, 4096).decode("utf-8", "replace").rstrip("\n")
    finally:
        os.close(fd)


def _default_max_open() -> int:
    """Leave room under the process's soft RLIMIT_NOFILE for sockets and the rest."""
    try:
        import resource

        soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
        if soft == resource.RLIM_INFINITY:
            soft = 65536
    except (ImportError, ValueError, OSError):
        soft = 1024
    return max(0, min(4096, soft - 256))


class OpenFiles:
    """sysfs attributes opened once and re-read with ``pread(fd, 4096, 0)``.

    sysfs calls the attribute's ``show()`` again on every read at offset 0
    (Documentation/filesystems/sysfs.rst), so a kept descriptor reads fresh values; that
    is ~6x cheaper than open/read/close and is what keeps a 1 s sample of 8 ports (about
    500 files) well under 1 % of a core. At most ``max_open`` descriptors are kept (the
    rest are opened per read); ``close_all()`` runs at every rediscovery, so a file that
    vanished with its device (ENODEV on a kept descriptor) is not read for long.
    """

    def __init__(self, max_open: int | None = None) -> None:
        self.max_open = _default_max_open() if max_open is None else max_open
        self._fds: dict[str, int] = {}

    def read_bytes(self, path: str) -> bytes:
        """The attribute's raw bytes (``int()`` takes them as they are, newline included)."""
        fd = self._fds.get(path)
        if fd is None:
            if len(self._fds) >= self.max_open:
                with open(path, "rb", buffering=0) as fh:
                    return fh.read(4096)
            fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
            self._fds[path] = fd
        try:
            return os.pread(fd, 4096, 0)
        except OSError as exc:
            self.failed(path, exc)
            raise

    @property
    def kept(self) -> dict[str, int]:
        """path -> kept descriptor (read it with ``os.pread(fd, n, 0)``; report errors to `failed`)."""
        return self._fds

    def failed(self, path: str, exc: OSError) -> None:
        """A read of a kept descriptor failed: forget it if its device went away."""
        if exc.errno in (errno.ENODEV, errno.ESTALE, errno.EBADF):
            self.forget(path)

    def read(self, path: str) -> str:
        return self.read_bytes(path).decode("utf-8", "replace").rstrip("\n")

    def forget(self, path: str) -> None:
        fd = self._fds.pop(path, None)
        if fd is not None:
            os.close(fd)

    def close_all(self) -> None:
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()

    def __len__(self) -> int:
        return len(self._fds)


def pcie_gen(speed: str) -> float:
    """PCIe generation from a sysfs link speed; NaN when unknown.

    >>> pcie_gen("32.0 GT/s PCIe"), pcie_gen("8 GT/s"), pcie_gen("Unknown")
    (5.0, 3.0, nan)
    """
    head = speed.split(" ", 1)[0]
    try:
        return float(PCIE_GEN_BY_GTS.get(float(head), NAN))
    except ValueError:
        return NAN


def read_netdev_speed(sys_root: str, ifname: str, problems: Problems | None = None, read=read_text) -> float:
    """``/sys/class/net/<if>/speed`` in Mb/s: -1 without carrier, NaN when admin-down or unreadable.

    ``read`` returns the attribute as str or bytes (``OpenFiles.read_bytes``).
    """
    return _read_speed(os.path.join(sys_root, "class", "net", ifname, "speed"), ifname, problems, read)


def _read_speed(path: str, ifname: str, problems: Problems | None, read) -> float:
    try:
        return float(int(read(path)))
    except OSError as exc:
        if problems is not None:
            if exc.errno == errno.EINVAL:   # speed_show: the interface is not running (admin-down)
                problems.report("netdev_admin_down", ifname, f"{path}: EINVAL, {ifname} is admin-down; speed NaN",
                                logging.INFO)
            else:
                problems.report("read_error", path, f"cannot read {path}: {exc}; speed NaN")
        return NAN
    except ValueError:
        if problems is not None:
            problems.report("parse_error", path, f"{path}: not an integer; speed NaN")
        return NAN


# --------------------------------------------------------------------------- discovery
@dataclass
class PortInfo:
    """Where one RDMA port's files are; found once per discovery, read every sample."""

    ibdev: str
    port: str
    path: str                                   # <sys_root>/class/infiniband/<dev>/ports/<n>
    counter_files: list[tuple[str, str]]        # (column name, file path), counters/ then hw_counters/
    netdev: str = ""
    netdev_source: str = ""                     # "device/net" | "gid_attrs/ndevs/0" | ""
    pci_bdf: str = ""
    link_layer: str = ""                        # as read at discovery (decides the ethtool sources)
    sys_root: str = ""                          # where the netdev and PCI files are looked up

    def __post_init__(self) -> None:
        # Every path a sample reads, joined once here rather than on every sample.
        self.label_paths = [(name, os.path.join(self.path, name)) for name in ("rate", "state", "phys_state",
                                                                                 "link_layer")]
        self.speed_path = os.path.join(self.sys_root, "class", "net", self.netdev, "speed") if self.netdev else ""
        pci = os.path.join(self.sys_root, "bus", "pci", "devices", self.pci_bdf)
        self.pcie_paths = [(gauge, os.path.join(pci, attr), parse) for gauge, attr, parse in _PCIE_FILES] \
            if self.pci_bdf else []

    @property
    def entity_id(self) -> str:
        return f"{self.ibdev}/{self.port}"


class NicReader:
    """Samples every RDMA port under ``<sys_root>/class/infiniband``.

    Parameters
    ----------
    sys_root : the sysfs mount ("/sys"); tests point it at a recorded tree.
    rediscover_s : ports, counter files and netdevs are listed again after this long
        (a port that appears, a driver reload); ``discover()`` forces it.

    Examples
    --------
    >>> import os
    >>> here = os.path.dirname(os.path.abspath(__file__))
    >>> tree = os.path.join(here, "..", "tests", "fixtures", "sysfs", "roce_cx7")
    >>> with NicReader(tree) as reader:      # keeps ~500 descriptors open until closed
    ...     [row] = [r for r in reader.sample() if r.entity_id == "mlx5_0/1"]
    >>> row.labels["rate"], row.labels["netdev"], row.gauges["netdev_speed_mbps"], row.gauges["pcie_gen_current"]
    ('400 Gb/sec (4X NDR)', 'enp24s0np0', 400000.0, 5.0)
    """

    def __init__(self, sys_root: str = "/sys", rediscover_s: float = 60.0, max_open_files: int | None = None) -> None:
        self.sys_root = sys_root
        self.rediscover_s = rediscover_s
        self.problems = Problems(log)
        self.files = OpenFiles(max_open_files)
        self._ports: list[PortInfo] = []
        self._discovered_at = -math.inf

    # -- discovery ----------------------------------------------------------------------------
    @property
    def ports(self) -> list[PortInfo]:
        if time.monotonic() - self._discovered_at >= self.rediscover_s:
            self.discover()
        return self._ports

    def discover(self) -> list[PortInfo]:
        base = os.path.join(self.sys_root, "class", "infiniband")
        self._discovered_at = time.monotonic()
        self.files.close_all()
        try:
            devices = sorted(os.listdir(base), key=_natural)
        except OSError as exc:
            self.problems.report("no_rdma_devices", base, f"no RDMA devices: cannot list {base} ({exc})",
                                 logging.INFO)
            self._ports = []
            return self._ports
        ports = []
        for dev in devices:
            ports_dir = os.path.join(base, dev, "ports")
            try:
                numbers = sorted(os.listdir(ports_dir), key=_natural)
            except OSError as exc:
                self.problems.report("read_error", ports_dir, f"cannot list {ports_dir}: {exc}")
                continue
            bdf = self._pci_bdf(os.path.join(base, dev, "device"))
            for n in numbers:
                ports.append(self._port_info(dev, n, os.path.join(ports_dir, n), bdf))
        if [p.entity_id for p in ports] != [p.entity_id for p in self._ports]:
            log.info("RDMA ports under %s: %s", base,
                     ", ".join(f"{p.entity_id}={p.netdev or '?'}({p.link_layer or '?'})" for p in ports) or "none")
        self._ports = ports
        return ports

    def _port_info(self, dev: str, n: str, path: str, bdf: str) -> PortInfo:
        files: list[tuple[str, str]] = []
        seen: set[str] = set()
        for sub in ("counters", "hw_counters"):
            d = os.path.join(path, sub)
            try:
                names = sorted(os.listdir(d))
            except FileNotFoundError:
                continue                   # optional group absent: no columns
            except OSError as exc:
                self.problems.report("read_error", d, f"cannot list {d}: {exc}")
                continue
            for name in names:
                if name in NOT_COUNTERS or name in seen:
                    continue
                seen.add(name)
                files.append((name, os.path.join(d, name)))
        netdev, source = self._netdev(dev, n, path)
        try:
            link_layer = read_text(os.path.join(path, "link_layer"))
        except OSError:
            link_layer = ""
        return PortInfo(dev, n, path, files, netdev, source, bdf, link_layer, self.sys_root)

    def _pci_bdf(self, device_link: str) -> str:
        try:
            return os.path.basename(os.readlink(device_link))
        except OSError:
            pass
        try:   # a plain directory (a copied tree): the PCI core's uevent names the slot
            for line in read_text(os.path.join(device_link, "uevent")).splitlines():
                if line.startswith("PCI_SLOT_NAME="):
                    return line.split("=", 1)[1]
        except OSError:
            pass
        return ""

    def _netdev(self, dev: str, n: str, port_path: str) -> tuple[str, str]:
        net_dir = os.path.join(self.sys_root, "class", "infiniband", dev, "device", "net")
        try:
            candidates = sorted(os.listdir(net_dir))
        except OSError:
            candidates = []
        if len(candidates) > 1:       # several netdevs on one function: match the port
            for ifname in candidates:
                try:
                    if int(read_text(os.path.join(net_dir, ifname, "dev_port"))) == int(n) - 1:
                        return ifname, "device/net"
                except (OSError, ValueError):
                    continue
        if candidates:
            return candidates[0], "device/net"
        try:
            ifname = read_text(os.path.join(port_path, "gid_attrs", "ndevs", "0"))
            if ifname:
                return ifname, "gid_attrs/ndevs/0"
        except OSError:
            pass                      # IB ports: EINVAL, no netdev behind GID 0
        return "", ""

    # -- sampling -----------------------------------------------------------------------------
    def sample(self) -> list[EntityRow]:
        """One row per port: counters that could be read, all gauges (NaN if not), all labels."""
        return [self.sample_port(p) for p in self.ports]

    def sample_port(self, port: PortInfo) -> EntityRow:
        row = EntityRow(port.entity_id)
        for name, path in port.label_paths:
            row.labels[name] = self._label(path)
        row.labels["netdev"] = port.netdev
        row.labels["pci_bdf"] = port.pci_bdf
        counters = row.counters
        read = self.files.read_bytes
        kept, pread = self.files.kept, os.pread
        for name, path in port.counter_files:
            try:
                fd = kept.get(path)     # the ~60 counter files of a port: kept descriptors, no call layers
                value = int(pread(fd, 64, 0) if fd is not None else read(path))
            except OSError as exc:
                if fd is not None:
                    self.files.failed(path, exc)
                kind = "missing_counter" if exc.errno == errno.ENOENT else "read_error"
                self.problems.report(kind, path, f"cannot read {path}: {exc}; column {name} left out")
                continue
            except ValueError:
                self.problems.report("parse_error", path, f"{path}: not an integer counter; left out")
                continue
            if 0 <= value <= MAX_U64:
                counters[name] = value
            else:
                self.problems.report("parse_error", path, f"{path}: {value} outside uint64; left out")
        gauges = row.gauges
        gauges["netdev_speed_mbps"] = (_read_speed(port.speed_path, port.netdev, self.problems, read)
                                       if port.netdev else NAN)
        gauges.update(self._pcie(port))
        assert tuple(gauges) == NIC_GAUGES and tuple(row.labels) == NIC_LABELS
        return row

    def _label(self, path: str) -> str:
        try:
            return self.files.read(path)
        except OSError as exc:
            self.problems.report("read_error", path, f"cannot read {path}: {exc}; label empty")
            return ""

    def close(self) -> None:
        """Close the kept descriptors (they are reopened on the next sample)."""
        self.files.close_all()

    def __enter__(self) -> NicReader:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def _pcie(self, port: PortInfo) -> dict[str, float]:
        out = {"pcie_width_current": NAN, "pcie_width_max": NAN, "pcie_gen_current": NAN, "pcie_gen_max": NAN}
        for gauge, path, parse in port.pcie_paths:
            try:
                out[gauge] = parse(self.files.read_bytes(path).decode("ascii", "replace"))
            except OSError as exc:
                self.problems.report("read_error", path, f"cannot read {path}: {exc}; {gauge} NaN")
        return out


def _width(text: str) -> float:
    try:
        return float(int(text))
    except ValueError:
        return NAN


_PCIE_FILES = (("pcie_width_current", "current_link_width", _width),
               ("pcie_width_max", "max_link_width", _width),
               ("pcie_gen_current", "current_link_speed", pcie_gen),
               ("pcie_gen_max", "max_link_speed", pcie_gen))


def _natural(name: str) -> tuple:
    """mlx5_2 before mlx5_10; port "2" before "10"."""
    head = name.rstrip("0123456789")
    tail = name[len(head):]
    return (head, int(tail) if tail else -1, name)
