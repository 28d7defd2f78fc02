"""Numenta Anomaly Benchmark (NAB) scores of the generic detector and two references.

    python3 bench/nab_eval.py [--nab ../shared/nab] [--out docs/nab.md] [--hst-seeds 3]

Runs, over all 58 NAB files, each with a fresh detector per file, one parameter set for
the corpus, and every row scored before it is learned (NAB's rules):

* ``NoveltyAlarm`` (fabricwatch.models.baseline) as the worker builds it
  (``fabricwatch.models.unknown.novelty_model``: the class defaults, float32 state);
* river's ``HalfSpaceTrees`` with default parameters behind ``preprocessing.MinMaxScaler``,
  for ``--hst-seeds`` seeds (their mean is reported; HST is the slow one);
* windowed Gaussian, as NAB's ``windowedGaussian`` detector (tail probability of the value
  under a Gaussian fitted to a window of up to 6400 previous values, moved by 100).

Scores come from the shared re-implementation of NAB's scorer (``score.py`` in the NAB
folder: standard, reward_low_FP_rate and reward_low_FN_rate profiles, one threshold per
profile for the whole corpus, normalised so that null = 0 and perfect = 100). Prints a
markdown table and writes it, with how it was made, to ``--out``. Single process.
"""
from __future__ import annotations

import argparse
import csv
import importlib.util
import math
import platform
import statistics
import sys
import time
from pathlib import Path

import numpy as np

from fabricwatch.machine import cpu_model, usable_cpus
from fabricwatch.models.unknown import novelty_model

REPO = Path(__file__).resolve().parent.parent
# What is scored: the worker's own detector factory, so docs/nab.md scores what runs.
DETECTOR = novelty_model
PROFILES = ("standard", "reward_low_FP_rate", "reward_low_FN_rate")
# Published NAB scores (standard, low FP, low FN), for context in the report.
PUBLISHED = [  # NAB's results/final_results.json (numenta/NAB @ ea702d7)
    ("ARTime", (74.9, 65.2, 80.4)),
    ("Numenta HTM", (70.1, 63.1, 74.3)),
    ("CAD OSE", (69.9, 67.0, 73.2)),
    ("KNN CAD", (58.0, 43.4, 64.8)),
    ("Relative Entropy", (54.6, 47.6, 58.8)),
    ("Windowed Gaussian", (39.6, 20.9, 47.4)),
]

