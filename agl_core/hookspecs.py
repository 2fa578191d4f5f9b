"""Every extension point of agl, as pluggy hook specifications.

Implement a hook by writing a function of the same name decorated with :data:`agl_core.hookimpl`,
in a module or class registered as a plugin (an entry point in group ``agl``, a hook file named in
``agentlightning.hooks``, or an object passed in code). Arguments are passed by name, so an
implementation may accept only the ones it needs.

Four kinds of hooks live here:

* **Registry hooks** (``agl_register_*``) are called once, when the plugin manager first needs the
  table (again after :meth:`~agl_core.plugins.PluginManager.configure` sets new settings). Each
  receives a ``register(name, obj)`` callback; the host owns the name table, rejects a name
  registered twice (naming both plugins) and lists what is registered (``agl plugins``).
  Each may also take a ``settings`` argument: the run's plugin settings
  (:class:`~agl_core.plugins.PluginSettings`, section name → typed instance, see
  :func:`agl_plugin_settings`), so a plugin registers entries configured for this run.
* **The settings hook** ``agl_plugin_settings`` declares the typed settings a plugin reads.
* **The loader hook** ``agl_load_hook_file`` turns a hook file into a plugin (``agl_hooks``
  implements it; ``agl_core`` itself never imports ``agl_hooks``).
* **Rollout lifecycle hooks** (``agl_on_*``) mirror Agent Lightning's four ``RolloutHooks`` methods
  (and ``agl_on_weights_served`` tells plugins which engines serve each new weight version), but
  compose: every plugin implementing one is called, in plugin registration order (built-ins, entry
  points, hook files, plugins given in code). A hook that raises is logged with its plugin's name and
  counted (``training/n_hook_failures``); the other plugins still run and training goes on.
  Each call runs in a worker thread and is waited for at most ``agentlightning.hook_timeout_seconds``
  (default 60): a call that overruns is abandoned, logged with its plugin's name and counted as a
  failure and in ``training/n_hook_timeouts``; that plugin's hook is skipped (and counted,
  ``training/n_hook_skipped``) until the abandoned call returns. The manager calls implementations one at a time, so
  pluggy hook wrappers (``wrapper=True``/``hookwrapper=True``) are refused, except on
  ``agl_load_hook_file``, which pluggy calls.
  They run for every rollout, validation rollouts included: ``request.is_train`` /
  ``rollout.is_train`` is false for those (their rewards feed ``val/*`` metrics, never training).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pluggy

if TYPE_CHECKING:
    from collections.abc import Mapping

    from agl_core.data import CompletedRollout, RolloutRequest
    from agl_core.plugins.event_writer import EventWriter
    from agl_core.plugins.settings import PluginSettings

hookspec = pluggy.HookspecMarker("agl")
hookimpl = pluggy.HookimplMarker("agl")

Register = Callable[[str, Any], None]


@hookspec
def agl_register_aggregators(register: Register, settings: PluginSettings) -> None:
    """Register trace aggregators: functions that turn completed rollouts into training rows.

    Called once per plugin manager. Call ``register(name, aggregate)`` for each aggregator; ``name``
    is what ``agentlightning.trace_aggregator.level`` selects (built-ins: ``transition``,
    ``trajectory``).

    ``aggregate`` is an :class:`agl_core.Aggregator`, ``aggregate(rollouts, settings) -> Aggregation``:
    ``rollouts`` is a sequence of
    :class:`~agl_core.data.CompletedRollout`; ``settings`` an
    :class:`~agl_core.stages.aggregation.AggregationSettings` (prompt/response limits, optional tokenizer,
    mismatch sample size). It returns an :class:`~agl_core.stages.aggregation.Aggregation` (rows, metrics,
    mismatch samples) and must not mutate its input. ``agl_core.testing`` holds the contract suite
    every aggregator must pass.

    A plain function is called once per step with the whole batch. An aggregator whose rows of a
    rollout depend on that rollout alone may declare so by registering an
    :class:`agl_core.PerRolloutAggregator` (``PerRolloutAggregator(aggregate_rollout)``, with
    ``aggregate_rollout(rollout, settings) -> RolloutAggregation``): the step pipeline then aggregates
    each training rollout as the rollout source finishes it and combines the parts in batch order,
    which gives the same result as the whole batch. The built-ins are declared so.
    """


@hookspec
def agl_register_advantage_estimators(register: Register, settings: PluginSettings) -> None:
    """Register advantage estimators: functions that assign credit to training rows.

    Called once per plugin manager. Call ``register(name, estimate)`` for each estimator; ``name`` is
    what ``algorithm.adv_estimator`` selects (built-ins include ``grpo``, ``rloo``, ``reinforce``,
    ``reinforce_baseline``).

    ``estimate`` is an :class:`agl_core.AdvantageEstimator`, ``estimate(rows, settings) -> Advantages``:
    ``rows`` is a sequence of
    :class:`~agl_core.data.TrainingRow` (every row collected for the step, before any drop; an
    estimator reads ``rollout_id``, ``group_id``, ``reward``, ``response_mask`` and, when it credits
    calls separately, ``response_turns``, ``turn_index`` and ``turn_rewards``); ``settings`` is an
    :class:`~agl_core.stages.advantage.AdvantageSettings` (``algorithm.norm_adv_by_std_in_grpo``,
    ``algorithm.gamma``). The result is an :class:`~agl_core.stages.advantage.Advantages`: ``per_row``, one
    read-only float32 array per row aligned with its response and zero wherever ``response_mask`` is
    0, and ``metrics``. Rows of one rollout that disagree on group or reward, and groups too small
    for the estimator, are errors that name the rollout or group. See :mod:`agl_core.stages.advantage`.
    """


@hookspec
def agl_register_policy_losses(register: Register, settings: PluginSettings) -> None:
    """Register policy losses: the objective a backend minimises in its actor update.

    Called once per plugin manager, and again inside every worker process that runs an update (the
    verl backend does this for Ray workers). Call ``register(name, loss_fn)`` for each loss; ``name``
    is what ``actor_rollout_ref.actor.policy_loss.loss_mode`` selects (built-ins:
    ``per_rollout_mean``, ``token_mean``, ``cispo_per_rollout_mean``).

    ``loss_fn`` is an :class:`agl_core.PolicyLoss`, ``loss_fn(old_log_prob, log_prob, advantages,
    response_mask, settings, rollout_is_weights=None) -> (loss, metrics)`` over padded
    ``[batch, response_len]`` torch tensors; ``settings`` is a
    :class:`~agl_core.stages.policy_loss.LossSettings`; ``loss`` is a scalar tensor to backpropagate and
    ``metrics`` maps ``actor/pg_clipfrac``, ``actor/ppo_kl`` and ``actor/pg_clipfrac_lower`` to
    floats. Values at padded positions must not reach the loss or its gradient.
    ``agl_backend_verl.policy_loss.as_verl_policy_loss`` turns such a function into one for verl's
    policy-loss registry. See :mod:`agl_core.builtins.losses`.

    A loss that needs something of the step pipeline declares it by registering a
    :class:`~agl_core.stages.policy_loss.PolicyLossSpec` instead of the bare function:
    ``register(name, PolicyLossSpec(loss_fn, scale_advantages_per_rollout=True))`` has its
    advantages scaled per rollout before the update (``per_rollout_mean`` does). A bare function is
    ``PolicyLossSpec(loss_fn)``: raw advantages.
    """


@hookspec
def agl_register_backends(register: Register, settings: PluginSettings) -> None:
    """Register training backends: the engines that run a training step.

    Called once per plugin manager. Call ``register(name, spec)``; ``name`` is what
    ``agentlightning.backend`` selects (built-in: ``torch``; ``agl-backend-verl`` adds ``verl``, and
    ``trl`` with its ``trl`` extra installed).
    ``spec`` is a :class:`~agl_core.backends.contract.BackendSpec`: ``factory(config, plugins)``
    returns a :class:`~agl_core.backends.contract.Backend` for the validated run config and this
    plugin manager, and ``load_config(path, overrides)`` is what validates that run config (by
    default the core schema's :func:`agl_core.config.load_config`; a backend with a larger schema
    gives its own, returning the validated ``DictConfig`` and raising ``ConfigError`` naming the
    key). A bare factory may be registered instead of a spec: it stands for ``BackendSpec(factory)``.
    ``agl train`` reads ``agentlightning.backend`` first, validates the run with that backend's
    ``load_config``, then builds the backend with its factory.

    The backend's ``fit(on_step)`` trains until the configured number of steps and calls
    ``on_step(step, total_steps, metrics, samples)`` after every training step (``metrics``: metric
    name → float; ``samples``: the step's sample tables; a validation before the first step is
    reported as step 0); ``agl train`` hands them to the metric sinks (``agl_register_metric_sinks``)
    and the progress bar. A spec's optional ``check_config(config)`` checks what the backend needs
    before it trains (files, devices, services) without loading a model, raising ``ConfigError``;
    ``agl check`` calls it. :mod:`agl_core.backends.contract` holds these types.
    """


@hookspec
def agl_register_metric_sinks(register: Register, settings: PluginSettings) -> None:
    """Register metric sinks: where ``agl train`` sends every step's metrics and sample tables.

    Called once per plugin manager. Call ``register(name, factory)``; ``name`` is what
    ``trainer.logger`` lists (built-ins: ``jsonl``, the run log, always on; ``console``;
    ``tensorboard``; ``wandb``). ``factory(context)`` receives a
    :class:`~agl_core.tracking.SinkContext` (the run directory, ``trainer.project_name``,
    ``trainer.experiment_name``, the run config as plain data with the gateway key redacted) and
    returns an :class:`agl_core.MetricSink`: ``log_samples(step, samples)`` (table name →
    rows of JSON-like dicts: ``trajectories``, ``mismatches``), then ``log_metrics(step, metrics)``
    for every step, and ``close()`` once at the end. Sinks run in the ``agl train`` process on
    every backend. The first step a sink is given is where the run starts (a resumed run redoes
    the steps after its checkpoint). A factory that cannot open its sink raises an error naming
    ``trainer.logger``.
    """


@hookspec
def agl_plugin_settings() -> Mapping[str, type]:
    """Declare the settings a plugin reads: return ``{section: settings_class}``.

    Called whenever the manager builds the run's settings (once per config). ``settings_class`` is a
    dataclass or an attrs class whose every field has a default, and whose field types omegaconf
    knows (``int``, ``float``, ``str``, ``bool``, enums, ``Optional``, lists and dicts of those,
    nested dataclasses); its ``__post_init__`` or attrs validators check values, raising
    ``ValueError`` or ``TypeError`` (say the field's name in quotes and the error names its key).
    Users set the values under ``agentlightning.plugins.<section>.<field>``; ``agl check`` and
    ``agl train`` refuse an undeclared section, an unknown field, a value of the wrong type or one
    the class refuses, with a :class:`~agl_core.config.ConfigError` naming the full key. A section
    declared by two plugins is an error naming both.

    The plugin receives the built instance as ``settings[section]`` in the ``settings`` argument
    of the registry hooks and of :func:`agl_on_startup`; code given a
    :class:`~agl_core.plugins.PluginManager` reads ``manager.settings[section]``.
    """


@hookspec(firstresult=True)
def agl_load_hook_file(path: Path) -> object | None:
    """Turn a hook file named in ``agentlightning.hooks`` into a plugin object.

    ``path`` is the file's absolute path. Return the object to register (a module, a class
    instance...) or ``None`` to leave the file to another plugin; the first non-``None`` answer
    wins, and the manager registers it under ``hookfile:<path>``. Raise an exception subclassing
    :class:`agl_core.plugins.PluginError` that names the file when it cannot be loaded.
    ``agl_hooks`` implements this hook for module-level ``@hookimpl`` functions and for Agent
    Lightning v1.0 ``RolloutHooks`` classes.
    """


@hookspec
def agl_on_startup(config: Any, settings: PluginSettings) -> None:
    """Initialise plugin state once per run, before the first rollout is enqueued.

    The backend calls it exactly once, in the process where the rollout hooks run (the verl backend:
    its Ray actor, not the ``agl train`` process). ``config`` is a copy of the validated run config
    (an omegaconf ``DictConfig``) with the gateway key replaced by ``***``: the plugin manager
    redacts it, whoever calls. ``settings`` holds the plugins' typed settings, as the registry hooks
    receive them (:func:`agl_plugin_settings`). Return value is ignored.
    """


@hookspec
def agl_on_weights_served(endpoints: list[str], version: int) -> None:
    """See each new weight version once the engines serve it, before any rollout uses it.

    The backend calls it in the process where the rollout hooks run, once for the weights a run
    starts from (``version`` is the step it starts at: 0, or a resumed checkpoint's) and once after
    every training step's update (``version`` is that step), right after registering the engines
    with the rollout source. ``endpoints`` are the OpenAI base URLs (``http://host:port/v1``) that
    serve those weights, as agents reach them; requests name the model ``actor_rollout_ref.model.path``.
    A plugin may query them (evaluate the new policy, warm a cache); a failure is isolated and counted
    as for every lifecycle hook. Return value is ignored.
    """


@hookspec
def agl_on_enqueue(request: RolloutRequest) -> RolloutRequest | None:
    """Rewrite a rollout request before it is sent to the rollout source.

    Called once per rollout, in plugin order, each plugin receiving the request as rewritten by the
    plugins before it (a chain, not a broadcast). Return a new
    :class:`~agl_core.data.RolloutRequest` (e.g. ``attrs.evolve(request, metadata=...)``) to replace
    it, or ``None`` to keep it. A request's ids and its place in the batch are the trainer's and cannot
    be changed: a rewrite that changes them has those fields put back (the rest of it is kept), and
    the call is counted in ``training/n_hook_changes_ignored`` and warned about once per plugin and field.

    A rollout that must run anew (lost to a gateway restart, or gone when a run resumes) comes
    through the chain again as the request it replaces (already rewritten once) under a fresh
    ``rollout_id``, with ``metadata["agl_replaces_rollout_id"]`` naming the old id: every rollout
    whose ``agl_on_succeeded`` / ``agl_on_failed`` a plugin sees was enqueued first. A hook that
    must not rewrite twice looks for that key.
    """


@hookspec
def agl_on_succeeded(rollout: CompletedRollout, events: dict[str, list[dict[str, Any]]], writer: EventWriter) -> None:
    """Inspect a rollout that succeeded, before its events are turned into training data.

    ``rollout`` is the :class:`~agl_core.data.CompletedRollout` as read so far; ``events`` maps each
    attempt id to its raw events (dicts with ``event_type``, ``data``, ``timestamp``...), in order.
    ``writer.add_event(rollout_id, attempt_id, event_type, data)`` appends events (a late reward, a
    judge's score); they are buffered and flushed to the rollout source after the hook returns, and
    the rollout's events are re-read when anything was written. Return value is ignored.
    """


@hookspec
def agl_on_failed(rollout: CompletedRollout, writer: EventWriter) -> None:
    """Inspect a rollout that failed (agent crash, timeout, trainer-side deadline).

    ``rollout.error`` says why when known. ``writer`` works as in :func:`agl_on_succeeded`. Return
    value is ignored.
    """
