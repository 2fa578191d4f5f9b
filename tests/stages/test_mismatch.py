"""Break classification: hand-built breaks of each kind, and the real ones in the recorded traces."""

import pytest
import transformers

from agl_core.builtins.aggregators import trajectory, transition
from agl_core.data import CompletedRollout, Triplet
from agl_core.stages.aggregation import AggregationSettings
from agl_core.stages.mismatch import classify_break
from agl_core.testing.strategies import TOY_TOKENIZER

TOY = TOY_TOKENIZER
ENC = TOY.encode
A, B = TOY.ids["a"], TOY.ids["b"]
# The model wrote "ab" as two tokens; the tokenizer writes it as one.
PREVIOUS = Triplet(prompt_ids=ENC("cd:"), response_ids=[A, B])


def rollout_of(calls, name="r"):
    return CompletedRollout(rollout_id=name, group_id="g", state="succeeded", triplets=calls, final_reward=1.0)


@pytest.mark.parametrize(
    ("next_prompt", "kind"),
    [
        (ENC("cd:ab") + ENC("\n::"), "retokenization"),  # same text, canonical ids
        (ENC("cd:") + ENC("<h>ba</h>") + ENC("\n"), "template"),  # the turn was re-rendered
        (ENC("cd:b") + ENC("\n"), "template"),  # part of the response stripped
        (ENC("ef:ab"), "other"),  # the history changed
        (ENC("cd"), "other"),  # the history was cut
    ],
)
def test_each_kind_of_break_is_told_apart(next_prompt, kind):
    assert classify_break(PREVIOUS, Triplet(prompt_ids=next_prompt, response_ids=[]).prompt_ids, TOY) == kind


def test_without_a_tokenizer_every_break_is_other():
    assert classify_break(PREVIOUS, Triplet(prompt_ids=ENC("cd:ab"), response_ids=[]).prompt_ids, None) == "other"


def test_counts_cover_every_break_and_the_sample_is_bounded():
    calls = [
        PREVIOUS,
        Triplet(prompt_ids=ENC("cd:ab::"), response_ids=[A]),
        Triplet(prompt_ids=ENC("gh"), response_ids=[B]),
    ]
    settings = AggregationSettings(
        max_prompt_length=50, max_response_length=50, tokenizer=TOY, mismatch_sample_size=1, mismatch_max_length=3
    )
    result = trajectory([rollout_of(calls)], settings)

    assert result.metrics["training/n_trace_merge_mismatch_rows"] == 2
    assert result.metrics["training/trace_merge_mismatch/retokenization"] == 1
    assert result.metrics["training/trace_merge_mismatch/other"] == 1
    (sample,) = result.mismatches
    assert (sample.kind, sample.turn_index, sample.common_prefix_length) == ("retokenization", 1, 2)
    assert sample.context_ids == (A, B) and sample.prompt_ids == (TOY.ids["ab"], TOY.ids["::"])
    # The texts start a little before the first difference (here the whole context) and are cut.
    assert (sample.text_offset, sample.context_text, sample.prompt_text) == (0, "cd:", "cd:")


def test_no_sample_is_kept_when_the_sample_size_is_zero():
    calls = [PREVIOUS, Triplet(prompt_ids=ENC("gh"), response_ids=[B])]
    settings = AggregationSettings(max_prompt_length=50, max_response_length=50, mismatch_sample_size=0)
    result = trajectory([rollout_of(calls)], settings)
    assert result.mismatches == () and result.metrics["training/n_trace_merge_mismatch_rows"] == 1


# -- the recorded gateway traces, with the tokenizer that produced them ---------------------------


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir):
    return transformers.AutoTokenizer.from_pretrained(tiny_model_dir)


def recorded_rollout(gateway_traces, scenario):
    """The scenario's triplet-format model calls as a rollout (calls without response ids skipped)."""
    calls = [
        Triplet(
            prompt_ids=e["data"]["prompt_token_ids"],
            response_ids=e["data"]["response_token_ids"],
            response_log_probs=e["data"]["response_log_probs"],
        )
        for e in gateway_traces[scenario]["events_triplet"]
        if e["event_type"] == "model_request" and e["data"]["response_token_ids"]
    ]
    return rollout_of(calls, scenario)


def settings_with(tokenizer):
    return AggregationSettings(max_prompt_length=2048, max_response_length=8192, tokenizer=tokenizer)


def test_the_recorded_retokenization_mismatches_are_classified(gateway_traces, tokenizer):
    result = trajectory([recorded_rollout(gateway_traces, "multiturn_4")], settings_with(tokenizer))
    assert len(result.rows) == 4
    assert [m.kind for m in result.mismatches] == ["retokenization"] * 3
    assert result.metrics["training/trace_merge_mismatch/retokenization"] == 3
    # The previous context's text ends where the new prompt's text goes on with the observation.
    for m in result.mismatches:
        assert m.prompt_text.startswith(m.context_text)
        assert m.prompt_text[len(m.context_text) :].startswith("<|im_end|>")


def test_the_recorded_history_rewrite_is_not_retokenization(gateway_traces, tokenizer):
    result = trajectory([recorded_rollout(gateway_traces, "multiturn_3_history_rewrite")], settings_with(tokenizer))
    assert [(m.turn_index, m.kind) for m in result.mismatches] == [
        (1, "retokenization"),
        (2, "other"),
        (3, "retokenization"),
    ]


def test_the_recorded_prefix_stable_agent_merges_into_one_row(gateway_traces, tokenizer):
    rollout = recorded_rollout(gateway_traces, "tito_multiturn_prefix_stable")
    result = trajectory([rollout], settings_with(tokenizer))
    (row,) = result.rows
    last = rollout.triplets[-1]
    assert row.prompt_ids.tolist() + row.response_ids.tolist() == last.prompt_ids.tolist() + last.response_ids.tolist()
    assert row.n_trained_tokens == sum(len(t.response_ids) for t in rollout.triplets)
    assert row.log_probs is not None and result.mismatches == ()
    assert len(transition([rollout], settings_with(tokenizer)).rows) == len(rollout.triplets)


def test_the_recorded_validation_call_without_log_probs_gives_a_row_without_them(gateway_traces):
    result = trajectory([recorded_rollout(gateway_traces, "validation_mode")], settings_with(None))
    (row,) = result.rows
    assert row.log_probs is None and row.n_trained_tokens == 6
