"""Convert between Hugging Face MiniMax checkpoints and megacispo (Megatron distributed) checkpoints.

    python tools/convert_checkpoint.py hf-to-megatron --hf-dir HF --out CKPT [--tp T --pp P --ep E]
    python tools/convert_checkpoint.py megatron-to-hf --ckpt CKPT --out HF

Both directions run in one process at TP = PP = EP = 1. Megatron's distributed checkpoints are
keyed by global tensor and reshard on load, so a checkpoint written here loads at any layout;
``--tp/--pp/--ep`` are only validated against the model and recorded in meta.json.

hf-to-megatron reads config.json and the safetensors (a single model.safetensors, or shards
listed by model.safetensors.index.json), one tensor at a time, into the single-process model and
saves it with megacispo.checkpoint.save_checkpoint. HF names come from megacispo.models.hf_names
(both expert layouts: legacy w1/w2/w3 and fused gate_up_proj/down_proj). Peak memory: the model's
parameters in their dtype, plus one of our tensors (an expert stack [E, 2I, H] at most) and the HF
tensors it is merged from, plus what Megatron's writer buffers. Everything is written into a
temporary directory beside ``--out`` and renamed at the end: a failed conversion leaves nothing
at ``--out``.

megatron-to-hf loads a checkpoint (a step_* directory, or a checkpoints root: its newest step)
and writes sharded safetensors in the on-disk (legacy) expert layout, model.safetensors.index.json
and config.json, which ``transformers.MiniMaxForCausalLM.from_pretrained`` loads. HF transformers
rotates whole heads: a model with rotary_dim < head_dim is written with a warning (config.json
keeps ``rotary_dim``, which only megacispo reads).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import shutil
import sys
import tempfile
import warnings
from pathlib import Path
from typing import Any, Iterator

import torch

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
CONFIG_FILE = "config.json"
CONVERTED_STEP = 0
# Derived (recomputed) lightning buffers that HF may hold: neither read nor written.
DERIVED_SUFFIXES = ("slope_rate", "query_decay", "key_decay", "diagonal_decay")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
DEFAULT_MAX_SHARD_BYTES = 5 * 1024**3


# ---------------------------------------------------------------------------------------------
# Reading an HF directory


@dataclasses.dataclass
class HFCheckpoint:
    """An HF directory's config and where each tensor lives."""

    directory: Path
    config: dict[str, Any]
    file_of: dict[str, str]
    """HF tensor name -> safetensors file name (relative to directory)."""


def read_hf_checkpoint(hf_dir: str | os.PathLike) -> HFCheckpoint:
    """config.json and the tensor -> file map; checks that every listed file exists and that the
    index names only tensors its files hold. Reads names only, no tensor data."""
    from safetensors import safe_open

    directory = Path(hf_dir)
    if not directory.is_dir():
        raise ValueError(f"--hf-dir {directory}: no such directory.")
    config_path = directory / CONFIG_FILE
    if not config_path.is_file():
        raise ValueError(f"--hf-dir {directory}: it has no {CONFIG_FILE}; pass a Hugging Face model directory.")
    config = json.loads(config_path.read_text())
    index_path = directory / INDEX_FILE
    if index_path.is_file():
        file_of = dict(json.loads(index_path.read_text())["weight_map"])
    elif (directory / SINGLE_FILE).is_file():
        file_of = {}
    else:
        raise ValueError(f"--hf-dir {directory}: neither {INDEX_FILE} nor {SINGLE_FILE} is there.")
    files = sorted(set(file_of.values())) or [SINGLE_FILE]
    for file_name in files:
        path = directory / file_name
        if not path.is_file():
            first = next((name for name, f in file_of.items() if f == file_name), "?")
            raise ValueError(
                f"shard {path} is missing: {INDEX_FILE} places tensor {first} (and others) in it. "
                f"Download the complete checkpoint."
            )
        with safe_open(str(path), framework="pt") as handle:
            names = set(handle.keys())
        if not file_of:
            file_of = {name: file_name for name in names}
            continue
        for name, listed in file_of.items():
            if listed == file_name and name not in names:
                raise ValueError(f"tensor {name} is listed in {index_path} under {path}, but that file does not hold it.")
    return HFCheckpoint(directory, config, file_of)


