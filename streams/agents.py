"""Faust agents: thin loops that move records between topics and the stage handlers.

Each agent takes a batch, and under the state lock admits each record (skip what the state
already holds, rebuild a gap first: `streams.rebuild`), folds it in, and sends what it
produced. Sends bypass Faust's attachments (`force=True`) so that a checkpoint, which
flushes the producer, covers only records whose outputs were delivered.
"""
from __future__ import annotations

import time
from collections.abc import Callable, Iterable

import faust

from .handlers import Record, StageHandlers
from .rebuild import StateKeeper

# Records are taken in small batches so Faust's per-message cost is amortised.
TAKE_MAX_RECORDS = 500
TAKE_WITHIN_S = 0.05
CLUSTER_TIMER_S = 0.5


def register(app: faust.App, stages: StageHandlers, keeper: StateKeeper) -> None:
    async def send_all(topic, records: Iterable[Record]) -> None:
        for key, value, headers in records:
            await topic.send(key=key, value=value, headers=list(headers), force=True)

    async def run_stage(stream, stage: Callable[[bytes], list[tuple[faust.TopicT, list[Record]]]]) -> None:
        fold = stages.rebuild_with(stage)
        async for events in stream.take_events(TAKE_MAX_RECORDS, within=TAKE_WITHIN_S):
            async with keeper.lock:
                for event in events:
                    message = event.message
                    if not await keeper.admit(message.topic, message.partition, message.offset,
                                              message.timestamp, fold):
                        continue
                    outputs = stage(event.value)
                    keeper.folded(message.topic, message.partition, message.offset)
                    for topic, records in outputs:
                        await send_all(topic, records)

    def telemetry(raw: bytes):
        anomalies, pause_states = stages.on_snapshot(raw)
        return [(app.anomalies_topic, anomalies), (app.pause_states_topic, pause_states)]

    @app.agent(app.telemetry_topic, name="detect_on_telemetry")
    async def detect_on_telemetry(stream):
        await run_stage(stream, telemetry)

    @app.agent(app.pause_states_topic, name="locate_storms")
    async def locate_storms(stream):
        await run_stage(stream, lambda raw: [(app.anomalies_topic, stages.on_pause_state(raw))])

    @app.agent(app.rank_steps_topic, name="detect_stragglers")
    async def detect_stragglers(stream):
        await run_stage(stream, lambda raw: [(app.anomalies_topic, stages.on_rank_steps(raw))])

    @app.timer(CLUSTER_TIMER_S)
    async def expire_cluster_state():
        # The pipeline caps this wall clock at the newest sample's event time (catch-up safe);
        # a half-rebuilt picture waits for its rebuild.
        if keeper.rebuilding:
            return
        await send_all(app.anomalies_topic, stages.on_timer(time.time_ns()))
