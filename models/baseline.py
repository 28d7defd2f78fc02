"""Generic online detector for "unknown" anomalies in a univariate (or per-feature) stream.

`NoveltyAlarm` is the catch-all model of fabricwatch: it knows nothing about RoCE or
InfiniBand, it only asks, per feature, "has this stream ever looked like this?". It is
measured on the Numenta Anomaly Benchmark (see ``bench/nab_eval.py`` and ``docs/nab.md``).

Four novelty tests run side by side on every feature; each one is calibrated against
the stream's own history, so a single set of parameters works across streams of
different scale and noise:

* **range** -- the value leaves the ``[min, max]`` envelope seen so far by more than
  ``range_tolerance`` times the envelope's width (the "spatial anomaly" rule of
  Numenta's NAB detector);
* **shape** -- the last ``window`` values, as a vector, are farther from their
  ``n_neighbors`` nearest neighbours among older windows than any window of the last
  ``calibration`` samples was (a KNN-CAD style non-conformity score, turned into a
  record test instead of a conformal p-value so that its false-alarm rate falls as
  history grows);
* **slow shape** -- the same test on means of ``coarse_block`` samples, over a span of
  ``coarse_block * coarse_window`` samples (a day at 5-minute sampling with the
  defaults), which catches a missing or deformed daily pattern that stays inside
  the normal range; its score is the distance to the one nearest older slow window;
* **quietness** -- the last ``quiet_window`` values vary less (standard deviation) than
  any ``quiet_window`` values of the last ``calibration`` samples did, by
  ``quiet_margin``: a stuck sensor, a source of load or noise that went away, which
  none of the other tests sees (a flat stretch is inside the range and closer to every
  older window than they are to each other).

The four ratios are combined with ``max`` and mapped to ``[0, 1)`` so that the
alarm level of every test is exactly 0.5. After an alarm a feature is silent for
``refractory`` samples (NAB, like an operator, wants one alarm per episode, not a
burst) unless something ``escalation`` times more novel comes along. Novelty comes in
episodes: after any *novelty event* (a test at its alarm level, reported or not) the
alarm level of the feature is raised to ``(recovery / age) ** recovery_exponent`` and
decays back to 1 over ``recovery`` samples, so a second record soon after the first
needs more to be reported than the first did (a soft refractory period).

The defaults were tuned globally on NAB (see ``docs/nab.md``): standard score ~75. They
are the one setting of the detector: the worker builds it with them
(``models/unknown.py``, ``novelty_model``) and ``bench/nab_eval.py`` scores that factory.
"""

from __future__ import annotations

import math
import threading
from collections import deque
from numbers import Real

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view
from river import base

__all__ = ["NoveltyAlarm"]

# The calibration record is kept as the maxima of about this many blocks of scores:
# memory O(1) instead of O(horizon), for a horizon exact to within one block.
_CAL_BLOCKS = 32

# The range tolerance is inflated by (1 + _RANGE_SETTLING / n) after n samples: with a
# short history, new extremes are common by chance (about 2/n per sample for noise).
_RANGE_SETTLING = 300.0
_BELOW_ONE = 1.0 - 1e-9
# Added, times (|mean| + 1e-3), to a standard deviation before it is inverted: a flat
# stretch has a finite quietness, and a deviation within rounding of the level counts as flat.
_QUIET_FLOOR = 1e-9
_QUIET_REFRESH = 1024

# Soft refractory period after a novelty event: the alarm level is (recovery / age) ** exponent
# for age < recovery samples. Chosen on NAB (docs/nab.md): 300 samples (one reference span
# of the shape test, ~1 day at NAB's 5-minute sampling) and 0.25 (twice the novelty 20
# samples after an event, ~1.2x after 150); 150-600 and 0.15-0.25 all scored within 1.
RECOVERY_SAMPLES = 300
RECOVERY_EXPONENT = 0.25

# Quietness test: the last QUIET_WINDOW values vary less (standard deviation) than any
# QUIET_WINDOW values of the calibration horizon did, by QUIET_MARGIN. Chosen on NAB
# (docs/nab.md): 36-72 values and margins 1.25-1.5 all scored within 0.6.
QUIET_WINDOW = 48
QUIET_MARGIN = 1.4

