"""One vocabulary: every kind a detector emits is in it, one entity spelling round-trips, and the
three event filters (policy, feed, dashboard) answer alike on the same events."""
from __future__ import annotations

import ast
import importlib
import itertools
from pathlib import Path

import pytest

from fabricwatch.actions.policy import PolicyError, parse_policy
from fabricwatch.dashboard.shapes import anomaly_dict, decision_dict
from fabricwatch.dashboard.shapes import entity_path as dashboard_path
from fabricwatch.dashboard.state import FabricState
from fabricwatch.dashboard.views import FeedFilter
from fabricwatch.evaluation.matching import entity_path as truth_spelling
from fabricwatch.models import node_health, vocabulary
from fabricwatch.models.event_filter import EventFilter
from fabricwatch.models.findings import EntityRef, Finding
from fabricwatch.models.vocabulary import ANOMALY_KINDS, CAUSE_CODES
from fabricwatch.protos.v1 import events_pb2 as ev
from fabricwatch.simulator import labels
from fabricwatch.streams.cloudevents import FeedEvent
from fabricwatch.streams.events import (OUTCOME_NAME, SEVERITY_NAME, SEVERITY_PROTO, anomaly_facts, entity_proto,
                                        entity_ref)
from fabricwatch.streams.feed import Subscription

MODELS = Path(__file__).resolve().parents[1] / "models"


# ------------------------------------------------------------------ kinds and causes
def _emitted() -> tuple[dict[str, set[str]], dict[str, set[str]], list[str]]:
    """Per models/ module: the kinds its `Finding(...)` (and `_occurrence(...)`) calls name and the
    cause codes they set, resolved through the module's globals; sites that pass a kind on
    from another finding or a parameter are listed apart."""
    kinds: dict[str, set[str]] = {}
    causes: dict[str, set[str]] = {}
    passed_on: list[str] = []
    for path in sorted(MODELS.glob("*.py")):
        module = importlib.import_module(f"fabricwatch.models.{path.stem}")
        tree = ast.parse(path.read_text())

        def value(node: ast.expr, module=module) -> str | None:
            if isinstance(node, ast.Constant) and isinstance(node.value, str):
                return node.value
            if isinstance(node, ast.Name) and isinstance(getattr(module, node.id, None), str):
                return getattr(module, node.id)
            return None

        for call in (n for n in ast.walk(tree) if isinstance(n, ast.Call)):
            name = call.func.id if isinstance(call.func, ast.Name) else getattr(call.func, "attr", "")
            if name not in ("Finding", "_occurrence"):
                continue
            kind = call.args[0] if call.args else next((k.value for k in call.keywords if k.arg == "kind"), None)
            if kind is not None:
                found = value(kind)
                if found is None:
                    passed_on.append(f"{path.stem}:{ast.unparse(kind)}")
                else:
                    kinds.setdefault(path.stem, set()).add(found)
            for k in call.keywords:
                if k.arg == "cause" and value(k.value) is not None:
                    causes.setdefault(path.stem, set()).add(value(k.value))
    return kinds, causes, passed_on


def test_every_kind_a_detector_emits_is_in_the_vocabulary_and_every_kind_is_emitted():
    kinds, _, passed_on = _emitted()
    emitted = set().union(*kinds.values())
    assert emitted <= ANOMALY_KINDS, emitted - ANOMALY_KINDS
    assert emitted == ANOMALY_KINDS, f"in the vocabulary, emitted by no detector: {ANOMALY_KINDS - emitted}"
    # what is not a literal or a module constant only passes on the kind of a finding already made
    assert all(site.split(":")[1] in ("opened.kind", "f.kind", "kind") for site in passed_on), passed_on
    for path in MODELS.glob("*.py"):
        module = importlib.import_module(f"fabricwatch.models.{path.stem}")
        if isinstance(getattr(module, "KIND", None), str):
            assert module.KIND in ANOMALY_KINDS, path.stem


