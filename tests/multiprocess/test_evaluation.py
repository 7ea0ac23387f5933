"""Held-out evaluation (megacispo.evaluation.evaluator) and its entry point (megacispo.eval).

pass@k against brute-force enumeration of k-subsets; the metrics of a tiny random model's checkpoint
(pass@1 = mean@n, pass@k non-decreasing in k, greedy accuracy as the trainer computed it before
pass@k existed), equal at DP = 1 and at DP = EP = 2 (2 gloo processes) for the same seed, from a
megacispo checkpoint and from a Hugging Face directory; Trainer.fit logging them before and after a
step; and ``python -m megacispo.eval`` end to end: its table and its TensorBoard scalars at the
checkpoint's step, its dry run, and bad input stopping it before a model is built.
"""

from __future__ import annotations

import itertools
import os
import subprocess
import sys
from pathlib import Path

import pytest

from megacispo.eval import main as eval_main
from megacispo.evaluation.config import EvalConfig
from megacispo.evaluation.evaluator import (
    GREEDY_CORRECT,
    GREEDY_LENGTH,
    NUM_COUNTS,
    SAMPLED_CORRECT,
    SAMPLED_LENGTH,
    eval_metrics,
)
from megacispo.evaluation.pass_at_k import pass_at_k, pass_at_k_values
from megacispo.testing.harness import run_distributed
from megacispo.testing.parallel_case import save_random_tiny_checkpoint

REPO = Path(__file__).resolve().parents[2]
NUM_SAMPLES = 4
STEP = 3
# Large random weights (as the layout matrix's start weights): peaked, varied responses.
INIT_STD = 0.3
# A reward the tiny random model earns about half the time, so that every metric has spread.
REWARD = "megacispo.testing.reward_fixtures:code_point_parity"


# ---------------------------------------------------------------------------------------------
# pass@k


def _enumerated_pass_at_k(num_samples: int, num_correct: int, k: int) -> float:
    """The fraction of k-subsets of the samples (the first num_correct correct) that hold a correct one."""
    subsets = list(itertools.combinations(range(num_samples), k))
    return sum(any(sample < num_correct for sample in subset) for subset in subsets) / len(subsets)


def test_pass_at_k_equals_enumeration_of_subsets():
    for n in range(1, 8):
        for c in range(n + 1):
            for k in range(1, n + 1):
                expected = _enumerated_pass_at_k(n, c, k)
                assert pass_at_k(n, c, k) == pytest.approx(expected, rel=1e-12, abs=1e-15), (n, c, k)


def test_pass_at_k_edge_cases():
    assert pass_at_k(10, 0, 3) == 0.0  # no correct sample
    assert pass_at_k(10, 10, 3) == 1.0  # every sample correct
    assert pass_at_k(10, 8, 3) == 1.0  # n - c < k: every 3-subset meets a correct one
    assert pass_at_k(10, 3, 1) == pytest.approx(0.3, rel=1e-12)  # pass@1 = c / n
    # Large n: the product form takes no binomial of 1000 (C(1000, 500) overflows a float).
    assert pass_at_k(1000, 1, 500) == pytest.approx(0.5, rel=1e-12)


@pytest.mark.parametrize("n, c, k", [(4, 5, 1), (4, -1, 1), (4, 2, 0), (4, 2, 5)])
def test_pass_at_k_rejects_impossible_counts(n, c, k):
    with pytest.raises(ValueError, match="num_correct"):
        pass_at_k(n, c, k)


def test_pass_at_k_values_are_powers_of_two_and_n():
    assert pass_at_k_values(1) == [1]
    assert pass_at_k_values(3) == [1, 2, 3]
    assert pass_at_k_values(8) == [1, 2, 4, 8]
    assert pass_at_k_values(12) == [1, 2, 4, 8, 12]


def test_eval_metrics_from_counts():
    """Three prompts of 4 samples with 0, 1 and 4 correct; greedy right on the last two."""
    counts = [[0.0] * NUM_COUNTS for _ in range(3)]
    for row, values in zip(counts, [(0, 5, 0, 8), (1, 3, 1, 12), (1, 4, 4, 16)]):
        row[GREEDY_CORRECT], row[GREEDY_LENGTH], row[SAMPLED_CORRECT], row[SAMPLED_LENGTH] = values
    metrics = eval_metrics(counts, EvalConfig(num_samples=4))
    assert metrics["eval/accuracy"] == pytest.approx(2 / 3)
    assert metrics["eval/greedy_response_length_mean"] == pytest.approx(4.0)
    assert metrics["eval/mean@4"] == pytest.approx(5 / 12)
    assert metrics["eval/pass@1"] == pytest.approx(metrics["eval/mean@4"], rel=1e-12)
    assert metrics["eval/pass@2"] == pytest.approx((0 + 0.5 + 1) / 3)  # one of 4 correct: 1 - C(3,2)/C(4,2)
    assert metrics["eval/pass@4"] == pytest.approx(2 / 3)
    assert metrics["eval/response_length_mean"] == pytest.approx(36 / 12)
    greedy_only = eval_metrics(counts, EvalConfig(num_samples=0))
    assert list(greedy_only) == ["eval/accuracy", "eval/greedy_response_length_mean"]
    assert "eval/accuracy" not in eval_metrics(counts, EvalConfig(greedy=False, num_samples=4))


