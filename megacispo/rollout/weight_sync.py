"""The weight sync of rollouts on processes of their own (megacispo.rollout.placement).

Weight sync, after each step: every training rank hands its pieces of the parameters (any TP / PP /
EP layout: the layout-independent pieces of ``sharded_state_dict``) to training rank 0, which
assembles the full tensors and broadcasts them as one flat buffer per dtype; each rollout process
copies them into its replica. Supported: any training layout the trainer supports, the rollout side
at TP = PP = EP = 1. Memory on training rank 0's host during a sync: the gathered pieces (the full
model, plus the dense weights once more per data-parallel replica), the assembled tensors and the
flat buffers (the full model each); on each rollout process, the flat buffers (the full model) beside
its replica.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from megacispo.models.hf_names import EXPERT_FC1_KEY, EXPERT_FC2_KEY
from megacispo.parallel.sharded import assemble, parameter_pieces
from megacispo.rollout.placement import Bridge


def parameter_slots(model: torch.nn.Module) -> dict[str, list[tuple[int | None, torch.Tensor]]]:
    """The tensors of a whole (TP = PP = EP = 1) model under the layout-independent checkpoint keys:
    each key's tensor, or for the stacked expert keys ([E, ...]) each expert's index and tensor. The
    tensors are the model's own (``keep_vars``): writing into them writes the model."""
    slots: dict[str, list[tuple[int | None, torch.Tensor]]] = {}
    for name, tensor in model.state_dict(keep_vars=True).items():
        if name.endswith("_extra_state"):
            continue
        if ".mlp.experts.local_experts." in name:
            prefix, rest = name.split(".mlp.experts.local_experts.")
            expert, fc = rest.split(".", 1)
            stacked = EXPERT_FC1_KEY if fc.startswith("linear_fc1") else EXPERT_FC2_KEY
            slots.setdefault(f"{prefix}.{stacked}", []).append((int(expert), tensor))
        else:
            slots[name] = [(None, tensor)]
    return slots


@dataclass
class WeightsHeader:
    """What precedes the flat buffers of a weight sync."""

    version: int
    """The training step whose weights these are."""
    entries: list[tuple[str, torch.dtype, tuple[int, ...]]]
    """(key, dtype, full shape) of every tensor, in buffer order: by dtype, then by key."""


def publish_weights(module: torch.nn.Module, bridge: Bridge | None, version: int) -> None:
    """Every training rank: send the model's full weights to the rollout processes (see the module's
    docstring). Training rank 0 returns once the buffers are queued, not received."""
    pieces = parameter_pieces(module)
    for piece in pieces:
        # Pickled as host copies: a GPU tensor would be unpickled onto the sending rank's GPU.
        piece.data = piece.data.cpu()
    gathered = [None] * dist.get_world_size() if bridge is not None else None
    dist.gather_object(pieces, gathered, dst=0)
    if bridge is None:
        return
    full = assemble(gathered)
    entries = sorted(((key, tensor.dtype, tuple(tensor.shape)) for key, tensor in full.items()),
                     key=lambda entry: (str(entry[1]), entry[0]))
    bridge.broadcast_object(WeightsHeader(version, entries))
    for dtype in _dtypes(entries):
        flat = torch.cat([full[key].reshape(-1) for key, kind, _ in entries if kind == dtype])
        bridge.broadcast_tensor(flat.to(bridge.device))


def receive_weights(model: torch.nn.Module, bridge: Bridge, header: WeightsHeader) -> None:
    """A rollout process: the buffers that follow ``header``, copied into ``model`` (TP = PP = EP = 1)."""
    slots = parameter_slots(model)
    if set(slots) != {key for key, _, _ in header.entries}:
        missing = sorted(set(slots) ^ {key for key, _, _ in header.entries})
        raise RuntimeError(f"weight sync: the training and rollout models differ in the tensors {missing[:4]}")
    for dtype in _dtypes(header.entries):
        group = [(key, shape) for key, kind, shape in header.entries if kind == dtype]
        flat = torch.empty(sum(_numel(shape) for _, shape in group), dtype=dtype, device=bridge.device)
        bridge.broadcast_tensor(flat)
        offset = 0
        with torch.no_grad():
            for key, shape in group:
                full = flat[offset:offset + _numel(shape)].view(shape)
                offset += _numel(shape)
                for expert, target in slots[key]:
                    target.copy_(full if expert is None else full[expert])


def _dtypes(entries: list[tuple[str, torch.dtype, tuple[int, ...]]]) -> list[torch.dtype]:
    return sorted({dtype for _, dtype, _ in entries}, key=str)


def _numel(shape: tuple[int, ...]) -> int:
    return int(torch.Size(shape).numel())
