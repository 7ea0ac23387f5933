"""A decode step's attention (models.softmax_attention.decode_attention): one query per row over the
cache's keys with pads masked, the query heads of a KV head grouped as that head's queries, against
attention from its definition with K and V repeated to every query head, in fp64. GQA groups of 1, 2
and 8, odd cache lengths, rows with masked positions at the front (left padding, a refilled slot) and
in the middle (a multi-turn row's held steps), and no mask at all."""

from __future__ import annotations

import pytest
import torch

from megacispo.models.softmax_attention import decode_attention

HEAD_DIM = 8
SCALE = HEAD_DIM**-0.5


def _reference(q, k, v, valid):
    groups = q.shape[1] // k.shape[1]
    k, v = (x.repeat_interleave(groups, dim=1) for x in (k, v))
    scores = (q @ k.transpose(-1, -2)) * SCALE  # [b, heads, 1, T]
    if valid is not None:
        scores = scores.masked_fill(~valid[:, None, None, :], float("-inf"))
    return scores.softmax(-1) @ v


@pytest.mark.parametrize("heads, kv_heads", [(4, 4), (4, 2), (16, 2)])
@pytest.mark.parametrize("length", [1, 7, 33])
@pytest.mark.parametrize("masked", [False, True])
def test_grouped_decode_attention_is_attention_with_repeated_heads(heads, kv_heads, length, masked):
    generator = torch.Generator().manual_seed(length * 100 + heads)
    batch = 3
    q = torch.randn(batch, heads, 1, HEAD_DIM, dtype=torch.float64, generator=generator)
    k, v = (torch.randn(batch, kv_heads, length, HEAD_DIM, dtype=torch.float64, generator=generator) for _ in range(2))
    valid = None
    if masked:
        valid = torch.ones(batch, length, dtype=torch.bool)
        valid[1, : length // 2] = False  # left padding, or a refilled row's older positions
        valid[2, length // 3: (2 * length) // 3] = False  # a multi-turn row's held steps
        valid[:, -1] = True  # the newest position is the step's own token
    bias = None if valid is None else torch.zeros(batch, 1, 1, length, dtype=torch.float64).masked_fill(
        ~valid[:, None, None, :], float("-inf"))
    out = decode_attention(q, k, v, bias, SCALE)
    torch.testing.assert_close(out, _reference(q, k, v, valid), rtol=1e-12, atol=1e-12)


def test_grouping_follows_the_heads_kv_sharing():
    """Query head h reads KV head h // (heads / kv heads), as repeat_interleave expands them: with the keys
    and values of KV head 1 changed, only query heads 2 and 3 (of 4, 2 KV heads) change."""
    generator = torch.Generator().manual_seed(1)
    q = torch.randn(1, 4, 1, HEAD_DIM, dtype=torch.float64, generator=generator)
    k, v = (torch.randn(1, 2, 5, HEAD_DIM, dtype=torch.float64, generator=generator) for _ in range(2))
    before = decode_attention(q, k, v, None, SCALE)
    v2 = v.clone()
    v2[:, 1] += 1.0
    after = decode_attention(q, k, v2, None, SCALE)
    assert torch.equal(after[:, :2], before[:, :2]) and not torch.allclose(after[:, 2:], before[:, 2:])
