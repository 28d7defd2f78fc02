"""Faust agents: thin loops that move records between topics and the handlers."""
from __future__ import annotations

import faust

from .handlers import TelemetryHandler

# Records are taken in small batches so Faust's per-message cost is amortised.
TAKE_MAX_RECORDS = 500
TAKE_WITHIN_S = 0.05


def register(app: faust.App, telemetry: TelemetryHandler) -> None:
    @app.agent(app.telemetry_topic, name="detect_on_telemetry")
    async def detect_on_telemetry(stream):
        async for records in stream.take(TAKE_MAX_RECORDS, within=TAKE_WITHIN_S):
            for raw in records:
                for key, value in telemetry.on_snapshot(raw):
                    await app.anomalies_topic.send(key=key, value=value)
