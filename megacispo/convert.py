"""Convert between Hugging Face MiniMax checkpoints and megacispo (Megatron distributed) checkpoints,
streaming tensor by tensor so that memory stays bounded whatever the model's size.

Both directions run in one process. Megatron's distributed checkpoints are keyed by global tensor
and reshard on load, so a checkpoint written here loads at any layout; ``tp/pp/ep/etp`` are only
validated against the model and recorded in meta.json.

hf-to-megatron never builds the weights. It builds the model on the meta device (no memory) at
TP = PP = EP = 1 for what ``HybridModel.sharded_state_dict()`` saves: every tensor's global key,
shape and dtype, its chunks (one per expert and SwiGLU half, as Megatron writes them) and the
Megatron extra-state objects. Each chunk is read from the safetensors when the writer asks for it
(``ChunkSavePlanner.resolve_data``), with torch.distributed.checkpoint writing parts of at most
the largest chunk's size into part directories (its file writer holds a file's tensors until the
file is closed); the parts' files are then moved into the checkpoint and their metadata merged into
one ``.metadata``. Beside it the directory gets what ``megacispo.checkpoint.save_checkpoint``
writes: Megatron's common.pt and metadata.json, and meta.json (no rng/: a converted checkpoint has
no RNG states, and loads with ``load_rng=False`` as train.load, sft.load and score do).

megatron-to-hf reads the checkpoint one tensor, or one expert of a stacked expert tensor, at a
time (torch.distributed.checkpoint with a one-region load plan) and streams it into safetensors
shards whose layout (names, shapes, offsets) is planned up front from the checkpoint's metadata;
``model.safetensors.index.json`` and config.json follow.

Peak memory: a part (at most the largest chunk) plus the chunk being read; reading and writing
keep no other tensor. ``TensorMeter`` counts the bytes of the tensors the converter holds.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import io
import json
import os
import secrets
import shutil
import sys
import warnings
import math
import weakref
from pathlib import Path
from typing import Any, Callable, Iterator

import torch
import torch.distributed.checkpoint as dcp
from safetensors import SafetensorError, safe_open
from torch.distributed.checkpoint import DefaultLoadPlanner, DefaultSavePlanner, FileSystemWriter, LoadPlan, SavePlan
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    MetadataIndex,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType
from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list
from torch.distributed.checkpoint.storage import WriteResult

from tqdm import tqdm

from megacispo.checkpoint import (
    MEGATRON_COMMON_FILE,
    MEGATRON_CONFIG_FILE,
    checkpoint_dir,
    checkpoint_meta,
    load_checkpoint,
    params_dtype_of,
    read_meta,
    resolve_checkpoint,
    sharded_metadata,
    write_meta,
)
from megacispo.cli import bad_input_exits
from megacispo.config import Config, to_dict
from megacispo.models import hf_names
from megacispo.models.config import PARAMS_DTYPES, HybridModelConfig, model_shape, transformer_config
from megacispo.models.hf_names import EXPERT_FC1_KEY, EXPERT_FC2_KEY, FUSED
from megacispo.parallel.layout import ParallelConfig, init_distributed, validate_layout

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
CONFIG_FILE = "config.json"
CONVERTED_STEP = 0
# Derived (recomputed) lightning buffers that HF may hold: neither read nor written.
DERIVED_SUFFIXES = ("slope_rate", "query_decay", "key_decay", "diagonal_decay")
SAFETENSORS_DTYPES = {torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16"}
SAFETENSORS_DTYPE_OF = {name: dtype for dtype, name in SAFETENSORS_DTYPES.items()}
DEFAULT_MAX_SHARD_BYTES = 5 * 1024**3
CLI_HELP = """Convert between Hugging Face MiniMax checkpoints and megacispo (Megatron distributed) checkpoints,
streaming tensor by tensor (memory: a few tensors, never the model).

    python tools/convert_checkpoint.py hf-to-megatron --hf-dir HF --out CKPT [--tp T --pp P --ep E --etp X]
    python tools/convert_checkpoint.py megatron-to-hf --ckpt CKPT --out HF

