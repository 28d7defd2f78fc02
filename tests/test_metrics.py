"""Prometheus metrics, the alert rules, the Grafana dashboard and JSON logs.

Counters are read from a fresh registry that exposes the project's metric objects; the
objects are process-wide, so every check compares before and after. The integration test
starts a real Prometheus (Debian `prometheus`) that scrapes our `/metrics` endpoint and
reads the values back through its HTTP API.
"""
from __future__ import annotations

import asyncio
import io
import json
import logging
import os
import re
import shutil
import subprocess
import sys
import time
import urllib.parse
import urllib.request
from collections import Counter, namedtuple
from pathlib import Path
from types import SimpleNamespace

import grpc
import pytest
import yaml
from helpers import RecordingSink, free_port, gpu_block, nic_snapshot, start_server
from prometheus_client import CollectorRegistry

from fabricwatch import metrics
from fabricwatch.collectors.sender import GatewaySender, SenderConfig
from fabricwatch.logging_setup import JsonFormatter, configure_logging
from fabricwatch.protos.v1 import telemetry_pb2 as pb
from fabricwatch.protos.v1 import telemetry_pb2_grpc as pb_grpc
from fabricwatch.streams.events import event_id
from fabricwatch.streams.gateway import IngestService
from fabricwatch.streams.pipeline import DetectionPipeline
from fabricwatch.streams.worker_metrics import WorkerMetrics, consumer_lag

ROOT = Path(__file__).resolve().parents[1]
RULES = ROOT / "deploy/prometheus/fabricwatch-rules.yml"
RULE_TESTS = ROOT / "deploy/prometheus/fabricwatch-rules.test.yml"
DASHBOARD = ROOT / "deploy/grafana/fabricwatch.json"
PROMETHEUS = shutil.which("prometheus")
PROMTOOL = shutil.which("promtool")
needs_prometheus = pytest.mark.skipif(PROMETHEUS is None, reason="the prometheus binary is missing "
                                      "(apt-get install prometheus; .ci/run installs it)")
needs_promtool = pytest.mark.skipif(PROMTOOL is None, reason="promtool is missing (apt-get install prometheus)")
S = 10**9


@pytest.fixture(scope="module")
def registry() -> CollectorRegistry:
    reg = CollectorRegistry()
    metrics.register_components(metrics.COMPONENTS, reg)
    return reg


def value(registry, name: str, **labels) -> float:
    got = registry.get_sample_value(name, labels)
    return 0.0 if got is None else got


def values(registry, *queries) -> list[float]:
    return [value(registry, name, **labels) for name, labels in queries]


# ---------------------------------------------------------------------------- gateway
async def test_gateway_counts_what_it_receives_accepts_and_rejects(registry):
    sink, port = RecordingSink(), free_port()
    server = await start_server(IngestService(sink), port)
    watched = [("fabricwatch_gateway_snapshots_received_total", {}),
               ("fabricwatch_gateway_snapshots_accepted_total", {}),
               ("fabricwatch_gateway_snapshots_rejected_total", {}),
               ("fabricwatch_gateway_rejected_records_total", {"reason": "bad_counter_count"}),
               ("fabricwatch_gateway_rejected_records_total", {"reason": "bad_source"}),
               ("fabricwatch_gateway_kafka_write_seconds_count", {}),
               ("fabricwatch_gateway_kafka_write_errors_total", {})]
    try:
        before = values(registry, *watched)
        bytes_before = value(registry, "fabricwatch_gateway_received_bytes_total")
        partly_bad = nic_snapshot(source="node-0002")
        gpu_block(partly_bad)
        del partly_bad.blocks[1].counters[:]          # the GPU block is dropped, the NIC block kept
        batch = pb.IngestBatch(batch_id=1, snapshots=[nic_snapshot(source="node-0001"), partly_bad,
                                                      nic_snapshot(source="")])
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
            ack = await pb_grpc.IngestStub(ch).Send(batch)
            assert (ack.accepted, ack.rejected) == (2, 1)
            after = values(registry, *watched)
            assert [a - b for a, b in zip(after, before)] == [3, 2, 1, 1, 1, 1, 0]
            assert value(registry, "fabricwatch_gateway_received_bytes_total") - bytes_before == batch.ByteSize()
            assert value(registry, "fabricwatch_gateway_batches_in_flight") == 0

            sink.fail = True                          # Kafka down: counted, and the batch is not acked
            with pytest.raises(grpc.aio.AioRpcError):
                await pb_grpc.IngestStub(ch).Send(pb.IngestBatch(batch_id=2, snapshots=[nic_snapshot()]))
        assert value(registry, "fabricwatch_gateway_kafka_write_errors_total") - after[-1] == 1
        assert value(registry, "fabricwatch_gateway_batches_in_flight") == 0
    finally:
        await server.stop(0)


