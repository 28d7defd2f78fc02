"""The training-rank SDK: each rank reports its step timings to the ingest gateway.

In synchronous data-parallel training every rank's wall-clock step time is the same (all
wait for the slowest at the gradient collectives), so step time alone never names a
straggler. What does is the split of each step into the rank's own compute (``busy``)
and the time it then spends inside the collectives (``wait``): a slow rank is busy longer
and waits least, its peers wait for it. The straggler detector (`models.straggler`)
compares these across the ranks of a job. A few lines in the training loop::

    from fabricwatch.rank import RankReporter

    reporter = RankReporter.from_env()          # torchrun / Slurm / mpirun variables
    for batch in loader:
        with reporter.step():
            loss = forward_backward(batch)       # own compute: busy
            with reporter.collectives():
                allreduce(gradients)             # inside the collectives: wait
            optimizer.step()                     # own compute again: busy

or the same with ``reporter.step_begin()``, ``reporter.collectives_begin()``,
``reporter.collectives_end()`` (optional) and ``reporter.step_end()``. Per step it
records the wall-clock step time, the time inside the collectives and the rest as busy
time (monotonic clock), with the step's start from the wall clock.

It never slows or breaks training: the hot path reads the clock and appends one tuple to
a bounded deque (past ``max_buffered`` the oldest is dropped and counted); a daemon
thread sends batches to the gateway with the unary ``Ingest.Send`` RPC, keeps unacked
steps (bounded) across outages and retries with backoff; a gateway that is down or
refuses us costs one warning, nothing raises into the training loop; at exit the thread
gets ``exit_flush_s`` to send what is left.

Configuration (environment):

=========================== ================================================================
``FABRICWATCH_GATEWAY``     ``host:port`` of the ingest gateway; unset = reporting disabled
``FABRICWATCH_TOKEN``       bearer token (the gateway's token file must allow this node)
``FABRICWATCH_CA_CERT``     PEM of the gateway's CA: TLS; unset = plaintext
``FABRICWATCH_TLS_SERVER_NAME`` expected name in the gateway's certificate, if not the host
``FABRICWATCH_CLUSTER``     cluster name (else the gateway's default)
``FABRICWATCH_JOB_ID``      job id override (else ``SLURM_JOB_ID``, ``TORCHELASTIC_RUN_ID``,
                            the MPI job namespace)
``FABRICWATCH_NODE``        node name override (else ``SLURMD_NODENAME``, the hostname); must
                            be the name the node collector reports as its ``source``
``FABRICWATCH_LOCAL_GPU``   GPU index override (else the local rank)
``FABRICWATCH_DISABLE``     ``1`` turns the reporter into a no-op
=========================== ================================================================

Rank, world size and local rank come from torchrun (``RANK``, ``WORLD_SIZE``,
``LOCAL_RANK``), else Slurm (``SLURM_PROCID``, ``SLURM_NTASKS``, ``SLURM_LOCALID``), else
Open MPI (``OMPI_COMM_WORLD_RANK``...), else PMI (``PMI_RANK``, ``PMI_SIZE``).

Also here: `instrument_torch` (PyTorch DDP comm hook and optimizer hooks, torch imported
only when called) and `ingest_nccl_inspector` (per-step records from the JSON output of
NCCL's Inspector profiler plugin). See docs/rank-sdk.md.

>>> identity = RankIdentity.from_env({"RANK": "3", "WORLD_SIZE": "8", "LOCAL_RANK": "3",
...                                   "TORCHELASTIC_RUN_ID": "run-42", "FABRICWATCH_NODE": "gpu-07"})
>>> identity
RankIdentity(job_id='run-42', rank=3, world_size=8, node='gpu-07', local_gpu=3, launcher='torchrun')
>>> r = RankReporter(identity, gateway="")       # no gateway: every call is a no-op
>>> with r.step():
...     with r.collectives():
...         pass
>>> r.enabled, r.stats["steps"]
(False, 0)
"""
from __future__ import annotations

import atexit
import gzip
import itertools
import json
import logging
import math
import os
import random
import re
import socket
import threading
import time
import weakref
from collections import Counter, deque
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

from fabricwatch.grpc_tls import channel_credentials, check_client_tls

log = logging.getLogger("fabricwatch.rank")

__all__ = ["RankIdentity", "RankReporter", "StepRecord", "InspectorSteps", "default_reporter",
           "instrument_torch", "ingest_nccl_inspector"]

