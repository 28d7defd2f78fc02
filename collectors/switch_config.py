"""The switch collector's configuration: its YAML schema, validation, and the credentials file.

The file lists the switches (gNMI target, profile, TLS, credentials file), keys that apply
to every switch (``defaults``), and the ingest gateway (the shared `GatewayConnection`
block). Unknown keys are errors at every level: a typo must not silently fall back to a
default (``skip_verfy: true``). Relative file paths are taken from the config file's folder
and must exist. The sections are `fabricwatch.config_schema.Section` models whose field
descriptions are docs/configuration.md's meanings; the loader hands the collector the
plain `gnmi_switch.SwitchSettings` it runs with.
"""
from __future__ import annotations

import logging
import os
import stat
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any

import yaml
from pydantic import Field, ValidationInfo, field_validator, model_validator

from fabricwatch.config_schema import ConfigFile, GatewayConnection, NonEmpty, Section, Target, Within, validate
from fabricwatch.netaddr import is_loopback, split_host_port

from .gnmi_profiles import PROFILES

log = logging.getLogger("fabricwatch.switch")

Priority = Annotated[int, Within(0, 7)]


class SwitchTls(Section):
    ca: ConfigFile = Field("", description="PEM of the CA that signed the switch's certificate")
    server_name: str = Field("", description="name to check in the switch certificate")
    client_cert: ConfigFile = Field("", description="mTLS client certificate (with `client_key`)")
    client_key: ConfigFile = Field("", description="mTLS client key (with `client_cert`)")
    skip_verify: bool = Field(False, description="pin whatever certificate the switch presents (warned on every "
                                                 "connect); excludes `ca`")
    plaintext: bool = Field(False, description="no TLS; loopback targets only")

    @model_validator(mode="after")
    def _coherent(self) -> SwitchTls:
        if self.skip_verify and self.ca:
            raise ValueError("skip_verify and ca contradict each other: verify against the CA, or skip")
        if bool(self.client_cert) != bool(self.client_key):
            raise ValueError("client_cert and client_key go together (mTLS)")
        if self.plaintext and (self.ca or self.skip_verify or self.client_cert):
            raise ValueError("plaintext excludes ca / skip_verify / client_cert")
        return self


class SwitchDefaults(Section):
    """Every key of a switch but its name and target (``defaults`` holds these)."""

    profile: str = Field("openconfig", description="`openconfig`, `sonic`, `arista`, `cumulus`")
    sample_interval_ms: Annotated[int, Within(10, 3_600_000)] = Field(
        1000, description="SAMPLE interval, sent in nanoseconds")
    heartbeat_interval_ms: Annotated[int, Within(0, 86_400_000)] = Field(
        60_000, description="heartbeat of ON_CHANGE subscriptions; 0 = none")
    priorities: Annotated[list[Priority], Field(min_length=1)] = Field(
        default_factory=lambda: list(range(8)), description="PFC priorities / queues to subscribe to and keep")
    credentials: ConfigFile = Field("", description="YAML file `{username, password}`, mode 600")
    auth: str = Field("", description="`metadata`, `basic` (HTTP Basic) or `none`")
    encoding: str = Field("", description="`json_ietf`, `json`, `proto`, `ascii`, `bytes`")
    tls: SwitchTls = Field(default_factory=SwitchTls, description="TLS settings (default: verify with the "
                                                                   "system roots); keys below")
    tick_quiet_ms: Annotated[int, Within(0, 60_000)] = Field(
        0, description="fallback that closes a tick that never completes (0: auto)")
    stall_timeout_s: Annotated[float, Within(0, 86_400)] = Field(
        0.0, description="reconnect when nothing arrives for this long (0: auto, max(3 intervals, 15 s))")
    backoff_initial_s: Annotated[float, Within(0.01, 3600)] = Field(
        0.5, description="first reconnect delay, seconds (doubling, jittered)")
    backoff_max_s: Annotated[float, Within(0.01, 3600)] = Field(30.0, description="longest reconnect delay, seconds")

    @field_validator("profile")
    @classmethod
    def _known_profile(cls, value: str) -> str:
        if value not in PROFILES:
            raise ValueError(f"unknown profile {value!r} (known: {', '.join(PROFILES)})")
        return value

    @field_validator("auth", "encoding")
    @classmethod
    def _known_mode(cls, value: str, info: ValidationInfo) -> str:
        from .gnmi_switch import AUTH_MODES, ENCODINGS

        known = AUTH_MODES if info.field_name == "auth" else tuple(ENCODINGS)
        if value and value not in known:
            raise ValueError(f"expected one of {', '.join(known)}, got {value!r}")
        return value


class SwitchEntry(SwitchDefaults):
    name: NonEmpty = Field(description="switch name = snapshot `source`; unique")
    target: Target = Field(description="`host:port` of the switch's gNMI server; unique")

    @model_validator(mode="after")
    def _plaintext_only_to_loopback(self) -> SwitchEntry:
        host, _ = split_host_port(self.target, "target")
        if self.tls.plaintext and not is_loopback(host):
            raise ValueError(f"tls.plaintext: plaintext gNMI is only allowed to a loopback target, not {host}")
        return self


