"""Small builders of wire-format snapshots for tests, and the in-process gateway they go through."""
from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path
from types import SimpleNamespace

import grpc
import pynvml
from aiokafka import AIOKafkaConsumer

from fabricwatch.collectors.ethtool_stats import RecordedSource
from fabricwatch.collectors.gnmi_decode import gnmi_pb2, xpath_to_path
from fabricwatch.models.topology import rail_optimised
from fabricwatch.protos.v1 import events_pb2 as ev
from fabricwatch.protos.v1 import telemetry_pb2 as pb
from fabricwatch.protos.v1 import telemetry_pb2_grpc as pb_grpc
from fabricwatch.rank import RankIdentity
from fabricwatch.simulator.cluster import ClusterSimulator
from fabricwatch.simulator.workload import Job
from fabricwatch.streams import topics
from fabricwatch.streams.validate import validate_snapshot

NIC_COUNTERS = ["port_xmit_data", "port_rcv_data", "tx_prio3_pause", "tx_prio3_pause_duration",
                "rx_prio3_pause", "rx_prio3_pause_duration"]
NIC_GAUGES = ["netdev_speed_mbps", "pcie_width_current", "pcie_width_max", "pcie_gen_current", "pcie_gen_max"]
GPU_GAUGES = ["utilization_gpu_pct", "pcie_gen_current", "pcie_gen_max", "pcie_width_current", "pcie_width_max",
              "temperature_c", "power_mw"]


def nic_snapshot(source="node-0001", t_ns=None, seq=1, rates=None, n_ports=8, counters=None, cluster="c1",
                 state="4: ACTIVE") -> pb.Snapshot:
    """A node snapshot with one NIC block; `rates` maps port index -> sysfs rate string."""
    t_ns = time.time_ns() if t_ns is None else t_ns
    rates = [(rates or {}).get(i, "400 Gb/sec (4X NDR)") for i in range(n_ports)]
    snap = pb.Snapshot(cluster=cluster, source=source, source_kind=pb.SOURCE_KIND_NODE, time_unix_ns=t_ns, seq=seq)
    block = snap.blocks.add(entity_kind=pb.ENTITY_KIND_NIC_PORT, entity_ids=[f"mlx5_{i}/1" for i in range(n_ports)],
                            counter_names=NIC_COUNTERS, gauge_names=NIC_GAUGES)
    for i in range(n_ports):
        block.counters.extend(counters[i] if counters else [seq * 1000 + i] * len(NIC_COUNTERS))
        block.gauges.extend([float(rates[i].split()[0]) * 1000, 16, 16, 5, 5])
    for name, values in (("rate", rates), ("state", [state] * n_ports), ("phys_state", ["5: LinkUp"] * n_ports),
                         ("link_layer", ["Ethernet"] * n_ports), ("netdev", [f"eth{i}" for i in range(n_ports)])):
        block.labels.add(name=name, values=values)
    return snap


def gpu_block(snap: pb.Snapshot, util=90.0, gen=5, gen_max=5, width=16, width_max=16, n=8) -> pb.CounterBlock:
    block = snap.blocks.add(entity_kind=pb.ENTITY_KIND_GPU, entity_ids=[f"gpu{i}" for i in range(n)],
                            counter_names=["ecc_uncorrected_volatile_total"], gauge_names=GPU_GAUGES,
                            counters=[0] * n)
    for _ in range(n):
        block.gauges.extend([util, gen, gen_max, width, width_max, 60, 500_000])
    return block


def gauge(block: pb.CounterBlock, entity: int, name: str) -> float:
    return block.gauges[entity * len(block.gauge_names) + list(block.gauge_names).index(name)]


def set_gauge(block: pb.CounterBlock, entity: int, name: str, value: float) -> None:
    block.gauges[entity * len(block.gauge_names) + list(block.gauge_names).index(name)] = value


def entity_rows(block: pb.CounterBlock) -> list[SimpleNamespace]:
    """The entities of a columnar block as rows with .id, .counters, .gauges, .labels."""
    m, k = len(block.counter_names), len(block.gauge_names)
    labels = {column.name: list(column.values) for column in block.labels}
    return [SimpleNamespace(id=eid, counters=list(block.counters[i * m:(i + 1) * m]),
                            gauges=list(block.gauges[i * k:(i + 1) * k]),
                            labels={name: values[i] for name, values in labels.items()})
            for i, eid in enumerate(block.entity_ids)]


