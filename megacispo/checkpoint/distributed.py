"""Checkpoints of a run: Megatron distributed checkpoints, written atomically, verified, resumable, reshardable.

One checkpoint is one directory ``root/step_{step:08d}``::

    <Megatron torch_dist files>   model and optimizer state by global tensor key: a checkpoint saved
                                  at one TP/PP/EP/DP layout loads at any other
    rng/rank_{r}.pt               rank r's RNG states (python, numpy, torch, Megatron's RNG tracker)
    meta.json                     step, world size, layout, extra_state (e.g. the sampler position),
                                  scheduler state, the resolved config, and the size of every other file

Everything is written into the sibling ``root/.tmp_step_{step:08d}`` first and flushed to disk;
meta.json is its last file, and the rename of the finished directory to ``step_*`` is the commit
(os.rename within one filesystem is atomic). A crash before the rename leaves only a ``.tmp_*``
directory, which is never read and which the next save removes. One run writes to a root at a time.

A checkpoint verifies (``verify_checkpoint``, before anything is built) when meta.json reads back,
every file it records is there with its recorded size, and the small files every rank reads
(Megatron's metadata.json and common.pt, torch DCP's .metadata) are intact and hold nothing that
would run code (megacispo.checkpoint.unpickling: loading a checkpoint unpickles nothing else).
Damage inside a shard shows when it loads: ``load_checkpoint`` reports it as a ``CheckpointError`` naming the file, on every rank alike, so a
resumed run can pass over that checkpoint to an older one.

The optimizer state uses the distributed optimizer's ``fully_reshardable`` format (per-parameter
tensors in model space, the way a plain optimizer stores them), so it reshards across TP/PP/DP too,
and across EP, which changes Megatron's chain of optimizers (``_state_for_chain``). A save gathers it
into the host memory of data-parallel rank 0 alone (of each model-parallel shard), which writes it: the
other data-parallel ranks hold their own shard only.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import pickle
import random
import re
import shutil
import warnings
import zipfile
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch
from torch.distributed.checkpoint.api import CheckpointException

from megacispo.checkpoint.formats import META_FILE, CheckpointError
from megacispo.checkpoint.unpickling import RefusedPickle, load_weights_only, read_dcp_metadata
from megacispo.files import flush_to_disk, fsync_path, publish_directory
from megacispo.models.config import ADAPTERS, ALL_WEIGHTS, BASE, M1, in_weights, is_adapter_parameter

# 2: meta.json records the size of every file of the checkpoint.
FORMAT_VERSION = 2
RNG_DIR = "rng"
TEMP_PREFIX = ".tmp_"
# Megatron's record of the checkpoint's format (JSON) and its non-sharded state (a torch.save archive):
# every rank reads both before the shards.
MEGATRON_CONFIG_FILE = "metadata.json"
MEGATRON_COMMON_FILE = "common.pt"
# torch DCP's index of the shards (a pickle: megacispo.checkpoint.unpickling reads it).
DCP_INDEX_FILE = ".metadata"
# The backends megacispo.checkpoint.dcp_load reads, as metadata.json names them.
MEGATRON_BACKENDS = {"sharded_backend": "torch_dist", "common_backend": "torch"}
_STEP_DIR = re.compile(r"step_(\d+)")
# The model fields that fix a checkpoint's tensor keys and shapes. The others (RoPE base, norm
# epsilons, residual factors, router top-k, ...) leave the tensors as they are, and a run may change them.
WEIGHT_FIELDS = ("family", "num_layers", "layer_pattern", "hidden_size", "num_attention_heads", "head_dim",
                 "num_query_groups", "num_experts", "moe_ffn_hidden_size", "vocab_size")
# A checkpoint saved before a field existed holds its default (every model then was MiniMax-M1).
WEIGHT_FIELD_DEFAULTS = {"family": M1}
# Megatron's distributed optimizer state format that reshards across every parallel dimension
# ('dp_reshardable', Megatron-LM's training default, reshards only across DP).
OPTIMIZER_SHARDING_TYPE = "fully_reshardable"


def refused_error(file: Path | str, refused: RefusedPickle) -> CheckpointError:
    """The CheckpointError for a pickle in ``file`` that megacispo.checkpoint.unpickling refused."""
    return CheckpointError(
        f"{file} is refused: loading it would call {refused.name}, and a checkpoint may hold only tensors, plain "
        f"values and torch DCP's index (nothing of it ran); load only checkpoints from a source you trust (README: "
        f"What a checkpoint may contain)")


def checkpoint_dir(root: str | os.PathLike, step: int) -> Path:
    """Where the checkpoint of ``step`` lives under ``root``."""
    return Path(root) / f"step_{step:08d}"


def sharded_metadata() -> dict[str, Any]:
    """What Megatron's ``sharded_state_dict`` methods are told about the format (a fresh dict per
    call: Megatron adds its data-parallel process group to it in place)."""
    return {
        "distrib_optim_sharding_type": OPTIMIZER_SHARDING_TYPE,
        "singleton_local_shards": False,
        # One key space for chained (dense + expert) optimizers: keys come from the parameters.
        "chained_optim_avoid_prefix": True,
        # On every device, gather the distributed optimizer's shards with gloo into DP rank 0's host
        # memory alone: the default all-gathers them with NCCL into every DP rank's host memory
        # (get_parameter_state_dp_zero, distrib_optimizer.py:1089 in 0.16.1), the whole optimizer state
        # of the rank's model-parallel shard on each (about 52 GB per rank at M1). Both variants load the
        # same way.
        "distrib_optim_fully_reshardable_mem_efficient": True,
    }


def _unwrap(model: torch.nn.Module) -> torch.nn.Module:
    """The MegatronModule inside DDP/FSDP/Float16 wrappers: the wrappers would prefix every key
    with ``module.``, so the same weights would get different keys with and without DDP."""
    # Megatron-Core on first use: the train dry run imports this module and must import none of it.
    from megatron.core.utils import unwrap_model

    module = unwrap_model(model)
    if not hasattr(module, "sharded_state_dict"):
        raise ValueError(
            f"model is a {type(module).__name__}, which has no sharded_state_dict(): pass a Megatron-Core "
            f"MegatronModule (or a DDP wrapper of one)."
        )
    return module


def _materialize_adam_state(optimizer) -> None:
    """Give a distributed optimizer that never stepped torch AdamW's initial state.

    Megatron-Core 0.16.1's ``DistributedOptimizer.state_dict()`` reads the ``step`` of every torch
    AdamW state (distrib_optimizer.py:640-642, the path without Apex or Transformer Engine), and its
    ``sharded_state_dict(is_loading=True)`` calls it: loading into a fresh optimizer fails there.
    The placeholder values are overwritten by the load.
    """
    # Megatron-Core on first use: the train dry run imports this module and must import none of it.
    from megatron.core.optimizer import distrib_optimizer

    if distrib_optimizer.HAVE_APEX_OR_TE:
        return
    for megatron_optimizer in getattr(optimizer, "chained_optimizers", [optimizer]):
        if not isinstance(megatron_optimizer, distrib_optimizer.DistributedOptimizer):
            continue
        inner = megatron_optimizer.optimizer
        if not isinstance(inner, (torch.optim.Adam, torch.optim.AdamW)):
            continue
        for group in inner.param_groups:
            for param in group["params"]:
                if not inner.state[param]:
                    inner.state[param] = {
                        # On the host, where torch AdamW keeps the step unless it is capturable or fused.
                        "step": torch.zeros((), dtype=torch.float32, device="cpu"),
                        "exp_avg": torch.zeros_like(param),
                        "exp_avg_sq": torch.zeros_like(param),
                    }


@contextlib.contextmanager
def _steps_set_aside(inner: torch.optim.Optimizer):
    """Remove torch AdamW's per-parameter ``step`` for the duration, then give every parameter
    its own copy back. Megatron's ``DistributedOptimizer.load_state_dict`` (distrib_optimizer.py:
    817-825, without Apex/TE) puts ONE step tensor into every parameter's state, and torch AdamW increments each
    parameter's step in place: shared, it would advance once per parameter per optimizer step."""
    steps = {param: state.pop("step") for param, state in inner.state.items() if "step" in state}
    try:
        yield
    finally:
        for param, step in steps.items():
            inner.state[param]["step"] = step.clone()