# Same rule as the gateway's validation of names (streams/validate.py).
_NAME_OK = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._:/@+=-]*$")
_NAME_BAD_CHARS = re.compile(r"[^A-Za-z0-9._:/@+=-]")
MAX_NAME_LEN = 253
MAX_STEPS_PER_SNAPSHOT = 4096     # the gateway's MAX_RANK_STEPS
MAX_STEP_SECONDS = 24 * 3600.0    # the gateway drops longer steps (bad_rank_step)
# The progress heartbeat's period (collectives entered/completed, sent even when no step
# completes). The hang model (models/hang.py) names a hang 20 s after the last completion at
# the earliest and calls a rank lost after three missed heartbeats (15 s): 5 s keeps a hang
# named well inside 60 s, and costs one ~100-byte message per rank per 5 s (a 10,000-rank
# job: 2,000 small messages a second at the gateway, batched per node).
HEARTBEAT_INTERVAL_S = 5.0


class StepRecord(NamedTuple):
    """One rank's timings of one step, field for field a `RankStep` of telemetry.proto."""
    job_id: str
    rank: int
    world_size: int
    node: str
    local_gpu: int
    step: int
    start_unix_ns: int
    step_seconds: float
    busy_seconds: float
    collective_wait_seconds: float


def clean_name(name: str, fallback: str = "unknown") -> str:
    """A job or node name the gateway accepts: odd characters become '-'.

    >>> clean_name("job 12/a#b"), clean_name("_x"), clean_name("")
    ('job-12/a-b', 'x', 'unknown')
    """
    name = _NAME_BAD_CHARS.sub("-", str(name).strip())[:MAX_NAME_LEN]
    name = name.lstrip("._:/@+=-")
    return name if _NAME_OK.match(name) else fallback


# -- identity --------------------------------------------------------------------------------
# (launcher, rank, world size, local rank) variables, first complete set wins. torchrun
# first: under `srun torchrun`, SLURM_PROCID is the launcher's index, RANK the rank's.
_LAUNCHERS = (
    ("torchrun", "RANK", "WORLD_SIZE", "LOCAL_RANK"),
    ("slurm", "SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID"),
    ("openmpi", "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK"),
    ("pmi", "PMI_RANK", "PMI_SIZE", "MPI_LOCALRANKID"),
)
# job id, first present wins; TORCHELASTIC_RUN_ID is "none" when torchrun had no --rdzv-id
_JOB_VARS = ("FABRICWATCH_JOB_ID", "SLURM_JOB_ID", "TORCHELASTIC_RUN_ID", "PMIX_NAMESPACE",
             "OMPI_MCA_ess_base_jobid")


def _int_var(env: Mapping[str, str], name: str, minimum: int = 0) -> int:
    raw = env.get(name, "")
    try:
        value = int(raw.strip())
    except ValueError:
        raise ValueError(f"{name}={raw!r} is not an integer") from None
    if value < minimum:
        raise ValueError(f"{name}={value} must be >= {minimum}")
    return value


@dataclass(frozen=True)
class RankIdentity:
    """Who a rank is: job, rank, world size, node and GPU."""
    job_id: str
    rank: int
    world_size: int
    node: str
    local_gpu: int
    launcher: str = "manual"

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> RankIdentity:
        """Read torchrun, Slurm or MPI variables; ValueError if they are inconsistent.

        >>> RankIdentity.from_env({"SLURM_PROCID": "5", "SLURM_NTASKS": "16", "SLURM_LOCALID": "1",
        ...                        "SLURM_JOB_ID": "81234", "SLURMD_NODENAME": "dgx-a17"})
        RankIdentity(job_id='81234', rank=5, world_size=16, node='dgx-a17', local_gpu=1, launcher='slurm')
        """
        env = os.environ if environ is None else environ
        launcher, rank, world, local = "single", 0, 1, 0
        for name, rank_var, world_var, local_var in _LAUNCHERS:
            if rank_var in env and world_var in env:
                launcher = name
                rank = _int_var(env, rank_var)
                world = _int_var(env, world_var, minimum=1)
                local = _int_var(env, local_var) if env.get(local_var, "").strip() else 0
                break
        if rank >= world:
            raise ValueError(f"rank {rank} is outside the world size {world} ({launcher} variables)")
        node = clean_name(env.get("FABRICWATCH_NODE") or env.get("SLURMD_NODENAME") or socket.gethostname(),
                          fallback="localhost")
        gpu = _int_var(env, "FABRICWATCH_LOCAL_GPU") if env.get("FABRICWATCH_LOCAL_GPU", "").strip() else local
        job = ""
        for var in _JOB_VARS:
            value = env.get(var, "").strip()
            if value and not (var == "TORCHELASTIC_RUN_ID" and value.lower() == "none"):
                job = value
                break
        if not job:
            # no launcher id: the ranks of one job on one node share the parent (the launcher)
            job = f"{node}-{os.getppid()}" if world > 1 else f"{node}-{os.getpid()}"
        return cls(clean_name(job), rank, world, node, gpu, launcher)


