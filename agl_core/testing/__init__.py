"""What a plugin author needs to test an agl plugin without reading agl's tests.

Hypothesis strategies for traces live in :mod:`agl_core.testing.strategies` and contract suites
(base test classes to subclass) in :mod:`agl_core.testing.contracts`; both need hypothesis, which
comes with the ``test`` extra. This package is also a pytest plugin (entry point ``pytest11``)
providing the fixtures in :mod:`agl_core.testing.pytest_plugin`; that plugin loads without
hypothesis, so installing agl never breaks another project's pytest.
"""

from __future__ import annotations

import importlib.util

__all__ = ["TEST_EXTRA_INSTALL", "has_hypothesis", "hypothesis_missing"]

TEST_EXTRA_INSTALL = "pip install 'agl-backend-verl[test]'"


def has_hypothesis() -> bool:
    return importlib.util.find_spec("hypothesis") is not None


def hypothesis_missing(module: str) -> ImportError:
    """The error ``module`` fails its import with when hypothesis is missing: what to install."""
    return ImportError(
        f"{module} needs hypothesis, which agl's test extra installs: {TEST_EXTRA_INSTALL}", name="hypothesis"
    )