def _load_optimizer(optimizer, state: Any) -> None:
    """``optimizer.load_state_dict(state)``, loading each distributed optimizer's parameter state
    (main params, exp_avg, exp_avg_sq) in a second pass.

    Megatron-Core 0.16.1's ``DistributedOptimizer._set_main_param_and_optimizer_states``
    (distrib_optimizer.py:936-940) copies every key of the torch AdamW state, including the 0-dim
    ``step`` that the parameter state does not hold: KeyError 'step' whenever neither Apex nor
    Transformer Engine provides FusedAdam. The step itself comes from the param groups (first pass).

    A checkpoint saved by another chain of distributed optimizers (another EP, below) is first put
    into this run's chain (``_state_for_chain``).
    """
    # Megatron-Core on first use: the train dry run imports this module and must import none of it.
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    chained = getattr(optimizer, "chained_optimizers", None)
    current = [optimizer] if chained is None else chained
    if all(isinstance(sub, DistributedOptimizer) for sub in current):
        saved = _saved_chain(state)
        if not _chain_matches(saved, current):
            state = _state_for_chain(current, saved, state)
    elif _chain_length_differs(state, len(current)):
        raise CheckpointError(
            f"the checkpoint was saved by another chain of optimizers than the {len(current)} of this run "
            f"(Megatron gives the experts an optimizer of their own only at EP > 1): the plain optimizer's "
            f"state loads only at the expert-parallel size it was saved at; resume at that size (the "
            f"distributed optimizer's state loads at any)."
        )
    # Megatron's ChainedOptimizer keys its sub-states by optimizer index, except a chain of one.
    pairs = [(current[0], state)] if len(current) == 1 else [(sub, state[index]) for index, sub in enumerate(current)]
    param_states = []
    for megatron_optimizer, sub_state in pairs:
        if isinstance(megatron_optimizer, DistributedOptimizer) and "param_state" in sub_state:
            sharding_type = sub_state.pop("param_state_sharding_type")
            assert sharding_type == OPTIMIZER_SHARDING_TYPE, sharding_type
            param_states.append((megatron_optimizer, sub_state.pop("param_state")))
    optimizer.load_state_dict(state)
    for megatron_optimizer, param_state in param_states:
        with _steps_set_aside(megatron_optimizer.optimizer):
            megatron_optimizer.load_parameter_state_from_fully_reshardable(param_state)