# -- reporter --------------------------------------------------------------------------------
class _NullContext:
    __slots__ = ()

    def __enter__(self):
        return None

    def __exit__(self, *exc) -> bool:
        return False


_NULL = _NullContext()


class _StepContext:
    __slots__ = ("_reporter",)

    def __init__(self, reporter: RankReporter) -> None:
        self._reporter = reporter

    def __enter__(self) -> RankReporter:
        r = self._reporter
        r.step_begin(r._ctx_step)
        return r

    def __exit__(self, exc_type, exc, tb) -> bool:
        if exc_type is None:
            self._reporter.step_end()
        else:
            self._reporter.step_abort()   # a failed step is not a timing
        return False


class _CollectiveContext:
    __slots__ = ("_reporter",)

    def __init__(self, reporter: RankReporter) -> None:
        self._reporter = reporter

    def __enter__(self) -> RankReporter:
        self._reporter.collective_begin()
        return self._reporter

    def __exit__(self, *exc) -> bool:
        self._reporter.collective_end()
        return False


class _CollectivesContext:
    __slots__ = ("_reporter",)

    def __init__(self, reporter: RankReporter) -> None:
        self._reporter = reporter

    def __enter__(self) -> RankReporter:
        self._reporter.collectives_begin()
        return self._reporter

    def __exit__(self, *exc) -> bool:
        self._reporter.collectives_end()
        return False


