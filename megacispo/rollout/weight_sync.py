"""The weight sync of rollouts on processes of their own (megacispo.rollout.placement).

Weight sync, after each step. Every training rank holds pieces of the parameters (any TP / PP / EP
layout: the layout-independent pieces of ``sharded_state_dict``). The ranks exchange where their
pieces sit (keys, dtypes and blocks, no tensors) and agree on one owner per block (the lowest rank
holding it: replicas send nothing) and on a plan of buckets of ``bucket_bytes`` each: the full tensors
by dtype, then by key, cut between rows of their first dimension. Bucket by bucket, each rank writes its
owned pieces into a zero-filled flat bucket, and a sum-reduce onto training rank 0 assembles the bucket
there (every element comes from one rank, so the sum is its value, bit for bit); training rank 0
broadcasts it to the rollout processes, after one header (the plan) that is the only pickled message.
Each rollout process copies every bucket into its replica. Supported: any training layout the trainer
supports, the rollout side at TP = PP = EP = 1.

``weight_buckets`` and ``full_tensors`` give the same buckets, and the full tensors they hold, to another
consumer: vLLM in every training process (megacispo.rollout.vllm_engine), the buckets all-reduced.

Memory during a sync: on each training rank, a copy of its pieces and one bucket; on training rank 0,
the buckets it has broadcast until the rollout processes receive them (after the round they are
generating: the full model at most); on each rollout process, one bucket beside its replica.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from typing import Iterator

import torch
import torch.distributed as dist

from megacispo.models.config import ALL_WEIGHTS, BASE, in_weights, is_adapter_parameter
from megacispo.models.hf_names import STACKED_EXPERTS
from megacispo.parallel.layout import run_device
from megacispo.parallel.sharded import TensorPiece, parameter_pieces
from megacispo.rollout.placement import Bridge

# A bucket's size: large enough that a sync of M1 takes a few thousand collectives, small enough to
# sit beside the weights on every training rank.
BUCKET_BYTES = 1 << 30


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
            expert, parameter = rest.split(".", 1)  # linear_fc1.weight, linear_fc2.lora_A, ...
            slots.setdefault(f"{prefix}.{STACKED_EXPERTS}.{parameter}", []).append((int(expert), tensor))
        else:
            slots[name] = [(None, tensor)]
    return slots


Segment = tuple[str, int, int]
"""(key, first row, end row): rows of a full tensor's first dimension (a 0-dim tensor has one row)."""


@dataclass
class WeightsHeader:
    """What precedes the buckets of a weight sync."""

    version: int
    """The training step whose weights these are."""
    entries: dict[str, tuple[torch.dtype, tuple[int, ...]]]
    """Every tensor's key: its dtype and full shape."""
    buckets: list[list[Segment]]
    """Each bucket's segments, in order: one dtype per bucket, its tensors by key."""


@dataclass(frozen=True)
class _Block:
    """Where a piece sits in its full tensor: per dimension, its first index and its size."""

    key: str
    dtype: torch.dtype
    global_shape: tuple[int, ...]
    starts: tuple[int, ...]
    sizes: tuple[int, ...]


# What a weight sync sends of a model with LoRA adapters (models/lora.py), beside models.config's ALL_WEIGHTS
# (adapters included: a rollout replica's first sync) and ADAPTERS (its later syncs: the base is frozen and the
# replica merges them): the base with the adapters merged into it (an engine without adapters: vLLM).
MERGED = "merged"


def _pieces(module: torch.nn.Module, weights: str) -> list[TensorPiece]:
    if weights == MERGED:
        with module.merged_adapters():
            return _pieces(module, BASE)
    return [piece for piece in parameter_pieces(module) if in_weights(piece.key, weights)]


def weight_buckets(module: torch.nn.Module, version: int, bucket_bytes: int = BUCKET_BYTES, *,
                   everywhere: bool = False, weights: str = ALL_WEIGHTS) -> tuple[WeightsHeader, Iterator[torch.Tensor]]:
    """Every training rank: the plan of the model's full weights (``weights``: all, the adapters alone, or
    merged) in buckets of ``bucket_bytes``, and the buckets, each sum-reduced onto training rank 0 as it is
    taken (see the module's docstring), or onto every rank (``everywhere``: an all-reduce). Every rank takes
    every bucket, in order; only rank 0's hold the weights, or every rank's with ``everywhere``."""
    pieces = _pieces(module, weights)
    blocks = [_block(piece) for piece in pieces]
    blocks_by_rank: list = [None] * dist.get_world_size()
    dist.all_gather_object(blocks_by_rank, blocks)
    owners: dict[_Block, int] = {}
    for rank, rank_blocks in enumerate(blocks_by_rank):
        for block in rank_blocks:
            owners.setdefault(block, rank)
    owned: dict[str, list[tuple[_Block, torch.Tensor]]] = defaultdict(list)
    for block, piece in zip(blocks, pieces):
        if owners[block] == dist.get_rank():
            owned[block.key].append((block, piece.data.reshape(block.sizes)))
    entries = {block.key: (block.dtype, block.global_shape) for block in owners}
    header = WeightsHeader(version, entries, _plan(entries, bucket_bytes))

    def buckets() -> Iterator[torch.Tensor]:
        for segments in header.buckets:
            flat = torch.zeros(_bucket_numel(header, segments), dtype=entries[segments[0][0]][0], device=run_device())
            for (key, first, end), rows in _segment_rows(header, segments, flat):
                for block, data in owned[key]:
                    low, high = max(block.starts[0], first), min(block.starts[0] + block.sizes[0], end)
                    if low < high:
                        inner = tuple(slice(start, start + size)
                                      for start, size in zip(block.starts[1:], block.sizes[1:]))
                        offset = block.starts[0]
                        rows[(slice(low - first, high - first), *inner)] = data[low - offset:high - offset]
            if everywhere:
                dist.all_reduce(flat)
            else:
                dist.reduce(flat, dst=0)
            yield flat

    return header, buckets()