def test_reject_reasons_are_the_validation_reason_codes():
    validate = (ROOT / "streams/validate.py").read_text()
    codes = set(re.findall(r'v\.problem\("([a-z_]+)"', validate)) | set(re.findall(r'return "([a-z_]+)", ', validate))
    codes |= set(re.findall(r'reason, detail = "([a-z_]+)", ', validate))
    codes |= {c for pair in re.findall(r'_REASONS = \("([a-z_]+)", "([a-z_]+)"\)', validate) for c in pair}
    codes |= set(re.findall(r'\("([a-z_]+)",\s*\n?\s*f"', (ROOT / "streams/gateway.py").read_text()))
    assert "source_not_allowed" in codes and "gauge_out_of_range" in codes
    assert codes == set(metrics.REJECT_REASONS)


# ---------------------------------------------------------------------------- sender
async def test_sender_reports_acks_buffer_and_last_send(registry):
    sink, port = RecordingSink(), free_port()
    server = await start_server(IngestService(sink), port)
    sender = GatewaySender(SenderConfig(target=f"127.0.0.1:{port}", max_batch=4))
    acked_before = value(registry, "fabricwatch_collector_snapshots_acked_total", result="accepted")
    stop = asyncio.Event()
    task = asyncio.create_task(sender.run(stop))
    try:
        t0 = time.time()
        for i in range(10):
            sender.submit(nic_snapshot(source="node-0007", seq=i + 1))
        assert value(registry, "fabricwatch_collector_buffered_snapshots") >= 1
        assert await sender.drain(timeout_s=10)
        assert value(registry, "fabricwatch_collector_snapshots_acked_total", result="accepted") - acked_before == 10
        assert value(registry, "fabricwatch_collector_buffered_snapshots") == 0
        assert value(registry, "fabricwatch_collector_last_send_timestamp_seconds") >= t0
    finally:
        stop.set()
        await asyncio.wait_for(task, 10)
        await server.stop(0)


async def test_sender_counts_dropped_snapshots_when_full(registry):
    sender = GatewaySender(SenderConfig(target="127.0.0.1:1", max_buffered=3))   # never started: all buffered
    dropped_before = value(registry, "fabricwatch_collector_dropped_snapshots_total")
    for i in range(5):
        sender.submit(nic_snapshot(seq=i + 1))
    assert value(registry, "fabricwatch_collector_dropped_snapshots_total") - dropped_before == 2
    assert value(registry, "fabricwatch_collector_buffered_snapshots") == 3


# ---------------------------------------------------------------------------- collectors
@pytest.mark.slow
async def test_node_collector_counts_samples_per_source_and_field_errors(registry, tmp_path):
    from fabricwatch.collectors.ethtool_stats import EthtoolReader, RecordedSource
    from fabricwatch.collectors.node import NodeCollector
    from fabricwatch.collectors.node_config import NodeConfig

    fixtures = ROOT / "tests/fixtures"
    root = tmp_path / "sysfs"
    shutil.copytree(fixtures / "sysfs/roce_cx7", root, symlinks=True)
    [broken] = root.glob("devices/**/mlx5_5/ports/1/counters/port_xmit_data")
    broken.write_text("not a number\n")                       # one counter that cannot be parsed
    config = NodeConfig.from_dict({"node_name": "node-0001", "cluster": "c1", "sysfs_root": str(root)})
    netdevs = [p.name for p in (root / "class/net").iterdir()]
    recorded = RecordedSource({netdev: str(fixtures / "ethtool/mlx5_cx7.txt") for netdev in netdevs})
    collector = NodeCollector(config, ethtool_reader=EthtoolReader(source=recorded), gpu_reader=False)
    watched = [("fabricwatch_collector_samples_total", {"source": "ethtool_pfc"}),
               ("fabricwatch_collector_samples_total", {"source": "sysfs"}),
               ("fabricwatch_collector_field_errors_total", {"kind": "parse_error"})]
    before = values(registry, *watched)
    try:
        stats = await asyncio.wait_for(collector.run(asyncio.Event(), max_snapshots=16), 30)
    finally:
        collector.close()
    pfc, sysfs, parse_errors = (a - b for a, b in zip(values(registry, *watched), before))
    assert stats["snapshots"] == 16
    assert pfc >= 14 and 1 <= sysfs <= 3 and parse_errors >= 1
    assert parse_errors <= collector.problems()["parse_error"]


