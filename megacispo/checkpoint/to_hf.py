"""megatron-to-hf: a megacispo checkpoint as a Hugging Face MiniMax directory, streamed.

The checkpoint is read one tensor, or one expert of a stacked expert tensor, at a time
(torch.distributed.checkpoint with a one-region load plan) and streamed into safetensors shards whose
layout (names, shapes, offsets) is planned up front from the checkpoint's metadata;
``model.safetensors.index.json`` and config.json follow. Peak memory: the tensor being read.

A LoRA run's checkpoint holds its adapters alone (lora.rank > 0 in its meta.json; models/lora.py):
megatron-to-hf then writes the merged model. Each weight W of the base (the run's train.load, which the
checkpoint records as extra_state.lora_base, or the ``base`` passed in) is read as above from a megacispo
checkpoint, or by HF name from a Hugging Face directory, and its adapter's update (alpha / rank) B A is
added in fp32 and cast back to W's dtype, one matrix (one expert) at a time: the model a rollout
computes with, for any runtime. megatron-to-peft writes the adapters alone in PEFT's layout
(``write_peft_files``), for transformers' PeftModel over the HF base.
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

from megacispo.checkpoint import hf_reader
from megacispo.checkpoint.distributed import (
    WEIGHT_FIELDS,
    adapter_rank_of,
    params_dtype_of,
    read_meta,
    recorded_lora_base,
    resolve_checkpoint,
)
from megacispo.checkpoint.formats import (
    CONFIG_FILE,
    INDEX_FILE,
    META_FILE,
    SAFETENSORS_DTYPE_OF,
    SAFETENSORS_DTYPES,
    CheckpointError,
    hf_model_config,
    is_hf_directory,
)
from megacispo.checkpoint.streaming import TensorMeter, check_finite, check_new, nbytes, single_process_dcp
from megacispo.checkpoint.unpickling import CheckpointReader
from megacispo.files import staged_directory
from megacispo.models import hf_names
from megacispo.models.config import M1, HybridModelConfig, LoraConfig, is_adapter_parameter

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
        self.path = directory
        self.storage_reader = CheckpointReader(directory)
        self.metadata = self.storage_reader.read_metadata()
        self.meter = meter

    def __contains__(self, key: str) -> bool:
        return key in self.metadata.state_dict_metadata

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


class HFBaseReader:
    """Our tensors by checkpoint key, read as CheckpointTensorReader reads them, from a Hugging Face
    directory (either expert layout; FP8 weights dequantized) in the dtype its embedding is stored in:
    the base of a LoRA run that started from one."""

    def __init__(self, directory: Path, config: HybridModelConfig, meter: TensorMeter | None = None):
        """ValueError naming the tensor and the file when the directory does not hold ``config``'s model
        (headers only, as train.load checks it)."""
        hf_reader.check_hf_checkpoint(directory, config)
        checkpoint = hf_reader.read_hf_checkpoint(directory)
        layout = hf_names.detect_experts_layout(checkpoint.file_of)
        embedding = hf_names.GLOBAL_NAMES["embedding.word_embeddings.weight"]
        self.path = directory
        self.dtype = SAFETENSORS_DTYPE_OF[checkpoint.dtype_of[embedding]]
        self.shapes = hf_reader.model_tensor_shapes(config)
        self.source = hf_reader.HFChunkSource(hf_reader.HFTensorReader(checkpoint, meter),
                                              hf_names.tensor_mappings(config, layout), layout, self.dtype)

    def __contains__(self, key: str) -> bool:
        return key in self.shapes

    def shape_and_dtype(self, key: str) -> tuple[tuple[int, ...], torch.dtype]:
        return self.shapes[key], self.dtype

    def read(
        self, key: str, offsets: tuple[int, ...] | None = None, sizes: tuple[int, ...] | None = None
    ) -> torch.Tensor:
        """The region [offsets, offsets + sizes) of ``key`` (default: the whole tensor)."""
        shape = self.shapes[key]
        region = hf_reader.Chunk(key, shape, offsets or (0,) * len(shape), sizes or shape, self.dtype)
        return self.source.read(region)


TensorReader = CheckpointTensorReader | HFBaseReader


def _adapter_keys(weight_key: str) -> tuple[str, str]:
    """The checkpoint keys of the A and B of the adapter on ``weight_key`` (models/lora.py: beside the weight)."""
    prefix = weight_key.removesuffix(".weight")
    return f"{prefix}.lora_A", f"{prefix}.lora_B"


class LoraDeltas:
    """The adapters of a LoRA run's checkpoint by the key of the weight each one adapts: A [..., rank, in]
    and B [..., out, rank] (stacked experts: [E, ...]), read one matrix (one expert) at a time."""

    def __init__(self, reader: CheckpointTensorReader, lora: LoraConfig):
        self.reader = reader
        self.lora = lora
        # The model's adapters; the optimizer's state of them is keyed "optimizer.state.<...>.lora_A".
        adapters = [key for key in reader.metadata.state_dict_metadata
                    if is_adapter_parameter(key) and not key.startswith("optimizer.")]
        self.weight_keys = {key.rsplit(".", 1)[0] + ".weight" for key in adapters}

    def check(self, weight_shapes: dict[str, tuple[int, ...]]) -> None:
        """Before any tensor is read: every adapter sits on a weight of the model (``weight_shapes``, by
        key) and has the rank and the shapes that fit it. ValueError naming the tensor and the checkpoint."""
        rank = self.lora.rank
        for key in sorted(self.weight_keys):
            a_key, b_key = _adapter_keys(key)
            if key not in weight_shapes:
                raise ValueError(f"adapter {a_key} in {self.reader.path} adapts {key}, which the model of its "
                                 f"{META_FILE} does not have: the checkpoint is damaged; use another one.")
            *experts, out_features, in_features = weight_shapes[key]
            for adapter, shape in ((a_key, (*experts, rank, in_features)), (b_key, (*experts, out_features, rank))):
                found = self.reader.shape_and_dtype(adapter)[0] if adapter in self.reader else None
                if found != shape:
                    raise ValueError(
                        f"adapter {adapter} in {self.reader.path} is {found or 'missing'}: lora.rank = {rank} on "
                        f"{key} {tuple(weight_shapes[key])} needs {shape}; the checkpoint is damaged, use another one.")

    def factors(self, weight_key: str, expert: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """(A, B) of the adapter on ``weight_key``; of expert ``expert`` alone for a stacked one."""
        return tuple(self._read(key, expert) for key in _adapter_keys(weight_key))

    def _read(self, key: str, expert: int | None) -> torch.Tensor:
        if expert is None:
            return self.reader.read(key)
        shape = self.reader.shape_and_dtype(key)[0]
        return self.reader.read(key, (expert,) + (0,) * (len(shape) - 1), (1,) + shape[1:])[0]

    def merge(self, weight_key: str, weight: torch.Tensor, expert: int | None = None) -> torch.Tensor:
        """``weight`` (the base's matrix of ``weight_key``, or of its expert ``expert``) plus (alpha / rank) B A
        where an adapter sits on it, computed in at least fp32 and returned in weight's dtype, as
        LoraAdapted.merged_weight merges for rollouts."""
        if weight_key not in self.weight_keys:
            return weight
        return self.lora.merged(weight, *self.factors(weight_key, expert))


HFReadPlan = list[tuple[list[tuple[str, tuple[int, ...]]], torch.dtype, Callable[[], dict[str, torch.Tensor]]]]


def _hf_tensor_plan(reader: TensorReader, config, adapters: LoraDeltas | None = None) -> HFReadPlan:
    """(HF names with their shapes, their dtype, a reader of them) in HF order, one entry per tensor we read:
    a whole tensor, or one expert of a stacked expert tensor (legacy layout: one tensor per expert);
    with ``adapters``, each adapted weight merged with its update."""

    mappings = hf_names.tensor_mappings(config, hf_names.LEGACY)
    for mapping in mappings:
        if mapping.key not in reader:
            raise ValueError(
                f"tensor {mapping.key} is missing from the checkpoint {reader.path}: it does not hold "
                f"the model its meta.json describes."
            )
    if adapters is not None:
        adapters.check({mapping.key: reader.shape_and_dtype(mapping.key)[0] for mapping in mappings})
    plan = []
    for mapping in mappings:
        shape, dtype = reader.shape_and_dtype(mapping.key)
        hf_shapes = {name: tuple(t.shape) for name, t in mapping.to_hf(torch.empty(shape, device="meta")).items()}
        if mapping.key.endswith(hf_names.EXPERT_FC1_KEY):
            for expert in range(shape[0]):
                names = mapping.hf_names[2 * expert : 2 * expert + 2]
                plan.append(([(name, hf_shapes[name]) for name in names], dtype,
                             _expert_reader(reader, adapters, mapping.key, expert, shape, names)))
        elif mapping.key.endswith(hf_names.EXPERT_FC2_KEY):
            for expert in range(shape[0]):
                names = mapping.hf_names[expert : expert + 1]
                plan.append(([(name, hf_shapes[name]) for name in names], dtype,
                             _expert_reader(reader, adapters, mapping.key, expert, shape, names)))
        else:
            name = mapping.hf_names[0]
            plan.append(([(name, hf_shapes[name])], dtype, _whole_reader(reader, adapters, mapping.key, name)))
    return plan


def _whole_reader(reader: TensorReader, adapters: LoraDeltas | None, key: str, name: str) -> Callable[[], dict]:
    def read() -> dict[str, torch.Tensor]:
        tensor = reader.read(key)
        return {name: tensor if adapters is None else adapters.merge(key, tensor)}
    return read


def _expert_reader(reader: TensorReader, adapters: LoraDeltas | None, key: str, expert: int,
                   shape: tuple[int, ...], names: tuple[str, ...]) -> Callable[[], dict]:
    """Expert ``expert``'s HF tensors: fc1 [2I, H] -> (w1, w3), fc2 [H, I] -> (w2,)."""
    def read() -> dict[str, torch.Tensor]:
        matrix = reader.read(key, (expert,) + (0,) * (len(shape) - 1), (1,) + shape[1:])[0]
        if adapters is not None:
            matrix = adapters.merge(key, matrix, expert)
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
    base: str | os.PathLike | None = None,
    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
    progress: bool = True,
    meter: TensorMeter | None = None,
) -> Path:
    """Write an HF directory for a megacispo checkpoint (a LoRA run's: merged into ``base``, by default
    its recorded train.load); nothing is left at ``out`` on failure. ``meter`` counts the bytes of the
    tensors held at once."""
    out = Path(out)
    check_new(out)
    with staged_directory(out) as temporary:
        write_hf_files(ckpt, temporary, base=base, max_shard_bytes=max_shard_bytes, progress=progress, meter=meter)
    return out


