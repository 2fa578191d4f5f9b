#!/usr/bin/env bash
# Train the corridor task with the verl backend (FSDP actor + vLLM replicas) on one GPU node.
#
# Needs: NVIDIA GPU(s); `pip install -e '.[vllm]'` (verl 0.9.1 + vLLM); a running Agent Lightning
# gateway (`agl-server ... default_proxy.model_name=$MODEL_PATH`: the gateway's model name must be
# the policy path) and its controller (`agl-controller runner_type=local ...`, started from this
# checkout or with it on PYTHONPATH, so it can import examples.corridor.agent).
#
# Usage, from anywhere:
#   MODEL_PATH=/path/to/policy AGL_BASE_URL=http://HOST:PORT AGL_KEY=SECRET \
#     bash examples/corridor/run_verl.sh [key=value ...]
# MODEL_PATH: a Hugging Face model folder (`python examples/corridor/build_policy.py DIR` builds the
# tiny corridor policy). Optional: N_GPUS (default 1), STEPS (default 150), RUN_DIR (metrics.jsonl,
# metrics.png and checkpoints; default outputs/corridor/verl), PYTHON (default python). Extra
# key=value arguments override any config key (verl's keys included).
#
# Without a GPU, verl's CPU mode runs the same loop: append its keys (`agl_backend_verl.cpu.CPU_KEYS`,
# listed in docs/verl-backend.md; later keys win), e.g.
#   bash examples/corridor/run_verl.sh $(python -c 'from agl_backend_verl.cpu import CPU_KEYS; print(*CPU_KEYS)')
#
# Not yet run on a GPU: the settings are written from verl 0.9.1's code and config, and checked on
# CPU (every key exists with verl's type, verl's validate_config passes) by tests/verl/test_gpu_check.py.
set -euo pipefail
: "${MODEL_PATH:?set MODEL_PATH to the policy folder}"
: "${AGL_BASE_URL:?set AGL_BASE_URL to the gateway URL, e.g. http://127.0.0.1:4747}"
root="$(cd "$(dirname "$0")/../.." && pwd)"
cd "$root"
exec "${PYTHON:-python}" -m agl_core.cli train examples/corridor/config.yaml \
  agentlightning.backend=verl \
  "agentlightning.agl_base_url=$AGL_BASE_URL" \
  "agentlightning.agl_key=${AGL_KEY:-}" \
  agentlightning.rollout_timeout_seconds=300 \
  "actor_rollout_ref.model.path=$MODEL_PATH" \
  actor_rollout_ref.model.override_config.attn_implementation=sdpa \
  actor_rollout_ref.model.use_remove_padding=false \
  actor_rollout_ref.model.enable_gradient_checkpointing=false \
  data.max_prompt_length=256 \
  data.max_response_length=256 \
  data.dataloader_num_workers=0 \
  actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4 \
  actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=4 \
  actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=4 \
  actor_rollout_ref.rollout.name=vllm \
  actor_rollout_ref.rollout.tensor_model_parallel_size=1 \
  actor_rollout_ref.rollout.gpu_memory_utilization=0.3 \
  actor_rollout_ref.rollout.max_model_len=512 \
  actor_rollout_ref.rollout.max_num_batched_tokens=1024 \
  actor_rollout_ref.rollout.enforce_eager=true \
  actor_rollout_ref.rollout.load_format=auto \
  trainer.nnodes=1 \
  "trainer.n_gpus_per_node=${N_GPUS:-1}" \
  "trainer.total_training_steps=${STEPS:-150}" \
  "trainer.default_local_dir=${RUN_DIR:-outputs/corridor/verl}" \
  "trainer.logger=[console]" \
  "$@"