class RecordingSink:
    """Stands in for Kafka behind a real in-process gRPC gateway: keeps (topic, key, value)."""

    def __init__(self):
        self.records = []
        self.fail = False

    async def write(self, records):
        if self.fail:
            raise ConnectionError("broker down")
        self.records.extend(records)

    def snapshots(self):
        """The snapshots of every telemetry record written, in order."""
        from fabricwatch.streams import topics

        return [snap for t, k, v in self.records if t == topics.TELEMETRY for snap in telemetry_snapshots(v)]



def telemetry_snapshots(value: bytes) -> list[pb.Snapshot]:
    """The snapshots (ticks) of one telemetry-topic record, a `SourceRecord`."""
    from fabricwatch.protos.v1 import records_pb2 as rec
    from fabricwatch.streams.decode import unpack

    return list(unpack(rec.SourceRecord.FromString(value)))


def telemetry_value(*snaps) -> bytes:
    """The telemetry topic's value for these ticks of one source (what the gateway writes)."""
    from fabricwatch.streams.decode import pack

    return pack(snaps).SerializeToString()


class FakeTime:
    """A clock to inject (``clock=fake``) and its asyncio-style sleep (``sleep=fake.sleep``):
    sleeping moves the clock on at once and is recorded, so timing logic is tested exactly
    and without waiting."""

    def __init__(self, start_s: float = 1000.0) -> None:
        self.now_s = start_s
        self.slept: list[float] = []

    def __call__(self) -> float:
        return self.now_s

    async def sleep(self, seconds: float) -> None:
        self.slept.append(seconds)
        self.now_s += seconds


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


async def start_server(service, port):
    """The real gRPC ingest server around `service`, on 127.0.0.1:port, plaintext, registered as
    the gateway registers it (raw requests, parsed after auth and admission)."""
    import grpc

    server = grpc.aio.server()
    service.add_to_server(server)
    server.add_insecure_port(f"127.0.0.1:{port}")
    await server.start()
    return server


@contextlib.asynccontextmanager
async def running_gateway(bootstrap: str, port: int | None = None, cluster: str = "it", **options):
    """The real gateway (`streams.gateway.serve`) in this process on 127.0.0.1; yields host:port.
    `options` are serve's keywords (auth, limits, ...)."""
    from fabricwatch.streams import topics
    from fabricwatch.streams.gateway import serve

    await topics.ensure_topics(bootstrap, topics.ALL_TOPICS)
    stop, ready = asyncio.Event(), asyncio.Event()
    listen = f"127.0.0.1:{port or free_port()}"
    gateway = asyncio.create_task(serve(bootstrap, listen, ready=ready, stop=stop, cluster=cluster, **options))
    try:
        await asyncio.wait_for(ready.wait(), 60)
        yield listen
    finally:
        stop.set()
        await gateway


@contextlib.asynccontextmanager
async def gateway_and_sender(bootstrap: str, port: int | None = None, cluster: str = "it", **sender_options):
    """`running_gateway` (stamping `cluster` on every snapshot) and a `GatewaySender` streaming to it."""
    from fabricwatch.collectors.sender import GatewaySender, SenderConfig

    async with running_gateway(bootstrap, port, cluster) as listen, \
            running(GatewaySender(SenderConfig(target=listen, **sender_options))) as sender:
        yield sender


@contextlib.asynccontextmanager
async def running(sender):
    """A `GatewaySender` streaming in the background for the duration of the block."""
    stop = asyncio.Event()
    task = asyncio.create_task(sender.run(stop))
    try:
        yield sender
    finally:
        stop.set()
        await task


async def read_topic(bootstrap: str, topic: str, keys: set[str], since_unix_s: float = 0.0) -> list[tuple[str, bytes]]:
    """(key, value) of every record of `topic` whose key is in `keys`, from the beginning (or
    from the first record written at `since_unix_s`) to the end offsets of now, in partition order."""
    from aiokafka import AIOKafkaConsumer

    consumer = AIOKafkaConsumer(topic, bootstrap_servers=bootstrap, group_id=None, auto_offset_reset="earliest",
                                enable_auto_commit=False)
    await consumer.start()
    found: list[tuple[str, bytes]] = []
    try:
        while not consumer.assignment():
            await asyncio.sleep(0.05)
        parts = list(consumer.assignment())
        end = await consumer.end_offsets(parts)
        if since_unix_s:
            starts = await consumer.offsets_for_times({tp: int(since_unix_s * 1000) for tp in parts})
            for tp in parts:
                if starts[tp] is None:
                    consumer.seek(tp, end[tp])
                else:
                    consumer.seek(tp, starts[tp].offset)
        while [tp for tp in parts if await consumer.position(tp) < end[tp]]:
            for records in (await consumer.getmany(timeout_ms=500, max_records=5000)).values():
                found += [(r.key.decode(), r.value) for r in records if r.key and r.key.decode() in keys]
    finally:
        await consumer.stop()
    return found


