"""The ``agl`` console script."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest


def agl(*args, env=None):
    exe = shutil.which("agl", path=str(Path(sys.executable).parent))
    assert exe, "the agl console script is installed with the package"
    return subprocess.run([exe, *args], capture_output=True, text=True, env={**os.environ, **(env or {})}, timeout=600)


def test_version_is_the_installed_distributions():
    from importlib.metadata import version

    out = agl("--version")
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == f"agl {version('agl-backend-verl')}"


def test_version_falls_back_to_the_package_version_in_a_source_tree(monkeypatch):
    import importlib.metadata

    import agl_core
    from agl_core import cli

    def not_installed(name):
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(importlib.metadata, "version", not_installed)
    assert cli.package_version() == agl_core.__version__


def test_plugins_lists_builtins_with_their_hooks_and_names():
    out = agl("plugins", env={"AGL_DISABLE_PLUGIN_AUTOLOAD": "1"})
    assert out.returncode == 0, out.stderr
    from agl_core.plugins import DEFAULT_PLUGINS

    assert DEFAULT_PLUGINS, "the built-in aggregators, estimators, losses and backend are plugins"
    for name in DEFAULT_PLUGINS:
        assert f"{name}  [built-in]" in out.stdout
    assert "aggregators: trajectory, transition" in out.stdout
    assert "policy_losses: cispo_per_rollout_mean, per_rollout_mean, token_mean" in out.stdout
    assert "backends: torch" in out.stdout
    assert "hookfiles  [entry point (agl-backend-verl" in out.stdout, "agl's own entry points always load"
    assert "retoken_merge" not in out.stdout, "third-party autoload is off"


def test_plugins_shows_a_hook_file(tmp_path):
    hooks = tmp_path / "my_hooks.py"
    hooks.write_text("from agl_core import hookimpl\n\n@hookimpl\ndef agl_on_startup(config):\n    pass\n")
    out = agl("plugins", "--hooks", str(hooks), env={"AGL_DISABLE_PLUGIN_AUTOLOAD": "1"})
    assert out.returncode == 0, out.stderr
    assert f"hookfile:{hooks.resolve()}  [hook file {hooks}]" in out.stdout
    assert "hooks: agl_on_startup" in out.stdout


def test_bad_hook_file_is_a_one_line_error(tmp_path):
    out = agl("plugins", "--hooks", str(tmp_path / "nope.py"))
    assert out.returncode == 2
    assert out.stderr.startswith("agl: error: hook file not found")


@pytest.mark.skipif(not hasattr(signal, "SIGUSR1"), reason="no SIGUSR1 on this platform")
def test_sigusr1_prints_every_threads_stack():
    """A stuck ``agl train`` can be asked where each thread is."""
    script = (
        "import os, signal, threading, time\n"
        "from agl_core.cli import dump_stacks_on_sigusr1\n"
        "assert dump_stacks_on_sigusr1()\n"
        "threading.Thread(target=time.sleep, args=(30,), name='sleeper', daemon=True).start()\n"
        "os.kill(os.getpid(), signal.SIGUSR1)\n"
        "time.sleep(0.5)\n"
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0
    assert "Current thread 0x" in done.stderr and done.stderr.count("hread 0x") == 2  # the main thread and the sleeper


# -- agl check, and one error line for every failure -------------------------------------------------

CONFIG = "examples/corridor/config.yaml"


@pytest.fixture(autouse=True)
def only_agls_own_plugins(monkeypatch):
    """What these commands report must not depend on third-party plugins installed alongside."""
    monkeypatch.setenv("AGL_DISABLE_PLUGIN_AUTOLOAD", "1")


@pytest.fixture(scope="module")
def policy(tmp_path_factory):
    from tests.helpers.corridor_policy import build_corridor_policy

    return build_corridor_policy(tmp_path_factory.mktemp("policy"))


def run_cli(capsys, *args):
    from agl_core.cli import main

    code = main(list(args))
    out, err = capsys.readouterr()
    assert "Traceback" not in err
    return code, out, err


# What agl plugins and agl check never use: registering the plugins (the built-ins, agl's own entry
# points) and checking a torch-backend run import none of it (benchmarks/bench_startup.py times them).
UNUSED_BY_PLUGINS_AND_CHECK = ("torch", "transformers", "peft", "ray", "verl", "vllm", "pyarrow", "matplotlib", "wandb")


@pytest.mark.parametrize("command", ["plugins", "check"])
def test_plugins_and_check_import_only_what_they_use(policy, command):
    args = ["plugins"] if command == "plugins" else ["check", CONFIG, f"actor_rollout_ref.model.path={policy}"]
    script = (
        f"import sys; from agl_core.cli import main; code = main({args!r}); "
        f"print([m for m in {UNUSED_BY_PLUGINS_AND_CHECK!r} if m in sys.modules]); sys.exit(code)"
    )
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines()[-1] == "[]"


def test_check_resolves_loads_and_checks_without_training(policy, tmp_path, capsys):
    from omegaconf import OmegaConf

    hooks = tmp_path / "hooks.py"
    hooks.write_text("from agl_core import hookimpl\n\n@hookimpl\ndef agl_on_startup(config):\n    pass\n")
    run_dir = tmp_path / "run"
    code, out, err = run_cli(
        capsys,
        "check",
        CONFIG,
        f"actor_rollout_ref.model.path={policy}",
        f"trainer.default_local_dir={run_dir}",
        "agentlightning.agl_key=sk-check-secret",
        f"agentlightning.hooks={hooks}",
    )
    assert code == 0, err
    resolved = OmegaConf.create(out)  # the output is the resolved config, as YAML (the report is comments)
    assert resolved.actor_rollout_ref.model.path == str(policy) and resolved.agentlightning.agl_key == "***"
    assert "sk-check-secret" not in out
    for line in (
        "# agl check: data.train_files: 256 rows",
        "# agl check: data.val_files: 32 rows",
        "# agl check: agentlightning.local.env_map: every field present in every row",
        "# agl check: advantage estimator: turn_grpo (plugin estimators)",
        "# agl check: backend 'torch': its own checks passed",
        f"# agl check: hook files: hookfile:{hooks.resolve()}",
        "# agl check: passed; nothing was trained",
    ):
        assert line in out
    assert not run_dir.exists(), "nothing was trained or written"


@pytest.mark.parametrize(
    "override, message",
    [
        (
            "actor_rollout_ref.model.path=/nonexistent/model",
            "agl: error: config key actor_rollout_ref.model.path: model folder /nonexistent/model does not exist",
        ),
        (
            "agentlightning.local.agent_class=examples.corridor.nope:Agent",
            "agl: error: config key agentlightning.local.agent_class: cannot import",
        ),
        (
            "algorithm.adv_estimator=grpp",
            "agl: error: unknown advantage estimator 'grpp' (set by algorithm.adv_estimator); registered:",
        ),
        (
            "agentlightning.torch.device=cuda:7",
            "agl: error: config key agentlightning.torch.device: cuda:7 was asked for",
        ),
        (
            "data.val_files=/nonexistent/val.jsonl",
            "agl: error: config key data.val_files: dataset file not found: /nonexistent/val.jsonl",
        ),
    ],
)
def test_check_reports_what_training_would_fail_on(policy, capsys, override, message):
    import torch

    if "cuda" in override and torch.cuda.is_available():
        pytest.skip("this machine has CUDA devices")
    code, _, err = run_cli(capsys, "check", CONFIG, f"actor_rollout_ref.model.path={policy}", override)
    assert code == 2 and err.startswith(message), err


def test_check_asks_the_gateway_when_one_is_configured(policy, capsys):
    import socket

    with socket.socket() as sock:  # a port on 127.0.0.1 that nothing listens on
        sock.bind(("127.0.0.1", 0))
        dead = f"http://127.0.0.1:{sock.getsockname()[1]}"
    code, out, err = run_cli(
        capsys,
        "check",
        CONFIG,
        f"actor_rollout_ref.model.path={policy}",
        f"agentlightning.agl_base_url={dead}",
        "agentlightning.gateway.max_retries=0",
    )
    assert code == 2 and "passed" not in out
    assert err.startswith("agl: error: gateway GET /proxy/state: no answer: ConnectError"), err
    assert "agl: hint: is the gateway running at agentlightning.agl_base_url" in err


def test_rows_missing_an_env_map_field_are_refused_before_training(policy, tmp_path, capsys):
    data = tmp_path / "rows.jsonl"
    data.write_text('{"signs": ["left"]}\n{"sign": ["right"]}\n')
    common = [
        CONFIG,
        f"actor_rollout_ref.model.path={policy}",
        f"data.train_files={data}",
        f"trainer.default_local_dir={tmp_path / 'run'}",
    ]
    expected = (
        f"agl: error: config key data.train_files: row 2 of 2 of {data}: agentlightning.local.env_map.CORRIDOR_SIGNS: "
        "path 'input.signs' not found in the rollout input\n"
    )
    for command in ("check", "train"):
        code, _, err = run_cli(capsys, command, *common)
        assert code == 2 and err == expected
    assert not (tmp_path / "run").exists()


def test_a_verl_only_key_under_torch_is_one_line_with_the_backend_to_use(capsys):
    pytest.importorskip("verl")
    code, _, err = run_cli(capsys, "check", CONFIG, "actor_rollout_ref.rollout.gpu_memory_utilization=0.3")
    assert code == 2
    assert err.strip().endswith("unknown key (in overrides); it is a key of backend 'verl': run with backend=verl")


def test_gateway_and_unexpected_errors_are_one_line(capsys, monkeypatch):
    import agl_core.runs.train
    from agl_core.rollouts.gateway_client import GatewayError

    def dead_gateway(*args, **kwargs):
        raise GatewayError("POST /api/models", None, "ConnectError: [Errno 111] Connection refused")

    monkeypatch.setattr(agl_core.runs.train, "run", dead_gateway)
    code, _, err = run_cli(capsys, "train", CONFIG)
    assert code == 2
    assert err.splitlines() == [
        "agl: error: gateway POST /api/models: no answer: ConnectError: [Errno 111] Connection refused",
        "agl: hint: is the gateway running at agentlightning.agl_base_url, with agentlightning.agl_key?",
    ]

    def bug(*args, **kwargs):
        raise RuntimeError("something agl did not expect")

    monkeypatch.setattr(agl_core.runs.train, "run", bug)
    code, _, err = run_cli(capsys, "train", CONFIG)
    assert code == 2
    assert err.splitlines()[0] == "agl: error: internal error: RuntimeError: something agl did not expect"
    assert "--traceback" in err.splitlines()[1]
    from agl_core.cli import main

    with pytest.raises(RuntimeError, match="did not expect"):
        main(["--traceback", "train", CONFIG])


def test_a_hook_file_that_fails_to_import_is_one_line(tmp_path, capsys):
    hooks = tmp_path / "broken.py"
    hooks.write_text("import not_a_module_anywhere_xyz\n")
    code, _, err = run_cli(capsys, "plugins", "--hooks", str(hooks))
    assert code == 2
    assert err.splitlines() == [
        f"agl: error: hook file {hooks.resolve()} failed to import: ModuleNotFoundError: No module named "
        "'not_a_module_anywhere_xyz'",
        "agl: hint: run again with --traceback for the whole report",
    ]


@pytest.mark.parametrize(
    "content, message",
    [
        ("", "holds no steps to plot"),
        ('{"step": 1, "note": "x"}\n', "holds none of the metrics agl plots (training/reward, val/reward,"),
        ('{"step": 1, "training/reward": 0.5}\n{not json\n', "line 2 is not valid JSON"),
        ('{"training/reward": 0.5}\n', "line 1 has no integer 'step'"),
        ("[1, 2]\n", "line 1 must be a JSON object"),
        (
            '{"step": 1, "training/reward": 0.5}\n{"step": 2, "training/reward": "high"}\n',
            "metric 'training/reward' of step 2 is 'high', not a number",
        ),
        ('{"step": 1, "timing/step_s": [1.0]}\n', "metric 'timing/step_s' of step 1 is [1.0], not a number"),
        (
            '{"step": 1, "training/reward": 1e308}\n{"step": 2, "training/reward": -1e308}\n',
            "metric 'training/reward' spans -1e+308 to 1e+308, too wide to plot",
        ),
        (
            '{"step": 1, "training/reward": 1' + "0" * 400 + "}\n",
            "metric 'training/reward' of step 1 is an integer beyond a float's range",
        ),
    ],
)
def test_plot_reports_empty_and_malformed_metrics_in_one_line(tmp_path, capsys, content, message):
    metrics = tmp_path / "metrics.jsonl"
    metrics.write_text(content)
    code, _, err = run_cli(capsys, "plot", str(tmp_path))
    assert code == 2 and err.startswith(f"agl: error: cannot plot {metrics}: ") and message in err
    code, _, err = run_cli(capsys, "plot", str(tmp_path / "elsewhere"))
    assert code == 2 and err == f"agl: error: no metrics file at {tmp_path / 'elsewhere'}\n"


@pytest.mark.parametrize("command", ["check", "train"])
def test_a_misspelt_hook_method_stops_check_and_train_at_the_start(policy, tmp_path, capsys, command):
    hooks = tmp_path / "hooks.py"
    hooks.write_text(
        "from agl_hooks import RolloutHooks\n\nclass Judge(RolloutHooks):\n"
        "    def onSucceeded(self, rollout, events, store):\n        pass\n"
    )
    run_dir = tmp_path / "run"
    code, _, err = run_cli(
        capsys,
        command,
        CONFIG,
        f"actor_rollout_ref.model.path={policy}",
        f"agentlightning.hooks={hooks}",
        f"trainer.default_local_dir={run_dir}",
    )
    assert code == 2
    assert err.splitlines()[0] == (
        f"agl: error: hook file {hooks.resolve()}: Judge.onSucceeded is not a hook, so it would never be called; did "
        "you mean 'on_succeeded'?"
    )
    assert not run_dir.exists()


def test_a_hook_files_syntax_error_names_its_line(tmp_path, capsys):
    hooks = tmp_path / "broken.py"
    hooks.write_text("from agl_core import hookimpl\n\ndef agl_on_startup(config:\n    pass\n")
    code, _, err = run_cli(capsys, "plugins", "--hooks", str(hooks))
    assert code == 2
    assert err.splitlines()[0].startswith(
        f"agl: error: hook file {hooks.resolve()} failed to import: {hooks.resolve()}:3: SyntaxError: "
    )


def test_train_given_a_directory_says_it_expected_a_yaml_file(tmp_path, capsys):
    code, _, err = run_cli(capsys, "train", str(tmp_path))
    assert (
        code == 2 and err == f"agl: error: config key <file>: {tmp_path} is a directory; expected a YAML config file\n"
    )


@pytest.mark.parametrize(
    "key, meant",
    [
        ("trainer.total_steps", "total_training_steps"),
        ("trainer.total_epoch", "total_epochs"),
        ("data.train_file", "train_files"),
    ],
)
def test_an_unknown_key_suggests_the_key_holding_its_words_else_the_closest_spelling(capsys, key, meant):
    code, _, err = run_cli(capsys, "check", CONFIG, f"{key}=3")
    assert code == 2 and f"config key {key}: unknown key (in overrides); did you mean '{meant}'?" in err


def test_a_reader_that_stops_early_is_not_an_error_of_agl():
    """``agl plugins | true``: the reader is gone before agl writes; agl stops quietly."""
    script = f"'{sys.executable}' -m agl_core.cli plugins | true"
    done = subprocess.run(["bash", "-c", script], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0 and "error" not in done.stderr, done.stderr
