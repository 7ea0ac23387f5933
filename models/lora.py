"""Low-rank adapters (LoRA) on Megatron's parallel linears, sharded as their layers are.

A targeted linear computes ``W x + s B (A x)``, s = lora.alpha / lora.rank, with W frozen. Under tensor
parallelism the adapter splits where its layer splits, so that every rank multiplies only what it holds
and the sum over ranks is the world of one's product:

- column-parallel (W split by output rows): B [out / TP, r] is split the same way, A [r, in] is whole on
  every rank. Each rank's input gradient is partial (the mixer's entry into the TP region, or the MoE
  dispatcher, sums it, as it does W's), and so is A's weight gradient: it is summed over TP in backward.
- row-parallel (W split by input columns): A [r, in / TP] is split the same way, B [out, r] is whole.
  A x is partial; it is summed over TP (all-reduce, or reduce-scatter along the sequence under sequence
  parallelism: r channels, not the H of the layer's own output) before B. Where each rank then holds
  different tokens (sequence parallelism) or a partial output that the MoE dispatcher sums (experts at
  ETP > 1), B's gradient is summed over TP in backward.

Experts are SequentialMLP's own linears: each expert has its own A and B, on its EP rank.

Rollouts multiply the merged weight ``W + s B A`` (``merged_weight``: this rank's shard of it, no
communication), which HybridModel.generation_dtype puts in the weight's place; the adapters' branch is
then skipped (``adapters_merged``).
"""

from __future__ import annotations

import zlib

import torch
import torch.nn.functional as F
from megatron.core import tensor_parallel
from megatron.core.dist_checkpointing.mapping import is_main_replica
from megatron.core.transformer.mlp import apply_swiglu_sharded_factory
from megatron.core.transformer.utils import make_sharded_tensors_for_checkpoint

from megacispo.checkpoint.distributed import sharded_metadata
from megacispo.models.config import LoraConfig, is_adapter_parameter
from megacispo.models.layers import at_least_fp32, parameter_device
from megacispo.parallel.sharded import piece_index, sharded_tensors


class _LinearSummingWeightGrad(torch.autograd.Function):
    """``x @ weight.T`` whose weight gradient is summed over ``group`` in backward: for a weight that is
    the same on every rank of the group while each rank's product sees a different part of the work (a
    column-parallel adapter's A, a row-parallel adapter's B under sequence parallelism)."""

    @staticmethod
    def forward(ctx, inputs: torch.Tensor, weight: torch.Tensor, group) -> torch.Tensor:
        ctx.save_for_backward(inputs, weight)
        ctx.group = group
        return F.linear(inputs, weight)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        inputs, weight = ctx.saved_tensors
        grad_inputs = grad @ weight
        # Summed in at least fp32, as Megatron's DDP reduces bf16 weights' gradients.
        rows, columns = grad.reshape(-1, grad.shape[-1]), inputs.reshape(-1, inputs.shape[-1])
        grad_weight = at_least_fp32(rows).t() @ at_least_fp32(columns)
        torch.distributed.all_reduce(grad_weight, group=ctx.group)
        return grad_inputs, grad_weight.to(weight.dtype), None


def _linear(inputs: torch.Tensor, weight: torch.Tensor, grad_group) -> torch.Tensor:
    """inputs @ weight.T; with a group of more than one rank, weight's gradient summed over it."""
    if grad_group is None or grad_group.size() == 1:
        return F.linear(inputs, weight)
    return _LinearSummingWeightGrad.apply(inputs, weight, grad_group)


