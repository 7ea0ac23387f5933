"""The CPU kernels (models/csrc/, built by models/cpu_kernels.py) against fp64 references on random
inputs of odd sizes:

- ``few_rows_linear`` (the kernel for 1 to FEW_ROWS fp32 rows; F.linear otherwise): within 1e-5 of
  the rows' scale; a row gets the same bits alone, in any batch and with any number of threads;
- ``decode_experts_cpu`` (one C++ call per MoE layer) against ``experts.decode_experts`` in fp64, with
  idle experts and a token per expert or many;
- the experts' SwiGLU for training (``swiglu_forward`` / ``swiglu_backward`` in ``expert_mlp`` under
  autograd): the forward the same bits as torch's ops, every gradient within 1e-5 of its scale of
  the fp64 autograd of torch's ops, with 0, 1 and odd numbers of rows and an odd width;
- bad inputs get an error naming the argument; without the kernels they fall back to torch's ops.
"""

from __future__ import annotations

import pytest
import torch

from megacispo.models import cpu_kernels
from megacispo.models.experts import decode_experts, expert_mlp
from megacispo.models.layers import FEW_ROWS, few_rows_linear
from megacispo.models.matmul import linear, mm
from megacispo.parallel.multiprocess import run_distributed


@pytest.fixture(autouse=True)
def _kernels_built():
    # The README's set-up has what they need (g++, ninja): on its machines they must build.
    assert cpu_kernels.cpu_kernels_available()