# The chain of optimizers follows the layout: Megatron-Core 0.16.1's get_megatron_optimizer gives the
# parameters marked `allreduce = False` an optimizer of their own, and the experts are marked so only
# at EP > 1 (transformer/moe/experts.py). A checkpoint holds its tensors by parameter name, which
# every chain reads alike, but its non-tensor state (the param groups and the sharding type, in
# common.pt) per optimizer of the chain that saved it, and dist_checkpointing.load merges the two:
# resumed at another EP, the state is the saved chain's sub-states beside this chain's tensors
# ({0: ..., 1: ..., 'param_state': ...} for EP 2 -> 1).


def _saved_chain(state: dict) -> list[dict]:
    """The non-tensor state of each optimizer of the chain that saved ``state``: at the top for a
    chain of one, by optimizer index otherwise. Only the saved state has an 'optimizer' entry: this
    run's request contributes tensors ('param_state') alone."""
    if "optimizer" in state:
        return [state]
    return [state[key] for key in sorted(key for key in state if isinstance(key, int)) if "optimizer" in state[key]]


def _chain_length_differs(state: dict, length: int) -> bool:
    """Whether ``state`` (any optimizer format) was saved by a chain of another length than ``length``:
    a chain of one keeps its state at the top, a longer one by optimizer index only."""
    if length == 1:
        return any(isinstance(key, int) for key in state)
    return set(state) != set(range(length))


def _group_key(group: dict) -> tuple:
    # What Megatron's DistributedOptimizer.load_state_dict matches saved and current groups by.
    from megatron.core.optimizer.optimizer import param_group_identifier_keys

    return tuple(group.get(key) for key in param_group_identifier_keys)


def _chain_matches(saved: list[dict], current: list) -> bool:
    """Whether Megatron's own load applies: as many optimizers, and every param group of each
    found among the saved groups of the optimizer at its index."""
    if len(saved) != len(current):
        return False
    for sub_state, megatron_optimizer in zip(saved, current):
        saved_keys = {_group_key(group) for group in sub_state["optimizer"]["param_groups"]}
        if not {_group_key(group) for group in megatron_optimizer.param_groups} <= saved_keys:
            return False
    return True


def _saved_step(saved: list[dict]) -> Any:
    """The optimizer step of the saved chain: every param group of every optimizer records it
    (DistributedOptimizer.state_dict writes one step into each group, and a ChainedOptimizer steps its
    optimizers together)."""
    steps = {group["step"] for sub_state in saved for group in sub_state["optimizer"]["param_groups"]
             if "step" in group}
    if len(steps) != 1:
        raise CheckpointError(f"the checkpoint's optimizers record the steps {sorted(steps)}, one step expected: "
                              f"load it at the expert-parallel layout it was saved at.")
    return steps.pop()


def _state_for_chain(current: list, saved: list[dict], state: dict) -> dict:
    """``state`` in this run's chain: each optimizer's tensors as loaded (by parameter name, whichever
    optimizer saved them), and its own param groups with the saved step, the one piece of state that
    the groups hold.

    The saved groups are not carried over: they record no parameters, so which of this chain's
    parameters each one held cannot be told (EP 1 saves the experts with the dense parameters). The
    rest of a group is the run's configuration: the learning rate and weight decay, which the scheduler
    sets at its load and at every step, and the multipliers, LR bounds, betas, eps and torch's
    implementation flags, which Megatron set from the optimizer config and the model when it built the
    optimizer, as it did for this run's. A run that changed them keeps its own here (Megatron's load,
    on an unchanged chain, takes the saved ones)."""
    step = _saved_step(saved)
    sub_states = []
    for index, megatron_optimizer in enumerate(current):
        tensors = state if len(current) == 1 else state[index]
        # state_dict(): this optimizer's param groups without parameters (its grad scaler, with fp16).
        own = megatron_optimizer.state_dict()
        for group in own["optimizer"]["param_groups"]:
            group["step"] = step
        sub_states.append({**own, "param_state_sharding_type": OPTIMIZER_SHARDING_TYPE,
                           "param_state": tensors["param_state"]})
    return sub_states[0] if len(sub_states) == 1 else dict(enumerate(sub_states))


# A LoRA run's checkpoint records in its extra_state, under this key, the base its adapters were trained on:
# {"train.load": path, "fingerprint": models.lora.base_fingerprint}.
LORA_BASE_STATE = "lora_base"


def recorded_lora_base(meta: dict) -> str | None:
    """The train.load of the run that saved a LoRA checkpoint: the base its adapters were trained on."""
    return ((meta.get("extra_state") or {}).get(LORA_BASE_STATE) or {}).get("train.load")


def adapter_rank_of(meta: dict) -> int:
    """The lora.rank of a checkpoint's run: above 0, the checkpoint holds its adapters alone, whose
    base is that run's train.load."""
    return ((meta.get("config") or {}).get("lora") or {}).get("rank", 0)


def _has_adapters(model: torch.nn.Module) -> bool:
    return any(is_adapter_parameter(name) for name, _ in _unwrap(model).named_parameters())


def _weights_to_load(path: Path, meta: dict, model: torch.nn.Module, optimizer) -> str:
    """What of ``model`` the checkpoint at ``path`` fills (a part of models.config's): every weight, a LoRA
    run's adapters (saved alone; loaded over the base the caller loaded), or a LoRA model's base (a full
    checkpoint, loaded without its optimizer state)."""
    rank, adapted = adapter_rank_of(meta), _has_adapters(model)
    if rank and not adapted:
        raise CheckpointError(f"{path} holds LoRA adapters alone (lora.rank = {rank}), not a whole model: load it "
                              f"over its base, with lora.rank={rank} and train.load set to the base it was trained on")
    if rank:
        return ADAPTERS
    if adapted and optimizer is not None:
        raise CheckpointError(f"{path} holds a whole model: a LoRA run loads it as its base (train.load), without "
                              f"its optimizer state; resume it with lora.rank=0")
    return BASE if adapted else ALL_WEIGHTS


