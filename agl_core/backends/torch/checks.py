"""What ``agl check`` verifies of a ``torch`` backend run without loading the model, and without
importing torch unless the device asks for CUDA: the model folder, the device, LoRA's keys, the
dtypes, whether prefix sharing can compute the model's positions (:func:`position_problem`, from its
``config.json`` and its modeling source) and, for the embedded source, that the agent class imports.
``TorchBackend`` runs the same checks when it starts (``model_folder``, ``check_device``,
``check_packable``)."""

from __future__ import annotations

import ast
import importlib.util
import json
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from agl_core.backends.lora import check_lora_keys
from agl_core.backends.precision import dtype_names
from agl_core.backends.rollout_source import check_rollout_source
from agl_core.config import ConfigError

if TYPE_CHECKING:
    from omegaconf import DictConfig

__all__ = [
    "BATCH_DEPENDENT_ROPE",
    "SHARE_KEY",
    "check_device",
    "check_torch_config",
    "model_folder",
    "position_problem",
]

SHARE_KEY = "agentlightning.torch.share_prefixes"
#: Rope types whose frequencies follow the longest position in the forward pass (transformers'
#: ``dynamic_rope_update``): in a pack, a row's positions would depend on the rows packed with it.
BATCH_DEPENDENT_ROPE = ("dynamic", "longrope")


def model_folder(config: DictConfig) -> Path:
    """The policy's folder (``actor_rollout_ref.model.path``), which must hold a ``config.json``."""
    path = config.actor_rollout_ref.model.path
    key = "actor_rollout_ref.model.path"
    if not path:
        raise ConfigError(key, "the policy's model folder is not set")
    folder = Path(path)
    if not (folder / "config.json").is_file():
        what = "does not exist" if not folder.exists() else "has no config.json"
        raise ConfigError(key, f"model folder {path} {what} (a local Hugging Face causal LM folder is needed)")
    return folder


def check_device(name: str) -> None:
    """``cuda`` and ``cuda:N`` need a CUDA device (torch is imported to ask); ``auto`` and ``cpu`` always work."""
    if name.startswith("cuda"):
        import torch

        if not torch.cuda.is_available():
            raise ConfigError("agentlightning.torch.device", f"{name} was asked for, but no CUDA device is available")


def position_problem(config: Mapping[str, Any], takes_position_ids: bool) -> str | None:
    """Why a tree pack, which gives each token its depth as ``position_ids``, would not compute the
    positions of a model with this ``config`` (``config.json``'s mapping), or ``None``: its forward
    takes no ``position_ids`` (``takes_position_ids``: alibi and relative biases follow a token's
    place in the pack), it has alibi, a rope whose scaling follows the pass
    (:data:`BATCH_DEPENDENT_ROPE`), or sliding-window attention. Rotary (static scaling) and learned
    absolute positions read from ``position_ids`` are computed exactly."""
    if not takes_position_ids:
        model_type = config.get("model_type")
        return f"a {model_type!r} model, whose forward takes no position_ids (positions by place in the pack)"
    for part in (config, config.get("text_config") or {}):
        if part.get("alibi") or (part.get("attn_config") or {}).get("alibi"):
            return "a model with alibi biases, which follow a token's place in the pack"
        rope = part.get("rope_parameters") or part.get("rope_scaling") or {}
        ropes = [r for r in rope.values() if isinstance(r, Mapping)] or [rope]  # per layer type, or one
        for kind in {r.get("rope_type") or r.get("type") for r in ropes} & set(BATCH_DEPENDENT_ROPE):
            return f"a rope of type {kind!r}, which scales every position by the longest one in the pass"
        layer_types = part.get("layer_types") or ["full_attention"]
        windowed = part.get("sliding_window") is not None and part.get("use_sliding_window", True)
        if windowed or any(kind != "full_attention" for kind in layer_types):
            return "sliding-window attention (full causal attention is needed in every layer)"
    return None


def forward_takes_position_ids(config: Mapping[str, Any]) -> bool:
    """Whether the forward of ``config``'s architecture takes ``position_ids``, read from its modeling
    source in the installed transformers without importing it (``True`` when it cannot be found:
    ``check_packable`` then asks the loaded model)."""
    spec = importlib.util.find_spec("transformers")
    model_type, architectures = config.get("model_type"), config.get("architectures") or []
    if spec is None or spec.origin is None or not model_type or not architectures:
        return True
    source = (
        Path(spec.origin).parent
        / "models"
        / model_type.replace("-", "_")
        / f"modeling_{model_type.replace('-', '_')}.py"
    )
    if not source.is_file():
        return True
    classes = {node.name: node for node in ast.parse(source.read_text()).body if isinstance(node, ast.ClassDef)}
    name = architectures[0]
    while name in classes:
        forward = next((f for f in classes[name].body if isinstance(f, ast.FunctionDef) and f.name == "forward"), None)
        if forward is not None:
            return any(arg.arg == "position_ids" for arg in forward.args.args + forward.args.kwonlyargs)
        bases = [b.id for b in classes[name].bases if isinstance(b, ast.Name)]
        name = bases[0] if bases else ""
    return True


def check_positions(folder: Path) -> None:
    """Refuse, naming :data:`SHARE_KEY`, prefix sharing for the model in ``folder`` (:func:`position_problem`)."""
    config = json.loads((folder / "config.json").read_text())
    problem = position_problem(config, forward_takes_position_ids(config))
    if problem is not None:
        raise ConfigError(SHARE_KEY, f"cannot share prefixes of {problem}; set {SHARE_KEY}=false")


def check_torch_config(config: DictConfig) -> None:
    """The ``check_config`` of the ``torch`` backend's :class:`~agl_core.BackendSpec` (see the module docstring)."""
    folder = model_folder(config)
    if config.agentlightning.torch.share_prefixes:
        check_positions(folder)
    check_device(config.agentlightning.torch.device)
    check_lora_keys(config.actor_rollout_ref.model)
    dtype_names(config.actor_rollout_ref.actor.fsdp_config)
    check_rollout_source(config)
