"""Job restart without a node, through the user's launcher: a command or a signed webhook.

Why this exists. torchrun (PyTorch elastic) has no API to exclude a node from inside a job:
a failed worker restarts *all* workers, and a bad node simply rejoins the rendezvous
(ecosystem 6.7). The node must be kept out by whatever launched the job: Slurm (the
``slurm`` executor), Kubernetes (``kubernetes``), or, for torchrun under a custom scheduler,
the user's own tooling. `CommandExecutor` hands EXCLUDE_AND_RESTART (and optionally
REQUEUE_JOBS) to that tooling in one of two ways:

* **command**: an argv template, a list of strings run with ``exec`` (never a shell), with
  the placeholders ``{job}``, ``{node}``, ``{rank}``, ``{reason}`` and ``{idempotency_key}``
  substituted inside each argument. Each argument stays exactly one argv element whatever
  it contains. Identifiers (job, node, rank, key) must look like identifiers, and no
  substituted value may turn an argument into an option (a leading ``-``), so data from an
  anomaly can never choose the program or its flags. The program (``argv[0]``) is fixed.
  It runs with a timeout (SIGTERM, then SIGKILL to its whole process group), an
  environment built only from an allow-list, and its output captured and capped. Exit 0 is
  DONE; ``already_exit_code`` (if set) is ALREADY; anything else is FAILED.
* **webhook**: a JSON body POSTed to a URL (https, or http to loopback) with
  ``X-Fabricwatch-Signature-256: sha256=<hex HMAC-SHA256 of the body>`` and the request's
  idempotency key as ``Idempotency-Key``, so the receiver can authenticate the call and
  ignore a repeat. 2xx is DONE (ALREADY if the JSON answer says ``"status": "already"``);
  5xx, 429 and connection errors are retried with backoff; other 4xx fail at once.

When the template names ``{job}`` and the request carries several jobs (REQUEUE_JOBS on a
node), the command runs once per job; the webhook always sends one body with all of them.

**Placement check.** The job ids and the node come from an anomaly, i.e. from telemetry a
collector chose, and this executor has no scheduler of its own to ask. So every job is
first confirmed by ``verify_argv``, a second command template naming ``{job}`` and
``{node}`` (e.g. a script asking the launcher), run the same way (no shell, allow-listed
environment, timeout): exit 0 means "this job runs on this node now". A job it does not
confirm is refused (FAILED, reported) and never restarted; without ``verify_argv`` nothing
is restarted at all. Jobs confirmed in a request are carried out, the others listed.
"""
from __future__ import annotations

import asyncio
import contextlib
import hashlib
import hmac
import json
import os
import re
import signal
import string
from collections.abc import Sequence
from urllib.parse import urlsplit

from fabricwatch.actions.base import (
    ALREADY,
    DONE,
    EXCLUDE_AND_RESTART,
    FAILED,
    REQUEUE_JOBS,
    ActionRequest,
    ExecutionResult,
)
from fabricwatch.actions.alerts.http import JsonPoster, RetryPolicy
from fabricwatch.actions.escape import untrusted
from fabricwatch.netaddr import is_loopback

PLACEHOLDERS = frozenset({"job", "node", "rank", "reason", "idempotency_key"})
#: Placeholders that carry identifiers: they must match `_IDENTIFIER`.
_IDENTIFIER_FIELDS = ("job", "node", "rank", "idempotency_key")
# Scheduler job ids (123, 123_4, 123.batch), host names, ranks, keys (sha256 hex, UUIDs,
# "drain_node:c1/node-1"): no whitespace, no shell or control characters, no leading '-'.
_IDENTIFIER = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._:@/+=,-]{0,255}$")
_CONTROL = re.compile(r"[\x00-\x1f\x7f]")
REASON_MAX_CHARS = 512
HANDLED = frozenset({EXCLUDE_AND_RESTART, REQUEUE_JOBS})
DEFAULT_ENV_ALLOW = ("PATH", "HOME", "LANG", "LC_ALL", "TZ")
SIGNATURE_HEADER = "X-Fabricwatch-Signature-256"
# Webhook retries: the longest pause between attempts (backoff; a Retry-After may ask for
# more, within the attempts' time), and the shortest first one.
MAX_RETRY_WAIT_S = 60.0
MIN_BACKOFF_S = 0.001


