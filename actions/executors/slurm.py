"""Slurm executor: drain, resume and requeue through ``scontrol`` and ``squeue``.

`SlurmExecutor` carries out five action kinds on the node ``request.target.node``:

* DRAIN_NODE: ``scontrol update nodename=N state=drain reason="fabricwatch: <reason> [<key>]"``,
  then move the node's running jobs off it (below). Slurm shows the node ``draining`` while
  jobs still run on it and ``drained`` once it is empty; ``sinfo -R`` lists the reason.
* DRAIN_AFTER_JOB: the drain only. A Slurm drain lets the running jobs finish.
* REQUEUE_JOBS: move the node's running jobs, plus ``request.jobs`` and ``target.job``.
* EXCLUDE_AND_RESTART: move ``target.job`` (else as REQUEUE_JOBS). Restarting *from its
  checkpoint* is the job's own business: Slurm reruns the batch script, whose resume logic
  must find the latest checkpoint (``SLURM_RESTART_COUNT`` tells it that it was requeued).
* RESUME_NODE: ``scontrol update nodename=N state=resume``, only for a drain of ours: a node
  drained with another reason (an operator's maintenance) is left drained and FAILED says why.

A job is only touched once Slurm itself says it runs on the node (``squeue -j J``: running
there now): the job ids an anomaly names come from telemetry, which a collector chose.
EXCLUDE_AND_RESTART of a job Slurm does not place on the node is refused (FAILED, nothing
run); a named job elsewhere is left alone. A job already pending with the node excluded
counts as done (ALREADY): the effect holds.

Moving a job off the node = ``scontrol requeue J`` while it runs there, then
``scontrol update jobid=J ExcNodeList=<its list + N>``. That order is forced: Slurm refuses
ExcNodeList on a running job ("Job is no longer pending execution"). It is safe: a requeued
job waits in PENDING (BeginTime, about 120 s on 22.05) before it can start again, and the
node is drained anyway for DRAIN_NODE. Only batch jobs that may be requeued
(``sbatch --requeue`` or ``JobRequeue=1``) can move; for others scontrol's refusal comes back
in a FAILED result. On a one-node cluster a job that excludes the only node stays pending.

Idempotent on Slurm's state, so a retry after a crash is harmless: a node already
draining or drained is not drained again (ALREADY when nothing else was left to do), a job
already pending with the node excluded is left alone, a resumed node reports ALREADY.

Safety: no shell anywhere (``asyncio.create_subprocess_exec``); node names and job ids are
checked against conservative patterns before any command runs; the reason is reduced to
printable ASCII and capped. `execute` never raises: a missing binary, a timeout or a
non-zero exit comes back as FAILED with the command line and its stderr.

Why squeue for jobs and ``scontrol show node -o`` for nodes: the one-line ``scontrol show``
format is ``Key=Value`` pairs with unquoted values that may hold spaces. For a node, the
fields we read (State, Reason) come before or instead of any free text; for a job, the
user-chosen JobName comes before JobState and could forge it, so job fields come from
``squeue -o '%i|%T|%N|%x'`` whose fields cannot hold ``|``.
"""
from __future__ import annotations

import asyncio
import os
import re
import shlex
from dataclasses import dataclass

from fabricwatch.actions.base import (
    ALREADY,
    DONE,
    DRAIN_AFTER_JOB,
    DRAIN_NODE,
    EXCLUDE_AND_RESTART,
    FAILED,
    REQUEUE_JOBS,
    RESUME_NODE,
    ActionRequest,
    ExecutionResult,
)

#: Every drain reason we set starts with this; RESUME_NODE only undoes drains that do.
REASON_PREFIX = "fabricwatch:"
REASON_MAX_CHARS = 200
IDEMPOTENCY_KEY_CHARS = 12
#: Conservative on purpose: no hostlist brackets, commas, spaces or leading '-' (an option).
NODE_NAME_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,62}")
#: A job id, or an array task (``123_4``).
JOB_ID_RE = re.compile(r"[0-9]{1,10}(?:_[0-9]{1,10})?")
_KEY_RE = re.compile(r"(?:^|\s)([A-Za-z][A-Za-z0-9_:/.]*)=")
_NULL = "(null)"
_DETAIL_OUTPUT_CHARS = 500
_COMPLETING_POLL_S = 0.5

