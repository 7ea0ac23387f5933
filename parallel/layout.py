"""The parallel layout: its config, its validation, and the start-up of torch.distributed and
Megatron-Core's model-parallel state from torchrun's environment."""

from __future__ import annotations

import datetime
import importlib
import os
from dataclasses import dataclass

import torch


@dataclass(kw_only=True)
class ParallelConfig:
    """How the model and the data are split across processes."""

    tensor_model_parallel_size: int = 1
    """TP: attention heads, expert FFNs and the vocabulary are split across this many ranks."""
    pipeline_model_parallel_size: int = 1
    """PP: the decoder layers are split into this many consecutive stages."""
    expert_model_parallel_size: int = 1
    """EP: the experts of every MoE layer are distributed over this many ranks."""
    expert_tensor_parallel_size: int | None = None
    """TP inside each expert; None means the same as tensor_model_parallel_size."""
    sequence_parallel: bool = False
    """Shard norms, residuals and dropout along the sequence across the TP group (needs TP > 1)."""
    distributed_timeout_minutes: int = 30
    """A collective that waits longer than this fails instead of hanging."""

    @property
    def expert_tp(self) -> int:
        return self.expert_tensor_parallel_size or self.tensor_model_parallel_size

    def data_parallel_size(self, world_size: int) -> int:
        return world_size // (self.tensor_model_parallel_size * self.pipeline_model_parallel_size)


@dataclass(frozen=True)
class ModelShape:
    """The model dimensions that a layout must divide."""

    num_layers: int
    num_attention_heads: int
    num_query_groups: int
    num_experts: int | None


def validate_layout(parallel: ParallelConfig, world_size: int, shape: ModelShape) -> None:
    """Raise ValueError naming the numbers and the fix if ``parallel`` cannot split ``shape`` over
    ``world_size`` processes. Called at start-up, before any process group or model exists."""
    tp = parallel.tensor_model_parallel_size
    pp = parallel.pipeline_model_parallel_size
    ep = parallel.expert_model_parallel_size
    etp = parallel.expert_tp
    for field, size in (
        ("tensor_model_parallel_size", tp),
        ("pipeline_model_parallel_size", pp),
        ("expert_model_parallel_size", ep),
        ("expert_tensor_parallel_size", etp),
    ):
        if size < 1:
            raise ValueError(f"parallel.{field} = {size}: it must be at least 1.")
    if world_size % (tp * pp):
        raise ValueError(
            f"world size {world_size} is not divisible by tensor_model_parallel_size * "
            f"pipeline_model_parallel_size = {tp} * {pp} = {tp * pp}: launch a multiple of {tp * pp} "
            f"processes or change TP/PP."
        )
    if world_size % (etp * ep * pp):
        raise ValueError(
            f"world size {world_size} is not divisible by expert_tensor_parallel_size * "
            f"expert_model_parallel_size * pipeline_model_parallel_size = {etp} * {ep} * {pp} = "
            f"{etp * ep * pp}: launch a multiple of {etp * ep * pp} processes or lower EP."
        )
    if shape.num_layers % pp:
        raise ValueError(
            f"model.num_layers = {shape.num_layers} is not divisible by pipeline_model_parallel_size = "
            f"{pp}: choose a PP size that divides the layer count."
        )
    if shape.num_attention_heads % tp:
        raise ValueError(
            f"model.num_attention_heads = {shape.num_attention_heads} is not divisible by "
            f"tensor_model_parallel_size = {tp}: choose a TP size that divides the head count."
        )
    if shape.num_query_groups % tp:
        raise ValueError(
            f"model.num_query_groups = {shape.num_query_groups} (KV heads) is not divisible by "
            f"tensor_model_parallel_size = {tp}: choose a TP size that divides the KV head count."
        )
    if ep > 1 and not shape.num_experts:
        raise ValueError(
            f"parallel.expert_model_parallel_size = {ep} but the model has no experts: set it to 1."
        )
    if shape.num_experts and shape.num_experts % ep:
        raise ValueError(
            f"model.num_experts = {shape.num_experts} is not divisible by expert_model_parallel_size = "
            f"{ep}: choose an EP size that divides the expert count."
        )
    if shape.num_experts and tp > 1 and not parallel.sequence_parallel:
        raise ValueError(
            f"tensor_model_parallel_size = {tp} with {shape.num_experts} experts needs "
            "parallel.sequence_parallel = true: Megatron-Core's MoE layer refuses to train under TP without it."
        )
    if parallel.sequence_parallel and tp == 1:
        raise ValueError(
            "parallel.sequence_parallel = true needs tensor_model_parallel_size > 1 (it is 1): "
            "raise TP or turn sequence parallelism off."
        )


