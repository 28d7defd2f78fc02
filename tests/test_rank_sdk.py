"""The training-rank SDK (`fabricwatch.rank`): identity from the launcher's environment,
the busy/wait split of a step, the bounded buffer, failure behaviour, hot-path overhead,
the PyTorch hooks (with stand-ins: torch is not installed in CI), NCCL Inspector
ingestion, and end to end: a real 4-rank MPI data-parallel job with one slowed rank, through
the gateway, Kafka and a `fabricwatch worker` process, named as a straggler.
"""
from __future__ import annotations

import asyncio
import importlib.util
import json
import logging
import os
import re
import shutil
import socket
import subprocess
import sys
import textwrap
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path

import grpc
import pytest
from helpers import running_gateway

from fabricwatch.models.frames import RankStep
from fabricwatch.models.straggler import StragglerDetector
from fabricwatch.protos.v1 import events_pb2 as ev
from fabricwatch.protos.v1 import telemetry_pb2 as pb
from fabricwatch.protos.v1 import telemetry_pb2_grpc as pb_grpc
from fabricwatch.rank import (RankIdentity, RankReporter, StepRecord, ingest_nccl_inspector,
                              instrument_torch)
from fabricwatch.rank import client as rank_client
from fabricwatch.rank import reporter as rank_reporter
from fabricwatch.rank.identity import clean_name
from fabricwatch.streams.validate import validate_snapshot

TESTS = Path(__file__).resolve().parent
IDENT = RankIdentity("job-t", 1, 4, "node-a", 1, "manual")


# -- helpers --------------------------------------------------------------------------------
def closed_port() -> int:
    """A loopback port nobody listens on (bound then released)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class FakeGateway(pb_grpc.IngestServicer):
    """Ingest.Send with the gateway's real validation; keeps what it accepted."""

    def __init__(self, token: str = "") -> None:
        self.token = token
        self.down = False
        self.snapshots: list[pb.Snapshot] = []
        self.calls = 0
        self.lock = threading.Lock()

    def Send(self, request, context):
        with self.lock:
            self.calls += 1
        if self.token and dict(context.invocation_metadata()).get("authorization") != f"Bearer {self.token}":
            context.abort(grpc.StatusCode.UNAUTHENTICATED, "bad token")
        if self.down:
            context.abort(grpc.StatusCode.UNAVAILABLE, "down for the test")
        ack = pb.IngestAck(batch_id=request.batch_id)
        for index, snap in enumerate(request.snapshots):
            verdict = validate_snapshot(snap, time.time_ns())
            for reason, detail in verdict.problems:
                ack.rejections.add(index=index, reason=reason, detail=detail)
            if verdict.accepted:
                ack.accepted += 1
                ack.dropped_parts += len(verdict.problems)
                with self.lock:
                    self.snapshots.append(snap)
            else:
                ack.rejected += 1
        return ack

    @property
    def steps(self) -> list[pb.RankStep]:
        with self.lock:
            return [rs for snap in self.snapshots for rs in snap.rank_steps]


@contextmanager
def fake_gateway(token: str = "", credentials=None):
    service = FakeGateway(token)
    server = grpc.server(ThreadPoolExecutor(max_workers=2))
    pb_grpc.add_IngestServicer_to_server(service, server)
    port = (server.add_secure_port("127.0.0.1:0", credentials) if credentials is not None
            else server.add_insecure_port("127.0.0.1:0"))
    server.start()
    try:
        yield service, f"127.0.0.1:{port}"
    finally:
        server.stop(0)


class FakeClock:
    """Stands in for the `time` module inside the reporter and its client: perf_counter is set by hand."""

    def __init__(self) -> None:
        self.t = 100.0
        self.base_ns = time.time_ns()
        self.monotonic, self.sleep = time.monotonic, time.sleep

    def perf_counter(self) -> float:
        return self.t

    def time_ns(self) -> int:
        return self.base_ns + int((self.t - 100.0) * 1e9)


@pytest.fixture
def clock(monkeypatch) -> FakeClock:
    fake = FakeClock()
    monkeypatch.setattr(rank_reporter, "time", fake)
    monkeypatch.setattr(rank_client, "time", fake)
    return fake


def quiet_reporter(**kw) -> RankReporter:
    """Enabled (a gateway is set) but nobody listens and the sender sleeps: steps stay queued."""
    kw.setdefault("flush_interval_s", 60.0)
    kw.setdefault("backoff_max_s", 60.0)
    kw.setdefault("exit_flush_s", 0.2)
    return RankReporter(IDENT, f"127.0.0.1:{closed_port()}", **kw)


# -- identity from the environment ------------------------------------------------------------
def test_torchrun_variables():
    ident = RankIdentity.from_env({"RANK": "5", "WORLD_SIZE": "16", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "8",
                                   "TORCHELASTIC_RUN_ID": "llm-run-7", "FABRICWATCH_NODE": "gpu-12"})
    assert ident == RankIdentity("llm-run-7", 5, 16, "gpu-12", 1, "torchrun")


def test_slurm_variables():
    ident = RankIdentity.from_env({"SLURM_PROCID": "9", "SLURM_NTASKS": "32", "SLURM_LOCALID": "1",
                                   "SLURM_JOB_ID": "771234", "SLURMD_NODENAME": "dgx-b07"})
    assert ident == RankIdentity("771234", 9, 32, "dgx-b07", 1, "slurm")