# Job states (squeue %T) by what moving a job off a node means for them.
_ON_NODE_STATES = frozenset({"RUNNING", "CONFIGURING", "SUSPENDED"})          # requeue, then exclude
_WAITING_STATES = frozenset({"PENDING", "REQUEUED", "REQUEUE_HOLD", "REQUEUE_FED",
                             "SPECIAL_EXIT", "RESV_DEL_HOLD"})                 # exclude only
_LEAVING_STATES = frozenset({"COMPLETING", "STAGE_OUT", "RESIZING"})         # exclude if still allowed
_LIST_STATES = "RUNNING,CONFIGURING,SUSPENDED"  # the jobs "on the node" for squeue -t
_JOB_FORMAT = "%i|%T|%N|%x"                       # id | state | nodes | excluded nodes


# ---------------------------------------------------------------- pure helpers

def parse_scontrol_record(line: str) -> dict[str, str]:
    """One ``scontrol show <entity> -o`` line as a dict; ``(null)`` becomes ``""``.

    Values may hold spaces (``Reason=fabricwatch: pfc storm [ab12]``): a value runs to the
    next `` Key=``. The first occurrence of a key wins, so free text late in the line
    cannot override an earlier real field.

    >>> rec = parse_scontrol_record("NodeName=n1 Arch=x86_64 State=IDLE+DRAIN "
    ...                             "Reason=fabricwatch: pfc storm [ab] [root@2026-11-30T18:16:03]")
    >>> rec["State"], rec["Reason"]
    ('IDLE+DRAIN', 'fabricwatch: pfc storm [ab] [root@2026-11-30T18:16:03]')
    >>> parse_scontrol_record("JobId=7 ExcNodeList=(null) AllocNode:Sid=vm:12")["ExcNodeList"]
    ''
    """
    matches = list(_KEY_RE.finditer(line.strip()))
    record: dict[str, str] = {}
    for i, m in enumerate(matches):
        end = matches[i + 1].start() if i + 1 < len(matches) else len(line.strip())
        value = line.strip()[m.end():end].strip()
        record.setdefault(m.group(1), "" if value == _NULL else value)
    return record


@dataclass(frozen=True)
class NodeState:
    """A node's ``State=`` field split into its base state and ``+`` flags."""

    base: str                 # IDLE, MIXED, ALLOCATED, DOWN, ...
    flags: frozenset[str]     # DRAIN, NOT_RESPONDING, COMPLETING, ...
    reason: str = ""

    @property
    def drain_set(self) -> bool:
        """Draining or drained: Slurm schedules nothing new onto it."""
        return "DRAIN" in self.flags

    @property
    def drained_by_us(self) -> bool:
        return self.drain_set and self.reason.startswith(REASON_PREFIX)


def parse_node_state(record: dict[str, str]) -> NodeState:
    """
    >>> s = parse_node_state({"State": "MIXED+DRAIN", "Reason": "fabricwatch: x [k]"})
    >>> s.base, sorted(s.flags), s.drain_set, s.drained_by_us
    ('MIXED', ['DRAIN'], True, True)
    >>> parse_node_state({"State": "DRAINED"}).drain_set  # older spellings
    True
    >>> parse_node_state({"State": "IDLE"}).drain_set
    False
    """
    parts = [p.rstrip("*") for p in record.get("State", "").upper().split("+") if p]
    base = parts[0] if parts else "UNKNOWN"
    flags = set(parts[1:])
    if base in ("DRAINED", "DRAINING", "DRAIN"):
        flags.add("DRAIN")
    return NodeState(base=base, flags=frozenset(flags), reason=record.get("Reason", ""))


@dataclass(frozen=True)
class SlurmJob:
    job_id: str
    state: str                # squeue %T: RUNNING, PENDING, COMPLETING, ...
    nodes: str                # hostlist expression of its allocation ("" while pending)
    excluded_nodes: str       # its ExcNodeList, hostlist expression ("" when none)


def parse_squeue_jobs(text: str) -> list[SlurmJob]:
    """Lines of ``squeue -h -o '%i|%T|%N|%x'``; malformed lines are skipped.

    >>> [(j.job_id, j.state, j.nodes, j.excluded_nodes)
    ...  for j in parse_squeue_jobs("12|RUNNING|n[1-2]|\\n13|PENDING||n7\\ngarbage\\n")]
    [('12', 'RUNNING', 'n[1-2]', ''), ('13', 'PENDING', '', 'n7')]
    """
    jobs = []
    for line in text.splitlines():
        fields = line.strip().split("|")
        if len(fields) != 4 or not JOB_ID_RE.fullmatch(fields[0]):
            continue
        jobs.append(SlurmJob(fields[0], fields[1].upper(), fields[2], fields[3]))
    return jobs


