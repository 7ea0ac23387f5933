"""tools/plan.py, the per-GPU memory planner: parameter splits and byte counts by hand from the
parameter shapes, layout errors, the shape of the activation estimate (linear in tokens and top-k,
what recompute removes), and the estimate against the tensors the real model saves for backward
(megacispo.testing.saved_activations; under tensor and sequence parallelism: tests/slow/test_plan.py)."""

from __future__ import annotations

import pytest

from megacispo.models.config import model_config, model_shape, parameter_breakdown, parameter_counts
from megacispo.parallel.layout import ParallelConfig, validate_layout
from megacispo.testing.saved_activations import compare_with_the_model
from megacispo.testing.tool_modules import load_tool

GIB = 2**30


plan = load_tool("plan")

# tiny: H 64, 4 heads x 16 (W 64), 2 KV heads (W_kv 32), 4 experts top-2 with I 64, V 512, 8 layers LLLLLLLS.
TINY_TP2_PP2_EP2 = ParallelConfig(
    tensor_model_parallel_size=2, pipeline_model_parallel_size=2, expert_model_parallel_size=2, sequence_parallel=True
)


def test_tiny_parameters_per_gpu_by_hand():
    tiny = model_config("tiny")
    stages = plan.stage_plans(tiny, TINY_TP2_PP2_EP2, world_size=8, micro_batch=1, seq_len=32)
    # One lightning layer on one GPU: qkv [3*64/2, 64], gate [64/2, 64], out [64, 64/2], output norm [64/2],
    # then the replicated input / pre-MLP norms [64] x 2 and the router [4, 64].
    lightning_projections = 96 * 64 + 32 * 64 + 64 * 32
    lightning = lightning_projections + 32 + 2 * 64 + 4 * 64
    # Softmax: q [64/2, 64], k and v [32/2, 64], o [64, 64/2].
    softmax_projections = 32 * 64 + 16 * 64 + 16 * 64 + 64 * 32
    softmax = softmax_projections + 2 * 64 + 4 * 64
    # Experts: 4 / EP 2 = 2 per GPU, each fc1 [2*64/2, 64] and fc2 [64, 64/2] (expert TP = TP = 2).
    experts_per_layer = 2 * (64 * 64 + 64 * 32)
    vocab_shard = 512 // 2 * 64
    first, last = stages
    assert first.layer_kinds == "LLLL" and last.layer_kinds == "LLLS"
    assert first.params.dense == 4 * lightning + vocab_shard  # + the embedding
    assert last.params.dense == 3 * lightning + softmax + 64 + vocab_shard  # + final norm, LM head
    assert first.params.expert == last.params.expert == 4 * experts_per_layer
    assert first.params.gemm == 4 * lightning_projections + 4 * experts_per_layer
    assert last.params.gemm == 3 * lightning_projections + softmax_projections + 4 * experts_per_layer
    assert (first.data_parallel_size, first.expert_data_parallel_size) == (2, 1)  # 8/(2*2), 8/(2*2*2)