# ---------------------------------------------------------------------- service processes
WORKER_READY_TIMEOUT_S = 120
# Short Kafka group timeouts so that a worker takes over a killed one's partitions in
# seconds (Faust's default session timeout is 60 s); read by Faust from the environment.
FAST_GROUP_ENV = {"BROKER_SESSION_TIMEOUT": "6", "BROKER_HEARTBEAT_INTERVAL": "1"}


class Process:
    """A service under test as a child process: `kill()` is kill -9, `stop()` a SIGTERM first."""

    proc: subprocess.Popen | None = None
    stop_timeout_s = 30.0

    def kill(self) -> None:
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(10)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(self.stop_timeout_s)
            except subprocess.TimeoutExpired:
                self.kill()


async def wait_caught_up(bootstrap: str, group: str, workers: list, timeout_s: float,
                         inputs: tuple[str, ...] | None = None) -> None:
    """Until ``group`` has committed every input partition to its end (its workers still alive).

    A fresh group reads its topics from the beginning: on a broker that earlier tests wrote
    to, that is a backlog whose drain time depends on what ran before, not on the test.
    """
    from fabricwatch.streams.status import INPUTS, group_lag

    deadline = time.monotonic() + timeout_s
    while True:
        lags = await group_lag(bootstrap, group, inputs or INPUTS)
        if all(t.lag == 0 for t in lags):
            return
        for w in workers:
            assert w.proc.poll() is None or w.proc.returncode == -9, w.log_path.read_text()[-3000:]
        assert time.monotonic() < deadline, f"{group}: not caught up in {timeout_s} s: {lags}"
        await asyncio.sleep(1.0)


class Worker(Process):
    """One `fabricwatch worker` process; `start()` starts it (again)."""

    def __init__(self, bootstrap: str, logs: Path, app_id: str, name: str, *extra: str, env=None) -> None:
        self.bootstrap, self.logs, self.app_id, self.name = bootstrap, logs, app_id, name
        self.extra, self.env = extra, env or {}
        self.proc: subprocess.Popen | None = None

    @property
    def log_path(self) -> Path:
        return self.logs / f"{self.name}.log"

    def start(self) -> Worker:
        ready = self.logs / f"{self.name}.ready"
        ready.unlink(missing_ok=True)
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "fabricwatch.cli", "--log-level", "INFO", "worker", "--broker", self.bootstrap,
                 "--app-id", self.app_id, *self.extra], stdout=log, stderr=subprocess.STDOUT,
                env={**os.environ, **self.env, "FABRICWATCH_WORKER_READY_FILE": str(ready)})
        deadline = time.monotonic() + WORKER_READY_TIMEOUT_S
        while not ready.exists():
            assert self.proc.poll() is None, self.log_path.read_text()[-3000:]
            assert time.monotonic() < deadline, f"{self.name} did not join its group in {WORKER_READY_TIMEOUT_S} s"
            time.sleep(0.2)
        return self


# ---------------------------------------------------------------------- node collector: recorded fixtures
# tests/fixtures/sysfs/roce_cx7 (ConnectX-7 RoCE, 8 ports), sysfs/ib_ndr (InfiniBand NDR, 2 ports),
# ethtool/mlx5_cx7.txt (`ethtool -S` of a ConnectX-7 netdev)
FIXTURES = Path(__file__).parent / "fixtures"
ROCE = FIXTURES / "sysfs" / "roce_cx7"
IB = FIXTURES / "sysfs" / "ib_ndr"
ETHTOOL_TXT = FIXTURES / "ethtool" / "mlx5_cx7.txt"
ROCE_NETDEVS = ["enp24s0np0", "enp64s0np0", "enp79s0np0", "enp94s0np0", "enp154s0np0", "enp192s0np0",
                "enp206s0np0", "enp220s0np0"]


def rows_by_id(rows):
    return {r.entity_id: r for r in rows}


def copy_tree(src: Path, tmp_path: Path) -> Path:
    dst = tmp_path / src.name
    shutil.copytree(src, dst, symlinks=True)
    return dst


def recorded_ethtool() -> RecordedSource:
    return RecordedSource({netdev: str(ETHTOOL_TXT) for netdev in ROCE_NETDEVS})


