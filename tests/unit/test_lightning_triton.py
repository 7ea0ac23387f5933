"""Triton lightning-attention kernels against the naive recurrence, run in Triton's CPU interpreter.

The tests load private copies of megacispo.models.lightning_triton with TRITON_INTERPRET set (or
unset) just for that import (megacispo.testing.triton_modules); the kernels use only Triton's
builtins, and a test here fails if not. The interpreter runs every kernel program in Python, so the
sizes are tiny: block 16, head dim 16, a few dozen tokens.
"""

import sys

import pytest
import torch

pytest.importorskip("triton", reason="triton is not installed (pip install -e '.[test]'); the kernels need it")

from megacispo.models.lightning import lightning_attention, lightning_attention_reference  # noqa: E402
from megacispo.testing.triton_modules import load_kernels_module  # noqa: E402


KERNELS = "megacispo.models.lightning_triton"
_interpreted = load_kernels_module(KERNELS, interpret=True, name="_lightning_triton_interpreted")
lightning_attention_triton = _interpreted.lightning_attention_triton

BLOCK = 16
HEADS = 2
HEAD_DIM = 16
DECAY = torch.tensor([0.7, 0.05])  # a fast and a slow head: exp(-0.7 * 16) ~ 1e-5 across a block


def _random_inputs(
    batch: int, seq_len: int, num_states: int | None, head_dim: int = HEAD_DIM, seed: int = 0
) -> tuple[torch.Tensor, ...]:
    """q, k, v [batch, seq_len, HEADS, head_dim] and an initial state [num_states, HEADS, d, d] (or None)."""
    generator = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(batch, seq_len, HEADS, head_dim, generator=generator) for _ in range(3))
    initial = None if num_states is None else torch.randn(num_states, HEADS, head_dim, head_dim, generator=generator)
    return q, k, v, initial


def _forward_backward(fn, inputs: tuple[torch.Tensor, ...], dtype: torch.dtype, **kwargs):
    """Run fn(q, k, v, DECAY, initial) on inputs cast to dtype (DECAY stays fp32: both functions take
    the rates in any dtype) and backpropagate a fixed random weighting of (out, final state).

    Returns (out, final_state, [grad q, grad k, grad v, grad initial]).
    """
    leaves = [None if x is None else x.to(dtype, copy=True).requires_grad_(True) for x in inputs]
    q, k, v, initial = leaves
    out, final_state = fn(q, k, v, DECAY, initial, **kwargs)
    generator = torch.Generator().manual_seed(1)
    out_weight = torch.randn(out.shape, generator=generator, dtype=torch.float64).to(out.device)
    final_weight = torch.randn(final_state.shape, generator=generator, dtype=torch.float64).to(out.device)
    loss = (out.double() * out_weight).sum() + (final_state.double() * final_weight).sum()
    loss.backward()
    return out, final_state, [None if x is None else x.grad for x in leaves]


def _assert_close(actual: torch.Tensor, expected: torch.Tensor, tol: float) -> None:
    """Every element within tol relative to the largest reference magnitude (elementwise relative
    error is meaningless where values cancel to ~0)."""
    scale = expected.abs().max().item()
    torch.testing.assert_close(actual.double(), expected.double(), rtol=tol, atol=tol * scale)


def _assert_matches(result, expected, tol: float) -> None:
    out, final_state, grads = result
    ref_out, ref_final, ref_grads = expected
    _assert_close(out, ref_out, tol)
    _assert_close(final_state, ref_final, tol)
    assert (grads[3] is None) == (ref_grads[3] is None)
    for grad, ref_grad in zip(grads, ref_grads):
        if ref_grad is not None:
            _assert_close(grad, ref_grad, tol)


