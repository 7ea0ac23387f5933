"""Context parallelism (CP) for the lightning-attention layers: the LASP-2 scheme (arXiv 2502.07563).

A packed row of N tokens (N a multiple of 2 * CP) is cut into 2 * CP equal chunks of C = N / (2 CP)
tokens; CP rank i holds chunk i and chunk 2 * CP - 1 - i, concatenated, as Megatron-Core's CP and
models.softmax_cp do. Documents may cross chunk and rank boundaries. Per head the state obeys

    S_t = exp(-s_h) S_(t-1) + k_t^T v_t,   o_t = q_t S_t

so a chunk's outputs are those computed from a zero state plus exp(-s_h (p + 1)) q_p S_0 at position p
of the chunk, for the state S_0 entering it, while p is in the document that was already running
when the chunk began ("the carried piece"; a document start inside the chunk stops the carried
state). ``lightning_attention_cp``:

1. runs this rank's two chunks from zero states with ``lightning_attention`` (the Triton kernel on
   CUDA), the chunks' document pieces as its documents, and keeps E_c, the state leaving each chunk
   (that of the document piece reaching the chunk's end);
2. all-gathers E over the CP group: 2 [h, d, d] states per rank, whatever N;
3. composes each of its chunks' S_0 from the earlier chunks: the state leaving chunk c is
   T_c = exp(-s_h C) T_(c-1) + E_c if chunk c is one piece of a document begun earlier, else E_c,
   and S_0 of chunk c is T_(c-1) if no document starts at chunk c's first token, else 0; unrolled,
   S_0 is a weighted sum of the gathered E, with weights decided on the host from cu_seqlens;
4. adds the S_0 term to each chunk's carried piece.

Backward is autograd's: the all-gather's backward reduce-scatters the gradients of E to the ranks
that made them, and they flow from there through the kernel's final-state gradient to q, k, v.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import torch.distributed as dist
from megatron.core.tensor_parallel import gather_from_sequence_parallel_region

from megacispo.models.lightning import lightning_attention

__all__ = ["lightning_attention_cp", "lightning_cp_state_bytes"]


def lightning_cp_state_bytes(num_heads: int, head_dim: int, element_size: int) -> int:
    """Bytes one CP rank sends per lightning layer call: its two chunk states [h, d, d]."""
    return 2 * num_heads * head_dim * head_dim * element_size


def lightning_attention_cp(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    decay: torch.Tensor,
    cu_seqlens: torch.Tensor | None,
    cp_group: dist.ProcessGroup,
    block_size: int = 256,
) -> torch.Tensor:
    """Lightning attention of this CP rank's tokens of one packed row -> out [1, 2C, h, d].

    q, k, v: [1, 2C, h, d], this rank's zigzag chunks (chunk r then chunk 2 CP - 1 - r of the row's
    2 CP chunks of C tokens, r the rank in ``cp_group``); decay: [h] positive rates s_h.
    cu_seqlens: int [D + 1], the GLOBAL document offsets of the whole row (0 .. N = 2 C CP), the same
    on every CP rank; None means one document. Gradients flow to q, k, v (of every rank), not to decay.
    block_size: ``lightning_attention``'s (CPU only).

    Host work: cu_seqlens is read once (``.tolist()``, a device sync where it lives on the GPU; pass
    it on the CPU to avoid it), and the per-row plan is cached by the offsets. One all-gather of
    2 h d^2 elements per rank per call, one reduce-scatter of the same size in backward; none at all
    when every chunk starts a document. Every CP rank must call this with the same cu_seqlens.
    """
    if q.dim() != 4 or q.shape[0] != 1:
        raise ValueError(
            f"lightning_attention_cp takes one packed row, q [1, tokens, heads, head_dim], got shape "
            f"{tuple(q.shape)}; concatenate the sequences along tokens and pass their offsets as cu_seqlens"
        )
    cp_size, cp_rank = cp_group.size(), cp_group.rank()
    local_len = q.shape[1]
    if local_len % 2:
        raise ValueError(
            f"this CP rank holds {local_len} tokens; under context parallelism a rank holds two equal "
            f"chunks, so the row's length must be a multiple of 2 * context_parallel_size = {2 * cp_size}: "
            "pad the row with a padding document"
        )
    row_len = local_len * cp_size
    offsets = (0, row_len) if cu_seqlens is None else tuple(_global_offsets(cu_seqlens, row_len))
    plan = _RankPlan.build(offsets, cp_size, cp_rank, q.device)

    out, final_states = lightning_attention(q, k, v, decay, cu_seqlens=plan.local_cu_seqlens, block_size=block_size)
    if plan.weight_lags is None:
        return out
    # This rank's chunk states in rank order; the gather concatenates ranks along dim 0, so row
    # 2 r + j of ``gathered`` is rank r's j-th chunk: global chunk r (j = 0) or 2 CP - 1 - r (j = 1).
    leaving = final_states.index_select(0, plan.chunk_last_pieces)  # [2, h, d, d]
    gathered = gather_from_sequence_parallel_region(leaving, tensor_parallel_output_grad=True, group=cp_group)
    weights = _carry_weights(decay, plan, q.dtype)  # [2, h, 2 CP]
    entering = torch.einsum("jhc,chde->jhde", weights, gathered)  # [2, h, d, d]: S_0 of each chunk
    chunk_len = local_len // 2
    for j, carried_len in enumerate(plan.carried_lengths):
        carried = slice(j * chunk_len, j * chunk_len + carried_len)
        # In place, which autograd allows because neither kernel saves its output for backward; a
        # slice-and-concatenate would copy the output and zero-fill its gradient once per slice.
        out[:, carried] += _initial_state_term(q[:, carried], decay, entering[j])
    return out


def _global_offsets(cu_seqlens: torch.Tensor, row_len: int) -> list[int]:
    if cu_seqlens.dim() != 1 or cu_seqlens.numel() < 2 or cu_seqlens.is_floating_point():
        raise ValueError(
            f"cu_seqlens must be a 1-D integer tensor [num_docs + 1], got dtype {cu_seqlens.dtype} "
            f"shape {tuple(cu_seqlens.shape)}"
        )
    offsets = cu_seqlens.tolist()
    if offsets[0] != 0 or offsets[-1] != row_len or any(b <= a for a, b in zip(offsets[:-1], offsets[1:])):
        raise ValueError(
            f"cu_seqlens must be the whole row's document offsets, increasing strictly from 0 to the row's "
            f"{row_len} tokens (this rank's tokens x context_parallel_size), got {offsets}"
        )
    return offsets


def _initial_state_term(q: torch.Tensor, decay: torch.Tensor, state: torch.Tensor) -> torch.Tensor:
    """exp(-s_h (p + 1)) q_p S_0 for the tokens p = 0 .. L - 1 of q [1, L, h, d]; state S_0 [h, d, d]."""
    steps = torch.arange(1, q.shape[1] + 1, dtype=torch.float64, device=q.device)
    factors = torch.exp(-decay.detach().double()[None, :] * steps[:, None])  # [L, h]
    # A fast head's factor falls towards the denormals, whose products made this term's CPU matmuls
    # 4x slower. Factors under the square root of the smallest normal number become zero, so their
    # products stay normal; what that drops is under 1e-19 of q_p S_0 in fp32 (1e-154 in fp64).
    factors = torch.where(factors < torch.finfo(q.dtype).tiny ** 0.5, 0.0, factors).to(q.dtype)
    return torch.einsum("bphd,hde->bphe", q * factors[None, :, :, None], state)


def _carry_weights(decay: torch.Tensor, plan: _RankPlan, dtype: torch.dtype) -> torch.Tensor:
    """[2, h, 2 CP]: weight exp(-s_h C lag) of each gathered chunk state in S_0 of this rank's two
    chunks, 0 where the lag is -1 (a document boundary lies between); computed in fp64."""
    rate = decay.detach().to(device=plan.weight_lags.device, dtype=torch.float64)[None, :, None]
    lags = plan.weight_lags[:, None, :]
    return (torch.exp(-rate * plan.chunk_len * lags.clamp(min=0)) * (lags >= 0)).to(dtype)


@dataclass(frozen=True)
class _RankPlan:
    """What one CP rank needs to know about the row's documents; decided on the host."""

    chunk_len: int
    local_cu_seqlens: torch.Tensor  # [pieces + 1] int, on the CPU: this rank's document pieces
    chunk_last_pieces: torch.Tensor  # [2] long: the piece that ends each of this rank's chunks
    # Tokens of each local chunk that get the S_0 term. A chunk that starts a document gets it on
    # its first token, with S_0 = 0: that keeps every rank's output connected to the all-gather, so
    # that every rank's backward takes part in the reduce-scatter the others wait in.
    carried_lengths: tuple[int, int]
    # [2, 2 CP] long, rows in gathered order: power of exp(-s_h C) that links that chunk's leaving state
    # to S_0 of the local chunk, -1 where a document boundary lies between. None: no chunk of the
    # row continues a document, so nothing is exchanged.
    weight_lags: torch.Tensor | None

    @staticmethod
    @functools.lru_cache(maxsize=16)
    def build(offsets: tuple[int, ...], cp_size: int, cp_rank: int, device: torch.device) -> _RankPlan:
        num_chunks = 2 * cp_size
        chunk_len = offsets[-1] // num_chunks
        boundaries = set(offsets)
        # continues[c]: chunk c's first token is not a document start; spans[c]: nor is any token of it.
        continues = [c > 0 and c * chunk_len not in boundaries for c in range(num_chunks)]
        spans = [
            continues[c] and not any(c * chunk_len < o < (c + 1) * chunk_len for o in offsets)
            for c in range(num_chunks)
        ]
        local_chunks = (cp_rank, num_chunks - 1 - cp_rank)
        local_offsets, last_pieces, carried = [0], [], []
        for j, c in enumerate(local_chunks):
            start = c * chunk_len
            inside = [o - start for o in offsets if start < o < start + chunk_len]
            local_offsets += [j * chunk_len + o for o in inside] + [(j + 1) * chunk_len]
            last_pieces.append(len(local_offsets) - 2)
            carried.append((inside[0] if inside else chunk_len) if continues[c] else 1)

        gathered_chunks = [c for rank in range(cp_size) for c in (rank, num_chunks - 1 - rank)]
        lags = torch.full((2, num_chunks), -1, dtype=torch.long, device="cpu")  # built on the host, moved once
        for j, c in enumerate(local_chunks):
            if not continues[c]:
                continue
            # S_0 of chunk c = T_(c-1) = sum over c' < c of exp(-s C (c - 1 - c')) E_(c') while every
            # chunk strictly between c' and c is one piece of the document.
            earlier = c - 1
            while True:
                lags[j, gathered_chunks.index(earlier)] = c - 1 - earlier
                if not spans[earlier]:
                    break
                earlier -= 1
        return _RankPlan(
            chunk_len=chunk_len,
            local_cu_seqlens=torch.tensor(local_offsets, dtype=torch.int64, device="cpu"),
            chunk_last_pieces=torch.tensor(last_pieces, dtype=torch.long, device=device),
            carried_lengths=(carried[0], carried[1]),
            weight_lags=lags.to(device) if any(continues) else None,
        )
