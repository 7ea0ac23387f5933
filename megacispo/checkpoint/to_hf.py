"""megatron-to-hf: a megacispo checkpoint as a Hugging Face MiniMax directory, streamed.

The checkpoint is read one tensor, or one expert of a stacked expert tensor, at a time
(torch.distributed.checkpoint with a one-region load plan) and streamed into safetensors shards whose
layout (names, shapes, offsets) is planned up front from the checkpoint's metadata;
``model.safetensors.index.json`` and config.json follow. Peak memory: the tensor being read.
"""

from __future__ import annotations

import io
import json
import os
import warnings
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import DefaultLoadPlanner, LoadPlan
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata
from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list
from tqdm import tqdm

from megacispo.checkpoint.distributed import params_dtype_of, read_meta, resolve_checkpoint
from megacispo.checkpoint.formats import CONFIG_FILE, INDEX_FILE, SAFETENSORS_DTYPES
from megacispo.checkpoint.streaming import TensorMeter, check_finite, check_new, nbytes, single_process_dcp
from megacispo.checkpoint.unpickling import CheckpointReader
from megacispo.files import staged_directory
from megacispo.models import hf_names
from megacispo.models.config import M1, HybridModelConfig

DEFAULT_MAX_SHARD_BYTES = 5 * 1024**3


class RegionLoadPlanner(DefaultLoadPlanner):
    """A torch.distributed.checkpoint load planner that reads only the region [offsets, offsets +
    destination.shape) of the stored tensor ``key`` into ``destination``, whatever chunks hold it."""

    def __init__(self, key: str, offsets: tuple[int, ...], destination: torch.Tensor) -> None:
        super().__init__()
        self.key = key
        self.offsets = offsets
        self.destination = destination

    def create_local_plan(self) -> LoadPlan:
        region = ChunkStorageMetadata(offsets=torch.Size(self.offsets), sizes=self.destination.shape)
        stored = self.metadata.state_dict_metadata[self.key]
        return LoadPlan(create_read_items_for_chunk_list(self.key, stored, [region]))

    def resolve_tensor(self, read_item) -> torch.Tensor:
        view = self.destination
        for dim, (start, length) in enumerate(zip(read_item.dest_offsets, read_item.lengths)):
            view = view.narrow(dim, start, length)
        return view

    def commit_tensor(self, read_item, tensor: torch.Tensor) -> None:
        """resolve_tensor handed out views of destination: nothing to copy back."""


class CheckpointTensorReader:
    """Regions of the tensors of a torch_dist checkpoint directory, read one at a time."""

    def __init__(self, directory: Path, meter: TensorMeter | None = None):
        self.storage_reader = CheckpointReader(directory)
        self.metadata = self.storage_reader.read_metadata()
        self.meter = meter

    def shape_and_dtype(self, key: str) -> tuple[tuple[int, ...], torch.dtype]:
        value = self.metadata.state_dict_metadata[key]
        return tuple(value.size), value.properties.dtype

    def read(
        self, key: str, offsets: tuple[int, ...] | None = None, sizes: tuple[int, ...] | None = None
    ) -> torch.Tensor:
        """The region [offsets, offsets + sizes) of ``key`` (default: the whole tensor)."""
        shape, dtype = self.shape_and_dtype(key)
        offsets = offsets if offsets is not None else (0,) * len(shape)
        # On the host: the region goes from one checkpoint format to the other and never reaches a GPU.
        destination = torch.empty(sizes if sizes is not None else shape, dtype=dtype, device="cpu")
        if self.meter is not None:
            self.meter.track(destination)
        with single_process_dcp():
            dcp.load({}, storage_reader=self.storage_reader, planner=RegionLoadPlanner(key, offsets, destination),
                     no_dist=True)
        if destination.is_floating_point():
            check_finite(key, destination, self.storage_reader.path)
        return destination


HFReadPlan = list[tuple[list[tuple[str, tuple[int, ...]]], torch.dtype, Callable[[], dict[str, torch.Tensor]]]]


