"""Per-GPU memory of a training layout: parameters, gradients, optimizer states, activations and a
fixed overhead, for the worst pipeline stage, and whether it fits.

    python tools/plan.py --model minimax-m1 --tp 8 --pp 8 --ep 8 --dp 8 --sequence-parallel \\
        --micro-batch 1 --seq-len 8192 --recompute full --precision bf16 --gpu-memory-gb 80 \\
        --distributed-optimizer

World size = TP x PP x CP x DP. Exit status 0 when the plan fits, 1 when it does not, 2 for bad
input: an impossible layout (the same checks and messages as start-up: parallel.layout.validate_layout)
or a bad argument. --longest replaces --seq-len by a binary search for the longest sequence, up to
the model's max_position_embeddings, that the layout fits, and prints the plan at that length (exit
status 1 when not even the shortest fits).
Memory is in GiB (2^30 bytes); an "80 GB" H100/H800 reports 81,559 MiB = 79.6 GiB to CUDA.

Parameters per GPU follow Megatron-Core's split. Dense parameters: the mixer projections are split
over TP (column-parallel qkv / gate / q / k / v, row-parallel out / o; the lightning output norm
over nh * d channels is TP-sharded), the layer RMSNorms and the MoE router are replicated on every
TP rank, and each pipeline stage holds L / PP consecutive layers. The embedding lives on the first
stage, the final norm and the untied LM head on the last (both vocabulary-split over TP). Experts:
E / EP experts per GPU, each split over expert TP (ETP, default = TP). Stages differ (which layers
are softmax, embedding vs LM head, micro-batches in flight): the plan reports the worst one.

Bytes per parameter (stated assumptions):
    weights     2     bf16 model weights, in both precisions. With fp8, Megatron's Transformer
                      Engine path keeps the bf16 weights and casts them to fp8 per GEMM; TE caches
                      that fp8 copy and its transpose across the micro-batches of a step (Megatron
                      passes is_first_microbatch), so the plan adds 2 bytes per GEMM weight (mixer
                      projections and experts; not norms, router, embedding or the fp32 LM head)
                      as "fp8 weight cache".
    gradients   4     the fp32 gradient buffer of Megatron's DDP with grad_reduce_in_fp32=True
                      (fp32 accumulation over micro-batches). Not sharded, even with the
                      distributed optimizer: the reduce-scatter writes into the same buffer.
    optimizer   12    fp32 master weights + Adam m and v. With the distributed optimizer dense
                      parameters are sharded over DP x CP = world / (TP x PP) (Megatron-Core's
                      data-parallel group with context parallelism) and expert parameters over the
                      expert-data-parallel size world / (EP x ETP x PP); without it, unsharded.

Activations: the tensors the forward keeps for the backward, itemized for one micro-batch of
T = micro_batch x seq_len / CP tokens on each rank from what this repository's modules save
(measured with torch.autograd.graph.saved_tensors_hooks on the tiny model;
tests/multiprocess/test_plan.py compares; the context-parallel items follow models/lightning_cp.py
and the Llama 3 all-gather scheme of models/softmax_cp.py, see "Context parallelism" below).
"/SP" means divided by TP under sequence parallelism; a = 2 bytes (bf16); g = bytes of a GEMM
input, a in bf16 and 1 in fp8 (Transformer Engine saves the fp8 cast of a GEMM's input).

    every layer     input and pre-MLP RMSNorm: fp32 input + normalized output + 1/rms, (4+a)H/SP each
                    mixer input, all-gathered over TP (the rank's whole T on every TP rank): gH
    lightning       qkv pre-activation a 3W/TP; q, k, v in fp32 for the kernel 12W/TP; one
                    [heads/TP, d, d] fp32 state per 1024-token chunk; sigmoid(gate) aW/TP; output
                    RMSNorm (4+a)W/TP; its output aW/TP; out_proj input gW/TP. No T x T scores:
                    the kernel keeps q, k, v and chunk states and recomputes block scores in backward.
    softmax         q, k, v after RoPE a(W + 2 W_kv)/TP (k, v of the whole sequence under CP);
                    SDPA output aW/TP and log-sum-exp
                    4 heads/TP; o_proj input gW/TP. Flash / memory-efficient SDPA keeps no T x T
                    scores (causal, no explicit mask: the trainer right-pads).
    MoE             router input aH/SP; routing (top-k ids and probs, scores, routing map)
                    (28k + 9E)/SP; per routed token copy (k e / SP copies per token after the
                    all-to-all and the expert-TP all-gather): expert input gH, fc1 output a 2I/e,
                    SwiGLU and probability-weighting intermediates 3aI/e + 4, fc2 input gI/e.
                    So MoE activations grow linearly with top-k, and ETP = TP stores the whole
                    expert input k x T x H on every TP rank.
    per stage       pipeline boundary tensors (received input, kept output) aH/SP each.
    last stage      final RMSNorm (4+a)H/SP and the fp32 LM head: unfused, the head's fp32 input
                    4H/SP, three [T, V/TP] fp32 logits tensors at the head's peak (the model's
                    output, the tempered copy the log-prob function saves, and one temporary of
                    the entropy metric or the logits gradient) and the fp32 weight copy
                    4 V/TP H; fused (parallel.vocab_parallel.lm_head_logprobs), the hidden states
                    aH and their fp32 gradient 4H per token, the fp32 weight copy and weight
                    gradient, two 64 MiB logits tiles, and the whole [T, V/TP] fp32 logits when
                    they fit in LOGITS_KEEP_BYTES (kept for the backward instead of recomputed).

Recompute:
    none        everything above.
    selective   Megatron's recompute_modules core_attn + layernorm + moe_act: RMSNorms keep only
                their input (aH/SP); the lightning core (SiLU, kernel, output norm, gating) is
                recomputed from the qkv pre-activation and sigmoid(gate); SDPA's output and
                log-sum-exp are recomputed from q, k, v; SwiGLU and the fc2 input are recomputed
                from the fc1 output. GEMM inputs stay.
    full        each layer keeps only its input aH/SP per micro-batch; during the backward one
                layer of one micro-batch is rebuilt (its "none" activations, counted once).

Context parallelism (--cp N): each sequence is padded to a multiple of 2 CP tokens and split into
2 CP chunks, each rank holding two (chunk i and chunk 2 CP - 1 - i, the causal load balancing), so
T above is micro_batch x seq_len / CP and every per-token tensor (norms, mixer input and
projections, MoE, pipeline boundaries, the RoPE tables of the rank's positions, the layer inputs
kept under full recompute, the LM head's hidden states and gradient) divides by CP. The fused LM
head's two logits tiles are of a fixed size; its fp32 weight copy and gradient are not per token.
Weights, gradients and optimizer states do not change: CP ranks hold the same weights, and the
distributed optimizer shards over DP x CP. On top of that, per layer and micro-batch sequence:
    lightning       the kernel runs the rank's two chunks as separate documents (its chunk states
                    are those of two sequences of seq_len / 2 CP tokens); the two entering states
                    [heads/TP, d, d] fp32 composed from the other ranks' chunks, and the fp32 query
                    scaled by the decay that adds them (4W/TP + 4 heads/TP per token: every token
                    of a document that began on an earlier chunk, all of them on a long
                    sequence); the 2 CP all-gathered chunk states, held during the layer. None of
                    this grows with the length beyond the per-token query.
    softmax         all_gather (parallel.context_parallel_comm): K and V are all-gathered over the
                    CP group, the layer keeps the WHOLE sequence's keys and values of its
                    kv_heads/TP heads, a 2 W_kv/TP per token of seq_len, not divided by CP (the
                    queries, the output and the log-sum-exp are the rank's); p2p (a ring, --cp-comm
                    p2p): the rank's own keys and values only, the blocks passing through are not
                    kept. Scores: none, as flash kernels keep them (models/softmax_cp.py).

Pipeline: 1F1B without interleaving; stage p holds min(PP - p, micro-batches) micro-batches in
flight, so the first stage holds PP and the last stage one (plus the LM head).
Fixed overhead (default 5 GiB): CUDA context and cuBLAS workspaces, NCCL buffers of the TP, PP,
EP and DP communicators, all-to-all and all-gather staging, allocator fragmentation.

Rollout (--rollout-slots N, --rollout-length L): the slot engine's cache for N sequences of up to L
tokens (rollout.max_running, data.max_prompt_tokens + rollout.max_new_tokens), as
megacispo.rollout.generate.rollout_cache_bytes counts it on the stage that holds the most: the softmax
layers' bf16 keys and values for 1.25 L positions (megacispo.rollout.generate.slot_capacity), the lightning
layers' fp32 [heads/TP, d, d] states, and the [N, V] logits with the sampler's copies (24 bytes a
number). Rollouts run between updates: the weights, gradients, optimizer states and overhead stay
resident, the training activations do not. The exit status also says whether that fits.

LoRA (--lora-rank r, --lora-targets; the run config's lora section, models/lora.py): the base
weights are frozen and stay, bf16, as above; each targeted linear W [out, in] gets A [r, in] and
B [out, r], bf16. Column-parallel linears (qkv_proj, output_gate, q/k/v_proj, the experts'
linear_fc1) split B over TP like W's rows and keep A whole on every TP rank; row-parallel ones
(out_proj, o_proj, linear_fc2) split A like W's columns and keep B whole. The experts' adapters are
their own (E / EP experts' on each GPU), split over expert TP as their weights are. Only the
adapters train: the fp32 gradient buffer (4 bytes) and the optimizer states (12 bytes, sharded as
above: mixer adapters over DP x CP, expert adapters over expert DP) count the adapters' parameters,
nothing for the frozen base (Megatron's DDP and optimizer skip parameters without requires_grad).
Activations add, per adapted linear and micro-batch, the bf16 product A x that B's backward needs:
[T, r] for a mixer's column-parallel projection (its input is all-gathered over TP), [T/SP, r] after
a row-parallel one's reduction over TP, [k e T/SP, r] for an expert linear (one row per routed
copy); the adapters' input is the tensor W's product already keeps (lora.dropout = 0 assumed: a
dropout would keep a masked copy of each input). Adapters run on Megatron's local linears, not
Transformer Engine's, so LoRA plans bf16 GEMMs only (--precision fp8 is refused, as at start-up).
A rollout multiplies the merged weights W + s B A (HybridModel.generation_dtype): it merges the weights it
stacks (q / k / v, qkv / gate, the experts') into their stacks, and makes a bf16 merged copy of the mixers'
output projections, which the rollout line adds to the resident memory.
"""

