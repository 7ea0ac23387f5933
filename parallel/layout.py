"""The parallel layout: its config, its validation, and the start-up of torch.distributed and
Megatron-Core's model-parallel state from torchrun's environment."""

from __future__ import annotations

import datetime
import importlib
import os
import socket
from dataclasses import dataclass

import torch


# parallel.context_parallel_comm's choices, Megatron-Core's names (TransformerConfig.cp_comm_type).
CONTEXT_PARALLEL_COMMS = ("all_gather", "p2p")


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
    """Expert TP: each expert's FFN is split across this many ranks; None means the same as
    tensor_model_parallel_size. The experts have a grid of their own (expert TP x EP x expert DP in
    each pipeline stage) over the same processes as the attention's TP x DP, so TP 2 with EP 2 and
    expert TP 1 runs on 2 processes (Megatron-Core's "MoE parallel folding")."""
    virtual_pipeline_model_parallel_size: int | None = None
    """Interleaved (virtual) pipeline stages per rank: not supported, leave it unset
    (validate_layout says what it would need)."""
    sequence_parallel: bool = False
    """Shard norms, residuals and dropout along the sequence across the TP group (needs TP > 1)."""
    context_parallel_size: int = 1
    """CP: each packed row of the training passes, and each sequence megacispo.score scores, is split over
    this many ranks (zigzag chunks), which hold the same weights; the losses' per-sequence sums (grpo, gspo)
    span them. Refused with CP > 1: train.pack_sequences = false (CP splits packed rows), logging.metric_hooks
    (a hook sees sequences whole), placement.rollout_ranks > 0 (the CP ranks generate in the training
    processes). Decoding (rollouts, evaluation) never splits a sequence: each CP rank decodes prompts of its own."""
    context_parallel_comm: str = "all_gather"
    """How softmax layers see the other CP ranks' keys: all_gather (the whole row's K and V at once) or p2p (a ring, one block at a time)."""
    distributed_timeout_minutes: int = 30
    """A collective that waits longer than this fails instead of hanging."""

    @property
    def expert_tp(self) -> int:
        """The expert TP size in effect (expert_tensor_parallel_size, or TP when it is unset)."""
        return self.expert_tensor_parallel_size or self.tensor_model_parallel_size

    @property
    def model_parallel_size(self) -> int:
        """The processes of one model replica: TP x PP x CP."""
        return self.tensor_model_parallel_size * self.pipeline_model_parallel_size * self.context_parallel_size

    def data_parallel_size(self, world_size: int) -> int:
        return world_size // self.model_parallel_size


@dataclass(frozen=True)
class ModelShape:
    """The model dimensions that a layout must divide."""

    num_layers: int
    num_attention_heads: int
    num_query_groups: int
    num_experts: int | None
    moe_ffn_hidden_size: int | None


