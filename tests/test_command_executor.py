"""The command/webhook restart executor: real subprocesses and a real local HTTP receiver.

The command tests run a small Python script that records its argv and environment to a
file; the webhook tests post to an aiohttp server on 127.0.0.1 that checks the HMAC
signature with the shared secret, as a receiver would.
"""
from __future__ import annotations

import email.utils
import hashlib
import hmac
import json
import os
import sys
import time
from pathlib import Path

import pytest
import pytest_asyncio
from aiohttp import web

from fabricwatch.actions.base import (
    ALREADY,
    DONE,
    DRAIN_NODE,
    EXCLUDE_AND_RESTART,
    FAILED,
    REQUEUE_JOBS,
    ActionRequest,
)
from fabricwatch.actions.executors.command import SIGNATURE_HEADER, CommandExecutor
from fabricwatch.models.findings import EntityRef

RECORDER = """\
import json, os, sys
with open({out!r}, "a") as fh:
    fh.write(json.dumps({{"argv": sys.argv[1:], "env": dict(os.environ)}}) + "\\n")
sys.exit(int(os.environ.get("RECORDER_EXIT", "0")))
"""


#: A placement check that confirms every job (the executor refuses all without one).
CONFIRM_ALL = [sys.executable, "-c", "import sys; sys.exit(0)", "{job}", "{node}"]


def placed(*args, **kwargs) -> CommandExecutor:
    """A `CommandExecutor` whose placement check confirms every job on every node."""
    kwargs.setdefault("verify_argv", CONFIRM_ALL)
    return CommandExecutor(*args, **kwargs)


def request(action=EXCLUDE_AND_RESTART, job="4242", node="gpu-node-7", rank="13", reason="pfc storm source",
            jobs=(), key="exclude_and_restart:c1/job=4242") -> ActionRequest:
    return ActionRequest(action=action, target=EntityRef(cluster="c1", node=node, rank=rank, job=job),
                         reason=reason, idempotency_key=key, anomaly_id="a-1", anomaly_dedup_key="pfc_storm:c1/x",
                         jobs=tuple(jobs))


@pytest.fixture
def recorder(tmp_path):
    out = tmp_path / "calls.jsonl"
    script = tmp_path / "restart.py"
    script.write_text(RECORDER.format(out=str(out)))

    def calls() -> list[dict]:
        return [json.loads(line) for line in out.read_text().splitlines()] if out.exists() else []

    return [sys.executable, str(script)], calls


# ----------------------------------------------------------------------------- command
async def test_placeholders_are_substituted_per_argument_with_an_allow_listed_env(recorder, monkeypatch):
    prog, calls = recorder
    monkeypatch.setenv("FABRICWATCH_TEST_SECRET", "do-not-leak")
    ex = placed([*prog, "--job={job}", "--exclude", "{node}", "--rank", "{rank}", "--reason", "{reason}",
                          "--key={idempotency_key}", "{{literal}}"])
    result = await ex.execute(request())

    assert result.status == DONE, result.detail
    assert result.affected == ("4242",)
    [call] = calls()
    assert call["argv"] == ["--job=4242", "--exclude", "gpu-node-7", "--rank", "13", "--reason", "pfc storm source",
                            "--key=exclude_and_restart:c1/job=4242", "{literal}"]
    assert "FABRICWATCH_TEST_SECRET" not in call["env"]
    assert call["env"]["FABRICWATCH_IDEMPOTENCY_KEY"] == "exclude_and_restart:c1/job=4242"
    assert call["env"]["FABRICWATCH_ACTION"] == EXCLUDE_AND_RESTART
    assert set(call["env"]) <= {"PATH", "HOME", "LANG", "LC_ALL", "TZ", "FABRICWATCH_ACTION",
                                "FABRICWATCH_IDEMPOTENCY_KEY", "LC_CTYPE"}   # LC_CTYPE: Python may set it
    assert "exit 0" in result.detail and "--exclude gpu-node-7" in result.detail


