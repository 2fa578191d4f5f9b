"""verl beside a TRL without the value-head model: verl is told TRL is not there.

verl 0.9.1 asks ``verl.utils.import_utils.is_trl_available()`` and, when TRL is installed, imports
TRL's ``AutoModelForCausalLMWithValueHead`` (from ``trl.experimental.ppo``, else ``trl``) to patch its
``state_dict`` when its FSDP engine starts, and to build a value-head critic from a TRL model. TRL
1.16 (agl's ``trl`` backend) has that class in neither place, so in an environment holding both
backends every verl worker failed at start with ``ImportError``. agl never builds verl's TRL critic;
where TRL lacks the class, the answer verl gets is the one it gets without TRL, whose path it tests.

Applied in every process that imports verl (:mod:`agl_backend_verl.verl_plugins`), while ``import
verl`` loads its plugins: before verl's modules that import the function by name (``IMPORTERS``); one
already imported has its name replaced too.
"""

from __future__ import annotations

import importlib.util
import sys
import warnings

__all__ = ["apply", "trl_has_value_head_model"]

IMPORTERS = ("verl.models.transformers.monkey_patch", "verl.utils.model")
VALUE_HEAD_MODEL = "AutoModelForCausalLMWithValueHead"


def trl_has_value_head_model() -> bool:
    """Whether the installed TRL (if any) has the class verl imports, where verl looks for it."""
    if importlib.util.find_spec("trl") is None:
        return False
    import trl

    if hasattr(trl, VALUE_HEAD_MODEL):
        return True
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # importing trl.experimental warns that its APIs are unstable
        return importlib.util.find_spec("trl.experimental.ppo") is not None


def _trl_with_value_head_is_available() -> bool:
    return False


def apply() -> list[str]:
    """Where TRL is installed without the value-head model, replace verl's ``is_trl_available`` (in
    ``verl.utils.import_utils`` and in the importers already loaded); the names replaced."""
    if importlib.util.find_spec("trl") is None or trl_has_value_head_model():
        return []
    from verl.utils import import_utils

    import_utils.is_trl_available = _trl_with_value_head_is_available
    replaced = ["verl.utils.import_utils.is_trl_available"]
    for name in IMPORTERS:
        module = sys.modules.get(name)
        if module is not None:
            module.is_trl_available = _trl_with_value_head_is_available
            replaced.append(f"{name}.is_trl_available")
    return replaced
