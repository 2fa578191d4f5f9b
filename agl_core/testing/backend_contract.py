"""The backend contract: what every backend registered through ``agl_register_backends`` must do,
checked against the reference backend (``torch``) on recorded steps.

Subclass :class:`BackendContract` in a ``test_*.py`` file::

    import my_backend
    from agl_core.testing.contracts import BackendContract

    class TestMyBackend(BackendContract):
        backend_name = "mine"
        plugins = (my_backend,)

The backend is built as ``agl train`` builds it: looked up by name in a plugin manager holding the
built-ins and ``plugins`` (entry points off), its run config made by its own ``BackendSpec.load_config``
and the backend by its factory, then trained with ``fit(on_step)``. Every run replays a recording
(``agentlightning.replay``, docs/replay.md): by default three steps of the tiny task
(:mod:`agl_core.testing.tiny_task`) that the contract records first with the reference backend;
override :meth:`BackendContract.recorded` to replay your own (a recording and the policy it was
recorded with). The config is the recording's (its core-schema keys) with the keys a replayed run
needs (``agentlightning.replay``, ``actor_rollout_ref.model.path``, ``data.train_files``: a file of
``data.train_batch_size`` rows ``{"index": i}``, which a replayed run does not read,
``data.val_files=null``, ``trainer.val_before_train=false``, ``trainer.test_freq=-1``,
``trainer.total_training_steps``, ``trainer.save_freq``, ``trainer.resume_mode=auto``,
``trainer.default_local_dir``; the recording, async rollout, the gateway and hook files off), then
``overrides`` (both backends) and ``backend_overrides`` (the backend under test only: keys of its
own schema). The reference runs the same steps from the same weights.

A plugin the contract adds, :class:`ServedProbe`, asks the served engines at every weight version
(``agl_on_weights_served``) for the greedy next token after a few recorded prompts and its log-prob.

The checks, each a test:

- **metric names**: every step 1..N is reported once, in order, with ``total_steps`` N,
  ``training/global_step`` N, and every name of :data:`STEP_METRICS`;
- **trains the rows it is handed**: each step's pipeline counts (``training/n_sample_trained``...)
  and gradient norm (``actor/grad_norm``, a sum over the rows handed to the update: a row left out or
  trained twice moves it) equal the reference's;
- **the update equals the reference's**: the loss terms of each step (``actor/pg_loss``,
  ``actor/entropy_loss``, ``actor/loss``, ``actor/pg_clipfrac``, ``actor/ppo_kl``, where both
  report them) and the served policy after each step (the probe's answers) equal the reference's;
- **weight versions advance and are what agents are served**: the probe sees versions 0, 1, ..., N,
  each once and in order, each with an endpoint, and the served answers change after every step
  whose gradient was not zero;
- **checkpoint → resume continues the same run**: a run of 2 steps checkpointing every step, then a
  run of 3 in the same directory (``trainer.resume_mode=auto``), reports step 3 only, serves version 2
  as the 2-step run left it, and its step 3 (metrics and served policy) equals an uninterrupted run's;
- **plugin failures are isolated**: with a plugin that raises in every lifecycle hook, one step
  trains as without it, and ``agl_on_startup`` ran once.

Every run is bounded: a step reported twice (or out of order) stops it, and a run that goes
:attr:`BackendContract.stall_timeout_seconds` without progress (a step reported, or a weight version
served for the first time) or has not finished after :attr:`BackendContract.run_timeout_seconds`
fails the checks that use it, saying what ``on_step`` and the probe saw (its training thread is
abandoned). The replay source refuses a step
asked for before the backend told it of the weights (``after_weight_update``). The runs train with an
entropy bonus (``actor_rollout_ref.actor.entropy_coeff=0.01``; ``overrides`` may change it), so that
every trained token, one of zero advantage too, moves ``actor/grad_norm``: a backend that trains a
row it should not fails whatever its loss.

Tolerances (fp32): metrics within :attr:`BackendContract.metric_rtol` relative (1e-4) or
``metric_atol`` absolute (1e-6); served log-probs within ``served_atol`` (1e-4) absolute, the
served tokens equal.

**A backend that owns its loop** (implements ``fit(on_step)`` itself rather than subclassing
:class:`~agl_core.backends.loop_backend.LoopBackend`, which does all of this) is run the same way
and must:

1. be registered with a ``BackendSpec`` whose ``load_config(path, overrides)`` accepts the core
   keys above and ``backend_overrides``;
2. get its rollouts from :func:`~agl_core.backends.rollout_source.open_rollout_source` (so that
   ``agentlightning.replay`` feeds it the recording), and run
   :class:`~agl_core.stages.pipeline.StepPipeline` and its update on them;
3. call ``plugins.on_startup(config)`` once, and ``plugins.on_weights_served(endpoints, version)``
   (after ``source.after_weight_update``) for the weights it starts from and after every step's
   push, ``version`` the step, ``endpoints`` OpenAI base URLs answering ``/completions`` for model
   ``actor_rollout_ref.model.path`` with a token-id list ``prompt``, ``temperature: 0``,
   ``logprobs: 1`` (vLLM does), from the process where the hooks run (plugins given in code must
   reach that process: the contract's pickle);
4. train ``trainer.total_training_steps`` steps, calling ``on_step(step, total, metrics, samples)``
   after each, with :data:`STEP_METRICS`; checkpoint every ``trainer.save_freq`` steps and at the
   last, and with ``trainer.resume_mode=auto`` continue from the newest checkpoint in
   ``trainer.default_local_dir`` (its rollout source's state kept with
   :func:`~agl_core.backends.checkpoints.save_source_state`).

Validation is not checked: a recording holds no validation rollouts.
"""

