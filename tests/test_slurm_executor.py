"""The Slurm executor: parsing and argv building (pure), refusals and process failures
(a recording stand-in for scontrol), and the real thing against the single-node Slurm of the
session fixture `slurm_conf` (tests/conftest.py, deploy/slurm/slurm-local.sh; skipped where
slurmctld is not installed or we are not root)."""
from __future__ import annotations

import os
import stat
import subprocess
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from fabricwatch.actions.base import (
    ALREADY,
    DONE,
    DRAIN_AFTER_JOB,
    DRAIN_NODE,
    EXCLUDE_AND_RESTART,
    FAILED,
    ISOLATE_PORT,
    REQUEUE_JOBS,
    RESUME_NODE,
    ActionRequest,
)
from fabricwatch.actions.executors.slurm import (
    REASON_MAX_CHARS,
    SlurmExecutor,
    SlurmJob,
    drain_argv,
    exclude_argv,
    expand_hostlist,
    jobs_on_node_argv,
    parse_node_state,
    parse_scontrol_record,
    parse_squeue_jobs,
    requeue_argv,
    resume_argv,
    sanitize_reason,
    valid_job_id,
    valid_node_name,
)
from fabricwatch.models.findings import EntityRef

# Real `scontrol show node -o` / `show job -o` lines from slurm-wlm 22.05.8 (shortened).
NODE_LINE = (
    "NodeName=vm Arch=x86_64 CoresPerSocket=1 CPUAlloc=1 CPUEfctv=2 CPUTot=2 CPULoad=1.07 "
    "AvailableFeatures=(null) ActiveFeatures=(null) Gres=(null) NodeAddr=127.0.0.1 NodeHostName=vm "
    "Version=22.05.8 OS=Linux 6.18.44-fc-v782 #1 SMP PREEMPT_DYNAMIC @0  RealMemory=22899 AllocMem=0 "
    "FreeMem=21849 Sockets=2 Boards=1 State=MIXED+DRAIN ThreadsPerCore=1 TmpDisk=0 Weight=1 Owner=N/A "
    "MCS_label=N/A Partitions=debug BootTime=2026-11-30T15:36:38 CfgTRES=cpu=2,mem=22899M,billing=2 "
    "AllocTRES= CapWatts=n/a Reason=fabricwatch: pfc storm [0123456789ab] [root@2026-11-30T18:16:03]"
)
JOB_LINE = (
    "JobId=1 JobName=wrap UserId=root(0) GroupId=root(0) MCS_label=N/A Priority=4294901759 Nice=0 "
    "Account=(null) QOS=(null) JobState=PENDING Reason=BeginTime Dependency=(null) Requeue=1 "
    "Restarts=1 BatchFlag=1 Reboot=0 ExitCode=0:0 Partition=debug AllocNode:Sid=localhost:3636 "
    "ReqNodeList=(null) ExcNodeList=vm NodeList= NumNodes=1 CPUs/Task=1 TRES=cpu=1,mem=22899M,node=1"
)


# ---------------------------------------------------------------- pure parsing

def test_parse_node_record_keeps_spaces_in_values_and_first_occurrence():
    rec = parse_scontrol_record(NODE_LINE)
    assert rec["NodeName"] == "vm"
    assert rec["State"] == "MIXED+DRAIN"
    assert rec["OS"] == "Linux 6.18.44-fc-v782 #1 SMP PREEMPT_DYNAMIC @0"
    assert rec["Reason"].startswith("fabricwatch: pfc storm [0123456789ab]")
    assert rec["ActiveFeatures"] == "" and rec["AllocTRES"] == ""
    assert rec["CfgTRES"] == "cpu=2,mem=22899M,billing=2"
    # A forged key later in free text does not override the real, earlier field.
    assert parse_scontrol_record("NodeName=n1 State=IDLE Reason=x State=IDLE+DRAIN")["State"] == "IDLE"


def test_parse_job_record_fields_the_tests_read():
    rec = parse_scontrol_record(JOB_LINE)
    assert (rec["JobState"], rec["Restarts"], rec["ExcNodeList"], rec["NodeList"]) == ("PENDING", "1", "vm", "")
    assert rec["AllocNode:Sid"] == "localhost:3636" and rec["CPUs/Task"] == "1"