def test_torchrun_under_slurm_takes_torchrun_rank_and_slurm_job():
    # `srun torchrun ...`: SLURM_PROCID is the launcher's index, RANK the training rank
    ident = RankIdentity.from_env({"SLURM_PROCID": "1", "SLURM_NTASKS": "2", "SLURM_LOCALID": "0",
                                   "SLURM_JOB_ID": "5521", "SLURMD_NODENAME": "n2",
                                   "RANK": "11", "WORLD_SIZE": "16", "LOCAL_RANK": "3",
                                   "TORCHELASTIC_RUN_ID": "none"})
    assert (ident.job_id, ident.rank, ident.world_size, ident.node, ident.local_gpu, ident.launcher) == \
        ("5521", 11, 16, "n2", 3, "torchrun")


def test_job_id_precedence_and_fallbacks():
    base = {"RANK": "0", "WORLD_SIZE": "2", "FABRICWATCH_NODE": "n1"}
    assert RankIdentity.from_env({**base, "SLURM_JOB_ID": "1", "FABRICWATCH_JOB_ID": "mine"}).job_id == "mine"
    assert RankIdentity.from_env({**base, "TORCHELASTIC_RUN_ID": "abc"}).job_id == "abc"
    # torchrun without --rdzv-id says "none": not a job id; the launcher's pid is shared by the job's ranks
    fallback = RankIdentity.from_env({**base, "TORCHELASTIC_RUN_ID": "none"}).job_id
    assert fallback == f"n1-{os.getppid()}"
    assert RankIdentity.from_env({**base, "FABRICWATCH_JOB_ID": "my job#3"}).job_id == "my-job-3"
    assert RankIdentity.from_env({"OMPI_COMM_WORLD_RANK": "2", "OMPI_COMM_WORLD_SIZE": "4",
                                  "OMPI_COMM_WORLD_LOCAL_RANK": "2", "PMIX_NAMESPACE": "1444282369"}) \
        .job_id == "1444282369"


def test_node_gpu_and_single_process_defaults():
    ident = RankIdentity.from_env({})
    assert (ident.rank, ident.world_size, ident.local_gpu, ident.launcher) == (0, 1, 0, "single")
    assert ident.node == clean_name(socket.gethostname())
    ident = RankIdentity.from_env({"RANK": "1", "WORLD_SIZE": "4", "LOCAL_RANK": "1", "FABRICWATCH_LOCAL_GPU": "6"})
    assert ident.local_gpu == 6


@pytest.mark.parametrize("env, message", [
    ({"RANK": "4", "WORLD_SIZE": "4"}, "outside the world size"),
    ({"RANK": "x", "WORLD_SIZE": "4"}, "not an integer"),
    ({"SLURM_PROCID": "0", "SLURM_NTASKS": "0"}, "must be >= 1"),
])
def test_inconsistent_environment(env, message, caplog):
    with pytest.raises(ValueError, match=message):
        RankIdentity.from_env(env)
    # the reporter never raises: it is disabled, with one warning
    with caplog.at_level(logging.WARNING, logger="fabricwatch.rank"):
        reporter = RankReporter.from_env({**env, "FABRICWATCH_GATEWAY": "127.0.0.1:1"})
    assert not reporter.enabled
    assert message in caplog.text
    with reporter.step():
        pass


def test_reporter_from_env_reads_gateway_settings():
    env = {"RANK": "0", "WORLD_SIZE": "1", "FABRICWATCH_GATEWAY": f"127.0.0.1:{closed_port()}",
           "FABRICWATCH_TOKEN": "t0k", "FABRICWATCH_CLUSTER": "c9", "FABRICWATCH_CA_CERT": ""}
    reporter = RankReporter.from_env(env, flush_interval_s=30.0)
    try:
        assert reporter.enabled and reporter.token == "t0k" and reporter.cluster == "c9"
        assert reporter.flush_interval_s == 30.0
    finally:
        reporter.close(0.1)
    assert not RankReporter.from_env({**env, "FABRICWATCH_DISABLE": "1"}).enabled
    assert not RankReporter.from_env({"RANK": "0", "WORLD_SIZE": "1"}).enabled   # no gateway: no-op


# -- the timing split -------------------------------------------------------------------------
def test_step_split_into_busy_and_collectives(clock):
    r = quiet_reporter()
    try:
        with r.step():
            clock.t += 0.30                    # forward/backward
            with r.collectives():
                clock.t += 0.20                # allreduce, waiting for the slowest
            clock.t += 0.05                    # optimizer step: own compute again
        s = r.last_step
        assert s.step == 0 and (s.job_id, s.rank, s.world_size, s.node, s.local_gpu) == \
            ("job-t", 1, 4, "node-a", 1)
        assert s.step_seconds == pytest.approx(0.55)
        assert s.busy_seconds == pytest.approx(0.35)
        assert s.collective_wait_seconds == pytest.approx(0.20)
        assert s.start_unix_ns == clock.base_ns

        r.step_begin()                         # explicit calls; the step ends inside the collectives
        clock.t += 0.1
        r.collectives_begin()
        clock.t += 0.4
        r.collectives_begin()                  # idempotent while inside
        clock.t += 0.1
        r.step_end()
        s = r.last_step
        assert (s.step, s.busy_seconds, s.collective_wait_seconds) == (1, pytest.approx(0.1), pytest.approx(0.5))

        with r.step(41):                       # several collective sections add up; no collectives = all busy
            for _ in range(3):
                clock.t += 0.1
                with r.collectives():
                    clock.t += 0.05
        assert (r.last_step.step, r.last_step.collective_wait_seconds) == (41, pytest.approx(0.15))
        with r.step():
            clock.t += 0.2
        assert (r.last_step.step, r.last_step.busy_seconds, r.last_step.collective_wait_seconds) == \
            (42, pytest.approx(0.2), 0.0)
        assert r.stats["steps"] == 4 and r.stats["misuse"] == 0
    finally:
        r.close(0.1)


