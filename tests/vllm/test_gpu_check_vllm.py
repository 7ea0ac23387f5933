"""The GPU check's vllm stage on its CPU twin (``bash tests/run.sh --vllm``): megacispo.train under torchrun with
rollout.engine = vllm on a random tiny M2, its steps' weight syncs checked and timed, vLLM's sampled log-probs
within bf16's gap of the trainer's; the row passes and says what it measured. On a lent GPU the stage runs the
same code with CUDA (where vLLM is installed: the lent image has none, and the row says so)."""

from __future__ import annotations

import re

import pytest

from megacispo.testing.gpu_check_twin import load_gpu_check

pytest.importorskip("vllm")
gpu_check = load_gpu_check()
# About 35 s, a twin of what tests/vllm/test_vllm_rl.py checks: bash tests/run.sh --vllm --slow runs it.
pytestmark = pytest.mark.slow


def test_the_vllm_stage_passes_on_the_cpu_twin(tmp_path):
    inputs, _ = gpu_check.prepare_driver_inputs(tmp_path)
    run = gpu_check.DriverRun(inputs, "float32", gpu_check.child_env("cpu"), timeout_s=300, gpus=0)
    report = gpu_check.Report()
    assert report.run_stage("vllm", run.dtype, "a bound", lambda: gpu_check.vllm_stage(run)), report.table()
    (row,) = report.rows
    assert re.match(r"vLLM 0\.32\.\d+, tiny M2: policy loss .* \(gap <= 0.05\); weight sync [\d.]+( / [\d.]+)* s, "
                    r"probe \|diff\| ", row.value), row.value