@pytest.mark.parametrize("state,base,drain", [
    ("IDLE", "IDLE", False), ("IDLE+DRAIN", "IDLE", True), ("MIXED+DRAIN", "MIXED", True),
    ("ALLOCATED+DRAIN+COMPLETING", "ALLOCATED", True), ("DOWN+NOT_RESPONDING", "DOWN", False),
    ("DOWN*+DRAIN", "DOWN", True), ("DRAINED", "DRAINED", True), ("", "UNKNOWN", False),
])
def test_node_state_flags(state, base, drain):
    parsed = parse_node_state({"State": state})
    assert (parsed.base, parsed.drain_set) == (base, drain)


def test_drained_by_us_needs_our_prefix():
    assert parse_node_state({"State": "IDLE+DRAIN", "Reason": "fabricwatch: x [k]"}).drained_by_us
    assert not parse_node_state({"State": "IDLE+DRAIN", "Reason": "disk swap [ops@2026]"}).drained_by_us
    assert not parse_node_state({"State": "IDLE", "Reason": "fabricwatch: x"}).drained_by_us


def test_parse_squeue_jobs_skips_garbage_and_headers():
    text = "JOBID|STATE|NODELIST|EXC_NODES\n7|RUNNING|vm|\n8_2|PENDING||n[1-2]\n9|RUNNING\n;rm|X|a|b\n"
    assert parse_squeue_jobs(text) == [SlurmJob("7", "RUNNING", "vm", ""),
                                       SlurmJob("8_2", "PENDING", "", "n[1-2]")]


@pytest.mark.parametrize("expr,names", [
    ("vm", ["vm"]), ("a,b", ["a", "b"]), ("gpu[08-11]", ["gpu08", "gpu09", "gpu10", "gpu11"]),
    ("n[1,3-4].ib", ["n1.ib", "n3.ib", "n4.ib"]), ("r[1-2]n[1-2]", ["r1n1", "r1n2", "r2n1", "r2n2"]),
    ("(null)", ["(null)"]), ("", []),
])
def test_expand_hostlist(expr, names):
    assert expand_hostlist(expr) == names


@pytest.mark.parametrize("expr", ["n[1-2", "n1-2]", "n[a-b]", "n[1-x]", "n[]"])
def test_expand_hostlist_rejects_malformed(expr):
    with pytest.raises(ValueError):
        expand_hostlist(expr)


def test_sanitize_reason_is_printable_capped_and_tagged():
    reason = sanitize_reason("PFC storm\ton\x00 mlx5_0 \u00e9\x7f " + "y" * 400, "k" * 40)
    assert reason.startswith("fabricwatch: PFC storm on mlx5_0 ")
    assert reason.endswith(" [kkkkkkkkkkkk]") and len(reason) == REASON_MAX_CHARS
    assert all(" " <= ch <= "~" for ch in reason) and "..." in reason
    # Shell-ish characters survive as text: nothing goes through a shell.
    assert sanitize_reason('a"; rm -rf / #', "") == 'fabricwatch: a"; rm -rf / #'
    # Brackets and spaces in a key would make the tag ambiguous: stripped.
    assert sanitize_reason("x", "ab c]d[e") == "fabricwatch: x [abcde]"


@pytest.mark.parametrize("name", ["-oRaw", "vm;reboot", "n[1-2]", "a,b", "a b", "$(id)", "x" * 64, "", "é"])
def test_hostile_node_names_are_invalid(name):
    assert not valid_node_name(name)


@pytest.mark.parametrize("job", ["1 2", "-1", "1;2", "1,2", "abc", "12345678901", ""])
def test_hostile_job_ids_are_invalid(job):
    assert not valid_job_id(job)


def test_argv_builders():
    assert drain_argv("scontrol", "gpu01", "fabricwatch: x [k]") == [
        "scontrol", "update", "nodename=gpu01", "state=drain", "reason=fabricwatch: x [k]"]
    assert resume_argv("/usr/bin/scontrol", "gpu01") == [
        "/usr/bin/scontrol", "update", "nodename=gpu01", "state=resume"]
    assert requeue_argv("scontrol", "12_3") == ["scontrol", "requeue", "12_3"]
    assert exclude_argv("scontrol", "12", ["n1", "gpu01"]) == [
        "scontrol", "update", "jobid=12", "ExcNodeList=n1,gpu01"]
    assert jobs_on_node_argv("squeue", "gpu01") == [
        "squeue", "-h", "-w", "gpu01", "-t", "RUNNING,CONFIGURING,SUSPENDED", "-o", "%i|%T|%N|%x"]


