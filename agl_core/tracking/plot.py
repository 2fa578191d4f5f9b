"""A PNG of a run's metrics per step: reward first, then the main training metrics.

Reads the run's ``metrics.jsonl`` (one JSON object per step with ``step`` and metric names). A step
logged twice (a run resumed from an earlier checkpoint repeats the steps after it) is plotted with
its last values.
"""

from __future__ import annotations

import math
from pathlib import Path

from agl_core.errors import FileFormatError
from agl_core.files.jsonl import read_json_objects

PANELS = (
    ("training/reward", "reward"),
    ("val/reward", "validation reward"),
    ("actor/pg_loss", "policy-gradient loss"),
    ("actor/loss", "actor loss (total)"),
    ("actor/entropy_loss", "entropy"),
    ("actor/grad_norm", "grad norm"),
    ("actor/ppo_kl", "PPO KL"),
    ("training/n_sample", "training rows"),
    ("timing/step_s", "step time (s)"),
)


def read_metrics(path: str | Path) -> dict[int, dict[str, float]]:
    """Metrics by step (the last line of a step wins)."""
    by_step: dict[int, dict[str, float]] = {}
    for number, record in read_json_objects(path):
        if not isinstance(record.get("step"), int):
            raise FileFormatError(f"{path} line {number} has no integer 'step'")
        by_step[record["step"]] = record
    return dict(sorted(by_step.items()))


def _points(by_step: dict[int, dict[str, float]], key: str) -> list[tuple[int, float]]:
    """``(step, value)`` of ``key`` where it is finite (``null`` is a NaN the run log wrote); any value
    that is not a number, or values too far apart for a float axis, are a
    :class:`~agl_core.errors.FileFormatError` naming the metric."""
    points = []
    for step, metrics in by_step.items():
        value = metrics.get(key)
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise FileFormatError(f"metric {key!r} of step {step} is {value!r:.60}, not a number")
        if isinstance(value, int) and abs(value) >= 2**1024:
            raise FileFormatError(f"metric {key!r} of step {step} is an integer beyond a float's range")
        if math.isfinite(value):
            points.append((step, float(value)))
    values = [v for _, v in points]
    if values and not math.isfinite(max(values) - min(values)):
        raise FileFormatError(f"metric {key!r} spans {min(values):g} to {max(values):g}, too wide to plot")
    return points


def plot_metrics(metrics_path: str | Path, out_path: str | Path) -> Path:
    """Write the PNG of ``metrics_path`` to ``out_path`` and return it."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    by_step = read_metrics(metrics_path)
    if not by_step:
        raise FileFormatError(f"{metrics_path} holds no steps to plot")
    panels = [(key, title) for key, title in PANELS if any(key in m for m in by_step.values())]
    if not panels:
        raise FileFormatError(f"{metrics_path} holds none of the metrics agl plots ({', '.join(k for k, _ in PANELS)})")
    series = {key: _points(by_step, key) for key, _ in panels}
    fig, axes = plt.subplots(len(panels), 1, figsize=(7, 2.2 * len(panels)), sharex=True, squeeze=False)
    for ax, (key, title) in zip(axes[:, 0], panels):
        points = series[key]
        ax.plot([p[0] for p in points], [p[1] for p in points], marker="." if len(points) < 50 else None)
        ax.set_ylabel(title)
        ax.grid(alpha=0.3)
    axes[-1, 0].set_xlabel("step")
    fig.tight_layout()
    out = Path(out_path)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return out
