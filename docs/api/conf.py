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
    ("py:.*", r"(numpy|np|torch|pluggy|attrs|omegaconf|hypothesis|pytest|argparse|pathlib|os|tempfile|collections|threading)(\..*)?"),
    ("py:.*", r"(str|int|float|bool|dict|list|tuple|object|Any|Path|ValueError|LookupError|TypeError|Exception)"),
]
