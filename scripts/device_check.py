"""A device check of agl in one command: real training steps and the numerics, written to a JSON report.

Runs agl from the source tree (nothing of agl is installed) and writes ``DIR/report.json``:

1. ``losses``, ``estimators``: every registered policy loss and advantage estimator on the device in
   float32 and bfloat16 against float64 on the CPU (:mod:`device_numerics`, tolerances in the report);
2. ``verl``: verl 0.9.1's ``ppo_loss`` with agl's registered losses on the same device batches,
   compared with the torch backend's loss, or the exact error where verl does not import;
3. ``corridor``: the corridor example (``examples/corridor/``, its policy built by ``build_policy.py``)
   trained by the reference ``torch`` backend (embedded rollouts, in-process policy server) on the
   device: rewards per step, whether they rose, seconds per step;
4. ``trl``: the corridor trained by the ``trl`` backend on the device (float32, then bf16 forward
   passes): rewards, where it trains and serves, seconds per step; ``unavailable`` without TRL;
5. ``synthetic``: a model of realistic size built locally at random init (``full``: Qwen2-0.5B's shape
   on the Llama architecture; ``tiny``: two small layers) with a word-level tokenizer built here, on a
   synthetic multi-turn task: per-step generation and update time (the backend's ``timing/*``
   metrics), tokens per second and peak device memory;
6. ``modes``: the same task on a 0.5B- and a 1.5B-shaped model (``tiny``: two small shapes) in each
   training mode of :data:`MODES` (full fine-tune in fp32, in bf16, LoRA, LoRA with gradient
   checkpointing, set by verl's keys): peak device memory, seconds per step of generation, log-probs
   and update, tokens per second, and which of them fit a 24 GiB and an 80 GiB card.

The sections before ``trl`` train in float32. Nothing is downloaded. ``agl train``'s own run driver also
draws ``metrics.png`` (matplotlib); these runs go through :func:`agl_core.runs.run_config.resolve_config` and
the backend registry instead, so matplotlib is not needed, and write each step's metrics to
``DIR/<section>/metrics.jsonl``.

Usage: ``python scripts/device_check.py --out DIR [--device cuda|cpu] [--size full|tiny]
[--deadline-s S] [--sections NAME ...]``. Exit status 0 whenever the report was written (``passed`` and each section's
``status`` say what passed; a section still running at the deadline is marked failed and the run
ends there), 2 on a usage error such as ``--device cuda`` where no GPU is visible.
"""

from __future__ import annotations

import argparse
import functools
import importlib.metadata
import json
import logging
import math
import os
import platform
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import attrs

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT))  # agl and the examples from the source tree

import device_numerics  # noqa: E402  (this script's folder is on sys.path)
import torch  # noqa: E402
from device_workload import AGENT_CLASS, build_policy, write_dataset  # noqa: E402

GIB = 2**30
PACKAGES = (
    "torch", "transformers", "tokenizers", "peft", "numpy", "omegaconf", "verl", "ray", "tensordict",
    "trl", "accelerate", "datasets",
)  # fmt: skip
SECTIONS = ("losses", "estimators", "verl", "corridor", "trl", "synthetic", "modes")


@attrs.frozen
class Size:
    corridor_steps: int
    model: Mapping[str, int]
    prompts: int  # dataset rows per step
    n: int  # rollouts per row
    turns: int
    observation_words: int
    max_tokens: int  # per reply
    steps: int
    deadline_s: float


