"""tools/plan.py under LoRA (--lora-rank, --lora-targets): the adapters' parameters per GPU by hand
from lora_target_dims (column-parallel linears split B over TP, row-parallel ones A; every expert its
own, on its EP rank), gradients and optimizer states for the adapters alone, their rank-r activations,
the merged weights a rollout adds, the bad input, and the layouts of docs/guides/launch.md that LoRA
fits on far fewer GPUs (tests/multiprocess/test_plan.py has the rest of the planner)."""

from __future__ import annotations

import dataclasses
import math

import pytest

from megacispo.models.config import LORA_TARGETS, LoraConfig, lora_target_dims, model_config
from megacispo.parallel.layout import ParallelConfig
from megacispo.testing.tool_modules import load_tool

plan = load_tool("plan")

# MiniMax-M1 on 512 GPUs, tests/multiprocess/test_plan.py's layout: stage 0 holds layers 0-9 (softmax at 7).
M1_512 = ParallelConfig(tensor_model_parallel_size=8, pipeline_model_parallel_size=8,
                        expert_model_parallel_size=8, sequence_parallel=True)
RANK = 16
# The 49,152-token runs of docs/guides/launch.md ("LoRA: the same sequences on fewer GPUs").
DOC_OPTIONS = ["--sequence-parallel", "--micro-batch", "1", "--seq-len", "49152", "--recompute", "full",
               "--precision", "bf16", "--distributed-optimizer", "--fused-lm-head", "--gpu-memory-gb", "80"]


def _adapter(target: str, rank: int, split: int) -> int:
    """A [r, in] + B [out, r] of one linear on one GPU: B split over ``split`` on a column-parallel
    linear, A on a row-parallel one (out_proj, o_proj, linear_fc2)."""
    in_features, out_features = lora_target_dims(model_config("minimax-m1"))[target]
    if target in ("out_proj", "o_proj", "linear_fc2"):
        return rank * in_features // split + out_features * rank
    return rank * in_features + out_features // split * rank


