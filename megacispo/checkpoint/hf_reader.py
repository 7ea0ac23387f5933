"""Reading a Hugging Face MiniMax directory: its config.json and its tensors' files, shapes and dtypes
from the headers, checked against the model before anything is written or built
(``check_hf_tensors``, which the converter and the run-time loader share; ``check_hf_checkpoint``
before any model is built, with the shapes ``model_tensor_shapes`` gives from the config), and each
tensor (or the region of one of ours that a chunk covers) read with exactly the bytes it needs and
checked to be finite.

Block-quantized FP8 checkpoints (the released MiniMax-M2 line; DeepSeek-V3's layout: config.json's
``quantization_config`` says quant_method "fp8" with a ``weight_block_size`` [rows, cols]) store a
quantized weight W [..., out, in] as F8_E4M3 beside ``W_scale_inv`` [..., ceil(out / rows),
ceil(in / cols)], W = q * scale_inv block by block: each is read dequantized, in float32, then cast
to the model's dtype."""

from __future__ import annotations

import dataclasses
import json
import os
import warnings
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open

from megacispo.checkpoint.formats import (
    CONFIG_FILE,
    INDEX_FILE,
    SAFETENSORS_DTYPE_OF,
    SINGLE_FILE,
    read_hf_config,
    read_json,
)
from megacispo.checkpoint.streaming import TensorMeter, check_finite, nbytes
from megacispo.models import hf_names
from megacispo.models.config import LIGHTNING, M2, PARAMS_DTYPES, SOFTMAX, HybridModelConfig
from megacispo.models.hf_names import EXPERT_FC1_KEY, EXPERT_FC2_KEY, FUSED, mtp_layer_prefixes

# Derived (recomputed) lightning buffers that HF may hold: neither read nor written.
DERIVED_SUFFIXES = ("slope_rate", "query_decay", "key_decay", "diagonal_decay")
FP8 = "F8_E4M3"
SCALE_SUFFIX = "_scale_inv"  # of an FP8 weight: the factor of each of its blocks


def fp8_block_size(config: dict[str, Any], config_path: Path) -> tuple[int, int] | None:
    """The [rows, cols] of the FP8 weight blocks of a config.json's ``quantization_config``; None: the
    checkpoint is not quantized. ValueError naming the field for a quantization megacispo does not read."""
    quantization = config.get("quantization_config")
    if quantization is None:
        return None
    fp8 = isinstance(quantization, dict) and quantization.get("quant_method") == "fp8" and (
        quantization.get("fmt", "float8_e4m3fn") == "float8_e4m3fn")
    block = quantization.get("weight_block_size") if fp8 else None
    if not (isinstance(block, list) and len(block) == 2
            and all(isinstance(size, int) and not isinstance(size, bool) and size > 0 for size in block)):
        raise ValueError(
            f"{config_path} quantization_config = {quantization!r}: megacispo reads unquantized checkpoints and "
            f"block-quantized FP8 ones (quant_method 'fp8', fmt 'float8_e4m3fn', weight_block_size [rows, cols]); "
            f"dequantize this one to bfloat16 first.")
    return block[0], block[1]


