"""Whole-model views of a megacispo checkpoint for tests and benchmarks on small models: the model
loaded in one process, and its tensors under the layout-independent checkpoint keys."""

from __future__ import annotations

import os

import torch

from megacispo.checkpoint.distributed import load_checkpoint, params_dtype_of, read_meta, resolve_checkpoint
from megacispo.checkpoint.to_megatron import single_process_model
from megacispo.models.config import PARAMS_DTYPES, HybridModelConfig
from megacispo.rollout.weight_sync import parameter_slots


def load_single_process(ckpt: str | os.PathLike):
    """(model, config, meta) of a megacispo checkpoint (step dir or checkpoints root) in one
    process, loaded with megacispo.checkpoint.distributed.load_checkpoint. Holds the whole model."""

    step_dir = resolve_checkpoint(ckpt)
    meta = read_meta(step_dir)
    if not meta.get("config") or "model" not in meta["config"]:
        raise ValueError(f"{step_dir}/meta.json has no config.model: this checkpoint cannot be converted.")
    config = HybridModelConfig(**meta["config"]["model"])
    params_dtype = PARAMS_DTYPES[params_dtype_of(meta)]
    model = single_process_model(config, params_dtype)
    load_checkpoint(step_dir, model, load_rng=False)
    return model, config, meta


def full_tensors(model) -> dict[str, torch.Tensor]:
    """The single-process model's tensors under our checkpoint keys (experts stacked [E, ...])."""
    return {
        key: pieces[0][1].detach() if pieces[0][0] is None
        else torch.stack([tensor.detach() for _, tensor in sorted(pieces, key=lambda piece: piece[0])])
        for key, pieces in parameter_slots(model).items()
    }


def _plain_model_tensors(checkpoint: str) -> dict[str, torch.Tensor]:
    from megatron.core.dist_checkpointing import load_plain_tensors

    torch.distributed.init_process_group("gloo")
    return {key: value for key, value in load_plain_tensors(checkpoint).items()
            if isinstance(value, torch.Tensor) and not key.startswith("optimizer.")}


def checkpoint_tensors(checkpoint: str | os.PathLike) -> dict[str, torch.Tensor]:
    """The model tensors a checkpoint holds, whole, by key (read in a process of its own: dist_checkpointing
    reads inside a process group)."""
    from megacispo.testing.harness import run_distributed

    (tensors,) = run_distributed(_plain_model_tensors, 1, str(checkpoint))
    return tensors
