"""Impact in GPU-hours: the model, the stream layer's job lookup, the wire, and every surface."""
from __future__ import annotations

import io
import time

import pytest

from fabricwatch.actions.alerts.alertmanager import am_alert
from fabricwatch.actions.alerts.message import alert_from_anomaly
from fabricwatch.actions.policy import PolicyError, parse_policy
from fabricwatch.console import LiveView, format_event
from fabricwatch.dashboard.state import FabricState
from fabricwatch.dashboard.views import open_summary
from fabricwatch.models.findings import CRITICAL, OPEN, RESOLVED, WARNING, EntityRef, Evidence, Finding
from fabricwatch.models.impact import (
    DEFAULT_SINCE_CHECKPOINT_S, ESTIMATED, MEASURED, SLOWDOWN_PRIOR, ImpactModel, JobShare, projected_gpu_hours,
)
from fabricwatch.models.topology import rail_optimised
from fabricwatch.protos.v1 import events_pb2 as ev
from fabricwatch.protos.v1 import feed_pb2 as fpb
from fabricwatch.streams import facts as fact_codec
from fabricwatch.streams.cloudevents import FeedEvent
from fabricwatch.streams.events import to_event
from fabricwatch.streams.facts import FactBook, JobPlacement
from fabricwatch.streams.feed import Subscription
from fabricwatch.streams.impact import assess

S = 10**9
HOUR = 3600 * S
T0 = 1_800_000_000 * S


# ------------------------------------------------------------------------------- the model
def test_a_straggler_costs_its_whole_job_by_its_measured_slowdown():
    i = ImpactModel().assess("straggler", WARNING, T0, T0 + 2 * HOUR, jobs=(JobShare("j", 64),),
                             evidence={"slowdown": 1.25})
    assert i.basis == MEASURED and i.gpus == 64
    assert i.gpu_hours_per_hour == pytest.approx(64 * 0.2)
    assert i.gpu_hours_lost == pytest.approx(64 * 0.2 * 2)
    assert not i.restarted


def test_unknown_jobs_fall_back_to_the_node_gpus_and_the_kind_prior():
    i = ImpactModel().assess("link_flap", WARNING, T0, T0 + HOUR, jobs=None, node_gpus=8)
    assert i.basis == ESTIMATED
    assert i.gpu_hours_per_hour == pytest.approx(8 * SLOWDOWN_PRIOR["link_flap"])
    unknown_kind = ImpactModel().assess("something_new", WARNING, T0, T0 + HOUR, jobs=(), node_gpus=8)
    assert unknown_kind.gpu_hours_per_hour == pytest.approx(8 * SLOWDOWN_PRIOR["unknown_anomaly"])


