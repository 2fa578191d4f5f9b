"""What agl keeps in verl's TransferQueue, the V1 trainer's data plane, and under which keys.

verl's V1 trainer tracks each prompt group by its ``uid`` (a tag-only key: ``status`` pending →
running → finished) and stores what the group produced under keys ``{uid}_...``, which its replay
buffer hands the trainer once the group is finished. agl uses both levels as they are:

- **rollout records** (:func:`put_group`): each finished rollout of group ``uid`` under
  ``{uid}_{k}`` (``k``: its place in the group), field :data:`ROLLOUT_FIELD` holding the rollout as
  plain data (:meth:`agl_core.CompletedRollout.to_dict`; ``None`` for a rollout the failed-rollout
  policy skipped, so a group is never empty), tags with the weight versions that served it
  (``min_global_steps`` / ``max_global_steps``, verl's staleness tags). TransferQueue's checkpoint
  keeps them, so an async run resumed from verl's checkpoint finds its finished groups again.
- **training rows** (:func:`put_rows`): the rows agl's pipeline kept, one key each
  (``{uid}_{k}_{i}``, verl's own ``{uid}_{session}_{index}`` layout), in the fields verl's agent
  loop writes (``prompts``, ``responses``, ``response_mask``, ``loss_mask``, ``input_ids``,
  ``position_ids``, ``rollout_log_probs``, ``rm_scores``, ``uid``) plus agl's ``advantages`` and
  ``returns``: verl's own ``_compute_old_log_prob``, ``_compute_ref_log_prob``,
  ``_compute_values``, ``_update_critic`` and ``_update_actor`` read and write them there, and the
  workers fetch their shares from TransferQueue directly.

  Vision-language rows go as verl's agent loop writes them: ``position_ids`` ``[4, length]`` per row
  (text positions, then mrope's), and ``multi_modal_inputs`` (the row's ``pixel_values`` and
  ``image_grid_thw``, ``{}`` for a text row), which verl's engine concatenates in row order.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np
import torch
import transfer_queue as tq
from tensordict import TensorDict
from transfer_queue import KVBatchMeta
from verl.utils import tensordict_utils as tu

from agl_core import CompletedRollout, FinishedGroup, PaddedBatch

__all__ = [
    "ROLLOUT_FIELD",
    "partition",
    "put_group",
    "put_rows",
    "read_rollouts",
    "rollout_key",
    "served_versions",
    "training_rows",
]

ROLLOUT_FIELD = "agl_rollout"


def partition(is_train: bool) -> str:
    """verl's partition of a training or validation group."""
    return "train" if is_train else "val"


def rollout_key(uid: str, index: int) -> str:
    return f"{uid}_{index}"


def served_versions(rollout: CompletedRollout | None, default: int) -> tuple[int, int]:
    """The oldest and newest weight version that served ``rollout``'s model calls (``default`` when
    none recorded one)."""
    versions = [] if rollout is None else [t.metadata.get("model_version") for t in rollout.triplets]
    known = [v for v in versions if type(v) is int]
    return (min(known), max(known)) if known else (default, default)


def put_group(group: FinishedGroup) -> None:
    """Store ``group``'s rollouts (skipped ones as ``None``) and mark its prompt finished."""
    records: list[CompletedRollout | None] = [*group.rollouts, *[None] * (group.size - len(group.rollouts))]
    keys = [rollout_key(group.group_id, k) for k in range(len(records))]
    tags = []
    for record in records:
        low, high = served_versions(record, group.step)
        tags.append(
            {"status": "success", "global_steps": group.step, "min_global_steps": low, "max_global_steps": high}
        )
    fields = tu.get_tensordict({ROLLOUT_FIELD: np.array([_plain(r) for r in records], dtype=object)})
    where = partition(group.is_train)
    tq.kv_batch_put(keys=keys, partition_id=where, fields=fields, tags=tags)
    tq.kv_put(key=group.group_id, partition_id=where, tag={"status": "finished"})


def _plain(rollout: CompletedRollout | None) -> dict[str, Any] | None:
    return None if rollout is None else rollout.to_dict()