def _scale(rows: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return (rows.double().abs() @ weight.double().abs().T).max()


@pytest.mark.parametrize("num_rows", [1, 2, 3, 5, 8, FEW_ROWS])
@pytest.mark.parametrize("out_features", [1, 7, 50, 257])
@pytest.mark.parametrize("in_features", [5, 37, 256])
def test_few_rows_linear_equals_the_fp64_product(num_rows, out_features, in_features):
    generator = torch.Generator().manual_seed(num_rows * 1000 + out_features + in_features)
    rows = torch.randn(num_rows, in_features, generator=generator)
    weight = torch.randn(out_features, in_features, generator=generator)
    with torch.no_grad():
        actual = few_rows_linear(rows, weight)
    assert actual.shape == (num_rows, out_features) and actual.dtype == torch.float32 and actual.is_contiguous()
    # fp32 sums of in_features products: well within 1e-5 of the rows' scale.
    expected = rows.double() @ weight.double().T
    assert (actual.double() - expected).abs().max() <= 1e-5 * _scale(rows, weight)


def test_a_row_gets_the_same_bits_in_any_batch_and_thread_count():
    generator = torch.Generator().manual_seed(1)
    weight = torch.randn(301, 83, generator=generator)
    rows = torch.randn(FEW_ROWS, 83, generator=generator)
    threads = torch.get_num_threads()
    with torch.no_grad():
        alone = torch.cat([few_rows_linear(rows[i : i + 1], weight) for i in range(FEW_ROWS)])
        assert torch.equal(few_rows_linear(rows, weight), alone)
        assert torch.equal(few_rows_linear(rows[3:10], weight), alone[3:10])
        try:
            torch.set_num_threads(1)
            assert torch.equal(few_rows_linear(rows, weight), alone)
        finally:
            torch.set_num_threads(threads)


def test_few_rows_linear_takes_matmul_linear_beyond_the_kernel():
    generator = torch.Generator().manual_seed(2)
    weight = torch.randn(40, 24, generator=generator)
    many = torch.randn(FEW_ROWS + 1, 24, generator=generator)
    wide = torch.randn(3, 48, generator=generator)
    with torch.no_grad():
        assert torch.equal(few_rows_linear(many, weight), linear(many, weight))
        # Non-contiguous rows are made contiguous: the kernel's bits, whatever the caller's layout.
        assert torch.equal(few_rows_linear(wide[:, ::2], weight), few_rows_linear(wide[:, ::2].contiguous(), weight))
        assert torch.equal(few_rows_linear(many[:2].double(), weight.double()),
                           torch.nn.functional.linear(many[:2].double(), weight.double()))
    rows = many[:1].clone().requires_grad_()
    assert torch.equal(few_rows_linear(rows, weight), linear(rows, weight))


def _experts(num_experts: int, hidden: int, ffn: int, generator: torch.Generator):
    fc1 = [torch.randn(2 * ffn, hidden, generator=generator) / hidden**0.5 for _ in range(num_experts)]
    fc2 = [torch.randn(hidden, ffn, generator=generator) / ffn**0.5 for _ in range(num_experts)]
    return fc1, fc2


@pytest.mark.parametrize("batch", [1, 2, 5, 16, 33])
def test_decode_experts_equals_the_fp64_experts(batch):
    num_experts, topk, hidden, ffn = 6, 2, 37, 19
    generator = torch.Generator().manual_seed(batch)
    fc1, fc2 = _experts(num_experts, hidden, ffn, generator)
    tokens = torch.randn(batch, hidden, generator=generator)
    probs = torch.rand(batch, topk, generator=generator)
    # Experts 0 and 5 never chosen: idle experts are skipped, the others get 1 to many rows.
    top_experts = torch.stack([torch.randperm(4, generator=generator)[:topk] + 1 for _ in range(batch)])
    with torch.no_grad():
        actual = torch.ops.megacispo.decode_experts_cpu(tokens, probs, top_experts, fc1, fc2)
        expected = decode_experts(
            tokens.double(), probs.double(), top_experts, [w.double() for w in fc1], [w.double() for w in fc2]
        )
    assert actual.shape == tokens.shape and actual.dtype == torch.float32
    assert (actual.double() - expected).abs().max() <= 1e-5 * expected.abs().max()


def test_bad_inputs_name_the_argument():
    generator = torch.Generator().manual_seed(4)
    fc1, fc2 = _experts(3, 16, 8, generator)
    tokens, probs = torch.randn(2, 16, generator=generator), torch.rand(2, 2, generator=generator)
    op = torch.ops.megacispo.decode_experts_cpu
    with pytest.raises(RuntimeError, match="expert id 3 outside"):
        op(tokens, probs, torch.tensor([[0, 3], [1, 2]]), fc1, fc2)
    with pytest.raises(RuntimeError, match="fc1 weight must be a contiguous fp32"):
        op(tokens, probs, torch.tensor([[0, 1], [1, 2]]), [fc1[0].double(), *fc1[1:]], fc2)
    with pytest.raises(RuntimeError, match="expert 1 weights"):
        op(tokens, probs, torch.tensor([[0, 1], [1, 2]]), [fc1[0], fc1[1][:, :8].contiguous(), fc1[2]], fc2)
    with pytest.raises(RuntimeError, match="1 to 16 rows"):
        torch.ops.megacispo.few_rows_linear(torch.randn(17, 16), fc2[0].T.contiguous())
    with pytest.raises(RuntimeError, match=r"rows \[m, C\] and weight \[C\]"):
        torch.ops.megacispo.rms_norm_rows(torch.randn(2, 16), torch.ones(15), 1e-5)
    with pytest.raises(RuntimeError, match="weight must be a contiguous fp32"):
        torch.ops.megacispo.rms_norm_rows(torch.randn(2, 16), torch.ones(16, dtype=torch.float64), 1e-5)


@pytest.mark.parametrize("num_rows", [1, 3, FEW_ROWS])
@pytest.mark.parametrize("channels", [5, 37, 256])
def test_rms_norm_rows_equals_the_fp64_norm(num_rows, channels):
    generator = torch.Generator().manual_seed(num_rows * 1000 + channels)
    rows, weight = torch.randn(num_rows, channels, generator=generator), torch.randn(channels, generator=generator)
    rows64 = rows.double()
    expected = weight.double() * (rows64 / torch.sqrt((rows64 * rows64).mean(-1, keepdim=True) + 1e-5))
    actual = torch.ops.megacispo.rms_norm_rows(rows, weight, 1e-5)
    assert actual.dtype == torch.float32 and actual.shape == rows.shape
    assert (actual.double() - expected).abs().max().item() <= 1e-6 * expected.abs().max().item()


def _norms_on_decode_rows() -> dict:
    """RMSNorm and TensorParallelRMSNorm (TP = 1) in a world of one: which rows take the kernel."""
    from megatron.core import parallel_state

    from megacispo.models.config import model_config, transformer_config
    from megacispo.models.layers import RMSNorm, TensorParallelRMSNorm, _rms_normalize, _sum_of_squares
    from megacispo.parallel.layout import ParallelConfig, init_distributed

    assert cpu_kernels.cpu_kernels_available()
    init_distributed(ParallelConfig(), seed=8)
    config = transformer_config(model_config("tiny"), ParallelConfig())
    norm = RMSNorm(config, 64, eps=1e-5)
    tp_norm = TensorParallelRMSNorm(config, 64, eps=1e-5, tp_group=parallel_state.get_tensor_model_parallel_group())
    generator = torch.Generator().manual_seed(8)
    rows, many = torch.randn(3, 64, generator=generator), torch.randn(FEW_ROWS + 1, 64, generator=generator)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(64, generator=generator))
        tp_norm.weight.copy_(norm.weight)
        kernel = torch.ops.megacispo.rms_norm_rows(rows, norm.weight, 1e-5)
        torch_ops = _rms_normalize(many, many, _sum_of_squares(many), 64, 1e-5, norm.weight)
        results = {"decode rows": torch.equal(norm(rows), kernel), "tp decode rows": torch.equal(tp_norm(rows), kernel),
                   "many rows": torch.equal(norm(many), torch_ops)}
    with_grad = norm(rows)
    results["autograd"] = with_grad.grad_fn is not None and torch.allclose(with_grad, kernel, rtol=1e-6, atol=1e-6)
    return results