class _TensorReader:
    """HF tensors by name, each file opened once."""

    def __init__(self, checkpoint: HFCheckpoint, stack: contextlib.ExitStack):
        self.checkpoint = checkpoint
        self.stack = stack
        self.handles: dict[str, Any] = {}

    def path_of(self, name: str) -> Path:
        return self.checkpoint.directory / self.checkpoint.file_of[name]

    def get(self, name: str) -> torch.Tensor:
        from safetensors import safe_open

        if name not in self.checkpoint.file_of:
            raise ValueError(
                f"HF tensor {name} is missing from {self.checkpoint.directory} (no file holds it): the checkpoint "
                f"does not match its {CONFIG_FILE} (layer count, expert count or layer types)."
            )
        file_name = self.checkpoint.file_of[name]
        if file_name not in self.handles:
            path = self.checkpoint.directory / file_name
            self.handles[file_name] = self.stack.enter_context(safe_open(str(path), framework="pt"))
        return self.handles[file_name].get_tensor(name)


def check_no_unknown_tensors(checkpoint: HFCheckpoint, mappings: list) -> None:
    """Every HF tensor must map to one of ours (derived decay buffers aside)."""
    known = {name for mapping in mappings for name in mapping.hf_names}
    for name, file_name in sorted(checkpoint.file_of.items()):
        if name not in known and not name.endswith(DERIVED_SUFFIXES):
            raise ValueError(
                f"unknown HF tensor {name} in {checkpoint.directory / file_name}: it maps to no tensor of the model "
                f"described by {CONFIG_FILE} (a different architecture, or a config that does not match the weights)."
            )


def _hf_params_dtype(checkpoint: HFCheckpoint, requested: str) -> torch.dtype:
    if requested != "auto":
        return DTYPES[requested]
    from safetensors import safe_open

    name = "model.embed_tokens.weight"
    if name not in checkpoint.file_of:
        raise ValueError(f"HF tensor {name} is missing from {checkpoint.directory}.")
    with safe_open(str(checkpoint.directory / checkpoint.file_of[name]), framework="pt") as handle:
        dtype = handle.get_slice(name).get_dtype()
    by_safetensors_name = {"F32": torch.float32, "BF16": torch.bfloat16}
    if dtype not in by_safetensors_name:
        raise ValueError(
            f"HF tensors are {dtype} ({name}): pass --dtype float32 or --dtype bfloat16 to convert them."
        )
    return by_safetensors_name[dtype]


# ---------------------------------------------------------------------------------------------
# The single-process model


def _single_process_model(config, params_dtype: torch.dtype):
    """Our model in one process (TP = PP = EP = 1), initializing a world of one if needed."""
    from megatron.core import parallel_state

    from megacispo.models.config import transformer_config
    from megacispo.models.model import HybridModel
    from megacispo.parallel.layout import ParallelConfig, init_distributed

    if not parallel_state.model_parallel_is_initialized():
        init_distributed(ParallelConfig(), seed=0)
    if torch.distributed.get_world_size() != 1:
        raise ValueError(
            f"the converter runs in one process, but this is a world of {torch.distributed.get_world_size()}: "
            f"run it with plain python, not torchrun."
        )
    megatron_config = transformer_config(config, ParallelConfig(), params_dtype=params_dtype)
    # Every weight is overwritten: random initialization would only cost time.
    megatron_config.perform_initialization = False
    return HybridModel(config, megatron_config).eval()


def _model_tensors(model) -> dict[str, torch.Tensor]:
    """The single-process model's learned tensors by state_dict key (no Megatron extra state)."""
    return {
        key: tensor for key, tensor in model.state_dict(keep_vars=True).items()
        if not key.endswith("_extra_state")
    }


