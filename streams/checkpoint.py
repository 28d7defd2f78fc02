"""Checkpoint the worker's detection state, so a restart does not replay hours of telemetry.

The worker pickles its `DetectionPipeline` (rates' previous totals, detector countdowns,
open anomalies, node-health history) to a local file every `interval` seconds and at
shutdown, atomically (write, fsync, rename), and loads it at start. Kafka offsets are
committed independently, so after a crash the worker resumes from its last commit with
state at most one interval older: the few samples in between are re-processed and
recognised as duplicates by event time. A checkpoint written by another version or for
another configuration is ignored (and says so), never half-loaded.

The file is written and read only by the worker itself, in its own state directory;
pickle is not a format for data from anyone else.
"""
from __future__ import annotations

import hashlib
import logging
import os
import pickle
import tempfile
from pathlib import Path

from .pipeline import DetectionPipeline

log = logging.getLogger("fabricwatch.checkpoint")
FORMAT = "fabricwatch-pipeline-checkpoint/1"


def _fingerprint(pipeline: DetectionPipeline) -> str:
    topology = pipeline.topology.to_dict() if pipeline.topology is not None else None
    return hashlib.sha256(repr((pipeline.config, topology)).encode()).hexdigest()


def save(pipeline: DetectionPipeline, path: Path) -> int:
    """Write the checkpoint atomically; returns its size in bytes."""
    path.parent.mkdir(parents=True, exist_ok=True)
    payload = pickle.dumps((FORMAT, _fingerprint(pipeline), pipeline), protocol=pickle.HIGHEST_PROTOCOL)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name, suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as fh:
            fh.write(payload)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return len(payload)


def load(path: Path, expected: DetectionPipeline) -> DetectionPipeline | None:
    """The checkpointed pipeline if it matches `expected`'s configuration, else None."""
    if not path.exists():
        return None
    try:
        fmt, fingerprint, pipeline = pickle.loads(path.read_bytes())
    except Exception as exc:  # a torn or foreign file: start fresh rather than crash
        log.warning("ignoring unreadable checkpoint %s: %s", path, exc)
        return None
    if fmt != FORMAT or fingerprint != _fingerprint(expected) or not isinstance(pipeline, DetectionPipeline):
        log.warning("ignoring checkpoint %s: written for another version, configuration or topology", path)
        return None
    return pipeline