class LoraAdapted:
    """What a parallel linear with an adapter adds: ``lora_A`` [r, in(/TP)], ``lora_B`` [out(/TP), r],
    the adapters' branch of its forward, and its merged weight."""

    lora_A: torch.nn.Parameter
    lora_B: torch.nn.Parameter

    def _add_adapters(self, lora: LoraConfig, a_shape: tuple[int, int], b_shape: tuple[int, int], config) -> None:
        self.lora = lora
        self.adapters_merged = False
        device = parameter_device(config)
        # A is drawn by ``init_adapters`` (layout-independent); B starts at zero: the model starts as the base.
        self.lora_A = torch.nn.Parameter(torch.zeros(a_shape, dtype=config.params_dtype, device=device))
        self.lora_B = torch.nn.Parameter(torch.zeros(b_shape, dtype=config.params_dtype, device=device))
        # Megatron's DDP reduces an expert's gradients over the expert-data-parallel group, as the weight's.
        for param in (self.lora_A, self.lora_B):
            setattr(param, "allreduce", self.weight.allreduce)

    def update(self, inputs: torch.Tensor) -> torch.Tensor:
        """B (A x) of the input W's product takes (unscaled), as this rank's share of the layer's output:
        reduced as W's product is (or left partial where W's is)."""
        raise NotImplementedError

    def plus_update(self, inputs: torch.Tensor, product: torch.Tensor) -> torch.Tensor:
        """W's ``product`` of ``inputs`` with the adapter's scaled update added, or alone where the adapter is
        merged into W (within a rollout)."""
        if self.adapters_merged:
            return product
        return torch.add(product, self.update(inputs), alpha=self.lora.scale)

    def _adapter_input(self, inputs: torch.Tensor) -> torch.Tensor:
        # Each rank draws its own mask (its own tokens, channels or output rows: a mask per rank is a mask).
        dropout = self.lora.dropout
        return F.dropout(inputs, dropout, self.training) if dropout else inputs

    def merged_weight(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        """This rank's shard of ``W + s B A`` in ``dtype`` (default: W's), computed in at least fp32 (no
        communication: B's rows and A's columns are the ones W's shard needs)."""
        return self.lora.merged(self.weight.detach(), self.lora_A.detach(), self.lora_B.detach(), dtype)

    def _sharded_axes(self) -> dict[str, int]:
        """Each split parameter's axis (as Megatron's linears name theirs)."""
        raise NotImplementedError

    def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (), metadata: dict | None = None):
        """Megatron's keys for W, and ``lora_A`` / ``lora_B`` split along the axis their shard is cut on
        (the other replicated)."""
        state = self.state_dict(prefix="", keep_vars=True)
        return make_sharded_tensors_for_checkpoint(
            state, prefix, self._sharded_axes(), sharded_offsets, tp_group=self.tp_group,
            dp_cp_group=metadata["dp_cp_group"],
        )


class LoraColumnParallelLinear(LoraAdapted, tensor_parallel.ColumnParallelLinear):
    """A ColumnParallelLinear with an adapter: B split like W's rows, A whole (its gradient summed over TP).
    Its input must be the one W's product takes as it is (already in the TP region: the mixers' local
    projections, or expert linears), so that its input gradient is summed where W's is."""

    def __init__(
        self, input_size: int, output_size: int, *, lora: LoraConfig, config, gated: bool = False, **kwargs
    ) -> None:
        """``gated``: the output is [gate; up] of a SwiGLU (an expert's linear_fc1), whose shards are each
        rank's rows of both halves: B's checkpoint key is then cut as W's (Megatron's swiglu factory)."""
        super().__init__(input_size, output_size, config=config, **kwargs)
        if self.tp_group.size() > 1 and not (self.disable_grad_reduce or self.explicit_expert_comm):
            raise ValueError("an adapter's column-parallel linear must take its input already in the TP region")
        self.gated = gated
        self._add_adapters(lora, (lora.rank, input_size), (self.output_size_per_partition, lora.rank), config)

    def forward(self, input_: torch.Tensor, weight: torch.Tensor | None = None, runtime_gather_output=None):
        output, bias = super().forward(input_, weight, runtime_gather_output)
        return self.plus_update(input_, output), bias

    def update(self, inputs: torch.Tensor) -> torch.Tensor:
        down = _linear(self._adapter_input(inputs), self.lora_A, self.tp_group)  # [..., r]
        return F.linear(down, self.lora_B)

    def _sharded_axes(self) -> dict[str, int]:
        return {"weight": 0, "bias": 0, "lora_B": 0}

    def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (), metadata: dict | None = None):
        state = super().sharded_state_dict(prefix, sharded_offsets, metadata)
        if self.gated:
            key = f"{prefix}lora_B"
            singleton = (metadata or {}).get("singleton_local_shards", False)
            state[key] = apply_swiglu_sharded_factory(state[key], sharded_offsets, singleton)
        return state


