"""The CPU layer's kernels (parallel/cpu/csrc/, switched on by ``megacispo.parallel.cpu``) against
fp64 references on random inputs of odd sizes:

- torch's fp32 products with the layer's kernels in its dispatch (``@``, F.linear, mm(out=), bmm, addmm,
  addmm_, and their autograd): within 1e-5 of the operands' scale for 1 to 16 rows (the few-rows
  kernel), many rows (oneDNN where it takes fp32), one row per batch entry, transposed and
  strided operands and empty products; other dtypes are torch's own results, bit for bit; a row
  of a few-rows product gets the same bits alone, in any batch and with any number of threads;
  switched off, torch's own bits again;
- the model's decode-step ops ``megacispo::decode_experts`` (one C++ call per MoE layer) and
  ``megacispo::rms_norm``: their CPU kernels against the ops' torch implementations in fp64, with
  idle experts and a token per expert or many, odd widths; in bf16 the torch implementations
  themselves; bad inputs get an error naming the argument.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from megacispo.models.experts import decode_experts
from megacispo.models.layers import rms_norm
from megacispo.parallel import cpu

FEW_ROWS = 16


@pytest.fixture
def cpu_products():
    """The layer's products in torch's dispatch for one test, torch's own again after it."""
    # The README's set-up has what they need (g++, ninja): on its machines they must build.
    assert cpu.kernels_available()
    cpu.enable_kernels()
    yield
    cpu.disable_products()