from __future__ import annotations

import collections
import functools
import json
import math
import threading
import time
import traceback
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, ClassVar

import attrs
import pytest
from omegaconf import OmegaConf

from agl_core.backends.contract import backend_spec
from agl_core.errors import UsageTypeError
from agl_core.files.recording import read_recording
from agl_core.hookspecs import hookimpl
from agl_core.testing.lookup import contract_manager
from agl_core.testing.reference import mapping_diff

__all__ = [
    "REFERENCE_BACKEND",
    "STEP_METRICS",
    "BackendContract",
    "ContractRun",
    "ContractRuns",
    "FailingPlugin",
    "ServedProbe",
    "recorded_tiny_task",
]

REFERENCE_BACKEND = "torch"

STEP_METRICS = (
    # the step loop's
    "training/global_step",
    "training/epoch",
    "timing/gen_s",
    "timing/update_s",
    "timing/step_s",
    # the step pipeline's (DESIGN §7 names)
    "training/reward",
    "training/n_sample",
    "training/n_rollouts",
    "training/n_sample_collected",
    "training/n_sample_trained",
    "training/n_sample_dropped/marked",
    "training/n_sample_dropped/same_reward",
    "training/n_sample_dropped/random",
    "training/n_groups",
    "training/n_zero_adv_groups",
    "training/n_skipped_updates",
    "training/n_trace_merge_mismatch_rows",
    # the update's, with verl's names
    "actor/pg_loss",
    "actor/grad_norm",
    "actor/lr",
    "actor/pg_clipfrac",
    "actor/ppo_kl",
    "actor/pg_clipfrac_lower",
)
"""The names every backend reports for every training step (more are allowed)."""

#: the pipeline's counts the rows of a step, equal on every backend that trains the rows it is handed.
ROW_METRICS = (
    "training/n_sample",
    "training/n_sample_collected",
    "training/n_sample_trained",
    "training/n_groups",
    "training/n_zero_adv_groups",
    "training/n_skipped_updates",
)
#: the update's loss terms compared with the reference's where both backends report them.
LOSS_METRICS = ("actor/pg_loss", "actor/entropy_loss", "actor/loss", "actor/pg_clipfrac", "actor/ppo_kl")

_PROBED_PROMPTS = 4


@functools.cache
def recorded_tiny_task() -> tuple[Path, Path]:
    """Three steps of the tiny task recorded with the reference backend (once per process, in a
    temporary folder): the recording's run directory and the policy
    (:func:`agl_core.testing.harness.tiny_policy`)."""
    from agl_core.testing.harness import run_training, tiny_policy

    run = run_training(overrides={"agentlightning.record_rollouts": True}, steps=3)
    return run.run_dir, tiny_policy()


