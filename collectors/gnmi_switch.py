"""asyncio gNMI collector: switch port counters -> one `Snapshot` per sampling tick.

One `SwitchCollector` per switch (one asyncio task each, any number per process). It dials
the switch over TLS (`grpc.aio`), opens one gNMI ``Subscribe`` (mode STREAM) per
subscription group of the switch's profile (`gnmi_profiles`), and merges every update
into the switch's current port table (`SwitchAssembler`). Counter leaves are subscribed
SAMPLE (``sample_interval`` in nanoseconds), status leaves ON_CHANGE (with a heartbeat).

Ticks. A SAMPLE subscription resends every leaf once per interval, so the table is
emitted as one `Snapshot` (source_kind SWITCH, source = switch name, SWITCH_PORT block)
once per sample, at the first of:

* the ``sync_response`` of every subscription (end of the initial dump; nothing is
  emitted before it);
* every SAMPLE leaf a complete sample carries has arrived (the set is learnt from the
  initial dump and later complete ticks): the normal case, without added latency;
* a SAMPLE leaf arrives that this tick already has from the same subscription (the next
  sample has begun; the leaves still missing are taken as gone);
* fallbacks for a tick that never completes: no SAMPLE leaf for ``tick_quiet`` (default
  min(interval/2, 2 s)), or the tick has been open for a whole interval.

ON_CHANGE leaves (oper-status, ...) update the table and go out with the next tick.
Counters travel raw (uint64, JSON-string values parsed), gauges as floats (NaN = never
read). The snapshot time is the collector clock when the tick's first SAMPLE leaf arrived.

Reconnects back off exponentially with jitter; the table is cleared on a reconnect (the
initial dump of the new stream refills it) and a half-received tick is dropped, never
sent. The gNMI stubs are pygnmi's compiled gNMI 0.8.0 protos (`pygnmi.spec.v080`), used
with `grpc.aio`; pygnmi's own (threaded) client is not used.
"""
from __future__ import annotations

import asyncio
import base64
import ipaddress
import json
import logging
import math
import random
import re
import socket
import ssl
import time
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import grpc

from fabricwatch.counters import PFC_PRIORITIES, SWITCH_GAUGES
from fabricwatch.netaddr import is_loopback
from fabricwatch.protos.v1 import telemetry_pb2 as pb

from .gnmi_profiles import (
    CONVERTERS,
    COUNTER,
    GAUGE,
    PORT_NAME_MAP,
    SAMPLE,
    CompiledProfile,
    Match,
    SubscriptionGroup,
    compile_profile,
    escape_key_value,
    expand_paths,
    split_path,
)

try:  # pygnmi bundles compiled gNMI 0.8.0 stubs; its threaded client is never imported.
    from pygnmi.spec.v080 import gnmi_pb2, gnmi_pb2_grpc
except ImportError as _exc:  # pragma: no cover - a packaging error, reported clearly
    raise ImportError("the switch collector needs the gNMI stubs from pygnmi: pip install pygnmi==0.8.15") from _exc

log = logging.getLogger("fabricwatch.switch")

ENCODINGS = {"json": gnmi_pb2.JSON, "json_ietf": gnmi_pb2.JSON_IETF, "proto": gnmi_pb2.PROTO,
             "ascii": gnmi_pb2.ASCII, "bytes": gnmi_pb2.BYTES}
AUTH_MODES = ("metadata", "basic", "none")
_MODULE_PREFIX = re.compile(r"^[a-z][a-z0-9._-]*:")
# Optional subscription groups the device refuses are switched off for the session.
_REFUSED = {grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.NOT_FOUND, grpc.StatusCode.UNIMPLEMENTED,
            grpc.StatusCode.FAILED_PRECONDITION}
MAX_RECEIVE_BYTES = 64 * 1024 * 1024   # SONiC sends all ports' counters as one JSON blob


# --------------------------------------------------------------------------- gNMI paths
def xpath_to_path(xpath: str, origin: str = "", target: str = "") -> gnmi_pb2.Path:
    """``/interfaces/interface[name=*]/state`` -> `gnmi_pb2.Path` (``elem`` form)."""
    path = gnmi_pb2.Path(origin=origin, target=target)
    for name, keys in split_path(xpath):
        elem = path.elem.add(name=name)
        for k, v in keys.items():
            elem.key[k] = v
    return path