def template_fields(argv: Sequence[str]) -> frozenset[str]:
    """The placeholders an argv template uses; ValueError for anything else.

    >>> sorted(template_fields(["/bin/restart", "--job={job}", "--exclude", "{node}", "{{literal}}"]))
    ['job', 'node']
    >>> template_fields(["/bin/restart", "{job.__class__}"])
    Traceback (most recent call last):
    ValueError: argv[1] '{job.__class__}': unknown placeholder {job.__class__}; allowed: {idempotency_key}, ...
    """
    if isinstance(argv, str) or not argv:
        raise ValueError("argv must be a non-empty list of strings (no shell command line)")
    used: set[str] = set()
    for i, arg in enumerate(argv):
        if not isinstance(arg, str):
            raise ValueError(f"argv[{i}] must be a string, got {type(arg).__name__}")
        try:
            parsed = list(string.Formatter().parse(arg))
        except ValueError as exc:
            raise ValueError(f"argv[{i}] {arg!r}: {exc} (write a literal brace as {{{{ or }}}})") from exc
        for _literal, name, spec, conversion in parsed:
            if name is None:
                continue
            if name not in PLACEHOLDERS:
                allowed = ", ".join(f"{{{p}}}" for p in sorted(PLACEHOLDERS))
                raise ValueError(f"argv[{i}] {arg!r}: unknown placeholder {{{name}}}; allowed: {allowed}")
            if spec or conversion:
                raise ValueError(f"argv[{i}] {arg!r}: placeholders take no format spec or conversion")
            if i == 0:
                raise ValueError("argv[0] is the program and must be fixed: no placeholders in it")
            used.add(name)
    if not argv[0]:
        raise ValueError("argv[0] (the program) is empty")
    return frozenset(used)