async def test_shell_syntax_in_the_reason_stays_one_argument_and_runs_nothing(recorder, tmp_path):
    prog, calls = recorder
    pwned = tmp_path / "pwned"
    reason = f"storm; rm -rf / && $(touch {pwned}) `touch {pwned}` | tee {pwned}"
    result = await placed([*prog, "{reason}"]).execute(request(reason=reason))
    assert result.status == DONE
    assert calls()[0]["argv"] == [reason]
    assert not pwned.exists()


@pytest.mark.parametrize("field,value", [("job", "1; rm -rf /"), ("job", "--help"), ("node", "n1 n2"),
                                         ("node", "gpu\nnode"), ("rank", "$(id)"), ("job", "")])
async def test_unsafe_or_missing_identifiers_are_refused_before_anything_runs(recorder, field, value):
    prog, calls = recorder
    ex = placed([*prog, "--job", "{job}", "--node={node}", "{rank}"])
    result = await ex.execute(request(**{field: value}))
    assert result.status == FAILED
    assert (repr(value) in result.detail) or ("names none" in result.detail) or ("has none" in result.detail) \
        or ("names no job" in result.detail)
    assert calls() == []


async def test_a_value_cannot_turn_an_argument_into_an_option(recorder):
    prog, calls = recorder
    refused = await placed([*prog, "{reason}"]).execute(request(reason="-rf /"))
    assert refused.status == FAILED and "option" in refused.detail
    allowed = await placed([*prog, "--reason={reason}"]).execute(request(reason="-rf /"))
    assert allowed.status == DONE
    assert calls()[0]["argv"] == ["--reason=-rf /"]


@pytest.mark.parametrize("argv,message", [
    (["/bin/true", "{jobid}"], "unknown placeholder {jobid}"),
    (["/bin/true", "{job.__class__}"], "unknown placeholder"),
    (["/bin/true", "{job[0]}"], "unknown placeholder"),
    (["/bin/true", "{job:>20}"], "no format spec or conversion"),
    (["/bin/true", "{job!r}"], "no format spec or conversion"),
    (["/bin/true", "{job"], "write a literal brace"),
    (["/bin/true", "}"], "write a literal brace"),
    (["{node}", "x"], "argv[0] is the program"),
    (["", "x"], "program) is empty"),
    ("/bin/restart {job}", "no shell command line"),
    ([], "non-empty list"),
    (["/bin/true", 7], "must be a string"),
])
def test_bad_templates_are_refused_at_construction(argv, message):
    with pytest.raises(ValueError) as err:
        CommandExecutor(argv)
    assert message in str(err.value)


def test_bad_settings_are_refused_at_construction():
    with pytest.raises(ValueError, match="exactly one"):
        CommandExecutor(["/bin/true"], webhook_url="https://example.invalid/x", webhook_secret="s")
    with pytest.raises(ValueError, match="exactly one"):
        CommandExecutor()
    with pytest.raises(ValueError, match="subset"):
        CommandExecutor(["/bin/true"], handles=[DRAIN_NODE])
    with pytest.raises(ValueError, match="plain http only to a loopback"):
        CommandExecutor(webhook_url="http://10.0.0.5/restart", webhook_secret="s")
    with pytest.raises(ValueError, match="webhook_secret is required"):
        CommandExecutor(webhook_url="https://launcher.example/restart")
    with pytest.raises(ValueError, match="http"):
        CommandExecutor(webhook_url="ftp://launcher.example/restart", webhook_secret="s")


async def test_exit_codes_failed_and_already(recorder, monkeypatch):
    prog, calls = recorder
    monkeypatch.setenv("RECORDER_EXIT", "3")
    ex = placed([*prog, "{job}"], env_allow=("PATH", "RECORDER_EXIT"))
    failed = await ex.execute(request())
    assert failed.status == FAILED and "exit 3" in failed.detail and failed.affected == ()
    already = await placed([*prog, "{job}"], env_allow=("RECORDER_EXIT",), already_exit_code=3).execute(request())
    assert already.status == ALREADY
    assert len(calls()) == 2


