"""The GPU check's CPU twin (``benchmarks/gpu_check.sh --cpu``): the driver stages it runs on a GPU
(SFT, RL with rollouts in packed rows, its first step in padded rows and at CP = 2 on 2 processes,
the checkpoint save, --resume, score, each through torchrun) run here on the CPU with gloo, one
passing row each (with bf16 weights: tests/slow/test_gpu_check.py); a stage that fails fails its
row, the rows that need it and the exit status; the CP stage is skipped, failing nothing, where
one GPU is visible; and without CUDA the GPU check itself stops at once with one line."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from megacispo.testing.gpu_check_twin import assert_every_stage_passed, cpu_twin, load_gpu_check, stage_rows

REPO = Path(__file__).resolve().parents[2]


def test_cpu_twin_runs_every_driver_stage_in_fp32(tmp_path):
    assert_every_stage_passed(cpu_twin(tmp_path, "float32"), "float32")


def test_a_failed_stage_fails_its_row_the_rows_that_need_it_and_the_exit_status(tmp_path):
    # No torchrun starts, imports and builds the model within a second: SFT times out.
    result = cpu_twin(tmp_path, "float32", "--stage-timeout", "1")
    assert result.returncode == 1
    statuses = {row["stage"]: (row["status"], row["result"]) for row in stage_rows(result.stdout)}
    assert statuses["data + tokenizer"][0] == "pass"
    assert statuses["sft"] == ("FAIL", f"timed out after 1 s (log: {tmp_path / 'float32' / 'logs' / 'sft.log'})")
    for stage, needs in [("rl", "sft"), ("padded", "rl"), ("cp", "rl"), ("save", "rl"), ("resume", "save"),
                         ("score", "save")]:
        assert statuses[stage] == ("FAIL", f"not run: it needs {needs}")


def test_the_cp_stage_is_skipped_on_one_gpu_and_fails_nothing(tmp_path):
    gpu_check = load_gpu_check()
    inputs = gpu_check.DriverInputs(tmp_path, tmp_path / "driver.yaml", tmp_path / "score_tokens.jsonl")
    run = gpu_check.DriverRun(inputs, "bfloat16", env={}, timeout_s=1.0, gpus=1)
    report = gpu_check.Report()
    assert not report.run_stage("cp", run.dtype, lambda: gpu_check.cp_stage(run))
    assert [(row.status, row.result) for row in report.stages] == [
        ("skip", "skipped: 1 CUDA GPU visible, CP = 2 needs 2 (GPU=0,1)")]
    assert not report.failed and not (tmp_path / "bfloat16").exists()
    assert "| cp | bfloat16 |" in report.stage_table() and report.stage_table().endswith("| skip |")


def test_without_cuda_the_gpu_check_stops_at_once_with_one_line():
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}
    result = subprocess.run([sys.executable, "benchmarks/gpu_check.py"], cwd=REPO, env=env, capture_output=True,
                            text=True, timeout=120)
    assert result.returncode == 2
    assert result.stdout == ""
    assert len(result.stderr.strip().splitlines()) == 1
    assert "no CUDA GPU" in result.stderr and "gpu_check.sh --cpu" in result.stderr
