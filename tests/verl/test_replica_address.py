"""The CPU replica's server listens where ``agentlightning.verl.replica_bind_host`` says and is
registered with the gateway under an address the gateway can reach."""

from __future__ import annotations

import httpx
import pytest

from agl_backend_verl.replica_address import (
    ADVERTISE_ENV,
    BIND_ENV,
    advertised_address,
    bind_host,
    replica_hosts_env,
)
from agl_core.config import load_config
from agl_core.serving.policy_server import PolicyServer

pytestmark = pytest.mark.verl


def test_the_driver_sends_both_keys_to_the_workers():
    assert replica_hosts_env(load_config()) == {BIND_ENV: "127.0.0.1"}  # the default: this node only
    config = load_config(
        overrides=["agentlightning.verl.replica_bind_host=0.0.0.0", "agentlightning.verl.replica_advertise_host=node7"]
    )
    assert replica_hosts_env(config) == {BIND_ENV: "0.0.0.0", ADVERTISE_ENV: "node7"}


@pytest.mark.parametrize(
    ("env", "expected"),
    [
        ({}, "127.0.0.1:8123"),
        ({BIND_ENV: "10.1.2.3"}, "10.1.2.3:8123"),
        ({BIND_ENV: "0.0.0.0", ADVERTISE_ENV: "node7.cluster"}, "node7.cluster:8123"),
        ({BIND_ENV: "0.0.0.0", ADVERTISE_ENV: "fd00::7"}, "[fd00::7]:8123"),
    ],
)
def test_the_advertised_address_is_the_advertise_host_else_the_bind_host(monkeypatch, env, expected):
    for name in (BIND_ENV, ADVERTISE_ENV):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    assert advertised_address(8123) == expected


def test_a_server_on_every_interface_advertises_the_nodes_address(monkeypatch):
    import ray

    monkeypatch.setenv(BIND_ENV, "0.0.0.0")
    monkeypatch.delenv(ADVERTISE_ENV, raising=False)
    assert bind_host() == "0.0.0.0"
    assert advertised_address(8123) == f"{ray.util.get_node_ip_address()}:8123"


def test_a_policy_server_on_every_interface_answers_on_its_node_address(tiny_model_dir):
    import ray
    from transformers import AutoModelForCausalLM, AutoTokenizer

    server = PolicyServer(
        AutoModelForCausalLM.from_pretrained(tiny_model_dir),
        AutoTokenizer.from_pretrained(tiny_model_dir),
        "tiny",
        host="0.0.0.0",
    )
    server.start()
    try:
        assert server.base_url == f"http://127.0.0.1:{server.port}/v1"  # how this process reaches it
        node = f"http://{ray.util.get_node_ip_address()}:{server.port}/v1"  # how another machine does
        body = {"prompt": [1, 2, 3], "max_tokens": 2, "temperature": 0}
        assert httpx.post(f"{node}/completions", json=body, timeout=60).status_code == 200
    finally:
        server.close()
