"""A scripted backend that reports known metrics and samples, and a sink that keeps them: ``agl train``'s
path to the metric sinks without a model."""

from __future__ import annotations

from agl_core import hookimpl
from agl_core.runs.train import run

KEY = "sk-agl-tracking-secret"

TRAJECTORY = {
    "step": 1,
    "rollout_id": "r0",
    "group_id": "g0",
    "reward": 1.0,
    "n_calls": 2,
    "prompt": "go | left",
    "response": "left\nnow",
}
MISMATCH = {
    "step": 1,
    "rollout_id": "r0",
    "group_id": "g0",
    "turn_index": 1,
    "kind": "template",
    "context_ids": [1, 2],
    "prompt_ids": [1, 3],
}

# step -> (metrics, samples) a scripted backend reports
SCRIPT = {
    0: ({"val/reward": 0.5}, {}),
    1: ({"training/reward": 0.25, "actor/pg_loss": 0.1}, {"trajectories": [TRAJECTORY], "mismatches": [MISMATCH]}),
    2: ({"training/reward": 0.75, "actor/pg_loss": float("nan")}, {"trajectories": [{**TRAJECTORY, "step": 2}]}),
}


class Scripted:
    """A backend reporting :data:`SCRIPT` from step ``trainer.total_training_steps - 2`` (0, or where
    a resumed run would start) on."""

    def __init__(self, config, plugins):
        self.first = int(config.trainer.total_training_steps) - 2

    def fit(self, on_step=None):
        for step in range(self.first, self.first + 3):
            metrics, samples = SCRIPT[step - self.first]
            samples = {name: [{**row, "step": step} for row in rows] for name, rows in samples.items()}
            on_step(step, self.first + 2, {**metrics, "script/step": float(step)}, samples)


class Memory:
    """A third-party sink: keeps what it is given."""

    def __init__(self, context):
        self.context = context
        self.calls: list[tuple] = []
        OPENED.append(self)

    def log_samples(self, step, samples):
        self.calls.append(("samples", step, {name: list(rows) for name, rows in samples.items()}))

    def log_metrics(self, step, metrics):
        self.calls.append(("metrics", step, dict(metrics)))

    def close(self):
        self.calls.append(("close",))


OPENED: list[Memory] = []


class Plugin:
    @hookimpl
    def agl_register_metric_sinks(self, register):
        register("memory", Memory)

    @hookimpl
    def agl_register_backends(self, register):
        register("scripted", Scripted)


def scripted_run(run_dir, logger, first_step=0):
    """``agl train`` on the scripted backend, logging to the sinks named in ``logger``."""
    overrides = [
        "agentlightning.backend=scripted",
        f"agentlightning.agl_key={KEY}",
        f"trainer.default_local_dir={run_dir}",
        f"trainer.total_training_steps={first_step + 2}",
        "trainer.project_name=agl-tests",
        "trainer.experiment_name=scripted",
        f"trainer.logger=[{','.join(logger)}]",
    ]
    return run(None, overrides, plugins=[Plugin()], show_progress=False)