A checkpoint written here loads at any layout; --tp/--pp/--ep/--etp are validated and recorded in
meta.json. Everything is written beside --out and renamed at the end: a failed conversion leaves
nothing at --out. See docs/conversion.md."""
# What Megatron's metadata.json (checkpoint.MEGATRON_CONFIG_FILE) records; its common.pt is empty for HybridModel.
MEGATRON_BACKEND = {"sharded_backend": "torch_dist", "sharded_backend_version": 1,
                    "common_backend": "torch", "common_backend_version": 1}


class TensorMeter:
    """Bytes of the tensors the converter holds at once: every tensor it reads or makes is tracked
    until the last reference to it is gone (weakref finalizers), whoever keeps it (the writers
    too); tensors that share memory (views) count once."""

    def __init__(self) -> None:
        self.live_bytes = 0
        self.peak_bytes = 0
        self.largest_bytes = 0
        self._holders: dict[int, list[int]] = {}
        """storage address -> [number of live tracked tensors on it, its bytes]"""

    def track(self, tensor: torch.Tensor) -> torch.Tensor:
        storage = tensor.untyped_storage()
        address, nbytes = storage.data_ptr(), storage.nbytes()
        holders = self._holders.setdefault(address, [0, nbytes])
        if holders[0] == 0:
            self.live_bytes += nbytes
            self.peak_bytes = max(self.peak_bytes, self.live_bytes)
            self.largest_bytes = max(self.largest_bytes, nbytes)
        holders[0] += 1
        weakref.finalize(tensor, self._release, address)
        return tensor

    def _release(self, address: int) -> None:
        holders = self._holders[address]
        holders[0] -= 1
        if holders[0] == 0:
            self.live_bytes -= holders[1]
            del self._holders[address]


@contextlib.contextmanager
def _single_process_dcp() -> Iterator[None]:
    """torch.distributed.checkpoint with no_dist=True warns that it assumes one process: meant here."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*assuming the intent is to (save|load) in a single process.*")
        yield


def _nbytes(shape: tuple[int, ...] | torch.Size, dtype: torch.dtype) -> int:
    numel = 1
    for size in shape:
        numel *= size
    return numel * dtype.itemsize


# ---------------------------------------------------------------------------------------------
# Reading an HF directory


@dataclasses.dataclass
class HFCheckpoint:
    """An HF directory's config and where each tensor lives."""

    directory: Path
    config: dict[str, Any]
    file_of: dict[str, str]
    """HF tensor name -> safetensors file name (relative to directory)."""
    shape_of: dict[str, tuple[int, ...]]
    dtype_of: dict[str, str]
    """HF tensor name -> safetensors dtype name (F32, BF16, ...)."""

    def path_of(self, name: str) -> Path:
        return self.directory / self.file_of[name]


def read_hf_checkpoint(hf_dir: str | os.PathLike) -> HFCheckpoint:
    """config.json and each tensor's file, shape and dtype; checks that every listed file exists
    and that the index names only tensors its files hold. Reads headers only, no tensor data."""

    directory = Path(hf_dir)
    if not directory.is_dir():
        raise ValueError(f"{directory}: no such directory; pass a Hugging Face model directory.")
    config_path = directory / CONFIG_FILE
    if not config_path.is_file():
        raise ValueError(f"{directory}: it has no {CONFIG_FILE}; pass a Hugging Face model directory.")
    config = read_json(config_path)
    index_path = directory / INDEX_FILE
    if index_path.is_file():
        weight_map = read_json(index_path).get("weight_map")
        if not isinstance(weight_map, dict):
            raise ValueError(f"{index_path} has no weight_map object: download it again.")
        file_of = dict(weight_map)
    elif (directory / SINGLE_FILE).is_file():
        file_of = {}
    else:
        raise ValueError(f"{directory}: neither {INDEX_FILE} nor {SINGLE_FILE} is there; pass a Hugging Face model "
                         f"directory with its weights.")
    files = sorted(set(file_of.values())) or [SINGLE_FILE]
    listed_by_index = bool(file_of)
    shape_of, dtype_of = {}, {}
    for file_name in files:
        path = directory / file_name
        if not path.is_file():
            first = next((name for name, f in file_of.items() if f == file_name), "?")
            raise ValueError(
                f"shard {path} is missing: {INDEX_FILE} places tensor {first} (and others) in it. "
                f"Download the complete checkpoint."
            )
        try:
            with safe_open(str(path), framework="pt") as handle:
                for name in handle.keys():
                    tensor_slice = handle.get_slice(name)
                    shape_of[name], dtype_of[name] = tuple(tensor_slice.get_shape()), tensor_slice.get_dtype()
                    if not listed_by_index:
                        file_of[name] = file_name
        except SafetensorError as error:
            raise ValueError(f"{path} is not a readable safetensors file ({error}): download it again.") from None
    for name, file_name in file_of.items():
        if name not in shape_of:
            raise ValueError(
                f"tensor {name} is listed in {index_path} under {directory / file_name}, but that file does not "
                f"hold it."
            )
    return HFCheckpoint(directory, config, file_of, shape_of, dtype_of)