def test_misuse_and_failed_steps_never_raise(clock):
    r = quiet_reporter()
    try:
        r.step_end()                            # no step open
        r.collectives_end()
        r.collectives_begin()                   # outside a step: ignored
        with pytest.raises(ZeroDivisionError):  # the training error propagates; the step is not recorded
            with r.step():
                clock.t += 0.1
                raise ZeroDivisionError("the step's own code fails")
        assert r.stats["steps"] == 0
        r.step_begin(7)
        r.step_begin(8)                         # 7 never ended: discarded
        clock.t += 0.1
        r.step_end()
        assert r.last_step.step == 8 and r.stats["steps"] == 1
        assert r.stats["misuse"] == 2
    finally:
        r.close(0.1)


def test_real_clock_split():
    r = quiet_reporter()
    try:
        with r.step():
            time.sleep(0.05)
            with r.collectives():
                time.sleep(0.03)
        s = r.last_step
        # the real clock end to end (the split itself is tested on the fake clock above): never
        # shorter than the sleeps, and a generous bound above for a loaded machine
        assert 0.045 <= s.busy_seconds <= 2.0 and 0.025 <= s.collective_wait_seconds <= 2.0
        assert s.step_seconds == pytest.approx(s.busy_seconds + s.collective_wait_seconds)
        assert abs(s.start_unix_ns - time.time_ns()) < 5 * 10**9
    finally:
        r.close(0.1)


# -- bounded buffer, failure behaviour, overhead --------------------------------------------
def test_bounded_buffer_drops_oldest_and_counts(clock):
    r = quiet_reporter(max_buffered=5)
    try:
        for _ in range(12):
            with r.step():
                clock.t += 0.01
        assert r.stats["steps"] == 12
        assert r.stats["dropped_buffer_full"] == 7
        assert r.stats["buffered"] == 5
        assert [rec[5] for rec in r._queue] == [7, 8, 9, 10, 11]   # the newest are kept
    finally:
        r.close(0.1)


def test_unreachable_gateway_one_warning_no_exception_bounded_close(caplog):
    with caplog.at_level(logging.DEBUG, logger="fabricwatch.rank"):
        r = RankReporter(IDENT, f"127.0.0.1:{closed_port()}", flush_interval_s=0.02, backoff_max_s=0.05,
                         max_buffered=50, exit_flush_s=0.5)
        for _ in range(200):
            with r.step():
                with r.collectives():
                    pass
            time.sleep(0.002)
        deadline = time.monotonic() + 10
        while r.stats["send_failures"] < 3 and time.monotonic() < deadline:
            time.sleep(0.02)
        t0 = time.monotonic()
        assert r.close() is False               # nothing could be sent
        assert time.monotonic() - t0 < 1.5
    warnings = [rec for rec in caplog.records if rec.levelno >= logging.WARNING]
    assert len(warnings) == 1 and "unreachable" in warnings[0].getMessage()
    assert r.stats["send_failures"] >= 3
    assert r.stats["buffered"] <= 50 and r.stats["dropped_buffer_full"] == 200 - r.stats["buffered"]
    with r.step():                               # closed: a no-op
        pass


def test_hot_path_overhead_with_gateway_unreachable():
    """< 20 µs per step (measured ~2-4 µs on a shared 2-core CI machine), sender thread running."""
    r = RankReporter(IDENT, f"127.0.0.1:{closed_port()}", flush_interval_s=0.01, backoff_max_s=0.02,
                     max_buffered=1000, exit_flush_s=0.1)
    try:
        n = 5000
        per_step = []
        for _ in range(7):
            t0 = time.perf_counter()
            for _ in range(n):
                with r.step():
                    with r.collectives():
                        pass
            per_step.append((time.perf_counter() - t0) / n)
        explicit = []
        for _ in range(7):
            t0 = time.perf_counter()
            for _ in range(n):
                r.step_begin()
                r.collectives_begin()
                r.step_end()
            explicit.append((time.perf_counter() - t0) / n)
        median = sorted(per_step)[3]
        print(f"hot path per step: context managers {median * 1e6:.2f} µs, "
              f"explicit calls {sorted(explicit)[3] * 1e6:.2f} µs (median of 7 x {n})")
        assert median < 20e-6
        assert r.stats["steps"] == 14 * n and r.stats["send_failures"] >= 1
    finally:
        r.close(0.1)


def test_disabled_reporter_costs_nothing_and_records_nothing():
    r = RankReporter(IDENT, "")
    t0 = time.perf_counter()
    for _ in range(10_000):
        with r.step():
            with r.collectives():
                pass
    assert (time.perf_counter() - t0) / 10_000 < 20e-6
    assert r.stats["steps"] == 0 and r.last_step is None and r._thread is None


# -- shipping to a gateway --------------------------------------------------------------------
def test_steps_reach_the_gateway_validated(clock):
    with fake_gateway(token="s3cret") as (gw, target):
        r = RankReporter(IDENT, target, token="s3cret", cluster="c1", flush_interval_s=0.05)
        try:
            for _ in range(5):
                with r.step():
                    clock.t += 0.2
                    with r.collectives():
                        clock.t += 0.1
            assert r.flush(10)
            assert r.stats["sent"] == 5 and r.stats["buffered"] == 0 and r.stats["rejected"] == 0
        finally:
            r.close(1)
        assert [s.step for s in gw.steps] == [0, 1, 2, 3, 4]
        s = gw.steps[0]
        assert (s.job_id, s.rank, s.world_size, s.node, s.local_gpu) == ("job-t", 1, 4, "node-a", 1)
        assert (s.step_seconds, s.busy_seconds, s.collective_wait_seconds) == \
            (pytest.approx(0.3), pytest.approx(0.2), pytest.approx(0.1))
        snap = gw.snapshots[0]
        assert (snap.source, snap.source_kind, snap.cluster) == ("node-a", pb.SOURCE_KIND_NODE, "c1")


