"""Every error agl defines has one root, :class:`agl_core.errors.AglError`, and keeps its built-in class."""

from __future__ import annotations

import ast
import builtins
from pathlib import Path

import pytest

import agl_core
from agl_core.config import ConfigError
from agl_core.errors import AglError, FileFormatError, UsageError, UsageTypeError
from agl_core.plugins import PluginError, RegistryError
from tests.helpers.paths import REPO_ROOT as REPO

BUILTIN_ERRORS = {
    name for name, value in vars(builtins).items() if isinstance(value, type) and issubclass(value, BaseException)
}


def errors_without_root(root: Path) -> list[str]:
    """``path:line class`` for every class of the agl packages whose bases are all built-in
    exceptions (an error deriving from another agl error has its root through it)."""
    found = []
    for package in ("agl_core", "agl_hooks", "agl_backend_verl"):
        for path in sorted((root / package).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text(), str(path))):
                if not isinstance(node, ast.ClassDef):
                    continue
                bases = {getattr(base, "id", getattr(base, "attr", None)) for base in node.bases}
                if bases and bases <= BUILTIN_ERRORS and node.name != "AglError":
                    found.append(f"{path.relative_to(root)}:{node.lineno} {node.name}")
    return found


def test_every_agl_error_derives_from_agl_error():
    assert errors_without_root(REPO) == []


def test_the_check_finds_an_error_without_root(tmp_path):
    (tmp_path / "agl_core").mkdir()
    (tmp_path / "agl_core" / "oops.py").write_text("class OopsError(ValueError):\n    pass\n")
    assert errors_without_root(tmp_path) == ["agl_core/oops.py:1 OopsError"]


@pytest.mark.parametrize(
    ("error", "builtin"),
    [
        (ConfigError, ValueError),
        (RegistryError, LookupError),
        (PluginError, Exception),
        (FileFormatError, ValueError),
        (UsageError, ValueError),
        (UsageTypeError, TypeError),
    ],
)
def test_each_error_keeps_its_builtin_class(error, builtin):
    assert issubclass(error, AglError) and issubclass(error, builtin)


def builtin_raises(root: Path, packages: tuple[str, ...] = ("agl_core", "agl_hooks", "agl_backend_verl")) -> list[str]:
    """``path:line`` of every ``raise ValueError(...)`` / ``raise TypeError(...)`` in ``packages``:
    library code raises an :class:`AglError` (its message naming the key, file, plugin or argument)."""
    found = []
    for package in packages:
        for path in sorted((root / package).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text(), str(path))):
                raised = node.exc.func if isinstance(node, ast.Raise) and isinstance(node.exc, ast.Call) else None
                if isinstance(node, ast.Raise) and isinstance(node.exc, ast.Name):
                    raised = node.exc
                if isinstance(raised, ast.Name) and raised.id in ("ValueError", "TypeError"):
                    found.append(f"{path.relative_to(root)}:{node.lineno}")
    return found


def test_library_code_raises_agl_errors_not_bare_builtins():
    assert builtin_raises(REPO) == []


def test_the_check_finds_a_bare_builtin_raise(tmp_path):
    (tmp_path / "agl_core").mkdir()
    (tmp_path / "agl_core" / "oops.py").write_text(
        "def f():\n    raise ValueError('no')\n\n\ndef g():\n    raise TypeError\n"
    )
    assert builtin_raises(tmp_path) == ["agl_core/oops.py:2", "agl_core/oops.py:6"]


@pytest.mark.parametrize(
    "name", ["GatewayError", "HookTimeout", "RecordingError", "VllmEngineError", "FileFormatError", "UsageError"]
)
def test_the_errors_a_caller_may_catch_are_public_agl_errors(name):
    error = getattr(agl_core, name)
    assert name in agl_core.__all__ and issubclass(error, AglError)


@pytest.mark.parametrize(
    "error",
    [
        ConfigError("data.train_files", "dataset file not found: data.jsonl"),
        agl_core.DataValidationError("triplets[0].reward", "is NaN", rollout_id="r-1"),
        RegistryError("no estimator 'grpoo'"),
        UsageError("n must be positive"),
    ],
    ids=lambda error: type(error).__name__,
)
def test_an_error_survives_pickling_with_its_message_and_fields(error):
    """Errors raised in a Ray worker reach the driver pickled, whatever their ``__init__`` takes."""
    import pickle

    copy = pickle.loads(pickle.dumps(error))
    assert type(copy) is type(error) and str(copy) == str(error) and vars(copy) == vars(error)