def block_rows(block):
    m, k = len(block.counter_names), len(block.gauge_names)
    labels = {c.name: list(c.values) for c in block.labels}
    return {eid: SimpleNamespace(counters=dict(zip(block.counter_names, block.counters[i * m:(i + 1) * m])),
                                 gauges=dict(zip(block.gauge_names, block.gauges[i * k:(i + 1) * k])),
                                 labels={n: v[i] for n, v in labels.items()})
            for i, eid in enumerate(block.entity_ids)}


def nvml_error(code):
    return pynvml.NVMLError(code)


# ---------------------------------------------------------------------- rank SDK: a gateway stand-in with the real validation
IDENT = RankIdentity("job-t", 1, 4, "node-a", 1, "manual")


def closed_port() -> int:
    """A loopback port nobody listens on (bound then released)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class FakeGateway(pb_grpc.IngestServicer):
    """Ingest.Send with the gateway's real validation; keeps what it accepted."""

    def __init__(self, token: str = "") -> None:
        self.token = token
        self.down = False
        self.snapshots: list[pb.Snapshot] = []
        self.calls = 0
        self.lock = threading.Lock()

    def Send(self, request, context):
        with self.lock:
            self.calls += 1
        if self.token and dict(context.invocation_metadata()).get("authorization") != f"Bearer {self.token}":
            context.abort(grpc.StatusCode.UNAUTHENTICATED, "bad token")
        if self.down:
            context.abort(grpc.StatusCode.UNAVAILABLE, "down for the test")
        ack = pb.IngestAck(batch_id=request.batch_id)
        for index, snap in enumerate(request.snapshots):
            verdict = validate_snapshot(snap, time.time_ns())
            for reason, detail in verdict.problems:
                ack.rejections.add(index=index, reason=reason, detail=detail)
            if verdict.accepted:
                ack.accepted += 1
                ack.dropped_parts += len(verdict.problems)
                with self.lock:
                    self.snapshots.append(snap)
            else:
                ack.rejected += 1
        return ack

    @property
    def steps(self) -> list[pb.RankStep]:
        with self.lock:
            return [rs for snap in self.snapshots for rs in snap.rank_steps]


@contextmanager
def fake_gateway(token: str = "", credentials=None):
    service = FakeGateway(token)
    server = grpc.server(ThreadPoolExecutor(max_workers=2))
    pb_grpc.add_IngestServicer_to_server(service, server)
    port = (server.add_secure_port("127.0.0.1:0", credentials) if credentials is not None
            else server.add_insecure_port("127.0.0.1:0"))
    server.start()
    try:
        yield service, f"127.0.0.1:{port}"
    finally:
        server.stop(0)


# ---------------------------------------------------------------------- gNMI switch collector: notifications built with the stub classes
NS = 1_800_000_000_000_000_000
OC = "/interfaces/interface[name={}]"


def tv(value) -> gnmi_pb2.TypedValue:
    if isinstance(value, bool):
        return gnmi_pb2.TypedValue(bool_val=value)
    if isinstance(value, int):
        return gnmi_pb2.TypedValue(uint_val=value)
    if isinstance(value, float):
        return gnmi_pb2.TypedValue(double_val=value)
    if isinstance(value, str):
        return gnmi_pb2.TypedValue(string_val=value)
    return gnmi_pb2.TypedValue(json_ietf_val=json.dumps(value).encode())


def notif(updates=(), *, target="", deletes=(), ts=1) -> gnmi_pb2.Notification:
    n = gnmi_pb2.Notification(timestamp=ts)
    if target:
        n.prefix.CopyFrom(gnmi_pb2.Path(target=target))
    for path, value in updates:
        n.update.add(path=xpath_to_path(path), val=value if isinstance(value, gnmi_pb2.TypedValue) else tv(value))
    for path in deletes:
        n.delete.append(xpath_to_path(path))
    return n


def table(snap: pb.Snapshot) -> dict[str, dict[str, float]]:
    """{port: {column: value}} over every SWITCH_PORT block (counters and gauges)."""
    out: dict[str, dict[str, float]] = {}
    for block in snap.blocks:
        assert block.entity_kind == pb.ENTITY_KIND_SWITCH_PORT
        for row in entity_rows(block):
            out[row.id] = {**dict(zip(block.counter_names, row.counters)), **dict(zip(block.gauge_names, row.gauges))}
    return out


# ---------------------------------------------------------------------- PFC storm tests: ns per ms, sample interval
MS = 1_000_000
INTERVAL_S = 0.1


