"""The two checkpoint formats on disk, as far as telling them apart and reading their configs goes:
the file names of a megacispo checkpoint (a Megatron distributed checkpoint with meta.json) and of a
Hugging Face MiniMax directory (config.json and safetensors), and the model an HF config.json
describes. Light on purpose: loading a run config reads these, before anything heavy is imported."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import torch

from megacispo.models import hf_names
from megacispo.models.config import PARAMS_DTYPES, HybridModelConfig

# A megacispo checkpoint's record of itself, written last (megacispo.checkpoint.distributed).
META_FILE = "meta.json"
SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
CONFIG_FILE = "config.json"
SAFETENSORS_DTYPES = {torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16"}
SAFETENSORS_DTYPE_OF = {name: dtype for dtype, name in SAFETENSORS_DTYPES.items()}


class CheckpointError(ValueError):
    """A checkpoint that cannot be used: the message names the file and what is wrong with it. A
    ValueError, which the entry points print as one ``error:`` line."""


def read_json(path: Path) -> dict[str, Any]:
    """A JSON object file of an HF directory; ValueError naming the file when it is not one."""
    try:
        value = json.loads(path.read_text())
    except (UnicodeDecodeError, json.JSONDecodeError) as error:
        raise ValueError(f"{path} is not valid JSON ({error}): download it again.") from None
    if not isinstance(value, dict):
        raise ValueError(f"{path} holds a {type(value).__name__}, not a JSON object: download it again.")
    return value


def is_hf_directory(path: str | os.PathLike) -> bool:
    """A Hugging Face model directory (config.json or safetensors weights), not a megacispo
    checkpoint (meta.json). One with weights but no config.json counts: hf_model_config then says
    what is missing."""
    path = Path(path)
    marks = (CONFIG_FILE, SINGLE_FILE, INDEX_FILE)
    return not (path / META_FILE).is_file() and any((path / name).is_file() for name in marks)


def read_hf_config(path: str | os.PathLike) -> dict[str, Any]:
    """The HF directory's config.json, checked to be transformers' MiniMax or MiniMax-M2
    (hf_names.HF_MODEL_TYPES, and the family's architecture where it names architectures) before
    anything else of it is read: another model's config.json would otherwise fail later on a field
    MiniMax has and it lacks."""
    config_path = Path(path) / CONFIG_FILE
    if not config_path.is_file():
        raise ValueError(f"{Path(path)}: it has no {CONFIG_FILE}; pass a Hugging Face model directory.")
    config = read_json(config_path)
    model_type, architectures = config.get("model_type"), config.get("architectures")
    family = hf_names.hf_family(model_type)
    if family is None or architectures not in (None, [hf_names.HF_ARCHITECTURES[family]]):
        known = " or ".join(f"model_type {hf_names.HF_MODEL_TYPES[name]!r} with architectures "
                            f"[{hf_names.HF_ARCHITECTURES[name]!r}]" for name in hf_names.HF_MODEL_TYPES)
        raise ValueError(
            f"{config_path} describes model_type {model_type!r} with architectures {architectures!r}: megacispo reads "
            f"MiniMax checkpoints as transformers saves them ({known}); pass one (for an original "
            f"MiniMax-Text-01 / M1 release, rewrite its config.json as a transformers MiniMaxConfig)."
        )
    return config


def hf_model_config(path: str | os.PathLike, *, rotary_dim: int | None = None) -> HybridModelConfig:
    """The model that the HF directory's config.json describes (``rotary_dim``: as
    hf_names.config_from_hf takes it); ValueError naming the file."""
    config = read_hf_config(path)
    try:
        return hf_names.config_from_hf(config, rotary_dim=rotary_dim)
    except (TypeError, ValueError) as error:
        # A missing field reaches config_from_hf as None: TypeError (layer_types) or a model.* ValueError.
        raise ValueError(f"{Path(path) / CONFIG_FILE} does not describe a MiniMax model ({error}): fix it or "
                         f"download it again.") from None


def dtype_name(dtype: torch.dtype) -> str:
    """The PARAMS_DTYPES name of ``dtype`` (as precision.params_dtype spells it)."""
    return next(name for name, value in PARAMS_DTYPES.items() if value == dtype)
