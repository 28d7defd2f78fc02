"""`RankReporter`: times each training step on the hot path and ships the steps from a
daemon thread.

The hot path (``step()``, ``collectives()``, ``step_begin`` ... ``step_end``) reads the
clock and appends one tuple to a bounded deque; the sender thread batches them to the
gateway (`.client`), keeps unacked steps across outages, retries with backoff and sends
the progress heartbeat. At interpreter exit every live reporter gets a last bounded
flush. This is the SDK's core; identity, the gRPC client, the PyTorch hooks and the NCCL
Inspector ingestion live in their own modules around it.
"""
from __future__ import annotations

import atexit
import itertools
import logging
import math
import os
import threading
import time
import weakref
from collections import Counter, deque
from collections.abc import Iterable, Mapping
from typing import Any, Literal

from fabricwatch.backoff import Backoff

from .client import IngestClient
from .identity import RankIdentity, StepRecord

log = logging.getLogger("fabricwatch.rank")

MAX_STEPS_PER_SNAPSHOT = 4096     # the gateway's MAX_RANK_STEPS
# The progress heartbeat's period (collectives entered/completed, sent even when no step
# completes). The hang model (models/hang.py) names a hang 20 s after the last completion at
# the earliest and calls a rank lost after three missed heartbeats (15 s): 5 s keeps a hang
# named well inside 60 s, and costs one ~100-byte message per rank per 5 s (a 10,000-rank
# job: 2,000 small messages a second at the gateway, batched per node).
HEARTBEAT_INTERVAL_S = 5.0
# The shared gateway block (`fabricwatch.config_schema.GatewayConnection`) from the environment:
# field -> variable (docs/configuration.md lists them with the block's meanings).
GATEWAY_ENV = {"target": "FABRICWATCH_GATEWAY", "token": "FABRICWATCH_TOKEN", "ca_cert": "FABRICWATCH_CA_CERT",
               "client_cert": "FABRICWATCH_CLIENT_CERT", "client_key": "FABRICWATCH_CLIENT_KEY",
               "server_name": "FABRICWATCH_TLS_SERVER_NAME"}


# -- reporter --------------------------------------------------------------------------------
class _NullContext:
    __slots__ = ()

    def __enter__(self):
        return None

    def __exit__(self, *exc) -> Literal[False]:
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

    def __exit__(self, exc_type, exc, tb) -> Literal[False]:
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

    def __exit__(self, *exc) -> Literal[False]:
        self._reporter.collective_end()
        return False


class _CollectivesContext:
    __slots__ = ("_reporter",)

    def __init__(self, reporter: RankReporter) -> None:
        self._reporter = reporter

    def __enter__(self) -> RankReporter:
        self._reporter.collectives_begin()
        return self._reporter

    def __exit__(self, *exc) -> Literal[False]:
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
        if self.gateway:
            # The collectors' gateway block, so the SDK's TLS rules are theirs (imported only
            # when reporting: pydantic costs a training script nothing while it is disabled).
            from fabricwatch.config_schema import GatewayConnection, validate

            validate(GatewayConnection, {"target": self.gateway, "token": token, "ca_cert": ca_cert,
                                         "client_cert": client_cert, "client_key": client_key,
                                         "server_name": server_name}, where="gateway")
        self.token = token
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
        options = {("gateway" if key == "target" else key): env.get(name, "") for key, name in GATEWAY_ENV.items()}
        options.update(cluster=env.get("FABRICWATCH_CLUSTER", ""))
        if disabled:
            options["gateway"] = ""
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
            client = IngestClient(self)
        except Exception as exc:   # noqa: BLE001 - no grpc, unreadable CA: report nothing
            self._warn_once("rank reporting disabled, cannot set up the gateway client (%s)", exc)
            self.enabled = False
            return
        backoff = Backoff(self.flush_interval_s, self.backoff_max_s)
        try:
            while True:
                stopping = self._stop.is_set()
                if not stopping:
                    self._kick.wait(backoff.step_s or self.flush_interval_s)
                    self._kick.clear()
                    stopping = self._stop.is_set()
                if stopping:
                    self._ship(client, self._final_deadline)
                    return
                self._beat()
                if backoff.step_s and time.monotonic() < self._retry_at:
                    continue
                ok = self._ship(client, None)
                if ok:
                    backoff.reset()
                else:
                    self._retry_at = time.monotonic() + backoff.next_s()
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

    def _ship(self, client: IngestClient, deadline: float | None) -> bool:
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