def read_rollouts(batch: KVBatchMeta) -> tuple[list[CompletedRollout], dict[str, str]]:
    """The rollouts stored under ``batch``'s record keys (skipped ones left out), and each one's key."""
    if not batch.keys:
        return [], {}
    data = tq.kv_batch_get(keys=batch.keys, partition_id=batch.partition_id, select_fields=[ROLLOUT_FIELD])
    rollouts, keys = [], {}
    for key, record in zip(batch.keys, list(data[ROLLOUT_FIELD])):
        if record is None:
            continue
        rollout = CompletedRollout.from_dict(_from_storage(record))
        rollouts.append(rollout)
        keys[rollout.rollout_id] = key
    return rollouts, keys


def _from_storage(record: Any) -> dict[str, Any]:
    """A stored record as :meth:`CompletedRollout.from_dict` takes it (TransferQueue may hand back
    tensordict's own containers)."""
    record = dict(record)
    record["triplets"] = [dict(t) for t in record["triplets"]]
    return record


def training_rows(
    padded: PaddedBatch, order: Sequence[int], advantages: torch.Tensor, returns: torch.Tensor
) -> TensorDict:
    """``padded``'s rows (verl's padded layout: prompts left-padded, responses right-padded) in
    ``order``, unpadded, in the fields verl's agent loop writes to TransferQueue, with their per-token
    ``advantages`` and ``returns``: what verl's workers read for a row."""
    t = padded.tensors
    width = t["prompts"].shape[1]
    mask = t["attention_mask"].bool()
    prompt_lens = mask[:, :width].sum(dim=1).tolist()
    response_lens = mask[:, width:].sum(dim=1).tolist()
    mrope = t["position_ids"].ndim == 3  # [rows, 4, L]: a vision-language batch
    names = ["prompts", "responses", "response_mask", "loss_mask", "input_ids", "position_ids", "rm_scores"]
    names += ["advantages", "returns", *(["rollout_log_probs"] if "rollout_log_probs" in t else [])]
    fields: dict[str, list[torch.Tensor]] = {name: [] for name in names}
    for i in order:
        p, r = prompt_lens[i], response_lens[i]
        prompt, response = t["prompts"][i, width - p :], t["responses"][i, :r]
        row = {
            "prompts": prompt,
            "responses": response,
            "response_mask": t["response_mask"][i, :r],
            "loss_mask": t["response_mask"][i, :r],
            "input_ids": torch.cat([prompt, response]),
            "position_ids": t["position_ids"][i, :, width - p : width + r]
            if mrope
            else torch.arange(p + r, dtype=torch.int64),
            "rm_scores": t["token_level_scores"][i, :r].float(),
            "advantages": advantages[i, :r].float(),
            "returns": returns[i, :r].float(),
        }
        if "rollout_log_probs" in t:
            row["rollout_log_probs"] = t["rollout_log_probs"][i, :r].float()
        for name in names:
            fields[name].append(row[name])
    data = {name: torch.nested.as_nested_tensor(values, layout=torch.jagged) for name, values in fields.items()}
    rows = TensorDict(data, batch_size=len(order))
    uids = np.array([str(padded.non_tensors["group_ids"][i]) for i in order], dtype=object)
    rows["uid"] = tu.get_tensordict({"uid": uids})["uid"]
    images = padded.non_tensors.get("multi_modal_inputs")
    if images is not None:
        per_row = np.empty(len(order), dtype=object)
        per_row[:] = [images[i] for i in order]
        rows["multi_modal_inputs"] = tu.get_tensordict({"multi_modal_inputs": per_row})["multi_modal_inputs"]
    return rows


def put_rows(rows: TensorDict, keys: Sequence[str]) -> KVBatchMeta:
    """Store :func:`training_rows` under ``keys`` in the training partition; the batch to hand verl's
    trainer methods (verl's dispatch cuts it into contiguous shares in this order)."""
    tags = [{"status": "success", "seq_len": int(n)} for n in rows["input_ids"].offsets().diff().tolist()]
    tq.kv_batch_put(keys=list(keys), partition_id=partition(True), fields=rows, tags=tags)
    return KVBatchMeta(keys=list(keys), tags=tags, partition_id=partition(True))


def clear(partition_id: str, keys: Iterable[str]) -> None:
    """Drop ``keys`` (records, rows, prompts) from ``partition_id``."""
    keys = list(keys)
    if keys:
        tq.kv_clear(keys=keys, partition_id=partition_id)
