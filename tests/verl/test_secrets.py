"""``agl train … backend=verl`` end to end on CPU, against the real gateway: verl's V1 trainer and
TransferQueue run on a local Ray, the task runner's body in this process (on a pickled copy of what
Ray would send it), verl's worker groups and replicas are answered in this process
(:mod:`tests.helpers.verl_local_workers`), and W&B runs offline. ``agl_on_startup`` runs once, in
the task runner, with the key redacted; plugins given in code reach the task runner; and the gateway
key shows up in no output of the run."""

from __future__ import annotations

import json
import logging
import textwrap
import threading
from types import SimpleNamespace

import pytest

pytestmark = [pytest.mark.verl, pytest.mark.gateway, pytest.mark.ray]

pytest.importorskip("verl")
ray = pytest.importorskip("ray")

from agl_backend_verl import run as verl_run  # noqa: E402
from agl_backend_verl import trainer as verl_trainer  # noqa: E402
from agl_backend_verl.config import load_verl_config  # noqa: E402
from agl_backend_verl.cpu import CPU_KEYS  # noqa: E402
from agl_core import hookimpl  # noqa: E402
from agl_core.plugins import DISABLE_AUTOLOAD_ENV, PluginError  # noqa: E402
from agl_core.runs.train import run  # noqa: E402
from tests.helpers.gateway_fixtures import Plan, SimulatedController, always  # noqa: E402
from tests.helpers.gateway_server import GatewayServer  # noqa: E402
from tests.helpers.verl_local_workers import local_trainer_class  # noqa: E402
from tests.helpers.wandb_mode import use_wandb_mode  # noqa: E402

KEY = "sk-agl-do-not-show-8c41f0e2"

CONFIG = """
agentlightning:
  backend: verl
  agl_base_url: {url}
  agl_key: {key}
data:
  train_files: {dataset}
  val_files: {dataset}
  train_batch_size: 2
  val_batch_size: 2
  dataloader_num_workers: 0
actor_rollout_ref:
  model:
    path: {model}
  actor:
    ppo_mini_batch_size: 2
    ppo_micro_batch_size_per_gpu: 1
  rollout:
    n: 2
    log_prob_micro_batch_size_per_gpu: 1
trainer:
  logger: [console, tensorboard, wandb]
  n_gpus_per_node: 1
  total_training_steps: 2
  test_freq: 2
  save_freq: 1
  default_local_dir: {run_dir}
"""


class Startup:
    """A plugin given in code: what it sees is appended to a file, since it runs on the task
    runner's copy, not on this object."""

    def __init__(self, path):
        self.path = str(path)
        self.calls = 0

    def _note(self, record):
        self.calls += 1
        with open(self.path, "a") as f:
            f.write(json.dumps(record) + "\n")

    @hookimpl
    def agl_on_startup(self, config):
        self._note({"hook": "startup", "key": config.agentlightning.agl_key, "url": config.agentlightning.agl_base_url})

    @hookimpl
    def agl_on_enqueue(self, request):
        self._note({"hook": "enqueue", "step": request.step})


@pytest.fixture(scope="module")
def keyed_gateway():
    with GatewayServer(key=KEY) as server:
        yield server


@pytest.fixture
def in_process_ray(monkeypatch):
    """The task runner in this process: ``ray.init``'s arguments are recorded (a local Ray holds
    TransferQueue), the task runner's body runs here on a cloudpickled copy of its arguments, verl's
    worker groups and replicas are local (:func:`local_trainer_class`)."""
    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False)
    started = []
    monkeypatch.setattr(verl_run, "init_ray", lambda config: started.append(verl_run.ray_init_kwargs(config)))
    monkeypatch.setattr(verl_run, "check_gpus", lambda config: None)
    monkeypatch.setattr(
        verl_run, "RemoteTaskRunner", SimpleNamespace(options=lambda **_: SimpleNamespace(remote=lambda: None))
    )
    monkeypatch.setattr(
        verl_run,
        "actor_steps",
        lambda runner, *args: verl_run.TaskRunner().run(*ray.cloudpickle.loads(ray.cloudpickle.dumps(args))),
    )
    monkeypatch.setattr(verl_trainer, "trainer_class", lambda mode: local_trainer_class(mode, ["10.0.0.1:8000"]))
    monkeypatch.setenv(DISABLE_AUTOLOAD_ENV, "1")
    use_wandb_mode(monkeypatch, "offline")
    yield started
    ray.shutdown()


