"""`fabricwatch up`: the whole local stack in one command.

Starts (each as its own process, logs in <state-dir>/logs/): the embedded Kafka broker
unless --broker is given, the gateway (TLS with a self-signed certificate, a fresh
collector token), the worker, the web dashboard (its URL is printed), the responder
(shadow mode with the example policy unless --policy says otherwise), and with --simulate
a simulated cluster with injected faults. Then shows the anomalies live until Ctrl-C or
--duration.
"""
from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import yaml

from fabricwatch.console import LiveView, follow_anomalies
from fabricwatch.localtls import ensure_self_signed
from fabricwatch.streams import topics
from fabricwatch.streams.auth import TokenAuth, new_token

WORKER_READY_TIMEOUT_S = 120
GATEWAY_READY_TIMEOUT_S = 60
DASHBOARD_READY_TIMEOUT_S = 30
DASHBOARD_LISTEN = "127.0.0.1:8080"


def _wait_port(host: str, port: int, timeout_s: float, proc: subprocess.Popen) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{proc.args[3]} exited with code {proc.returncode}")
        try:
            with socket.create_connection((host, port), timeout=0.5):
                return
        except OSError:
            time.sleep(0.2)
    raise TimeoutError(f"nothing listening on {host}:{port} after {timeout_s:.0f} s")