def expand_hostlist(expression: str) -> list[str]:
    """Slurm hostlist expression to names: ``n[01-03,7],x`` -> n01 n02 n03 n7 x.

    Brackets may appear more than once in a name (cartesian product); zero padding is kept.
    Raises ValueError on a malformed expression.

    >>> expand_hostlist("n[01-03,7],x")
    ['n01', 'n02', 'n03', 'n7', 'x']
    >>> expand_hostlist("r[1-2]n[1-2]")
    ['r1n1', 'r1n2', 'r2n1', 'r2n2']
    >>> expand_hostlist("")
    []
    """
    names: list[str] = []
    for item in _split_top_level(expression.strip()):
        if item:
            names.extend(_expand_item(item))
    return names


def _split_top_level(expression: str) -> list[str]:
    items, depth, start = [], 0, 0
    for i, ch in enumerate(expression):
        if ch == "[":
            depth += 1
        elif ch == "]":
            depth -= 1
            if depth < 0:
                raise ValueError(f"unbalanced ']' in hostlist {expression!r}")
        elif ch == "," and depth == 0:
            items.append(expression[start:i])
            start = i + 1
    if depth:
        raise ValueError(f"unbalanced '[' in hostlist {expression!r}")
    items.append(expression[start:])
    return items


def _expand_item(item: str) -> list[str]:
    open_at = item.find("[")
    if open_at < 0:
        return [item]
    close_at = item.index("]", open_at)
    prefix, ranges, rest = item[:open_at], item[open_at + 1:close_at], item[close_at + 1:]
    heads: list[str] = []
    for part in ranges.split(","):
        lo, _, hi = part.partition("-")
        if not lo.isdigit() or (hi and not hi.isdigit()):
            raise ValueError(f"bad range {part!r} in hostlist item {item!r}")
        width = len(lo)
        heads.extend(f"{prefix}{n:0{width}d}" for n in range(int(lo), int(hi or lo) + 1))
    return [head + tail for head in heads for tail in _expand_item(rest)]


def sanitize_reason(reason: str, idempotency_key: str = "",
                    max_chars: int = REASON_MAX_CHARS) -> str:
    """The drain reason Slurm stores: ``fabricwatch: <reason> [<key[:12]>]``, printable ASCII,
    whitespace collapsed, capped at `max_chars` (Slurm refuses a drain without a reason).

    >>> sanitize_reason("PFC storm\\n on mlx5_0\\x1b[31m", "0123456789abcdef")
    'fabricwatch: PFC storm on mlx5_0 [31m [0123456789ab]'
    >>> sanitize_reason("", "")
    'fabricwatch: anomaly'
    >>> len(sanitize_reason("x" * 500, "k"))
    200
    """
    text = " ".join("".join(ch if " " <= ch <= "~" else " " for ch in reason).split()) or "anomaly"
    key = re.sub(r"[^A-Za-z0-9._:-]", "", idempotency_key)[:IDEMPOTENCY_KEY_CHARS]
    suffix = f" [{key}]" if key else ""
    room = max(8, max_chars - len(REASON_PREFIX) - 1 - len(suffix))
    if len(text) > room:
        text = text[: room - 3] + "..."
    return f"{REASON_PREFIX} {text}{suffix}"


def valid_node_name(name: str) -> bool:
    """
    >>> [valid_node_name(n) for n in ("gpu-a01", "n1.rack2", "-o", "n[1-2]", "a b", "x;rm", "")]
    [True, True, False, False, False, False, False]
    """
    return bool(NODE_NAME_RE.fullmatch(name))


def valid_job_id(job_id: str) -> bool:
    """
    >>> [valid_job_id(j) for j in ("42", "42_3", "42 ", "-1", "1;2", "")]
    [True, True, False, False, False, False]
    """
    return bool(JOB_ID_RE.fullmatch(job_id))


# argv builders: the exact commands, kept pure so unit tests pin them down.

def show_node_argv(scontrol: str, node: str) -> list[str]:
    return [scontrol, "show", "node", node, "-o"]


def drain_argv(scontrol: str, node: str, reason: str) -> list[str]:
    return [scontrol, "update", f"nodename={node}", "state=drain", f"reason={reason}"]


def resume_argv(scontrol: str, node: str) -> list[str]:
    return [scontrol, "update", f"nodename={node}", "state=resume"]