def world_size_from_env() -> int:
    """The world size torchrun announces (1 when started as a plain process)."""
    return int(os.environ.get("WORLD_SIZE", "1"))


def init_distributed(parallel: ParallelConfig, seed: int) -> torch.device:
    """Start torch.distributed from torchrun's environment and Megatron-Core's model-parallel state;
    return the run's device (``run_device``). With CUDA: NCCL and the local GPU (LOCAL_RANK).
    Without: gloo and the CPU, after the CPU layer (``megacispo.parallel.cpu.enable``) has made
    Megatron-Core run there. A plain ``python`` start runs as a world of one."""
    from megatron.core import parallel_state, tensor_parallel

    bind_missing_te_names()
    use_cuda = torch.cuda.is_available()
    if use_cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    else:
        # The one place the CPU layer is entered; a GPU run never imports it.
        from megacispo.parallel import cpu

        cpu.enable()
    if not torch.distributed.is_initialized():
        os.environ.setdefault("RANK", "0")
        os.environ.setdefault("WORLD_SIZE", "1")
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        if "MASTER_PORT" not in os.environ:
            from megacispo.parallel.multiprocess import find_free_port

            os.environ["MASTER_PORT"] = str(find_free_port())
        torch.distributed.init_process_group(
            backend="nccl" if use_cuda else "gloo",
            timeout=datetime.timedelta(minutes=parallel.distributed_timeout_minutes),
        )
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=parallel.tensor_model_parallel_size,
        pipeline_model_parallel_size=parallel.pipeline_model_parallel_size,
        expert_model_parallel_size=parallel.expert_model_parallel_size,
        expert_tensor_parallel_size=parallel.expert_tensor_parallel_size,
        distributed_timeout_minutes=parallel.distributed_timeout_minutes,
    )
    tensor_parallel.model_parallel_cuda_manual_seed(seed)
    return run_device()


def bind_missing_te_names() -> None:
    """Megatron-Core's moe_utils.py:1192 reads ``te_general_gemm``, which is undefined when Transformer
    Engine is absent (on any device): bind it to None so the router falls back to torch's matmul."""
    moe_utils = importlib.import_module("megatron.core.transformer.moe.moe_utils")
    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None


def run_device() -> torch.device:
    """The one device of this run, which every tensor of the model and the driver lives on: the
    local GPU when torch.distributed runs on NCCL, the CPU when it runs on gloo (or is not started).
    Collectives of either backend take tensors on it."""
    if torch.distributed.is_initialized() and torch.distributed.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def broadcast_from_last_stage(tensor: torch.Tensor, pp_group) -> torch.Tensor:
    """The last pipeline stage's ``tensor`` on every stage of ``pp_group``, in place (a no-op
    without pipeline parallelism): what only the last stage computes (logits, log-probs), every
    stage needs to take the same next step."""
    pp_size = torch.distributed.get_world_size(pp_group)
    if pp_size > 1:
        torch.distributed.broadcast(tensor, src=torch.distributed.get_global_rank(pp_group, pp_size - 1), group=pp_group)
    return tensor


def destroy_distributed() -> None:
    from megatron.core import parallel_state

    parallel_state.destroy_model_parallel()
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
