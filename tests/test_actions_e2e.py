"""Issue 5 end to end on real parts: a fault in telemetry -> worker -> anomaly -> responder
(`fabricwatch respond`, its own process) -> Slurm drain and requeue (seen in `sinfo` and
`scontrol`) -> alert in a real Alertmanager -> CloudEvents on the audit/actions topics and
on a gRPC `Subscribe` stream. Then the same in shadow mode (nothing executed), and a
responder killed with SIGKILL and restarted on a replayed anomalies topic (no action twice).
"""
from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
import uuid
from pathlib import Path

import grpc
import pytest
from aiokafka import AIOKafkaConsumer
from helpers import gateway_and_sender, nic_snapshot
from test_pipeline_kafka import start_worker

from fabricwatch.protos.v1 import events_pb2 as ev
from fabricwatch.protos.v1 import feed_pb2, feed_pb2_grpc
from fabricwatch.streams import topics
from fabricwatch.streams.cloudevents import CloudEventError, parse
from fabricwatch.streams.feed import FeedServer

pytestmark = pytest.mark.kafka
S = 10**9

POLICY = """
mode: {mode}
execute: [drain_node, requeue_jobs]
guards: {{breaker: {{min_count: 2}}, cooldown_s: 600, quiet_period_s: 3600}}
executors:
  scheduler: slurm
  slurm: {{slurm_conf: "{slurm_conf}", command_timeout_s: 20}}
alerts:
  alertmanager: {{urls: ["{am_url}"], resend_interval_s: 30}}
rules:
  - name: degraded-link-drain
    match: {{kind: link_downgrade, cluster: {cluster}}}
    actions: [alert, drain_node, requeue_jobs]
"""


def slurm_env(conf: str) -> dict[str, str]:
    return {**os.environ, "SLURM_CONF": conf}


def sh(argv: list[str], conf: str) -> str:
    done = subprocess.run(argv, capture_output=True, text=True, env=slurm_env(conf), timeout=30)
    assert done.returncode == 0, f"{argv}: {done.stderr}"
    return done.stdout


def start_responder(tmp_path: Path, bootstrap: str, policy: Path, group: str) -> subprocess.Popen:
    with open(tmp_path / f"{group}.log", "ab") as log:        # the child keeps its own copy
        return subprocess.Popen([sys.executable, "-m", "fabricwatch.cli", "respond", "--broker", bootstrap,
                                 "--policy", str(policy), "--group-id", group],
                                stdout=log, stderr=subprocess.STDOUT)


async def audit_of(bootstrap: str, cluster: str, want, timeout_s: float) -> list[tuple[dict, ev.ActionDecision]]:
    """Decisions about `cluster` on the audit topic, with their CloudEvents attributes."""
    consumer = AIOKafkaConsumer(topics.AUDIT, bootstrap_servers=bootstrap, group_id=None,
                                auto_offset_reset="earliest")
    await consumer.start()
    found: list[tuple[dict, ev.ActionDecision]] = []
    try:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline and not want(found):
            for records in (await consumer.getmany(timeout_ms=500)).values():
                for r in records:
                    try:
                        event = parse(r.headers, r.key, r.value)
                    except CloudEventError:
                        continue   # other tests put malformed records on the shared topic on purpose
                    if isinstance(event.message, ev.ActionDecision) and event.message.target.cluster == cluster:
                        found.append(({**event.attributes, "headers": sorted(k for k, _ in r.headers)},
                                      event.message))
    finally:
        await consumer.stop()
    return found


def am_alerts(am_url: str, cluster: str) -> list[dict]:
    with urllib.request.urlopen(f"{am_url}/api/v2/alerts?active=true", timeout=10) as resp:
        return [a for a in json.load(resp) if a["labels"].get("cluster") == cluster]


def outcome(record: ev.ActionDecision) -> str:
    return ev.Outcome.Name(record.outcome).removeprefix("OUTCOME_")


