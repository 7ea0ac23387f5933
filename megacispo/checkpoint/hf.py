"""Hugging Face MiniMax directories at run time: the one place that reads them for training and
scoring and writes them at the end of a run.

(Telling an HF directory from a megacispo checkpoint, and the model its config.json describes, are
megacispo.checkpoint.formats': the run config reads them.)

- ``check_hf_checkpoint`` checks before any model is built that its safetensors hold exactly the
  model's tensors, with the model's shapes (headers only; ``model_tensor_shapes`` gives the shapes
  from the config, since no model exists yet);
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
from megacispo.models.config import LIGHTNING, M2, SOFTMAX, HybridModelConfig, is_adapter_parameter


def model_tensor_shapes(config: HybridModelConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor of the model under its checkpoint key with its global shape (experts stacked),
    from the config alone: known before any process group or model exists."""
    hidden, width = config.hidden_size, config.num_attention_heads * config.head_dim
    kv_width = config.num_query_groups * config.head_dim
    experts, inner = config.num_experts, config.moe_ffn_hidden_size
    shapes = {
        "embedding.word_embeddings.weight": (config.vocab_size, hidden),
        "decoder.final_layernorm.weight": (hidden,),
        "output_layer.weight": (config.vocab_size, hidden),
    }
    mixers = {
        LIGHTNING: {"qkv_proj": (3 * width, hidden), "output_gate": (width, hidden), "norm": (width,),
                    "out_proj": (hidden, width)},
        SOFTMAX: {"q_proj": (width, hidden), "k_proj": (kv_width, hidden), "v_proj": (kv_width, hidden),
                  "o_proj": (hidden, width)},
    }
    for layer in range(config.num_layers):
        prefix = f"decoder.layers.{layer}."
        shapes[prefix + "input_layernorm.weight"] = (hidden,)
        shapes[prefix + "pre_mlp_layernorm.weight"] = (hidden,)
        for name, shape in mixers[config.layer_kind(layer)].items():
            shapes[f"{prefix}self_attention.{name}.weight"] = shape
        shapes[prefix + hf_names.ROUTER_KEY] = (experts, hidden)
        if config.family == M2:
            q_norm, k_norm = hf_names.QK_NORM_NAMES
            shapes.update({prefix + q_norm: (width,), prefix + k_norm: (kv_width,),
                           prefix + hf_names.ROUTER_BIAS_KEY: (experts,)})
        shapes[prefix + hf_names.EXPERT_FC1_KEY] = (experts, 2 * inner, hidden)
        shapes[prefix + hf_names.EXPERT_FC2_KEY] = (experts, hidden, inner)
    return shapes


def check_hf_checkpoint(path: str | os.PathLike, config: HybridModelConfig) -> None:
    """Before any model is built: the HF directory at ``path`` has its config.json and readable
    safetensors holding every tensor of ``config``'s model with its shape, and no other (the
    derived lightning decay buffers aside), in a dtype megacispo reads. Reads headers only
    (hf_reader.check_hf_tensors, as the converter checks them). ValueError naming the tensor and
    the file."""
    checkpoint = hf_reader.read_hf_checkpoint(path)
    mappings = hf_names.tensor_mappings(config, hf_names.detect_experts_layout(checkpoint.file_of))
    hf_reader.check_hf_tensors(checkpoint, mappings, model_tensor_shapes(config))


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
    rank's piece holds a NaN or an infinity. ``check_hf_checkpoint`` has checked the directory
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
        check_hf_checkpoint(path, config)
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
