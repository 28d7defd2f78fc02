"""Behaviour tests of the generic detector `NoveltyAlarm` (models/baseline.py)."""

from __future__ import annotations

import copy
import math
import pickle
import random

import numpy as np
import pytest
from river.checks import common as river_checks

from fabricwatch.models.baseline import NoveltyAlarm


def noise(n, seed=0, mean=100.0, sd=5.0):
    rng = random.Random(seed)
    return [rng.gauss(mean, sd) for _ in range(n)]


def run(model, values, name="x"):
    """Score-then-learn each value (the online protocol); the list of scores."""
    scores = []
    for v in values:
        x = {name: v}
        scores.append(model.score_one(x))
        model.learn_one(x)
    return scores


def alarms(scores, level=0.5):
    return [t for t, s in enumerate(scores) if s >= level]


# --------------------------------------------------------------------------- behaviour


def test_warm_up_scores_zero_even_for_wild_values():
    model = NoveltyAlarm(warm_up=200)
    rng = random.Random(1)
    values = [rng.choice([0.0, 1e6, -1e6]) * rng.random() for _ in range(200)]
    assert run(model, values) == [0.0] * 200
    # ...and the first sample after warm-up can score.
    assert model.score_one({"x": 1e9}) > 0.5


def test_fresh_model_scores_zero():
    assert NoveltyAlarm().score_one({"x": 1.0}) == 0.0
    assert NoveltyAlarm().score_one({}) == 0.0


@pytest.mark.parametrize("seed", range(5))
def test_level_shift_alarms_at_the_shift(seed):
    values = noise(1000, seed) + noise(200, seed + 100, mean=130.0)
    scores = run(NoveltyAlarm(), values)
    assert scores[1000] >= 0.9  # a 6-sigma shift, far outside the range seen so far
    assert max(scores[900:1000]) < scores[1000]  # the strongest score around it


@pytest.mark.parametrize("seed", range(5))
def test_spike_alarms(seed):
    values = noise(2000, seed)
    values[1500] = 100.0 + 12 * 5.0
    scores = run(NoveltyAlarm(), values)
    assert scores[1500] >= 0.8


@pytest.mark.parametrize("seed", range(3))
def test_shape_change_inside_the_range_alarms(seed):
    # A sine that suddenly becomes a square wave of the same amplitude: never leaves the
    # range, so only the shape tests can see it.
    rng = random.Random(seed)
    values = [math.sin(2 * math.pi * t / 50) + rng.gauss(0, 0.02) for t in range(3000)]
    values += [math.copysign(0.95, math.sin(2 * math.pi * t / 50)) + rng.gauss(0, 0.02)
               for t in range(3000, 3300)]
    scores = run(NoveltyAlarm(), values)
    assert max(scores[3000:3060]) >= 0.5
    assert alarms(scores[1000:3000]) == []


@pytest.mark.parametrize("seed", range(3))
def test_a_stuck_value_inside_the_range_alarms_on_quietness_only(seed):
    # A noisy sensor that freezes at an ordinary value: inside the range, and a constant
    # window is closer to the noise windows than they are to each other; only the
    # quietness test (standard deviation of the last 48 values) sees it.
    values = noise(3000, seed) + [100.0] * 300
    got = alarms(run(NoveltyAlarm(), values)[3000:])
    # once the 48 values are mostly stuck, and at most once more, when they all are (an
    # exactly flat stretch is infinitely quieter: the escalation rule); then silent
    assert got and len(got) <= 2 and got[-1] < 48
    assert alarms(run(NoveltyAlarm(quiet_window=0), values)[3000:]) == []


def test_quietness_of_a_large_level_is_not_rounding():
    # Sliding statistics at a level 2e5 times the noise: a stuck stretch alarms as above,
    # and neither their refresh (every 1024 samples) nor float32 state makes new records.
    values = noise(3000, 21, mean=1e6) + [1e6 + 3.0] * 3000 + noise(1000, 22, mean=1e6)
    for compact in (True, False):
        got = alarms(run(NoveltyAlarm(compact=compact), values)[3000:6000])
        assert got and len(got) <= 2 and got[-1] < 48


