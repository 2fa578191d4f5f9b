"""The ``trl`` section: each key pair's rule, refusals by name, and ``agl check`` of a trl run; micro-batches
of a loss that does not add up over them refused."""

from __future__ import annotations

import re

import pytest
import torch

from agl_backend_trl.config import check_trl_config, grpo_config, load_trl_config
from agl_core.cli import main
from agl_core.config import ConfigError
from agl_core.plugins import PluginManager
from tests.helpers.whole_batch_loss import WHOLE_BATCH_LOSS, WholeBatchLoss
from tests.trl.conftest import CONFIG, corridor_overrides

# TRL key, a value agl's default config makes it, a value that disagrees, the agl key named in the refusal.
PAIRS = [
    ("learning_rate", 1e-3, 5e-4, "actor_rollout_ref.actor.optim.lr"),
    ("num_generations", 8, 4, "actor_rollout_ref.rollout.n"),
    ("beta", 0.0, 0.04, "actor_rollout_ref.actor.use_kl_loss/kl_loss_coef"),
    ("max_completion_length", 512, 256, "data.max_response_length"),
    ("scale_rewards", "group", "none", "algorithm.norm_adv_by_std_in_grpo"),
    ("bf16", False, True, "actor_rollout_ref.actor.fsdp_config.mixed_precision.param_dtype"),
    ("epsilon", 0.2, 0.3, "actor_rollout_ref.actor.clip_ratio_low"),
    ("epsilon_high", 0.2, 0.28, "actor_rollout_ref.actor.clip_ratio_high"),
]


def load(policy, tmp_path, *extra):
    return load_trl_config(CONFIG, corridor_overrides(policy, tmp_path / "run", *extra))


@pytest.mark.parametrize(("key", "same", "other", "agl_key"), PAIRS, ids=[p[0] for p in PAIRS])
def test_a_trl_key_agl_also_has_is_refused_unless_it_says_the_same(
    corridor_policy, tmp_path, key, same, other, agl_key
):
    config = load(corridor_policy, tmp_path, f"trl.{key}={same}")
    assert getattr(grpo_config(config, tmp_path), key) == same
    with pytest.raises(ConfigError, match=rf"config key trl\.{key}: .*{agl_key}"):
        load(corridor_policy, tmp_path, f"trl.{key}={other}")


def test_the_agl_key_sets_the_trl_value(corridor_policy, tmp_path):
    """agl's keys win: TRL's trainer gets their values (the KL coefficient as beta only with use_kl_loss)."""
    config = load(
        corridor_policy,
        tmp_path,
        "actor_rollout_ref.actor.optim.lr=5e-4",
        "actor_rollout_ref.rollout.n=4",
        "actor_rollout_ref.actor.use_kl_loss=true",
        "actor_rollout_ref.actor.kl_loss_coef=0.04",
        "data.max_response_length=256",
        "algorithm.norm_adv_by_std_in_grpo=false",
        "trl.beta=0.04",
        "trl.scale_rewards=false",
        "actor_rollout_ref.actor.clip_ratio_high=0.28",
        "trl.epsilon_high=0.28",
    )
    args = grpo_config(config, tmp_path)
    assert (args.epsilon, args.epsilon_high) == (0.2, 0.28)
    assert (args.learning_rate, args.num_generations, args.beta, args.max_completion_length, args.scale_rewards) == (
        5e-4,
        4,
        0.04,
        256,
        "none",
    )


def test_trls_loss_type_is_refused_whatever_its_value(corridor_policy, tmp_path):
    with pytest.raises(ConfigError, match=r"config key trl\.loss_type: .*agl's loss replaces TRL's.*loss_mode"):
        load(corridor_policy, tmp_path, "trl.loss_type=grpo")


@pytest.mark.parametrize(
    ("override", "message"),
    [
        (
            "trl.lerning_rate=0.1",
            r"trl\.lerning_rate: is not a key of TRL's GRPOConfig; did you mean trl\.learning_rate",
        ),
        ("trl.use_vllm=true", r"trl\.use_vllm: is not proven"),
        ("trl.deepspeed=ds.json", r"trl\.deepspeed: is not proven"),
        ("trl.fsdp=full_shard", r"trl\.fsdp: is not proven"),
        ("trl.temperature=0.7", r"trl\.temperature: is TRL's generation or reward setting"),
        ("trl.max_steps=10", r"trl\.max_steps: is TRL's training-loop setting"),
        ("trl.callbacks=nowhere", r"trl\.callbacks: must be a list of import paths"),
        ("trl.callbacks=[nowhere]", r"trl\.callbacks\[0\]: must be an import path module:Class"),
    ],
)
def test_a_refused_or_unknown_trl_key_is_named(corridor_policy, tmp_path, override, message):
    with pytest.raises(ConfigError, match=message):
        load(corridor_policy, tmp_path, override)