def read_json(path: Path) -> dict[str, Any]:
    """A JSON object file of an HF directory; ValueError naming the file when it is not one."""
    try:
        value = json.loads(path.read_text())
    except (UnicodeDecodeError, json.JSONDecodeError) as error:
        raise ValueError(f"{path} is not valid JSON ({error}): download it again.") from None
    if not isinstance(value, dict):
        raise ValueError(f"{path} holds a {type(value).__name__}, not a JSON object: download it again.")
    return value


class HFTensorReader:
    """HF tensors by name, read with plain file reads at the offsets of the safetensors header:
    exactly the requested bytes are allocated. (safetensors' safe_open memory-maps the file, whose
    pages stay resident while it is open, and in 0.8 a slice [i] of a tensor keeps the whole
    tensor's storage.)"""

    def __init__(self, checkpoint: HFCheckpoint, meter: TensorMeter | None = None):
        self.checkpoint = checkpoint
        self.meter = meter
        self.headers: dict[str, tuple[int, dict[str, Any]]] = {}
        """file name -> (where its data starts, its header)"""

    def _header(self, file_name: str) -> tuple[int, dict[str, Any]]:
        if file_name not in self.headers:
            with open(self.checkpoint.directory / file_name, "rb") as file:
                header_bytes = int.from_bytes(file.read(8), "little")
                self.headers[file_name] = (8 + header_bytes, json.loads(file.read(header_bytes)))
        return self.headers[file_name]

    def read(self, name: str, index: int | None = None) -> torch.Tensor:
        """The tensor, or only its slice [index] along the first axis."""
        file_name = self.checkpoint.file_of[name]
        data_start, header = self._header(file_name)
        entry = header[name]
        if entry["dtype"] not in SAFETENSORS_DTYPE_OF:
            raise ValueError(
                f"HF tensor {name} in {self.checkpoint.path_of(name)} is {entry['dtype']}: the converter reads "
                f"{sorted(SAFETENSORS_DTYPE_OF)}."
            )
        shape, start = tuple(entry["shape"]), entry["data_offsets"][0]
        if index is not None:
            shape = shape[1:]
            start += index * _nbytes(shape, SAFETENSORS_DTYPE_OF[entry["dtype"]])
        # On the host: the file is read into its bytes through numpy.
        tensor = torch.empty(shape, dtype=SAFETENSORS_DTYPE_OF[entry["dtype"]], device="cpu")
        if self.meter is not None:
            self.meter.track(tensor)
        with open(self.checkpoint.path_of(name), "rb") as file:
            file.seek(data_start + start)
            # Into the tensor's own bytes, as uint8 (numpy has no bfloat16); little-endian host.
            if file.readinto(tensor.reshape(-1).view(torch.uint8).numpy()) != tensor.nbytes:
                raise ValueError(f"{self.checkpoint.path_of(name)} ends inside tensor {name}: the file is truncated.")
        return tensor


def check_no_unknown_tensors(checkpoint: HFCheckpoint, mappings: list) -> None:
    """Every HF tensor must map to one of ours (derived decay buffers aside)."""
    known = {name for mapping in mappings for name in mapping.hf_names}
    for name, file_name in sorted(checkpoint.file_of.items()):
        if name not in known and not name.endswith(DERIVED_SUFFIXES):
            raise ValueError(
                f"unknown HF tensor {name} in {checkpoint.directory / file_name}: it maps to no tensor of the model "
                f"described by {CONFIG_FILE} (a different architecture, or a config that does not match the weights)."
            )


def hf_params_dtype(checkpoint: HFCheckpoint, requested: str = "auto") -> torch.dtype:
    """``requested`` (a name of PARAMS_DTYPES), or for "auto" the dtype the HF tensors are stored in."""
    if requested != "auto":
        return PARAMS_DTYPES[requested]
    name = "model.embed_tokens.weight"
    if name not in checkpoint.dtype_of:
        raise ValueError(f"HF tensor {name} is missing from {checkpoint.directory}.")
    by_safetensors_name = {"F32": torch.float32, "BF16": torch.bfloat16}
    dtype = checkpoint.dtype_of[name]
    if dtype not in by_safetensors_name:
        raise ValueError(
            f"HF tensors are {dtype} ({name}): pass --dtype float32 or --dtype bfloat16 to convert them."
        )
    return by_safetensors_name[dtype]