def path_elems(path: gnmi_pb2.Path) -> list[tuple[str, dict[str, str]]]:
    """The elements of a received path; the deprecated string ``element`` form
    (``"interface[name=Ethernet0]"``, as the openconfig fake target sends) is parsed."""
    if path.elem:
        return [(e.name, dict(e.key)) for e in path.elem]
    out: list[tuple[str, dict[str, str]]] = []
    for element in path.element:
        if "[" in element:
            out.extend(split_path(element))
        else:
            out.append((element, {}))
    return out


def _strip(name: str) -> str:
    return name.split(":", 1)[1] if _MODULE_PREFIX.match(name) else name


def canonical(elems, strip_module_prefixes: bool = True) -> str:
    """The canonical string of a leaf path that profile rules match (keys sorted, module
    prefixes dropped): ``interfaces/interface[name=Ethernet0]/state/counters/in-octets``."""
    parts = []
    for name, keys in elems:
        if strip_module_prefixes:
            name = _strip(name)
        if keys:
            items = sorted(((_strip(k) if strip_module_prefixes else k), v) for k, v in keys.items())
            name += "".join(f"[{k}={escape_key_value(v)}]" for k, v in items)
        parts.append(name)
    return "/".join(parts)


# --------------------------------------------------------------------------- values
_NO_VALUE = object()


def decode_value(tv: gnmi_pb2.TypedValue):
    """A `TypedValue` as a Python scalar, or a JSON tree for ``json_val``/``json_ietf_val``."""
    kind = tv.WhichOneof("value")
    if kind in ("string_val", "ascii_val", "int_val", "uint_val", "bool_val", "double_val", "float_val"):
        return getattr(tv, kind)
    if kind in ("json_val", "json_ietf_val"):
        raw = getattr(tv, kind)
        try:
            return json.loads(raw)
        except (ValueError, UnicodeDecodeError):
            return _NO_VALUE
    if kind == "decimal_val":
        return tv.decimal_val.digits / (10 ** tv.decimal_val.precision)
    return _NO_VALUE   # leaflist, bytes, any, proto_bytes: nothing fabricwatch reads


_LIST_KEYS = ("name", "index", "interface-id", "id")


def flatten(elems: list, value) -> Iterator[tuple[list, object]]:
    """(leaf elems, scalar) pairs of a value: a JSON object becomes one leaf per member
    (``COUNTERS/Ethernet*`` + ``{"Ethernet0": {"SAI_...": "0"}}``); a JSON list of objects
    (a YANG list in JSON_IETF) is keyed by its ``name``/``index``/``interface-id``/``id``."""
    if isinstance(value, dict):
        for k, v in value.items():
            yield from flatten(elems + [(k, {})], v)
    elif isinstance(value, list):
        if not value or not all(isinstance(x, dict) for x in value):
            return   # a leaf-list: nothing fabricwatch reads
        name, last_keys = elems[-1] if elems else ("", {})
        for entry in value:
            key = next((k for k in entry if _strip(k) in _LIST_KEYS), None)
            if key is None:
                continue
            keyed = elems[:-1] + [(name, {**last_keys, _strip(key): str(entry[key])})]
            rest = {k: v for k, v in entry.items() if k != key}
            yield from flatten(keyed, rest)
    elif value is not _NO_VALUE and value is not None:
        yield elems, value


def natural_key(s: str):
    """``Ethernet2`` before ``Ethernet10``; ``Ethernet1/2`` before ``Ethernet1/10``."""
    return tuple((0, int(t), "") if t.isdigit() else (1, 0, t) for t in re.split(r"(\d+)", s) if t)


_COUNTER_ORDER = ["in-octets", "out-octets", "in-pkts", "out-pkts", "in-errors", "out-errors", "in-discards",
                  "out-discards", "interface-transitions"]
for _p in PFC_PRIORITIES:
    _COUNTER_ORDER += [f"pfc{_p}-rx-pkts", f"pfc{_p}-tx-pkts", f"pfc{_p}-rx-pause-duration-us",
                       f"queue{_p}-transmit-pkts", f"queue{_p}-transmit-octets"]
