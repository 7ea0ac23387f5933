"""Megatron's SequentialMLP experts with a cheaper forward for decoding and training.

Megatron's SequentialMLP runs every local expert's MLP module on its slice of the permuted tokens,
also when the slice is empty: decoding one token that goes to 2 of 8 experts still calls 8 MLPs,
each two Megatron linears (an autograd function plus tensor-parallel region mappings) and the
SwiGLU, and that Python made about half of a CPU decode step. ``SkipEmptySequentialMLP`` keeps the
module tree, the parameters and ``sharded_state_dict`` of SequentialMLP (it is a subclass that
only replaces ``forward``), so checkpoints, the HF converter and hf_names see the same keys, and
computes each expert as two plain matmuls:

    out_e = (silu(x_e W_gate^T) * (x_e W_up^T) * p_e) W_2^T,   linear_fc1.weight = [W_gate; W_up]

That equals what Megatron's expert linears compute whatever the layout: an expert's linears never
communicate (with expert TP or EP they set ``explicit_expert_comm`` and the token dispatcher does
the all-gather / reduce-scatter; in a world of one the mappings are identities), so each is a local
matmul with this rank's shard, and the gate / up split of a shard is the local chunk, as MLP's glu.

Experts without tokens are skipped when no gradient is recorded (decoding, evaluation); within a
rollout, whose experts' weights are stacked, all of them run as two grouped products instead (the
decode step through Megatron's modules: TP, EP). Under
autograd every expert still runs (an empty matmul is cheap): each parameter then gets its gradient,
zero for an idle expert, as with SequentialMLP, so Megatron DDP's per-parameter hooks and
overlapped gradient reduction see every parameter.

Configurations outside plain SwiGLU experts without bias (FP8 / FP4 padding, bias, other
activations, clamped GLU, delayed weight gradients, probabilities applied on the input) run
SequentialMLP's own forward. The Transformer Engine layers' experts are Megatron's TEGroupedMLP as
``StackingTEGroupedMLP``, whose weights a rollout stacks like SkipEmptySequentialMLP's
(``StacksExpertWeights``): the lean decode step runs either the same way.

``InProcessMoELayer`` is Megatron's MoELayer (same submodules and keys) that, when no gradient is
recorded and every expert and token is in this process (EP = TP = 1: decoding, evaluation),
hands the routed tokens to the experts directly instead of through the token dispatcher, whose
permute / sort / unpermute bookkeeping cost a CPU decode step about as much as the experts. Its
``step`` (HybridModel's lean decode step, one token per sequence) also does the router's math
itself, as TopKRouter computes it for this model's configuration, without the router module's
autograd function and [tokens, experts] routing map; one sequence runs just its top-k experts.
Under tensor parallelism the step needs no dispatcher either: a decode step's tokens are the same on
every attention TP rank, so each runs its expert-TP shard of every expert on them and the partial
outputs are added over the expert TP group (one all-reduce); under EP with agreed rows it gathers the
group's tokens (``step``).
The experts of a step, with the layer's residual, are computed by the op ``megacispo::decode_experts``
(under EP ``megacispo::local_expert_products``, a rank's own experts) from the experts' stacked weights
(``stacked_weights``: HybridModel.generation_dtype stacks them once per rollout) as a fixed number of
ops with no host sync, whatever the routing: grouped products (``torch._grouped_mm``) over all slots'
routed tokens, or a dense form where no grouped product takes the dtype. Around the grouped products
three ops do the bookkeeping (``permute_pairs``, ``swiglu``, ``combine_pairs``): a Triton kernel each
on CUDA (models/experts_triton.py) where torch launches eight, their composites of torch ops elsewhere.
A backend may register a kernel of its own for an op (the CPU layer does for decode_experts,
parallel/cpu/). Under torch.compile (``decode_step(compiled=True)``) a bf16 step traces the op's
composite, whose elementwise ops the graph fuses and whose bookkeeping ops it calls; in other dtypes
the op is one node of the graph (``step_experts``).
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from megatron.core import tensor_parallel
from megatron.core.transformer.moe.experts import SequentialMLP, TEGroupedMLP
from megatron.core.transformer.moe.moe_layer import MoELayer
from megatron.core.transformer.moe.router import TopKRouter
from megatron.core.transformer.transformer_config import TransformerConfig

from megacispo.models.layers import (
    ScaledResidual,
    StacksWeights,
    all_gather_rows,
    reduce_scatter_rows,
    scaled_residual,
    stack_weights_as_views,
    weight_places,
    weights_at,
)
from megacispo.models.lora import LoraAdapted, adapted_linears


def swiglu_experts(config: TransformerConfig) -> bool:
    """Whether the experts are plain SwiGLU MLPs without bias, weighted after the SwiGLU: the math of
    ``expert_mlp`` and of the decode step's ``decode_experts``, whatever the GEMMs' precision."""
    return (
        config.gated_linear_unit
        and config.activation_func is F.silu
        and not config.add_bias_linear
        and not config.use_te_activation_func
        and config.activation_func_clamp_value is None
        and config.glu_linear_offset == 0.0
        and not config.moe_apply_probs_on_input
    )


def supports_fused_forward(config: TransformerConfig) -> bool:
    """Whether ``SkipEmptySequentialMLP`` computes these experts itself: SwiGLU experts
    (``swiglu_experts``) whose GEMMs are not FP8 / FP4, without delayed weight gradients."""
    return swiglu_experts(config) and not (config.fp8 or config.fp4) and not config.delay_wgrad_compute


def expert_mlp(
    tokens: torch.Tensor, probs: torch.Tensor, fc1_weight: torch.Tensor, fc2_weight: torch.Tensor,
    fc1_adapter: LoraAdapted | None = None, fc2_adapter: LoraAdapted | None = None,
) -> torch.Tensor:
    """One expert on its tokens [m, H] with routing weights [m] -> [m, H], as Megatron's MLP computes
    it (the weight is applied after the SwiGLU, in fp32 when probs are, then cast back); with each
    linear's LoRA adapter (models/lora.py) where it has one, as its forward adds it."""
    gate, up = _adapted_linear(tokens, fc1_weight, fc1_adapter).chunk(2, dim=-1)
    intermediate = F.silu(gate) * up
    intermediate = (intermediate * probs.unsqueeze(-1)).to(intermediate.dtype)
    return _adapted_linear(intermediate, fc2_weight, fc2_adapter)