def test_executor_rejects_bad_timeouts():
    with pytest.raises(ValueError, match="command_timeout_s"):
        SlurmExecutor(command_timeout_s=0)
    with pytest.raises(ValueError, match="completing_wait_s"):
        SlurmExecutor(completing_wait_s=-1)


# ---------------------------------------------------------------- refusals and process failures
# A stand-in scontrol/squeue that records its argv, so we can see what would have run.

def _fake_binary(tmp_path: Path, name: str, body: str) -> Path:
    path = tmp_path / name
    path.write_text(f"#!/bin/sh\necho \"$0 $*\" >> {tmp_path}/calls.log\n{body}\n")
    path.chmod(path.stat().st_mode | stat.S_IXUSR)
    return path


def _request(action=DRAIN_NODE, node="gpu01", job="", jobs=(), reason="pfc storm", key="0123456789abcdef"):
    return ActionRequest(action=action, target=EntityRef(cluster="c1", node=node, job=job),
                         reason=reason, idempotency_key=key, jobs=tuple(jobs))


@pytest.mark.parametrize("node", ["-oRaw", "vm;touch /tmp/pwned", "n[1-2]", "gpu01 --help", ""])
async def test_hostile_node_name_is_refused_without_running_anything(tmp_path, node):
    fake = _fake_binary(tmp_path, "scontrol", "exit 0")
    ex = SlurmExecutor(scontrol=str(fake), squeue=str(fake))
    for action in (DRAIN_NODE, RESUME_NODE, REQUEUE_JOBS, DRAIN_AFTER_JOB, EXCLUDE_AND_RESTART):
        result = await ex.execute(_request(action, node=node))
        assert result.status == FAILED and "refused: node name" in result.detail
    assert not (tmp_path / "calls.log").exists()


async def test_hostile_job_id_is_refused_without_running_anything(tmp_path):
    fake = _fake_binary(tmp_path, "scontrol", "exit 0")
    ex = SlurmExecutor(scontrol=str(fake), squeue=str(fake))
    result = await ex.execute(_request(EXCLUDE_AND_RESTART, job="1;scancel -u root"))
    assert result.status == FAILED and "not Slurm job ids" in result.detail
    result = await ex.execute(_request(REQUEUE_JOBS, jobs=("12", "-h")))
    assert result.status == FAILED and "'-h'" in result.detail
    assert not (tmp_path / "calls.log").exists()


async def test_unhandled_action_fails():
    result = await SlurmExecutor().execute(_request(ISOLATE_PORT))
    assert result.status == FAILED and "does not handle 'isolate_port'" in result.detail


async def test_missing_binary_fails_with_the_command(tmp_path):
    ex = SlurmExecutor(scontrol=str(tmp_path / "no-such-scontrol"))
    result = await ex.execute(_request(DRAIN_NODE))
    assert result.status == FAILED
    assert "no-such-scontrol show node gpu01 -o" in result.detail and "cannot run" in result.detail


async def test_missing_slurm_conf_fails_fast(tmp_path):
    result = await SlurmExecutor(slurm_conf=str(tmp_path / "slurm.conf")).execute(_request())
    assert result.status == FAILED and "does not exist" in result.detail


async def test_timeout_kills_the_command(tmp_path):
    fake = _fake_binary(tmp_path, "scontrol", "exec sleep 30")
    started = time.monotonic()
    result = await SlurmExecutor(scontrol=str(fake), command_timeout_s=0.5).execute(_request())
    assert time.monotonic() - started < 5
    assert result.status == FAILED and "timed out after 0.5s" in result.detail


async def test_nonzero_exit_reports_stderr(tmp_path):
    fake = _fake_binary(tmp_path, "scontrol", "echo 'Node gpu01 not found' >&2; exit 1")
    result = await SlurmExecutor(scontrol=str(fake)).execute(_request(RESUME_NODE))
    assert result.status == FAILED
    assert "$ " in result.detail and "rc=1: Node gpu01 not found" in result.detail


