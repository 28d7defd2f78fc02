"""The responder's decisions and guard rails, driven without Kafka (actions/responder.py)."""
from __future__ import annotations

import pytest

from fabricwatch.actions.base import DONE, FAILED, ExecutionResult
from fabricwatch.actions.guards import KILL_SWITCH_ENV
from fabricwatch.actions.policy import PolicyError, load_policy, parse_policy
from fabricwatch.actions.responder import Responder
from fabricwatch.protos.v1 import events_pb2 as ev

S = 10**9
T0 = 1_800_000_000 * S

EXECUTE_DRAIN = """
mode: execute
execute: [drain_node, requeue_jobs]
guards: {breaker: {min_count: 2, window_s: 600}, cooldown_s: 300, quiet_period_s: 60, flap_max_undos: 1}
rules:
  - name: storm-source
    match: {kind: pfc_storm, scope: node}
    actions: [alert, drain_node, requeue_jobs]
  - name: straggler-local-fault
    match: {kind: straggler, cause: [thermal, power, ecc, xid]}
    actions: [alert, exclude_and_restart]
"""


def storm(node="node-7", lifecycle=ev.LIFECYCLE_OPEN, onset=T0, severity=ev.SEVERITY_CRITICAL, cluster="c1"):
    dedup = f"pfc_storm:{cluster}/{node}/mlx5_0/1"
    return ev.AnomalyEvent(id=f"{dedup}|{lifecycle}", dedup_key=dedup, kind="pfc_storm", severity=severity,
                           lifecycle=lifecycle, onset_unix_ns=onset, detected_unix_ns=onset, cause_code="stuck_host",
                           entity=ev.EntityPath(cluster=cluster, node=node, device="mlx5_0", port="1"),
                           related=[ev.EntityPath(cluster=cluster, job="job-42")])


def outcomes(decisions):
    return [(d.record.action, ev.Outcome.Name(d.record.outcome).removeprefix("OUTCOME_")) for d in decisions]


def run(responder, decisions, now_ns, status=DONE):
    """What the stream layer does: execute STARTED requests, report alerts as sent."""
    records = []
    for d in decisions:
        if d.request is not None:
            records.append(responder.on_result(d, ExecutionResult(status, "ok"), now_ns))
        elif d.alert:
            records.append(responder.on_alert_sent(d, True, "sent", now_ns))
        else:
            records.append(d.record)
    return [d.record for d in decisions] + records


def test_default_policy_is_shadow_and_alerts_still_go():
    r = Responder(parse_policy("rules: [{name: s, match: {kind: pfc_storm}, actions: [alert, drain_node]}]"))
    decisions = r.on_anomaly(storm(), T0)
    assert outcomes(decisions) == [("alert", "UNSPECIFIED"), ("drain_node", "SHADOW")]
    assert decisions[0].alert == "firing" and decisions[1].request is None
    assert decisions[1].record.shadow and "would have" in decisions[1].record.reason


def test_execute_needs_mode_and_the_action_listed():
    policy = parse_policy("mode: execute\nexecute: [requeue_jobs]\n"
                          "rules: [{name: s, match: {kind: pfc_storm}, actions: [drain_node, requeue_jobs]}]")
    decisions = Responder(policy).on_anomaly(storm(), T0)
    assert outcomes(decisions) == [("drain_node", "SHADOW"), ("requeue_jobs", "STARTED")]
    request = decisions[1].request
    assert request.target.node == "node-7" and request.jobs == ("job-42",)
    assert request.idempotency_key == decisions[1].record.idempotency_key


def test_redelivered_anomaly_is_a_duplicate_and_never_executes_twice():
    r = Responder(parse_policy(EXECUTE_DRAIN))
    first = r.on_anomaly(storm(), T0)
    run(r, first, T0)
    again = r.on_anomaly(storm(), T0 + S)
    assert outcomes(again) == [("alert", "SKIPPED_DUPLICATE"), ("drain_node", "SKIPPED_DUPLICATE"),
                               ("requeue_jobs", "SKIPPED_DUPLICATE")]
    assert all(d.request is None and not d.alert for d in again)
    # an UPDATE of the same episode does not act again either
    update = r.on_anomaly(storm(lifecycle=ev.LIFECYCLE_UPDATE), T0 + 2 * S)
    assert [o for _, o in outcomes(update)] == ["SKIPPED_DUPLICATE", "SKIPPED_DUPLICATE"]