def test_honoured_keys_reach_trls_config(corridor_policy, tmp_path):
    config = load(corridor_policy, tmp_path, "trl.lr_scheduler_type=cosine", "trl.warmup_steps=2", "trl.optim=sgd")
    check_trl_config(config)
    args = grpo_config(config, tmp_path)
    assert (args.lr_scheduler_type.value, args.warmup_steps, args.optim.value) == ("cosine", 2, "sgd")


def test_a_warmup_takes_effect_or_is_refused_naming_the_schedule(corridor_policy, tmp_path):
    """TRL's ``constant`` schedule (agl's default) ignores a warmup: alone, a warmup makes it
    ``constant_with_warmup``; beside a ``constant`` the user set, it is refused."""
    for warmup in ("trl.warmup_steps=3", "trl.warmup_ratio=0.1"):
        args = grpo_config(load(corridor_policy, tmp_path, warmup), tmp_path)
        assert args.lr_scheduler_type.value == "constant_with_warmup", warmup
    with pytest.raises(ConfigError, match=r"trl\.lr_scheduler_type: is constant, which ignores trl\.warmup_steps=3"):
        grpo_config(load(corridor_policy, tmp_path, "trl.warmup_steps=3", "trl.lr_scheduler_type=constant"), tmp_path)


@pytest.mark.parametrize(
    ("override", "key"),
    [
        ("actor_rollout_ref.actor.optim.lr_scheduler_type=cosine", "actor_rollout_ref.actor.optim.lr_scheduler_type"),
        ("agentlightning.engine=vllm", "agentlightning.engine"),
    ],
)
def test_agl_keys_the_backend_does_not_implement_are_refused(corridor_policy, tmp_path, override, key):
    with pytest.raises(ConfigError, match=rf"config key {key}: backend 'trl' trains with"):
        check_trl_config(load(corridor_policy, tmp_path, override))


@pytest.mark.parametrize(
    ("overrides", "key"),
    [
        (("actor_rollout_ref.model.lora_rank=-1",), "actor_rollout_ref.model.lora_rank"),
        (
            ("actor_rollout_ref.model.lora_rank=4", "actor_rollout_ref.model.lora_adapter_path=/nowhere"),
            "actor_rollout_ref.model.lora_adapter_path",
        ),
    ],
)
def test_lora_keys_are_checked_before_anything_starts(corridor_policy, tmp_path, overrides, key):
    with pytest.raises(ConfigError) as error:
        check_trl_config(load(corridor_policy, tmp_path, *overrides))
    assert error.value.key == key


@pytest.mark.skipif(torch.cuda.is_available(), reason="TRL asks for trl.use_cpu on a machine without a GPU only")
def test_bf16_on_a_machine_without_a_gpu_asks_for_trl_use_cpu(corridor_policy, tmp_path):
    bf16 = "actor_rollout_ref.actor.fsdp_config.mixed_precision.param_dtype=bf16"
    with pytest.raises(ConfigError) as error:
        check_trl_config(load(corridor_policy, tmp_path, bf16))
    assert error.value.key == "trl.use_cpu"
    check_trl_config(load(corridor_policy, tmp_path, bf16, "trl.use_cpu=true", "trl.bf16=true"))


def test_a_vision_language_policy_is_refused_before_anything_starts(vision_policy_dir, tmp_path):
    with pytest.raises(ConfigError, match="is a vision-language model; backend 'trl' trains text models only") as error:
        check_trl_config(load(vision_policy_dir, tmp_path))
    assert error.value.key == "actor_rollout_ref.model.path"


@pytest.mark.parametrize(
    ("override", "key"),
    [
        (
            "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2",
            "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu",
        ),
        ("actor_rollout_ref.actor.use_dynamic_bsz=true", "actor_rollout_ref.actor.use_dynamic_bsz"),
    ],
)
def test_micro_batches_of_a_loss_that_does_not_add_up_over_them_are_refused(corridor_policy, tmp_path, override, key):
    from agl_backend_trl.backend import TrlBackend

    config = load(corridor_policy, tmp_path, WHOLE_BATCH_LOSS, override)
    plugins = PluginManager.from_config(config, (WholeBatchLoss(),), load_entrypoints=False)
    with pytest.raises(ConfigError, match=rf"{re.escape(key)}: the policy loss"):
        TrlBackend(config, plugins)


def run_check(capsys, *args):
    code = main(["check", CONFIG, *args])
    out, err = capsys.readouterr()
    return code, out, err


