"""What a plugin author needs to test an agl plugin without reading agl's tests.

Hypothesis strategies for traces live in :mod:`agl_core.testing.strategies` and contract suites
(base test classes to subclass) in :mod:`agl_core.testing.contracts`. This package is also a pytest
plugin (entry point ``pytest11``) providing the fixtures in :mod:`agl_core.testing.pytest_plugin`.
"""