def test_restart_restores_the_ledger_from_the_audit_records():
    r = Responder(parse_policy(EXECUTE_DRAIN))
    audit = run(r, r.on_anomaly(storm(), T0), T0)
    fresh = Responder(parse_policy(EXECUTE_DRAIN))
    assert fresh.restore(audit) == []
    assert all(d.request is None and not d.alert for d in fresh.on_anomaly(storm(), T0 + 5 * S))
    assert fresh.held(shadow=False) == ["drain_node:c1/node-7"]


def test_crash_between_started_and_result_is_unknown_and_not_retried():
    r = Responder(parse_policy(EXECUTE_DRAIN))
    started = [d.record for d in r.on_anomaly(storm(), T0)]          # audited STARTED, then the crash
    fresh = Responder(parse_policy(EXECUTE_DRAIN))
    unknown = fresh.restore(started)
    assert sorted((u.action, ev.Outcome.Name(u.outcome)) for u in unknown) == [
        ("drain_node", "OUTCOME_UNKNOWN"), ("requeue_jobs", "OUTCOME_UNKNOWN")]
    assert not any(d.request for d in fresh.on_anomaly(storm(), T0 + S))


def test_blast_radius_breaker_refuses_beyond_the_limit_and_reopens_after_the_window():
    r = Responder(parse_policy(EXECUTE_DRAIN))
    got = [outcomes(r.on_anomaly(storm(node=f"node-{i}"), T0 + i * S)) for i in range(4)]
    drains = [o for decisions in got for a, o in decisions if a == "drain_node"]
    assert drains == ["STARTED", "STARTED", "REFUSED_BREAKER", "REFUSED_BREAKER"]
    # a second action on a node already in the window is not a new target
    assert [o for a, o in got[1] if a == "requeue_jobs"] == ["STARTED"]
    later = r.on_anomaly(storm(node="node-9", onset=T0 + 700 * S), T0 + 700 * S)
    assert [o for a, o in outcomes(later) if a == "drain_node"] == ["STARTED"]
    # breakers are per cluster
    other = r.on_anomaly(storm(node="node-5", cluster="c2"), T0 + 3 * S)
    assert [o for a, o in outcomes(other) if a == "drain_node"] == ["STARTED"]


def test_breaker_limit_scales_with_fleet_size():
    policy = parse_policy("guards: {breaker: {fleet_size: 1000, max_fraction: 0.01, min_count: 2}}")
    assert policy.guards.breaker.limit == 10
    assert parse_policy("guards: {breaker: {fleet_size: 50}}").guards.breaker.limit == 2


def test_breaker_survives_a_restart():
    r = Responder(parse_policy(EXECUTE_DRAIN))
    audit = run(r, r.on_anomaly(storm(node="node-1"), T0), T0) + run(r, r.on_anomaly(storm(node="node-2"), T0), T0)
    fresh = Responder(parse_policy(EXECUTE_DRAIN))
    fresh.restore(audit)
    assert [o for a, o in outcomes(fresh.on_anomaly(storm(node="node-3"), T0 + S)) if a == "drain_node"] == \
        ["REFUSED_BREAKER"]


def test_cooldown_skips_the_same_action_on_the_same_target():
    r = Responder(parse_policy(EXECUTE_DRAIN))
    run(r, r.on_anomaly(storm(onset=T0), T0), T0)
    second_episode = r.on_anomaly(storm(onset=T0 + 100 * S), T0 + 100 * S)
    assert [o for a, o in outcomes(second_episode) if a == "drain_node"] == ["SKIPPED_COOLDOWN"]
    third = r.on_anomaly(storm(onset=T0 + 400 * S), T0 + 400 * S)
    assert [o for a, o in outcomes(third) if a == "drain_node"] == ["STARTED"]


