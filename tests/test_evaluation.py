"""`fabricwatch eval`: the matcher on hand-made events, the baselines' rule semantics, a quick run."""
from __future__ import annotations

import numpy as np
import pytest

from fabricwatch.evaluation.baselines import StaticRules
from fabricwatch.evaluation.matching import CLOCK_TOLERANCE_NS, detection_from_event, entity_path, grace_ns, match
from fabricwatch.evaluation.scenarios import FAULT_CLASSES, SuiteConfig, expected_case_counts
from fabricwatch.evaluation.suites import build_suites
from fabricwatch.models.frames import EntityFrame, SourceView
from fabricwatch.models.rates import RateTracker
from fabricwatch.protos.v1 import events_pb2 as ev
from fabricwatch.simulator.labels import GroundTruth

S = 1_000_000_000
T0 = 1_767_225_600 * S
END = T0 + 120 * S


def event(kind, t_s, lifecycle=ev.LIFECYCLE_OPEN, **entity):
    return ev.AnomalyEvent(kind=kind, lifecycle=lifecycle, detected_unix_ns=T0 + int(t_s * S),
                           entity=ev.EntityPath(cluster="eval", **entity))


def nic(node, dev):
    return {"node": node, "device": dev, "port": "1"}


def dets(*events):
    return [detection_from_event(e) for e in events]


DOWNGRADE = GroundTruth("link_downgrade", "node-0002/mlx5_3/1", T0 + 10 * S, None, related=("leaf-u0-r3/Ethernet1",))
STORM = GroundTruth("pfc_storm", "node-0003/mlx5_5/1", T0 + 20 * S, T0 + 25 * S,
                    victims=("node-0001/mlx5_5/1", "node-0002/mlx5_5/1", "spine-0/Ethernet5"),
                    related=("leaf-u0-r5/Ethernet2",))
STRAGGLER = GroundTruth("straggler", "job=job-001/rank=11", T0 + 30 * S, None, victims=("job=job-001",),
                        related=("node-0002/gpu3",), detail={"node": "node-0002", "gpu": 3, "cause": "thermal"})


def test_entity_paths_are_spelled_like_ground_truth():
    assert entity_path(ev.EntityPath(cluster="c", node="node-0003", device="mlx5_2", port="1")) == "node-0003/mlx5_2/1"
    assert entity_path(ev.EntityPath(cluster="c", node="node-0003", device="gpu2")) == "node-0003/gpu2"
    assert entity_path(ev.EntityPath(cluster="c", switch="leaf-u0-r2", port="Ethernet3")) == "leaf-u0-r2/Ethernet3"
    assert entity_path(ev.EntityPath(cluster="c", job="job-7", rank="3", node="n", device="gpu3")) == "job=job-7/rank=3"


def test_downgrade_tp_with_delay_and_the_leaf_port_is_the_same_incident():
    m = match(dets(event("link_downgrade", 10.4, **nic("node-0002", "mlx5_3")),
                   event("link_downgrade", 10.5, switch="leaf-u0-r3", port="Ethernet1"),
                   event("link_downgrade", 10.4, lifecycle=ev.LIFECYCLE_RESOLVED, **nic("node-0002", "mlx5_3"))),
              [DOWNGRADE], interval_s=1.0, end_ns=END)
    assert [(t.cls, t.entity, t.delay_ns) for t in m.tps] == [("link_downgrade", "node-0002/mlx5_3/1", 400_000_000)]
    assert len(m.duplicates) == 1 and not m.fps and not m.fns


def test_only_the_leaf_port_still_detects_the_downgrade():
    m = match(dets(event("link_downgrade", 11.0, switch="leaf-u0-r3", port="Ethernet1")), [DOWNGRADE], 1.0, END)
    assert len(m.tps) == 1 and m.tps[0].delay_ns == S


def test_wrong_entity_wrong_kind_and_missed_fault():
    m = match(dets(event("link_downgrade", 10.4, **nic("node-0002", "mlx5_4")),
                   event("pcie_downgrade", 10.4, **nic("node-0002", "mlx5_3"))), [DOWNGRADE], 1.0, END)
    assert not m.tps
    assert sorted((f.cls, f.fp_reason) for f in m.fps) == [("link_downgrade", "wrong entity"),
                                                           ("pcie_downgrade", "unexplained")]
    assert [(f.cls, f.entity) for f in m.fns] == [("link_downgrade", "node-0002/mlx5_3/1")]


