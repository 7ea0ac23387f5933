"""models/matmul.py: the dense products on oneDNN (cpu_matmul.cpp) against fp64 references, their
gradients and layouts, the fall-back to torch's products, and Megatron's linears running them."""

from __future__ import annotations

import pytest
import torch

from megacispo.models import cpu_kernels, matmul
from megacispo.parallel.multiprocess import run_distributed

needs_onednn = pytest.mark.skipif(not matmul.onednn_available(), reason="oneDNN takes no fp32 products on this CPU")

# fp32 sums of up to 300 products of unit normals: a few 1e-6 relative to the result's scale.
TOLERANCE = 1e-5


def _operand(shape: tuple[int, ...], layout: str, generator: torch.Generator) -> torch.Tensor:
    """A [.., rows, columns] operand laid out contiguous, as a transposed view, or as a strided slice
    (neither: the op copies it)."""
    *batch, rows, columns = shape
    if layout == "contiguous":
        return torch.randn(shape, generator=generator)
    if layout == "transposed":
        return torch.randn(*batch, columns, rows, generator=generator).mT
    return torch.randn(*batch, rows, 2 * columns, generator=generator)[..., ::2]


def _relative_error(actual: torch.Tensor, reference: torch.Tensor) -> float:
    """max |actual - reference| over max(|reference|, 1); 0 for empty tensors."""
    if not reference.numel():
        return 0.0
    return (actual.double() - reference).abs().max().item() / max(reference.abs().max().item(), 1.0)


def _graph_names(tensor: torch.Tensor) -> set[str]:
    names, stack = set(), [tensor.grad_fn]
    while stack:
        node = stack.pop()
        if node is not None:
            names.add(node.name())
            stack.extend(next_node for next_node, _ in node.next_functions)
    return names


ONEDNN_BACKWARD = "GeneratedBackwardFor_megacispo_onednn_mm_defaultBackward"


@needs_onednn
@pytest.mark.parametrize("batch", [(), (3,), (2, 1, 3)])
@pytest.mark.parametrize("m, k, n", [(1, 1, 1), (7, 33, 5), (37, 256, 129), (0, 8, 4), (4, 0, 6), (5, 8, 0)])
@pytest.mark.parametrize("layouts", [("contiguous", "contiguous"), ("contiguous", "transposed"),
                                     ("transposed", "contiguous"), ("strided", "transposed")])
def test_mm_equals_the_fp64_product_and_its_gradients(batch, m, k, n, layouts):
    generator = torch.Generator().manual_seed(m * 1000 + k * 10 + n)
    a = _operand((*batch, m, k), layouts[0], generator).requires_grad_(True)
    b = _operand((*batch, k, n), layouts[1], generator).requires_grad_(True)
    grad_out = torch.randn(*batch, m, n, generator=generator)
    out = matmul.mm(a, b)
    assert ONEDNN_BACKWARD in _graph_names(out)
    out.backward(grad_out)
    a64, b64 = (x.detach().double().requires_grad_(True) for x in (a, b))
    reference = a64 @ b64
    reference.backward(grad_out.double())
    assert out.shape == reference.shape and out.dtype == torch.float32
    for name, actual, expected in (("out", out, reference), ("grad a", a.grad, a64.grad), ("grad b", b.grad, b64.grad)):
        assert actual.shape == expected.shape, name
        assert _relative_error(actual, expected) <= TOLERANCE, name


@needs_onednn
def test_gradients_take_their_inputs_layout():
    generator = torch.Generator().manual_seed(1)
    rows = torch.randn(2, 9, 16, generator=generator, requires_grad=True)
    weight = torch.randn(24, 16, generator=generator, requires_grad=True)
    matmul.linear(rows, weight).sum().backward()
    assert weight.grad.is_contiguous() and rows.grad.is_contiguous()
    a = torch.randn(16, 9, generator=generator).requires_grad_(True)
    out = matmul.mm(a.T, weight.detach().T)
    (grad_a,) = torch.autograd.grad(out.sum(), a)
    assert grad_a.is_contiguous()  # computed transposed, for a's transposed view


@needs_onednn
def test_linear_equals_f_linear_in_fp64():
    generator = torch.Generator().manual_seed(2)
    rows, weight = torch.randn(3, 11, 40, generator=generator), torch.randn(17, 40, generator=generator)
    out = matmul.linear(rows, weight)
    expected = torch.nn.functional.linear(rows.double(), weight.double())
    assert out.shape == (3, 11, 17)
    assert _relative_error(out, expected) <= TOLERANCE


