"""The step loop, written once: :class:`LoopBackend`, which a backend subclasses with four methods.

::

    fit(on_step)
      start   newest checkpoint loaded (trainer.resume_mode: auto)         load_checkpoint(folder, state)
              the weights served as version = step                         serve(step) -> Served(endpoints)
              plugins.on_startup(config)
              rollout source opened (open_rollout_source: replay | gateway | embedded agents on endpoints)
              source.after_weight_update(endpoints, step); plugins.on_weights_served(endpoints, step)
              the rollouts the checkpoint carried (async) handed back to the source
      steps   run_steps: validation first (fresh run), then per step:
                next dataset batch(es) -> train_step -> validation (test_freq, last) -> on_step(metrics)
                -> checkpoint (save_freq, last)                            save_checkpoint(folder) -> state
                (and what control() asks: a validation, a checkpoint, the end of the run)
      stop    source closed, then the backend                              close()

    train_step(samples), step N
      source.collect(samples)                                              timing/gen_s
      source.before_weight_update()          (async: the gateway paused and drained)
      StepPipeline.prepare(rollouts) -> PreparedBatch (aggregate, estimate, shape, normalise)
      update(prepared)                       (skipped when no row survived shaping)
      serve(N) -> source.after_weight_update(endpoints, N)                 timing/update_s
      plugins.on_weights_served(endpoints, N)
      training/global_step = N, training/epoch

Validation collects one rollout per ``data.val_files`` row (``is_train=False``) in batches of
``data.val_batch_size`` and reports :func:`~agl_core.stages.pipeline.validation_metrics` over all
of them. A checkpoint (:mod:`agl_core.backends.checkpoints`) holds the backend's files and state,
the step, the data position (:class:`~agl_core.backends.data_order.DataOrder`), every RNG state and
the rollouts the source carries into the next step.

A backend whose engine must own the loop (verl's trainer) does not subclass this: it implements
``fit(on_step)`` itself (:class:`~agl_core.backends.contract.Backend`) from the same parts
(:func:`open_rollout_source`, :class:`~agl_core.stages.pipeline.StepPipeline`,
:func:`~agl_core.stages.pipeline.validation_metrics`, :func:`~agl_core.backends.checkpoints.save_source_state`)
and reports the same metric names through ``on_step``.
"""

from __future__ import annotations

import abc
import logging
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import attrs

from agl_core.backends.checkpoints import (
    latest_checkpoint,
    read_state,
    restore_rng_states,
    restore_source_state,
    rng_states,
    write_checkpoint,
)
from agl_core.backends.data_order import DataOrder
from agl_core.backends.loop import LoopControl, LoopSettings, run_steps
from agl_core.backends.rollout_source import check_rollout_source, open_rollout_source
from agl_core.files.datasets import load_dataset
from agl_core.stages.pipeline import PreparedBatch, StepPipeline, validation_metrics

if TYPE_CHECKING:
    from omegaconf import DictConfig

    from agl_core.backends.contract import OnStep
    from agl_core.data import CompletedRollout
    from agl_core.plugins import PluginManager
    from agl_core.rollouts.source import RolloutSource

__all__ = ["LoopBackend", "Served"]

logger = logging.getLogger(__name__)


@attrs.frozen
class Served:
    """What :meth:`LoopBackend.serve` returns: the OpenAI base URLs (``http://host:port/v1``) at which
    agents reach the weights just served, and metrics of the push (a step reports them)."""

    endpoints: tuple[str, ...] = attrs.field(converter=tuple)
    metrics: dict[str, float] = attrs.field(factory=dict)


