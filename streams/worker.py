"""Run the worker: the Faust app with its agents, until interrupted."""
from __future__ import annotations

import asyncio
import logging
from pathlib import Path

import faust

from fabricwatch.models.topology import Topology

from . import checkpoint, topics
from .agents import register
from .app import WorkerSettings, build_app
from .handlers import StageHandlers
from .pipeline import DetectionConfig, DetectionPipeline


log = logging.getLogger("fabricwatch.worker")


def run_worker(settings: WorkerSettings, detection: DetectionConfig, topology: Topology | None,
               loglevel: str = "WARNING") -> None:
    # Faust's own leader-election topic too: the broker does not auto-create topics.
    leader = topics.TopicSpec(f"{settings.app_id}-__assignor-__leader", partitions=1, retention_ms=topics.DAY_MS)
    asyncio.run(topics.ensure_topics(settings.bootstrap, [*topics.ALL_TOPICS, leader]))
    app = build_app(settings)
    pipeline = DetectionPipeline(detection, topology)
    ckpt = Path(settings.state_dir) / f"{settings.app_id}.checkpoint" if settings.state_dir else None
    if ckpt is not None:
        restored = checkpoint.load(ckpt, pipeline)
        if restored is not None:
            pipeline = restored
            log.warning("restored detection state from %s (%d snapshots seen before)", ckpt,
                        pipeline.stats["snapshots"])

        @app.timer(settings.checkpoint_interval_s)
        async def _checkpoint() -> None:
            checkpoint.save(pipeline, ckpt)

        @app.on_before_shutdown.connect
        async def _final_checkpoint(sender, **kwargs) -> None:
            checkpoint.save(pipeline, ckpt)

    register(app, StageHandlers(pipeline))
    if settings.ready_file:
        @app.on_rebalance_complete.connect
        async def _mark_ready(sender, **kwargs) -> None:
            Path(settings.ready_file).touch()
    logging.getLogger("fabricwatch").setLevel(loglevel)
    worker = faust.Worker(app, loglevel=loglevel, quiet=True)
    worker.execute_from_commandline()