def test_steps_reach_a_gateway_that_needs_a_client_certificate(clock, tmp_path):
    """With --client-ca the handshake needs a certificate signed by that CA (the node
    collector's `gateway.client_cert`): the SDK presents one from FABRICWATCH_CLIENT_CERT/KEY."""
    from fabricwatch.localtls import ensure_self_signed
    from fabricwatch.streams.gateway import server_credentials

    cert, key = ensure_self_signed(tmp_path / "server")
    client_cert, client_key = ensure_self_signed(tmp_path / "client")      # self-signed: its own CA
    creds = server_credentials(str(cert), str(key), client_ca_path=str(client_cert))
    with fake_gateway(credentials=creds) as (gw, target):
        env = {"RANK": "1", "WORLD_SIZE": "4", "LOCAL_RANK": "1", "TORCHELASTIC_RUN_ID": "job-t",
               "FABRICWATCH_GATEWAY": target, "FABRICWATCH_CA_CERT": str(cert),
               "FABRICWATCH_TLS_SERVER_NAME": "localhost", "FABRICWATCH_CLIENT_CERT": str(client_cert),
               "FABRICWATCH_CLIENT_KEY": str(client_key)}
        without = RankReporter(IDENT, target, ca_cert=str(cert), server_name="localhost", flush_interval_s=0.05,
                               backoff_max_s=0.2)
        with_cert = RankReporter.from_env(env, flush_interval_s=0.05)
        try:
            for r in (without, with_cert):
                with r.step():
                    clock.t += 0.2
            assert with_cert.flush(10) and not without.flush(1)
        finally:
            without.close(0.5)
            with_cert.close(1)
        assert [s.job_id for s in gw.steps] == ["job-t"] and without.stats["sent"] == 0
    with pytest.raises(ValueError, match="go together"):
        RankReporter(IDENT, target, ca_cert=str(cert), client_cert=str(client_cert))


def test_outage_keeps_steps_and_resends_them(caplog):
    with fake_gateway() as (gw, target):
        gw.down = True
        with caplog.at_level(logging.WARNING, logger="fabricwatch.rank"):
            r = RankReporter(IDENT, target, flush_interval_s=0.02, backoff_max_s=0.05)
            try:
                for _ in range(10):
                    with r.step():
                        pass
                deadline = time.monotonic() + 10
                while r.stats["send_failures"] < 2 and time.monotonic() < deadline:
                    time.sleep(0.01)
                assert r.stats["send_failures"] >= 2 and r.stats["sent"] == 0
                gw.down = False
                for _ in range(5):
                    with r.step():
                        pass
                assert r.flush(10)
            finally:
                r.close(1)
        assert [s.step for s in gw.steps] == list(range(15))     # in order, none lost, none twice
        assert len([rec for rec in caplog.records if rec.levelno >= logging.WARNING]) == 1


def test_wrong_token_and_invalid_records_are_reported_once(caplog):
    with fake_gateway(token="right") as (gw, target):
        with caplog.at_level(logging.WARNING, logger="fabricwatch.rank"):
            r = RankReporter(IDENT, target, token="wrong", flush_interval_s=0.02, backoff_max_s=0.05)
            with r.step():
                pass
            deadline = time.monotonic() + 10
            while r.stats["send_failures"] < 2 and time.monotonic() < deadline:
                time.sleep(0.01)
            r.close(0.3)
        assert "refused our token" in caplog.text and not gw.steps
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="fabricwatch.rank"):
            r = RankReporter(IDENT, target, token="right", flush_interval_s=0.02)
            good = StepRecord("job-t", 1, 4, "node-a", 1, 0, time.time_ns(), 1.0, 0.7, 0.3)
            assert r.submit([good, good._replace(step=1, rank=9), ("not", "a", "record")]) == 2
            assert r.flush(10)
            r.close(1)
        assert r.stats["sent"] == 2 and r.stats["dropped_parts"] == 1 and r.stats["misuse"] == 1
        assert [s.step for s in gw.steps] == [0]
        assert "bad_rank_step" in caplog.text


def test_flush_at_interpreter_exit(tmp_path):
    with fake_gateway() as (gw, target):
        script = textwrap.dedent("""
            from fabricwatch.rank import RankReporter
            r = RankReporter.from_env(flush_interval_s=3600)     # only the exit flush can send
            for _ in range(3):
                with r.step():
                    with r.collectives():
                        pass
        """)
        env = {**os.environ, "RANK": "2", "WORLD_SIZE": "3", "LOCAL_RANK": "0", "FABRICWATCH_JOB_ID": "exit-job",
               "FABRICWATCH_GATEWAY": target, "FABRICWATCH_NODE": "n-exit"}
        subprocess.run([sys.executable, "-c", script], env=env, check=True, timeout=60)
        assert [(s.job_id, s.rank, s.step) for s in gw.steps] == [("exit-job", 2, 0), ("exit-job", 2, 1),
                                                                  ("exit-job", 2, 2)]
        # gateway gone: the process still exits promptly (bounded exit flush, one warning)
        env["FABRICWATCH_GATEWAY"] = f"127.0.0.1:{closed_port()}"
        t0 = time.monotonic()
        done = subprocess.run([sys.executable, "-c", script], env=env, timeout=60, capture_output=True, text=True)
        assert done.returncode == 0 and time.monotonic() - t0 < 30
        assert done.stderr.count("fabricwatch:") == 1 and "Traceback" not in done.stderr