# ---------------------------------------------------------------------------------------------
# A tiny model's checkpoint


@pytest.fixture(scope="module")
def workspace(tmp_path_factory) -> Path:
    """Addition prompts (7 held out: uneven over 2 ranks), a tokenizer and a tiny random model's checkpoint."""
    root = tmp_path_factory.mktemp("evaluation")
    subprocess.run([sys.executable, "tools/make_task_data.py", "--out", str(root / "task"), "--task", "addition",
                    "--digits", "2", "--num-train", "4", "--num-test", "7", "--seed", "0"],
                   cwd=REPO, check=True, capture_output=True)
    subprocess.run([sys.executable, "tools/train_tokenizer.py", "--input", str(root / "task" / "corpus.txt"),
                    "--vocab-size", "512", "--out", str(root / "tok")], cwd=REPO, check=True, capture_output=True)
    run_distributed(save_random_tiny_checkpoint, 1, str(root / "checkpoints"), STEP, INIT_STD)
    return root


def _overrides(workspace: Path, run_dir: Path) -> list[str]:
    pairs = {
        "data.test_prompts": workspace / "task" / "test.jsonl", "data.tokenizer": workspace / "tok" / "tokenizer.model",
        "rollout.max_new_tokens": 4, "rl.reward": REWARD, "eval.num_samples": NUM_SAMPLES,
        "eval.temperature": 1.0, "train.run_dir": run_dir, "train.load": workspace / "checkpoints",
    }
    return [f"{key}={value}" for key, value in pairs.items()]


def _evaluate(overrides: list[str]) -> dict:
    """megacispo.eval's steps in this world; on DP rank 0 also the greedy accuracy as Trainer.evaluate
    computed it before this module (all prompts in one greedy batch, early truncation as configured);
    ``decoded/samples``: the samples this rank decoded."""
    from megatron.core import parallel_state

    import megacispo.evaluation.evaluator as evaluator
    from megacispo.evaluation.run import evaluate, load_model
    from megacispo.evaluation.source import weights_source
    from megacispo.parallel.layout import init_distributed
    from megacispo.startup import load_rl_prompt_file, load_tokenizer, run_config

    config = run_config(None, overrides, load_field="train.load")
    source = weights_source(config)
    tokenizer = load_tokenizer(config)
    records, _ = load_rl_prompt_file(config, tokenizer, "test_prompts")
    init_distributed(config.parallel, config.train.seed)
    model = load_model(config, source)
    decoded = []
    sample_and_score = evaluator.sample_and_score

    def counting(model, records, *args, **kwargs):
        decoded.append(len(records))
        return sample_and_score(model, records, *args, **kwargs)

    evaluator.sample_and_score = counting
    metrics = evaluate(config, model, tokenizer, records)
    evaluator.sample_and_score = sample_and_score
    metrics["decoded/samples"] = float(sum(decoded))
    if parallel_state.get_data_parallel_world_size(with_context_parallel=True) == 1:
        metrics["legacy/accuracy"] = _legacy_greedy_accuracy(config, model, tokenizer, records)
    parallel_state.destroy_model_parallel()
    return metrics


def _legacy_greedy_accuracy(config, model, tokenizer, records) -> float:
    from megacispo.data.prompts import prompt_token_ids
    from megacispo.data.rewards import get_reward_fn, score_responses
    from megacispo.rollout.episodes import response_text
    from megacispo.rollout.generate import generate, sample_keys

    greedy = type(config.rollout)(**{**vars(config.rollout), "temperature": 0.0})
    samples = generate(model, [prompt_token_ids(tokenizer, r) for r in records], greedy, stop_ids=tokenizer.stop_ids,
                       pad_id=tokenizer.pad_id, keys=sample_keys((0,), range(len(records)), 1, device="cpu"))
    texts = [response_text(tokenizer, samples, row) for row in range(len(records))]
    rewards = score_responses(get_reward_fn(config.rl.reward), texts, records, config.rl.failure_reward).rewards
    return sum(r >= 1.0 for r in rewards) / len(records)


