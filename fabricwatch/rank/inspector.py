"""`ingest_nccl_inspector`: per-rank step records from the JSON output of NCCL's Inspector.

Reads the profiler plugin's dumps (v4.0-v4.3, JSON Lines or pretty-printed, also
gzipped), picks one communicator and groups its collectives into steps: GPU-true wait
times, where the reporter's hooks see only CPU-side launches. Separate from the reporter:
it is an offline parser of files that needs no reporter (one may be given to ship the
records).
"""
from __future__ import annotations

import gzip
import json
import math
import os
import re
from collections import Counter
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any, NamedTuple

from .identity import JOB_VARS, StepRecord, clean_name
from .reporter import RankReporter


class InspectorSteps(list):
    """`StepRecord` list from `ingest_nccl_inspector`, with ``stats`` about the parse."""

    def __init__(self, records: Iterable[StepRecord] = (), stats: Counter | None = None, comm_id: str = "") -> None:
        super().__init__(records)
        self.stats: Counter = stats if stats is not None else Counter()
        self.comm_id = comm_id


_INSPECTOR_GLOBS = ("*.log", "*.jsonl", "*.json", "*.log.gz", "*.jsonl.gz")
_MAX_OBJECT_CHARS = 4 * 1024 * 1024


def _inspector_files(path: Path) -> list[Path]:
    if path.is_dir():
        return sorted({p for g in _INSPECTOR_GLOBS for p in path.rglob(g) if p.is_file()})
    if path.exists():
        return [path]
    raise FileNotFoundError(f"{path}: no such NCCL Inspector file or directory")


def _json_objects(lines: Iterable[str], stats: Counter) -> Iterator[Any]:
    """Objects of a JSON Lines file, tolerating pretty-printed (multi-line) objects."""
    decoder = json.JSONDecoder()
    buf = ""
    for line in lines:
        if not buf:
            stripped = line.strip()
            if not stripped:
                continue
            try:
                yield json.loads(stripped)
                continue
            except ValueError:
                pass
        buf += line
        while buf.strip():
            text = buf.lstrip()
            try:
                obj, end = decoder.raw_decode(text)
            except ValueError as exc:   # also a plain ValueError (a number past int's digit limit): no .pos
                incomplete = isinstance(exc, json.JSONDecodeError) and exc.pos >= len(text.rstrip()) - 1
                if incomplete and len(buf) < _MAX_OBJECT_CHARS:  # read on
                    break
                stats["malformed_lines"] += 1
                buf = ""
                break
            yield obj
            buf = text[end:]
    if buf.strip():
        stats["malformed_lines"] += 1


def _open_text(path: Path):
    if path.suffix == ".gz":
        return gzip.open(path, "rt", encoding="utf-8", errors="replace")
    return open(path, encoding="utf-8", errors="replace")


class _Coll(NamedTuple):
    comm: str
    rank: int
    n_ranks: int
    host: str
    sn: int
    exec_s: float
    start_us: float     # first kernel start (unix µs), NaN when not verbose
    stop_us: float      # last kernel stop
    dump_us: float


def _inspector_records(files: list[Path], stats: Counter, colls: set[str] | None) -> list[_Coll]:
    out: list[_Coll] = []
    for path in files:
        header: dict | None = None
        metadata: dict | None = None
        with _open_text(path) as fh:
            for obj in _json_objects(fh, stats):
                if not isinstance(obj, dict):
                    stats["malformed_lines"] += 1
                    continue
                if "dump_stats" in obj:          # v4.3: context for the records that follow
                    header, metadata = obj.get("header"), obj.get("metadata")
                    ds = obj["dump_stats"] if isinstance(obj["dump_stats"], dict) else {}
                    stats["inspector_dropped"] += int(ds.get("coll_dropped_since_last_dump", 0) or 0)
                    continue
                perf = obj.get("coll_perf")
                if not isinstance(perf, dict):
                    stats["other_records"] += 1
                    continue
                h = obj.get("header", header)
                m = obj.get("metadata", metadata)
                try:
                    if colls is not None and perf.get("coll") not in colls:
                        stats["other_collectives"] += 1
                        continue
                    start = stop = math.nan
                    kernels = (perf.get("event_trace_ts") or {}).get("kernel_events") or []
                    starts = [float(k["kernel_start_ts"]) for k in kernels if k.get("kernel_start_ts")]
                    stops = [float(k["kernel_stop_ts"]) for k in kernels if k.get("kernel_stop_ts")]
                    if starts and stops:
                        start, stop = min(starts), max(stops)
                    exec_us = float(perf["coll_exec_time_us"])
                    if not (math.isfinite(exec_us) and exec_us >= 0):
                        raise ValueError("bad exec time")
                    out.append(_Coll(str(h["id"]), int(h["rank"]), int(h["n_ranks"]),
                                     str((m or {}).get("hostname", "")), int(perf["coll_sn"]), exec_us / 1e6,
                                     start, stop, float((m or {}).get("dump_timestamp_us", math.nan))))
                except (KeyError, TypeError, ValueError, AttributeError):
                    stats["malformed_records"] += 1
    return out


