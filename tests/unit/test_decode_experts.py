"""The fixed-shape forms of a decode step's experts (models/experts.py) against a naive reference:
each token's chosen experts run one by one in fp64 and are summed in ascending expert order. Random
inputs, odd batch sizes, idle experts and experts chosen by many tokens; the grouped products in fp32
and bf16 (where ``torch._grouped_mm`` takes them), the dense form in fp64 and fp32."""

from __future__ import annotations

import pytest
import torch

from megacispo.models.experts import (
    dense_expert_products,
    expert_mlp,
    grouped_expert_products,
    grouped_products_take,
)

NUM_EXPERTS, TOPK, HIDDEN, FFN = 7, 2, 24, 40  # rows of multiples of 16 bytes in bf16: grouped_mm's alignment


def _inputs(batch: int, dtype: torch.dtype, seed: int):
    generator = torch.Generator().manual_seed(seed)
    fc1 = torch.randn(NUM_EXPERTS, 2 * FFN, HIDDEN, generator=generator, dtype=torch.float64) / HIDDEN**0.5
    fc2 = torch.randn(NUM_EXPERTS, HIDDEN, FFN, generator=generator, dtype=torch.float64) / FFN**0.5
    tokens = torch.randn(batch, HIDDEN, generator=generator, dtype=torch.float64)
    probs = torch.rand(batch, TOPK, generator=generator, dtype=torch.float64)
    # Experts 0 and 6 idle; the others chosen by several tokens each.
    top_experts = torch.stack([torch.randperm(5, generator=generator)[:TOPK] + 1 for _ in range(batch)])
    return tokens.to(dtype), probs.float(), top_experts, fc1.to(dtype), fc2.to(dtype)


def _reference(tokens, probs, top_experts, fc1, fc2) -> torch.Tensor:
    out = torch.zeros(tokens.shape, dtype=torch.float64)
    for token in range(tokens.shape[0]):
        for slot in top_experts[token].argsort().tolist():
            expert = int(top_experts[token, slot])
            out[token] += expert_mlp(tokens[token : token + 1].double(), probs[token, slot : slot + 1].double(),
                                     fc1[expert].double(), fc2[expert].double())[0]
    return out


@pytest.mark.parametrize("batch", [1, 3, 16, 33])
@pytest.mark.parametrize("form, dtype, tolerance", [
    (grouped_expert_products, torch.float32, 1e-5), (grouped_expert_products, torch.bfloat16, 3e-2),
    (dense_expert_products, torch.float64, 1e-12), (dense_expert_products, torch.float32, 1e-5),
])
def test_fixed_shape_experts_equal_the_naive_experts(batch, form, dtype, tolerance):
    inputs = _inputs(batch, dtype, seed=batch)
    expected = _reference(*inputs)
    with torch.no_grad():
        actual = form(*inputs)
    assert actual.shape == inputs[0].shape and actual.dtype == dtype
    assert (actual.double() - expected).abs().max() <= tolerance * expected.abs().max()


def test_grouped_products_take_aligned_cpu_dtypes_only():
    tokens, _, _, fc1, fc2 = _inputs(2, torch.float32, seed=0)
    assert grouped_products_take(tokens, fc1, fc2)
    assert not grouped_products_take(tokens.double(), fc1.double(), fc2.double())
    odd = torch.zeros(NUM_EXPERTS, 2 * FFN, HIDDEN + 1)
    assert not grouped_products_take(torch.zeros(2, HIDDEN + 1), odd, fc2)