@pytest.fixture(scope="module")
def single_rank_metrics(workspace) -> dict:
    (metrics,) = run_distributed(_evaluate, 1, _overrides(workspace, workspace / "run"))
    return metrics


def test_metrics_are_consistent(single_rank_metrics):
    metrics = single_rank_metrics
    expected = {"eval/accuracy", "eval/greedy_response_length_mean", "eval/pass@1", "eval/pass@2", "eval/pass@4",
                f"eval/mean@{NUM_SAMPLES}", "eval/response_length_mean", "legacy/accuracy", "decoded/samples"}
    assert set(metrics) == expected
    mean = metrics[f"eval/mean@{NUM_SAMPLES}"]
    assert 0 < mean < 1, f"{REWARD} should split a random model's samples"
    assert metrics["eval/pass@1"] == pytest.approx(mean, rel=1e-12)
    assert metrics["eval/pass@1"] <= metrics["eval/pass@2"] <= metrics["eval/pass@4"]
    assert metrics["eval/accuracy"] == metrics["legacy/accuracy"]
    assert 1 <= metrics["eval/response_length_mean"] <= 4 and 1 <= metrics["eval/greedy_response_length_mean"] <= 4


def test_two_data_parallel_ranks_give_the_same_metrics(workspace, single_rank_metrics):
    """7 prompts over 2 ranks, 4 on one and 3 on the other, with the experts split over them (EP = 2:
    the ranks decode in lockstep, the one with fewer samples idling until the other is done)."""
    overrides = _overrides(workspace, workspace / "run") + ["parallel.expert_model_parallel_size=2"]
    results = [_eval_metrics(result) for result in run_distributed(_evaluate, 2, overrides)]
    assert results[0] == results[1]
    assert results[0] == pytest.approx(_eval_metrics(single_rank_metrics), rel=1e-12)


def test_context_parallel_ranks_share_the_prompts(workspace, single_rank_metrics):
    """CP = 2: decoding never splits a sequence, so the two CP ranks of the one model replica take 4 and 3
    of the 7 prompts (not all 7 each) and give the one process's metrics."""
    overrides = _overrides(workspace, workspace / "run") + ["parallel.context_parallel_size=2"]
    results = run_distributed(_evaluate, 2, overrides)
    one_rank = single_rank_metrics["decoded/samples"]
    assert sorted(r["decoded/samples"] for r in results) == [one_rank * 3 / 7, one_rank * 4 / 7]
    for result in results:
        assert _eval_metrics(result) == pytest.approx(_eval_metrics(single_rank_metrics), rel=1e-12)


def _eval_metrics(metrics: dict) -> dict:
    return {key: value for key, value in metrics.items() if key.startswith("eval/")}


def test_a_rank_without_prompts_decodes_in_lockstep(workspace, tmp_path):
    """One test prompt over 2 ranks at EP = 2: the rank without a prompt runs the other's forward passes
    (the experts' all-to-all needs both) and both return the one prompt's metrics."""
    one_prompt = tmp_path / "one.jsonl"
    one_prompt.write_text((workspace / "task" / "test.jsonl").read_text().splitlines()[0] + "\n")
    overrides = _overrides(workspace, tmp_path / "run") + [f"data.test_prompts={one_prompt}",
                                                           "parallel.expert_model_parallel_size=2"]
    first, second = run_distributed(_evaluate, 2, overrides, timeout_s=120)
    assert _eval_metrics(first) == _eval_metrics(second)
    assert first["eval/accuracy"] in (0.0, 1.0) and first["eval/pass@4"] in (0.0, 1.0)


def test_hugging_face_directory_evaluates_alike_in_any_layout(workspace, tmp_path):
    """--load of an HF directory: the model section comes from its config.json and each rank loads its
    piece of the weights; at EP = 2 over 2 ranks (the experts split) the metrics equal DP = 1's."""
    from make_tiny_hf import build_model

    hf_dir = build_model(tmp_path / "hf", vocab_size=512)
    overrides = _overrides(workspace, tmp_path / "run") + [f"train.load={hf_dir}"]
    (single,) = run_distributed(_evaluate, 1, overrides)
    split = run_distributed(_evaluate, 2, overrides + ["parallel.expert_model_parallel_size=2"])
    assert 0 < single[f"eval/mean@{NUM_SAMPLES}"] < 1
    assert _eval_metrics(split[0]) == _eval_metrics(split[1]) == pytest.approx(_eval_metrics(single), rel=1e-12)