from __future__ import annotations

import argparse
import math
import sys
from dataclasses import dataclass

from megacispo.models.config import (
    LIGHTNING,
    LORA_EXPERT_TARGETS,
    LORA_LIGHTNING_TARGETS,
    LORA_SOFTMAX_TARGETS,
    LORA_TARGETS,
    MODEL_SIZES,
    RECOMPUTE_GRANULARITIES,
    SOFTMAX,
    HybridModelConfig,
    LoraConfig,
    lora_target_dims,
    model_config,
    model_shape,
)
from megacispo.models.lightning import CHUNK_TOKENS
from megacispo.parallel.layout import CONTEXT_PARALLEL_COMMS, ParallelConfig, validate_layout
from megacispo.parallel.vocab_parallel import LOGITS_KEEP_BYTES, LOGITS_TILE_BYTES
from megacispo.rollout.generate import rollout_cache_bytes
from megacispo.startup import bad_input_exits

GIB = 2**30
RECOMPUTE_MODES = RECOMPUTE_GRANULARITIES  # the run config's recompute.granularity names
PRECISIONS = ("bf16", "fp8")
WEIGHT_BYTES = 2
FP8_WEIGHT_CACHE_BYTES = 2  # TE's cached fp8 weight and its fp8 transpose
GRAD_BYTES = 4
OPTIMIZER_BYTES = 12  # fp32 master weight, Adam m, Adam v
ACTIVATION_BYTES = 2  # bf16
FP32 = 4
DEFAULT_OVERHEAD_GIB = 5.0
# LoRA targets on row-parallel linears (W split by input columns over TP: the adapter splits A); the
# other targets are column-parallel (W split by output rows: the adapter splits B).
LORA_ROW_PARALLEL = ("out_proj", "o_proj", "linear_fc2")
# The adapted weights a rollout copies merged, W + s B A, beside W: the mixers' output projections. It merges
# the others (q / k / v, qkv / gate, the experts') into the stacks it makes of them anyway
# (models/layers.py rollout_weight).
LORA_MERGED_COPIES = ("out_proj", "o_proj")


@dataclass(frozen=True)
class ActivationItem:
    """Bytes one micro-batch keeps for the backward in one part of the model."""

    name: str
    none: float
    """Without recompute."""
    selective: float
    """Under selective recompute."""


@dataclass(frozen=True)
class StageParams:
    """Parameters held by one GPU of a pipeline stage."""

    dense: int
    """Non-expert parameters (sharded over DP by the distributed optimizer)."""
    expert: int
    """Expert parameters (sharded over the expert-data-parallel ranks)."""
    gemm: int
    """Weights that go through fp8 GEMMs under Transformer Engine (mixer projections, experts)."""

    @property
    def total(self) -> int:
        return self.dense + self.expert

    def __add__(self, other: StageParams) -> StageParams:
        return StageParams(dense=self.dense + other.dense, expert=self.expert + other.expert,
                           gemm=self.gemm + other.gemm)


NO_PARAMS = StageParams(dense=0, expert=0, gemm=0)


