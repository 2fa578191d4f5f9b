"""The verl releases this backend supports, checked before it reads anything of verl.

The backend runs on verl 0.9.x: it loads its losses into verl's Ray workers through verl's
``verl.plugins`` entry-point group and reaches verl's device, engine and rollout registries
(``verl.plugin``), which verl 0.9 introduced; verl 0.8.0 (the newest release Agent Lightning v1.0
supports) has neither, and its config keys differ (:mod:`agl_backend_verl.moved_keys`). Any other
installed verl is refused with the installed and the supported versions named, rather than failing
later on a missing module or key. verl 0.9 requires Python < 3.13, so agl installs without verl on
Python 3.13 and later, and there the backend says that no verl it supports exists for this Python.
"""

from __future__ import annotations

import importlib.metadata
import platform

from packaging.specifiers import SpecifierSet
from packaging.version import Version

from agl_core import ConfigError

__all__ = ["SUPPORTED_VERL", "VERL_INSTALL", "VERL_PYTHON", "check_verl_version", "installed_verl_version"]

SUPPORTED_VERL = ">=0.9.1,<0.10"
VERL_INSTALL = f"pip install 'verl{SUPPORTED_VERL}'"
VERL_PYTHON = "<3.13"  # verl 0.9.x's Requires-Python (pyproject.toml's marker on verl says the same)


def installed_verl_version() -> str | None:
    """The installed verl distribution's version, or None when verl is not installed."""
    try:
        return importlib.metadata.version("verl")
    except importlib.metadata.PackageNotFoundError:
        return None


def check_verl_version(installed: str | None = None, python: str | None = None) -> None:
    """Raise a :class:`ConfigError` unless the installed verl (or ``installed``) is one this backend
    supports; ``python`` (this interpreter's version by default) says why verl may be missing."""
    installed = installed if installed is not None else installed_verl_version()
    if installed is None:
        python = python or platform.python_version()
        if not SpecifierSet(VERL_PYTHON).contains(Version(python)):
            raise ConfigError(
                "agentlightning.backend",
                f"backend 'verl' needs verl {SUPPORTED_VERL}, which supports Python {VERL_PYTHON} only, and this "
                f"is Python {python}: run backend=verl on Python 3.10 to 3.12, or train with backend=torch here",
            )
        raise ConfigError("agentlightning.backend", f"backend 'verl' needs verl installed: {VERL_INSTALL}")
    version = Version(installed)
    if SpecifierSet(SUPPORTED_VERL).contains(version, prereleases=True):
        return
    if version.release[:2] == (0, 8):
        reason = (
            "verl 0.8 lacks the verl.plugins entry points and device registries this backend loads its losses "
            "and devices through"
        )
    else:
        reason = "no other release is tested"
    raise ConfigError(
        "agentlightning.backend",
        f"backend 'verl' supports verl {SUPPORTED_VERL} (0.9.x), but verl {installed} is installed "
        f"({reason}): {VERL_INSTALL}",
    )