# ---------------------------------------------------------------------------- worker
def test_pipeline_counts_stages_anomalies_and_keeps_the_open_book(registry, caplog):
    t0 = time.time_ns() - 3 * S
    snaps = [nic_snapshot(t_ns=t0, seq=1),
             nic_snapshot(t_ns=t0 + S, seq=2, rates={3: "200 Gb/sec (4X HDR)"}),
             nic_snapshot(t_ns=t0 + S, seq=2),                       # a redelivered duplicate
             nic_snapshot(t_ns=t0 + 2 * S, seq=3, rates={3: "200 Gb/sec (4X HDR)"})]
    watched = [("fabricwatch_detector_processing_seconds_count", {"stage": "telemetry"}),
               ("fabricwatch_worker_anomalies_emitted_total", {"kind": "link_downgrade", "lifecycle": "open"}),
               ("fabricwatch_worker_anomalies_emitted_total", {"kind": "link_downgrade", "lifecycle": "resolved"}),
               ("fabricwatch_worker_late_snapshots_total", {}),
               ("fabricwatch_detector_event_to_anomaly_seconds_count", {"stage": "telemetry"})]
    p = DetectionPipeline()
    before = values(registry, *watched)
    with caplog.at_level(logging.INFO, logger="fabricwatch.pipeline"):
        found = [f for s in snaps for f in p.observe(s).findings]
    assert [(f.kind, f.state) for f in found] == [("link_downgrade", "open")]
    assert [a - b for a, b in zip(values(registry, *watched), before)] == [4, 1, 0, 1, 1]
    assert p.open_anomalies == {found[0].dedup_key: ("link_downgrade", "critical")}
    [record] = [r for r in caplog.records if r.name == "fabricwatch.pipeline"]
    assert (record.anomaly_id, record.lifecycle) == (event_id(found[0]), "open")

    resolved = p.observe(nic_snapshot(t_ns=t0 + 3 * S, seq=4)).findings
    assert [f.state for f in resolved] == ["resolved"] and p.open_anomalies == {}


def test_open_anomalies_gauge_follows_the_book_and_goes_to_zero(registry):
    pipeline = SimpleNamespace(open_anomalies={"a": ("pfc_storm", "critical"), "b": ("pfc_storm", "critical"),
                                               "c": ("straggler", "info")}, checkpointed_at_s=float("nan"))
    exporter = WorkerMetrics(SimpleNamespace(), SimpleNamespace(stats=Counter()), pipeline, None, 500)

    def gauge(kind, severity):
        return value(registry, "fabricwatch_worker_open_anomalies", kind=kind, severity=severity)

    exporter.export_open_anomalies()
    assert (gauge("pfc_storm", "critical"), gauge("straggler", "info")) == (2, 1)
    pipeline.open_anomalies = {"c": ("straggler", "info")}
    exporter.export_open_anomalies()
    assert (gauge("pfc_storm", "critical"), gauge("straggler", "info")) == (0, 1)