_GAUGE_ORDER = list(SWITCH_GAUGES) + [f"queue{_p}-occupancy-bytes" for _p in PFC_PRIORITIES]
_RANK = {n: i for i, n in enumerate(_COUNTER_ORDER + _GAUGE_ORDER)}


def _column_key(name: str):
    return (_RANK.get(name, len(_RANK)), name)


# --------------------------------------------------------------------------- assembly
class SwitchAssembler:
    """The current port table of one switch, and its ticks (see the module doc).

    Pure: no I/O, the caller passes the clocks, so snapshot assembly is unit-tested with
    hand-built notifications.
    """

    def __init__(self, switch: str, profile: CompiledProfile | str, *, interval_s: float = 1.0,
                 priorities=PFC_PRIORITIES, cluster: str = "", tick_quiet_s: float | None = None,
                 sync_timeout_s: float | None = None) -> None:
        if interval_s <= 0:
            raise ValueError("interval_s must be > 0")
        self.switch = switch
        self.profile = compile_profile(profile) if isinstance(profile, str) else profile
        self.interval_s = interval_s
        self.priorities = frozenset(int(p) for p in priorities)
        self.cluster = cluster
        self.tick_quiet_s = tick_quiet_s if tick_quiet_s else max(0.02, min(interval_s / 2, 2.0))
        self.sync_timeout_s = sync_timeout_s if sync_timeout_s else max(10.0, 5 * interval_s)
        self.seq = 0
        self.last_time_ns = 0
        self.stats: Counter[str] = Counter()
        self.unmapped_examples: list[str] = []
        self.oid_names: dict[str, str] = {}
        self.reset()

    # -- state ------------------------------------------------------------------------------
    def reset(self, now_mono: float | None = None) -> None:
        """Forget the table (a new stream's initial dump refills it); drop a half tick."""
        if getattr(self, "_pending", None):
            self.stats["partial_ticks_dropped"] += 1
        self.counters: dict[str, dict[str, int]] = {}
        self.gauges: dict[str, dict[str, float]] = {}
        self.ranks: dict[tuple[str, str], int] = {}
        self.synced = False
        self.stream_start_mono = now_mono
        self._pending: set[tuple[int, str, str]] = set()   # SAMPLE leaves (group, port, name) this tick
        self._expected: set[tuple[int, str, str]] = set()  # ... that a complete tick carries (learnt)
        self._expected_seen = 0                             # |pending & expected|
        self._incomplete_run = 0
        self._tick_mono: float | None = None
        self._tick_ns: int | None = None
        self._last_sample_mono: float | None = None

    # -- input ------------------------------------------------------------------------------
    def apply(self, notification: gnmi_pb2.Notification, now_mono: float, now_ns: int,
              group: int = 0) -> list[pb.Snapshot]:
        """Merge one notification of subscription `group`; returns the snapshot of a tick it
        completed, if any."""
        out: list[pb.Snapshot] = []
        if self.stream_start_mono is None:
            self.stream_start_mono = now_mono
        strip = self.profile.strip_module_prefixes
        prefix = path_elems(notification.prefix) if notification.HasField("prefix") else []
        for deleted in notification.delete:
            self._delete(canonical(prefix + path_elems(deleted), strip))
        for update in notification.update:
            self.stats["updates"] += 1
            if update.HasField("val"):
                value = decode_value(update.val)
            elif update.HasField("value"):       # gNMI < 0.4 `Value` (JSON bytes)
                try:
                    value = json.loads(update.value.value)
                except ValueError:
                    value = _NO_VALUE
            else:
                value = _NO_VALUE
            for leaf, scalar in flatten(prefix + path_elems(update.path), value):
                path = canonical(leaf, strip)
                match = self.profile.match(path)
                if match is None:
                    self.stats["unmapped_leaves"] += 1
                    if len(self.unmapped_examples) < 20 and path not in self.unmapped_examples:
                        self.unmapped_examples.append(path)
                        log.debug("%s: no %s rule for %s", self.switch, self.profile.name, path)
                    continue
                out += self._apply_leaf(match, scalar, now_mono, now_ns, group)
        return out

    def _port(self, match: Match) -> str | None:
        port = match.binds.get("port", "")
        if port.startswith("oid:"):          # SONiC raw COUNTERS:oid paths
            name = self.oid_names.get(port)
            if name is None:
                self.stats["unknown_oid"] += 1
            return name
        return port or None

    def _apply_leaf(self, match: Match, scalar, now_mono: float, now_ns: int, group: int) -> list[pb.Snapshot]:
        rule = match.rule
        if rule.kind == PORT_NAME_MAP:
            if isinstance(scalar, str) and scalar.startswith("oid:"):
                self.oid_names[scalar] = match.binds["port"]
            return []
        for ph in ("prio", "queue"):
            if ph in match.binds and int(match.binds[ph]) not in self.priorities:
                self.stats["other_priorities"] += 1
                return []
        port = self._port(match)
        if port is None:
            return []
        value = CONVERTERS[rule.convert](scalar)
        if value is None:
            self.stats["bad_values"] += 1
            return []
        name = rule.output_name(match.binds)
        key = (port, name)
        seen_rank = self.ranks.get(key)
        if seen_rank is not None and rule.rank < seen_rank:
            return []                         # a better source for this column exists
        self.ranks[key] = rule.rank
        out: list[pb.Snapshot] = []
        seen = (group, port, name)
        if rule.mode == SAMPLE and self.synced and seen in self._pending:
            # the same leaf again from one subscription: the next sample has begun (the new
            # value belongs to it), and what the closed tick lacked did not come in a whole sample
            out += self._flush("repeat")
        if rule.kind == COUNTER:
            self.counters.setdefault(port, {})[name] = value
        elif rule.kind == GAUGE:
            self.gauges.setdefault(port, {})[name] = value
        if rule.mode == SAMPLE:
            if self._tick_ns is None:
                self._tick_mono, self._tick_ns = now_mono, now_ns
            self._last_sample_mono = now_mono
            if seen not in self._pending:
                self._pending.add(seen)
                if seen in self._expected:
                    self._expected_seen += 1
            if self.synced and self._expected and self._expected_seen == len(self._expected):
                out += self._flush("complete")      # every leaf of a sample is in: send it now
        return out

    def _delete(self, path: str) -> None:
        port = self.profile.port_root(path)
        if port is not None:
            self.counters.pop(port, None)
            self.gauges.pop(port, None)
            self.ranks = {k: v for k, v in self.ranks.items() if k[0] != port}
            self._pending = {k for k in self._pending if k[1] != port}
            self._expected = {k for k in self._expected if k[1] != port}
            self._expected_seen = len(self._pending & self._expected)
            self.stats["deleted_ports"] += 1
            return
        match = self.profile.match(path)
        if match is None or match.rule.kind not in (COUNTER, GAUGE):
            return
        port = self._port(match)
        if port is None:
            return
        name = match.rule.output_name(match.binds)
        (self.counters if match.rule.kind == COUNTER else self.gauges).get(port, {}).pop(name, None)
        self.ranks.pop((port, name), None)
        self._expected = {k for k in self._expected if k[1:] != (port, name)}
        self._expected_seen = len(self._pending & self._expected)

    def sync(self, now_mono: float, now_ns: int) -> list[pb.Snapshot]:
        """The initial dump is complete (every subscription group sent ``sync_response``)."""
        self.synced = True
        if self._tick_ns is None:
            self._tick_mono, self._tick_ns = now_mono, now_ns
        return self._flush("sync")

    # -- time -------------------------------------------------------------------------------
    def due_in(self, now_mono: float) -> float | None:
        """Seconds until `poll` may flush something (None: nothing pending)."""
        if not self.synced:
            if self.stream_start_mono is None:
                return None
            return max(0.0, self.stream_start_mono + self.sync_timeout_s - now_mono)
        if not self._pending:
            return None
        return max(0.0, min(self._last_sample_mono + self.tick_quiet_s, self._tick_mono + self.interval_s) - now_mono)

    def poll(self, now_mono: float) -> list[pb.Snapshot]:
        if not self.synced:
            if self.stream_start_mono is not None and now_mono - self.stream_start_mono >= self.sync_timeout_s:
                log.warning("%s: no sync_response within %.0f s; emitting what arrived", self.switch,
                            self.sync_timeout_s)
                self.stats["sync_timeouts"] += 1
                return self.sync(now_mono, time.time_ns())
            return []
        if self._pending and now_mono - self._last_sample_mono >= self.tick_quiet_s:
            return self._flush("quiet")
        if self._pending and now_mono - self._tick_mono >= self.interval_s:
            return self._flush("age")
        return []

    # -- output -----------------------------------------------------------------------------
    def _flush(self, reason: str) -> list[pb.Snapshot]:
        """Close the tick: emit the table, and learn which SAMPLE leaves make a tick complete.

        The expected set comes from the initial dump (sync) and grows with complete ticks.
        It shrinks to what arrived only when a whole sample passed without the missing
        leaves ("repeat"), or after 3 ticks in a row closed by the quiet/age fallback, so a
        one-off stall in mid-burst does not teach it a partial set.
        """
        pending, t_ns = self._pending, self._tick_ns
        self.stats[f"ticks_closed_by_{reason}"] += 1
        if reason in ("sync", "complete"):
            self._expected |= pending
            self._incomplete_run = 0
        elif reason == "repeat" or not self._expected:
            self._expected = set(pending)
            self._incomplete_run = 0
        else:
            self._incomplete_run += 1
            if self._incomplete_run >= 3:
                self._expected = set(pending)
                self._incomplete_run = 0
        self._pending = set()
        self._expected_seen = 0
        self._tick_mono = self._tick_ns = self._last_sample_mono = None
        if t_ns is None:
            return []
        t_ns = max(t_ns, self.last_time_ns + 1)     # strictly increasing per source
        snap = self.build(t_ns)
        if snap is None:
            return []
        self.last_time_ns = t_ns
        self.stats["ticks"] += 1
        return [snap]

    def build(self, time_ns: int) -> pb.Snapshot | None:
        """The current table as a `Snapshot`; None when no port is known yet.

        Ports that report the same counter columns share one SWITCH_PORT block (normally
        all of them); a port whose leaves differ gets its own block rather than an invented
        value, since a uint64 counter has no "not read". Gauges never read are NaN.
        """
        rows = []
        derived = self.profile.derived
        for port in sorted(set(self.counters) | set(self.gauges), key=natural_key):
            counters = self.counters.get(port, {})
            values = {n: v for n, v in counters.items() if not n.startswith("~")}
            for out, parts in derived.items():
                if out not in values and all(p in counters for p in parts):
                    values[out] = sum(counters[p] for p in parts) & 0xFFFFFFFFFFFFFFFF
            gauges = self.gauges.get(port, {})
            if values or gauges:
                rows.append((port, values, gauges))
        if not rows:
            return None
        gauge_names = sorted({g for _, _, gs in rows for g in gs}, key=_column_key)
        blocks: dict[tuple[str, ...], pb.CounterBlock] = {}
        snap = pb.Snapshot(cluster=self.cluster, source=self.switch, source_kind=pb.SOURCE_KIND_SWITCH,
                           time_unix_ns=time_ns, seq=self.seq + 1)
        for port, values, gauges in rows:
            names = tuple(sorted(values, key=_column_key))
            block = blocks.get(names)
            if block is None:
                block = blocks[names] = snap.blocks.add(entity_kind=pb.ENTITY_KIND_SWITCH_PORT,
                                                        counter_names=names, gauge_names=gauge_names)
            block.entity_ids.append(port)
            block.counters.extend(values[n] for n in names)
            block.gauges.extend(gauges.get(g, math.nan) for g in gauge_names)
        if len(blocks) > 1:
            self.stats["split_blocks"] += 1
        self.seq += 1
        return snap


