"""The node collector's configuration: the YAML file's schema, its validation and the token.

`NodeConfig` and its sections (``gateway``, ``intervals``, ``sources``, ``ethtool``,
``nvml``) are frozen dataclasses: their fields are the keys and defaults
(`fabricwatch.config_reference` documents them from here); `load_config` refuses unknown
keys and wrong types with a message naming the key. Separate from the collector: the
config is read by the CLI, the docs generator and the tests without starting a collector.
"""
from __future__ import annotations

import logging
import math
import os
import re
import socket
from dataclasses import MISSING, dataclass, field, fields
from typing import Any

import yaml


log = logging.getLogger("fabricwatch.collect")

# Snapshots per second at the default intervals: 10 PFC ticks + 1 tick for the rest.
DEFAULT_SNAPSHOTS_PER_S = 11
# 10 000 snapshots cover 15 minutes of gateway outage at the default rates (11/s). On the wire
# an 8-port node averages ~2.1 KB per snapshot, but a buffered protobuf message holds ~13.7 KB
# of memory (measured, upb), so a full buffer is ~135 MB.
DEFAULT_MAX_BUFFERED = 10_000
MIN_INTERVAL_S, MAX_INTERVAL_S = 0.01, 3600.0
MIN_BUFFERED, MAX_BUFFERED = 100, 5_000_000
LOOPBACK_PREFIXES = ("127.", "localhost", "[::1]")
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._:/@+=-]*$")   # what the gateway accepts as a source


class ConfigError(ValueError):
    """A collector config that cannot be used (the message names the key)."""



@dataclass(frozen=True)
class GatewaySettings:
    target: str = "127.0.0.1:50051"      # host:port of the gateway
    token_file: str = ""                 # file holding this collector's bearer token
    ca_cert: str = ""                    # PEM of the CA that signed the gateway's certificate
    client_cert: str = ""                # mTLS: this collector's certificate (PEM), with client_key
    client_key: str = ""
    server_name_override: str = ""       # TLS name check override (self-signed test certs)
    max_buffered: int = DEFAULT_MAX_BUFFERED
    max_batch: int = 64
    linger_s: float = 2.0                # hold snapshots this long and hand them over together...
    flush_on_pause: bool = True          # ...unless a port pauses (`PauseWatch`), a link changes or an XID arrived: at once


@dataclass(frozen=True)
class Intervals:
    ethtool_pfc: float = 0.1
    ethtool: float = 1.0
    sysfs: float = 1.0
    nvml: float = 1.0


@dataclass(frozen=True)
class Sources:
    sysfs: bool = True
    ethtool: bool = True
    nvml: bool = True


@dataclass(frozen=True)
class EthtoolSettings:
    allow: tuple[str, ...] = ()          # extra names/globs, sampled with `intervals.ethtool`
    allow_fast: tuple[str, ...] = ()     # extra names/globs, sampled with `intervals.ethtool_pfc`
    recorded_dir: str = ""               # testing/demo: read <dir>/<ifname>.txt (`ethtool -S` text)


@dataclass(frozen=True)
class NvmlSettings:
    nvlink: bool = True
    xid_events: bool = True
    energy: bool = False                 # energy_mj: ~2.8 ms of CPU per GPU and read on an H200 (measured)
    # ECC, remapped rows, PCIe replays, NVLink error totals: read this often (rounded to whole
    # NVML samples); they move rarely, and the PCIe replay call alone costs 0.2-0.4 ms per GPU
    slow_fields_s: float = 10.0


