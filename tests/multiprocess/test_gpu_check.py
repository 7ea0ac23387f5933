"""The GPU check's CPU twin (``benchmarks/gpu_check.sh --cpu``): the driver stages it runs on a GPU
(SFT, RL with rollouts in packed rows, its first step in padded rows and at CP = 2 on 2 processes, a
step with bf16 rollouts through the compiled decode step, the checkpoint save, --resume, score, each
through torchrun) run here on the CPU with gloo, one passing row each (the multi-process TP 2 + EP 2
and rollout-ranks stages, and bf16 weights: tests/slow/test_gpu_check.py); a stage that fails fails
its row, the rows that need it and the exit status; the multi-GPU stages are skipped, failing
nothing, where one GPU is visible, and fp8 without Transformer Engine; a row fails on a number over
its bound with the number and the bound in it (the decode-paths row on a planted lean-step
mistake, the decode expert kernels' row on planted kernel mistakes, run on the CPU); past its time budget nothing starts; and without CUDA the GPU check
itself stops at once with one line."""

from __future__ import annotations

import importlib.util
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from megacispo.testing.gpu_check_twin import assert_every_stage_passed, cpu_twin, load_gpu_check, stage_rows
from megacispo.testing.harness import run_distributed

REPO = Path(__file__).resolve().parents[2]
gpu_check = load_gpu_check()
MULTI_PROCESS = ("tp2-ep2", "rollout-ranks")


def test_cpu_twin_runs_every_driver_stage_in_fp32(tmp_path):
    """About 100 s on 2 cores, 35 s of it the compiled bf16 rollout."""
    skips = [arg for stage in MULTI_PROCESS for arg in ("--skip-stage", stage)]
    result = cpu_twin(tmp_path, "float32", *skips)
    assert_every_stage_passed(result, "float32", skipped={"fp8", *MULTI_PROCESS})
    rows = {row["stage"]: row["result"] for row in stage_rows(result.stdout)}
    assert rows["bf16-rollout"].startswith("rollout.dtype bfloat16, compiled decode: policy loss ")
    assert rows["fp8"] == "skipped: FP8 trains bf16 weights: it runs in the bfloat16 half"


def test_a_failed_stage_fails_its_row_the_rows_that_need_it_and_the_exit_status(tmp_path):
    # No torchrun starts, imports and builds the model within a second: SFT times out.
    result = cpu_twin(tmp_path, "float32", "--stage-timeout", "1")
    assert result.returncode == 1
    statuses = {row["stage"]: (row["status"], row["result"]) for row in stage_rows(result.stdout)}
    assert statuses["data + tokenizer"][0] == "pass"
    assert statuses["sft"] == ("FAIL", f"timed out after 1 s (log: {tmp_path / 'float32' / 'logs' / 'sft.log'})")
    for stage, needs in [("rl", "sft"), ("padded", "rl"), ("cp", "rl"), ("bf16-rollout", "rl"), ("fp8", "rl"),
                         ("tp2-ep2", "rl"), ("rollout-ranks", "rl"), ("save", "rl"), ("resume", "save"),
                         ("score", "save")]:
        assert statuses[stage] == ("FAIL", f"not run: it needs {needs}")


def _run(tmp_path: Path, dtype: str, gpus: int, budget_s: float = 0.0):
    inputs = gpu_check.DriverInputs(tmp_path, tmp_path / "driver.yaml", tmp_path / "score_tokens.jsonl")
    return gpu_check.DriverRun(inputs, dtype, env={}, timeout_s=1.0, gpus=gpus, budget=gpu_check.Budget(budget_s))


