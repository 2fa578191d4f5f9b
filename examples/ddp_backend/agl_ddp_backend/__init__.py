"""``ddp``: an agl backend on plain PyTorch, data parallel over gloo (CPU processes).

agl runs the step loop (:class:`agl_core.LoopBackend`); this package supplies what the loop asks of
a backend. The driver (the ``agl train`` process) keeps a copy of the policy that an in-process
:class:`agl_core.PolicyServer` serves to the agents, and ``agentlightning.plugins.ddp.processes``
worker processes (:mod:`agl_ddp_backend.worker`) train it in ``DistributedDataParallel``: every
update goes to all of them, rank 0 sends the new weights back, and the driver serves them.

What it does not implement is refused with an error naming the key (:data:`agl_core.PLAIN_UPDATE_KEYS`).
"""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Mapping
from multiprocessing.connection import wait
from pathlib import Path
from typing import Any

import attrs
import torch
from omegaconf import DictConfig, OmegaConf

from agl_core import (
    AglError,
    BackendSpec,
    ConfigError,
    LoopBackend,
    PluginManager,
    PolicyServer,
    PreparedBatch,
    Served,
    check_plain_update,
    hookimpl,
    tensorize,
)
from agl_core.backends.ppo import check_splittable, take_rows
from agl_ddp_backend.worker import pack, serve_rank, unpack

__all__ = ["DdpBackend", "DdpSettings", "check_ddp_config"]


@attrs.frozen
class DdpSettings:
    """``agentlightning.plugins.ddp``: how many processes train."""

    processes: int = attrs.field(default=2, validator=[attrs.validators.instance_of(int), attrs.validators.ge(1)])


def check_ddp_config(config: DictConfig) -> None:
    """What ``agl check`` refuses before a ``ddp`` run: what the plain update does not implement."""
    check_plain_update(config, "ddp")


class RankError(AglError):
    """A worker process failed or died; the message holds its traceback."""


class DdpBackend(LoopBackend):
    """The backend ``ddp``: the update in worker processes, the weights served by the driver."""

    def __init__(self, config: DictConfig, plugins: PluginManager):
        from transformers import AutoModelForCausalLM, AutoTokenizer

        check_ddp_config(config)
        processes = plugins.settings["ddp"].processes
        loss = plugins.policy_losses.get(config.actor_rollout_ref.actor.policy_loss.loss_mode)
        if processes > 1:
            check_splittable(loss, "agentlightning.plugins.ddp.processes", f"{processes} processes' shares")
        if config.actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu is not None:
            check_splittable(loss, "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu", "micro-batches")
        folder = str(config.actor_rollout_ref.model.path)
        super().__init__(config, plugins, AutoTokenizer.from_pretrained(folder))
        rows = int(config.actor_rollout_ref.actor.ppo_mini_batch_size) * int(config.actor_rollout_ref.rollout.n)
        if rows < processes:
            raise ConfigError(
                "agentlightning.plugins.ddp.processes", f"is {processes}, more than the {rows} rows of a mini-batch"
            )
        actor = OmegaConf.to_container(config.actor_rollout_ref.actor, resolve=True)
        self.model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
        self.server = PolicyServer(self.model, self.tokenizer, folder, seed=int(config.trainer.seed))
        self._store = tempfile.mkdtemp(prefix="agl-ddp-")
        context = torch.multiprocessing.get_context("spawn")
        self.pipes, self.processes = [], []
        dropout = bool(config.agentlightning.disable_dropout)
        for rank in range(processes):
            here, there = context.Pipe()
            args = (rank, processes, f"{self._store}/store", folder, actor, loss, dropout, there)
            self.processes.append(context.Process(target=serve_rank, args=args, daemon=True))
            self.processes[-1].start()
            self.pipes.append(here)

    def _call(self, command: str, *args: Any) -> Any:
        """Run ``command`` on every rank; rank 0's result. A rank that fails or dies fails the call at
        once (the others may wait in a collective: :meth:`close` ends them)."""
        for pipe in self.pipes:
            pipe.send_bytes(pack((command, args)))
        results: dict[int, Any] = {}
        while len(results) < len(self.pipes):
            for pipe in wait([p for rank, p in enumerate(self.pipes) if rank not in results]):
                rank = self.pipes.index(pipe)
                try:
                    ok, value = unpack(pipe.recv_bytes())
                except EOFError:
                    ok, value = False, f"exited with code {self.processes[rank].exitcode}"
                if not ok:
                    raise RankError(f"rank {rank} failed in {command}: {value}")
                results[rank] = value
        return results[0]

    def update(self, prepared: PreparedBatch) -> dict[str, float]:
        assert prepared.shaped is not None
        padded = tensorize(prepared.shaped.rows, pad_token_id=self.tokenizer.pad_token_id or 0)
        tensors = take_rows(padded.tensors, slice(None))
        advantages = prepared.advantages(tensors["responses"].shape[1])
        metrics, weights = self._call("update", tensors, advantages, prepared.shaped.n_mini_batches)
        self.model.load_state_dict(weights)
        return metrics

    def serve(self, version: int) -> Served:
        self.server.start()
        self.server.push_weights(self.model, version)
        return Served([self.server.base_url])

    def save_checkpoint(self, folder: Path) -> dict[str, Any]:
        self.model.save_pretrained(folder / "model")
        self.tokenizer.save_pretrained(folder / "model")
        return {"optimizer": self._call("optimizer_state"), "sampler_rng": self.server.sampler_state()}

    def load_checkpoint(self, folder: Path, state: Mapping[str, Any]) -> None:
        self.model = type(self.model).from_pretrained(folder / "model", dtype=torch.float32)
        self._call("load", self.model.state_dict(), state["optimizer"])
        self.server.restore_sampler_state(state["sampler_rng"])

    def close(self) -> None:
        self.server.close()
        for pipe, process in zip(self.pipes, self.processes):
            if process.is_alive():
                pipe.send_bytes(pack(("stop", ())))
        for process in self.processes:  # a rank stuck in a collective (another failed) is killed
            process.join(timeout=30)
            if process.is_alive():
                process.kill()
        shutil.rmtree(self._store, ignore_errors=True)


@hookimpl
def agl_plugin_settings() -> dict[str, type]:
    return {"ddp": DdpSettings}


@hookimpl
def agl_register_backends(register: Any) -> None:
    register("ddp", BackendSpec(DdpBackend, check_config=check_ddp_config))