# --------------------------------------------------------------------------- settings
@dataclass(frozen=True)
class TlsSettings:
    ca: str = ""                 # PEM of the CA that signed the switch's certificate
    client_cert: str = ""        # mTLS: our certificate and key (optional)
    client_key: str = ""
    server_name: str = ""        # name to check in the switch's certificate (default: the host)
    skip_verify: bool = False    # accept whatever certificate the switch presents (pinned per connect)
    plaintext: bool = False      # no TLS at all: loopback targets only (tests, a local gNMI proxy)


@dataclass(frozen=True)
class SwitchSettings:
    name: str
    target: str                  # host:port
    profile: str = "openconfig"
    tls: TlsSettings = TlsSettings()
    username: str = ""
    password: str = field(default="", repr=False)
    auth: str = ""               # metadata | basic | none; "" = the profile's
    encoding: str = ""           # json_ietf | json | proto | ascii; "" = the profile's
    sample_interval_ms: int = 1000
    heartbeat_interval_ms: int = 60_000   # ON_CHANGE heartbeat; 0 = none
    priorities: tuple[int, ...] = tuple(PFC_PRIORITIES)
    tick_quiet_ms: int = 0       # 0 = min(interval/2, 2 s): closes a tick that never completes
    stall_timeout_s: float = 0   # 0 = max(3 intervals, 15 s) without any message
    backoff_initial_s: float = 0.5
    backoff_max_s: float = 30.0


