"""``agl_core`` is the one public API: its names stay, and the packaged example imports nothing else."""

from __future__ import annotations

import ast
import subprocess
import sys
import typing

import pytest

import agl_core
from tests.helpers.imports import BACKEND_TOOLKIT, private_imports
from tests.helpers.paths import REPO_ROOT as REPO

# Removing a name from this list is a breaking change for every plugin: it needs a major version.
PUBLIC_NAMES = [
    "__version__",
    "AdvantageError",
    "AdvantageEstimator",
    "Advantages",
    "AdvantageSettings",
    "AgentLightningConfig",
    "aggregate_trajectories",
    "Aggregation",
    "AggregationCounts",
    "AggregationSettings",
    "Aggregator",
    "AglError",
    "Align",
    "Backend",
    "BackendFactory",
    "BackendSpec",
    "broadcast",
    "CALLS_LEFT_OUT_METRIC",
    "common_prefix_length",
    "CompletedRollout",
    "ConfigCheck",
    "ConfigError",
    "ConfigFile",
    "ConfigLoader",
    "DataValidationError",
    "default_config",
    "EventWriter",
    "exact_prefix",
    "FileFormatError",
    "FrozenDict",
    "GatewayError",
    "gateway_source",
    "group_rollouts",
    "hookimpl",
    "HookTimeout",
    "load_config",
    "load_dataset",
    "LoopBackend",
    "LoopControl",
    "LoopSettings",
    "LossSettings",
    "masked_sum",
    "merge_config",
    "merged_row",
    "MetricSink",
    "Mismatch",
    "MISMATCH_KINDS",
    "OnStep",
    "open_rollout_source",
    "check_rollout_source",
    "FinishedGroup",
    "GroupStream",
    "group_stream",
    "rollout_timing_metrics",
    "read_recording",
    "run_ppo",
    "write_dataset",
    "PaddedBatch",
    "PerRolloutAggregator",
    "PluginError",
    "PluginManager",
    "policy_loss_spec",
    "PolicyLoss",
    "PolicyLossSpec",
    "PreparedBatch",
    "ppo_token_losses",
    "RecordingError",
    "Register",
    "RegistryError",
    "require_group_size",
    "restore_source_state",
    "rollout_level",
    "rollout_reward",
    "RolloutAdvantageError",
    "RolloutAggregation",
    "RolloutGroups",
    "RolloutRequest",
    "RolloutSource",
    "run_steps",
    "save_source_state",
    "Segment",
    "Served",
    "SinkContext",
    "SinkFactory",
    "Step",
    "StepPipeline",
    "StepSamples",
    "tensorize",
    "TrainingRow",
    "trajectory_rollout",
    "Triplet",
    "UsageError",
    "UsageTypeError",
    "validate_config",
    "validation_metrics",
    "VllmEngineError",
]


@pytest.mark.parametrize("name", PUBLIC_NAMES)
def test_a_public_name_is_exported_and_resolves(name):
    assert name in agl_core.__all__, f"agl_core no longer exports {name!r}"
    assert getattr(agl_core, name) is not None


def test_every_exported_name_resolves_and_unknown_names_fail():
    for name in agl_core.__all__:
        getattr(agl_core, name)
    assert set(PUBLIC_NAMES) <= set(dir(agl_core))
    with pytest.raises(AttributeError, match="no attribute 'nope'"):
        agl_core.nope  # noqa: B018


def literal(tree: ast.Module, name: str):
    """The literal value a module-level assignment gives ``name`` (``ValueError`` when it is computed)."""
    (value,) = [
        n.value for n in tree.body if isinstance(n, (ast.Assign, ast.AnnAssign)) and ast.unparse(n).startswith(name)
    ]
    return ast.literal_eval(value)


def test_all_and_the_lazy_table_are_literals_and_the_type_checking_imports_match_them():
    """``__all__`` and the name -> module table are written out (no source parsed at import), and the
    imports type checkers read name exactly the table's names, each from the table's module."""
    tree = ast.parse((REPO / "agl_core" / "__init__.py").read_text())
    names, modules = literal(tree, "__all__"), literal(tree, "_MODULES")
    assert names == agl_core.__all__ and modules == agl_core._MODULES
    assert set(names) == {"__version__", "hookimpl", *modules} and len(names) == len(set(names))
    (block,) = [n for n in tree.body if isinstance(n, ast.If) and ast.unparse(n.test) == "TYPE_CHECKING"]
    imported = {a.asname or a.name: n.module for n in block.body if isinstance(n, ast.ImportFrom) for a in n.names}
    assert imported == modules
    assert "ast" not in {a.name for n in tree.body if isinstance(n, ast.Import) for a in n.names}


