"""A verl run config as a verl user writes it, for the CLI tests of backend ``verl``."""

from __future__ import annotations

import textwrap
from pathlib import Path

# A run config as a verl user writes it: core keys plus keys that only verl's config has.
VERL_YAML = """
agentlightning:
  backend: {backend}
data:
  train_files: {dataset}
  val_files: {dataset}
  train_batch_size: 2
actor_rollout_ref:
  model:
    path: /models/tiny
  actor:
    ppo_mini_batch_size: 2
    ppo_micro_batch_size_per_gpu: 1
    fsdp_config:
      {offload_key}: true
  rollout:
    gpu_memory_utilization: 0.25
trainer:
  logger: [console]
"""


def write_config(tmp_path: Path, backend: str = "verl", offload_key: str = "param_offload") -> Path:
    """``config.yaml`` and its two-row dataset in ``tmp_path``, under ``backend``."""
    dataset = tmp_path / "rows.jsonl"
    dataset.write_text('{"signs": ["left"]}\n{"signs": ["right"]}\n')
    path = tmp_path / "config.yaml"
    path.write_text(textwrap.dedent(VERL_YAML.format(backend=backend, dataset=dataset, offload_key=offload_key)))
    return path