QWEN2_0_5B = {
    "vocab_size": 151936, "hidden_size": 896, "intermediate_size": 4864, "num_hidden_layers": 24,
    "num_attention_heads": 14, "num_key_value_heads": 2, "max_position_embeddings": 4096, "tie_word_embeddings": True,
}  # fmt: skip
TINY = {
    "vocab_size": 512, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
    "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 512, "tie_word_embeddings": True,
}  # fmt: skip
QWEN2_1_5B = {
    "vocab_size": 151936, "hidden_size": 1536, "intermediate_size": 8960, "num_hidden_layers": 28,
    "num_attention_heads": 12, "num_key_value_heads": 2, "max_position_embeddings": 4096, "tie_word_embeddings": True,
}  # fmt: skip
TINY_WIDE = {**TINY, "hidden_size": 128, "intermediate_size": 256, "num_hidden_layers": 3}
SIZES = {
    "full": Size(40, QWEN2_0_5B, prompts=8, n=4, turns=3, observation_words=32, max_tokens=48, steps=5, deadline_s=420),
    "tiny": Size(8, TINY, prompts=2, n=4, turns=2, observation_words=6, max_tokens=6, steps=3, deadline_s=240),
}
# The models of the modes section, by size.
MODE_SHAPES = {"full": {"0.5B": QWEN2_0_5B, "1.5B": QWEN2_1_5B}, "tiny": {"tiny": TINY, "tiny-wide": TINY_WIDE}}
MODE_STEPS = 3  # per mode; the timings are means over the steps after the first
BF16 = ["actor_rollout_ref.actor.fsdp_config.model_dtype=bf16"]
LORA = [
    "actor_rollout_ref.model.lora_rank=32",
    "actor_rollout_ref.model.lora_alpha=64",
    "actor_rollout_ref.model.target_modules=all-linear",
]
# The training modes compared, as verl's keys set them (LoRA over bf16 base weights; PEFT keeps the adapter in fp32).
MODES = {
    "full fp32": [],
    "full bf16": BF16,
    "lora bf16": [*BF16, *LORA],
    "lora bf16 + checkpointing": [*BF16, *LORA, "actor_rollout_ref.model.enable_gradient_checkpointing=true"],
}
CARDS_GIB = (24, 80)
CUDA_CONTEXT_GIB = 1.0  # what the CUDA context and kernels take besides torch's allocations


class Report:
    """The report, rewritten after every section so that a run cut short still leaves one."""

    def __init__(self, out: Path, head: dict[str, Any]):
        self.path = out / "report.json"
        self.data: dict[str, Any] = {**head, "passed": None, "timed_out": False, "sections": {}}
        self.lock = threading.RLock()
        self.current: str | None = None

    def write(self, section: str | None = None, result: dict[str, Any] | None = None) -> None:
        """Write the report, with ``result`` as ``section``'s entry when given."""
        with self.lock:
            if section is not None:
                self.data["sections"][section] = result
            statuses = [s["status"] for s in self.data["sections"].values()]
            self.data["passed"] = bool(statuses) and "failed" not in statuses and "running" not in statuses
            tmp = self.path.with_suffix(".tmp")
            tmp.write_text(json.dumps(json_ready(self.data), indent=2) + "\n")
            tmp.replace(self.path)

    def run(self, name: str, check: Callable[[], dict[str, Any]], device: str) -> None:
        self.current = name
        self.write(name, {"status": "running"})
        log = LogCapture()
        if device == "cuda":
            torch.cuda.reset_peak_memory_stats()
        started = time.perf_counter()
        try:
            result = check()
        except Exception:
            result = {"status": "failed", "error": traceback.format_exc(limit=-8)}
        finally:
            log.close()
        result["seconds"] = round(time.perf_counter() - started, 2)
        result["peak_gpu_memory_gib"] = round(torch.cuda.max_memory_allocated() / GIB, 3) if device == "cuda" else None
        result["log"] = log.records
        with self.lock:
            self.write(name, result)
            self.current = None

    def time_out(self, deadline_s: float) -> None:
        """Called by the watchdog: mark the running section, write the report and end the process."""
        with self.lock:
            self.data["timed_out"] = True
            self.write(self.current, {"status": "failed", "error": f"not finished within {deadline_s:g} s"})
        os._exit(0)


class LogCapture(logging.Handler):
    """agl's warnings and errors while a section runs (e.g. the policy server's generation failures)."""

    LIMIT = 12

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.records: list[str] = []
        self.setFormatter(logging.Formatter("%(name)s: %(message)s"))
        logging.getLogger("agl_core").addHandler(self)

    def emit(self, record: logging.LogRecord) -> None:
        text = self.format(record)
        if len(self.records) < self.LIMIT and text not in self.records:
            self.records.append(text[-3000:])

    def close(self) -> None:
        logging.getLogger("agl_core").removeHandler(self)
        super().close()