def test_detection_window_bounds():
    before = event("link_downgrade", 10 - 2 * CLOCK_TOLERANCE_NS / S, **nic("node-0002", "mlx5_3"))
    skewed = event("link_downgrade", 10 - CLOCK_TOLERANCE_NS / S / 2, **nic("node-0002", "mlx5_3"))
    assert not match(dets(before), [DOWNGRADE], 1.0, END).tps
    assert len(match(dets(skewed), [DOWNGRADE], 1.0, END).tps) == 1
    late = (25 * S + grace_ns("pfc_storm", 0.1)) / S + 0.5
    m = match(dets(event("pfc_storm", late, **nic("node-0003", "mlx5_5"))), [STORM], 0.1, END)
    assert not m.tps and len(m.fps) == 1 and len(m.fns) == 1


def test_storm_source_vs_victim():
    m = match(dets(event("pfc_storm", 20.25, **nic("node-0003", "mlx5_5")),
                   event("pfc_storm", 20.3, **nic("node-0001", "mlx5_5")),
                   event("pfc_storm", 20.3, switch="spine-0", port="Ethernet5")), [STORM], 0.1, END)
    assert [(t.entity, t.delay_ns) for t in m.tps] == [("node-0003/mlx5_5/1", 250_000_000)]
    assert sorted(f.fp_reason for f in m.fps) == ["victim named as source"] * 2


def test_storm_named_on_the_leaf_port_facing_the_source_counts():
    m = match(dets(event("pfc_storm", 20.3, switch="leaf-u0-r5", port="Ethernet2")), [STORM], 0.1, END)
    assert len(m.tps) == 1 and not m.fps


def test_straggler_matches_job_rank_and_node():
    right = event("straggler", 38.0, job="job-001", rank="11", node="node-0002", device="gpu3")
    wrong_rank = event("straggler", 38.0, job="job-001", rank="12", node="node-0002", device="gpu4")
    wrong_node = event("straggler", 39.0, job="job-001", rank="11", node="node-0005", device="gpu3")
    m = match(dets(right, wrong_rank, wrong_node), [STRAGGLER], 1.0, END)
    assert [(t.entity, t.delay_ns) for t in m.tps] == [("job=job-001/rank=11", 8 * S)]
    assert len(m.fps) == 2


def test_consequences_are_explained_not_false_positives():
    xid48 = GroundTruth("gpu_xid", "node-0004/gpu1", T0 + 40 * S, T0 + 40 * S + 1_000_000, detail={"code": 48})
    xid13 = GroundTruth("gpu_xid", "node-0005/gpu1", T0 + 40 * S, T0 + 40 * S + 1_000_000, detail={"code": 13})
    m = match(dets(event("straggler", 14.0, job="job-001", rank="3", node="node-0002", device="gpu3"),
                   event("gpu_xid", 40.5, node="node-0004", device="gpu1"),
                   event("gpu_ecc_uncorrectable", 40.5, node="node-0004", device="gpu1"),
                   event("gpu_xid", 40.5, node="node-0005", device="gpu1"),
                   event("gpu_ecc_uncorrectable", 40.5, node="node-0005", device="gpu1")),
              [DOWNGRADE, xid48, xid13], 1.0, END)
    assert len(m.explained) == 2
    assert [(f.cls, f.entity) for f in m.fps] == [("gpu_ecc_uncorrectable", "node-0005/gpu1")]
    assert sorted(t.cls for t in m.tps) == ["gpu_xid", "gpu_xid"]
    assert [f.cls for f in m.fns] == ["link_downgrade"]


def test_a_hang_named_on_any_rank_of_a_job_a_storm_stalls_is_explained():
    """A storm that holds one node of a job stalls the whole job's collective: every rank is
    stuck alike and the hang detector names one of them, on whatever node."""
    hang = event("hang", 22.0, job="job-001", rank="21", node="node-0004", device="gpu5")
    placed = {"job-001": ("node-0002", "node-0003", "node-0004")}
    m = match(dets(hang), [STORM], 0.1, END, placed)
    assert len(m.explained) == 1 and not m.fps
    elsewhere = match(dets(hang), [STORM], 0.1, END, {"job-001": ("node-0004", "node-0007")})
    assert [f.cls for f in elsewhere.fps] == ["hang"] and not elsewhere.explained