def requeue_argv(scontrol: str, job_id: str) -> list[str]:
    return [scontrol, "requeue", job_id]


def exclude_argv(scontrol: str, job_id: str, excluded_nodes: list[str]) -> list[str]:
    return [scontrol, "update", f"jobid={job_id}", f"ExcNodeList={','.join(excluded_nodes)}"]


def jobs_on_node_argv(squeue: str, node: str) -> list[str]:
    return [squeue, "-h", "-w", node, "-t", _LIST_STATES, "-o", _JOB_FORMAT]


def job_argv(squeue: str, job_id: str) -> list[str]:
    return [squeue, "-h", "-j", job_id, "-o", _JOB_FORMAT]


# ---------------------------------------------------------------- executor

@dataclass(frozen=True)
class CommandResult:
    argv: tuple[str, ...]
    returncode: int | None     # None: did not run to an exit (missing binary, timeout)
    stdout: str
    stderr: str

    @property
    def ok(self) -> bool:
        return self.returncode == 0

    def describe(self) -> str:
        """``$ cmd args -> rc=N: stderr`` for a result's detail."""
        line = f"$ {shlex.join(self.argv)}"
        status = "rc=?" if self.returncode is None else f"rc={self.returncode}"
        out = (self.stderr.strip() or self.stdout.strip())[:_DETAIL_OUTPUT_CHARS]
        return f"{line} -> {status}" + (f": {out}" if out and not self.ok else "")


class _Refused(Exception):
    """A step failed; carries the detail line. Caught in `execute`, never escapes."""


