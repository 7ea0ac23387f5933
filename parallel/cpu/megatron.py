"""Megatron-Core 0.16.1 on a CPU-only torch.

Megatron-Core assumes CUDA: it allocates on ``torch.cuda.current_device()``, hard-codes
``device="cuda"``, forks the CUDA RNG, synchronizes streams and checks ``param.type()`` against
``torch.cuda.FloatTensor``. On a CPU-only torch each of those raises. ``apply()`` redirects them,
and only them, to the CPU, so that the real Megatron-Core code paths (TP, PP, EP, DDP, the
distributed optimizer, distributed checkpointing) run on gloo in tests and the quick start.

Three kinds of patch, each naming the upstream call site it serves (line numbers of 0.16.1):

- ``torch.cuda`` functions that cannot work without CUDA get CPU meanings (current device,
  synchronize, RNG state, inert streams). Nothing that works on a CPU-only torch is changed.
- Functions with a hard-coded CUDA device or tensor type are recompiled from their own source
  with exactly those literals replaced. Every replaced literal must be found, so an upstream
  change fails loudly here instead of silently running unpatched code. Two more are recompiled the
  same way for speed alone: MoE's ``unpermute``, to take its own ``index_add_`` branch (much faster
  than ``scatter_add_`` on a multi-threaded CPU), and the optimizer's construction, to give torch's
  AdamW its fused CPU kernel.
- Two MoE helpers get small wrappers, and so do DDP's two buffer collectives, which over a group
  of one rank are skipped instead of copying the buffer onto itself, and the sequence-parallel
  all-gather: gloo refuses shards of different sizes (NCCL takes them), which the MoE token
  dispatcher gathers under expert tensor parallelism, so such a gather is padded into an even one.

It is applied only when CUDA is unavailable; with CUDA, ``apply()`` changes nothing.
"""

from __future__ import annotations

import contextlib
import importlib
import inspect
import sys
import textwrap
from dataclasses import dataclass

import torch

_applied = False


@dataclass(frozen=True)
class SourcePatch:
    """Recompile ``module.qualname`` with each ``old`` literal replaced by ``new``."""

    module: str
    qualname: str
    replacements: tuple[tuple[str, str], ...]
    call_sites: str


_CUDA_DEVICE = (('device="cuda"', 'device="cpu"'),)
_CUDA_DEVICE_SQ = (("device='cuda'", "device='cpu'"),)
_CUDA_FLOAT_TYPE = (("'torch.cuda.FloatTensor'", "'torch.FloatTensor'"),)

