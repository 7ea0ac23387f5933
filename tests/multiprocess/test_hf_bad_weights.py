"""Hugging Face directories that must not load, through every entry point that reads one
(tools/convert_checkpoint.py hf-to-megatron, megacispo.score, megacispo.eval, megacispo.train): each
ends with exit code 2 and one ``error:`` line naming what is wrong, and nothing is written.

- A NaN (or an infinity in one expert's weights) is found as the tensor is read, named with its file;
  at EP = 2 the infinity lies in rank 1's expert and rank 0 prints the same line.
- A Llama config.json is refused by the architecture check before any tensor is read, with the same
  line from the converter and from train (after the field each names).
- An int32 tensor is refused from the headers, with the same line from the converter and from train.
- megacispo.score writes strict JSON: a non-finite log-prob is null, its position listed; input with
  NaN is refused naming the line.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from megacispo.testing.harness import run_distributed, run_entry_point, run_main
from megacispo.testing.hf_models import DAMAGES, write_damaged_copy
from megacispo.testing.tool_modules import load_tool

pytest.importorskip("transformers")
pytest.importorskip("safetensors")

SEQUENCES = [[5, 17, 99, 300, 2, 41, 7], [1, 2, 3]]


@pytest.fixture(scope="module")
def workspace(tmp_path_factory) -> Path:
    """tools/make_tiny_hf.py's chat tokenizer and random model in hf/, its Parquet math prompts, token
    sequences to score, and one damaged copy of hf/ per DAMAGES entry."""
    make_tiny_hf = load_tool("make_tiny_hf")
    root = tmp_path_factory.mktemp("hf_bad_weights")
    make_tiny_hf.build_tokenizer(root / "hf")
    make_tiny_hf.build_model(root / "hf", vocab_size=512)
    make_tiny_hf.write_math_parquet(root / "prompts.parquet", make_tiny_hf.math_problems(4, seed=0))
    (root / "tokens.jsonl").write_text("".join(json.dumps({"tokens": tokens}) + "\n" for tokens in SEQUENCES))
    for damage in DAMAGES:
        write_damaged_copy(root / "hf", root / damage, damage)
    return root


def _entry_point(name: str, argv: list[str]) -> dict:
    """The entry point ``name`` (convert, or a megacispo module) run in this process."""
    if name == "convert":
        return run_main(load_tool("convert_checkpoint").main, argv)
    return run_entry_point(f"megacispo.{name}", argv)


def _rank(name: str, argv: list[str]) -> dict:
    """``_entry_point`` in a harness worker, whose ranks other than 0 exit on bad input at once
    instead of after startup's delay (which lets rank 0 print first under torchrun)."""
    from megacispo import startup

    startup.QUIET_RANK_EXIT_DELAY_S = 0.0
    return _entry_point(name, argv)


def _error_line(result: dict) -> str:
    """The one ``error:`` line of a run that ended on bad input (warnings may precede it)."""
    assert result["code"] == 2, result
    assert "Traceback" not in result["err"], result["err"]
    lines = [line for line in result["err"].splitlines() if line.startswith("error: ")]
    assert len(lines) == 1, result["err"]
    return lines[0]


def _sets(pairs: dict) -> list[str]:
    return [arg for key, value in pairs.items() for arg in ("--set", f"{key}={value}")]


def _eval_argv(root: Path, hf_dir: Path) -> list[str]:
    return ["--load", str(hf_dir), *_sets({
        "data.test_prompts": root / "prompts.parquet", "data.tokenizer": root / "hf", "data.chat_template": "true",
        "data.prompt_key": "prompt", "data.answer_key": "reward_model.ground_truth", "rl.reward": "boxed_math",
        "rollout.max_new_tokens": 2, "train.run_dir": root / f"eval_run_{hf_dir.name}"})]


def _train_argv(root: Path, hf_dir: Path) -> list[str]:
    return ["--load", str(hf_dir), *_sets({
        "data.train_prompts": root / "prompts.parquet", "data.tokenizer": root / "hf", "data.chat_template": "true",
        "data.prompt_key": "prompt", "data.answer_key": "reward_model.ground_truth", "rl.reward": "boxed_math",
        "rollout.prompts_per_step": 2, "rollout.group_size": 2, "rollout.max_new_tokens": 2,
        "rl.updates_per_rollout": 1, "train.steps": 1, "train.micro_batch_size": 2,
        "train.run_dir": root / f"train_run_{hf_dir.name}"})]


def _convert_argv(hf_dir: Path, out: Path) -> list[str]:
    return ["hf-to-megatron", "--hf-dir", str(hf_dir), "--out", str(out), "--no-progress"]


# ---------------------------------------------------------------------------------------------
# Non-finite weights: found as each tensor is read, through every entry point


@pytest.mark.parametrize("damage", ["nan", "inf_expert"])
def test_converter_names_the_non_finite_tensor_and_leaves_nothing(workspace, tmp_path, damage):
    (result,) = run_distributed(_rank, 1, "convert", _convert_argv(workspace / damage, tmp_path / "ckpt"))
    line = _error_line(result)
    assert f"tensor {DAMAGES[damage]} in {workspace / damage / 'model.safetensors'} is not finite" in line, line
    assert list(tmp_path.iterdir()) == []