def _hf_tensor_plan(reader: CheckpointTensorReader, config) -> HFReadPlan:
    """(HF names with their shapes, their dtype, a reader of them) in HF order, one entry per tensor we read:
    a whole tensor, or one expert of a stacked expert tensor (legacy layout: one tensor per expert)."""

    plan = []
    for mapping in hf_names.tensor_mappings(config, hf_names.LEGACY):
        if mapping.key not in reader.metadata.state_dict_metadata:
            raise ValueError(
                f"tensor {mapping.key} is missing from the checkpoint {reader.storage_reader.path}: it does not hold "
                f"the model its meta.json describes."
            )
        shape, dtype = reader.shape_and_dtype(mapping.key)
        hf_shapes = {name: tuple(t.shape) for name, t in mapping.to_hf(torch.empty(shape, device="meta")).items()}
        if mapping.key.endswith(hf_names.EXPERT_FC1_KEY):
            for expert in range(shape[0]):
                names = mapping.hf_names[2 * expert : 2 * expert + 2]
                plan.append(([(name, hf_shapes[name]) for name in names], dtype,
                             _expert_reader(reader, mapping.key, expert, shape, names)))
        elif mapping.key.endswith(hf_names.EXPERT_FC2_KEY):
            for expert in range(shape[0]):
                names = mapping.hf_names[expert : expert + 1]
                plan.append(([(name, hf_shapes[name]) for name in names], dtype,
                             _expert_reader(reader, mapping.key, expert, shape, names)))
        else:
            name = mapping.hf_names[0]
            plan.append(([(name, hf_shapes[name])], dtype, _whole_reader(reader, mapping.key, name)))
    return plan


def _whole_reader(reader: CheckpointTensorReader, key: str, name: str) -> Callable[[], dict]:
    return lambda: {name: reader.read(key)}


def _expert_reader(reader: CheckpointTensorReader, key: str, expert: int, shape: tuple[int, ...],
                   names: tuple[str, ...]) -> Callable[[], dict]:
    """Expert ``expert``'s HF tensors: fc1 [2I, H] -> (w1, w3), fc2 [H, I] -> (w2,)."""
    def read() -> dict[str, torch.Tensor]:
        matrix = reader.read(key, (expert,) + (0,) * (len(shape) - 1), (1,) + shape[1:])[0]
        return dict(zip(names, matrix.chunk(len(names), dim=0)))
    return read


class SafetensorsShardWriter:
    """Writes safetensors files whose tensor list is known up front, one tensor at a time: the
    header (names, dtypes, shapes, byte offsets) first, then each tensor's bytes as it comes, so
    only the tensor being written is in memory (safetensors' save_file needs a whole shard)."""

    def __init__(self, directory: Path, shards: list[list[tuple[str, tuple[int, ...], torch.dtype]]]):
        self.directory = directory
        self.shards = shards
        self.file_names = [f"model-{n + 1:05d}-of-{len(shards):05d}.safetensors" for n in range(len(shards))]
        self.pending = iter([(number, *entry) for number, shard in enumerate(shards) for entry in shard])
        self.file: io.BufferedWriter | None = None
        self.file_number = -1

    def _open(self, number: int) -> None:
        if self.file is not None:
            self.file.close()
        header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
        start = 0
        for name, shape, dtype in self.shards[number]:
            end = start + nbytes(shape, dtype)
            header[name] = {"dtype": SAFETENSORS_DTYPES[dtype], "shape": list(shape), "data_offsets": [start, end]}
            start = end
        encoded = json.dumps(header, separators=(",", ":")).encode()
        encoded += b" " * (-len(encoded) % 8)  # the data starts 8-byte aligned, as safetensors writes it
        self.file = open(self.directory / self.file_names[number], "wb")
        self.file.write(len(encoded).to_bytes(8, "little"))
        self.file.write(encoded)
        self.file_number = number

    def write(self, name: str, tensor: torch.Tensor) -> None:
        number, expected, shape, dtype = next(self.pending)
        assert (name, tuple(tensor.shape), tensor.dtype) == (expected, shape, dtype), (name, expected)
        if number != self.file_number:
            self._open(number)
        # The bytes of the contiguous tensor, as uint8 (numpy has no bfloat16); little-endian host.
        self.file.write(tensor.contiguous().reshape(-1).view(torch.uint8).numpy().data)

    def close(self) -> None:
        assert next(self.pending, None) is None, "every planned tensor is written"
        if self.file is not None:
            self.file.close()

    def weight_map(self) -> dict[str, str]:
        return {name: self.file_names[n] for n, shard in enumerate(self.shards) for name, _, _ in shard}