class SwitchCollectorFile(Section):
    cluster: str = Field("", description="cluster name (empty: the gateway's `--cluster`)")
    gateway: GatewayConnection | None = Field(None, description="where to send (omit to only `--record`); "
                                                                "keys below")
    defaults: SwitchDefaults = Field(default_factory=SwitchDefaults,
                                     description="keys applied to every switch (all `switches[]` keys but "
                                                 "`name`, `target`)")
    switches: Annotated[list[SwitchEntry], Field(min_length=1)] = Field(
        description="the list of switches; keys below")

    @model_validator(mode="before")
    @classmethod
    def _apply_defaults(cls, data: Any) -> Any:
        """Each switch's keys over the defaults' (``tls`` merged key by key)."""
        if not isinstance(data, dict) or not isinstance(data.get("defaults"), dict) \
                or not isinstance(data.get("switches"), list):
            return data
        defaults = data["defaults"]
        merged = []
        for raw in data["switches"]:
            if isinstance(raw, dict):
                raw = {**{k: v for k, v in defaults.items() if k in SwitchDefaults.model_fields}, **raw}
                if isinstance(defaults.get("tls"), dict) and isinstance(raw.get("tls"), dict):
                    raw["tls"] = {**defaults["tls"], **raw["tls"]}
            merged.append(raw)
        return {**data, "switches": merged}

    @model_validator(mode="after")
    def _unique(self) -> SwitchCollectorFile:
        names, targets = set(), set()
        for i, s in enumerate(self.switches):
            if s.name in names:
                raise ValueError(f"switches[{i}] ({s.name}): duplicate switch name {s.name!r}")
            if s.target in targets:
                raise ValueError(f"switches[{i}] ({s.name}): target {s.target} is listed twice")
            names.add(s.name)
            targets.add(s.target)
        return self


class Credentials(Section):
    username: NonEmpty = Field(description="gNMI user")
    password: str = Field("", repr=False, description="its password")


@dataclass(frozen=True)
class CollectorConfig:
    switches: tuple            # of gnmi_switch.SwitchSettings
    gateway: GatewayConnection | None = None
    cluster: str = ""


def load_credentials(path: str, where: str) -> tuple[str, str]:
    """``{username: ..., password: ...}`` from a YAML file that only its owner may read."""
    mode = os.stat(path).st_mode
    if mode & (stat.S_IRWXG | stat.S_IRWXO):
        log.warning("%s: credentials file %s is readable by group/others (mode %o); chmod 600 it",
                    where, path, stat.S_IMODE(mode))
    with open(path, encoding="utf-8") as fh:
        data = yaml.safe_load(fh) or {}
    creds = validate(Credentials, data, where=f"{where} ({path})")
    return creds.username, creds.password


def parse_config(data, base: Path = Path(".")) -> CollectorConfig:
    """Validate a loaded YAML document (relative file paths are taken from `base`)."""
    from .gnmi_switch import SwitchSettings, TlsSettings

    doc = validate(SwitchCollectorFile, data, base=base)
    switches = []
    for i, s in enumerate(doc.switches):
        username = password = ""
        if s.credentials:
            username, password = load_credentials(s.credentials, f"switches[{i}] ({s.name}).credentials")
        t = s.tls
        switches.append(SwitchSettings(
            name=s.name, target=s.target.strip(), profile=s.profile,
            tls=TlsSettings(ca=t.ca, client_cert=t.client_cert, client_key=t.client_key,
                            server_name=t.server_name.strip(), skip_verify=t.skip_verify, plaintext=t.plaintext),
            username=username, password=password, auth=s.auth, encoding=s.encoding,
            sample_interval_ms=s.sample_interval_ms, heartbeat_interval_ms=s.heartbeat_interval_ms,
            priorities=tuple(sorted(set(s.priorities))), tick_quiet_ms=s.tick_quiet_ms,
            stall_timeout_s=float(s.stall_timeout_s), backoff_initial_s=float(s.backoff_initial_s),
            backoff_max_s=float(s.backoff_max_s)))
    gateway = doc.gateway
    if gateway is not None:
        # the token is read once, here: token_file, else token, else FABRICWATCH_TOKEN
        gateway = gateway.model_copy(update={"token": gateway.read_token(os.environ), "token_file": ""})
    return CollectorConfig(switches=tuple(switches), gateway=gateway, cluster=doc.cluster.strip())


def load_config(path: str | os.PathLike) -> CollectorConfig:
    p = Path(path)
    with open(p, encoding="utf-8") as fh:
        try:
            data = yaml.safe_load(fh)
        except yaml.YAMLError as exc:
            raise ValueError(f"{p}: not valid YAML: {exc}") from None
    return parse_config(data or {}, p.resolve().parent)