def _adapted_linear(inputs: torch.Tensor, weight: torch.Tensor, adapter: LoraAdapted | None) -> torch.Tensor:
    product = F.linear(inputs, weight)
    return product if adapter is None else adapter.plus_update(inputs, product)


def run_experts(
    rows: torch.Tensor,
    counts: list[int],
    probs: torch.Tensor,
    fc1_weights: list[torch.Tensor],
    fc2_weights: list[torch.Tensor],
    *,
    run_idle: bool,
    adapters: tuple[list[LoraAdapted | None], list[LoraAdapted | None]] | None = None,
) -> torch.Tensor:
    """rows [n, H] sorted by expert, counts[e] of them for expert e, routing weights probs [n] ->
    each row's expert output [n, H]. ``run_idle`` also runs the experts without rows (an empty
    matmul), so that every expert weight gets a gradient under autograd. ``adapters``: each expert's
    linear_fc1 and linear_fc2 where it has a LoRA adapter to add (else None)."""
    fc1_adapters, fc2_adapters = adapters or ([None] * len(counts), [None] * len(counts))
    # One split, whose backward is one cat, rather than a slice per expert, whose backward
    # would write a zero tensor of all n rows for each expert and add them up.
    outputs = [
        expert_mlp(expert_rows, expert_probs, fc1_weight, fc2_weight, fc1_adapter, fc2_adapter)
        for expert_rows, expert_probs, fc1_weight, fc2_weight, fc1_adapter, fc2_adapter, count in zip(
            rows.split(counts), probs.split(counts), fc1_weights, fc2_weights, fc1_adapters, fc2_adapters, counts
        )
        if count or run_idle
    ]
    if not outputs:
        return rows.new_empty(0, rows.shape[1])
    return outputs[0] if len(outputs) == 1 else torch.cat(outputs, dim=0)


def _sum_per_token(tokens: torch.Tensor, token_ids: torch.Tensor, expert_outputs: torch.Tensor) -> torch.Tensor:
    """Megatron's unpermute in one process: expert_outputs [n, H] of rows token_ids [n] summed back
    per token with index_add_, in row order, into [T, H] like tokens."""
    return torch.zeros_like(tokens).index_add_(0, token_ids, expert_outputs.to(tokens.dtype))


def decode_experts(
    tokens: torch.Tensor,
    probs: torch.Tensor,
    top_experts: torch.Tensor,
    fc1_weight: torch.Tensor,
    fc2_weight: torch.Tensor,
    residual_scale: float,
    update_scale: float,
) -> torch.Tensor:
    """The routed experts of a decode step with the residual around them: tokens [b, H] (the MoE's
    normalized input), each with its k experts top_experts [b, k] and routing weights probs [b, k], the
    local experts' stacked weights fc1_weight [E, 2F, H] (``[W_gate; W_up]`` each) and fc2_weight
    [E, H, F] -> [b, H], ``residual_scale * tokens + update_scale * moe``, where moe is the weighted
    expert outputs summed per token, what MoELayer computes (``ScaledResidual`` around it).

    A fixed number of ops whatever the routing, with no shape that depends on it and no host sync
    (a CUDA graph can hold it): the b * k (token, expert) rows are sorted by expert and run as two
    grouped products (``grouped_expert_products``), or, where no grouped product takes the dtype
    (fp64, fp32 on a GPU), every expert runs on every token and the unchosen outputs are weighted 0
    (``dense_expert_products``). The CPU layer's ``decode_experts_cpu`` serves fp32 on the CPU."""
    if grouped_products_take(tokens, fc1_weight, fc2_weight):
        return grouped_expert_products(tokens, probs, top_experts, fc1_weight, fc2_weight, residual_scale,
                                       update_scale)
    return dense_expert_products(tokens, probs, top_experts, fc1_weight, fc2_weight, residual_scale, update_scale)


def grouped_products_take(tokens: torch.Tensor, fc1_weight: torch.Tensor, fc2_weight: torch.Tensor) -> bool:
    """Whether ``torch._grouped_mm`` multiplies these: bf16 on a GPU (its grouped GEMM kernels), bf16 /
    fp16 / fp32 on the CPU, rows of a multiple of 16 bytes (its alignment rule)."""
    dtypes = (torch.bfloat16,) if tokens.is_cuda else (torch.float32, torch.bfloat16, torch.float16)
    aligned = all(size * tokens.element_size() % 16 == 0 for size in (*fc1_weight.shape[1:], fc2_weight.shape[2]))
    return tokens.dtype in dtypes and fc1_weight.dtype == tokens.dtype and aligned