def _fit(overrides: list[str]) -> dict[str, float]:
    """megacispo.train's steps in a world of one, the logger enabled: Trainer.fit's accuracies."""
    from megacispo.metrics.logger import MetricsLogger
    from megacispo.parallel.layout import init_distributed
    from megacispo.rl.start import check_start
    from megacispo.rl.trainer import Trainer
    from megacispo.startup import load_rl_prompts, load_tokenizer, run_config
    from megacispo.training.engine import Engine

    config = run_config(None, overrides, load_field="train.load")
    tokenizer = load_tokenizer(config)
    train_records, test_records, prompt_metrics = load_rl_prompts(config, tokenizer)
    start = check_start(config, False, train_records)
    init_distributed(config.parallel, config.train.seed)
    engine = Engine(config, total_steps=config.train.steps, peak_lr=config.optimizer.lr)
    with MetricsLogger(config.train.run_dir, enabled=True, console=False) as logger:
        trainer = Trainer(config, engine, tokenizer, train_records, test_records, logger, prompt_metrics)
        trainer.start(start)
        return trainer.fit()


def test_trainer_logs_every_metric_before_and_after(workspace, single_rank_metrics, tmp_path):
    """One RL step from the checkpoint: the evaluation before it is the checkpoint's (with the prompt
    counts), the one after it has every key too, and fit returns both greedy accuracies."""
    from megacispo.metrics.logger import read_scalars

    overrides = _overrides(workspace, tmp_path) + [
        f"data.train_prompts={workspace / 'task' / 'train.jsonl'}", "rollout.prompts_per_step=2",
        "rollout.group_size=2", "rl.updates_per_rollout=1", "train.micro_batch_size=4", "train.steps=1"]
    (accuracy,) = run_distributed(_fit, 1, overrides)
    scalars = read_scalars(tmp_path)
    expected = {key: value for key, value in single_rank_metrics.items() if key.startswith("eval/")}
    for key, value in expected.items():
        assert [step for step, _ in scalars[key]] == [0, 1], key
        assert scalars[key][0][1] == pytest.approx(value, rel=1e-6), key
    assert [step for step, _ in scalars["data/test_prompts_skipped"]] == [0]
    assert accuracy["before"] == expected["eval/accuracy"]
    assert accuracy["after"] == pytest.approx(scalars["eval/accuracy"][1][1], rel=1e-6)


# ---------------------------------------------------------------------------------------------
# The entry point


def test_entry_point_prints_the_table_and_writes_tensorboard(workspace, single_rank_metrics, tmp_path):
    from megacispo.metrics.logger import read_scalars

    overrides = _overrides(workspace, tmp_path)
    command = [sys.executable, "-m", "megacispo.eval", *[arg for item in overrides for arg in ("--set", item)]]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    finished = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert finished.returncode == 0, finished.stderr[-3000:]
    table = {line.split()[0]: line.split()[1] for line in finished.stdout.splitlines() if line.startswith("eval/")}
    expected = {key: value for key, value in single_rank_metrics.items() if key.startswith("eval/")}
    assert table == {key: f"{value:.4f}" for key, value in expected.items()}
    scalars = read_scalars(tmp_path / "eval")
    assert set(scalars) == set(expected)
    for key, value in expected.items():
        ((step, logged),) = scalars[key]
        assert step == STEP and logged == pytest.approx(value, rel=1e-6), key


@pytest.mark.parametrize("change, fragments", [
    ('data.test_prompts=""', ["data.test_prompts is not set", "--set data.test_prompts=PATH"]),
    ("train.load=/nonexistent/checkpoints", ["train.load", "/nonexistent/checkpoints does not exist"]),
    ("eval.greedy=false", ["nothing to evaluate", "eval.num_samples=K"]),
])
def test_bad_input_stops_before_a_model_is_built(workspace, tmp_path, capsys, change, fragments):
    from megacispo.startup import BadInput

    overrides = _overrides(workspace, tmp_path) + [change]
    if change.startswith("eval.greedy"):
        overrides.append("eval.num_samples=0")
    with pytest.raises(BadInput) as raised:
        eval_main([arg for item in overrides for arg in ("--set", item)])
    assert raised.value.code == 2
    errors = capsys.readouterr().err.strip().splitlines()
    assert len(errors) == 1 and errors[0].startswith("error: ")
    assert all(fragment in errors[0] for fragment in fragments), errors[0]
    assert not any(tmp_path.iterdir()), "nothing may be written before the model is built"


def test_dry_run_prints_the_plan(workspace, tmp_path, capsys):
    overrides = _overrides(workspace, tmp_path)
    assert eval_main([*[arg for item in overrides for arg in ("--set", item)], "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert f"checkpoint of step {STEP}" in out and "pass@k (k = 1, 2, 4) and mean@4" in out
    assert str(tmp_path / "eval") in out
    assert not any(tmp_path.iterdir())
