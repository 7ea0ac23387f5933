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
import re
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from megacispo.testing.gpu_check_twin import (
    TABLE_HEADER, assert_every_stage_passed, cpu_twin, load_gpu_check, stage_rows,
)
from megacispo.testing.harness import run_distributed

REPO = Path(__file__).resolve().parents[2]
gpu_check = load_gpu_check()
MULTI_PROCESS = ("tp2-ep2", "rollout-ranks")


@pytest.mark.slow
def test_cpu_twin_runs_every_driver_stage_in_fp32(tmp_path):
    """About 130 s on 2 cores, 35 s of it the compiled bf16 rollout: in the slow tier, beside the bf16 twin
    (tests/slow/test_gpu_check.py), since the CI tier passed 18 of its 20 minutes; each stage's code has
    its own tests there."""
    skips = [arg for stage in MULTI_PROCESS for arg in ("--skip-stage", stage)]
    result = cpu_twin(tmp_path, "float32", *skips)
    assert_every_stage_passed(result, "float32", skipped={"fp8", "vllm", *MULTI_PROCESS})
    rows = {row["stage"]: row["result"] for row in stage_rows(result.stdout)}
    assert rows["bf16-rollout"].startswith("rollout.dtype bfloat16, compiled decode: policy loss ")
    assert rows["fp8"] == "skipped: FP8 trains bf16 weights: it runs in the bfloat16 half"
    # vLLM lives in .venv-vllm: tests/vllm/test_gpu_check_vllm.py runs the stage there.
    assert rows["vllm"].startswith("skipped: vLLM is not installed: pip install 'megacispo[vllm]'")


def test_a_failed_stage_fails_its_row_the_rows_that_need_it_and_the_exit_status(tmp_path):
    """... and every row is in --rows-file too, as the table prints it (written as each row finished)."""
    # No torchrun starts, imports and builds the model within a second: SFT times out.
    rows_file = tmp_path / "out" / "rows.md"
    result = cpu_twin(tmp_path, "float32", "--stage-timeout", "1", "--rows-file", str(rows_file))
    assert result.returncode == 1
    table = result.stdout[result.stdout.index(TABLE_HEADER):].split("\n\n")[0]
    assert rows_file.read_text() == table + "\n" and len(table.splitlines()) == 2 + 13
    statuses = {row["stage"]: (row["status"], row["result"]) for row in stage_rows(result.stdout)}
    assert statuses["data + tokenizer"][0] == "pass"
    assert statuses["sft"] == ("FAIL", f"timed out after 1 s (log: {tmp_path / 'float32' / 'logs' / 'sft.log'})")
    for stage, needs in [("rl", "sft"), ("padded", "rl"), ("cp", "rl"), ("bf16-rollout", "rl"), ("fp8", "rl"),
                         ("tp2-ep2", "rl"), ("rollout-ranks", "rl"), ("save", "rl"), ("resume", "save"),
                         ("score", "save")]:
        assert statuses[stage] == ("FAIL", f"not run: it needs {needs}")
    # The vllm stage needs no other (it trains a random tiny M2): here, without vLLM, it skips.
    assert statuses["vllm"][0] == "skip" and statuses["vllm"][1].startswith("skipped: vLLM is not installed")


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
    assert not report.run_stage(stage, run.dtype, "a bound", lambda: getattr(gpu_check, action)(run))
    assert [(row.status, row.value) for row in report.rows] == [("skip", f"skipped: {reason}")]
    assert not report.failed and not (tmp_path / "bfloat16").exists()
    assert f"| driver | {stage} (bfloat16) | skipped: {reason} | a bound | skip |" in report.table()


def test_fp8_is_skipped_without_transformer_engine(tmp_path):
    if importlib.util.find_spec("transformer_engine") is not None:
        pytest.skip("transformer-engine is installed here: the stage would run")
    report = gpu_check.Report()
    run = _run(tmp_path, "bfloat16", gpus=1)
    assert not report.run_stage("fp8", run.dtype, "a bound", lambda: gpu_check.fp8_stage(run))
    (row,) = report.rows
    assert row.status == "skip" and "transformer-engine" in row.value and not report.failed


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
    lines = report.table().splitlines()
    assert lines[0] == "| check | case | value | bound | status | note |"
    assert lines[2] == "| lightning error | triton float32 | out 3.0e-05, dq 2.5e-04 | <= 0.0001 | FAIL | " \
                       "FAILED: dq 2.50e-04 > 0.0001 |"


def test_a_row_within_its_bounds_passes():
    report = gpu_check.Report()
    report.add(gpu_check.error_row("vocab-parallel loss", "logits", {"logp": 2e-7, "grad": 9e-6}, 1e-5))
    assert not report.failed and report.rows[0].status == "pass"


def _train(losses: list[float]):
    return gpu_check.TrainResult(losses, step_ms=10.0, peak_gib=1.0, weights={})