def _sharded_state_dict(model: torch.nn.Module, optimizer, is_loading: bool, weights: str = ALL_WEIGHTS) -> dict:
    metadata = sharded_metadata()
    model_state = _unwrap(model).sharded_state_dict(metadata=metadata)
    model_state = {key: value for key, value in model_state.items() if in_weights(key, weights)}
    state = {"model": model_state}
    if optimizer is not None:
        if is_loading:
            _materialize_adam_state(optimizer)
        # The optimizer maps its states onto the model's sharding: same tensors, "optimizer." keys.
        state["optimizer"] = optimizer.sharded_state_dict(model_state, is_loading=is_loading, metadata=metadata)
        _drop_absent_param_states(state["optimizer"])
    return state


def _drop_absent_param_states(optimizer_state: dict) -> None:
    """Remove the ``param_state: None`` that the distributed optimizer leaves on data-parallel ranks
    other than 0, where it gathers on DP rank 0 alone (distrib_optim_fully_reshardable_mem_efficient,
    sharded_metadata): rank 0's gathered state is sharded tensors, which leave the common
    state, so the None alone would make the ranks' common states differ and Megatron's
    ``_validate_common_state_dict`` (dist_checkpointing/validation.py) warn at every save. Only rank
    0's common state is written, so the checkpoint does not change."""
    sub_states = [optimizer_state, *(value for key, value in optimizer_state.items() if isinstance(key, int))]
    for sub_state in sub_states:
        if isinstance(sub_state, dict) and "param_state" in sub_state and sub_state["param_state"] is None:
            del sub_state["param_state"]


def parallel_layout() -> dict[str, int]:
    """This process's Megatron-Core parallel layout, as recorded in meta.json."""
    # Megatron-Core on first use: the train dry run imports this module and must import none of it.
    from megatron.core import parallel_state

    return {
        "tensor_model_parallel_size": parallel_state.get_tensor_model_parallel_world_size(),
        "pipeline_model_parallel_size": parallel_state.get_pipeline_model_parallel_world_size(),
        "expert_model_parallel_size": parallel_state.get_expert_model_parallel_world_size(),
        "expert_tensor_parallel_size": parallel_state.get_expert_tensor_parallel_world_size(),
        "context_parallel_size": parallel_state.get_context_parallel_world_size(),
        "data_parallel_size": parallel_state.get_data_parallel_world_size(),
    }


def _rank() -> int:
    return torch.distributed.get_rank() if torch.distributed.is_initialized() else 0


def _world_size() -> int:
    return torch.distributed.get_world_size() if torch.distributed.is_initialized() else 1


def _barrier() -> None:
    if torch.distributed.is_initialized():
        torch.distributed.barrier()


def _json_checked(name: str, value: Any) -> Any:
    try:
        json.dumps(value)
    except (TypeError, ValueError) as error:
        raise ValueError(
            f"{name} must be plain JSON (dicts, lists, str, int, float, bool, None); "
            f"json.dumps failed with: {error}. Convert the offending values (e.g. tensors with .item(), "
            f"paths with str())."
        ) from error
    return value


# ---------------------------------------------------------------------------------------------
# RNG states (rank-local)
# ---------------------------------------------------------------------------------------------