async def test_drain_builds_the_reason_and_passes_it_as_one_argument(tmp_path):
    # Node idle, no jobs: the stand-in answers `show node` and records the update.
    fake = _fake_binary(tmp_path, "scontrol", """
case "$1" in
  show) echo "NodeName=gpu01 Arch=x86_64 State=IDLE ThreadsPerCore=1" ;;
  update) printf '%s\\n' "$@" > "$(dirname "$0")/update.args" ;;
esac""")
    squeue = _fake_binary(tmp_path, "squeue", "exit 0")
    ex = SlurmExecutor(scontrol=str(fake), squeue=str(squeue))
    result = await ex.execute(_request(DRAIN_NODE, reason="storm; $(reboot)\n"))
    assert result.status == DONE, result.detail
    assert (tmp_path / "update.args").read_text().splitlines() == [
        "update", "nodename=gpu01", "state=drain", "reason=fabricwatch: storm; $(reboot) [0123456789ab]"]


async def test_resume_waits_for_completing_jobs_then_gives_up(tmp_path):
    fake = _fake_binary(tmp_path, "scontrol", """
case "$1" in
  show) echo "NodeName=gpu01 State=IDLE+DRAIN+COMPLETING Reason=fabricwatch: x [k] [root@t]" ;;
  update) touch "$(dirname "$0")/updated" ;;
esac""")
    result = await SlurmExecutor(scontrol=str(fake), completing_wait_s=1).execute(_request(RESUME_NODE))
    assert result.status == FAILED and "still completing jobs after 1s" in result.detail
    assert not (tmp_path / "updated").exists()


async def test_resume_goes_ahead_once_completing_clears(tmp_path):
    # The first `show` says COMPLETING, later ones not.
    fake = _fake_binary(tmp_path, "scontrol", """
d="$(dirname "$0")"
case "$1" in
  show) if [ -e "$d/shown" ]; then flags=IDLE+DRAIN; else flags=IDLE+DRAIN+COMPLETING; touch "$d/shown"; fi
        echo "NodeName=gpu01 State=$flags Reason=fabricwatch: x [k] [root@t]" ;;
  update) printf '%s\n' "$@" > "$d/update.args" ;;
esac""")
    result = await SlurmExecutor(scontrol=str(fake)).execute(_request(RESUME_NODE))
    assert result.status == DONE, result.detail
    assert (tmp_path / "update.args").read_text().split() == ["update", "nodename=gpu01", "state=resume"]


# ---------------------------------------------------------------- a real single-node Slurm

def _slurm_env(conf: str) -> dict[str, str]:
    return dict(os.environ, SLURM_CONF=conf, LC_ALL="C")


@pytest.fixture
def slurm(slurm_conf: str) -> Iterator[tuple[SlurmExecutor, str, dict[str, str]]]:
    """The executor, the node's name and the env for Slurm commands; each test starts and
    leaves with no jobs and the node idle."""
    env = _slurm_env(slurm_conf)
    node = subprocess.run(["hostname", "-s"], capture_output=True, text=True, check=True).stdout.strip()
    _reset_cluster(node, env)
    yield SlurmExecutor(slurm_conf=slurm_conf, command_timeout_s=20), node, env
    _reset_cluster(node, env)


def _cmd(argv: list[str], env: dict[str, str]) -> str:
    done = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=30)
    assert done.returncode == 0, f"{argv}: rc={done.returncode} {done.stderr}"
    return done.stdout


def _node_state(node: str, env: dict[str, str]) -> str:
    return _cmd(["sinfo", "-h", "-n", node, "-o", "%T"], env).strip()


def _reset_cluster(node: str, env: dict[str, str]) -> None:
    subprocess.run(["scancel", "--full", "--user", "root"], env=env, capture_output=True, timeout=30)
    # Resume only once the cancelled jobs are gone (see SlurmExecutor._resume).
    _wait_for(lambda: not _cmd(["squeue", "-h"], env).strip(), 60, "the queue to empty")
    if "drain" in _node_state(node, env):
        _cmd(["scontrol", "update", f"nodename={node}", "state=resume"], env)
    seen = {}

    def idle_and_empty() -> bool:
        seen["node"], seen["queue"] = _node_state(node, env), _cmd(["squeue", "-h"], env).strip()
        seen["show"] = _cmd(["scontrol", "show", "node", node, "-o"], env).strip()
        return seen["node"] == "idle" and not seen["queue"]
    _wait_for(idle_and_empty, 60, lambda: f"node {node} idle and the queue empty (last seen: {seen})")