@pytest.mark.slow
async def test_a_hanging_command_and_its_children_are_killed_at_the_timeout(tmp_path):
    pidfile = tmp_path / "child.pid"
    script = tmp_path / "hang.py"
    script.write_text(
        "import subprocess, sys, time\n"
        f"child = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)'])\n"
        f"open({str(pidfile)!r}, 'w').write(str(child.pid))\n"
        "print('started', flush=True)\n"
        "time.sleep(60)\n")
    ex = placed([sys.executable, str(script), "{job}"], timeout_s=2, kill_grace_s=0.5)
    started = time.monotonic()
    result = await ex.execute(request())
    assert time.monotonic() - started < 10
    assert result.status == FAILED
    assert "timed out after 2 s" in result.detail and "started" in result.detail
    child = int(pidfile.read_text())
    for _ in range(50):   # the child was SIGKILLed with its group; wait for init to reap it
        try:
            os.kill(child, 0)
        except ProcessLookupError:
            break
        if Path(f"/proc/{child}/stat").exists() and Path(f"/proc/{child}/stat").read_text().split()[2] == "Z":
            break
        time.sleep(0.1)
    else:
        pytest.fail(f"child {child} survived the timeout")


async def test_output_is_captured_and_capped(tmp_path):
    script = tmp_path / "loud.py"
    script.write_text("import sys\nsys.stdout.write('x' * 100_000)\nsys.stderr.write('ERR-AT-END')\n")
    result = await placed([sys.executable, str(script), "{job}"], output_limit_bytes=1000).execute(request())
    assert result.status == DONE
    assert "x" * 1000 in result.detail and "x" * 1001 not in result.detail
    assert "[... 99010 more bytes of output not kept]" in result.detail


async def test_requeue_runs_once_per_job_and_unhandled_actions_fail(recorder):
    prog, calls = recorder
    ex = placed([*prog, "--requeue", "{job}", "--avoid", "{node}"], handles=[REQUEUE_JOBS, EXCLUDE_AND_RESTART])
    result = await ex.execute(request(REQUEUE_JOBS, job="", jobs=["101", "102_3"]))
    assert result.status == DONE
    assert result.affected == ("101", "102_3")
    assert [c["argv"] for c in calls()] == [["--requeue", "101", "--avoid", "gpu-node-7"],
                                            ["--requeue", "102_3", "--avoid", "gpu-node-7"]]
    assert (await placed([*prog]).execute(request(REQUEUE_JOBS))).status == FAILED
    assert len(calls()) == 2


async def test_a_missing_program_is_failed_not_raised(tmp_path):
    result = await placed([str(tmp_path / "no-such-launcher"), "{job}"]).execute(request())
    assert result.status == FAILED and "cannot start" in result.detail


# ----------------------------------------------------------------------------- webhook
SECRET = "whsec-test-0123"


class Receiver:
    """A launcher's webhook endpoint: verifies the HMAC, answers from a script of statuses."""

    def __init__(self, statuses=(200,), answer: dict | None = None, error_headers=None):
        self.statuses = list(statuses)
        self.answer = answer or {"status": "accepted"}
        self.error_headers = error_headers or (lambda: {})
        self.received_at: list[float] = []
        self.received: list[tuple[bytes, dict]] = []
        self.url = ""

    async def handle(self, request: web.Request) -> web.Response:
        body = await request.read()
        self.received.append((body, dict(request.headers)))
        self.received_at.append(time.monotonic())
        expected = "sha256=" + hmac.new(SECRET.encode(), body, hashlib.sha256).hexdigest()
        if not hmac.compare_digest(request.headers.get(SIGNATURE_HEADER, ""), expected):
            return web.json_response({"error": "bad signature"}, status=401)
        status = self.statuses.pop(0) if len(self.statuses) > 1 else self.statuses[0]
        if status >= 300:
            return web.json_response({"error": f"status {status}"}, status=status, headers=self.error_headers())
        return web.json_response(self.answer, status=status)