def test_counter_mirror_adds_only_increases_of_known_keys(registry):
    mirror = metrics.CounterMirror(metrics.WORKER_DECODE_ERRORS, rename={"malformed_records": "malformed_record"})
    name = "fabricwatch_worker_decode_errors_total"
    start = value(registry, name, reason="malformed_record")
    stats = Counter(malformed_records=3, unrelated=7)
    mirror.sync(stats)
    mirror.sync(stats)                     # no change: nothing added
    stats["malformed_records"] += 2
    mirror.sync(stats)
    assert value(registry, name, reason="malformed_record") - start == 5
    assert registry.get_sample_value(name, {"reason": "unrelated"}) is None


async def test_consumer_lag_is_highwater_minus_position():
    tp = namedtuple("TP", "topic partition")
    read, unread, unfetched = tp("t", 0), tp("t", 1), tp("t", 2)

    class Consumer:
        def assignment(self):
            return {read, unread, unfetched}

        def highwater(self, tp):
            return {read: 100, unread: 40}.get(tp)          # nothing fetched from partition 2 yet

        async def position(self, tp):
            return 10

    app = SimpleNamespace(consumer=Consumer(), monitor=SimpleNamespace(tp_read_offsets={read: 89}))
    assert await consumer_lag(app) == {("t", "0"): 10, ("t", "1"): 30}


# ---------------------------------------------------------------------------- endpoint
def test_metrics_server_stays_on_loopback_unless_allowed():
    with pytest.raises(ValueError, match="not a loopback address"):
        metrics.start_metrics_server("0.0.0.0:0")
    with pytest.raises(ValueError, match="expected host:port"):
        metrics.start_metrics_server("9701")
    endpoint = metrics.start_metrics_server("127.0.0.1:0", components=["gateway"], registry=CollectorRegistry())
    try:
        text = urllib.request.urlopen(f"http://127.0.0.1:{endpoint.port}/metrics", timeout=5).read().decode()
    finally:
        metrics.stop_metrics_server(endpoint)
    assert "fabricwatch_gateway_snapshots_received_total" in text
    assert "fabricwatch_collector_last_send_timestamp_seconds" not in text   # not a collector


# ---------------------------------------------------------------------------- real Prometheus
def _prom_query(prom_port: int, query: str) -> list[dict]:
    url = f"http://127.0.0.1:{prom_port}/api/v1/query?" + urllib.parse.urlencode({"query": query})
    body = json.loads(urllib.request.urlopen(url, timeout=5).read())
    assert body["status"] == "success", body
    return body["data"]["result"]


async def _wait_for(predicate, timeout_s: float, what: str):
    deadline = time.monotonic() + timeout_s
    while True:
        got = await asyncio.to_thread(predicate)
        if got:
            return got
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.5)


@needs_prometheus
@pytest.mark.slow
async def test_real_prometheus_scrapes_the_gateway_counters(tmp_path, registry):
    endpoint = metrics.start_metrics_server("127.0.0.1:0", registry=registry)
    prom_port = free_port()
    config = {"global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
              "rule_files": [str(RULES)],
              "scrape_configs": [{"job_name": "fabricwatch-gateway",
                                  "static_configs": [{"targets": [f"127.0.0.1:{endpoint.port}"]}]}]}
    (tmp_path / "prometheus.yml").write_text(yaml.safe_dump(config))
    log = open(tmp_path / "prometheus.log", "wb")
    prom = subprocess.Popen([PROMETHEUS, f"--config.file={tmp_path / 'prometheus.yml'}",
                             f"--storage.tsdb.path={tmp_path / 'tsdb'}", f"--web.listen-address=127.0.0.1:{prom_port}"],
                            stdout=log, stderr=subprocess.STDOUT)
    sink, port = RecordingSink(), free_port()
    server = await start_server(IngestService(sink), port)
    sender = GatewaySender(SenderConfig(target=f"127.0.0.1:{port}", max_batch=8))
    stop = asyncio.Event()
    task = asyncio.create_task(sender.run(stop))
    accepted = "fabricwatch_gateway_snapshots_accepted_total"
    try:
        def scraped(query):
            def check():
                try:
                    return _prom_query(prom_port, query)
                except OSError:                       # Prometheus still starting
                    return []
            return check

        base = float((await _wait_for(scraped(accepted), 60, "the first scrape"))[0]["value"][1])
        n = 25
        for i in range(n):
            sender.submit(nic_snapshot(source="node-0042", seq=i + 1))
        assert await sender.drain(timeout_s=10)
        assert value(registry, accepted) == base + n
        await _wait_for(lambda: scraped(f"{accepted} == {base + n}")(), 30, f"{accepted} == {base + n}")
        [up] = _prom_query(prom_port, 'up{job="fabricwatch-gateway"}')
        assert up["value"][1] == "1"
        # the histogram arrives with its buckets: quantiles are computable
        [p99] = _prom_query(prom_port,
                            "histogram_quantile(0.99, sum by (le) (fabricwatch_gateway_kafka_write_seconds_bucket))")
        assert 0 < float(p99["value"][1]) <= 10

        def rules_loaded():
            url = f"http://127.0.0.1:{prom_port}/api/v1/rules"
            groups = json.loads(urllib.request.urlopen(url, timeout=5).read())["data"]["groups"]
            rules = [r for g in groups for r in g["rules"]]
            return rules if rules and all(r.get("lastEvaluation", "").startswith("20") for r in rules) else None

        rules = await _wait_for(rules_loaded, 30, "the rules to be evaluated")
        assert {r["health"] for r in rules} == {"ok"}, [r for r in rules if r["health"] != "ok"]
        assert len(rules) == len(yaml.safe_load(RULES.read_text())["groups"][0]["rules"]) + sum(
            len(g["rules"]) for g in yaml.safe_load(RULES.read_text())["groups"][1:])
    finally:
        stop.set()
        await asyncio.wait_for(task, 10)
        await server.stop(0)
        metrics.stop_metrics_server(endpoint)
        prom.terminate()
        try:
            prom.wait(timeout=10)
        except subprocess.TimeoutExpired:
            prom.kill()
            prom.wait()
        log.close()