async def inject_downgrade(bootstrap: str, port: int, node: str, cluster: str) -> None:
    async with gateway_and_sender(bootstrap, port, cluster=cluster) as sender:
        t0 = time.time_ns()
        for i in range(4):   # NIC port 5 trains at half rate from the third sample on
            sender.submit(nic_snapshot(source=node, t_ns=t0 + i * S, seq=i, cluster=cluster,
                                       rates={5: "200 Gb/sec (4X HDR)"} if i >= 2 else {}))
        assert await sender.drain(30)


@pytest.fixture
def slurm_node(slurm_conf):
    node = subprocess.run(["hostname", "-s"], capture_output=True, text=True, check=True).stdout.strip()
    subprocess.run(["scancel", "--full", "--user", "root"], env=slurm_env(slurm_conf), capture_output=True)
    deadline = time.monotonic() + 60
    while sh(["squeue", "-h"], slurm_conf).strip():   # resume only once cancelled jobs have left the node
        assert time.monotonic() < deadline, "cancelled jobs did not finish"
        time.sleep(0.5)
    if "drain" in sh(["sinfo", "-h", "-n", node, "-o", "%T"], slurm_conf):
        sh(["scontrol", "update", f"nodename={node}", "state=resume"], slurm_conf)
    job = sh(["sbatch", "--parsable", "--requeue", "--output=/dev/null", "--wrap", "sleep 600"], slurm_conf).strip().split(";")[0]
    deadline = time.monotonic() + 30
    while "RUNNING" not in sh(["squeue", "-h", "-j", job, "-o", "%T"], slurm_conf):
        assert time.monotonic() < deadline, "the test job did not start"
        time.sleep(0.5)
    yield node, job
    subprocess.run(["scancel", "--full", job], env=slurm_env(slurm_conf), capture_output=True)
    subprocess.run(["scontrol", "update", f"nodename={node}", "state=resume"], env=slurm_env(slurm_conf),
                   capture_output=True)


async def run_scenario(mode, kafka_bootstrap, tmp_path, unused_tcp_port, slurm_conf, alertmanager_url, node):
    cluster = f"e2e-{mode}-{uuid.uuid4().hex[:6]}"
    policy = tmp_path / "policy.yaml"
    policy.write_text(POLICY.format(mode=mode, slurm_conf=slurm_conf, am_url=alertmanager_url, cluster=cluster))
    app_id = f"fw-e2e-{uuid.uuid4().hex[:8]}"
    worker = start_worker(kafka_bootstrap, tmp_path, app_id)
    responder = start_responder(tmp_path, kafka_bootstrap, policy, f"responder-{app_id}")
    feed = FeedServer(kafka_bootstrap, "127.0.0.1:0")
    await feed.start()
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{feed.port}")
    stream = feed_pb2_grpc.EventFeedStub(channel).Subscribe(
        feed_pb2.SubscribeRequest(cluster=cluster, include_actions=True, include_audit=True))
    received: list[feed_pb2.FeedEvent] = []

    async def subscribe():
        async for item in stream:
            received.append(item)

    reader = asyncio.create_task(subscribe())
    try:
        await asyncio.sleep(1.0)   # the subscription is live before the fault
        await inject_downgrade(kafka_bootstrap, unused_tcp_port, node, cluster)

        def settled(found):
            return any(r.action == "alert" and outcome(r) == "ALERTED" for _, r in found)

        audit = await audit_of(kafka_bootstrap, cluster, settled, 120)
        assert responder.poll() is None, (tmp_path / f"responder-{app_id}.log").read_text()[-3000:]
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline and not any(e.HasField("decision") for e in received):
            await asyncio.sleep(0.2)
        return cluster, audit, received, responder, worker, policy
    finally:
        reader.cancel()
        await channel.close()
        await feed.stop()
        if mode == "shadow":
            responder.terminate()
            worker.terminate()
            responder.wait(30)
            worker.wait(30)


