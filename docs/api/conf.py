"""Sphinx configuration of agl's API reference (``sphinx-build -W -n -b html docs/api build/api``)."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

project = "agl"
extensions = ["sphinx.ext.autodoc"]
# Signatures without annotations: the docstrings say what each argument is, and strict
# cross-reference checking (-n) then judges the references the docstrings make.
autodoc_typehints = "none"
autodoc_member_order = "bysource"
autodoc_default_options = {"members": True, "show-inheritance": False}
autodoc_inherit_docstrings = False  # FrozenDict's refused dict methods would show dict's docstrings
html_theme = "alabaster"
# Names of other projects' objects (no intersphinx: the build runs offline).
nitpick_ignore_regex = [
    (
        "py:.*",
        r"(numpy|np|torch|pluggy|attrs|omegaconf|hypothesis|pytest|abc|argparse|pathlib|os|tempfile|collections|threading)(\..*)?",
    ),
    ("py:.*", r"(str|int|float|bool|dict|list|tuple|object|Any|Path|ValueError|LookupError|TypeError|Exception)"),
]

# The reference documents each public name under ``agl_core.NAME`` only; the modules behind them are
# free to move and are not documented. A docstring may still cite a name by the module defining it
# (``agl_core.stages.aggregation.AggregationSettings``, or a member of it): that reference resolves
# to the public name. A citation of an internal module renders as code, unresolved by design.
nitpick_ignore_regex += [
    ("py:mod", r"agl_core\.(?!hookspecs$|testing|scaffold$).*"),
    # a name of an internal module that is not public (agl_core.runs.train.run...): rendered as code
    ("py:.*", r"agl_core\.(?!testing\.|hookspecs\.|scaffold\.)[a-z_]+\..*"),
    # a postponed annotation (a string) that autodoc splits at its first comma
    ("py:class", r"'dict\[str"),
]


def _public_target(target: str) -> str | None:
    import agl_core

    parts = target.split(".")
    for i, part in enumerate(parts):
        if part in agl_core.__all__ and parts[0] == "agl_core":
            return ".".join(["agl_core", part, *parts[i + 1 :]])
    return None


def _resolve_to_public_name(app, env, node, contnode):
    if node.get("refdomain") != "py":
        return None
    target = node.get("reftarget", "")
    public = _public_target(target) if target.startswith("agl_core.") else None
    if public is None and "." not in target and node.get("py:class"):
        public = _public_target(f"agl_core.{node['py:class']}.{target}")  # a sibling member of a public class
    if public is None or public == target:
        return None
    domain = env.get_domain("py")
    return domain.resolve_xref(env, node["refdoc"], app.builder, node["reftype"], public, node, contnode)


def setup(app):
    app.connect("missing-reference", _resolve_to_public_name)
