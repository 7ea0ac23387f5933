"""The dense products of training and prefill: oneDNN's fp32 kernels on a CPU, torch's elsewhere.

torch sends fp32 products on a CPU to MKL, which runs no AVX-512 code on AMD CPUs. oneDNN, built
into torch too, does: on a 2-core AMD EPYC VM with AVX-512 it multiplies at 470-560 GFLOP/s where
MKL reaches 210-240 (2048^3, and the ``small`` model's linear, expert and LM-head shapes, transposed
operands included), and an RL update of that model (benchmarks/rl_vs_hf.py) took 0.57 instead of
0.89 s. On CPUs without AVX-512 oneDNN refuses fp32 products and torch's run, as before.

``mm``, ``addmm_`` and ``linear`` run cpu_matmul.cpp's ops for fp32 tensors on a CPU where the
kernels are built and oneDNN takes fp32 (a CPU with AVX-512; tried once), and torch's products
otherwise. The sums are the same products in another order: results agree with torch's to fp32
rounding, not bit for bit. ``mm`` and ``linear`` are differentiable; ``addmm_`` is for backward
passes written by hand.
"""

from __future__ import annotations

import functools
import warnings

import torch
import torch.nn.functional as F

from megacispo.models.cpu_kernels import cpu_kernels_apply, cpu_kernels_available


def mm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a [..., m, k] @ b [..., k, n] -> [..., m, n]; oneDNN takes operands with the same leading
    dimensions, torch's matmul the others (broadcasting, vectors)."""
    if a.dim() < 2 or a.dim() != b.dim() or a.shape[:-2] != b.shape[:-2] or not onednn_applies(a, b):
        return a @ b
    if a.dim() <= 3:
        return torch.ops.megacispo.onednn_mm(a, b)
    batch = a.shape[:-2]
    # Views where the leading dimensions are contiguous, as the lightning layers' blocks are.
    product = torch.ops.megacispo.onednn_mm(a.reshape(batch.numel(), *a.shape[-2:]),
                                            b.reshape(batch.numel(), *b.shape[-2:]))
    return product.view(*batch, *product.shape[-2:])


def addmm_(out: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """out [m, n] += a [m, k] @ b [k, n], in place; no autograd."""
    if out.is_contiguous() and onednn_applies(out, a, b):
        torch.ops.megacispo.onednn_addmm_(out, a, b)
        return out
    return out.addmm_(a, b)


def linear(input: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """input [..., in] x weight [out, in] -> [..., out], F.linear without bias."""
    if not onednn_applies(input, weight):
        return F.linear(input, weight)
    rows = input.reshape(-1, input.shape[-1])
    return torch.ops.megacispo.onednn_mm(rows, weight.T).view(*input.shape[:-1], weight.shape[0])


def onednn_applies(*tensors: torch.Tensor) -> bool:
    """Whether these tensors' product runs on oneDNN: all fp32 on a CPU where it takes fp32, eager."""
    return cpu_kernels_apply(*tensors) and not torch.compiler.is_compiling() and onednn_available()


@functools.cache
def onednn_available() -> bool:
    """Whether oneDNN takes fp32 products here (it asks for AVX-512); tried on a small product once,
    after which the op's autograd is registered. False, with one warning, where it does not, and
    where the kernels are not built."""
    if not cpu_kernels_available():
        return False
    a = torch.arange(12, dtype=torch.float32).view(3, 4)
    try:
        product = torch.ops.megacispo.onednn_mm(a, a.T)
    except RuntimeError as error:
        warnings.warn(f"oneDNN does not take fp32 products on this CPU ({error}); the dense products run on "
                      "torch's BLAS instead.", stacklevel=3)
        return False
    if not torch.equal(product, a @ a.T):  # small integers: exact in any order
        raise RuntimeError(f"megacispo::onednn_mm computed {product.tolist()} for {(a @ a.T).tolist()}")
    torch.library.register_autograd("megacispo::onednn_mm", _mm_backward, setup_context=_mm_setup_context)
    return True


def _is_transposed(tensor: torch.Tensor) -> bool:
    return not tensor.is_contiguous() and tensor.mT.is_contiguous()


def _mm_setup_context(ctx, inputs, output) -> None:
    a, b = inputs
    ctx.save_for_backward(a if ctx.needs_input_grad[1] else None, b if ctx.needs_input_grad[0] else None)
    ctx.transposed = (_is_transposed(a), _is_transposed(b))


def _mm_backward(ctx, grad: torch.Tensor):
    a, b = ctx.saved_tensors
    a_transposed, b_transposed = ctx.transposed
    need_a, need_b = ctx.needs_input_grad
    return (
        _product_in_layout(grad, b.mT, a_transposed) if need_a else None,
        _product_in_layout(a.mT, grad, b_transposed) if need_b else None,
    )


def _product_in_layout(x: torch.Tensor, y: torch.Tensor, transposed: bool) -> torch.Tensor:
    """x @ y, computed as (y^T @ x^T)^T when ``transposed``: a gradient gets its input's layout, so
    a weight's gradient through ``weight.T`` arrives contiguous, as the weight is."""
    return mm(y.mT, x.mT).mT if transposed else mm(x, y)
