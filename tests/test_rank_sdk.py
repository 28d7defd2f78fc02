"""The training-rank SDK's reporter (`fabricwatch.rank`): the busy/wait split of a step, the
bounded buffer, failure behaviour, hot-path overhead, shipping to a gateway, the PyTorch hooks
(with stand-ins: torch is not installed in CI) and the progress heartbeat.
"""
from __future__ import annotations

import importlib.util
import logging
import os
import subprocess
import sys
import textwrap
import time

import pytest

from helpers import IDENT, closed_port, fake_gateway

from fabricwatch.protos.v1 import telemetry_pb2 as pb
from fabricwatch.rank import RankReporter, StepRecord, instrument_torch
from fabricwatch.rank import client as rank_client
from fabricwatch.rank import reporter as rank_reporter


# -- helpers --------------------------------------------------------------------------------


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