def probe_prompts(recording: Path) -> list[list[int]]:
    """The first call's prompt of one rollout per group of the recording's first step (at most four)."""
    first_step = min(read_recording(recording).steps)
    prompts: dict[str, list[int]] = {}
    for rollout in read_recording(recording).rollouts(first_step):
        if rollout.triplets and rollout.group_id not in prompts:
            prompts[rollout.group_id] = [int(t) for t in rollout.triplets[0].prompt_ids]
    return list(prompts.values())[:_PROBED_PROMPTS]


class ServedProbe:
    """At every weight version, asks the first endpoint for the greedy next token after each prompt
    and its log-prob; appends ``{"version", "n_endpoints", "answers": [[token, log_prob], ...]}`` (or
    ``"error"``) to a JSON-lines file, since the hooks may run in another process."""

    def __init__(self, path: Path, model: str, prompts: Sequence[Sequence[int]], max_records: int = 1000):
        self.path, self.model, self.prompts = str(path), model, [list(p) for p in prompts]
        self.max_records, self.n_records = max_records, 0  # a backend stuck serving one version stops being asked

    @hookimpl
    def agl_on_weights_served(self, endpoints: list[str], version: int) -> None:
        self.n_records += 1
        if self.n_records > self.max_records:
            return
        record: dict[str, Any] = {"version": version, "n_endpoints": len(endpoints)}
        try:
            record["answers"] = [self._ask(endpoints[0], prompt) for prompt in self.prompts]
        except Exception as exc:
            record["error"] = f"{type(exc).__name__}: {exc}"
        with open(self.path, "a", encoding="utf-8") as f:
            f.write(json.dumps(record) + "\n")

    def _ask(self, endpoint: str, prompt: list[int]) -> list[Any]:
        import httpx

        body = {"model": self.model, "prompt": prompt, "max_tokens": 1, "temperature": 0.0, "logprobs": 1}
        response = httpx.post(f"{endpoint.rstrip('/')}/completions", json=body, timeout=300)
        response.raise_for_status()
        logprobs = response.json()["choices"][0]["logprobs"]
        return [logprobs["tokens"][0], float(logprobs["token_logprobs"][0])]


class FailingPlugin:
    """Raises in every lifecycle hook; notes each ``agl_on_startup`` call in a file."""

    def __init__(self, path: Path):
        self.path = str(path)

    @hookimpl
    def agl_on_startup(self) -> None:
        with open(self.path, "a", encoding="utf-8") as f:
            f.write("startup\n")
        raise RuntimeError("agl_on_startup fails on purpose")

    @hookimpl
    def agl_on_weights_served(self) -> None:
        raise RuntimeError("agl_on_weights_served fails on purpose")

    @hookimpl
    def agl_on_enqueue(self) -> None:
        raise RuntimeError("agl_on_enqueue fails on purpose")

    @hookimpl
    def agl_on_succeeded(self) -> None:
        raise RuntimeError("agl_on_succeeded fails on purpose")

    @hookimpl
    def agl_on_failed(self) -> None:
        raise RuntimeError("agl_on_failed fails on purpose")


@attrs.frozen
class ContractRun:
    """One training run: each ``on_step`` call ``(step, total_steps, metrics)`` and what the probe
    saw at each served version; ``error`` is the run's exception (formatted) when it failed."""

    run_dir: Path
    steps: list[tuple[int, int, dict[str, float]]]
    served: list[dict[str, Any]]
    error: str | None = None

    def metrics(self, step: int) -> dict[str, float]:
        for number, _, metrics in self.steps:
            if number == step:
                return metrics
        raise AssertionError(f"the run reported no step {step}; it reported {[s for s, _, _ in self.steps]}")

    def answers(self, version: int) -> list[list[Any]]:
        found = [record for record in self.served if record["version"] == version]
        if not found:
            raise AssertionError(
                f"no agl_on_weights_served call for version {version}; versions served: "
                f"{[r['version'] for r in self.served]}"
            )
        if "error" in found[-1]:
            raise AssertionError(f"the engine serving version {version} could not be asked: {found[-1]['error']}")
        return found[-1]["answers"]

    def check(self) -> ContractRun:
        if self.error is not None:
            raise AssertionError(f"the run failed:\n{self.error}")
        return self


