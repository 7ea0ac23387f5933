"""Megatron-Core's torch_dist load, with the checkpoint's pickles read as megacispo.checkpoint.unpickling
allows: the one way every entry point loads a checkpoint's shards (``load``).

Megatron-Core 0.16.1's ``TorchDistLoadShardedStrategy.load`` builds torch DCP's FileSystemReader
(full pickle for ``.metadata``) and its own ``MCoreLoadPlanner``, whose ``load_bytes`` comes from
torch's DefaultLoadPlanner (``torch.load(weights_only=False)`` for every byte record); its
``TorchCommonLoadStrategy`` reads common.pt with torch.load's default. ``CheckpointLoadStrategy``
and ``CommonLoadStrategy`` are those strategies with ``CheckpointReader``, ``CheckpointLoadPlanner``
and weights-only loading put in. Imports Megatron-Core: imported on first load.
"""

from __future__ import annotations

import io
import os
from pathlib import Path
from typing import Any

import torch
from megatron.core import dist_checkpointing
from megatron.core.dist_checkpointing.dict_utils import nested_values
from megatron.core.dist_checkpointing.mapping import ShardedTensor
from megatron.core.dist_checkpointing.strategies.common import COMMON_STATE_FNAME, TorchCommonLoadStrategy
from megatron.core.dist_checkpointing.strategies.torch import (
    MCoreLoadPlanner,
    TorchDistLoadShardedStrategy,
    _replace_sharded_keys_with_state_dict_keys,
    _replace_state_dict_keys_with_sharded_keys,
    _restore_dict_types,
    _unwrap_pyt_sharded_tensor,
    mcore_to_pyt_state_dict,
)
from torch.distributed import checkpoint as dcp
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.planner import ReadItem

from megacispo.checkpoint.formats import CheckpointError
from megacispo.checkpoint.streaming import check_finite
from megacispo.checkpoint.unpickling import CheckpointReader, RefusedPickle, check_extra_state, load_weights_only


class RefusedRecord(RefusedPickle):
    """A byte record of a shard refused: ``where`` names its file and key."""

    def __init__(self, name: str, where: str):
        super().__init__(name)
        self.where = where

    def __reduce__(self):
        return type(self), (self.name, self.where)


class CheckpointLoadPlanner(MCoreLoadPlanner):
    """Megatron's load planner, reading each byte record weights-only (``load_weights_only``,
    ``check_extra_state``) where torch's reads it with full pickle."""

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        try:
            record = load_weights_only(value)
            check_extra_state(record)
        except RefusedPickle as refused:
            where = self.metadata.storage_data[read_item.storage_index].relative_path
            raise RefusedRecord(refused.name, f"{where}, record {read_item.storage_index.fqn}") from None
        # What DefaultLoadPlanner.load_bytes does with the value it unpickled.
        if self.flatten_state_dict:
            set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], record)
        else:
            self.state_dict[read_item.dest_index.fqn] = record


class CheckpointLoadStrategy(TorchDistLoadShardedStrategy):
    """Megatron's torch_dist sharded load (TorchDistLoadShardedStrategy.load) through
    ``CheckpointReader`` and ``CheckpointLoadPlanner``."""

    def load(self, sharded_state_dict: dict, checkpoint_dir: Path) -> dict:
        tensors = [value for value in nested_values(sharded_state_dict) if isinstance(value, ShardedTensor)]
        shape_checked = [tensor for tensor in tensors if not tensor.allow_shape_mismatch]
        shape_free = {tensor.key: tensor for tensor in tensors if tensor.allow_shape_mismatch}
        original = sharded_state_dict
        sharded_state_dict, flat_mapping, rename_mapping = _replace_state_dict_keys_with_sharded_keys(
            sharded_state_dict)
        pyt_state_dict = mcore_to_pyt_state_dict(sharded_state_dict, True)
        reader = CheckpointReader(checkpoint_dir)
        dcp.load_state_dict(pyt_state_dict, reader, planner=CheckpointLoadPlanner(
            shapes_validation_sharded_tensors=shape_checked, allow_shape_mismatch_sharded_tensors=shape_free))
        self.cached_global_metadata = reader.read_metadata()
        loaded = {key: _unwrap_pyt_sharded_tensor(value) for key, value in pyt_state_dict.items()}
        loaded = _replace_sharded_keys_with_state_dict_keys(loaded, flat_mapping, rename_mapping)
        _restore_dict_types(loaded, original)
        return loaded


class CommonLoadStrategy(TorchCommonLoadStrategy):
    """Megatron's common.pt load, weights-only whatever torch.load's default."""

    def load_common(self, checkpoint_dir: str | os.PathLike) -> Any:
        return load_weights_only(Path(checkpoint_dir) / COMMON_STATE_FNAME)


def load(sharded_state: dict[str, Any], path: Path) -> dict[str, Any]:
    """``dist_checkpointing.load(sharded_state, path)`` with the strategies above."""
    return dist_checkpointing.load(sharded_state, str(path), sharded_strategy=CheckpointLoadStrategy(),
                                   common_strategy=CommonLoadStrategy())


def non_finite_weight(model_state: dict[str, Any], path: Path) -> str | None:
    """The error naming the first tensor of this rank's loaded ``model_state`` that holds a NaN or an
    infinity (``check_finite``), or None."""
    for name, tensor in model_state.items():
        if isinstance(tensor, torch.Tensor) and tensor.is_floating_point():
            try:
                check_finite(name, tensor, path)
            except CheckpointError as error:
                return str(error)
    return None
