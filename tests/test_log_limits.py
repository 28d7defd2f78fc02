"""Issue #13: reconnect errors are rate-limited in the logs.

During a broker outage the gateway, the dashboard and the event feed (each its own
process, as deployed, logging at the default level) and a collector's sender (in this
process) used to write thousands of lines: every retry of aiokafka and of our own loops.
Here a broker of this module's own is stopped for OUTAGE_S while all of them run, and the
lines each wrote meanwhile are counted. `bench/outage_logs.py` runs the same scenario on
another checkout (the numbers before, docs/security.md).
"""
from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
from helpers import free_port, nic_snapshot, running

from fabricwatch.collectors.sender import GatewaySender, SenderConfig
from fabricwatch.lograte import RateLimitedLogger, RepeatFilter, RepeatLimiter, install_reconnect_log_limits
from fabricwatch.localkafka import LocalKafka
from fabricwatch.streams import topics

OUTAGE_S = 15.0
# With the limits: each kind of line at most BURST times per 30 s window, a handful of kinds.
MAX_LINES_PER_PROCESS = 60


def test_a_repeated_line_passes_a_few_times_then_is_counted():
    now = [0.0]
    limiter = RepeatLimiter(interval_s=30, burst=3, clock=lambda: now[0])
    logger = logging.getLogger("aiokafka.test-limits")
    logger.addFilter(RepeatFilter(limiter))
    records: list[logging.LogRecord] = []
    handler = logging.Handler()
    handler.emit = records.append
    logger.addHandler(handler)
    try:
        for _ in range(1000):
            logger.error("Unable connect to node with id %s: %s", 1, "refused")
        now[0] = 31.0
        logger.error("Unable connect to node with id %s: %s", 1, "refused")
        logger.error("another kind of line")
    finally:
        logger.removeHandler(handler)
        logger.filters.clear()
    assert len(records) == 5 and "997 similar lines held back" in records[3].getMessage()
    ours = []
    limited = RateLimitedLogger(logging.getLogger("fabricwatch.test-limits"), RepeatLimiter(burst=2))
    limited.logger.addHandler(handler)
    handler.emit = ours.append
    try:
        for i in range(50):
            limited.warning("gateway stream broke (%s)", i)
    finally:
        limited.logger.removeHandler(handler)
    assert [r.getMessage() for r in ours] == ["gateway stream broke (0)", "gateway stream broke (1)"]
    assert install_reconnect_log_limits() in logging.getLogger("aiokafka.conn").filters


def _lines(path: Path) -> int:
    return path.read_text(errors="replace").count("\n") if path.exists() else 0


def _wait_port(port: int, proc: subprocess.Popen, log: Path, timeout_s: float = 60) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        assert proc.poll() is None, log.read_text(errors="replace")[-3000:]
        with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), timeout=0.5):
            return
        assert time.monotonic() < deadline, f"nothing listening on {port} after {timeout_s} s"
        time.sleep(0.2)


async def outage_log_lines(python: str, tmp_path: Path, outage_s: float = OUTAGE_S) -> dict[str, int]:
    """Lines each process logged while its broker was down for `outage_s` (see the module doc)."""
    broker = LocalKafka(port=free_port(), controller_port=free_port(), state_dir=tmp_path / "kafka")
    broker.start()
    procs: dict[str, tuple[subprocess.Popen, Path]] = {}
    sender_lines: list[logging.LogRecord] = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = sender_lines.append
    logging.getLogger("fabricwatch.sender").addHandler(handler)
    try:
        await topics.ensure_topics(broker.bootstrap, topics.ALL_TOPICS)
        ports = {name: free_port() for name in ("gateway", "dashboard", "feed")}
        argv = {"gateway": ["gateway", "--listen", f"127.0.0.1:{ports['gateway']}"],
                "dashboard": ["dashboard", "--listen", f"127.0.0.1:{ports['dashboard']}"],
                "feed": ["feed", "--listen", f"127.0.0.1:{ports['feed']}"]}
        for name, args in argv.items():
            log = tmp_path / f"{name}.log"
            with open(log, "ab") as out:
                procs[name] = (subprocess.Popen([python, "-m", "fabricwatch.cli", args[0], "--broker", broker.bootstrap,
                                                 *args[1:]], stdout=out, stderr=subprocess.STDOUT, cwd=tmp_path), log)
        for name, (proc, log) in procs.items():
            _wait_port(ports[name], proc, log)
        status = f"http://127.0.0.1:{ports['dashboard']}/api/status"
        deadline = time.monotonic() + 60
        while '"state":"following"' not in urllib.request.urlopen(status, timeout=5).read().decode():
            assert time.monotonic() < deadline, "the dashboard never followed its topics"
            await asyncio.sleep(0.5)
        sender = GatewaySender(SenderConfig(target=f"127.0.0.1:{ports['gateway']}", backoff_max_s=10.0))
        async with running(sender):
            for i in range(30):
                sender.submit(nic_snapshot(source="node-logs", seq=i))
                await asyncio.sleep(0.1)
            assert await sender.drain(30)
            before = {name: _lines(log) for name, (_, log) in procs.items()}
            sender_lines.clear()
            await asyncio.get_running_loop().run_in_executor(None, broker.stop)
            end = time.monotonic() + outage_s
            i = 30
            while time.monotonic() < end:
                sender.submit(nic_snapshot(source="node-logs", seq=i))
                i += 1
                await asyncio.sleep(0.1)
            during = {name: _lines(log) - before[name] for name, (_, log) in procs.items()}
            during["sender"] = len(sender_lines)
        for name, (proc, _) in procs.items():
            assert proc.poll() is None, f"{name} died during the outage"
        return during
    finally:
        logging.getLogger("fabricwatch.sender").removeHandler(handler)
        for proc, _ in procs.values():
            proc.terminate()
        for proc, _ in procs.values():
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
        broker.stop()


@pytest.mark.slow
async def test_a_broker_outage_writes_a_bounded_number_of_log_lines(tmp_path):
    during = await outage_log_lines(sys.executable, tmp_path)
    print(f"log lines during a {OUTAGE_S:.0f} s broker outage: {during}")
    assert all(lines <= MAX_LINES_PER_PROCESS for lines in during.values()), during