class BackendContract:
    """Base test class: subclass it, set ``backend_name`` (and ``plugins``), and pytest runs the contract.

    What it checks and to which tolerances: :mod:`agl_core.testing.backend_contract`'s docstring."""

    #: the registry name of the backend under test.
    backend_name: ClassVar[str] = ""
    #: plugin objects registered in code beside the built-ins (entry points are never loaded).
    plugins: ClassVar[tuple[Any, ...]] = ()
    #: the plugins' settings, as under ``agentlightning.plugins`` (``{section: {key: value}}``).
    plugin_settings: ClassVar[Mapping[str, Any]] = {}
    #: ``key=value`` config overrides of both the backend's runs and the reference's.
    overrides: ClassVar[Sequence[str]] = ()
    #: ``key=value`` overrides of the backend's runs only (keys of its own schema).
    backend_overrides: ClassVar[Sequence[str]] = ()
    #: steps replayed (the recording must hold them).
    steps: ClassVar[int] = 3
    #: relative and absolute tolerances of the compared metrics (fp32: a backend that adds up the
    #: same terms in another order, or over data-parallel ranks, lands within them).
    metric_rtol: ClassVar[float] = 1e-4
    metric_atol: ClassVar[float] = 1e-6
    #: absolute tolerance of the served log-probs compared after each step.
    served_atol: ClassVar[float] = 1e-4
    #: the longest one run may take.
    run_timeout_seconds: ClassVar[float] = 900.0
    #: the longest one run may go without progress (a step reported, or a weight version served for the
    #: first time): a backend that stops advancing fails within it, not after the whole run's bound.
    stall_timeout_seconds: ClassVar[float] = 60.0

    def recorded(self, folder: Path) -> tuple[Path, Path]:
        """The recording to replay and the policy folder it was recorded with (the tokenizer must
        match the recording's fingerprint); ``folder`` is free to build them in. Default:
        :func:`~agl_core.testing.backend_contract.recorded_tiny_task`."""
        return recorded_tiny_task()

    # -- the runs ---------------------------------------------------------------------------------

    @pytest.fixture(scope="class")
    @classmethod
    def runs(cls, tmp_path_factory: pytest.TempPathFactory) -> ContractRuns:
        if not cls.backend_name:
            raise UsageTypeError(f"{cls.__name__} must set backend_name to the name of the backend under test")
        return ContractRuns(cls(), tmp_path_factory.mktemp(f"contract-{cls.backend_name}"))

    # -- the checks -------------------------------------------------------------------------------

    def test_reports_every_step_with_the_shared_metric_names(self, runs: ContractRuns) -> None:
        run = runs.straight.check()
        reported = [(step, total) for step, total, _ in run.steps]
        expected = [(step, self.steps) for step in range(1, self.steps + 1)]
        assert reported == expected, f"on_step saw (step, total_steps) {reported}, expected {expected}"
        for step, _, metrics in run.steps:
            missing = [name for name in STEP_METRICS if name not in metrics]
            assert not missing, f"step {step} lacks the metrics {missing} (every backend reports STEP_METRICS)"
            assert metrics["training/global_step"] == step, f"step {step} reports training/global_step " + str(
                metrics["training/global_step"]
            )
            bad = {k: v for k, v in metrics.items() if not isinstance(v, (int, float)) or isinstance(v, bool)}
            assert not bad, f"step {step}: metric values must be numbers: {bad}"

    def test_trains_the_rows_it_is_handed(self, runs: ContractRuns) -> None:
        run, reference = runs.straight.check(), runs.reference.check()
        for step in range(1, self.steps + 1):
            got, want = run.metrics(step), reference.metrics(step)
            diff = mapping_diff(got, want, rtol=0.0, atol=0.0, keys=ROW_METRICS)
            assert diff is None, f"step {step}: the step pipeline's counts differ from the reference's:\n{diff}"
            diff = self._metric_diff(got, want, ("actor/grad_norm",))
            assert diff is None, (
                f"step {step}: the gradient differs from the reference's on the same rows (a row left out, "
                f"trained twice or weighted otherwise moves it):\n{diff}"
            )

    def test_update_equals_the_reference(self, runs: ContractRuns) -> None:
        run, reference = runs.straight.check(), runs.reference.check()
        for step in range(1, self.steps + 1):
            got, want = run.metrics(step), reference.metrics(step)
            shared = [name for name in LOSS_METRICS if name in got and name in want]
            diff = self._metric_diff(got, want, shared)
            assert diff is None, f"step {step}: the loss terms differ from the reference's:\n{diff}"
        for version in range(self.steps + 1):
            diff = self._served_diff(run.answers(version), reference.answers(version))
            assert diff is None, (
                f"after step {version} the served policy differs from the reference's (greedy next token "
                f"and its log-prob after each probed prompt):\n{diff}"
            )

    def test_weight_versions_advance_and_are_what_agents_are_served(self, runs: ContractRuns) -> None:
        run = runs.straight.check()
        versions = [record["version"] for record in run.served]
        assert versions == list(range(self.steps + 1)), (
            f"agl_on_weights_served saw versions {versions}; expected {list(range(self.steps + 1))}: the "
            "starting weights, then one version per step, numbered by the step"
        )
        assert all(record["n_endpoints"] > 0 for record in run.served), "a version was served at no endpoint"
        for step in range(1, self.steps + 1):
            before, after = run.answers(step - 1), run.answers(step)
            if run.metrics(step).get("actor/grad_norm", 0.0) > 0 and self._served_diff(after, before) is None:
                raise AssertionError(
                    f"step {step} updated the weights (grad_norm {run.metrics(step)['actor/grad_norm']:.4g}), "
                    "but the engines serve what they served before it: the new weights were not pushed"
                )

    def test_a_resumed_run_continues_the_same_run(self, runs: ContractRuns) -> None:
        interrupted, resumed, straight = runs.interrupted.check(), runs.resumed.check(), runs.straight.check()
        reported = [step for step, _, _ in resumed.steps]
        assert reported == [3], f"the resumed run reported steps {reported}; it should continue at step 3 only"
        assert [r["version"] for r in resumed.served] == [2, 3], (
            f"the resumed run served versions {[r['version'] for r in resumed.served]}, expected [2, 3]"
        )
        diff = self._served_diff(resumed.answers(2), interrupted.answers(2))
        assert diff is None, f"the resumed run serves other weights than the checkpoint of step 2 holds:\n{diff}"
        names = [name for name in ("actor/grad_norm", *LOSS_METRICS) if name in straight.metrics(3)]
        diff = self._metric_diff(resumed.metrics(3), straight.metrics(3), names)
        assert diff is None, f"step 3 after a resume differs from an uninterrupted run's step 3:\n{diff}"
        diff = self._served_diff(resumed.answers(3), straight.answers(3))
        assert diff is None, f"after a resumed step 3 the served policy differs from an uninterrupted run's:\n{diff}"

    def test_plugin_failures_are_isolated(self, runs: ContractRuns) -> None:
        run, straight = runs.with_failing_plugin.check(), runs.straight.check()
        assert [step for step, _, _ in run.steps] == [1], "a failing plugin stopped the run"
        names = [name for name in (*ROW_METRICS, "actor/grad_norm", *LOSS_METRICS) if name in straight.metrics(1)]
        diff = self._metric_diff(run.metrics(1), straight.metrics(1), names)
        assert diff is None, f"a failing plugin changed step 1:\n{diff}"
        startups = (run.run_dir.parent / "startup.log").read_text().splitlines()
        assert len(startups) == 1, f"agl_on_startup ran {len(startups)} times; a backend calls it once per run"

    # -- comparisons ------------------------------------------------------------------------------

    def _metric_diff(self, got: Mapping[str, float], want: Mapping[str, float], names: Sequence[str]) -> str | None:
        return mapping_diff(got, want, rtol=self.metric_rtol, atol=self.metric_atol, keys=names)

    def _served_diff(self, got: Sequence[Sequence[Any]], want: Sequence[Sequence[Any]]) -> str | None:
        lines = []
        for i, ((token, log_prob), (want_token, want_log_prob)) in enumerate(zip(got, want)):
            if token != want_token or not math.isclose(log_prob, want_log_prob, rel_tol=0, abs_tol=self.served_atol):
                lines.append(
                    f"  prompt {i}: {token!r} at {log_prob:.6f}, reference {want_token!r} at {want_log_prob:.6f}"
                )
        if len(got) != len(want):
            lines.append(f"  {len(got)} answers, reference {len(want)}")
        return "\n".join(lines) or None