@pytest.mark.parametrize("how", ["policy", "env", "file"])
def test_kill_switch_refuses_execution_but_not_alerts(how, tmp_path, monkeypatch):
    text = EXECUTE_DRAIN
    if how == "policy":
        text = text.replace("guards: {", "guards: {kill_switch: true, ")
    elif how == "env":
        monkeypatch.setenv(KILL_SWITCH_ENV, "1")
    else:
        stop = tmp_path / "STOP"
        text = text.replace("guards: {", f"guards: {{kill_switch_file: '{stop}', ")
        r = Responder(parse_policy(text))
        assert [o for a, o in outcomes(r.on_anomaly(storm(node="node-1"), T0)) if a == "drain_node"] == ["STARTED"]
        stop.touch()   # engaged while running, no restart
    r = Responder(parse_policy(text))
    decisions = r.on_anomaly(storm(), T0)
    assert outcomes(decisions)[1:] == [("drain_node", "REFUSED_KILL_SWITCH"), ("requeue_jobs", "REFUSED_KILL_SWITCH")]
    assert decisions[0].alert == "firing"
    assert not any(d.request for d in decisions)


def test_kill_switch_does_not_stop_shadow_records():
    monkey = parse_policy("guards: {kill_switch: true}\nrules: [{name: s, match: {kind: pfc_storm}, actions: [drain_node]}]")
    assert outcomes(Responder(monkey).on_anomaly(storm(), T0)) == [("drain_node", "SHADOW")]


def test_not_applicable_when_the_anomaly_names_no_target():
    r = Responder(parse_policy("rules: [{name: s, match: {kind: pfc_storm}, actions: [isolate_port, drain_node]}]"))
    switch_storm = storm()
    switch_storm.entity.CopyFrom(ev.EntityPath(cluster="c1", switch="leaf-1", port="Ethernet8"))
    assert outcomes(r.on_anomaly(switch_storm, T0)) == [("isolate_port", "SHADOW"), ("drain_node", "NOT_APPLICABLE")]


def test_straggler_rule_matches_on_cause_code():
    r = Responder(parse_policy(EXECUTE_DRAIN))
    straggler = ev.AnomalyEvent(id="s1", dedup_key="straggler:c1/job=j1/rank=3", kind="straggler",
                                severity=ev.SEVERITY_WARNING, lifecycle=ev.LIFECYCLE_OPEN, onset_unix_ns=T0, detected_unix_ns=T0,
                                cause_code="thermal",
                                entity=ev.EntityPath(cluster="c1", node="node-3", device="gpu3", rank="3", job="j1"))
    decisions = r.on_anomaly(straggler, T0)
    assert outcomes(decisions) == [("alert", "UNSPECIFIED"), ("exclude_and_restart", "SHADOW")]
    assert decisions[1].record.target.job == "j1" and decisions[1].record.target.node == "node-3"
    straggler.cause_code = "storm_victim"
    straggler.dedup_key += "x"
    assert r.on_anomaly(straggler, T0) == []


def test_quiet_period_undoes_a_drain_and_flapping_targets_stay_drained():
    r = Responder(parse_policy(EXECUTE_DRAIN))
    run(r, r.on_anomaly(storm(), T0), T0)
    assert r.due_undos(T0 + 120 * S) == []                     # the storm is still open
    r.on_anomaly(storm(lifecycle=ev.LIFECYCLE_RESOLVED), T0 + 10 * S)
    assert r.due_undos(T0 + 30 * S) == []                      # quiet for 20 s < 60 s
    undo = r.due_undos(T0 + 71 * S)
    assert outcomes(undo) == [("resume_node", "STARTED")] and undo[0].request.target.node == "node-7"
    run(r, undo, T0 + 71 * S)
    assert r.held(shadow=False) == [] and r.due_undos(T0 + 500 * S) == []
    # the node comes back: drained again (after the cooldown), and this time it stays drained
    run(r, r.on_anomaly(storm(onset=T0 + 400 * S), T0 + 400 * S), T0 + 400 * S)
    r.on_anomaly(storm(onset=T0 + 400 * S, lifecycle=ev.LIFECYCLE_RESOLVED), T0 + 410 * S)
    flapping = r.due_undos(T0 + 480 * S)
    assert outcomes(flapping) == [("resume_node", "REFUSED_FLAPPING")]
    assert r.due_undos(T0 + 600 * S) == []