def test_tiny_memory_components_by_hand():
    tiny = model_config("tiny")
    kwargs = dict(world_size=8, micro_batch=1, seq_len=32, overhead_bytes=123)
    first = plan.stage_plans(tiny, TINY_TP2_PP2_EP2, **kwargs)[0]
    dense, expert = first.params.dense, first.params.expert
    assert first.weights == 2 * (dense + expert)
    assert first.gradients == 4 * (dense + expert)
    assert first.optimizer_states == 12 * (dense // 2 + expert // 1)  # dense over DP 2, experts over expert DP 1
    assert first.fp8_weight_cache == 0 and first.overhead == 123
    unsharded = plan.stage_plans(tiny, TINY_TP2_PP2_EP2, distributed_optimizer=False, **kwargs)[0]
    assert unsharded.optimizer_states == 12 * (dense + expert)
    fp8 = plan.stage_plans(tiny, TINY_TP2_PP2_EP2, precision="fp8", **kwargs)[0]
    for component in ("weights", "gradients", "optimizer_states"):
        assert getattr(fp8, component) == getattr(first, component)
    assert fp8.fp8_weight_cache == 2 * first.params.gemm
    assert first.total == (first.weights + first.gradients + first.optimizer_states + first.activations + 123)


@pytest.mark.parametrize("size", ["tiny", "small", "minimax-m1"])
def test_pieces_on_the_gpus_add_up_to_the_model(size):
    model = model_config(size)
    total, _ = parameter_counts(model)
    # TP = 1: the stages partition the model (each expert on one of the EP ranks).
    layout = ParallelConfig(pipeline_model_parallel_size=4, expert_model_parallel_size=model.num_experts)
    stages = plan.stage_plans(model, layout, model.num_experts * 4, 1, 16)
    assert sum(s.params.dense + s.params.expert * model.num_experts for s in stages) == total
    # TP = 2 (expert TP 1): TP-split tensors appear once per TP rank, norms and routers twice.
    layout = ParallelConfig(tensor_model_parallel_size=2, pipeline_model_parallel_size=2, sequence_parallel=True,
                            expert_tensor_parallel_size=1)
    stages = plan.stage_plans(model, layout, 4, 1, 16)
    parts = parameter_breakdown(model)
    replicated = parts["router"] + parts["norms"]  # the lightning output norm is TP-split, counted in its mixer
    dense_total = total - parts["experts"]
    assert sum(2 * s.params.dense for s in stages) == dense_total + replicated
    assert sum(s.params.expert for s in stages) == parts["experts"]


def test_minimax_m1_512_gpus_worst_stage_by_hand():
    m1 = model_config("minimax-m1")
    layout = ParallelConfig(tensor_model_parallel_size=8, pipeline_model_parallel_size=8,
                            expert_model_parallel_size=8, sequence_parallel=True)
    worst = plan.memory_plan(m1, layout, 512, micro_batch=1, seq_len=8192, recompute="full")
    hidden, width, kv_width, ffn = 6144, 64 * 128, 8 * 128, 9216
    replicated = 2 * hidden + 32 * hidden  # two norms and the router, on every TP rank
    lightning = (5 * hidden * width + width) // 8 + replicated
    softmax = (2 * hidden * width + 2 * hidden * kv_width) // 8 + replicated
    experts = 10 * (32 // 8) * 3 * hidden * ffn // 8  # 10 layers, 4 experts per GPU, expert TP 8
    vocab_shard = 200_064 // 8 * hidden
    # Stage 0: layers 0-9 (softmax at 7) and the embedding; stage 7: layers 70-79 (softmax at 71, 79),
    # the final norm and the LM head. The first has more parameters, the last the fp32 logits.
    first_params = 9 * lightning + softmax + vocab_shard + experts
    last_params = 8 * lightning + 2 * softmax + hidden + vocab_shard + experts
    stages = plan.stage_plans(m1, layout, 512, micro_batch=1, seq_len=8192, recompute="full")
    assert stages[0].params.total == first_params == 1_302_365_184
    assert stages[7].params.total == last_params
    assert max(s.params.total for s in stages) == first_params
    assert 1.2e9 < first_params < 1.4e9  # ~456B / 512 x (expert share unsharded by DP) sanity range
    assert worst.stage == 7 and worst.fits
    assert worst.expert_data_parallel_size == 1 and worst.data_parallel_size == 8
    # Expert optimizer states are not sharded (expert DP 1): 12 bytes for each of 849M expert parameters.
    assert worst.optimizer_states == 12 * (worst.params.dense / 8 + experts)


@pytest.mark.parametrize(
    "layout, world_size",
    [
        (ParallelConfig(tensor_model_parallel_size=2, sequence_parallel=True), 3),  # world not divisible by TP
        (ParallelConfig(expert_model_parallel_size=4), 2),  # world not divisible by EP
        (ParallelConfig(tensor_model_parallel_size=8, sequence_parallel=True), 8),  # 4 heads
        (ParallelConfig(tensor_model_parallel_size=2), 2),  # MoE under TP without sequence parallelism
        (ParallelConfig(pipeline_model_parallel_size=3), 3),  # 8 layers
        (ParallelConfig(context_parallel_size=0), 1),
        (ParallelConfig(context_parallel_size=3), 4),  # world not divisible by TP x PP x CP
    ],
)
def test_impossible_layouts_raise_validate_layouts_error(layout, world_size):
    tiny = model_config("tiny")
    with pytest.raises(ValueError) as expected:
        validate_layout(layout, world_size, model_shape(tiny))
    with pytest.raises(ValueError) as raised:
        plan.memory_plan(tiny, layout, world_size, micro_batch=1, seq_len=32)
    assert str(raised.value) == str(expected.value)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(recompute="partial"), r"recompute = 'partial': choose one of none, selective, full"),
        (dict(precision="fp16"), r"precision = 'fp16': choose one of bf16, fp8"),
        (dict(micro_batch=0), r"micro_batch = 0"),
        (dict(seq_len=0), r"seq_len = 0"),
        (dict(num_microbatches=0), r"num_microbatches = 0"),
    ],
)
def test_bad_arguments_name_the_argument(kwargs, message):
    arguments = dict(micro_batch=1, seq_len=32) | kwargs
    with pytest.raises(ValueError, match=message):
        plan.memory_plan(model_config("tiny"), ParallelConfig(), 1, **arguments)