def publish_weights(module: torch.nn.Module, bridge: Bridge | None, version: int,
                    bucket_bytes: int = BUCKET_BYTES, weights: str = ALL_WEIGHTS) -> None:
    """Every training rank: send the model's full weights (``weights``: all, or the adapters alone) to the
    rollout processes in buckets of ``bucket_bytes`` (see the module's docstring). Training rank 0 returns
    once the buckets are queued, not received."""
    header, buckets = weight_buckets(module, version, bucket_bytes, weights=weights)
    if bridge is not None:
        bridge.broadcast_object(header)
    for flat in buckets:
        if bridge is not None:
            bridge.broadcast_tensor(flat)


def full_tensors(header: WeightsHeader, buckets: Iterator[torch.Tensor]) -> Iterator[tuple[str, torch.Tensor]]:
    """A rank that the buckets reach: each full tensor of ``weight_buckets``, by key, as soon as its last rows
    arrive (a tensor whose rows lie in several buckets is copied together; one within a bucket is a view of it)."""
    pending: dict[str, tuple[torch.Tensor, int]] = {}
    for segments, flat in zip(header.buckets, buckets, strict=True):
        for (key, first, end), rows in _segment_rows(header, segments, flat):
            dtype, shape = header.entries[key]
            num_rows = _row_shape(shape)[0]
            if first == 0 and end == num_rows:
                yield key, rows.view(shape)
                continue
            tensor, filled = pending.pop(key, (torch.empty(_row_shape(shape), dtype=dtype, device=flat.device), 0))
            tensor[first:end] = rows
            if filled + end - first == num_rows:
                yield key, tensor.view(shape)
            else:
                pending[key] = (tensor, filled + end - first)


def receive_weights(model: torch.nn.Module, bridge: Bridge, header: WeightsHeader) -> None:
    """A rollout process: the buckets that follow ``header``, copied into ``model`` (TP = PP = EP = 1): every
    weight, or the adapters alone (which ``generation_dtype`` merges into the weights)."""
    slots = parameter_slots(model)
    adapters = {key for key in slots if is_adapter_parameter(key)}
    if set(header.entries) not in (set(slots), adapters):
        missing = sorted(set(slots) ^ set(header.entries))
        raise RuntimeError(f"weight sync: the training and rollout models differ in the tensors {missing[:4]}")
    for segments in header.buckets:
        flat = torch.empty(_bucket_numel(header, segments), dtype=header.entries[segments[0][0]][0],
                           device=bridge.device)
        bridge.broadcast_tensor(flat, f"a bucket of the weights of step {header.version}")
        with torch.no_grad():
            for (key, first, end), rows in _segment_rows(header, segments, flat):
                shape = header.entries[key][1]
                for expert, target in slots[key]:
                    if expert is None:
                        target.view(_row_shape(shape))[first:end].copy_(rows)
                    elif first <= expert < end:
                        target.copy_(rows[expert - first])


def _block(piece: TensorPiece) -> _Block:
    # The prepended axes (layers, experts) are single indices; a 0-dim tensor is one row of one element.
    prepend = piece.prepend_axis_num
    sizes = (1,) * prepend + tuple(piece.data.shape)
    starts = tuple(piece.global_offset)
    if not sizes:
        starts, sizes = (0,), (1,)
    return _Block(piece.key, piece.data.dtype, tuple(piece.global_shape), starts, sizes)


def _row_shape(shape: tuple[int, ...]) -> tuple[int, ...]:
    return shape if shape else (1,)


def _plan(entries: dict[str, tuple[torch.dtype, tuple[int, ...]]], bucket_bytes: int) -> list[list[Segment]]:
    """The buckets: the tensors by dtype, then by key, each bucket of one dtype and at most
    ``bucket_bytes`` (a single row larger than that makes a bucket of its own)."""
    buckets: list[list[Segment]] = []
    used, dtype_of_last = bucket_bytes, None
    for key in sorted(entries, key=lambda name: (str(entries[name][0]), name)):
        dtype, shape = entries[key]
        rows, *row_shape = _row_shape(shape)
        row_bytes = torch.Size(row_shape).numel() * dtype.itemsize
        first = 0
        while first < rows:
            if dtype != dtype_of_last or used + row_bytes > bucket_bytes:
                buckets.append([])
                used, dtype_of_last = 0, dtype
            end = min(rows, first + max(1, (bucket_bytes - used) // row_bytes))
            buckets[-1].append((key, first, end))
            used += (end - first) * row_bytes
            first = end
    return buckets


def _bucket_numel(header: WeightsHeader, segments: list[Segment]) -> int:
    return sum((end - first) * _row_numel(header.entries[key][1]) for key, first, end in segments)


def _row_numel(shape: tuple[int, ...]) -> int:
    return torch.Size(_row_shape(shape)[1:]).numel()


def _segment_rows(header: WeightsHeader, segments: list[Segment],
                  flat: torch.Tensor) -> Iterator[tuple[Segment, torch.Tensor]]:
    """Each segment of a bucket with its rows in ``flat``, shaped [rows, *the full tensor's other dims]."""
    offset = 0
    for key, first, end in segments:
        shape = _row_shape(header.entries[key][1])
        numel = (end - first) * _row_numel(shape)
        yield (key, first, end), flat[offset:offset + numel].view(end - first, *shape[1:])
        offset += numel
