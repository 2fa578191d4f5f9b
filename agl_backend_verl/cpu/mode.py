"""verl's CPU mode (``trainer.device: cpu``): the settings it needs, Ray's resources, the fp32 rule.

On CPU, verl's ranks are Ray actors scheduled on the custom resource
:data:`~agl_backend_verl.cpu.platform.RANK_RESOURCE` (one unit per rank: ``trainer.nnodes x
trainer.n_gpus_per_node``), which :func:`ray_init_kwargs` declares when agl starts Ray; every Ray
worker gets ``VERL_PLATFORM=cpu``, so verl picks :class:`~agl_backend_verl.cpu.platform.CpuPlatform`
(gloo) and the FSDP engines :mod:`~agl_backend_verl.cpu.engines` registers for ``cpu``.

:data:`CPU_KEYS` are the keys a CPU run sets (the CPU examples, tests and scripts use them), and
:data:`SEPARATE_ASYNC_CPU_KEYS` those a ``separate_async`` run adds: its standalone rollout pool
(more ``verl_cpu_rank`` bundles) and the gloo checkpoint engine
(:mod:`~agl_backend_verl.cpu.checkpoint_engine`) that carries the weights there;
:func:`check_cpu_config` refuses, by key, a value verl cannot run on CPU; :func:`use_fp32` sets the
FSDP mixed precision to fp32, which verl's YAML has no key for (its default autocasts to bf16).
"""

from __future__ import annotations

from typing import Any

from omegaconf import DictConfig, OmegaConf, open_dict

from agl_backend_verl.config import trainer_mode
from agl_core import ConfigError

DEVICE = "cpu"
PLATFORM_ENV = "VERL_PLATFORM"
RANK_RESOURCE = "verl_cpu_rank"  # the Ray resource of one rank (CpuPlatform.ray_resource_name)
RANKS = 2
REPLICA = "agl_cpu"  # actor_rollout_ref.rollout.name of the CPU replica
CHECKPOINT_ENGINE = "agl_gloo"  # actor_rollout_ref.rollout.checkpoint_engine.backend of the standalone replicas
CHECKPOINT_ENGINE_KEY = "actor_rollout_ref.rollout.checkpoint_engine.backend"

# The keys of a CPU run: two gloo ranks sharing one CPU replica, one agent-loop and one reward worker
# (verl starts them; agl's rollouts go through the gateway), one TransferQueue storage unit, no
# torch.compile, no padding removal (its kernels need flash-attn).
CPU_KEYS: tuple[str, ...] = (
    f"trainer.device={DEVICE}",
    "trainer.nnodes=1",
    f"trainer.n_gpus_per_node={RANKS}",
    "actor_rollout_ref.actor.strategy=fsdp2",
    "critic.strategy=fsdp2",
    "actor_rollout_ref.model.override_config.attn_implementation=sdpa",
    "actor_rollout_ref.model.use_remove_padding=false",
    "actor_rollout_ref.model.enable_gradient_checkpointing=false",
    "critic.model.override_config.attn_implementation=sdpa",
    "critic.model.use_remove_padding=false",
    "critic.model.enable_gradient_checkpointing=false",
    "actor_rollout_ref.actor.use_torch_compile=false",
    f"actor_rollout_ref.rollout.name={REPLICA}",
    f"actor_rollout_ref.rollout.tensor_model_parallel_size={RANKS}",
    "actor_rollout_ref.rollout.agent.num_workers=1",
    "reward.num_workers=1",
    "data.dataloader_num_workers=0",
    # verl's V1 data plane: one TransferQueue storage unit (each takes a Ray CPU; verl's default is 8)
    "transfer_queue.backend.SimpleStorage.num_data_storage_units=1",
    "ray_kwargs.ray_init.num_cpus=12",
)

# The keys a separate_async run adds to CPU_KEYS: one standalone replica on its own pool of RANKS
# verl_cpu_rank bundles (the CPU replica's tensor_model_parallel_size), fed by the gloo checkpoint
# engine, and Ray CPUs for that pool's bundles (verl gives each bundle 2).
SEPARATE_ASYNC_CPU_KEYS: tuple[str, ...] = (
    "trainer.v1.trainer_mode=separate_async",
    "actor_rollout_ref.rollout.nnodes=1",
    f"actor_rollout_ref.rollout.n_gpus_per_node={RANKS}",
    f"{CHECKPOINT_ENGINE_KEY}={CHECKPOINT_ENGINE}",
    "ray_kwargs.ray_init.num_cpus=16",
)


def mode_keys(mode: str) -> tuple[str, ...]:
    """What a CPU run adds to :data:`CPU_KEYS` for ``trainer.v1.trainer_mode`` ``mode``:
    :data:`SEPARATE_ASYNC_CPU_KEYS` for ``separate_async``; ``sync`` and ``colocate_async`` need nothing more."""
    return SEPARATE_ASYNC_CPU_KEYS if mode == "separate_async" else ()


# Engine sections whose FSDP mixed precision CPU mode sets to fp32.
ENGINE_SECTIONS = ("actor_rollout_ref.actor.fsdp_config", "actor_rollout_ref.ref.fsdp_config", "critic.fsdp")
FP32 = {"param_dtype": "fp32", "reduce_dtype": "fp32", "buffer_dtype": "fp32"}