def _scale(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return (a.double().abs() @ b.double().abs()).max().clamp(min=1.0)


def _assert_close_to_fp64(actual: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> None:
    expected = a.double() @ b.double()
    assert actual.shape == expected.shape and actual.dtype == torch.float32
    # fp32 sums of k products: well within 1e-5 of the operands' scale.
    assert (actual.double() - expected).abs().max() <= 1e-5 * _scale(a, b)


@pytest.mark.parametrize("num_rows", [1, 2, 3, 5, 8, FEW_ROWS, FEW_ROWS + 1, 64])
@pytest.mark.parametrize("out_features", [1, 7, 257])
@pytest.mark.parametrize("in_features", [5, 37, 256])
def test_linear_equals_the_fp64_product(cpu_products, num_rows, out_features, in_features):
    generator = torch.Generator().manual_seed(num_rows * 1000 + out_features + in_features)
    rows = torch.randn(num_rows, in_features, generator=generator)
    weight = torch.randn(out_features, in_features, generator=generator)
    with torch.no_grad():
        _assert_close_to_fp64(F.linear(rows, weight), rows, weight.T)


@pytest.mark.parametrize("shape", [(4, 0, 3), (0, 5, 3), (4, 5, 0), (1, 0, 3)])
def test_empty_products(cpu_products, shape):
    m, k, n = shape
    product = torch.randn(m, k) @ torch.randn(k, n)
    assert torch.equal(product, torch.zeros(m, n))


def test_layouts_and_batched_products(cpu_products):
    generator = torch.Generator().manual_seed(7)
    a, b = torch.randn(23, 41, generator=generator), torch.randn(41, 19, generator=generator)
    for left in (a, a.T.contiguous().T, torch.randn(23, 82, generator=generator)[:, ::2]):
        for right in (b, b.T.contiguous().T):
            _assert_close_to_fp64(left @ right, left, right)
    for rows in (1, 5):  # one row per batch entry (a decode step's q_t S_t), and more
        x, y = torch.randn(2, 3, rows, 16, generator=generator), torch.randn(2, 3, 16, 9, generator=generator)
        _assert_close_to_fp64(x @ y, x, y)
        _assert_close_to_fp64(x @ y.transpose(-1, -2).contiguous().transpose(-1, -2), x, y)


@pytest.mark.parametrize("num_rows", [1, FEW_ROWS, 40])
def test_the_out_form_compiled_graphs_call(cpu_products, num_rows):
    generator = torch.Generator().manual_seed(num_rows)
    rows, weight = torch.randn(num_rows, 37, generator=generator), torch.randn(29, 37, generator=generator)
    for out in (torch.empty(num_rows, 29), torch.empty(0)):  # the right shape, and one to resize
        torch.mm(rows, weight.T, out=out)
        _assert_close_to_fp64(out, rows, weight.T)


def test_addmm_in_place_and_with_bias(cpu_products):
    generator = torch.Generator().manual_seed(8)
    a, b = torch.randn(9, 33, generator=generator), torch.randn(33, 21, generator=generator)
    out = torch.randn(20, 21, generator=generator)
    expected = out.double()
    expected[4:13] += a.double() @ b.double()
    out[4:13].addmm_(a, b)  # a block of rows, as the fused LM head's backward accumulates
    assert (out.double() - expected).abs().max() <= 1e-5 * _scale(a, b)
    bias = torch.randn(21, generator=generator)
    with_bias = torch.addmm(bias, a, b, beta=0.5, alpha=2.0)
    expected = 0.5 * bias.double() + 2.0 * (a.double() @ b.double())
    assert (with_bias.double() - expected).abs().max() <= 2e-5 * _scale(a, b)
    # A decode step's output projection with the residual (rows @ weight.T: the few-rows kernel).
    weight, residual = b.t().contiguous(), torch.randn(9, 21, generator=generator)
    with_residual = torch.addmm(residual, a, weight.t(), beta=1.5, alpha=0.5)
    expected = 1.5 * residual.double() + 0.5 * (a.double() @ b.double())
    assert (with_residual.double() - expected).abs().max() <= 2e-5 * _scale(a, b)
    unread = torch.addmm(torch.full((9, 21), float("nan")), a, weight.t(), beta=0.0)
    assert (unread.double() - a.double() @ b.double()).abs().max() <= 1e-5 * _scale(a, b)


@pytest.mark.parametrize("num_rows", [3, 40])
def test_gradients_equal_the_fp64_gradients(cpu_products, num_rows):
    generator = torch.Generator().manual_seed(num_rows)
    inputs = [torch.randn(num_rows, 37, generator=generator), torch.randn(29, 37, generator=generator)]
    grad_out = torch.randn(num_rows, 29, generator=generator)
    leaves = [tensor.clone().requires_grad_(True) for tensor in inputs]
    F.linear(*leaves).backward(grad_out)
    references = [tensor.double().requires_grad_(True) for tensor in inputs]
    F.linear(*references).backward(grad_out.double())
    for leaf, reference in zip(leaves, references):
        assert (leaf.grad.double() - reference.grad).abs().max() <= 1e-5 * reference.grad.abs().max()


def test_a_few_rows_row_gets_the_same_bits_in_any_batch_and_thread_count(cpu_products):
    generator = torch.Generator().manual_seed(1)
    weight = torch.randn(301, 83, generator=generator)
    rows = torch.randn(FEW_ROWS, 83, generator=generator)
    threads = torch.get_num_threads()
    with torch.no_grad():
        alone = torch.cat([F.linear(rows[i : i + 1], weight) for i in range(FEW_ROWS)])
        assert torch.equal(F.linear(rows, weight), alone)
        assert torch.equal(F.linear(rows[3:10], weight), alone[3:10])
        try:
            torch.set_num_threads(1)
            assert torch.equal(F.linear(rows, weight), alone)
        finally:
            torch.set_num_threads(threads)


def test_other_dtypes_and_switching_off_give_torchs_own_bits():
    generator = torch.Generator().manual_seed(2)
    a, b = torch.randn(3, 24, generator=generator), torch.randn(24, 40, generator=generator)
    torch_own = {dtype: a.to(dtype) @ b.to(dtype) for dtype in (torch.float32, torch.float64, torch.bfloat16)}
    cpu.enable_kernels()
    try:
        for dtype in (torch.float64, torch.bfloat16):
            assert torch.equal(a.to(dtype) @ b.to(dtype), torch_own[dtype])
    finally:
        cpu.disable_products()
    assert torch.equal(a @ b, torch_own[torch.float32])


def _experts(num_experts: int, hidden: int, ffn: int, generator: torch.Generator):
    """The stacked expert weights decode_experts takes: fc1 [E, 2F, H], fc2 [E, H, F]."""
    fc1 = torch.randn(num_experts, 2 * ffn, hidden, generator=generator) / hidden**0.5
    fc2 = torch.randn(num_experts, hidden, ffn, generator=generator) / ffn**0.5
    return fc1, fc2


@pytest.mark.parametrize("batch", [1, 2, 5, 16, 33])
@pytest.mark.parametrize("scales", [(0.0, 1.0), (1.7, 0.6)])
def test_decode_experts_kernel_equals_the_fp64_experts(cpu_products, batch, scales):
    num_experts, topk, hidden, ffn = 6, 2, 37, 19
    generator = torch.Generator().manual_seed(batch)
    fc1, fc2 = _experts(num_experts, hidden, ffn, generator)
    tokens = torch.randn(batch, hidden, generator=generator)
    probs = torch.rand(batch, topk, generator=generator)
    # Experts 0 and 5 never chosen: idle experts are skipped, the others get 1 to many rows.
    top_experts = torch.stack([torch.randperm(4, generator=generator)[:topk] + 1 for _ in range(batch)])
    with torch.no_grad():
        actual = torch.ops.megacispo.decode_experts(tokens, probs, top_experts, fc1, fc2, *scales)
        expected = decode_experts(tokens.double(), probs.double(), top_experts, fc1.double(), fc2.double(), *scales)
    assert actual.shape == tokens.shape and actual.dtype == torch.float32
    assert (actual.double() - expected).abs().max() <= 1e-5 * expected.abs().max()


def test_decode_experts_in_bf16_is_the_torch_implementation(cpu_products):
    generator = torch.Generator().manual_seed(6)
    fc1, fc2 = _experts(4, 16, 8, generator)
    fc1, fc2 = fc1.bfloat16(), fc2.bfloat16()
    tokens, probs = torch.randn(3, 16, generator=generator).bfloat16(), torch.rand(3, 2, generator=generator)
    top_experts = torch.tensor([[0, 1], [2, 3], [1, 3]])
    with torch.no_grad():
        assert torch.equal(torch.ops.megacispo.decode_experts(tokens, probs, top_experts, fc1, fc2, 1.5, 1.0),
                           decode_experts(tokens, probs, top_experts, fc1, fc2, 1.5, 1.0))


def test_bad_inputs_name_the_argument(cpu_products):
    generator = torch.Generator().manual_seed(4)
    fc1, fc2 = _experts(3, 16, 8, generator)
    tokens, probs = torch.randn(2, 16, generator=generator), torch.rand(2, 2, generator=generator)
    op = torch.ops.megacispo.decode_experts
    with pytest.raises(RuntimeError, match="expert id 3 outside"):
        op(tokens, probs, torch.tensor([[0, 3], [1, 2]]), fc1, fc2, 1.0, 1.0)
    with pytest.raises(RuntimeError, match="fc1 weight must be a contiguous fp32"):
        op(tokens, probs, torch.tensor([[0, 1], [1, 2]]), fc1.double(), fc2, 1.0, 1.0)
    with pytest.raises(RuntimeError, match="expert 0 weights"):
        op(tokens, probs, torch.tensor([[0, 1], [1, 2]]), fc1[:, :, :8].contiguous(), fc2, 1.0, 1.0)


@pytest.mark.parametrize("num_rows", [1, 3, FEW_ROWS, 40])
@pytest.mark.parametrize("channels", [5, 37, 256])
def test_rms_norm_kernel_equals_the_fp64_norm(cpu_products, num_rows, channels):
    generator = torch.Generator().manual_seed(num_rows * 1000 + channels)
    rows, weight = torch.randn(num_rows, channels, generator=generator), torch.randn(channels, generator=generator)
    expected = rms_norm(rows.double(), weight.double(), 1e-5)
    actual = torch.ops.megacispo.rms_norm(rows, weight, 1e-5)
    assert actual.dtype == torch.float32 and actual.shape == rows.shape
    assert (actual.double() - expected).abs().max().item() <= 1e-6 * expected.abs().max().item()


def test_rms_norm_in_bf16_is_the_torch_implementation(cpu_products):
    generator = torch.Generator().manual_seed(9)
    rows, weight = torch.randn(3, 37, generator=generator).bfloat16(), torch.randn(37, generator=generator).bfloat16()
    assert torch.equal(torch.ops.megacispo.rms_norm(rows, weight, 1e-5), rms_norm(rows, weight, 1e-5))