# -- PyTorch hooks, with stand-ins for DDP and the optimizer --------------------------------------
class StandInDDP:
    def __init__(self) -> None:
        self.forward_pre_hooks, self.comm_hook = [], None

    def register_forward_pre_hook(self, hook):
        self.forward_pre_hooks.append(hook)
        return ("fwd", hook)

    def register_comm_hook(self, state, hook):
        self.comm_hook = (state, hook)


class StandInOptimizer:
    def __init__(self) -> None:
        self.pre, self.post = [], []

    def register_step_pre_hook(self, hook):
        self.pre.append(hook)
        return ("pre", hook)

    def register_step_post_hook(self, hook):
        self.post.append(hook)
        return ("post", hook)

    def step(self):
        for hook in self.pre:
            hook(self, (), {})
        for hook in self.post:
            hook(self, (), {})


def test_instrument_torch_ddp_and_optimizer_hooks(clock):
    r = quiet_reporter()
    model, opt = StandInDDP(), StandInOptimizer()
    buckets = []

    def allreduce(state, bucket):
        buckets.append((state, bucket))
        return f"future-{bucket}"

    try:
        handles = instrument_torch(r, model, opt, comm_hook=allreduce, comm_state="pg")
        assert len(handles) == 3 and model.comm_hook[0] == "pg"
        hook = model.comm_hook[1]
        for _ in range(2):                      # two iterations of a DDP loop
            for pre in model.forward_pre_hooks:
                pre(model, ())                  # forward: opens the step
            clock.t += 0.3                      # forward + first part of backward
            assert hook("pg", 0) == "future-0"  # first gradient bucket enters the collectives
            clock.t += 0.1
            assert hook("pg", 1) == "future-1"
            clock.t += 0.2                      # DDP's backward waits for the allreduce
            opt.step()                          # pre-hook: collectives over; post-hook: step over
        s = r.last_step
        assert (s.step, s.step_seconds, s.busy_seconds, s.collective_wait_seconds) == \
            (1, pytest.approx(0.6), pytest.approx(0.3), pytest.approx(0.3))
        assert buckets == [("pg", 0), ("pg", 1)] * 2 and r.stats["steps"] == 2
    finally:
        r.close(0.1)


def test_instrument_torch_default_hook_needs_torch():
    if importlib.util.find_spec("torch") is not None:
        pytest.skip("torch is installed: the default hook exists")
    r = quiet_reporter()
    try:
        with pytest.raises(ImportError):
            instrument_torch(r, StandInDDP())
    finally:
        r.close(0.1)


# -- NCCL Inspector --------------------------------------------------------------------------
# ten minutes ago, in microseconds: the gateway accepts rank steps within its clock window only
T0_US = time.time_ns() // 1000 - 600_000_000
BUSY_US = {0: 200_000, 1: 205_000, 2: 420_000, 3: 198_000}   # rank 2: a slow GPU
XFER_US = 30_000


def inspector_dump(tmp_path: Path, *, verbose: bool = True, steps: int = 8, per_step: int = 2,
                   v43: bool = True, pretty_rank: int | None = None) -> Path:
    """Synthetic Inspector output of a 4-rank, 2-node job: each step, every rank computes
    for BUSY_US then runs `per_step` AllReduce kernels; a kernel ends for everyone when the
    last rank arrived plus XFER_US. Another (2-rank) communicator and P2P records as noise."""
    out = tmp_path / "nccl-inspector-4242"
    out.mkdir()
    ranks = sorted(BUSY_US)
    end = {r: T0_US for r in ranks}
    lines: dict[int, list[dict]] = {r: [] for r in ranks}
    sn = 100
    for _step in range(steps):
        for i in range(per_step):
            arrive = {r: end[r] + (BUSY_US[r] if i == 0 else 0) for r in ranks}
            done = max(arrive.values()) + XFER_US
            for r in ranks:
                perf = {"coll": "AllReduce", "coll_sn": sn, "coll_msg_size_bytes": 25 << 20,
                        "coll_exec_time_us": done - arrive[r], "coll_timing_source": "kernel_gpu",
                        "coll_algobw_gbs": 100.0, "coll_busbw_gbs": 150.0}
                if verbose:
                    perf["event_trace_ts"] = {"coll_start_ts": arrive[r] - 50, "coll_stop_ts": arrive[r] - 45,
                                              "kernel_events": [
                                                  {"channel_id": 0, "kernel_start_ts": arrive[r],
                                                   "kernel_stop_ts": done - 3},
                                                  {"channel_id": 1, "kernel_start_ts": arrive[r] + 2,
                                                   "kernel_stop_ts": done}]}
                lines[r].append({"coll_perf": perf})
                end[r] = done
            sn += 1
    for r in ranks:
        header = {"id": "0xdp", "rank": r, "n_ranks": 4, "nnodes": 2}
        metadata = {"inspector_output_format_version": "v4.3" if v43 else "v4.0", "git_rev": "",
                    "rec_mechanism": "nccl_profiler_interface", "dump_timestamp_us": end[r] + 500,
                    "hostname": f"node-{r // 2}", "pid": 1000 + r}
        objs: list[dict] = []
        if v43:
            objs.append({"header": header, "metadata": metadata,
                         "dump_stats": {"coll_records": len(lines[r]), "coll_dropped_total": 0,
                                        "coll_dropped_since_last_dump": 0, "p2p_records": 1}})
            objs += lines[r]
            objs.append({"p2p_perf": {"p2p_operation": "Send", "p2p_sn": 1, "p2p_exec_time_us": 5}})
        else:
            objs += [{"header": header, "metadata": metadata, **rec} for rec in lines[r]]
        if r < 2:   # a 2-rank tensor-parallel communicator on node-0
            objs.append({"header": {"id": "0xtp", "rank": r, "n_ranks": 2, "nnodes": 1}, "metadata": metadata,
                         "coll_perf": {"coll": "AllGather", "coll_sn": 1, "coll_exec_time_us": 10}})
        path = out / f"node-{r // 2}-pid{1000 + r}.log"
        with open(path, "w") as fh:
            for obj in objs:
                fh.write(json.dumps(obj, indent=2 if r == pretty_rank else None) + "\n")
    return out