@dataclass(frozen=True)
class MemoryPlan:
    """Per-GPU memory of one pipeline stage, in bytes."""

    stage: int
    """0-based pipeline stage."""
    num_stages: int
    """PP."""
    layer_kinds: str
    """One character per layer of this stage (L lightning, S softmax)."""
    first_layer: int
    """Global index of the stage's first layer."""
    params: StageParams
    """Parameters per GPU (the base model's; frozen under LoRA)."""
    lora_rank: int
    """The adapters' rank; 0: no LoRA, every parameter trains."""
    adapters: StageParams
    """LoRA's A and B per GPU (dense: the mixers', expert: the experts'); none without LoRA."""
    adapted: StageParams
    """The base weights per GPU that adapters sit on; none without LoRA."""
    merged: StageParams
    """The adapted weights per GPU that a rollout copies merged (LORA_MERGED_COPIES); none without LoRA."""
    data_parallel_size: int
    """DP = world / (TP x PP x CP), ParallelConfig.data_parallel_size."""
    context_parallel_size: int
    """CP, parallel.context_parallel_size: the ranks each sequence is split over; the distributed
    optimizer shards dense parameters over DP x CP."""
    expert_data_parallel_size: int
    """world / (EP x ETP x PP): the distributed optimizer's shards of expert parameters."""
    distributed_optimizer: bool
    """Optimizer states sharded over the (expert-)data-parallel ranks."""
    micro_batches_in_flight: int
    """Micro-batches whose activations this stage holds at its peak (1F1B)."""
    weights: int
    fp8_weight_cache: int
    gradients: int
    optimizer_states: int
    activations: int
    overhead: int
    capacity: int
    """Usable device memory."""
    layer_items: dict[str, tuple[ActivationItem, ...]]
    """Per layer kind present on the stage ('L', 'S'): the itemized activations of one micro-batch."""
    stage_items: tuple[ActivationItem, ...]
    """Stage-level activations of one micro-batch (RoPE tables, pipeline boundaries, final norm, LM head)."""

    @property
    def trainable(self) -> StageParams:
        """The parameters with gradients and optimizer states: the adapters under LoRA, else all."""
        return self.adapters if self.lora_rank else self.params

    @property
    def total(self) -> int:
        return (self.weights + self.fp8_weight_cache + self.gradients + self.optimizer_states + self.activations
                + self.overhead)

    @property
    def fits(self) -> bool:
        return self.total <= self.capacity


