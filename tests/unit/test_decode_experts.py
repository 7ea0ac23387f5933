"""The fixed-shape forms of a decode step's experts (models/experts.py) against a naive reference:
each token's chosen experts run one by one in fp64 and are summed in ascending expert order, the
residual around them added. Random inputs, odd batch sizes, idle experts and experts chosen by many
tokens, with and without the residual; the grouped products in fp32 and bf16 (where
``torch._grouped_mm`` takes them), the dense form in fp64 and fp32; and expert parallelism's part of
a rank, whose pairs of other ranks' experts add nothing."""

from __future__ import annotations

import pytest
import torch

from megacispo.models.experts import (
    dense_expert_products,
    expert_mlp,
    grouped_expert_products,
    grouped_products_take,
    local_expert_products,
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


def _reference(tokens, probs, top_experts, fc1, fc2, residual_scale: float = 0.0, update_scale: float = 1.0,
               local: range | None = None) -> torch.Tensor:
    """residual_scale * tokens + update_scale * each token's experts summed in ascending expert order,
    in fp64; ``local``: only these experts, numbered from its start (expert parallelism's part of a rank)."""
    out = torch.zeros(tokens.shape, dtype=torch.float64)
    for token in range(tokens.shape[0]):
        for slot in top_experts[token].argsort().tolist():
            expert = int(top_experts[token, slot])
            if local is not None and expert not in local:
                continue
            index = expert if local is None else expert - local.start
            out[token] += expert_mlp(tokens[token : token + 1].double(), probs[token, slot : slot + 1].double(),
                                     fc1[index].double(), fc2[index].double())[0]
    return residual_scale * tokens.double() + update_scale * out


# (0, 1): the experts alone, as a rank that is not first in its group adds them; then MiniMax's kind.
SCALES = [(0.0, 1.0), (1.7, 0.6)]


@pytest.mark.parametrize("batch", [1, 3, 16, 33])
@pytest.mark.parametrize("form, dtype, tolerance", [
    (grouped_expert_products, torch.float32, 1e-5), (grouped_expert_products, torch.bfloat16, 3e-2),
    (dense_expert_products, torch.float64, 1e-12), (dense_expert_products, torch.float32, 1e-5),
])
@pytest.mark.parametrize("scales", SCALES)
def test_fixed_shape_experts_equal_the_naive_experts(batch, form, dtype, tolerance, scales):
    inputs = _inputs(batch, dtype, seed=batch)
    expected = _reference(*inputs, *scales)
    with torch.no_grad():
        actual = form(*inputs, *scales)
    assert actual.shape == inputs[0].shape and actual.dtype == dtype
    assert (actual.double() - expected).abs().max() <= tolerance * expected.abs().max()


@pytest.mark.parametrize("batch", [1, 5, 16])
@pytest.mark.parametrize("dtype, tolerance", [(torch.float32, 1e-5), (torch.float64, 1e-12)])
@pytest.mark.parametrize("scales", SCALES)
def test_a_ranks_part_under_expert_parallelism_sums_its_own_experts(batch, dtype, tolerance, scales):
    """Experts 2-4 on this rank (0-2 here), 1 and 5 elsewhere (index 3 = E): the grouped form (fp32)
    leaves their rows uncomputed, the dense form (fp64) weighs them 0; neither adds them."""
    tokens, probs, top_experts, fc1, fc2 = _inputs(batch, dtype, seed=10 + batch)
    local = range(2, 5)
    local_index = torch.full((NUM_EXPERTS,), len(local), dtype=torch.long)
    local_index[local.start:local.stop] = torch.arange(len(local))
    own_fc1, own_fc2 = fc1[local.start:local.stop], fc2[local.start:local.stop]
    expected = _reference(tokens, probs, top_experts, own_fc1, own_fc2, *scales, local=local)
    with torch.no_grad():
        actual = local_expert_products(tokens, probs, local_index[top_experts], own_fc1, own_fc2, *scales)
    assert actual.shape == tokens.shape and torch.isfinite(actual).all()
    assert (actual.double() - expected).abs().max() <= tolerance * expected.abs().max()


def test_grouped_products_take_aligned_cpu_dtypes_only():
    tokens, _, _, fc1, fc2 = _inputs(2, torch.float32, seed=0)
    assert grouped_products_take(tokens, fc1, fc2)
    assert not grouped_products_take(tokens.double(), fc1.double(), fc2.double())
    odd = torch.zeros(NUM_EXPERTS, 2 * FFN, HIDDEN + 1)
    assert not grouped_products_take(torch.zeros(2, HIDDEN + 1), odd, fc2)