@pytest_asyncio.fixture(loop_scope="function")
async def serve():
    runners = []

    async def start(receiver: Receiver) -> Receiver:
        app = web.Application()
        app.router.add_post("/restart", receiver.handle)
        runner = web.AppRunner(app)
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", 0).start()
        runners.append(runner)
        receiver.url = f"http://127.0.0.1:{runner.addresses[0][1]}/restart"
        return receiver

    yield start
    for runner in runners:
        await runner.cleanup()


async def test_webhook_is_signed_and_carries_the_idempotency_key(serve):
    receiver = await serve(Receiver())
    ex = placed(webhook_url=receiver.url, webhook_secret=SECRET)
    try:
        result = await ex.execute(request())
    finally:
        await ex.close()
    assert result.status == DONE, result.detail
    [(body, headers)] = receiver.received
    assert headers["Idempotency-Key"] == "exclude_and_restart:c1/job=4242"
    assert headers["Content-Type"] == "application/json"
    assert json.loads(body) == {"action": EXCLUDE_AND_RESTART, "cluster": "c1", "node": "gpu-node-7", "rank": "13",
                                "job": "4242", "jobs": ["4242"], "reason": "pfc storm source",
                                "idempotency_key": "exclude_and_restart:c1/job=4242", "anomaly_id": "a-1",
                                "anomaly_dedup_key": "pfc_storm:c1/x"}
    assert "HTTP 200" in result.detail


async def test_webhook_retries_503_with_the_same_signed_body(serve):
    receiver = await serve(Receiver(statuses=[503, 503, 200]))
    ex = placed(webhook_url=receiver.url, webhook_secret=SECRET, webhook_backoff_s=0.05)
    try:
        result = await ex.execute(request())
    finally:
        await ex.close()
    assert result.status == DONE and "attempt 3" in result.detail
    assert len(receiver.received) == 3
    assert len({(body, h[SIGNATURE_HEADER], h["Idempotency-Key"]) for body, h in receiver.received}) == 1


@pytest.mark.slow
async def test_webhook_honours_a_retry_after_given_as_an_http_date(serve):
    """RFC 9110: Retry-After is delta-seconds or an HTTP-date; a launcher that says "after
    <date>" is not retried before it (our own backoff here would be 10 ms)."""
    def two_seconds_ahead():
        return {"Retry-After": email.utils.formatdate(time.time() + 2.0, usegmt=True)}

    receiver = await serve(Receiver(statuses=[503, 200], error_headers=two_seconds_ahead))
    ex = placed(webhook_url=receiver.url, webhook_secret=SECRET, webhook_backoff_s=0.01)
    try:
        result = await ex.execute(request())
    finally:
        await ex.close()
    assert result.status == DONE and "attempt 2" in result.detail
    first, second = receiver.received_at
    assert second - first >= 1.0                  # the date has a 1 s resolution: 1 to 2 s


async def test_webhook_gives_up_after_the_attempts_and_does_not_retry_4xx(serve):
    down = await serve(Receiver(statuses=[503]))
    ex = placed(webhook_url=down.url, webhook_secret=SECRET, webhook_attempts=2, webhook_backoff_s=0.01)
    failed = await ex.execute(request())
    await ex.close()
    assert failed.status == FAILED and "HTTP 503" in failed.detail and "gave up after 2" in failed.detail
    assert len(down.received) == 2

    picky = await serve(Receiver(statuses=[400]))
    ex = placed(webhook_url=picky.url, webhook_secret=SECRET, webhook_backoff_s=0.01)
    refused = await ex.execute(request())
    await ex.close()
    assert refused.status == FAILED and "HTTP 400" in refused.detail and "not retried" in refused.detail
    assert len(picky.received) == 1


async def test_a_wrong_secret_is_rejected_by_the_receiver(serve):
    receiver = await serve(Receiver())
    ex = placed(webhook_url=receiver.url, webhook_secret="not-the-secret", webhook_backoff_s=0.01)
    result = await ex.execute(request())
    await ex.close()
    assert result.status == FAILED and "HTTP 401" in result.detail and "bad signature" in result.detail


