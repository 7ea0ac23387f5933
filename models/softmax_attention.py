"""The softmax-attention mixer as a Megatron-Core module: GQA with separate column-parallel q/k/v
projections (HF's q_proj / k_proj / v_proj, each split by heads under TP), M2's QK-norm where the
spec has it (q_norm / k_norm: an RMSNorm over all heads' projected queries, one over the keys, their
mean of squares summed over the TP group), RoPE on the first rotary_dim channels of each head, scale
1/sqrt(head_dim), causal, torch's scaled_dot_product_attention, row-parallel o_proj. A KV cache
serves decoding.

Packed rows (documents laid end to end in batch 1, packed_seq_params) attend causally within each
document; ``attend_documents`` picks the kernel by device. Under context parallelism (a packed row
whose packed_seq_params.cp_group is set, HybridModel's training forward at CP > 1) each rank holds
its zigzag share of the row and attends through ``models.softmax_cp``: K and V of the whole row
all-gathered over the CP group ([1, kv heads, N, d] each per rank), dK and dV reduce-scattered back
(``attention_cp``), or with parallel.context_parallel_comm = p2p passed round a ring of the CP ranks
one block at a time (``attention_cp_ring``). The Transformer Engine backend
(models/te_specs.py) swaps only the projections for TE linears, so its packed and context-parallel
rows take the same paths.
"""

from __future__ import annotations

import functools
import inspect
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F
from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.transformer_config import TransformerConfig

from megacispo.models.layers import (
    AttentionStep,
    InferenceCache,
    ScaledResidual,
    StacksWeights,
    apply_rotary,
    enter_tensor_parallel_region,
    local_column_parallel_linear,
    row_parallel_linear,
    row_parallel_step,
    stack_weights_as_views,
    weight_places,
)
from megacispo.models.softmax_cp import attention_cp, attention_cp_ring, document_causal_mask, masked_attention
from megacispo.parallel.context import packed_document_ids


@dataclass
class PackedRowParams(PackedSeqParams):
    """PackedSeqParams of a packed row whose offsets are also on the run's device: cu_seqlens_q (= kv)
    stays on the host, where the layers plan on it (the lightning layers' document blocks, the CP
    pieces), and ``device_cu_seqlens`` is the copy that the kernels taking the offsets on the device read
    (varlen flash attention, the masked kernel's document ids), made once per row by its packer
    (megacispo.training.packing): a copy in each softmax layer would be a host-to-device copy per layer,
    from pageable memory a wait for the device."""

    device_cu_seqlens: torch.Tensor | None = None
    """cu_seqlens_q as int32 on the run's device."""


@dataclass
class SoftmaxAttentionSubmodules:
    """Builders of the projections, each called as (config, input_size, output_size, tp_group), and of
    the QK-norms, called as (config, width, eps, tp_group) (None: no QK-norm, M1)."""

    q_proj: Callable = local_column_parallel_linear
    k_proj: Callable = local_column_parallel_linear
    v_proj: Callable = local_column_parallel_linear
    o_proj: Callable = row_parallel_linear
    q_norm: Callable | None = None
    k_norm: Callable | None = None