def test_score_names_the_non_finite_tensor(workspace, tmp_path):
    argv = ["--load", str(workspace / "nan"), "--tokens", str(workspace / "tokens.jsonl"), "--out",
            str(tmp_path / "scored.jsonl")]
    (result,) = run_distributed(_rank, 1, "score", argv)
    assert DAMAGES["nan"] in _error_line(result) and "is not finite" in result["err"]
    assert not (tmp_path / "scored.jsonl").exists()


def test_score_at_ep2_stops_every_rank_when_one_rank_finds_it(workspace, tmp_path):
    """The infinity is in expert 3, which only rank 1 reads at EP = 2: rank 0 prints rank 1's line."""
    argv = ["--load", str(workspace / "inf_expert"), "--tokens", str(workspace / "tokens.jsonl"), "--out",
            str(tmp_path / "scored.jsonl"), "--set", "parallel.expert_model_parallel_size=2"]
    first, second = run_distributed(_rank, 2, "score", argv)
    assert DAMAGES["inf_expert"] in _error_line(first) and "(expert" not in _error_line(first)
    assert second["code"] == 2 and "error:" not in second["err"]
    assert not (tmp_path / "scored.jsonl").exists()


def test_eval_names_the_non_finite_tensor(workspace):
    (result,) = run_distributed(_rank, 1, "eval", _eval_argv(workspace, workspace / "nan"))
    line = _error_line(result)
    assert DAMAGES["nan"] in line and str(workspace / "nan" / "model.safetensors") in line, line


def test_train_names_the_non_finite_tensor_before_any_step(workspace):
    (result,) = run_distributed(_rank, 1, "train", _train_argv(workspace, workspace / "nan"))
    line = _error_line(result)
    assert DAMAGES["nan"] in line and "is not finite" in line, line
    assert not (workspace / "train_run_nan" / "checkpoints").exists()


# ---------------------------------------------------------------------------------------------
# What the headers show: the same line from the converter and from train, before any tensor is read


@pytest.mark.parametrize("damage", ["llama", "int32"])
def test_converter_and_train_refuse_alike_before_reading_a_tensor(workspace, tmp_path, capsys, damage):
    from megacispo.train import main as train_main

    converted = _entry_point("convert", _convert_argv(workspace / damage, tmp_path / "ckpt"))
    with pytest.raises(SystemExit) as exit_info:
        train_main(_train_argv(workspace, workspace / damage))
    assert exit_info.value.code == 2
    (trained,) = capsys.readouterr().err.strip().splitlines()
    converter_line = _error_line(converted)
    assert converter_line.startswith("error: --hf-dir: ") and trained.startswith("error: train.load: "), trained
    assert converter_line.removeprefix("error: --hf-dir: ") == trained.removeprefix("error: train.load: ")
    assert DAMAGES[damage] in trained
    if damage == "llama":
        assert "'llama'" in trained and "LlamaForCausalLM" in trained and "MiniMaxForCausalLM" in trained, trained
    else:
        assert "is I32" in trained, trained
    assert list(tmp_path.iterdir()) == [] and not (workspace / f"train_run_{damage}").exists()


# ---------------------------------------------------------------------------------------------
# megacispo.score writes strict JSON


def _strict_json(line: str):
    def refuse(constant: str):
        raise AssertionError(f"{constant} is not JSON: {line}")

    return json.loads(line, parse_constant=refuse)


def test_score_output_is_strict_json(workspace, tmp_path):
    out = tmp_path / "scored.jsonl"
    argv = ["--load", str(workspace / "hf"), "--tokens", str(workspace / "tokens.jsonl"), "--out", str(out)]
    (result,) = run_distributed(_rank, 1, "score", argv)
    assert result["code"] == 0, result["err"]
    records = [_strict_json(line) for line in out.read_text().splitlines()]
    assert [len(record["logprobs"]) for record in records] == [len(tokens) - 1 for tokens in SEQUENCES]
    assert all(math.isfinite(value) and value <= 0 for record in records for value in record["logprobs"])


def test_a_non_finite_log_prob_is_null_and_listed():
    from megacispo.evaluation.scoring import NONFINITE_KEY, scored_line

    record = _strict_json(scored_line({"tokens": [1, 2, 3, 4, 5], "id": 7}, [-0.5, math.nan, -math.inf, -1.0]))
    assert record == {"tokens": [1, 2, 3, 4, 5], "id": 7, "logprobs": [-0.5, None, None, -1.0], NONFINITE_KEY: [1, 2]}
    assert NONFINITE_KEY not in _strict_json(scored_line({"tokens": [1, 2]}, [-2.0]))


def test_score_refuses_input_that_is_not_strict_json(tmp_path):
    from megacispo.models.config import model_config
    from megacispo.score import read_records

    tokens = tmp_path / "tokens.jsonl"
    tokens.write_text('{"tokens": [1, 2]}\n{"tokens": [3, 4], "weight": NaN}\n')
    with pytest.raises(ValueError, match=rf"--tokens {tokens} line 2: not JSON \(NaN is not JSON"):
        read_records(tokens, model_config("tiny"))