DOC_TEMPLATE = """\
# NAB: the generic detector `NoveltyAlarm`

Scores on the [Numenta Anomaly Benchmark](https://github.com/numenta/NAB) ({files} files,
{rows:,} rows), measured with the shared re-implementation of NAB's scorer
(`../shared/nab/score.py`, which reproduces NAB's published results to 1e-10). NAB rules:
one parameter set for the whole corpus, a fresh detector per file, every row scored before
it is learned, scores in [0, 1]; the scorer then picks one threshold per profile for the
whole corpus. 100 = perfect, 0 = a detector that never fires.

The detector scored is the one the worker runs: `bench/nab_eval.py` builds it with the
worker's own factory (`fabricwatch.models.unknown.novelty_model`), i.e. `NoveltyAlarm`'s
defaults with their float32 state (`compact=True`; the float64 state scores the same
here). The worker's quieter `unknown_anomaly` reports are an alert decision on this
detector's score (`docs/detectors.md`), not another setting.

{table}

µs/sample: CPU time (`time.process_time`) of `score_one` + `learn_one` (one feature)
divided by the rows, in one process; the machine is shared with other jobs, which
inflates CPU time too (cache, SMT), so expect ±30 %. Measured once separately on an idle
machine (one core of an Intel Xeon, numpy 2.5), the same score-then-learn loop costs
NoveltyAlarm 41 µs/sample on a synthetic 20k-sample stream (before the soft refractory
period, which adds one comparison per sample, and the quietness test of step 5). Step 5
costs about 10 % more CPU than the setting before it: 16.7 against 15.1 µs/sample,
interleaved in one process on a synthetic 20k-sample stream on this machine while idle
(the 27 µs/sample that the previous table showed was measured while it was busier).
{hst_note}

Published scores of other NAB entries, for context (same scorer, standard / low FP / low FN):
{published}

The windowed-Gaussian row is NAB's detector re-implemented (window 6400, step 100, tail
probability, scores written with 12 significant digits as NAB's results files have them);
it reproduces the published 39.6 / 20.9 / 47.4, which checks the harness end to end.

Made with:

    {command}

on {date}, {machine}; Python {python}, numpy {numpy}, river {river}; total run time {total_s:.0f} s.

## How the parameters were chosen

By tuning on this corpus, as every NAB entry does: one global parameter set chosen by
its corpus score; no per-file setting, no labels at run time. So the score above is
in-sample. How it went:

1. Candidate raw scores were computed once per file and post-processing compared on
   them. Numenta-style anomaly likelihood on a KNN prediction error or on conformal
   KNN p-values scored badly here (< 20, in the forms tried); KNN-CAD-like conformal
   p-values with a refractory period ~46; the range ("spatial") test alone ~57. What
   worked was turning each test into a *record* test (beat the largest score of the
   last few thousand samples) and taking the max of the range test and a 19-value
   KNN shape test (~65), then adding the slow shape test on 8-sample means (~70).
2. On the detector itself, one parameter at a time (reference size 200, window 12,
   10 neighbours, refractory 20/50, range tolerance 0.01/0.03, margin 0.9/1.1, slow
   margin 1.15/1.5, warm-up 300, gap 150, calibration 2000/5000): every variant scored
   between 69.5 and 72.1, so the optimum is flat rather than a lucky spike. The slow
   margin was set to the best value (1.5); the escalation rule and the damping of the
   range test while the history is short were added for operational reasons and cost
   0.2. That setting scored 71.9 / 66.6 / 75.5.
3. Soft refractory period (issue 14): novelty comes in episodes, and NAB, like an
   operator, wants the onset, not every record the episode keeps setting. After a
   *novelty event* (any test at its alarm level, reported or not) the alarm level of
   the feature is `(300 / age) ** 0.25` for 300 samples (twice the novelty 20 samples
   later, 1.2x after 150): 71.9 -> 72.9 standard, with 93 false alarms instead of 114
   and the same 96 windows detected. Its neighbours: 300 samples with exponents 0.15 /
   0.5 scored 72.6 / 71.5, 150 / 200 / 600 samples with 0.25 scored 72.6 / 72.6 / 71.9;
   measuring the age from the last *reported* alarm instead scored 72.7, one raised
   level per test instead of per feature 72.6. The hard refractory period (30
   samples, escalation 2) stays (without it 72.8).
4. Tried in the same round and not kept (standard score): Numenta's anomaly
   likelihood (short vs long mean of the novelty ratio, Gaussian tail) as a fourth
   test, 59.9-63.8 (without the soft period); a record test on first differences, or a
   range test over the last 500-2000 samples, 63.4-71.6 (without); the three tests on
   first differences as extra tests, 70.4-73.1; damping the shape records while their
   history is short, as the range test is, 67.4-71.6 (without); a longer record
   horizon (8000) or reference (600 windows), 71.8 / 71.9; raising the alarm level
   with the number of recent events, 67.2-72.9; a third shape test on means of 3 or 4
   samples, 72.8-73.8 depending on its margin. The best of those add one window (the
   slow test on differences) or two (the 3-sample test: rogue_agent_key_updown and
   Twitter_volume_UPS, at every margin) for 25-50 % more CPU: that is tuning on one or
   two files, so they were left out.
5. Issue 14 item 7, on raw per-file test scores cached once (the post-processing then
   replayed exactly: 72.87 reproduced) and confirmed end to end here. Two changes kept:
   72.9 -> 75.2 standard (68.5 -> 69.7 low FP, 76.2 -> 78.8 low FN), 96 -> 100
   windows detected, 93 -> 116 false alarms:
   * a fourth test, *quietness* (the last 48 values vary less, by standard deviation,
     than any 48 of the last 3000 samples did, by 1.4x), which sees a stream that goes
     still inside its range: +0.6 on its own (TravelTime_451's anomaly, 5 more false
     alarms). A flat stretch is closer to every older window than they are to each
     other, so no shape test can see it. Its neighbours (alone, with the old slow test):
     windows 36 / 48 / 72 and margins 1.2-1.4 and horizons 1500-6000 scored 72.9-73.8;
     with the new slow test, margin 1.2 / 1.25-1.5 scored 74.9 / 75.2, window 36 / 72
     75.1-75.5 / 74.9-75.1, horizon 1500 / 6000 74.7 / 75.2. The opposite test (a
     stretch more variable than any before) scored 71.2-72.9 and was left out.
   * the slow shape test scores the distance to the *one* nearest older slow window
     (was the sum over 5) at 1.3x its record (was 1.5x): a day-long pattern that
     happened once before is then familiar, one that never happened is novel: +1.7 on
     its own (three more windows: nyc_taxi's last holiday, one each in
     Twitter_volume_AMZN and _GOOG; 18 more false alarms). This is the spikiest part
     of the setting: margins 1.2 / 1.3 / 1.4 / 1.5 scored 74.4 / 75.2 / 75.0 / 73.6
     (with quietness), 2 or 3 neighbours at 1.3 scored 74.4 / 72.8, slow windows of
     30 / 45 blocks 73.9 / 74.2.
   Tried in the same round and not kept (standard, with both changes unless said): a
   third slow test on means of 16-48 samples, 72.7-74.5 on the old setting and up to
   +1.0 on the new one, each time from one window (nyc_taxi's or, on the new setting,
   Twitter_volume_AMZN's last); the shape record against two horizons (3000 and
   6000-30000 samples), 73.7-75.4, +0.2 at best (a few false alarms fewer); the soft
   refractory period over 450 / 600 samples, 75.4 / 74.2 (kept 300); warm-up 100 /
   200, escalation 1.5 / 3, refractory 20 / 45, range tolerance 0.012 / 0.02 and shape
   margin 0.95 / 1.05 scored 75.2 / 75.0, 75.2, 75.2, 74.2 / 75.2 and 73.9 / 73.9.

The detector does not use what NAB allows but a live stream does not have: the file
length (NAB's probationary period, which HTM, KNN CAD and CAD OSE use to size their
windows) and the file's min/max (which HTM, CAD OSE and ARTime use to scale their input).
Its learning period is a fixed count (`warm_up=150`, the probationary period of NAB's
shortest file) and its scale comes only from the values seen so far.

## What limits the score

Alarms of `NoveltyAlarm` (score >= 0.5, the alarm level) after NAB's probationary period,
per category:

{categories}

* **Missed windows** ({missed} of {windows}). About half are anomalies in the first
  few hundred rows of short files (iio NetworkIn, TravelTime_387, rogue_agent_key_hold,
  the ad-exchange files): with little history, records are broken by chance all the
  time, so the range test is damped early and the shape records are still high. The
  rest stay inside the range already seen with a familiar local shape: a level that
  drifts within its old range (rds_cpu_utilization_cc0c53, ec2_cpu_utilization_24ae8d
  and fe7f93), quieter periods of the tweet volumes (AMZN, UPS).
* **Timing.** NAB credits a detection by how early it comes in a window; the median
  first alarm sits at {median_at:.2f} of the window, i.e. at the labelled anomaly
  (windows are centred on it), worth about 0.85 of an early detection. Nothing here
  predicts an anomaly before it shows.
* **False alarms** ({false_alarms}). Mostly on the long, noisy files (the ten 16k-row
  tweet volumes, machine_temperature, cpu_utilization_asg_misconfiguration): a record
  over 3000 samples is still broken by chance every few thousand samples on
  heavy-tailed data. On Gaussian noise the defaults alarm about once per 2000 samples
  per feature once settled, more often in the first thousand: the worker reports only
  scores >= 0.9 after 1000 samples (an alert decision on this same detector, see
  `docs/detectors.md`).
* **Profiles.** The scorer's best thresholds for the three profiles are {thresholds}
  (the alarm level is 0.5): scores above the alarm level grade how novel an alarm is,
  not how likely it is to be a true one, so a higher threshold loses detections as
  fast as false alarms. Serving reward_low_FP_rate better takes other parameters
  (fewer alarms), not another threshold.
* **Against ARTime (74.9).** {vs_artime}
  ARTime, HTM and CAD OSE scale their input with the file's min/max and size their
  windows with the file length, which a live stream does not have; this detector does
  neither. The margin is a few windows: the last change (step 5) gained four, in four
  files, and its slow-test margin is tuned to them; most structural changes tried
  (steps 4 and 5) that detect more windows bring more chance records than they are
  worth.
* **In-sample.** The parameters were chosen on these 58 files; the score on data they
  were not chosen on will be lower.
"""