class LoopBackend(abc.ABC):
    """A backend whose step loop agl runs: subclass it, implement :meth:`update`, :meth:`serve`,
    :meth:`save_checkpoint` and :meth:`load_checkpoint` (and :meth:`close` when :meth:`serve` starts
    something), and register the class in ``agl_register_backends``: it is the factory
    (``Backend(config, plugins)``) and :meth:`fit` trains.

    The subclass's ``__init__(config, plugins)`` calls ``super().__init__(config, plugins, tokenizer)``
    with the run's tokenizer before it builds its model: the loop then has ``config``, ``plugins``,
    ``tokenizer``, ``pipeline`` (the step pipeline), ``data`` (the dataset order), ``total_steps``,
    ``run_dir`` and ``step`` (the training steps done).
    """

    source: RolloutSource | None
    """The run's rollout source, opened by :meth:`start`."""

    def __init__(self, config: DictConfig, plugins: PluginManager, tokenizer: Any):
        check_rollout_source(config)
        self.config, self.plugins, self.tokenizer = config, plugins, tokenizer
        self.data = DataOrder.from_config(config)
        steps = config.trainer.total_training_steps
        self.total_steps = int(steps if steps is not None else config.trainer.total_epochs * self.data.steps_per_epoch)
        self.val_rows = load_dataset(config.data.val_files, "data.val_files") if config.data.val_files else []
        self.loop = LoopSettings.from_config(config, self.total_steps, has_validation=bool(self.val_rows))
        self.pipeline = StepPipeline(config, plugins, tokenizer)
        self.run_dir = Path(config.trainer.default_local_dir)
        self.step = 0
        self.source = None
        self._resumed_from: Path | None = None

    # -- what a backend implements ---------------------------------------------------------------

    @abc.abstractmethod
    def update(self, prepared: PreparedBatch) -> dict[str, float]:
        """Train on ``prepared`` (its ``shaped`` batch is set): the rows are ``prepared.shaped.rows``
        (:func:`~agl_core.stages.tensorize.tensorize` pads them), their advantages
        ``prepared.advantages(response_width)``, cut into ``prepared.shaped.n_mini_batches``
        consecutive mini-batches, one optimizer step each (``actor.ppo_epochs`` passes), with the
        policy loss ``plugins.policy_losses.get(actor.policy_loss.loss_mode)``. Compute the old (and,
        with ``actor.use_kl_loss``, the reference) log-probs here if the engine does. Return the
        update's metrics under verl's names: ``actor/pg_loss``, ``actor/grad_norm``, ``actor/lr``,
        ``actor/entropy_loss``, ``actor/loss`` and the loss's own (``actor/pg_clipfrac``...)."""

    @abc.abstractmethod
    def serve(self, version: int) -> Served:
        """Make the engines agents call generate with the current weights, as weight version
        ``version`` (the training step; at start, the step the run starts from, when serving starts);
        return their base URLs. When this returns, no request is answered with older weights."""

    @abc.abstractmethod
    def save_checkpoint(self, folder: Path) -> dict[str, Any]:
        """Write this backend's part of the checkpoint of step ``step`` into ``folder`` (its
        weights) and return the plain state to keep with it (optimizer, lr schedule...; not the
        keys ``step``, ``data`` and ``rng``, which are the loop's)."""

    @abc.abstractmethod
    def load_checkpoint(self, folder: Path, state: Mapping[str, Any]) -> None:
        """Continue from the checkpoint in ``folder``: its files, and ``state`` (what
        :meth:`save_checkpoint` returned, beside the loop's keys). Called before :meth:`serve`."""

    def close(self) -> None:  # noqa: B027 -- a backend that starts nothing has nothing to stop
        """Stop what :meth:`serve` started and free the backend's workers; called once when training
        ends, however it ends."""

    def control(self) -> LoopControl:
        """What the engine asks of the loop after the step just trained (a validation, a checkpoint,
        the end of the run): nothing, unless a backend's engine steers its own loop."""
        return LoopControl()

    def on_report(self, metrics: Mapping[str, float]) -> None:  # noqa: B027 -- optional, a no-op by default
        """A step's metrics as the run reports them (what ``metrics.jsonl`` gets), before the loop
        reads :meth:`control`: nothing, unless a backend's engine reads them (TRL's ``on_log``)."""

    # -- the loop --------------------------------------------------------------------------------

    def fit(self, on_step: OnStep | None = None) -> None:
        """Train until the configured number of steps, calling ``on_step`` after every step."""
        steps = None
        try:
            steps = run_steps(self, self.start(), self.control, self.on_report)
            for step, total, metrics in steps:
                if on_step is not None:
                    on_step(step, total, metrics, self.pipeline.take_samples())
        finally:
            try:
                if steps is not None:
                    steps.close()  # a step whose report stopped the run is checkpointed as scheduled
            finally:
                self.stop()

    def start(self) -> LoopSettings:
        """Everything before the first step (the module docstring's ``start``); the loop's settings,
        the async fill reduced by what the source carries from a checkpoint."""
        self.resume()
        served = self.serve(self.step)
        self.plugins.on_startup(self.config)
        self.source = open_rollout_source(self.config, self.plugins, self.tokenizer, served.endpoints)
        self.source.on_rollout_done = self.pipeline.prepare_rollout
        self.source.next_samples = self.next_batch  # the async source refills evicted groups from the dataset
        self.source.after_weight_update(served.endpoints, self.step)
        self.plugins.on_weights_served(served.endpoints, self.step)
        carried = 0 if self._resumed_from is None else restore_source_state(self.source, self._resumed_from)
        return attrs.evolve(self.loop, fill=max(0, self.loop.fill - carried))  # the fill counts what is carried

    def stop(self) -> None:
        """Close the rollout source, then the backend (:meth:`close`), even when closing the source fails."""
        try:
            if self.source is not None:
                self.source.close()
        finally:
            self.close()

    def resume(self) -> bool:
        """Continue from the newest checkpoint in ``trainer.default_local_dir`` when
        ``trainer.resume_mode`` is ``auto``; whether there was one."""
        if self.config.trainer.resume_mode != "auto":
            return False
        path = latest_checkpoint(self.run_dir)
        if path is None:
            return False
        state = read_state(path)
        self.load_checkpoint(path, state)
        self.data.restore(state["data"])
        restore_rng_states(state["rng"])
        self.step = int(state["step"])
        self._resumed_from = path
        logger.info("resumed from %s (step %d)", path, self.step)
        return True

    def save(self) -> None:
        """Checkpoint step ``step`` (:func:`~agl_core.backends.checkpoints.write_checkpoint`)."""
        loop_state = {"data": self.data.position(), "rng": rng_states()}
        write_checkpoint(self.run_dir, self.step, self.save_checkpoint, loop_state, self.source)

    def next_batch(self) -> list[Mapping[str, Any]]:
        return self.data.next_batch()

    def validate(self) -> dict[str, float]:
        """One rollout per validation row with the current weights; ``val/*`` metrics over all batches
        (:func:`~agl_core.stages.pipeline.validation_metrics`)."""
        assert self.source is not None, "start() opens the rollout source"
        size = int(self.config.data.val_batch_size or len(self.val_rows))
        rollouts: list[CompletedRollout] = []
        source_metrics: list[dict[str, float]] = []
        for first in range(0, len(self.val_rows), size):
            batch = self.source.collect(self.val_rows[first : first + size], step=self.step, is_train=False)
            rollouts.extend(batch.rollouts)
            source_metrics.append(batch.metrics)
        return validation_metrics(rollouts, source_metrics)

    def train_step(self, samples: Sequence[Mapping[str, Any]]) -> dict[str, float]:
        """Train step ``step + 1`` on ``samples`` (the module docstring's ``train_step``) and advance ``step``."""
        assert self.source is not None, "start() opens the rollout source"
        self.step += 1
        step = self.step
        started = time.perf_counter()
        batch = self.source.collect(samples, step=step, is_train=True)
        metrics: dict[str, float] = dict(batch.metrics)
        metrics["timing/gen_s"] = time.perf_counter() - started
        metrics.update(self.source.before_weight_update())  # async: pause the gateway, drain in-flight calls
        update_started = time.perf_counter()
        metrics.update(self.learn(batch.rollouts, step))
        served = self.serve(step)
        metrics.update(served.metrics)
        self.source.after_weight_update(served.endpoints, step)
        metrics["timing/update_s"] = time.perf_counter() - update_started
        self.plugins.on_weights_served(served.endpoints, step)
        metrics["training/global_step"] = float(step)
        metrics["training/epoch"] = float(self.data.epoch)
        return metrics

    def learn(self, rollouts: Sequence[CompletedRollout], step: int) -> dict[str, float]:
        """The step pipeline on ``rollouts``, then :meth:`update` when a batch survived shaping: step
        ``step`` from the rollouts on."""
        prepared = self.pipeline.prepare(rollouts, step)
        metrics = dict(prepared.metrics)
        if prepared.shaped is not None:
            metrics.update(self.update(prepared))
        return metrics

    def replay_step(self, rollouts: Sequence[CompletedRollout], step: int) -> dict[str, float]:
        """Re-run step ``step`` of this run on its recorded ``rollouts`` (``agl replay``): from the
        checkpoint of step ``step - 1`` in the run directory when there is one, else the initial
        weights; nothing is served and no rollout source is opened."""
        checkpoint = self.run_dir / f"global_step_{step - 1}"
        if step > 1 and checkpoint.is_dir():
            self.load_checkpoint(checkpoint, read_state(checkpoint))
            logger.info("replaying step %d from %s", step, checkpoint)
        else:
            logger.info("replaying step %d from the initial model (no checkpoint %s)", step, checkpoint)
        self.step = step
        return self.learn(rollouts, step)