class SoftmaxAttention(MegatronModule, StacksWeights):
    """Causal GQA softmax attention of one decoder layer: [s(/TP), b, H] -> [s(/TP), b, H]."""

    def __init__(
        self,
        config: TransformerConfig,
        submodules: SoftmaxAttentionSubmodules,
        layer_number: int,
        pg_collection: ProcessGroupCollection | None = None,
    ) -> None:
        super().__init__(config=config)
        if pg_collection is None:
            pg_collection = ProcessGroupCollection.use_mpu_process_groups()
        self.tp_group = pg_collection.tp
        tp_size = self.tp_group.size()
        self.layer_idx = layer_number - 1
        self.head_dim = config.kv_channels
        self.num_local_heads = config.num_attention_heads // tp_size
        self.num_local_kv_heads = config.num_query_groups // tp_size
        width = config.num_attention_heads * self.head_dim
        kv_width = config.num_query_groups * self.head_dim
        self.q_proj = submodules.q_proj(config, config.hidden_size, width, self.tp_group)
        self.k_proj = submodules.k_proj(config, config.hidden_size, kv_width, self.tp_group)
        self.v_proj = submodules.v_proj(config, config.hidden_size, kv_width, self.tp_group)
        self.o_proj = submodules.o_proj(config, width, config.hidden_size, self.tp_group)
        self.q_norm = self.k_norm = None
        if submodules.q_norm is not None:
            self.q_norm = submodules.q_norm(config, width, config.layernorm_epsilon, self.tp_group)
            self.k_norm = submodules.k_norm(config, kv_width, config.layernorm_epsilon, self.tp_group)
        self._qkv_weight: torch.Tensor | None = None

    def forward(
        self,
        hidden_states: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        rotary_pos_cos: torch.Tensor | None = None,
        rotary_pos_sin: torch.Tensor | None = None,
        packed_seq_params: PackedSeqParams | None = None,
        inference_context: InferenceCache | None = None,
        **unused,
    ) -> torch.Tensor:
        """hidden_states [s(/TP), b, H]; attention_mask [b, s] bool, True for real tokens (pad keys are
        masked); rotary_pos_cos / _sin [b, s, rotary_dim] for the full sequence; packed_seq_params:
        documents packed in batch 1 (attention stays inside each document), with cp_group set this
        CP rank's zigzag tokens of a row whose cu_seqlens_q covers all of it; inference_context: the
        decoding cache, whose valid_mask already covers these tokens."""
        full = enter_tensor_parallel_region(hidden_states, self.config.sequence_parallel, self.tp_group)
        seq_len, batch = full.shape[:2]
        q, k = self.q_proj(full)[0], self.k_proj(full)[0]  # [s, b, heads * d / TP], [s, b, kv heads * d / TP]
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = self._heads(q, self.num_local_heads), self._heads(k, self.num_local_kv_heads)  # [b, heads, s, d]
        v = self._heads(self.v_proj(full)[0], self.num_local_kv_heads)
        q, k = apply_rotary(q, rotary_pos_cos, rotary_pos_sin), apply_rotary(k, rotary_pos_cos, rotary_pos_sin)
        if inference_context is not None:
            k, v = inference_context.extend_kv(self.layer_idx, k, v)
            out = self._attend(q, k, v, _padded_causal_mask(inference_context.valid_mask, seq_len))
        elif packed_seq_params is not None and packed_seq_params.cp_group is not None:
            out = self._attend_cp(q, k, v, packed_seq_params)
        elif packed_seq_params is not None:
            out = attend_packed_row(q, k, v, packed_seq_params, self.head_dim**-0.5)
        elif attention_mask is not None:
            out = self._attend(q, k, v, _padded_causal_mask(attention_mask.bool(), seq_len))
        else:
            out = self._attend(q, k, v, None)
        out = out.permute(2, 0, 1, 3).reshape(seq_len, batch, -1)
        out, _ = self.o_proj(out)
        return out

    def step(
        self, hidden: torch.Tensor, cache: InferenceCache, attention: AttentionStep, residual: ScaledResidual
    ) -> torch.Tensor:
        """One token per sequence, for HybridModel.decode_step: hidden [b, H] (the layer's normalized
        input, every TP rank the same) -> ``residual(hidden, forward(hidden))`` [b, H], what forward
        computes for a one-token decode step, with one matmul on this rank's q / k / v weights
        (``qkv_weight``: its heads) instead of Megatron's three linears, and the residual added in the
        output projection (``row_parallel_step``); ``attention``: the step's rotation (of q and k
        together: they sit side by side in the product) and key bias. The token's key and value are
        written at ``cache.column`` (``InferenceCache.step_kv``), and the attention reads the step's span."""
        batch, heads, kv_heads, dim = hidden.shape[0], self.num_local_heads, self.num_local_kv_heads, self.head_dim
        qkv = F.linear(hidden, self.qkv_weight())  # [b, (heads + 2 kv heads) d]
        qk = qkv[:, : (heads + kv_heads) * dim]
        if self.q_norm is not None:
            qk = torch.cat([self.q_norm.step(qk[:, : heads * dim], qk.dtype),
                            self.k_norm.step(qk[:, heads * dim :], qk.dtype)], dim=1)
        qk = attention.rotate(qk.reshape(batch, heads + kv_heads, 1, dim))
        q, k = qk[:, :heads], qk[:, heads:]
        v = qkv[:, (heads + kv_heads) * dim :].view(batch, kv_heads, 1, dim)
        k, v = cache.step_kv(self.layer_idx, k, v, attention.span)  # [b, kv heads, span, d]
        # The newest position sees every earlier one: pad keys and positions past it are masked (the
        # same keys as _padded_causal_mask's last row masks, since the token itself is valid).
        out = decode_attention(q, k, v, attention.key_bias, self.head_dim**-0.5)  # [b, heads, 1, d]
        return row_parallel_step(out.reshape(batch, -1), self.o_proj.weight, hidden, residual, self.tp_group)

    def qkv_weight(self) -> torch.Tensor:
        """[(heads + 2 kv heads) d, H]: the q, k and v weights one after the other; within a rollout
        the stack ``stacking_weights`` made, else concatenated now (a copy)."""
        if self._qkv_weight is not None:
            return self._qkv_weight
        return torch.cat([self.q_proj.weight, self.k_proj.weight, self.v_proj.weight])

    def stacked_parameters(self) -> list[torch.nn.Parameter]:
        return [self.q_proj.weight, self.k_proj.weight, self.v_proj.weight]

    def stacking_weights(self, dtype_of) -> list[tuple[torch.nn.Module, str, torch.nn.Parameter]]:
        places = weight_places(self.q_proj, self.k_proj, self.v_proj)
        self._qkv_weight, replaced = stack_weights_as_views(places, dtype_of, new_dim=False)
        return replaced

    def forget_stacks(self) -> None:
        self._qkv_weight = None

    def _attend_cp(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, packed_seq_params: PackedSeqParams):
        """This CP rank's zigzag tokens q [1, heads, s, d], k and v [1, kv heads, s, d] of a packed row
        of s * CP tokens split over packed_seq_params.cp_group -> [1, heads, s, d], by the scheme of
        parallel.context_parallel_comm (TransformerConfig.cp_comm_type): all_gather or p2p (a ring)."""
        attend = attention_cp_ring if self.config.cp_comm_type == "p2p" else attention_cp
        return attend(q, k, v, packed_seq_params.cu_seqlens_q, packed_seq_params.cp_group, self.head_dim**-0.5)

    def _heads(self, projected: torch.Tensor, num_heads: int) -> torch.Tensor:
        """[s, b, heads * d] -> [b, heads, s, d]."""
        seq_len, batch = projected.shape[:2]
        return projected.view(seq_len, batch, num_heads, self.head_dim).permute(1, 2, 0, 3)

    def _attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        """q [b, heads, s, d], k and v [b, kv heads, T, d]; mask [b, 1, s, T] bool (or an additive bias
        in q's dtype), or None: causal (s = T). A mask goes through ``masked_attention``: on CUDA a mask
        with GQA would send SDPA to its math kernel, whose [b, heads, s, T] fp32 scores are 69 GB at
        M1's 8 heads a rank and 32 rows of 8K-token prompts."""
        if mask is not None:
            return masked_attention(q, k, v, mask, self.head_dim**-0.5)
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=self.head_dim**-0.5, enable_gqa=True)