def test_failed_execution_is_recorded_as_failed():
    r = Responder(parse_policy(EXECUTE_DRAIN))
    decisions = r.on_anomaly(storm(), T0)
    record = r.on_result(decisions[1], ExecutionResult(FAILED, "scontrol: error"), T0)
    assert ev.Outcome.Name(record.outcome) == "OUTCOME_FAILED" and "scontrol" in record.detail


def test_alerts_once_per_severity_and_resolve():
    r = Responder(parse_policy(EXECUTE_DRAIN))
    run(r, r.on_anomaly(storm(severity=ev.SEVERITY_WARNING), T0), T0)
    same = r.on_anomaly(storm(severity=ev.SEVERITY_WARNING, lifecycle=ev.LIFECYCLE_UPDATE), T0 + S)
    assert [d for d in same if d.alert] == []
    escalated = r.on_anomaly(storm(severity=ev.SEVERITY_CRITICAL, lifecycle=ev.LIFECYCLE_UPDATE), T0 + 2 * S)
    assert [d.alert for d in escalated if d.alert] == ["firing"]
    run(r, escalated, T0 + 2 * S)
    resolved = r.on_anomaly(storm(lifecycle=ev.LIFECYCLE_RESOLVED), T0 + 3 * S)
    assert [d.alert for d in resolved] == ["resolved"]
    run(r, resolved, T0 + 3 * S)
    assert r.on_anomaly(storm(lifecycle=ev.LIFECYCLE_RESOLVED), T0 + 4 * S) == []


# -- hostile and mistaken policy files --------------------------------------------------------------
@pytest.mark.parametrize("text, message", [
    ("rules: [{name: a, match: {kind: pfc_storm}, actions: [drain]}]", "unknown action kind 'drain'"),
    ("rules: [{name: a, match: {kind: pfc_storm}, actions: [alert], extra: 1}]", "rules[0]: unknown key 'extra'"),
    ("mode: yolo", "mode: 'yolo' is not one of shadow, execute"),
    ("execute: [resume_node]", "unknown action kind 'resume_node'"),
    ("guards: {breaker: {max_fraction: .nan}}", "guards.breaker.max_fraction: expected a number"),
    ("guards: {breaker: {max_fraction: 5}}", "expected a number in 0..1, got 5"),
    ("guards: {cooldown_s: -1}", "guards.cooldown_s"),
    ("guards: {kill_switch: 'yes please'}", "expected true or false"),
    ("rules: [{name: a, match: {kind: pfc_storm}, actions: []}]", "at least one action"),
    ("rules: [{name: a, match: {}, actions: [alert]}, {name: a, match: {}, actions: [alert]}]", "duplicate rule name"),
    ("rules: [{name: '../../etc', match: {}, actions: [alert]}]", "rules[0].name"),
    ("rules: {name: a}", "rules: expected a list"),
    ("[1, 2, 3]", "policy: expected a mapping"),
    ("a: &x [1]\nb: *x", "aliases are not allowed"),
    ("!!python/object/apply:os.system ['true']", "not valid YAML"),
    ("rules: [{name: a, match: {kind: pfc_storm, min_severity: fatal}, actions: [alert]}]", "min_severity"),
    ("version: 2", "version"),
    ("{1: a}", "keys must be strings"),
])
def test_bad_policies_are_refused_with_the_path_named(text, message):
    with pytest.raises(PolicyError) as err:
        parse_policy(text)
    assert message in str(err.value)


def test_oversized_and_binary_policy_files_are_refused(tmp_path):
    big = tmp_path / "big.yaml"
    big.write_text("# " + "x" * 300_000)
    with pytest.raises(PolicyError, match="bytes"):
        load_policy(big)
    binary = tmp_path / "bin.yaml"
    binary.write_bytes(b"\xff\xfe\x00rules")
    with pytest.raises(PolicyError, match="not UTF-8"):
        load_policy(binary)
    with pytest.raises(PolicyError, match="cannot read"):
        load_policy(tmp_path / "missing.yaml")


def test_the_shipped_example_policy_is_valid_and_shadow():
    from pathlib import Path

    policy = load_policy(Path(__file__).parent.parent / "deploy" / "policy.example.yaml")
    assert policy.mode == "shadow" and policy.rules