def split_target(target: str) -> tuple[str, int]:
    """``host:port`` / ``[v6]:port`` -> (host, port)."""
    host, sep, port = target.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"target {target!r} is not host:port")
    return host.strip("[]"), int(port)



def subscribe_request(group: SubscriptionGroup, settings: SwitchSettings,
                      profile: CompiledProfile) -> gnmi_pb2.SubscribeRequest:
    """The STREAM `SubscribeRequest` of one group: SAMPLE with ``sample_interval`` in ns,
    ON_CHANGE with ``heartbeat_interval`` in ns."""
    subs = []
    for path, mode in expand_paths(group, settings.priorities):
        sub = gnmi_pb2.Subscription(path=xpath_to_path(path))
        if mode == SAMPLE:
            sub.mode = gnmi_pb2.SAMPLE
            sub.sample_interval = settings.sample_interval_ms * 1_000_000
        else:
            sub.mode = gnmi_pb2.ON_CHANGE
            sub.heartbeat_interval = settings.heartbeat_interval_ms * 1_000_000
        subs.append(sub)
    sl = gnmi_pb2.SubscriptionList(subscription=subs, mode=gnmi_pb2.SubscriptionList.STREAM,
                                   encoding=ENCODINGS[settings.encoding or profile.encoding])
    if group.target or group.origin:
        sl.prefix.CopyFrom(gnmi_pb2.Path(target=group.target, origin=group.origin))
    return gnmi_pb2.SubscribeRequest(subscribe=sl)


