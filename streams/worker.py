"""Run the worker: the Faust app with its agents, until interrupted."""
from __future__ import annotations

import asyncio
import logging
from pathlib import Path

import faust

from fabricwatch.models.topology import Topology

from . import topics
from .agents import register
from .app import WorkerSettings, build_app
from .handlers import StageHandlers
from .pipeline import DetectionConfig, DetectionPipeline


def run_worker(settings: WorkerSettings, detection: DetectionConfig, topology: Topology | None,
               loglevel: str = "WARNING") -> None:
    # Faust's own leader-election topic too: the broker does not auto-create topics.
    leader = topics.TopicSpec(f"{settings.app_id}-__assignor-__leader", partitions=1, retention_ms=topics.DAY_MS)
    asyncio.run(topics.ensure_topics(settings.bootstrap, [*topics.ALL_TOPICS, leader]))
    app = build_app(settings)
    register(app, StageHandlers(DetectionPipeline(detection, topology)))
    if settings.ready_file:
        @app.on_rebalance_complete.connect
        async def _mark_ready(sender, **kwargs) -> None:
            Path(settings.ready_file).touch()
    logging.getLogger("fabricwatch").setLevel(loglevel)
    worker = faust.Worker(app, loglevel=loglevel, quiet=True)
    worker.execute_from_commandline()
