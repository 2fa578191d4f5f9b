"""Metric sink ``wandb``: a Weights & Biases run (``trainer.project_name`` / ``trainer.experiment_name``)
whose local files live in ``<run dir>/wandb``.

W&B's own environment settles the mode: ``WANDB_MODE=offline`` writes the run only to that folder
(``wandb sync`` uploads it later), otherwise W&B needs its usual login. The run's config is the run
config with the gateway key redacted, and W&B's system metadata (which records the command line,
where a key given as an override would show) is not collected. Sample tables are logged as W&B
tables ``samples/<table>``. The run id is kept in ``<run dir>/wandb/run_id``, so a resumed run logs
into the same W&B run (W&B ignores steps it has already recorded).
"""

from __future__ import annotations

import uuid
from collections.abc import Mapping
from typing import Any

from agl_core.config import ConfigError
from agl_core.data import StepSamples
from agl_core.tracking.sink import SinkContext, error_gist, table_columns

__all__ = ["RUN_ID_FILE", "WANDB_DIR", "WandB"]

WANDB_DIR = "wandb"
RUN_ID_FILE = "run_id"


class WandB:
    def __init__(self, context: SinkContext):
        try:
            import wandb
        except ImportError as exc:
            raise ConfigError("trainer.logger", f"metric sink 'wandb' needs the wandb package ({exc})") from exc
        self._wandb = wandb
        folder = context.run_dir / WANDB_DIR
        folder.mkdir(parents=True, exist_ok=True)
        id_file = folder / RUN_ID_FILE
        if not id_file.is_file():
            id_file.write_text(uuid.uuid4().hex[:16] + "\n")
        try:
            self.run: Any = wandb.init(
                project=context.project_name,
                name=context.experiment_name,
                id=id_file.read_text().strip(),
                resume="allow",
                dir=str(context.run_dir),
                config=dict(context.config),
                settings=wandb.Settings(x_disable_meta=True),
            )
        except Exception as exc:
            raise ConfigError(
                "trainer.logger",
                f"metric sink 'wandb' could not start a W&B run ({error_gist(exc)}); log in (wandb login, "
                f"or WANDB_API_KEY), or set WANDB_MODE=offline to keep the run in {folder} only "
                "(wandb sync uploads it later), "
                "or leave wandb out of trainer.logger",
            ) from exc

    def log_samples(self, step: int, samples: StepSamples) -> None:
        tables = {}
        for name, rows in samples.items():
            columns, data = table_columns(rows)
            tables[f"samples/{name}"] = self._wandb.Table(columns=columns, data=data)
        self.run.log(tables, step=step)

    def log_metrics(self, step: int, metrics: Mapping[str, float]) -> None:
        self.run.log({name: float(value) for name, value in metrics.items()}, step=step)

    def close(self) -> None:
        self.run.finish()