@pytest.mark.parametrize("seed", range(3))
def test_stationary_noise_stays_low(seed):
    scores = run(NoveltyAlarm(), noise(10000, seed))
    assert np.quantile(scores, 0.99) < 0.5
    # Record tests are broken by chance now and then (about one in 2000 samples per
    # feature once a few thousand samples are in); early on more often.
    assert len(alarms(scores[2000:])) <= 12
    assert len(alarms(scores)) <= 25


def test_flat_and_periodic_series_stay_silent():
    # Exact repeats give exact zero distances: no spurious records from rounding.
    for values in ([5.0] * 3000, [float(t % 24 < 12) for t in range(5000)]):
        assert alarms(run(NoveltyAlarm(), values)) == []


def test_scores_are_in_unit_interval():
    values = noise(3000, 3) + [1e12, -1e12, 0.0] + noise(500, 4)
    scores = run(NoveltyAlarm(), values)
    assert all(0.0 <= s <= 1.0 for s in scores)


def test_refractory_silences_the_feature_after_an_alarm():
    model = NoveltyAlarm(refractory=30, escalation=math.inf)
    run(model, noise(1000, 5))
    assert model.score_one({"x": 1e4}) > 0.9
    model.learn_one({"x": 1e4})
    after = run(model, [2e4, 4e4, 8e4] + noise(27, 6))  # ever larger excursions
    assert after == [0.0] * 30
    assert model.score_one({"x": 1e6}) > 0.9  # refractory over


def test_much_stronger_novelty_breaks_through_the_refractory_period():
    model = NoveltyAlarm(refractory=30, escalation=2.0)
    run(model, noise(1000, 5))
    assert model.score_one({"x": 150.0}) >= 0.5  # a mild excursion: an alarm
    model.learn_one({"x": 150.0})
    assert run(model, [151.0, 100.0, 99.0]) == [0.0] * 3  # same episode: silent
    assert model.score_one({"x": 1e4}) > 0.9  # far stronger: reported anyway


def test_a_second_record_soon_after_a_novelty_event_needs_more_novelty():
    """Soft refractory period: after an event the alarm level is (recovery / age) ** exponent."""
    def excursion_score(recovery, age):
        model = NoveltyAlarm(refractory=0, recovery=recovery, recovery_exponent=0.5, coarse_block=0)
        run(model, noise(1000, 5))
        hi = max(ch.hi for ch in model._channels.values())
        run(model, [hi + 1.0] + noise(age - 1, 6))     # a new maximum: a novelty event
        top = model._channels["x"].hi
        lo = model._channels["x"].lo
        # an excursion at twice the range test's alarm level
        return model.score_one({"x": top + 2 * model.range_tolerance * (top - lo) * (1 + 300 / (1000 + age))})

    assert excursion_score(0, 25) == pytest.approx(0.75)           # off: 1 - 0.5 / 2
    assert excursion_score(100, 25) == pytest.approx(0.5)          # level (100/25) ** 0.5 = 2
    assert excursion_score(100, 100) == pytest.approx(0.75)        # recovered


@pytest.mark.parametrize("seed", [3, 4, 5, 6, 7])
def test_a_level_shift_re_alarms_less_than_with_the_hard_refractory_period_only(seed):
    values = noise(2500, seed) + noise(500, seed + 1, mean=130.0)
    soft = [t for t in alarms(run(NoveltyAlarm(), values)) if t >= 2500]
    hard = [t for t in alarms(run(NoveltyAlarm(recovery=0), values)) if t >= 2500]
    assert soft[0] == hard[0] == 2500          # the onset is reported all the same
    assert len(soft) <= 2 and len(soft) < len(hard)


