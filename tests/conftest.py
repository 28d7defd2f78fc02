"""Shared pytest fixtures."""

from __future__ import annotations

import os
import socket
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

# The tests' brokers hold a few simulated racks: the embedded partition count, as for
# `fabricwatch up` (set before anything imports `streams.topics`, which reads it once).
_EMBEDDED = "12"
os.environ.setdefault("FABRICWATCH_PARTITIONS", _EMBEDDED)
from fabricwatch.streams import topics as _topics  # noqa: E402

if TYPE_CHECKING:
    from fabricwatch.localkafka import LocalKafka

assert _EMBEDDED == str(_topics.EMBEDDED_PARTITIONS), "conftest's partition count drifted from streams.topics"

# ---------------------------------------------------------------------- local Kafka
# Only tests that request `kafka_bootstrap` start a broker (once per session; a cold
# start fetches the jars with Maven first). Mark such tests `@pytest.mark.kafka` so that
# `-m "not kafka"` skips them on a machine without Java.
#
#   FABRICWATCH_TEST_BROKER=host:port   use that broker instead of starting one
#   FABRICWATCH_TEST_KAFKA_PORT=N        start the local broker on N (controller N+1)

_FIRST_TEST_PORT = 19092


def _port_free(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def _free_port_pair(first: int = _FIRST_TEST_PORT, tries: int = 50) -> int:
    """A port N with N and N+1 free on 127.0.0.1, from `first` up, below the ephemeral range."""
    for port in range(first, first + 2 * tries, 2):
        if _port_free(port) and _port_free(port + 1):
            return port
    raise RuntimeError(f"no free port pair in {first}..{first + 2 * tries}")


@pytest.fixture(scope="session")
def kafka_bootstrap(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """Bootstrap address of a Kafka broker for the whole test session."""
    from fabricwatch.localkafka import LocalKafka, wait_for_broker_blocking

    external = os.environ.get("FABRICWATCH_TEST_BROKER")
    if external:
        wait_for_broker_blocking(external, timeout_s=60)
        yield external
        return

    port = int(os.environ.get("FABRICWATCH_TEST_KAFKA_PORT") or _free_port_pair())
    kafka = LocalKafka(port=port, state_dir=tmp_path_factory.mktemp("kafka-state"))
    bootstrap = kafka.start()
    try:
        yield bootstrap
    finally:
        kafka.stop()


# ---------------------------------------------------------------------- local Slurm and Alertmanager
# Real services for the action layer (deploy/slurm/slurm-local.sh, deploy/alertmanager/
# alertmanager-local.sh), once per session. CI installs them (.ci/run); elsewhere the tests
# that need them skip with the install command.
_DEPLOY = Path(__file__).resolve().parent.parent / "deploy"


@pytest.fixture(scope="session")
def slurm_conf(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """SLURM_CONF of a real slurmctld + slurmd (one node: this host)."""
    import shutil
    import subprocess

    if shutil.which("slurmctld") is None or shutil.which("slurmd") is None:
        pytest.skip("slurmctld/slurmd not installed (apt-get install slurm-wlm munge)")
    if os.geteuid() != 0:
        pytest.skip("a local Slurm needs root (slurmd starts jobs as their users)")
    state_dir = tmp_path_factory.mktemp("slurm-state")
    script = _DEPLOY / "slurm" / "slurm-local.sh"
    started = subprocess.run([str(script), "start", str(state_dir)], capture_output=True, text=True, timeout=180)
    if started.returncode != 0:
        pytest.fail(f"slurm-local.sh start failed:\n{started.stderr}")
    conf = next(ln.split("=", 1)[1] for ln in started.stdout.splitlines() if ln.startswith("SLURM_CONF="))
    try:
        yield conf
    finally:
        subprocess.run([str(script), "stop", str(state_dir)], capture_output=True, timeout=60)


@pytest.fixture(scope="session")
def alertmanager_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """Base URL of a real Alertmanager (Debian's prometheus-alertmanager) on loopback."""
    import shutil
    import subprocess

    if not (shutil.which("prometheus-alertmanager") or shutil.which("alertmanager")):
        pytest.skip("prometheus-alertmanager is not installed (apt-get install prometheus-alertmanager)")
    state_dir = tmp_path_factory.mktemp("alertmanager")
    script = _DEPLOY / "alertmanager" / "alertmanager-local.sh"
    port = str(_free_port_pair(first=19300))
    started = subprocess.run([str(script), "start", str(state_dir), port], capture_output=True, text=True,
                             timeout=90)
    if started.returncode != 0:
        pytest.fail(f"alertmanager-local.sh start failed:\n{started.stderr}")
    try:
        yield started.stdout.strip()
    finally:
        subprocess.run([str(script), "stop", str(state_dir), port], capture_output=True, timeout=30)


# Tests on these real services take seconds each (and the first starts the service): they
# are `slow` by nature, so that `-m "not slow and not kafka"` never starts one.
_SLOW_SERVICES = {"slurm_conf", "alertmanager_url"}


@pytest.hookimpl(tryfirst=True)       # before `-m` deselects
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        if _SLOW_SERVICES.intersection(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.slow)


# ---------------------------------------------------------------------- leaked file descriptors
# Sockets, pipes and files that tests (or the code under test) forget to close pile up over a
# session; the ResourceWarnings (errors, see pyproject) catch most, this catches the rest,
# e.g. a gRPC channel or a child's pipe still referenced at the end. Linux only (/proc).
_FD_DIR = Path("/proc/self/fd")
FD_GROWTH_LIMIT = 64       # generous: a session-scoped broker client or a cached loop may stay open
_fds_at_start: int | None = None
_fds_peak = 0
_fd_growth_key = pytest.StashKey[int]()


def _open_fds() -> int | None:
    return len(os.listdir(_FD_DIR)) if _FD_DIR.is_dir() else None


def pytest_sessionstart(session: pytest.Session) -> None:
    global _fds_at_start
    _fds_at_start = _open_fds()


def pytest_runtest_logfinish(nodeid: str, location: tuple) -> None:
    global _fds_peak
    if _fds_at_start is not None:
        _fds_peak = max(_fds_peak, _open_fds() or 0)


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    import gc

    if _fds_at_start is None:
        return
    gc.collect()                    # count only what is still referenced, not garbage awaiting collection
    grown = (_open_fds() or 0) - _fds_at_start
    session.config.stash[_fd_growth_key] = grown
    if grown > FD_GROWTH_LIMIT and exitstatus == pytest.ExitCode.OK:
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


def pytest_terminal_summary(terminalreporter, exitstatus: int, config: pytest.Config) -> None:
    grown = config.stash.get(_fd_growth_key, None)
    if grown is None or not _fds_peak:      # --collect-only: nothing ran
        return
    verdict = "FAILED: more than " + str(FD_GROWTH_LIMIT) if grown > FD_GROWTH_LIMIT else "ok"
    terminalreporter.write_line(f"open file descriptors: {_fds_at_start} at start, {_fds_at_start + grown} "
                                f"at the end ({verdict}), at most {_fds_peak} after a test")


# ---------------------------------------------------------------------- a broker per module
@pytest.fixture(scope="module")
def broker(tmp_path_factory) -> Iterator[LocalKafka]:
    """A broker for the requesting module alone (the fault-injection scenarios stop and restart it)."""
    from fabricwatch.localkafka import LocalKafka
    from helpers import free_port

    kafka = LocalKafka(port=free_port(), controller_port=free_port(),
                       state_dir=tmp_path_factory.mktemp("fault-kafka"))
    kafka.start()
    try:
        yield kafka
    finally:
        kafka.stop()