def validate_layout(parallel: ParallelConfig, world_size: int, shape: ModelShape) -> None:
    """Raise ValueError naming the numbers and the fix if ``parallel`` cannot split ``shape`` over
    ``world_size`` processes. Called at start-up, before any process group or model exists."""
    tp = parallel.tensor_model_parallel_size
    pp = parallel.pipeline_model_parallel_size
    cp = parallel.context_parallel_size
    ep = parallel.expert_model_parallel_size
    etp = parallel.expert_tp
    for field, size in (
        ("tensor_model_parallel_size", tp),
        ("pipeline_model_parallel_size", pp),
        ("context_parallel_size", cp),
        ("expert_model_parallel_size", ep),
        ("expert_tensor_parallel_size", etp),
    ):
        if size < 1:
            raise ValueError(f"parallel.{field} = {size}: it must be at least 1.")
    if world_size % parallel.model_parallel_size:
        raise ValueError(
            f"world size {world_size} is not divisible by tensor_model_parallel_size * "
            f"pipeline_model_parallel_size * context_parallel_size = {tp} * {pp} * {cp} = "
            f"{parallel.model_parallel_size}: launch a multiple of {parallel.model_parallel_size} processes or "
            f"change TP/PP/CP."
        )
    if world_size % (etp * ep * pp):
        raise ValueError(_expert_grid_error(parallel, world_size))
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
    if shape.num_experts and shape.moe_ffn_hidden_size % etp:
        raise ValueError(
            f"model.moe_ffn_hidden_size = {shape.moe_ffn_hidden_size} is not divisible by "
            f"expert_tensor_parallel_size = {etp}{_expert_tp_origin(parallel)}: each expert's FFN is split "
            f"across the expert TP ranks; set parallel.expert_tensor_parallel_size to a divisor of it "
            f"(1 keeps every expert whole)."
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
    if parallel.virtual_pipeline_model_parallel_size is not None:
        raise ValueError(
            f"parallel.virtual_pipeline_model_parallel_size = {parallel.virtual_pipeline_model_parallel_size}: "
            "interleaved pipeline stages are not supported. They would need several model chunks per rank "
            "(each HybridModel built for its virtual stage and layer offset; the engine's DDP, optimizer and "
            "checkpoints over the list of chunks), Megatron's interleaved schedule (micro-batches a multiple "
            "of pipeline_model_parallel_size), and rollouts that decode through every chunk of every stage "
            "in turn. Unset it: pipeline_model_parallel_size alone gives each rank one stage."
        )


def _expert_tp_origin(parallel: ParallelConfig) -> str:
    """Where the expert TP size comes from, when the user did not set it."""
    if parallel.expert_tensor_parallel_size is None:
        return f" (expert_tensor_parallel_size is unset, so it is tensor_model_parallel_size = {parallel.expert_tp})"
    return ""


def _expert_grid_error(parallel: ParallelConfig, world_size: int) -> str:
    """The refusal of a world size that the experts' grid (expert TP x EP x PP) does not divide."""
    etp, ep = parallel.expert_tp, parallel.expert_model_parallel_size
    pp = parallel.pipeline_model_parallel_size
    grid = etp * ep * pp
    fix = f"launch a multiple of {grid} processes or lower EP"
    if etp > 1 and world_size % (ep * pp) == 0:
        fix = (f"launch a multiple of {grid} processes, lower EP, or set parallel.expert_tensor_parallel_size = 1 "
               f"(whole experts, EP across the TP ranks)")
    return (
        f"world size {world_size} is not divisible by expert_tensor_parallel_size * expert_model_parallel_size * "
        f"pipeline_model_parallel_size = {etp} * {ep} * {pp} = {grid}{_expert_tp_origin(parallel)}: the experts of "
        f"each pipeline stage sit on a grid of their own, expert TP x EP x expert DP, over the same processes as "
        f"TP x DP; {fix}."
    )


def world_size_from_env() -> int:
    """The world size torchrun announces (1 when started as a plain process)."""
    return int(os.environ.get("WORLD_SIZE", "1"))


# precision.fp32_matmul -> torch.set_float32_matmul_precision's name for it.
FP32_MATMUL_PRECISIONS = {"ieee": "highest", "tf32": "high"}


def init_distributed(parallel: ParallelConfig, seed: int, fp32_matmul: str = "ieee") -> torch.device:
    """Start torch.distributed from torchrun's environment and Megatron-Core's model-parallel state;
    return the run's device (``run_device``). With CUDA: NCCL and the local GPU (LOCAL_RANK).
    Without: gloo and the CPU, after the CPU layer (``megacispo.parallel.cpu.enable``) has made
    Megatron-Core run there. A plain ``python`` start runs as a world of one. ``fp32_matmul``
    (precision.fp32_matmul) sets how fp32 matrix products run in this process."""
    from megatron.core import parallel_state, tensor_parallel

    torch.set_float32_matmul_precision(FP32_MATMUL_PRECISIONS[fp32_matmul])
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
        context_parallel_size=parallel.context_parallel_size,
        distributed_timeout_minutes=parallel.distributed_timeout_minutes,
    )
    tensor_parallel.model_parallel_cuda_manual_seed(seed)
    return run_device()


def find_free_port() -> int:
    """A TCP port on the loopback interface that nothing listens on right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


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


def destroy_model_parallel() -> None:
    """Megatron's model-parallel state torn down, the process group kept (a process may score again)."""
    from megatron.core import parallel_state

    parallel_state.destroy_model_parallel()


def destroy_distributed() -> None:
    destroy_model_parallel()
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