def check_hf_shapes(checkpoint: HFCheckpoint, mappings: list, global_shapes: dict[str, tuple[int, ...]]) -> None:
    """Before anything is written: every HF tensor is there, the ones merged into one of ours agree
    with each other, and they give our tensor the shape the model has."""
    for mapping in mappings:
        for name in mapping.hf_names:
            if name not in checkpoint.file_of:
                raise ValueError(
                    f"HF tensor {name} is missing from {checkpoint.directory} (no file holds it): the checkpoint "
                    f"does not match its {CONFIG_FILE} (layer count, expert count or layer types)."
                )
        first = mapping.hf_names[0]
        for name in mapping.hf_names:
            if checkpoint.shape_of[name] != checkpoint.shape_of[first]:
                raise ValueError(
                    f"HF tensor {name} in {checkpoint.path_of(name)} has shape {checkpoint.shape_of[name]}, but "
                    f"{first} has {checkpoint.shape_of[first]}: the checkpoint does not match its {CONFIG_FILE}."
                )
        # The merge on the meta device gives the merged shape without touching data.
        merged = mapping.merge(tuple(torch.empty(checkpoint.shape_of[n], device="meta") for n in mapping.hf_names))
        if tuple(merged.shape) != global_shapes[mapping.key]:
            sources = ", ".join(f"{name} in {checkpoint.path_of(name)}" for name in mapping.hf_names[:2])
            more = " ..." if len(mapping.hf_names) > 2 else ""
            raise ValueError(
                f"HF tensor(s) {sources}{more} give {mapping.key} the shape {tuple(merged.shape)}, but the model "
                f"described by {CONFIG_FILE} needs {global_shapes[mapping.key]}: the config does not match the weights."
            )


# ---------------------------------------------------------------------------------------------
# What a megacispo checkpoint holds, from the model on the meta device


@dataclasses.dataclass(frozen=True)
class Chunk:
    """One stored piece of one of our tensors: the region [offsets, offsets + sizes) of the
    global tensor ``key`` (Megatron stores each expert's matrices, and SwiGLU halves, apart)."""

    key: str
    global_shape: tuple[int, ...]
    offsets: tuple[int, ...]
    sizes: tuple[int, ...]
    dtype: torch.dtype

    @property
    def nbytes(self) -> int:
        return _nbytes(self.sizes, self.dtype)


def _init_single_process() -> None:
    """A world of one for Megatron's parallel state (the model's modules read it)."""
    # Megatron-Core on first use: hf_checkpoint imports this module, and the train dry run must import none of it.
    from megatron.core import parallel_state


    if not parallel_state.model_parallel_is_initialized():
        init_distributed(ParallelConfig(), seed=0)
    if torch.distributed.get_world_size() != 1:
        raise ValueError(
            f"the converter runs in one process, but this is a world of {torch.distributed.get_world_size()}: "
            f"run it with plain python, not torchrun."
        )


def _single_process_model(config, params_dtype: torch.dtype, device: str | torch.device = "cpu"):
    """Our model in one process (TP = PP = EP = 1); on the meta device it holds no memory."""
    # Megatron-Core on first use: hf_checkpoint imports this module, and the train dry run must import none of it.
    from megacispo.models.model import HybridModel

    _init_single_process()
    megatron_config = transformer_config(config, ParallelConfig(), params_dtype=params_dtype)
    # Every weight is overwritten: random initialization would only cost time.
    megatron_config.perform_initialization = False
    with torch.device(device):
        return HybridModel(config, megatron_config).eval()


def checkpoint_contents(config, params_dtype: torch.dtype) -> tuple[list[Chunk], dict[str, Any]]:
    """(chunks, objects) that ``save_checkpoint`` would write for this model: the tensor chunks in
    the model's order, and Megatron's sharded objects (the layers' extra state) by storage key."""
    # Megatron-Core on first use: hf_checkpoint imports this module, and the train dry run must import none of it.
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import ShardedObject, ShardedTensor, apply_factories


    model = _single_process_model(config, params_dtype, device="meta")
    sharded_state = model.sharded_state_dict(metadata=sharded_metadata())
    apply_factories(sharded_state)
    chunks, objects = [], {}
    for value in nested_values(sharded_state):
        if isinstance(value, ShardedTensor):
            assert value.flattened_range is None, value.key
            # Megatron stores the prepended (expert) axes as size-1 dimensions of the chunk.
            sizes = (1,) * value.prepend_axis_num + tuple(value.local_shape)
            chunks.append(Chunk(value.key, tuple(value.global_shape), tuple(value.global_offset), sizes, value.dtype))
        elif isinstance(value, ShardedObject):
            objects[value.unique_key] = value.data
    return chunks, objects


# ---------------------------------------------------------------------------------------------
# hf-to-megatron