def write_hf_files(
    ckpt: str | os.PathLike,
    directory: Path,
    *,
    base: str | os.PathLike | None = None,
    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
    progress: bool = True,
    meter: TensorMeter | None = None,
) -> None:
    """The safetensors shards, their index and config.json of a megacispo checkpoint, written into
    the existing empty ``directory`` (megatron_to_hf and megacispo.checkpoint.hf.export_hf make it
    beside their output and rename it when everything is written). A LoRA run's checkpoint is written
    merged into its base (``base``, default the run's train.load), in the base's dtype."""

    if max_shard_bytes < 1:
        raise ValueError(f"--max-shard-bytes = {max_shard_bytes}: it must be positive.")
    step_dir = resolve_checkpoint(ckpt)
    meta = read_meta(step_dir)
    config = _model_config(step_dir, meta)
    if config.family == M1 and config.rotary_dim != config.head_dim:
        warnings.warn(
            f"rotary_dim = {config.rotary_dim} < head_dim = {config.head_dim}: HF transformers' MiniMax rotates "
            f"whole heads and ignores config.json's rotary_dim, so transformers will compute different "
            f"outputs; megacispo (and the original MiniMax code) read rotary_dim back.",
            stacklevel=2,
        )
    checkpoint = CheckpointTensorReader(step_dir, meter)
    lora = _lora_config(meta)
    reader: TensorReader
    if lora is None:
        if base is not None:
            raise ValueError(f"--base {base}: {step_dir} holds a whole model (no lora.rank in its {META_FILE}), not "
                             f"adapters to merge into a base; drop --base.")
        reader, adapters, dtype = checkpoint, None, params_dtype_of(meta)
    else:
        adapters = LoraDeltas(checkpoint, lora)
        reader, dtype = _lora_base_reader(step_dir, meta, config, base, meter)
    plan = _hf_tensor_plan(reader, config, adapters)
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
    (directory / CONFIG_FILE).write_text(json.dumps(hf_names.config_file(config, dtype), indent=2))