class RankReporter:
    """Measures each training step of this rank and ships it to the gateway.

    Parameters
    ----------
    identity : who this rank is (`RankIdentity.from_env` reads it from the launcher).
    gateway : ``host:port`` of the ingest gateway; empty disables the reporter (no-op).
    token, ca_cert, server_name, cluster : as ``FABRICWATCH_TOKEN``, ``FABRICWATCH_CA_CERT``,
        ``FABRICWATCH_TLS_SERVER_NAME``, ``FABRICWATCH_CLUSTER``.
    client_cert, client_key : mTLS, for a gateway run with ``--client-ca``: as
        ``FABRICWATCH_CLIENT_CERT``, ``FABRICWATCH_CLIENT_KEY`` (PEM files).
    max_buffered : steps kept while the gateway is slow or down; past it the oldest are
        dropped (``stats["dropped_buffer_full"]``).
    flush_interval_s : how often the background thread sends what was recorded.
    send_timeout_s : deadline of one ``Send`` call.
    backoff_max_s : the longest wait between retries while the gateway is down.
    exit_flush_s : at interpreter exit, how long the last send may take (0: none).
    """

    def __init__(self, identity: RankIdentity, gateway: str = "", *, token: str = "", ca_cert: str = "",
                 client_cert: str = "", client_key: str = "",
                 server_name: str = "", cluster: str = "", max_buffered: int = 10_000,
                 flush_interval_s: float = 1.0, send_timeout_s: float = 5.0, backoff_max_s: float = 30.0,
                 exit_flush_s: float = 2.0, heartbeat_interval_s: float = HEARTBEAT_INTERVAL_S) -> None:
        if max_buffered < 1:
            raise ValueError("max_buffered must be >= 1")
        if not (flush_interval_s > 0 and send_timeout_s > 0 and backoff_max_s > 0 and exit_flush_s >= 0
                and heartbeat_interval_s > 0):
            raise ValueError("need flush_interval_s, send_timeout_s, backoff_max_s, heartbeat_interval_s > 0 and "
                             "exit_flush_s >= 0")
        self.identity = identity
        self.gateway = gateway.strip()
        self.token = token
        check_client_tls(ca_cert, client_cert, client_key)
        self.ca_cert, self.client_cert, self.client_key = ca_cert, client_cert, client_key
        self.server_name = server_name
        self.cluster = cluster
        self.max_buffered = max_buffered
        self.flush_interval_s = flush_interval_s
        self.send_timeout_s = send_timeout_s
        self.backoff_max_s = max(backoff_max_s, flush_interval_s)
        self.exit_flush_s = exit_flush_s
        self.heartbeat_interval_s = heartbeat_interval_s
        self.enabled = bool(self.gateway)
        # hot path state (the training thread writes these; the sender only reads the deque)
        self._queue: deque[tuple] = deque()     # bounded by max_buffered in step_end()
        self._prefix = (identity.job_id, identity.rank, identity.world_size, identity.node, identity.local_gpu)
        self._t0: float | None = None
        self._wall0 = 0
        self._step = 0
        self._next_step = 0
        self._ctx_step: int | None = None
        self._coll_t: float | None = None
        self._inside = 0.0
        self._recorded = 0
        self._last: tuple | None = None
        self._dropped = 0
        self._misuse = 0
        self._step_ctx = _StepContext(self)
        self._coll_ctx = _CollectivesContext(self)
        self._one_ctx = _CollectiveContext(self)
        # progress counters (sequence numbers): the training thread writes, the sender reads
        self._entered = 0
        self._completed = 0
        self._last_entered_ns = 0
        self._last_completed_ns = 0
        self._in_block = False
        self._heartbeat: tuple | None = None      # the newest unsent heartbeat (older ones are moot)
        self._heartbeat_at = -math.inf
        # sender state
        self._sender_stats: Counter[str] = Counter()
        self._unsent: deque[tuple] = deque()
        self._stop = threading.Event()
        self._kick = threading.Event()
        self._idle = threading.Event()
        self._idle.set()
        self._warned = False
        self._retry_at = 0.0
        self._final_deadline = 0.0
        self._thread: threading.Thread | None = None
        self._closed = False
        self._batch_ids = itertools.count(1)
        self._pid = os.getpid()
        if self.enabled:
            self._thread = threading.Thread(target=self._run, name="fabricwatch-rank-sender", daemon=True)
            self._thread.start()
            _at_exit(self)
            if hasattr(os, "register_at_fork"):
                ref = weakref.ref(self)
                os.register_at_fork(after_in_child=lambda: (r := ref()) is not None and r._forked())

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None, **kwargs: Any) -> RankReporter:
        """A reporter configured from the environment; never raises (a bad environment
        gives a disabled reporter and one warning)."""
        env = os.environ if environ is None else environ
        try:
            identity = RankIdentity.from_env(env)
        except Exception as exc:   # noqa: BLE001 - never break the training script
            log.warning("fabricwatch: rank reporting disabled: %s", exc)
            return cls(RankIdentity("unknown", 0, 1, "unknown", 0, "invalid"), "")
        disabled = env.get("FABRICWATCH_DISABLE", "").strip().lower() in ("1", "true", "yes", "on")
        options = dict(gateway="" if disabled else env.get("FABRICWATCH_GATEWAY", ""),
                       token=env.get("FABRICWATCH_TOKEN", ""), ca_cert=env.get("FABRICWATCH_CA_CERT", ""),
                       client_cert=env.get("FABRICWATCH_CLIENT_CERT", ""),
                       client_key=env.get("FABRICWATCH_CLIENT_KEY", ""),
                       server_name=env.get("FABRICWATCH_TLS_SERVER_NAME", ""),
                       cluster=env.get("FABRICWATCH_CLUSTER", ""))
        options.update(kwargs)
        try:
            return cls(identity, **options)
        except Exception as exc:   # noqa: BLE001
            log.warning("fabricwatch: rank reporting disabled: %s", exc)
            return cls(identity, "")

    # -- hot path: clock reads and one deque append, never raises --------------------------
    def step(self, step: int | None = None):
        """Context manager around one training step (``step`` defaults to the next number)."""
        if not self.enabled:
            return _NULL
        self._ctx_step = step
        return self._step_ctx

    def collectives(self):
        """Context manager around the gradient collectives of the current step."""
        return self._coll_ctx if self.enabled else _NULL

    def collective(self):
        """Context manager around one collective call (`collective_begin` / `collective_end`)."""
        return self._one_ctx if self.enabled else _NULL

    def collective_begin(self) -> None:
        """One collective call entered: the progress heartbeat's ``entered`` sequence number."""
        self._last_entered_ns = time.time_ns()   # the time first: a heartbeat never shows a count without one
        self._entered += 1

    def collective_end(self) -> None:
        """That collective call left (returned or raised): ``completed``."""
        self._last_completed_ns = time.time_ns()
        self._completed += 1

    def step_begin(self, step: int | None = None) -> None:
        if not self.enabled:
            return
        try:
            if self._t0 is not None:
                self._misuse += 1      # the previous step never ended: discarded
            self._step = self._next_step if step is None else int(step)
            self._coll_t = None
            self._inside = 0.0
            self._wall0 = time.time_ns()
            self._t0 = time.perf_counter()
        except Exception:   # noqa: BLE001
            self._misuse += 1

    def collectives_begin(self) -> None:
        """Entering the collectives (idempotent while inside); counts one entered collective."""
        if not self._in_block:
            self._in_block = True
            self.collective_begin()
        if self._t0 is None or self._coll_t is not None:
            return
        self._coll_t = time.perf_counter()

    def collectives_end(self) -> None:
        """Leaving the collectives; what follows in the step counts as busy again."""
        if self._in_block:
            self._in_block = False
            self.collective_end()
        coll_t = self._coll_t
        if coll_t is None:
            return
        self._inside += time.perf_counter() - coll_t
        self._coll_t = None

    def step_end(self) -> None:
        t = time.perf_counter()
        t0 = self._t0
        if t0 is None:
            if self.enabled:
                self._misuse += 1
            return
        if self._in_block:
            self._in_block = False
            self.collective_end()
        try:
            inside = self._inside
            if self._coll_t is not None:
                inside += t - self._coll_t
                self._coll_t = None
            total = t - t0
            queue = self._queue
            if len(queue) >= self.max_buffered:
                try:
                    queue.popleft()       # full: the oldest goes
                    self._dropped += 1
                except IndexError:        # the sender emptied it meanwhile
                    pass
            rec = self._prefix + (self._step, self._wall0, total, total - inside, inside)
            queue.append(rec)
            self._last = rec
            self._recorded += 1
            self._next_step = self._step + 1
        except Exception:   # noqa: BLE001
            self._misuse += 1
        finally:
            self._t0 = None

    def step_abort(self) -> None:
        """Forget the current step (it failed or was not a training step)."""
        if self._in_block:          # the collectives were left (by an exception): not "inside" any more
            self._in_block = False
            self.collective_end()
        self._t0 = None
        self._coll_t = None

    def submit(self, records: Iterable[StepRecord | tuple]) -> int:
        """Queue complete records (e.g. from `ingest_nccl_inspector`); returns how many."""
        if not self.enabled:
            return 0
        n = 0
        for rec in records:
            if len(rec) != len(StepRecord._fields):
                self._misuse += 1
                continue
            if len(self._queue) >= self.max_buffered:
                try:
                    self._queue.popleft()
                    self._dropped += 1
                except IndexError:
                    pass
            self._queue.append(tuple(rec))
            n += 1
        self._recorded += n
        self._kick.set()
        return n

    # -- control ---------------------------------------------------------------------------
    @property
    def last_step(self) -> StepRecord | None:
        """The most recent step this rank measured (for the training script's own logs)."""
        return StepRecord._make(self._last) if self._last is not None else None

    @property
    def stats(self) -> dict[str, int]:
        """steps (recorded), dropped_buffer_full, buffered, sent (acked by the gateway),
        batches, send_failures, rejected (by the gateway's validation), misuse."""
        out = {"steps": self._recorded, "dropped_buffer_full": self._dropped + self._sender_stats["dropped"],
               "buffered": len(self._queue) + len(self._unsent), "misuse": self._misuse}
        for key in ("sent", "batches", "send_failures", "rejected", "dropped_parts", "heartbeats"):
            out[key] = self._sender_stats[key]
        out["collectives_entered"], out["collectives_completed"] = self._entered, self._completed
        return out

    def progress(self) -> tuple:
        """The heartbeat as it would go out now: identity, sampling time, entered, completed,
        last entered and completed times, step (field for field a `RankProgress`)."""
        last_c, completed = self._last_completed_ns, self._completed
        last_e, entered = self._last_entered_ns, self._entered
        return self._prefix + (time.time_ns(), entered, min(completed, entered), last_e, last_c, self._step)

    def flush(self, timeout_s: float = 5.0) -> bool:
        """Ask the sender to send everything now and wait (bounded); True when all acked."""
        if not self.enabled or self._thread is None or not self._thread.is_alive():
            return self.stats["buffered"] == 0
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if not self._queue and not self._unsent and self._idle.is_set():
                return True
            self._kick.set()
            time.sleep(min(0.02, max(0.0, deadline - time.monotonic())))
        return not self._queue and not self._unsent

    def close(self, timeout_s: float | None = None) -> bool:
        """Stop the sender after one last bounded send; True when everything was acked."""
        if self._closed:
            return self.stats["buffered"] == 0
        self._closed = True
        self.enabled = False
        self._t0 = None
        thread = self._thread
        if thread is None or not thread.is_alive():
            return self.stats["buffered"] == 0
        self._final_deadline = time.monotonic() + (self.exit_flush_s if timeout_s is None else timeout_s)
        self._stop.set()
        self._kick.set()
        thread.join(max(0.0, self._final_deadline - time.monotonic()) + 0.2)
        return self.stats["buffered"] == 0

    def _forked(self) -> None:
        """In a forked child (a data-loader worker): inert, no thread, nothing to flush."""
        self.enabled = False
        self._closed = True
        self._thread = None
        self._queue = deque()
        self._unsent = deque()

    # -- background sender -----------------------------------------------------------------
    def _warn_once(self, message: str, *args: Any) -> None:
        if not self._warned:
            self._warned = True
            log.warning("fabricwatch: " + message + "; training is not affected, further problems are "
                        "logged at debug level", *args)
        else:
            log.debug(message, *args)

    def _run(self) -> None:
        try:
            client = _Client(self)
        except Exception as exc:   # noqa: BLE001 - no grpc, unreadable CA: report nothing
            self._warn_once("rank reporting disabled, cannot set up the gateway client (%s)", exc)
            self.enabled = False
            return
        backoff = 0.0
        try:
            while True:
                stopping = self._stop.is_set()
                if not stopping:
                    self._kick.wait(backoff or self.flush_interval_s)
                    self._kick.clear()
                    stopping = self._stop.is_set()
                if stopping:
                    self._ship(client, self._final_deadline)
                    return
                self._beat()
                if backoff and time.monotonic() < self._retry_at:
                    continue
                ok = self._ship(client, None)
                if ok:
                    backoff = 0.0
                else:
                    backoff = min(max(2 * backoff, self.flush_interval_s), self.backoff_max_s)
                    self._retry_at = time.monotonic() + random.uniform(0.5, 1.0) * backoff
        except Exception as exc:   # noqa: BLE001 - a bug here must not surface in training
            self._warn_once("rank reporting stopped after an internal error (%r)", exc)
        finally:
            self._idle.set()
            client.close()

    def _beat(self) -> None:
        """Queue a progress heartbeat when one is due (from the first collective on)."""
        now = time.monotonic()
        if self._entered and now - self._heartbeat_at >= self.heartbeat_interval_s:
            self._heartbeat_at = now
            self._heartbeat = self.progress()

    def _ship(self, client: _Client, deadline: float | None) -> bool:
        """Send what is queued; False when the gateway could not be reached."""
        self._idle.clear()
        try:
            queue, unsent = self._queue, self._unsent
            while queue:
                unsent.append(queue.popleft())
            while len(unsent) > self.max_buffered:
                unsent.popleft()
                self._sender_stats["dropped"] += 1
            while unsent:
                timeout = self.send_timeout_s
                if deadline is not None:
                    timeout = min(timeout, deadline - time.monotonic())
                    if timeout <= 0.05:
                        return False
                batch = list(itertools.islice(unsent, MAX_STEPS_PER_SNAPSHOT))
                beat = self._heartbeat
                ok, ack = client.send(batch, next(self._batch_ids), timeout, beat)
                if not ok:
                    self._sender_stats["send_failures"] += 1
                    return False
                if beat is not None:
                    self._heartbeat_sent(beat)
                for _ in batch:
                    unsent.popleft()
                self._sender_stats["batches"] += 1
                self._sender_stats["sent"] += len(batch)
                if ack is not None and (ack.rejected or ack.dropped_parts):
                    self._sender_stats["rejected"] += ack.rejected
                    self._sender_stats["dropped_parts"] += ack.dropped_parts
                    self._warn_once("the gateway refused some rank steps: %s",
                                    "; ".join(f"{r.reason}: {r.detail}" for r in ack.rejections[:3]))
                if deadline is None:
                    while queue:
                        unsent.append(queue.popleft())
            beat = self._heartbeat
            if beat is not None:
                ok, ack = client.send([], next(self._batch_ids), self.send_timeout_s if deadline is None else
                                      max(0.05, deadline - time.monotonic()), beat)
                if not ok:
                    self._sender_stats["send_failures"] += 1
                    return False
                self._heartbeat_sent(beat)
            return True
        finally:
            if not self._queue:
                self._idle.set()


    def _heartbeat_sent(self, beat: tuple) -> None:
        self._sender_stats["heartbeats"] += 1
        if self._heartbeat is beat:
            self._heartbeat = None