@pytest.mark.parametrize("with_initial_state", [False, True], ids=["zero_state", "initial_state"])
@pytest.mark.parametrize("seq_len", [1, BLOCK - 1, BLOCK, BLOCK + 1, 2 * BLOCK + 5])
def test_fp32_matches_recurrence(seq_len: int, with_initial_state: bool) -> None:
    inputs = _random_inputs(batch=2, seq_len=seq_len, num_states=2 if with_initial_state else None, seed=seq_len)
    result = _forward_backward(lightning_attention_triton, inputs, torch.float32, block_size=BLOCK)
    expected = _forward_backward(lightning_attention_reference, inputs, torch.float64)
    _assert_matches(result, expected, tol=1e-4)


def test_packed_documents_match_independent_recurrences() -> None:
    """State resets at every document start, each document gets its own initial / final state."""
    doc_lengths = [5, BLOCK, 1, BLOCK + 4]  # short, exactly one block, one token, partial second block
    cu_seqlens = torch.tensor([0, *torch.tensor(doc_lengths).cumsum(0).tolist()])
    inputs = _random_inputs(batch=1, seq_len=sum(doc_lengths), num_states=len(doc_lengths), seed=7)
    result = _forward_backward(
        lightning_attention_triton, inputs, torch.float32, cu_seqlens=cu_seqlens, block_size=BLOCK
    )

    def per_document_reference(q, k, v, decay, initial):
        outs, finals = [], []
        for doc, (start, end) in enumerate(zip(cu_seqlens[:-1].tolist(), cu_seqlens[1:].tolist())):
            out, final = lightning_attention_reference(
                q[:, start:end], k[:, start:end], v[:, start:end], decay, initial[doc : doc + 1]
            )
            outs.append(out)
            finals.append(final)
        return torch.cat(outs, dim=1), torch.cat(finals, dim=0)

    expected = _forward_backward(per_document_reference, inputs, torch.float64)
    _assert_matches(result, expected, tol=1e-4)


def test_head_dim_over_one_tile() -> None:
    """head_dim 72 pads to 128: 2 x 2 state tiles, 2 column tiles, and masked padding features."""
    inputs = _random_inputs(batch=1, seq_len=BLOCK + 3, num_states=1, head_dim=72, seed=3)
    result = _forward_backward(lightning_attention_triton, inputs, torch.float32, block_size=BLOCK)
    expected = _forward_backward(lightning_attention_reference, inputs, torch.float64)
    _assert_matches(result, expected, tol=1e-4)


def test_bf16_inputs_default_block_size() -> None:
    """bf16 in and out (fp32 accumulation), default block 64 with a partial second block.

    The reference runs on the same bf16-rounded inputs in fp64, so the error is only the kernel's
    bf16 rounding of the output and of the scores / states it multiplies: a few bf16 ulps (2^-8).
    """
    inputs = _random_inputs(batch=1, seq_len=70, num_states=1, seed=5)
    rounded = tuple(x.bfloat16().float() for x in inputs)
    out, final_state, grads = _forward_backward(lightning_attention_triton, rounded, torch.bfloat16)
    assert out.dtype == final_state.dtype == torch.bfloat16
    assert all(grad.dtype == torch.bfloat16 for grad in grads)
    expected = _forward_backward(lightning_attention_reference, rounded, torch.float64)
    _assert_matches((out, final_state, grads), expected, tol=3e-2)


def test_rejects_block_size_that_is_not_a_power_of_two() -> None:
    q, k, v, _ = _random_inputs(batch=1, seq_len=4, num_states=None)
    for block_size in (8, 24):
        with pytest.raises(ValueError, match="block_size"):
            lightning_attention_triton(q, k, v, DECAY, block_size=block_size)


def test_cpu_without_interpreter_raises_clear_error() -> None:
    """Without TRITON_INTERPRET the kernels are compiled for a GPU: CPU tensors must be refused."""
    compiled = load_kernels_module(KERNELS, interpret=False, name="_lightning_triton_compiled")
    q, k, v, _ = _random_inputs(batch=1, seq_len=4, num_states=None)
    with pytest.raises(RuntimeError, match="needs a CUDA GPU.*TRITON_INTERPRET=1"):
        compiled.lightning_attention_triton(q, k, v, DECAY)