@dataclass(frozen=True)
class _Dims:
    """The sizes every formula needs, from the model, the layout and the batch."""

    model: HybridModelConfig
    tp: int
    etp: int
    sp: int  # TP under sequence parallelism, else 1: the split of the hidden states between layers
    cp: int
    ring: bool  # CP's softmax K and V round a ring (parallel.context_parallel_comm = p2p), not all-gathered
    row_len: int  # a sequence's tokens, padded to a multiple of 2 CP under context parallelism
    micro_batch: int
    gemm_input_bytes: int
    lora_rank: int  # 0: no adapters
    lora_targets: tuple[str, ...]

    @property
    def local_len(self) -> int:
        """Tokens of each sequence on this rank: its two zigzag chunks under CP."""
        return self.row_len // self.cp

    @property
    def tokens(self) -> int:
        """T: the micro-batch's tokens on this rank."""
        return self.micro_batch * self.local_len

    @property
    def routed_copies(self) -> float:
        """Rows of the expert input on this GPU: each local token (T / SP) is sent to k experts; after
        the all-to-all over EP (balanced routing) and the all-gather over expert TP a GPU computes its
        1/ETP slice of k * ETP copies per local token."""
        return self.tokens / self.sp * self.model.moe_router_topk * self.etp

    @property
    def width(self) -> int:
        return self.model.num_attention_heads * self.model.head_dim

    @property
    def kv_width(self) -> int:
        return self.model.num_query_groups * self.model.head_dim

    @property
    def vocab_shard(self) -> int:
        return -(-self.model.vocab_size // self.tp)


def row_length(seq_len: int, context_parallel_size: int) -> int:
    """A sequence's length as CP splits it: padded to a multiple of 2 CP (two chunks per rank)."""
    if context_parallel_size == 1:
        return seq_len
    chunks = 2 * context_parallel_size
    return -(-seq_len // chunks) * chunks


def stage_layers(model: HybridModelConfig, pipeline_size: int, stage: int) -> range:
    """Global indices of the consecutive layers of ``stage`` (Megatron's even split)."""
    per_stage = model.num_layers // pipeline_size
    return range(stage * per_stage, (stage + 1) * per_stage)


def layer_params(model: HybridModelConfig, kind: str, tp: int, ep: int, etp: int) -> StageParams:
    """Parameters one GPU holds of one layer of ``kind``."""
    hidden, width = model.hidden_size, model.num_attention_heads * model.head_dim
    kv_width = model.num_query_groups * model.head_dim
    if kind == LIGHTNING:
        projections = (3 * hidden * width + width * hidden + width * hidden) // tp  # qkv, gate, out
        mixer = projections + width // tp  # + the output RMSNorm over this rank's nh * d channels
    else:
        projections = (2 * hidden * width + 2 * hidden * kv_width) // tp  # q, o and k, v
        mixer = projections + ((width + kv_width) // tp if model.qk_norm else 0)  # M2's QK-norms, TP-sharded
    replicated = 2 * hidden + model.num_experts * hidden  # two RMSNorms, the router
    expert = (model.num_experts // ep) * 3 * hidden * model.moe_ffn_hidden_size // etp
    return StageParams(dense=mixer + replicated, expert=expert, gemm=projections + expert)


def layer_adapters(model: HybridModelConfig, kind: str, lora: LoraConfig, tp: int, ep: int,
                   etp: int) -> tuple[StageParams, StageParams, StageParams]:
    """LoRA on one GPU of one layer of ``kind``: (the adapters' A and B, the base weights they sit on, the
    adapted weights a rollout copies merged), each split into dense (the mixer's projections, over TP) and
    expert (E / EP experts' own, over expert TP). A column-parallel linear's adapter splits B, a row-parallel
    one's A."""
    dims = lora_target_dims(model)
    mixer_targets = LORA_LIGHTNING_TARGETS if kind == LIGHTNING else LORA_SOFTMAX_TARGETS
    counts = {"dense": [0, 0, 0], "expert": [0, 0, 0]}  # [adapters, adapted weights, merged copies]
    for target in lora.adapted_targets(model):
        if target in LORA_EXPERT_TARGETS:
            part, copies, split = "expert", model.num_experts // ep, etp
        elif target in mixer_targets:
            part, copies, split = "dense", 1, tp
        else:
            continue  # the other mixer kind's projection
        in_features, out_features = dims[target]
        if target in LORA_ROW_PARALLEL:
            a, b = lora.rank * in_features // split, out_features * lora.rank
        else:
            a, b = lora.rank * in_features, out_features // split * lora.rank
        counts[part][0] += copies * (a + b)
        counts[part][1] += copies * in_features * out_features // split
        if target in LORA_MERGED_COPIES:
            counts[part][2] += copies * in_features * out_features // split
    return tuple(StageParams(dense=dense, expert=expert, gemm=0 if what == 0 else dense + expert)
                 for what, (dense, expert) in enumerate(zip(counts["dense"], counts["expert"])))


def stage_params(model: HybridModelConfig, parallel: ParallelConfig, stage: int) -> StageParams:
    """Parameters one GPU of pipeline ``stage`` holds."""
    tp, pp = parallel.tensor_model_parallel_size, parallel.pipeline_model_parallel_size
    params = sum((layer_params(model, model.layer_kind(layer), tp, parallel.expert_model_parallel_size,
                               parallel.expert_tp) for layer in stage_layers(model, pp, stage)), NO_PARAMS)
    vocab_shard = -(-model.vocab_size // tp) * model.hidden_size
    if stage == 0:
        params += StageParams(dense=vocab_shard, expert=0, gemm=0)  # embedding
    if stage == pp - 1:
        params += StageParams(dense=model.hidden_size + vocab_shard, expert=0, gemm=0)  # final RMSNorm, LM head
    return params


def stage_adapters(model: HybridModelConfig, parallel: ParallelConfig, stage: int,
                   lora: LoraConfig) -> tuple[StageParams, StageParams, StageParams]:
    """LoRA on one GPU of pipeline ``stage``: (the adapters, the base weights they sit on, the merged copies
    a rollout makes), as ``layer_adapters`` counts them for each of its layers."""
    layers = [layer_adapters(model, model.layer_kind(layer), lora, parallel.tensor_model_parallel_size,
                             parallel.expert_model_parallel_size, parallel.expert_tp)
              for layer in stage_layers(model, parallel.pipeline_model_parallel_size, stage)]
    return tuple(sum(parts, NO_PARAMS) for parts in zip(*layers))


def _common_items(dims: _Dims) -> list[ActivationItem]:
    hidden, tokens, sp = dims.model.hidden_size, dims.tokens, dims.sp
    norm = tokens * ((FP32 + ACTIVATION_BYTES) * hidden + FP32) / sp
    norm_input = tokens * ACTIVATION_BYTES * hidden / sp
    mixer_input = tokens * dims.gemm_input_bytes * hidden
    return [
        ActivationItem("input RMSNorm", norm, norm_input),
        ActivationItem("pre-MLP RMSNorm", norm, norm_input),
        ActivationItem("mixer input (all-gathered over TP)", mixer_input, mixer_input),
    ]


def _lightning_items(dims: _Dims) -> list[ActivationItem]:
    model, tokens, a, g = dims.model, dims.tokens, ACTIVATION_BYTES, dims.gemm_input_bytes
    local_width, local_heads = dims.width / dims.tp, model.num_attention_heads // dims.tp
    state = local_heads * model.head_dim**2 * FP32  # one [heads/TP, d, d] fp32 state
    # Under CP the kernel runs the rank's two zigzag chunks as two documents.
    pieces = 1 if dims.cp == 1 else 2
    blocks = -(-dims.local_len // pieces // model.lightning_block_size)
    chunks = pieces * -(-blocks // max(1, CHUNK_TOKENS // model.lightning_block_size))
    items = [
        ActivationItem("qkv pre-activation", tokens * a * 3 * local_width, tokens * a * 3 * local_width),
        ActivationItem("q, k, v in fp32 (kernel input)", tokens * FP32 * 3 * local_width, 0),
        ActivationItem("kernel chunk states", dims.micro_batch * chunks * state, 0),
    ]
    if dims.cp > 1:
        carried_query = tokens * FP32 * (local_width + local_heads)
        items += [
            ActivationItem("CP: entering states of the 2 chunks", dims.micro_batch * 2 * state, 0),
            ActivationItem("CP: decayed query of the carried tokens", carried_query, 0),
            ActivationItem(f"CP: all-gathered chunk states (2 CP = {2 * dims.cp})",
                           dims.micro_batch * 2 * dims.cp * state, 0),
        ]
    return items + [
        ActivationItem("sigmoid(gate)", tokens * a * local_width, tokens * a * local_width),
        ActivationItem("output RMSNorm", tokens * ((FP32 + a) * local_width + FP32), 0),
        ActivationItem("output RMSNorm result (gating operand)", tokens * a * local_width, 0),
        ActivationItem("out_proj input", tokens * g * local_width, tokens * g * local_width),
    ]


def _softmax_items(dims: _Dims) -> list[ActivationItem]:
    model, tokens, a, g = dims.model, dims.tokens, ACTIVATION_BYTES, dims.gemm_input_bytes
    local_width, local_kv_width = dims.width / dims.tp, dims.kv_width / dims.tp
    local_heads = model.num_attention_heads / dims.tp
    query = tokens * a * local_width
    # All-gathered under CP, every rank keeps the whole sequence's keys and values; a ring keeps its own.
    if dims.cp == 1 or dims.ring:
        keys_values, kv_name = tokens * a * 2 * local_kv_width, "k, v after RoPE"
    else:
        keys_values = dims.micro_batch * dims.row_len * a * 2 * local_kv_width
        kv_name = "CP: k, v of the whole sequence (all-gathered)"
    qk_norm = []
    if model.qk_norm:
        projected = tokens * a * (local_width + local_kv_width)
        qk_norm = [ActivationItem("QK-norm inputs (q, k projections) and 1/rms", projected + tokens * FP32 * 2, 0)]
    return qk_norm + [
        ActivationItem("q after RoPE (attention input)", query, query),
        ActivationItem(kv_name, keys_values, keys_values),
        ActivationItem("SDPA output and log-sum-exp", tokens * (a * local_width + FP32 * local_heads), 0),
        ActivationItem("o_proj input", tokens * g * local_width, tokens * g * local_width),
    ]


def _moe_items(dims: _Dims) -> list[ActivationItem]:
    model, a, g = dims.model, ACTIVATION_BYTES, dims.gemm_input_bytes
    hidden, ffn, topk, experts = model.hidden_size, model.moe_ffn_hidden_size, model.moe_router_topk, model.num_experts
    local_tokens, copies = dims.tokens / dims.sp, dims.routed_copies
    router_input = local_tokens * a * hidden
    routing = local_tokens * (28 * topk + 9 * experts)  # int64 ids x2 + fp32 probs; fp32 scores, bool map + fp32 probs
    expert_input = copies * g * hidden
    fc1_output = copies * a * 2 * ffn / dims.etp
    return [
        ActivationItem("router input", router_input, router_input),
        ActivationItem("routing (top-k ids, probs, scores, map)", routing, routing),
        ActivationItem("expert input (k copies per token)", expert_input, expert_input),
        ActivationItem("expert fc1 output", fc1_output, fc1_output),
        ActivationItem("SwiGLU and prob-weighting", copies * (3 * a * ffn / dims.etp + FP32), 0),
        ActivationItem("expert fc2 input", copies * g * ffn / dims.etp, 0),
    ]


def _lora_items(dims: _Dims, kind: str) -> list[ActivationItem]:
    """What a layer's adapters add (none without LoRA): each adapted linear keeps its bf16 [rows, r]
    product A x for B's backward, with the rows of the tensor it is in: T for a mixer's
    column-parallel projection (all-gathered input), T / SP after a row-parallel one's reduction, the
    routed copies for an expert linear. Their input is the one W's product keeps."""
    if not dims.lora_rank:
        return []
    mixer_targets = LORA_LIGHTNING_TARGETS if kind == LIGHTNING else LORA_SOFTMAX_TARGETS
    rows = 0.0
    for target in dims.lora_targets:
        if target in LORA_EXPERT_TARGETS:
            rows += dims.routed_copies
        elif target in mixer_targets:
            rows += dims.tokens / dims.sp if target in LORA_ROW_PARALLEL else dims.tokens
    kept = rows * ACTIVATION_BYTES * dims.lora_rank
    return [ActivationItem(f"LoRA: adapters' A x (rank {dims.lora_rank})", kept, kept)] if rows else []


def layer_activation_items(dims: _Dims, kind: str) -> tuple[ActivationItem, ...]:
    """What one layer of ``kind`` keeps for the backward, for one micro-batch."""
    mixer = _lightning_items(dims) if kind == LIGHTNING else _softmax_items(dims)
    return tuple(_common_items(dims) + mixer + _moe_items(dims) + _lora_items(dims, kind))


def _stage_items(
    dims: _Dims, stage: int, kinds: str, num_stages: int, fused_lm_head: bool
) -> tuple[ActivationItem, ...]:
    """Stage-level activations of one micro-batch: RoPE tables, pipeline boundary tensors, final
    norm and LM head."""
    hidden, tokens, sp = dims.model.hidden_size, dims.tokens, dims.sp
    boundary = tokens * ACTIVATION_BYTES * hidden / sp
    items = []
    if SOFTMAX in kinds:
        rope = tokens * 2 * FP32 * dims.model.rotary_dim  # cos and sin, shared by the stage's softmax layers
        items.append(ActivationItem("RoPE cos and sin", rope, rope))
    if stage > 0:
        items.append(ActivationItem("received stage input", boundary, boundary))
    if stage < num_stages - 1:
        items.append(ActivationItem("stage output kept for the backward send", boundary, boundary))
    if stage == num_stages - 1:
        norm = tokens * ((FP32 + ACTIVATION_BYTES) * hidden + FP32) / sp
        items.append(ActivationItem("final RMSNorm", norm, tokens * ACTIVATION_BYTES * hidden / sp))
        head = _lm_head_bytes(dims, fused_lm_head)
        items.append(ActivationItem(f"LM head ({'fused' if fused_lm_head else 'fp32 logits'})", head, head))
    return tuple(items)


def _lm_head_bytes(dims: _Dims, fused: bool) -> float:
    """Peak bytes of the fp32 LM head and log-probs: the unfused head holds [T, V/TP] fp32 logits
    (three at once, see the module docstring), the fused one a GPU tile at a time (and all of them,
    kept for the backward, when they fit in LOGITS_KEEP_BYTES)."""
    hidden, tokens = dims.model.hidden_size, dims.tokens
    weight_copy = FP32 * dims.vocab_shard * hidden
    if fused:
        logits = FP32 * tokens * dims.vocab_shard
        kept = logits if logits <= LOGITS_KEEP_BYTES else 0
        return tokens * (ACTIVATION_BYTES + FP32) * hidden + 2 * weight_copy + 2 * LOGITS_TILE_BYTES["cuda"] + kept
    return tokens * (FP32 * hidden / dims.sp + 3 * FP32 * dims.vocab_shard) + weight_copy


def activation_bytes(items: tuple[ActivationItem, ...], recompute: str) -> float:
    """Bytes of ``items`` under ``recompute`` none or selective (full recompute is per stage)."""
    return sum(item.selective if recompute == "selective" else item.none for item in items)


def _stage_activations(
    dims: _Dims, kinds: str, layer_items: dict, stage_items: tuple, recompute: str, in_flight: int
) -> int:
    """Peak activation bytes of a stage holding ``in_flight`` micro-batches."""
    head_and_boundaries = activation_bytes(stage_items, "none" if recompute == "full" else recompute)
    if recompute == "full":
        checkpoints = len(kinds) * dims.tokens * ACTIVATION_BYTES * dims.model.hidden_size / dims.sp
        rebuilt_layer = max(activation_bytes(layer_items[kind], "none") for kind in set(kinds))
        return math.ceil(in_flight * (checkpoints + head_and_boundaries) + rebuilt_layer)
    layers = sum(activation_bytes(layer_items[kind], recompute) for kind in kinds)
    return math.ceil(in_flight * (layers + head_and_boundaries))


def _check_arguments(micro_batch: int, seq_len: int, recompute: str, precision: str,
                     num_microbatches: int | None, lora: LoraConfig | None) -> None:
    if micro_batch < 1:
        raise ValueError(f"micro_batch = {micro_batch}: it must be at least 1 sequence.")
    if seq_len < 1:
        raise ValueError(f"seq_len = {seq_len}: it must be at least 1 token.")
    if recompute not in RECOMPUTE_MODES:
        raise ValueError(f"recompute = {recompute!r}: choose one of {', '.join(RECOMPUTE_MODES)}.")
    if precision not in PRECISIONS:
        raise ValueError(f"precision = {precision!r}: choose one of {', '.join(PRECISIONS)}.")
    if num_microbatches is not None and num_microbatches < 1:
        raise ValueError(f"num_microbatches = {num_microbatches}: it must be at least 1 (or None: at least PP).")
    if lora is not None and lora.enabled and precision == "fp8":
        raise ValueError(f"lora.rank = {lora.rank} with precision = 'fp8': adapters sit on Megatron's local linears, "
                         "not Transformer Engine's (and so not under FP8); plan precision bf16, or lora.rank 0")


def stage_plans(
    model: HybridModelConfig,
    parallel: ParallelConfig,
    world_size: int,
    micro_batch: int,
    seq_len: int,
    recompute: str = "none",
    precision: str = "bf16",
    *,
    distributed_optimizer: bool = True,
    fused_lm_head: bool = False,
    num_microbatches: int | None = None,
    overhead_bytes: int = int(DEFAULT_OVERHEAD_GIB * GIB),
    capacity_bytes: int = 80 * GIB,
    lora: LoraConfig | None = None,
) -> list[MemoryPlan]:
    """The memory plan of every pipeline stage (see the module docstring for the accounting).

    num_microbatches: micro-batches per optimizer step and data-parallel rank; None assumes at
    least PP (1F1B's steady state). Context parallelism is parallel.context_parallel_size (CP, the
    ranks each sequence is split over; world_size = TP x PP x CP x DP). lora: LoRA's adapters on a
    frozen base (None or rank 0: every parameter trains). Raises ValueError for an impossible layout
    (validate_layout's message) or a bad argument (LoraConfig.check_model's for adapters the model
    cannot take).
    """
    _check_arguments(micro_batch, seq_len, recompute, precision, num_microbatches, lora)
    validate_layout(parallel, world_size, model_shape(model))
    if lora is not None and not lora.enabled:
        lora = None
    if lora is not None:
        lora.check_model(model)
    tp, pp = parallel.tensor_model_parallel_size, parallel.pipeline_model_parallel_size
    cp = parallel.context_parallel_size
    dims = _Dims(
        model=model, tp=tp, etp=parallel.expert_tp, sp=tp if parallel.sequence_parallel else 1,
        cp=cp, ring=parallel.context_parallel_comm == "p2p", row_len=row_length(seq_len, cp), micro_batch=micro_batch,
        gemm_input_bytes=1 if precision == "fp8" else ACTIVATION_BYTES,
        lora_rank=lora.rank if lora else 0,
        lora_targets=tuple(lora.adapted_targets(model)) if lora else (),
    )
    dp = parallel.data_parallel_size(world_size)
    # Megatron-Core's data-parallel group with CP: the gradients reduce, and the optimizer shards, over DP x CP.
    dp_with_cp = dp * cp
    expert_dp = world_size // (parallel.expert_model_parallel_size * parallel.expert_tp * pp)
    layer_items = {kind: layer_activation_items(dims, kind) for kind in (LIGHTNING, SOFTMAX)}
    plans = []
    for stage in range(pp):
        layers = stage_layers(model, pp, stage)
        kinds = "".join(model.layer_kind(i) for i in layers)
        params = stage_params(model, parallel, stage)
        adapters, adapted, merged = stage_adapters(model, parallel, stage, lora) if lora else (NO_PARAMS,) * 3
        trainable = adapters if lora else params
        in_flight = min(pp - stage, num_microbatches or pp)
        items = _stage_items(dims, stage, kinds, pp, fused_lm_head)
        optimizer_shards = (dp_with_cp, expert_dp) if distributed_optimizer else (1, 1)
        plans.append(MemoryPlan(
            stage=stage, num_stages=pp, layer_kinds=kinds, first_layer=layers.start, params=params,
            lora_rank=lora.rank if lora else 0, adapters=adapters, adapted=adapted, merged=merged,
            data_parallel_size=dp, context_parallel_size=cp, expert_data_parallel_size=expert_dp,
            distributed_optimizer=distributed_optimizer, micro_batches_in_flight=in_flight,
            weights=WEIGHT_BYTES * (params.total + adapters.total),
            fp8_weight_cache=FP8_WEIGHT_CACHE_BYTES * params.gemm if precision == "fp8" else 0,
            gradients=GRAD_BYTES * trainable.total,
            optimizer_states=math.ceil(OPTIMIZER_BYTES * (trainable.dense / optimizer_shards[0]
                                                         + trainable.expert / optimizer_shards[1])),
            activations=_stage_activations(dims, kinds, layer_items, items, recompute, in_flight),
            overhead=overhead_bytes, capacity=capacity_bytes,
            layer_items={kind: layer_items[kind] for kind in sorted(set(kinds))}, stage_items=items,
        ))
    return plans


def memory_plan(model: HybridModelConfig, parallel: ParallelConfig, world_size: int, micro_batch: int,
                seq_len: int, recompute: str = "none", precision: str = "bf16", **options) -> MemoryPlan:
    """The plan of the pipeline stage that needs the most memory (arguments as ``stage_plans``)."""
    return max(stage_plans(model, parallel, world_size, micro_batch, seq_len, recompute, precision, **options),
               key=lambda plan: plan.total)


def longest_sequence(model: HybridModelConfig, parallel: ParallelConfig, world_size: int, micro_batch: int,
                     recompute: str = "none", precision: str = "bf16", *, fused_lm_head: bool = False,
                     **options) -> int:
    """The longest sequence, up to model.max_position_embeddings tokens, whose worst pipeline stage
    fits (arguments as ``stage_plans``); 0 when not even one token does. A binary search: memory
    grows with the length, except that the fused LM head drops its kept logits once they outgrow
    LOGITS_KEEP_BYTES, so the lengths above that point are searched first."""
    def fits(seq_len: int) -> bool:
        return memory_plan(model, parallel, world_size, micro_batch, seq_len, recompute, precision,
                           fused_lm_head=fused_lm_head, **options).fits

    # The layout first: the kept logits' bound below divides by CP.
    validate_layout(parallel, world_size, model_shape(model))
    limit = model.max_position_embeddings
    cp = parallel.context_parallel_size
    kept_up_to = 0
    if fused_lm_head:
        vocab_shard = -(-model.vocab_size // parallel.tensor_model_parallel_size)

        def keeps_logits(seq_len: int) -> bool:
            tokens = micro_batch * row_length(seq_len, cp) // cp
            return FP32 * tokens * vocab_shard <= LOGITS_KEEP_BYTES

        kept_up_to = _last_true(keeps_logits, 1, limit)
    longest = _last_true(fits, kept_up_to + 1, limit)
    return longest if longest > kept_up_to else _last_true(fits, 1, kept_up_to)


def _last_true(predicate, low: int, high: int) -> int:
    """The largest n in [low, high] with predicate(n), for a predicate true up to some n and false
    after it; low - 1 when predicate(low) is false (or low > high)."""
    if low > high or not predicate(low):
        return low - 1
    while low < high:
        middle = (low + high + 1) // 2
        if predicate(middle):
            low = middle
        else:
            high = middle - 1
    return low


def rollout_bytes(model: HybridModelConfig, parallel: ParallelConfig, slots: int, max_length: int) -> int:
    """The rollout cache (``rollout_cache_bytes``, bf16 keys and values) of ``slots`` sequences of up to
    ``max_length`` tokens on the GPU of the pipeline stage that holds the most."""
    pp = parallel.pipeline_model_parallel_size
    return max(
        rollout_cache_bytes(model, stage_layers(model, pp, stage), slots=slots, max_length=max_length,
                            tensor_parallel=parallel.tensor_model_parallel_size, kv_bytes=ACTIVATION_BYTES)
        for stage in range(pp)
    )


def rollout_summary(plan: MemoryPlan, cache_bytes: int, slots: int, max_length: int) -> tuple[str, bool]:
    """The rollout line of the report for ``plan``'s stage, and whether the rollout fits: the cache
    next to what stays resident between updates (weights, gradients, optimizer states, overhead) and,
    under LoRA, the merged copies W + s B A of the mixers' output projections (LORA_MERGED_COPIES)."""
    resident = plan.weights + plan.fp8_weight_cache + plan.gradients + plan.optimizer_states + plan.overhead
    merged = WEIGHT_BYTES * plan.merged.total
    total = resident + merged + cache_bytes
    fits = total <= plan.capacity
    with_merged = f", LoRA's merged weights {gib(merged)}" if merged else ""
    line = (f"rollout: {slots} slots x {max_length} tokens: cache {gib(cache_bytes)} per GPU; with the resident "
            f"{gib(resident)}{with_merged}: {gib(total)} of {gib(plan.capacity)}: "
            + ("fits" if fits else "DOES NOT FIT"))
    return line, fits


def longest_line(longest: int, context_parallel_size: int, limit: int) -> str:
    """The report's verdict of --longest."""
    if not longest:
        return "longest sequence that fits: none (not even 1 token; the plan above is for 1)"
    per_rank = row_length(longest, context_parallel_size) // context_parallel_size
    where = f" ({per_rank:,} on each of the {context_parallel_size} CP ranks)" if context_parallel_size > 1 else ""
    bound = "the model's limit," if longest == limit else "searched up to"
    return f"longest sequence that fits: {longest:,} tokens{where}; {bound} model.max_position_embeddings = {limit:,}"


def human(count: int) -> str:
    """456.1B, 29.7M, 1.1K: one decimal in the largest unit that keeps the number >= 1."""
    for unit, scale in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if count >= scale:
            return f"{count / scale:.1f}{unit}"
    return str(count)


def gib(num_bytes: float) -> str:
    return f"{num_bytes / GIB:.2f} GiB"


def mib(num_bytes: float) -> str:
    return f"{num_bytes / 2**20:.1f} MiB"


def summary(plan: MemoryPlan, all_stages: list[MemoryPlan] | None = None) -> str:
    """The readable report: the worst stage's components, its activation items, every stage's total."""
    params, adapters, trainable = plan.params, plan.adapters, plan.trainable
    last_layer = plan.first_layer + len(plan.layer_kinds) - 1
    holds = [name for name, present in (("embedding", plan.stage == 0), ("LM head", plan.stage == plan.num_stages - 1))
             if present]
    lines = [
        f"worst pipeline stage: {plan.stage} of {plan.num_stages} (layers {plan.first_layer}-{last_layer}: "
        f"{plan.layer_kinds.count(LIGHTNING)} lightning, {plan.layer_kinds.count(SOFTMAX)} softmax"
        + (f"; {', '.join(holds)}" if holds else "") + ")",
        f"  parameters per GPU  {params.total:>14,}  ({human(params.total)}: dense {human(params.dense)}, "
        f"expert {human(params.expert)})" + (" frozen" if plan.lora_rank else ""),
    ]
    if plan.lora_rank:
        lines.append(f"  LoRA adapters       {adapters.total:>14,}  ({human(adapters.total)}: dense "
                     f"{human(adapters.dense)}, expert {human(adapters.expert)}; rank {plan.lora_rank} on "
                     f"{human(plan.adapted.total)} weights) trained")
    lines += [
        f"  weights             {gib(plan.weights):>12}  (bf16, 2 bytes/param)",
    ]
    if plan.fp8_weight_cache:
        lines.append(f"  fp8 weight cache    {gib(plan.fp8_weight_cache):>12}  (TE's fp8 copy and transpose of the "
                     f"{human(params.gemm)} GEMM weights)")
    lines += [
        f"  gradients           {gib(plan.gradients):>12}  (fp32 buffer, 4 bytes/param"
        + (f" of the {human(trainable.total)} adapter params)" if plan.lora_rank else ")"),
        f"  optimizer states    {gib(plan.optimizer_states):>12}  (fp32 master + Adam m, v = 12 bytes/"
        + ("adapter param; " if plan.lora_rank else "param; ")
        + (f"dense / {_dense_shards(plan)}, experts / expert DP {plan.expert_data_parallel_size})"
           if plan.distributed_optimizer else "not sharded)"),
        f"  activations         {gib(plan.activations):>12}  (micro-batches in flight: "
        f"{plan.micro_batches_in_flight})",
        f"  fixed overhead      {gib(plan.overhead):>12}",
        f"  total               {gib(plan.total):>12}  of {gib(plan.capacity)}: "
        + ("fits" if plan.fits else "DOES NOT FIT") + f" ({gib(abs(plan.capacity - plan.total))} "
        + ("free)" if plan.fits else "over)"),
    ]
    lines += activation_table(plan)
    if all_stages and len(all_stages) > 1:
        lines.append("every stage: " + ", ".join(f"{p.stage}: {gib(p.total)}" for p in all_stages))
    return "\n".join(lines)


def _dense_shards(plan: MemoryPlan) -> str:
    """The distributed optimizer's shards of dense parameters, as the report names them."""
    cp = plan.context_parallel_size
    if cp == 1:
        return f"DP {plan.data_parallel_size}"
    return f"DP x CP {plan.data_parallel_size * cp}"


def activation_table(plan: MemoryPlan) -> list[str]:
    """The itemized activations of one micro-batch: each layer kind of the stage, then the stage's own."""
    def row(name: str, none: float, selective: float, indent: int) -> str:
        return f"{' ' * indent}{name:<{48 - indent}} {mib(none):>12} | {mib(selective)}"

    lines = ["activations of one micro-batch (no recompute | selective):"]
    for kind, items in plan.layer_items.items():
        title = "each lightning layer" if kind == LIGHTNING else "each softmax layer"
        lines.append(row(title, activation_bytes(items, "none"), activation_bytes(items, "selective"), 2))
        lines += [row(item.name, item.none, item.selective, 4) for item in items]
    if plan.stage_items:
        lines.append("  this stage")
        lines += [row(item.name, item.none, item.selective, 4) for item in plan.stage_items]
    return lines


def _at_least_one(text: str) -> int:
    """argparse type of --dp, which no layout check sees (the world size is computed from it)."""
    if not text.isdecimal() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"{text}: give a whole number of at least 1")
    return int(text)


def _gib(text: str) -> float:
    """argparse type of a memory size: a finite number of GiB >= 0."""
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not 0 <= value < math.inf:
        raise argparse.ArgumentTypeError(f"{text}: give a finite number of GiB >= 0")
    return value


def _names(text: str) -> list[str]:
    """argparse type of a comma-separated list of names."""
    return [name.strip() for name in text.split(",") if name.strip()]


def lora_config(rank: int, targets: list[str] | None) -> LoraConfig | None:
    """The LoRA of --lora-rank and --lora-targets (default: every target the model has); None for rank 0.
    Raises LoraConfig's ValueError for a bad rank or target."""
    if not rank:
        if targets is not None:
            raise ValueError("--lora-targets without --lora-rank: give the adapters' rank, --lora-rank N > 0")
        return None
    return LoraConfig(rank=rank) if targets is None else LoraConfig(rank=rank, targets=targets)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    model = parser.add_argument_group("model")
    model.add_argument("--model", default="minimax-m1", choices=sorted(MODEL_SIZES), help="model size")
    layout = parser.add_argument_group("parallel layout (world size = TP x PP x CP x DP)")
    layout.add_argument("--tp", type=int, default=1, help="tensor-parallel size")
    layout.add_argument("--pp", type=int, default=1, help="pipeline-parallel size")
    layout.add_argument("--ep", type=int, default=1, help="expert-parallel size")
    layout.add_argument("--etp", type=int, default=None, help="expert tensor-parallel size (default: TP)")
    layout.add_argument("--cp", type=int, default=1,
                        help="context-parallel size (parallel.context_parallel_size): each sequence is split over "
                             "this many ranks")
    layout.add_argument("--cp-comm", default="all_gather", choices=CONTEXT_PARALLEL_COMMS,
                        help="parallel.context_parallel_comm: how softmax layers see the other CP ranks' keys")
    layout.add_argument("--dp", type=_at_least_one, default=1, help="data-parallel size")
    layout.add_argument("--sequence-parallel", action="store_true", help="shard norms and residuals over TP")
    batch = parser.add_argument_group("batch")
    batch.add_argument("--micro-batch", type=int, default=1, help="sequences per micro-batch")
    length = batch.add_mutually_exclusive_group()
    length.add_argument("--seq-len", type=int, default=8192, help="tokens per sequence (prompt + response)")
    length.add_argument("--longest", action="store_true",
                        help="search the longest sequence the layout fits (up to model.max_position_embeddings) "
                             "and plan it")
    batch.add_argument("--num-microbatches", type=int, default=None,
                       help="micro-batches per step and DP rank (default: at least PP, 1F1B's steady state)")
    memory = parser.add_argument_group("memory")
    memory.add_argument("--recompute", default="none", choices=RECOMPUTE_MODES,
                        help="activation recompute, the run config's recompute.granularity")
    memory.add_argument("--precision", default="bf16", choices=PRECISIONS,
                        help="GEMM precision, fp8 when the run config sets precision.fp8 (weights stay bf16)")
    memory.add_argument("--distributed-optimizer", action="store_true",
                        help="shard optimizer states over the (expert-)data-parallel ranks")
    memory.add_argument("--fused-lm-head", action="store_true",
                        help="tiled fp32 LM head (holds [tokens, V/TP] logits only when they are small)")
    memory.add_argument("--gpu-memory-gb", type=_gib, default=80.0, help="usable device memory, GiB")
    memory.add_argument("--overhead-gb", type=_gib, default=DEFAULT_OVERHEAD_GIB,
                        help="fixed overhead: CUDA context, NCCL buffers, fragmentation; GiB")
    rollout = parser.add_argument_group("rollout")
    rollout.add_argument("--rollout-slots", type=_at_least_one, default=None,
                         help="sequences decoded together per GPU (rollout.max_running); default: no rollout plan")
    rollout.add_argument("--rollout-length", type=_at_least_one, default=None,
                         help="longest prompt + response, tokens (default: the plan's sequence length)")
    lora = parser.add_argument_group("LoRA")
    lora.add_argument("--lora-rank", type=int, default=0, metavar="N",
                      help="lora.rank: train rank-N adapters on the frozen base (0: no LoRA, every weight trains)")
    lora.add_argument("--lora-targets", type=_names, default=None, metavar="T,...",
                      help=f"lora.targets, comma-separated, among {', '.join(LORA_TARGETS)} "
                           "(default: every one the model has)")
    return parser.parse_args(argv)


def describe_run(args: argparse.Namespace, plan: MemoryPlan, world_size: int, seq_len: int,
                 lora: LoraConfig | None = None, model: HybridModelConfig | None = None) -> str:
    """The layout and batch the plan is for, as two lines (three with LoRA, on ``model``'s linears)."""
    context = plan.context_parallel_size
    cp = f" x CP {context}" if context > 1 else ""
    per_rank = f" ({row_length(seq_len, context) // context} on each CP rank)" if context > 1 else ""
    return (
        f"{args.model} on {world_size} GPUs = TP {args.tp} x PP {args.pp}{cp} x DP {plan.data_parallel_size}; "
        f"EP {args.ep}, expert TP {args.etp or args.tp}, expert DP {plan.expert_data_parallel_size}; "
        f"sequence parallel {'on' if args.sequence_parallel else 'off'}\n"
        f"micro-batch {args.micro_batch} x {seq_len} tokens{per_rank}, recompute {args.recompute}, precision "
        f"{args.precision}, distributed optimizer {'on' if args.distributed_optimizer else 'off'}, LM head "
        f"{'fused' if args.fused_lm_head else 'unfused (fp32 logits)'}"
        + (f"\nLoRA rank {plan.lora_rank} on {', '.join(lora.adapted_targets(model))}; the base frozen"
           if lora else "")
    )


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    model = model_config(args.model)
    parallel = ParallelConfig(
        tensor_model_parallel_size=args.tp, pipeline_model_parallel_size=args.pp,
        expert_model_parallel_size=args.ep, expert_tensor_parallel_size=args.etp,
        sequence_parallel=args.sequence_parallel, context_parallel_size=args.cp, context_parallel_comm=args.cp_comm,
    )
    world_size = parallel.model_parallel_size * args.dp
    seq_len = args.seq_len
    with bad_input_exits():
        lora = lora_config(args.lora_rank, args.lora_targets)
        options = dict(
            distributed_optimizer=args.distributed_optimizer, fused_lm_head=args.fused_lm_head,
            num_microbatches=args.num_microbatches,
            overhead_bytes=int(args.overhead_gb * GIB), capacity_bytes=int(args.gpu_memory_gb * GIB), lora=lora,
        )
        if args.longest:
            longest = longest_sequence(model, parallel, world_size, args.micro_batch, args.recompute, args.precision,
                                       **options)
            seq_len = max(longest, 1)
        plans = stage_plans(model, parallel, world_size, args.micro_batch, seq_len, args.recompute, args.precision,
                            **options)
    worst = max(plans, key=lambda plan: plan.total)
    print(describe_run(args, worst, world_size, seq_len, lora, model))
    print(summary(worst, plans))
    if args.longest:
        print(longest_line(longest, parallel.context_parallel_size, model.max_position_embeddings))
    rollout_fits = True
    if args.rollout_slots is not None:
        length = args.rollout_length or seq_len
        cache = rollout_bytes(model_config(args.model), parallel, args.rollout_slots, length)
        line, rollout_fits = rollout_summary(worst, cache, args.rollout_slots, length)
        print(line)
    return 0 if worst.fits and rollout_fits else 1


if __name__ == "__main__":
    sys.exit(main())