_local = threading.local()


def _scratch(rows, cols):
    """(rows x cols, rows, cols) float buffers for this thread, reused across calls."""
    bufs = getattr(_local, "bufs", None)
    if bufs is None:
        bufs = _local.bufs = {}
    key = (rows, cols)
    b = bufs.get(key)
    if b is None:
        b = bufs[key] = (np.empty((rows, cols)), np.empty(rows), np.empty(cols))
    return b


class _Record:
    """A record test: the ratio of a score to the largest score seen over the last
    ``horizon`` samples (kept as the maxima of about `_CAL_BLOCKS` blocks of scores:
    memory O(1), horizon exact to within one block); 0 until ``min_calibration`` scores
    were recorded."""

    def __init__(self, horizon, min_calibration):
        self.min_calibration = min_calibration
        self.cal_block = max(1, horizon // _CAL_BLOCKS)
        self.cal_blocks = deque(maxlen=-(-horizon // self.cal_block))
        self.cal_top = 0.0  # max of the completed blocks
        self.cal_block_max = 0.0
        self.cal_block_len = 0
        self.cal_count = 0

    def ratio(self, score):
        """score / (largest score over the horizon); 0 while calibration is too short."""
        if score is None or self.cal_count < self.min_calibration:
            return 0.0
        top = self.cal_top
        if self.cal_block_len and self.cal_block_max > top:
            top = self.cal_block_max
        if top > 0.0:
            # Equalling the record is not a new record: exactly periodic signals tie
            # with it once per period.
            return score / top if score > top else min(score / top, _BELOW_ONE)
        return math.inf if score > 0.0 else 0.0

    def record(self, score):
        self.cal_count += 1
        if not self.cal_block_len or score > self.cal_block_max:
            self.cal_block_max = score
        self.cal_block_len += 1
        if self.cal_block_len == self.cal_block:
            self.cal_blocks.append(self.cal_block_max)  # drops the oldest block
            self.cal_top = max(self.cal_blocks)
            self.cal_block_len = 0


class _ShapeNovelty(_Record):
    """KNN non-conformity of the newest window against older windows, as a ratio to
    the largest non-conformity seen over the calibration horizon.

    The last ``reference + gap + window - 1`` values live in a double-length ring so
    that any run of them is one contiguous slice; a strided view over that ring gives
    every reference window without copying.
    """

    def __init__(self, window, k, reference, gap, horizon, min_calibration, dtype=np.float64):
        self.window = window
        self.k = k
        self.reference = reference
        self.gap = gap
        self.size = reference + gap + window - 1
        self.ring = np.zeros(2 * self.size, dtype)
        self.count = 0  # values stored so far
        super().__init__(horizon, min_calibration)
        self._view = None

    def __getstate__(self):
        state = self.__dict__.copy()
        state["_view"] = None  # a view of `ring`; rebuilt on demand
        return state

    def ncm(self, x):
        """Sum of squared distances from (last window-1 values, x) to its k nearest
        reference windows; None until there are k+1 reference windows."""
        d, k, n = self.window, self.k, self.count
        n_win = n - d + 1  # complete windows already stored
        # Reference windows: those that ended at least `gap` steps ago. At start-up the
        # first k+1 windows are used at once so that scoring can begin early.
        end = min(n_win, max(k + 1, n_win - self.gap))
        if end < k + 1:
            return None
        start = max(0, end - self.reference)
        m = end - start
        if self._view is None:
            self._view = sliding_window_view(self.ring, d)
        s = start % self.size
        # Scratch buffers shared by all detectors of this thread: no per-sample
        # allocation, and no per-feature copy of the (reference, window) matrix.
        diff, dist, w = _scratch(self.reference, d)
        p = (n - d + 1) % self.size
        w[:-1] = self.ring[p : p + d - 1]
        w[-1] = x
        np.subtract(self._view[s : s + m], w, out=diff[:m])
        np.einsum("ij,ij->i", diff[:m], diff[:m], out=dist[:m])
        if m > k:
            dist[:m].partition(k - 1)
        return float(dist[:k].sum())

    def learn(self, x, ncm):
        i = self.count % self.size
        self.ring[i] = x
        self.ring[i + self.size] = x
        self.count += 1
        if ncm is not None:
            self.record(ncm)


class _Quietness(_Record):
    """Record test on the quietness, 1 / standard deviation, of the last ``length`` values
    (the newest one and ``length - 1`` from the fine shape ring): a stretch that varies less
    than any stretch of the calibration horizon did (a stuck sensor, a lost source of load).

    The mean and sum of squared deviations of the stored ``length - 1`` values are slid
    along in O(1) (Welford), recomputed from the ring every `_QUIET_REFRESH` samples so
    that rounding cannot accumulate.
    """

    def __init__(self, length, horizon, min_calibration):
        super().__init__(horizon, min_calibration)
        self.length = length
        self.n = 0  # stored values in the statistics: min(count, length - 1)
        self.mean = 0.0
        self.m2 = 0.0

    def quietness(self, x):
        """1 / (standard deviation of the last length-1 stored values and x); None until
        length-1 values are stored."""
        if self.n < self.length - 1:
            return None
        delta = x - self.mean
        m2 = self.m2 + delta * (x - (self.mean + delta / self.length))
        return 1.0 / (math.sqrt(max(m2, 0.0) / self.length) + _QUIET_FLOOR * (abs(self.mean) + 1e-3))

    def slide(self, ring: _ShapeNovelty):
        """Take in the value `ring` just stored, dropping the one that left the stretch."""
        keep, count = self.length - 1, ring.count
        before = self.m2
        y = float(ring.ring[(count - 1) % ring.size])
        if self.n == keep:  # drop the oldest of the stretch
            old = float(ring.ring[(count - 1 - keep) % ring.size])
            mean = self.mean - (old - self.mean) / (keep - 1) if keep > 1 else 0.0
            self.m2 -= (old - self.mean) * (old - mean)
            self.mean, self.n = mean, keep - 1
        self.n += 1
        delta = y - self.mean
        self.mean += delta / self.n
        self.m2 += delta * (y - self.mean)
        # Recompute now and then, and whenever the stretch turned much quieter (the
        # subtraction then cancels): rounding is never taken for quietness.
        if self.n == keep and (count % _QUIET_REFRESH == 0 or self.m2 < 1e-6 * before):
            p = (count - keep) % ring.size
            w = ring.ring[p : p + keep].astype(np.float64)
            self.mean = float(w.mean())
            w -= self.mean
            self.m2 = float(w.dot(w))


class _Channel:
    """State of one feature."""

    last_event = None  # checkpoints written before the soft refractory period had none
    quiet = None  # nor those written before the quietness test

    def __init__(self, p: NoveltyAlarm):
        self.n = 0
        self.lo = math.inf
        self.hi = -math.inf
        self.last_alarm = None
        self.last_z = 0.0
        self.last_event = None  # sample of the last novelty event (z >= 1 after warm-up)
        dtype = np.float32 if p.compact else np.float64
        self.fine = _ShapeNovelty(
            p.window, p.n_neighbors, p.reference_size, p.gap, p.calibration, 50, dtype
        )
        self.coarse = None
        if p.coarse_block:
            self.coarse = _ShapeNovelty(
                p.coarse_window,
                p.coarse_neighbors,
                p.coarse_reference_size,
                p.coarse_window,  # gap of one window: reference never overlaps the query
                p.coarse_calibration,
                10,
                dtype,
            )
        self.quiet = _Quietness(p.quiet_window, p.calibration, 50) if p.quiet_window else None
        self.block_sum = 0.0
        self._cache = None  # (n, x, result) from the last score, reused by learn

    def __getstate__(self):
        state = self.__dict__.copy()
        state["_cache"] = None
        return state

    def evaluate(self, x, p: NoveltyAlarm):
        """(score, fine ncm, coarse ncm, coarse block mean or None, quietness, novelty z) of x."""
        c = self._cache
        if c is not None and c[0] == self.n and c[1] == x:
            return c[2]
        z = 0.0
        lo, hi = self.lo, self.hi
        if hi > lo and (x > hi or x < lo):  # range test
            tol = p.range_tolerance * (1.0 + _RANGE_SETTLING / self.n)
            z = (x - hi if x > hi else lo - x) / (hi - lo) / tol
        ncm_f = self.fine.ncm(x)
        r = self.fine.ratio(ncm_f) / p.margin
        if r > z:
            z = r
        ncm_c = block = None
        if self.coarse is not None and (self.n + 1) % p.coarse_block == 0:
            block = (self.block_sum + x) / p.coarse_block
            ncm_c = self.coarse.ncm(block)
            r = self.coarse.ratio(ncm_c) / p.coarse_margin
            if r > z:
                z = r
        quiet = None
        if self.quiet is not None:
            quiet = self.quiet.quietness(x)
            r = self.quiet.ratio(quiet) / p.quiet_margin
            if r > z:
                z = r
        # z == 1 is the alarm level of every test, raised for a while after a novelty
        # event; map the alarm level to 0.5 and saturate towards 1.
        zl = z
        if self.last_event is not None and self.n - self.last_event < p.recovery:
            zl = z * ((self.n - self.last_event) / p.recovery) ** p.recovery_exponent
        score = 1.0 - 0.5 / zl if zl > 0.5 else 0.0
        if self.n < p.warm_up:
            score = 0.0
        elif (
            self.last_alarm is not None
            and self.n - self.last_alarm <= p.refractory
            and z < p.escalation * self.last_z
        ):
            score = 0.0
        result = (score, ncm_f, ncm_c, block, quiet, z)
        self._cache = (self.n, x, result)
        return result

    def learn(self, x, p: NoveltyAlarm):
        score, ncm_f, ncm_c, block, quiet, z = self.evaluate(x, p)
        if score >= 0.5:
            self.last_alarm = self.n
            self.last_z = z
        if z >= 1.0 and self.n >= p.warm_up:
            self.last_event = self.n
        self.fine.learn(x, ncm_f)
        if self.quiet is not None:
            if quiet is not None:
                self.quiet.record(quiet)
            self.quiet.slide(self.fine)
        if self.coarse is not None:
            if block is None:
                self.block_sum += x
            else:
                self.coarse.learn(block, ncm_c)
                self.block_sum = 0.0
        if x < self.lo:
            self.lo = x
        if x > self.hi:
            self.hi = x
        self.n += 1
        self._cache = None


def _value(v):
    """The feature as a finite float, or None (missing, NaN, inf, non-numeric)."""
    if not isinstance(v, float):  # float (and numpy float64) first: the common case
        if not isinstance(v, Real):
            return None
        v = float(v)
    return v if v - v == 0.0 else None  # false for NaN and +-inf


class NoveltyAlarm(base.AnomalyDetector):
    """Calibrated novelty alarm for streams with unknown kinds of anomaly.

    Each numeric feature of ``x`` gets its own state and four novelty tests (value
    outside the range seen so far, unseen short-term shape, unseen slow shape, a stretch
    quieter than any before, see the module docstring); the score of ``x`` is the largest score over its features.
    Missing and non-finite values are ignored: they are neither scored nor learned.

    The score is an alarm-onset score: 0 for ordinary samples, 0.5 exactly when a test
    reaches its alarm level, rising towards 1 for stronger novelty, and 0 again for the
    ``refractory`` samples that follow an alarm of the same feature. Threshold it at 0.5
    (or higher for fewer alarms). State per feature is bounded (about
    ``2 * (reference_size + gap + window) + 2 * (coarse_reference_size + 2 * coarse_window)``
    floats, 15 KB with the defaults) and does not grow with the length of the stream.

    On pure noise the record tests are still broken by chance, often while the history
    is short and then about once in 2000 samples per feature; where that matters more
    than NAB's early detections, report only higher scores after a longer history (an
    alert decision on the score, as in the example below) rather than change the setting.

    Parameters
    ----------
    warm_up
        Samples per feature learned before any non-zero score is returned.
    window
        Length of the short-term shape (values per window).
    n_neighbors
        Neighbours summed in the shape non-conformity score.
    reference_size
        Number of older windows the shape is compared with.
    gap
        Age (in samples) a window must reach before it joins the reference set, so that
        a new regime is not excused by its own recent past.
    calibration
        Horizon (samples) of the record a shape score has to beat.
    margin
        Ratio to the record at which the shape test alarms (1.0: any new record).
    coarse_block
        Samples averaged into one point of the slow shape test; 0 disables that test.
    coarse_window
        Length of the slow shape, in blocks.
    coarse_neighbors
        Neighbours summed in the slow shape score.
    coarse_reference_size
        Number of older slow windows compared with.
    coarse_calibration
        Horizon (blocks) of the record a slow shape score has to beat.
    coarse_margin
        Ratio to the record at which the slow shape test alarms.
    quiet_window
        Values whose standard deviation the quietness test compares with the quietest
        ``quiet_window`` values of the last ``calibration`` samples (at most
        ``reference_size + gap + window - 1``: they are read from the shape test's
        history); 0 disables that test. A deviation within 1e-9 of the level (rounding)
        counts as flat.
    quiet_margin
        Ratio to the record (the quietest stretch) at which the quietness test alarms.
    range_tolerance
        Excursion beyond the observed range, as a fraction of its width, at which the
        range test alarms.
    refractory
        Samples after an alarm during which the same feature scores 0 ...
    escalation
        ... unless its novelty is at least this many times that of the alarm: a much
        stronger anomaly right after a weak one is still reported. ``math.inf`` makes
        the refractory period absolute.
    recovery
        Samples after a novelty event (any test at its alarm level, reported or not)
        during which the feature's alarm level is raised; 0 disables.
    recovery_exponent
        The raised alarm level is ``(recovery / age) ** recovery_exponent`` at ``age``
        samples after the event.
    compact
        Keep the histories as float32: half the memory (about 7 KB per feature with the
        defaults), distances still computed in float64; for many models kept at once
        (one per node of a cluster). On by default, and scored so on NAB (the same
        score as float64 there). Turn it off for a feature whose variation is below
        float32's resolution of its level (about 6e-8 of the value).

    Examples
    --------
    Two features of a NIC port, Gaussian noise; congestion notifications jump at t = 2500:

    >>> import random
    >>> from fabricwatch.models.baseline import NoveltyAlarm
    >>> def run(model, seed=42):
    ...     rng = random.Random(seed)
    ...     scores = []
    ...     for t in range(3000):
    ...         x = {"tx_gbps": rng.gauss(380.0, 4.0),
    ...              "cnp_per_s": rng.gauss(100.0 if t < 2500 else 160.0, 5.0)}
    ...         scores.append(model.score_one(x))
    ...         model.learn_one(x)
    ...     return scores
    >>> scores = run(NoveltyAlarm())
    >>> max(scores[:150])  # warm-up
    0.0
    >>> round(scores[2500], 3)  # the jump
    0.993
    >>> [t for t, s in enumerate(scores) if s >= 0.5]
    [161, 220, 362, 401, 475, 534, 688, 1230, 1444, 1854, 2500]

    With the NAB-tuned defaults, chance records of the noise alarm too, mostly while the
    history is short; the new level alarms once, not at each record it keeps setting
    (the soft refractory period). Where chance records cost more than late detections,
    keep this detector and decide downstream what to report, as the worker does for
    ``unknown_anomaly`` (``models/unknown.py``: score >= 0.9 once 1000 samples are learned):

    >>> [t for t, s in enumerate(scores) if s >= 0.9 and t >= 1000]
    [1444, 2500]

    """

    # for checkpoints written before these parameters existed
    recovery = RECOVERY_SAMPLES
    recovery_exponent = RECOVERY_EXPONENT
    quiet_window = QUIET_WINDOW
    quiet_margin = QUIET_MARGIN

    def __init__(
        self,
        warm_up: int = 150,
        window: int = 19,
        n_neighbors: int = 27,
        reference_size: int = 300,
        gap: int = 300,
        calibration: int = 3000,
        margin: float = 1.0,
        coarse_block: int = 8,
        coarse_window: int = 36,
        coarse_neighbors: int = 1,
        coarse_reference_size: int = 200,
        coarse_calibration: int = 100,
        coarse_margin: float = 1.3,
        quiet_window: int = QUIET_WINDOW,
        quiet_margin: float = QUIET_MARGIN,
        range_tolerance: float = 0.015,
        refractory: int = 30,
        escalation: float = 2.0,
        recovery: int = RECOVERY_SAMPLES,
        recovery_exponent: float = RECOVERY_EXPONENT,
        compact: bool = True,
    ):
        self.warm_up = warm_up
        self.window = window
        self.n_neighbors = n_neighbors
        self.reference_size = reference_size
        self.gap = gap
        self.calibration = calibration
        self.margin = margin
        self.coarse_block = coarse_block
        self.coarse_window = coarse_window
        self.coarse_neighbors = coarse_neighbors
        self.coarse_reference_size = coarse_reference_size
        self.coarse_calibration = coarse_calibration
        self.coarse_margin = coarse_margin
        self.quiet_window = quiet_window
        self.quiet_margin = quiet_margin
        self.range_tolerance = range_tolerance
        self.refractory = refractory
        self.escalation = escalation
        self.recovery = recovery
        self.recovery_exponent = recovery_exponent
        self.compact = compact
        self._validate()
        self._channels: dict[base.typing.FeatureName, _Channel] = {}

    def _validate(self):
        def need(name, ok, what):
            if not ok:
                raise ValueError(f"{name} must be {what}, got {getattr(self, name)!r}")

        def is_int(v):
            return isinstance(v, int) and not isinstance(v, bool)

        def is_num(v):
            return isinstance(v, Real) and not isinstance(v, bool) and math.isfinite(v)

        for name in ("warm_up", "refractory", "coarse_block", "recovery", "quiet_window"):
            need(name, is_int(getattr(self, name)) and getattr(self, name) >= 0, "an int >= 0")
        for name in ("window", "coarse_window"):
            need(name, is_int(getattr(self, name)) and getattr(self, name) >= 2, "an int >= 2")
        for name in ("n_neighbors", "coarse_neighbors", "gap", "calibration", "coarse_calibration"):
            need(name, is_int(getattr(self, name)) and getattr(self, name) >= 1, "an int >= 1")
        for name, k in (
            ("reference_size", "n_neighbors"),
            ("coarse_reference_size", "coarse_neighbors"),
        ):
            v = getattr(self, name)
            need(name, is_int(v) and v > getattr(self, k), f"an int > {k}")
        span = self.reference_size + self.gap + self.window - 1  # values the fine ring holds
        need("quiet_window", self.quiet_window == 0 or 2 <= self.quiet_window <= span,
             f"0 (off) or in [2, reference_size + gap + window - 1 = {span}]")
        for name in ("margin", "coarse_margin", "range_tolerance", "quiet_margin"):
            need(name, is_num(getattr(self, name)) and getattr(self, name) > 0, "a number > 0")
        need("recovery_exponent", is_num(self.recovery_exponent) and self.recovery_exponent >= 0,
             "a number >= 0")
        v = self.escalation
        need("escalation", isinstance(v, Real) and not isinstance(v, bool) and v >= 1,
             "a number >= 1 (math.inf: never)")

    @classmethod
    def _unit_test_params(cls):
        yield {}
        yield {"warm_up": 20, "coarse_block": 0, "refractory": 0}

    def learn_one(self, x: dict) -> None:
        channels = self._channels
        for name, v in x.items():
            v = _value(v)
            if v is None:  # missing / NaN / inf / non-numeric: not learned
                continue
            ch = channels.get(name)
            if ch is None:
                ch = channels[name] = _Channel(self)
            ch.learn(v, self)

    def score_one(self, x: dict) -> float:
        score = 0.0
        channels = self._channels
        for name, v in x.items():
            ch = channels.get(name)
            if ch is None:
                continue
            v = _value(v)
            if v is not None:
                s = ch.evaluate(v, self)[0]
                if s > score:
                    score = s
        return score