def test_multiple_features_score_is_the_max():
    model = NoveltyAlarm()
    rng = random.Random(7)
    for _ in range(1000):
        x = {"tx_gbps": rng.gauss(380.0, 4.0), "cnp_per_s": rng.gauss(100.0, 5.0)}
        model.score_one(x)
        model.learn_one(x)
    quiet = {"tx_gbps": 380.0, "cnp_per_s": 100.0}
    assert model.score_one(quiet) < 0.5
    bad = {"tx_gbps": 380.0, "cnp_per_s": 1000.0}
    assert model.score_one(bad) > 0.9
    assert model.score_one({"cnp_per_s": 1000.0}) == model.score_one(bad)
    assert model.score_one({"unseen": 1e9}) == 0.0  # a new feature is warming up


def test_missing_feature_is_not_learned():
    model = NoveltyAlarm()
    run(model, noise(500, 8), name="a")
    model.learn_one({"b": 1.0})
    assert model._channels["a"].n == 500
    assert model._channels["b"].n == 1


# --------------------------------------------------------------------------- NaN, state


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf"), None, "7", [1.0]])
def test_non_finite_or_non_numeric_is_neither_scored_nor_learned(bad):
    model = NoveltyAlarm()
    run(model, noise(400, 9))
    before = pickle.dumps(model)
    assert model.score_one({"x": bad}) == 0.0
    model.learn_one({"x": bad})
    assert pickle.dumps(model) == before
    # Next to a valid feature, the valid one is still scored and learned.
    assert model.score_one({"x": bad, "y": 1.0}) == 0.0
    model.learn_one({"x": bad, "y": 1.0})
    assert model._channels["x"].n == 400 and model._channels["y"].n == 1


def test_nan_does_not_change_later_scores():
    values = noise(1500, 10)
    ref = run(NoveltyAlarm(), values)
    model = NoveltyAlarm()
    got = []
    for t, v in enumerate(values):
        if t % 100 == 50:
            assert model.score_one({"x": math.nan}) == 0.0
            model.learn_one({"x": math.nan})
        got.append(model.score_one({"x": v}))
        model.learn_one({"x": v})
    assert got == ref


def test_numpy_and_int_values_are_accepted():
    a, b = NoveltyAlarm(), NoveltyAlarm()
    values = [int(v) for v in noise(600, 11)]
    sa = run(a, values)
    sb = run(b, [np.int64(v) for v in values])
    sc = run(NoveltyAlarm(), [np.float32(v) for v in values])
    assert sa == sb == sc


def test_learn_without_score_matches_score_then_learn():
    values = noise(1200, 12) + noise(50, 13, mean=200.0)
    ref = run(NoveltyAlarm(), values)
    model = NoveltyAlarm()
    for v in values[:1000]:
        model.learn_one({"x": v})  # no score_one in between: no cache to reuse
    assert run(model, values[1000:]) == ref[1000:]