def auth_metadata(settings: SwitchSettings, profile: CompiledProfile) -> tuple[tuple[str, str], ...]:
    """gNMI credentials: ``username``/``password`` metadata (gNMI spec), or an HTTP Basic
    ``authorization`` header (Cumulus Linux, which ignores the metadata form)."""
    mode = settings.auth or profile.auth
    if not settings.username or mode == "none":
        return ()
    if mode == "basic":
        token = base64.b64encode(f"{settings.username}:{settings.password}".encode()).decode()
        return (("authorization", f"Basic {token}"),)
    return (("username", settings.username), ("password", settings.password))


def fetch_server_certificate(host: str, port: int, timeout_s: float = 10.0, client_cert: str = "",
                             client_key: str = "") -> tuple[bytes, str]:
    """(PEM, name in it) of the certificate the server presents, unverified: for
    ``skip_verify`` only. The name is its first DNS SAN, else an IP SAN, else its CN."""
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    ctx.check_hostname = False
    ctx.verify_mode = ssl.CERT_NONE
    ctx.set_alpn_protocols(["h2"])
    if client_cert:
        ctx.load_cert_chain(client_cert, client_key or None)
    with socket.create_connection((host, port), timeout=timeout_s) as sock:
        with ctx.wrap_socket(sock, server_hostname=None if _is_ip(host) else host) as tls:
            der = tls.getpeercert(binary_form=True)
    if not der:
        raise ssl.SSLError(f"{host}:{port} presented no certificate")
    return ssl.DER_cert_to_PEM_cert(der).encode(), certificate_name(der)


def _is_ip(host: str) -> bool:
    try:
        ipaddress.ip_address(host)
        return True
    except ValueError:
        return False


def certificate_name(der: bytes) -> str:
    from cryptography import x509
    from cryptography.x509.oid import NameOID

    cert = x509.load_der_x509_certificate(der)
    try:
        san = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
        dns = san.get_values_for_type(x509.DNSName)
        if dns:
            return dns[0]
        ips = san.get_values_for_type(x509.IPAddress)
        if ips:
            return str(ips[0])
    except x509.ExtensionNotFound:
        pass
    cns = cert.subject.get_attributes_for_oid(NameOID.COMMON_NAME)
    return str(cns[0].value) if cns else ""