def test_a_stall_costs_every_gpu_plus_the_work_redone_from_the_checkpoint():
    jobs = (JobShare("a", 16), JobShare("b", 8, since_checkpoint_s=600.0))
    i = ImpactModel().assess("gpu_xid", CRITICAL, T0, T0 + HOUR // 2, jobs=jobs)
    assert i.restarted and i.gpu_hours_per_hour == 24.0
    redo = 16 * DEFAULT_SINCE_CHECKPOINT_S / 3600 + 8 * 600 / 3600
    assert i.gpu_hours_lost == pytest.approx(24 * 0.5 + redo)
    # the same kind at warning severity (the job survived the XID) is a slowdown, no restart
    assert not ImpactModel().assess("gpu_xid", WARNING, T0, T0 + HOUR, jobs=jobs).restarted


def test_pause_duty_is_the_storm_victims_lost_fraction():
    i = ImpactModel().assess("pfc_storm", WARNING, T0, T0 + HOUR, jobs=(JobShare("j", 10),),
                             evidence={"rx_pause_duty": 0.3})
    assert i.gpu_hours_per_hour == pytest.approx(3.0)


def test_resolved_keeps_what_was_lost_and_stops_the_rate_and_time_never_runs_backwards():
    m = ImpactModel()
    done = m.assess("link_downgrade", WARNING, T0, T0 + HOUR, jobs=(JobShare("j", 8),), open=False)
    assert done.gpu_hours_per_hour == 0.0 and done.gpu_hours_lost == pytest.approx(4.0)
    assert m.assess("link_downgrade", WARNING, T0, T0 - HOUR, jobs=(JobShare("j", 8),)).gpu_hours_lost == 0.0
    weird = m.assess("straggler", WARNING, T0, T0 + HOUR, jobs=(JobShare("j", 8),),
                     evidence={"slowdown": float("nan")})
    assert weird.gpu_hours_per_hour == pytest.approx(8 * SLOWDOWN_PRIOR["straggler"])
    with pytest.raises(ValueError):
        ImpactModel(since_checkpoint_s=-1)


def test_projection_adds_the_rate_since_the_latest_event():
    assert projected_gpu_hours(1.0, 4.0, T0, T0 + HOUR // 4) == pytest.approx(2.0)
    assert projected_gpu_hours(1.0, 4.0, T0, T0 - HOUR) == 1.0


# ------------------------------------------------------------------- the stream layer
def _finding(kind="link_downgrade", state=OPEN, severity=WARNING, node="node-0002", job="", related=(),
             evidence=(), onset_ns=T0, detected_ns=T0 + HOUR) -> Finding:
    entity = EntityRef(cluster="c1", job=job, rank="3") if job else EntityRef(cluster="c1", node=node,
                                                                                 device="mlx5_0", port="1")
    return Finding(kind, state, entity, severity=severity, onset_ns=onset_ns, detected_ns=detected_ns,
                   evidence=list(evidence), related=list(related))


def test_placements_name_the_jobs_of_a_node_with_their_gpus():
    topo = rail_optimised("c1", n_nodes=4, gpus_per_node=4, nodes_per_unit=4, n_spines=1)
    book = FactBook(topo)
    book.apply(JobPlacement("c1", "job-a", ("node-0001", "node-0002"), T0, ranks=8))
    book.apply(JobPlacement("c1", "job-b", ("node-0002", "node-0003", "node-0004"), T0))   # ranks unknown
    [f] = assess([_finding()], book, topo)
    assert f.impact_basis == MEASURED
    assert f.impact_gpu_hours_per_hour == pytest.approx((8 + 3 * 4) * SLOWDOWN_PRIOR["link_downgrade"])
    assert f.impact_gpu_hours == pytest.approx(f.impact_gpu_hours_per_hour)
    # the switch end of the same link: the node at the far end of the port
    port = EntityRef(cluster="c1", switch="leaf-u0-r0", port="Ethernet1")
    peer = topo.peer_of("leaf-u0-r0", "Ethernet1").nic.node
    [sw] = assess([Finding("link_downgrade", OPEN, port, onset_ns=T0, detected_ns=T0 + HOUR)], book, topo)
    assert sw.impact_basis == (MEASURED if book.jobs_by_node.get(peer) else ESTIMATED)
    # a node without jobs: its GPUs stand in
    [idle] = assess([_finding(node="node-0009")], book, topo)
    assert idle.impact_basis == ESTIMATED
    assert idle.impact_gpu_hours_per_hour == pytest.approx(4 * SLOWDOWN_PRIOR["link_downgrade"])


def test_a_storm_counts_the_jobs_of_its_victims_and_a_job_anomaly_its_own_world():
    book = FactBook()
    book.apply(JobPlacement("c1", "job-v", ("node-0005",), T0, ranks=16))
    victims = [EntityRef(cluster="c1", node="node-0005", device="mlx5_1", port="1"),
               EntityRef(cluster="c1", node="node-0006", device="mlx5_1", port="1")]
    [storm] = assess([_finding("pfc_storm", related=victims, evidence=[Evidence("rx_pause_duty", 0.5, 0.1, "s/s")])],
                     book, None)
    assert storm.impact_gpu_hours_per_hour == pytest.approx(16 * 0.5)
    [alone] = assess([_finding("pfc_storm", node="node-0100", related=victims[1:])], FactBook(), None)
    assert alone.impact_basis == ESTIMATED and alone.impact_gpu_hours_per_hour == pytest.approx(2 * 8 * 0.5)
    [slow] = assess([_finding("straggler", job="job-s", evidence=[Evidence("slowdown", 2.0, 1.5, "x")])],
                    FactBook(), None, job_gpus=lambda cluster, job: 32)
    assert slow.impact_basis == MEASURED and slow.impact_gpu_hours_per_hour == pytest.approx(16.0)


def test_impact_goes_out_on_the_event_and_leaves_the_ids_alone():
    plain = _finding()
    [priced] = assess([plain], FactBook(), None)
    e = to_event(priced, emitted_ns=0)
    assert e.id == to_event(plain, emitted_ns=5).id == plain.event_id
    back = ev.AnomalyEvent.FromString(e.SerializeToString())
    assert back.impact_basis == ESTIMATED
    assert back.impact_gpu_hours == pytest.approx(priced.impact_gpu_hours)
    assert back.impact_gpu_hours > 0
    assert back.impact_gpu_hours_per_hour == pytest.approx(8 * SLOWDOWN_PRIOR["link_downgrade"])
    [gone] = assess([_finding(state=RESOLVED)], FactBook(), None)
    assert to_event(gone, 0).impact_gpu_hours_per_hour == 0.0


def test_placement_facts_carry_the_job_size():
    p = JobPlacement("c1", "job-a", ("node-0001",), T0, ranks=8)
    assert fact_codec.decode(fact_codec.encode(p)[1]) == p
    book = FactBook()
    book.apply(p)
    assert book.job_ranks("c1", "job-a") == 8 and book.job_ranks("c1", "nope") == 0


def test_the_pipeline_prices_a_straggler_from_its_ranks():
    from fabricwatch.simulator.host_faults import Straggler
    from fabricwatch.simulator.cluster import ClusterSimulator
    from fabricwatch.simulator.workload import Job
    from fabricwatch.simulator.encoding import COLLECTOR_CADENCE
    from fabricwatch.streams.pipeline import DetectionPipeline
    from fabricwatch.streams.replay import replay

    topo = rail_optimised("c1", n_nodes=4, gpus_per_node=2, nodes_per_unit=4, n_spines=1)
    sim = ClusterSimulator(topo, seed=3, jobs=[Job("job-a", ("node-0001", "node-0002", "node-0003", "node-0004"))],
                           faults=[Straggler("node-0002", gpu=1, onset_s=4.0, offset_s=20.0, factor=2.0,
                                             cause="thermal")],
                           cadence=COLLECTOR_CADENCE, start_unix_ns=time.time_ns() - 60 * S)   # not ahead of the clock
    events = replay([s for tick in sim.run(30) for s in tick], DetectionPipeline(topology=topo)).events
    stragglers = [e for e in events if e.kind == "straggler"]
    assert stragglers and all(e.impact_basis == MEASURED for e in stragglers)
    opened = stragglers[0]
    assert 0 < opened.impact_gpu_hours_per_hour <= 8          # 8 ranks, at most all of them lost
    lost = [e.impact_gpu_hours for e in stragglers]
    assert lost == sorted(lost)                                # grows while open, kept on resolve


# ------------------------------------------------------------------------------ surfaces
def _event(dedup, lost, rate, basis=MEASURED, t_s=0, severity=ev.SEVERITY_WARNING, lifecycle=ev.LIFECYCLE_OPEN):
    return ev.AnomalyEvent(id=f"{dedup}-{t_s}-{lifecycle}", dedup_key=dedup, kind="link_downgrade", severity=severity,
                           lifecycle=lifecycle, entity=ev.EntityPath(cluster="c1", node=dedup),
                           onset_unix_ns=T0, detected_unix_ns=T0 + t_s * S, impact_gpu_hours=lost,
                           impact_gpu_hours_per_hour=rate, impact_basis=basis)


def test_policy_thresholds_on_impact_and_their_validation():
    policy = parse_policy("rules: [{name: costly, match: {min_severity: info, min_impact_gpu_hours: 10,"
                          " min_impact_gpu_hours_per_hour: 2}, actions: [alert]}]")
    assert policy.rules_for(_event("a", 12.0, 4.0))
    assert not policy.rules_for(_event("a", 9.0, 4.0))
    assert not policy.rules_for(_event("a", 12.0, 1.0))
    assert parse_policy("rules: [{name: any, match: {}, actions: [alert]}]").rules_for(_event("a", 0.0, 0.0))
    for bad in ("-1", "'lots'", "true", ".nan", "1e12"):
        with pytest.raises(PolicyError, match="min_impact_gpu_hours"):
            parse_policy(f"rules: [{{name: r, match: {{min_impact_gpu_hours: {bad}}}, actions: [alert]}}]")


def test_alerts_carry_the_impact_in_text_and_annotations_not_in_the_identity():
    alert = alert_from_anomaly(_event("node-0001", 12.5, 64.0, basis=ESTIMATED))
    assert "Impact: 12.5 GPU-hours lost, 64 GPU-hours/h while open (estimated)" in alert.body
    item = am_alert(alert)
    assert item["annotations"]["impact_gpu_hours"] == "12.5"
    assert item["annotations"]["impact_gpu_hours_per_hour"] == "64"
    later = am_alert(alert_from_anomaly(_event("node-0001", 99.0, 64.0, t_s=60)))
    assert later["labels"] == item["labels"]              # same alert in Alertmanager as its cost grows
    resolved = alert_from_anomaly(_event("node-0001", 20.0, 0.0, lifecycle=ev.LIFECYCLE_RESOLVED))
    assert "Impact: 20 GPU-hours lost (measured)" in resolved.body
    assert "Impact" not in alert_from_anomaly(_event("node-0001", 0.0, 0.0, basis="")).body


def test_dashboard_lists_open_anomalies_by_what_they_cost_by_now():
    state = FabricState(cluster="c1")
    state.add_anomaly(_event("cheap", 1.0, 0.5, severity=ev.SEVERITY_CRITICAL))
    state.add_anomaly(_event("old-big", 10.0, 0.0, t_s=0))
    state.add_anomaly(_event("fast", 0.0, 100.0, t_s=0))
    half_hour = T0 + HOUR // 2
    order = [a["dedup_key"] for a in open_summary(state, now_ns=half_hour)]
    assert order == ["fast", "old-big", "cheap"]            # 50 > 10 > 1.25 GPU-hours by now
    top = open_summary(state, now_ns=half_hour)[0]
    assert top["impact_gpu_hours_now"] == pytest.approx(50.0)
    assert top["impact_basis"] == MEASURED and top["impact_gpu_hours_per_hour"] == 100.0
    early = [a["dedup_key"] for a in open_summary(state, now_ns=T0)]   # nothing lost yet: the recorded values
    assert early == ["old-big", "cheap", "fast"]


def test_feed_subscribers_can_ask_for_costly_anomalies_only():
    sub = Subscription.from_request(fpb.SubscribeRequest(min_impact_gpu_hours_per_hour=10), max_replay_s=60)
    assert sub.matches(FeedEvent({}, _event("a", 0.0, 12.0)))
    assert not sub.matches(FeedEvent({}, _event("a", 0.0, 2.0)))
    assert sub.matches(FeedEvent({}, _event("a", 5.0, 0.0, lifecycle=ev.LIFECYCLE_RESOLVED)))
    for bad in (-1.0, float("inf"), float("nan")):
        with pytest.raises(ValueError, match="min_impact_gpu_hours_per_hour"):
            Subscription.from_request(fpb.SubscribeRequest(min_impact_gpu_hours_per_hour=bad), max_replay_s=60)


def test_tail_lines_show_the_impact():
    line = format_event(_event("node-0001", 12.5, 64.0, basis=ESTIMATED))
    assert "12.5 GPU-h +64/h~" in line
    assert "GPU-h" not in format_event(_event("node-0001", 0.0, 0.0, basis=""))
    out = io.StringIO()
    view = LiveView("t", out=out)
    view.add(_event("node-0001", 3.0, 1.0))
    assert "3 GPU-h +1/h" in out.getvalue()


# ---------------------------------------------------------------------------------- eval
def test_rank_metrics():
    from fabricwatch.evaluation.impact import spearman, top_overlap

    assert spearman([1, 2, 3], [3, 2, 1]) == pytest.approx(-1.0)
    assert spearman([1, 1, 2, 3], [5, 5, 6, 7]) == pytest.approx(1.0)         # ties averaged
    assert spearman([1, 2], [1, 2]) is None and spearman([1, 1, 1], [1, 2, 3]) is None
    assert top_overlap([9, 8, 7, 1, 0, 5], [0, 1, 7, 8, 9, 5], k=3) == pytest.approx(1 / 3)
    assert top_overlap([], []) is None
    with pytest.raises(ValueError):
        spearman([1, 2, 3], [1, 2])


def test_truth_is_what_the_job_did_not_progress():
    from fabricwatch.simulator.labels import GroundTruth
    from fabricwatch.evaluation.impact import TAIL_S, truth_gpu_hours

    # one step a second, except no progress at all from 100 s to 200 s (a stall)
    # job k: one step a second, half that from 100 s to 150 s (a straggler)
    slow = [t * S for t in range(100)] + [int((100 + 2 * i) * S) for i in range(25)] + [t * S for t in range(150, 400)]
    progress = {"j": [(t * S, t if t < 100 else (99 if t < 200 else t - 100)) for t in range(0, 400)],
                "k": [(t, i) for i, t in enumerate(slow)]}
    stall = GroundTruth("gpu_xid", "node-0001/gpu0", 100 * S, 200 * S)
    idle = GroundTruth("link_flap", "node-0009/mlx5_0/1", 100 * S, 200 * S)
    straggler = GroundTruth("straggler", "job=k/rank=3", 100 * S, 150 * S)
    jobs = {"j": ("node-0001", "node-0002"), "k": ("node-0003",)}
    lost = truth_gpu_hours([stall, idle, straggler], jobs, 4, progress, 0, 400 * S)
    assert lost[1] is None                               # no job on that node
    assert lost[0] == pytest.approx(8 * 100 / 3600, rel=0.05)   # 8 GPUs, 100 s of nothing (the tail is healthy)
    assert lost[2] == pytest.approx(4 * 25 / 3600, rel=0.1)     # 4 GPUs, half of 50 s
    assert TAIL_S > 0


@pytest.mark.slow
def test_eval_measures_truth_and_ranks_our_impact():
    from fabricwatch.evaluation.runs import FABRICWATCH, run_scenario
    from fabricwatch.evaluation.scoring import score
    from fabricwatch.evaluation.fault_scenarios import _stragglers

    run = run_scenario(_stragglers(0, 200), (FABRICWATCH,))
    stragglers = [gt for gt in run.truths if gt.kind == "straggler" and gt.expect_alert]
    assert stragglers and all(gt.gpu_hours_lost is not None and gt.gpu_hours_lost > 0 for gt in stragglers)
    ranking = score([run], (FABRICWATCH,)).impact_ranking
    assert ranking["straggler"]["pairs"] == len(stragglers)
    assert ranking["straggler"]["ours_gpu_hours"] > 0


def test_the_work_redone_after_a_stall_is_at_most_what_the_job_did_here():
    book = FactBook()
    book.apply(JobPlacement("c1", "young", ("node-0002",), T0 + HOUR, ranks=8, first_step_ns=T0 + HOUR - 120 * S))
    stall = _finding("gpu_xid", severity=CRITICAL, onset_ns=T0 + HOUR, detected_ns=T0 + HOUR)
    [f] = assess([stall], book, None)
    assert f.impact_gpu_hours == pytest.approx(8 * 120 / 3600, abs=1e-5)   # 2 minutes old: 2 minutes redone, not 15
    old = FactBook()
    old.apply(JobPlacement("c1", "old", ("node-0002",), T0 + HOUR, ranks=8, first_step_ns=T0))
    [g] = assess([stall], old, None)
    assert g.impact_gpu_hours == pytest.approx(8 * DEFAULT_SINCE_CHECKPOINT_S / 3600, abs=1e-5)
    assert fact_codec.decode(fact_codec.encode(JobPlacement("c1", "j", (), T0, 8, T0 - S))[1]).first_step_ns == T0 - S