@dataclass(frozen=True)
class NodeConfig:
    node_name: str = ""                  # default: this host's name
    cluster: str = ""
    sysfs_root: str = "/sys"
    rediscover_s: float = 60.0           # list ports / netdevs again after this long
    gateway: GatewaySettings = field(default_factory=GatewaySettings)
    intervals: Intervals = field(default_factory=Intervals)
    sources: Sources = field(default_factory=Sources)
    ethtool: EthtoolSettings = field(default_factory=EthtoolSettings)
    nvml: NvmlSettings = field(default_factory=NvmlSettings)

    @property
    def source_name(self) -> str:
        return self.node_name or socket.gethostname()

    @classmethod
    def from_dict(cls, data: dict | None) -> NodeConfig:
        config = _build(cls, data or {}, "")
        config.validate()
        return config

    def validate(self) -> None:
        name = self.source_name
        if not _NAME.match(name) or len(name) > 253:
            raise ConfigError(f"node_name {name!r} is not a valid host name (letters, digits, '.-_:@+=/')")
        if self.cluster and not _NAME.match(self.cluster):
            raise ConfigError(f"cluster {self.cluster!r} is not a valid name")
        for f in fields(Intervals):
            v = getattr(self.intervals, f.name)
            if not MIN_INTERVAL_S <= v <= MAX_INTERVAL_S:
                raise ConfigError(f"intervals.{f.name} = {v}: must be {MIN_INTERVAL_S}..{MAX_INTERVAL_S} s")
        if not self.intervals.nvml <= self.nvml.slow_fields_s <= MAX_INTERVAL_S:
            raise ConfigError(f"nvml.slow_fields_s = {self.nvml.slow_fields_s}: must be intervals.nvml "
                              f"({self.intervals.nvml})..{MAX_INTERVAL_S} s")
        if not 1.0 <= self.rediscover_s <= 86400:
            raise ConfigError(f"rediscover_s = {self.rediscover_s}: must be 1..86400 s")
        g = self.gateway
        if not MIN_BUFFERED <= g.max_buffered <= MAX_BUFFERED:
            raise ConfigError(f"gateway.max_buffered = {g.max_buffered}: must be {MIN_BUFFERED}..{MAX_BUFFERED}")
        if not 1 <= g.max_batch <= 10_000:
            raise ConfigError(f"gateway.max_batch = {g.max_batch}: must be 1..10000")
        if not 0.0 <= g.linger_s <= 10.0:
            raise ConfigError(f"gateway.linger_s = {g.linger_s}: must be 0..10 s")
        if ":" not in g.target:
            raise ConfigError(f"gateway.target {g.target!r}: expected host:port")
        if not g.target.startswith(LOOPBACK_PREFIXES) and not g.ca_cert:
            raise ConfigError(f"gateway.target {g.target} is not loopback: set gateway.ca_cert (TLS); "
                              "only a loopback gateway may be plaintext")
        if not g.target.startswith(LOOPBACK_PREFIXES) and not g.token_file:
            raise ConfigError(f"gateway.target {g.target} is not loopback: set gateway.token_file")
        if not any((self.sources.sysfs, self.sources.ethtool, self.sources.nvml)):
            raise ConfigError("sources: every source is disabled; nothing to collect")

    @property
    def nvml_slow_every(self) -> int:
        """``nvml.slow_fields_s`` in NVML samples (at least 1)."""
        return max(1, round(self.nvml.slow_fields_s / self.intervals.nvml))

    def sender_config(self):
        from .sender import SenderConfig

        g = self.gateway
        return SenderConfig(target=g.target, token=read_token(g.token_file) if g.token_file else "",
                            root_cert_path=g.ca_cert, server_name_override=g.server_name_override,
                            client_cert_path=g.client_cert, client_key_path=g.client_key,
                            max_batch=g.max_batch, max_buffered=g.max_buffered)


def _build(cls, data: Any, where: str):
    """A frozen dataclass from a YAML mapping; unknown keys and wrong types are refused."""
    if not isinstance(data, dict):
        raise ConfigError(f"{where or 'config'}: expected a mapping, got {type(data).__name__}")
    known = {f.name: f for f in fields(cls)}
    unknown = sorted(set(data) - set(known))
    if unknown:
        raise ConfigError(f"unknown key{'s' if len(unknown) > 1 else ''} {', '.join(map(repr, unknown))} in "
                          f"{where or 'the top level'} of the collector config (allowed: {', '.join(known)})")
    kwargs = {}
    for name, value in data.items():
        f = known[name]
        path = f"{where}.{name}" if where else name
        default = f.default_factory() if f.default_factory is not MISSING else f.default
        if hasattr(default, "__dataclass_fields__"):
            kwargs[name] = _build(type(default), value if value is not None else {}, path)
            continue
        kwargs[name] = _coerce(path, value, default)
    return cls(**kwargs)


def _coerce(path: str, value: Any, default: Any) -> Any:
    if isinstance(default, bool):
        if not isinstance(value, bool):
            raise ConfigError(f"{path}: expected true or false, got {value!r}")
        return value
    if isinstance(default, int):
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{path}: expected an integer, got {value!r}")
        return value
    if isinstance(default, float):
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            raise ConfigError(f"{path}: expected a number of seconds, got {value!r}")
        return float(value)
    if isinstance(default, tuple):
        if not isinstance(value, list) or not all(isinstance(v, str) and v for v in value):
            raise ConfigError(f"{path}: expected a list of names, got {value!r}")
        return tuple(value)
    if isinstance(default, str):
        if value is None:
            return ""
        if not isinstance(value, str):
            raise ConfigError(f"{path}: expected a string, got {value!r}")
        return value
    raise ConfigError(f"{path}: unsupported value {value!r}")


def load_config(path: str) -> NodeConfig:
    try:
        with open(path, encoding="utf-8") as fh:
            data = yaml.safe_load(fh)
    except yaml.YAMLError as exc:
        raise ConfigError(f"{path}: not valid YAML: {exc}") from exc
    try:
        return NodeConfig.from_dict(data)
    except ConfigError as exc:
        raise ConfigError(f"{path}: {exc}") from None


def read_token(path: str) -> str:
    with open(path, encoding="utf-8") as fh:
        token = fh.read().strip()
    if not token:
        raise ConfigError(f"gateway.token_file {path} is empty")
    try:
        if os.stat(path).st_mode & 0o004:
            log.warning("token file %s is world-readable; chmod 600 it", path)
    except OSError:
        pass
    return token
