"""The reference backend (``agentlightning.backend: torch``): one process, PyTorch, any local causal LM.

One training step, with every stage reached through the plugin registries:

rollouts (embedded source, or the gateway when ``agl_base_url`` is set) → Triplets → the configured
aggregator → the configured advantage estimator (on everything collected) → batch shaping → tensors
→ old log-probs → for each PPO epoch and mini-batch: the configured policy loss (+ optional KL to
the initial policy, − ``actor.entropy_coeff`` × the policy's entropy, weighted over tokens as the
loss is; ``actor/entropy`` is reported either way) → AdamW step with gradient clipping → lr schedule step → the serving copy of the
policy gets the new weights.

Validation (``data.val_files``): before the first step when ``trainer.val_before_train`` is set, and
after every ``trainer.test_freq``-th step and the last, one rollout per validation row
(``is_train=False``; the embedded source samples them at
``actor_rollout_ref.rollout.val_kwargs.temperature``, 0 = greedy), in batches of
``data.val_batch_size`` (all rows at once when unset). ``val/reward`` is the mean final reward over
every validation rollout of every batch (Agent Lightning v1.0 keeps only the last batch's); the
sources' counters are summed over the batches under ``val/`` instead of ``training/``.

Async rollout (``agentlightning.async_rollout.enabled``; gateway only): a run's first step hands the
source enough batches to keep ``async_train_batch_size`` groups in flight, later steps one batch (the
source tops up and carries unfinished groups over); the gateway is paused and drained between the
rollouts and the update, and resumed once the new weights are registered. Every step reports the
staleness of the calls it trains (``training/async/staleness_*``, from the shared pipeline).

The policy is served by ``agentlightning.engine``: ``builtin`` (:class:`~agl_core.serving.policy_server.PolicyServer`,
in-process) or ``vllm`` (:class:`~agl_core.serving.vllm_engine.VllmEngine`). A vLLM server that dies
mid-step fails that step's rollouts (counted) and is restarted at the weight push
(``training/engine/n_restarts``). Checkpoints
(:mod:`agl_core.backends.torch.checkpoint`) hold model, optimizer, scheduler, step, data position and RNG states;
with ``trainer.resume_mode: auto`` a run continues from the newest one in ``trainer.default_local_dir``.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import attrs
import numpy as np
import torch

from agl_core.backends.torch.checkpoint import latest_checkpoint, load_checkpoint, restore_rng_states, rng_states, save_checkpoint
from agl_core.config import ConfigError
from agl_core.data import CompletedRollout, TrainingRow
from agl_core.hookspecs import hookimpl
from agl_core.datasets import load_dataset
from agl_core.stages.policy_loss import LossSettings
from agl_core.stages.normalization import token_weights
from agl_core.stages.pipeline import PreparedBatch, StepPipeline, rollout_metrics
from agl_core.stages.micro_batches import MicroBatch, micro_batches
from agl_core.stages.tensorize import pad_responses, tensorize
from agl_core.serving.vllm_engine import VllmEngineError

logger = logging.getLogger(__name__)

OnStep = Callable[[int, int, Mapping[str, float]], None]


def model_folder(config: Any) -> Path:
    path = config.actor_rollout_ref.model.path
    key = "actor_rollout_ref.model.path"
    if not path:
        raise ConfigError(key, "the policy's model folder is not set")
    folder = Path(path)
    if not (folder / "config.json").is_file():
        what = "does not exist" if not folder.exists() else "has no config.json"
        raise ConfigError(key, f"model folder {path} {what} (a local Hugging Face causal LM folder is needed)")
    return folder


def pick_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise ConfigError("agentlightning.torch.device", f"{name} was asked for, but no CUDA device is available")
    return torch.device(name)


def lr_lambda(optim: Any, total_steps: int) -> Callable[[int], float]:
    """verl's schedules: linear warmup over ``lr_warmup_steps``, then constant or cosine down to
    ``min_lr_ratio``."""
    kind = optim.lr_scheduler_type
    if kind not in ("constant", "cosine"):
        raise ConfigError("actor_rollout_ref.actor.optim.lr_scheduler_type", f"must be constant or cosine, got {kind!r}")
    warmup = max(0, int(optim.lr_warmup_steps))
    floor = float(optim.min_lr_ratio)

    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        if kind == "constant":
            return 1.0
        progress = min(1.0, (step - warmup) / max(1, total_steps - warmup))
        return floor + (1.0 - floor) * 0.5 * (1.0 + math.cos(math.pi * progress))

    return factor


def response_distributions(model: torch.nn.Module, tensors: Mapping[str, torch.Tensor]) -> torch.Tensor:
    """Log-softmax over the vocabulary at every response position, ``[rows, response_len, vocab]``."""
    width = tensors["responses"].shape[1]
    logits = model(
        input_ids=tensors["input_ids"], attention_mask=tensors["attention_mask"], position_ids=tensors["position_ids"]
    ).logits[:, -width - 1 : -1, :]
    return torch.log_softmax(logits.float(), dim=-1)


def chosen_log_probs(distributions: torch.Tensor, responses: torch.Tensor) -> torch.Tensor:
    """The log-probs of the ``responses`` tokens, ``[rows, response_len]``, from :func:`response_distributions`."""
    return distributions.gather(-1, responses[..., None]).squeeze(-1)


def response_log_probs(model: torch.nn.Module, tensors: Mapping[str, torch.Tensor]) -> torch.Tensor:
    """Log-probs of the response tokens under ``model``, ``[rows, response_len]``."""
    return chosen_log_probs(response_distributions(model, tensors), tensors["responses"])


def token_entropy(log_probs: torch.Tensor) -> torch.Tensor:
    """The policy's entropy at every position, from its log-softmax ``[..., vocab]``."""
    return -(log_probs.exp() * log_probs).sum(-1)


