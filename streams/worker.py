"""Run the worker: the Faust app with its agents, until interrupted."""
from __future__ import annotations

import asyncio
import dataclasses
import logging
from pathlib import Path

import faust

from fabricwatch.models.topology import Topology

from . import checkpoint, topics
from .agents import register
from .app import WorkerSettings, build_app
from .coverage import Coverage
from .handlers import StageHandlers
from .history import KafkaHistory
from .pipeline import DetectionConfig, DetectionPipeline
from .rebuild import StateKeeper
from .worker_metrics import REFRESH_INTERVAL_S, WorkerMetrics


log = logging.getLogger("fabricwatch.worker")
# The worker sees live data: findings on samples older than this are marked stale
# (`DetectionConfig.max_sample_age_s`) unless the configuration sets its own bound.
LIVE_MAX_SAMPLE_AGE_S = 120.0


def run_worker(settings: WorkerSettings, detection: DetectionConfig, topology: Topology | None,
               loglevel: str = "WARNING", log_format: str = "text") -> None:
    # Faust's own leader-election topic too: the broker does not auto-create topics.
    leader = topics.TopicSpec(f"{settings.app_id}-__assignor-__leader", partitions=1, retention_ms=topics.DAY_MS)
    asyncio.run(topics.ensure_topics(settings.bootstrap, [*topics.ALL_TOPICS, leader]))
    app = build_app(settings)
    if detection.max_sample_age_s is None:
        detection = dataclasses.replace(detection, max_sample_age_s=LIVE_MAX_SAMPLE_AGE_S)
    pipeline, coverage = DetectionPipeline(detection, topology), Coverage()
    ckpt = Path(settings.state_dir) / f"{settings.app_id}.checkpoint" if settings.state_dir else None
    restored = checkpoint.load(ckpt, pipeline) if ckpt is not None else None
    if restored is not None:
        pipeline, coverage = restored.pipeline, Coverage(restored.offsets)
        log.warning("restored detection state from %s (%d snapshots seen before, %d partitions covered)", ckpt,
                    pipeline.stats["snapshots"], len(coverage.offsets))
    keeper = StateKeeper(coverage, KafkaHistory(settings.bootstrap), {
        topics.TELEMETRY: settings.rebuild_telemetry_lookback_s,
        topics.PAUSE_STATES: settings.rebuild_pause_states_lookback_s,
        topics.RANK_STEPS: settings.rebuild_rank_steps_lookback_s})

    @app.on_partitions_assigned.connect
    async def _check_coverage(sender, *args, **kwargs) -> None:
        coverage.on_assignment()

    if ckpt is not None:
        async def save_checkpoint() -> None:
            async with keeper.lock:
                payload = checkpoint.dumps(pipeline, coverage.offsets)
            await app.producer.flush()       # what the payload covers has been emitted before it is on disk
            checkpoint.write(payload, ckpt)

        @app.timer(settings.checkpoint_interval_s)
        async def _checkpoint() -> None:
            await save_checkpoint()

        @app.on_before_shutdown.connect
        async def _final_checkpoint(sender, **kwargs) -> None:
            await save_checkpoint()

    handlers = StageHandlers(pipeline)
    register(app, handlers, keeper)
    worker_metrics = WorkerMetrics(app, handlers, pipeline, ckpt)

    @app.timer(REFRESH_INTERVAL_S)
    async def _refresh_metrics() -> None:
        await worker_metrics.refresh()

    if settings.ready_file:
        @app.on_rebalance_complete.connect
        async def _mark_ready(sender, **kwargs) -> None:
            Path(settings.ready_file).touch()
    logging.getLogger("fabricwatch").setLevel(loglevel)
    # Faust replaces the root logger's handlers with its own text ones unless told not to.
    worker = faust.Worker(app, loglevel=loglevel, quiet=True, override_logging=log_format != "json")
    if log_format == "json":
        worker.spinner = None   # its terminal codes ("\x1b[?25h") would break the first JSON line
    worker.execute_from_commandline()