def _layout_parallel_config(config, tp: int, pp: int, ep: int):
    """Validate the layout the checkpoint is meant for; TP > 1 with experts needs sequence parallelism."""
    import math

    from megacispo.models.config import model_shape
    from megacispo.parallel.layout import ParallelConfig, validate_layout

    parallel = ParallelConfig(
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        expert_model_parallel_size=ep,
        sequence_parallel=tp > 1,
    )
    smallest_world = math.lcm(tp * pp, parallel.expert_tp * ep * pp)
    validate_layout(parallel, smallest_world, model_shape(config))
    return parallel


# ---------------------------------------------------------------------------------------------
# hf-to-megatron


def hf_to_megatron(
    hf_dir: str | os.PathLike,
    out: str | os.PathLike,
    *,
    tp: int = 1,
    pp: int = 1,
    ep: int = 1,
    rotary_dim: int | None = None,
    dtype: str = "auto",
    progress: bool = True,
) -> Path:
    """Convert an HF directory into a megacispo checkpoint root ``out`` (holding step_00000000).
    Returns the step directory. Nothing is left at ``out`` when it fails."""
    from tqdm import tqdm

    from megacispo.checkpoint import save_checkpoint
    from megacispo.config import Config, to_dict
    from megacispo.models import hf_names

    out = Path(out)
    if out.exists():
        raise ValueError(f"--out {out} already exists: choose a new directory (the converter never overwrites).")
    checkpoint = read_hf_checkpoint(hf_dir)
    config = hf_names.config_from_hf(checkpoint.config, rotary_dim=rotary_dim)
    parallel = _layout_parallel_config(config, tp, pp, ep)
    layout = hf_names.detect_experts_layout(checkpoint.file_of)
    mappings = hf_names.tensor_mappings(config, layout)
    check_no_unknown_tensors(checkpoint, mappings)
    params_dtype = _hf_params_dtype(checkpoint, dtype)

    model = _single_process_model(config, params_dtype)
    targets = _model_tensors(model)
    assigned: set[str] = set()
    out.parent.mkdir(parents=True, exist_ok=True)
    temporary = Path(tempfile.mkdtemp(prefix=f".tmp_{out.name}_", dir=out.parent))
    try:
        with contextlib.ExitStack() as stack, torch.no_grad():
            reader = _TensorReader(checkpoint, stack)
            for mapping in tqdm(mappings, desc="hf-to-megatron", unit="tensor", disable=not progress):
                hf_tensors = {name: reader.get(name) for name in mapping.hf_names}
                _check_hf_shapes(mapping, hf_tensors, reader)
                full = {mapping.key: mapping.merge(tuple(hf_tensors[name] for name in mapping.hf_names))}
                for key, tensor in hf_names.full_to_single_process(full).items():
                    _assign(targets, key, tensor, mapping, reader)
                    assigned.add(key)
                del hf_tensors, full
        unset = sorted(set(targets) - assigned)
        assert not unset, f"model tensors without an HF source: {unset[:4]}"
        config_dict = to_dict(dataclasses.replace(Config(), model=config, parallel=parallel))
        step_dir = save_checkpoint(
            temporary, CONVERTED_STEP, model, config_dict=config_dict, keep_last=None,
            extra_state={
                "converted_from": str(Path(hf_dir).resolve()),
                "params_dtype": _dtype_name(params_dtype),
                "hf_experts_layout": layout,
            },
        )
        os.rename(temporary, out)
    except BaseException:
        shutil.rmtree(temporary, ignore_errors=True)
        raise
    return out / step_dir.name


def _dtype_name(dtype: torch.dtype) -> str:
    return next(name for name, value in DTYPES.items() if value == dtype)


def _check_hf_shapes(mapping, hf_tensors: dict[str, torch.Tensor], reader: _TensorReader) -> None:
    """The HF tensors merged into one of ours must agree with each other (same shape)."""
    shapes = {tuple(t.shape) for t in hf_tensors.values()}
    if len(shapes) > 1:
        first = mapping.hf_names[0]
        for name, tensor in hf_tensors.items():
            if tuple(tensor.shape) != tuple(hf_tensors[first].shape):
                raise ValueError(
                    f"HF tensor {name} in {reader.path_of(name)} has shape {tuple(tensor.shape)}, but {first} has "
                    f"{tuple(hf_tensors[first].shape)}: the checkpoint does not match its {CONFIG_FILE}."
                )