@needs_onednn
def test_addmm_accumulates_into_a_block_of_rows():
    generator = torch.Generator().manual_seed(3)
    out = torch.randn(10, 12, generator=generator)
    a, b = torch.randn(24, 4, generator=generator).T, torch.randn(24, 12, generator=generator)
    expected = out.double().clone()
    expected[3:7] += a.double() @ b.double()
    block = out[3:7]
    assert matmul.addmm_(block, a, b) is block
    assert _relative_error(out, expected) <= TOLERANCE
    strided = torch.zeros(4, 24)[:, ::2]  # not contiguous: torch's addmm_
    matmul.addmm_(strided, a, b)
    assert torch.equal(strided, torch.zeros(4, 24)[:, ::2].addmm_(a, b))


def test_broadcasting_and_vectors_take_torchs_matmul():
    generator = torch.Generator().manual_seed(7)
    within, states = torch.randn(4, 6, 6, generator=generator), torch.randn(2, 4, 6, 9, generator=generator)
    assert torch.equal(matmul.mm(within, states), within @ states)
    rows, vector = torch.randn(5, 9, generator=generator), torch.randn(9, generator=generator)
    assert torch.equal(matmul.mm(rows, vector), rows @ vector)


def test_other_dtypes_and_no_kernels_take_torchs_products(monkeypatch):
    generator = torch.Generator().manual_seed(4)
    a, b = torch.randn(6, 5, dtype=torch.float64, generator=generator), torch.randn(5, 3, dtype=torch.float64)
    assert torch.equal(matmul.mm(a, b), a @ b)
    rows, weight = torch.randn(4, 8, generator=generator), torch.randn(6, 8, generator=generator)
    monkeypatch.setattr(cpu_kernels, "_loaded", False)
    out = matmul.linear(rows.requires_grad_(True), weight)
    assert torch.equal(out, torch.nn.functional.linear(rows, weight))
    assert ONEDNN_BACKWARD not in _graph_names(out)


@needs_onednn
def test_the_op_names_its_bad_operands():
    op = torch.ops.megacispo
    with pytest.raises(RuntimeError, match="a and b must be float32"):
        op.onednn_mm(torch.randn(2, 3), torch.randn(3, 2, dtype=torch.float64))
    with pytest.raises(RuntimeError, match="both 2-D or both 3-D"):
        op.onednn_mm(torch.randn(2, 3), torch.randn(1, 3, 2))
    with pytest.raises(RuntimeError, match="cannot be multiplied"):
        op.onednn_mm(torch.randn(2, 3), torch.randn(4, 2))
    with pytest.raises(RuntimeError, match=r"out must be a contiguous float32 \[2, 5\]"):
        op.onednn_addmm_(torch.zeros(5, 2), torch.randn(2, 3), torch.randn(3, 5))


def _megatron_linears() -> dict:
    """local_column_parallel_linear and row_parallel_linear in a world of one: outputs and gradients
    against fp64, and which autograd nodes they ran."""
    from megacispo.models.config import model_config, transformer_config
    from megacispo.models.layers import local_column_parallel_linear, row_parallel_linear
    from megacispo.parallel.layout import ParallelConfig, init_distributed
    from megatron.core import parallel_state

    parallel = ParallelConfig()
    init_distributed(parallel, seed=5)
    config = transformer_config(model_config("tiny"), parallel)
    tp_group = parallel_state.get_tensor_model_parallel_group()
    generator = torch.Generator().manual_seed(6)
    results = {}
    for name, builder in (("column", local_column_parallel_linear), ("row", row_parallel_linear)):
        layer = builder(config, 48, 80, tp_group)
        hidden = torch.randn(7, 3, 48, generator=generator, requires_grad=True)
        grad_out = torch.randn(7, 3, 80, generator=generator)
        out, _ = layer(hidden)
        out.backward(grad_out)
        hidden64 = hidden.detach().double().requires_grad_(True)
        weight64 = layer.weight.detach().double().requires_grad_(True)
        expected = torch.nn.functional.linear(hidden64, weight64)
        expected.backward(grad_out.double())
        results[name] = {
            "onednn": ONEDNN_BACKWARD in _graph_names(out),
            "errors": [_relative_error(actual, reference) for actual, reference in ((out, expected), (hidden.grad, hidden64.grad),
                                                 (layer.weight.grad, weight64.grad))],
        }
    # Where oneDNN does not apply (here: no kernels), Megatron's own product runs.
    cpu_kernels._loaded = False
    out, _ = local_column_parallel_linear(config, 48, 80, tp_group)(torch.randn(7, 3, 48, requires_grad=True))
    results["without kernels"] = sorted(name for name in _graph_names(out) if "Linear" in name)
    return results


@needs_onednn
def test_megatrons_linears_run_the_onednn_product():
    (results,) = run_distributed(_megatron_linears, 1)
    assert results.pop("without kernels") == ["LinearWithGradAccumulationAndAsyncCommunicationBackward"]
    for name, result in results.items():
        assert result["onednn"], name
        assert max(result["errors"]) <= TOLERANCE, (name, result["errors"])