class LoraRowParallelLinear(LoraAdapted, tensor_parallel.RowParallelLinear):
    """A RowParallelLinear with an adapter: A split like W's columns, B whole."""

    def __init__(self, input_size: int, output_size: int, *, lora: LoraConfig, config, **kwargs) -> None:
        super().__init__(input_size, output_size, config=config, **kwargs)
        self._add_adapters(lora, (lora.rank, self.input_size_per_partition), (output_size, lora.rank), config)

    def forward(self, input_: torch.Tensor):
        output, bias = super().forward(input_)
        return self.plus_update(input_, output), bias

    def update(self, inputs: torch.Tensor) -> torch.Tensor:
        down = F.linear(self._adapter_input(inputs), self.lora_A)  # [..., r], partial over TP
        tp_size = self.tp_group.size()
        if tp_size > 1 and not self.explicit_expert_comm:
            if self.sequence_parallel:
                down = tensor_parallel.reduce_scatter_to_sequence_parallel_region(down, group=self.tp_group)
            else:
                down = tensor_parallel.reduce_from_tensor_model_parallel_region(down, group=self.tp_group)
        # Each rank's B then sees other tokens (sequence parallel) or a partial sum (experts): sum its gradient.
        grad_group = self.tp_group if self.sequence_parallel or self.explicit_expert_comm else None
        return _linear(down, self.lora_B, grad_group)

    def _sharded_axes(self) -> dict[str, int]:
        return {"weight": 1, "lora_A": 1}


def adapted_linears(model: torch.nn.Module) -> list[LoraAdapted]:
    """The model's linears with adapters."""
    return [module for module in model.modules() if isinstance(module, LoraAdapted)]


def freeze_base(model: torch.nn.Module) -> None:
    """Every parameter but the adapters' leaves autograd (requires_grad = False), before DDP and the
    optimizer are built: the base gets no gradient buffer, no optimizer state and no update."""
    for name, param in model.named_parameters():
        param.requires_grad_(is_adapter_parameter(name))


def init_adapters(model: torch.nn.Module, seed: int) -> None:
    """Draw every A (PEFT's default: kaiming-uniform, a = sqrt(5), i.e. U(-1/sqrt(in), 1/sqrt(in))) and zero
    every B, the same at any layout: each A is drawn whole from a generator seeded by the run's seed and
    its checkpoint key, and each rank keeps its piece."""
    for tensor in sharded_tensors(model.sharded_state_dict()):
        if not is_adapter_parameter(tensor.key):
            continue
        with torch.no_grad():
            if tensor.key.endswith(".lora_B"):
                tensor.data.zero_()
                continue
            # Drawn on the host, the same on every device; each rank copies its piece to its parameter.
            generator = torch.Generator(device="cpu").manual_seed(seed * 1_000_003 + zlib.crc32(tensor.key.encode()))
            bound = tensor.global_shape[-1] ** -0.5
            whole = torch.empty(tensor.global_shape, dtype=torch.float64, device="cpu")
            whole.uniform_(-bound, bound, generator=generator)
            tensor.data.copy_(whole[piece_index(tensor.global_offset, tensor.prepend_axis_num, tensor.data.shape)])


def base_fingerprint(model: torch.nn.Module) -> list[float]:
    """[sum, sum of squares] over every weight of the frozen base (adapters left out), in fp64, summed over
    the world with each piece counted once (its main replica): the same at any layout but for the
    order of the sums, so an adapter checkpoint recognizes the base it was trained on. Call on every rank."""
    # On the weights' device: the all-reduce runs on the run's backend.
    sums = torch.zeros(2, dtype=torch.float64, device=next(model.parameters()).device)
    for tensor in sharded_tensors(model.sharded_state_dict(metadata=sharded_metadata())):
        if is_adapter_parameter(tensor.key) or not is_main_replica(tensor.replica_id):
            continue
        values = tensor.data.detach().to(torch.float64)
        sums += torch.stack([values.sum(), values.square().sum()])
    if torch.distributed.is_initialized():
        torch.distributed.all_reduce(sums)
    return sums.tolist()


def same_base(saved: list[float], loaded: list[float]) -> bool:
    """Whether two ``base_fingerprint``s are of the same weights (to 1e-9: the layouts' orders of summing)."""
    return all(abs(a - b) <= 1e-9 * max(abs(a), abs(b), 1.0) for a, b in zip(saved, loaded, strict=True))
