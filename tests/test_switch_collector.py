"""The gNMI switch collector on real gNMI streams: an in-process scripted target, and the
openconfig/gnmi fake target (deploy/gnmi/build-fake-server.sh builds it with Go; skipped only
when Go is missing), over TLS/mTLS, through the real gRPC ingest service.
"""
from __future__ import annotations

import asyncio
import shutil
import signal
import socket
import subprocess
import time
from contextlib import contextmanager
from pathlib import Path

import grpc
import pytest
from helpers import OC, RecordingSink, notif, table

from fabricwatch.collectors.gnmi_decode import canonical, gnmi_pb2, gnmi_pb2_grpc, path_elems
from fabricwatch.collectors.gnmi_switch import (
    SwitchCollector,
    SwitchSettings,
    TlsSettings,
)
from fabricwatch.collectors.switch import collect, parse_config
from fabricwatch.protos.v1 import telemetry_pb2_grpc as pb_grpc
from fabricwatch.streams import topics
from fabricwatch.streams.decode import to_view
from fabricwatch.streams.gateway import IngestService

REPO = Path(__file__).resolve().parents[1]
FIXTURES = REPO / "tests" / "fixtures" / "gnmi"


# ----------------------------------------------------------------------------- helpers


# ----------------------------------------------------------------------------- in-process gNMI target
class ScriptedTarget(gnmi_pb2_grpc.gNMIServicer):
    """A small gNMI target: records metadata and requests, refuses qos paths, streams counters."""

    def __init__(self):
        self.metadata: list[dict] = []
        self.requests: list[gnmi_pb2.SubscribeRequest] = []

    async def Subscribe(self, request_iterator, context):
        self.metadata.append(dict(context.invocation_metadata()))
        request = await request_iterator.__anext__()
        self.requests.append(request)
        paths = [canonical(path_elems(s.path)) for s in request.subscribe.subscription]
        if any(p.startswith("qos") for p in paths):
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "qos paths are not supported")
        k = 0
        while True:
            yield gnmi_pb2.SubscribeResponse(update=notif([(OC.format("Ethernet0") + "/state/counters/in-octets", k)]))
            if k == 0:
                yield gnmi_pb2.SubscribeResponse(sync_response=True)
            k += 1
            await asyncio.sleep(0.05)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


async def until(predicate, timeout_s: float, what: str):
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s} s waiting for {what}")
        await asyncio.sleep(0.02)


async def test_credentials_metadata_and_a_refused_optional_group_against_a_grpc_target():
    target, port = ScriptedTarget(), free_port()
    server = grpc.aio.server()
    gnmi_pb2_grpc.add_gNMIServicer_to_server(target, server)
    server.add_insecure_port(f"127.0.0.1:{port}")
    await server.start()
    snaps, stop = [], asyncio.Event()
    settings = SwitchSettings(name="leaf-01", target=f"127.0.0.1:{port}", tls=TlsSettings(plaintext=True),
                              username="telemetry", password="pw", sample_interval_ms=50)
    collector = SwitchCollector(settings, snaps.append)
    task = asyncio.create_task(collector.run(stop))
    try:
        await until(lambda: len(snaps) >= 3, 10, "3 snapshots")
        assert collector.stats["refused_groups"] == 1 and collector.stats["stream_errors"] == 0
        assert all(md["username"] == "telemetry" and md["password"] == "pw" for md in target.metadata)
        sample = target.requests[0].subscribe.subscription[0]
        assert (sample.mode, sample.sample_interval) == (gnmi_pb2.SAMPLE, 50_000_000)
        values = [table(s)["Ethernet0"]["in-octets"] for s in snaps]
        assert values == sorted(values) and [s.seq for s in snaps] == list(range(1, len(snaps) + 1))
    finally:
        stop.set()
        await asyncio.wait_for(task, 10)
        await server.stop(0)


# ----------------------------------------------------------------------------- the real fake target
@pytest.fixture(scope="session")
def fake_server_bin() -> str:
    """The fake gNMI target, built once (minutes on a cold module cache, then cached)."""
    if shutil.which("go") is None:
        pytest.skip("Go is not installed: cannot build the openconfig/gnmi fake gNMI target "
                    "(deploy/gnmi/build-fake-server.sh)")
    script = REPO / "deploy" / "gnmi" / "build-fake-server.sh"
    built = subprocess.run([str(script)], capture_output=True, text=True, timeout=1800)
    if built.returncode != 0:
        raise RuntimeError(f"deploy/gnmi/build-fake-server.sh failed:\n{built.stderr[-4000:]}")
    return built.stdout.strip().splitlines()[-1]