def test_agl_check_checks_a_trl_run_before_anything_starts(corridor_policy, tmp_path, capsys):
    run_dir = tmp_path / "run"
    code, out, err = run_check(capsys, *corridor_overrides(corridor_policy, run_dir, "trl.warmup_steps=1"))
    assert code == 0, err
    assert "# agl check: backend 'trl': its own checks passed" in out and "warmup_steps: 1" in out
    assert not run_dir.exists(), "nothing was trained or written"
    code, _, err = run_check(capsys, *corridor_overrides(corridor_policy, run_dir, "trl.use_vllm=true"))
    assert code == 2 and "config key trl.use_vllm: is not proven" in err, err


@pytest.mark.parametrize(
    ("callbacks", "message"),
    [
        ("[nowhere.mod:Foo]", r"config key trl\.callbacks\[0\]: cannot import nowhere\.mod:Foo"),
        ("[agl_core:ConfigError]", r"trl\.callbacks\[0\]: agl_core:ConfigError is not a transformers\.TrainerCallback"),
        (
            "[transformers:PrinterCallback, {transformers:EarlyStoppingCallback: {patience: 3}}]",
            r"trl\.callbacks\[1\]: transformers:EarlyStoppingCallback\(\*\*\{'patience': 3\}\) cannot be built: "
            "TypeError",
        ),
    ],
)
def test_agl_check_imports_and_builds_the_callbacks(corridor_policy, tmp_path, capsys, callbacks, message):
    overrides = corridor_overrides(corridor_policy, tmp_path / "run", f"trl.callbacks={callbacks}")
    code, _, err = run_check(capsys, *overrides)
    assert code == 2 and re.search(message, err), err


def test_a_callback_is_built_with_the_keyword_arguments_its_entry_gives(corridor_policy, tmp_path):
    from agl_backend_trl.config import build_callbacks

    entry = "{transformers:EarlyStoppingCallback: {early_stopping_patience: 3, early_stopping_threshold: 0.5}}"
    (callback,) = build_callbacks(load(corridor_policy, tmp_path, f"trl.callbacks=[{entry}]"))
    assert (callback.early_stopping_patience, callback.early_stopping_threshold) == (3, 0.5)


@pytest.mark.parametrize(("installed", "said"), [(None, "TRL is not installed"), ("1.13.0", "TRL 1.13.0 is installed")])
def test_a_trl_other_than_the_supported_one_is_refused_naming_the_backend_key(monkeypatch, installed, said):
    import importlib.metadata

    from agl_backend_trl.config import grpo_config_class

    def version(name):
        if installed is None:
            raise importlib.metadata.PackageNotFoundError(name)
        return installed

    monkeypatch.setattr(importlib.metadata, "version", version)
    with pytest.raises(
        ConfigError, match=f"config key agentlightning.backend: backend 'trl' needs TRL 1.16.x and {said}"
    ):
        grpo_config_class()


def _launch(world_size, distributed_type="MULTI_CPU"):
    """The process facts ``check_processes`` reads of a ``GRPOConfig``, as accelerate sets them."""
    from types import SimpleNamespace

    from accelerate.utils import DistributedType

    state = SimpleNamespace(distributed_type=DistributedType[distributed_type])
    return SimpleNamespace(distributed_state=state, world_size=world_size)


@pytest.mark.parametrize(
    ("launched", "args", "rows", "key"),
    [
        ("2", _launch(1, "NO"), 8, "trl.use_cpu"),  # torchrun's processes, each training alone
        ("2", _launch(2, "DEEPSPEED"), 8, "agentlightning.backend"),
        ("2", _launch(2, "FSDP"), 8, "agentlightning.backend"),
        ("2", _launch(2, "MULTI_GPU"), 8, "agentlightning.backend"),  # not run on GPUs yet
        ("4", _launch(4), 2, "actor_rollout_ref.actor.ppo_mini_batch_size"),
    ],
    ids=["processes-accelerate-does-not-join", "deepspeed", "fsdp", "gpu-processes", "more-processes-than-rows"],
)
def test_a_process_model_the_backend_does_not_train_in_is_refused(monkeypatch, launched, args, rows, key):
    from agl_backend_trl.backend import check_processes

    monkeypatch.setenv("WORLD_SIZE", launched)
    with pytest.raises(ConfigError, match=f"config key {re.escape(key)}: "):
        check_processes(args, rows)
    monkeypatch.setenv("WORLD_SIZE", str(args.world_size))
    check_processes(_launch(args.world_size), max(rows, args.world_size))  # data-parallel processes are trained


def test_a_replay_in_several_processes_is_refused():
    from types import SimpleNamespace

    from agl_backend_trl.backend import TrlBackend

    with pytest.raises(ConfigError, match=r"config key agentlightning\.backend: .*one process"):
        TrlBackend.replay_step(SimpleNamespace(world=2), [], 2)
