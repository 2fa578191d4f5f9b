"""What retoken_merge adds over trajectory aggregation, as properties and on a recorded trace."""

import json
from pathlib import Path

import attrs
import transformers
from agl_retoken_merge import REALIGNED_METRIC, retoken_merge
from hypothesis import given, settings

from agl_core import AggregationSettings, CompletedRollout, PluginManager, Triplet
from agl_core.testing.strategies import TOY_TOKENIZER, aggregation_settings, rollout_batches

# agl's built-in trajectory aggregation, looked up by name as a run would.
trajectory = PluginManager(load_entrypoints=False).aggregators.get("trajectory")

# The recorded gateway traces ship in agl's repository (tests/fixtures/gateway_traces/README.md).
TRACES = Path(__file__).resolve().parents[3] / "tests" / "fixtures" / "gateway_traces"


@given(batch=rollout_batches(), agg_settings=aggregation_settings())
@settings(deadline=None)
def test_without_a_tokenizer_it_is_trajectory(batch, agg_settings):
    agg_settings = attrs.evolve(agg_settings, tokenizer=None)
    ours, plain = retoken_merge(batch, agg_settings), trajectory(batch, agg_settings)
    assert ours.rows == plain.rows
    assert ours.metrics == {**plain.metrics, REALIGNED_METRIC: 0.0}


@given(batch=rollout_batches(), agg_settings=aggregation_settings())
@settings(deadline=None)
def test_every_trajectory_break_is_either_realigned_or_still_a_break(batch, agg_settings):
    agg_settings = attrs.evolve(agg_settings, tokenizer=TOY_TOKENIZER)
    ours, plain = retoken_merge(batch, agg_settings), trajectory(batch, agg_settings)
    breaks = "training/n_trace_merge_mismatch_rows"
    assert plain.metrics[breaks] == ours.metrics[breaks] + ours.metrics[REALIGNED_METRIC]
    assert (
        ours.metrics["training/trace_merge_mismatch/retokenization"]
        <= plain.metrics["training/trace_merge_mismatch/retokenization"]
    )
    assert len(ours.rows) <= len(plain.rows)


def test_merges_the_retokenized_history_of_a_recorded_conversation():
    tokenizer = transformers.AutoTokenizer.from_pretrained(TRACES / "tiny_qwen2")
    events = json.loads((TRACES / "traces.json").read_text())["scenarios"]["multiturn_4"]["events_triplet"]
    calls = [
        Triplet(
            prompt_ids=e["data"]["prompt_token_ids"],
            response_ids=e["data"]["response_token_ids"],
            response_log_probs=e["data"]["response_log_probs"],
        )
        for e in events
        if e["event_type"] == "model_request"
    ]
    rollout = CompletedRollout(rollout_id="r", group_id="g", state="succeeded", triplets=calls, final_reward=1.0)
    agg_settings = AggregationSettings(max_prompt_length=2048, max_response_length=8192, tokenizer=tokenizer)

    assert len(trajectory([rollout], agg_settings).rows) == 4
    result = retoken_merge([rollout], agg_settings)

    (row,) = result.rows
    assert result.metrics[REALIGNED_METRIC] == 3
    assert result.metrics["training/n_trace_merge_mismatch_rows"] == 0
    assert row.n_trained_tokens == sum(len(c.response_ids) for c in calls)
    assert tokenizer.decode(list(row.prompt_ids) + list(row.response_ids)) == tokenizer.decode(
        list(calls[-1].prompt_ids) + list(calls[-1].response_ids)
    )