def test_without_triton_module_imports_and_call_raises(monkeypatch: pytest.MonkeyPatch) -> None:
    """CPU-only installs have no triton: importing must work (the lead dispatches on q.is_cuda)."""
    monkeypatch.setitem(sys.modules, "triton", None)  # makes `import triton` raise ImportError
    without_triton = load_kernels_module(KERNELS, interpret=False, name="_lightning_triton_without_triton")
    q, k, v, _ = _random_inputs(batch=1, seq_len=4, num_states=None)
    with pytest.raises(RuntimeError, match="needs the triton package"):
        without_triton.lightning_attention_triton(q, k, v, DECAY)


def _blockwise_torch(q, k, v, decay, initial, cu_seqlens=None):
    """The block-wise torch implementation: ``lightning_attention`` picks it for CPU tensors (CUDA
    ones go to the Triton kernel), so it runs on CPU copies; autograd carries the gradients back."""
    out, final_state = lightning_attention(q.cpu(), k.cpu(), v.cpu(), decay.cpu(), initial.cpu(), cu_seqlens.cpu())
    return out.to(q.device), final_state.to(q.device)


def test_the_cuda_reference_is_the_blockwise_torch_path() -> None:
    """_blockwise_torch, the CUDA test's reference, gives each packed document's recurrence (CPU
    inputs here; the CUDA test hands it CUDA ones, which it computes on the CPU all the same)."""
    doc_lengths = [1, 15, 16, 17]
    cu_seqlens = torch.tensor([0, *torch.tensor(doc_lengths).cumsum(0).tolist()])
    inputs = _random_inputs(batch=1, seq_len=sum(doc_lengths), num_states=len(doc_lengths), seed=13)
    inputs = tuple(x.double() for x in inputs)
    out, final_state = _blockwise_torch(*inputs[:3], DECAY, inputs[3], cu_seqlens)
    for doc, (start, end) in enumerate(zip(cu_seqlens[:-1].tolist(), cu_seqlens[1:].tolist())):
        ref_out, ref_final = lightning_attention_reference(
            *(x[:, start:end] for x in inputs[:3]), DECAY, inputs[3][doc : doc + 1]
        )
        _assert_close(out[:, start:end], ref_out, 1e-10)
        _assert_close(final_state[doc : doc + 1], ref_final, 1e-10)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-4), (torch.bfloat16, 3e-2)], ids=["fp32", "bf16"])
def test_cuda_compiled_kernels_match_blockwise_torch(dtype: torch.dtype, tol: float) -> None:
    """The compiled kernels at the model's head dim 128 and the default block 64, on packed documents
    of lengths around the block size, against the pure-torch block-wise path in fp64 (on the CPU:
    lightning_attention on CUDA tensors would be the Triton kernel itself)."""
    from megacispo.models import lightning_triton

    if lightning_triton.INTERPRETED:
        pytest.skip("TRITON_INTERPRET is set, so the importable module's kernels are not compiled")
    doc_lengths = [1, 63, 64, 65, 300]
    cu_seqlens = torch.tensor([0, *torch.tensor(doc_lengths).cumsum(0).tolist()], device="cuda")
    inputs = _random_inputs(batch=1, seq_len=sum(doc_lengths), num_states=len(doc_lengths), head_dim=128, seed=11)
    rounded = tuple(x.to(dtype).float().cuda() for x in inputs)  # both sides see the same dtype-rounded values
    result = _forward_backward(lightning_triton.lightning_attention_triton, rounded, dtype, cu_seqlens=cu_seqlens)
    expected = _forward_backward(_blockwise_torch, rounded, torch.float64, cu_seqlens=cu_seqlens)
    _assert_matches(result, expected, tol)
