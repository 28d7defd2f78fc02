"""`fabricwatch collect-switch`: stream switch port counters over gNMI to the gateway.

    fabricwatch collect-switch --config switches.yaml [--record out.jsonl] [--duration S] [--check]

The configuration (YAML; reference in docs/collectors-switch.md, example in
deploy/switch-collector.example.yaml) lists the switches, each with its gNMI target,
profile, TLS and credentials file, and the ingest gateway to send to. Unknown keys are
errors: a typo must not silently fall back to a default (``skip_verfy: true``).

This module imports nothing heavy, so the CLI can register the subcommand cheaply; the
gRPC/gNMI machinery is imported when the command runs.
"""
from __future__ import annotations

import argparse
import logging
import os
import stat
import sys
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from fabricwatch.grpc_tls import check_client_tls

from .gnmi_profiles import PROFILES

log = logging.getLogger("fabricwatch.switch")
# SwitchCollector.stats keys mirrored into fabricwatch_collector_field_errors_total{kind}.
FIELD_ERROR_STATS = {"unmapped_leaves": "unmapped_leaf", "bad_values": "bad_value", "unknown_oid": "unknown_oid"}
METRICS_SYNC_S = 1.0

_TLS_KEYS = {"ca", "client_cert", "client_key", "server_name", "skip_verify", "plaintext"}
_SWITCH_KEYS = {"name", "target", "profile", "tls", "credentials", "auth", "encoding", "sample_interval_ms",
                "heartbeat_interval_ms", "priorities", "tick_quiet_ms", "stall_timeout_s", "backoff_initial_s",
                "backoff_max_s"}
_DEFAULT_KEYS = _SWITCH_KEYS - {"name", "target"}
_GATEWAY_KEYS = {"target", "token", "token_file", "ca", "server_name", "client_cert", "client_key"}
_TOP_KEYS = {"cluster", "gateway", "defaults", "switches"}
_CREDENTIAL_KEYS = {"username", "password"}


@dataclass(frozen=True)
class GatewayTarget:
    target: str
    token: str = field(default="", repr=False)
    ca: str = ""
    server_name: str = ""
    client_cert: str = ""        # mTLS to a gateway run with --client-ca
    client_key: str = ""


@dataclass(frozen=True)
class CollectorConfig:
    switches: tuple            # of gnmi_switch.SwitchSettings
    gateway: GatewayTarget | None = None
    cluster: str = ""


def _fail(where: str, message: str):
    raise ValueError(f"{where}: {message}")


def _check_keys(where: str, data, allowed: set[str]) -> dict:
    if not isinstance(data, dict):
        _fail(where, f"expected a mapping, got {type(data).__name__}")
    unknown = sorted(set(map(str, data)) - allowed)
    if unknown:
        _fail(where, f"unknown key{'s' if len(unknown) > 1 else ''} {', '.join(map(repr, unknown))} "
                     f"(known: {', '.join(sorted(allowed))})")
    return data


def _str(where: str, v, *, empty_ok: bool = False) -> str:
    if not isinstance(v, str) or (not v.strip() and not empty_ok):
        _fail(where, f"expected a non-empty string, got {v!r}")
    return v.strip()


def _bool(where: str, v) -> bool:
    if not isinstance(v, bool):
        _fail(where, f"expected true or false, got {v!r}")
    return v


def _int(where: str, v, lo: int, hi: int) -> int:
    if isinstance(v, bool) or not isinstance(v, int) or not lo <= v <= hi:
        _fail(where, f"expected an integer in {lo}..{hi}, got {v!r}")
    return v


def _float(where: str, v, lo: float, hi: float) -> float:
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not lo <= v <= hi:
        _fail(where, f"expected a number in {lo}..{hi}, got {v!r}")
    return float(v)


def _file(where: str, v, base: Path) -> str:
    path = Path(_str(where, v)).expanduser()
    if not path.is_absolute():
        path = base / path
    if not path.is_file():
        _fail(where, f"no such file: {path}")
    return str(path)


def load_credentials(path: str, where: str) -> tuple[str, str]:
    """``{username: ..., password: ...}`` from a YAML file that only its owner may read."""
    mode = os.stat(path).st_mode
    if mode & (stat.S_IRWXG | stat.S_IRWXO):
        log.warning("%s: credentials file %s is readable by group/others (mode %o); chmod 600 it",
                    where, path, stat.S_IMODE(mode))
    with open(path, encoding="utf-8") as fh:
        data = yaml.safe_load(fh) or {}
    _check_keys(f"{where} ({path})", data, _CREDENTIAL_KEYS)
    user = _str(f"{where} ({path}).username", data.get("username"))
    password = data.get("password", "")
    if not isinstance(password, str):
        _fail(f"{where} ({path}).password", "expected a string")
    return user, password