class LocalStack:
    def __init__(self, args) -> None:
        self.args = args
        self.state = Path(args.state_dir).resolve()
        self.logs = self.state / "logs"
        self.procs: list[subprocess.Popen] = []
        self.kafka = None
        self.dashboard_url = ""

    def _spawn(self, name: str, *argv: str, env: dict | None = None) -> subprocess.Popen:
        log = open(self.logs / f"{name}.log", "ab")
        # A few simulated racks: the embedded topics get fewer partitions unless told.
        base = {"FABRICWATCH_PARTITIONS": str(topics.EMBEDDED_PARTITIONS), **os.environ}
        proc = subprocess.Popen([sys.executable, "-m", "fabricwatch.cli", *argv], stdout=log, stderr=subprocess.STDOUT,
                                env={**base, **(env or {})}, start_new_session=True)
        self.procs.append(proc)
        return proc

    def _say(self, text: str) -> None:
        print(text, flush=True)

    def run(self) -> int:
        from fabricwatch.streams.pipeline import detection_config_of

        detection_config_of(self.args)   # refuse bad thresholds before starting anything
        if self.args.topology:
            from fabricwatch.topology_file import load_topology

            load_topology(self.args.topology)
        from fabricwatch.streams.respond import load

        load(self.args.policy)   # a bad response policy is refused before anything starts (PolicyError)
        self.logs.mkdir(parents=True, exist_ok=True)
        try:
            return self._run()
        finally:
            self._shutdown()

    def _run(self) -> int:
        a = self.args
        if a.broker:
            bootstrap = a.broker
        else:
            from fabricwatch.localkafka import LocalKafka

            self._say(f"starting the embedded Kafka broker on 127.0.0.1:{a.kafka_port} (first run downloads it with Maven)...")
            self.kafka = LocalKafka(port=a.kafka_port, state_dir=self.state)
            bootstrap = self.kafka.start()
        self._say(f"kafka: {bootstrap}")

        cert, key = ensure_self_signed(self.state / "tls")
        token = new_token()
        tokens_file = self.state / "collector-tokens.yaml"
        TokenAuth.write(tokens_file, "local-simulator", token, ["node-*", "leaf-*", "spine-*"])
        topology_file = self.state / "topology.yaml"
        if a.simulate:
            from fabricwatch.collectors.run_simulated import SimulationRun, build_simulator

            sim = build_simulator(SimulationRun(nodes=a.nodes, seed=a.seed))
            topology_file.write_text(yaml.safe_dump(sim.topology.to_dict(), sort_keys=False), encoding="utf-8")
        topology = a.topology or (str(topology_file) if a.simulate else None)

        gateway = self._spawn("gateway", "--log-level", "INFO", "gateway", "--broker", bootstrap,
                              "--listen", a.gateway_listen, "--tls-cert", str(cert), "--tls-key", str(key),
                              "--tokens", str(tokens_file), "--cluster", "local")
        ready_file = self.state / "worker.ready"
        ready_file.unlink(missing_ok=True)
        worker_args = ["worker", "--broker", bootstrap, "--default-nic-rate", a.default_nic_rate,
                       "--pfc-detection-ms", str(a.pfc_detection_ms), "--state-dir", str(self.state)]
        if a.pfc_restoration_ms:
            worker_args += ["--pfc-restoration-ms", str(a.pfc_restoration_ms)]
        if topology:
            worker_args += ["--topology", topology]
        worker = self._spawn("worker", *worker_args, env={"FABRICWATCH_WORKER_READY_FILE": str(ready_file)})
        host, _, port = a.gateway_listen.rpartition(":")
        _wait_port(host, int(port), GATEWAY_READY_TIMEOUT_S, gateway)
        self._say(f"gateway: {a.gateway_listen} (TLS, token auth)")
        deadline = time.monotonic() + WORKER_READY_TIMEOUT_S
        while not ready_file.exists():
            if worker.poll() is not None:
                raise RuntimeError(f"worker exited with code {worker.returncode}; see {self.logs / 'worker.log'}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"worker not ready after {WORKER_READY_TIMEOUT_S} s; see {self.logs / 'worker.log'}")
            time.sleep(0.2)
        self._say("worker: joined its consumer group")
        self._start_dashboard(bootstrap, topology)
        self._spawn("respond", "--log-level", "INFO", "respond", "--broker", bootstrap, *(["--policy", a.policy] if a.policy else []))
        feed_token = new_token()
        feed_tokens = self.state / "feed-tokens.yaml"
        TokenAuth.write(feed_tokens, "local-subscriber", feed_token, ["*"])
        (self.state / "feed-token").write_text(feed_token)
        (self.state / "feed-token").chmod(0o600)
        self._spawn("feed", "--log-level", "INFO", "feed", "--broker", bootstrap, "--listen", a.feed_listen,
                    "--tls-cert", str(cert), "--tls-key", str(key), "--tokens", str(feed_tokens))
        self._say(f"event feed (gRPC Subscribe): {a.feed_listen} (TLS, token in {self.state / 'feed-token'})")
        self._say(f"responder: policy {a.policy or 'deploy/policy.example.yaml'} (shadow mode unless it says "
                  f"otherwise); decisions on fabricwatch.audit.v1 and the dashboard's feed")
        return asyncio.run(self._show(bootstrap, token, cert))

    def _start_dashboard(self, bootstrap: str, topology: str | None) -> None:
        """The web dashboard (fabricwatch.dashboard); `up` goes on without it if it cannot start."""
        listen = getattr(self.args, "dashboard_listen", DASHBOARD_LISTEN)
        argv = ["dashboard", "--broker", bootstrap, "--listen", listen] + (["--topology", topology] if topology else [])
        proc = self._spawn("dashboard", *argv)
        url = f"http://{listen}/"
        deadline = time.monotonic() + DASHBOARD_READY_TIMEOUT_S
        while time.monotonic() < deadline and proc.poll() is None:
            try:   # our dashboard answers /api/status; anything else on that port does not
                with urllib.request.urlopen(url + "api/status", timeout=1) as resp:
                    if "open_anomalies" in json.load(resp):
                        self.dashboard_url = url
                        self._say(f"dashboard: {url}")
                        return
            except (OSError, ValueError):
                time.sleep(0.3)
        self._say(f"dashboard: not started (port taken?); see {self.logs / 'dashboard.log'}")

    async def _show(self, bootstrap: str, token: str, cert: Path) -> int:
        a = self.args
        view = LiveView(f"fabricwatch up — {a.nodes}-node simulated cluster" if a.simulate else "fabricwatch up")
        stop = asyncio.Event()
        follower = asyncio.create_task(follow_anomalies(bootstrap, view.add, stop))
        await asyncio.sleep(1.0)  # the follower's position is set before any telemetry flows
        if a.simulate:
            self._spawn("simulate", "simulate", "--gateway", a.gateway_listen, "--ca-cert", str(cert),
                        "--nodes", str(a.nodes), "--seed", str(a.seed), "--duration", "0", "--scenario", "demo",
                        env={"FABRICWATCH_TOKEN": token})
            self._say(f"simulator: {a.nodes} nodes x 8 GPUs x 8 NICs, faults injected within the first ~30 s")
        expected = {k for k in a.expect.split(",") if k}
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        started = time.monotonic()
        while not stop.is_set():
            elapsed = time.monotonic() - started
            view.status = f"up {elapsed:4.0f} s   open anomalies: {len(view.open)}" + (
                f"   dashboard: {self.dashboard_url}" if self.dashboard_url else "")
            view.render()
            if a.duration and elapsed >= a.duration:
                break
            if expected and expected <= set(view.counts):
                break
            if follower.done():
                follower.result()
            try:
                await asyncio.wait_for(stop.wait(), 0.5)
            except asyncio.TimeoutError:
                pass
        stop.set()
        await follower
        missing = expected - set(view.counts)
        if missing:
            self._say(f"expected anomaly kinds not flagged: {sorted(missing)}")
            return 1
        if expected:
            self._say(f"all expected anomaly kinds flagged: {sorted(expected)}")
        return 0

    def _shutdown(self) -> None:
        for proc in reversed(self.procs):
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for proc in reversed(self.procs):
            try:
                proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                proc.kill()
        if self.kafka is not None:
            self.kafka.stop()
