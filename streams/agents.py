"""Faust agents: thin loops that move records between topics and the stage handlers."""
from __future__ import annotations

import time

import faust

from .handlers import StageHandlers

# Records are taken in small batches so Faust's per-message cost is amortised.
TAKE_MAX_RECORDS = 500
TAKE_WITHIN_S = 0.05
CLUSTER_TIMER_S = 0.5


def register(app: faust.App, stages: StageHandlers) -> None:
    async def send_all(topic, records) -> None:
        for key, value, headers in records:
            await topic.send(key=key, value=value, headers=list(headers))

    @app.agent(app.telemetry_topic, name="detect_on_telemetry")
    async def detect_on_telemetry(stream):
        async for values in stream.take(TAKE_MAX_RECORDS, within=TAKE_WITHIN_S):
            for raw in values:
                anomalies, pause_states = stages.on_snapshot(raw)
                await send_all(app.anomalies_topic, anomalies)
                await send_all(app.pause_states_topic, pause_states)

    @app.agent(app.pause_states_topic, name="locate_storms")
    async def locate_storms(stream):
        async for raw in stream:
            await send_all(app.anomalies_topic, stages.on_pause_state(raw))

    @app.agent(app.rank_steps_topic, name="detect_stragglers")
    async def detect_stragglers(stream):
        async for values in stream.take(TAKE_MAX_RECORDS, within=TAKE_WITHIN_S):
            for raw in values:
                await send_all(app.anomalies_topic, stages.on_rank_steps(raw))

    @app.timer(CLUSTER_TIMER_S)
    async def expire_cluster_state():
        # The pipeline caps this wall clock at the newest sample's event time (catch-up safe).
        await send_all(app.anomalies_topic, stages.on_timer(time.time_ns()))
