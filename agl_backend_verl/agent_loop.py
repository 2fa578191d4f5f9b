"""agl's rollout source in verl's agent-loop-manager slot (``rollout.agent.agent_loop_manager_class``).

verl's V1 trainer asks its agent-loop manager for one thing: a non-blocking ``generate_sequences``
whose outputs land in TransferQueue, each prompt group's ``uid`` tag turning ``finished`` once it
is done; its replay buffer then hands finished groups to the trainer, carries the others over and
applies the staleness bound. :class:`RolloutLoopManager` fills that slot with agl's rollouts: the
prompts become rollout groups of the run's source (the Agent Lightning gateway, the embedded
agents, or a recording), under verl's uids, and each finished group is stored as rollout records
(:mod:`agl_backend_verl.transfer`).

One thread (:meth:`RolloutLoopManager.run`) owns the source's polling: it starts what was
submitted and stores what finished. The trainer's own calls on the source (pause and drain before
a weight update, registering the new endpoints after it) take the same lock, so the source is
never used by two threads at once; between the two, a source whose poll runs the agents itself
(the embedded agents, a recording) is not polled, so no agent calls a replica whose weights are
being replaced. A failure in that thread is kept and raised by the trainer's next call, never lost.
"""

from __future__ import annotations

import logging
import threading
from collections import deque
from collections.abc import Mapping, Sequence
from typing import Any

from tensordict import TensorDict

from agl_backend_verl.dataset import INPUT_KEY
from agl_backend_verl.transfer import partition, put_group
from agl_core import AglError, GroupStream, RolloutSource, group_stream

__all__ = ["RolloutLoopError", "RolloutLoopManager"]

logger = logging.getLogger(__name__)


class RolloutLoopError(AglError, RuntimeError):
    """The thread that runs the rollouts and stores them in TransferQueue stopped; the message says
    on what (the gateway, a TransferQueue storage unit that no longer answers...)."""

    hint = (
        "a TransferQueue storage unit on a lost node never answers again (keep the units on nodes that stay, "
        "transfer_queue.backend.SimpleStorage.required_node_resource); run agl train again once the cause is "
        "fixed: trainer.resume_mode=auto continues from the last checkpoint"
    )


class RolloutLoopManager:
    """verl's agent-loop manager backed by an agl :class:`~agl_core.RolloutSource`.

    ``n`` is ``actor_rollout_ref.rollout.n`` (rollouts per training group). Start the polling thread
    with :meth:`start`, stop it with :meth:`close` (which closes the source)."""

    def __init__(self, source: RolloutSource, n: int):
        self.source = source
        self.stream: GroupStream = group_stream(source, n)
        self.stream_n = n
        self.lock = threading.Lock()
        self._submitted: deque[tuple[list[Mapping[str, Any]], int, bool, list[str]]] = deque()
        self._wake = threading.Event()
        self._stopped = threading.Event()
        self._paused = False  # between before_weight_update and after_weight_update
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self.run, name="agl-rollout-loop", daemon=True)

    # -- verl's agent-loop manager interface ------------------------------------------------------

    @classmethod
    def create(cls, *, source: RolloutSource, n: int, **verl_kwargs: Any) -> RolloutLoopManager:
        """Build and start the manager. verl's task runner passes ``config``, ``llm_client``,
        ``teacher_client`` and ``reward_loop_worker_handles``: agl's agents reach the replicas
        through the gateway, and rewards come from the agents, so none of them is used."""
        manager = cls(source, n)
        manager.start()
        return manager

    def generate_sequences(self, prompts: TensorDict) -> None:
        """Hand ``prompts`` (verl's dataset batch: ``uid``, the rows under ``raw_prompt``,
        ``global_steps`` and, for validation, ``validate``) to the polling thread; returns at once."""
        self.raise_failure()
        uids = [str(uid) for uid in prompts["uid"]]
        samples = [dict(sample) for sample in prompts[INPUT_KEY]]
        step = int(_scalar(prompts.get("global_steps", 0)))
        is_train = not bool(_scalar(prompts.get("validate", False)))
        self._submitted.append((samples, step, is_train, uids))
        self._wake.set()

    # -- the polling thread -----------------------------------------------------------------------

    def start(self) -> None:
        self._thread.start()

    def run(self) -> None:
        """Start what was submitted, store what finished; wait the source's poll interval when idle."""
        try:
            while not self._stopped.is_set():
                with self.lock:
                    while self._submitted:
                        samples, step, is_train, uids = self._submitted.popleft()
                        self.stream.submit(samples, step=step, is_train=is_train, group_ids=uids)
                        _mark_running(uids, is_train)
                    held = self._paused and self.stream.runs_in_poll  # no agent runs while weights change
                    finished = [] if held else self.stream.finished_groups()
                for group in finished:
                    put_group(group)
                if not finished:
                    self._wake.wait(self.stream.poll_interval or 0.5)
                    self._wake.clear()
        except BaseException as exc:  # kept for the trainer's thread, which raises it
            logger.exception("the rollout loop failed")
            self._error = exc

    def raise_failure(self) -> None:
        """Raise what ended the polling thread, if anything did: an agl error as it is, anything else
        as a :class:`RolloutLoopError` naming it."""
        if isinstance(self._error, AglError):
            raise self._error
        if self._error is not None:
            raise RolloutLoopError(
                f"agl's rollout loop stopped: {type(self._error).__name__}: {self._error}"
            ) from self._error

    def pop_counts(self) -> dict[str, float]:
        """The source's counts since the last call (rollouts by state, retries, hook failures...)."""
        with self.lock:
            return self.stream.pop_counts()

    def n_pending(self) -> int:
        """Rollouts submitted and not yet finished (queued here or started by the source)."""
        with self.lock:
            queued = sum(len(samples) for samples, _, _, _ in self._submitted)
            return queued * self.stream_n + self.stream.n_pending()

    def before_weight_update(self) -> dict[str, float]:
        """The source's pause-and-drain (async gateway), with the polling thread held off."""
        self.raise_failure()
        with self.lock:
            self._paused = True
            return self.source.before_weight_update()

    def after_weight_update(self, endpoints: Sequence[str], version: int) -> None:
        """Register ``endpoints`` serving weights ``version`` with the source (and resume it)."""
        self.raise_failure()
        with self.lock:
            self.source.after_weight_update(endpoints, version)
            self._paused = False
        self._wake.set()

    def close(self) -> None:
        self._stopped.set()
        self._wake.set()
        if self._thread.is_alive():
            self._thread.join()
        self.source.close()


def _scalar(value: Any) -> Any:
    """A TensorDict's non-tensor entry as its Python value."""
    return getattr(value, "data", value)


def _mark_running(uids: Sequence[str], is_train: bool) -> None:
    import transfer_queue as tq

    tq.kv_batch_put(keys=list(uids), partition_id=partition(is_train), tags=[{"status": "running"}] * len(uids))
