"""The dashboard in a real headless Chromium, over a real broker, under a simulated fault.

A 16-node simulated cluster with the README demo's faults (a NIC link trained down to
200G, a PFC storm from one NIC, a thermally throttled straggling rank) goes to Kafka as
the gateway writes it (telemetry and rank-steps records), with the anomaly events of the
real detectors and two action decisions (one shadow "would have"). Then the dashboard
process (`fabricwatch dashboard`) follows the topics, and tests/browser/dashboard.js
drives Debian's Chromium through playwright-core: every view, the marks of source,
victims, downgraded link and straggler, an entity chart with data points, keyboard
navigation, filters, and a live anomaly pushed by server-sent events. Screenshots of each
view are written under tests/artifacts/dashboard/ (kept out of git).

Needs `node` and `chromium` (skipped, saying so, without them); `npm ci --prefix
tests/browser` is run here when its node_modules are missing.
"""
from __future__ import annotations

import asyncio
import json
import os
import shutil
import subprocess
import sys
import threading
import time
import urllib.request
import uuid
from pathlib import Path

import pytest
import yaml

from fabricwatch.dashboard.shapes import entity_path
from fabricwatch.protos.v1 import events_pb2 as ev
from fabricwatch.streams import topics
from dashboard_scenario import fault_scenario
from helpers import free_port

pytestmark = pytest.mark.kafka

REPO = Path(__file__).resolve().parent.parent
BROWSER_DIR = REPO / "tests" / "browser"
ARTIFACTS = REPO / "tests" / "artifacts" / "dashboard"
CHROMIUM = os.environ.get("FABRICWATCH_CHROMIUM") or shutil.which("chromium") or "/usr/bin/chromium"
NODE = shutil.which("node")
DASHBOARD_READY_TIMEOUT_S = 90
BROWSER_TIMEOUT_S = 300


def _require_browser() -> None:
    if NODE is None:
        pytest.skip("node is not installed (apt-get install nodejs npm): the browser tests need it")
    if not os.access(CHROMIUM, os.X_OK):
        pytest.skip(f"chromium not found at {CHROMIUM} (apt-get install chromium): the browser tests need it")
    if not (BROWSER_DIR / "node_modules" / "playwright-core").is_dir():
        npm = shutil.which("npm")
        if npm is None:
            pytest.skip("npm is not installed: cannot install tests/browser (npm ci)")
        done = subprocess.run([npm, "ci", "--prefix", str(BROWSER_DIR), "--no-audit", "--no-fund"],
                              capture_output=True, text=True, timeout=600)
        assert done.returncode == 0, f"npm ci --prefix tests/browser failed:\n{done.stdout}\n{done.stderr}"


async def _produce(bootstrap: str, records: list[tuple[str, bytes, bytes]]) -> None:
    from aiokafka import AIOKafkaProducer

    producer = AIOKafkaProducer(bootstrap_servers=bootstrap, acks="all", linger_ms=5, enable_idempotence=True,
                                max_request_size=8 * 1024 * 1024)
    await producer.start()
    try:
        futures = [await producer.send(topic, value, key=key) for topic, key, value in records]
        await asyncio.gather(*futures)
    finally:
        await producer.stop()


def _status(base: str) -> dict:
    with urllib.request.urlopen(base + "/api/status", timeout=5) as resp:
        return json.load(resp)


def _wait_ready(base: str, proc: subprocess.Popen, log: Path, want_open: int, want_decisions: int) -> dict:
    deadline = time.monotonic() + DASHBOARD_READY_TIMEOUT_S
    status: dict = {}
    while time.monotonic() < deadline:
        assert proc.poll() is None, f"dashboard exited with {proc.returncode}:\n{log.read_text()[-3000:]}"
        try:
            status = _status(base)
            if status["open_anomalies"] >= want_open and status["decisions"] >= want_decisions \
                    and status["jobs"] > 0 and status["stats"].get("snapshots", 0) > 0:
                return status
        except OSError:
            pass
        time.sleep(0.5)
    raise AssertionError(f"dashboard not showing the scenario after {DASHBOARD_READY_TIMEOUT_S} s: {status}\n"
                         f"{log.read_text()[-3000:]}")