SOURCE_PATCHES: tuple[SourcePatch, ...] = (
    SourcePatch("megatron.core.pipeline_parallel.schedules", "forward_backward_no_pipelining",
                _CUDA_DEVICE, "schedules.py:596 total_num_tokens"),
    SourcePatch("megatron.core.pipeline_parallel.schedules", "forward_backward_pipelining_with_interleaving",
                _CUDA_DEVICE, "schedules.py:983 total_num_tokens"),
    SourcePatch("megatron.core.pipeline_parallel.schedules", "forward_backward_pipelining_without_interleaving",
                _CUDA_DEVICE, "schedules.py:2138 total_num_tokens"),
    SourcePatch("megatron.core.optimizer.optimizer", "MixedPrecisionOptimizer.__init__",
                _CUDA_DEVICE_SQ, "optimizer.py:473/481/485 found_inf, overflow buffer, unit scale"),
    SourcePatch("megatron.core.optimizer.optimizer", "Float16OptimizerWithFloat16Params.__init__",
                (("['torch.cuda.HalfTensor', 'torch.cuda.BFloat16Tensor']", "['torch.HalfTensor', 'torch.BFloat16Tensor']"),)
                + _CUDA_FLOAT_TYPE, "optimizer.py:671/690 parameter type checks"),
    SourcePatch("megatron.core.optimizer.optimizer", "FP32Optimizer.__init__",
                _CUDA_DEVICE_SQ, "optimizer.py:907 unit scale"),
    SourcePatch("megatron.core.optimizer.clip_grads", "get_grad_norm_fp32",
                _CUDA_DEVICE_SQ, "clip_grads.py:90/103/115 norm buffers"),
    SourcePatch("megatron.core.utils", "local_multi_tensor_l2_norm",
                _CUDA_DEVICE, "utils.py:1207 grad norm without apex (clip_grads.py:108)"),
    SourcePatch("megatron.core.optimizer.clip_grads", "clip_grad_by_total_norm_fp32",
                _CUDA_DEVICE_SQ + _CUDA_FLOAT_TYPE, "clip_grads.py:167 grad type check, :174 overflow buffer"),
    SourcePatch("megatron.core.optimizer.clip_grads", "count_zeros_fp32",
                _CUDA_DEVICE_SQ, "clip_grads.py:207 zero counter"),
    SourcePatch("megatron.core.optimizer.distrib_optimizer", "DistributedOptimizer._build_model_and_main_param_groups",
                (("['torch.cuda.HalfTensor', 'torch.cuda.BFloat16Tensor']", "['torch.HalfTensor', 'torch.BFloat16Tensor']"),)
                + _CUDA_FLOAT_TYPE, "distrib_optimizer.py:361/420 parameter type checks"),
    SourcePatch("megatron.core.distributed.param_and_grad_buffer", "_ParamAndGradBuffer.__init__",
                _CUDA_DEVICE, "param_and_grad_buffer.py:768 NCCL warm-up all-reduce"),
    SourcePatch("megatron.core.models.common.language_module.language_module",
                "LanguageModule.setup_embeddings_and_output_layer",
                (("weight.data.cuda()", "weight.data"),), "language_module.py:244 tied embeddings with PP>1"),
    SourcePatch("megatron.core.transformer.utils", "get_default_causal_mask",
                _CUDA_DEVICE, "transformer/utils.py:35 causal mask when no attention mask is given"),
    SourcePatch("megatron.core.tensor_parallel.data", "_build_key_size_numel_dictionaries",
                _CUDA_DEVICE_SQ, "tensor_parallel/data.py:37 size broadcast"),
    SourcePatch("megatron.core.tensor_parallel.data", "broadcast_data",
                (("data[key].cuda()", "data[key]"),), "tensor_parallel/data.py:84 data broadcast"),
    # Not a CUDA call: a CPU cost. Combining the experts' outputs with scatter_add_ over an index
    # expanded to [n, H] took 15-20 ms per call at 2 threads (half of a decode step of the small
    # model); upstream's deterministic branch, index_add_ over the row index, sums the same rows.
    SourcePatch("megatron.core.transformer.moe.moe_utils", "unpermute",
                (("if torch.are_deterministic_algorithms_enabled():", "if True:"),),
                "moe_utils.py:453 combine expert outputs with index_add_ instead of scatter_add_"),
    # Not a CUDA call either: without Transformer Engine or apex Megatron builds torch's AdamW, which
    # on CPU tensors defaults to a loop of about ten ops per tensor; torch's fused CPU kernel updates
    # each tensor in one pass (115 -> 31 ms a step for 30M parameters at 2 threads). Same update rule.
    SourcePatch("megatron.core.optimizer", "_get_megatron_optimizer_based_on_param_groups",
                (('"params": param_groups,', '"params": param_groups, "fused": True,'),),
                "optimizer/__init__.py:350 torch AdamW with its fused CPU kernel"),
)


class _InertStream:
    """Stands in for torch.cuda.Stream/Event: on the CPU every operation is already complete."""

    def __init__(self, *args, **kwargs):
        pass

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False

    def __getattr__(self, name):
        # wait_stream, record_event, synchronize, ...: do nothing; record_event's result is
        # synchronized later (token_dispatcher.py:899), so methods return another inert object.
        return lambda *args, **kwargs: _InertStream()


def _cpu_device(*args, **kwargs) -> torch.device:
    return torch.device("cpu")