class ContractRuns:
    """The runs of one contract class, each made when a test first asks for it (a test of the
    contract itself builds one for a contract instance and a folder)."""

    def __init__(self, contract: BackendContract, folder: Path):
        self.contract, self.folder = contract, folder
        self.recording, self.policy = contract.recorded(folder / "recorded")
        self.prompts = probe_prompts(self.recording)

    @functools.cached_property
    def reference(self) -> ContractRun:
        return _reference_run(self.recording, self.policy, tuple(self.contract.overrides), self.contract.steps)

    @functools.cached_property
    def straight(self) -> ContractRun:
        return self._run("straight", self.contract.steps)

    @functools.cached_property
    def interrupted(self) -> ContractRun:
        return self._run("resumed", 2, save_freq=1, probe_file="served-first.jsonl")

    @functools.cached_property
    def resumed(self) -> ContractRun:
        self.interrupted  # noqa: B018 -- the resumed run continues its checkpoints
        return self._run("resumed", 3, save_freq=1)

    @functools.cached_property
    def with_failing_plugin(self) -> ContractRun:
        failing = FailingPlugin(self.folder / "failing" / "startup.log")
        return self._run("failing", 1, extra_plugins=(failing,))

    def _run(
        self,
        name: str,
        steps: int,
        save_freq: int = -1,
        extra_plugins: Sequence[Any] = (),
        probe_file: str = "served.jsonl",
    ) -> ContractRun:
        contract = self.contract
        return train_replayed(
            contract.backend_name,
            self.recording,
            self.policy,
            self.folder / name,
            steps,
            [*contract.overrides, *contract.backend_overrides],
            plugins=(*contract.plugins, *extra_plugins),
            plugin_settings=contract.plugin_settings,
            save_freq=save_freq,
            probe_file=probe_file,
            timeout=contract.run_timeout_seconds,
            stall_timeout=contract.stall_timeout_seconds,
        )