def test_lightning_layer_activations_by_hand():
    """One lightning layer, TP 2 with sequence parallelism, expert TP 2, micro-batch 2 x 64 tokens."""
    stages = plan.stage_plans(model_config("tiny"), TINY_TP2_PP2_EP2, 8, micro_batch=2, seq_len=64)
    tokens, local_tokens, local_width = 128, 64, 32  # T, T / TP, W / TP
    norms = 2 * local_tokens * (4 * 64 + 2 * 64 + 4)  # fp32 input, bf16 output, fp32 1/rms
    mixer_input = tokens * 2 * 64
    qkv_pre, qkv_fp32 = tokens * 2 * 3 * local_width, tokens * 4 * 3 * local_width
    chunk_states = 2 * 1 * 2 * 16 * 16 * 4  # 2 sequences x 1 chunk x 2 local heads x d x d fp32
    gate, out_norm, norm_result, out_proj = (tokens * 2 * local_width, tokens * (6 * local_width + 4),
                                             tokens * 2 * local_width, tokens * 2 * local_width)
    copies = local_tokens * 2 * 2  # top-2, all-gathered over expert TP 2
    moe = (local_tokens * 2 * 64 + local_tokens * (28 * 2 + 9 * 4)  # router input, routing
           + copies * 2 * 64 + copies * 2 * 64 + copies * (3 * 2 * 32 + 4) + copies * 2 * 32)  # per copy, I/ETP = 32
    expected = norms + mixer_input + qkv_pre + qkv_fp32 + chunk_states + gate + out_norm + norm_result + out_proj + moe
    assert plan.activation_bytes(stages[0].layer_items["L"], "none") == expected
    # Stage 0 holds 2 micro-batches (1F1B, PP 2) of 4 layers and its output for the backward send.
    boundary = local_tokens * 2 * 64
    assert stages[0].micro_batches_in_flight == 2
    assert stages[0].activations == 2 * (4 * expected + boundary)


def _activations(model, layout, world_size, seq_len, **kwargs):
    return plan.memory_plan(model, layout, world_size, micro_batch=1, seq_len=seq_len, **kwargs).activations


@pytest.mark.parametrize("recompute", ["none", "selective", "full"])
def test_activations_are_linear_in_sequence_length(recompute):
    """No T x T term anywhere: lightning layers keep no scores, SDPA keeps none either."""
    m1 = model_config("minimax-m1")
    layout = ParallelConfig(tensor_model_parallel_size=8, pipeline_model_parallel_size=8,
                            expert_model_parallel_size=8, sequence_parallel=True)
    one, two, three = (_activations(m1, layout, 512, n * 8192, recompute=recompute) for n in (1, 2, 3))
    assert three - two == pytest.approx(two - one, abs=2)  # bytes are rounded up once per stage
    assert two - one > 0