def test_every_cause_code_a_detector_sets_is_in_the_vocabulary():
    _, causes, _ = _emitted()
    assert set().union(*causes.values()) <= CAUSE_CODES
    assert set(node_health.CAUSES) | {node_health.NONE, node_health.UNKNOWN} <= CAUSE_CODES
    assert set(labels.HANG_ROOTS) <= CAUSE_CODES
    from fabricwatch.models import storm_locator
    assert {storm_locator.CAUSE_STUCK_HOST, storm_locator.CAUSE_SILENT_HOST, storm_locator.CAUSE_SWITCH_PORT} <= CAUSE_CODES


def test_the_evaluation_scores_every_kind_but_the_catch_all():
    from fabricwatch.evaluation.scenarios import FAULT_CLASSES
    assert sorted(FAULT_CLASSES) == sorted(ANOMALY_KINDS - {vocabulary.UNKNOWN_ANOMALY})


def test_the_policy_knows_exactly_the_vocabulary():
    for kind in sorted(ANOMALY_KINDS):
        assert parse_policy(f"rules: [{{name: r, match: {{kind: {kind}}}, actions: [alert]}}]").rules
    with pytest.raises(PolicyError, match="unknown anomaly kind 'gpu_fault'"):
        parse_policy("rules: [{name: r, match: {kind: gpu_fault}, actions: [alert]}]")
    with pytest.raises(PolicyError, match="unknown cause code"):
        parse_policy("rules: [{name: r, match: {cause: overheated}, actions: [alert]}]")


def test_the_cli_refuses_an_expected_kind_no_detector_emits(capsys):
    from fabricwatch.cli import build_parser
    assert build_parser().parse_args(["up", "--expect", "pfc_storm,straggler"]).expect == "pfc_storm,straggler"
    with pytest.raises(SystemExit):
        build_parser().parse_args(["up", "--expect", "pfc_storm,stragler"])
    assert "unknown anomaly kind stragler" in capsys.readouterr().err


def test_severities_lifecycles_and_outcomes_are_the_protobuf_enums_names():
    def names(enum, prefix: str) -> list[str]:
        return [v.name.removeprefix(prefix).lower() for v in enum.DESCRIPTOR.values if v.number]

    assert list(vocabulary.SEVERITIES) == names(ev.Severity, "SEVERITY_")
    assert list(vocabulary.LIFECYCLES) == names(ev.Lifecycle, "LIFECYCLE_")
    assert sorted(vocabulary.OUTCOMES) == sorted(names(ev.Outcome, "OUTCOME_")) == sorted(OUTCOME_NAME.values())
    assert {SEVERITY_NAME[SEVERITY_PROTO[s]] for s in vocabulary.SEVERITIES} == set(vocabulary.SEVERITIES)
    ranks = [vocabulary.SEVERITY_RANK[s] for s in (vocabulary.UNSPECIFIED, *vocabulary.SEVERITIES)]
    assert ranks == sorted(set(ranks))


# ------------------------------------------------------------------ one entity spelling
SWITCHES = {"leaf-0", "spine-1"}
SHAPES = {
    "node": (EntityRef(cluster="c1", node="node-7"), "node-7"),
    "nic_port": (EntityRef(cluster="c1", node="node-7", device="mlx5_3", port="1"), "node-7/mlx5_3/1"),
    "gpu": (EntityRef(cluster="c1", node="node-7", device="gpu2"), "node-7/gpu2"),
    "switch": (EntityRef(cluster="c1", switch="spine-1"), "spine-1"),
    "switch_port": (EntityRef(cluster="c1", switch="leaf-0", port="Ethernet8"), "leaf-0/Ethernet8"),
    "switch_queue_port": (EntityRef(cluster="c1", switch="leaf-0", device="queue3", port="Ethernet8"),
                          "leaf-0/queue3/Ethernet8"),
    "rank": (EntityRef(cluster="c1", job="job-a", rank="17"), "job=job-a/rank=17"),
    "job": (EntityRef(cluster="c1", job="job-a"), "job=job-a"),
}