# ---------------------------------------------------------------------------- rules, dashboard
@needs_promtool
def test_rules_pass_promtool_check_and_their_unit_tests():
    check = subprocess.run([PROMTOOL, "check", "rules", str(RULES)], capture_output=True, text=True)
    assert check.returncode == 0, check.stdout + check.stderr
    assert "SUCCESS: 18 rules found" in check.stdout
    tests = subprocess.run([PROMTOOL, "test", "rules", RULE_TESTS.name], capture_output=True, text=True,
                           cwd=RULE_TESTS.parent)
    assert tests.returncode == 0, tests.stdout + tests.stderr


@needs_promtool
def test_example_prometheus_config_is_valid():
    out = subprocess.run([PROMTOOL, "check", "config", "prometheus.example.yml"], capture_output=True, text=True,
                         cwd=RULES.parent)
    assert out.returncode == 0, out.stdout + out.stderr


def _metric_names_in(expr: str) -> set[str]:
    names = set(re.findall(r"\bfabricwatch_[a-z0-9_]+", expr))
    return {re.sub(r"_(bucket|sum|count)$", "", n) if n.endswith(("_bucket", "_sum", "_count")) else n
            for n in names}


def test_dashboard_and_rules_name_only_defined_metrics():
    dash = json.loads(DASHBOARD.read_text())
    defined = metrics.metric_names()
    panels = [p for p in dash["panels"] if p["type"] != "row"]
    assert len({p["id"] for p in dash["panels"]}) == len(dash["panels"])
    used: set[str] = set()
    for p in panels:
        assert p["targets"], p["title"]
        assert {"h", "w", "x", "y"} <= set(p["gridPos"]) and p["gridPos"]["x"] + p["gridPos"]["w"] <= 24
        assert p["datasource"]["uid"] == "${datasource}"
        for t in p["targets"]:
            names = _metric_names_in(t["expr"])
            assert names or t["expr"].startswith("count by (job) (up{"), (p["title"], t["expr"])
            assert names <= defined, (p["title"], names - defined)
            used |= names
    for wanted in ("fabricwatch_gateway_rejected_records_total", "fabricwatch_worker_consumer_lag_messages",
                   "fabricwatch_detector_event_to_anomaly_seconds", "fabricwatch_worker_open_anomalies",
                   "fabricwatch_action_decisions_total", "fabricwatch_guard_trips_total",
                   "fabricwatch_collector_last_send_timestamp_seconds"):
        assert wanted in used, wanted
    variables = {v["name"] for v in dash["templating"]["list"]}
    for p in panels:
        for t in p["targets"]:
            assert set(re.findall(r"\$([a-z_]+)", t["expr"])) - {"__rate_interval", "__range"} <= variables
    rule_exprs = [r["expr"] for g in yaml.safe_load(RULES.read_text())["groups"] for r in g["rules"]]
    for expr in rule_exprs:
        assert _metric_names_in(expr) <= defined, expr