def test_moe_activations_are_linear_in_topk():
    tiny = model_config("tiny")
    layout = ParallelConfig(tensor_model_parallel_size=2, sequence_parallel=True)

    def moe_bytes(topk: int) -> float:
        items = plan.memory_plan(tiny.replace(moe_router_topk=topk), layout, 2, 1, 64).layer_items["L"]
        return sum(item.none for item in items if item.name.startswith(("expert", "SwiGLU", "rout")))

    one, two, three = moe_bytes(1), moe_bytes(2), moe_bytes(3)
    assert three - two == two - one > 0
    # Per extra routed token copy per token: expert input, fc1 output, SwiGLU intermediates, fc2 input
    # (x expert TP 2 copies after the all-gather, / TP 2 tokens under sequence parallelism) + 28 bytes of routing.
    per_copy = 2 * 64 + 2 * 2 * 64 / 2 + 3 * 2 * 64 / 2 + 4 + 2 * 64 / 2
    assert two - one == 64 / 2 * (2 * per_copy + 28)


def test_recompute_keeps_less():
    m1 = model_config("minimax-m1")
    layout = ParallelConfig(tensor_model_parallel_size=8, pipeline_model_parallel_size=8,
                            expert_model_parallel_size=8, sequence_parallel=True)
    none, selective, full = (plan.stage_plans(m1, layout, 512, 1, 8192, recompute=mode)[0].activations
                             for mode in ("none", "selective", "full"))
    assert full < selective < none
    first = plan.stage_plans(m1, layout, 512, 1, 8192, recompute="full")[0]
    # Full: 8 micro-batches x (10 layer inputs + RoPE tables + stage output) + one rebuilt lightning layer.
    checkpoint = 8192 * 2 * 6144 / 8
    stage = sum(item.none for item in first.stage_items)
    rebuilt = plan.activation_bytes(first.layer_items["L"], "none")
    assert first.activations == pytest.approx(8 * (10 * checkpoint + stage) + rebuilt, abs=1)


def test_fused_lm_head_drops_the_logits():
    m1 = model_config("minimax-m1")
    layout = ParallelConfig(tensor_model_parallel_size=8, pipeline_model_parallel_size=8,
                            expert_model_parallel_size=8, sequence_parallel=True)
    tokens, hidden, shard = 8192, 6144, 200_064 // 8
    unfused = plan.stage_plans(m1, layout, 512, 1, tokens, recompute="full")[7]
    fused = plan.stage_plans(m1, layout, 512, 1, tokens, recompute="full", fused_lm_head=True)[7]
    unfused_head = tokens * (4 * hidden / 8 + 3 * 4 * shard) + 4 * shard * hidden
    fused_head = tokens * (2 + 4) * hidden + 2 * 4 * shard * hidden + 2 * 64 * 2**20
    assert unfused.activations - fused.activations == pytest.approx(unfused_head - fused_head, abs=1)
    assert unfused_head > 2.5 * GIB  # three [8192, 25008] fp32 logits


def test_cli_prints_the_plan_and_exits_by_the_verdict(capsys):
    fits = ["--model", "tiny", "--tp", "2", "--pp", "2", "--ep", "2", "--dp", "2", "--sequence-parallel",
            "--seq-len", "64", "--distributed-optimizer"]
    assert plan.main(fits) == 0
    out = capsys.readouterr().out
    assert "tiny on 8 GPUs = TP 2 x PP 2 x DP 2; EP 2, expert TP 2, expert DP 1" in out
    assert "fits" in out and "each lightning layer" in out and "every stage: 0:" in out
    assert plan.main(fits + ["--gpu-memory-gb", "1"]) == 1
    assert "DOES NOT FIT" in capsys.readouterr().out


