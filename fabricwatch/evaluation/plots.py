"""The evaluation's plots (matplotlib, imported only here): F1 per class, detection
delays, false alarms on healthy runs.

Separate from the markdown report because it is the only code that needs matplotlib, and
the report only links the files it writes.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np

from .runs import DETECTORS, FABRICWATCH, HST, STATIC
from .scenarios import FAULT_CLASSES, T_DETECT_S
from .scoring import TARGET_F1, TARGET_FP_PER_1000_NODE_HOURS, ClassScore, Scores, per_1000, poisson_upper


def write_plots(scores: Scores, out_dir: Path, detectors: tuple[str, ...] = DETECTORS) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out_dir.mkdir(parents=True, exist_ok=True)
    files: list[Path] = []
    colors = {FABRICWATCH: "#1f77b4", STATIC: "#ff7f0e", HST: "#2ca02c"}
    classes = [c for c in FAULT_CLASSES]

    # 1. F1 / precision / recall per class
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2), sharey=True)
    width = 0.8 / len(detectors)
    x = np.arange(len(classes))
    for ax, metric in zip(axes, ("f1", "precision", "recall")):
        for k, d in enumerate(detectors):
            vals = [getattr(scores.classes[d].get(c, ClassScore()), metric) for c in classes]
            ax.bar(x + (k - (len(detectors) - 1) / 2) * width, [v if v is not None else 0 for v in vals], width,
                   label=d, color=colors.get(d))
            for xi, v in zip(x, vals):
                if v is None:
                    ax.text(xi + (k - (len(detectors) - 1) / 2) * width, 0.01, "n/a", rotation=90, fontsize=6,
                            ha="center", va="bottom")
        ax.axhline(TARGET_F1, color="grey", lw=0.8, ls="--")
        ax.set_title(metric.upper() if metric == "f1" else metric)
        ax.set_xticks(x, [c.replace("_", "\n") for c in classes], fontsize=7)
        ax.set_ylim(0, 1.05)
    axes[0].legend(fontsize=8, loc="lower left")
    fig.suptitle("Per fault class, labelled suites (dashed: 0.95 target)")
    fig.tight_layout()
    p = out_dir / "scores_by_class.png"
    _save(fig, p, files)

    # 2. detection delay distributions per class
    fig, axes = plt.subplots(1, len(classes), figsize=(2.3 * len(classes), 4.2))
    for ax, c in zip(axes, classes):
        data, labels = [], []
        for d in detectors:
            v = [max(s, 1e-3) for s in scores.classes[d].get(c, ClassScore()).delays_s]
            data.append(v if v else [np.nan])
            labels.append(d.replace(" ", "\n"))
        for k, v in enumerate(data):
            jitter = (np.random.default_rng(k).random(len(v)) - 0.5) * 0.3
            ax.scatter(np.full(len(v), k) + jitter, v, s=8, alpha=0.6, color=colors.get(detectors[k]))
            if np.isfinite(v).any():
                ax.hlines(np.nanmedian(v), k - 0.3, k + 0.3, color="black", lw=1.2)
        ax.set_yscale("log")
        ax.set_xticks(range(len(detectors)), labels, fontsize=6)
        ax.set_title(c.replace("_", "\n"), fontsize=8)
        ax.set_ylim(1e-3, 500)
        if c == "pfc_storm":
            ax.axhline(T_DETECT_S + 0.1, color="red", lw=0.8, ls="--")
    axes[0].set_ylabel("detection delay after onset [s] (log)")
    fig.suptitle("Detection delay of true positives (bar: median; red dashed: T_detect + 100 ms)")
    fig.tight_layout()
    p = out_dir / "delay_by_class.png"
    _save(fig, p, files)

    # 3. false alarms per 1000 node-hours on healthy runs
    fig, ax = plt.subplots(figsize=(7, 3.8))
    vals = []
    for d in detectors:
        n = sum(scores.healthy_fp[d].values())
        vals.append(per_1000(n, scores.healthy_node_hours) or 0.0)
    bars = ax.bar(range(len(detectors)), [max(v, 0.1) for v in vals], color=[colors.get(d) for d in detectors])
    uppers = [per_1000(poisson_upper(sum(scores.healthy_fp[d].values())), scores.healthy_node_hours) or 0.0
              for d in detectors]
    for b, v, u in zip(bars, vals, uppers):
        ax.text(b.get_x() + b.get_width() / 2, max(v, u, 0.1) * 1.8, f"{v:,.0f}" if v >= 1 else f"{v:.3g}",
                ha="center", fontsize=8)
    ax.set_ylim(0.05, max(uppers + vals + [10.0]) * 10)
    ax.scatter(range(len(detectors)), uppers, marker="_", s=400, color="black", zorder=3,
               label="95% upper bound")
    ax.legend(fontsize=8, loc="upper left")
    ax.set_yscale("log")
    ax.axhline(TARGET_FP_PER_1000_NODE_HOURS, color="grey", lw=0.8, ls="--")
    ax.set_xticks(range(len(detectors)), detectors)
    ax.set_ylabel("false alarms / 1000 node-hours (log)")
    ax.set_title(f"Healthy runs, {scores.healthy_node_hours:.3g} node-hours (dashed: target 1)")
    fig.tight_layout()
    p = out_dir / "false_alarms_healthy.png"
    _save(fig, p, files)
    return files


def _save(fig, path: Path, files: list[Path]) -> None:
    import matplotlib.pyplot as plt

    fig.savefig(path, dpi=110)
    plt.close(fig)
    files.append(path)