def is_cpu(config: DictConfig) -> bool:
    """Whether the run uses verl's CPU mode (verl's own key, ``trainer.device``)."""
    return str(OmegaConf.select(config, "trainer.device", default="cuda")) == DEVICE


def check_cpu_config(config: DictConfig, use_critic: bool) -> None:
    """Refuse, naming the key, what verl cannot run on CPU."""
    required = [
        ("actor_rollout_ref.actor.strategy", "fsdp2", "FSDP1 refuses CPU parameters"),
        ("actor_rollout_ref.ref.strategy", "fsdp2", "FSDP1 refuses CPU parameters"),
        (
            "actor_rollout_ref.model.override_config.attn_implementation",
            "sdpa",
            "verl's default, FlashAttention2, needs a GPU",
        ),
        ("actor_rollout_ref.model.use_remove_padding", False, "padding removal needs flash-attn"),
        (
            "actor_rollout_ref.rollout.name",
            REPLICA,
            f"verl's vLLM/SGLang replicas need GPUs; {REPLICA} is the CPU replica",
        ),
    ]
    if use_critic:
        required += [
            ("critic.strategy", "fsdp2", "FSDP1 refuses CPU parameters"),
            ("critic.model.override_config.attn_implementation", "sdpa", "FlashAttention2 needs a GPU"),
            ("critic.model.use_remove_padding", False, "padding removal needs flash-attn"),
        ]
    for key, value, why in required:
        got = OmegaConf.select(config, key, default=None)
        if got != value:
            raise ConfigError(key, f"is {got!r}, but trainer.device=cpu needs {value!r} ({why})")
    check_checkpoint_engine(config)
    for section in ENGINE_SECTIONS:  # CPU mode trains in fp32: a user's other dtype is refused, not replaced
        mixed = OmegaConf.select(config, f"{section}.mixed_precision", default=None)
        for field, dtype in (mixed or {}).items():
            if str(dtype).lower() not in ("fp32", "float32"):
                raise ConfigError(
                    f"{section}.mixed_precision.{field}",
                    f"is {dtype!r}, but trainer.device=cpu trains in fp32 (set fp32 or leave mixed_precision out)",
                )


def check_checkpoint_engine(config: DictConfig) -> None:
    """On CPU, weights reach a standalone replica (``separate_async``) through :data:`CHECKPOINT_ENGINE`
    only; the other modes feed the trainer's own replicas in process (``naive``)."""
    separate = trainer_mode(config) == "separate_async"
    allowed = (CHECKPOINT_ENGINE,) if separate else ("naive", CHECKPOINT_ENGINE)
    got = OmegaConf.select(config, CHECKPOINT_ENGINE_KEY, default=None)
    if got not in allowed:
        raise ConfigError(
            CHECKPOINT_ENGINE_KEY,
            f"is {got!r}, but trainer.device=cpu{' with separate_async' if separate else ''} needs "
            f"{' or '.join(map(repr, allowed))}: verl's other checkpoint engines need GPUs (nccl, hccl) or RDMA "
            "(nixl, mooncake, kimi), and 'naive' only feeds replicas inside the trainer's ranks; "
            f"{CHECKPOINT_ENGINE!r} sends the weights to the standalone replicas over gloo",
        )


def use_fp32(config: DictConfig) -> None:
    """fp32 FSDP mixed precision in every engine section (verl autocasts to bf16 otherwise)."""
    for section in ENGINE_SECTIONS:
        node = OmegaConf.select(config, section)
        with open_dict(node):
            node.mixed_precision = dict(FP32)


def ranks(config: DictConfig) -> int:
    """The :data:`RANK_RESOURCE` units a run takes: the trainer's ranks, and in ``separate_async`` the
    standalone rollout pool's."""
    trainer = int(config.trainer.nnodes) * int(config.trainer.n_gpus_per_node)
    if trainer_mode(config) != "separate_async":
        return trainer
    rollout = config.actor_rollout_ref.rollout
    return trainer + int(rollout.nnodes) * int(rollout.n_gpus_per_node)


def runtime_env_vars() -> dict[str, str]:
    """What every Ray worker of a CPU run needs in its environment."""
    return {PLATFORM_ENV: DEVICE}


def ray_init_kwargs(config: DictConfig, kwargs: dict[str, Any]) -> dict[str, Any]:
    """``ray.init`` arguments for a CPU run: one :data:`RANK_RESOURCE` per rank, added to ``kwargs``."""
    resources = {**(kwargs.get("resources") or {}), RANK_RESOURCE: float(ranks(config))}
    return {**kwargs, "resources": resources}


def check_ray_resources(config: DictConfig, cluster: dict[str, float]) -> None:
    """The Ray cluster must offer one :data:`RANK_RESOURCE` per rank (agl declares them when it starts Ray)."""
    needed, available = ranks(config), cluster.get(RANK_RESOURCE, 0)
    if available < needed:
        pools = "trainer.nnodes x trainer.n_gpus_per_node"
        if trainer_mode(config) == "separate_async":
            pools += " + actor_rollout_ref.rollout.nnodes x actor_rollout_ref.rollout.n_gpus_per_node"
        raise ConfigError(
            "trainer.n_gpus_per_node",
            f"trainer.device=cpu runs {pools} = {needed} ranks on Ray resource "
            f"{RANK_RESOURCE!r}, of which the Ray cluster has {available:g} "
            f"(start Ray with resources={{'{RANK_RESOURCE}': {needed}}}, "
            "or let agl start it)",
        )
