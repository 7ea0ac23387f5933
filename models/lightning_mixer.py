"""The lightning-attention mixer (MiniMax-01) as a Megatron-Core module.

    q, k, v = split(silu(qkv_proj(h)))       # per head the projection output is [q_h | k_h | v_h]
    o       = lightning_attention(q, k, v)   # S_t = exp(-s_h) S_(t-1) + k_t^T v_t,  o_t = q_t S_t
    o       = sigmoid(output_gate(h)) * RMSNorm(o)   # RMSNorm over all nh * d channels
    a       = out_proj(o)

Tensor parallelism splits the heads: qkv_proj and output_gate are column-parallel (head-major
rows, so a contiguous row block is a block of whole heads), out_proj is row-parallel, and the
RMSNorm's mean of squares is summed over the TP group. The attention itself runs in fp32 (or
fp64 in an fp64 model) whatever the model's dtype: the state accumulates over the whole sequence.

Context parallelism (a packed row whose packed_seq_params.cp_group is set, HybridModel's training
forward at CP > 1) splits the sequence instead: each rank runs its two zigzag chunks and takes the
state entering them from the earlier chunks' states, ``models.lightning_cp.lightning_attention_cp``
(LASP-2). A layer sends 2 [heads, d, d] fp32 states per rank per call, whatever the length, and
reads the row's cu_seqlens on the host once (a device sync where it lives on the GPU).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F
from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.spec_utils import ModuleSpec, build_module
from megatron.core.transformer.transformer_config import TransformerConfig

from megacispo.models.layers import (
    AttentionStep,
    InferenceCache,
    ScaledResidual,
    StacksWeights,
    TensorParallelRMSNorm,
    at_least_fp32,
    enter_tensor_parallel_region,
    local_column_parallel_linear,
    parameter_device,
    row_parallel_linear,
    row_parallel_step,
    stack_weights_as_views,
    weight_places,
)
from megacispo.models.lightning import (
    lightning_attention,
    lightning_decay_rates,
    lightning_state_step,
    lightning_step_decay,
)
from megacispo.models.lightning_cp import lightning_attention_cp


@dataclass
class LightningMixerSubmodules:
    """Builders of the lightning mixer's parts; a projection builder is called as
    (config, input_size, output_size, tp_group)."""

    qkv_proj: Callable = local_column_parallel_linear
    output_gate: Callable = local_column_parallel_linear
    norm: ModuleSpec | type = TensorParallelRMSNorm
    out_proj: Callable = row_parallel_linear


class LightningMixer(MegatronModule, StacksWeights):
    """Lightning attention of one decoder layer: [s(/TP), b, H] -> [s(/TP), b, H]."""

    def __init__(
        self,
        config: TransformerConfig,
        submodules: LightningMixerSubmodules,
        layer_number: int,
        block_size: int,
        norm_eps: float,
        pg_collection: ProcessGroupCollection | None = None,
    ) -> None:
        super().__init__(config=config)
        if pg_collection is None:
            pg_collection = ProcessGroupCollection.use_mpu_process_groups()
        self.tp_group = pg_collection.tp
        tp_size, tp_rank = self.tp_group.size(), self.tp_group.rank()
        self.layer_idx = layer_number - 1  # global, 0-based: it sets the decay rates
        self.block_size = block_size
        self.head_dim = config.kv_channels
        self.num_local_heads = config.num_attention_heads // tp_size
        width = config.num_attention_heads * self.head_dim

        self.qkv_proj = submodules.qkv_proj(config, config.hidden_size, 3 * width, self.tp_group)
        self.output_gate = submodules.output_gate(config, config.hidden_size, width, self.tp_group)
        self.norm = build_module(
            submodules.norm, config=config, hidden_size=width, eps=norm_eps, tp_group=self.tp_group
        )
        self.out_proj = submodules.out_proj(config, width, config.hidden_size, self.tp_group)

        # Derived from the layer index, not learned: kept out of the state dict and out of dtype casts.
        all_rates = lightning_decay_rates(
            config.num_attention_heads, self.layer_idx, config.num_layers, device=parameter_device(config)
        )
        self._decay = all_rates[tp_rank * self.num_local_heads : (tp_rank + 1) * self.num_local_heads].clone()
        self._step_decay: torch.Tensor | None = None
        self._projection_weight: torch.Tensor | None = None

    def decay_rates(self, device: torch.device) -> torch.Tensor:
        """s_h [local heads] fp32 of this rank's heads (moved to the device once)."""
        if self._decay.device != device:
            self._decay = self._decay.to(device)
        return self._decay

    def step_decay(self, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
        """exp(-s_h) [local heads, 1, 1] in ``dtype`` (lightning_step_decay of decay_rates), kept:
        every decode step needs it."""
        if self._step_decay is None or self._step_decay.device != device or self._step_decay.dtype != dtype:
            self._step_decay = lightning_step_decay(self.decay_rates(device).to(dtype), dtype)
        return self._step_decay

    def forward(
        self,
        hidden_states: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        packed_seq_params: PackedSeqParams | None = None,
        inference_context: InferenceCache | None = None,
        **unused,
    ) -> torch.Tensor:
        """hidden_states [s(/TP), b, H]; attention_mask [b, s] bool, True for real tokens (pads get zero
        q, k, v, so they add nothing to the state); packed_seq_params: documents packed in batch 1
        (the state resets at each cu_seqlens_q boundary), with cp_group set this CP rank's zigzag
        tokens of a row whose cu_seqlens_q covers all of it; inference_context: the decoding cache."""
        full = enter_tensor_parallel_region(hidden_states, self.config.sequence_parallel, self.tp_group)
        seq_len, batch = full.shape[:2]
        qkv, _ = self.qkv_proj(full)  # [s, b, heads * 3d]
        qkv = F.silu(qkv).transpose(0, 1).reshape(batch, seq_len, self.num_local_heads, 3 * self.head_dim)
        if attention_mask is not None:
            qkv = qkv * attention_mask[:, :, None, None].to(qkv.dtype)
        q, k, v = at_least_fp32(qkv).split(self.head_dim, dim=-1)  # each [b, s, heads, d]
        out = self._attend(q, k, v, packed_seq_params, inference_context)  # [b, s, heads, d]
        out = out.to(full.dtype).reshape(batch, seq_len, -1).transpose(0, 1)  # [s, b, heads * d]
        gate, _ = self.output_gate(full)
        out, _ = self.out_proj(torch.sigmoid(gate) * self.norm(out))
        return out

    def step(
        self, hidden: torch.Tensor, cache: InferenceCache, attention: AttentionStep | None, residual: ScaledResidual
    ) -> torch.Tensor:
        """One token per sequence, for HybridModel.decode_step: hidden [b, H] (the layer's normalized
        input, every TP rank the same) -> ``residual(hidden, forward(hidden))`` [b, H], what forward
        computes for a one-token decode step, in the same op order and dtypes, with plain matmuls on
        this rank's shards of the projections' weights (its heads) instead of Megatron's linears, and
        the residual added in the output projection (``row_parallel_step``). The layer's state in
        ``cache`` advances in place; ``attention`` is unused (the mixers share one signature)."""
        batch, qkv_width = hidden.shape[0], 3 * self.num_local_heads * self.head_dim
        projected = F.linear(hidden, self.projection_weight())  # [b, 4 heads d]: q, k, v, then the gate
        qkv = F.silu(projected[:, :qkv_width]).reshape(batch, self.num_local_heads, 3 * self.head_dim)
        q, k, v = at_least_fp32(qkv).split(self.head_dim, dim=-1)  # each [b, heads, d]
        out, cache.lightning_states[self.layer_idx] = lightning_state_step(
            q, k, v, self.step_decay(q.device, q.dtype), cache.lightning_states[self.layer_idx], cache.live_rows
        )
        normed = self.norm.step(out.reshape(batch, -1), hidden.dtype)  # [b, heads * d]
        gated = torch.sigmoid(projected[:, qkv_width:]) * normed
        return row_parallel_step(gated, self.out_proj.weight, hidden, residual, self.tp_group)

    def projection_weight(self) -> torch.Tensor:
        """[4 heads d, H]: this rank's q / k / v weight, then its output gate's (both take the layer's
        input, so a decode step runs them as one product); within a rollout the stack
        ``stacking_weights`` made, else concatenated now (a copy)."""
        if self._projection_weight is not None:
            return self._projection_weight
        return torch.cat([self.qkv_proj.weight, self.output_gate.weight])

    def stacked_parameters(self) -> list[torch.nn.Parameter]:
        return [self.qkv_proj.weight, self.output_gate.weight]

    def stacking_weights(self, dtype_of) -> list[tuple[torch.nn.Module, str, torch.nn.Parameter]]:
        places = weight_places(self.qkv_proj, self.output_gate)
        self._projection_weight, replaced = stack_weights_as_views(places, dtype_of, new_dim=False)
        return replaced

    def forget_stacks(self) -> None:
        self._projection_weight = None

    def _attend(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        packed_seq_params: PackedSeqParams | None,
        cache: InferenceCache | None,
    ) -> torch.Tensor:
        if packed_seq_params is not None and packed_seq_params.cp_group is not None:
            return lightning_attention_cp(
                q, k, v, self.decay_rates(q.device).to(q.dtype), packed_seq_params.cu_seqlens_q,
                packed_seq_params.cp_group, block_size=self.block_size,
            )
        state = None if cache is None else cache.lightning_states.get(self.layer_idx)
        if state is not None and q.shape[1] == 1:
            out, state = lightning_state_step(q[:, 0], k[:, 0], v[:, 0], self.step_decay(q.device, q.dtype), state,
                                              cache.live_rows)
            out = out[:, None]
        else:
            cu_seqlens = None if packed_seq_params is None else packed_seq_params.cu_seqlens_q
            out, state = lightning_attention(
                q, k, v, self.decay_rates(q.device).to(q.dtype), initial_state=state, cu_seqlens=cu_seqlens,
                block_size=self.block_size,
            )
        if cache is not None:
            cache.lightning_states[self.layer_idx] = state
        return out

