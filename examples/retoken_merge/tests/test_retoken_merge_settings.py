"""retoken_merge's one setting, set from the run config and refused when wrong."""

import agl_retoken_merge
import pytest
from agl_retoken_merge import RetokenMergeSettings

from agl_core import ConfigError, PluginManager


def manager(section):
    config = {"agentlightning": {"plugins": {"retoken_merge": section}}}
    return PluginManager.from_config(config, [agl_retoken_merge], load_entrypoints=False)


def test_the_configured_lookahead_reaches_the_aggregator():
    m = manager({"lookahead_tokens": 6})
    assert m.settings["retoken_merge"] == RetokenMergeSettings(lookahead_tokens=6)
    assert m.aggregators.get("retoken_merge").keywords == {"lookahead_tokens": 6}


def test_the_default_lookahead():
    m = PluginManager.from_config({}, [agl_retoken_merge], load_entrypoints=False)
    assert m.aggregators.get("retoken_merge").keywords == {"lookahead_tokens": 4}


def test_a_negative_lookahead_is_refused_naming_the_key():
    with pytest.raises(ConfigError) as err:
        manager({"lookahead_tokens": -1})
    assert str(err.value) == (
        "config key agentlightning.plugins.retoken_merge.lookahead_tokens: "
        "'lookahead_tokens' must be >= 0: -1 (plugin 'agl_retoken_merge')"
    )