def _wait_for(predicate, timeout_s: float, what: str | Callable[[], str]) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s}s waiting for {what() if callable(what) else what}")
        time.sleep(0.5)


def _submit_running_job(tmp_path: Path, env: dict[str, str], *flags: str) -> str:
    out = _cmd(["sbatch", "--parsable", *flags, f"--chdir={tmp_path}", "--output=/dev/null",
                "--wrap", "sleep 300"], env)
    job_id = out.strip().split(";")[0]
    _wait_for(lambda: _job(job_id, env)["JobState"] == "RUNNING", 60, f"job {job_id} to run")
    return job_id


def _job(job_id: str, env: dict[str, str]) -> dict[str, str]:
    return parse_scontrol_record(_cmd(["scontrol", "show", "job", job_id, "-o"], env))


async def test_drain_shows_in_sinfo_and_a_second_drain_is_already(slurm):
    ex, node, env = slurm
    first = await ex.execute(_request(DRAIN_NODE, node=node, reason="pfc storm on mlx5_0"))
    assert first.status == DONE, first.detail
    assert first.affected == ()
    assert _node_state(node, env) == "drained"
    reasons = _cmd(["sinfo", "-R", "-h", "-o", "%N|%E"], env)
    assert f"{node}|fabricwatch: pfc storm on mlx5_0 [0123456789ab]" in reasons
    second = await ex.execute(_request(DRAIN_NODE, node=node, reason="pfc storm again", key="ffff"))
    assert second.status == ALREADY, second.detail
    assert "[0123456789ab]" in _cmd(["sinfo", "-R", "-h", "-o", "%E"], env)  # first reason kept


async def test_drain_node_requeues_the_running_job_off_the_node(slurm, tmp_path):
    ex, node, env = slurm
    job_id = _submit_running_job(tmp_path, env, "--requeue")
    result = await ex.execute(_request(DRAIN_NODE, node=node))
    assert result.status == DONE, result.detail
    assert result.affected == (job_id,)
    job = _job(job_id, env)
    assert int(job["Restarts"]) >= 1
    assert node in expand_hostlist(job["ExcNodeList"])
    # One node, and it is excluded: the job waits (expected on this cluster), once its
    # requeue has finished killing the batch step (COMPLETING for a moment).
    _wait_for(lambda: _job(job_id, env)["JobState"] == "PENDING", 30, f"job {job_id} pending")
    assert _node_state(node, env) in ("drained", "draining")
    again = await ex.execute(_request(DRAIN_NODE, node=node))
    assert again.status == ALREADY, again.detail
    assert int(_job(job_id, env)["Restarts"]) == int(job["Restarts"])


async def test_resume_brings_our_drained_node_back_to_idle(slurm):
    ex, node, env = slurm
    assert (await ex.execute(_request(RESUME_NODE, node=node))).status == ALREADY
    assert (await ex.execute(_request(DRAIN_NODE, node=node))).status == DONE
    result = await ex.execute(_request(RESUME_NODE, node=node))
    assert result.status == DONE, result.detail
    _wait_for(lambda: _node_state(node, env) == "idle", 30, f"{node} idle after resume")
    assert (await ex.execute(_request(RESUME_NODE, node=node))).status == ALREADY


async def test_resume_leaves_an_operators_drain_alone(slurm):
    ex, node, env = slurm
    _cmd(["scontrol", "update", f"nodename={node}", "state=drain", "reason=PSU swap"], env)
    result = await ex.execute(_request(RESUME_NODE, node=node))
    assert result.status == FAILED and "drained by someone else" in result.detail
    assert _node_state(node, env) == "drained"
    # Our drain sees it drained already and keeps the operator's reason.
    assert (await ex.execute(_request(DRAIN_NODE, node=node))).status == ALREADY
    assert "PSU swap" in _cmd(["sinfo", "-R", "-h", "-o", "%E"], env)


async def test_drain_after_job_lets_the_job_run(slurm, tmp_path):
    ex, node, env = slurm
    job_id = _submit_running_job(tmp_path, env, "--requeue")
    result = await ex.execute(_request(DRAIN_AFTER_JOB, node=node))
    assert result.status == DONE, result.detail
    assert _node_state(node, env) == "draining"
    job = _job(job_id, env)
    assert (job["JobState"], job["Restarts"]) == ("RUNNING", "0")


