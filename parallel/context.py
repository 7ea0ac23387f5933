"""Where the tokens of a packed row sit under context parallelism (CP), for the model and the trainer.

A packed row of N tokens (documents laid end to end, their offsets ``cu_seqlens`` as flash-attn's
varlen API) is cut into 2 * CP equal chunks; CP rank i holds chunk i and chunk 2 * CP - 1 - i,
concatenated, so that every rank has the same share of the causal work, as Megatron-Core's CP does.
The trainer slices a row's tokens (and labels, masks, routes) with ``zigzag_positions``; the model
derives from the same positions each token's document and its position within it (RoPE). All of it
runs on the device without host syncs.
"""

from __future__ import annotations

import torch


def zigzag_positions(
    seq_len: int, cp_size: int, cp_rank: int, device: torch.device | str | None = None
) -> torch.Tensor:
    """[seq_len / cp_size] long: the positions in the packed row of CP rank ``cp_rank``'s tokens,
    chunk cp_rank then chunk 2 * cp_size - 1 - cp_rank of 2 * cp_size equal chunks."""
    if seq_len % (2 * cp_size):
        raise ValueError(
            f"a packed row of {seq_len} tokens cannot be split over context_parallel_size = {cp_size}: "
            f"its length must be a multiple of 2 * {cp_size} = {2 * cp_size}; pad the row to "
            f"{-(-seq_len // (2 * cp_size)) * 2 * cp_size} tokens with a padding document."
        )
    chunk = seq_len // (2 * cp_size)
    first = torch.arange(cp_rank * chunk, (cp_rank + 1) * chunk, device=device)
    second = torch.arange((2 * cp_size - 1 - cp_rank) * chunk, (2 * cp_size - cp_rank) * chunk, device=device)
    return torch.cat([first, second])


def packed_document_ids(cu_seqlens: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """The document (0, 1, ...) of each token at ``positions`` of a packed row whose documents end at
    cu_seqlens[1:] (cumulative offsets, as flash-attn's varlen API). No host sync."""
    return torch.searchsorted(cu_seqlens[1:].to(positions.dtype), positions, right=True)


def positions_in_documents(cu_seqlens: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """Each token's position within its own document (0 at a document's first token, RoPE's
    position), for tokens at ``positions`` of the packed row. No host sync."""
    cu_seqlens = cu_seqlens.to(device=positions.device, dtype=positions.dtype)
    return positions - cu_seqlens[packed_document_ids(cu_seqlens, positions)]