def _switch(where: str, raw: dict, defaults: dict, base: Path):
    from .gnmi_switch import AUTH_MODES, ENCODINGS, SwitchSettings, TlsSettings, is_loopback, split_target

    _check_keys(where, raw, _SWITCH_KEYS)
    for required in ("name", "target"):
        if required not in raw:
            _fail(where, f"missing key {required!r}")
    merged = {**defaults, **raw}
    if "tls" in defaults and "tls" in raw:
        merged["tls"] = {**defaults["tls"], **raw["tls"]}
    name = _str(f"{where}.name", merged["name"])
    target = _str(f"{where}.target", merged["target"])
    try:
        host, _ = split_target(target)
    except ValueError as exc:
        _fail(f"{where}.target", str(exc))
    profile = merged.get("profile", "openconfig")
    if profile not in PROFILES:
        _fail(f"{where}.profile", f"unknown profile {profile!r} (known: {', '.join(PROFILES)})")

    tls_raw = _check_keys(f"{where}.tls", merged.get("tls", {}) or {}, _TLS_KEYS)
    tls = TlsSettings(
        ca=_file(f"{where}.tls.ca", tls_raw["ca"], base) if tls_raw.get("ca") else "",
        client_cert=(_file(f"{where}.tls.client_cert", tls_raw["client_cert"], base)
                     if tls_raw.get("client_cert") else ""),
        client_key=_file(f"{where}.tls.client_key", tls_raw["client_key"], base) if tls_raw.get("client_key") else "",
        server_name=_str(f"{where}.tls.server_name", tls_raw["server_name"]) if tls_raw.get("server_name") else "",
        skip_verify=_bool(f"{where}.tls.skip_verify", tls_raw.get("skip_verify", False)),
        plaintext=_bool(f"{where}.tls.plaintext", tls_raw.get("plaintext", False)),
    )
    if tls.skip_verify and tls.ca:
        _fail(f"{where}.tls", "skip_verify and ca contradict each other: verify against the CA, or skip")
    if bool(tls.client_cert) != bool(tls.client_key):
        _fail(f"{where}.tls", "client_cert and client_key go together (mTLS)")
    if tls.plaintext and not is_loopback(host):
        _fail(f"{where}.tls.plaintext", f"plaintext gNMI is only allowed to a loopback target, not {host}")
    if tls.plaintext and (tls.ca or tls.skip_verify or tls.client_cert):
        _fail(f"{where}.tls", "plaintext excludes ca / skip_verify / client_cert")

    username = password = ""
    if merged.get("credentials"):
        username, password = load_credentials(_file(f"{where}.credentials", merged["credentials"], base),
                                              f"{where}.credentials")
    auth = merged.get("auth", "")
    if auth and auth not in AUTH_MODES:
        _fail(f"{where}.auth", f"expected one of {', '.join(AUTH_MODES)}, got {auth!r}")
    encoding = merged.get("encoding", "")
    if encoding and encoding not in ENCODINGS:
        _fail(f"{where}.encoding", f"expected one of {', '.join(ENCODINGS)}, got {encoding!r}")
    priorities = merged.get("priorities", list(range(8)))
    if not isinstance(priorities, list) or not priorities:
        _fail(f"{where}.priorities", f"expected a non-empty list of 0..7, got {priorities!r}")
    prios = tuple(sorted({_int(f"{where}.priorities", p, 0, 7) for p in priorities}))
    return SwitchSettings(
        name=name, target=target, profile=profile, tls=tls, username=username, password=password, auth=auth,
        encoding=encoding,
        sample_interval_ms=_int(f"{where}.sample_interval_ms", merged.get("sample_interval_ms", 1000), 10, 3_600_000),
        heartbeat_interval_ms=_int(f"{where}.heartbeat_interval_ms", merged.get("heartbeat_interval_ms", 60_000),
                                   0, 86_400_000),
        priorities=prios,
        tick_quiet_ms=_int(f"{where}.tick_quiet_ms", merged.get("tick_quiet_ms", 0), 0, 60_000),
        stall_timeout_s=_float(f"{where}.stall_timeout_s", merged.get("stall_timeout_s", 0), 0, 86_400),
        backoff_initial_s=_float(f"{where}.backoff_initial_s", merged.get("backoff_initial_s", 0.5), 0.01, 3600),
        backoff_max_s=_float(f"{where}.backoff_max_s", merged.get("backoff_max_s", 30.0), 0.01, 3600),
    )