def _model_config(step_dir: Path, meta: dict) -> HybridModelConfig:
    if not meta.get("config") or "model" not in meta["config"]:
        raise ValueError(f"{step_dir}/{META_FILE} has no config.model: this checkpoint cannot be converted.")
    return HybridModelConfig(**meta["config"]["model"])


def _lora_config(meta: dict) -> LoraConfig | None:
    """The adapters of a LoRA run's checkpoint (its config's lora section); None for a whole model."""
    return LoraConfig(**meta["config"]["lora"]) if adapter_rank_of(meta) else None


def _lora_base_reader(step_dir: Path, meta: dict, config: HybridModelConfig, base: str | os.PathLike | None,
                      meter: TensorMeter | None) -> tuple[TensorReader, str]:
    """A reader of the base that the adapters of the LoRA checkpoint ``step_dir`` merge into (``base``, else
    the recorded train.load), and the name of its dtype. ValueError naming the field that gave the path,
    what is wrong and the fix."""
    field = "--base" if base is not None else f"{step_dir / META_FILE} extra_state.lora_base.train.load"
    path = base if base is not None else recorded_lora_base(meta)
    fix = ("pass --base with the base the adapters were trained on (the megacispo checkpoint or Hugging Face "
           "directory that was the run's train.load)")
    if not path:
        raise ValueError(f"{field} is not recorded: {step_dir} holds LoRA adapters alone (lora.rank = "
                         f"{adapter_rank_of(meta)}) and names no base; {fix}.")
    path = Path(path)
    if not path.exists():
        raise ValueError(f"{field} = {path}: no such file or directory; {fix}.")
    try:
        if is_hf_directory(path):
            _check_same_model(config, hf_model_config(path), path / CONFIG_FILE)
            hf_base = HFBaseReader(path, config, meter)
            return hf_base, str(hf_base.dtype).removeprefix("torch.")
        base_dir = resolve_checkpoint(path)
        base_meta = read_meta(base_dir)
        if adapter_rank_of(base_meta):
            raise CheckpointError(f"{base_dir} holds LoRA adapters too (lora.rank = {adapter_rank_of(base_meta)} in "
                                  f"its {META_FILE}), not a whole model")
        _check_same_model(config, _model_config(base_dir, base_meta), base_dir / META_FILE)
        return CheckpointTensorReader(base_dir, meter), params_dtype_of(base_meta)
    except ValueError as error:
        raise ValueError(f"{field} = {path}: {str(error).rstrip('.')}; {fix}.") from None