def json_ready(value: Any) -> Any:
    """``value`` for JSON: a non-finite float becomes null (a NaN loss must not stop the report)."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, Mapping):
        return {str(k): json_ready(v) for k, v in value.items()}
    if isinstance(value, (list, tuple, set)):
        return [json_ready(v) for v in value]
    return value if value is None or isinstance(value, (str, int, bool)) else str(value)


class NoRollouts(RuntimeError):
    """A training step in which no rollout succeeded: training further would measure nothing."""


def train(
    config_path: Path | None,
    overrides: list[str],
    out: Path,
    plugins: tuple[Any, ...] = (),
    inspect: Callable[[Any], None] | None = None,
) -> list[dict[str, Any]]:
    """Train as ``agl train`` would (config, plugin manager with ``plugins``, the configured backend's
    ``fit``); every step's metrics are returned and appended to ``out/metrics.jsonl``. ``inspect`` is
    given the backend once it is built."""
    from agl_core.runs.run_config import resolve_config

    config, manager = resolve_config(None if config_path is None else str(config_path), overrides, plugins)
    backend = manager.backends.get(config.agentlightning.backend)(config, manager)
    if inspect is not None:
        inspect(backend)
    out.mkdir(parents=True, exist_ok=True)
    steps: list[dict[str, Any]] = []

    def on_step(step: int, total: int, metrics: Mapping[str, float], samples: Any = None) -> None:
        record = json_ready({"step": step, **{k: float(v) for k, v in metrics.items()}})
        steps.append(record)
        with (out / "metrics.jsonl").open("a") as f:
            f.write(json.dumps(record) + "\n")
        if step > 0 and not metrics.get("training/rollouts/n_succeeded"):
            failed = metrics.get("training/rollouts/n_failed", 0.0)
            raise NoRollouts(f"step {step}: no rollout succeeded ({failed:g} failed); see the log")

    backend.fit(on_step)
    return steps


def run_overrides(work: Path, name: str, device: str, steps: int) -> list[str]:
    return [
        f"agentlightning.torch.device={device}",
        "agentlightning.rollout_timeout_seconds=120",  # a hung rollout fails its step, not the deadline
        "agentlightning.rollout_timeout_grace_seconds=10",
        f"trainer.default_local_dir={work / name}",
        f"trainer.total_training_steps={steps}",
        "trainer.save_freq=-1",
        "trainer.test_freq=-1",
        "trainer.val_before_train=false",
        "trainer.resume_mode=disable",
        "data.val_files=null",
    ]


def _mean(values: list[float]) -> float | None:
    values = [v for v in values if v is not None]
    return sum(values) / len(values) if values else None


def timing(steps: list[dict[str, Any]]) -> dict[str, float | None]:
    """Mean of every ``timing/*`` step metric (the per-rollout distributions aside), over the steps
    after the first (which also compiles and warms the device) when there are several."""
    warm = steps[1:] if len(steps) > 1 else steps
    names = sorted({k for s in warm for k in s if k.startswith("timing/") and not k.startswith("timing/rollout_")})
    return {name: _mean([s.get(name) for s in warm]) for name in names}


def corridor(size: Size, device: str, work: Path, out: Path) -> dict[str, Any]:
    from examples.corridor.build_policy import build

    policy = build(work / "corridor-policy", seed=0)
    overrides = [
        *run_overrides(work, "corridor-run", device, size.corridor_steps),
        f"actor_rollout_ref.model.path={policy}",
        f"data.train_files={REPO_ROOT / 'examples' / 'corridor' / 'dataset.jsonl'}",
    ]
    config = REPO_ROOT / "examples" / "corridor" / "config.yaml"
    steps = [s for s in train(config, overrides, out / "corridor") if s["step"] > 0]
    rewards = [s["training/reward"] for s in steps]
    third = max(1, len(rewards) // 3)
    first, last = _mean(rewards[:third]), _mean(rewards[-third:])
    rose = first is not None and last is not None and last > first
    return {
        "status": "passed" if len(steps) == size.corridor_steps and rose else "failed",
        "steps": len(steps),
        "rewards": [None if r is None else round(r, 4) for r in rewards],
        "reward_first_third": first,
        "reward_last_third": last,
        "reward_rose": rose,
        "seconds_per_step": timing(steps).get("timing/step_s"),
        "timing": timing(steps),
    }


def trl(size: Size, device: str, work: Path, out: Path) -> dict[str, Any]:
    """The corridor trained by the ``trl`` backend (TRL's GRPO trainer machinery, one process) on the
    device: in float32 for the corridor's steps (rewards must rise), and with bf16 forward passes for
    :data:`MODE_STEPS`; where the policy trains and where its served copy generates, seconds per step.
    ``unavailable`` with the import error where TRL (or accelerate, datasets) does not import."""
    try:
        import agl_backend_trl.backend  # noqa: F401  (TRL, accelerate and datasets import here)
        import agl_backend_trl.plugin
    except ImportError:
        return {"status": "unavailable", "import_error": traceback.format_exc(limit=-2)}
    from examples.corridor.build_policy import build

    installed = any(e.name == "trl" for e in importlib.metadata.entry_points(group="agl"))
    plugins = () if installed else (agl_backend_trl.plugin,)  # from the source tree: registered here
    policy = build(work / "trl-policy", seed=0)
    config = REPO_ROOT / "examples" / "corridor" / "config.yaml"
    runs: dict[str, Any] = {}
    for name, extra, steps in (
        ("fp32", [], size.corridor_steps),
        ("bf16", ["actor_rollout_ref.actor.fsdp_config.mixed_precision.param_dtype=bf16"], MODE_STEPS),
    ):
        placed: dict[str, str] = {}
        overrides = [
            *run_overrides(work, f"trl-{name}", device, steps),
            "agentlightning.backend=trl",
            f"actor_rollout_ref.model.path={policy}",
            f"data.train_files={REPO_ROOT / 'examples' / 'corridor' / 'dataset.jsonl'}",
            *(["trl.use_cpu=true"] if device == "cpu" else []),
            *extra,
        ]
        where = functools.partial(placement, into=placed)
        trained = [s for s in train(config, overrides, out / f"trl-{name}", plugins, where) if s["step"] > 0]
        rewards = [s["training/reward"] for s in trained]
        third = max(1, len(rewards) // 3)
        first, last = _mean(rewards[:third]), _mean(rewards[-third:])
        on_device = all(place.startswith(device) for place in placed.values())
        rose = name != "fp32" or (first is not None and last is not None and last > first)
        runs[name] = {
            "status": "passed" if len(trained) == steps and on_device and rose else "failed",
            "steps": len(trained),
            **placed,
            "rewards": [None if r is None else round(r, 4) for r in rewards],
            "reward_rose": rose,
            "seconds_per_step": timing(trained).get("timing/step_s"),
            "timing": timing(trained),
        }
    return {"status": "passed" if all(r["status"] == "passed" for r in runs.values()) else "failed", "runs": runs}


def placement(backend: Any, into: dict[str, str]) -> None:
    """Where ``backend`` trains and where its policy server generates, into ``into``."""
    into["trains_on"] = str(backend.device)
    into["serves_on"] = str(backend.server.device)


def synthetic_overrides(size: Size, device: str, work: Path, name: str, folder: Path, steps: int) -> list[str]:
    """The synthetic task's run of ``steps`` steps on the policy in ``folder``."""
    dataset = write_dataset(
        work / f"{name}.jsonl",
        size.prompts * steps,
        size.turns,
        size.observation_words,
        size.max_tokens,
        size.model["vocab_size"],
    )
    return [
        *run_overrides(work, name, device, steps),
        f"actor_rollout_ref.model.path={folder}",
        f"data.train_files={dataset}",
        f"data.train_batch_size={size.prompts}",
        "data.shuffle=false",
        f"actor_rollout_ref.rollout.n={size.n}",
        f"actor_rollout_ref.actor.ppo_mini_batch_size={size.prompts}",
        f"agentlightning.local.agent_class={AGENT_CLASS}",
        "agentlightning.local.env_map.DEVICE_CHECK_TASK=input",
        "algorithm.adv_estimator=grpo",
    ]


def synthetic(size: Size, device: str, work: Path, out: Path) -> dict[str, Any]:
    folder, model = build_policy(work / "synthetic-policy", size.model, device)
    overrides = synthetic_overrides(size, device, work, "synthetic-run", folder, size.steps)
    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()  # the peak of training, not of drawing the weights
    steps = [s for s in train(None, overrides, out / "synthetic") if s["step"] > 0]
    per_step = [step_summary(s) for s in steps]
    complete = len(steps) == size.steps and all(p["rollouts_succeeded"] == size.prompts * size.n for p in per_step)
    return {
        "status": "passed" if complete else "failed",
        "model": {**model, "dtype": "float32"},
        "workload": {
            "prompts_per_step": size.prompts,
            "rollouts_per_prompt": size.n,
            "turns": size.turns,
            "observation_words": size.observation_words,
            "max_tokens_per_reply": size.max_tokens,
        },  # fmt: skip
        "per_step": per_step,
        **throughput(per_step),
        "timing": timing(steps),
    }


def step_summary(step: Mapping[str, Any]) -> dict[str, Any]:
    """One step of the synthetic run; its generated tokens are the mean reply length × the replies."""
    return {
        "step": step["step"],
        "gen_s": step.get("timing/gen_s"),
        "update_s": step.get("timing/update_s"),
        "step_s": step.get("timing/step_s"),
        "log_prob_s": step.get("timing/log_prob_s"),
        "actor_update_s": step.get("timing/actor_update_s"),
        "generated_tokens": (step.get("response_length/training/avg_by_turn") or 0.0)
        * (step.get("training/n_turns") or 0),
        "trained_tokens": step.get("perf/total_num_tokens") or 0.0,
        "rollouts_succeeded": step.get("training/rollouts/n_succeeded"),
        "reward": step.get("training/reward"),
        "rows": step.get("training/n_sample"),
        "mismatch_rows": step.get("training/n_trace_merge_mismatch_rows"),
    }


def throughput(per_step: list[dict[str, Any]]) -> dict[str, Any]:
    """Means over the steps after the first (which also warms the device up) when there are several."""
    warm = per_step[1:] if len(per_step) > 1 else per_step
    return {
        "mean_after_first_step": {
            k: _mean([p[k] for p in warm]) for k in ("gen_s", "log_prob_s", "actor_update_s", "update_s", "step_s")
        },
        "generated_tokens_per_s": _mean([p["generated_tokens"] / p["gen_s"] for p in warm if p["gen_s"]]),
        "trained_tokens_per_s": _mean([p["trained_tokens"] / p["update_s"] for p in warm if p["update_s"]]),
    }


def modes(size_name: str, size: Size, device: str, work: Path, out: Path) -> dict[str, Any]:
    """Every shape of :data:`MODE_SHAPES` in every mode of :data:`MODES`: peak memory, the step's time
    split, tokens per second, and whether the peak fits each card of :data:`CARDS_GIB`."""
    import gc

    shapes: dict[str, Any] = {}
    for shape_name, shape in MODE_SHAPES[size_name].items():
        folder, model = build_policy(work / f"modes-{shape_name}-policy", {**size.model, **shape}, device)
        runs: dict[str, Any] = {}
        for mode, keys in MODES.items():
            name = f"modes-{shape_name}-{mode.replace(' ', '-').replace('+', 'and')}"
            gc.collect()
            if device == "cuda":
                torch.cuda.empty_cache()
                torch.cuda.reset_peak_memory_stats()
            try:
                steps = [
                    s
                    for s in train(
                        None, [*synthetic_overrides(size, device, work, name, folder, MODE_STEPS), *keys], out / name
                    )
                    if s["step"] > 0
                ]
            except Exception:
                runs[mode] = {"status": "failed", "error": traceback.format_exc(limit=-4)}
                continue
            per_step = [step_summary(s) for s in steps]
            runs[mode] = {
                "status": "passed" if len(steps) == MODE_STEPS else "failed",
                "keys": keys,
                **mode_summary(per_step, device),
            }
        shapes[shape_name] = {"model": model, "modes": runs}
    statuses = [run["status"] for shape in shapes.values() for run in shape["modes"].values()]
    return {
        "status": "passed" if all(s == "passed" for s in statuses) else "failed",
        "cards_gib": list(CARDS_GIB),
        "shapes": shapes,
    }


def mode_summary(per_step: list[dict[str, Any]], device: str) -> dict[str, Any]:
    """One mode's means after the first step, its peak memory and the cards that hold it."""
    warm = per_step[1:] if len(per_step) > 1 else per_step
    times = {k: _mean([p[k] for p in warm]) for k in ("gen_s", "log_prob_s", "actor_update_s", "step_s")}
    trained_s = [(p["log_prob_s"] or 0.0) + (p["actor_update_s"] or 0.0) for p in warm]
    result: dict[str, Any] = {
        **times,
        "generated_tokens_per_s": _mean([p["generated_tokens"] / p["gen_s"] for p in warm if p["gen_s"]]),
        "trained_tokens_per_s": _mean([p["trained_tokens"] / s for p, s in zip(warm, trained_s) if s]),
        "peak_allocated_gib": None,
        "peak_reserved_gib": None,
        "fits": None,
    }
    if device == "cuda":
        reserved = torch.cuda.max_memory_reserved() / GIB
        result["peak_allocated_gib"] = round(torch.cuda.max_memory_allocated() / GIB, 3)
        result["peak_reserved_gib"] = round(reserved, 3)
        result["fits"] = {f"{card}GiB": reserved + CUDA_CONTEXT_GIB <= card for card in CARDS_GIB}
    return result


def environment(device: str) -> dict[str, Any]:
    def version(name: str) -> str | None:
        try:
            return importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            return None

    try:
        git = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO_ROOT, capture_output=True, text=True, timeout=10)
        commit = git.stdout.strip() or None
    except (OSError, subprocess.TimeoutExpired):
        commit = None  # a copy of the tree without its history
    return {
        "python": platform.python_version(),
        "packages": {n: version(n) for n in PACKAGES},
        "torch_cuda": torch.version.cuda,
        "device": device,
        "device_name": torch.cuda.get_device_name() if device == "cuda" else platform.processor() or platform.machine(),
        "device_memory_gib": round(torch.cuda.get_device_properties(0).total_memory / GIB, 1)
        if device == "cuda"
        else None,
        "cpu_count": os.cpu_count(),
        "agl_commit": commit,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True, help="folder for report.json and the runs' metrics")
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--size", choices=tuple(SIZES), default="full")
    parser.add_argument(
        "--deadline-s", type=float, help="end the check (report written) after this long (default: by size)"
    )
    parser.add_argument(
        "--sections", nargs="+", choices=SECTIONS, default=list(SECTIONS), help="the sections to run (default: all)"
    )
    args = parser.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: no CUDA device is visible (use --device cpu)")
    size = SIZES[args.size]
    args.out.mkdir(parents=True, exist_ok=True)
    report = Report(args.out, {"device": args.device, "size": args.size, "environment": environment(args.device)})
    deadline_s = args.deadline_s or size.deadline_s
    watchdog = threading.Timer(deadline_s, report.time_out, args=(deadline_s,))
    watchdog.daemon = True
    watchdog.start()
    with tempfile.TemporaryDirectory(prefix="agl-device-check-") as tmp:
        work = Path(tmp)
        checks = {
            "losses": lambda: device_numerics.check_losses(args.device),
            "estimators": lambda: device_numerics.check_estimators(args.device),
            "verl": lambda: device_numerics.check_verl(args.device),
            "corridor": lambda: corridor(size, args.device, work, args.out),
            "trl": lambda: trl(size, args.device, work, args.out),
            "synthetic": lambda: synthetic(size, args.device, work, args.out),
            "modes": lambda: modes(args.size, size, args.device, work, args.out),
        }
        for name in SECTIONS:
            if name in args.sections:
                report.run(name, checks[name], args.device)
    watchdog.cancel()
    for name, section in report.data["sections"].items():
        print(f"device_check: {name}: {section['status']} ({section['seconds']} s)")
    print(f"device_check: {'PASSED' if report.data['passed'] else 'FAILED'}; report in {report.path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
