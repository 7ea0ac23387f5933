"""Softmax attention over packed rows (models.softmax_attention.attend_documents) against attention
computed document by document from its definition, in fp64: the CPU path, and the masked path that
CUDA takes in fp32, run here on the CPU. Odd lengths, a one-token document, GQA, and the
trailing padding document that packing adds."""

from __future__ import annotations

import pytest
import torch

from megacispo.models.softmax_attention import _documents_masked, attend_documents

HEADS, KV_HEADS, HEAD_DIM = 4, 2, 8
LENGTHS = [7, 1, 13, 5, 6]  # the last is the row's padding, a document of its own
SCALE = HEAD_DIM**-0.5


def _inputs() -> tuple[torch.Tensor, ...]:
    generator = torch.Generator().manual_seed(0)
    total = sum(LENGTHS)
    q = torch.randn(1, HEADS, total, HEAD_DIM, dtype=torch.float64, generator=generator)
    k, v = (torch.randn(1, KV_HEADS, total, HEAD_DIM, dtype=torch.float64, generator=generator) for _ in range(2))
    cu_seqlens = torch.tensor([0, *torch.tensor(LENGTHS).cumsum(0).tolist()], dtype=torch.int32)
    return q, k, v, cu_seqlens


def _reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """softmax(q k^T * scale + causal mask) v, one document at a time, K and V repeated per group."""
    k, v = (x.repeat_interleave(HEADS // KV_HEADS, dim=1) for x in (k, v))
    pieces, start = [], 0
    for length in LENGTHS:
        end = start + length
        scores = q[:, :, start:end] @ k[:, :, start:end].transpose(-1, -2) * SCALE
        causal = torch.ones(length, length, dtype=torch.bool).tril()
        pieces.append(scores.masked_fill(~causal, float("-inf")).softmax(-1) @ v[:, :, start:end])
        start = end
    return torch.cat(pieces, dim=2)


@pytest.mark.parametrize("path", ["cpu", "masked"])
def test_packed_attention_matches_each_document_alone(path):
    q, k, v, cu_seqlens = _inputs()
    leaves = [x.clone().requires_grad_(True) for x in (q, k, v)]
    if path == "cpu":
        out = attend_documents(*leaves, cu_seqlens, max(LENGTHS), SCALE)
    else:
        out = _documents_masked(*leaves, cu_seqlens, SCALE)
    reference_leaves = [x.clone().requires_grad_(True) for x in (q, k, v)]
    expected = _reference(*reference_leaves)
    torch.testing.assert_close(out, expected, rtol=1e-12, atol=1e-12)
    upstream = torch.randn(expected.shape, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    out.backward(upstream)
    expected.backward(upstream)
    for leaf, reference in zip(leaves, reference_leaves):
        torch.testing.assert_close(leaf.grad, reference.grad, rtol=1e-12, atol=1e-12)


def test_packed_attention_rejects_bad_rows():
    q, k, v, cu_seqlens = _inputs()
    with pytest.raises(ValueError, match=r"cu_seqlens_q spans \[0, 26\] but the sequence has 32 tokens"):
        attend_documents(q, k, v, cu_seqlens[:-1], None, SCALE)
    with pytest.raises(ValueError, match="the batch has 2 rows: pass input_ids of shape \\[1, T\\]"):
        attend_documents(q.expand(2, -1, -1, -1), k, v, cu_seqlens, None, SCALE)
