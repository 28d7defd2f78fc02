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
from .handlers import TelemetryHandler
from .pipeline import DetectionConfig, DetectionPipeline


def run_worker(settings: WorkerSettings, detection: DetectionConfig, topology: Topology | None,
               loglevel: str = "WARNING") -> None:
    asyncio.run(topics.ensure_topics(settings.bootstrap, topics.ALL_TOPICS))
    app = build_app(settings)
    handler = TelemetryHandler(DetectionPipeline(detection, topology))
    register(app, handler)
    if settings.ready_file:
        @app.on_rebalance_complete.connect
        async def _mark_ready(sender, **kwargs) -> None:
            Path(settings.ready_file).touch()
    logging.getLogger("fabricwatch").setLevel(loglevel)
    worker = faust.Worker(app, loglevel=loglevel, quiet=True)
    worker.execute_from_commandline()