@pytest.mark.parametrize("stage, action, reason", [
    ("cp", "cp_stage", "1 CUDA GPU visible, CP = 2 needs 2 (GPU=0,1)"),
    ("tp2-ep2", "tp_ep_stage", "1 CUDA GPU visible, TP = 2 + EP = 2 needs 2 (GPU=0,1)"),
    ("rollout-ranks", "rollout_ranks_stage", "1 CUDA GPU visible, a training and a rollout process need 2 (GPU=0,1)"),
])
def test_the_multi_gpu_stages_are_skipped_on_one_gpu_and_fail_nothing(tmp_path, stage, action, reason):
    run = _run(tmp_path, "bfloat16", gpus=1)
    report = gpu_check.Report()
    assert not report.run_stage(stage, run.dtype, lambda: getattr(gpu_check, action)(run))
    assert [(row.status, row.result) for row in report.stages] == [("skip", f"skipped: {reason}")]
    assert not report.failed and not (tmp_path / "bfloat16").exists()
    assert f"| {stage} | bfloat16 |" in report.stage_table() and report.stage_table().endswith("| skip |")


def test_fp8_is_skipped_without_transformer_engine(tmp_path):
    if importlib.util.find_spec("transformer_engine") is not None:
        pytest.skip("transformer-engine is installed here: the stage would run")
    report = gpu_check.Report()
    run = _run(tmp_path, "bfloat16", gpus=1)
    assert not report.run_stage("fp8", run.dtype, lambda: gpu_check.fp8_stage(run))
    (row,) = report.stages
    assert row.status == "skip" and "transformer-engine" in row.result and not report.failed


def test_past_the_budget_no_stage_starts(tmp_path):
    run = _run(tmp_path, "float32", gpus=0, budget_s=1e-9)
    with pytest.raises(gpu_check.StageFailed, match=r"not run: the check's time budget of 0 s is spent"):
        run.launch("rl", "megacispo.train")
    assert not (tmp_path / "float32").exists()


def test_a_row_over_its_bound_fails_with_the_value_and_the_bound():
    report = gpu_check.Report()
    report.add(gpu_check.error_row("lightning error", "triton float32", {"out": 3e-5, "dq": 2.5e-4}, 1e-4))
    report.add(gpu_check.error_row("lightning error", "triton bfloat16", {"out": 1e-2, "dq": 2e-2}, 3e-2))
    report.add(gpu_check.error_row("vocab-parallel loss", "fused LM head", {"logp": math.nan}, 1e-5))
    assert [row.status for row in report.rows] == ["FAIL", "pass", "FAIL"] and report.failed
    assert report.rows[0].failure == "dq 2.50e-04 > 0.0001"
    assert report.rows[2].failure == "logp nan > 1e-05"
    line = report.table().splitlines()[2]
    assert line.startswith("| lightning error | triton float32 | out 3.0e-05, dq 2.5e-04 | <= 0.0001 |")
    assert "| FAIL | FAILED: dq 2.50e-04 > 0.0001 |" in line


def test_a_row_within_its_bounds_passes():
    report = gpu_check.Report()
    report.add(gpu_check.error_row("vocab-parallel loss", "logits", {"logp": 2e-7, "grad": 9e-6}, 1e-5))
    assert not report.failed and report.rows[0].status == "pass"


def _train(losses: list[float]):
    return gpu_check.TrainResult(losses, step_ms=10.0, peak_gib=1.0, weights={})


def test_a_training_row_fails_when_its_loss_does_not_fall_or_fp8_drifts_from_bf16():
    bf16 = [9.7, 9.0, 8.1]
    rows = {
        "falls": gpu_check.train_row("bf16", _train(bf16), "-", ""),
        "flat": gpu_check.train_row("bf16", _train([9.7, 9.7, 9.7]), "-", ""),
        "fp8 close": gpu_check.train_row("fp8", _train([9.7, 9.02, 8.14]), "-", "", bf16),
        "fp8 far": gpu_check.train_row("fp8", _train([9.7, 9.1, 8.2]), "-", "", bf16),
    }
    assert {name: row.status for name, row in rows.items()} == {
        "falls": "pass", "flat": "FAIL", "fp8 close": "pass", "fp8 far": "FAIL"}
    assert rows["flat"].failure == "the loss did not fall: 9.7000 -> 9.7000"
    assert rows["fp8 far"].failure == "max |fp8 - bf16 loss| 1.00e-01 > 0.05"
    assert rows["fp8 far"].bound == "loss falls; |fp8 - bf16| <= 0.05"


