"""The local single-node Kafka broker used by the tests, CI and ``fabricwatch up``.

A thin Python face over ``deploy/kafka/kafka-local.sh``, which fetches the Kafka 4.x jars
from Maven Central (``deploy/kafka/pom.xml``), formats KRaft storage and runs one
combined broker+controller JVM on 127.0.0.1. Needs ``java`` (17+) and, the first time
only, ``mvn``.

>>> kafka = LocalKafka(port=19092, state_dir=Path("/tmp/fw-state"))
>>> kafka.bootstrap
'127.0.0.1:19092'

Typical use::

    with LocalKafka(port=19092, state_dir=tmp) as bootstrap:
        ...  # bootstrap == "127.0.0.1:19092"
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import os
import shutil
import subprocess
import time
from pathlib import Path
from types import TracebackType

__all__ = [
    "KAFKA_SCRIPT",
    "LocalKafka",
    "LocalKafkaError",
    "wait_for_broker",
    "wait_for_broker_blocking",
]

#: The script that does the work; located relative to the repository checkout.
KAFKA_SCRIPT = Path(__file__).resolve().parents[1] / "deploy" / "kafka" / "kafka-local.sh"

# Upper bound for one `kafka-local.sh start`: a cold Maven fetch plus the broker's own
# start timeout. The script enforces the broker part itself.
_FETCH_ALLOWANCE_S = 900


class LocalKafkaError(RuntimeError):
    """The local broker could not be fetched, started or stopped."""


class LocalKafka:
    """A single-node KRaft Kafka broker on 127.0.0.1, run by ``kafka-local.sh``.

    :param port: the broker (PLAINTEXT) port; the KRaft controller takes ``port + 1``
        unless ``controller_port`` is given.
    :param state_dir: where data dirs live; this broker's is ``state_dir/kafka-<port>``.
        Default: ``$FABRICWATCH_STATE`` or ``./.fabricwatch``.
    :param cache_dir: the fabricwatch cache root the jars go under
        (``<cache_dir>/kafka-4.1.1/libs``). Default: ``$FABRICWATCH_CACHE`` or
        ``~/.cache/fabricwatch``.
    :param start_timeout_s: how long to wait for the started broker to answer metadata.
    """

    def __init__(
        self,
        port: int = 9092,
        state_dir: Path | str | None = None,
        cache_dir: Path | str | None = None,
        *,
        controller_port: int | None = None,
        start_timeout_s: int = 90,
    ) -> None:
        self.port = int(port)
        self.controller_port = controller_port
        if state_dir is None:
            state_dir = os.environ.get("FABRICWATCH_STATE", ".fabricwatch")
        self.state_dir = Path(state_dir).absolute()
        self.cache_dir = Path(cache_dir).absolute() if cache_dir is not None else None
        self.start_timeout_s = int(start_timeout_s)

    @property
    def bootstrap(self) -> str:
        """The bootstrap address, ``127.0.0.1:<port>``."""
        return f"127.0.0.1:{self.port}"

    @property
    def data_dir(self) -> Path:
        """This broker's data dir (config, KRaft storage, logs under ``log/``)."""
        return self.state_dir / f"kafka-{self.port}"

    # ------------------------------------------------------------------ lifecycle
    def start(self) -> str:
        """Start the broker (fetching the jars first if needed); return the bootstrap.

        Idempotent: if this broker already runs, returns its address at once.
        """
        _require_java()
        result = self._run("start", timeout=self.start_timeout_s + _FETCH_ALLOWANCE_S)
        lines = result.stdout.strip().splitlines()
        return lines[-1] if lines else self.bootstrap

    def stop(self) -> None:
        """Stop the broker (SIGTERM, then SIGKILL after 30 s). No-op if not running."""
        self._run("stop", timeout=60)

    def is_running(self) -> bool:
        """True when the broker process runs and answers metadata requests."""
        return self._run("status", timeout=30, check=False).returncode == 0

    def wipe(self) -> None:
        """Stop the broker and delete its data dir."""
        self._run("wipe", timeout=60)

    def __enter__(self) -> str:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()

    def __repr__(self) -> str:
        return f"LocalKafka(port={self.port}, data_dir={str(self.data_dir)!r})"

    # ------------------------------------------------------------------ internals
    def _run(self, command: str, *, timeout: float, check: bool = True) -> subprocess.CompletedProcess[str]:
        if not KAFKA_SCRIPT.is_file():
            raise LocalKafkaError(
                f"{KAFKA_SCRIPT} not found: LocalKafka needs a source checkout of fabricwatch"
            )
        if shutil.which("bash") is None:
            raise LocalKafkaError("bash not found: kafka-local.sh needs bash")
        env = dict(os.environ)
        env["FABRICWATCH_STATE"] = str(self.state_dir)
        env["FABRICWATCH_KAFKA_PORT"] = str(self.port)
        env["FABRICWATCH_KAFKA_START_TIMEOUT"] = str(self.start_timeout_s)
        if self.controller_port is not None:
            env["FABRICWATCH_KAFKA_CONTROLLER_PORT"] = str(self.controller_port)
        else:
            env.pop("FABRICWATCH_KAFKA_CONTROLLER_PORT", None)
        env.pop("FABRICWATCH_KAFKA_DATA_DIR", None)  # always state_dir/kafka-<port>
        if self.cache_dir is not None:
            env["FABRICWATCH_CACHE"] = str(self.cache_dir)
            env.pop("FABRICWATCH_KAFKA_LIBS", None)
        try:
            result = subprocess.run(
                ["bash", str(KAFKA_SCRIPT), command],
                env=env,
                stdin=subprocess.DEVNULL,
                capture_output=True,
                text=True,
                timeout=timeout,
            )
        except subprocess.TimeoutExpired as e:
            raise LocalKafkaError(
                f"kafka-local.sh {command} did not finish within {timeout:.0f}s "
                f"(logs: {self.data_dir / 'log'})"
            ) from e
        if check and result.returncode != 0:
            raise LocalKafkaError(
                f"kafka-local.sh {command} failed (exit {result.returncode}) for {self!r}:\n"
                + _tail(result.stderr or result.stdout)
            )
        return result


