"""Every key of the core schema takes effect: some code reads it, or it is knowingly handed to verl unread."""

from __future__ import annotations

import ast
import json
import re
from pathlib import Path

import httpx
from omegaconf import DictConfig, OmegaConf

from agl_core.config import CoreConfig, load_config
from agl_core.plugins import PluginManager
from tests.helpers.paths import REPO_ROOT

PACKAGES = ("agl_core", "agl_backend_verl", "agl_hooks")
NOT_READERS = (
    REPO_ROOT / "agl_core" / "config",  # the schema and its checks define keys; they do not use them
    # The policy server parses OpenAI request fields (top_p, temperature...), which share names with
    # the sampling keys but are not reads of the config.
    REPO_ROOT / "agl_core" / "serving" / "policy_server.py",
)

# Keys of the core schema that no agl code reads, each with why it is still accepted. Only keys that
# the verl backend hands to verl itself belong here (agl's own code never needs them).
PASSED_THROUGH_UNREAD: dict[str, str] = {
    "algorithm.use_kl_in_reward": "verl's switch in v1.0 configs: false is what agl does, true is refused",
}


def schema_keys(node: DictConfig, prefix: str = "") -> list[str]:
    """Dotted paths of the schema's leaves (a free-form mapping, like ``local.env_map``, or a section
    that is null by default, like ``fsdp_config.mixed_precision``, is one leaf)."""
    keys = []
    for name in node.keys():
        child = node._get_node(name)
        if isinstance(child, DictConfig) and child._metadata.object_type is not dict and not child._is_none():
            keys.extend(schema_keys(child, f"{prefix}{name}."))
        else:
            keys.append(f"{prefix}{name}")
    return keys


def names_used_in_code() -> set[str]:
    """Attribute names, keyword names and string constants (docstrings left out) in agl's packages."""
    names: set[str] = set()
    for package in PACKAGES:
        for path in sorted((REPO_ROOT / package).rglob("*.py")):
            if any(path == skip or skip in path.parents for skip in NOT_READERS):
                continue
            tree = ast.parse(path.read_text(encoding="utf-8"))
            docstrings = {
                id(node.body[0].value)
                for node in ast.walk(tree)
                if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
                and node.body
                and isinstance(node.body[0], ast.Expr)
            }
            for node in ast.walk(tree):
                if isinstance(node, ast.Attribute):
                    names.add(node.attr)
                elif isinstance(node, ast.keyword) and node.arg:
                    names.add(node.arg)
                elif isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docstrings:
                    names.add(node.value)
    return names


def test_every_schema_key_is_read_or_knowingly_passed_through():
    keys = schema_keys(OmegaConf.structured(CoreConfig))
    assert "actor_rollout_ref.rollout.top_p" in keys and "agentlightning.local.env_map" in keys
    used = names_used_in_code()
    unread = [key for key in keys if key not in used and key.rsplit(".", 1)[-1] not in used]
    assert sorted(set(unread) - set(PASSED_THROUGH_UNREAD)) == [], "accepted keys that nothing reads"
    assert sorted(set(PASSED_THROUGH_UNREAD) - set(unread)) == [], "allow-listed keys that are read after all"


def test_top_p_reaches_the_engine_in_training_calls(monkeypatch):
    """The embedded source sends ``actor_rollout_ref.rollout.top_p`` with every training call (to the
    built-in policy server or vLLM alike), whatever the agent asked for."""
    from agl_core.rollouts.embedded import EmbeddedRolloutSource

    sent = []

    def engine(request: httpx.Request) -> httpx.Response:
        sent.append(json.loads(request.content))
        return httpx.Response(200, json={"choices": []})

    cfg = load_config(
        overrides=[
            "agentlightning.local.agent_class=examples.corridor.agent:CorridorAgent",
            "actor_rollout_ref.rollout.top_p=0.7",
        ]
    )
    monkeypatch.chdir(REPO_ROOT)
    source = EmbeddedRolloutSource(
        cfg, PluginManager(load_entrypoints=False, builtins={}), "http://engine.invalid/v1", "policy"
    )
    try:
        source.recorder.client = httpx.Client(transport=httpx.MockTransport(engine))
        source.recorder.open("r1", (1, 1, 0))
        source.recorder.proxy("r1", "0", "train", "chat/completions", {"messages": [], "top_p": 0.1})
        source.recorder.proxy("r1", "0", "val", "chat/completions", {"messages": []})
    finally:
        source.close()
    assert sent[0]["top_p"] == 0.7
    assert "top_p" not in sent[1], "validation samples at the engine's default"


def documented_keys(page: Path) -> set[str]:
    """The keys of the tables in ``page``: each row's first cell, ``| `key` | default | what |``."""
    return set(re.findall(r"^\| `([a-z_][a-z0-9_.]*)` \|", page.read_text(encoding="utf-8"), flags=re.MULTILINE))


def test_every_config_key_is_documented():
    """As datasette checks its settings: every key of the core schema has its row in
    docs/configuration.md, and every row there is a key of the schema."""
    documented = documented_keys(REPO_ROOT / "docs" / "configuration.md")
    keys = set(schema_keys(load_config()))
    assert sorted(keys - documented) == [], "add these keys to docs/configuration.md, Every key"
    assert sorted(documented - keys) == [], "docs/configuration.md documents keys the schema no longer has"


def test_the_documentation_check_reads_table_rows_only(tmp_path):
    page = tmp_path / "configuration.md"
    page.write_text("| `data.seed` | `null` | the seed |\nprose naming `data.shuffle`\n| key | default |\n")
    assert documented_keys(page) == {"data.seed"}