@pytest.mark.parametrize("shape", sorted(SHAPES))
def test_path_spelling_and_protobuf_round_trip(shape):
    ref, local = SHAPES[shape]
    assert ref.local_path() == local and ref.path() == f"c1/{local}"
    assert EntityRef.parse(local, is_switch=SWITCHES.__contains__) == EntityRef(**{**ref.__dict__, "cluster": ""})
    assert EntityRef.parse(ref.path(), with_cluster=True, is_switch=SWITCHES.__contains__) == ref
    wire = entity_proto(ref).SerializeToString()
    assert entity_ref(ev.EntityPath.FromString(wire)) == ref


def test_dedup_keys_keep_their_wire_spelling():
    rank = EntityRef(cluster="c1", node="n1", device="gpu3", job="j", rank="3")
    assert Finding("straggler", "open", rank).dedup_key == "straggler:c1/job=j/rank=3"
    assert Finding("link_down", "open", SHAPES["nic_port"][0]).dedup_key == "link_down:c1/node-7/mlx5_3/1"


def test_ground_truth_dashboard_and_events_spell_an_entity_alike():
    on_gpu = EntityRef(cluster="c1", node="node-7", device="gpu2", job="job-a", rank="17")
    assert truth_spelling(entity_proto(on_gpu)) == labels.rank_path("job-a", 17) == on_gpu.local_path()
    assert dashboard_path(entity_proto(on_gpu)) == labels.gpu_path("node-7", 2)    # the dashboard files it on its GPU
    assert dashboard_path(entity_proto(SHAPES["rank"][0])) == labels.rank_path("job-a", 17)
    assert labels.job_path("job-a") == SHAPES["job"][1]
    nic = SHAPES["nic_port"][0]
    assert truth_spelling(entity_proto(nic)) == dashboard_path(entity_proto(nic)) == labels.nic_path("node-7", "mlx5_3/1")
    # the ground truth names a switch port, a detector its queue on that port
    assert truth_spelling(entity_proto(SHAPES["switch_queue_port"][0])) == labels.port_path("leaf-0", "Ethernet8")


@pytest.mark.parametrize("bad", ["", "a//b", "job=j/x=3", "a/b/c/d", "job=j/rank=3/x"])
def test_parse_refuses_what_no_entity_spells(bad):
    with pytest.raises(ValueError):
        EntityRef.parse(bad)


# ------------------------------------------------------------------ one filter core
def _events() -> list[ev.AnomalyEvent]:
    entities = [SHAPES[s][0] for s in ("nic_port", "gpu", "switch_port", "rank")]
    entities.append(EntityRef(cluster="c2", node="node-9", device="gpu0", job="job-b", rank="0"))
    out = []
    for i, (kind, sev, ent) in enumerate(itertools.product(("pfc_storm", "straggler", "link_down"),
                                                           (ev.SEVERITY_INFO, ev.SEVERITY_WARNING,
                                                            ev.SEVERITY_CRITICAL), entities)):
        related = [entity_proto(EntityRef(cluster=ent.cluster, job="job-c", rank="1"))] if i % 4 == 0 else []
        out.append(ev.AnomalyEvent(id=f"e{i}", dedup_key=f"{kind}:{ent.path()}", kind=kind, severity=sev,
                                   lifecycle=ev.LIFECYCLE_OPEN, entity=entity_proto(ent), related=related,
                                   cause_code="thermal" if i % 3 else "storm_victim"))
    return out


FILTERS = [dict(kind=k, min_severity=s, cluster=c, job=j) for k, s, c, j in itertools.product(
    ("", "pfc_storm", "straggler"), ("info", "warning", "critical"), ("", "c1"), ("", "job-a", "job-c"))]


