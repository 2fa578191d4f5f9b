"""The row order that makes verl's actor dispatch train the torch backend's mini-batches.

verl's worker dispatch hands data-parallel rank ``r`` the ``r``-th contiguous share of the batch
(``DataProto.chunk``) and each rank cuts its share into mini-batches, so with several ranks verl's
mini-batch ``i`` would be the ``i``-th slice of every share, not rows ``i × per_mini`` onwards as on
the torch backend (with 2 ranks and 2 mini-batches of 16 rows: rows 0–7 and 16–23 instead of
0–15). :func:`mini_batch_major_order` puts the ``r``-th part of every mini-batch, in turn, into
rank ``r``'s share, so every optimizer step sees the torch backend's rows.

verl's own ``trainer.balance_batch`` partitions the whole batch across ranks by token count, which
moves rows between mini-batches; :func:`dispatch_order` balances within each mini-batch instead
(verl's equal-size partitioning of the mini-batch's rows into one part per rank), so a mini-batch
keeps its rows and only which rank trains which of them changes. The ``global_seqlen/*`` metrics
are verl's, over the ranks' shares.
"""

from __future__ import annotations

from collections.abc import Sequence

from agl_core import UsageError

__all__ = ["dispatch_order", "mini_batch_major_order"]


def _check(n_rows: int, n_mini: int, dp_size: int) -> int:
    """Rows per mini-batch, once the batch splits into ``n_mini`` mini-batches of ``dp_size`` equal parts."""
    if n_mini <= 0 or dp_size <= 0 or n_rows % n_mini or (n_rows // n_mini) % dp_size:
        raise UsageError(
            f"{n_rows} rows cannot be cut into {n_mini} mini-batches of {dp_size} equal per-rank parts "
            "(actor_rollout_ref.actor.ppo_mini_batch_size × rollout.n must be a multiple of the actor's "
            "data-parallel size)"
        )
    return n_rows // n_mini


def mini_batch_major_order(n_rows: int, n_mini: int, dp_size: int) -> list[int]:
    """The row order after which verl's dispatch trains mini-batch ``i`` = rows ``i × per_mini`` to
    ``(i + 1) × per_mini``: rank ``r``'s share holds the ``r``-th part of each mini-batch in turn."""
    per_mini = _check(n_rows, n_mini, dp_size)
    part = per_mini // dp_size
    return [i * per_mini + r * part + j for r in range(dp_size) for i in range(n_mini) for j in range(part)]


def dispatch_order(
    seqlens: Sequence[int], n_mini: int, dp_size: int, balance: bool
) -> tuple[list[int], dict[str, float]]:
    """The order to put the batch's rows in before verl's workers see it, and verl's balance metrics.

    ``seqlens`` are the rows' token counts (attention mask sums). With ``balance``, each mini-batch's
    rows are first grouped into ``dp_size`` parts of equal size and similar workload (verl's
    ``get_seqlen_balanced_partitions``), then :func:`mini_batch_major_order` sends part ``r`` to rank ``r``.
    """
    import torch
    from verl.utils.seqlen_balancing import calculate_workload, get_seqlen_balanced_partitions, log_seqlen_unbalance

    n_rows = len(seqlens)
    per_mini = _check(n_rows, n_mini, dp_size)
    within = list(range(n_rows))
    if balance and dp_size > 1:
        workload = calculate_workload(torch.as_tensor(list(seqlens))).tolist()
        within = []
        for i in range(n_mini):
            start = i * per_mini
            parts = get_seqlen_balanced_partitions(
                workload[start : start + per_mini], k_partitions=dp_size, equal_size=True
            )
            within.extend(start + j for part in parts for j in sorted(part))
    order = [within[k] for k in mini_batch_major_order(n_rows, n_mini, dp_size)]
    share = n_rows // dp_size
    shares = [order[r * share : (r + 1) * share] for r in range(dp_size)]
    metrics = (
        log_seqlen_unbalance(seqlen_list=list(seqlens), partitions=shares, prefix="global_seqlen") if balance else {}
    )
    return order, metrics
