"""``agentlightning.disable_dropout`` on verl: the model's dropout probabilities reach verl as zeros in
the section's ``override_config``, which verl's own ``update_model_config`` applies when it builds the
model; a user's override that contradicts the key is refused naming both."""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.verl

pytest.importorskip("verl")

from omegaconf import OmegaConf  # noqa: E402

from agl_backend_verl.config import load_verl_config  # noqa: E402
from agl_backend_verl.dropout import dropout_override_configs, turn_off_dropout  # noqa: E402
from agl_core.backends.dropout import check_train_mode_exact  # noqa: E402
from agl_core.config import ConfigError  # noqa: E402

ZEROS = {"resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0, "summary_first_dropout": 0.0}


@pytest.fixture(scope="module")
def gpt2_folder(tmp_path_factory):
    """A tiny GPT-2's config (dropout 0.1 on embeddings, attention and residuals): verl reads no more."""
    from transformers import GPT2Config

    folder = tmp_path_factory.mktemp("gpt2")
    config = GPT2Config(vocab_size=64, n_embd=32, n_layer=2, n_head=4, n_positions=64, bos_token_id=0, eos_token_id=0)
    config.save_pretrained(folder)
    return folder


def _config(folder, *overrides):
    return load_verl_config(None, [f"actor_rollout_ref.model.path={folder}", *overrides])


def test_verls_own_update_builds_the_model_without_dropout(gpt2_folder):
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM
    from verl.utils.model import update_model_config

    cfg = _config(gpt2_folder, "actor_rollout_ref.model.override_config.use_cache=false")
    turn_off_dropout(cfg)
    override = OmegaConf.to_container(cfg.actor_rollout_ref.model.override_config)
    assert override == {**ZEROS, "use_cache": False}  # the user's entries kept
    hf_config = AutoConfig.from_pretrained(gpt2_folder)
    update_model_config(hf_config, override)  # as verl's HFModelConfig does
    torch.manual_seed(0)
    check_train_mode_exact(AutoModelForCausalLM.from_config(hf_config), str(gpt2_folder))


def test_the_zeros_go_where_the_user_nests_the_override(gpt2_folder):
    cfg = _config(gpt2_folder, "actor_rollout_ref.model.override_config.model_config.use_cache=false")
    assert dropout_override_configs(cfg) == {"actor_rollout_ref.model.override_config.model_config": ZEROS}


def test_an_override_that_keeps_dropout_is_refused_naming_both_keys(gpt2_folder):
    keep = "actor_rollout_ref.model.override_config.attn_pdrop=0.2"
    cfg = _config(gpt2_folder, keep)
    with pytest.raises(ConfigError, match="agentlightning.disable_dropout") as refused:
        dropout_override_configs(cfg)
    assert refused.value.key == "actor_rollout_ref.model.override_config.attn_pdrop"
    kept = _config(gpt2_folder, keep, "agentlightning.disable_dropout=false")
    turn_off_dropout(kept)
    assert OmegaConf.to_container(kept.actor_rollout_ref.model.override_config) == {"attn_pdrop": 0.2}


def test_a_model_path_whose_config_cannot_be_read_is_refused_by_key_where_verl_loads_it(tmp_path):
    """Before Ray starts only this machine is read: a hub id not cached here (an Agent Lightning
    config's ``Qwen/...``) is checked in the task runner, where verl resolves it too."""
    config = _config(tmp_path / "missing")
    assert dropout_override_configs(config, local_files_only=True) == {}
    with pytest.raises(ConfigError, match="disable_dropout=false") as refused:
        dropout_override_configs(config)
    assert refused.value.key == "actor_rollout_ref.model.path"