def write_config(tmp_path, gateway, tiny_model_dir):
    dataset = tmp_path / "rows.jsonl"
    dataset.write_text('{"q": "a"}\n{"q": "b"}\n')
    path = tmp_path / "config.yaml"
    text = CONFIG.format(url=gateway.url, key=KEY, dataset=dataset, model=tiny_model_dir, run_dir=tmp_path / "run")
    path.write_text(textwrap.dedent(text))
    return path


def test_a_verl_run_starts_plugins_once_in_the_task_runner_and_never_shows_the_key(
    keyed_gateway, in_process_ray, tmp_path, tiny_model_dir, caplog, capfd
):
    caplog.set_level(logging.DEBUG)
    seen = tmp_path / "seen.jsonl"
    plugin = Startup(seen)
    with SimulatedController(keyed_gateway, always(Plan())):
        run_dir = run(  # verl's CPU mode, with its workers local
            str(write_config(tmp_path, keyed_gateway, tiny_model_dir)),
            list(CPU_KEYS),
            plugins=[plugin],
            show_progress=False,
        )

    records = [json.loads(line) for line in seen.read_text().splitlines()]
    startups = [r for r in records if r["hook"] == "startup"]
    assert startups == [{"hook": "startup", "key": "***", "url": keyed_gateway.url}]
    assert records[0]["hook"] == "startup", "startup runs before the first rollout is enqueued"
    assert {r["step"] for r in records if r["hook"] == "enqueue"} == {0, 1, 2}
    assert plugin.calls == 0, "the hooks ran on the task runner's copy"
    steps = [json.loads(line)["step"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert steps == [0, 1, 2]
    # the driver's sinks logged what the task runner streamed: metrics and the rollouts' sample
    trajectories = [json.loads(line) for line in (run_dir / "samples" / "trajectories.jsonl").read_text().splitlines()]
    assert [t["step"] for t in trajectories] == [1] * 4 + [2] * 4
    assert list((run_dir / "tensorboard").glob("events.out.tfevents.*"))
    assert list((run_dir / "wandb").glob("offline-run-*/run-*.wandb"))

    out, err = capfd.readouterr()
    outputs = {
        "captured logs": caplog.text,
        "stdout": out,
        "stderr": err,
        "ray.init arguments": json.dumps(in_process_ray),
    }
    assert len(in_process_ray) == 1 and "env_vars" in in_process_ray[0]["runtime_env"]
    files = sorted(p for p in run_dir.rglob("*") if p.is_file())
    assert files, "the run wrote files"
    for path in files:
        outputs[str(path)] = path.read_bytes().decode("latin-1")
    assert caplog.text and out
    assert [where for where, text in outputs.items() if KEY in text] == []


class Locked:
    """A plugin holding a lock: it cannot be pickled."""

    def __init__(self):
        self.lock = threading.Lock()

    @hookimpl
    def agl_on_startup(self, config):
        pass


def test_a_plugin_given_in_code_that_cannot_be_pickled_is_refused_before_ray_starts(
    monkeypatch, tmp_path, tiny_model_dir
):
    started = []
    monkeypatch.setattr(verl_run, "init_ray", lambda config: started.append(config))
    config = load_verl_config(None, [*CPU_KEYS, f"actor_rollout_ref.model.path={tiny_model_dir}"])
    with pytest.raises(
        PluginError, match=r"cannot be pickled.*entry point in group 'agl'.*hook file named in agentlightning\.hooks"
    ):
        verl_run.run_ppo(config, [{"q": 1}], [{"q": 1}], plugins=[Locked()])
    assert started == []