def test_metric_names_follow_the_conventions():
    for name in metrics.metric_names():
        assert name.startswith("fabricwatch_"), name
        assert re.fullmatch(r"[a-z][a-z0-9_]*", name), name
    for m in (m for group in metrics.COMPONENTS.values() for m in group):
        assert m._documentation.strip(), m._name
        if m._type == "histogram":
            assert m._name.endswith("_seconds"), m._name


# ---------------------------------------------------------------------------- logs
def test_json_log_lines_carry_ids_passed_as_extra():
    stream = io.StringIO()
    configure_logging("INFO", "json", stream=stream)
    try:
        log = logging.getLogger("fabricwatch.test")
        log.info("anomaly %s opened", "pfc_storm", extra={"anomaly_id": "a1b2", "action_id": "x9", "source": "node-1"})
        try:
            raise RuntimeError("boom")
        except RuntimeError:
            log.exception("action failed", extra={"action_id": "x9"})
        log.debug("not at INFO")
    finally:
        configure_logging("WARNING", "text")
    lines = stream.getvalue().splitlines()
    assert len(lines) == 2
    first, second = map(json.loads, lines)
    assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z", first["ts"])
    assert {k: first[k] for k in ("level", "logger", "msg", "anomaly_id", "action_id", "source")} == {
        "level": "INFO", "logger": "fabricwatch.test", "msg": "anomaly pfc_storm opened", "anomaly_id": "a1b2",
        "action_id": "x9", "source": "node-1"}
    assert second["level"] == "ERROR" and "RuntimeError: boom" in second["exc"]


def test_json_formatter_writes_unserialisable_extras_as_text():
    record = logging.LogRecord("x", logging.WARNING, __file__, 1, "m", (), None)
    record.path = Path("/tmp/a")
    assert json.loads(JsonFormatter().format(record))["path"] == "/tmp/a"
    with pytest.raises(ValueError, match="--log-format"):
        configure_logging("INFO", "xml")


@pytest.mark.slow
def test_cli_simulate_serves_metrics_and_logs_json(tmp_path):
    port = free_port()
    cmd = [sys.executable, "-m", "fabricwatch.cli", "--log-format", "json", "--log-level", "INFO", "simulate",
           "--nodes", "4", "--scenario", "healthy", "--duration", "60", "--record", str(tmp_path / "rec.jsonl"),
           "--metrics-listen", f"127.0.0.1:{port}"]
    stderr = open(tmp_path / "stderr", "wb")
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=stderr, cwd=tmp_path)
    try:
        deadline = time.monotonic() + 60
        samples = 0.0
        while samples < 8:                      # 4 nodes x 2 ticks
            assert proc.poll() is None, (tmp_path / "stderr").read_text()
            assert time.monotonic() < deadline, "no simulator samples on /metrics in 60 s"
            time.sleep(0.5)
            try:
                text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=2).read().decode()
            except OSError:
                continue
            m = re.search(r'^fabricwatch_collector_samples_total\{source="simulator"\} (\S+)$', text, re.M)
            samples = float(m.group(1)) if m else 0.0
        assert "fabricwatch_gateway_" not in text
    finally:
        proc.terminate()
        proc.wait(timeout=20)
        stderr.close()
    lines = [json.loads(line) for line in (tmp_path / "stderr").read_text().splitlines() if line.startswith("{")]
    [started] = [x for x in lines if x["logger"] == "fabricwatch.metrics"]
    assert started["metrics_port"] == port and started["level"] == "INFO"

    refused = subprocess.run([sys.executable, "-m", "fabricwatch.cli", "simulate", "--duration", "1",
                              "--metrics-listen", "0.0.0.0:0"], capture_output=True, text=True, cwd=tmp_path,
                             timeout=60)
    assert refused.returncode == 2 and "not a loopback address" in refused.stderr