def openssl(*args: str) -> None:
    subprocess.run(["openssl", *args], check=True, capture_output=True)


@pytest.fixture(scope="session")
def pki(tmp_path_factory) -> dict[str, str]:
    """A test CA, a server certificate for localhost/127.0.0.1, a client certificate, and a
    self-signed server certificate, all P-256 and valid for a day."""
    if shutil.which("openssl") is None:
        pytest.skip("openssl not found")
    d = tmp_path_factory.mktemp("pki")
    ec = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]
    openssl("req", "-x509", *ec, "-keyout", f"{d}/ca.key", "-out", f"{d}/ca.pem", "-days", "1",
            "-subj", "/CN=fabricwatch test CA")
    for who, ext in (("server", "subjectAltName=DNS:localhost,IP:127.0.0.1\nextendedKeyUsage=serverAuth"),
                     ("client", "extendedKeyUsage=clientAuth")):
        (d / f"{who}.ext").write_text(ext + "\n")
        openssl("req", *ec, "-keyout", f"{d}/{who}.key", "-out", f"{d}/{who}.csr", "-subj", f"/CN=fabricwatch-{who}")
        openssl("x509", "-req", "-in", f"{d}/{who}.csr", "-CA", f"{d}/ca.pem", "-CAkey", f"{d}/ca.key",
                "-CAcreateserial", "-out", f"{d}/{who}.pem", "-days", "1", "-extfile", f"{d}/{who}.ext")
    openssl("req", "-x509", *ec, "-keyout", f"{d}/self.key", "-out", f"{d}/self.pem", "-days", "1",
            "-subj", "/CN=localhost", "-addext", "subjectAltName=DNS:localhost,IP:127.0.0.1")
    return {n: str(d / n) for n in ("ca.pem", "server.pem", "server.key", "client.pem", "client.key",
                                    "self.pem", "self.key")}