async def test_webhook_already_answer_and_unreachable_receiver(serve):
    receiver = await serve(Receiver(answer={"status": "already"}))
    ex = placed(webhook_url=receiver.url, webhook_secret=SECRET)
    assert (await ex.execute(request())).status == ALREADY
    await ex.close()

    from helpers import free_port

    ex = placed(webhook_url=f"http://127.0.0.1:{free_port()}/restart", webhook_secret=SECRET,
                         webhook_attempts=2, webhook_backoff_s=0.01)
    result = await ex.execute(request())
    await ex.close()
    assert result.status == FAILED and "ClientConnectorError" in result.detail


# ----------------------------------------------------------------------------- #13: the placement check
PLACEMENT = """\
import sys
# the launcher's view: job 4242 runs on gpu-node-7, job 101 on gpu-node-7, nothing else anywhere
placed = {("4242", "gpu-node-7"), ("101", "gpu-node-7")}
sys.exit(0 if (sys.argv[1], sys.argv[2]) in placed else 3)
"""


@pytest.fixture
def placement(tmp_path):
    script = tmp_path / "placement.py"
    script.write_text(PLACEMENT)
    return [sys.executable, str(script), "{job}", "{node}"]


async def test_a_job_the_placement_check_does_not_confirm_is_never_restarted(recorder, placement):
    """#13: forged rank steps got five jobs that never ran on the sender's node restarted."""
    prog, calls = recorder
    ex = CommandExecutor([*prog, "--job={job}", "--exclude={node}"], verify_argv=placement,
                         handles=[EXCLUDE_AND_RESTART, REQUEUE_JOBS])
    forged = await ex.execute(request(job="5555"))
    assert forged.status == FAILED and "does not confirm job 5555 on gpu-node-7" in forged.detail
    assert "exit 3" in forged.detail and calls() == []
    mixed = await ex.execute(request(REQUEUE_JOBS, job="", jobs=["101", "5555"]))
    assert mixed.status == FAILED and mixed.affected == ("101",)              # the confirmed one moved
    assert [c["argv"] for c in calls()] == [["--job=101", "--exclude=gpu-node-7"]]
    real = await ex.execute(request())
    assert real.status == DONE and real.affected == ("4242",)


async def test_without_a_placement_check_nothing_is_restarted(recorder, serve):
    prog, calls = recorder
    result = await CommandExecutor([*prog, "{job}"]).execute(request())
    assert result.status == FAILED and "no placement check configured" in result.detail and calls() == []
    receiver = await serve(Receiver())
    hook = CommandExecutor(webhook_url=receiver.url, webhook_secret=SECRET)
    try:
        assert (await hook.execute(request())).status == FAILED and receiver.received == []
    finally:
        await hook.close()
    with pytest.raises(ValueError, match="must name both"):
        CommandExecutor([*prog, "{job}"], verify_argv=[sys.executable, "check.py", "{job}"])


async def test_the_webhook_posts_only_confirmed_jobs(serve, placement):
    receiver = await serve(Receiver())
    ex = CommandExecutor(webhook_url=receiver.url, webhook_secret=SECRET, verify_argv=placement,
                         handles=[REQUEUE_JOBS])
    try:
        result = await ex.execute(request(REQUEUE_JOBS, job="", jobs=["5555", "101"]))
    finally:
        await ex.close()
    assert result.status == FAILED and "5555" in result.detail
    [(body, _)] = receiver.received
    assert json.loads(body)["jobs"] == ["101"]


def test_a_policy_executing_restarts_through_a_command_needs_the_placement_check(monkeypatch):
    from fabricwatch.actions.policy import PolicyError, parse_policy
    from fabricwatch.actions.wiring import build

    text = "mode: execute\nexecute: [exclude_and_restart]\nexecutors: {restart: {argv: [/bin/launch, '{job}']}}"
    with pytest.raises(PolicyError, match=r"executors\.restart\.verify_argv: required"):
        build(parse_policy(text))
    ok = build(parse_policy(text.replace("}}", ", verify_argv: [/bin/placed, '{job}', '{node}']}}")))
    assert ok.executor_domains() == {"exclude_and_restart": "command:/bin/launch"}
    assert build(parse_policy(text.replace("mode: execute", "mode: shadow")))   # shadow runs nothing