def test_dashboard_in_headless_chromium(kafka_bootstrap: str, tmp_path: Path) -> None:
    _require_browser()
    cluster = f"dash-{uuid.uuid4().hex[:8]}"     # the session broker is shared: see only our records
    scenario = fault_scenario(cluster)
    storm, down, straggler = (scenario.first(k) for k in ("pfc_storm", "link_downgrade", "straggler"))
    down_nic = next(e for e in scenario.events if e.kind == "link_downgrade" and e.entity.node)
    victims = [entity_path(r) for r in storm.related if r.node and r.device]
    victim_switch = next(r.switch for r in storm.related if r.switch)
    open_keys = {e.dedup_key for e in scenario.events if e.lifecycle != ev.LIFECYCLE_RESOLVED} - {
        e.dedup_key for e in scenario.events if e.lifecycle == ev.LIFECYCLE_RESOLVED}
    bad = [(topics.ANOMALIES, b"bad", b"\x0a\xff\x01"),                 # truncated protobuf
           (topics.TELEMETRY, b"bad", b"\x22\x05abc"),                   # truncated protobuf
           (topics.ANOMALIES, b"bad", ev.AnomalyEvent(kind="pfc_storm", entity=ev.EntityPath(cluster=cluster))
            .SerializeToString())]                                        # no dedup key

    asyncio.run(topics.ensure_topics(kafka_bootstrap, topics.ALL_TOPICS))
    asyncio.run(_produce(kafka_bootstrap, bad + scenario.records))

    topology = tmp_path / "topology.yaml"
    topology.write_text(yaml.safe_dump(scenario.topology.to_dict(), sort_keys=False), encoding="utf-8")
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    log = tmp_path / "dashboard.log"
    with open(log, "wb") as log_fh:
        dashboard = subprocess.Popen(
            [sys.executable, "-m", "fabricwatch.cli", "--log-level", "INFO", "dashboard", "--broker", kafka_bootstrap,
             "--listen", f"127.0.0.1:{port}", "--topology", str(topology), "--cluster", cluster,
             # the recording ends when the test starts: do not let it turn "silent" mid-test
             "--stale-after", "3600"],
            stdout=log_fh, stderr=subprocess.STDOUT, cwd=tmp_path)
    try:
        status = _wait_ready(base, dashboard, log, len(open_keys), len(scenario.decisions))
        print("dashboard stats:", status["stats"])
        assert status["feed"]["state"] == "following", status["feed"]
        assert status["stats"]["bad_records:fabricwatch.anomalies.v1"] == 1, status["stats"]
        assert status["stats"]["bad_records:anomaly_without_dedup_key"] == 1, status["stats"]
        assert status["stats"][f"bad_records:{topics.TELEMETRY}"] == 1, status["stats"]

        ARTIFACTS.mkdir(parents=True, exist_ok=True)
        for old in ARTIFACTS.glob("*.png"):       # a screenshot must come from this run
            old.unlink()
        live_summary = f"live check {uuid.uuid4().hex[:6]}: node-0001 mlx5_0/1 flapped 3 times in 60 s"
        live_event = ev.AnomalyEvent(
            id=uuid.uuid4().hex[:24], dedup_key=f"link_flap:{cluster}/node-0001/mlx5_0/1", kind="link_flap",
            severity=ev.SEVERITY_WARNING, lifecycle=ev.LIFECYCLE_OPEN,
            entity=ev.EntityPath(cluster=cluster, node="node-0001", device="mlx5_0", port="1"),
            detected_unix_ns=time.time_ns(), emitted_unix_ns=time.time_ns(), summary=live_summary,
            evidence=[ev.Evidence(name="link_downed", value=3, threshold=2, unit="events")])
        live_decision = ev.ActionDecision(
            idempotency_key=f"{live_event.dedup_key}|disable", anomaly_id=live_event.id,
            anomaly_dedup_key=live_event.dedup_key, anomaly_kind="link_flap", rule="isolate-flapping-port",
            action="disable_port", target=live_event.entity, outcome=ev.OUTCOME_SHADOW, shadow=True,
            decided_unix_ns=time.time_ns(), executor="slurm")
        expect = {
            "source": entity_path(storm.entity), "victims_in_heatmap": victims, "victim_switch": victim_switch,
            "downgraded_nic": entity_path(down_nic.entity),
            "straggler_gpu": f"{straggler.entity.node}/{straggler.entity.device}",
            "straggler_job": straggler.entity.job, "straggler_rank": int(straggler.entity.rank),
            "straggler_cause": "thermal", "live_summary": live_summary,
        }
        assert "thermal" in straggler.probable_cause.lower(), straggler.probable_cause
        assert down.kind == "link_downgrade" and victims, (down, victims)

        env = {**os.environ, "BASE_URL": base, "EXPECT": json.dumps(expect), "SCREENSHOT_DIR": str(ARTIFACTS),
               "CHROMIUM": CHROMIUM}
        browser = subprocess.Popen([NODE, str(BROWSER_DIR / "dashboard.js")], env=env, cwd=BROWSER_DIR,
                                   stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        lines: list[str] = []

        def read() -> None:
            for line in browser.stdout:
                lines.append(line.rstrip())
                if line.strip() == "waiting-for-live-anomaly":
                    asyncio.run(_produce(kafka_bootstrap, [
                        (topics.ANOMALIES, live_event.dedup_key.encode(), live_event.SerializeToString()),
                        (topics.ACTIONS, live_event.dedup_key.encode(), live_decision.SerializeToString())]))

        reader = threading.Thread(target=read, daemon=True)
        reader.start()
        try:
            rc = browser.wait(timeout=BROWSER_TIMEOUT_S)
        finally:
            if browser.poll() is None:
                browser.kill()
                browser.wait()
        reader.join(timeout=10)
        browser.stdout.close()
        output = "\n".join(lines)
        print(output)
        print(f"dashboard screenshots: {ARTIFACTS}")
        assert rc == 0, f"browser checks failed:\n{output}\n--- dashboard log ---\n{log.read_text()[-3000:]}"
        for name in ("fabric", "entity", "entity-downgraded", "feed", "jobs", "fabric-dark", "entity-dark"):
            shot = ARTIFACTS / f"{name}.png"
            assert shot.stat().st_size > 10_000, f"{shot} looks empty"
        assert dashboard.poll() is None, "the dashboard died during the browser run"
        assert "Traceback" not in log.read_text(), log.read_text()[-3000:]
    finally:
        dashboard.terminate()
        try:
            dashboard.wait(timeout=20)
        except subprocess.TimeoutExpired:
            dashboard.kill()
            dashboard.wait()