def test_inspector_counts_a_number_past_the_digit_limit_as_malformed(tmp_path):
    # json raises a plain ValueError (no .pos) for an integer of more than 4300 digits
    out = inspector_dump(tmp_path)
    with (out / "node-1-pid1003.log").open("a") as fh:
        fh.write('{"coll_perf": {"coll_sn": ' + "1" * 5000 + "}}\n")
    steps = ingest_nccl_inspector(out, collectives_per_step=2)
    assert steps.stats["malformed_lines"] == 1 and len(steps) == 4 * 7


def test_inspector_v43_verbose_gives_the_busy_wait_split(tmp_path):
    out = inspector_dump(tmp_path, pretty_rank=3)
    with (out / "node-1-pid1003.log").open("a") as fh:
        fh.write("{not json\n")
    steps = ingest_nccl_inspector(out, collectives_per_step=2)
    assert steps.comm_id == "0xdp"
    assert steps.stats["steps_anchor_only"] == 4 and steps.stats["malformed_lines"] == 1
    assert steps.stats["other_communicators"] == 2 and steps.stats["other_records"] == 4
    assert {s.job_id for s in steps} == {"4242"}                    # from the directory name
    assert len(steps) == 4 * 7                                      # each rank's first step only anchors
    step_us = max(BUSY_US.values()) + 2 * XFER_US
    for s in steps:
        assert s.world_size == 4 and s.node == f"node-{s.rank // 2}" and s.local_gpu == s.rank % 2
        assert s.step_seconds == pytest.approx(step_us / 1e6)
        assert s.busy_seconds == pytest.approx(BUSY_US[s.rank] / 1e6)
        assert s.busy_seconds + s.collective_wait_seconds == pytest.approx(s.step_seconds)
    # the straggler detector names rank 2 from these records
    det = StragglerDetector(cluster="c")
    found = [f for s in steps for f in det.add_step(RankStep(s.job_id, s.rank, s.world_size, s.node, s.local_gpu,
                                                              s.step, s.start_unix_ns, s.step_seconds,
                                                              s.busy_seconds, s.collective_wait_seconds))]
    assert [(f.kind, f.state, f.entity.rank, f.entity.node, f.entity.device) for f in found] == \
        [("straggler", "open", "2", "node-1", "gpu0")]


def test_inspector_older_format_and_non_verbose(tmp_path):
    out = inspector_dump(tmp_path, v43=False)
    steps = ingest_nccl_inspector(out / "node-1-pid1002.log", job_id="j", collectives_per_step=2)
    assert len(steps) == 7 and {s.rank for s in steps} == {2}
    assert steps[0].busy_seconds == pytest.approx(BUSY_US[2] / 1e6) and steps[0].local_gpu == 0

    (tmp_path / "plain").mkdir()
    plain = inspector_dump(tmp_path / "plain", verbose=False)
    skipped = ingest_nccl_inspector(plain, job_id="j", collectives_per_step=2)
    assert list(skipped) == [] and skipped.stats["steps_without_times"] == 32
    given = ingest_nccl_inspector(plain, job_id="j", collectives_per_step=2, step_seconds=0.5)
    assert len(given) == 32
    slow = [s for s in given if s.rank == 2][0]
    assert slow.step_seconds == 0.5 and slow.collective_wait_seconds == pytest.approx(2 * XFER_US / 1e6)
    fast = [s for s in given if s.rank == 3][0]
    assert fast.busy_seconds < slow.busy_seconds


def test_inspector_records_can_be_shipped(tmp_path):
    out = inspector_dump(tmp_path)
    with fake_gateway() as (gw, target):
        r = RankReporter(IDENT, target, flush_interval_s=0.05)
        try:
            steps = ingest_nccl_inspector(out, job_id="insp-1", collectives_per_step=2, reporter=r)
            assert r.flush(10)
        finally:
            r.close(1)
    assert len(gw.steps) == len(steps) == 28
    assert {snap.source for snap in gw.snapshots} == {"node-0", "node-1"}   # one snapshot per node
    with pytest.raises(FileNotFoundError):
        ingest_nccl_inspector(tmp_path / "missing", job_id="x")
    with pytest.raises(ValueError, match="job id"):
        ingest_nccl_inspector(tmp_path, environ={})


# -- end to end: a real MPI data-parallel job --------------------------------------------------
MPI_MISSING = ("needs Open MPI and mpi4py (apt-get install -y openmpi-bin libopenmpi-dev; "
               "pip install mpi4py)")


def _mpi_available() -> bool:
    return shutil.which("mpirun") is not None and importlib.util.find_spec("mpi4py") is not None


def start_worker_in(tmp_path: Path, bootstrap: str, app_id: str) -> subprocess.Popen:
    """`fabricwatch worker` as deployed, run in tmp_path (its Faust data dir goes there)."""
    from test_pipeline_kafka import start_worker

    return start_worker(bootstrap, tmp_path, app_id, cwd=tmp_path)


def print_busy_ratios(reports: list[dict], steps: int, step_col: int, busy_col: int) -> None:
    """Busy time / job median, per rank and step: shown with -s, and on failure."""
    for s in range(steps):
        busy = [rep["steps"][s][busy_col] for rep in reports]
        median = sorted(busy)[1:3]
        print(f"step {s:2d}: {reports[0]['steps'][s][step_col]:.2f} s, busy/median",
              " ".join(f"{b / (sum(median) / 2):.2f}" for b in busy))