@pytest.mark.slow
def test_bounded_memory_after_100k_samples():
    rng = random.Random(14)
    model = NoveltyAlarm()
    sizes = []
    for t in range(100_000):
        model.learn_one({"x": rng.gauss(0.0, 1.0) + (t // 5000) * 0.1})
        if t + 1 in (20_000, 100_000):
            sizes.append(len(pickle.dumps(model)))
    assert sizes[1] <= sizes[0] + 256
    assert sizes[1] < 64 * 1024  # one feature: a few rings of floats


def test_pickle_round_trip_continues_identically():
    values = noise(2500, 15) + noise(100, 16, mean=140.0)
    model = NoveltyAlarm()
    run(model, values[:2000])
    clone = pickle.loads(pickle.dumps(model))
    twin = copy.deepcopy(model)
    rest = values[2000:]
    expected = run(model, rest)
    assert run(clone, rest) == expected
    assert run(twin, rest) == expected
    assert max(expected) > 0.5


def test_clone_is_fresh_and_keeps_params():
    model = NoveltyAlarm(warm_up=20, refractory=5, coarse_block=0)
    run(model, noise(500, 17))
    fresh = model.clone()
    assert fresh._get_params() == model._get_params()
    assert fresh._channels == {}
    assert fresh.score_one({"x": 1e9}) == 0.0
    other = model.clone({"refractory": 7})
    assert other.refractory == 7 and other.warm_up == 20


# --------------------------------------------------------------------------- parameters


@pytest.mark.parametrize(
    "name, value",
    [
        ("warm_up", -1),
        ("warm_up", 1.5),
        ("window", 1),
        ("n_neighbors", 0),
        ("reference_size", 27),  # must exceed n_neighbors (27)
        ("gap", 0),
        ("calibration", 0),
        ("margin", 0.0),
        ("margin", float("nan")),
        ("coarse_block", -8),
        ("coarse_window", 1),
        ("coarse_neighbors", 0),
        ("coarse_reference_size", 1),  # must exceed coarse_neighbors (1)
        ("quiet_window", 1),
        ("quiet_window", 619),  # longer than the fine ring (300 + 300 + 19 - 1)
        ("quiet_window", 4.0),
        ("quiet_margin", 0.0),
        ("coarse_calibration", 0),
        ("coarse_margin", -1.0),
        ("range_tolerance", 0),
        ("range_tolerance", "0.1"),
        ("refractory", -1),
        ("refractory", True),
        ("recovery", -1),
        ("recovery", 2.5),
        ("recovery_exponent", -0.1),
        ("recovery_exponent", float("inf")),
    ],
)
def test_invalid_params_raise_value_error_naming_them(name, value):
    with pytest.raises(ValueError, match=name):
        NoveltyAlarm(**{name: value})


def test_defaults_are_the_documented_nab_setting():
    params = NoveltyAlarm()._get_params()
    assert params["warm_up"] == 150 and params["refractory"] == 30
    assert params["recovery"] == 300 and params["recovery_exponent"] == 0.25 and params["compact"]
    assert all(isinstance(v, (int, float)) for v in params.values())  # immutable defaults


# --------------------------------------------------------------------------- river conventions


def _dataset(n=300, seed=18):
    rng = random.Random(seed)
    return [({f"f{i}": rng.gauss(0, 1) for i in range(6)}, None) for _ in range(n)]


@pytest.mark.parametrize(
    "check",
    [
        river_checks.check_learn_one,
        river_checks.check_predict_one_pure,
        river_checks.check_shuffle_features_no_impact,
        river_checks.check_emerging_features,
        river_checks.check_disappearing_features,
        river_checks.check_radically_disappearing_features,
        river_checks.check_pickling,
        river_checks.check_no_state_aliasing_with_input,
        river_checks.check_clone_is_independent,
    ],
    ids=lambda c: c.__name__,
)
@pytest.mark.parametrize("params", list(NoveltyAlarm._unit_test_params()), ids=str)
def test_river_dataset_checks(check, params):
    check(NoveltyAlarm(**params), dataset=_dataset())


@pytest.mark.parametrize(
    "check",
    [
        river_checks.check_repr,
        river_checks.check_str,
        river_checks.check_clone_same_class,
        river_checks.check_clone_is_idempotent,
        river_checks.check_init_default_params_are_not_mutable,
        river_checks.check_doc,
        river_checks.check_clone_changes_memory_addresses,
        river_checks.check_pickling_supports_roundtrip,
        river_checks.check_repr_roundtrips_clone,
        river_checks.check_get_params_matches_signature,
    ],
    ids=lambda c: c.__name__,
)
def test_river_model_checks(check):
    check(NoveltyAlarm())


# --------------------------------------------------------------------------- one setting


def test_worker_runs_the_nab_scored_defaults():
    """The worker's per-node detector is NoveltyAlarm's defaults, and bench/nab_eval.py scores
    that very factory: docs/nab.md cannot drift from what runs (issue 14, item 7)."""
    import importlib.util
    from pathlib import Path

    from fabricwatch.models import unknown

    assert unknown.novelty_model()._get_params() == NoveltyAlarm()._get_params()
    assert NoveltyAlarm().compact  # the float32 state the worker keeps, scored so on NAB
    spec = importlib.util.spec_from_file_location(
        "nab_eval", Path(__file__).resolve().parent.parent / "bench" / "nab_eval.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    assert bench.DETECTOR is unknown.novelty_model
    det = unknown.UnknownAnomalyDetector()
    det._node("node-1", 0)
    assert det._nodes["node-1"].model._get_params() == NoveltyAlarm()._get_params()