def decode_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, key_bias: torch.Tensor | None, scale: float
) -> torch.Tensor:
    """One query per row: q [b, heads, 1, d] over k, v [b, kv heads, T, d] with key_bias [b, 1, 1, T]
    (0 at valid keys, -inf at pads; None: none) -> [b, heads, 1, d].

    The query heads that share a KV head become that head's queries: q as [b, kv heads, g, d], every
    one of the g seeing all T keys. K and V are then read once per KV head, not repeated to every
    query head (the GQA expansion SDPA would make for a bias it cannot pass to a GQA kernel), and the
    call has equal head counts and an additive bias, which CUDA's memory-efficient kernel takes."""
    batch, heads, _, dim = q.shape
    kv_heads = k.shape[1]
    grouped = q.reshape(batch, kv_heads, heads // kv_heads, dim)
    out = F.scaled_dot_product_attention(grouped, k, v, attn_mask=key_bias, scale=scale)
    return out.reshape(batch, heads, 1, dim)


def attend_packed_row(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, packed_seq_params: PackedSeqParams, scale: float
) -> torch.Tensor:
    """``attend_documents`` on a packed row (batch 1) with its packed_seq_params' offsets: those on the
    host, and their device copy where the row's packer made one (``PackedRowParams``)."""
    device_cu_seqlens = packed_seq_params.device_cu_seqlens if isinstance(packed_seq_params, PackedRowParams) else None
    return attend_documents(q, k, v, packed_seq_params.cu_seqlens_q, packed_seq_params.max_seqlen_q, scale,
                            device_cu_seqlens)


def attend_documents(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor, max_seqlen: int | None, scale: float,
    device_cu_seqlens: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal attention inside each document of a packed row: q [1, heads, T, d], k and v
    [1, kv heads, T, d], documents ending at cu_seqlens[1:] (cu_seqlens[0] = 0, cu_seqlens[-1] = T, on
    the host), the longest ``max_seqlen`` tokens (None: not known) -> [1, heads, T, d].
    ``device_cu_seqlens``: cu_seqlens as int32 on q's device (``PackedRowParams``); None: the CUDA arms
    copy cu_seqlens there, a host-to-device copy. By device:

    - CPU: one SDPA call per document (``_documents_one_by_one``), exact; memory and work
      sum(L_i^2). It reads cu_seqlens on the host, which costs nothing there, and checks it.
    - CUDA, fp16 / bf16: torch's variable-length flash attention (``_documents_varlen``), memory
      linear in T, GQA without repeating K and V. No host sync when ``max_seqlen`` is given
      (PackedSeqParams.max_seqlen_q) and the offsets are on the device; one to find it otherwise.
    - CUDA, fp32 (no flash kernel takes it): SDPA's memory-efficient kernel under a block-diagonal
      causal mask built from document ids (``_documents_masked``), no host sync and no loop. Exact,
      but the mask is T^2 bytes of bool, plus the kernel's T^2 bias in fp32 (5 GiB together at T =
      32k), K and V are repeated to all heads, and the work is T^2 / 2 instead of sum(L_i^2) / 2.
    """
    if q.shape[0] != 1:
        raise ValueError(
            f"packed_seq_params packs documents into one row, but the batch has {q.shape[0]} rows: "
            f"pass input_ids of shape [1, T] with packed_seq_params."
        )
    if not q.is_cuda:
        return _documents_one_by_one(q, k, v, cu_seqlens, scale)
    if device_cu_seqlens is None:
        device_cu_seqlens = cu_seqlens.to(device=q.device, dtype=torch.int32)
    if q.dtype in (torch.float16, torch.bfloat16):
        return _documents_varlen(q, k, v, device_cu_seqlens, max_seqlen, scale)
    return _documents_masked(q, k, v, device_cu_seqlens, scale)


def _documents_one_by_one(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor, scale: float
) -> torch.Tensor:
    seq_len = q.shape[2]
    bounds = cu_seqlens.tolist()
    if bounds[0] != 0 or bounds[-1] != seq_len:
        raise ValueError(
            f"packed_seq_params.cu_seqlens_q spans [{bounds[0]}, {bounds[-1]}] but the sequence has "
            f"{seq_len} tokens: the documents must cover the packed sequence exactly."
        )
    pieces = [
        F.scaled_dot_product_attention(
            q[:, :, start:end], k[:, :, start:end], v[:, :, start:end], is_causal=True, scale=scale, enable_gqa=True
        )
        for start, end in zip(bounds[:-1], bounds[1:])
    ]
    return torch.cat(pieces, dim=2)


def _documents_masked(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor, scale: float
) -> torch.Tensor:
    positions = torch.arange(q.shape[2], device=q.device)
    documents = packed_document_ids(cu_seqlens, positions)
    mask = document_causal_mask(positions, documents, positions, documents)
    return masked_attention(q, k, v, mask, scale)


def _documents_varlen(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor, max_seqlen: int | None, scale: float
) -> torch.Tensor:
    from torch.nn.attention.varlen import varlen_attn

    if max_seqlen is None:
        max_seqlen = int(torch.diff(cu_seqlens).max())  # the caller did not say: one host sync
    # The flash kernel's layout: tokens, heads, d ([T, heads, d]); GQA when heads is a multiple of kv heads.
    q, k, v = (x.squeeze(0).transpose(0, 1) for x in (q, k, v))
    out = varlen_attn(q, k, v, cu_seqlens, cu_seqlens, max_seqlen, max_seqlen, scale=scale,
                      **_varlen_causal_gqa(q.shape[1] != k.shape[1]))
    return out.transpose(0, 1).unsqueeze(0)


@functools.cache
def _varlen_causal_gqa(gqa: bool) -> dict:
    """varlen_attn's keywords for causal attention (and GQA) in this torch, whose API has changed across
    releases: ``is_causal`` in the first, a ``window_size`` of (-1, 0) since; ``enable_gqa`` where it
    exists (without it, the flash kernel takes fewer KV heads as they come)."""
    from torch.nn.attention.varlen import varlen_attn

    parameters = inspect.signature(varlen_attn).parameters
    keywords = {"window_size": (-1, 0)} if "window_size" in parameters else {"is_causal": True}
    if gqa and "enable_gqa" in parameters:
        keywords["enable_gqa"] = True
    return keywords


def _padded_causal_mask(key_valid: torch.Tensor, query_len: int) -> torch.Tensor:
    """[b, 1, s, T] bool: the last s of T positions attend causally to the valid keys.

    A pad query would have no key left (a NaN row in softmax); it may attend to itself. Its output
    is never read by a real token: pads are masked as keys here and zeroed in lightning layers.
    """
    key_len = key_valid.shape[1]
    key_index = torch.arange(key_len, device=key_valid.device)
    query_index = key_index[key_len - query_len :, None]  # absolute positions of the queries
    causal = key_index[None, :] <= query_index  # [s, T]
    itself = key_index[None, :] == query_index
    return ((causal & key_valid[:, None, :]) | itself)[:, None]