def grouped_expert_products(
    tokens: torch.Tensor, probs: torch.Tensor, top_experts: torch.Tensor, fc1_weight: torch.Tensor,
    fc2_weight: torch.Tensor, residual_scale: float, update_scale: float,
) -> torch.Tensor:
    """decode_experts through grouped products: Megatron's permutation (expert-major rows, token order
    within an expert: a stable sort of the token-major (token, slot) pairs by expert), each expert's
    rows multiplied by its weights in one ``torch._grouped_mm`` per projection, then each token's k
    outputs weighed by its routing weights and summed, with the residual (``combine_pairs``).
    top_experts may hold E (another rank's expert, ``local_expert_products``): those pairs sort last,
    past every group, so no product computes them, and they add 0."""
    num_experts = fc1_weight.shape[0]
    sorted_experts, order = torch.sort(top_experts.flatten(), stable=True)  # [b * k]
    # Where each expert's rows end (int32, as grouped_mm takes them), found on the device.
    ends = torch.searchsorted(sorted_experts, _expert_ids(num_experts, tokens.device), right=True, out_int32=True)
    rows, positions = torch.ops.megacispo.permute_pairs(tokens, sorted_experts, order, num_experts)  # [b * k, H]
    expert_outputs = sorted_rows_products(rows, ends, fc1_weight, fc2_weight)  # [b * k, H], unweighted
    return torch.ops.megacispo.combine_pairs(tokens, probs, expert_outputs, positions, residual_scale, update_scale)


def local_expert_products(
    tokens: torch.Tensor, probs: torch.Tensor, local_experts: torch.Tensor, fc1_weight: torch.Tensor,
    fc2_weight: torch.Tensor, residual_scale: float, update_scale: float,
) -> torch.Tensor:
    """This rank's part of decode_experts under expert parallelism: tokens [n, H] with routing weights
    probs [n, k] and local_experts [n, k], the index of each chosen expert among this rank's E
    (fc1_weight [E, 2F, H], fc2_weight [E, H, F]), or E where another rank holds it -> [n, H],
    ``residual_scale * tokens`` plus ``update_scale`` times the weighted outputs of this rank's experts
    summed per token (the other ranks add the rest). Fixed shapes and no host sync, like
    decode_experts: a pair of another rank's expert is computed by no grouped product, and weighs 0 in
    the dense form."""
    if grouped_products_take(tokens, fc1_weight, fc2_weight):
        return grouped_expert_products(tokens, probs, local_experts, fc1_weight, fc2_weight, residual_scale,
                                       update_scale)
    return dense_expert_products(tokens, probs, local_experts, fc1_weight, fc2_weight, residual_scale, update_scale)


def sorted_rows_products(
    rows: torch.Tensor, ends: torch.Tensor, fc1_weight: torch.Tensor, fc2_weight: torch.Tensor,
    probs: torch.Tensor | None = None,
) -> torch.Tensor:
    """Rows [n, H] sorted by expert, expert e's ending at ends[e] (int32 [E], on the device) -> each
    row's expert output [n, H] (``expert_mlp``'s math; with routing weights probs [n], applied after
    the SwiGLU as Megatron's MLP applies them), as two grouped products over the stacked weights: two
    kernels whatever the experts' loads."""
    intermediate = torch.ops.megacispo.swiglu(torch._grouped_mm(rows, fc1_weight.transpose(1, 2), offs=ends), ends)
    if probs is not None:
        intermediate = (intermediate * probs.unsqueeze(-1)).to(intermediate.dtype)
    return torch._grouped_mm(intermediate, fc2_weight.transpose(1, 2), offs=ends)