def ingest_nccl_inspector(path: str | os.PathLike, *, job_id: str | None = None, collectives_per_step: int = 1,
                          comm_id: str | None = None, collectives: Iterable[str] | None = None,
                          step_seconds: float | None = None, reporter: RankReporter | None = None,
                          environ: Mapping[str, str] | None = None) -> InspectorSteps:
    """Per-rank, per-step records from the JSON output of NCCL's Inspector plugin.

    ``path``: an Inspector dump directory (every ``*.log``/``*.jsonl``/``*.json``, also
    gzipped, below it) or one file. Accepted formats: v4.0-v4.2 (every record carries its
    ``header`` and ``metadata``) and v4.3 (a ``dump_stats`` marker carries them for the
    records that follow); one JSON object per line or pretty-printed. Used per collective:
    ``header.id`` (communicator), ``header.rank``, ``header.n_ranks``,
    ``metadata.hostname``, ``coll_perf.coll``, ``coll_sn``, ``coll_exec_time_us`` and, in
    verbose output (``NCCL_INSPECTOR_DUMP_VERBOSE=1``), the GPU kernel start/stop times in
    ``event_trace_ts.kernel_events`` (unix µs). P2P and proxy records are skipped.

    One communicator is read: ``comm_id``, else the one with the most ranks (the data-
    parallel group of a pure DP job). Its collectives are grouped into steps of
    ``collectives_per_step`` consecutive sequence numbers (``coll_sn`` is the same on
    every rank): set it to the number of gradient collectives of one step (DDP: its
    buckets). Per rank and step: the wait is the sum of the kernels' execution times (a
    collective kernel that starts before its peers spins until they arrive); with kernel
    times, the step runs from the previous step's last kernel end to this step's (the
    first step of each rank only anchors the next) and busy = step - wait. Without
    kernel times a step time must be given (``step_seconds``; the start is then the dump
    time), else such steps are skipped (``stats["steps_without_times"]``).

    ``job_id`` defaults to the environment's (as `RankIdentity`) or the ``<id>`` of an
    ``nccl-inspector-<id>`` directory. Local GPU = the rank's index among the ranks of
    its host. With ``reporter``, the records are also queued for sending.
    """
    if collectives_per_step < 1:
        raise ValueError("collectives_per_step must be >= 1")
    root = Path(path)
    stats: Counter = Counter()
    colls = set(collectives) if collectives is not None else None
    records = _inspector_records(_inspector_files(root), stats, colls)
    stats["collectives"] = len(records)
    if job_id is None:
        job_id = _inspector_job_id(root, os.environ if environ is None else environ)
    job_id = clean_name(job_id)
    if not records:
        return InspectorSteps([], stats)
    if comm_id is None:
        sizes: dict[str, tuple[int, int]] = {}
        for c in records:
            n, count = sizes.get(c.comm, (0, 0))
            sizes[c.comm] = (max(n, c.n_ranks), count + 1)
        comm_id = max(sizes, key=lambda k: sizes[k])
    mine = [c for c in records if c.comm == comm_id]
    stats["other_communicators"] = len(records) - len(mine)
    if not mine:
        return InspectorSteps([], stats, comm_id)
    base = min(c.sn for c in mine)
    hosts: dict[str, set[int]] = {}
    per_rank: dict[int, dict[int, dict[int, _Coll]]] = {}
    for c in mine:
        hosts.setdefault(c.host, set()).add(c.rank)
        per_rank.setdefault(c.rank, {}).setdefault((c.sn - base) // collectives_per_step, {})[c.sn] = c
    local = {rank: sorted(ranks).index(rank) for ranks in hosts.values() for rank in ranks}
    out: list[StepRecord] = []
    for rank, steps in sorted(per_rank.items()):
        prev_stop = math.nan
        prev_step = None
        for s in sorted(steps):
            cs = list(steps[s].values())
            c0 = cs[0]
            wait = sum(c.exec_s for c in cs)
            stop = max(c.stop_us for c in cs) if all(math.isfinite(c.stop_us) for c in cs) else math.nan
            if len(cs) < collectives_per_step:
                stats["steps_incomplete"] += 1
            elif math.isfinite(stop):
                if prev_step == s - 1 and math.isfinite(prev_stop) and stop > prev_stop:
                    step_s = (stop - prev_stop) / 1e6
                    out.append(StepRecord(job_id, rank, c0.n_ranks, clean_name(c0.host, "localhost"),
                                          local[rank], s, int(prev_stop * 1000), step_s,
                                          max(step_s - wait, 0.0), min(wait, step_s)))
                else:
                    stats["steps_anchor_only"] += 1
            elif step_seconds is not None and math.isfinite(c0.dump_us):
                out.append(StepRecord(job_id, rank, c0.n_ranks, clean_name(c0.host, "localhost"), local[rank], s,
                                      int(max(c.dump_us for c in cs) * 1000 - step_seconds * 1e9), step_seconds,
                                      max(step_seconds - wait, 0.0), min(wait, step_seconds)))
            else:
                stats["steps_without_times"] += 1
            prev_stop, prev_step = (stop, s) if len(cs) >= collectives_per_step else (math.nan, None)
    stats["steps"] = len(out)
    result = InspectorSteps(sorted(out, key=lambda r: (r.step, r.rank)), stats, comm_id)
    if reporter is not None:
        reporter.submit(result)
    return result


def _inspector_job_id(root: Path, env: Mapping[str, str]) -> str:
    for var in JOB_VARS[:3]:
        value = env.get(var, "").strip()
        if value and value.lower() != "none":
            return value
    for part in (root, *root.parents):
        m = re.fullmatch(r"nccl-inspector-(.+)", part.name)
        if m and m.group(1) != "unknown-jobid":
            return m.group(1)
    raise ValueError("no job id: pass job_id=, or set FABRICWATCH_JOB_ID / SLURM_JOB_ID")
