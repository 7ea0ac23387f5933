"""hf-to-megatron: a Hugging Face MiniMax directory as a megacispo (Megatron distributed) checkpoint,
streamed tensor by tensor so that memory stays bounded whatever the model's size.

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
one ``.metadata``. Beside it the directory gets what ``megacispo.checkpoint.distributed.save_checkpoint``
writes: Megatron's common.pt and metadata.json, and meta.json (no rng/: a converted checkpoint has
no RNG states, and loads with ``load_rng=False`` as train.load, sft.load and score do).
"""

from __future__ import annotations

import dataclasses
import io
import json
import math
import os
import shutil
from pathlib import Path
from typing import Any, Callable, Iterator

import torch
import torch.distributed.checkpoint as dcp
from megatron.core import parallel_state
from megatron.core.dist_checkpointing.dict_utils import nested_values
from megatron.core.dist_checkpointing.mapping import ShardedObject, ShardedTensor, apply_factories
from torch.distributed.checkpoint import DefaultSavePlanner, FileSystemWriter, SavePlan
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    MetadataIndex,
    StorageMeta,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType
from torch.distributed.checkpoint.storage import WriteResult
from tqdm import tqdm

from megacispo.checkpoint.distributed import (
    MEGATRON_COMMON_FILE,
    MEGATRON_CONFIG_FILE,
    CheckpointError,
    checkpoint_dir,
    checkpoint_meta,
    sharded_metadata,
    write_meta,
)
from megacispo.checkpoint.formats import dtype_name, hf_model_config
from megacispo.checkpoint.hf_reader import (
    Chunk,
    HFChunkSource,
    HFTensorReader,
    check_hf_tensors,
    hf_params_dtype,
    model_tensor_shapes,
    read_hf_checkpoint,
)
from megacispo.checkpoint.streaming import TensorMeter, check_new, nbytes, single_process_dcp
from megacispo.config import Config, to_dict
from megacispo.files import staged_directory
from megacispo.models import hf_names
from megacispo.models.config import model_shape, transformer_config
from megacispo.models.model import HybridModel
from megacispo.parallel.layout import ParallelConfig, init_distributed, validate_layout

CONVERTED_STEP = 0
# What Megatron's metadata.json (distributed.MEGATRON_CONFIG_FILE) records; its common.pt is empty for HybridModel.
MEGATRON_BACKEND = {"sharded_backend": "torch_dist", "sharded_backend_version": 1,
                    "common_backend": "torch", "common_backend_version": 1}


def _init_single_process() -> None:
    """A world of one for Megatron's parallel state (the model's modules read it)."""
    if not parallel_state.model_parallel_is_initialized():
        init_distributed(ParallelConfig(), seed=0)
    if torch.distributed.get_world_size() != 1:
        raise ValueError(
            f"the converter runs in one process, but this is a world of {torch.distributed.get_world_size()}: "
            f"run it with plain python, not torchrun."
        )


def single_process_model(config, params_dtype: torch.dtype, device: str | torch.device = "cpu"):
    """Our model in one process (TP = PP = EP = 1); on the meta device it holds no memory."""
    _init_single_process()
    megatron_config = transformer_config(config, ParallelConfig(), params_dtype=params_dtype)
    # Every weight is overwritten: random initialization would only cost time.
    megatron_config.perform_initialization = False
    with torch.device(device):
        return HybridModel(config, megatron_config).eval()


def checkpoint_contents(config, params_dtype: torch.dtype) -> tuple[list[Chunk], dict[str, Any]]:
    """(chunks, objects) that ``save_checkpoint`` would write for this model: the tensor chunks in
    the model's order, and Megatron's sharded objects (the layers' extra state) by storage key."""
    model = single_process_model(config, params_dtype, device="meta")
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


class IndexWriter(FileSystemWriter):
    """torch DCP's file writer, recording its directory in the index as a str, as Megatron's writer
    does: torch's records a pathlib.Path, which the checkpoint readers' restricted unpickler
    (megacispo.checkpoint.unpickling) refuses."""

    def storage_meta(self) -> StorageMeta:
        return StorageMeta(checkpoint_id=str(self.checkpoint_id), save_id=self.save_id)


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
            try:
                with single_process_dcp():
                    metadata = dcp.save({}, storage_writer=writer, planner=planner, no_dist=True)
            except CheckpointException as error:  # a BaseException: what resolve_data raised, wrapped
                failure = next(iter(error.failures.values()))[0]
                if isinstance(failure, CheckpointError):  # a non-finite tensor, named by the reader
                    raise failure from None
                raise
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
            covered = sum(nbytes(chunk.sizes, torch.uint8) for chunk in value.chunks)
            assert covered == nbytes(value.size, torch.uint8), f"{key}: the chunks do not cover the tensor"
    merged = dataclasses.replace(metadata, state_dict_metadata=state_dict_metadata, planner_data=None)
    IndexWriter(directory).finish(merged, [results])


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
    check_new(out)
    # The checks train.load makes of an HF directory (config.json first, then the tensors' headers).
    try:
        checkpoint = read_hf_checkpoint(hf_dir)
        config = hf_model_config(hf_dir, rotary_dim=rotary_dim)
        layout = hf_names.detect_experts_layout(checkpoint.file_of)
        mappings = hf_names.tensor_mappings(config, layout)
        check_hf_tensors(checkpoint, mappings, model_tensor_shapes(config))
    except ValueError as error:
        raise ValueError(f"--hf-dir: {error}") from None
    parallel = _layout_parallel_config(config, tp, pp, ep, etp)
    params_dtype = hf_params_dtype(checkpoint, dtype)
    chunks, objects = checkpoint_contents(config, params_dtype)
    assert {chunk.key for chunk in chunks} == {mapping.key for mapping in mappings}, "hf_names and the model disagree"

    source = HFChunkSource(HFTensorReader(checkpoint, meter), mappings, layout, params_dtype)
    step_name = checkpoint_dir(out, CONVERTED_STEP).name
    with staged_directory(out) as temporary:
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