def _check_same_model(adapters_model: HybridModelConfig, base_model: HybridModelConfig, source: Path) -> None:
    """The base describes the adapters' model: the fields that fix the tensors' keys and shapes agree."""
    differing = [name for name in WEIGHT_FIELDS if getattr(base_model, name) != getattr(adapters_model, name)]
    if differing:
        values = ", ".join(f"model.{name} = {getattr(base_model, name)!r} (the adapters' model: "
                           f"{getattr(adapters_model, name)!r})" for name in differing)
        raise ValueError(f"{source} describes another model than the one the adapters were trained on: {values}")


# PEFT's LoRA adapter directory (what PeftModel.save_pretrained writes), and the prefix PeftModel puts before
# the transformers model's own parameter names.
PEFT_CONFIG_FILE = "adapter_config.json"
PEFT_WEIGHTS_FILE = "adapter_model.safetensors"
PEFT_PREFIX = "base_model.model."


def megatron_to_peft(ckpt: str | os.PathLike, out: str | os.PathLike, *,
                     base: str | os.PathLike | None = None) -> Path:
    """Write a LoRA run's checkpoint as a PEFT adapter directory (``write_peft_files``); nothing is left at
    ``out`` on failure."""
    out = Path(out)
    check_new(out)
    with staged_directory(out) as temporary:
        write_peft_files(ckpt, temporary, base=base)
    return out