class SlurmExecutor:
    """Executor for Slurm clusters, run where ``scontrol`` can reach slurmctld as an admin
    (root or SlurmUser).

    Parameters
    ----------
    scontrol, squeue
        The binaries (names on PATH or absolute paths).
    slurm_conf
        ``SLURM_CONF`` for the commands; ``""`` keeps the environment's (``/etc/slurm``).
    command_timeout_s
        Wall-clock limit per command; scontrol retries a missing config for 60 s, and a
        hung slurmctld must not stall the responder.
    completing_wait_s
        How long RESUME_NODE waits for jobs still completing on the node before it gives up.
    """

    name = "slurm"
    handles = frozenset({DRAIN_NODE, DRAIN_AFTER_JOB, RESUME_NODE, REQUEUE_JOBS, EXCLUDE_AND_RESTART})

    def __init__(self, scontrol: str = "scontrol", squeue: str = "squeue", slurm_conf: str = "",
                 command_timeout_s: float = 10.0, completing_wait_s: float = 30.0, cluster_name: str = "") -> None:
        if command_timeout_s <= 0:
            raise ValueError(f"command_timeout_s must be > 0, got {command_timeout_s}")
        if completing_wait_s < 0:
            raise ValueError(f"completing_wait_s must be >= 0, got {completing_wait_s}")
        self.scontrol = scontrol
        self.squeue = squeue
        self.slurm_conf = slurm_conf
        self.command_timeout_s = command_timeout_s
        self.completing_wait_s = completing_wait_s
        self.cluster_name = cluster_name
        #: What the guard rails count in: the Slurm cluster this executor's scontrol reaches.
        self.domain = f"slurm:{cluster_name or slurm_cluster_name(slurm_conf)}"

    async def execute(self, request: ActionRequest) -> ExecutionResult:
        log: list[str] = []
        try:
            return await self._execute(request, log)
        except _Refused as refused:
            return ExecutionResult(FAILED, "; ".join([*log, str(refused)]))
        except Exception as exc:  # noqa: BLE001 - the contract: never raise, report
            return ExecutionResult(FAILED, "; ".join([*log, f"unexpected {type(exc).__name__}: {exc}"]))

    async def _execute(self, request: ActionRequest, log: list[str]) -> ExecutionResult:
        if request.action not in self.handles:
            raise _Refused(f"the slurm executor does not handle {request.action!r}")
        if self.slurm_conf and not os.path.isfile(self.slurm_conf):
            raise _Refused(f"SLURM_CONF {self.slurm_conf!r} does not exist")
        node = request.target.node
        if not valid_node_name(node):
            raise _Refused(f"refused: node name {node!r} is not a plain Slurm node name "
                           f"({NODE_NAME_RE.pattern})")
        explicit_jobs = [j for j in (request.target.job, *request.jobs) if j]
        bad = [j for j in explicit_jobs if not valid_job_id(j)]
        if bad:
            raise _Refused(f"refused: job ids {bad!r} are not Slurm job ids ({JOB_ID_RE.pattern})")

        if request.action == RESUME_NODE:
            return await self._resume(node, log)
        changed = False
        if request.action in (DRAIN_NODE, DRAIN_AFTER_JOB):
            changed = await self._drain(node, sanitize_reason(request.reason, request.idempotency_key), log)
            if request.action == DRAIN_AFTER_JOB:
                return ExecutionResult(DONE if changed else ALREADY, "; ".join(log))
        required = ()
        if request.action == EXCLUDE_AND_RESTART and request.target.job:
            job_ids = required = [request.target.job]
        else:
            job_ids = _unique([*explicit_jobs, *await self._running_job_ids(node, log)])
        moved, failures = await self._move_jobs(job_ids, node, log, required=set(required))
        if failures:
            log.append(f"could not move jobs {failures} off {node}")
            return ExecutionResult(FAILED, "; ".join(log), tuple(moved))
        if not job_ids:
            log.append(f"no running jobs on {node}")
        return ExecutionResult(DONE if changed or moved else ALREADY, "; ".join(log), tuple(moved))

    # -- node

    async def _node_state(self, node: str, log: list[str]) -> NodeState:
        result = await self._run(show_node_argv(self.scontrol, node))
        if not result.ok:
            raise _Refused(result.describe())
        line = next((ln for ln in result.stdout.splitlines() if ln.startswith("NodeName=")), "")
        record = parse_scontrol_record(line)
        if record.get("NodeName") != node:
            raise _Refused(f"{result.describe()}: no record for node {node!r} in the output")
        state = parse_node_state(record)
        log.append(f"node {node} was {record.get('State', '?')}")
        return state

    async def _drain(self, node: str, reason: str, log: list[str]) -> bool:
        """Drain unless a drain is already set (ours or an operator's); True if we drained."""
        state = await self._node_state(node, log)
        if state.drain_set:
            log.append(f"already draining/drained (reason: {state.reason or '-'})")
            return False
        await self._checked(drain_argv(self.scontrol, node, reason), log)
        return True

    async def _resume(self, node: str, log: list[str]) -> ExecutionResult:
        state = await self._node_state(node, log)
        if not state.drain_set:
            log.append("not drained: nothing to resume")
            return ExecutionResult(ALREADY, "; ".join(log))
        if not state.drained_by_us:
            raise _Refused(f"refused: {node} was drained by someone else (reason: "
                           f"{state.reason or '-'}); resume it by hand if that is over")
        # Resuming while a job's teardown is still in flight once left the node "mixed" with
        # no job on it for good (22.05, test runs): let the teardown finish first.
        deadline = asyncio.get_running_loop().time() + self.completing_wait_s
        while "COMPLETING" in state.flags:
            if asyncio.get_running_loop().time() >= deadline:
                raise _Refused(f"{node} still completing jobs after {self.completing_wait_s:g}s: "
                               "not resumed, try again")
            await asyncio.sleep(_COMPLETING_POLL_S)
            state = await self._node_state(node, [])
        await self._checked(resume_argv(self.scontrol, node), log)
        return ExecutionResult(DONE, "; ".join(log))

    # -- jobs

    async def _running_job_ids(self, node: str, log: list[str]) -> list[str]:
        result = await self._run(jobs_on_node_argv(self.squeue, node))
        if not result.ok:
            raise _Refused(result.describe())
        return [job.job_id for job in parse_squeue_jobs(result.stdout)]

    async def _move_jobs(self, job_ids: list[str], node: str, log: list[str],
                         required: set[str] = frozenset()) -> tuple[list[str], list[str]]:
        """Requeue each job that runs on `node` and add `node` to its ExcNodeList.
        Returns (jobs changed, jobs that could not be moved); a `required` job that Slurm
        does not place on `node` is a failure, any other is left alone."""
        moved, failures = [], []
        for job_id in job_ids:
            try:
                if await self._move_job(job_id, node, log, job_id in required):
                    moved.append(job_id)
            except _Refused as refused:
                log.append(str(refused))
                failures.append(job_id)
        return moved, failures

    async def _move_job(self, job_id: str, node: str, log: list[str], required: bool = False) -> bool:
        result = await self._run(job_argv(self.squeue, job_id))
        jobs = parse_squeue_jobs(result.stdout) if result.ok else []
        job = next((j for j in jobs if j.job_id == job_id), None)
        if job is None:  # squeue forgets finished jobs after MinJobAge ("Invalid job id")
            if required:
                raise _Refused(f"refused: job {job_id} is not in Slurm's queue, so not running on {node}")
            log.append(f"job {job_id}: not in the queue (finished)")
            return False
        try:
            on_node = node in expand_hostlist(job.nodes)
            excluded = expand_hostlist(job.excluded_nodes)
        except ValueError as exc:
            raise _Refused(f"job {job_id}: {exc}") from None
        changed = False
        if node in excluded and not on_node:
            log.append(f"job {job_id}: {job.state}, {node} already excluded")   # moved before: the effect holds
            return False
        if not on_node:
            # Slurm does not place it there: the anomaly's claim is not confirmed, so nothing is
            # done (and Slurm takes no ExcNodeList while a job runs anyway).
            where = f"{job.state} on {job.nodes or 'no node yet'}, not on {node}"
            if required:
                raise _Refused(f"refused: job {job_id} is {where} (squeue)")
            log.append(f"job {job_id}: {where}, left alone")
            return False
        if job.state in _ON_NODE_STATES:
            await self._checked(requeue_argv(self.scontrol, job_id), log)
            changed = True
        elif job.state not in _ON_NODE_STATES | _WAITING_STATES | _LEAVING_STATES:
            log.append(f"job {job_id}: {job.state}, left alone")
            return False
        if node in excluded:
            if not changed:
                log.append(f"job {job_id}: {job.state}, {node} already excluded")
            return changed
        argv = exclude_argv(self.scontrol, job_id, [*excluded, node])
        if job.state in _LEAVING_STATES and not changed:
            # A job finishing normally refuses the update; one requeued before a crash takes it.
            result = await self._run(argv)
            log.append(result.describe() if result.ok else f"job {job_id}: {job.state}, left alone")
            return result.ok
        await self._checked(argv, log)
        return True

    # -- processes

    async def _checked(self, argv: list[str], log: list[str]) -> CommandResult:
        result = await self._run(argv)
        if not result.ok:
            raise _Refused(result.describe())
        log.append(result.describe())
        return result

    async def _run(self, argv: list[str]) -> CommandResult:
        env = dict(os.environ, LC_ALL="C")
        if self.slurm_conf:
            env["SLURM_CONF"] = self.slurm_conf
        try:
            proc = await asyncio.create_subprocess_exec(
                *argv, stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.PIPE,
                stderr=asyncio.subprocess.PIPE, env=env)
        except OSError as exc:  # missing binary, not executable
            return CommandResult(tuple(argv), None, "", f"cannot run {argv[0]!r}: {exc.strerror or exc}")
        try:
            stdout, stderr = await asyncio.wait_for(proc.communicate(), self.command_timeout_s)
        except asyncio.TimeoutError:
            proc.kill()
            await proc.wait()
            return CommandResult(tuple(argv), None, "", f"timed out after {self.command_timeout_s:g}s")
        return CommandResult(tuple(argv), proc.returncode, stdout.decode(errors="replace"),
                             stderr.decode(errors="replace"))