def _gateway(raw, base: Path) -> GatewayTarget:
    from .gnmi_switch import is_loopback, split_target

    _check_keys("gateway", raw, _GATEWAY_KEYS)
    target = _str("gateway.target", raw.get("target"))
    try:
        host, _ = split_target(target)
    except ValueError as exc:
        _fail("gateway.target", str(exc))
    if raw.get("token") and raw.get("token_file"):
        _fail("gateway", "give token or token_file, not both")
    token = ""
    if raw.get("token_file"):
        with open(_file("gateway.token_file", raw["token_file"], base), encoding="utf-8") as fh:
            token = fh.read().strip()
    elif raw.get("token"):
        token = _str("gateway.token", raw["token"])
    else:
        token = os.environ.get("FABRICWATCH_TOKEN", "")
    ca = _file("gateway.ca", raw["ca"], base) if raw.get("ca") else ""
    if not ca and not is_loopback(host):
        _fail("gateway", f"a gateway at {host} needs TLS: set gateway.ca (only loopback may be plaintext)")
    server_name = _str("gateway.server_name", raw["server_name"]) if raw.get("server_name") else ""
    client_cert = _file("gateway.client_cert", raw["client_cert"], base) if raw.get("client_cert") else ""
    client_key = _file("gateway.client_key", raw["client_key"], base) if raw.get("client_key") else ""
    try:
        check_client_tls(ca, client_cert, client_key)
    except ValueError as exc:
        _fail("gateway", str(exc))
    return GatewayTarget(target=target, token=token, ca=ca, server_name=server_name, client_cert=client_cert,
                         client_key=client_key)


def parse_config(data, base: Path = Path(".")) -> CollectorConfig:
    """Validate a loaded YAML document (relative file paths are taken from `base`)."""
    _check_keys("config", data, _TOP_KEYS)
    defaults = _check_keys("defaults", data.get("defaults") or {}, _DEFAULT_KEYS)
    switches_raw = data.get("switches")
    if not isinstance(switches_raw, list) or not switches_raw:
        _fail("switches", "expected a non-empty list of switches")
    switches, names, targets = [], set(), set()
    for i, raw in enumerate(switches_raw):
        label = raw.get("name") if isinstance(raw, dict) and isinstance(raw.get("name"), str) else ""
        where = f"switches[{i}]" + (f" ({label})" if label else "")
        s = _switch(where, raw, defaults, base)
        if s.name in names:
            _fail(where, f"duplicate switch name {s.name!r}")
        if s.target in targets:
            _fail(where, f"target {s.target} is listed twice")
        names.add(s.name)
        targets.add(s.target)
        switches.append(s)
    cluster = data.get("cluster", "")
    if cluster:
        cluster = _str("cluster", cluster)
    gateway = _gateway(data["gateway"], base) if data.get("gateway") else None
    return CollectorConfig(switches=tuple(switches), gateway=gateway, cluster=cluster)


def load_config(path: str | os.PathLike) -> CollectorConfig:
    p = Path(path)
    with open(p, encoding="utf-8") as fh:
        try:
            data = yaml.safe_load(fh)
        except yaml.YAMLError as exc:
            raise ValueError(f"{p}: not valid YAML: {exc}") from None
    return parse_config(data or {}, p.resolve().parent)


