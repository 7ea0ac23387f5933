"""megacispo.score's bad input (catalog 3, issue #56): the --tokens file and the layout are checked before
any process group exists, each refusal naming the line or the field."""

from __future__ import annotations

import json

import pytest

from megacispo.models.config import model_config
from megacispo.parallel.layout import ParallelConfig
from megacispo.score import read_records, scoring_layout

MODEL = model_config("tiny")


@pytest.mark.parametrize("tokens, message", [
    ([1] * (MODEL.max_position_embeddings + 1),
     f"line 1: {MODEL.max_position_embeddings + 1} tokens, more than the model's context, "
     f"model.max_position_embeddings = {MODEL.max_position_embeddings}; split or shorten it."),
    ([], 'line 1: expected {"tokens": [ids]} with at least one int id.'),
    ([1, True], 'line 1: expected {"tokens": [ids]} with at least one int id.'),
    ([1, -3], "line 1: token id -3 is outside the model's vocabulary"),
    ([1, MODEL.vocab_size], f"line 1: token id {MODEL.vocab_size} is outside the model's vocabulary"),
], ids=["beyond-context", "empty", "bool-id", "negative-id", "id-past-vocab"])
def test_a_bad_sequence_is_refused_naming_its_line(tokens, message, tmp_path):
    path = tmp_path / "tokens.jsonl"
    path.write_text(json.dumps({"tokens": tokens}) + "\n")
    with pytest.raises(ValueError, match="^--tokens .*") as error:
        read_records(path, MODEL)
    assert message in str(error.value)


def test_one_token_and_the_whole_context_are_scored(tmp_path):
    path = tmp_path / "tokens.jsonl"
    path.write_text(json.dumps({"tokens": [3]}) + "\n" + json.dumps({"tokens": [1] * MODEL.max_position_embeddings}))
    assert [len(record["tokens"]) for record in read_records(path, MODEL)] == [1, MODEL.max_position_embeddings]


def test_a_context_parallel_layout_the_world_cannot_split_is_refused():
    with pytest.raises(ValueError, match=r"world size 2 is not divisible by .* context_parallel_size = 1 \* 1 \* 3"):
        scoring_layout(ParallelConfig(context_parallel_size=3), MODEL, world_size=2)