def test_a_peer_that_raises_is_a_note_not_a_failure():
    def raises():
        raise RuntimeError("fla: no kernel for this GPU")

    report = gpu_check.Report()
    report.add(gpu_check.peer_row("lightning error", "fla chunk_simple_gla", raises))
    (row,) = report.rows
    assert row.status == "pass" and not report.failed
    assert row.note == "the peer raised RuntimeError: fla: no kernel for this GPU"


def _steps(**per_key: tuple[float, ...]) -> dict[str, dict[int, float]]:
    keys = {"loss": "loss/policy_loss", "reward": "rollout/reward_mean", "gap": gpu_check.LOGP_GAP,
            "entropy": "loss/entropy", "tokens": "loss/num_tokens", "sync": "perf/weight_sync_s"}
    return {keys[name]: dict(enumerate(values, start=1)) for name, values in per_key.items()}


def test_a_rollout_gap_over_its_bound_fails_the_stage():
    assert gpu_check.steps_within(_steps(loss=(0.1,), reward=(0.5,), gap=(0.004,)), [1], 0.05)
    with pytest.raises(gpu_check.StageFailed, match=r"\|old - rollout logp\| over 0.05 at step\(s\) \[1\]: 0.2"):
        gpu_check.steps_within(_steps(loss=(0.1,), reward=(0.5,), gap=(0.2,)), [1], 0.05)
    with pytest.raises(gpu_check.StageFailed, match="policy loss not finite"):
        gpu_check.steps_within(_steps(loss=(math.nan,), reward=(0.5,), gap=(0.004,)), [1], 0.05)


def test_fp8_compares_losses_only_where_it_sampled_what_bf16_sampled():
    bf16 = {"rollout/reward_mean": 0.5, "loss/num_tokens": 64.0, "loss/policy_loss": 0.01, "loss/entropy": 6.2}
    same = dict(loss=(0.02, 0.03), reward=(0.5, 0.4), gap=(0.03, 0.03), entropy=(6.22, 6.1), tokens=(64.0, 60.0))
    assert "step 1 as bf16 rl: |policy loss - rl's| 0.01" in gpu_check.fp8_result(_steps(**same), bf16, "tensorwise")
    with pytest.raises(gpu_check.StageFailed, match=r"\|entropy - rl's\| 1.00e-01 > 0.05"):
        gpu_check.fp8_result(_steps(**{**same, "entropy": (6.3, 6.1)}), bf16, "tensorwise")
    other = gpu_check.fp8_result(_steps(**{**same, "entropy": (6.3, 6.1), "reward": (0.25, 0.4)}), bf16, "tensorwise")
    assert other.endswith("sampled other rollouts than bf16 rl (reward mean 0.25, rl 0.5): losses not compared")


def test_rollout_ranks_fail_on_a_gap_larger_than_rls_or_a_missing_sync():
    fine = dict(loss=(0.1, 0.2), reward=(0.5, 0.5), gap=(1.5e-7, 1.4e-7), sync=(0.1, 0.1))
    rl_gaps = {1: 1.4e-7, 2: 1.5e-7}
    assert "weight sync 0.10 / 0.10 s" in gpu_check.rollout_ranks_result(_steps(**fine), rl_gaps, 1e-5)
    with pytest.raises(gpu_check.StageFailed, match=r"over 2 x rl's \+ 1e-05: step 2: 0.003 > 1.03e-05"):
        gpu_check.rollout_ranks_result(_steps(**{**fine, "gap": (1.5e-7, 3e-3)}), rl_gaps, 1e-5)
    with pytest.raises(gpu_check.StageFailed, match=r"no weight sync at step\(s\) \[2\]"):
        gpu_check.rollout_ranks_result(_steps(**{**fine, "sync": (0.1, 0.0)}), rl_gaps, 1e-5)