# --------------------------------------------------------------------------- command line
def add_parser(subparsers) -> argparse.ArgumentParser:
    """Register ``collect-switch`` on the `fabricwatch` subparsers."""
    sp = subparsers.add_parser("collect-switch", help="stream switch port counters (gNMI) to the gateway",
                               description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sp.add_argument("--config", required=True, help="switch collector YAML (docs/collectors-switch.md)")
    sp.add_argument("--record", help="also write every snapshot to this JSON Lines file")
    sp.add_argument("--duration", type=float, default=0.0, help="stop after this many seconds (0 = until signalled)")
    sp.add_argument("--check", action="store_true",
                    help="validate the configuration, print the subscriptions, and exit")
    sp.set_defaults(func=run_command)
    return sp


def describe(config: CollectorConfig) -> str:
    from .gnmi_profiles import compile_profile
    from .gnmi_switch import subscribe_request

    lines = []
    gw = config.gateway
    lines.append(f"gateway: {gw.target} ({'TLS' if gw.ca else 'plaintext'}, token {'set' if gw.token else 'none'})"
                 if gw else "gateway: none (--record only)")
    for s in config.switches:
        profile = compile_profile(s.profile)
        tls = ("plaintext" if s.tls.plaintext else "TLS skip-verify" if s.tls.skip_verify
               else "TLS" + (" mTLS" if s.tls.client_cert else ""))
        lines.append(f"switch {s.name} {s.target} profile={s.profile} {tls} auth={s.auth or profile.auth}"
                     f"{'' if s.username else ' (no credentials)'} interval={s.sample_interval_ms}ms "
                     f"priorities={','.join(map(str, s.priorities))}")
        for group in profile.groups:
            req = subscribe_request(group, s, profile)
            lines.append(f"  group {group.name}{' (optional)' if group.optional else ''}"
                         f"{' target=' + group.target if group.target else ''}: "
                         f"{len(req.subscribe.subscription)} paths")
    return "\n".join(lines)


def run_command(args) -> int:
    config = load_config(args.config)
    if args.check:
        print(describe(config))
        return 0
    if config.gateway is None and not args.record:
        print("fabricwatch collect-switch: nothing to send to: configure `gateway:` or pass --record",
              file=sys.stderr)
        return 2
    import asyncio

    stats = asyncio.run(collect(config, record_path=args.record, duration_s=args.duration))
    print(" ".join(f"{k}={v}" for k, v in sorted(stats.items())), file=sys.stderr)
    return 0


async def collect(config: CollectorConfig, *, record_path: str | None = None, duration_s: float = 0.0,
                  stop=None):
    """Run every switch until `stop` (or SIGINT/SIGTERM, or `duration_s`); returns the stats."""
    import asyncio
    import signal
    from collections import Counter

    from fabricwatch.recording import snapshot_to_json

    from .gnmi_switch import run_switches
    from .sender import GatewaySender, SenderConfig

    from fabricwatch import metrics

    stop = stop or asyncio.Event()
    loop = asyncio.get_running_loop()
    handled = []
    for sig in (signal.SIGINT, signal.SIGTERM):
        try:
            loop.add_signal_handler(sig, stop.set)
            handled.append(sig)
        except (NotImplementedError, RuntimeError, ValueError):   # not the main thread / platform
            pass
    timer = loop.call_later(duration_s, stop.set) if duration_s else None
    sender = sender_task = None
    sender_stop = asyncio.Event()
    if config.gateway:
        gw = config.gateway
        sender = GatewaySender(SenderConfig(target=gw.target, token=gw.token, root_cert_path=gw.ca,
                                            client_cert_path=gw.client_cert, client_key_path=gw.client_key,
                                            server_name_override=gw.server_name))
        sender_task = asyncio.create_task(sender.run(sender_stop))
    record = open(record_path, "w", encoding="utf-8") if record_path else None
    stats: Counter[str] = Counter()
    samples = metrics.COLLECTOR_SAMPLES.labels("gnmi")

    def emit(snapshot) -> None:
        stats["snapshots"] += 1
        samples.inc()
        if sender:
            sender.submit(snapshot)
        if record:
            record.write(snapshot_to_json(snapshot) + "\n")

    collectors: list = []

    async def export_stats() -> None:
        # The collectors count per switch in plain Counters; mirror their sums once a second.
        field_errors = metrics.CounterMirror(metrics.COLLECTOR_FIELD_ERRORS, rename=FIELD_ERROR_STATS)
        reconnects = metrics.CounterMirror(metrics.COLLECTOR_RECONNECTS, rename={"reconnects": "switch"})
        while True:
            total: Counter[str] = Counter()
            for c in collectors:
                total.update(c.stats)
            field_errors.sync(total)
            reconnects.sync(total)
            await asyncio.sleep(METRICS_SYNC_S)

    exporter = asyncio.create_task(export_stats())
    try:
        await run_switches(list(config.switches), emit, stop, cluster=config.cluster, collectors=collectors)
        if sender:
            stats["drained"] = int(await sender.drain(timeout_s=10))
    finally:
        exporter.cancel()
        for sig in handled:
            loop.remove_signal_handler(sig)
        if timer:
            timer.cancel()
        sender_stop.set()
        if sender_task:
            await sender_task
            stats.update({f"sender_{k}": v for k, v in sender.stats.items()})
        if record:
            record.close()
        for c in collectors:
            for k in ("ticks", "reconnects", "stream_errors", "unmapped_leaves", "bad_values"):
                if c.stats[k]:
                    stats[f"{k}"] += c.stats[k]
    return stats
