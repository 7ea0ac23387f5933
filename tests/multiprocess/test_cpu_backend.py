"""The CPU back-end: each patch does what its upstream call site needs, and nothing is patched
when CUDA is present. Each check runs in a fresh process because the patches are process-wide."""

from __future__ import annotations

import importlib
import inspect
from unittest import mock

import torch

from megacispo.testing.harness import run_distributed


def _code_constants(code) -> set:
    constants = set()
    for const in code.co_consts:
        if inspect.iscode(const):
            constants |= _code_constants(const)
        elif isinstance(const, (str, tuple)):
            constants.add(const)
    return constants


def _check_source_patches() -> list[str]:
    from megacispo.parallel.cpu import megatron as cpu_backend

    originals = {}
    for patch in cpu_backend.SOURCE_PATCHES:
        owner, name = cpu_backend._resolve(patch.module, patch.qualname)
        originals[patch] = inspect.unwrap(getattr(owner, name))
    assert cpu_backend.apply() is True
    problems = []
    for patch in cpu_backend.SOURCE_PATCHES:
        owner, name = cpu_backend._resolve(patch.module, patch.qualname)
        patched = inspect.unwrap(getattr(owner, name))
        if patched is originals[patch]:
            problems.append(f"{patch.qualname}: not replaced")
        constants = _code_constants(patched.__code__)
        for old, _ in patch.replacements:
            for literal in ("cuda", "torch.cuda.FloatTensor", "torch.cuda.HalfTensor"):
                if literal in old and literal in constants:
                    problems.append(f"{patch.qualname}: still holds {literal!r}")
    return problems


def test_every_source_patch_replaces_its_cuda_literals():
    (problems,) = run_distributed(_check_source_patches, 1)
    assert problems == []


def _unpermute_results(unpermute, generator: torch.Generator) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(output, permuted-token gradient) of a top-2 permute / unpermute round trip, odd sizes."""
    from megatron.core.transformer.moe.moe_utils import permute

    results = []
    for num_tokens, hidden, num_experts in ((1, 8, 4), (13, 24, 5), (37, 16, 8)):
        tokens = torch.randn(num_tokens, hidden, generator=generator)
        logits = torch.randn(num_tokens, num_experts, generator=generator)
        top = logits.topk(2, dim=-1)
        routing_map = torch.zeros_like(logits, dtype=torch.bool).scatter(1, top.indices, True)
        probs = torch.zeros_like(logits).scatter(1, top.indices, top.values.softmax(-1))
        permuted, _, sorted_indices = permute(tokens, routing_map, num_out_tokens=2 * num_tokens)
        expert_outputs = (permuted * torch.randn(permuted.shape[0], 1, generator=generator)).requires_grad_(True)
        output = unpermute(expert_outputs, sorted_indices, tokens.shape, probs=probs, routing_map=routing_map)
        output.backward(torch.randn(output.shape, generator=generator))
        results.append((output.detach(), expert_outputs.grad))
    return results


def _check_unpermute_patch() -> dict:
    from megacispo.parallel.cpu import megatron as cpu_backend

    moe_utils = importlib.import_module("megatron.core.transformer.moe.moe_utils")
    upstream = moe_utils.unpermute
    expected = _unpermute_results(upstream, torch.Generator().manual_seed(4))
    cpu_backend.apply()
    token_dispatcher = importlib.import_module("megatron.core.transformer.moe.token_dispatcher")
    patched = moe_utils.unpermute
    actual = _unpermute_results(patched, torch.Generator().manual_seed(4))
    return {
        "replaced": patched is not upstream and token_dispatcher.unpermute is patched,
        "asks_determinism": "are_deterministic_algorithms_enabled" in patched.__code__.co_names,
        "max_difference": max(
            (a - b).abs().max().item() for pair_a, pair_b in zip(expected, actual) for a, b in zip(pair_a, pair_b)
        ),
    }


def test_unpermute_patch_takes_index_add_with_equal_results():
    """unpermute always takes upstream's index_add_ branch on CPU; outputs and gradients equal the
    scatter_add_ branch's (the same sums, up to the order of two fp32 additions)."""
    (out,) = run_distributed(_check_unpermute_patch, 1)
    assert out["replaced"] and not out["asks_determinism"]
    assert out["max_difference"] <= 1e-6


