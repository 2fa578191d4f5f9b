"""A hook file and an entry-point plugin that exist only in one folder of the machine that runs
``agl`` (as on a cluster's head node), for tests that prove the run ships them to other nodes.

:func:`write_head_only_plugins` writes, under a folder:

- ``site/probe_plugin/``: a package registering the aggregator ``probe_agg`` and declaring the
  settings section ``probe`` (``greeting``), with its distribution's metadata
  (``site/probe_plugin-0.1.dist-info``: entry point ``probe`` in group ``agl``); put ``site`` on
  ``sys.path`` and ``importlib.metadata`` finds it, as an installed plugin;
- ``hooks/probe_hooks.py``: a hook file whose ``agl_on_startup`` imports ``probe_helper`` beside it.
"""

from __future__ import annotations

from pathlib import Path

import attrs

PLUGIN = """
import attrs

from agl_core import hookimpl


@attrs.frozen
class ProbeSettings:
    greeting: str = "hello"


@hookimpl
def agl_plugin_settings():
    return {"probe": ProbeSettings}


@hookimpl
def agl_register_aggregators(register, settings):
    greeting = settings["probe"].greeting

    def probe_agg(rollouts, aggregation_settings):
        return []

    probe_agg.greeting = greeting
    register("probe_agg", probe_agg)
"""
HOOK_FILE = """
from agl_core import hookimpl

import probe_helper  # beside this file, on the head node only


@hookimpl
def agl_register_advantage_estimators(register):
    register("probe_estimator", probe_helper.estimate)
"""
HELPER = """
def estimate(rows, settings):
    raise NotImplementedError("registered only to show the helper was imported")
"""


@attrs.frozen
class HeadOnlyPlugins:
    site: Path  # to put on the driver's sys.path
    hook_file: Path


def write_head_only_plugins(folder: Path) -> HeadOnlyPlugins:
    site, hooks = folder / "site", folder / "hooks"
    (site / "probe_plugin").mkdir(parents=True)
    (site / "probe_plugin" / "__init__.py").write_text(PLUGIN)
    metadata = site / "probe_plugin-0.1.dist-info"
    metadata.mkdir()
    (metadata / "METADATA").write_text("Metadata-Version: 2.1\nName: probe-plugin\nVersion: 0.1\n")
    (metadata / "entry_points.txt").write_text("[agl]\nprobe = probe_plugin\n")
    hooks.mkdir()
    (hooks / "probe_hooks.py").write_text(HOOK_FILE)
    (hooks / "probe_helper.py").write_text(HELPER)
    return HeadOnlyPlugins(site, hooks / "probe_hooks.py")
