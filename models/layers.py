"""Building blocks shared by the mixers and the decoder layer: RMSNorms that know about tensor and
sequence parallelism, the projections' entry into the tensor-parallel region, rotary embeddings,
and the decoding cache.

Layout: Megatron's [s, b, ...] (sequence first) between modules; under sequence parallelism the
hidden states between layers hold s / TP tokens of every sequence.
"""

from __future__ import annotations

import functools
from collections.abc import Hashable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from megatron.core import tensor_parallel
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.core.transformer.utils import make_sharded_tensors_for_checkpoint
from megatron.core.utils import divide

_FP32_OR_WIDER = (torch.float32, torch.float64)
MIN_SPAN = 64
"""The smallest span a bucketed decode step's attention reads (InferenceCache.step_span)."""


def at_least_fp32(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor in fp32, or as it is if wider (fp64 models compute in fp64 throughout)."""
    if tensor.dtype in _FP32_OR_WIDER:
        return tensor  # decode steps call this often: no dispatcher round trip when nothing changes
    return tensor.to(torch.promote_types(tensor.dtype, torch.float32))


def parameter_device(config: TransformerConfig) -> torch.device:
    """Where Megatron-Core's layers create their parameters, and so this project's: the CPU with
    use_cpu_initialization, else the current device (the local GPU; the CPU under the CPU layer)."""
    return torch.device("cpu") if config.use_cpu_initialization else torch.device(torch.cuda.current_device())


def scalar_operand(value: float, like: torch.Tensor) -> torch.Tensor | float:
    """``value`` as the other operand of an elementwise op on ``like``. For fp32 / fp64 a cached
    0-dim tensor of like's dtype: the same result as the Python number, without the 0-dim tensor
    that torch creates and casts for a number on every call (a few microseconds, many times per
    decode step). Other dtypes get the number: a bf16 tensor times a number is computed with the
    number in fp32, which a 0-dim operand would not reproduce. Under torch.compile the number:
    the graph holds it as a constant, with no per-call cost to save."""
    if like.dtype in _FP32_OR_WIDER and not torch.compiler.is_compiling():
        return _constant(value, like.dtype, like.device)
    return value


@functools.cache
def _constant(value: float, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    # A normal tensor even if first asked for under inference mode: autograd may save it later.
    with torch.inference_mode(False):
        return torch.tensor(value, dtype=dtype, device=device)


# torch 2.13 names the flat collectives *_single (its old names warn); torch 2.11, the lent GPU image's,
# has only the old names.
all_gather_single = getattr(torch.distributed, "all_gather_single", torch.distributed.all_gather_into_tensor)
reduce_scatter_single = getattr(torch.distributed, "reduce_scatter_single", torch.distributed.reduce_scatter_tensor)


def all_gather_rows(tensor: torch.Tensor, group) -> torch.Tensor:
    """[n, ...] on each rank of ``group`` -> [size * n, ...]: every rank's rows, in rank order, in one
    collective (no copy after it; under torch.compile a graph node on any device)."""
    gathered = tensor.new_empty(group.size() * tensor.shape[0], *tensor.shape[1:])
    all_gather_single(gathered, tensor.contiguous(), group=group)
    return gathered


def reduce_scatter_rows(tensor: torch.Tensor, group) -> torch.Tensor:
    """[size * n, ...] on each rank of ``group`` -> [n, ...]: rows [r n, (r + 1) n) summed over the group,
    on rank r (``all_gather_rows``' reverse)."""
    output = tensor.new_empty(tensor.shape[0] // group.size(), *tensor.shape[1:])
    reduce_scatter_single(output, tensor, group=group)
    return output


def all_gather_columns(tensor: torch.Tensor, group, dtype: torch.dtype | None = None) -> torch.Tensor:
    """[n, C / size] on each rank of ``group`` -> [n, C] in ``dtype`` (default: the tensor's): every
    rank's columns side by side, in rank order (a row-parallel shard made whole): the rows' all-gather,
    then one copy that puts them in place and casts them."""
    rows, columns = tensor.shape
    gathered = all_gather_rows(tensor, group).view(group.size(), rows, columns)
    # A cast copies into the row-major layout, and the reshape is then a view; without one the reshape copies.
    placed = gathered.transpose(0, 1).to(dtype or tensor.dtype, memory_format=torch.contiguous_format)
    return placed.reshape(rows, -1)


@dataclass(frozen=True)
class ScaledResidual:
    """MiniMax's scaled post-norm residual around a sublayer, ``alpha * normed + beta * update``: the
    residual carries the sublayer's own normalized input (models/decoder_layer.py)."""

    alpha: float
    beta: float

    def __call__(self, normed: torch.Tensor, update: torch.Tensor) -> torch.Tensor:
        return scaled_residual(normed, update, self.alpha, self.beta)

    def alpha_on(self, *group_ranks: int) -> float:
        """The residual's factor on a rank whose partial update the given groups sum: alpha on the rank
        that is first in each (``group_ranks``: its rank in them), 0 on the others, so that the sum
        holds the residual once."""
        return 0.0 if any(group_ranks) else self.alpha


def scaled_residual(normed: torch.Tensor, update: torch.Tensor, alpha: float, beta: float) -> torch.Tensor:
    """``alpha * normed + beta * update`` as one add with alpha; beta = 1 (MiniMax's value) skips that
    product: multiplying by 1 is exact. A function, not a ScaledResidual made where it is needed: torch
    2.11's dynamo cannot call a frozen dataclass built inside a compiled region (it hashes it unbuilt)."""
    scaled_update = update if beta == 1.0 else scalar_operand(beta, update) * update
    if torch.compiler.is_compiling():
        # A compiled graph fuses the two ops anyway; inductor (torch 2.13) miscompiled add's alpha in
        # the lean decode step (logits off by 10: tests/multiprocess/test_lean_decode.py).
        return scalar_operand(alpha, normed) * normed + scaled_update
    return torch.add(scaled_update, normed, alpha=alpha)


def row_parallel_step(
    inputs: torch.Tensor, weight: torch.Tensor, normed: torch.Tensor, residual: ScaledResidual, tp_group
) -> torch.Tensor:
    """A decode step's row-parallel output projection with the residual around it: inputs [b, K / TP]
    and this rank's weight [H, K / TP] -> ``residual(normed, inputs @ weight.T summed over TP)`` [b, H],
    as one addmm on each rank (the residual from the group's first: ``alpha_on``; addmm does not read
    its input where that factor is 0) and, at TP > 1, one all-reduce."""
    alpha = residual.alpha_on(tp_group.rank())
    if torch.compiler.is_compiling():
        # Inductor lowers addmm to the product and a fused epilogue anyway, and scaling the residual
        # there is what it miscompiled (ScaledResidual): the two ops of the eager form.
        out = scaled_residual(normed, F.linear(inputs, weight), alpha, residual.beta)
    else:
        out = torch.addmm(normed, inputs, weight.t(), beta=alpha, alpha=residual.beta)
    if tp_group.size() == 1:
        return out
    return tensor_parallel.reduce_from_tensor_model_parallel_region(out, group=tp_group)


class RMSNorm(torch.nn.Module):
    """RMSNorm over the last dimension, computed in (at least) fp32 like HF's MiniMaxRMSNorm:
    weight * (x / sqrt(mean(x^2) + eps)).to(x.dtype).

    Megatron's WrappedTorchNorm refuses sequence parallelism; here the weight is marked
    ``sequence_parallel`` so that finalize_model_grads all-reduces its gradient over the TP group
    (each rank saw only its s / TP tokens), as Megatron does for its own norms.
    """

    def __init__(self, config: TransformerConfig, hidden_size: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = torch.nn.Parameter(
            torch.ones(hidden_size, dtype=config.params_dtype, device=parameter_device(config))
        )
        setattr(self.weight, "sequence_parallel", config.sequence_parallel)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return rms_norm(hidden, self.weight, self.eps)

    def step(self, hidden: torch.Tensor) -> torch.Tensor:
        """A decode step's norm of [b, C], without autograd (``rms_norm_step``)."""
        return rms_norm_step(hidden, self.weight, self.eps)


def rms_norm(hidden: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm's math over the whole last dimension of hidden [..., C], as ``_rms_normalize`` computes
    it, through torch's rms_norm (one fused kernel on CUDA, the same ops as _rms_normalize's on a CPU):
    the weight inside it when hidden is fp32 / fp64 of the weight's dtype (weight * normed is
    normed * weight), else applied after the cast back, in hidden's dtype (HF's order)."""
    shape = (hidden.shape[-1],)
    if hidden.dtype in _FP32_OR_WIDER and weight.dtype == hidden.dtype:
        return F.rms_norm(hidden, shape, weight, eps)
    return weight * F.rms_norm(at_least_fp32(hidden), shape, eps=eps).to(hidden.dtype)


def rms_norm_step(hidden: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """A decode step's norm (three a layer, on a few rows) as one kernel. fp32 / fp64: ``rms_norm``'s
    math through the op ``megacispo::rms_norm``, a place for a backend's own kernel (the CPU layer has
    one, parallel/cpu/). bf16 (a GPU's rollouts): torch's fused rms_norm with the weight inside, which
    normalizes in fp32 and rounds once, where ``rms_norm`` (HF's order, the training forward) rounds
    the normalized rows before the weight and runs four kernels: the two may differ in the last bit.
    Under torch.compile the torch ops, which the graph fuses with their neighbours."""
    if hidden.dtype in _FP32_OR_WIDER and not torch.compiler.is_compiling():
        return torch.ops.megacispo.rms_norm(hidden, weight, eps)
    if weight.dtype == hidden.dtype:
        return F.rms_norm(hidden, (hidden.shape[-1],), weight, eps)
    return rms_norm(hidden, weight, eps)


_LIBRARY = torch.library.Library("megacispo", "FRAGMENT")
_LIBRARY.define("rms_norm(Tensor hidden, Tensor weight, float eps) -> Tensor")
_LIBRARY.impl("rms_norm", rms_norm, "CompositeExplicitAutograd")


@torch.library.register_fake("megacispo::rms_norm")
def _(hidden, weight, eps) -> torch.Tensor:
    dtype = torch.promote_types(weight.dtype, hidden.dtype)
    return torch.empty(hidden.shape, dtype=dtype, device=hidden.device)


def _sum_of_squares(wide: torch.Tensor) -> torch.Tensor:
    """[..., C] -> [..., 1]. wide * wide is wide.pow(2) bit for bit (torch computes a square as that
    product) without the exponent's scalar handling: decode steps run this for every norm."""
    return (wide * wide).sum(-1, keepdim=True)


def _rms_normalize(
    hidden: torch.Tensor, wide: torch.Tensor, sum_squares: torch.Tensor, size: int, eps: float, weight: torch.Tensor
) -> torch.Tensor:
    """weight * (x / sqrt(sum_squares / size + eps)).to(x.dtype), with wide = x in at least fp32
    and sum_squares over ``size`` channels: both norms' math. On a CPU torch's mean is this sum
    divided by the count, bit for bit (HF's mean(x^2)); a GPU's mean may differ in the last bit."""
    mean_square = sum_squares / scalar_operand(size, wide)
    normed = wide * torch.rsqrt(mean_square + scalar_operand(eps, wide))
    return weight * normed.to(hidden.dtype)


class _AllReduceSum(torch.autograd.Function):
    """Sum over a group, forward and backward: every rank's output depends on every rank's input."""

    @staticmethod
    def forward(ctx, tensor: torch.Tensor, group) -> torch.Tensor:
        ctx.group = group
        tensor = tensor.clone()
        torch.distributed.all_reduce(tensor, group=group)
        return tensor

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        grad = grad.clone()
        torch.distributed.all_reduce(grad, group=ctx.group)
        return grad, None


def rollout_tensor(owner: torch.nn.Module, key: Hashable, shape: torch.Size | tuple[int, ...], dtype: torch.dtype,
                   device: torch.device) -> torch.Tensor:
    """The tensor that ``owner`` keeps under ``key`` for the rollouts' copies of its weights (a cast
    parameter, a stack of weights), of that shape, dtype and device: made the first time (and when one
    of them changes), the same tensor for every later rollout, which fills it in place, until
    ``release_rollout_tensors``. A compiled decode step's CUDA graphs read the weights at the addresses
    they were recorded with: every rollout then replays them rather than recording them anew at new
    addresses. Marked a static address: a graph reads it in place instead of copying it into its own
    input buffer at every replay."""
    kept = owner.__dict__.setdefault("_rollout_tensors", {})
    tensor = kept.get(key)
    if tensor is None or tensor.shape != shape or tensor.dtype != dtype or tensor.device != device:
        tensor = kept[key] = torch.empty(shape, dtype=dtype, device=device)
        torch._dynamo.mark_static_address(tensor)
    return tensor


def release_rollout_tensors(model: torch.nn.Module) -> None:
    """Drop what ``rollout_tensor`` keeps for ``model``'s modules: the next rollout makes them anew."""
    for module in model.modules():
        module.__dict__.pop("_rollout_tensors", None)


class StacksWeights:
    """A module whose decode step uses one tensor made of several weights (the experts of a MoE layer,
    a softmax layer's q / k / v, a TP-sharded norm's whole weight): HybridModel.generation_dtype fills
    the tensor for a rollout (``stacking_weights``: the same tensor every rollout, ``rollout_tensor``)
    and stops using it after (``forget_stacks``)."""

    def stacked_parameters(self) -> list[torch.nn.Parameter]:
        """The parameters ``stacking_weights`` copies (generation_dtype copies them no other way)."""
        raise NotImplementedError

    def stacking_weights(self, dtype_of) -> list[tuple[torch.nn.Module, str, torch.nn.Parameter]]:
        """Fill the stacks in ``dtype_of(weight)`` with the parameters' places taken by views of them;
        returns what ``stack_weights_as_views`` returns, to put back."""
        raise NotImplementedError

    def forget_stacks(self) -> None:
        """Stop using the stacks (the parameters are put back; the stacks' memory is kept for the next
        rollout): later steps stack on each call."""
        raise NotImplementedError


class TensorParallelRMSNorm(torch.nn.Module, StacksWeights):
    """RMSNorm over channels that are split across the TP group (the lightning attention's nh * d
    output channels, split by heads): the mean of squares is summed over the group, so TP = 2
    computes exactly what TP = 1 does. The weight is TP-sharded like the channels."""

    def __init__(self, config: TransformerConfig, hidden_size: int, eps: float, tp_group) -> None:
        super().__init__()
        self.eps = eps
        self.tp_group = tp_group
        self.tp_size = tp_group.size()
        self.hidden_size = hidden_size
        local_size = divide(hidden_size, self.tp_size)
        self.weight = torch.nn.Parameter(
            torch.ones(local_size, dtype=config.params_dtype, device=parameter_device(config))
        )
        tensor_parallel.set_tensor_model_parallel_attributes(self.weight, is_parallel=True, dim=0, stride=1)
        self._full_weight: torch.Tensor | None = None

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        wide = at_least_fp32(hidden)
        sum_squares = _sum_of_squares(wide)
        if self.tp_size > 1:
            sum_squares = _AllReduceSum.apply(sum_squares, self.tp_group)
        return _rms_normalize(hidden, wide, sum_squares, self.hidden_size, self.eps, self.weight)

    def step(self, hidden: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """A decode step's norm of this rank's channels [b, C / TP], given in at least fp32 (the attention's
        output) and normalized in ``dtype`` (the residual stream's), without autograd (``rms_norm_step``'s
        math). At TP > 1 the rows are all-gathered and every rank normalizes all C channels with the
        whole weight (``full_weight``) in one kernel, then keeps its own: where the sums of squares'
        all-reduce sits between eight, the gathered rows are a decode step's few; the copy that puts
        the gathered columns in place casts them too."""
        if self.tp_size == 1:
            return rms_norm_step(hidden.to(dtype), self.weight, self.eps)
        batch, local = hidden.shape
        gathered = all_gather_columns(hidden, self.tp_group, dtype)  # [b, C]
        normed = rms_norm_step(gathered, self.full_weight(), self.eps)
        return normed.view(batch, self.tp_size, local)[:, self.tp_group.rank()]

    def full_weight(self) -> torch.Tensor:
        """The weight of all C channels [C]: within a rollout the one ``stacking_weights`` gathered, else
        all-gathered now (a collective: the training weights change every step)."""
        if self._full_weight is not None:
            return self._full_weight
        return self._gather_weight(self.weight.dtype)

    def stacked_parameters(self) -> list[torch.nn.Parameter]:
        return [self.weight] if self.tp_size > 1 else []

    def stacking_weights(self, dtype_of) -> list[tuple[torch.nn.Module, str, torch.nn.Parameter]]:
        """At TP > 1 the whole weight, gathered once for the rollout into the tensor every rollout fills
        (``rollout_tensor``), this rank's weight a view of its slice."""
        if self.tp_size == 1:
            return []
        weight = self.weight
        gathered = self._gather_weight(dtype_of(weight))
        self._full_weight = rollout_tensor(self, "full_weight", gathered.shape, gathered.dtype, gathered.device)
        self._full_weight.copy_(gathered)
        copy = torch.nn.Parameter(self._full_weight.chunk(self.tp_size)[self.tp_group.rank()], requires_grad=False)
        copy.__dict__.update(weight.__dict__)  # Megatron's attributes (tensor_model_parallel, ...)
        self._parameters["weight"] = copy
        return [(self, "weight", weight)]

    def forget_stacks(self) -> None:
        self._full_weight = None

    def _gather_weight(self, dtype: torch.dtype) -> torch.Tensor:
        return all_gather_rows(self.weight.detach().to(dtype), self.tp_group)

    def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (), metadata: dict | None = None):
        return make_sharded_tensors_for_checkpoint(
            self.state_dict(prefix="", keep_vars=True), prefix, {"weight": 0}, sharded_offsets,
            tp_group=self.tp_group, dp_cp_group=(metadata or {}).get("dp_cp_group"),
        )


def weight_places(*linears: torch.nn.Module) -> list[tuple[torch.nn.Module, str]]:
    """The ``weight`` of each linear, as ``stack_weights_as_views`` takes places."""
    return [(linear, "weight") for linear in linears]


def weights_at(places: list[tuple[torch.nn.Module, str]]) -> list[torch.Tensor]:
    """The parameters at ``places``, (module, parameter name) pairs."""
    return [getattr(module, name) for module, name in places]


def rollout_weight(module: torch.nn.Module, name: str, dtype: torch.dtype) -> torch.Tensor:
    """What a rollout multiplies in the place of ``module``'s parameter ``name``, to be copied in ``dtype``:
    the parameter, or a LoRA linear's merged weight ``W + s B A`` rounded once, to ``dtype`` (models/lora.py;
    made here, one weight at a time, where a stack copies it: no merged copy of the stacked weights beside
    their stack)."""
    merged_weight = getattr(module, "merged_weight", None)
    if name == "weight" and merged_weight is not None:
        return merged_weight(dtype)
    return getattr(module, name).detach()


def stack_weights_as_views(
    places: list[tuple[torch.nn.Module, str]], dtype_of, *, new_dim: bool
) -> tuple[torch.Tensor, list[tuple[torch.nn.Module, str, torch.nn.Parameter]]]:
    """Copy the weights at ``places`` ((module, parameter name) pairs: a linear's ``weight``, a grouped
    linear's ``weight{i}``) into one tensor, in ``dtype_of(weight)``: stacked along a new first
    dimension (``new_dim``, equal shapes) or concatenated along the output dimension, and put a view
    of it in each weight's place, so that a decode step multiplies by the whole tensor in one kernel
    while the modules keep their parameters' names and shapes. The tensor is the one every rollout
    fills (``rollout_tensor``, kept by the first place's module). Returns (the tensor,
    [(module, name, the parameter replaced)] to put back)."""
    weights = weights_at(places)
    rows = [weight.shape[0] for weight in weights]
    shape = (len(weights), *weights[0].shape) if new_dim else (sum(rows), *weights[0].shape[1:])
    key = (tuple((id(module), name) for module, name in places), new_dim)
    stack = rollout_tensor(places[0][0], key, shape, dtype_of(weights[0]), weights[0].device)
    views = stack.unbind(0) if new_dim else stack.split(rows)
    replaced = []
    for (module, name), weight, view in zip(places, weights, views):
        view.copy_(rollout_weight(module, name, view.dtype))
        copy = torch.nn.Parameter(view, requires_grad=False)
        copy.__dict__.update(weight.__dict__)  # Megatron's attributes (tensor_model_parallel, allreduce, ...)
        replaced.append((module, name, weight))
        module._parameters[name] = copy
    return stack, replaced


def local_column_parallel_linear(
    config: TransformerConfig, input_size: int, output_size: int, tp_group,
    linear: type = tensor_parallel.ColumnParallelLinear, **options,
):
    """A ColumnParallelLinear whose input is already in the tensor-parallel region.

    Each mixer feeds several column-parallel projections from one input; ``enter_tensor_parallel_region``
    does the one all-gather (sequence parallel) or copy (its backward all-reduce) for all of them,
    instead of one per projection as a plain ColumnParallelLinear would. ``linear``: the class, a
    ColumnParallelLinear or a subclass (an adapted one, models/lora.py) taking ``options`` too.
    """
    projection = linear(
        input_size, output_size, config=config, init_method=config.init_method, bias=False,
        gather_output=False, disable_grad_reduce=True, tp_group=tp_group, **options,
    )
    # With disable_grad_reduce the layer skips the copy and the gradient all-reduce; this also
    # skips its own sequence-parallel all-gather (tensor_parallel/layers.py:1028 passes the flag on).
    projection.sequence_parallel = False
    return projection


def row_parallel_linear(
    config: TransformerConfig, input_size: int, output_size: int, tp_group,
    linear: type = tensor_parallel.RowParallelLinear, **options,
):
    """RowParallelLinear from head-split channels back to the hidden size: all-reduce, or
    reduce-scatter along the sequence under sequence parallelism. ``linear``: as for
    ``local_column_parallel_linear``."""
    return linear(
        input_size, output_size, config=config, init_method=config.output_layer_init_method, bias=False,
        input_is_parallel=True, skip_bias_add=True, tp_group=tp_group, **options,
    )


def enter_tensor_parallel_region(hidden: torch.Tensor, sequence_parallel: bool, tp_group) -> torch.Tensor:
    """[s(/TP), b, H] -> [s, b, H], the full sequence on every TP rank, as input to local
    column-parallel projections. Its backward sums the ranks' partial input gradients
    (reduce-scatter under sequence parallelism, all-reduce otherwise)."""
    if sequence_parallel:
        return tensor_parallel.gather_from_sequence_parallel_region(hidden, group=tp_group)
    return tensor_parallel.copy_to_tensor_model_parallel_region(hidden, group=tp_group)


class RotaryEmbedding(torch.nn.Module):
    """cos / sin of RoPE for the first ``rotary_dim`` channels of a head, at given positions.

    Frequencies and angles in fp32 exactly as HF transformers and vLLM compute them
    (inv_freq = 1 / base^(2i / rotary_dim), angle = position * inv_freq), so that training,
    HF and the inference engine see the same rotation.
    """

    def __init__(self, rotary_dim: int, base: float) -> None:
        super().__init__()
        self.rotary_dim = rotary_dim
        self.base = base

    def forward(self, position_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """position_ids [b, s] -> (cos, sin), each [b, s, rotary_dim] fp32."""
        steps = torch.arange(0, self.rotary_dim, 2, dtype=torch.float32, device=position_ids.device)
        inv_freq = 1.0 / (self.base ** (steps / self.rotary_dim))
        angles = position_ids[..., None].float() * inv_freq  # [b, s, rotary_dim / 2]
        angles = torch.cat((angles, angles), dim=-1)
        return angles.cos(), angles.sin()


    def decode_tables(self, position_ids: torch.Tensor, head_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
        """position_ids [b, 1] -> (cos, signed_sin), each [b, 1, 1, head_dim] fp32, for
        ``AttentionStep.rotate``: on the rotary channels cos, and sin negated on their first half
        (where rotate-half takes the negated partner); on the other channels 1 and 0."""
        cos, sin = self.forward(position_ids)  # [b, 1, rotary_dim]
        half = self.rotary_dim // 2
        sign = torch.ones(self.rotary_dim, dtype=sin.dtype, device=sin.device)
        sign[:half] = -1.0
        passed = head_dim - self.rotary_dim
        cos = F.pad(cos, (0, passed), value=1.0)
        signed_sin = F.pad(sin * sign, (0, passed))
        return cos[:, :, None], signed_sin[:, :, None]


def _rotate_half_partners(rotary_dim: int, head_dim: int, device: torch.device) -> torch.Tensor:
    """[head_dim] int64: the channel whose value rotate-half puts in each channel (the channels past
    rotary_dim keep their own; their sin is 0). Made once eagerly (kernels a step would launch);
    a compiled step makes them as constants of its graph."""
    if torch.compiler.is_compiling():
        return _partners(rotary_dim, head_dim, device)
    with torch.inference_mode(False):
        return _cached_partners(rotary_dim, head_dim, device)


def _partners(rotary_dim: int, head_dim: int, device: torch.device) -> torch.Tensor:
    half = rotary_dim // 2
    partners = torch.arange(head_dim, device=device)
    partners[:half] += half
    partners[half:rotary_dim] -= half
    return partners


_cached_partners = functools.cache(_partners)


@dataclass
class AttentionStep:
    """What the softmax layers of one decode step share, made once per step (HybridModel's lean step):
    RoPE at each row's position as a product, a gather and a multiply-add, and the keys' mask as an
    additive bias, so that each layer runs neither the rotation's slicing and concatenations nor the
    boolean mask's conversion."""

    cos: torch.Tensor
    """[b, 1, 1, head_dim] fp32 (``RotaryEmbedding.decode_tables``)."""
    signed_sin: torch.Tensor
    """[b, 1, 1, head_dim] fp32."""
    partners: torch.Tensor
    """[head_dim] int64, ``_rotate_half_partners``."""
    key_bias: torch.Tensor
    """[b, 1, 1, span] in the model's dtype: 0 at the valid keys up to the step's own, -inf at pads and
    past the step's position."""

    @classmethod
    def build(cls, rotary: RotaryEmbedding, position_ids: torch.Tensor, head_dim: int, cache: InferenceCache,
              dtype: torch.dtype, span: int) -> AttentionStep:
        """For rows at position_ids [b, 1] decoding against ``cache`` at ``cache.column`` (already marked
        valid: ``open_step``), whose attention reads ``span`` positions (``step_span``), in ``dtype``."""
        cos, signed_sin = rotary.decode_tables(position_ids, head_dim)
        partners = _rotate_half_partners(rotary.rotary_dim, head_dim, position_ids.device)
        # The buffers past the step's position hold what moved there (drop_oldest): masked by position.
        seen = cache.valid_buffer(span) & (torch.arange(span, device=position_ids.device) <= cache.column)
        key_bias = torch.zeros(seen.shape, dtype=dtype, device=seen.device).masked_fill_(~seen, float("-inf"))
        return cls(cos, signed_sin, partners, key_bias[:, None, None, :])

    @property
    def span(self) -> int:
        return self.key_bias.shape[-1]

    def rotate(self, x: torch.Tensor) -> torch.Tensor:
        """``apply_rotary`` of x [b, heads, 1, head_dim] at this step's positions: x cos + rotate_half(x)
        sin on the rotary channels, computed in (at least) fp32, returned in x's dtype."""
        wide = at_least_fp32(x)
        return torch.addcmul(wide * self.cos, wide.index_select(-1, self.partners), self.signed_sin).to(x.dtype)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    first, second = x.chunk(2, dim=-1)
    return torch.cat((-second, first), dim=-1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate the first cos.shape[-1] channels of x [b, heads, s, d] (rotate-half convention, as HF);
    cos, sin [b, s, rotary_dim]. Computed in (at least) fp32, returned in x's dtype."""
    rotary_dim = cos.shape[-1]
    cos, sin = cos[:, None], sin[:, None]
    rotated, passed = at_least_fp32(x[..., :rotary_dim]), x[..., rotary_dim:]
    rotated = rotated * cos + _rotate_half(rotated) * sin
    return torch.cat((rotated.to(x.dtype), passed), dim=-1)


def _with_capacity(buffer: torch.Tensor, dim: int, used: int, needed: int) -> torch.Tensor:
    """``buffer`` if it has ``needed`` positions along ``dim``, else a new buffer with its first
    ``used`` positions copied and room for max(needed, twice as many): doubling keeps a sequence of
    appends amortized O(1) instead of a copy per token."""
    if buffer.shape[dim] >= needed:
        return buffer
    shape = list(buffer.shape)
    shape[dim] = max(needed, 2 * buffer.shape[dim])
    # Zeros, not garbage: a bucketed decode step reads past the used positions (masked: a NaN there
    # would still reach the output as 0 x NaN).
    grown = buffer.new_zeros(shape)
    grown.narrow(dim, 0, used).copy_(buffer.narrow(dim, 0, used))
    return grown


class InferenceCache:
    """Decoding state of a batch of left-padded sequences, filled by ``HybridModel.prefill`` and
    advanced by ``HybridModel.decode_step`` (in place). Tensors hold this rank's heads only.

    Left padding keeps every lightning state exact: pad tokens get zero keys and values, and the
    state stays zero until the first real token, so no decay is applied for the pads.
    """

    def __init__(self, valid_mask: torch.Tensor, next_positions: torch.Tensor) -> None:
        """valid_mask [b, T] bool, True for the real tokens of the prompts; next_positions [b]."""
        # Positions are appended every decode step: a buffer whose capacity doubles when full keeps
        # the appends amortized O(1) instead of a [b, T] copy per token.
        self._valid_buffer = valid_mask
        self._length = valid_mask.shape[1]
        self.next_positions = next_positions
        """[b] RoPE position of each sequence's next token (its number of real tokens so far)."""
        self.column = torch.tensor(self._length, device=valid_mask.device)
        """[] int64: ``length`` on the device, the position the next decode step writes. The lean step
        reads and advances it (and next_positions) in place, so its graph holds no position: one
        captured graph replays at every step of a bucket (``step_span``)."""
        self.lightning_states: dict[int, torch.Tensor] = {}
        """Global layer index -> [b, heads, d, d] fp32 state of a lightning layer."""
        self.keys: dict[int, torch.Tensor] = {}
        """Global layer index -> [b, kv heads, capacity, d] buffer whose first T positions hold the
        rotated keys of a softmax layer (the capacity doubles when full: amortized O(1) appends)."""
        self.values: dict[int, torch.Tensor] = {}
        """Global layer index -> [b, kv heads, capacity, d], the values, like keys."""
        self.live_rows: torch.Tensor | None = None
        """[b] bool: the rows a decode step advances; the others are held as they are (their lightning
        states unchanged, their new position masked, their RoPE position kept: a multi-turn sample
        waiting for its environment's reply). None: every row advances."""
        self.rows_agree = False
        """Every rank of the expert-parallel group decodes as many rows as this cache's, step for step
        (the rollout's lockstep keeps it so and says so): a decode step's MoE layers may then gather the
        group's tokens (fixed shapes, no host sync) instead of Megatron's all-to-all."""

    @property
    def valid_mask(self) -> torch.Tensor:
        """[b, T] bool: True for the real tokens of all T positions so far (prompt and generated)."""
        return self._valid_buffer[:, : self._length]

    def valid_buffer(self, span: int) -> torch.Tensor:
        """[b, span] bool: the valid mask's buffer over its first ``span`` positions (past ``length``: stale)."""
        return self._valid_buffer[:, :span]

    @property
    def batch_size(self) -> int:
        return self._valid_buffer.shape[0]

    @property
    def length(self) -> int:
        return self._length

    def append_token(self) -> None:
        """Add one position per sequence (a decode step through Megatron's modules) to the valid mask:
        a real token of every row ``live_rows`` advances."""
        self._valid_buffer = _with_capacity(self._valid_buffer, 1, self._length, self._length + 1)
        self._valid_buffer[:, self._length] = True if self.live_rows is None else self.live_rows
        self._length += 1
        self.column.add_(1)

    def append_positions(self, positions: int) -> None:
        """Add ``positions`` real tokens to every sequence (a prefill that continues the cache's sequences)."""
        self._valid_buffer = _with_capacity(self._valid_buffer, 1, self._length, self._length + positions)
        self._valid_buffer[:, self._length:self._length + positions] = True
        self._length += positions
        self.column.add_(positions)

    def advance_positions(self) -> None:
        """Move every row's RoPE position on by a decode step's token (a held row's stays)."""
        self.next_positions = self.next_positions + (1 if self.live_rows is None else self.live_rows)

    # A lean decode step (HybridModel._lean_stage) on fixed shapes: the host picks the span its
    # attention reads (``step_span``), the step writes at ``column`` and advances it on the device
    # (``open_step``, ``step_kv``, ``close_step``), and the host counts it (``count_step``).

    def step_span(self, bucketed: bool) -> int:
        """The positions a lean decode step's attention reads: every position so far and the step's own
        (length + 1); ``bucketed``: that rounded up to a power of two (at least MIN_SPAN, at most one short
        of the buffers' smallest capacity: ``reserve`` makes room for two more positions), so that a
        captured step's shapes take a few values over a rollout instead of one per step. Never the whole
        buffer: its view would be contiguous where the others are not, a guard and a recompile. The
        positions past length + 1 are masked (AttentionStep.build)."""
        needed = self._length + 1
        if not bucketed:
            return needed
        buffers = (*self.keys.values(), *self.values.values())
        capacity = min(self._valid_buffer.shape[1], *(kv.shape[2] for kv in buffers))
        return min(max(MIN_SPAN, 1 << (needed - 1).bit_length()), capacity - 1)

    def open_step(self) -> None:
        """Mark the step's position valid in the rows ``live_rows`` advances (all: None), in place at ``column``."""
        rows = self._valid_buffer.shape[0]
        live = torch.ones(rows, 1, dtype=torch.bool, device=self.column.device) if self.live_rows is None \
            else self.live_rows[:, None]
        self._valid_buffer.index_copy_(1, self.column.view(1), live)

    def step_kv(self, layer_idx: int, keys: torch.Tensor, values: torch.Tensor, span: int
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """Write a softmax layer's key and value of the step ([b, kv heads, 1, d]) at ``column``, in place;
        return its first ``span`` positions, [b, kv heads, span, d] views."""
        for store, new in ((self.keys, keys), (self.values, values)):
            store[layer_idx].index_copy_(2, self.column.view(1), new)
        return self.keys[layer_idx][:, :, :span], self.values[layer_idx][:, :, :span]

    def close_step(self) -> None:
        """After the step's layers: ``column`` and the rows' RoPE positions move on, in place (a held row's stay)."""
        self.column.add_(1)
        self.next_positions.add_(1 if self.live_rows is None else self.live_rows)

    def count_step(self) -> None:
        """The host's count of a lean step's position (the step advanced ``column`` itself)."""
        self._length += 1

    def reserve(self, positions: int) -> None:
        """Make room in every buffer for ``positions`` positions beyond the current ones now, so
        that appending them does not reallocate. A compiled decode step reserves one more than it
        appends: its graph then never grows a buffer, nor sees one filled to capacity (whose
        prefix view would be contiguous, unlike the others: a guard, and a recompile)."""
        needed = self._length + positions
        self._valid_buffer = _with_capacity(self._valid_buffer, 1, self._length, needed)
        for store in (self.keys, self.values):
            for layer_idx, buffer in store.items():
                store[layer_idx] = _with_capacity(buffer, 2, self._length, needed)

    def mark_dynamic_shapes(self, *batch_tensors: torch.Tensor) -> None:
        """For torch.compile: the batch size and the number of positions change between decode steps
        and rollouts; marked dynamic they share one compiled graph (batch 1 keeps its own) instead of
        recompiling once for each new size. ``batch_tensors``: the step's other inputs [b, ...]."""
        for tensor in (*batch_tensors, self.next_positions, *self.lightning_states.values()):
            torch._dynamo.maybe_mark_dynamic(tensor, 0)
        position_dims = [(self._valid_buffer, 1), *((kv, 2) for kv in (*self.keys.values(), *self.values.values()))]
        for tensor, position_dim in position_dims:
            torch._dynamo.maybe_mark_dynamic(tensor, 0)
            torch._dynamo.maybe_mark_dynamic(tensor, position_dim)

    def mark_static_addresses(self) -> None:
        """For CUDA graphs: the buffers a captured decode step mutates in place keep their addresses
        from step to step (a buffer that grows or a cache that is re-selected re-records the graph).
        Unguarded: a new address never recompiles, and without CUDA graphs the marks change nothing."""
        for tensor in (self._valid_buffer, self.column, self.next_positions, *self.lightning_states.values(),
                       *self.keys.values(), *self.values.values()):
            torch._dynamo.mark_static_address(tensor)

    def extend_kv(self, layer_idx: int, keys: torch.Tensor, values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Store a softmax layer's keys and values of the s newest positions ([b, kv heads, s, d],
        valid_mask already covers them); return all T so far, [b, kv heads, T, d] views."""
        total = self.length
        start = total - keys.shape[2]
        for store, new in ((self.keys, keys), (self.values, values)):
            if layer_idx not in store:  # prefill: the prompt's positions exactly
                store[layer_idx] = new.new_zeros(new.shape[0], new.shape[1], total, new.shape[3])
            store[layer_idx] = _with_capacity(store[layer_idx], 2, start, total)
            store[layer_idx][:, :, start:total] = new
        return self.keys[layer_idx][:, :, :total], self.values[layer_idx][:, :, :total]

    def write_rows(self, rows: torch.Tensor, other: InferenceCache) -> None:
        """Replace the sequences of ``rows`` [k] with the k sequences of ``other`` (a prefill of new
        prompts, no longer than this cache): each ends at the newest position, like a left-padded
        prompt, and the older positions of those rows are masked. The other rows keep their state:
        continuous batching refills a finished sequence's slot without recomputing the running ones."""
        total, width = self._length, other.length
        if width > total:
            raise ValueError(f"write_rows: the new sequences span {width} positions, more than this cache's {total}")
        start = total - width
        self._valid_buffer[rows, :start] = False
        self._valid_buffer[rows, start:total] = other.valid_mask
        self.next_positions[rows] = other.next_positions
        for layer_idx, state in other.lightning_states.items():
            self.lightning_states[layer_idx][rows] = state
        for store, new_store in ((self.keys, other.keys), (self.values, other.values)):
            for layer_idx, new in new_store.items():
                store[layer_idx][rows, :, start:total] = new[:, :, :width]

    def drop_oldest(self, positions: int) -> None:
        """Forget the ``positions`` oldest positions of every row, in place (the newer ones move to the
        front of the same buffers): a slot rollout keeps its buffers' capacity bounded by dropping
        positions no running sequence uses (its caller checks that they are masked)."""
        if positions <= 0:
            return
        kept = self._length - positions
        for buffer, dim in [(self._valid_buffer, 1), *((kv, 2) for kv in (*self.keys.values(), *self.values.values()))]:
            # Chunks of ``positions`` never overlap their source: an in-place move without a copy of the buffer.
            for begin in range(0, kept, positions):
                size = min(positions, kept - begin)
                buffer.narrow(dim, begin, size).copy_(buffer.narrow(dim, begin + positions, size))
        self._length = kept
        self.column.sub_(positions)

    def pad_front(self, positions: int) -> None:
        """Put ``positions`` masked positions before the oldest position of every row, in place where the
        buffers have room: the room a row needs to grow at the newest end (``write_rows`` of a longer
        sequence) when its sequence already starts at the oldest position."""
        if positions <= 0:
            return
        used, needed = self._length, self._length + positions
        self._valid_buffer = _with_capacity(self._valid_buffer, 1, used, needed)
        for store in (self.keys, self.values):
            for layer_idx, buffer in store.items():
                store[layer_idx] = _with_capacity(buffer, 2, used, needed)
        for buffer, dim in [(self._valid_buffer, 1), *((kv, 2) for kv in (*self.keys.values(), *self.values.values()))]:
            # From the newest chunk back, so that no chunk overwrites positions still to be moved.
            for end in range(used, 0, -positions):
                begin = max(0, end - positions)
                buffer.narrow(dim, begin + positions, end - begin).copy_(buffer.narrow(dim, begin, end - begin))
        self._valid_buffer[:, :positions] = False
        self._length = needed
        self.column.add_(positions)

    def newest(self, positions: int) -> InferenceCache:
        """The cache of the ``positions`` newest positions of every row (views of these buffers)."""
        start = self._length - positions
        view = InferenceCache(valid_mask=self.valid_mask[:, start:], next_positions=self.next_positions)
        view.lightning_states = dict(self.lightning_states)
        view.keys = {layer: k[:, :, start:self._length] for layer, k in self.keys.items()}
        view.values = {layer: v[:, :, start:self._length] for layer, v in self.values.items()}
        return view

    def select(self, indices: torch.Tensor) -> InferenceCache:
        """The cache of a subset (or a reordering) of the sequences, e.g. to drop finished ones."""
        selected = InferenceCache(valid_mask=self.valid_mask[indices], next_positions=self.next_positions[indices])
        selected.lightning_states = {layer: state[indices] for layer, state in self.lightning_states.items()}
        selected.keys = {layer: k[indices] for layer, k in self.keys.items()}
        selected.values = {layer: v[indices] for layer, v in self.values.items()}
        return selected