def dequantize_fp8(weight: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """float32 W [..., out, in] of an FP8 weight and its per-block factors [..., ceil(out / rows), ceil(in / cols)]
    (the last block of a row or column may be partial)."""
    rows, cols = weight.shape[-2:]
    scale = scale_inv.float().repeat_interleave(block[0], dim=-2)[..., :rows, :]
    return weight.float() * scale.repeat_interleave(block[1], dim=-1)[..., :cols]


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
    fp8_block: tuple[int, int] | None = None
    """The [rows, cols] of the blocks of its FP8 weights (config.json's quantization_config); None: unquantized."""

    def path_of(self, name: str) -> Path:
        return self.directory / self.file_of[name]


def read_hf_checkpoint(hf_dir: str | os.PathLike) -> HFCheckpoint:
    """config.json (checked to be MiniMax's first: formats.read_hf_config) and each tensor's file,
    shape and dtype; checks that every listed file exists and that the index names only tensors its
    files hold. Reads headers only, no tensor data."""

    directory = Path(hf_dir)
    if not directory.is_dir():
        raise ValueError(f"{directory}: no such directory; pass a Hugging Face model directory.")
    config = read_hf_config(directory)
    fp8_block = fp8_block_size(config, directory / CONFIG_FILE)
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
    return HFCheckpoint(directory, config, file_of, shape_of, dtype_of, fp8_block)


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
        """The tensor, or only its slice [index] along the first axis, an FP8 weight dequantized;
        CheckpointError (streaming.check_finite) when it holds a NaN or an infinity. Its dtype was
        checked with the headers (``check_hf_tensors``)."""
        tensor = self._read_stored(name, index)
        if tensor.dtype == torch.float8_e4m3fn:
            tensor = dequantize_fp8(tensor, self._read_stored(name + SCALE_SUFFIX, index), self.checkpoint.fp8_block)
        check_finite(name if index is None else f"{name} (expert {index})", tensor, self.checkpoint.path_of(name))
        return tensor

    def _read_stored(self, name: str, index: int | None) -> torch.Tensor:
        """The tensor (or its slice [index]) as the file stores it."""
        file_name = self.checkpoint.file_of[name]
        data_start, header = self._header(file_name)
        entry = header[name]
        dtype = torch.float8_e4m3fn if entry["dtype"] == FP8 else SAFETENSORS_DTYPE_OF[entry["dtype"]]
        shape, start = tuple(entry["shape"]), entry["data_offsets"][0]
        if index is not None:
            shape = shape[1:]
            start += index * nbytes(shape, dtype)
        # On the host: the file is read into its bytes through numpy.
        tensor = torch.empty(shape, dtype=dtype, device="cpu")
        if self.meter is not None:
            self.meter.track(tensor)
        with open(self.checkpoint.path_of(name), "rb") as file:
            file.seek(data_start + start)
            # Into the tensor's own bytes, as uint8 (numpy has no bfloat16); little-endian host.
            if file.readinto(tensor.reshape(-1).view(torch.uint8).numpy()) != tensor.nbytes:
                raise ValueError(f"{self.checkpoint.path_of(name)} ends inside tensor {name}: the file is truncated.")
        return tensor


def check_hf_tensors(checkpoint: HFCheckpoint, mappings: list, global_shapes: dict[str, tuple[int, ...]]) -> None:
    """Before any tensor is read: the HF tensors are exactly the model's (``mappings``; derived
    decay buffers aside), with its shapes (``global_shapes``, by our key) and in a dtype megacispo
    reads. ValueError naming the tensor and the file."""
    check_no_unknown_tensors(checkpoint, mappings)
    check_hf_shapes(checkpoint, mappings, global_shapes)
    for name in (name for mapping in mappings for name in mapping.hf_names):
        if checkpoint.dtype_of[name] == FP8 and checkpoint.fp8_block is not None:
            _check_fp8_scale(checkpoint, name)
        elif checkpoint.dtype_of[name] not in SAFETENSORS_DTYPE_OF:
            raise ValueError(
                f"HF tensor {name} in {checkpoint.path_of(name)} is {checkpoint.dtype_of[name]}: megacispo reads "
                f"{sorted(SAFETENSORS_DTYPE_OF)}, and {FP8} with a block-quantized FP8 quantization_config in "
                f"{CONFIG_FILE}; convert the checkpoint to one of them."
            )


def _check_fp8_scale(checkpoint: HFCheckpoint, name: str) -> None:
    """An FP8 weight has its per-block factors, one for each block of its last two axes."""
    scale = name + SCALE_SUFFIX
    if scale not in checkpoint.file_of:
        raise ValueError(f"HF tensor {name} in {checkpoint.path_of(name)} is {FP8} without its {scale}: the "
                         f"checkpoint is incomplete; download it again.")
    shape, (rows, cols) = checkpoint.shape_of[name], checkpoint.fp8_block
    expected = (*shape[:-2], -(-shape[-2] // rows), -(-shape[-1] // cols))
    if checkpoint.shape_of[scale] != expected or checkpoint.dtype_of[scale] not in SAFETENSORS_DTYPE_OF:
        raise ValueError(
            f"HF tensor {scale} in {checkpoint.path_of(scale)} is {checkpoint.dtype_of[scale]} "
            f"{checkpoint.shape_of[scale]}: the {FP8} weight {name} {shape} in blocks of {[rows, cols]} needs a "
            f"float tensor of shape {expected}; the checkpoint does not match its {CONFIG_FILE}'s quantization_config.")


def check_no_unknown_tensors(checkpoint: HFCheckpoint, mappings: list) -> None:
    """Every HF tensor must map to one of ours (derived decay buffers and M2's multi-token-prediction
    modules aside: a warning says how many of those are passed over, and why)."""
    known = {name for mapping in mappings for name in mapping.hf_names}
    if checkpoint.fp8_block is not None:
        known |= {name + SCALE_SUFFIX for name in known}
    mtp = mtp_layer_prefixes(checkpoint.config)
    passed_over = sorted(name for name in checkpoint.file_of if name.startswith(mtp))
    if passed_over:
        warnings.warn(
            f"{checkpoint.directory}: {len(passed_over)} tensors of {len(mtp)} multi-token-prediction modules "
            f"({mtp[0]}* ...) are not read: megacispo's MiniMax-M2 has no MTP modules (neither has transformers'; "
            f"vLLM and SGLang skip them too). They are not trained and not exported; the RL loss is the next-token "
            f"loss.", stacklevel=2)
    for name, file_name in sorted(checkpoint.file_of.items()):
        if name not in known and not name.endswith(DERIVED_SUFFIXES) and not name.startswith(mtp):
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
        return nbytes(self.sizes, self.dtype)


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
    (``check_hf_tensors``, as the converter checks them). ValueError naming the tensor and
    the file."""
    checkpoint = read_hf_checkpoint(path)
    mappings = hf_names.tensor_mappings(config, hf_names.detect_experts_layout(checkpoint.file_of))
    check_hf_tensors(checkpoint, mappings, model_tensor_shapes(config))
