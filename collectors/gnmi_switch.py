"""asyncio gNMI collector: switch port counters -> one `Snapshot` per sampling tick.

One `SwitchCollector` per switch (one asyncio task each, any number per process). It dials
the switch over TLS (`grpc.aio`), opens one gNMI ``Subscribe`` (mode STREAM) per
subscription group of the switch's profile (`gnmi_profiles`), and merges every update
into the switch's current port table (`gnmi_assembler.SwitchAssembler`). Counter leaves
are subscribed SAMPLE (``sample_interval`` in nanoseconds), status leaves ON_CHANGE (with
a heartbeat).

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
sent. The gNMI stubs are pygnmi's compiled gNMI 0.8.0 protos (`pygnmi.spec.v080`, imported
in `gnmi_decode`), used with `grpc.aio`; pygnmi's own (threaded) client is not used.

This module: the settings of a switch, the connection (TLS, credentials, subscribe
requests) and the collector's stream loop; paths and values are decoded in `gnmi_decode`,
the table and its ticks assembled in `gnmi_assembler`.
"""
from __future__ import annotations

import asyncio
import base64
import ipaddress
import logging
import socket
import ssl
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import grpc

from fabricwatch.backoff import Backoff
from fabricwatch.counters import PFC_PRIORITIES
from fabricwatch.netaddr import is_loopback
from fabricwatch.protos.v1 import telemetry_pb2 as pb

from .gnmi_assembler import SwitchAssembler
from .gnmi_decode import gnmi_pb2, gnmi_pb2_grpc, xpath_to_path
from .gnmi_profiles import SAMPLE, CompiledProfile, SubscriptionGroup, compile_profile, expand_paths

log = logging.getLogger("fabricwatch.switch")

ENCODINGS = {"json": gnmi_pb2.JSON, "json_ietf": gnmi_pb2.JSON_IETF, "proto": gnmi_pb2.PROTO,
             "ascii": gnmi_pb2.ASCII, "bytes": gnmi_pb2.BYTES}
AUTH_MODES = ("metadata", "basic", "none")
# Optional subscription groups the device refuses are switched off for the session.
_REFUSED = {grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.NOT_FOUND, grpc.StatusCode.UNIMPLEMENTED,
            grpc.StatusCode.FAILED_PRECONDITION}
MAX_RECEIVE_BYTES = 64 * 1024 * 1024   # SONiC sends all ports' counters as one JSON blob

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
        backoff = Backoff(self.settings.backoff_initial_s, self.settings.backoff_max_s)
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
                backoff.reset()                              # it worked for a while: start over
            delay_s = backoff.next_s()
            self.stats["reconnects"] += 1
            try:
                await asyncio.wait_for(stop.wait(), delay_s)
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