def test_the_norms_take_the_kernel_for_decode_rows_only():
    (results,) = run_distributed(_norms_on_decode_rows, 1)
    assert results == {"decode rows": True, "tp decode rows": True, "many rows": True, "autograd": True}


def test_without_the_kernels_few_rows_linear_is_f_linear(monkeypatch):
    generator = torch.Generator().manual_seed(5)
    rows, weight = torch.randn(5, 24, generator=generator), torch.randn(12, 24, generator=generator)
    monkeypatch.setattr(cpu_kernels, "_loaded", False)
    with torch.no_grad():
        assert torch.equal(few_rows_linear(rows, weight), torch.nn.functional.linear(rows, weight))


def _torch_ops_expert(tokens, probs, fc1, fc2):
    """expert_mlp's math in torch's ops, with the same products (matmul.mm)."""
    gate, up = mm(tokens, fc1.T).chunk(2, dim=-1)
    return mm(torch.nn.functional.silu(gate) * up * probs[:, None], fc2.T)


@pytest.mark.parametrize("num_rows", [0, 1, 7, 33])
@pytest.mark.parametrize("ffn", [5, 12, 19, 40, 64])
def test_swiglu_expert_equals_torch_ops_and_the_fp64_gradients(num_rows, ffn):
    hidden = 37
    generator = torch.Generator().manual_seed(num_rows * 100 + ffn)
    (fc1,), (fc2,) = _experts(1, hidden, ffn, generator)
    inputs = [torch.randn(num_rows, hidden, generator=generator), torch.rand(num_rows, generator=generator), fc1, fc2]
    grad_out = torch.randn(num_rows, hidden, generator=generator)
    leaves = [tensor.clone().requires_grad_(True) for tensor in inputs]
    output = expert_mlp(*leaves)
    assert output.grad_fn.name() == "_SwiGLUExpertBackward"
    output.backward(grad_out)
    with torch.no_grad():  # the forward: torch's ops, bit for bit
        assert torch.equal(output, _torch_ops_expert(*inputs))
    references = [tensor.double().requires_grad_(True) for tensor in inputs]
    _torch_ops_expert(*references).backward(grad_out.double())
    for name, leaf, reference in zip(("tokens", "probs", "fc1", "fc2"), leaves, references):
        assert leaf.grad.shape == reference.grad.shape, name
        if reference.grad.numel():  # an idle expert still gets (zero) weight gradients
            scale = reference.grad.abs().max().clamp(min=1.0)
            assert (leaf.grad.double() - reference.grad).abs().max() <= 1e-5 * scale, name


def test_swiglu_kernels_name_bad_inputs():
    projected, probs = torch.randn(4, 10), torch.rand(4)
    with pytest.raises(RuntimeError, match="projected must be a contiguous"):
        torch.ops.megacispo.swiglu_forward(torch.randn(4, 9), probs)
    with pytest.raises(RuntimeError, match="probs must be a contiguous"):
        torch.ops.megacispo.swiglu_forward(projected, torch.rand(3))
    with pytest.raises(RuntimeError, match="must be float32"):
        torch.ops.megacispo.swiglu_forward(projected.double(), probs)
    with pytest.raises(RuntimeError, match=r"grad_weighted must be a contiguous float32 \[4, 5\]"):
        torch.ops.megacispo.swiglu_backward(torch.randn(4, 6), projected, probs)


def test_without_the_kernels_the_expert_runs_torchs_ops(monkeypatch):
    generator = torch.Generator().manual_seed(3)
    (fc1,), (fc2,) = _experts(1, 12, 7, generator)
    tokens = torch.randn(5, 12, generator=generator).requires_grad_(True)
    monkeypatch.setattr(cpu_kernels, "_loaded", False)
    output = expert_mlp(tokens, torch.rand(5, generator=generator), fc1, fc2)
    assert output.grad_fn.name() != "_SwiGLUExpertBackward"