def _patch_torch_cuda() -> None:
    cuda = torch.cuda
    # ~40 allocations `device=torch.cuda.current_device()` (utils.py:631 GlobalMemoryBuffer,
    # tensor_parallel/mappings.py:91/141/148/181/442, layers.py:552/597/607,
    # param_and_grad_buffer.py:783-806, moe/router.py:90, p2p_communication.py:190-321).
    cuda.current_device = _cpu_device
    # filesystem_async.py:230, p2p_communication.py:242/398, parallel_state.py:198.
    cuda.synchronize = lambda *args, **kwargs: None
    # moe/token_dispatcher.py:445 creates a D2H stream in the all-to-all dispatcher's constructor.
    cuda.Stream = _InertStream
    cuda.Event = _InertStream
    cuda.current_stream = lambda *args, **kwargs: _InertStream()
    cuda.stream = lambda *args, **kwargs: contextlib.nullcontext()
    # tensor_parallel/random.py:235-240 (CudaRNGStatesTracker.add) and :422
    # (model_parallel_cuda_manual_seed): the model-parallel RNG tracker forks the CPU generator.
    # torch.manual_seed itself calls torch.cuda.manual_seed_all, so seed the generator directly.
    cuda.get_rng_state = lambda *args, **kwargs: torch.get_rng_state()
    cuda.set_rng_state = lambda new_state, *args, **kwargs: torch.set_rng_state(new_state)
    cuda.manual_seed = lambda seed: torch.default_generator.manual_seed(seed)


def _patch_rng_tracker() -> None:
    # tensor_parallel/random.py:41/72 read torch.cuda.default_generators directly;
    # dot_product_attention.py:217 and every initialization under the tracker go through them.
    random = importlib.import_module("megatron.core.tensor_parallel.random")
    random._get_cuda_rng_state = lambda *args, clone=False, **kwargs: torch.get_rng_state()
    random._set_cuda_rng_state = lambda new_state, *args, **kwargs: torch.set_rng_state(new_state)


def _patch_moe_helpers() -> None:
    moe_utils = importlib.import_module("megatron.core.transformer.moe.moe_utils")
    upstream = moe_utils.maybe_move_tensor_to_cpu

    def maybe_move_tensor_to_cpu(tensor, as_numpy=False, record_stream=False):
        # moe_utils.py:1093 only converts CUDA tensors; CPU split sizes must become numpy too, or
        # all_to_all_single (mappings.py:444) rejects them.
        if torch.is_tensor(tensor) and not tensor.is_cuda and as_numpy:
            return tensor.numpy()
        return upstream(tensor, as_numpy=as_numpy, record_stream=record_stream)

    _rebind(upstream, maybe_move_tensor_to_cpu)


def _in_place_over_one_rank(collective):
    """``collective`` (output, input, ...), skipped when it would copy a buffer onto itself: over a
    group of one, all-gathering a shard that is the whole buffer, or reduce-scattering a buffer
    into its only shard, changes nothing, but gloo still copies it (130-150 ms for the 119 MB
    buffer of the small model, twice a step: DDP's gradient reduce-scatter and the distributed
    optimizer's parameter all-gather, also for experts when the expert-data-parallel group is one rank)."""
    signature = inspect.signature(collective)

    def call(*args, **kwargs):
        bound = signature.bind(*args, **kwargs)
        output, source = args[0], args[1]
        if (
            torch.distributed.get_world_size(bound.arguments.get("group")) == 1
            and output.data_ptr() == source.data_ptr()
            and output.numel() == source.numel()
        ):
            return None  # inside _coalescing_manager: an empty op list, and its handle waits on nothing
        return collective(*args, **kwargs)

    return call


def _patch_single_rank_collectives() -> None:
    # param_and_grad_buffer.py:289 (start_param_sync) and :443 (start_grad_sync).
    buffers = importlib.import_module("megatron.core.distributed.param_and_grad_buffer")
    buffers.dist_all_gather_func = _in_place_over_one_rank(buffers.dist_all_gather_func)
    buffers.dist_reduce_scatter_func = _in_place_over_one_rank(buffers.dist_reduce_scatter_func)