class CommandExecutor:
    """Restart a job without a node through a command or a webhook (see the module doc).

    Parameters
    ----------
    argv
        The command template (give this or ``webhook_url``).
    webhook_url, webhook_secret
        The webhook (https, or http to loopback) and the HMAC-SHA256 key.
    handles
        Action kinds to take: EXCLUDE_AND_RESTART and/or REQUEUE_JOBS.
    timeout_s
        Per command run, or per webhook attempt.
    env_allow
        Names of environment variables passed through to the command; it also gets
        ``FABRICWATCH_ACTION`` and ``FABRICWATCH_IDEMPOTENCY_KEY``.
    output_limit_bytes
        Command output kept in the result (the rest is read and counted, not kept).
    already_exit_code
        An exit status of the command that means "already done"; None: none does.
    webhook_attempts, webhook_backoff_s
        Tries per request and the first pause between them (doubled each time, up to
        `MAX_RETRY_WAIT_S`; half of each pause is jitter, as for the alert sinks).
    """

    def __init__(self, argv: Sequence[str] | None = None, *, webhook_url: str = "", webhook_secret: str = "",
                 handles: Sequence[str] = (EXCLUDE_AND_RESTART,), timeout_s: float = 60.0,
                 env_allow: Sequence[str] = DEFAULT_ENV_ALLOW, output_limit_bytes: int = 16_384,
                 already_exit_code: int | None = None, kill_grace_s: float = 2.0, webhook_attempts: int = 3,
                 webhook_backoff_s: float = 0.5, cwd: str | None = None,
                 verify_argv: Sequence[str] | None = None) -> None:
        if (argv is None) == (not webhook_url):
            raise ValueError("give exactly one of argv (a command) or webhook_url")
        unknown = set(handles) - HANDLED
        if unknown or not handles:
            raise ValueError(f"handles must be a non-empty subset of {sorted(HANDLED)}, got {sorted(handles)}")
        if timeout_s <= 0 or kill_grace_s < 0:
            raise ValueError(f"timeout_s must be > 0 and kill_grace_s >= 0, got {timeout_s}, {kill_grace_s}")
        if output_limit_bytes < 0:
            raise ValueError(f"output_limit_bytes must be >= 0, got {output_limit_bytes}")
        if webhook_attempts < 1 or webhook_backoff_s < 0:
            raise ValueError(f"webhook_attempts must be >= 1 and webhook_backoff_s >= 0, "
                             f"got {webhook_attempts}, {webhook_backoff_s}")
        self._fields = template_fields(argv) if argv is not None else frozenset()
        self.argv = tuple(argv) if argv is not None else ()
        self._verify_fields = template_fields(verify_argv) if verify_argv is not None else frozenset()
        if verify_argv is not None and not {"job", "node"} <= self._verify_fields:
            raise ValueError("verify_argv must name both {job} and {node}: it confirms that the job runs on the node")
        self.verify_argv = tuple(verify_argv) if verify_argv is not None else ()
        self.webhook_url = webhook_url
        self.webhook_secret = webhook_secret
        self.handles = frozenset(handles)
        self.timeout_s = timeout_s
        self.env_allow = tuple(env_allow)
        self.output_limit_bytes = output_limit_bytes
        self.already_exit_code = already_exit_code
        self.kill_grace_s = kill_grace_s
        self.webhook_attempts = webhook_attempts
        self.webhook_backoff_s = webhook_backoff_s
        self.cwd = cwd
        if argv is not None:
            self.name = "command"
            #: What the guard rails count in: the launcher this command drives.
            self.domain = f"command:{self.argv[0]}"
        else:
            self.name = "webhook"
            parts = urlsplit(webhook_url)
            self.domain = f"webhook:{parts.hostname or webhook_url}"
            if parts.scheme not in ("http", "https") or not parts.hostname:
                raise ValueError(f"webhook_url must be an http(s) URL, got {webhook_url!r}")
            if parts.scheme == "http" and not is_loopback(parts.hostname):
                raise ValueError(f"webhook_url {webhook_url!r}: plain http only to a loopback host; use https")
            if not webhook_secret:
                raise ValueError("webhook_secret is required: the receiver must be able to verify the caller")
        self._poster: JsonPoster | None = None

    def __repr__(self) -> str:
        what = f"argv={list(self.argv)!r}" if self.argv else f"webhook_url={self.webhook_url!r}"
        return f"CommandExecutor({what}, handles={sorted(self.handles)})"

    async def close(self) -> None:
        if self._poster is not None:
            await self._poster.close()
            self._poster = None

    # -- entry point --------------------------------------------------------------------------
    async def execute(self, request: ActionRequest) -> ExecutionResult:
        if request.action not in self.handles:
            return ExecutionResult(FAILED, f"{self.name} executor does not handle {request.action!r}")
        try:
            jobs = (request.target.job,) if request.target.job else tuple(request.jobs)
            jobs, refusals = await self._confirmed(request, jobs)
            if not jobs:
                return ExecutionResult(FAILED, "\n".join(refusals))
            if self.argv:
                result = await self._run_commands(request, jobs)
            else:
                result = await self._post(request, jobs)
            if refusals:
                return ExecutionResult(FAILED, "\n".join([*refusals, result.detail]), result.affected)
            return result
        except Exception as exc:   # a bug must surface as FAILED, never crash the responder
            return ExecutionResult(FAILED, f"{self.name}: {type(exc).__name__}: {exc}")

    async def _confirmed(self, request: ActionRequest, jobs: tuple[str, ...]) -> tuple[tuple[str, ...], list[str]]:
        """(the jobs `verify_argv` confirms run on the request's node, a refusal line per other one)."""
        node = request.target.node
        if not self.verify_argv:
            return (), [f"refused: {request.action} on {node}: no placement check configured (verify_argv), "
                        "so no job can be confirmed to run there"]
        if not jobs:
            return (), [f"refused: {request.action} on {node}: the request names no job to confirm"]
        confirmed, refusals = [], []
        for job in jobs:
            try:
                argv = self.render(request, job, self.verify_argv, self._verify_fields)
            except ValueError as exc:
                refusals.append(f"refused: job {job!r}: {exc}")
                continue
            status, detail = await self._run(argv, request)
            if status == DONE:
                confirmed.append(job)
            else:
                refusals.append(f"refused: the placement check does not confirm job {job} on {node}:\n{detail}")
        return tuple(confirmed), refusals

    # -- command ------------------------------------------------------------------------------
    def render(self, request: ActionRequest, job: str, template: Sequence[str] | None = None,
               fields: frozenset[str] | None = None) -> list[str]:
        """The argv of `template` (default: the command) for one job; ValueError if a value
        is unsafe or missing."""
        template = self.argv if template is None else tuple(template)
        fields = self._fields if fields is None else fields
        values = {"job": job, "node": request.target.node, "rank": request.target.rank,
                  "idempotency_key": request.idempotency_key,
                  "reason": untrusted(request.reason, REASON_MAX_CHARS)}
        for name in _IDENTIFIER_FIELDS:
            if name not in fields:
                continue
            if not values[name]:
                raise ValueError(f"the template needs {{{name}}} but the request has none")
            if not _IDENTIFIER.match(values[name]):
                raise ValueError(f"refusing {name} {values[name]!r}: not a plain identifier "
                                 f"(letters, digits, ._:@/+=,- ; no leading '-')")
        argv = [template[0]]
        for item in template[1:]:
            arg = item.format(**values)
            if arg.startswith("-") and not item.startswith("-"):
                raise ValueError(f"refusing argument {arg!r}: a substituted value would make it an option")
            argv.append(arg)
        return argv

    async def _run_commands(self, request: ActionRequest, jobs: tuple[str, ...]) -> ExecutionResult:
        if "job" in self._fields and not jobs:
            return ExecutionResult(FAILED, f"{request.action}: the template needs {{job}} but the request names none")
        runs = jobs if "job" in self._fields else ("",)
        try:
            argvs = [self.render(request, job) for job in runs]   # all validated before any runs
        except ValueError as exc:
            return ExecutionResult(FAILED, f"{request.action}: {exc}")
        details, done, statuses = [], [], []
        for job, argv in zip(runs, argvs):
            status, detail = await self._run(argv, request)
            statuses.append(status)
            details.append(detail)
            if status != FAILED and job:
                done.append(job)
        if FAILED in statuses:
            overall = FAILED
        elif all(s == ALREADY for s in statuses):
            overall = ALREADY
        else:
            overall = DONE
        return ExecutionResult(overall, "\n".join(details), tuple(done))

    async def _run(self, argv: list[str], request: ActionRequest) -> tuple[str, str]:
        env = {k: os.environ[k] for k in self.env_allow if k in os.environ}
        env.update(FABRICWATCH_ACTION=request.action, FABRICWATCH_IDEMPOTENCY_KEY=request.idempotency_key)
        shown = " ".join(_quote(a) for a in argv)
        try:
            proc = await asyncio.create_subprocess_exec(
                *argv, stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.PIPE,
                stderr=asyncio.subprocess.STDOUT, env=env, cwd=self.cwd,
                start_new_session=True)   # its own process group: a timeout kills its children too
        except OSError as exc:
            return FAILED, f"$ {shown}\ncannot start: {exc}"
        kept = bytearray()
        dropped = 0

        async def read_all() -> None:
            nonlocal dropped
            while chunk := await proc.stdout.read(65_536):
                room = self.output_limit_bytes - len(kept)
                kept.extend(chunk[:max(room, 0)])
                dropped += max(len(chunk) - max(room, 0), 0)
            await proc.wait()

        timed_out = False
        try:
            await asyncio.wait_for(read_all(), self.timeout_s)
        except asyncio.TimeoutError:
            timed_out = True
            await self._kill(proc)
        output = kept.decode("utf-8", "replace")
        if dropped:
            output += f"\n[... {dropped} more bytes of output not kept]"
        if timed_out:
            return FAILED, f"$ {shown}\ntimed out after {self.timeout_s:g} s, killed\n{output}".rstrip()
        rc = proc.returncode
        status = DONE if rc == 0 else ALREADY if rc == self.already_exit_code else FAILED
        return status, f"$ {shown}\nexit {rc}\n{output}".rstrip()

    async def _kill(self, proc: asyncio.subprocess.Process) -> None:
        for sig, wait_s in ((signal.SIGTERM, self.kill_grace_s), (signal.SIGKILL, 5.0)):
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, sig)
            try:
                await asyncio.wait_for(proc.wait(), wait_s)
                break
            except asyncio.TimeoutError:
                continue
        with contextlib.suppress(ProcessLookupError):   # children that ignored SIGTERM
            os.killpg(proc.pid, signal.SIGKILL)

    # -- webhook ------------------------------------------------------------------------------
    def body(self, request: ActionRequest, jobs: tuple[str, ...]) -> bytes:
        """The JSON body, canonical (sorted keys, no spaces) so the signature is reproducible."""
        payload = {"action": request.action, "cluster": request.target.cluster, "node": request.target.node,
                   "rank": request.target.rank, "job": request.target.job, "jobs": list(jobs),
                   "reason": untrusted(request.reason, REASON_MAX_CHARS),
                   "idempotency_key": request.idempotency_key,
                   "anomaly_id": request.anomaly_id, "anomaly_dedup_key": request.anomaly_dedup_key}
        return json.dumps(payload, sort_keys=True, separators=(",", ":")).encode()

    def signature(self, body: bytes) -> str:
        return "sha256=" + hmac.new(self.webhook_secret.encode(), body, hashlib.sha256).hexdigest()

    async def _post(self, request: ActionRequest, jobs: tuple[str, ...]) -> ExecutionResult:
        """The signed body through the alert sinks' poster (`actions.alerts.http`): 5xx, 429 and
        connection errors retried with backoff and Retry-After, other 4xx failed at once."""
        if self._poster is None:
            self._poster = JsonPoster(f"POST {self.webhook_url}", RetryPolicy(
                timeout_s=self.timeout_s, max_attempts=self.webhook_attempts,
                backoff_initial_s=max(self.webhook_backoff_s, MIN_BACKOFF_S), backoff_max_s=MAX_RETRY_WAIT_S,
                # every attempt may take its timeout and wait its longest: the attempts bound it, not time
                total_budget_s=self.webhook_attempts * (self.timeout_s + MAX_RETRY_WAIT_S)))
        body = self.body(request, jobs)
        headers = {"Content-Type": "application/json", "Idempotency-Key": request.idempotency_key,
                   SIGNATURE_HEADER: self.signature(body)}
        sent = await self._poster.post_body(self.webhook_url, body, headers=headers)
        if sent.ok:
            return ExecutionResult(_webhook_status(sent.answer), f"{sent.detail} (attempt {sent.attempts})", jobs)
        if sent.attempts < self.webhook_attempts:
            return ExecutionResult(FAILED, f"{sent.detail} (attempt {sent.attempts}, not retried)")
        return ExecutionResult(FAILED, f"{sent.detail} (gave up after {sent.attempts} attempts)")


def _webhook_status(text: str) -> str:
    try:
        answer = json.loads(text)
    except ValueError:
        return DONE
    return ALREADY if isinstance(answer, dict) and answer.get("status") == ALREADY else DONE


def _quote(arg: str) -> str:
    """For the detail text only (nothing is run through a shell)."""
    return arg if arg and re.fullmatch(r"[A-Za-z0-9._:@/+=,%-]+", arg) else json.dumps(arg)