def public_classes() -> list[str]:
    return [name for name in agl_core.__all__ if isinstance(getattr(agl_core, name), type)]


@pytest.mark.parametrize("name", public_classes())
def test_a_public_class_shows_its_public_module(name):
    """As pytest's and pluggy's public classes do: ``agl_core.ConfigError`` in a traceback and a repr.
    A class with annotated fields (attrs classes, dataclasses) keeps the module defining it, where
    ``typing.get_type_hints`` (omegaconf's structured configs, hypothesis) resolves its annotations."""
    cls = getattr(agl_core, name)
    if cls.__module__ == "agl_core":
        assert repr(cls) == f"<class 'agl_core.{name}'>"
        typing.get_type_hints(cls)  # the annotations it inherits still resolve
    else:
        assert "__annotations__" in vars(cls) and not issubclass(cls, BaseException), (
            f"agl_core.{name} shows module {cls.__module__}: set __module__ = 'agl_core' in its class body"
        )


def test_an_agl_error_prints_its_public_name_in_a_traceback():
    script = "from agl_core.config import ConfigError\nraise ConfigError('data.seed', 'bad')\n"
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert out.stderr.splitlines()[-1] == "agl_core.ConfigError: config key data.seed: bad"


def test_import_agl_core_does_not_import_torch():
    """Nor does reading the loss toolkit (registering a loss): torch comes with the first module that
    computes on tensors (``tensorize``)."""
    script = (
        "import sys, agl_core; print('torch' in sys.modules); agl_core.LossSettings; agl_core.PolicyLossSpec; "
        "print('torch' in sys.modules); agl_core.tensorize; print('torch' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["False", "False", "True"]


def test_the_import_check_finds_a_private_import():
    assert private_imports("from agl_core.builtins.aggregators import trajectory\nimport agl_core.data\n") == [
        "agl_core.builtins.aggregators",
        "agl_core.data",
    ]
    assert private_imports("from agl_core import hookimpl\nfrom agl_core.testing.contracts import X\n") == []


PACKAGED_EXAMPLES = [REPO / "examples" / "retoken_merge", REPO / "examples" / "ddp_backend"]


@pytest.mark.parametrize(
    "path",
    sorted(p.relative_to(REPO).as_posix() for example in PACKAGED_EXAMPLES for p in example.rglob("*.py")),
    ids=str,
)
def test_the_example_plugins_import_only_the_public_api(path):
    assert private_imports((REPO / path).read_text()) == []


def guide_code_blocks() -> list[str]:
    text = (REPO / "docs" / "plugin-guide.md").read_text()
    return [block.split("```", 1)[0] for block in text.split("```python\n")[1:]]


def test_every_python_example_of_the_guide_compiles_and_imports_only_the_public_api():
    blocks = guide_code_blocks()
    assert len(blocks) >= 10
    for block in blocks:
        compile(block, "docs/plugin-guide.md", "exec")
        assert private_imports(block) == [], block
        for node in ast.walk(ast.parse(block)):
            if isinstance(node, ast.ImportFrom) and node.module == "agl_core":
                assert {alias.name for alias in node.names} <= set(agl_core.__all__), block
        if "my_judge" not in block:  # the others define plugins: they must at least load
            exec(compile(block, "docs/plugin-guide.md", "exec"), {})


def test_names_the_example_plugins_import_from_agl_core_are_public():
    for path in (p for example in PACKAGED_EXAMPLES for p in example.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module == "agl_core":
                assert {alias.name for alias in node.names} <= set(agl_core.__all__), path


def test_the_api_reference_documents_every_public_name_by_its_public_name():
    """docs/api documents ``agl_core.NAME`` for each name of ``__all__``, and no module behind them."""
    text = (REPO / "docs" / "api" / "index.rst").read_text()
    named = [line.split("::")[1].strip() for line in text.splitlines() if line.startswith(".. ") and "::" in line]
    documented = {name if name.startswith("agl_core") else f"agl_core.{name}" for name in named}
    public = {f"agl_core.{name}" for name in agl_core.__all__ if name != "__version__"}
    assert public <= documented, sorted(public - documented)
    modules = {name for name in documented if name.count(".") and name not in public}
    assert all(
        m == "agl_core.hookspecs" or m in BACKEND_TOOLKIT or m.startswith(("agl_core.testing", "agl_core.scaffold"))
        for m in modules
    ), sorted(modules)