def test_m1_lora_memory_by_hand():
    m1 = model_config("minimax-m1")
    lora = LoraConfig(rank=RANK, targets=list(LORA_TARGETS))
    kwargs = dict(world_size=512, micro_batch=1, seq_len=8192, recompute="none")
    full = plan.stage_plans(m1, M1_512, **kwargs)[0]
    stage = plan.stage_plans(m1, M1_512, lora=lora, **kwargs)[0]
    assert stage.layer_kinds == "LLLLLLLSLL"
    # TP 8 (expert TP 8 too), 32 / EP 8 = 4 experts a GPU, each with its own fc1 and fc2 adapters.
    lightning = sum(_adapter(target, RANK, 8) for target in ("qkv_proj", "output_gate", "out_proj"))
    softmax = sum(_adapter(target, RANK, 8) for target in ("q_proj", "k_proj", "v_proj", "o_proj"))
    experts = 4 * (_adapter("linear_fc1", RANK, 8) + _adapter("linear_fc2", RANK, 8))
    assert lightning == 16 * (6144 + 24576 // 8) + 16 * (6144 + 8192 // 8) + 16 * (8192 // 8 + 6144)
    assert stage.adapters.dense == 9 * lightning + softmax
    assert stage.adapters.expert == 10 * experts
    adapters = stage.adapters.total
    # The base is the full plan's, frozen: its bf16 weights stay, its gradients and optimizer states go.
    assert stage.params == full.params and stage.trainable == stage.adapters
    assert stage.weights == 2 * (full.params.total + adapters)
    assert stage.gradients == 4 * adapters
    # Distributed optimizer: the mixers' adapters over DP 8, the experts' over expert DP 512 / (8 x 8 x 8) = 1.
    assert stage.optimizer_states == math.ceil(12 * (stage.adapters.dense / 8 + stage.adapters.expert / 1))
    # Activations: each adapted linear's bf16 [rows, 16] A x, for the 8 micro-batches stage 0 holds (1F1B, PP 8).
    tokens, copies = 8192, 8192 // 8 * 2 * 8  # T; T / SP x top-2 x expert TP 8 routed copies
    lightning_rows = 2 * tokens + tokens // 8 + 2 * copies  # qkv, gate; out_proj after the reduce-scatter; fc1, fc2
    softmax_rows = 3 * tokens + tokens // 8 + 2 * copies
    assert stage.activations - full.activations == pytest.approx(
        8 * 2 * RANK * (9 * lightning_rows + softmax_rows), abs=1)
    assert stage.total < full.total - full.gradients  # the base's gradients alone are more than LoRA adds
    assert stage.optimizer_states < full.optimizer_states / 50  # 1.2%: the 10.1M expert adapters against 849M experts


@pytest.mark.parametrize("size", ["minimax-m1", "minimax-m2"])
def test_the_adapters_sit_on_every_gemm_weight_or_the_targets_alone(size):
    model = model_config(size)
    layout = ParallelConfig(tensor_model_parallel_size=4, pipeline_model_parallel_size=2,
                            expert_model_parallel_size=8, expert_tensor_parallel_size=1, sequence_parallel=True)
    every = LoraConfig(rank=8, targets=list(lora_target_dims(model)))
    experts_only = LoraConfig(rank=8, targets=["linear_fc1", "linear_fc2"])
    for stage, alone in zip(plan.stage_plans(model, layout, 64, 1, 1024, lora=every),
                            plan.stage_plans(model, layout, 64, 1, 1024, lora=experts_only)):
        assert stage.adapted.total == stage.params.gemm  # the mixer projections and the experts
        assert alone.adapted.total == alone.params.expert and alone.adapters.dense == 0
        assert alone.adapters.expert == stage.adapters.expert


@pytest.mark.parametrize("size", ["tiny", "minimax-m1", "minimax-m2"])
def test_the_adapters_on_the_gpus_add_up_to_the_models(size):
    """TP 1, each expert on one EP rank: the stages' adapters partition the model's, r (in + out) a linear."""
    model = model_config(size)
    lora = LoraConfig(rank=4, targets=list(lora_target_dims(model)))
    layout = ParallelConfig(pipeline_model_parallel_size=2, expert_model_parallel_size=model.num_experts)
    stages = plan.stage_plans(model, layout, 2 * model.num_experts, 1, 16, lora=lora)
    kinds = [model.layer_kind(layer) for layer in range(model.num_layers)]
    per_linear = {target: 4 * (in_features + out_features)
                  for target, (in_features, out_features) in lora_target_dims(model).items()}
    mixers = {"L": ("qkv_proj", "output_gate", "out_proj"), "S": ("q_proj", "k_proj", "v_proj", "o_proj")}
    whole = sum(per_linear[target] for kind in kinds for target in mixers[kind])
    whole += model.num_layers * model.num_experts * (per_linear["linear_fc1"] + per_linear["linear_fc2"])
    assert sum(s.adapters.dense + s.adapters.expert * model.num_experts for s in stages) == whole


def test_tiny_adapter_activations_by_hand():
    """TP 2 with sequence parallelism, expert TP 2, micro-batch 2 x 64 tokens, rank 4."""
    tiny = model_config("tiny")
    layout = ParallelConfig(tensor_model_parallel_size=2, pipeline_model_parallel_size=2,
                            expert_model_parallel_size=2, sequence_parallel=True)
    lora = LoraConfig(rank=4, targets=["out_proj", "q_proj", "linear_fc2"])
    stages = plan.stage_plans(tiny, layout, 8, micro_batch=2, seq_len=64, lora=lora)
    tokens, copies = 128, 64 * 2 * 2  # T; T / SP x top-2 x expert TP 2

    def lora_item(stage, kind):
        return next(item for item in stage.layer_items[kind] if item.name.startswith("LoRA"))

    lightning = lora_item(stages[0], "L")  # out_proj after the reduce-scatter, linear_fc2
    assert lightning.none == lightning.selective == (tokens // 2 + copies) * 2 * 4
    assert lora_item(stages[1], "S").none == (tokens + copies) * 2 * 4  # q_proj's input is all-gathered


def test_rollout_adds_the_merged_weights():
    tiny = model_config("tiny")
    lora = LoraConfig(rank=4, targets=["out_proj", "qkv_proj", "linear_fc1"])
    stage = plan.memory_plan(tiny, ParallelConfig(), 1, 1, 64, lora=lora)
    # 7 lightning out_proj [64, 64]; the qkv and the experts' fc1 are merged into the rollout's stacks.
    merged = 2 * 7 * 64 * 64
    assert 2 * stage.merged.total == merged
    assert stage.adapted.total == 7 * (64 * 64 + 192 * 64) + 8 * 4 * 128 * 64
    resident = stage.weights + stage.gradients + stage.optimizer_states + stage.overhead
    line, fits = plan.rollout_summary(stage, 1000, slots=1, max_length=64)
    assert fits and "LoRA's merged weights" in line
    _, fits = plan.rollout_summary(dataclasses.replace(stage, capacity=resident + merged + 999), 1000, slots=1,
                                   max_length=64)
    assert not fits


@pytest.mark.parametrize(
    "size, full_layout, lora_layout, full_gpus, lora_gpus",
    [
        ("minimax-m1", "--tp 8 --pp 4 --ep 32 --etp 1 --cp 4 --dp 1", "--tp 8 --pp 2 --ep 8 --etp 1 --dp 1", 128, 16),
        ("minimax-m2", "--tp 8 --pp 2 --ep 32 --etp 1 --cp 4 --dp 1", "--tp 8 --pp 1 --ep 8 --etp 1 --dp 1", 64, 8),
    ],
)
def test_lora_fits_the_sequence_on_far_fewer_gpus(size, full_layout, lora_layout, full_gpus, lora_gpus, capsys):
    """docs/guides/launch.md's table: the exit status is the verdict."""
    model = ["--model", size, *DOC_OPTIONS]
    assert plan.main(model + full_layout.split()) == 0
    assert f"on {full_gpus} GPUs" in capsys.readouterr().out
    assert plan.main(model + lora_layout.split() + ["--lora-rank", "16"]) == 0
    out = capsys.readouterr().out
    assert f"on {lora_gpus} GPUs" in out and "LoRA rank 16 on" in out and "LoRA adapters" in out
    assert plan.main(model + lora_layout.split()) == 1  # full RL on the LoRA layout
    assert "DOES NOT FIT" in capsys.readouterr().out


def test_longest_sequence_grows_with_lora():
    m1 = model_config("minimax-m1")
    layout = ParallelConfig(tensor_model_parallel_size=8, pipeline_model_parallel_size=4, expert_model_parallel_size=32,
                            expert_tensor_parallel_size=1, sequence_parallel=True)  # 128 GPUs: DP 4
    options = dict(recompute="full", distributed_optimizer=True, fused_lm_head=True)
    full = plan.longest_sequence(m1, layout, 128, 1, **options)
    lora = plan.longest_sequence(m1, layout, 128, 1, lora=LoraConfig(rank=16, targets=list(LORA_TARGETS)), **options)
    assert 0 < full < lora


def test_bad_lora_input_names_the_field():
    tiny, m2 = model_config("tiny"), model_config("minimax-m2")
    with pytest.raises(ValueError, match=r"lora.rank = 4 with precision = 'fp8'"):
        plan.memory_plan(tiny, ParallelConfig(), 1, 1, 32, precision="fp8", lora=LoraConfig(rank=4))
    with pytest.raises(ValueError, match=r"\['qkv_proj'\] name no layer of this"):
        plan.memory_plan(m2, ParallelConfig(expert_model_parallel_size=256), 256, 1, 32,
                         lora=LoraConfig(rank=4, targets=["qkv_proj", "q_proj"]))
    with pytest.raises(ValueError, match=r"use lora.rank < 32"):  # tiny's k_proj is [32, 64]
        plan.memory_plan(tiny, ParallelConfig(), 1, 1, 32, lora=LoraConfig(rank=32))
    # Rank 0 is no LoRA: the full plan.
    assert plan.memory_plan(tiny, ParallelConfig(), 1, 1, 32, lora=LoraConfig(rank=0)) == plan.memory_plan(
        tiny, ParallelConfig(), 1, 1, 32)


def test_cli_default_targets_are_the_models(capsys):
    assert plan.main(["--model", "tiny-m2", "--seq-len", "64", "--lora-rank", "4"]) == 0
    assert "LoRA rank 4 on q_proj, k_proj, v_proj, o_proj, linear_fc1, linear_fc2; the base frozen" in (
        capsys.readouterr().out)
