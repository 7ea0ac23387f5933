"""The GPU check's CPU twin (``benchmarks/gpu_check.sh --cpu``) with bf16 weights: every driver stage
passes, the multi-process ones included, but fp8, which needs Transformer Engine and a GPU, and vllm, which
needs .venv-vllm (tests/multiprocess/test_gpu_check.py runs the twin in fp32, tests/vllm/test_gpu_check_vllm.py
the vllm stage)."""

from __future__ import annotations

from megacispo.testing.gpu_check_twin import assert_every_stage_passed, cpu_twin


def test_cpu_twin_runs_every_driver_stage_in_bf16(tmp_path):
    assert_every_stage_passed(cpu_twin(tmp_path, "bfloat16"), "bfloat16", skipped={"fp8", "vllm"})