# ---------------------------------------------------------------------- simulator: a small cluster and an index of what it sent
START = 1_800_000_000_000_000_000


def small_topology(n_nodes: int = 8):
    return rail_optimised("t", n_nodes=n_nodes, nodes_per_unit=4, n_spines=2)


def two_jobs(topo) -> list[Job]:
    nodes = topo.nodes
    return [Job("job-a", tuple(nodes[0:3]), step_compute_s=0.6, step_comm_s=0.3),
            Job("job-b", tuple(nodes[4:7]), step_compute_s=0.8, step_comm_s=0.25)]


class Recorder:
    """Runs a simulator and indexes what it sent: (source, entity) -> per-tick samples."""

    def __init__(self, sim: ClusterSimulator, ticks: int) -> None:
        self.sim = sim
        self.ticks: list[dict[str, pb.Snapshot]] = []
        for _ in range(ticks):
            self.ticks.append({s.source: s for s in sim.tick()})

    def entity(self, i: int, source: str, eid: str):
        snap = self.ticks[i].get(source)
        if snap is None:
            return None
        for block in snap.blocks:
            for e in entity_rows(block):
                if e.id == eid:
                    return (dict(zip(block.counter_names, e.counters)), dict(zip(block.gauge_names, e.gauges)),
                            dict(e.labels))
        raise KeyError((source, eid))

    def counter(self, source: str, eid: str, name: str) -> list[int | None]:
        return [None if (e := self.entity(i, source, eid)) is None else e[0][name] for i in range(len(self.ticks))]

    def gauge(self, source: str, eid: str, name: str) -> list[float | None]:
        return [None if (e := self.entity(i, source, eid)) is None else e[1][name] for i in range(len(self.ticks))]

    def label(self, source: str, eid: str, name: str) -> list[str | None]:
        return [None if (e := self.entity(i, source, eid)) is None else e[2][name] for i in range(len(self.ticks))]

    def rate(self, source: str, eid: str, name: str) -> list[float | None]:
        """Per-second deltas (None across a missing sample)."""
        xs = self.counter(source, eid, name)
        dt = self.sim.interval_s
        return [None if a is None or b is None else (b - a) / dt for a, b in zip(xs, xs[1:])]

    def rank_steps(self) -> list[pb.RankStep]:
        return [r for t in self.ticks for s in t.values() for r in s.rank_steps]


def leaf_port(topo, node: str, nic: str) -> tuple[str, str]:
    n = topo.nic(node, nic)
    return n.switch, n.switch_port


# ---------------------------------------------------------------------- fault injection: a broker of the module's own, the anomalies it publishes
S = 10**9
CATCH_UP_TIMEOUT_S = 300


class AnomalyReader:
    """Follows the anomalies topic from the beginning, keeping the events of one cluster."""

    def __init__(self, bootstrap: str, cluster: str) -> None:
        self.bootstrap, self.cluster = bootstrap, cluster
        self.events: list[ev.AnomalyEvent] = []
        self._task: asyncio.Task | None = None

    async def __aenter__(self) -> AnomalyReader:
        # no group (no heartbeats to miss on a loaded machine): all partitions, from the beginning
        consumer = AIOKafkaConsumer(topics.ANOMALIES, bootstrap_servers=self.bootstrap, group_id=None,
                                    auto_offset_reset="earliest", enable_auto_commit=False)
        await consumer.start()
        self._task = asyncio.create_task(self._follow(consumer))
        return self

    async def _follow(self, consumer) -> None:
        try:
            while True:
                for records in (await consumer.getmany(timeout_ms=200)).values():
                    for r in records:
                        event = ev.AnomalyEvent.FromString(r.value)
                        if event.entity.cluster == self.cluster:
                            self.events.append(event)
        finally:
            await consumer.stop()

    async def __aexit__(self, *exc) -> None:
        self._task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._task

    async def wait_for(self, what: str, predicate, timeout_s: float = 90) -> None:
        deadline = time.monotonic() + timeout_s
        while not predicate(self.events):
            assert time.monotonic() < deadline, f"no {what} within {timeout_s} s; saw {summary(self.events)}"
            await asyncio.sleep(0.2)

    def has(self, dedup_key: str, lifecycle: int):
        return lambda events: any(e.dedup_key == dedup_key and e.lifecycle == lifecycle for e in events)


def summary(events) -> list[tuple[str, str, str]]:
    return [(e.dedup_key, ev.Lifecycle.Name(e.lifecycle), e.id) for e in events]
