"""Checkpoint the worker's detection state, so a restart does not replay hours of telemetry.

The worker pickles its `DetectionPipeline` (rates' previous totals, detector countdowns,
open anomalies, node-health history) together with the offsets it covers (per partition,
the last record folded in: `streams.coverage`) to a local file every `interval` seconds
and at shutdown, atomically (write, fsync, rename), and loads it at start. Kafka commits
offsets on its own schedule, so after a crash the two disagree: records the checkpoint
covers are skipped when redelivered, records it does not cover are folded in before live
processing resumes (`streams.rebuild`). The worker takes the payload under the state lock
and flushes the producer before writing it, so what a checkpoint covers has been emitted.
A checkpoint written by another version or for another configuration is ignored (and
says so), never half-loaded.

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
from typing import NamedTuple

from .pipeline import DetectionPipeline

log = logging.getLogger("fabricwatch.checkpoint")
FORMAT = "fabricwatch-pipeline-checkpoint/2"   # /2: with the offsets covered


class Restored(NamedTuple):
    pipeline: DetectionPipeline
    offsets: dict[tuple[str, int], int]        # (topic, partition) -> last offset folded in


def _fingerprint(pipeline: DetectionPipeline) -> str:
    topology = pipeline.topology.to_dict() if pipeline.topology is not None else None
    return hashlib.sha256(repr((pipeline.config, topology)).encode()).hexdigest()


def dumps(pipeline: DetectionPipeline, offsets: dict[tuple[str, int], int] | None = None) -> bytes:
    """The checkpoint's bytes: take them while nothing folds records (the worker's state lock)."""
    return pickle.dumps((FORMAT, _fingerprint(pipeline), pipeline, dict(offsets or {})),
                        protocol=pickle.HIGHEST_PROTOCOL)


def save(pipeline: DetectionPipeline, path: Path, offsets: dict[tuple[str, int], int] | None = None) -> int:
    """Write the checkpoint atomically; returns its size in bytes."""
    return write(dumps(pipeline, offsets), path)


def write(payload: bytes, path: Path) -> int:
    """Write checkpoint bytes atomically; returns their size."""
    path.parent.mkdir(parents=True, exist_ok=True)
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


def load(path: Path, expected: DetectionPipeline) -> Restored | None:
    """The checkpointed pipeline and offsets if they match `expected`'s configuration, else None."""
    if not path.exists():
        return None
    try:
        fmt, fingerprint, pipeline, offsets = pickle.loads(path.read_bytes())
    except Exception as exc:  # a torn, foreign or older-format file: start fresh rather than crash
        log.warning("ignoring unreadable checkpoint %s: %s", path, exc)
        return None
    if fmt != FORMAT or fingerprint != _fingerprint(expected) or not isinstance(pipeline, DetectionPipeline) \
            or not _valid_offsets(offsets):
        log.warning("ignoring checkpoint %s: written for another version, configuration or topology", path)
        return None
    return Restored(pipeline, offsets)


def _valid_offsets(offsets: object) -> bool:
    return isinstance(offsets, dict) and all(
        isinstance(k, tuple) and len(k) == 2 and isinstance(k[0], str) and isinstance(k[1], int)
        and isinstance(v, int) and v >= 0 for k, v in offsets.items())