def low_var_kl(log_prob: torch.Tensor, ref_log_prob: torch.Tensor) -> torch.Tensor:
    """The k3 estimator of KL(policy ‖ reference) per token, clamped as verl does."""
    diff = torch.clamp(ref_log_prob - log_prob, min=-20, max=20)
    return torch.clamp(torch.exp(diff) - diff - 1, min=-10, max=10)


class DataOrder:
    """The training rows in epoch order: reshuffled per epoch from ``(seed, epoch)``, so a position
    ``(epoch, index)`` names the same rows in every run; an incomplete last batch is skipped."""

    def __init__(self, rows: Sequence[Mapping[str, Any]], batch_size: int, shuffle: bool, seed: int):
        if len(rows) < batch_size:
            raise ConfigError("data.train_batch_size", f"is {batch_size}, but the dataset has only {len(rows)} rows")
        self.rows, self.batch_size, self.shuffle, self.seed = rows, batch_size, shuffle, seed
        self.steps_per_epoch = len(rows) // batch_size
        self.epoch, self.index = 0, 0

    def next_batch(self) -> list[Mapping[str, Any]]:
        if self.index >= self.steps_per_epoch:
            self.epoch, self.index = self.epoch + 1, 0
        order = np.random.default_rng([self.seed, self.epoch]).permutation(len(self.rows)) if self.shuffle else np.arange(len(self.rows))
        picked = order[self.index * self.batch_size : (self.index + 1) * self.batch_size]
        self.index += 1
        return [self.rows[i] for i in picked]

    def position(self) -> dict[str, int]:
        return {"epoch": self.epoch, "index": self.index}

    def restore(self, position: Mapping[str, int]) -> None:
        self.epoch, self.index = int(position["epoch"]), int(position["index"])