async def test_exclude_and_restart_moves_only_the_target_job(slurm, tmp_path):
    ex, node, env = slurm
    job_id = _submit_running_job(tmp_path, env, "--requeue")
    request = _request(EXCLUDE_AND_RESTART, node=node, job=job_id)
    result = await ex.execute(request)
    assert result.status == DONE, result.detail
    assert result.affected == (job_id,)
    job = _job(job_id, env)
    assert int(job["Restarts"]) >= 1 and node in expand_hostlist(job["ExcNodeList"])
    assert "drain" not in _node_state(node, env)  # the node itself is not drained
    assert (await ex.execute(request)).status == ALREADY


async def test_requeue_of_a_non_requeueable_job_fails_with_slurms_reason(slurm, tmp_path):
    ex, node, env = slurm
    job_id = _submit_running_job(tmp_path, env, "--no-requeue")
    result = await ex.execute(_request(REQUEUE_JOBS, node=node))
    assert result.status == FAILED
    assert f"scontrol requeue {job_id}" in result.detail and "disabled" in result.detail
    assert _job(job_id, env)["JobState"] == "RUNNING"


async def test_requeue_jobs_with_no_jobs_is_already(slurm):
    ex, node, _ = slurm
    result = await ex.execute(_request(REQUEUE_JOBS, node=node))
    assert result.status == ALREADY and "no running jobs" in result.detail


async def test_unknown_node_fails_with_scontrols_message(slurm):
    ex, _, _ = slurm
    result = await ex.execute(_request(DRAIN_NODE, node="no-such-node"))
    assert result.status == FAILED and "not found" in result.detail


async def test_hostile_node_name_changes_nothing_on_the_real_cluster(slurm):
    ex, node, env = slurm
    result = await ex.execute(_request(DRAIN_NODE, node=f"{node} state=down"))
    assert result.status == FAILED and "refused" in result.detail
    assert _node_state(node, env) == "idle"


# ---------------------------------------------------------------- #13: only jobs Slurm places on the node

async def test_a_forged_job_is_never_restarted_slurm_must_place_it_on_the_node(slurm, tmp_path):
    """#13: forged rank steps named five jobs that never ran on the sender's node, and all five
    were restarted with that node excluded. Slurm's own answer decides now."""
    ex, node, env = slurm
    job_id = _submit_running_job(tmp_path, env, "--requeue")
    held = _cmd(["sbatch", "--parsable", "--hold", "--requeue", f"--chdir={tmp_path}", "--output=/dev/null",
                 "--wrap", "sleep 300"], env).strip().split(";")[0]                # pending, on no node
    elsewhere = await ex.execute(_request(EXCLUDE_AND_RESTART, node="gpu-elsewhere", job=job_id))
    assert elsewhere.status == FAILED and f"refused: job {job_id} is RUNNING on {node}" in elsewhere.detail
    missing = await ex.execute(_request(EXCLUDE_AND_RESTART, node=node, job="999999"))
    assert missing.status == FAILED and "not in Slurm's queue" in missing.detail
    pending = await ex.execute(_request(EXCLUDE_AND_RESTART, node=node, job=held))
    assert pending.status == FAILED and "not on" in pending.detail
    # named by an anomaly next to a requeue of the node: left alone, the node's own job moves
    requeue = await ex.execute(_request(REQUEUE_JOBS, node=node, jobs=[held]))
    assert requeue.status == DONE and requeue.affected == (job_id,), requeue.detail
    assert f"job {held}: PENDING on no node yet, not on {node}, left alone" in requeue.detail
    job, other = _job(job_id, env), _job(held, env)
    assert int(job["Restarts"]) == 1 and node in expand_hostlist(job["ExcNodeList"])     # once: by the requeue
    assert (other["Restarts"], other["ExcNodeList"]) == ("0", "")


def test_the_slurm_domain_is_the_cluster_its_scontrol_reaches(slurm_conf, tmp_path, monkeypatch):
    assert SlurmExecutor(slurm_conf=slurm_conf).domain == "slurm:fabricwatch"       # ClusterName= of slurm.conf
    assert SlurmExecutor(slurm_conf=slurm_conf, cluster_name="east").domain == "slurm:east"
    monkeypatch.setenv("SLURM_CONF", str(tmp_path / "missing.conf"))
    assert SlurmExecutor().domain == f"slurm:{tmp_path / 'missing.conf'}"