def _policy_says(f: dict, event: ev.AnomalyEvent) -> bool | None:
    if f["job"]:
        return None                                  # a policy rule has no job field
    match = f"{{min_severity: {f['min_severity']}" + (f", kind: {f['kind']}" if f["kind"] else "") \
        + (f", cluster: {f['cluster']}" if f["cluster"] else "") + "}"
    rule = parse_policy(f"rules: [{{name: r, match: {match}, actions: [alert]}}]").rules[0]
    return rule.match.matches(event)


def _feed_says(f: dict, event: ev.AnomalyEvent) -> bool:
    sub = Subscription(kinds=frozenset({f["kind"]} - {""}), min_severity=SEVERITY_PROTO[f["min_severity"]],
                       cluster=f["cluster"], job=f["job"])
    return sub.matches(FeedEvent({"type": "io.fabricwatch.anomaly.v1.open"}, event))


def _dashboard_says(f: dict, event: ev.AnomalyEvent, state: FabricState) -> bool | None:
    if f["cluster"]:
        return None                                  # a dashboard shows one cluster
    flt = FeedFilter.parse({"kind": f["kind"], "severity": f["min_severity"], "job": f["job"]})
    return flt.matches({"type": "anomaly", "data": anomaly_dict(event)}, state)


def test_policy_feed_and_dashboard_filters_agree_on_the_same_events():
    state, events = FabricState(), _events()
    compared = 0
    for f in FILTERS:
        core = EventFilter(kinds=frozenset({f["kind"]} - {""}), min_severity=f["min_severity"],
                           clusters=frozenset({f["cluster"]} - {""}), job=f["job"])
        for event in events:
            want = core.admits(anomaly_facts(event))
            answers = [_policy_says(f, event), _feed_says(f, event), _dashboard_says(f, event, state)]
            assert all(a == want for a in answers if a is not None), (f, event.id, want, answers)
            compared += sum(a is not None for a in answers)
    assert compared > 2000
    # and the filters do filter: each field turns some events away
    admitted = [sum(EventFilter(**kw).admits(anomaly_facts(e)) for e in events)
                for kw in ({}, {"kinds": frozenset({"straggler"})}, {"min_severity": "critical"},
                           {"clusters": frozenset({"c2"})}, {"job": "job-c"})]
    assert admitted[0] == len(events) and all(0 < n < len(events) for n in admitted[1:])


def test_decisions_match_on_their_anomalys_kind_and_target_in_feed_and_dashboard():
    target = SHAPES["rank"][0]
    decision = ev.ActionDecision(idempotency_key="k", anomaly_kind="straggler", anomaly_dedup_key="gone",
                                 action="exclude_and_restart", target=entity_proto(target), outcome=ev.OUTCOME_SHADOW)
    state = FabricState()
    for kind, job, want in (("straggler", "job-a", True), ("pfc_storm", "", False), ("", "job-b", False)):
        # the decision's anomaly is gone: no severity bound turns it away
        flt = FeedFilter.parse({"kind": kind, "job": job, "severity": "critical"})
        assert flt.matches({"type": "decision", "data": decision_dict(decision)}, state) is want
        sub = Subscription(kinds=frozenset({kind} - {""}), job=job, include_actions=True,
                           min_severity=ev.SEVERITY_CRITICAL)
        assert sub.matches(FeedEvent({"type": "io.fabricwatch.action.v1.shadow"}, decision)) is want


def test_the_dashboards_switch_filter_counts_a_nic_by_its_leaf():
    nic = SHAPES["nic_port"][0]
    event = ev.AnomalyEvent(id="x", kind="link_down", severity=ev.SEVERITY_CRITICAL, entity=entity_proto(nic))
    facts = anomaly_facts(event)
    assert not EventFilter(switch="leaf-0").admits(facts)
    assert EventFilter(switch="leaf-0").admits(facts, peer_switches={"leaf-0"})
    assert EventFilter(job="job-z").admits(facts, job_nodes={"node-7"})