def all_gather_uneven_rows(input_: torch.Tensor, group, output_split_sizes: list[int]) -> torch.Tensor:
    """The ``input_`` [output_split_sizes[rank], ...] of every rank of ``group``, concatenated along
    the first dimension in rank order. Gloo gathers only tensors of one size: each rank's rows are
    padded to the largest count, gathered evenly, and the padding is dropped."""
    num_ranks, most = len(output_split_sizes), max(output_split_sizes)
    padded = input_.new_zeros((most, *input_.shape[1:]))
    padded[: input_.shape[0]] = input_
    gathered = input_.new_empty((num_ranks * most, *input_.shape[1:]))
    torch.distributed.all_gather_into_tensor(gathered, padded, group=group)
    return torch.cat([shard[:rows] for shard, rows in zip(gathered.chunk(num_ranks), output_split_sizes)])


def _patch_uneven_sequence_gather() -> None:
    # tensor_parallel/mappings.py:150 (_gather_along_first_dim) hands gloo's all_gather a list of
    # shards of different sizes when given split sizes, and gloo refuses it ("ProcessGroupGloo::
    # allgather: invalid tensor size"). The all-to-all token dispatcher gives split sizes whenever
    # expert TP > 1, and they differ once EP > 1 (each expert-TP rank routes its own tokens to this
    # rank's experts): the gather of tokens and probabilities at token_dispatcher.py:696/699, and
    # the backward of the reduce-scatter of the experts' outputs at :779 (mappings.py:373). Gloo's
    # list reduce-scatter (mappings.py:193, the gather's backward) takes uneven shards as they are.
    # Even split sizes keep upstream's path.
    mappings = importlib.import_module("megatron.core.tensor_parallel.mappings")
    upstream = mappings._gather_along_first_dim

    def gather_along_first_dim(input_, group, output_split_sizes=None, use_global_buffer=False):
        if output_split_sizes is not None and len(set(output_split_sizes)) > 1:
            return all_gather_uneven_rows(input_, group, output_split_sizes)
        return upstream(input_, group, output_split_sizes, use_global_buffer)

    _rebind(upstream, gather_along_first_dim)


def _resolve(module_name: str, qualname: str):
    owner = importlib.import_module(module_name)
    *path, name = qualname.split(".")
    for part in path:
        owner = getattr(owner, part)
    return owner, name


def _rebind(old, new) -> None:
    """Point every loaded Megatron-Core module that holds ``old`` by name at ``new``: modules
    import these functions with ``from x import f``, so patching only the defining module misses them."""
    for name, module in list(sys.modules.items()):
        if not name.startswith("megatron.core") or module is None:
            continue
        for attr, value in list(vars(module).items()):
            if value is old:
                setattr(module, attr, new)


def apply_source_patch(patch: SourcePatch) -> None:
    owner, name = _resolve(patch.module, patch.qualname)
    function = inspect.unwrap(getattr(owner, name))
    lines, first_line = inspect.getsourcelines(function)
    source = textwrap.dedent("".join(lines))
    for old, new in patch.replacements:
        if old not in source:
            raise RuntimeError(
                f"megatron-core changed: {patch.module}.{patch.qualname} no longer contains {old!r} "
                f"({patch.call_sites}). megacispo's CPU back-end is written for megatron-core==0.16.1."
            )
        source = source.replace(old, new)
    if inspect.isclass(owner):
        # A method recompiled outside its class body has no __class__ cell for zero-argument super().
        source = source.replace("super()", f"super({owner.__name__}, self)")
    # Padding keeps tracebacks pointing at the upstream line numbers.
    code = compile("\n" * (first_line - 1) + source, inspect.getsourcefile(function), "exec")
    namespace: dict = {}
    exec(code, function.__globals__, namespace)  # noqa: S102 - upstream's own source, two literals changed
    patched = namespace[name]
    if inspect.isclass(owner):
        setattr(owner, name, patched)
    else:
        _rebind(getattr(owner, name), patched)


def apply() -> bool:
    """Make Megatron-Core run on a CPU-only torch. Returns whether anything was patched."""
    global _applied
    if torch.cuda.is_available():
        return False
    if _applied:
        return True
    _patch_torch_cuda()
    _patch_rng_tracker()
    _patch_moe_helpers()
    _patch_single_rank_collectives()
    _patch_uneven_sequence_gather()
    for patch in SOURCE_PATCHES:
        apply_source_patch(patch)
    _applied = True
    return True