def test_a_flood_of_forged_storms_across_the_fabric_acts_on_at_most_the_blast_radius():
    """Whatever arrives (a buggy detector, a compromised collector), execution stays bounded."""
    policy = parse_policy(EXECUTE_DRAIN.replace("min_count: 2", "min_count: 2, fleet_size: 1000"))
    r = Responder(policy)
    started = []
    for i in range(2000):   # every node of a 2000-node fabric "storms" within 100 s
        for d in r.on_anomaly(storm(node=f"node-{i:04d}", onset=T0 + i * 10**6), T0 + i * 50 * 10**6):
            if d.request is not None:
                started.append(d.request.target.node)
    assert len(set(started)) == policy.guards.breaker.limit == 10


def straggler(job: str, node: str = "node-7", cluster: str = "c1", at=T0) -> ev.AnomalyEvent:
    return ev.AnomalyEvent(id=f"s-{job}", dedup_key=f"straggler:{cluster}/job={job}/rank=3", kind="straggler",
                           severity=ev.SEVERITY_WARNING, lifecycle=ev.LIFECYCLE_OPEN, onset_unix_ns=at,
                           detected_unix_ns=at, cause_code="thermal",
                           entity=ev.EntityPath(cluster=cluster, node=node, device="gpu3", rank="3", job=job))


RESTART = EXECUTE_DRAIN.replace("execute: [drain_node, requeue_jobs]",
                                "execute: [drain_node, requeue_jobs, exclude_and_restart]")
SLURM_A = {a: "slurm:a" for a in ("drain_node", "requeue_jobs", "exclude_and_restart")}


def started(responder, event, action, now=T0):
    return [o for a, o in outcomes(responder.on_anomaly(event, now)) if a == action]


def test_one_node_cannot_restart_any_number_of_jobs():
    """#13: forged rank steps of five jobs on one node restarted all five; jobs are counted now."""
    r = Responder(parse_policy(RESTART), domain_for=SLURM_A)
    got = [started(r, straggler(f"j{i}"), "exclude_and_restart") for i in range(5)]
    assert got == [["STARTED"], ["STARTED"], ["REFUSED_BREAKER"], ["REFUSED_BREAKER"], ["REFUSED_BREAKER"]]
    refused = [d for d in r.on_anomaly(straggler("j9"), T0) if d.record.action == "exclude_and_restart"][0]
    assert "2 jobs of slurm:a" in refused.record.reason and "limit 2" in refused.record.reason
    # nodes are a separate budget: the node itself can still be drained
    assert started(r, storm(node="node-7"), "drain_node") == ["STARTED"]


def test_invented_cluster_names_share_the_executors_budget():
    """#13: six nodes labelled with six invented clusters were all drained (one window per cluster)."""
    r = Responder(parse_policy(EXECUTE_DRAIN), domain_for=SLURM_A)
    drains = [started(r, storm(node=f"node-{i}", cluster=f"made-up-{i}"), "drain_node") for i in range(6)]
    assert drains == [["STARTED"]] * 2 + [["REFUSED_BREAKER"]] * 4
    # and a cooldown is the node's, whatever cluster the anomaly claims
    again = started(r, storm(node="node-0", cluster="yet-another", onset=T0 + S), "drain_node", now=T0 + S)
    assert again == ["SKIPPED_COOLDOWN"]


def test_each_executor_domain_has_its_own_budget():
    domains = {"drain_node": "slurm:a", "requeue_jobs": "slurm:a", "exclude_and_restart": "command:/bin/launch"}
    r = Responder(parse_policy(RESTART), domain_for=domains)
    assert [started(r, storm(node=f"node-{i}"), "drain_node") for i in range(3)] == \
        [["STARTED"], ["STARTED"], ["REFUSED_BREAKER"]]
    assert [started(r, straggler(f"j{i}"), "exclude_and_restart") for i in range(3)] == \
        [["STARTED"], ["STARTED"], ["REFUSED_BREAKER"]]