def _tail(text: str, lines: int = 60) -> str:
    return "\n".join(text.strip().splitlines()[-lines:])


def _require_java() -> None:
    java_home = os.environ.get("JAVA_HOME")
    if java_home and Path(java_home, "bin", "java").is_file():
        return
    if shutil.which("java") is None:
        raise LocalKafkaError(
            "java not found: install Java 17 (e.g. apt-get install openjdk-17-jre-headless) "
            "or set JAVA_HOME; the local Kafka broker is a JVM process"
        )


# ---------------------------------------------------------------------- readiness
async def wait_for_broker(bootstrap: str, timeout_s: float = 60.0) -> None:
    """Wait until the broker(s) at ``bootstrap`` answer a metadata request with at least
    one live broker. Raises :class:`TimeoutError` (with the last error) otherwise."""
    from aiokafka.admin import AIOKafkaAdminClient

    deadline = time.monotonic() + timeout_s
    last_error: BaseException | None = None
    while True:
        admin = AIOKafkaAdminClient(bootstrap_servers=bootstrap, request_timeout_ms=5000)
        try:
            await admin.start()
            cluster = await admin.describe_cluster()
            if cluster.get("brokers"):
                return
            last_error = RuntimeError("metadata lists no live broker yet")
        except Exception as e:  # connection refused, timeouts, not ready yet
            last_error = e
        finally:
            try:
                await admin.close()
            except Exception:
                pass
        if time.monotonic() >= deadline:
            raise TimeoutError(
                f"Kafka at {bootstrap} did not answer within {timeout_s:.0f}s: {last_error!r}"
            )
        await asyncio.sleep(0.5)


def wait_for_broker_blocking(bootstrap: str, timeout_s: float = 60.0) -> None:
    """:func:`wait_for_broker` for synchronous code, safe to call whether or not an event
    loop runs in this thread (it runs on a private loop in a worker thread)."""
    with concurrent.futures.ThreadPoolExecutor(max_workers=1) as pool:
        pool.submit(asyncio.run, wait_for_broker(bootstrap, timeout_s)).result()