class FakeTarget:
    """One fake_server_loopback process serving a fixture config on 127.0.0.1:port."""

    def __init__(self, binary: str, config: Path, pki: dict, port: int, *, mtls: bool, log_path: Path):
        self.args = [binary, "-config", str(config), "-text", "-listen_addr", "127.0.0.1", "-port", str(port)]
        if mtls:
            self.args += ["-server_crt", pki["server.pem"], "-server_key", pki["server.key"], "-ca_crt", pki["ca.pem"]]
        else:
            self.args += ["-server_crt", pki["self.pem"], "-server_key", pki["self.key"], "-allow_no_client_auth"]
        self.port, self.log_path, self.proc = port, log_path, None

    def start(self) -> FakeTarget:
        self.log = open(self.log_path, "ab")
        self.proc = subprocess.Popen(self.args, stdout=self.log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 15
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"fake gNMI target exited: {self.log_path.read_text()[-2000:]}")
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=0.2):
                    return self
            except OSError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.05)

    def kill(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(10)
        self.log.close()


@contextmanager
def fake_target(binary, config, pki, tmp_path, *, mtls=True, port=None):
    target = FakeTarget(binary, config, pki, port or free_port(), mtls=mtls, log_path=tmp_path / "fake.log").start()
    try:
        yield target
    finally:
        target.kill()


# Fixture values (tests/fixtures/gnmi/openconfig.textproto): port i, sample k.
OC_PORTS = ["Ethernet0", "Ethernet8", "Ethernet16", "Ethernet24"]
OC_COUNTERS = {  # name: (start for port i = base * (i + 1), delta per sample)
    "in-octets": (1_000_000, 125_000_000), "out-octets": (2_000_000, 100_000_000),
    "in-pkts": (1_000, 100_000), "out-pkts": (2_000, 80_000),
}


def sample_index(snap_table: dict) -> int:
    """k of a snapshot, after checking that every counter of every port is at that same k."""
    ks = set()
    for i, port in enumerate(OC_PORTS):
        for name, (base, delta) in OC_COUNTERS.items():
            k, rem = divmod(snap_table[port][name] - base * (i + 1), delta)
            assert rem == 0, (port, name, snap_table[port][name])
            ks.add(k)
    assert len(ks) == 1, f"one snapshot mixes samples {sorted(ks)}"
    return ks.pop()


async def test_end_to_end_fake_target_over_mtls_to_the_gateway(fake_server_bin, pki, tmp_path):
    """mTLS on both sides: to the switch's gNMI server, and to a gateway run with --client-ca
    (the collector presents `gateway.client_cert`, as the node collector and the rank SDK do)."""
    from fabricwatch.streams.gateway import server_credentials

    sink, gw_port = RecordingSink(), free_port()
    gateway = grpc.aio.server()
    # the cluster of every snapshot is the gateway's (or its token's), whatever the collector says
    pb_grpc.add_IngestServicer_to_server(IngestService(sink, cluster="c1"), gateway)
    gateway.add_secure_port(f"127.0.0.1:{gw_port}", server_credentials(pki["server.pem"], pki["server.key"],
                                                                       client_ca_path=pki["ca.pem"]))
    await gateway.start()
    with fake_target(fake_server_bin, FIXTURES / "openconfig.textproto", pki, tmp_path, mtls=True) as fake:
        config = parse_config({
            "cluster": "c1",
            "gateway": {"target": f"127.0.0.1:{gw_port}", "token": "", "ca": pki["ca.pem"],
                        "client_cert": pki["client.pem"], "client_key": pki["client.key"]},
            "switches": [{"name": "leaf-01", "target": f"127.0.0.1:{fake.port}", "profile": "openconfig",
                          "sample_interval_ms": 200, "priorities": [3],
                          "tls": {"ca": pki["ca.pem"], "client_cert": pki["client.pem"],
                                  "client_key": pki["client.key"]}}],
        }, tmp_path)
        stop = asyncio.Event()
        task = asyncio.create_task(collect(config, stop=stop))
        try:
            await until(lambda: len(sink.snapshots()) >= 6, 20, "6 snapshots at the gateway")
        finally:
            stop.set()
            stats = await asyncio.wait_for(task, 20)
    await gateway.stop(0)
    assert stats["drained"] == 1 and stats["sender_rejected"] == 0 and stats["stream_errors"] == 0
    assert {(t, k) for t, k, _ in sink.records} == {(topics.TELEMETRY, b"leaf-01")}
    snaps = sink.snapshots()
    assert [s.seq for s in snaps] == list(range(1, len(snaps) + 1))
    views = [to_view(s) for s in snaps]
    assert all((v.cluster, v.source, v.source_kind) == ("c1", "leaf-01", "switch") for v in views)
    # every snapshot is exactly one sample of the fake: all counters of all ports at one k,
    # k = 0, 1, 2, ... with none skipped or split, raw values as served
    ks = [sample_index(table(s)) for s in snaps]
    assert ks == list(range(len(ks))), ks
    [frame] = views[-1].frames
    assert frame.kind == "switch_port" and frame.ids == tuple(OC_PORTS)
    assert frame.counter_names == ("in-octets", "out-octets", "in-pkts", "out-pkts", "in-errors",
                                   "interface-transitions")
    assert frame.gauge_names == ("port_speed_gbps", "oper_up", "admin_up")
    assert frame.gauges.tolist() == [[400, 1, 1], [400, 1, 1], [100, 1, 1], [400, 0, 1]]
    assert frame.counters[:, 4].tolist() == [0, 1, 2, 3] and frame.counters[:, 5].tolist() == [2, 2, 2, 4]
    gaps = sorted(b.time_ns - a.time_ns for a, b in zip(views, views[1:]))
    assert 0.15e9 < gaps[len(gaps) // 2] < 0.3e9, f"snapshots about one 200 ms sample apart: {gaps}"


@pytest.mark.parametrize("tls_case", ["no client certificate", "untrusted server certificate"])
async def test_tls_failures_send_nothing_and_keep_retrying(fake_server_bin, pki, tmp_path, tls_case):
    tls = {"no client certificate": TlsSettings(ca=pki["ca.pem"]),
           "untrusted server certificate": TlsSettings(ca=pki["self.pem"], client_cert=pki["client.pem"],
                                                       client_key=pki["client.key"])}[tls_case]
    snaps, stop = [], asyncio.Event()
    with fake_target(fake_server_bin, FIXTURES / "openconfig.textproto", pki, tmp_path, mtls=True) as fake:
        collector = SwitchCollector(SwitchSettings(name="leaf-01", target=f"127.0.0.1:{fake.port}", tls=tls,
                                                   sample_interval_ms=200, backoff_initial_s=0.05,
                                                   backoff_max_s=0.1), snaps.append)
        task = asyncio.create_task(collector.run(stop))
        try:
            await until(lambda: collector.stats["stream_errors"] >= 2, 15, "two failed attempts")
        finally:
            stop.set()
            await asyncio.wait_for(task, 10)
    assert snaps == [] and collector.stats["syncs"] == 0


async def test_arista_profile_pfc_from_the_fake_target_with_skip_verify(fake_server_bin, pki, tmp_path):
    snaps, stop = [], asyncio.Event()
    with fake_target(fake_server_bin, FIXTURES / "arista.textproto", pki, tmp_path, mtls=False) as fake:
        settings = SwitchSettings(name="spine-01", target=f"127.0.0.1:{fake.port}", profile="arista",
                                  tls=TlsSettings(skip_verify=True), sample_interval_ms=200, priorities=(3,))
        collector = SwitchCollector(settings, snaps.append)
        task = asyncio.create_task(collector.run(stop))
        try:
            await until(lambda: len(snaps) >= 4, 20, "4 snapshots")
        finally:
            stop.set()
            await asyncio.wait_for(task, 10)
    first, last = table(snaps[0]), table(snaps[-1])
    assert set(last) == {"Ethernet1/1", "Ethernet1/2"}
    assert set(last["Ethernet1/1"]) == {
        "in-octets", "out-octets", "interface-transitions", "pfc3-rx-pkts", "pfc3-tx-pkts",
        "pfc3-rx-pause-duration-us", "queue3-transmit-pkts", "queue3-transmit-octets", "port_speed_gbps", "oper_up"}
    k = len(snaps) - 1
    e1 = last["Ethernet1/2"]
    assert (e1["pfc3-rx-pkts"], e1["pfc3-tx-pkts"]) == (200 + 1_000 * k, 20 + 10 * k)
    # 6_001_998 ns + 50e6 ns per sample, reported in us (floor)
    assert e1["pfc3-rx-pause-duration-us"] == (6_001_998 + 50_000_000 * k) // 1000
    assert first["Ethernet1/1"]["pfc3-rx-pause-duration-us"] == 3_000
    assert (e1["interface-transitions"], e1["port_speed_gbps"], e1["oper_up"]) == (6, 400.0, 1.0)
    assert collector.stats["unmapped_leaves"] > 0 and collector.stats["other_priorities"] > 0


@pytest.mark.slow
async def test_collector_recovers_when_the_switch_restarts(fake_server_bin, pki, tmp_path):
    snaps, stop = [], asyncio.Event()
    port = free_port()
    settings = SwitchSettings(name="leaf-01", target=f"127.0.0.1:{port}", tls=TlsSettings(ca=pki["self.pem"]),
                              sample_interval_ms=200, backoff_initial_s=0.1, backoff_max_s=0.5)
    collector = SwitchCollector(settings, snaps.append)
    config = FIXTURES / "openconfig.textproto"
    first = FakeTarget(fake_server_bin, config, pki, port, mtls=False, log_path=tmp_path / "fake1.log").start()
    task = asyncio.create_task(collector.run(stop))
    try:
        await until(lambda: len(snaps) >= 3, 20, "3 snapshots before the restart")
        first.kill()                                             # the switch goes away
        await until(lambda: collector.stats["stream_errors"] >= 1, 10, "the stream error")
        before = len(snaps)
        await asyncio.sleep(0.6)                                 # a few failed redials
        assert len(snaps) == before
        second = FakeTarget(fake_server_bin, config, pki, port, mtls=False, log_path=tmp_path / "fake2.log").start()
        try:
            await until(lambda: len(snaps) >= before + 3, 20, "3 snapshots after the restart")
        finally:
            second.kill()
    finally:
        stop.set()
        await asyncio.wait_for(task, 10)
    assert collector.stats["reconnects"] >= 1 and collector.stats["syncs"] >= 2
    assert [s.seq for s in snaps] == list(range(1, len(snaps) + 1))      # seq continues across streams
    ks = [sample_index(table(s)) for s in snaps]
    assert ks[before] == 0 and ks[before:] == list(range(len(ks) - before))   # a fresh switch: counters restart
    assert all(b.time_unix_ns > a.time_unix_ns for a, b in zip(snaps, snaps[1:]))