def capture_rng() -> dict[str, Any]:
    """This rank's RNG states as tensors and plain containers (loadable with weights_only=True)."""
    # Megatron-Core on first use: the train dry run imports this module and must import none of it.
    from megatron.core import tensor_parallel

    key, pos, has_gauss, cached_gaussian = np.random.get_state(legacy=True)[1:]
    state = {
        "python": random.getstate(),
        "numpy": {
            "key": torch.from_numpy(key.astype(np.int64)),
            "pos": int(pos),
            "has_gauss": int(has_gauss),
            "cached_gaussian": float(cached_gaussian),
        },
        "torch": torch.get_rng_state(),
        # Megatron's named generators (model-parallel RNG for dropout and init in TP regions).
        "tracker": tensor_parallel.get_cuda_rng_tracker().get_states(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def restore_rng(state: dict[str, Any]) -> None:
    """Set this rank's RNG states to ``capture_rng``'s."""
    # Megatron-Core on first use: the train dry run imports this module and must import none of it.
    from megatron.core import tensor_parallel

    version, internal, gauss_next = state["python"]
    random.setstate((version, tuple(internal), gauss_next))
    numpy_state = state["numpy"]
    np.random.set_state((
        "MT19937",
        numpy_state["key"].numpy().astype(np.uint32),
        numpy_state["pos"],
        numpy_state["has_gauss"],
        numpy_state["cached_gaussian"],
    ))
    torch.set_rng_state(state["torch"])
    tensor_parallel.get_cuda_rng_tracker().set_states(state["tracker"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


def _rng_file(directory: Path, rank: int) -> Path:
    return directory / RNG_DIR / f"rank_{rank}.pt"


# ---------------------------------------------------------------------------------------------
# Save
# ---------------------------------------------------------------------------------------------


def save_checkpoint(
    root: str | os.PathLike,
    step: int,
    model: torch.nn.Module,
    optimizer=None,
    scheduler=None,
    extra_state: dict | None = None,
    config_dict: dict | None = None,
    keep_last: int | None = 2,
) -> Path:
    """Write the checkpoint of ``step`` under ``root``; call on every rank. Returns its directory.

    ``optimizer`` is a Megatron optimizer (plain or distributed), ``scheduler`` Megatron's
    OptimizerParamScheduler, ``extra_state`` plain JSON that the caller wants back on resume (the
    data sampler position, counters), ``config_dict`` the resolved run config. The newest
    ``keep_last`` complete checkpoints are kept (None: all).
    """
    if step < 0:
        raise ValueError(f"step = {step}: checkpoint steps are non-negative.")
    if keep_last is not None and keep_last < 1:
        raise ValueError(f"keep_last = {keep_last}: keep at least 1 checkpoint, or pass None to keep all.")
    extra_state = _json_checked("extra_state", extra_state or {})
    config_dict = _json_checked("config_dict", config_dict)
    meta = checkpoint_meta(step, has_optimizer=optimizer is not None,
                           scheduler_state=scheduler.state_dict() if scheduler is not None else None,
                           extra_state=extra_state, config_dict=config_dict)
    # Built before anything is written: it checks the model, and the distributed optimizer
    # gathers its state here (a collective on every rank).
    sharded_state = _sharded_state_dict(model, optimizer, is_loading=False,
                                        weights=ADAPTERS if _has_adapters(model) else ALL_WEIGHTS)
    root = Path(root)
    final = checkpoint_dir(root, step)
    temporary = root / f"{TEMP_PREFIX}{final.name}"
    rank = _rank()
    if rank == 0:
        root.mkdir(parents=True, exist_ok=True)
        remove_temporaries(root)
        temporary.mkdir()
    _barrier()

    try:
        _write_files(sharded_state, temporary, rank)
        if rank == 0:
            write_meta(temporary, meta)
    except BaseException as error:
        # What the save wrote is never read, and may be what filled the disk.
        shutil.rmtree(temporary, ignore_errors=True)
        if isinstance(error, (OSError, RuntimeError, CheckpointException)):
            raise _save_error(step, temporary, error) from None
        raise
    if rank == 0:
        publish_directory(temporary, final, TEMP_PREFIX)
        if keep_last is not None:
            _prune(root, keep_last)
    _barrier()
    return final


def _write_files(sharded_state: dict[str, Any], temporary: Path, rank: int) -> None:
    # Megatron-Core on first use: the train dry run imports this module and must import none of it.
    from megatron.core import dist_checkpointing

    # Into an empty directory: Megatron warns about overwriting a corrupted checkpoint otherwise.
    dist_checkpointing.save(sharded_state, str(temporary))
    (temporary / RNG_DIR).mkdir(exist_ok=True)
    with open(_rng_file(temporary, rank), "wb") as file:
        torch.save(capture_rng(), file)
        flush_to_disk(file)
    _barrier()


# Below this much space left, a failed write is taken for a full disk: torch.save's writer reports one
# as "unexpected pos" (inline_container.cc), without the errno.
_FULL_DISK_BYTES = 16 * 1024**2


def _save_error(step: int, temporary: Path, error: BaseException) -> CheckpointError:
    """The CheckpointError of a save that failed: a full disk named as such (by errno, or by the space
    left where torch's writer gives no errno), anything else by its first line."""
    usage = shutil.disk_usage(temporary.parent)
    full = getattr(error, "errno", None) == errno.ENOSPC or usage.free < _FULL_DISK_BYTES
    if full:
        problem = f"No space left on device ({usage.free / 1024**2:.0f} MiB free of {usage.total / 1024**3:.1f} GiB)"
        fix = "free space there, or set train.run_dir on a larger disk, then continue with --resume"
    else:
        failures = getattr(error, "failures", None)
        cause = next(iter(failures.values()))[0] if failures else error
        problem = f"{type(cause).__name__}: {str(cause).strip().splitlines()[0] if str(cause).strip() else ''}"
        fix = "fix the cause, then continue with --resume"
    return CheckpointError(f"saving step {step} under {temporary.parent} failed: {problem}; its partial files were "
                           f"removed: {fix}")


def checkpoint_meta(step: int, *, has_optimizer: bool, scheduler_state: dict | None, extra_state: dict,
                    config_dict: dict | None) -> dict[str, Any]:
    """The contents of a checkpoint's meta.json (also written by megacispo.checkpoint.to_megatron)."""
    return {
        "format_version": FORMAT_VERSION,
        "step": step,
        "world_size": _world_size(),
        "parallel": parallel_layout(),
        "has_optimizer": has_optimizer,
        "optimizer_sharding_type": OPTIMIZER_SHARDING_TYPE,
        "scheduler": scheduler_state,
        "extra_state": extra_state,
        "config": config_dict,
    }


def write_meta(directory: Path, meta: dict) -> None:
    """meta.json, written last: its presence marks a complete checkpoint, and it records the size of
    every other file, each flushed to disk first (Megatron does not flush its common.pt and
    metadata.json), so that a checkpoint that verifies survives a crash of the machine."""
    files = {}
    for path in sorted(directory.rglob("*")):
        if path.is_file():
            fsync_path(path)
            files[path.relative_to(directory).as_posix()] = path.stat().st_size
    with open(directory / META_FILE, "w") as file:
        json.dump({**meta, "files": files}, file, indent=2)
        flush_to_disk(file)


def _prune(root: Path, keep_last: int) -> None:
    """Delete the checkpoints older than the newest ``keep_last`` that verify. Damaged ones do not
    count (a damaged newer one must not cost the last good one) and are left to be looked at."""
    for old in complete_checkpoints(root)[:-keep_last]:
        # Renamed before deletion, so an interrupted delete never leaves a half-deleted step_*.
        doomed = old.with_name(f"{TEMP_PREFIX}deleting_{old.name}")
        os.rename(old, doomed)
        shutil.rmtree(doomed)


def remove_temporaries(root: str | os.PathLike) -> list[Path]:
    """Delete what interrupted saves left under ``root`` (``.tmp_*`` directories). Only safe while
    no save to ``root`` is in progress; ``save_checkpoint`` calls it on rank 0 before writing."""
    removed = [path for path in Path(root).iterdir() if path.name.startswith(TEMP_PREFIX) and path.is_dir()]
    for path in removed:
        shutil.rmtree(path)
    return removed


# ---------------------------------------------------------------------------------------------
# Find and load
# ---------------------------------------------------------------------------------------------


def _step_of(path: Path) -> int | None:
    match = _STEP_DIR.fullmatch(path.name)
    return int(match.group(1)) if match else None


def find_checkpoints(root: str | os.PathLike) -> dict[Path, str | None]:
    """Every ``step_*`` directory under ``root``, oldest first, with why it does not verify (None when
    it does). Interrupted saves (``.tmp_*``) are not looked at."""
    root = Path(root)
    steps = sorted((path for path in root.iterdir() if path.is_dir() and _step_of(path) is not None),
                   key=_step_of) if root.is_dir() else []
    return {path: _problem(path) for path in steps}


def _problem(path: Path) -> str | None:
    try:
        verify_checkpoint(path)
    except CheckpointError as error:
        return str(error)
    return None


def complete_checkpoints(root: str | os.PathLike) -> list[Path]:
    """The checkpoints under ``root`` that verify, oldest first."""
    return [path for path, problem in find_checkpoints(root).items() if problem is None]


def latest_checkpoint(root: str | os.PathLike) -> Path | None:
    """The newest checkpoint under ``root`` that verifies, or None."""
    verified = complete_checkpoints(root)
    return verified[-1] if verified else None


def resolve_checkpoint(path: str | os.PathLike) -> Path:
    """The checkpoint ``path`` names: a step directory (``step_*``, or any directory with a meta.json),
    which must verify, or else the newest checkpoint under ``path`` that verifies. CheckpointError
    naming the file and the fix otherwise."""
    path = Path(path)
    if not path.is_dir():
        raise CheckpointError(f"{path} does not exist: pass a step_* checkpoint directory or the directory holding "
                              f"them.")
    if _step_of(path) is not None or (path / META_FILE).is_file():
        try:
            verify_checkpoint(path)
        except CheckpointError as error:
            raise CheckpointError(f"{error}; pass another checkpoint, or the directory holding them to take the newest "
                                  f"one that verifies.") from None
        return path
    found = find_checkpoints(path)
    verified = [step_dir for step_dir, problem in found.items() if problem is None]
    if verified:
        return verified[-1]
    if found:
        problems = "; ".join(f"{step_dir.name}: {problem}" for step_dir, problem in found.items())
        raise CheckpointError(f"no checkpoint under {path} verifies ({problems}): pass another checkpoint.")
    raise CheckpointError(f"{path} is not a checkpoint (no {META_FILE}) and holds no step_* checkpoint: pass a "
                          f"step_* checkpoint directory or the directory holding them.")


def params_dtype_of(meta: dict) -> str:
    """The dtype name of a checkpoint's weights (``float32`` | ``bfloat16``): its run's
    ``precision.params_dtype``, as meta.json records the run's config."""
    return meta.get("config", {}).get("precision", {}).get("params_dtype", "float32")


def read_meta(path: str | os.PathLike) -> dict[str, Any]:
    """A checkpoint's meta.json; CheckpointError naming the path when ``path`` is not a checkpoint."""
    path = Path(path)
    meta_path = path / META_FILE
    if not meta_path.is_file():
        raise CheckpointError(
            f"{path} is not a megacispo checkpoint: it has no {META_FILE} (an interrupted save leaves a "
            f"{TEMP_PREFIX}step_* directory without one)."
        )
    try:
        meta = json.loads(meta_path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise CheckpointError(f"{meta_path} is not valid JSON ({error}): the checkpoint is damaged.") from None
    if not isinstance(meta, dict) or meta.get("format_version") != FORMAT_VERSION:
        version = meta.get("format_version") if isinstance(meta, dict) else None
        raise CheckpointError(
            f"{meta_path} has format_version {version!r}; this megacispo reads version {FORMAT_VERSION} "
            f"(which records the size of every file): save or convert the checkpoint again."
        )
    return meta


def verify_checkpoint(path: str | os.PathLike) -> dict[str, Any]:
    """The meta.json of the step directory ``path``, once the checkpoint verifies: every file meta.json
    records is there with its recorded size, and Megatron's metadata.json and common.pt read back.
    CheckpointError naming the first file that fails. Reads no shard: damage inside one shows when it
    loads (``load_checkpoint``)."""
    path = Path(path)
    meta = read_meta(path)
    for name, size in meta["files"].items():
        file = path / name
        if not file.is_file():
            raise CheckpointError(f"{file} is missing: the checkpoint is damaged")
        if file.stat().st_size != size:
            raise CheckpointError(f"{file} has {file.stat().st_size} bytes, {size} when it was saved: the checkpoint "
                                  f"is damaged")
    _check_megatron_files(path)
    return meta


def _check_megatron_files(path: Path) -> None:
    """Megatron's metadata.json, common.pt and torch DCP's index read back, the two pickles as
    megacispo.checkpoint.unpickling allows. Every rank reads them before the shards: checked here,
    their damage, or code planted in them, is found before anything is built, like a missing file."""
    config = path / MEGATRON_CONFIG_FILE
    try:
        backends = json.loads(config.read_text())
    except ValueError as error:  # not JSON, or not UTF-8
        raise CheckpointError(f"{config} does not read back ({error}): the checkpoint is damaged") from None
    found = {key: backends.get(key) for key in MEGATRON_BACKENDS} if isinstance(backends, dict) else backends
    if found != MEGATRON_BACKENDS:
        raise CheckpointError(f"{config} records {found}; megacispo loads Megatron checkpoints saved as "
                              f"{MEGATRON_BACKENDS} (dist_checkpointing.save's default): save it again in that format")
    _check_archive(path / MEGATRON_COMMON_FILE)
    _unpickle_checked(path / DCP_INDEX_FILE, read_dcp_metadata)


def _unpickle_checked(file: Path, read: Callable[[Path], Any]) -> None:
    """``read(file)``: a refused pickle or a damaged one reported as a CheckpointError naming ``file``."""
    try:
        read(file)
    except RefusedPickle as refused:
        raise refused_error(file, refused) from None
    except Exception as error:  # noqa: BLE001 - whatever a damaged pickle raises, it is reported as damage
        raise CheckpointError(f"{file} does not read back ({type(error).__name__}): the checkpoint is "
                              f"damaged") from None


def _check_archive(common: Path) -> None:
    """common.pt is intact and holds only what torch's weights-only unpickler reads."""
    try:
        with zipfile.ZipFile(common) as archive:
            # torch.save writes a zip archive with CRC-32 checksums, which torch.load does not check.
            damaged_member = archive.testzip()
    except zipfile.BadZipFile as error:
        damaged_member = str(error)
    if damaged_member:
        raise CheckpointError(f"{common} is not the archive torch.save wrote ({damaged_member}): the checkpoint "
                              f"is damaged")
    _unpickle_checked(common, load_weights_only)


def check_model(path: str | os.PathLike, model) -> None:
    """CheckpointError when the checkpoint at ``path`` holds another model than ``model`` (a run
    config's model section): a field of WEIGHT_FIELDS differs, so its tensors would not fit."""
    meta_path = Path(path) / META_FILE
    saved = (read_meta(path).get("config") or {}).get("model")
    if saved is None:
        raise CheckpointError(f"{meta_path} records no config.model: load a checkpoint that megacispo saved or "
                              f"converted.")
    saved = {**WEIGHT_FIELD_DEFAULTS, **saved}
    differing = [name for name in WEIGHT_FIELDS if saved.get(name) != getattr(model, name)]
    if differing:
        values = ", ".join(f"model.{name} = {getattr(model, name)!r} (checkpoint: {saved.get(name)!r})"
                           for name in differing)
        sets = " ".join(f"--set model.{name}={saved.get(name)}" for name in differing)
        raise CheckpointError(f"{meta_path} holds another model: {values}; load a checkpoint of the configured "
                              f"model, or configure the checkpoint's: {sets}")


def weights_checkpoint(field: str, path: str | os.PathLike, model) -> Path:
    """The checkpoint that the config field ``field`` (e.g. train.load) = ``path`` names
    (``resolve_checkpoint``), holding ``model``; CheckpointError naming the field, the file and the fix."""
    try:
        checkpoint = resolve_checkpoint(path)
        check_model(checkpoint, model)
    except CheckpointError as error:
        raise CheckpointError(f"{field}: {error}") from None
    return checkpoint


def load_checkpoint(
    path: str | os.PathLike,
    model: torch.nn.Module,
    optimizer=None,
    scheduler=None,
    load_rng: bool = True,
) -> dict[str, Any]:
    """Load a checkpoint into ``model`` (and ``optimizer``, ``scheduler``); call on every rank.

    Any parallel layout loads any checkpoint. The RNG states are restored only where the world size
    and layout equal the saved ones (a different layout gives every rank a different role); otherwise
    a warning says they were skipped. A checkpoint that does not verify, or a file that does not read
    back, raises the same CheckpointError on every rank (on rank 0 it names the damaged file).
    Returns meta.json's content: ``step``, ``extra_state``, ``config``, ``parallel``, ``world_size``
    (as JSON reads them back: tuples become lists, dict keys strings).
    """
    path = Path(path)
    meta = verify_checkpoint(path)
    if optimizer is not None and not meta["has_optimizer"]:
        raise ValueError(f"{path} holds no optimizer state (saved without one): load it with optimizer=None.")
    if scheduler is not None and meta["scheduler"] is None:
        raise ValueError(f"{path} holds no scheduler state (saved without one): load it with scheduler=None.")
    same_layout = meta["world_size"] == _world_size() and meta["parallel"] == parallel_layout()
    rng_state = _read_rng(path) if load_rng and same_layout else None

    weights = _weights_to_load(path, meta, model, optimizer)
    loaded = _read_shards(path, _sharded_state_dict(model, optimizer, is_loading=True, weights=weights))
    # Megatron-Core on first use: the train dry run imports this module and must import none of it.
    from megacispo.checkpoint import dcp_load

    # Each rank holds its own piece of the weights: they agree before any rank goes on.
    _raise_agreed(dcp_load.non_finite_weight(loaded["model"], path))
    missing, unexpected = _unwrap(model).load_state_dict(loaded["model"], strict=weights == ALL_WEIGHTS)
    # Loading a part: what stays unloaded is the other part (checked, as strict checks a whole load).
    left = [key for key in missing if in_weights(key, weights)]
    if left or unexpected:
        raise CheckpointError(f"{path}: the model's {weights} weights and the checkpoint's differ: missing "
                              f"{left[:3]}, unexpected {unexpected[:3]}")
    if optimizer is not None:
        _load_optimizer(optimizer, loaded["optimizer"])
    if scheduler is not None:
        scheduler.load_state_dict(meta["scheduler"])
    if rng_state is not None:
        restore_rng(rng_state)
    elif load_rng:
        warnings.warn(
            f"RNG states of {path} not restored: saved with world size {meta['world_size']} and layout "
            f"{meta['parallel']}, this run has world size {_world_size()} and layout {parallel_layout()}. "
            f"The run continues with its current RNG states.",
            stacklevel=2,
        )
    return meta


def _read_rng(path: Path) -> dict[str, Any]:
    """This rank's RNG states. Each rank reads a file of its own, so the ranks agree on failure before
    the load's collectives: one rank failing alone would leave the others waiting in them."""
    rng_file = _rng_file(path, _rank())
    try:
        state, failure = load_weights_only(rng_file), None
    except RefusedPickle as refused:
        state, failure = None, str(refused_error(rng_file, refused))
    except Exception as error:  # noqa: BLE001 - whatever a damaged file raises, it is reported as damage
        state, failure = None, f"{rng_file} does not read back ({type(error).__name__}): the checkpoint is damaged"
    _raise_agreed(failure)
    return state


def _raise_agreed(failure: str | None) -> None:
    """CheckpointError on every rank when any rank has a ``failure`` (the first rank's, which rank 0 prints)."""
    failures = [failure]
    if torch.distributed.is_initialized():
        failures = [None] * _world_size()
        torch.distributed.all_gather_object(failures, failure)
    first = next((text for text in failures if text), None)
    if first:
        raise CheckpointError(first)


def _read_shards(path: Path, sharded_state: dict[str, Any]) -> dict[str, Any]:
    """megacispo.checkpoint.dcp_load's load, a shard that does not read back, or a pickle refused,
    reported as a CheckpointError. torch DCP gathers the failures of the ranks' readers and raises
    them on every rank, so every rank raises it; rank 0, which prints it, names the damaged file."""
    # Megatron-Core on first use: the train dry run imports this module and must import none of it.
    from megacispo.checkpoint import dcp_load

    try:
        return dcp_load.load(sharded_state, path)
    except RefusedPickle as refused:  # common.pt, read by every rank alike
        raise refused_error(path / MEGATRON_COMMON_FILE, refused) from None
    except CheckpointException as error:  # a BaseException, which `except Exception` would let through
        failure = next(iter(error.failures.values()))[0]
        if isinstance(failure, dcp_load.RefusedRecord):
            raise refused_error(path / failure.where, failure) from None
        if isinstance(failure, RefusedPickle):
            raise refused_error(path / DCP_INDEX_FILE, failure) from None
        damaged = _damaged_record(path) if _rank() == 0 else None
        if damaged:
            raise CheckpointError(f"{damaged} does not load ({type(failure).__name__}): the checkpoint is "
                                  f"damaged; use another one") from None
        # torch.load's weights-only unpickler explains its failure as advice to load the file with
        # weights_only=False: wrong for a damaged file, so only its type is given.
        detail = "" if isinstance(failure, pickle.UnpicklingError) else f": {str(failure).splitlines()[0]}"
        raise CheckpointError(f"{path} does not load ({type(failure).__name__}{detail})") from None


# How torch.save lays out each record of a torch_dist shard file: a zip archive, from a local file header
# to the 22-byte end-of-central-directory record (no archive comment).
_ZIP_LOCAL_HEADER = b"PK\x03\x04"
_ZIP_END_RECORD = b"PK\x05\x06"
_ZIP_END_RECORD_SIZE = 22


def _damaged_record(path: Path) -> str | None:
    """The first record of the shard files under ``path`` that does not begin and end as torch.save
    writes one, as '<file> at byte <offset>'; None when all do. Reads 8 bytes per record: it finds a
    record zeroed or overwritten at either end, not damage confined to a tensor's bytes."""

    try:
        # The reading of the index that the failed load has just done.
        records = read_dcp_metadata(path / DCP_INDEX_FILE).storage_data.values()
    except Exception:  # noqa: BLE001 - the index itself is damaged
        return str(path / DCP_INDEX_FILE)
    for record in sorted(records, key=lambda record: (record.relative_path, record.offset)):
        shard = path / record.relative_path
        with open(shard, "rb") as file:
            file.seek(record.offset)
            head = file.read(len(_ZIP_LOCAL_HEADER))
            file.seek(record.offset + record.length - _ZIP_END_RECORD_SIZE)
            tail = file.read(len(_ZIP_END_RECORD))
        if (head, tail) != (_ZIP_LOCAL_HEADER, _ZIP_END_RECORD):
            return f"{shard} at byte {record.offset}"
    return None
