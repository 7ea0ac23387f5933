"""The decode step's expert kernels (models/experts_triton.py), run in Triton's CPU interpreter, against
the composites of their ops (models/experts.py) and, through the whole step's experts, against the
naive experts in fp64: random inputs, odd token counts and widths past one program's block, top-1 to
top-3, pairs of other ranks' experts, rows that no product wrote holding NaN."""

from __future__ import annotations

import sys

import pytest
import torch

pytest.importorskip("triton", reason="triton is not installed (pip install -e '.[test]'); the kernels need it")

from megacispo.models.experts import (  # noqa: E402
    combine_pairs,
    decode_experts,
    local_expert_products,
    permute_pairs,
    swiglu,
)
from megacispo.testing.triton_modules import load_kernels_module  # noqa: E402

KERNELS = "megacispo.models.experts_triton"
_interpreted = load_kernels_module(KERNELS, interpret=True, name="_experts_triton_interpreted")

# bf16 results within two roundings of the composites' (exp and the sums' order may differ in the last
# bit, and the interpreter's casts to bf16 truncate, where torch's and a GPU's round to nearest).
TOLERANCES = {torch.float32: 1e-6, torch.bfloat16: 2e-2}


def _pairs(tokens: int, topk: int, num_experts: int, local: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(sorted_experts, order) of ``tokens`` tokens' top-k choices among ``num_experts``, the experts
    from ``local`` on marked as another rank's (``local``), as grouped_expert_products sorts them."""
    generator = torch.Generator().manual_seed(seed)
    choices = torch.stack([torch.randperm(num_experts, generator=generator)[:topk] for _ in range(tokens)])
    return torch.sort(choices.clamp(max=local).flatten(), stable=True)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("tokens, topk, hidden, local", [(1, 1, 24, 5), (5, 2, 40, 3), (13, 3, 1100, 5)])
def test_permute_pairs_kernel_equals_its_composite(dtype, tokens, topk, hidden, local):
    """Rows of this rank's pairs and every pair's position equal the composite's exactly (a copy, an
    index); rows of other ranks' pairs are the kernel's to leave unwritten."""
    sorted_experts, order = _pairs(tokens, topk, num_experts=5, local=local, seed=tokens)
    token_rows = torch.randn(tokens, hidden).to(dtype)
    rows, positions = _interpreted.permute_pairs_triton(token_rows, sorted_experts, order, local)
    expected_rows, expected_positions = permute_pairs(token_rows, sorted_experts, order, local)
    assert torch.equal(positions, expected_positions)
    computed = sorted_experts < local
    assert torch.equal(rows[computed], expected_rows[computed])
    if local < 5:
        assert (positions == -1).sum() == (~computed).sum() > 0


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("rows, width, computed", [(1, 8, 1), (7, 40, 7), (7, 40, 4), (3, 1100, 2)])
def test_swiglu_kernel_equals_its_composite(dtype, rows, width, computed):
    """On the rows the groups cover (ends[-1] = ``computed``); the rest are the kernel's to skip."""
    projected = (3 * torch.randn(rows, 2 * width)).to(dtype)
    ends = torch.tensor([computed // 2, computed], dtype=torch.int32)
    result = _interpreted.swiglu_triton(projected, ends)
    assert result.dtype == dtype
    torch.testing.assert_close(result[:computed], swiglu(projected, ends)[:computed], rtol=TOLERANCES[dtype],
                               atol=TOLERANCES[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("scales", [(0.0, 1.0), (1.0, 0.5)], ids=["no residual", "residual"])
@pytest.mark.parametrize("tokens, topk, hidden, local", [(1, 1, 24, 5), (5, 2, 40, 3), (13, 3, 1100, 5)])
def test_combine_pairs_kernel_equals_its_composite(dtype, scales, tokens, topk, hidden, local):
    """Other ranks' pairs add 0, and the rows no product wrote (NaN here) are never read."""
    sorted_experts, order = _pairs(tokens, topk, num_experts=5, local=local, seed=tokens + 1)
    token_rows = torch.randn(tokens, hidden).to(dtype)
    probs = torch.rand(tokens, topk)
    _, positions = permute_pairs(token_rows, sorted_experts, order, local)
    expert_outputs = torch.randn(tokens * topk, hidden).to(dtype)
    expert_outputs[sorted_experts >= local] = float("nan")
    result = _interpreted.combine_pairs_triton(token_rows, probs, expert_outputs, positions, *scales)
    expected = combine_pairs(token_rows, probs, expert_outputs, positions, *scales)
    assert result.isfinite().all() and expected.isfinite().all()
    torch.testing.assert_close(result, expected, rtol=TOLERANCES[dtype], atol=TOLERANCES[dtype])


@pytest.fixture
def kernels_on_the_cpu():
    """The ops' CUDA kernels, interpreted, registered for the CPU too: ops called on CPU tensors run
    them. Removed after the test."""
    library = torch.library.Library("megacispo", "IMPL")
    for name in ("permute_pairs", "swiglu", "combine_pairs"):
        library.impl(name, getattr(_interpreted, f"{name}_triton"), "CPU")
    yield
    library._destroy()


NUM_EXPERTS, TOPK, HIDDEN, FFN = 7, 2, 24, 40


def _expert_inputs(batch: int, dtype: torch.dtype, seed: int) -> tuple[torch.Tensor, ...]:
    generator = torch.Generator().manual_seed(seed)
    fc1 = torch.randn(NUM_EXPERTS, 2 * FFN, HIDDEN, generator=generator, dtype=torch.float64) / HIDDEN**0.5
    fc2 = torch.randn(NUM_EXPERTS, HIDDEN, FFN, generator=generator, dtype=torch.float64) / FFN**0.5
    tokens = torch.randn(batch, HIDDEN, generator=generator, dtype=torch.float64)
    probs = torch.rand(batch, TOPK, generator=generator, dtype=torch.float64).float()
    top_experts = torch.stack([torch.randperm(NUM_EXPERTS, generator=generator)[:TOPK] for _ in range(batch)])
    return tokens.to(dtype), probs, top_experts, fc1.to(dtype), fc2.to(dtype)


def _naive(tokens, probs, top_experts, fc1, fc2, residual_scale, update_scale, local: int = NUM_EXPERTS):
    """Each token's chosen experts one by one in fp64 (those numbered ``local`` or more: another rank's)."""
    out = residual_scale * tokens.double()
    for token in range(tokens.shape[0]):
        for slot in range(top_experts.shape[1]):
            expert = int(top_experts[token, slot])
            if expert >= local:
                continue
            gate, up = (fc1[expert].double() @ tokens[token].double()).chunk(2)
            hidden = torch.nn.functional.silu(gate) * up
            out[token] += update_scale * probs[token, slot].double() * (fc2[expert].double() @ hidden)
    return out


@pytest.mark.parametrize("dtype, tolerance", [(torch.float32, 1e-5), (torch.bfloat16, 5e-2)], ids=["fp32", "bf16"])
@pytest.mark.parametrize("batch", [1, 9])
def test_decode_experts_through_the_kernels_equal_the_naive_experts(kernels_on_the_cpu, dtype, tolerance, batch):
    """decode_experts and a rank's part under EP (experts 4-6 another rank's), with the kernels doing
    the bookkeeping around torch's grouped products."""
    tokens, probs, top_experts, fc1, fc2 = _expert_inputs(batch, dtype, seed=batch)
    result = decode_experts(tokens, probs, top_experts, fc1, fc2, 1.0, 0.5)
    torch.testing.assert_close(result.double(), _naive(tokens, probs, top_experts, fc1, fc2, 1.0, 0.5),
                               rtol=tolerance, atol=tolerance)
    local = top_experts.clamp(max=4)
    result = local_expert_products(tokens, probs, local, fc1[:4], fc2[:4], 0.0, 1.0)
    torch.testing.assert_close(result.double(), _naive(tokens, probs, local, fc1, fc2, 0.0, 1.0, local=4),
                               rtol=tolerance, atol=tolerance)


def test_cpu_without_interpreter_raises_clear_error():
    compiled = load_kernels_module(KERNELS, interpret=False, name="_experts_triton_compiled")
    with pytest.raises(RuntimeError, match="need a CUDA GPU.*TRITON_INTERPRET=1"):
        compiled.swiglu_triton(torch.randn(2, 8), torch.tensor([2], dtype=torch.int32))


def test_without_triton_module_imports_and_call_raises(monkeypatch: pytest.MonkeyPatch):
    """CPU-only installs have no triton: the module imports (the ops register their CUDA kernels
    anyway), and a call says what is missing."""
    monkeypatch.setitem(sys.modules, "triton", None)
    without_triton = load_kernels_module(KERNELS, interpret=False, name="_experts_triton_without_triton")
    with pytest.raises(RuntimeError, match="need the triton package"):
        without_triton.swiglu_triton(torch.randn(2, 8), torch.tensor([2], dtype=torch.int32))
