"""The checks of lightning attention's inputs, and the documents' lengths: shared by the block-wise
torch path (models/lightning.py) and the Triton kernels (models/lightning_triton.py), which the torch
path dispatches to on CUDA. Each bad input is a ValueError naming the argument and what it must be."""

from __future__ import annotations

import torch


def check_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    if q.dim() != 4:
        raise ValueError(f"q must be [batch, seq, heads, head_dim], got shape {tuple(q.shape)}")
    if q.shape[1] == 0:
        raise ValueError("q has sequence length 0; pass at least one token (or skip the call)")
    for name, tensor in (("k", k), ("v", v)):
        if tensor.shape != q.shape:
            raise ValueError(f"{name} must have q's shape {tuple(q.shape)}, got {tuple(tensor.shape)}")
        if tensor.dtype != q.dtype:
            raise ValueError(f"{name} dtype must be q's {q.dtype}, got {tensor.dtype}")


def check_decay_shape(decay: torch.Tensor, num_heads: int) -> None:
    if decay.shape != (num_heads,):
        raise ValueError(f"decay must be [heads] = ({num_heads},), got shape {tuple(decay.shape)}")


def check_decay(decay: torch.Tensor, num_heads: int) -> None:
    """The shape, and the values where reading them costs nothing (on the host): on a GPU the read
    would be a host sync in every lightning layer, and the layers' rates come from
    lightning_decay_rates, finite and positive by construction."""
    check_decay_shape(decay, num_heads)
    if decay.device.type == "cpu" and not bool(torch.all(torch.isfinite(decay) & (decay > 0))):
        raise ValueError(
            f"decay must hold finite positive rates s_h (state factor exp(-s_h) < 1), got {decay.tolist()}; "
            "use lightning_decay_rates"
        )


def check_state(name: str, state: torch.Tensor, expected_shape: tuple[int, ...]) -> None:
    if state.shape != expected_shape:
        raise ValueError(f"{name} must have shape {expected_shape}, got {tuple(state.shape)}")


def document_lengths(cu_seqlens: torch.Tensor | None, batch: int, seq_len: int) -> list[int]:
    """Document lengths as host ints (the block layout is decided on the host: one sync)."""
    if cu_seqlens is None:
        return [seq_len]
    if batch != 1:
        raise ValueError(
            f"cu_seqlens needs the packed documents in one row (batch 1), got batch {batch}; "
            "concatenate the sequences along seq"
        )
    if cu_seqlens.dim() != 1 or cu_seqlens.numel() < 2 or cu_seqlens.is_floating_point():
        raise ValueError(
            f"cu_seqlens must be a 1-D integer tensor [num_docs + 1], got dtype {cu_seqlens.dtype} "
            f"shape {tuple(cu_seqlens.shape)}"
        )
    offsets = cu_seqlens.tolist()
    lengths = [end - start for start, end in zip(offsets[:-1], offsets[1:])]
    if offsets[0] != 0 or offsets[-1] != seq_len or min(lengths) < 1:
        raise ValueError(
            f"cu_seqlens must increase strictly from 0 to seq_len={seq_len} (no empty documents), got {offsets}"
        )
    return lengths