class HFChunkSource:
    """Each chunk of ours, read from the HF tensors it is made of when asked for."""

    def __init__(self, reader: HFTensorReader, mappings: list, experts_layout: str, params_dtype: torch.dtype):
        self.reader = reader
        self.mapping_of = {mapping.key: mapping for mapping in mappings}
        self.experts_layout = experts_layout
        self.params_dtype = params_dtype

    def read(self, chunk: Chunk) -> torch.Tensor:

        mapping = self.mapping_of[chunk.key]
        if chunk.key.endswith((EXPERT_FC1_KEY, EXPERT_FC2_KEY)):
            first_expert, num_experts = chunk.offsets[0], chunk.sizes[0]
            experts = [self._expert(mapping, e) for e in range(first_expert, first_expert + num_experts)]
            tensor = experts[0][None] if num_experts == 1 else torch.stack(experts)
            start_dim = 1
        else:
            tensor, start_dim = self.reader.read(mapping.hf_names[0]), 0
        for dim in range(start_dim, len(chunk.sizes)):
            tensor = tensor.narrow(dim, chunk.offsets[dim], chunk.sizes[dim])
        tensor = tensor.to(self.params_dtype)
        if tensor.untyped_storage().nbytes() != tensor.nbytes:
            # A SwiGLU half of an expert: keep only its own bytes alive in the writer.
            tensor = tensor.clone()
        return self.reader.meter.track(tensor) if self.reader.meter is not None else tensor

    def _expert(self, mapping, expert: int) -> torch.Tensor:
        """Expert ``expert``'s matrix of a stacked tensor: [2I, H] = [W1; W3] for fc1, [H, I] for fc2."""

        if self.experts_layout == FUSED:
            return self.reader.read(mapping.hf_names[0], index=expert)
        if mapping.key.endswith(EXPERT_FC1_KEY):
            # legacy names run expert by expert: w1, w3 of expert 0, then of expert 1, ...
            return torch.cat([self.reader.read(mapping.hf_names[2 * expert + half]) for half in (0, 1)])
        return self.reader.read(mapping.hf_names[expert])


class ChunkSavePlanner(DefaultSavePlanner):
    """A torch.distributed.checkpoint save planner for the given chunks and objects whose data is
    produced by ``read`` only when the writer asks for it (the planner's documented extension
    points: create_local_plan and resolve_data)."""

    def __init__(self, chunks: list[Chunk], objects: dict[str, Any], read: Callable[[Chunk], torch.Tensor]) -> None:
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)
        self.chunk_of = {MetadataIndex(chunk.key, torch.Size(chunk.offsets)): chunk for chunk in chunks}
        self.objects = objects
        self.read = read

    def create_local_plan(self) -> SavePlan:
        items = [
            WriteItem(index=index, type=WriteItemType.SHARD, tensor_data=TensorWriteData(
                chunk=ChunkStorageMetadata(offsets=torch.Size(chunk.offsets), sizes=torch.Size(chunk.sizes)),
                properties=TensorProperties(dtype=chunk.dtype), size=torch.Size(chunk.global_shape),
            ))
            for index, chunk in self.chunk_of.items()
        ]
        items += [WriteItem(index=MetadataIndex(key), type=WriteItemType.BYTE_IO) for key in self.objects]
        self.plan = SavePlan(items)
        return self.plan

    def resolve_data(self, write_item: WriteItem) -> torch.Tensor | io.BytesIO:
        if write_item.type == WriteItemType.BYTE_IO:
            # Megatron stores each key's objects as one torch.save'd list (strategies/torch.py).
            serialized = io.BytesIO()
            torch.save([self.objects[write_item.index.fqn]], serialized)
            return serialized
        return self.read(self.chunk_of[dataclasses.replace(write_item.index, index=None)])


def _parts(chunks: list[Chunk], part_bytes: int) -> Iterator[list[Chunk]]:
    """Consecutive chunks in groups of at most part_bytes (a larger chunk alone)."""
    part, size = [], 0
    for chunk in chunks:
        if part and size + chunk.nbytes > part_bytes:
            yield part
            part, size = [], 0
        part.append(chunk)
        size += chunk.nbytes
    if part:
        yield part