async def test_execute_mode_drains_requeues_alerts_and_publishes(kafka_bootstrap, tmp_path, unused_tcp_port,
                                                                  slurm_conf, alertmanager_url, slurm_node):
    node, job = slurm_node
    cluster, audit, received, responder, worker, policy = await run_scenario(
        "execute", kafka_bootstrap, tmp_path, unused_tcp_port, slurm_conf, alertmanager_url, node)
    try:
        by_action = {(r.action, outcome(r)) for _, r in audit}
        assert {("drain_node", "STARTED"), ("drain_node", "EXECUTED"), ("requeue_jobs", "STARTED"),
                ("requeue_jobs", "EXECUTED"), ("alert", "ALERTED")} <= by_action, by_action
        # Slurm really did it
        assert "drain" in sh(["sinfo", "-h", "-n", node, "-o", "%T"], slurm_conf)
        assert "fabricwatch" in sh(["sinfo", "-R", "-h", "-n", node, "-o", "%E"], slurm_conf)
        shown = sh(["scontrol", "show", "job", job, "-o"], slurm_conf)
        assert "Restarts=0" not in shown and f"ExcNodeList={node}" in shown, shown
        # on-call sees it, with the action taken
        alerts = am_alerts(alertmanager_url, cluster)
        assert len(alerts) == 1 and alerts[0]["labels"]["node"] == node
        assert "drain_node" in alerts[0]["annotations"]["description"]
        # CloudEvents on the audit topic, and the same decisions on the gRPC feed
        attributes = next(a for a, r in audit if r.action == "drain_node" and outcome(r) == "EXECUTED")
        assert {"ce_id", "ce_source", "ce_specversion", "ce_type", "ce_time", "content-type"} <= \
            set(attributes["headers"])
        assert attributes["type"] == "io.fabricwatch.audit.v1.executed"
        assert attributes["specversion"] == "1.0" and attributes["subject"] == f"{cluster}/{node}"
        kinds = {e.anomaly.kind for e in received if e.HasField("anomaly")}
        decided = {(e.decision.action, outcome(e.decision)) for e in received if e.HasField("decision")}
        assert "link_downgrade" in kinds and ("drain_node", "EXECUTED") in decided

        # SIGKILL the responder and replay the whole anomalies topic to a fresh consumer group:
        # every decision is found in the ledger rebuilt from the audit topic; nothing runs twice.
        responder.send_signal(signal.SIGKILL)
        responder.wait(30)
        again = start_responder(tmp_path, kafka_bootstrap, policy, f"replay-{uuid.uuid4().hex[:6]}")
        try:
            def replayed(found):
                return sum(r.action == "drain_node" and outcome(r) == "SKIPPED_DUPLICATE" for _, r in found) >= 1

            audit = await audit_of(kafka_bootstrap, cluster, replayed, 120)
        finally:
            again.terminate()
            again.wait(30)
        executed = [r for _, r in audit if r.action in ("drain_node", "requeue_jobs") and outcome(r) == "EXECUTED"]
        assert len(executed) == 2, [(r.action, outcome(r)) for _, r in audit]
        assert "Restarts=1" in sh(["scontrol", "show", "job", job, "-o"], slurm_conf)
    finally:
        responder.kill()
        worker.terminate()
        responder.wait(30)
        worker.wait(30)


async def test_shadow_mode_executes_nothing_but_records_and_alerts(kafka_bootstrap, tmp_path, unused_tcp_port,
                                                                    slurm_conf, alertmanager_url, slurm_node):
    node, job = slurm_node
    cluster, audit, received, *_ = await run_scenario(
        "shadow", kafka_bootstrap, tmp_path, unused_tcp_port, slurm_conf, alertmanager_url, node)
    decided = {(r.action, outcome(r), r.shadow) for _, r in audit}
    assert {("drain_node", "SHADOW", True), ("requeue_jobs", "SHADOW", True)} <= decided
    assert not any(o in ("STARTED", "EXECUTED") for _, o, _ in decided)
    assert sh(["sinfo", "-h", "-n", node, "-o", "%T"], slurm_conf).strip() in ("allocated", "mixed")
    assert "RUNNING" in sh(["squeue", "-h", "-j", job, "-o", "%T"], slurm_conf)
    alerts = am_alerts(alertmanager_url, cluster)
    assert len(alerts) == 1 and "would have" in alerts[0]["annotations"]["description"]
    assert any(e.HasField("decision") and e.decision.shadow for e in received)
