"""Context parallelism (CP) for the softmax-attention layers, the Llama 3 scheme, and the document
masks it shares with packed attention on one rank (models.softmax_attention).

A packed row of N tokens (N a multiple of 2 * CP) is cut into 2 * CP equal chunks; CP rank i holds
chunk i and chunk 2 * CP - 1 - i, concatenated (``megacispo.parallel.context.zigzag_positions``),
so that every rank has the same share of the causal work, as Megatron-Core's CP does.
``attention_cp`` all-gathers K and V over the CP group, lets this rank's queries attend to their own
document's keys up to their GLOBAL positions (documents may cross chunk and rank boundaries), and in
the backward reduce-scatters dK and dV to the ranks that own those tokens.

Memory per rank: K and V of the whole row ([1, kv heads, N, d] each) and what SDPA's causal kernel
saves for the pieces' queries, linear in N: no [N / CP, N] mask exists (on CUDA; a CPU materializes
each piece's [p, prefix] mask, which is where tests run).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from megatron.core.tensor_parallel import gather_from_sequence_parallel_region
from torch.nn.attention.bias import causal_lower_right

from megacispo.parallel.context import zigzag_positions


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
    cu_seqlens: torch.Tensor,
    cp_group: dist.ProcessGroup,
    scale: float,
) -> torch.Tensor:
    """Causal per-document attention of this CP rank's tokens of one packed row -> [1, heads, s, d].

    q [1, heads, s, d], k and v [1, kv heads, s, d]: this rank's zigzag tokens (``zigzag_positions``:
    chunk r, then chunk 2 CP - 1 - r) of a row of N = s CP tokens whose documents end at
    cu_seqlens[1:] (the whole row's offsets, the same on every rank). K and V travel in one all-gather
    (their gradients in one reduce-scatter). Each piece of a document in a local chunk attends to its
    document's keys up to the piece's end, causal aligned to the lower right (torch's ``CausalBias``:
    flash attention's own causal alignment on CUDA, so no [s, N] mask is built or saved there). Memory
    stays linear in N, and a piece's work is its own queries' (p x prefix): CP divides the attention
    work as it divides the tokens.
    """
    lengths = {q.shape[2], k.shape[2], v.shape[2]}
    if len(lengths) != 1 or q.shape[0] != 1:
        raise ValueError(
            f"attention_cp takes this rank's tokens of one packed row, q [1, heads, s, d] and k, v [1, kv heads, "
            f"s, d], got shapes {tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}"
        )
    cp_size, cp_rank = cp_group.size(), cp_group.rank()
    head_dim, local = k.shape[-1], q.shape[2]
    row_len = local * cp_size
    # [1, kv, s, 2d] -> [s, 1, kv, 2d]: Megatron's sequence gather works along dim 0, and its backward
    # reduce-scatters there, summing every rank's dK, dV of this rank's tokens.
    kv = torch.cat([k, v], dim=-1).permute(2, 0, 1, 3).contiguous()
    kv = gather_from_sequence_parallel_region(kv, tensor_parallel_output_grad=True, group=cp_group)
    gathered_positions = torch.cat([zigzag_positions(row_len, cp_size, rank) for rank in range(cp_size)])
    kv = kv[torch.argsort(gathered_positions).to(kv.device)].permute(1, 2, 0, 3)  # [1, kv, N, 2d], row order
    keys, values = kv[..., :head_dim], kv[..., head_dim:]
    offsets = cu_seqlens.tolist()  # the pieces are decided on the host
    if offsets[0] != 0 or offsets[-1] != row_len:
        raise ValueError(
            f"cu_seqlens spans [{offsets[0]}, {offsets[-1]}] but the row has {row_len} tokens ({local} on each of "
            f"{cp_size} CP ranks): pass the whole row's document offsets"
        )
    chunk = local // 2
    pieces = []
    for slot, chunk_index in enumerate((cp_rank, 2 * cp_size - 1 - cp_rank)):
        start, end = chunk_index * chunk, (chunk_index + 1) * chunk
        for doc_start, doc_end in zip(offsets[:-1], offsets[1:]):
            piece_start, piece_end = max(doc_start, start), min(doc_end, end)
            if piece_start >= piece_end:
                continue
            queries = q[:, :, slot * chunk + piece_start - start: slot * chunk + piece_end - start]
            # The piece's queries are the last of its document's prefix: causal aligned to the lower right.
            causal = causal_lower_right(piece_end - piece_start, piece_end - doc_start)
            pieces.append(F.scaled_dot_product_attention(
                queries, keys[:, :, doc_start:piece_end], values[:, :, doc_start:piece_end], attn_mask=causal,
                scale=scale, enable_gqa=q.shape[1] != k.shape[1],
            ))
    return torch.cat(pieces, dim=2)
