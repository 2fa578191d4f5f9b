"""The step loop a LoopBackend runs (agl_core.backends.loop_backend), on a backend that only records
what the loop asks of it, replaying the corridor recording."""

from __future__ import annotations

import pytest
from transformers import AutoTokenizer

from agl_core import ConfigError, LoopBackend, PluginManager, Served, hookimpl, load_config, open_rollout_source
from agl_core.backends.checkpoints import SOURCE_STATE_FILE, latest_checkpoint, read_state
from tests.helpers.corridor_policy import shared_corridor_policy
from tests.helpers.paths import RECORDED_CORRIDOR, REPO_ROOT

ENDPOINT = "http://127.0.0.1:9/v1"  # nothing is asked of it: the replayed rollouts need no agent


class Recorder(LoopBackend):
    """Notes every call the loop makes in ``log``; its checkpoint holds the step it was saved at."""

    def __init__(self, config, plugins, log, fail_serving=False):
        super().__init__(config, plugins, AutoTokenizer.from_pretrained(config.actor_rollout_ref.model.path))
        self.log, self.fail_serving = log, fail_serving

    def update(self, prepared):
        self.log.append(("update", self.step, len(prepared.shaped.rows), prepared.shaped.n_mini_batches))
        return {"actor/pg_loss": 0.5}

    def serve(self, version):
        self.log.append(("serve", version))
        if self.fail_serving:
            raise RuntimeError("the engine did not start")
        return Served([ENDPOINT], {"training/engine/n_pushes": 1.0})

    def save_checkpoint(self, folder):
        (folder / "weights.txt").write_text(str(self.step))
        self.log.append(("save", self.step))
        return {"saved_at": self.step}

    def load_checkpoint(self, folder, state):
        self.log.append(("load", (folder / "weights.txt").read_text(), state["saved_at"]))

    def close(self):
        self.log.append(("close",))


class Hooks:
    def __init__(self, log):
        self.log = log

    @hookimpl
    def agl_on_startup(self):
        self.log.append(("startup",))

    @hookimpl
    def agl_on_weights_served(self, endpoints, version):
        self.log.append(("served", version, endpoints))


def config(run_dir, steps, *extra):
    return load_config(
        REPO_ROOT / "examples/corridor/config.yaml",
        [
            f"actor_rollout_ref.model.path={shared_corridor_policy()}",
            f"agentlightning.replay={RECORDED_CORRIDOR}",
            "data.val_files=null",
            "trainer.val_before_train=false",
            f"trainer.total_training_steps={steps}",
            f"trainer.default_local_dir={run_dir}",
            *extra,
        ],
    )


def fit(cfg, **kwargs):
    """Train a Recorder; the loop's calls and hook calls in order, and what on_step saw."""
    log: list[tuple] = []
    manager = PluginManager(load_entrypoints=False)
    manager.register(Hooks(log))
    steps: list[tuple] = []
    Recorder(cfg, manager, log, **kwargs).fit(
        lambda step, total, metrics, samples: steps.append((step, total, metrics))
    )
    return log, steps


def test_a_run_starts_serves_trains_registers_and_checkpoints_in_order(tmp_path):
    log, steps = fit(config(tmp_path, 3, "trainer.save_freq=2"))
    assert log == [
        ("serve", 0),
        ("startup",),
        ("served", 0, [ENDPOINT]),
        ("update", 1, 32, 1),  # the corridor's 4 groups x 8 rollouts, one row each, one mini-batch
        ("serve", 1),
        ("served", 1, [ENDPOINT]),
        ("update", 2, 32, 1),
        ("serve", 2),
        ("served", 2, [ENDPOINT]),
        ("save", 2),
        ("update", 3, 32, 1),
        ("serve", 3),
        ("served", 3, [ENDPOINT]),
        ("save", 3),  # the last step is saved whatever save_freq says
        ("close",),
    ]
    assert [(step, total) for step, total, _ in steps] == [(1, 3), (2, 3), (3, 3)]
    for step, _, metrics in steps:
        assert metrics["training/global_step"] == step and metrics["training/epoch"] == 0
        assert metrics["actor/pg_loss"] == 0.5 and metrics["training/engine/n_pushes"] == 1.0
        assert {"timing/gen_s", "timing/update_s", "timing/step_s", "training/n_sample_trained"} <= set(metrics)
        assert metrics["training/replay/n_rollouts_replayed"] == 32
    state = read_state(latest_checkpoint(tmp_path))
    assert (state["step"], state["saved_at"], state["data"]) == (3, 3, {"epoch": 0, "index": 3})
    assert not (latest_checkpoint(tmp_path) / SOURCE_STATE_FILE).exists(), "a sync source carries nothing"


def test_a_resumed_run_loads_the_newest_checkpoint_before_serving_it(tmp_path):
    fit(config(tmp_path, 2, "trainer.save_freq=1"))
    log, steps = fit(config(tmp_path, 3, "trainer.save_freq=1"))
    assert log[:4] == [("load", "2", 2), ("serve", 2), ("startup",), ("served", 2, [ENDPOINT])]
    assert [step for step, _, _ in steps] == [3]


def test_the_backend_is_closed_when_it_fails_to_serve(tmp_path):
    log: list[tuple] = []
    backend = Recorder(config(tmp_path, 1), PluginManager(load_entrypoints=False), log, fail_serving=True)
    with pytest.raises(RuntimeError, match="the engine did not start"):
        backend.fit()
    assert log == [("serve", 0), ("close",)] and backend.source is None


def test_embedded_agents_need_an_endpoint_the_backend_serves(tmp_path):
    cfg = config(tmp_path, 1, "agentlightning.replay=null")
    with pytest.raises(ConfigError, match=r"agentlightning\.agl_base_url.*serves none"):
        open_rollout_source(cfg, PluginManager(load_entrypoints=False), tokenizer=None)