class _Client:
    """A small synchronous gRPC client of ``Ingest.Send`` (grpc imported here, lazily)."""

    def __init__(self, reporter: RankReporter) -> None:
        import grpc

        from fabricwatch.protos.v1 import telemetry_pb2 as pb
        from fabricwatch.protos.v1 import telemetry_pb2_grpc as pb_grpc

        self.grpc, self.pb, self.r = grpc, pb, reporter
        options = [("grpc.max_send_message_length", 16 * 1024 * 1024),
                   ("grpc.initial_reconnect_backoff_ms", 200), ("grpc.max_reconnect_backoff_ms", 5000)]
        if reporter.server_name:
            options.append(("grpc.ssl_target_name_override", reporter.server_name))
        if reporter.ca_cert:
            creds = channel_credentials(reporter.ca_cert, reporter.client_cert, reporter.client_key)
            self.channel = grpc.secure_channel(reporter.gateway, creds, options=options)
        else:
            self.channel = grpc.insecure_channel(reporter.gateway, options=options)
        self.send_rpc = pb_grpc.IngestStub(self.channel).Send
        self.metadata = (("authorization", f"Bearer {reporter.token}"),) if reporter.token else None
        self.seq = 0

    def send(self, batch: list[tuple], batch_id: int, timeout: float, beat: tuple | None = None):
        pb = self.pb
        by_node: dict[str, list] = {}
        if beat is not None:
            by_node[beat[3]] = []
        for rec in batch:
            by_node.setdefault(rec[3], []).append(pb.RankStep(
                job_id=rec[0], rank=rec[1], world_size=rec[2], node=rec[3], local_gpu=rec[4], step=rec[5],
                start_unix_ns=rec[6], step_seconds=_finite(rec[7]), busy_seconds=_finite(rec[8]),
                collective_wait_seconds=_finite(rec[9])))
        now = time.time_ns()
        snaps = []
        for node, steps in by_node.items():
            self.seq += 1
            snap = pb.Snapshot(cluster=self.r.cluster, source=node, source_kind=pb.SOURCE_KIND_NODE,
                               time_unix_ns=now, seq=self.seq, rank_steps=steps)
            if beat is not None and node == beat[3]:
                snap.rank_progress.add(job_id=beat[0], rank=beat[1], world_size=beat[2], node=beat[3],
                                       local_gpu=beat[4], time_unix_ns=beat[5], collectives_entered=beat[6],
                                       collectives_completed=beat[7], last_entered_unix_ns=beat[8],
                                       last_completed_unix_ns=beat[9], step=beat[10])
            snaps.append(snap)
        try:
            ack = self.send_rpc(pb.IngestBatch(batch_id=batch_id, snapshots=snaps), timeout=timeout,
                                metadata=self.metadata)
        except self.grpc.RpcError as exc:
            code = exc.code() if hasattr(exc, "code") else None
            if code == self.grpc.StatusCode.UNAUTHENTICATED:
                self.r._warn_once("the gateway %s refused our token (FABRICWATCH_TOKEN); rank steps are dropped "
                                  "once %d are buffered", self.r.gateway, self.r.max_buffered)
            else:
                self.r._warn_once("gateway %s unreachable (%s); up to %d rank steps are kept and retried",
                                  self.r.gateway, getattr(code, "name", exc), self.r.max_buffered)
            return False, None
        return True, ack

    def close(self) -> None:
        try:
            self.channel.close()
        except Exception:   # noqa: BLE001
            pass