def write_distributed_checkpoint(
    directory: Path, chunks: list[Chunk], objects: dict[str, Any], read: Callable[[Chunk], torch.Tensor],
    *, progress: bool = True,
) -> None:
    """Write a torch_dist checkpoint of ``chunks`` (data from ``read``) and ``objects`` into the
    empty ``directory``, in parts of at most the largest chunk's size, merged at the end."""

    part_bytes = max(chunk.nbytes for chunk in chunks)
    state_dict_metadata: dict[str, Any] = {}
    results: list[WriteResult] = []
    bar = tqdm(total=sum(chunk.nbytes for chunk in chunks), desc="hf-to-megatron", unit="B", unit_scale=True,
               disable=not progress)
    with bar:
        for number, part in enumerate(_parts(chunks, part_bytes)):
            part_dir = directory / f".part_{number}"
            # Serial writes (per_thread_copy_ahead 0): no tensor is resolved before the writer needs it.
            writer = FileSystemWriter(part_dir, thread_count=1, per_thread_copy_ahead=0)
            planner = ChunkSavePlanner(part, objects if number == 0 else {}, read)
            with _single_process_dcp():
                metadata = dcp.save({}, storage_writer=writer, planner=planner, no_dist=True)
            file_names = {info.relative_path for info in metadata.storage_data.values()}
            assert len(file_names) == 1, file_names
            file_name = f"__0_{number}.distcp"
            os.rename(part_dir / file_names.pop(), directory / file_name)
            shutil.rmtree(part_dir)
            for index, info in metadata.storage_data.items():
                # The chunk index is a lookup hint: renumbered to the chunk's place in the merged list.
                held = state_dict_metadata.get(index.fqn)
                offset = len(held.chunks) if isinstance(held, TensorStorageMetadata) else 0
                merged_index = dataclasses.replace(index, index=None if index.index is None else index.index + offset)
                results.append(WriteResult(index=merged_index, size_in_bytes=info.length,
                                           storage_data=dataclasses.replace(info, relative_path=file_name)))
            for key, value in metadata.state_dict_metadata.items():
                if key in state_dict_metadata:
                    state_dict_metadata[key].chunks.extend(value.chunks)
                else:
                    state_dict_metadata[key] = value
            bar.update(sum(chunk.nbytes for chunk in part))
    for key, value in state_dict_metadata.items():
        if isinstance(value, TensorStorageMetadata):
            covered = sum(_nbytes(chunk.sizes, torch.uint8) for chunk in value.chunks)
            assert covered == _nbytes(value.size, torch.uint8), f"{key}: the chunks do not cover the tensor"
    merged = dataclasses.replace(metadata, state_dict_metadata=state_dict_metadata, planner_data=None)
    FileSystemWriter(directory).finish(merged, [results])


def _write_megatron_files(directory: Path) -> None:
    """What Megatron's dist_checkpointing.save writes beside the torch_dist files."""
    torch.save({}, directory / MEGATRON_COMMON_FILE)
    (directory / MEGATRON_CONFIG_FILE).write_text(json.dumps(MEGATRON_BACKEND))


def _write_meta(directory: Path, config_dict: dict, extra_state: dict) -> None:
    """meta.json as save_checkpoint writes it for a model without optimizer."""

    write_meta(directory, checkpoint_meta(CONVERTED_STEP, has_optimizer=False, scheduler_state=None,
                                          extra_state=extra_state, config_dict=config_dict))


def _layout_parallel_config(config, tp: int, pp: int, ep: int, etp: int | None):
    """Validate the layout the checkpoint is meant for; TP > 1 with experts needs sequence parallelism."""

    parallel = ParallelConfig(
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        expert_model_parallel_size=ep,
        expert_tensor_parallel_size=etp,
        sequence_parallel=tp > 1,
    )
    smallest_world = math.lcm(tp * pp, parallel.expert_tp * ep * pp)
    validate_layout(parallel, smallest_world, model_shape(config))
    return parallel


def _check_new(out: Path) -> None:
    if out.exists():
        raise ValueError(f"--out {out} already exists: choose a new directory (the converter never overwrites).")


@contextlib.contextmanager
def temporary_beside(out: Path) -> Iterator[Path]:
    """A fresh directory beside ``out`` (checked not to exist), renamed to ``out`` when the block
    succeeds and removed when it fails: a failed conversion leaves nothing behind."""
    out.parent.mkdir(parents=True, exist_ok=True)
    # Made by mkdir, whose mode the umask decides as for the user's other directories (mkdtemp's
    # would be 0700, and the rename would keep it).
    temporary = out.parent / f".tmp_{out.name}_{secrets.token_hex(8)}"
    temporary.mkdir()
    try:
        yield temporary
        os.rename(temporary, out)
    except BaseException:
        shutil.rmtree(temporary, ignore_errors=True)
        raise