def _unique(items: list[str]) -> list[str]:
    return list(dict.fromkeys(items))


_CLUSTER_NAME_LINE = re.compile(r"^\s*ClusterName\s*=\s*(\S+)", re.IGNORECASE | re.MULTILINE)
DEFAULT_SLURM_CONF = "/etc/slurm/slurm.conf"


def slurm_cluster_name(slurm_conf: str = "") -> str:
    """``ClusterName`` of the slurm.conf the commands use (`slurm_conf`, else ``$SLURM_CONF``,
    else /etc/slurm/slurm.conf); the file's path when it names none or cannot be read.

    >>> import tempfile, os
    >>> with tempfile.NamedTemporaryFile("w", suffix=".conf", delete=False) as f:
    ...     _ = f.write("SlurmctldHost=h\\nClusterName=gpu-east\\n")
    >>> slurm_cluster_name(f.name)
    'gpu-east'
    >>> os.unlink(f.name); slurm_cluster_name(f.name) == f.name
    True
    """
    path = slurm_conf or os.environ.get("SLURM_CONF", "") or DEFAULT_SLURM_CONF
    try:
        with open(path, encoding="utf-8", errors="replace") as fh:
            found = _CLUSTER_NAME_LINE.search(fh.read(1_000_000))
    except OSError:
        return path
    return found.group(1).lower() if found else path
