"""Layout-independent views of a Megatron-Core model's tensors.

``model.sharded_state_dict()`` names every parameter by a global key and says where the rank's
piece sits in the full tensor (global shape, offset, prepended axes for experts and layers).
Collecting those pieces from every rank rebuilds the full tensors whatever the TP/PP/EP layout:
this is how parallel runs are compared with single-process runs, parameter by parameter and
gradient by gradient.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch
from megatron.core.dist_checkpointing.mapping import ShardedTensor, ShardedTensorFactory


@dataclass
class TensorPiece:
    """One rank's piece of a full tensor (plain data, picklable across processes)."""

    key: str
    data: torch.Tensor
    global_shape: tuple[int, ...]
    global_offset: tuple[int, ...]
    prepend_axis_num: int


def _flatten(sharded_state_dict) -> list:
    if isinstance(sharded_state_dict, dict):
        return [leaf for value in sharded_state_dict.values() for leaf in _flatten(value)]
    if isinstance(sharded_state_dict, (list, tuple)):
        return [leaf for value in sharded_state_dict for leaf in _flatten(value)]
    return [sharded_state_dict]


def sharded_tensors(sharded_state_dict) -> list[ShardedTensor]:
    """The ShardedTensors of a sharded state dict, its factories built."""
    tensors = []
    for leaf in _flatten(sharded_state_dict):
        if isinstance(leaf, ShardedTensorFactory):
            tensors.extend(sharded_tensors(leaf.build()))
        elif isinstance(leaf, ShardedTensor):
            tensors.append(leaf)
    return tensors


def parameter_pieces(model: torch.nn.Module) -> list[TensorPiece]:
    """This rank's pieces of every parameter, keyed by the layout-independent checkpoint key."""
    return [
        TensorPiece(
            key=t.key,
            data=t.data.detach().clone(),
            global_shape=tuple(t.global_shape),
            global_offset=tuple(t.global_offset),
            prepend_axis_num=t.prepend_axis_num,
        )
        for t in sharded_tensors(model.sharded_state_dict())
        if isinstance(t.data, torch.Tensor) and t.flattened_range is None
    ]


@contextlib.contextmanager
def _params_hold_grads(model: torch.nn.Module):
    """Temporarily swap every parameter's data with its gradient, so that code that slices
    parameters (sharded_state_dict and its factories) slices the gradients the same way."""
    params = [p for p in model.parameters() if p.requires_grad]
    saved = [p.data for p in params]
    for param in params:
        grad = getattr(param, "main_grad", None)
        grad = param.grad if grad is None else grad
        param.data = torch.zeros_like(param.data) if grad is None else grad.to(param.dtype)
    try:
        yield
    finally:
        for param, data in zip(params, saved):
            param.data = data


def gradient_pieces(model: torch.nn.Module) -> list[TensorPiece]:
    """This rank's pieces of every parameter's gradient (``main_grad`` under Megatron DDP)."""
    with _params_hold_grads(model):
        return parameter_pieces(model)


def piece_index(global_offset: tuple[int, ...], prepend_axis_num: int, shape: tuple[int, ...]) -> tuple:
    """Where a piece of ``shape`` at ``global_offset`` sits in its full tensor: an index into the full
    tensor (the prepended axes, experts' and layers', by position; the others as slices)."""
    return tuple(global_offset[:prepend_axis_num]) + tuple(
        slice(offset, offset + size) for offset, size in zip(global_offset[prepend_axis_num:], shape)
    )


def assemble(pieces_by_rank: list[list[TensorPiece]]) -> dict[str, torch.Tensor]:
    """Rebuild full tensors from the pieces of all ranks (replicas simply write the same values)."""
    full: dict[str, torch.Tensor] = {}
    for pieces in pieces_by_rank:
        for piece in pieces:
            if piece.key not in full:
                full[piece.key] = torch.zeros(piece.global_shape, dtype=piece.data.dtype, device=piece.data.device)
            target = full[piece.key]
            target[piece_index(piece.global_offset, piece.prepend_axis_num, piece.data.shape)] = piece.data
    return full
