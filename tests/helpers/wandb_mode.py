"""W&B's mode for one test: W&B reads its settings from the environment once per process and keeps
them, so a test that sets ``WANDB_MODE`` also drops what an earlier test in this process left."""

from __future__ import annotations


def use_wandb_mode(monkeypatch, mode: str) -> None:
    """``WANDB_MODE=mode``, quiet, with W&B's kept settings torn down so the next run reads it."""
    import wandb

    monkeypatch.setenv("WANDB_MODE", mode)
    monkeypatch.setenv("WANDB_SILENT", "true")
    wandb.teardown()
