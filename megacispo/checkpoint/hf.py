"""Hugging Face MiniMax directories at run time: the one place that reads them for training and
scoring and writes them at the end of a run.

(Telling an HF directory from a megacispo checkpoint, and the model its config.json describes, are
megacispo.checkpoint.formats': the run config reads them.)

- ``load_hf_weights`` fills each rank's piece of the model in-process: the model's sharded state
  dict says, for every tensor of this rank, its checkpoint key, global shape and the region
  (offsets) it holds at this TP / PP / EP layout; megacispo.checkpoint.hf_reader's HFChunkSource reads that
  region from the HF tensors it is made of (expert by expert for the stacked experts) and it is
  copied into the parameter, cast to its dtype. No temporary checkpoint, no subprocess;
- ``check_start_weights`` / ``load_start_weights``: train.load and sft.load, a megacispo checkpoint
  or an HF directory, checked at start-up and loaded into the engine's model;
- ``export_hf`` writes a final checkpoint as an HF directory with the tokenizer files, atomically.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

from megacispo.checkpoint import hf_reader
from megacispo.checkpoint.distributed import CheckpointError, load_checkpoint, sharded_metadata, weights_checkpoint
from megacispo.checkpoint.formats import dtype_name, is_hf_directory
from megacispo.checkpoint.to_hf import write_hf_files
from megacispo.files import staged_directory
from megacispo.models import hf_names
from megacispo.models.config import HybridModelConfig, is_adapter_parameter


def hf_params_dtype_name(path: str | os.PathLike) -> str:
    """The dtype name (float32 | bfloat16) the HF directory's tensors are stored in."""
    return dtype_name(hf_reader.hf_params_dtype(hf_reader.read_hf_checkpoint(path)))


@torch.no_grad()
def load_hf_weights(model: torch.nn.Module, hf_dir: str | os.PathLike) -> None:
    """Fill this rank's piece of ``model`` (a HybridModel, or a DDP wrapper of one) from the HF
    directory ``hf_dir``; every rank calls it after building its model piece. Each tensor of the
    model's sharded state dict gets the region of its global tensor that it holds, read from the
    HF tensors (one expert at a time for the stacked experts), checked to be finite and cast to the
    parameter's dtype: CheckpointError on every rank, naming the tensor and the file, when one
    rank's piece holds a NaN or an infinity. ``hf_reader.check_hf_checkpoint`` has checked the directory
    before the model was built."""
    # Megatron-Core on first use: the train dry run imports this module and must import none of it.
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import ShardedTensor, apply_factories
    from megatron.core.utils import unwrap_model

    module = unwrap_model(model)
    checkpoint = hf_reader.read_hf_checkpoint(hf_dir)
    layout = hf_names.detect_experts_layout(checkpoint.file_of)
    mappings = hf_names.tensor_mappings(module.hybrid_config, layout)
    source = hf_reader.HFChunkSource(hf_reader.HFTensorReader(checkpoint), mappings, layout, module.config.params_dtype)
    storages = {tensor.untyped_storage().data_ptr() for tensor in [*module.parameters(), *module.buffers()]}
    sharded_state = module.sharded_state_dict(metadata=sharded_metadata())
    # Factories (each expert's SwiGLU halves) build views of the parameters they split.
    apply_factories(sharded_state)
    damaged = None
    for value in nested_values(sharded_state):
        if not isinstance(value, ShardedTensor) or is_adapter_parameter(value.key):
            continue  # Megatron's extra-state objects (no weights), LoRA adapters (not the base's)
        assert value.flattened_range is None and value.data.untyped_storage().data_ptr() in storages, (
            f"{value.key}: the sharded state dict must hand out the parameters themselves (or views of them)"
        )
        # The prepended (expert) axes are size-1 dimensions of the region, as convert's chunks have them.
        sizes = (1,) * value.prepend_axis_num + tuple(value.local_shape)
        chunk = hf_reader.Chunk(value.key, tuple(value.global_shape), tuple(value.global_offset), sizes, value.dtype)
        try:
            value.data.copy_(source.read(chunk).reshape(value.data.shape))
        except CheckpointError as error:
            damaged = error
            break
    _raise_on_every_rank(damaged)


def _raise_on_every_rank(error: CheckpointError | None) -> None:
    """Each rank reads only its piece (its layers, its experts), so one rank alone may find a damaged
    tensor: every rank raises the first such rank's CheckpointError, which the entry points expect
    of every rank alike (rank 0 prints it)."""
    messages = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(messages, None if error is None else str(error))
    found = next((message for message in messages if message is not None), None)
    if found is not None:
        raise CheckpointError(found)


def check_start_weights(field: str, path: str | os.PathLike, config: HybridModelConfig) -> None:
    """Before any model is built: the megacispo checkpoint or HF directory that the config field
    ``field`` (train.load, sft.load) = ``path`` names holds ``config``'s model. CheckpointError
    naming the field, the file and the fix."""
    if not is_hf_directory(path):
        weights_checkpoint(field, path, config)
        return
    try:
        hf_reader.check_hf_checkpoint(path, config)
    except ValueError as error:
        raise CheckpointError(f"{field}: {error}") from None


def load_start_weights(field: str, path: str | os.PathLike, engine) -> None:
    """Every rank, into its piece of ``engine``'s model: the weights that ``check_start_weights``
    checked (a checkpoint's without its optimizer and RNG states, or an HF directory's)."""
    if is_hf_directory(path):
        load_hf_weights(engine.module, path)
    else:
        load_checkpoint(weights_checkpoint(field, path, engine.config.model), engine.module, load_rng=False)
    # The optimizer made its fp32 master copies of bf16 weights from the initial ones: without this
    # its first step would write them back over the loaded weights.
    engine.optimizer.reload_model_params()


def check_export_target(field: str, out: str | os.PathLike) -> None:
    """The export directory must not exist yet (an export never overwrites); checked at start-up."""
    if Path(out).exists():
        raise ValueError(f"{field} = {out} already exists: choose a new directory (an export never overwrites), "
                         f"or move it away.")


def export_hf(step_dir: str | os.PathLike, out: str | os.PathLike, tokenizer) -> Path:
    """Write the checkpoint ``step_dir`` as the Hugging Face directory ``out`` (train.export_hf):
    safetensors, their index and config.json (megacispo.checkpoint.to_hf.write_hf_files) and the tokenizer's
    files (``tokenizer.save_files``). One process, no process group needed: the checkpoint is read
    with torch.distributed.checkpoint's single-process loader. Everything is written beside ``out``
    and renamed at the end: nothing is left at ``out`` when it fails."""
    out = Path(out)
    check_export_target("train.export_hf", out)
    with staged_directory(out) as staging:
        write_hf_files(step_dir, staging, progress=False)
        tokenizer.save_files(staging)
    return out
