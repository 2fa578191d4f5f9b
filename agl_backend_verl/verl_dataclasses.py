"""What verl's config dataclasses declare, for the sections of verl's defaults that name one (``_target_``).

verl builds each such section into its dataclass (``omega_conf_to_dataclass``), which accepts more than
the flattened YAML defaults show: fields the YAML leaves out (``fsdp_config.mixed_precision``) and
fields typed wider than their default (``model.target_modules``: ``"all-linear"`` or a list of names).
"""

from __future__ import annotations

import dataclasses
import importlib
import types
import typing
from collections.abc import Mapping
from functools import cache
from typing import Any

from omegaconf import DictConfig, OmegaConf

__all__ = ["declared_fields", "type_names"]

# The type names of agl_backend_verl.config's type check.
_NAMES = {bool: "bool", int: "int", float: "float", str: "str", list: "list", tuple: "list", dict: "mapping"}


@cache
def _fields(target: str) -> dict[str, Any]:
    """Init field name -> type annotation of the dataclass ``target`` names ({} for anything else)."""
    module, _, name = target.rpartition(".")
    cls = getattr(importlib.import_module(module), name, None)
    if not (isinstance(cls, type) and dataclasses.is_dataclass(cls)):
        return {}
    hints = typing.get_type_hints(cls)
    return {f.name: hints[f.name] for f in dataclasses.fields(cls) if f.init and not f.name.startswith("_")}


def declared_fields(defaults: DictConfig, prefix: str = "") -> dict[str, Any]:
    """Dotted key -> type annotation, for every field of every dataclass a section under ``defaults`` names."""
    found: dict[str, Any] = {}
    if "_target_" in defaults and not OmegaConf.is_interpolation(defaults, "_target_"):
        target = defaults._target_
        if isinstance(target, str):
            found.update({f"{prefix}{name}": hint for name, hint in _fields(target).items()})
    for key in defaults.keys():
        if OmegaConf.is_interpolation(defaults, key) or OmegaConf.is_missing(defaults, key):
            continue
        value = defaults[key]
        if isinstance(value, DictConfig):
            found.update(declared_fields(value, f"{prefix}{key}."))
    return found


def type_names(annotation: Any) -> frozenset[str] | None:
    """The type names (``str``, ``list``, ``mapping``...) a value of a field so annotated may have;
    ``None`` when the annotation admits anything (``Any``, or a type the config cannot hold)."""
    origin = typing.get_origin(annotation)
    if origin is typing.Union or origin is types.UnionType:
        names: set[str] = set()
        for member in typing.get_args(annotation):
            if member is type(None):
                continue
            member_names = type_names(member)
            if member_names is None:
                return None
            names |= member_names
        return frozenset(names)
    cls = origin or annotation
    if isinstance(cls, type) and dataclasses.is_dataclass(cls):
        return frozenset({"mapping"})
    for base, name in _NAMES.items():
        if cls is base:
            return frozenset({name})
    if isinstance(cls, type) and issubclass(cls, Mapping):
        return frozenset({"mapping"})
    return None
