"""The verl releases the backend supports, checked when it starts: any other verl, or none, is refused
naming what is installed, what is supported, and (on a Python verl 0.9 does not support) why none is.
These run without verl too: on Python 3.13 agl installs without it."""

from __future__ import annotations

import importlib.util
import platform

import pytest

from agl_backend_verl import config as verl_config
from agl_backend_verl import verl_version
from agl_backend_verl.verl_version import check_verl_version, installed_verl_version
from agl_core.config import ConfigError

HAS_VERL = importlib.util.find_spec("verl") is not None


@pytest.mark.parametrize(
    ("installed", "reason"),
    [
        ("0.8.0", "verl 0.8 lacks the verl.plugins entry points and device registries"),
        ("0.7.1", "no other release is tested"),
        ("0.10.0", "no other release is tested"),
    ],
)
def test_an_unsupported_verl_is_refused_at_backend_start_naming_both_versions(monkeypatch, installed, reason):
    monkeypatch.setattr(verl_version, "installed_verl_version", lambda: installed)
    verl_config._verl_defaults.cache_clear()
    try:
        with pytest.raises(ConfigError) as info:
            verl_config.load_verl_config(None, [])
    finally:
        verl_config._verl_defaults.cache_clear()
    assert info.value.key == "agentlightning.backend"
    assert info.value.message.startswith(
        f"backend 'verl' supports verl >=0.9.1,<0.10 (0.9.x), but verl {installed} is installed ({reason}"
    )
    assert info.value.message.endswith("pip install 'verl>=0.9.1,<0.10'")


@pytest.mark.skipif(not HAS_VERL, reason="verl is not installed (Python 3.13 and later)")
@pytest.mark.parametrize("installed", ["0.9.1", "0.9.2", "0.9.3rc1"])
def test_verl_09_releases_are_accepted(installed):
    check_verl_version(installed)
    check_verl_version()  # the verl installed here
    assert installed_verl_version().startswith("0.9.")


@pytest.mark.parametrize("python", ["3.13.0", "3.14.1"])
def test_without_verl_on_a_python_verl_does_not_support_the_error_says_so(monkeypatch, python):
    monkeypatch.setattr(verl_version, "installed_verl_version", lambda: None)
    with pytest.raises(ConfigError) as info:
        check_verl_version(python=python)
    assert info.value.key == "agentlightning.backend"
    assert info.value.message == (
        f"backend 'verl' needs verl >=0.9.1,<0.10, which supports Python <3.13 only, and this is Python {python}: "
        "run backend=verl on Python 3.10 to 3.12, or train with backend=torch here"
    )


def test_without_verl_on_a_python_verl_supports_the_error_says_how_to_install_it(monkeypatch):
    monkeypatch.setattr(verl_version, "installed_verl_version", lambda: None)
    with pytest.raises(ConfigError) as info:
        check_verl_version(python="3.12.1")
    assert info.value.message == "backend 'verl' needs verl installed: pip install 'verl>=0.9.1,<0.10'"


@pytest.mark.skipif(HAS_VERL, reason="verl is installed here")
def test_agl_check_backend_verl_without_verl_names_this_python(capsys):
    """What a user on Python 3.13 meets: ``agl check`` with ``backend=verl`` is refused, naming why."""
    from agl_core.cli import main
    from tests.helpers.paths import REPO_ROOT

    config = REPO_ROOT / "examples" / "corridor" / "config.yaml"
    assert main(["check", str(config), "backend=verl"]) == 2
    err = capsys.readouterr().err
    assert f"this is Python {platform.python_version()}" in err and "agentlightning.backend" in err