def load_scorer(nab: Path):
    spec = importlib.util.spec_from_file_location("nab_score", nab / "score.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def load_values(nab: Path, corpus) -> dict[str, list[float]]:
    out = {}
    for rel in corpus:
        with open(nab / "data" / rel, newline="") as f:
            out[rel] = [float(r["value"]) for r in csv.DictReader(f)]
    return out


def run_river(make, values):
    """Scores per file from a fresh river anomaly detector per file; CPU seconds spent
    in score_one + learn_one (CPU, not wall, time: the machine is shared)."""
    scores, spent = {}, 0.0
    for rel, vals in values.items():
        model = make()
        out = []
        t0 = time.process_time()
        for v in vals:
            x = {"value": v}
            out.append(min(1.0, max(0.0, float(model.score_one(x)))))
            model.learn_one(x)
        spent += time.process_time() - t0
        scores[rel] = out
    return scores, spent


def windowed_gaussian(vals, window=6400, step=100):
    """NAB's windowedGaussian detector (nab/detectors/gaussian, numenta/NAB @ ea702d7):
    1 - Q(|x - mean| / std) under the mean and std of up to `window` previous values,
    refreshed every sample while the window fills, then every `step` samples; 0 for the
    first row. Scores are rounded to 12 significant digits as NAB's results files
    (Python 2 `str(float)`) have them: 1 - Q saturates near 1, so that rounding decides
    which scores tie at 1.0 and moves the score by ~0.5.
    """
    buf = np.empty(len(vals))  # chronological; the window is always a slice of it
    lo = n = 0
    pending = 0
    mean, std = 0.0, 1.0
    out = []
    for v in vals:
        if n:
            z = abs(v - mean) / std
            out.append(float("%.12g" % (1.0 - 0.5 * math.erfc(z / math.sqrt(2)))))
        else:
            out.append(0.0)
        buf[n] = v
        n += 1
        if n - lo <= window:  # still filling: refresh every sample
            refresh = True
        else:
            pending += 1
            refresh = pending == step
            if refresh:
                lo += step
                pending = 0
        if refresh:
            w = buf[lo:n]
            mean = float(w.mean())
            std = float(w.std()) or 0.000001
    return out


def alarm_stats(corpus, scores, level=0.5):
    """Per category: labelled windows, windows with an alarm (score >= level) inside,
    and alarms outside every window, counting only rows after NAB's probationary
    period (15 % of the file, at most 750 rows). Also the median position of the first
    alarm inside a detected window (0 = window start, 1 = end)."""
    cats, where = {}, []
    for rel, (ts, windows) in corpus.items():
        s = scores[rel]
        index = {t: i for i, t in enumerate(ts)}
        start = min(int(0.15 * len(ts)), 750)
        inside = [False] * len(ts)
        c = cats.setdefault(rel.split("/")[0], [0, 0, 0])
        for a, b in windows:
            a, b = index[a], index[b]
            for i in range(a, b + 1):
                inside[i] = True
            c[0] += 1
            first = next((i for i in range(max(a, start), b + 1) if s[i] >= level), None)
            if first is not None:
                c[1] += 1
                where.append((first - a) / (b - a + 1))
        c[2] += sum(1 for i in range(start, len(ts)) if s[i] >= level and not inside[i])
    return cats, statistics.median(where) if where else float("nan")


def score(scorer, nab, corpus, scores):
    return {
        p: scorer.score_corpus(str(nab), scores, profile=p, corpus=corpus)["normalized"]
        for p in PROFILES
    }


def machine() -> str:
    return f"{usable_cpus()} vCPU ({cpu_model()}), {platform.system()} {platform.release()}"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--nab", type=Path, default=REPO.parent / "shared" / "nab",
                    help="NAB folder with data/, labels/ and score.py (default: ../shared/nab)")
    ap.add_argument("--out", type=Path, default=REPO / "docs" / "nab.md",
                    help="markdown report to write (default: docs/nab.md)")
    ap.add_argument("--hst-seeds", type=int, default=3,
                    help="HalfSpaceTrees seeds to average (0 skips HST; ~25 s CPU per seed)")
    args = ap.parse_args(argv)
    if not (args.nab / "score.py").is_file():
        ap.error(f"no score.py in {args.nab}")
    if args.hst_seeds < 0:
        ap.error("--hst-seeds must be >= 0")

    from river import anomaly, preprocessing

    t_start = time.perf_counter()
    scorer = load_scorer(args.nab)
    corpus = scorer.load_corpus(str(args.nab))
    values = load_values(args.nab, corpus)
    rows = sum(map(len, values.values()))
    print(f"{len(corpus)} files, {rows} rows", file=sys.stderr)

    results = []  # (name, {profile: score}, us/sample)

    s, spent = run_river(DETECTOR, values)
    cats, median_at = alarm_stats(corpus, s)
    ours = {p: scorer.score_corpus(str(args.nab), s, profile=p, corpus=corpus) for p in PROFILES}
    our_thresholds = [ours[p]["threshold"] for p in PROFILES]
    results.append(("NoveltyAlarm (this repo: defaults, as the worker runs it)",
                    {p: r["normalized"] for p, r in ours.items()}, spent / rows * 1e6))
    print(f"NoveltyAlarm {results[-1][1]} {spent:.0f} s", file=sys.stderr)

    hst_per_seed = []
    if args.hst_seeds:
        per, total = [], 0.0
        for seed in range(args.hst_seeds):
            s, spent = run_river(
                lambda seed=seed: preprocessing.MinMaxScaler()
                | anomaly.HalfSpaceTrees(seed=seed),
                values,
            )
            per.append(score(scorer, args.nab, corpus, s))
            total += spent
            print(f"HST seed {seed} {per[-1]} {spent:.0f} s", file=sys.stderr)
        mean = {p: statistics.fmean(r[p] for r in per) for p in PROFILES}
        hst_per_seed = [f"{r['standard']:.1f}" for r in per]
        results.append((f"river HalfSpaceTrees + MinMaxScaler (defaults, {args.hst_seeds} seeds)",
                        mean, total / args.hst_seeds / rows * 1e6))

    t0 = time.process_time()
    s = {rel: windowed_gaussian(v) for rel, v in values.items()}
    spent = time.process_time() - t0
    results.append(("windowed Gaussian (NAB's, re-implemented)", score(scorer, args.nab, corpus, s),
                    spent / rows * 1e6))
    print(f"windowed Gaussian {results[-1][1]} {spent:.0f} s", file=sys.stderr)

    lines = ["| detector | standard | reward_low_FP | reward_low_FN | µs/sample |",
             "|---|---:|---:|---:|---:|"]
    for name, sc, us in results:
        lines.append(f"| {name} | {sc['standard']:.1f} | {sc['reward_low_FP_rate']:.1f} | "
                     f"{sc['reward_low_FN_rate']:.1f} | {us:.0f} |")
    table = "\n".join(lines)
    print(table)

    import numpy
    import river

    cat_lines = ["| category | windows | detected | false alarms |", "|---|---:|---:|---:|"]
    for c, (w, d, f) in sorted(cats.items()):
        cat_lines.append(f"| {c} | {w} | {d} | {f} |")
    tot = [sum(v[i] for v in cats.values()) for i in range(3)]
    cat_lines.append(f"| all | {tot[0]} | {tot[1]} | {tot[2]} |")

    published = "\n".join(f"{name} {a} / {b} / {c};" for name, (a, b, c) in PUBLISHED)
    cmd = "python3 bench/nab_eval.py" + "".join(f" {a}" for a in (argv if argv is not None
                                                                   else sys.argv[1:]))
    doc = DOC_TEMPLATE.format(
        categories="\n".join(cat_lines),
        windows=tot[0],
        detected=tot[1],
        missed=tot[0] - tot[1],
        false_alarms=tot[2],
        median_at=median_at,
        files=len(corpus),
        rows=rows,
        table=table,
        hst_note=(f"HST: mean over {args.hst_seeds} seeds (standard per seed: "
                  + ", ".join(hst_per_seed) + ").") if hst_per_seed
        else "HST skipped (--hst-seeds 0).",
        thresholds=" / ".join(f"{t:.3f}" for t in our_thresholds),
        vs_artime=(f"Above it by {ours['standard']['normalized'] - 74.9:.1f} on the standard profile, in-sample."
                   if ours["standard"]["normalized"] >= 74.95 else "Below it on the standard profile."),
        published=published.rstrip(";") + ".",
        command=cmd,
        machine=machine(),
        date=time.strftime("%Y-%m-%d"),
        python=platform.python_version(),
        numpy=numpy.__version__,
        river=river.__version__,
        total_s=time.perf_counter() - t_start,
    )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(doc)
    print(f"wrote {args.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