def hf_to_megatron(
    hf_dir: str | os.PathLike,
    out: str | os.PathLike,
    *,
    tp: int = 1,
    pp: int = 1,
    ep: int = 1,
    etp: int | None = None,
    rotary_dim: int | None = None,
    dtype: str = "auto",
    progress: bool = True,
    meter: TensorMeter | None = None,
) -> Path:
    """Convert an HF directory into a megacispo checkpoint root ``out`` (holding step_00000000).
    Returns the step directory. Nothing is left at ``out`` when it fails. ``tp/pp/ep/etp``: the layout
    recorded in meta.json (etp None: the same as tp). ``meter`` counts the bytes of the tensors held
    at once."""

    out = Path(out)
    _check_new(out)
    try:
        checkpoint = read_hf_checkpoint(hf_dir)
    except ValueError as error:
        raise ValueError(f"--hf-dir {error}") from None
    config = hf_names.config_from_hf(checkpoint.config, rotary_dim=rotary_dim)
    parallel = _layout_parallel_config(config, tp, pp, ep, etp)
    layout = hf_names.detect_experts_layout(checkpoint.file_of)
    mappings = hf_names.tensor_mappings(config, layout)
    check_no_unknown_tensors(checkpoint, mappings)
    params_dtype = hf_params_dtype(checkpoint, dtype)
    chunks, objects = checkpoint_contents(config, params_dtype)
    global_shapes = {chunk.key: chunk.global_shape for chunk in chunks}
    assert global_shapes.keys() == {mapping.key for mapping in mappings}, "hf_names and the model disagree"
    check_hf_shapes(checkpoint, mappings, global_shapes)

    source = HFChunkSource(HFTensorReader(checkpoint, meter), mappings, layout, params_dtype)
    step_name = checkpoint_dir(out, CONVERTED_STEP).name
    with temporary_beside(out) as temporary:
        step_dir = temporary / step_name
        step_dir.mkdir()
        write_distributed_checkpoint(step_dir, chunks, objects, source.read, progress=progress)
        _write_megatron_files(step_dir)
        precision = dataclasses.replace(Config().precision, params_dtype=dtype_name(params_dtype))
        config_dict = to_dict(dataclasses.replace(Config(), model=config, parallel=parallel, precision=precision))
        _write_meta(step_dir, config_dict, {
            "converted_from": str(Path(hf_dir).resolve()),
            "hf_experts_layout": layout,
        })
    return out / step_name


def dtype_name(dtype: torch.dtype) -> str:
    """The PARAMS_DTYPES name of ``dtype`` (as precision.params_dtype spells it)."""
    return next(name for name, value in PARAMS_DTYPES.items() if value == dtype)