class StreamStalled(ConnectionError):
    pass



async def open_channel(settings: SwitchSettings, options: list[tuple[str, object]] | None = None) -> grpc.aio.Channel:
    """A `grpc.aio` channel to a switch: plaintext (loopback only, checked at config time),
    or TLS with its CA, optional mTLS, and `skip_verify` pinning the presented certificate."""
    tls = settings.tls
    options = list(options or [])
    if tls.plaintext:
        return grpc.aio.insecure_channel(settings.target, options=options)
    root = None
    if tls.ca:
        with open(tls.ca, "rb") as fh:
            root = fh.read()
    name = tls.server_name
    if tls.skip_verify:
        log.warning("%s: skip_verify is set: accepting the certificate %s presents without verification",
                    settings.name, settings.target)
        host, port = split_target(settings.target)
        root, presented = await asyncio.to_thread(fetch_server_certificate, host, port, 10.0,
                                                  tls.client_cert, tls.client_key)
        name = name or presented
    key = chain = None
    if tls.client_cert:
        with open(tls.client_cert, "rb") as fh:
            chain = fh.read()
        with open(tls.client_key or tls.client_cert, "rb") as fh:
            key = fh.read()
    if name:
        options.append(("grpc.ssl_target_name_override", name))
    creds = grpc.ssl_channel_credentials(root_certificates=root, private_key=key, certificate_chain=chain)
    return grpc.aio.secure_channel(settings.target, creds, options=options)