async def assert_straggler_named(bootstrap: str, tmp_path: Path, app_id: str, job_id: str, reports: list[dict],
                                 slow_rank: int, slow_from: int) -> ev.AnomalyEvent:
    """The job's straggler events name exactly `slow_rank`, its node and GPU, within a few steps."""
    from test_pipeline_kafka import collect_anomalies

    def named(found):
        return any(e.kind == "straggler" and e.entity.job == job_id for _, e in found)

    found = await collect_anomalies(bootstrap, named, 90, group=f"reader-{app_id}")
    mine = [e for _, e in found if e.kind == "straggler" and e.entity.job == job_id]
    assert mine, f"no straggler event for {job_id}; worker log:\n" + \
        (tmp_path / f"{app_id}.log").read_text()[-3000:]
    assert {e.entity.rank for e in mine} == {str(slow_rank)}, [e.summary for e in mine]
    opened = mine[0]
    assert opened.lifecycle == ev.LIFECYCLE_OPEN and opened.entity.cluster == "it"
    slow_ident = reports[slow_rank]["identity"]
    assert opened.entity.node == slow_ident["node"] and opened.entity.device == f"gpu{slow_ident['local_gpu']}"
    delay = {e.name: e for e in opened.evidence}["detection_delay_steps"]
    first, named_at = map(int, re.search(r"first flagged step (\d+), named at step (\d+)", delay.detail).groups())
    assert slow_from <= first <= slow_from + 2 and named_at <= slow_from + 5, delay.detail
    starts = {s[0]: s[1] for s in reports[0]["steps"]}
    assert opened.onset_unix_ns >= starts[slow_from] - 500_000_000
    print(f"straggler named: {opened.summary} (first flagged step {first}, named at step {named_at})")
    return opened