def test_must_not_fire_alarm_is_a_false_positive_and_never_a_miss():
    toggle = GroundTruth("admin_toggle", "leaf-u0-r3/Ethernet3", T0 + 5 * S, T0 + 8 * S,
                         related=("node-0004/mlx5_3/1",), expect_alert=False)
    short = GroundTruth("pfc_storm", "node-0001/mlx5_1/1", T0 + 50 * S, T0 + 50 * S + 100_000_000,
                        expect_alert=False)
    m = match(dets(event("link_flap", 5.4, **nic("node-0004", "mlx5_3")),
                   event("pfc_storm", 50.3, **nic("node-0001", "mlx5_1"))), [toggle, short], 0.1, END)
    assert not m.tps and not m.fns
    assert [f.fp_reason for f in m.fps] == ["must-not-fire: admin_toggle", "must-not-fire: pfc_storm"]
    assert {i: dict(c) for i, c in m.mnf_hits.items()} == {0: {"link_flap": 1}, 1: {"pfc_storm": 1}}


def test_unknown_kinds_are_their_own_class():
    m = match(dets(event("nvlink_errors", 3.0, node="node-0001", device="gpu0")), [], 1.0, END)
    assert [(f.cls, f.fp_reason) for f in m.fps] == [("nvlink_errors", "unexplained")]


# --------------------------------------------------------------------------- baselines


def _pause_view(t_s: float, total_frames: int) -> SourceView:
    f = EntityFrame("nic_port", ("mlx5_0/1",), ("tx_prio3_pause", "rx_prio3_pause"),
                    np.array([[total_frames, 0]], dtype=np.uint64), (), np.empty((1, 0)), [{}])
    return SourceView("eval", "node-0001", "node", T0 + int(t_s * S), int(t_s), [f])


def _run_pause_rule(storm_from_s: int, storm_to_s: int, until_s: int = 360) -> list[tuple]:
    rules, rates = StaticRules(), RateTracker()
    frames, out = 0, []
    for t in range(until_s):
        frames += 24_000 if storm_from_s <= t < storm_to_s else 100
        view = _pause_view(t, frames)
        for frame in view.frames:
            rates.update(view.source, frame, view.time_ns)
        out += [(f.kind, f.state, (f.detected_ns - T0) / S) for f in rules.update(view)]
    return out


def test_static_pause_rule_is_rate_over_1m_for_1m():
    fired = _run_pause_rule(100, 300)
    # the 1-minute rate of a 24 000/s storm crosses 10 000/s 25 s in; `for: 1m` adds a minute
    assert [f[:2] for f in fired] == [("pfc_storm", "open"), ("pfc_storm", "resolved")]
    assert 184 <= fired[0][2] <= 186
    assert 333 <= fired[1][2] <= 337        # resolves once the 1-minute rate falls back under (35 s)


def test_static_pause_rule_misses_a_40s_storm():
    assert _run_pause_rule(100, 140) == []


# --------------------------------------------------------------------------- suites and a quick run


def test_full_suites_have_enough_cases_per_class():
    counts = expected_case_counts(build_suites(SuiteConfig(healthy_node_hours=0.5)))
    assert all(counts[c] >= 20 for c in FAULT_CLASSES), counts


@pytest.mark.slow
def test_quick_eval_writes_report_and_scores_a_clear_downgrade(tmp_path):
    from fabricwatch.evaluation.report import evaluate
    from fabricwatch.evaluation.runs import FABRICWATCH, STATIC

    out = tmp_path / "evaluation.md"
    scores, runs = evaluate(out, quick=True, jobs=1, progress=False)
    text = out.read_text()
    assert "## Targets (fabricwatch)" in text and "### link_downgrade" in text and "## Must-not-fire cases" in text
    for png in ("scores_by_class.png", "delay_by_class.png", "false_alarms_healthy.png"):
        data = (tmp_path / "evaluation" / png).read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 5000
    mix = next(r for r in runs if r.scenario.name == "quick-mix")
    for detector in (FABRICWATCH, STATIC):
        tps = [t for t in scores.matches[(mix.scenario.name, detector)].tps if t.cls == "link_downgrade"]
        assert len(tps) == 1, detector
        assert 0 < tps[0].delay_ns <= mix.scenario.interval_s * S, detector     # within one sample
    fw = scores.classes[FABRICWATCH]["link_downgrade"]
    assert fw.tp == 1 and fw.fn == 0 and fw.within_bound == [True]


def test_cli_has_eval():
    from fabricwatch.cli import build_parser, cmd_eval

    args = build_parser().parse_args(["eval", "--quick", "--out", "x.md", "--jobs", "1"])
    assert args.func is cmd_eval and args.quick and args.out == "x.md" and args.jobs == 1


if __name__ == "__main__":  # pragma: no cover
    pytest.main([__file__, "-q"])