@functools.cache
def _reference_run(recording: Path, policy: Path, overrides: tuple[str, ...], steps: int) -> ContractRun:
    """The reference backend on the recording, once per process for each recording and overrides."""
    import tempfile

    folder = Path(tempfile.mkdtemp(prefix="agl-contract-reference-"))
    return train_replayed(REFERENCE_BACKEND, recording, policy, folder, steps, list(overrides))


def train_replayed(
    backend_name: str,
    recording: Path,
    policy: Path,
    folder: Path,
    steps: int,
    overrides: Sequence[str],
    plugins: Sequence[Any] = (),
    plugin_settings: Mapping[str, Any] | None = None,
    save_freq: int = -1,
    probe_file: str = "served.jsonl",
    timeout: float = BackendContract.run_timeout_seconds,
    stall_timeout: float = BackendContract.stall_timeout_seconds,
) -> ContractRun:
    """Train backend ``backend_name`` on ``steps`` steps of ``recording`` from ``policy`` in
    ``folder/run``, with a :class:`ServedProbe` writing to ``folder/probe_file``; what it reported
    (an error is kept, not raised). The run is abandoned after ``timeout`` seconds, or after
    ``stall_timeout`` seconds without progress, and stopped at a step reported again: each is its error."""
    run_dir = folder / "run"
    folder.mkdir(parents=True, exist_ok=True)
    recorded = read_recording(recording)
    base, dataset = folder / "recorded_config.yaml", folder / "samples.jsonl"
    OmegaConf.save(OmegaConf.create(recorded.core_config()), base)
    batch_size = int(recorded.core_config().get("data", {}).get("train_batch_size") or 1)
    dataset.write_text("".join(json.dumps({"index": i}) + "\n" for i in range(batch_size)))  # replay reads no sample
    probe = ServedProbe(folder / probe_file, str(policy), probe_prompts(recording), max_records=4 * (steps + 1))
    manager = contract_manager([*plugins, probe], plugin_settings)
    spec = backend_spec(manager.backends.entry(backend_name))
    config = spec.load_config(
        str(base),
        [
            f"agentlightning.backend={backend_name}",
            f"agentlightning.replay={recorded.path}",
            "agentlightning.record_rollouts=false",
            "agentlightning.agl_base_url=null",
            "agentlightning.async_rollout.enabled=false",
            "agentlightning.hooks=null",
            f"actor_rollout_ref.model.path={policy}",
            f"data.train_files={dataset}",
            "data.val_files=null",
            "trainer.val_before_train=false",
            "trainer.test_freq=-1",
            f"trainer.total_training_steps={steps}",
            f"trainer.save_freq={save_freq}",
            "trainer.resume_mode=auto",
            f"trainer.default_local_dir={run_dir}",
            # every trained token moves the gradient, a zero-advantage one too: a row trained that
            # should not be (or left out) shows in actor/grad_norm under any loss
            "actor_rollout_ref.actor.entropy_coeff=0.01",
            *overrides,
        ],
    )
    manager.hook_timeout_seconds = float(config.agentlightning.hook_timeout_seconds)
    manager.configure(config)
    reported: list[tuple[int, int, dict[str, float]]] = []

    def on_step(step: int, total: int, metrics: Mapping[str, float], samples: Any = None) -> None:
        if reported and step <= reported[-1][0]:
            raise AssertionError(
                f"on_step reported step {step} after step {reported[-1][0]}: the step does not advance"
            )
        reported.append((step, total, dict(metrics)))

    errors: list[str] = []

    def fit() -> None:
        try:
            spec.factory(config, manager).fit(on_step)
        except BaseException:
            errors.append(traceback.format_exc())

    served_path = Path(probe.path)

    def served() -> list[dict[str, Any]]:  # the probe may write from another process: read its file
        return [json.loads(line) for line in served_path.read_text().splitlines()] if served_path.is_file() else []

    training = threading.Thread(target=fit, name=f"contract-{backend_name}", daemon=True)
    training.start()
    stalled = _wait_for_progress(
        training, lambda: (len(reported), {r["version"] for r in served()}), timeout, stall_timeout
    )
    records = served()
    if stalled is not None:  # left running in its daemon thread: it cannot be stopped from outside
        versions = collections.Counter(record["version"] for record in records)
        errors.append(
            f"the backend {stalled}: on_step saw steps {[step for step, _, _ in reported]}, agl_on_weights_served "
            f"was called {probe.n_records} times (versions of the first {len(records)}: {dict(versions)}); its step "
            "does not advance, or it hangs"
        )
    return ContractRun(run_dir, reported, records, errors[0] if errors else None)


def _wait_for_progress(thread: threading.Thread, progress: Any, timeout: float, stall_timeout: float) -> str | None:
    """Wait for ``thread`` to end; what went wrong if it did not: no change of ``progress()`` for
    ``stall_timeout`` seconds, or ``timeout`` seconds in all (``None`` when it ended)."""
    start = last_change = time.monotonic()
    seen = progress()
    while thread.is_alive():
        thread.join(min(1.0, stall_timeout))
        now, current = time.monotonic(), progress()
        if current != seen:
            seen, last_change = current, now
        if thread.is_alive() and now - last_change >= stall_timeout:
            return f"made no progress for {stall_timeout:g} s (stall_timeout_seconds)"
        if thread.is_alive() and now - start >= timeout:
            return f"did not finish within {timeout:g} s (run_timeout_seconds)"
    return None
