"""The Faust application of the worker: only the App, its topics and settings.

Agents live in `streams/agents.py`; the logic they call lives in plain classes.
"""
from __future__ import annotations

import tempfile
from dataclasses import dataclass
from pathlib import Path

import faust

from . import topics


@dataclass(frozen=True)
class WorkerSettings:
    bootstrap: str = "127.0.0.1:9092"
    app_id: str = "fabricwatch-worker"       # the Kafka consumer group: workers with one id share partitions
    telemetry_partitions: int = topics.PARTITIONS
    web_port: int = 6066
    ready_file: str = ""                     # touched once the first rebalance completes
    state_dir: str = ""                      # Faust's data folder; "" = a temporary folder
    # Every partition's stage state goes to the state topic this often, and when revoked.
    checkpoint_interval_s: float = 30.0
    checkpoints: bool = True
    # A partition within this many records of its end counts as caught up (`fabricwatch status`).
    caught_up_lag: int = 500
    # How far before the first live record a partition with no checkpoint is rebuilt from
    # (`streams.rebuild`), when it was processed before (committed offsets, no state):
    # rates and watchdogs need seconds; the storm locator's edge-triggered pause states
    # and the straggler's step windows need minutes.
    rebuild_telemetry_lookback_s: float = 15.0
    rebuild_pause_states_lookback_s: float = 600.0
    rebuild_rank_steps_lookback_s: float = 300.0


def build_app(settings: WorkerSettings) -> faust.App:
    # Faust keeps a data folder even with in-memory tables: under the state dir, not the cwd.
    datadir = Path(settings.state_dir or tempfile.gettempdir()) / f"{settings.app_id}-faust"
    datadir.parent.mkdir(parents=True, exist_ok=True)
    app = faust.App(
        settings.app_id,
        datadir=str(datadir),
        broker=f"kafka://{settings.bootstrap}",
        store="memory://",
        processing_guarantee="at_least_once",
        topic_partitions=settings.telemetry_partitions,
        topic_allow_declare=False,           # topics are created by streams.topics with explicit specs
        web_enabled=False,
        web_host="127.0.0.1",
        web_port=settings.web_port,
        consumer_auto_offset_reset="earliest",
        broker_commit_every=1000,
        broker_commit_interval=1.0,
        producer_max_request_size=4 << 20,   # state chunks are 512 KB
    )
    raw = dict(key_type=bytes, value_type=bytes, key_serializer="raw", value_serializer="raw")
    app.telemetry_topic = app.topic(topics.TELEMETRY, **raw)
    app.rank_steps_topic = app.topic(topics.RANK_STEPS, **raw)
    app.pause_states_topic = app.topic(topics.PAUSE_STATES, **raw)
    app.facts_topic = app.topic(topics.FACTS, **raw)
    app.state_topic = app.topic(topics.STATE, **raw)
    app.anomalies_topic = app.topic(topics.ANOMALIES, **raw)
    return app