def _assign(targets: dict[str, torch.Tensor], key: str, tensor: torch.Tensor, mapping, reader: _TensorReader) -> None:
    if key not in targets:
        raise AssertionError(f"hf_names maps to {key}, which the model does not have")
    target = targets[key]
    if tuple(tensor.shape) != tuple(target.shape):
        sources = ", ".join(f"{name} in {reader.path_of(name)}" for name in mapping.hf_names[:2])
        more = " ..." if len(mapping.hf_names) > 2 else ""
        raise ValueError(
            f"HF tensor(s) {sources}{more} give {mapping.key} the shape {tuple(tensor.shape)}, but the model "
            f"described by {CONFIG_FILE} needs {tuple(target.shape)}: the config does not match the weights."
        )
    target.copy_(tensor)


# ---------------------------------------------------------------------------------------------
# megatron-to-hf


def load_single_process(ckpt: str | os.PathLike):
    """(model, config, meta) of a megacispo checkpoint (step dir or checkpoints root) in one process."""
    from megacispo.checkpoint import load_checkpoint, read_meta, resolve_checkpoint
    from megacispo.models.config import HybridModelConfig

    step_dir = resolve_checkpoint(ckpt)
    meta = read_meta(step_dir)
    if not meta.get("config") or "model" not in meta["config"]:
        raise ValueError(f"{step_dir}/meta.json has no config.model: this checkpoint cannot be converted.")
    config = HybridModelConfig(**meta["config"]["model"])
    params_dtype = DTYPES[meta.get("extra_state", {}).get("params_dtype", "float32")]
    model = _single_process_model(config, params_dtype)
    with warnings.catch_warnings():
        # The saved RNG states belong to the saving run's layout: not wanted here.
        warnings.simplefilter("ignore")
        load_checkpoint(step_dir, model, load_rng=False)
    return model, config, meta


def full_tensors(model) -> dict[str, torch.Tensor]:
    """The single-process model's tensors under our checkpoint keys (experts stacked [E, ...])."""
    from megacispo.models.hf_names import EXPERT_FC1_KEY, EXPERT_FC2_KEY

    tensors: dict[str, torch.Tensor] = {}
    experts: dict[str, dict[int, torch.Tensor]] = {}
    for key, tensor in _model_tensors(model).items():
        if ".mlp.experts.local_experts." in key:
            prefix, rest = key.split(".mlp.experts.local_experts.")
            expert, fc = rest.split(".", 1)
            stacked = EXPERT_FC1_KEY if fc.startswith("linear_fc1") else EXPERT_FC2_KEY
            experts.setdefault(f"{prefix}.{stacked}", {})[int(expert)] = tensor.detach()
        else:
            tensors[key] = tensor.detach()
    for key, by_expert in experts.items():
        tensors[key] = torch.stack([by_expert[e] for e in sorted(by_expert)])
    return tensors