@pytest.mark.kafka
async def test_mpi_job_with_a_slowed_rank_is_named_a_straggler(kafka_bootstrap, tmp_path, unused_tcp_port):
    """4 MPI ranks, real Allreduce every step, rank 2 slowed from step 10; SDK -> gateway ->
    Kafka -> `fabricwatch worker` -> a straggler event naming exactly rank 2 of this job."""
    if not _mpi_available():
        pytest.skip(MPI_MISSING)

    steps, slow_rank, slow_from = 20, 2, 10
    tag = uuid.uuid4().hex[:8]
    app_id, job_id = f"fw-rank-{tag}", f"dp-{tag}"
    out = tmp_path / "reports"
    out.mkdir()
    worker = start_worker_in(tmp_path, kafka_bootstrap, app_id)
    job = None
    try:
        async with running_gateway(kafka_bootstrap, unused_tcp_port) as listen:
            env = {**os.environ, "FABRICWATCH_GATEWAY": listen, "FABRICWATCH_JOB_ID": job_id,
                   "OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1",
                   "OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
            # The 4 ranks share one core: waiting ranks poll inside Allreduce, and with
            # mpi_yield_when_idle they yield to the computing rank on that core, so every rank's
            # busy time is fair and repeatable; the other core stays with broker, worker, gateway.
            cpus = sorted(os.sched_getaffinity(0))
            pin = ["taskset", "-c", str(cpus[-1])] if len(cpus) > 1 and shutil.which("taskset") else []
            cmd = [*pin, "mpirun", "-np", "4", "--oversubscribe", "--bind-to", "none",
                   "--mca", "mpi_yield_when_idle", "1", "--mca", "btl_vader_single_copy_mechanism", "none",
                   "-x", "FABRICWATCH_GATEWAY", "-x", "FABRICWATCH_JOB_ID",
                   sys.executable, str(TESTS / "dp_job.py"), "--steps", str(steps), "--slow-rank", str(slow_rank),
                   "--slow-from", str(slow_from), "--slow-factor", "6", "--micro", "24", "--out", str(out)]
            log_path = tmp_path / "mpirun.log"
            with open(log_path, "wb") as log:
                t0 = time.monotonic()
                job = await asyncio.create_subprocess_exec(*cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
                rc = await asyncio.wait_for(job.wait(), 240)
            print(f"mpirun job: {time.monotonic() - t0:.1f} s")
            assert rc == 0, log_path.read_text()[-4000:]
            reports = [json.loads((out / f"rank{r}.json").read_text()) for r in range(4)]
            print_busy_ratios(reports, steps, step_col=3, busy_col=4)
            for r, rep in enumerate(reports):
                assert rep["identity"]["rank"] == r and rep["identity"]["job_id"] == job_id
                assert rep["identity"]["launcher"] == "openmpi"
                assert rep["stats"]["sent"] == steps, rep["stats"]       # all acked, the last ones by the exit flush
                assert rep["stats"]["dropped_buffer_full"] == 0 and rep["stats"]["buffered"] == 0
            await assert_straggler_named(kafka_bootstrap, tmp_path, app_id, job_id, reports, slow_rank, slow_from)
    finally:
        if job is not None and job.returncode is None:
            job.kill()
            await job.wait()
        worker.terminate()
        worker.wait(30)


# -- progress heartbeat (hang localisation) -----------------------------------------------------
def test_heartbeat_carries_sequence_numbers_while_a_step_is_stuck_inside_its_collectives():
    """No step completes (the rank sits inside its collectives), yet heartbeats go out, validated."""
    with fake_gateway() as (gw, target):
        r = RankReporter(IDENT, target, flush_interval_s=0.05, heartbeat_interval_s=0.2, exit_flush_s=1.0)
        try:
            for _ in range(3):
                with r.step():
                    with r.collective():            # explicit per-call counters, inside the block
                        pass
            r.step_begin()
            r.collectives_begin()                   # ... and stuck here
            deadline = time.monotonic() + 10
            while time.monotonic() < deadline and len({p.time_unix_ns for s in gw.snapshots
                                                       for p in s.rank_progress}) < 3:
                time.sleep(0.05)
            beats = [p for s in gw.snapshots for p in s.rank_progress]
            assert len(beats) >= 3, r.stats
            last = beats[-1]
            # 3 steps of one counted call each entered and completed, then the 4th step's block entered only
            assert (last.job_id, last.rank, last.node, last.local_gpu) == (IDENT.job_id, IDENT.rank, IDENT.node,
                                                                          IDENT.local_gpu)
            assert (last.collectives_entered, last.collectives_completed) == (4, 3)
            assert last.last_completed_unix_ns <= last.last_entered_unix_ns <= last.time_unix_ns
            assert len(gw.steps) == 3 and r.stats["heartbeats"] >= 3 and r.stats["rejected"] == 0
            r.step_abort()                          # an exception left the collectives: not inside any more
            assert r.progress()[6:8] == (4, 4)
        finally:
            r.close(1.0)


def test_progress_counters_overhead_and_heartbeat_cpu():
    """The numbers docs/rank-sdk.md states: ns per counted collective call, heartbeat CPU per second."""
    r = RankReporter(IDENT, f"127.0.0.1:{closed_port()}", flush_interval_s=0.01, backoff_max_s=0.02,
                     exit_flush_s=0.1, heartbeat_interval_s=0.01)
    try:
        n = 20000
        per_call = []
        for _ in range(7):
            t0 = time.perf_counter()
            for _ in range(n):
                r.collective_begin()
                r.collective_end()
            per_call.append((time.perf_counter() - t0) / n)
        ns = sorted(per_call)[3] * 1e9
        # heartbeat building alone (what the sender thread adds every HEARTBEAT_INTERVAL_S)
        t0 = time.process_time()
        for _ in range(n):
            r._heartbeat_at = -1e9
            r._beat()
        beat_us = (time.process_time() - t0) / n * 1e6
        print(f"progress counters: {ns:.0f} ns per collective (begin+end); heartbeat build {beat_us:.2f} µs "
              f"-> {beat_us / rank_reporter.HEARTBEAT_INTERVAL_S:.3f} µs CPU per second at the default period, "
              "plus one unary Send per period")
        assert ns < 5000 and r.stats["collectives_entered"] == 7 * n
    finally:
        r.close(0.1)


@pytest.mark.kafka
async def test_mpi_job_with_a_rank_stuck_before_its_allreduce_is_named_a_hang_within_60_s(
        kafka_bootstrap, tmp_path, unused_tcp_port):
    """4 MPI ranks, real Allreduce every step; rank 1 sleeps forever before the all-reduce of
    step 6 (its peers wait inside it). SDK heartbeats -> gateway -> Kafka -> `fabricwatch worker`
    -> a `hang` event naming exactly rank 1, its node and GPU, within 60 s of the last completion."""
    if not _mpi_available():
        pytest.skip(MPI_MISSING)

    hang_rank, hang_at = 1, 6
    tag = uuid.uuid4().hex[:8]
    app_id, job_id = f"fw-hang-{tag}", f"hang-{tag}"
    worker = start_worker_in(tmp_path, kafka_bootstrap, app_id)
    job = None
    try:
        async with running_gateway(kafka_bootstrap, unused_tcp_port) as listen:
            env = {**os.environ, "FABRICWATCH_GATEWAY": listen, "FABRICWATCH_JOB_ID": job_id,
                   "OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1",
                   "OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
            cmd = ["mpirun", "-np", "4", "--oversubscribe", "--bind-to", "none",
                   "--mca", "mpi_yield_when_idle", "1", "--mca", "btl_vader_single_copy_mechanism", "none",
                   "-x", "FABRICWATCH_GATEWAY", "-x", "FABRICWATCH_JOB_ID",
                   sys.executable, str(TESTS / "dp_job.py"), "--steps", "1000", "--slow-rank", "-1",
                   "--micro", "2", "--hang-rank", str(hang_rank), "--hang-at", str(hang_at)]
            log_path = tmp_path / "mpirun.log"
            with open(log_path, "wb") as log:
                job = await asyncio.create_subprocess_exec(*cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
                from test_pipeline_kafka import collect_anomalies

                def named(found):
                    return any(e.kind == "hang" and e.entity.job == job_id for _, e in found)

                found = await collect_anomalies(kafka_bootstrap, named, 150, group=f"reader-{app_id}")
                received_ns = time.time_ns()
            mine = [e for _, e in found if e.kind == "hang" and e.entity.job == job_id]
            assert mine, "no hang event; mpirun log:\n" + log_path.read_text()[-2000:] + "\nworker log:\n" + \
                (tmp_path / f"{app_id}.log").read_text()[-3000:]
            opened = mine[0]
            assert opened.lifecycle == ev.LIFECYCLE_OPEN and opened.entity.rank == str(hang_rank), opened.summary
            assert opened.entity.node and opened.entity.device.startswith("gpu")
            assert "hanging before the all-reduce" in log_path.read_text()
            evidence = {e.name: e for e in opened.evidence}
            assert evidence["culprit_rule"].detail == "never_entered"
            assert evidence["ranks_waiting"].value == 3
            delay_s = (received_ns - opened.onset_unix_ns) / 1e9
            print(f"hang named {delay_s:.1f} s after the last completion: {opened.summary}")
            assert delay_s <= 60, delay_s
    finally:
        if job is not None and job.returncode is None:
            job.terminate()
            try:
                await asyncio.wait_for(job.wait(), 15)
            except asyncio.TimeoutError:
                job.kill()
                await job.wait()
        worker.terminate()
        worker.wait(30)