def test_a_training_row_fails_when_its_loss_does_not_fall_its_mfu_is_low_or_fp8_drifts_from_bf16():
    bf16 = [9.7, 9.0, 8.1]
    rows = {
        "falls": gpu_check.train_row("bf16", _train(bf16), "-", "", mfu=0.02),
        "unknown card": gpu_check.train_row("bf16", _train(bf16), "-", ""),
        "slow": gpu_check.train_row("bf16", _train(bf16), "-", "", mfu=0.004),
        "flat": gpu_check.train_row("bf16", _train([9.7, 9.7, 9.7]), "-", "", mfu=0.02),
        "fp8 close": gpu_check.train_row("fp8", _train([9.7, 9.02, 8.14]), "-", "", bf16, mfu=0.02),
        "fp8 far": gpu_check.train_row("fp8", _train([9.7, 9.1, 8.2]), "-", "", bf16, mfu=0.02),
    }
    assert {name: row.status for name, row in rows.items()} == {
        "falls": "pass", "unknown card": "pass", "slow": "FAIL", "flat": "FAIL", "fp8 close": "pass",
        "fp8 far": "FAIL"}
    assert rows["falls"].value == "loss 9.700 -> 8.100; MFU 2.00%"
    assert rows["unknown card"].value == "loss 9.700 -> 8.100; MFU unknown (pass --peak-tflops)"
    assert rows["slow"].failure == "MFU 0.40% < 0.5%"
    assert rows["flat"].failure == "the loss did not fall: 9.7000 -> 9.7000"
    assert rows["fp8 far"].failure == "max |fp8 - bf16 loss| 1.00e-01 > 0.05"
    assert rows["fp8 far"].bound == "loss falls; MFU >= 0.5%; |fp8 - bf16| <= 0.05"


def test_a_peer_that_raises_is_a_note_not_a_failure():
    def raises():
        raise RuntimeError("fla: no kernel for this GPU")

    report = gpu_check.Report()
    report.add(gpu_check.peer_row("lightning error", "fla chunk_simple_gla", raises))
    report.add(gpu_check.peer_row("lightning error", "fla over the bound", lambda: gpu_check.error_row(
        "lightning error", "", {"out": 1.0}, 1e-4)))
    assert [row.status for row in report.rows] == ["pass", "pass"] and not report.failed
    assert report.rows[0].note == "the peer raised RuntimeError: fla: no kernel for this GPU"
    assert [row.bound for row in report.rows] == [gpu_check.PEER] * 2 and report.rows[1].value == "out 1.0e+00"


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
    return row.status, row.value, row.failure


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


def _interpreted_lightning():
    """lightning_attention_triton in Triton's interpreter, as gpu_check's rows call a kernel."""
    from megacispo.testing.triton_modules import load_kernels_module

    kernels = load_kernels_module("megacispo.models.lightning_triton", interpret=True, name="_gpu_check_lightning")
    return lambda q, k, v, decay, cu_seqlens=None: kernels.lightning_attention_triton(q, k, v, decay,
                                                                                      cu_seqlens=cu_seqlens)[0]


def test_the_lightning_error_row_passes_the_kernel_and_fails_a_wrong_one():
    """The lightning error row on the CPU, the kernel in Triton's interpreter (fp32, packed documents of
    odd lengths), within its bound; the same kernel with its output off by 1% over it."""
    kernel = _interpreted_lightning()
    inputs = gpu_check.lightning_inputs(1, 37, 2, 16, device="cpu")
    cu_seqlens = torch.tensor([0, 5, 6, 37], dtype=torch.int32)
    reference = gpu_check.lightning_reference(inputs, torch.float32, cu_seqlens)
    good = gpu_check.lightning_error_row(kernel, "interpreted", inputs, torch.float32, reference, cu_seqlens)
    assert good.status == "pass" and good.bound == "<= 0.0001", good
    bad = gpu_check.lightning_error_row(lambda *args: 1.01 * kernel(*args), "planted", inputs, torch.float32,
                                        reference, cu_seqlens)
    assert bad.status == "FAIL" and bad.failure.startswith("out 1.00e-02 > 0.0001"), bad


def test_a_kernel_slower_than_the_torch_path_it_replaces_fails_its_speed_row():
    inputs = gpu_check.lightning_inputs(1, 64, 2, 16, device="cpu")

    def slower(*args):
        time.sleep(0.05)
        return gpu_check.torch_blockwise(*args)

    fast = gpu_check.lightning_speed_row(gpu_check.torch_blockwise, slower, "faster", inputs)
    slow = gpu_check.lightning_speed_row(slower, gpu_check.torch_blockwise, "planted", inputs)
    assert fast.status == "pass" and fast.bound == "<= torch block-wise", fast
    assert slow.status == "FAIL" and re.fullmatch(r"fwd\+bwd \d+\.\d\d ms > torch block-wise \d+\.\d\d ms",
                                                  slow.failure), slow