def permute_pairs(
    tokens: torch.Tensor, sorted_experts: torch.Tensor, order: torch.Tensor, num_experts: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """The op ``megacispo::permute_pairs``: a decode step's (token, expert) pairs in expert order.
    tokens [n, H]; order [P] (P = n * k), the pair at each sorted position (pair p is token p // k's
    choice p % k); sorted_experts [P], its expert, num_experts or more for another rank's ->
    (rows [P, H], the token row at each sorted position; positions [P] int64, each pair's sorted
    position, -1 for another rank's expert). Its CUDA kernel leaves the rows of other ranks' experts
    unwritten: no product reads them."""
    pairs = order.numel()
    rows = tokens.index_select(0, order.div(pairs // tokens.shape[0], rounding_mode="floor"))
    sorted_positions = torch.arange(pairs, device=order.device).masked_fill(sorted_experts >= num_experts, -1)
    return rows, torch.empty_like(order).index_copy_(0, order, sorted_positions)


def swiglu(projected: torch.Tensor, ends: torch.Tensor) -> torch.Tensor:
    """The op ``megacispo::swiglu``: projected [m, 2F] (gate | up, the first product's output, its
    rows sorted by expert, expert e's ending at ends[e]) -> silu(gate) * up [m, F]. The rows past
    ends[-1], which no product wrote, are the CUDA kernel's to skip."""
    gate, up = projected.chunk(2, dim=-1)
    return F.silu(gate) * up


def combine_pairs(
    tokens: torch.Tensor, probs: torch.Tensor, expert_outputs: torch.Tensor, positions: torch.Tensor,
    residual_scale: float, update_scale: float,
) -> torch.Tensor:
    """The op ``megacispo::combine_pairs``: tokens [n, H], routing weights probs [n, k], the experts'
    output rows expert_outputs [P, H] by sorted position and each pair's position positions [P]
    (``permute_pairs``) -> [n, H], ``residual_scale * tokens + update_scale *`` each token's outputs
    weighed by its routing weights (cast to the tokens' dtype) and summed; a pair at position -1
    (another rank's expert) adds 0. Rows at no pair's position are never read (no product wrote them)."""
    batch, topk = probs.shape
    by_pair = F.pad(expert_outputs, (0, 0, 0, 1))[positions]  # [P, H]: position -1 reads the zero row
    summed = torch.baddbmm(tokens[:, None], probs.to(tokens.dtype)[:, None], by_pair.view(batch, topk, -1),
                           beta=residual_scale, alpha=update_scale)  # [b, 1, H]
    return summed[:, 0]


def dense_expert_products(
    tokens: torch.Tensor, probs: torch.Tensor, top_experts: torch.Tensor, fc1_weight: torch.Tensor,
    fc2_weight: torch.Tensor, residual_scale: float, update_scale: float,
) -> torch.Tensor:
    """decode_experts with every expert on every token ([E, b, ...] batched products), each token's
    unchosen experts weighted 0: E / k times the products of the grouped form, but in a decode step
    the weights' reads dominate and most experts are chosen by some token anyway. The sum over
    experts adds the chosen outputs in ascending expert order (a zero adds nothing)."""
    num_experts = fc1_weight.shape[0]
    # One column more for another rank's expert (index E, ``local_expert_products``), dropped.
    weights = torch.zeros(tokens.shape[0], num_experts + 1, dtype=probs.dtype, device=tokens.device)
    weights = weights.scatter(1, top_experts, probs)[:, :num_experts].T.unsqueeze(-1)  # [E, b, 1]
    gate, up = torch.matmul(tokens, fc1_weight.transpose(1, 2)).chunk(2, dim=-1)  # [E, b, F] each
    intermediate = F.silu(gate) * up
    intermediate = (intermediate * weights).to(intermediate.dtype)
    moe = torch.bmm(intermediate, fc2_weight.transpose(1, 2)).to(tokens.dtype).sum(dim=0)
    return scaled_residual(tokens, moe, residual_scale, update_scale)


@functools.cache
def _local_expert_index(num_experts: int, first: int, count: int, device: torch.device) -> torch.Tensor:
    """[num_experts] int64: expert first + i -> i for this rank's ``count`` experts, every other -> count
    (``local_expert_products``' mark of another rank's expert). Made once, like _expert_ids."""
    with torch.inference_mode(False):
        index = torch.full((num_experts,), count, dtype=torch.long, device=device)
        index[first:first + count] = torch.arange(count, device=device)
        return index


@functools.cache
def _expert_ids(num_experts: int, device: torch.device) -> torch.Tensor:
    # Made once: an arange per MoE layer and step would be a kernel launch each.
    with torch.inference_mode(False):
        return torch.arange(num_experts, device=device)


def step_experts(
    implementation, tokens: torch.Tensor, probs: torch.Tensor, top_experts: torch.Tensor, fc1_weight: torch.Tensor,
    fc2_weight: torch.Tensor, residual_scale: float, update_scale: float,
) -> torch.Tensor:
    """A decode step's experts (``decode_experts`` or ``local_expert_products``, with its arguments): the op
    ``megacispo::<name>``, a place for a backend's own kernel and one node of a compiled graph, whose
    tracing holds grouped products to their CUDA kernels' dtype (bf16) on every device; under
    torch.compile a bf16 step (a GPU's rollouts) whose grouped products take it traces the composite
    instead, so that the graph fuses its elementwise ops with their neighbours and calls the
    bookkeeping ops' kernels."""
    args = (tokens, probs, top_experts, fc1_weight, fc2_weight, residual_scale, update_scale)
    traced = torch.compiler.is_compiling() and tokens.dtype == torch.bfloat16
    if traced and grouped_products_take(tokens, fc1_weight, fc2_weight):
        return implementation(*args)
    return getattr(torch.ops.megacispo, implementation.__name__)(*args)


_LIBRARY = torch.library.Library("megacispo", "FRAGMENT")
for _name, _implementation in (("decode_experts", decode_experts), ("local_expert_products", local_expert_products)):
    _LIBRARY.define(
        f"{_name}(Tensor tokens, Tensor probs, Tensor top_experts, Tensor fc1_weight, Tensor fc2_weight, "
        "float residual_scale, float update_scale) -> Tensor"
    )
    _LIBRARY.impl(_name, _implementation, "CompositeExplicitAutograd")
    torch.library.register_fake(f"megacispo::{_name}")(
        lambda tokens, probs, top_experts, fc1_weight, fc2_weight, residual_scale, update_scale: torch.empty_like(tokens)
    )


@functools.cache
def _triton_kernels():
    """models/experts_triton.py, imported (with Triton) at the first call on a GPU."""
    from megacispo.models import experts_triton

    return experts_triton


def _triton_kernel(name: str):
    """The CUDA kernel of op ``name``: its launcher in models/experts_triton.py."""

    def launch(*args):
        return getattr(_triton_kernels(), f"{name}_triton")(*args)

    return launch


# The grouped products' bookkeeping: a composite of torch ops (the CPU, tracing) and one Triton kernel
# each on CUDA, where torch would launch two to six.
_LIBRARY.define(
    "permute_pairs(Tensor tokens, Tensor sorted_experts, Tensor order, int num_experts) -> (Tensor, Tensor)"
)
_LIBRARY.define("swiglu(Tensor projected, Tensor ends) -> Tensor")
_LIBRARY.define(
    "combine_pairs(Tensor tokens, Tensor probs, Tensor expert_outputs, Tensor positions, float residual_scale, "
    "float update_scale) -> Tensor"
)
for _name, _implementation in (("permute_pairs", permute_pairs), ("swiglu", swiglu), ("combine_pairs", combine_pairs)):
    _LIBRARY.impl(_name, _implementation, "CompositeExplicitAutograd")
    _LIBRARY.impl(_name, _triton_kernel(_name), "CUDA")
torch.library.register_fake("megacispo::permute_pairs")(
    lambda tokens, sorted_experts, order, num_experts: (tokens.new_empty(order.numel(), tokens.shape[1]),
                                                        torch.empty_like(order))
)
torch.library.register_fake("megacispo::swiglu")(
    lambda projected, ends: projected.new_empty(projected.shape[0], projected.shape[1] // 2)
)
torch.library.register_fake("megacispo::combine_pairs")(
    lambda tokens, probs, expert_outputs, positions, residual_scale, update_scale: torch.empty_like(tokens)
)


class StacksExpertWeights(StacksWeights):
    """Experts whose weights a rollout stacks, [E, 2F, H] and [E, H, F] (``stacked_weights``), for the
    decode step's grouped products: Megatron's SequentialMLP (a linear per expert) and TEGroupedMLP
    (Transformer Engine's grouped linears, ``weight{i}`` per expert) alike."""

    _stacked: tuple[torch.Tensor, torch.Tensor] | None = None

    def expert_weight_places(self) -> tuple[list[tuple[torch.nn.Module, str]], list[tuple[torch.nn.Module, str]]]:
        """Where the local experts' fc1 weights [2F, H] and fc2 weights [H, F] are, in expert order:
        (module, parameter name) pairs, as ``stack_weights_as_views`` takes them."""
        raise NotImplementedError

    def stacked_weights(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(fc1 [E, 2F, H], fc2 [E, H, F]): the local experts' weights stacked, as decode_experts takes
        them. Within a rollout (``stacking_weights``) the experts' weights are views of these stacks;
        outside it they are stacked on each call (a copy: the training weights change every step)."""
        if self._stacked is not None:
            return self._stacked
        fc1_places, fc2_places = self.expert_weight_places()
        return torch.stack(weights_at(fc1_places)), torch.stack(weights_at(fc2_places))

    def stacked_parameters(self) -> list[torch.nn.Parameter]:
        fc1_places, fc2_places = self.expert_weight_places()
        return weights_at(fc1_places + fc2_places)

    def stacking_weights(self, dtype_of) -> list[tuple[torch.nn.Module, str, torch.nn.Parameter]]:
        """One stack per projection, [E, 2F, H] and [E, H, F], the experts' weights views of it."""
        fc1_places, fc2_places = self.expert_weight_places()
        fc1, replaced_fc1 = stack_weights_as_views(fc1_places, dtype_of, new_dim=True)
        fc2, replaced_fc2 = stack_weights_as_views(fc2_places, dtype_of, new_dim=True)
        self._stacked = (fc1, fc2)
        return replaced_fc1 + replaced_fc2

    def forget_stacks(self) -> None:
        self._stacked = None


class SkipEmptySequentialMLP(SequentialMLP, StacksExpertWeights):
    """SequentialMLP (same parameters and checkpoint keys) whose forward calls no Megatron linear
    and, without autograd, skips the experts that got no tokens."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._expert_weights: tuple[list[torch.Tensor], list[torch.Tensor]] | None = None
        self._adapted = adapted_linears(self)

    def forward(
        self, permuted_local_hidden_states: torch.Tensor, tokens_per_expert: torch.Tensor, permuted_probs: torch.Tensor
    ) -> tuple[torch.Tensor, None]:
        """permuted_local_hidden_states [n, H], sorted by local expert; tokens_per_expert [E_local]
        (sums to n); permuted_probs [n] the routing weight of each row. Returns ([n, H], None).
        Experts with LoRA adapters add them, unless they are merged into the weights (within a rollout)."""
        if not supports_fused_forward(self.config):
            return super().forward(permuted_local_hidden_states, tokens_per_expert, permuted_probs)
        rows = permuted_local_hidden_states
        if not torch.is_grad_enabled() and self._stacked is not None and grouped_products_take(rows, *self._stacked):
            # A rollout's step through Megatron's modules (TP, EP): two grouped products, no host sync.
            ends = tokens_per_expert.to(device=rows.device, dtype=torch.int32).cumsum(0, dtype=torch.int32)
            return sorted_rows_products(rows, ends, *self._stacked, probs=permuted_probs), None
        fc1_weights, fc2_weights = self.expert_weights()
        return run_experts(
            permuted_local_hidden_states, tokens_per_expert.tolist(), permuted_probs, fc1_weights, fc2_weights,
            run_idle=torch.is_grad_enabled(), adapters=self._unmerged_adapters(),
        ), None

    def _unmerged_adapters(self) -> tuple[list[LoraAdapted | None], list[LoraAdapted | None]] | None:
        """Each local expert's linear_fc1 and linear_fc2 where it has an adapter not merged into its weight."""
        if all(linear.adapters_merged for linear in self._adapted):
            return None
        return tuple([linear if isinstance(linear, LoraAdapted) else None
                      for linear in (getattr(expert, name) for expert in self.local_experts)]
                     for name in ("linear_fc1", "linear_fc2"))

    def expert_weights(self) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """(linear_fc1 weights, linear_fc2 weights) of the local experts, in expert order.

        The Parameter objects are looked up once: casts, moves, loading and Megatron's gradient
        buffers keep them (as an optimizer holding them assumes), and the lookup, about 30 us a
        layer of module attribute reads, was 2-4% of an eager decode step. A traced step looks them
        up itself, so that the graph reads the module's parameters."""
        if torch.compiler.is_compiling():
            return self._look_up_expert_weights()
        if self._expert_weights is None:
            self._expert_weights = self._look_up_expert_weights()
        return self._expert_weights

    def expert_weight_places(self) -> tuple[list[tuple[torch.nn.Module, str]], list[tuple[torch.nn.Module, str]]]:
        experts = self.local_experts
        return weight_places(*(e.linear_fc1 for e in experts)), weight_places(*(e.linear_fc2 for e in experts))

    def stacking_weights(self, dtype_of) -> list[tuple[torch.nn.Module, str, torch.nn.Parameter]]:
        self._expert_weights = None
        return super().stacking_weights(dtype_of)

    def forget_stacks(self) -> None:
        """Look the weights up again at the next call, and drop the rollout's stacks:
        HybridModel.generation_dtype puts other tensors in the experts' places for a rollout, and back."""
        self._expert_weights = None
        super().forget_stacks()

    def _look_up_expert_weights(self) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        fc1_places, fc2_places = self.expert_weight_places()
        return weights_at(fc1_places), weights_at(fc2_places)


class StackingTEGroupedMLP(TEGroupedMLP, StacksExpertWeights):
    """Megatron's TEGroupedMLP (the same forward, parameters and checkpoint keys: Transformer Engine's
    grouped linears, ``weight{i}`` for local expert i) whose experts' weights a rollout stacks, so that
    the lean decode step runs them as it runs SkipEmptySequentialMLP's: the experts of the FP8
    configs, whose rollouts run outside FP8 (HybridModel.generation_dtype)."""

    def expert_weight_places(self) -> tuple[list[tuple[torch.nn.Module, str]], list[tuple[torch.nn.Module, str]]]:
        experts = range(self.num_local_experts)
        return [(self.linear_fc1, f"weight{i}") for i in experts], [(self.linear_fc2, f"weight{i}") for i in experts]


class PaddingMaskedTopKRouter(TopKRouter):
    """Megatron-Core's TopKRouter, whose selection-bias token counts (M2's aux-loss-free balancing) leave
    out the padding: Megatron-Core 0.16.1's ``_apply_expert_bias`` ands the flattened padding mask [T]
    with the routing map [T, E] (a broadcast error at any T other than E) where each token's row is meant.
    Its two lines are written here rather than called with the mask reshaped: Megatron's is wrapped in
    torch.compile (jit_fuser), a graph of its own at its first call, one more in a compiled rollout's
    recompile budget (tests/multiprocess/test_decode_catalog.py counted it) for a sum it skips there."""

    def _apply_expert_bias(self, routing_map: torch.Tensor, padding_mask: torch.Tensor | None = None) -> None:
        if self.enable_expert_bias and torch.is_grad_enabled():
            with torch.no_grad():
                if padding_mask is not None:
                    routing_map = routing_map & ~padding_mask[:, None]
                self.local_tokens_per_expert += routing_map.sum(dim=0)


class InProcessMoELayer(MoELayer):
    """MoELayer whose no-grad forward with all experts local routes tokens without the dispatcher,
    and whose ``step`` (one token per sequence, decoding) also bypasses Megatron's router module."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        config = self.config
        dispatcher = self.token_dispatcher
        # Fixed by the layout and the config at construction: checked once, not per token.
        plain_experts = (
            not self.use_shared_expert and not config.moe_latent_size and config.moe_expert_capacity_factor is None
        )
        self._all_local = (
            self.attn_tp_group.size() == 1 and dispatcher.tp_size == 1 and dispatcher.ep_size == 1 and plain_experts
        )
        # A decode step's tokens are the same on every rank of the attention TP group (no sequence
        # parallelism for one token), so expert TP ranks within it can each run their shard of every
        # expert on all the tokens and add the partial outputs: no dispatch.
        attention_tp_ranks = set(torch.distributed.get_process_group_ranks(self.attn_tp_group))
        shares_tokens = set(torch.distributed.get_process_group_ranks(dispatcher.tp_group)) <= attention_tp_ranks
        # Likewise an EP group within the attention TP group (TP 8 and EP 8 on one node) holds the same
        # tokens on every rank: its step needs no gather, and adds the experts' outputs with an all-reduce.
        self._ep_shares_tokens = set(torch.distributed.get_process_group_ranks(self.ep_group)) <= attention_tp_ranks
        self._expert_tp_size, self._expert_tp_rank = dispatcher.tp_size, dispatcher.tp_group.rank()
        # What ``_route_tokens`` reproduces of TopKRouter: the softmax over the top-k logits (M1), or
        # the sigmoid scores chosen with the selection bias (M2), as topk_routing_with_score_function
        # computes them without pre-softmax, groups or fusion; no input jitter, no linear bias, no Megatron
        # replay (HybridModel attaches its own routing hook after this check; ``step`` records through
        # it); its z-loss, aux losses and expert-bias counts only act under autograd.
        self._plain_topk_router = (
            config.moe_router_score_function in ("softmax", "sigmoid")
            and not config.moe_router_pre_softmax
            and not config.moe_router_group_topk
            and not config.moe_router_fusion
            and config.moe_input_jitter_eps is None
            and not config.moe_router_force_load_balancing
            and self.router.routing_type != "sinkhorn"
            and self.router.bias is None
            and self.router.router_replay is None
        )
        self._steps_routing = (
            shares_tokens
            and plain_experts
            and self._plain_topk_router
            and isinstance(self.experts, StacksExpertWeights)
            and swiglu_experts(config)
        )
        self._ep_size, self._ep_rank = dispatcher.ep_size, self.ep_group.rank()
        self.steps_in_process = self._steps_routing and self._ep_size == 1
        """Whether ``step`` routes and runs the experts itself, in this process (else it calls forward):
        every expert is on this rank, whole or as its expert-TP shard (EP = 1, expert TP within attention TP)."""

    def steps_without_dispatcher(self, rows_agree: bool) -> bool:
        """Whether ``step`` routes and runs the experts itself, without Megatron's dispatcher: in this
        process, under EP on the tokens that the EP group already shares, or by gathering the group's
        tokens, which needs ``rows_agree``: every rank of the EP group steps as many rows
        (InferenceCache.rows_agree)."""
        return self.steps_in_process or (self._steps_routing and (rows_agree or self._ep_shares_tokens))

    def forward(
        self, hidden_states: torch.Tensor, intermediate_tensors=None, padding_mask: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, None]:
        """hidden_states [s, b, H] -> ([s, b, H], None), as MoELayer.forward. padding_mask [b, s], True
        at padding, only keeps padding out of the router's load-balancing statistics, which exist
        under autograd alone: the in-process route has no use for it."""
        if not self._routes_in_process(intermediate_tensors):
            return super().forward(hidden_states, intermediate_tensors, padding_mask)
        tokens = hidden_states.reshape(-1, hidden_states.shape[-1])  # [T, H]
        probs, routing_map = self.route(hidden_states)  # [T, E] fp32, [T, E] bool
        expert_ids, token_ids = routing_map.T.nonzero(as_tuple=True)  # [n] each, sorted by expert
        output = self._combine(tokens, token_ids, routing_map.sum(dim=0), probs.T[expert_ids, token_ids])
        return output.view(hidden_states.shape), None

    def step(self, hidden: torch.Tensor, residual: ScaledResidual, rows_agree: bool = False) -> torch.Tensor:
        """One token per sequence (decoding): hidden [b, H] (the layer's normalized input, every attention
        TP rank the same) -> ``residual(hidden, forward(hidden))`` [b, H], with the router's math done
        here (no router module, autograd function or [b, E] routing map) and the residual added in the
        experts' last product (on the first rank of the groups that sum the outputs: ``alpha_on``);
        under expert TP each rank's shard of the experts' outputs is added over the expert TP group.

        Under EP with ``rows_agree`` (every rank of the EP group steps b rows) the dispatch has fixed
        shapes and no host sync, where Megatron's all-to-all reads its split sizes on the host: the
        group's tokens are all-gathered, every rank routes all of them (the router is replicated) and
        runs its own experts on the pairs that chose them, and a reduce-scatter returns each rank the
        sums for its rows (``_step_expert_parallel``: over the EP group, each expert-TP rank a share of
        the rows). Runs forward where neither applies (EP without agreed rows, under autograd, ...)."""
        if torch.is_grad_enabled() or not self.steps_without_dispatcher(rows_agree):
            output, _ = self.forward(hidden[None])
            return residual(hidden, output[0])
        routes = self.router.router_replay  # models/routing.py's hook, attached by HybridModel
        alpha = residual.alpha_on(self._ep_rank, self._expert_tp_rank)
        if self._ep_size == 1:
            probs, top_experts = self._route_tokens(hidden)  # [b, k] each
            if routes is not None:
                routes.record_step(top_experts)
            output = step_experts(decode_experts, hidden, probs, top_experts, *self.experts.stacked_weights(),
                                  alpha, residual.beta)
        elif self._ep_shares_tokens:
            output = self._step_shared_tokens(hidden, routes, alpha, residual.beta)
        else:
            # The expert-TP ranks split the rows where they can (``_step_expert_parallel``).
            shares = self._expert_tp_size if hidden.shape[0] % self._expert_tp_size == 0 else 1
            output = self._step_expert_parallel(hidden, routes, alpha, residual.beta, shares)
            if shares > 1:  # summed over expert TP too
                return output
        if self._expert_tp_size == 1:  # one expert-TP rank: nothing to add, no autograd function's call
            return output
        return tensor_parallel.reduce_from_tensor_model_parallel_region(output, group=self.token_dispatcher.tp_group)

    def _step_shared_tokens(self, hidden: torch.Tensor, routes, alpha: float, beta: float) -> torch.Tensor:
        """``step``'s experts under EP where the EP group lies within the attention TP group, whose ranks
        hold the same tokens: hidden [b, H] -> [b, H], ``alpha * hidden`` (from the group's first rank)
        plus ``beta`` times the outputs of this expert-TP shard's experts, added over the EP group with
        an all-reduce: no gather."""
        probs, top_experts = self._route_tokens(hidden)  # [b, k] each
        if routes is not None:
            routes.record_step(top_experts)
        partial = step_experts(local_expert_products, hidden, probs, self._local_experts(top_experts),
                               *self.experts.stacked_weights(), alpha, beta)
        torch.distributed.all_reduce(partial, group=self.ep_group)
        return partial

    def _step_expert_parallel(
        self, hidden: torch.Tensor, routes, alpha: float, beta: float, shares: int
    ) -> torch.Tensor:
        """``step``'s experts under EP across attention TP groups (M1's EP 32 over nodes of TP 8):
        hidden [b, H] -> [b, H], ``alpha * hidden`` plus ``beta`` times the routed experts' outputs,
        summed over the EP group, and with ``shares`` = T (the expert TP size, which divides b) over the
        expert TP group too; with ``shares`` = 1 this expert-TP shard's part (``step`` adds them).

        ``shares`` = 1: the EP group's b rows a rank are all-gathered, each rank runs its experts on the
        pairs that chose them, and a reduce-scatter returns each rank the sums for its rows.

        ``shares`` = T: the expert-TP ranks hold the same b tokens and run shards of the same experts, so
        each sends only its share: rank t gives rows [t s, (t + 1) s) (s = b / T) to one all-gather over
        the expert TP and EP group (Megatron's ``tp_ep`` group, expert-TP rank fastest: the group its
        all-gather dispatcher gathers over), which puts the EP ranks' rows in the same order, b a rank.
        One reduce-scatter over that group sums each share over all shards and EP ranks to the rank
        that gave it, and an all-gather over expert TP (for the all-reduce over it) puts a rank's b rows
        together. Each row still crosses to another EP rank's node once each way, but from one GPU of
        T: over EP each GPU sends and receives 1 / T of the bytes of gathering all b rows (M1: 8x fewer,
        benchmarks/decode_ops.py's table), the rest moving inside a node. As many collectives either way.

        Megatron's all-to-all moves fewer bytes only by reading its split sizes on the host. With fixed
        shapes (no host sync, a CUDA graph) and no dropped token, an all-to-all's buffer to each EP rank
        must hold all b rows (all b may choose that rank's experts): each rank sends and receives what
        the all-gather moves, and the return what the reduce-scatter moves, so the step uses none."""
        batch = hidden.shape[0]
        share = batch // shares
        group = self.token_dispatcher.tp_ep_group if shares > 1 else self.ep_group
        first = self._expert_tp_rank % shares * share
        tokens = all_gather_rows(hidden[first:first + share], group)  # [EP b, H]: each EP rank's rows in order
        probs, top_experts = self._route_tokens(tokens)  # [EP b, k] each
        if routes is not None:
            routes.record_step(top_experts[self._ep_rank * batch:(self._ep_rank + 1) * batch])
        partial = step_experts(local_expert_products, tokens, probs, self._local_experts(top_experts),
                               *self.experts.stacked_weights(), alpha, beta)  # [EP b, H]
        output = reduce_scatter_rows(partial, group)  # [s, H]: this rank's share, summed
        return output if shares == 1 else all_gather_rows(output, self.token_dispatcher.tp_group)

    def _local_experts(self, top_experts: torch.Tensor) -> torch.Tensor:
        """The chosen experts [n, k] -> each one's index among this rank's experts, or their count
        where another rank holds it (``local_expert_products``)."""
        return _local_expert_index(self.config.num_moe_experts, self.local_expert_indices[0], self.num_local_experts,
                                   top_experts.device)[top_experts]

    def _routes_in_process(self, intermediate_tensors) -> bool:
        return self._all_local and not torch.is_grad_enabled() and intermediate_tensors is None

    def _route_tokens(self, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """tokens [T, H] -> (probs [T, k], experts [T, k]), as TopKRouter (``_plain_topk_router``)
        computes them without autograd: the gating matmul in moe_router_dtype (router_gating_linear);
        softmax: the top-k logits, softmax over them in fp32; sigmoid: the sigmoid scores, the top-k of
        scores + expert_bias (the selection bias, where the router has one), those k scores renormalized;
        then the scaling factor."""
        config = self.config
        router_dtype = {"fp32": torch.float32, "fp64": torch.float64}.get(config.moe_router_dtype, tokens.dtype)
        logits = torch.mm(tokens.to(router_dtype), self.router.weight.to(router_dtype).t())  # [T, E]
        if config.moe_router_score_function == "sigmoid":
            scores = torch.sigmoid(logits.float()).type_as(logits)
            chosen = scores if self.router.expert_bias is None else scores + self.router.expert_bias
            top_experts = torch.topk(chosen, k=self.router.topk, dim=1).indices
            scores = scores.gather(1, top_experts)
            probs = scores / (scores.sum(dim=-1, keepdim=True) + 1e-20) if self.router.topk > 1 else scores
        else:
            scores, top_experts = torch.topk(logits, k=self.router.topk, dim=1)
            probs = torch.softmax(scores, dim=-1, dtype=torch.float32).type_as(logits)
        if config.moe_router_topk_scaling_factor:
            probs = probs * config.moe_router_topk_scaling_factor
        return probs, top_experts

    def _combine(
        self, tokens: torch.Tensor, token_ids: torch.Tensor, tokens_per_expert: torch.Tensor, row_probs: torch.Tensor
    ) -> torch.Tensor:
        """What Megatron's permute, experts and unpermute compute in one process. tokens [T, H]; the
        n routed rows in expert order (then token order): token_ids [n] and routing weights
        row_probs [n]; tokens_per_expert [E]. The experts' outputs are summed back per token with
        index_add_ in that same order. Returns [T, H]."""
        expert_outputs, _ = self.experts(tokens.index_select(0, token_ids), tokens_per_expert, row_probs)  # [n, H]
        return _sum_per_token(tokens, token_ids, expert_outputs)