def test_rollout_cache_of_the_slots_by_hand(capsys):
    tiny = model_config("tiny")  # 8 layers, the last softmax; 4 heads of 16, 2 KV groups, vocabulary 512
    assert [tiny.layer_kind(i) for i in range(8)] == ["L"] * 7 + ["S"]
    # 100 tokens -> 125 positions (a quarter more); softmax K and V in bf16: 2 x 2 groups x 16 x 125 x 2 bytes;
    # lightning: 4 heads x 16 x 16 fp32; logits and the sampler's copies: 24 x 512 bytes.
    softmax, lightning, logits = 2 * 2 * 16 * 125 * 2, 4 * 16 * 16 * 4, 24 * 512
    assert plan.rollout_bytes(tiny, ParallelConfig(), 3, 100) == 3 * (softmax + 7 * lightning + logits)
    # PP = 2: the second stage holds the softmax layer; TP = 2 halves the heads and the groups.
    assert plan.rollout_bytes(tiny, ParallelConfig(pipeline_model_parallel_size=2), 3, 100) == (
        3 * (softmax + 3 * lightning + logits))
    assert plan.rollout_bytes(tiny, ParallelConfig(tensor_model_parallel_size=2), 3, 100) == (
        3 * (softmax // 2 + 7 * lightning // 2 + logits))
    # The cache grows with the slots, not with anything else.
    assert plan.rollout_bytes(tiny, ParallelConfig(), 6, 100) == 2 * plan.rollout_bytes(tiny, ParallelConfig(), 3, 100)
    arguments = ["--model", "tiny", "--seq-len", "64", "--rollout-slots", "3", "--rollout-length", "100"]
    assert plan.main(arguments) == 0
    assert "rollout: 3 slots x 100 tokens: cache 0.00 GiB per GPU" in capsys.readouterr().out
    big = ["--model", "minimax-m1", "--tp", "8", "--pp", "8", "--ep", "8", "--dp", "8", "--sequence-parallel",
           "--seq-len", "8192", "--recompute", "full", "--distributed-optimizer", "--rollout-length", "40000"]
    assert plan.main(big + ["--rollout-slots", "64"]) == 0
    assert plan.main(big + ["--rollout-slots", "2048"]) == 1
    assert "rollout: 2048 slots x 40000 tokens" in capsys.readouterr().out.splitlines()[-1]


@pytest.mark.parametrize(
    "arguments, message",
    [
        (["--tp", "2", "--dp", "2"], "needs parallel.sequence_parallel = true"),
        (["--dp", "-2"], "error: argument --dp: -2: give a whole number of at least 1"),
        (["--dp", "0"], "error: argument --dp: 0: give a whole number of at least 1"),
        (["--gpu-memory-gb", "nan"], "error: argument --gpu-memory-gb: nan: give a finite number of GiB >= 0"),
        (["--overhead-gb", "-1"], "error: argument --overhead-gb: -1: give a finite number of GiB >= 0"),
        # LoRA (--lora-rank, --lora-targets: tests/unit/test_plan_lora.py has the rest).
        (["--lora-rank", "-1"], "lora.rank = -1: use a positive rank, or 0 for no adapters."),
        (["--lora-targets", "q_proj"], "--lora-targets without --lora-rank"),
        (["--lora-rank", "4", "--lora-targets", "q_proj,lm_head"], "['lm_head']"),
        (["--model", "tiny-m2", "--lora-rank", "4", "--lora-targets", "out_proj"], "name no layer of this"),
        (["--lora-rank", "4", "--precision", "fp8"], "not under FP8"),
    ],
)
def test_cli_bad_input_exits_2_naming_the_argument(arguments, message, capsys):
    with pytest.raises(SystemExit) as exit_info:
        plan.main(["--model", "tiny", *arguments])
    assert exit_info.value.code == 2
    captured = capsys.readouterr()
    assert captured.out == "" and message in captured.err.strip().splitlines()[-1]


def test_estimate_matches_what_the_model_saves():
    """The per-layer items against torch's saved tensors of the real bf16 model (one process)."""
    compare_with_the_model({}, world_size=1)
