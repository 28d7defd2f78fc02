"""The project's Kafka topics and their creation.

The broker runs with ``auto.create.topics.enable=false``: every topic is declared here
and created by :func:`ensure_topics` with explicit partition counts and configs.

Topic names carry a schema version suffix (``.v1``); a breaking change of the payload
gets a new topic, not an in-place change. Every name starts with `PREFIX` (default
``fabricwatch.``; the environment variable ``FABRICWATCH_TOPIC_PREFIX``, which every
command's ``--topic-prefix`` sets), so several deployments or test runs share a broker.

=========================  ==========================  ==========  =========
topic                      key                         partitions  retention
=========================  ==========================  ==========  =========
``TELEMETRY``              source node / switch name   24 (P)      6 h
``RANK_STEPS``             job id                      24 (P)      6 h
``PAUSE_STATES``           cluster name                3           1 day
``FACTS``                  fact (``streams.facts``)    24 (P)      compacted
``STATE``                  stage / partition / chunk   24 (P)      compacted, 1 h
``ANOMALIES``              anomaly dedup key           6           7 days
``ACTIONS``                (see actions/)              6           30 days
``AUDIT``                  (see actions/)              6           30 days
=========================  ==========================  ==========  =========

P, the stage-1 partitions, is ``FABRICWATCH_PARTITIONS`` (``--partitions``) when the
topics are created: it caps the workers that share the load and sizes what a rebalance
moves (docs/operations.md has the sizing table). The default, 24, serves a 100,000-GPU
cluster (22 workers at 60 % busy, `docs/benchmarks.md`); `fabricwatch up`'s embedded
stack and the tests create `EMBEDDED_PARTITIONS`. FACTS and STATE have P partitions too:
a partition's facts and checkpoints go to the partition of the same number.

>>> [s.name for s in ALL_TOPICS][:2]
['fabricwatch.telemetry.v2', 'fabricwatch.rank-steps.v1']
>>> SPECS[TELEMETRY].partitions == PARTITIONS, SPECS[TELEMETRY].configs()["retention.ms"]
(True, '21600000')
>>> [s.partitions for s in all_topics(partitions=1)]
[1, 1, 1, 1, 1, 1, 1, 1]
>>> all_topics(partitions={ANOMALIES: 2})[5].partitions
2
>>> SPECS[FACTS].configs()["cleanup.policy"]
'compact'
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
import re
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

__all__ = [
    "ACTIONS",
    "ALL_TOPICS",
    "ANOMALIES",
    "AUDIT",
    "FACTS",
    "PARTITIONS",
    "PAUSE_STATES",
    "PREFIX",
    "RANK_STEPS",
    "SPECS",
    "STATE",
    "TELEMETRY",
    "TopicSpec",
    "all_topics",
    "ensure_topics",
    "partitions_of",
]

log = logging.getLogger(__name__)

HOUR_MS = 60 * 60 * 1000
DAY_MS = 24 * HOUR_MS

_CLEANUP_POLICIES = {"delete", "compact", "compact,delete", "delete,compact"}


@dataclass(frozen=True)
class TopicSpec:
    """One topic as the application wants it."""

    name: str
    partitions: int
    retention_ms: int
    cleanup_policy: str = "delete"
    replication_factor: int = 1
    # Compacted topics roll segments often: only closed segments are compacted, so the
    # default of 7 days would keep every checkpoint of a week.
    segment_ms: int | None = None

    def __post_init__(self) -> None:
        if not self.name:
            raise ValueError("topic name must not be empty")
        if self.partitions < 1:
            raise ValueError(f"{self.name}: partitions must be >= 1, got {self.partitions}")
        if self.replication_factor < 1:
            raise ValueError(f"{self.name}: replication_factor must be >= 1")
        if self.retention_ms < -1 or self.retention_ms == 0:
            raise ValueError(f"{self.name}: retention_ms must be > 0 or -1 (forever)")
        if self.cleanup_policy not in _CLEANUP_POLICIES:
            raise ValueError(f"{self.name}: unknown cleanup_policy {self.cleanup_policy!r}")

    def configs(self) -> dict[str, str]:
        """The topic-level configs this spec sets at creation."""
        out = {"retention.ms": str(self.retention_ms), "cleanup.policy": self.cleanup_policy}
        if self.segment_ms is not None:
            out["segment.ms"] = str(self.segment_ms)
        return out

    def with_partitions(self, partitions: int) -> TopicSpec:
        return dataclasses.replace(self, partitions=partitions)


# ---------------------------------------------------------------------- the topics
_PREFIX_RE = re.compile(r"^[A-Za-z0-9._-]{0,100}$")


def _env_prefix() -> str:
    prefix = os.environ.get("FABRICWATCH_TOPIC_PREFIX", "fabricwatch.")
    if not _PREFIX_RE.match(prefix):
        raise ValueError(f"FABRICWATCH_TOPIC_PREFIX {prefix!r}: letters, digits, '.', '_' and '-' only")
    return prefix


#: Stage-1 partitions when nothing says otherwise: enough workers for 100,000 GPUs.
DEFAULT_PARTITIONS = 24
#: For a simulated cluster of a few racks (`fabricwatch up`, the tests): fewer partitions
#: keep the fixed per-partition cost (progress, checkpoints) of one worker small.
EMBEDDED_PARTITIONS = 12


def _env_partitions() -> int:
    raw = os.environ.get("FABRICWATCH_PARTITIONS", str(DEFAULT_PARTITIONS))
    if not raw.isdigit() or not 1 <= int(raw) <= 1024:
        raise ValueError(f"FABRICWATCH_PARTITIONS {raw!r}: an integer 1..1024")
    return int(raw)


#: What every topic name starts with (``FABRICWATCH_TOPIC_PREFIX``).
PREFIX = _env_prefix()
#: Partitions of the stage-1 topics (telemetry, rank steps, facts, state) at creation.
PARTITIONS = _env_partitions()
#: Fabric telemetry: `SourceRecord`s, several ticks of one source each. Key: source name.
TELEMETRY = f"{PREFIX}telemetry.v2"
#: Per-rank training step timings. Key: job id.
RANK_STEPS = f"{PREFIX}rank-steps.v1"
#: PFC watchdog onsets/restorations and stage-1 progress, input of the storm locator. Key: cluster.
PAUSE_STATES = f"{PREFIX}pause-states.v1"
#: What a stage tells every worker (node health, nominal-rate votes, placements, progress).
FACTS = f"{PREFIX}facts.v1"
#: Checkpoints of each partition's detection state (`streams.state_store`).
STATE = f"{PREFIX}state.v1"
#: Detected anomalies. Key: the anomaly's dedup key.
ANOMALIES = f"{PREFIX}anomalies.v1"
#: Remediation actions requested / taken.
ACTIONS = f"{PREFIX}actions.v1"
#: Audit trail of decisions and actions.
AUDIT = f"{PREFIX}audit.v1"

_DEFAULTS: tuple[TopicSpec, ...] = (
    TopicSpec(TELEMETRY, partitions=PARTITIONS, retention_ms=6 * HOUR_MS),
    TopicSpec(RANK_STEPS, partitions=PARTITIONS, retention_ms=6 * HOUR_MS),
    TopicSpec(PAUSE_STATES, partitions=3, retention_ms=1 * DAY_MS),
    TopicSpec(FACTS, partitions=PARTITIONS, retention_ms=-1, cleanup_policy="compact", segment_ms=10 * 60_000),
    TopicSpec(STATE, partitions=PARTITIONS, retention_ms=1 * HOUR_MS, cleanup_policy="compact,delete",
              segment_ms=5 * 60_000),
    TopicSpec(ANOMALIES, partitions=6, retention_ms=7 * DAY_MS),
    TopicSpec(ACTIONS, partitions=6, retention_ms=30 * DAY_MS),
    TopicSpec(AUDIT, partitions=6, retention_ms=30 * DAY_MS),
)


def all_topics(partitions: int | Mapping[str, int] | None = None) -> list[TopicSpec]:
    """The project's topic specs, optionally with other partition counts.

    :param partitions: ``None`` for the defaults; an ``int`` for every topic (e.g. 1 on
        a laptop); or a mapping ``{topic name: partitions}`` for some of them.
    """
    if partitions is None:
        return list(_DEFAULTS)
    if isinstance(partitions, int):
        return [s.with_partitions(partitions) for s in _DEFAULTS]
    unknown = set(partitions) - {s.name for s in _DEFAULTS}
    if unknown:
        raise ValueError(f"unknown topics in partitions override: {sorted(unknown)}")
    return [s.with_partitions(partitions.get(s.name, s.partitions)) for s in _DEFAULTS]


#: Every topic the application uses, with default partition counts.
ALL_TOPICS: list[TopicSpec] = all_topics()
#: The same, by name.
SPECS: dict[str, TopicSpec] = {s.name: s for s in ALL_TOPICS}


# ---------------------------------------------------------------------- creation
# Kafka error codes that ensure_topics treats as "fine".
_NO_ERROR = 0
_TOPIC_ALREADY_EXISTS = 36


async def ensure_topics(
    bootstrap: str,
    specs: Iterable[TopicSpec],
    *,
    timeout_s: float = 30.0,
) -> None:
    """Create the topics of ``specs`` that do not exist yet; leave existing ones as they are.

    Creation races with another creator are tolerated (``TopicAlreadyExists``). Returns
    once every topic of ``specs`` is visible in the metadata with all its partitions led,
    so producers can use them at once. An existing topic with fewer partitions than its
    spec is logged, not changed.

    :raises aiokafka.errors.KafkaError: a topic could not be created (bad config, ...).
    :raises TimeoutError: the topics did not all show up within ``timeout_s``.
    """
    from aiokafka.admin import AIOKafkaAdminClient, NewTopic
    from aiokafka.errors import for_code

    specs = list(specs)
    if not specs:
        return
    names = [s.name for s in specs]
    if len(set(names)) != len(names):
        raise ValueError(f"duplicate topic names in specs: {names}")

    admin = AIOKafkaAdminClient(
        bootstrap_servers=bootstrap,
        client_id="fabricwatch-topics",
        request_timeout_ms=int(timeout_s * 1000),
    )
    await admin.start()
    try:
        existing = set(await admin.list_topics())
        missing = [s for s in specs if s.name not in existing]
        if missing:
            response = await admin.create_topics(
                [
                    NewTopic(
                        name=s.name,
                        num_partitions=s.partitions,
                        replication_factor=s.replication_factor,
                        topic_configs=s.configs(),
                    )
                    for s in missing
                ],
                timeout_ms=int(timeout_s * 1000),
            )
            for topic, code, message in _topic_errors(response):
                if code == _TOPIC_ALREADY_EXISTS:
                    log.info("topic %s was created concurrently", topic)
                elif code != _NO_ERROR:
                    raise for_code(code)(f"could not create topic {topic}: {message}")
            log.info("created topics %s", [s.name for s in missing])
        await _wait_visible(admin, specs, timeout_s)
    finally:
        await admin.close()


async def partitions_of(bootstrap: str, topic: str, timeout_s: float = 30.0) -> list[int]:
    """The partition numbers a topic has now (empty when it does not exist)."""
    from aiokafka.admin import AIOKafkaAdminClient

    admin = AIOKafkaAdminClient(bootstrap_servers=bootstrap, client_id="fabricwatch-topics",
                                request_timeout_ms=int(timeout_s * 1000))
    await admin.start()
    try:
        described = await admin.describe_topics([topic])
        return sorted(p["partition"] for t in described if t["topic"] == topic and t["error_code"] == _NO_ERROR
                      for p in t["partitions"])
    finally:
        await admin.close()


def _topic_errors(response) -> list[tuple[str, int, str | None]]:
    """(topic, error_code, error_message) for every topic of a CreateTopicsResponse."""
    out = []
    for entry in response.topic_errors:
        topic, code = entry[0], entry[1]
        message = entry[2] if len(entry) > 2 else None
        out.append((topic, code, message))
    return out


async def _wait_visible(admin, specs: list[TopicSpec], timeout_s: float) -> None:
    """Wait until each topic is in the metadata with every partition led."""
    deadline = time.monotonic() + timeout_s
    pending = {s.name: s for s in specs}
    while True:
        described = await admin.describe_topics(list(pending))
        for t in described:
            spec = pending.get(t["topic"])
            if spec is None or t["error_code"] != _NO_ERROR:
                continue
            parts = t["partitions"]
            if parts and all(p["leader"] >= 0 for p in parts):
                if len(parts) < spec.partitions:
                    log.warning(
                        "topic %s exists with %d partitions, spec wants %d; left unchanged",
                        spec.name, len(parts), spec.partitions,
                    )
                del pending[spec.name]
        if not pending:
            return
        if time.monotonic() >= deadline:
            raise TimeoutError(f"topics not ready after {timeout_s:.0f}s: {sorted(pending)}")
        await asyncio.sleep(0.2)
