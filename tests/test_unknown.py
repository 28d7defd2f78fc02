"""The worker's unknown-anomaly detector (models/unknown.py): the NAB-scored NoveltyAlarm plus
an alert decision on its score (threshold, baseline age), nothing else."""

from __future__ import annotations

import numpy as np

from fabricwatch.models.frames import GPU, NIC_PORT, EntityFrame, SourceView
from fabricwatch.models.unknown import UnknownAnomalyDetector


def node(t_s, tx_bytes_s, power_mw):
    nic = EntityFrame(NIC_PORT, ("mlx5_0/1",), ("port_xmit_data",), np.zeros((1, 1), np.uint64), (),
                      np.empty((1, 0)), [{}])
    nic.rates, nic.dt_s = np.array([[tx_bytes_s]]), 1.0
    gpu = EntityFrame(GPU, ("0",), (), np.zeros((1, 0), np.uint64), ("power_mw",), np.array([[power_mw]]), [{}])
    return SourceView("c1", "node-1", "node", int(t_s * 1e9), 0, [nic, gpu])


def feed(det, t0, t1, tx, power, rng):
    return [f for t in range(t0, t1)
            for f in det.update(node(t, tx + 1e9 * rng.standard_normal(), power + 5e3 * rng.standard_normal()))]


def test_nothing_is_reported_while_the_baseline_is_young():
    det, rng = UnknownAnomalyDetector(window_s=10, report_after=400), np.random.default_rng(1)
    assert feed(det, 0, 2000, 4e10, 4e5, rng) == []
    assert feed(det, 2000, 2100, 4e10, 9e5, rng) == []        # wild power, but 210 windows only


def test_a_clear_novelty_is_reported_once_naming_its_feature():
    det, rng = UnknownAnomalyDetector(window_s=10, report_after=200), np.random.default_rng(2)
    assert feed(det, 0, 3000, 4e10, 4e5, rng) == []
    found = feed(det, 3000, 3100, 4e10, 9e5, rng)              # GPU power jumps, traffic as before
    opened = [f for f in found if f.state == "open"]
    assert [(f.kind, f.evidence[0].name) for f in opened] == [("unknown_anomaly", "gpu_power_w")]
    assert opened[0].confidence >= det.threshold and opened[0].severity == "info"

