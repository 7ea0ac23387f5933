"""Context parallelism (CP) for the softmax-attention layers, the Llama 3 scheme, and the document
masks it shares with packed attention on one rank (models.softmax_attention).

A packed row of N tokens (N a multiple of 2 * CP) is cut into 2 * CP equal chunks; CP rank i holds
chunk i and chunk 2 * CP - 1 - i, concatenated (``megacispo.parallel.context.zigzag_positions``),
so that every rank has the same share of the causal work, as Megatron-Core's CP does.
``attention_cp`` all-gathers K and V over the CP group, lets this rank's queries attend to the
whole row's keys under the causal mask of their GLOBAL positions restricted to their own document
(documents may cross chunk and rank boundaries), and in the backward reduce-scatters dK and dV to
the ranks that own those tokens.

Memory per rank: K and V of the whole row ([b, kv heads, N, d] each, repeated to all heads on CUDA,
see ``masked_attention``) and a [b, 1, N / CP, N] bool mask; the scores are those of SDPA's kernel
(the math kernel on the CPU materializes [b, heads, N / CP, N]).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from megatron.core.tensor_parallel import gather_from_sequence_parallel_region


def document_causal_mask(
    query_positions: torch.Tensor,
    query_documents: torch.Tensor,
    key_positions: torch.Tensor,
    key_documents: torch.Tensor,
) -> torch.Tensor:
    """[b, 1, s, T] bool, True where a query may see a key: the same document, at or before the
    query's position. Queries [b, s] (or [s]), keys [b, T] (or [T]). Every query sees itself, so no
    row is empty."""
    query_positions, query_documents = torch.atleast_2d(query_positions), torch.atleast_2d(query_documents)
    key_positions, key_documents = torch.atleast_2d(key_positions), torch.atleast_2d(key_documents)
    same_document = query_documents[:, :, None] == key_documents[:, None, :]
    causal = key_positions[:, None, :] <= query_positions[:, :, None]
    return (same_document & causal)[:, None]


def masked_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, scale: float
) -> torch.Tensor:
    """SDPA of q [b, heads, s, d] over k, v [b, kv heads, T, d] under a bool mask [b, 1, s, T].

    On CUDA, K and V are repeated to all heads first: SDPA's memory-efficient kernel takes a mask
    but not enable_gqa, and would otherwise fall back to the math kernel, which materializes the
    [b, heads, s, T] scores; the repeat costs [b, heads, T, d] each, linear in T."""
    groups = q.shape[1] // k.shape[1]
    if q.is_cuda and groups > 1:
        k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=groups > 1)


def attention_cp(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    positions: torch.Tensor,
    document_ids: torch.Tensor,
    cp_group: dist.ProcessGroup,
    scale: float,
) -> torch.Tensor:
    """Causal per-document attention of this CP rank's tokens of one packed row -> [b, heads, s, d].

    q [b, heads, s, d], k and v [b, kv heads, s, d]: this rank's s tokens (any split of the row
    works, zigzag balances the work); positions and document_ids [s] (or [b, s]) long: each token's
    position in the packed row (``parallel.context.zigzag_positions``; positions restarting per
    document give the same mask) and its document (``parallel.context.packed_document_ids``). K and
    V travel in one all-gather (their gradients in one reduce-scatter), positions and documents in
    another, without gradients."""
    lengths = {q.shape[2], k.shape[2], v.shape[2], positions.shape[-1], document_ids.shape[-1]}
    if len(lengths) != 1:
        raise ValueError(
            f"attention_cp takes this rank's tokens of q, k, v (sequence lengths {q.shape[2]}, {k.shape[2]}, "
            f"{v.shape[2]}), positions ({positions.shape[-1]}) and document_ids ({document_ids.shape[-1]}): "
            f"pass the same tokens' slices of all five."
        )
    head_dim = k.shape[-1]
    # [b, kv, s, 2d] -> [s, b, kv, 2d]: Megatron's sequence gather works along dim 0, and its
    # backward reduce-scatters there, summing every rank's dK, dV of this rank's tokens.
    kv = torch.cat([k, v], dim=-1).permute(2, 0, 1, 3).contiguous()
    kv = gather_from_sequence_parallel_region(kv, tensor_parallel_output_grad=True, group=cp_group)
    kv = kv.permute(1, 2, 0, 3)
    layout = torch.stack(torch.broadcast_tensors(positions.long(), document_ids.long()))
    key_layout = _all_gather_last_dim(layout, cp_group)
    mask = document_causal_mask(positions, document_ids, key_layout[0], key_layout[1])
    return masked_attention(q, kv[..., :head_dim], kv[..., head_dim:], mask, scale)


def _all_gather_last_dim(tensor: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """Every rank's ``tensor`` [..., s] concatenated along the last dim in rank order (no gradient)."""
    gathered = tensor.new_empty((group.size() * tensor.shape[0], *tensor.shape[1:]))
    dist.all_gather_single(gathered, tensor.contiguous(), group=group)
    return torch.cat(gathered.view(group.size(), *tensor.shape).unbind(0), dim=-1)