class TorchBackend:
    """The reference backend; ``fit(on_step)`` trains until the configured number of steps."""

    def __init__(self, config: Any, plugins: Any):
        from transformers import AutoModelForCausalLM, AutoTokenizer

        self.config, self.plugins = config, plugins
        actor = config.actor_rollout_ref.actor
        self.loss_fn = plugins.policy_losses.get(actor.policy_loss.loss_mode)
        folder = model_folder(config)
        self.data = DataOrder(
            load_dataset(config.data.train_files),
            int(config.data.train_batch_size),
            bool(config.data.shuffle),
            int(config.data.seed if config.data.seed is not None else config.trainer.seed),
        )
        self.total_steps = int(config.trainer.total_training_steps or config.trainer.total_epochs * self.data.steps_per_epoch)
        self.val_rows = load_dataset(config.data.val_files, "data.val_files") if config.data.val_files else []
        threads = config.agentlightning.torch.num_threads
        if threads:
            torch.set_num_threads(int(threads))
        torch.manual_seed(int(config.trainer.seed))
        self.device = pick_device(config.agentlightning.torch.device)
        self.tokenizer = AutoTokenizer.from_pretrained(folder)
        self.model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).to(self.device)
        self.ref_model = None
        if actor.use_kl_loss:
            self.ref_model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).to(self.device).eval()
            self.ref_model.requires_grad_(False)
        optim = actor.optim
        self.optimizer = torch.optim.AdamW(
            self.model.parameters(), lr=float(optim.lr), betas=tuple(optim.betas), weight_decay=float(optim.weight_decay)
        )
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, lr_lambda(optim, self.total_steps))
        self.loss_settings = LossSettings.from_actor_config(actor)
        self.pipeline = StepPipeline(config, plugins, self.tokenizer)
        self.run_dir = Path(config.trainer.default_local_dir)
        pad = self.tokenizer.pad_token_id
        self.pad_token_id = int(pad if pad is not None else 0)
        self.step = 0
        self.engine: Any = None
        self.is_async = bool(config.agentlightning.async_rollout.enabled)
        if self.is_async and not config.agentlightning.agl_base_url:
            raise ConfigError(
                "agentlightning.async_rollout.enabled",
                "async rollout runs through the gateway: set agentlightning.agl_base_url (the embedded source is sync only)",
            )

    # -- serving --------------------------------------------------------------------------------

    def make_engine(self) -> Any:
        name = str(self.config.actor_rollout_ref.model.path)
        if self.config.agentlightning.engine == "vllm":
            from agl_core.serving.vllm_engine import VllmEngine

            return VllmEngine.from_config(self.config.agentlightning.vllm, self.config.actor_rollout_ref.model.path, name)
        from agl_core.serving.policy_server import PolicyServer

        return PolicyServer(self.model, self.tokenizer, name, seed=int(self.config.trainer.seed))

    def make_source(self) -> Any:
        if self.config.agentlightning.agl_base_url:
            from agl_core.rollouts.gateway import gateway_source

            return gateway_source(self.config, self.plugins)
        from agl_core.rollouts.embedded import EmbeddedRolloutSource

        return EmbeddedRolloutSource(self.config, self.plugins, self.engine.base_url, self.engine.model_name)

    # -- checkpoints ----------------------------------------------------------------------------

    def save(self) -> Path:
        state = {
            "optimizer": self.optimizer.state_dict(),
            "scheduler": self.scheduler.state_dict(),
            "data": self.data.position(),
            "rng": rng_states(),
        }
        if hasattr(self.engine, "generator_state"):
            state["sampler_rng"] = self.engine.generator_state()
        return save_checkpoint(self.run_dir, self.step, self.model, self.tokenizer, state)

    def resume(self) -> bool:
        """Continue from the newest checkpoint when ``trainer.resume_mode`` is ``auto``."""
        if self.config.trainer.resume_mode != "auto":
            return False
        path = latest_checkpoint(self.run_dir)
        if path is None:
            return False
        state = load_checkpoint(path, self.model)
        self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
        self.data.restore(state["data"])
        restore_rng_states(state["rng"])
        self.step = int(state["step"])
        self._sampler_rng = state.get("sampler_rng")
        logger.info("resumed from %s (step %d)", path, self.step)
        return True

    # -- training -------------------------------------------------------------------------------

    def fit(self, on_step: OnStep | None = None) -> None:
        self._sampler_rng = None
        self.resume()
        self.engine = self.make_engine()
        source = None
        try:
            self.engine.start()
            self.engine.push_weights(self.model, self.step)
            if self._sampler_rng is not None and hasattr(self.engine, "set_generator_state"):
                self.engine.set_generator_state(self._sampler_rng)
            source = self.make_source()
            source.after_weight_update([self.engine.base_url], self.step)
            save_freq = int(self.config.trainer.save_freq)
            test_freq = int(self.config.trainer.test_freq)
            if self.val_rows and self.config.trainer.val_before_train and self.step == 0 and on_step is not None:
                on_step(0, self.total_steps, self.validate(source))
            first = True
            while self.step < self.total_steps:
                metrics = self.train_step(source, self.next_samples(first))
                first = False
                self.step += 1
                if self.val_rows and test_freq > 0 and (self.step % test_freq == 0 or self.step == self.total_steps):
                    metrics.update(self.validate(source))
                # The step is logged before it is checkpointed: a run killed in between resumes from
                # the previous checkpoint, redoes this step, and the run log replaces its line.
                if on_step is not None:
                    on_step(self.step, self.total_steps, metrics)
                if save_freq > 0 and (self.step % save_freq == 0 or self.step == self.total_steps):
                    started = time.perf_counter()
                    self.save()
                    logger.info("checkpoint of step %d saved in %.2f s", self.step, time.perf_counter() - started)
        finally:
            if source is not None:
                source.close()
            self.engine.close()

    def next_samples(self, first: bool) -> list[Mapping[str, Any]]:
        """The next batch; async, at a run's first step, enough batches to put
        ``async_train_batch_size`` groups in flight (the source keeps what it cannot start yet)."""
        samples = self.data.next_batch()
        if self.is_async and first:
            while len(samples) < int(self.config.agentlightning.async_rollout.async_train_batch_size):
                samples += self.data.next_batch()
        return samples

    def validate(self, source: Any) -> dict[str, float]:
        """One rollout per validation row with the current weights; ``val/*`` metrics over all batches."""
        started = time.perf_counter()
        size = int(self.config.data.val_batch_size or len(self.val_rows))
        rollouts: list[CompletedRollout] = []
        counts: dict[str, float] = {}
        n_batches = 0
        for start in range(0, len(self.val_rows), size):
            batch = source.collect(self.val_rows[start : start + size], step=self.step, is_train=False)
            rollouts.extend(batch.rollouts)
            for name, value in batch.metrics.items():
                if name.startswith("training/"):
                    key = "val/" + name[len("training/") :]
                    counts[key] = counts.get(key, 0.0) + value
            n_batches += 1
        return {
            **counts,
            **rollout_metrics(rollouts, "val"),
            "val/n_batches": float(n_batches),
            "timing/val_s": time.perf_counter() - started,
        }

    def train_step(self, source: Any, samples: Sequence[Mapping[str, Any]]) -> dict[str, float]:
        step = self.step + 1
        started = time.perf_counter()
        batch = source.collect(samples, step=step, is_train=True)
        metrics: dict[str, float] = dict(batch.metrics)
        metrics["timing/gen_s"] = time.perf_counter() - started
        metrics.update(source.before_weight_update())  # async: pause the gateway, drain in-flight calls
        update_started = time.perf_counter()
        prepared = self.pipeline.prepare(batch.rollouts, step)
        metrics.update(prepared.metrics)
        if prepared.shaped is not None:
            metrics.update(self.update(prepared))
        self.scheduler.step()
        metrics.update(self.serve_weights(source, step))
        metrics["timing/update_s"] = time.perf_counter() - update_started
        metrics["timing/step_s"] = time.perf_counter() - started
        return metrics

    def serve_weights(self, source: Any, version: int) -> dict[str, float]:
        """Push the weights and register the engine with ``version``. A vLLM server that died (its
        rollouts this step failed and were counted) is started again (an attached one: waited for,
        up to ``agentlightning.vllm.startup_timeout_seconds``) and pushed to once more; a second
        failure ends training."""
        restarts = 0
        try:
            self.engine.push_weights(self.model, version)
        except VllmEngineError as exc:
            logger.warning("weight push failed, restarting the vLLM engine: %s", exc)
            self.engine.start()
            self.engine.push_weights(self.model, version)
            restarts = 1
        source.after_weight_update([self.engine.base_url], version)
        return {"training/engine/n_restarts": float(restarts)}

    def update(self, prepared: PreparedBatch) -> dict[str, float]:
        """PPO epochs over the prepared batch's mini-batches, one optimizer step each; returns the actor metrics.

        With ``actor.use_dynamic_bsz`` a mini-batch's gradients are accumulated over token-budget
        micro-batches (:mod:`agl_core.stages.micro_batches`, at most ``ppo_max_token_len_per_gpu``
        padded tokens each, padded only to their own longest row); the old and reference log-probs
        likewise under ``rollout.log_prob_*`` / ``ref.log_prob_*``. Each micro-batch's loss is its
        share of the mini-batch's loss, so the step equals a single pass's up to float rounding.
        """
        shaped = prepared.shaped
        rows = shaped.rows
        cfg = self.config.actor_rollout_ref
        started = time.perf_counter()
        with torch.no_grad():
            self.model.eval()
            old = self.row_log_probs(self.model, rows, cfg.rollout.log_prob_use_dynamic_bsz, cfg.rollout.log_prob_max_token_len_per_gpu)
            ref = None
            if self.ref_model is not None:
                ref = self.row_log_probs(self.ref_model, rows, cfg.ref.log_prob_use_dynamic_bsz, cfg.ref.log_prob_max_token_len_per_gpu)
        metrics = {"timing/log_prob_s": time.perf_counter() - started}
        started = time.perf_counter()
        self.model.train()
        scales = prepared.row_scales
        advantages = [a if scales is None else a * scales[i] for i, a in enumerate(shaped.advantages)]
        per_mini = len(rows) // shaped.n_mini_batches
        sums: dict[str, float] = {}
        n_updates = 0
        for _ in range(int(cfg.actor.ppo_epochs)):
            for start in range(0, len(rows), per_mini):
                step = self.update_mini_batch(rows, range(start, start + per_mini), old, ref, advantages, scales)
                for name, value in step.items():
                    sums[name] = sums.get(name, 0.0) + value
                n_updates += 1
        padded, real = sums.pop("perf/padded_tokens"), sums.pop("perf/real_tokens")
        metrics.update({k: v if k.startswith("actor/n_") and k != "actor/n_micro_batches" else v / n_updates for k, v in sums.items()})
        metrics["actor/lr"] = float(self.scheduler.get_last_lr()[0])
        metrics["actor/n_updates"] = float(n_updates)
        metrics["perf/total_num_tokens"] = float(sum(len(row.prompt_ids) + len(row.response_ids) for row in rows))
        metrics["perf/padded_per_real_tokens"] = padded / real
        metrics["timing/actor_update_s"] = time.perf_counter() - started
        return metrics

    def row_log_probs(self, model: torch.nn.Module, rows: Sequence[TrainingRow], use_budget: bool, budget: int) -> list[torch.Tensor]:
        """Each row's response log-probs under ``model`` (1-D, unpadded), in token-budget micro-batches
        when ``use_budget``, else in one pass."""
        out: list[torch.Tensor] = [torch.empty(0)] * len(rows)
        for group in micro_batches(*_lengths(rows), budget if use_budget else None):
            log_probs = response_log_probs(model, self._tensors([rows[i] for i in group.rows], group)).cpu()
            for j, i in enumerate(group.rows):
                out[i] = log_probs[j, : len(rows[i].response_ids)]
        return out

    def _tensors(self, rows: Sequence[TrainingRow], group: MicroBatch) -> dict[str, torch.Tensor]:
        """``rows`` (a micro-batch's) padded to the group's own longest prompt and response, on the device."""
        padded = tensorize(rows, pad_token_id=self.pad_token_id, prompt_length=group.prompt_length, response_length=group.response_length)
        return {k: v.to(self.device) for k, v in padded.tensors.items()}

    def update_mini_batch(self, rows, part, old, ref, advantages, scales) -> dict[str, float]:
        """One optimizer step on rows ``part``, gradients accumulated over its micro-batches."""
        actor = self.config.actor_rollout_ref.actor
        mini = [rows[i] for i in part]
        n_tokens = sum(row.n_trained_tokens for row in mini)
        groups = micro_batches(*_lengths(mini), actor.ppo_max_token_len_per_gpu if actor.use_dynamic_bsz else None)
        self.optimizer.zero_grad(set_to_none=True)
        step = {"perf/padded_tokens": 0.0, "perf/real_tokens": float(sum(len(r.prompt_ids) + len(r.response_ids) for r in mini))}
        for group in groups:
            picked = [part[j] for j in group.rows]
            loss, loss_metrics = self.micro_batch_loss(rows, picked, group, n_tokens, old, ref, advantages, scales)
            loss.backward()
            for name, value in loss_metrics.items():
                step[name] = step.get(name, 0.0) + value
            step["perf/padded_tokens"] += group.padded_elements
        grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), float(actor.grad_clip))
        if torch.isfinite(grad_norm):
            self.optimizer.step()
        else:
            step["actor/n_skipped_nonfinite_grad"] = 1.0
        step["actor/grad_norm"] = float(grad_norm)
        step["actor/n_micro_batches"] = float(len(groups))
        return step

    def micro_batch_loss(self, rows, picked, group, n_tokens, old, ref, advantages, scales) -> tuple[torch.Tensor, dict[str, float]]:
        """Rows ``picked`` (one micro-batch of a mini-batch with ``n_tokens`` trained tokens): their
        share of the mini-batch's loss, and their metrics weighted so that micro-batches add up."""
        actor = self.config.actor_rollout_ref.actor
        tensors = self._tensors([rows[i] for i in picked], group)
        mask = tensors["response_mask"]
        width = group.response_length
        old_log_prob = pad_responses([old[i] for i in picked], width, torch.float32).to(self.device)
        adv = pad_responses([advantages[i] for i in picked], width, torch.float32).to(self.device)
        row_scales = None if scales is None else torch.as_tensor(scales[picked], device=self.device)
        distributions = response_distributions(self.model, tensors)
        log_prob = chosen_log_probs(distributions, tensors["responses"])
        settings = attrs.evolve(self.loss_settings, batch_num_tokens=n_tokens)
        loss, loss_metrics = self.loss_fn(old_log_prob, log_prob, adv, mask, settings)
        share = float(mask.sum()) / max(n_tokens, 1)
        out = {name: float(value) * share for name, value in loss_metrics.items()}
        entropy_coeff = float(actor.entropy_coeff)
        with torch.set_grad_enabled(entropy_coeff > 0):
            entropy = (token_weights(mask, row_scales, n_tokens) * token_entropy(distributions)).sum()
        if entropy_coeff > 0:
            loss = loss - entropy_coeff * entropy
        out["actor/entropy"] = entropy.item()
        if ref is not None:
            ref_log_prob = pad_responses([ref[i] for i in picked], width, torch.float32).to(self.device)
            kl = torch.where(mask.bool(), low_var_kl(log_prob, ref_log_prob), 0.0).sum() / max(n_tokens, 1)
            loss = loss + float(actor.kl_loss_coef) * kl
            out["actor/kl_loss"] = kl.item()
        out["actor/pg_loss"] = loss.item()
        return loss, out


def _lengths(rows: Sequence[TrainingRow]) -> tuple[list[int], list[int]]:
    return [len(row.prompt_ids) for row in rows], [len(row.response_ids) for row in rows]


@hookimpl
def agl_register_backends(register: Any) -> None:
    register("torch", TorchBackend)
