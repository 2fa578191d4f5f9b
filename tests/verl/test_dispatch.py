"""The row order for verl's actor dispatch: verl cuts the batch into one contiguous share per rank,
then each share into mini-batches; after :func:`dispatch_order` those are the torch backend's
mini-batches (contiguous rows of the batch), balanced within each mini-batch or not."""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.verl

pytest.importorskip("verl")

from agl_backend_verl.dispatch import dispatch_order, mini_batch_major_order  # noqa: E402


def verls_mini_batches(order, n_mini, dp_size):
    """The original rows verl trains in each mini-batch, all ranks together, given the rows in ``order``."""
    share = len(order) // dp_size
    part = share // n_mini
    return [sorted(order[r * share + i * part + j] for r in range(dp_size) for j in range(part)) for i in range(n_mini)]


@pytest.mark.parametrize("n_rows,n_mini,dp_size", [(32, 2, 2), (24, 3, 4), (8, 1, 2), (12, 4, 1), (48, 2, 8)])
@pytest.mark.parametrize("balance", [False, True])
def test_verl_trains_the_torch_backends_mini_batches(n_rows, n_mini, dp_size, balance):
    seqlens = [(7 * i) % 13 + 1 for i in range(n_rows)]
    order, metrics = dispatch_order(seqlens, n_mini, dp_size, balance)
    assert sorted(order) == list(range(n_rows))
    per_mini = n_rows // n_mini
    assert verls_mini_batches(order, n_mini, dp_size) == [
        list(range(i * per_mini, (i + 1) * per_mini)) for i in range(n_mini)
    ]
    assert ("global_seqlen/balanced_max" in metrics) == balance


def test_two_ranks_two_mini_batches():
    """Contiguous shares alone would train rows 0-7 and 16-23 first; the order sends rows 0-7 and 8-15."""
    order = mini_batch_major_order(32, 2, 2)
    assert order[:16] == [*range(8), *range(16, 24)] and order[16:] == [*range(8, 16), *range(24, 32)]
    assert verls_mini_batches(list(range(32)), 2, 2)[0] == [*range(8), *range(16, 24)]


def test_balancing_evens_the_ranks_tokens_within_each_mini_batch():
    seqlens = [100, 100, 100, 100, 1, 1, 1, 1] * 2  # unbalanced: rank 0 would get all long rows of a mini-batch
    unbalanced, _ = dispatch_order(seqlens, 2, 2, balance=False)
    balanced, metrics = dispatch_order(seqlens, 2, 2, balance=True)
    tokens = [
        [sum(seqlens[i] for i in order[r * 8 : (r + 1) * 8]) for r in range(2)] for order in (unbalanced, balanced)
    ]
    assert tokens[0] == [800, 8]  # each mini-batch's first half holds its long rows
    assert tokens[1] == [404, 404] and metrics["global_seqlen/balanced_max"] == 404


def test_a_batch_that_does_not_split_evenly_is_refused():
    with pytest.raises(ValueError, match="ppo_mini_batch_size"):
        dispatch_order([1] * 12, 2, 4, balance=True)