# ---------------------------------------------------------------------------- worker on Kafka
def _scrape(port: int) -> dict[tuple[str, frozenset], float]:
    from prometheus_client.parser import text_string_to_metric_families

    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    return {(s.name, frozenset(s.labels.items())): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def _sum(samples, name: str, **labels) -> float:
    want = set(labels.items())
    return sum(v for (n, lbls), v in samples.items() if n == name and want <= lbls)


@pytest.mark.kafka
async def test_worker_exports_consumption_lag_anomalies_and_checkpoint_age(kafka_bootstrap, tmp_path):
    import uuid

    from helpers import gateway_and_sender

    from fabricwatch.streams import topics

    app_id, node, port = f"fw-metrics-{uuid.uuid4().hex[:8]}", f"node-{uuid.uuid4().hex[:6]}", free_port()
    ready, log_path = tmp_path / "ready", tmp_path / "worker.log"
    with open(log_path, "wb") as log:
        worker = subprocess.Popen(
            [sys.executable, "-m", "fabricwatch.cli", "--log-format", "json", "--log-level", "INFO", "worker",
             "--broker", kafka_bootstrap, "--app-id", app_id, "--metrics-listen", f"127.0.0.1:{port}",
             "--state-dir", str(tmp_path / "state"), "--checkpoint-interval", "1"],
            stdout=log, stderr=subprocess.STDOUT, env={**os.environ, "FABRICWATCH_WORKER_READY_FILE": str(ready)})
    try:
        await _wait_for(lambda: ready.exists() or worker.poll() is not None, 120, "the worker to join its group")
        assert worker.poll() is None, log_path.read_text()[-3000:]
        async with gateway_and_sender(kafka_bootstrap, free_port()) as sender:
            t0 = time.time_ns()
            for i in range(6):                        # port 2 trains down at i=2 and stays down
                sender.submit(nic_snapshot(source=node, t_ns=t0 + i * S, seq=i, cluster="",
                                           rates={2: "200 Gb/sec (4X HDR)"} if i >= 2 else {}))
            assert await sender.drain(30)

            def settled():
                samples = _scrape(port)
                lags = {lbls: v for (n, lbls), v in samples.items()
                        if n == "fabricwatch_worker_consumer_lag_messages"
                        and ("topic", topics.TELEMETRY) in lbls}
                # the sender's one batch is one record per node
                ok = (_sum(samples, "fabricwatch_worker_records_consumed_total", topic=topics.TELEMETRY) >= 1
                      and _sum(samples, "fabricwatch_worker_open_anomalies", kind="link_downgrade") >= 1
                      and lags and sum(lags.values()) == 0)
                return samples if ok else None

            samples = await _wait_for(settled, 90, "the worker's metrics to show the records, no lag, the anomaly")
    finally:
        worker.terminate()
        worker.wait(30)
    lag_partitions = {dict(lbls)["partition"] for (n, lbls) in samples
                      if n == "fabricwatch_worker_consumer_lag_messages" and ("topic", topics.TELEMETRY) in lbls}
    assert lag_partitions == {str(p) for p in range(topics.SPECS[topics.TELEMETRY].partitions)}   # one worker: all
    assert _sum(samples, "fabricwatch_detector_processing_seconds_count", stage="telemetry") >= 1
    assert _sum(samples, "fabricwatch_worker_anomalies_emitted_total", kind="link_downgrade", lifecycle="open") >= 1
    assert 0 <= _sum(samples, "fabricwatch_worker_checkpoint_age_seconds") < 30
    assert not [n for (n, _) in samples if n.startswith("fabricwatch_gateway_")]
    # JSON log lines survive Faust's logging set-up, with the anomaly id in them
    lines = [json.loads(x) for x in log_path.read_text().splitlines() if x.startswith("{")]
    opened = [x for x in lines if x["logger"] == "fabricwatch.pipeline" and node in x.get("entity", "")]
    assert opened and opened[0]["lifecycle"] == "open" and re.fullmatch(r"[0-9a-f]{24}", opened[0]["anomaly_id"])