def _decode_paths_rows(planted_offset: float) -> list[tuple[str, str, str]]:
    """gpu_check's decode-paths row on the tiny model with the Transformer Engine backend's experts
    (twinned: megacispo.testing.te_twins), on the CPU; ``planted_offset`` is added to every decode
    layer's lean-step output (a wrong lean step)."""
    from megacispo.models.config import model_config, transformer_config
    from megacispo.models.decoder_layer import HybridDecoderLayer
    from megacispo.models.model import HybridModel
    from megacispo.parallel.layout import ParallelConfig, init_distributed
    from megacispo.testing.te_twins import te_experts_twinned

    init_distributed(ParallelConfig(), seed=0)
    config = model_config("tiny")
    with te_experts_twinned():
        model = HybridModel(config, transformer_config(config, ParallelConfig())).eval()
    prompts = torch.randint(3, config.vocab_size, (5, 11), generator=torch.Generator().manual_seed(0)).tolist()
    step = HybridDecoderLayer.step
    HybridDecoderLayer.step = lambda *args, **kwargs: step(*args, **kwargs) + planted_offset
    try:
        row = gpu_check.decode_paths_row(model, prompts, "tiny, twin TE experts", steps=4)
    finally:
        HybridDecoderLayer.step = step
    return row.status, row.error, row.failure


def test_the_decode_paths_row_fails_a_lean_step_that_departs_from_megatrons_modules():
    """bf16 rollouts of TE-layer experts: the lean step within the bound of Megatron's modules, and
    a lean step off by 0.25 in every layer's output over it, the gap in the row."""
    (good,) = run_distributed(_decode_paths_rows, 1, 0.0)
    (bad,) = run_distributed(_decode_paths_rows, 1, 0.25)
    assert good[0] == "pass" and good[1].startswith("max |lean - megatron log-prob| "), good
    assert bad[0] == "FAIL" and bad[2].startswith("log-prob gap ") and bad[2].endswith(" > 0.05"), bad


# A small MoE layer on an EP rank for the interpreter: odd sizes, two of seven experts local.
SMALL_EXPERT_STEP = {"tokens": 13, "topk": 2, "num_experts": 7, "local": 2, "hidden": 40, "ffn": 24}


def test_the_expert_kernels_row_passes_the_kernels_and_fails_a_wrong_one():
    """The decode expert kernels' row on the CPU, with the kernels in Triton's interpreter (in fp32:
    its casts to bf16 truncate, where a GPU's round to nearest), within its bound; and a combine kernel
    that drops the residual, and a permute that swaps two positions, over it."""
    from megacispo.testing.triton_modules import load_kernels_module

    dtype = torch.float32
    kernels = load_kernels_module("megacispo.models.experts_triton", interpret=True, name="_gpu_check_experts")
    good = gpu_check.expert_kernels_row(kernels, dtype, "cpu", "small", **SMALL_EXPERT_STEP)
    assert good.status == "pass", good
    interpreted = {name: getattr(kernels, name) for name in ("combine_pairs_triton", "permute_pairs_triton")}

    def swapped(*args):
        rows, positions = interpreted["permute_pairs_triton"](*args)
        return rows, positions.roll(1)

    planted = {"combine_pairs_triton": lambda tokens, *args: interpreted["combine_pairs_triton"](0 * tokens, *args),
               "permute_pairs_triton": swapped}
    for name, wrong in planted.items():
        setattr(kernels, name, wrong)
        try:
            bad = gpu_check.expert_kernels_row(kernels, dtype, "cpu", "small", **SMALL_EXPERT_STEP)
        finally:
            setattr(kernels, name, interpreted[name])
        assert bad.status == "FAIL" and bad.failure.endswith(f" > {gpu_check.EXPERT_KERNELS_BOUND[dtype]:g}"), bad


def test_without_cuda_the_gpu_check_stops_at_once_with_one_line():
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}
    result = subprocess.run([sys.executable, "benchmarks/gpu_check.py"], cwd=REPO, env=env, capture_output=True,
                            text=True, timeout=120)
    assert result.returncode == 2
    assert result.stdout == ""
    assert len(result.stderr.strip().splitlines()) == 1
    assert "no CUDA GPU" in result.stderr and "gpu_check.sh --cpu" in result.stderr