class SwitchCollector:
    """Streams one switch for as long as `run` runs; calls `emit(snapshot)` once per tick."""

    def __init__(self, settings: SwitchSettings, emit: Callable[[pb.Snapshot], None], *, cluster: str = "") -> None:
        self.settings = settings
        self.profile = compile_profile(settings.profile)
        self.emit = emit
        interval = settings.sample_interval_ms / 1000
        self.assembler = SwitchAssembler(settings.name, self.profile, interval_s=interval,
                                         priorities=settings.priorities, cluster=cluster,
                                         tick_quiet_s=settings.tick_quiet_ms / 1000 or None)
        self.stall_timeout_s = settings.stall_timeout_s or max(3 * interval, 15.0)
        self.stats = self.assembler.stats
        self.host, self.port = split_target(settings.target)
        if settings.tls.plaintext and not is_loopback(self.host):
            raise ValueError(f"switch {settings.name}: plaintext gNMI is only allowed to a loopback target")

    # -- connection loop --------------------------------------------------------------------
    async def run(self, stop: asyncio.Event) -> None:
        backoff = self.settings.backoff_initial_s
        name = self.settings.name
        while not stop.is_set():
            syncs_before = self.stats["syncs"]
            try:
                await self._session(stop)
            except grpc.aio.AioRpcError as exc:
                self.stats["stream_errors"] += 1
                if exc.code() in (grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.PERMISSION_DENIED):
                    log.error("%s: the switch refused our credentials (%s): %s", name, exc.code().name,
                              exc.details())
                else:
                    log.warning("%s: gNMI stream broke (%s: %s)", name, exc.code().name, exc.details())
            except (OSError, ssl.SSLError) as exc:   # ConnectionError and StreamStalled included
                self.stats["stream_errors"] += 1
                log.warning("%s: gNMI connection failed: %s", name, exc)
            except Exception:                        # a bug or bad data must not stop the other switches
                self.stats["stream_errors"] += 1
                self.stats["unexpected_errors"] += 1
                log.exception("%s: unexpected error in the gNMI session; reconnecting", name)
            finally:
                self.assembler.reset()
            if stop.is_set():
                break
            if self.stats["syncs"] > syncs_before:
                backoff = self.settings.backoff_initial_s   # it worked for a while: start over
            delay = random.uniform(0.5, 1.0) * backoff       # jitter: switches must not redial in lockstep
            backoff = min(backoff * 2, self.settings.backoff_max_s)
            self.stats["reconnects"] += 1
            try:
                await asyncio.wait_for(stop.wait(), delay)
            except asyncio.TimeoutError:
                pass

    async def _channel(self) -> grpc.aio.Channel:
        return await open_channel(self.settings, [("grpc.max_receive_message_length", MAX_RECEIVE_BYTES)])

    async def _session(self, stop: asyncio.Event) -> None:
        metadata = auth_metadata(self.settings, self.profile)
        queue: asyncio.Queue = asyncio.Queue(maxsize=10_000)
        now = time.monotonic()
        self.assembler.reset(now)
        async with await self._channel() as channel:
            stub = gnmi_pb2_grpc.gNMIStub(channel)
            calls, readers = [], []
            try:
                for group in self.profile.groups:
                    call = stub.Subscribe(metadata=metadata)
                    calls.append(call)
                    await call.write(subscribe_request(group, self.settings, self.profile))
                    readers.append(asyncio.create_task(self._read(group, call, queue)))
                await self._consume(queue, stop, {g.name for g in self.profile.groups})
            finally:
                for call in calls:
                    call.cancel()
                for task in readers:
                    task.cancel()
                await asyncio.gather(*readers, return_exceptions=True)

    async def _read(self, group: SubscriptionGroup, call, queue: asyncio.Queue) -> None:
        try:
            async for response in call:
                await queue.put((group, response))
            await queue.put((group, ConnectionError(f"the switch ended subscription group {group.name!r}")))
        except grpc.aio.AioRpcError as exc:
            if group.optional and exc.code() in _REFUSED:
                await queue.put((group, None))
            else:
                await queue.put((group, exc))

    async def _consume(self, queue: asyncio.Queue, stop: asyncio.Event, unsynced: set[str]) -> None:
        asm = self.assembler
        last_message = time.monotonic()
        while not stop.is_set():
            now = time.monotonic()
            wait = min(0.5, max(0.0, last_message + self.stall_timeout_s - now))
            due = asm.due_in(now)
            if due is not None:
                wait = min(wait, due)
            item = None
            if queue.empty():
                try:
                    async with asyncio.timeout(wait):
                        item = await queue.get()
                except TimeoutError:
                    pass
            else:
                item = queue.get_nowait()
            batch = 0
            while item is not None:
                last_message = time.monotonic()
                self._handle(item, unsynced)
                batch += 1
                item = queue.get_nowait() if batch < 1000 and not queue.empty() else None
            now = time.monotonic()
            for snap in asm.poll(now):
                self.emit(snap)
            if now - last_message > self.stall_timeout_s:
                self.stats["stalls"] += 1
                raise StreamStalled(f"nothing received for {self.stall_timeout_s:.0f} s")

    def _handle(self, item, unsynced: set[str]) -> None:
        group, response = item
        asm = self.assembler
        if isinstance(response, BaseException):
            raise response
        if response is None:
            log.warning("%s: the switch refused optional subscription group %r (%s profile); continuing without it",
                        self.settings.name, group.name, self.profile.name)
            self.stats["refused_groups"] += 1
            response = gnmi_pb2.SubscribeResponse(sync_response=True)   # nothing more will come from it
        self.stats["responses"] += 1
        kind = response.WhichOneof("response")
        if kind == "update":
            for snap in asm.apply(response.update, time.monotonic(), time.time_ns(), group.index):
                self.emit(snap)
        elif kind == "sync_response":
            unsynced.discard(group.name)
            if not unsynced and not asm.synced:
                self.stats["syncs"] += 1
                log.info("%s: synced (%s profile)", self.settings.name, self.profile.name)
                for snap in asm.sync(time.monotonic(), time.time_ns()):
                    self.emit(snap)
        elif kind == "error":
            log.warning("%s: switch reported an error: %s", self.settings.name, response.error.message)
            self.stats["error_responses"] += 1


async def run_switches(settings: list[SwitchSettings], emit: Callable[[pb.Snapshot], None], stop: asyncio.Event,
                       *, cluster: str = "", collectors: list[SwitchCollector] | None = None) -> list[SwitchCollector]:
    """Run one collector task per switch until `stop` is set; returns the collectors (stats)."""
    made = [SwitchCollector(s, emit, cluster=cluster) for s in settings]
    if collectors is not None:
        collectors.extend(made)
    await asyncio.gather(*(c.run(stop) for c in made))
    return made