def _finite(x: float) -> float:
    """Clamp a timing to what the gateway accepts (tiny negative clock noise -> 0)."""
    x = float(x)
    if math.isnan(x):
        return 0.0
    return min(max(x, 0.0), MAX_STEP_SECONDS)


# -- exit ------------------------------------------------------------------------------------
_LIVE: weakref.WeakSet[RankReporter] = weakref.WeakSet()
_ATEXIT_REGISTERED = False
_DEFAULT: RankReporter | None = None
_DEFAULT_LOCK = threading.Lock()


def _at_exit(reporter: RankReporter) -> None:
    global _ATEXIT_REGISTERED
    _LIVE.add(reporter)
    if not _ATEXIT_REGISTERED:
        _ATEXIT_REGISTERED = True
        atexit.register(_close_all)


def _close_all() -> None:
    for reporter in list(_LIVE):
        if reporter._pid == os.getpid():
            try:
                reporter.close()
            except Exception:   # noqa: BLE001
                pass


def default_reporter() -> RankReporter:
    """The process's reporter, created from the environment on first use."""
    global _DEFAULT
    with _DEFAULT_LOCK:
        if _DEFAULT is None:
            _DEFAULT = RankReporter.from_env()
        return _DEFAULT


# -- PyTorch ---------------------------------------------------------------------------------
def instrument_torch(reporter: RankReporter, model: Any = None, optimizer: Any = None, *,
                     comm_hook: Callable | None = None, comm_state: Any = None,
                     sync_cuda: bool = False) -> list:
    """Time a PyTorch DDP training loop without touching it; returns the hook handles.

    * ``model`` (a ``DistributedDataParallel``): a forward pre-hook opens a step when none
      is open and autograd is on (a ``torch.no_grad()`` forward, e.g. validation between
      steps, is no training step: it would open one that runs into the next); the DDP comm hook is wrapped so that the first gradient bucket handed to
      the collectives marks the entry into them. ``comm_hook`` defaults to DDP's own
      ``allreduce_hook``; pass yours (PowerSGD, fp16 compression...) to keep it. Each
      bucket's collective also counts in the progress heartbeat (entered when handed to
      the hook, completed when its future completes: `collective_begin`/`collective_end`).
    * ``optimizer``: a step pre-hook marks the end of the collectives (DDP's backward has
      waited for them) and a step post-hook ends the step.

    On CUDA the CPU runs ahead of the GPU, so the split then follows kernel *launches*
    unless ``sync_cuda=True`` (a ``torch.cuda.synchronize()`` at those two points, which
    costs the CPU-GPU overlap there). For GPU-true collective times use NCCL's Inspector
    and `ingest_nccl_inspector`. torch is imported only here.
    """
    handles: list = []
    sync = None
    if sync_cuda:
        import torch

        if torch.cuda.is_available():
            sync = torch.cuda.synchronize
    if model is not None:
        grad_enabled = _grad_mode()

        def _forward_pre_hook(module, args):
            if reporter._t0 is None and grad_enabled():
                reporter.step_begin()
            return None

        handles.append(model.register_forward_pre_hook(_forward_pre_hook))
        if comm_hook is None:
            from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook as comm_hook
        inner = comm_hook

        def _done(fut):
            reporter.collective_end()       # the bucket's all-reduce left (done or failed)
            return fut.value()

        def _comm_hook(state, bucket):
            if reporter._coll_t is None and reporter._t0 is not None:
                if sync is not None:
                    sync()
                reporter.collectives_begin()
            reporter.collective_begin()     # one progress sequence number per gradient bucket
            fut = inner(state, bucket)
            then = getattr(fut, "then", None)
            if then is None:                # not a torch Future (a synchronous hook): left already
                reporter.collective_end()
                return fut
            return then(_done)

        model.register_comm_hook(comm_state, _comm_hook)
    if optimizer is not None:
        def _pre_step(opt, args, kwargs):
            if sync is not None and reporter._coll_t is not None:
                sync()
            reporter.collectives_end()
            return None

        def _post_step(opt, args, kwargs):
            if sync is not None:
                sync()
            reporter.step_end()

        handles.append(optimizer.register_step_pre_hook(_pre_step))
        handles.append(optimizer.register_step_post_hook(_post_step))
    return handles


def _grad_mode() -> Callable[[], bool]:
    """``torch.is_grad_enabled``; without torch (stand-in modules) every forward trains."""
    try:
        from torch import is_grad_enabled
    except ImportError:
        return lambda: True
    return is_grad_enabled


# -- NCCL Inspector --------------------------------------------------------------------------
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
            except ValueError as exc:
                if exc.pos >= len(text.rstrip()) - 1 and len(buf) < _MAX_OBJECT_CHARS:  # incomplete: read on
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
    for var in _JOB_VARS[:3]:
        value = env.get(var, "").strip()
        if value and value.lower() != "none":
            return value
    for part in (root, *root.parents):
        m = re.fullmatch(r"nccl-inspector-(.+)", part.name)
        if m and m.group(1) != "unknown-jobid":
            return m.group(1)
    raise ValueError("no job id: pass job_id=, or set FABRICWATCH_JOB_ID / SLURM_JOB_ID")