def megatron_to_hf(
    ckpt: str | os.PathLike,
    out: str | os.PathLike,
    *,
    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
    progress: bool = True,
) -> Path:
    """Write an HF directory for a megacispo checkpoint; nothing is left at ``out`` on failure."""
    from safetensors.torch import save_file
    from tqdm import tqdm

    from megacispo.models import hf_names

    out = Path(out)
    if out.exists():
        raise ValueError(f"--out {out} already exists: choose a new directory (the converter never overwrites).")
    if max_shard_bytes < 1:
        raise ValueError(f"--max-shard-bytes = {max_shard_bytes}: it must be positive.")
    model, config, meta = load_single_process(ckpt)
    if config.rotary_dim != config.head_dim:
        warnings.warn(
            f"rotary_dim = {config.rotary_dim} < head_dim = {config.head_dim}: HF transformers' MiniMax rotates "
            f"whole heads and ignores config.json's rotary_dim, so transformers will compute different "
            f"outputs; megacispo (and the original MiniMax code) read rotary_dim back.",
            stacklevel=2,
        )
    tensors = full_tensors(model)
    out.parent.mkdir(parents=True, exist_ok=True)
    temporary = Path(tempfile.mkdtemp(prefix=f".tmp_{out.name}_", dir=out.parent))
    try:
        shards = list(_shards(tensors, config, max_shard_bytes))
        weight_map, total_bytes = {}, 0
        for number, shard in enumerate(tqdm(shards, desc="megatron-to-hf", unit="shard", disable=not progress)):
            file_name = f"model-{number + 1:05d}-of-{len(shards):05d}.safetensors"
            save_file({name: t.contiguous() for name, t in shard.items()}, str(temporary / file_name),
                      metadata={"format": "pt"})
            weight_map.update({name: file_name for name in shard})
            total_bytes += sum(t.numel() * t.element_size() for t in shard.values())
        index = {"metadata": {"total_size": total_bytes}, "weight_map": dict(sorted(weight_map.items()))}
        (temporary / INDEX_FILE).write_text(json.dumps(index, indent=2))
        dtype = meta.get("extra_state", {}).get("params_dtype", "float32")
        hf_config = {
            "architectures": ["MiniMaxForCausalLM"], "model_type": "minimax", "dtype": dtype,
            **hf_names.config_to_hf(config),
        }
        (temporary / CONFIG_FILE).write_text(json.dumps(hf_config, indent=2))
        os.rename(temporary, out)
    except BaseException:
        shutil.rmtree(temporary, ignore_errors=True)
        raise
    return out


def _shards(tensors: dict[str, torch.Tensor], config, max_shard_bytes: int) -> Iterator[dict[str, torch.Tensor]]:
    """HF tensors (legacy on-disk layout), mapping by mapping, cut into shards of at most
    max_shard_bytes (a single larger tensor gets a shard of its own)."""
    from megacispo.models import hf_names

    shard: dict[str, torch.Tensor] = {}
    size = 0
    for mapping in hf_names.tensor_mappings(config, hf_names.LEGACY):
        for name, tensor in mapping.to_hf(tensors[mapping.key]).items():
            nbytes = tensor.numel() * tensor.element_size()
            if shard and size + nbytes > max_shard_bytes:
                yield shard
                shard, size = {}, 0
            shard[name] = tensor
            size += nbytes
    if shard:
        yield shard


# ---------------------------------------------------------------------------------------------
# Command line


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = parser.add_subparsers(dest="command", required=True)
    to_megatron = commands.add_parser("hf-to-megatron", help="HF directory -> megacispo checkpoint")
    to_megatron.add_argument("--hf-dir", required=True, help="Hugging Face model directory")
    to_megatron.add_argument("--out", required=True, help="new checkpoints root; step_00000000 is written in it")
    to_megatron.add_argument("--tp", type=int, default=1, help="tensor-parallel size to validate and record")
    to_megatron.add_argument("--pp", type=int, default=1, help="pipeline-parallel size to validate and record")
    to_megatron.add_argument("--ep", type=int, default=1, help="expert-parallel size to validate and record")
    to_megatron.add_argument("--rotary-dim", type=int, default=None,
                             help="rotated channels per head (default: config.json's rotary_dim, else head_dim "
                                  "as HF transformers computes; the original MiniMax uses head_dim / 2)")
    to_megatron.add_argument("--dtype", choices=["auto", *DTYPES], default="auto",
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
    try:
        if args.command == "hf-to-megatron":
            path = hf_to_megatron(args.hf_dir, args.out, tp=args.tp, pp=args.pp, ep=args.ep,
                                  rotary_dim=args.rotary_dim, dtype=args.dtype, progress=not args.no_progress)
        else:
            path = megatron_to_hf(args.ckpt, args.out, max_shard_bytes=args.max_shard_bytes,
                                  progress=not args.no_progress)
    except ValueError as error:
        raise SystemExit(f"error: {error}") from None
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