# ---------------------------------------------------------------------------------------------
# megatron-to-hf


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
        # Megatron-Core on first use: the train dry run imports this module and must import none of it.
        from megatron.core.dist_checkpointing.strategies.cached_metadata_filesystem_reader import (
            CachedMetadataFileSystemReader,
        )

        self.storage_reader = CachedMetadataFileSystemReader(directory)
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
        with _single_process_dcp():
            dcp.load({}, storage_reader=self.storage_reader, planner=RegionLoadPlanner(key, offsets, destination),
                     no_dist=True)
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
            end = start + _nbytes(shape, dtype)
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
        nbytes = _nbytes(entry[1], entry[2])
        if not shards or (shards[-1] and size + nbytes > max_shard_bytes):
            shards.append([])
            size = 0
        shards[-1].append(entry)
        size += nbytes
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
    _check_new(out)
    with temporary_beside(out) as temporary:
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
    the existing empty ``directory`` (megatron_to_hf and megacispo.hf_checkpoint.export_hf make it
    beside their output and rename it when everything is written)."""

    if max_shard_bytes < 1:
        raise ValueError(f"--max-shard-bytes = {max_shard_bytes}: it must be positive.")
    step_dir = resolve_checkpoint(ckpt)
    meta = read_meta(step_dir)
    if not meta.get("config") or "model" not in meta["config"]:
        raise ValueError(f"{step_dir}/meta.json has no config.model: this checkpoint cannot be converted.")
    config = HybridModelConfig(**meta["config"]["model"])
    if config.rotary_dim != config.head_dim:
        warnings.warn(
            f"rotary_dim = {config.rotary_dim} < head_dim = {config.head_dim}: HF transformers' MiniMax rotates "
            f"whole heads and ignores config.json's rotary_dim, so transformers will compute different "
            f"outputs; megacispo (and the original MiniMax code) read rotary_dim back.",
            stacklevel=2,
        )
    reader = CheckpointTensorReader(step_dir, meter)
    plan = _hf_tensor_plan(reader, config)
    entries = [(name, shape, dtype) for names, dtype, _ in plan for name, shape in names]
    total_bytes = sum(_nbytes(shape, dtype) for _, shape, dtype in entries)
    writer = SafetensorsShardWriter(directory, _plan_shards(entries, max_shard_bytes))
    with tqdm(total=total_bytes, desc="megatron-to-hf", unit="B", unit_scale=True, disable=not progress) as bar:
        for _, _, read in plan:
            for name, tensor in read().items():
                writer.write(name, tensor)
                bar.update(tensor.nbytes)
    writer.close()
    index = {"metadata": {"total_size": total_bytes}, "weight_map": dict(sorted(writer.weight_map().items()))}
    (directory / INDEX_FILE).write_text(json.dumps(index, indent=2))
    hf_config = {
        "architectures": ["MiniMaxForCausalLM"], "model_type": "minimax",
        "dtype": params_dtype_of(meta),
        **hf_names.config_to_hf(config),
    }
    (directory / CONFIG_FILE).write_text(json.dumps(hf_config, indent=2))


# ---------------------------------------------------------------------------------------------
# Command line (tools/convert_checkpoint.py)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=CLI_HELP, formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = parser.add_subparsers(dest="command", required=True)
    to_megatron = commands.add_parser("hf-to-megatron", help="HF directory -> megacispo checkpoint")
    to_megatron.add_argument("--hf-dir", required=True, help="Hugging Face model directory")
    to_megatron.add_argument("--out", required=True, help="new checkpoints root; step_00000000 is written in it")
    to_megatron.add_argument("--tp", type=int, default=1, help="tensor-parallel size to validate and record")
    to_megatron.add_argument("--pp", type=int, default=1, help="pipeline-parallel size to validate and record")
    to_megatron.add_argument("--ep", type=int, default=1, help="expert-parallel size to validate and record")
    to_megatron.add_argument("--etp", type=int, default=None,
                             help="expert tensor-parallel size to validate and record (default: --tp)")
    to_megatron.add_argument("--rotary-dim", type=int, default=None,
                             help="rotated channels per head (default: config.json's rotary_dim, else head_dim "
                                  "as HF transformers computes; the original MiniMax uses head_dim / 2)")
    to_megatron.add_argument("--dtype", choices=["auto", *PARAMS_DTYPES], default="auto",
                             help="parameter dtype of the checkpoint (auto: the HF tensors' dtype)")
    to_hf = commands.add_parser("megatron-to-hf", help="megacispo checkpoint -> HF directory")
    to_hf.add_argument("--ckpt", required=True, help="step_* directory, or a checkpoints root (its newest step)")
    to_hf.add_argument("--out", required=True, help="new HF model directory")
    to_hf.add_argument("--max-shard-bytes", type=int, default=DEFAULT_MAX_SHARD_BYTES,
                       help="largest safetensors shard (default 5 GiB)")
    for command in (to_megatron, to_hf):
        command.add_argument("--no-progress", action="store_true", help="no progress bar")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    warnings.filterwarnings("ignore", message=".*(Transformer Engine|Apex|apex).*")
    with bad_input_exits():
        if args.command == "hf-to-megatron":
            path = hf_to_megatron(args.hf_dir, args.out, tp=args.tp, pp=args.pp, ep=args.ep, etp=args.etp,
                                  rotary_dim=args.rotary_dim, dtype=args.dtype, progress=not args.no_progress)
        else:
            path = megatron_to_hf(args.ckpt, args.out, max_shard_bytes=args.max_shard_bytes,
                                  progress=not args.no_progress)
    print(f"wrote {path}")
    return 0


# ---------------------------------------------------------------------------------------------
# Whole-model views (tests and small models): the model loaded through megacispo.checkpoint


def load_single_process(ckpt: str | os.PathLike):
    """(model, config, meta) of a megacispo checkpoint (step dir or checkpoints root) in one
    process, loaded with megacispo.checkpoint.load_checkpoint. Holds the whole model."""

    step_dir = resolve_checkpoint(ckpt)
    meta = read_meta(step_dir)
    if not meta.get("config") or "model" not in meta["config"]:
        raise ValueError(f"{step_dir}/meta.json has no config.model: this checkpoint cannot be converted.")
    config = HybridModelConfig(**meta["config"]["model"])
    params_dtype = PARAMS_DTYPES[params_dtype_of(meta)]
    model = _single_process_model(config, params_dtype)
    load_checkpoint(step_dir, model, load_rng=False)
    return model, config, meta


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


def full_tensors(model) -> dict[str, torch.Tensor]:
    """The single-process model's tensors under our checkpoint keys (experts stacked [E, ...])."""
    return {
        key: pieces[0][1].detach() if pieces[0][0] is None
        else torch.stack([tensor.detach() for _, tensor in sorted(pieces, key=lambda piece: piece[0])])
        for key, pieces in parameter_slots(model).items()
    }


if __name__ == "__main__":
    sys.exit(main())
