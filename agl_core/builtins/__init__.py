"""agl's built-in plugins: one module per registry, each registered as an ordinary plugin.

Each pairs with the toolkit it is written with, which a third-party plugin uses the same way:

* ``aggregators`` (``transition``, ``trajectory``) ↔ :mod:`agl_core.stages.aggregation`;
* ``estimators`` (``grpo``, ``rloo``, ``reinforce``, ``reinforce_baseline``, ``turn_grpo``) ↔
  :mod:`agl_core.stages.advantage`;
* ``losses`` (``token_mean``, ``per_rollout_mean``) ↔ :mod:`agl_core.stages.policy_loss`;
* ``sinks`` (``jsonl``, ``console``, ``tensorboard``, ``wandb``) ↔ :mod:`agl_core.tracking`;
* ``backends`` (``torch``, plugin ``torch``) ↔ :mod:`agl_core.backends`.

The plugin manager registers them first, in this order, from its one table
(:data:`agl_core.plugins.DEFAULT_PLUGINS`); the plugin names are what ``AGL_BLOCKED_PLUGINS`` and
``agl plugins`` use.

May import every ``agl_core`` part but the entry points; only the plugin manager (by name) and
tests import a built-in module.
"""