def _plan_shards(entries: list[tuple[str, tuple[int, ...], torch.dtype]], max_shard_bytes: int) -> list[list]:
    """Consecutive tensors in shards of at most max_shard_bytes (a single larger tensor alone)."""
    shards: list[list] = []
    size = 0
    for entry in entries:
        entry_bytes = nbytes(entry[1], entry[2])
        if not shards or (shards[-1] and size + entry_bytes > max_shard_bytes):
            shards.append([])
            size = 0
        shards[-1].append(entry)
        size += entry_bytes
    return shards


def megatron_to_hf(
    ckpt: str | os.PathLike,
    out: str | os.PathLike,
    *,
    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
    progress: bool = True,
    meter: TensorMeter | None = None,
) -> Path:
    """Write an HF directory for a megacispo checkpoint; nothing is left at ``out`` on failure.
    ``meter`` counts the bytes of the tensors held at once."""
    out = Path(out)
    check_new(out)
    with staged_directory(out) as temporary:
        write_hf_files(ckpt, temporary, max_shard_bytes=max_shard_bytes, progress=progress, meter=meter)
    return out


def write_hf_files(
    ckpt: str | os.PathLike,
    directory: Path,
    *,
    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
    progress: bool = True,
    meter: TensorMeter | None = None,
) -> None:
    """The safetensors shards, their index and config.json of a megacispo checkpoint, written into
    the existing empty ``directory`` (megatron_to_hf and megacispo.checkpoint.hf.export_hf make it
    beside their output and rename it when everything is written)."""

    if max_shard_bytes < 1:
        raise ValueError(f"--max-shard-bytes = {max_shard_bytes}: it must be positive.")
    step_dir = resolve_checkpoint(ckpt)
    meta = read_meta(step_dir)
    if not meta.get("config") or "model" not in meta["config"]:
        raise ValueError(f"{step_dir}/meta.json has no config.model: this checkpoint cannot be converted.")
    config = HybridModelConfig(**meta["config"]["model"])
    if config.family == M1 and config.rotary_dim != config.head_dim:
        warnings.warn(
            f"rotary_dim = {config.rotary_dim} < head_dim = {config.head_dim}: HF transformers' MiniMax rotates "
            f"whole heads and ignores config.json's rotary_dim, so transformers will compute different "
            f"outputs; megacispo (and the original MiniMax code) read rotary_dim back.",
            stacklevel=2,
        )
    reader = CheckpointTensorReader(step_dir, meter)
    plan = _hf_tensor_plan(reader, config)
    entries = [(name, shape, dtype) for names, dtype, _ in plan for name, shape in names]
    total_bytes = sum(nbytes(shape, dtype) for _, shape, dtype in entries)
    writer = SafetensorsShardWriter(directory, _plan_shards(entries, max_shard_bytes))
    with tqdm(total=total_bytes, desc="megatron-to-hf", unit="B", unit_scale=True, disable=not progress) as bar:
        for _, _, read in plan:
            for name, tensor in read().items():
                writer.write(name, tensor)
                bar.update(tensor.nbytes)
    writer.close()
    index = {"metadata": {"total_size": total_bytes}, "weight_map": dict(sorted(writer.weight_map().items()))}
    (directory / INDEX_FILE).write_text(json.dumps(index, indent=2))
    (directory / CONFIG_FILE).write_text(json.dumps(hf_names.config_file(config, params_dtype_of(meta)), indent=2))
