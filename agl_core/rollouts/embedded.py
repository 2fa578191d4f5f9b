"""The embedded rollout source: agents run in threads of the trainer, recorded as the gateway records them.

It is the default when no gateway URL is configured (``agentlightning.agl_base_url: null``). Each
rollout runs ``agentlightning.local.agent_class`` in a thread pool (:mod:`agl_core.rollouts.agents`)
with the contract's environment: ``AGL_OPENAI_BASE_URL``
(``…/proxy/rollout/{rid}/attempt/{aid}/mode/{train|val}/openai/v1``), ``AGL_EVENT_URL``
(``…/api/rollouts/{rid}/attempt/{aid}/events``), ``AGL_KEY`` and the ``local.env_map`` fields of the
rollout input. Those URLs point at the local recording server of :mod:`agl_core.rollouts.recorder`,
whose proxy uses the mode's temperature — ``actor_rollout_ref.rollout.temperature`` in train mode,
``actor_rollout_ref.rollout.val_kwargs.temperature`` in val mode, 0 being greedy — and, in train
mode, ``actor_rollout_ref.rollout.top_p``, as the gateway does with its
``default_proxy.{train,val}`` sampling settings. The recorded
events are finished by :mod:`agl_core.rollouts.finish` and parsed by :mod:`agl_core.rollouts.events`,
so everything downstream is what the gateway path produces.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import secrets
import threading
import time
from collections import Counter
from collections.abc import Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import wait as wait_futures
from typing import Any

from omegaconf import DictConfig

from agl_core.data import CompletedRollout, RolloutRequest
from agl_core.files.datasets import env_from_map
from agl_core.local_http import LocalHTTPServer
from agl_core.plugins import EventWriter, PluginManager
from agl_core.rollouts.agents import install_thread_environ, load_agent_class, uninstall_thread_environ
from agl_core.rollouts.events import FailedRolloutPolicy, apply_failed_policy, rollout_timing_metrics
from agl_core.rollouts.finish import finish_rollout
from agl_core.rollouts.recorder import Recorder, recorded_event, recorder_handler
from agl_core.rollouts.source import RolloutBatch, RolloutSource, make_requests, rollout_config

__all__ = ["ATTEMPT_ID", "EmbeddedRolloutSource"]

logger = logging.getLogger(__name__)

ATTEMPT_ID = "0"  # each rollout runs once
# How long closing waits for the model calls still in flight (rollouts already given up on) before
# closing the engine's connections under them.
CLOSE_WAIT_SECONDS = 5.0


class EmbeddedRolloutSource(RolloutSource):
    """Runs agents in-process against ``engine_url`` (the inference engine's OpenAI base URL) serving
    ``model_name``."""

    def __init__(self, config: DictConfig, plugins: PluginManager, engine_url: str, model_name: str):
        agl = config.agentlightning
        self.plugins = plugins
        self.agent_class = load_agent_class(agl.local.agent_class)
        self.rollout_config = rollout_config(config)
        self.env_map = dict(agl.local.env_map)
        self.n = int(config.actor_rollout_ref.rollout.n)
        self.reward_fillna_value = float(agl.reward_fillna_value)
        self.failed_rollout_policy: FailedRolloutPolicy = agl.failed_rollout_policy
        self.deadline_seconds = float(agl.rollout_timeout_seconds) + float(agl.rollout_timeout_grace_seconds)
        self.deadline_text = (
            f"no result within {self.deadline_seconds:g} s "
            f"(agentlightning.rollout_timeout_seconds={agl.rollout_timeout_seconds} "
            f"+ agentlightning.rollout_timeout_grace_seconds={agl.rollout_timeout_grace_seconds:g})"
        )
        workers = int(agl.embedded.max_workers)
        self.recorder = Recorder(
            key=agl.agl_key or secrets.token_hex(16),
            upstream=engine_url,
            model_name=model_name,
            temperature={
                "train": float(config.actor_rollout_ref.rollout.temperature),
                "val": float(config.actor_rollout_ref.rollout.val_kwargs.temperature),
            },
            max_connections=workers,
            seed=int(config.trainer.seed),
            top_p=float(config.actor_rollout_ref.rollout.top_p),
            call_timeout_s=float(agl.rollout_timeout_seconds),
        )
        self.server = LocalHTTPServer(("127.0.0.1", 0), recorder_handler(self.recorder))
        self.base_url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self._serve = threading.Thread(target=self.server.serve_forever, name="embedded-gateway", daemon=True)
        self._serve.start()
        self.pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="agl-agent")
        self.environ = install_thread_environ()
        self._closed = False

    def agent_env(self, request: RolloutRequest) -> dict[str, str]:
        """The controller's environment for one rollout."""
        mode = "train" if request.is_train else "val"
        rid = request.rollout_id
        return {
            "AGL_KEY": self.recorder.key,
            "AGL_OPENAI_BASE_URL": f"{self.base_url}/proxy/rollout/{rid}/attempt/{ATTEMPT_ID}/mode/{mode}/openai/v1",
            "AGL_EVENT_URL": f"{self.base_url}/api/rollouts/{rid}/attempt/{ATTEMPT_ID}/events",
            **env_from_map(request.input, self.env_map),
        }

    def _run_agent(self, env: Mapping[str, str]) -> None:
        with self.environ.overlay(env):
            result = self.agent_class().run()
            if inspect.isawaitable(result):
                asyncio.run(result)  # type: ignore[arg-type]

    def _start(
        self, requests: list[RolloutRequest], *, step: int, is_train: bool
    ) -> tuple[dict[str, Future[None]], dict[str, str]]:
        """Open each rollout on the recorder and submit its agent. A rollout whose environment cannot
        be built is not started: its error is returned instead, as a controller's failed spawn."""
        futures: dict[str, Future[None]] = {}
        errors: dict[str, str] = {}
        for index, request in enumerate(requests):
            try:
                env = self.agent_env(request)
            except KeyError as exc:
                errors[request.rollout_id] = f"local subprocess spawn failed: {exc.args[0]}"
                logger.warning("rollout %s not started: %s", request.rollout_id, errors[request.rollout_id])
                continue
            self.recorder.open(request.rollout_id, (step, int(is_train), index))
            futures[request.rollout_id] = self.pool.submit(self._run_agent, env)
        return futures, errors

    def _outcome(
        self, rid: str, future: Future[None], not_done: set[Future[None]], counts: Counter[str]
    ) -> tuple[str, str | None]:
        """The state and error of a started agent; one still running is cancelled and timed out."""
        if future in not_done:
            future.cancel()
            counts["training/rollouts/n_timed_out"] += 1
            return "failed", self.deadline_text
        raised = future.exception()
        if raised is None:
            return "succeeded", None
        return "failed", f"agent raised {type(raised).__name__}: {raised}"

    def collect(self, samples: Sequence[Mapping[str, Any]], *, step: int, is_train: bool) -> RolloutBatch:
        groups = make_requests(
            samples, n=self.n, step=step, is_train=is_train, rollout_config=self.rollout_config, plugins=self.plugins
        )
        requests = [r for group in groups for r in group]
        counts: Counter[str] = Counter()
        queued_at = time.time()
        futures, errors = self._start(requests, step=step, is_train=is_train)
        _, not_done = wait_futures(futures.values(), timeout=self.deadline_seconds)
        rollouts = []
        causes: dict[str, list[str]] = {}  # error -> the rollouts that failed with it
        for request in requests:
            rid = request.rollout_id
            events = self.recorder.close(rid)
            if rid in futures:
                state, error = self._outcome(rid, futures[rid], not_done, counts)
            else:
                state, error = "failed", errors[rid]
            if error is not None:  # grouped by cause: the first line, without the rollout's own id
                causes.setdefault(error.splitlines()[0].replace(rid, "{rollout_id}"), []).append(rid)
            rollout = self._finish(request, events, state, error, queued_at, counts)
            counts[f"training/rollouts/n_{rollout.state}"] += 1
            kept, policy_counts = apply_failed_policy([rollout], self.failed_rollout_policy, self.reward_fillna_value)
            counts.update(policy_counts)
            rollouts.extend(kept)
        with self.recorder.lock:
            counts.update(self.recorder.counts)
            self.recorder.counts.clear()
        self._log_failures(step, len(requests), causes)
        metrics = {k: float(v) for k, v in counts.items()}
        metrics.update(rollout_timing_metrics(rollouts))
        metrics.update(self.plugins.pop_metrics())
        return RolloutBatch(rollouts, metrics)

    def _log_failures(self, step: int, n_rollouts: int, causes: Mapping[str, Sequence[str]]) -> None:
        """One line per cause of this step's failed model calls and rollouts, with their count."""
        for cause, n_calls in self.recorder.pop_failures().items():
            logger.warning("step %d: %d model call(s) got no answer: %s", step, n_calls, cause)
        for cause, rids in causes.items():
            logger.warning(
                "step %d: %d of %d rollouts failed: %s (first: rollout %s)", step, len(rids), n_rollouts, cause, rids[0]
            )

    def _finish(
        self,
        request: RolloutRequest,
        events: list[dict[str, Any]],
        state: str,
        error: str | None,
        queued_at: float,
        counts: Counter[str],
    ) -> CompletedRollout:
        """Finish one rollout; what its hooks write is appended to its recorded events."""

        def store(writer: EventWriter) -> int:
            return writer.flush(
                lambda e: events.append(recorded_event(e.rollout_id, e.attempt_id, e.event_type, e.data))
            )

        return finish_rollout(
            request,
            events,
            state=state,
            error=error,
            queued_at=queued_at,
            attempt_id=ATTEMPT_ID,
            reward_fillna_value=self.reward_fillna_value,
            plugins=self.plugins,
            store=store,
            reread=lambda: events,
            counts=counts,
        )

    def before_weight_update(self) -> dict[str, float]:
        return {}  # collect() returns only once every agent is done: nothing is in flight

    def after_weight_update(self, endpoints: Sequence[str], version: int) -> None:
        """Route later model calls to ``endpoints[0]`` and record them with ``version``."""
        self.recorder.upstream = endpoints[0]
        self.recorder.version = int(version)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self.pool.shutdown(wait=False, cancel_futures=True)
        self.server.shutdown()
        self.recorder.shutdown(CLOSE_WAIT_SECONDS)
        self.server.server_close()
        uninstall_thread_environ()
