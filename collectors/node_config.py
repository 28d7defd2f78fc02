"""The node collector's configuration: the YAML file's schema and its validation.

`NodeConfig` and its sections (``gateway``, ``intervals``, ``sources``, ``ethtool``,
``nvml``) are frozen `fabricwatch.config_schema.Section` models: their fields are the keys,
defaults and one-line meanings (`fabricwatch.config_reference` documents them from here);
`load_config` refuses unknown keys, wrong types and out-of-range values with a message
naming the key. ``gateway`` is the shared `GatewayConnection` block plus batching.
Separate from the collector: the config is read by the CLI, the docs generator and the
tests without starting a collector.
"""
from __future__ import annotations

import re
import socket
from typing import Annotated

import yaml
from pydantic import Field, model_validator

from fabricwatch.config_schema import GatewayConnection, NonEmpty, Section, Within, validate

# Snapshots per second at the default intervals: 10 PFC ticks + 1 tick for the rest.
DEFAULT_SNAPSHOTS_PER_S = 11
# 10 000 snapshots cover 15 minutes of gateway outage at the default rates (11/s). On the wire
# an 8-port node averages ~2.1 KB per snapshot, but a buffered protobuf message holds ~13.7 KB
# of memory (measured, upb), so a full buffer is ~135 MB.
DEFAULT_MAX_BUFFERED = 10_000
MIN_INTERVAL_S, MAX_INTERVAL_S = 0.01, 3600.0
MIN_BUFFERED, MAX_BUFFERED = 100, 5_000_000
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._:/@+=-]*$")   # what the gateway accepts as a source


class ConfigError(ValueError):
    """A collector config that cannot be used (the message names the key)."""


Seconds = Annotated[float, Within(MIN_INTERVAL_S, MAX_INTERVAL_S)]
Globs = Annotated[tuple[NonEmpty, ...], Field(strict=False)]     # YAML lists; each item strict


class GatewaySettings(GatewayConnection):
    """The shared gateway block, plus how this collector batches and buffers for it."""

    max_buffered: Annotated[int, Within(MIN_BUFFERED, MAX_BUFFERED)] = Field(
        DEFAULT_MAX_BUFFERED,
                              description="snapshots kept while the gateway is unreachable, oldest dropped (and "
                                          "counted) beyond; ~13.7 KB of memory each")
    max_batch: Annotated[int, Within(1, 10_000)] = Field(64, description="snapshots per gRPC batch")
    linger_s: Annotated[float, Within(0.0, 10.0)] = Field(
        2.0,
                            description="group snapshots for this long before handing them to the sender, seconds")
    flush_on_pause: bool = Field(True, description="hand a group over at once when a port pauses (>= 10 % of a "
                                                   "tick) or an XID arrived: storms do not wait for linger_s")

    @model_validator(mode="after")
    def _token_unless_loopback(self) -> GatewaySettings:
        if not self.loopback and not (self.token_file or self.token):
            raise ValueError(f"gateway.target {self.target} is not loopback: set gateway.token_file")
        return self


class Intervals(Section):
    ethtool_pfc: Seconds = Field(0.1, description="PFC / pause counters (ethtool), seconds")
    ethtool: Seconds = Field(1.0, description="ethtool phy, buffer and PCIe health counters, seconds")
    sysfs: Seconds = Field(1.0, description="RDMA port counters, link state, netdev speed, NIC PCIe link, seconds")
    nvml: Seconds = Field(1.0, description="GPUs, seconds (XID events go out with the next snapshot)")


class Sources(Section):
    sysfs: bool = Field(True, description="read RDMA ports from sysfs (not all three sources off)")
    ethtool: bool = Field(True, description="read ethtool statistics of RoCE ports' netdevs")
    nvml: bool = Field(True, description="read GPUs through NVML (without a driver: one log line, the NIC "
                                         "sources go on)")


class EthtoolSettings(Section):
    allow: Globs = Field((), description="extra `ethtool -S` names or `fnmatch` globs, at `intervals.ethtool`")
    allow_fast: Globs = Field((), description="extra names or globs at `intervals.ethtool_pfc`")
    recorded_dir: str = Field("", description="testing and demos: read `<dir>/<ifname>.txt` (recorded "
                                              "`ethtool -S`) instead of the NIC")


class NvmlSettings(Section):
    nvlink: bool = Field(True, description="NVLink state and error counters")
    xid_events: bool = Field(True, description="the XID event thread")
    energy: bool = Field(False, description="the `energy_mj` counter (~2.8 ms of CPU per GPU and read, measured "
                                            "on an H200)")
    # they move rarely, and the PCIe replay call alone costs 0.2-0.4 ms per GPU
    slow_fields_s: Annotated[float, Within(0.0, MAX_INTERVAL_S)] = Field(
        10.0,
                                 description="ECC, remapped rows, PCIe replay and NVLink error totals are read "
                                             "this often, seconds, rounded to whole NVML samples (the fast GPU "
                                             "fields follow `intervals.nvml`)")


class NodeConfig(Section):
    node_name: str = Field("", description="the snapshot `source` and Kafka key; the token's `sources` globs "
                                           "must allow it")
    cluster: str = Field("", description="cluster name (empty: the gateway's `--cluster`)")
    sysfs_root: str = Field("/sys", description="where sysfs is (tests point it at `tests/fixtures/sysfs/...`)")
    rediscover_s: Annotated[float, Within(1.0, 86400.0)] = Field(
        60.0,
                                description="list ports, counter files and netdevs again after this long, seconds")
    gateway: GatewaySettings = Field(default_factory=GatewaySettings)
    intervals: Intervals = Field(default_factory=Intervals)
    sources: Sources = Field(default_factory=Sources)
    ethtool: EthtoolSettings = Field(default_factory=EthtoolSettings)
    nvml: NvmlSettings = Field(default_factory=NvmlSettings)

    @property
    def source_name(self) -> str:
        return self.node_name or socket.gethostname()

    @classmethod
    def from_dict(cls, data: dict | None) -> NodeConfig:
        return validate(cls, data or {}, error=ConfigError)

    @model_validator(mode="after")
    def _consistent(self) -> NodeConfig:
        name = self.source_name
        if not _NAME.match(name) or len(name) > 253:
            raise ValueError(f"node_name {name!r} is not a valid host name (letters, digits, '.-_:@+=/')")
        if self.cluster and not _NAME.match(self.cluster):
            raise ValueError(f"cluster {self.cluster!r} is not a valid name")
        if not self.intervals.nvml <= self.nvml.slow_fields_s:
            raise ValueError(f"nvml.slow_fields_s = {self.nvml.slow_fields_s}: must be intervals.nvml "
                             f"({self.intervals.nvml})..{MAX_INTERVAL_S} s")
        if not any((self.sources.sysfs, self.sources.ethtool, self.sources.nvml)):
            raise ValueError("sources: every source is disabled; nothing to collect")
        return self

    @property
    def nvml_slow_every(self) -> int:
        """``nvml.slow_fields_s`` in NVML samples (at least 1)."""
        return max(1, round(self.nvml.slow_fields_s / self.intervals.nvml))

    def sender_config(self):
        from .sender import SenderConfig

        g = self.gateway
        try:
            token = g.read_token()
        except ValueError as exc:
            raise ConfigError(str(exc)) from None
        return SenderConfig(target=g.target, token=token, root_cert_path=g.ca_cert, server_name_override=g.server_name,
                            client_cert_path=g.client_cert, client_key_path=g.client_key,
                            max_batch=g.max_batch, max_buffered=g.max_buffered)


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