def test_jobs_a_drain_requeued_count_as_restarted_and_survive_a_restart():
    policy = parse_policy(RESTART)
    r = Responder(policy, domain_for=SLURM_A)
    audit = []
    for d in r.on_anomaly(storm(node="node-1"), T0):
        audit.append(d.record)
        if d.request is not None and d.request.action == "drain_node":
            audit.append(r.on_result(d, ExecutionResult(DONE, "requeued", affected=("101", "102")), T0))
    assert started(r, straggler("j3", node="node-2"), "exclude_and_restart") == ["REFUSED_BREAKER"]
    # a restart without a target job charges the anomaly's jobs, kept in the audit record
    fresh = Responder(policy, domain_for=SLURM_A)
    related = storm(node="node-3")
    related.related.add(cluster="c1", job="j-77")
    [restart] = [d for d in Responder(parse_policy(RESTART.replace("actions: [alert, drain_node, requeue_jobs]",
                                                                    "actions: [exclude_and_restart]")),
                                      domain_for=SLURM_A).on_anomaly(related, T0)]
    assert restart.record.outcome == ev.OUTCOME_STARTED and restart.record.detail == "jobs: j-77,job-42"
    fresh.restore([restart.record])
    assert fresh.modes[False].breaker.in_window("slurm:a", "jobs", T0 / 1e9) == 2


def test_an_anomaly_older_than_the_max_age_is_alerted_not_acted_on():
    """#13: a 3-day-old forged storm drained a node. Old evidence (or a backlog) only alerts."""
    r = Responder(parse_policy(EXECUTE_DRAIN))
    old = storm(node="node-1", onset=T0 - 3 * 86400 * S)
    decisions = r.on_anomaly(old, T0)
    assert outcomes(decisions) == [("alert", "UNSPECIFIED"), ("drain_node", "REFUSED_STALE"),
                                   ("requeue_jobs", "REFUSED_STALE")]
    assert decisions[0].alert == "firing" and all(d.request is None for d in decisions)
    assert "259200 s old" in decisions[1].record.reason
    # fresh evidence, but the record sat on Kafka for an hour (the responder was down): too old too
    backlog = r.on_anomaly(storm(node="node-2"), T0, received_ns=T0 - 3600 * S)
    assert [o for a, o in outcomes(backlog) if a == "drain_node"] == ["REFUSED_STALE"]
    # an anomaly carrying no time at all cannot be shown to be fresh
    timeless = storm(node="node-3", onset=0)
    assert [o for a, o in outcomes(r.on_anomaly(timeless, T0)) if a == "drain_node"] == ["REFUSED_STALE"]
    # within the limit it acts; shadow mode shows the same refusal
    assert started(r, storm(node="node-4", onset=T0 - 60 * S), "drain_node") == ["STARTED"]
    shadow = Responder(parse_policy(EXECUTE_DRAIN.replace("mode: execute", "mode: shadow")))
    assert started(shadow, old, "drain_node") == ["REFUSED_STALE"]


def test_max_anomaly_age_and_breaker_limits_are_validated_with_their_path():
    policy = parse_policy("guards: {max_anomaly_age_s: 120, breaker: {max_jobs_restarted: 5, max_ports_isolated: 1}}")
    assert policy.guards.max_anomaly_age_s == 120 and policy.guards.breaker.limits == {
        "nodes": 2, "jobs": 5, "ports": 1}
    for text, path in (("guards: {max_anomaly_age_s: 0}", "guards.max_anomaly_age_s"),
                       ("guards: {breaker: {max_jobs_restarted: -1}}", "guards.breaker.max_jobs_restarted"),
                       ("guards: {breaker: {max_ports: 3}}", "guards.breaker: unknown key 'max_ports'")):
        with pytest.raises(PolicyError, match=path.replace(".", r"\.")):
            parse_policy(text)


def test_fresh_node_names_cannot_grow_the_responders_state_without_bound(monkeypatch):
    from fabricwatch.actions import responder as responder_module

    monkeypatch.setattr(responder_module, "MAX_TRACKED_TARGETS", 100)
    r = Responder(parse_policy(EXECUTE_DRAIN))
    held = [d for d in r.on_anomaly(storm(node="node-held"), T0) if d.request is not None]
    assert held
    for i in range(1000):
        r.on_anomaly(storm(node=f"fresh-{i}", lifecycle=ev.LIFECYCLE_RESOLVED), T0 + i * S)
    assert len(r.last_anomaly_s) <= 100 and r.forgotten_targets >= 900
    assert "node-held" in r.last_anomaly_s and r.held(shadow=False) == ["drain_node:c1/node-held"]