def test_a_decode_row_fails_on_too_many_kernels_or_syncs_a_compiled_step_slower_than_eager_or_far_from_roofline():
    eager = gpu_check.DecodeSteps(slots=16, step_ms=4.0, kernels=250.0, host_syncs=0.25, floor_ms=0.05)
    kernel_bound = 8 * gpu_check.DECODE_KERNELS_PER_LAYER + gpu_check.DECODE_KERNELS_OUTSIDE_LAYERS
    rows = {
        "eager": gpu_check.decode_row("eager", eager, layers=8),
        "compiled": gpu_check.decode_row("compiled", replace(eager, step_ms=1.5, kernels=180.0), 8, eager),
        "slow": gpu_check.decode_row("slow", replace(eager, step_ms=4.5), 8, eager),
        "kernels": gpu_check.decode_row("kernels", replace(eager, kernels=kernel_bound + 0.5), 8),
        "syncs": gpu_check.decode_row("syncs", replace(eager, host_syncs=1.0), 8),
        "far": gpu_check.decode_row("far", replace(eager, step_ms=60.0), 8),
        "unknown card": gpu_check.decode_row("unknown card", replace(eager, floor_ms=None), 8),
    }
    assert {name: row.status for name, row in rows.items()} == {
        "eager": "pass", "compiled": "pass", "slow": "FAIL", "kernels": "FAIL", "syncs": "FAIL", "far": "FAIL",
        "unknown card": "pass"}
    assert rows["eager"].value.startswith("4,000 tok/s (1.25% of roofline); 4.00 ms, 250.0 kernels")
    assert rows["far"].failure == "0.08% of roofline < 0.1%"
    assert rows["unknown card"].value.startswith("4,000 tok/s (roofline unknown (pass --hbm-tbps)); ")
    assert rows["slow"].failure == "4.50 ms per step > eager's 4.00"
    assert rows["kernels"].failure == f"{kernel_bound + 0.5:.1f} kernels > {kernel_bound}"
    assert rows["syncs"].failure == "1.00 host syncs > 0.25"
    assert rows["compiled"].bound == (f"tok/s >= 0.5% of roofline, kernels <= {kernel_bound}, host syncs <= 0.25 "
                                      "per step, ms <= eager's")


def _decode_floor(hbm_tbps: float) -> tuple[float, int, int]:
    """decode_floor_ms of the tiny model (fp32 weights), and its bf16 and fp32 parameters but the
    embedding's within a bf16 rollout."""
    from megacispo.models.config import model_config, transformer_config
    from megacispo.models.model import HybridModel
    from megacispo.parallel.layout import ParallelConfig, init_distributed

    init_distributed(ParallelConfig(), seed=0)
    config = model_config("tiny")
    model = HybridModel(config, transformer_config(config, ParallelConfig())).eval()
    floor_ms = gpu_check.decode_floor_ms(model, hbm_tbps)
    with model.generation_dtype(torch.bfloat16):
        counts = {dtype: sum(p.numel() for name, p in model.named_parameters()
                             if p.dtype == dtype and "word_embeddings" not in name)
                  for dtype in (torch.bfloat16, torch.float32)}
    return floor_ms, counts[torch.bfloat16], counts[torch.float32]


def test_the_decode_roofline_reads_every_weight_but_the_embedding_in_its_rollout_dtype():
    ((floor_ms, bf16, fp32),) = run_distributed(_decode_floor, 1, 2.0)
    assert bf16 > 0 and fp32 > 0  # the fp32 LM head and routers beside bf16 layers
    assert floor_ms == pytest.approx((2 * bf16 + 4 * fp32) / 2e12 * 1e3)


def test_the_parts_split_the_check_between_two_calls():
    parts = {number: gpu_check.parse_args(["--part", str(number)]) for number in gpu_check.PARTS}
    sections = {number: [name for name in gpu_check.SECTIONS if name not in args.skip]
                for number, args in parts.items()}
    assert sections == {1: ["lightning", "decode", "driver"], 2: ["train", "loss", "driver"]}
    assert {number: args.driver_dtype for number, args in parts.items()} == {1: ["bfloat16"], 2: ["float32"]}
    with pytest.raises(SystemExit):
        gpu_check.parse_args(["--part", "1", "--skip", "train"])


def test_on_a_device_without_the_wheels_the_check_says_how_to_bundle_them(tmp_path):
    env = {**os.environ, "WHEELS": str(tmp_path), "OUT": str(tmp_path / "out")}
    result = subprocess.run(["bash", "benchmarks/gpu_check.sh", "--device", "--part", "1"], cwd=REPO, env=env,
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 2 and result.stdout == ""
    assert result.stderr == (f"gpu_check --device: no wheels in {tmp_path}/: run 'bash benchmarks/gpu_bundle.sh' on "
                             "your machine and name .whl in the device call's carry\n")


def test_without_cuda_the_gpu_check_stops_at_once_with_one_line():
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}
    result = subprocess.run([sys.executable, "benchmarks/gpu_check.py"], cwd=REPO, env=env, capture_output=True,
                            text=True, timeout=120)
    assert result.returncode == 2
    assert result.stdout == ""
    assert len(result.stderr.strip().splitlines()) == 1
    assert "no CUDA GPU" in result.stderr and "gpu_check.sh --cpu" in result.stderr
