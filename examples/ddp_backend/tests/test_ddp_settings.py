"""What ddp refuses, naming the key."""

import agl_ddp_backend
import pytest

from agl_core import ConfigError, PluginManager, load_config
from agl_core.testing.harness import tiny_policy

AGENT = "agentlightning.local.agent_class=agl_core.testing.tiny_task:TinyWordAgent"


def backend(*overrides):
    config = load_config(overrides=[f"actor_rollout_ref.model.path={tiny_policy()}", AGENT, *overrides])
    manager = PluginManager(load_entrypoints=False)
    manager.register(agl_ddp_backend)
    manager.configure(config)
    return agl_ddp_backend.DdpBackend(config, manager)


@pytest.mark.parametrize(
    ("override", "key"),
    [
        ("actor_rollout_ref.actor.use_kl_loss=true", "actor_rollout_ref.actor.use_kl_loss"),
        ("actor_rollout_ref.model.lora_rank=8", "actor_rollout_ref.model.lora_rank"),
        ("actor_rollout_ref.actor.optim.lr_warmup_steps=3", "actor_rollout_ref.actor.optim.lr_warmup_steps"),
    ],
)
def test_what_it_does_not_implement_is_refused_naming_the_key(override, key):
    with pytest.raises(ConfigError) as info:
        agl_ddp_backend.check_ddp_config(load_config(overrides=[override]))
    assert info.value.key == key


def test_more_processes_than_rows_in_a_mini_batch_are_refused(tmp_path):
    rows = tmp_path / "rows.jsonl"
    rows.write_text('{"id": 0}\n')
    with pytest.raises(ConfigError, match=r"agentlightning\.plugins\.ddp\.processes.*is 3, more than the 2 rows"):
        backend(
            f"data.train_files={rows}",
            "data.train_batch_size=1",
            "actor_rollout_ref.rollout.n=2",
            "actor_rollout_ref.actor.ppo_mini_batch_size=1",
            "agentlightning.plugins.ddp.processes=3",
        )
