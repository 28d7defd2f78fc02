"""Run the worker: the Faust app with its agents, until interrupted.

One worker holds the stage instances of the partitions assigned to it (`streams.partitions`)
and one copy of the facts every worker reads (`streams.fact_reader`). Workers with the same
``--app-id`` share the partitions; any number of them gives the answers one gives.
"""
from __future__ import annotations

import asyncio
import logging
from pathlib import Path

import faust

from fabricwatch import metrics
from fabricwatch.models.node_health import HealthBook
from fabricwatch.models.nominal import NominalRates
from fabricwatch.models.topology import Topology

from . import topics
from .agents import register
from .app import WorkerSettings, build_app
from .config import DetectionConfig
from .fact_reader import FactReader
from .facts import FactBook
from .handlers import StageHandlers
from .history import KafkaHistory
from .partitions import PartitionStates
from .straggler_stage import StragglerStage
from .state_store import KafkaStateLog, StateStore, fingerprint
from .worker_metrics import REFRESH_INTERVAL_S, WorkerMetrics

log = logging.getLogger("fabricwatch.worker")
# The worker sees live data: findings on records the gateway received longer ago than this
# are marked stale (`DetectionConfig.max_sample_age_s`): the default of ``--stale-after``
# (0 turns it off).
LIVE_MAX_SAMPLE_AGE_S = 120.0


def run_worker(settings: WorkerSettings, detection: DetectionConfig, topology: Topology | None,
               loglevel: str = "WARNING", log_format: str = "text") -> None:
    # Faust's own leader-election topic too: the broker does not auto-create topics.
    leader = topics.TopicSpec(f"{settings.app_id}-__assignor-__leader", partitions=1, retention_ms=topics.DAY_MS)
    asyncio.run(topics.ensure_topics(settings.bootstrap, [*topics.ALL_TOPICS, leader]))
    # what the topics really have (they may predate this configuration)
    facts_partitions = len(asyncio.run(topics.partitions_of(settings.bootstrap, topics.FACTS)))
    state_partitions = len(asyncio.run(topics.partitions_of(settings.bootstrap, topics.STATE)))
    telemetry_partitions = len(asyncio.run(topics.partitions_of(settings.bootstrap, topics.TELEMETRY)))
    pause_partitions = len(asyncio.run(topics.partitions_of(settings.bootstrap, topics.PAUSE_STATES)))
    app = build_app(settings)
    facts = FactBook(topology, NominalRates(topology, default=detection.default_nic_rate), HealthBook(topology=topology))
    reader = FactReader(settings.bootstrap, topics.FACTS, facts)
    store = None
    if settings.checkpoints:
        async def send_state(key: bytes, value: bytes, partition: int) -> None:
            await app.state_topic.send(key=key, value=value, partition=partition, force=True)

        store = StateStore(KafkaStateLog(settings.bootstrap, topics.STATE, send_state), state_partitions,
                           fingerprint(detection, topology.to_dict() if topology is not None else None),
                           settings.checkpoint_interval_s, namespace=settings.app_id)
    states = PartitionStates(detection, topology, facts, store, KafkaHistory(settings.bootstrap), {
        topics.TELEMETRY: settings.rebuild_telemetry_lookback_s,
        topics.PAUSE_STATES: settings.rebuild_pause_states_lookback_s,
        topics.RANK_STEPS: settings.rebuild_rank_steps_lookback_s}, flush=lambda: app.producer.flush(),
        telemetry_partitions=telemetry_partitions)
    handlers = StageHandlers(facts_partitions, pause_partitions)
    register(app, handlers, states, reader, history=KafkaHistory(settings.bootstrap))

    if store is not None:
        @app.timer(settings.checkpoint_interval_s)
        async def _checkpoint() -> None:
            await states.checkpoint()

        @app.on_before_shutdown.connect
        async def _final_checkpoint(sender, **kwargs) -> None:
            await states.checkpoint()

    @app.on_before_shutdown.connect
    async def _log_stage_stats(sender, **kwargs) -> None:
        for (topic, partition), stage in sorted(states.stages.items()):
            held = f", {stage.held} held" if isinstance(stage, StragglerStage) else ""
            log.info("at shutdown %s[%d]: %s%s", topic, partition, dict(sorted(stage.stats.items())), held)
        log.info("at shutdown: handlers %s, partitions %s", dict(handlers.stats), dict(states.stats))

    worker_metrics = WorkerMetrics(app, handlers, states, reader, settings.caught_up_lag)

    @app.timer(REFRESH_INTERVAL_S)
    async def _refresh_metrics() -> None:
        await worker_metrics.refresh()

    if settings.ready_file:
        @app.on_rebalance_complete.connect
        async def _mark_ready(sender, **kwargs) -> None:
            Path(settings.ready_file).touch()
    logging.getLogger("fabricwatch").setLevel(loglevel)
    metrics.WORKER_CHECKPOINT_AGE.set(float("nan"))
    # Faust replaces the root logger's handlers with its own text ones unless told not to.
    worker = faust.Worker(app, loglevel=loglevel, quiet=True, override_logging=log_format != "json")
    if log_format == "json":
        worker.spinner = None   # its terminal codes ("\x1b[?25h") would break the first JSON line
    worker.execute_from_commandline()