def write_peft_files(ckpt: str | os.PathLike, directory: Path, *, base: str | os.PathLike | None = None) -> None:
    """adapter_config.json and adapter_model.safetensors of a LoRA run's checkpoint, as PEFT saves a LoRA
    adapter of the transformers model: each adapter under the HF name of the linear it sits on
    (``base_model.model.model.layers.N.self_attn.q_proj.lora_A.weight`` [r, in], ``.lora_B.weight`` [out, r]),
    target_modules the HF module names, and base_model_name_or_path ``base`` (default: the run's
    train.load), which is not read. The adapters are held at once (rank-r matrices: megabytes).

    Adapters on the experts are refused: transformers 5.x holds MiniMax's experts as fused parameters
    (mlp.experts.gate_up_proj / down_proj), not linears that PEFT's target_modules adapt."""
    from safetensors.torch import save_file

    step_dir = resolve_checkpoint(ckpt)
    meta = read_meta(step_dir)
    config = _model_config(step_dir, meta)
    lora = _lora_config(meta)
    if lora is None:
        raise ValueError(f"{step_dir} holds a whole model (no lora.rank in its {META_FILE}): it has no adapters to "
                         f"export; write it as a Hugging Face directory with megatron-to-hf.")
    adapters = LoraDeltas(CheckpointTensorReader(step_dir), lora)
    experts = sorted(key for key in adapters.weight_keys
                     if key.endswith((hf_names.EXPERT_FC1_KEY, hf_names.EXPERT_FC2_KEY)))
    if experts:
        raise ValueError(
            f"{step_dir} has adapters on the experts (on {experts[0]} and {len(experts) - 1} more; lora.targets = "
            f"{lora.targets}): transformers 5.x holds MiniMax's experts as fused parameters (mlp.experts.gate_up_proj, "
            f"down_proj), which PEFT's target_modules cannot adapt; export the merged model with megatron-to-hf "
            f"instead, or train with lora.targets listing the attention projections alone.")
    adapters.check(hf_reader.model_tensor_shapes(config))
    hf_name_of = {mapping.key: mapping.hf_names[0] for mapping in hf_names.tensor_mappings(config)}
    tensors, target_modules = {}, set()
    for key in sorted(adapters.weight_keys):
        module = hf_name_of[key].removesuffix(".weight")
        down, up = adapters.factors(key)
        tensors[f"{PEFT_PREFIX}{module}.lora_A.weight"] = down
        tensors[f"{PEFT_PREFIX}{module}.lora_B.weight"] = up
        target_modules.add(module.rsplit(".", 1)[-1])
    save_file(tensors, str(directory / PEFT_WEIGHTS_FILE), metadata={"format": "pt"})
    base_path = str(base) if base is not None else recorded_lora_base(meta)
    if base_path and Path(base_path).is_dir() and not is_hf_directory(base_path):
        warnings.warn(f"base_model_name_or_path = {base_path} is not a Hugging Face directory (a megacispo "
                      f"checkpoint?), which transformers does not load: write the base with megatron-to-hf and pass "
                      f"that directory as --base.", stacklevel=2)
    peft_config = {
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": base_path,
        "r": lora.rank, "lora_alpha": lora.alpha, "lora_dropout": lora.dropout,
        "target_modules": sorted(target_modules), "bias": "none", "fan_in_fan_out": False,
        # The update is (lora_alpha / r) B A, plain LoRA's.
        "use_rslora": False, "use_dora": False, "inference_mode": True,
    }
    (directory / PEFT_CONFIG_FILE).write_text(json.dumps(peft_config, indent=2))