def _check_runtime_patches() -> dict:
    from megacispo.parallel.layout import ParallelConfig, init_distributed

    init_distributed(ParallelConfig(), seed=0)
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, param_and_grad_buffer
    from megatron.core.optimizer import OptimizerConfig, clip_grads, get_megatron_optimizer
    from megatron.core.tensor_parallel import random
    from megatron.core.transformer import utils
    from megatron.core.transformer.moe import moe_utils

    from megacispo.models.config import model_config, transformer_config
    from megacispo.models.model import HybridModel

    out = {}
    # current_device: ~40 allocations `device=torch.cuda.current_device()`.
    out["alloc_device"] = torch.empty(3, device=torch.cuda.current_device()).device.type
    torch.cuda.synchronize()
    # Inert streams: token_dispatcher.py:445 and :899.
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        stream.wait_stream(torch.cuda.current_stream())
    stream.record_event().synchronize()
    # The RNG tracker forks the CPU generator and restores the default stream of numbers.
    torch.manual_seed(0)
    expected_default = torch.rand(4)
    torch.manual_seed(0)
    tracker = random.get_cuda_rng_tracker()
    tracker.add("test-rng", 5)
    with tracker.fork("test-rng"):
        forked = torch.rand(4)
    out["fork_equals_seeded"] = torch.equal(forked, torch.rand(4, generator=torch.Generator().manual_seed(5)))
    out["default_stream_untouched"] = torch.equal(torch.rand(4), expected_default)
    # moe_utils.py:1093: CPU split sizes become numpy for all_to_all_single.
    out["split_sizes_numpy"] = type(moe_utils.maybe_move_tensor_to_cpu(torch.tensor([1, 2]), as_numpy=True)).__name__
    out["te_general_gemm"] = moe_utils.te_general_gemm
    # transformer/utils.py:35 and the clip_grads.py buffers.
    out["causal_mask"] = utils.get_default_causal_mask(3)
    param = torch.nn.Parameter(torch.ones(4))
    param.grad = torch.full((4,), 2.0)
    out["grad_norm"] = clip_grads.get_grad_norm_fp32([param.grad])
    clip_grads.clip_grad_by_total_norm_fp32([param], max_norm=1.0, total_norm=out["grad_norm"])
    out["clipped_grad"] = param.grad.clone()
    out["num_zeros"] = clip_grads.count_zeros_fp32([param], grad_stats_parallel_group=None)
    # param_and_grad_buffer.py:289/443 over a group of one: a buffer onto itself is skipped (the
    # function returns None, where the real collective would also return None when synchronous),
    # a distinct output still gets the data.
    buffer, other = torch.arange(6.0), torch.zeros(6)
    world = torch.distributed.group.WORLD
    out["gather_onto_itself"] = param_and_grad_buffer.dist_all_gather_func(buffer, buffer, group=world)
    param_and_grad_buffer.dist_all_gather_func(other, buffer, group=world)
    out["gathered"] = other.clone()
    param_and_grad_buffer.dist_reduce_scatter_func(other.zero_(), buffer, group=world)
    out["reduce_scattered"] = other.clone()
    # get_megatron_optimizer's AdamW gets torch's fused CPU kernel.
    tiny = model_config("tiny")
    megatron_config = transformer_config(tiny, ParallelConfig())
    model = DistributedDataParallel(megatron_config, DistributedDataParallelConfig(use_distributed_optimizer=True),
                                    HybridModel(tiny, megatron_config))
    optimizer = get_megatron_optimizer(OptimizerConfig(optimizer="adam", lr=1e-3, use_distributed_optimizer=True),
                                       [model])
    out["fused_adam"] = {group["fused"] for inner in optimizer.chained_optimizers for group in inner.optimizer.param_groups}
    return out


def test_runtime_patches_work_on_cpu():
    (out,) = run_distributed(_check_runtime_patches, 1)
    assert out["alloc_device"] == "cpu"
    assert out["fork_equals_seeded"] and out["default_stream_untouched"]
    assert out["split_sizes_numpy"] == "ndarray"
    assert out["te_general_gemm"] is None
    assert torch.equal(out["causal_mask"], torch.triu(torch.ones(3, 3, dtype=torch.bool), diagonal=1))
    assert abs(out["grad_norm"] - 4.0) < 1e-6
    torch.testing.assert_close(out["clipped_grad"], torch.full((4,), 0.5), rtol=1e-5, atol=1e-6)
    assert out["num_zeros"] == 0
    assert out["gather_onto_itself"] is None
    assert torch.equal(out["gathered"], torch.arange(6.0)) and torch.equal(out["reduce_scattered"], torch.arange(6.0))
    assert out["fused_adam"] == {True}


def _apply_with_cuda_present() -> dict:
    import megatron.core.transformer.utils as utils

    from megacispo.parallel.cpu import megatron as cpu_backend

    current_device = torch.cuda.current_device
    mask_fn = utils.get_default_causal_mask
    with mock.patch("torch.cuda.is_available", return_value=True):
        applied = cpu_backend.apply()
    return {
        "applied": applied,
        "current_device_untouched": torch.cuda.current_device is current_device,
        "mask_untouched": importlib.import_module("megatron.core.transformer.utils").get_default_causal_mask is mask_fn,
    }


def test_nothing_is_patched_when_cuda_is_present():
    (out,) = run_distributed(_apply_with_cuda_present, 1)
    assert out == {"applied": False, "current_device_untouched": True, "mask_untouched": True}


def test_upstream_change_fails_loudly():
    from megacispo.parallel.cpu import megatron as cpu_backend

    patch = cpu_backend.SourcePatch("megacispo.parallel.layout", "find_free_port",
                                    (("device='cuda'", "device='cpu'"),), "test")
    try:
        cpu_backend.apply_source_patch(patch)
    except RuntimeError as error:
        assert "no longer contains" in str(error) and "0.16.1" in str(error)
    else:
        raise AssertionError("a missing literal must raise")
