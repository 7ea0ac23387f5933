"""SFT's token counter: every loss-mask token and every sequence with one, with no old log-probs."""

from __future__ import annotations

import pytest
import torch

from megacispo.rl.losses import compute_global_counts, count_loss_tokens


def test_count_loss_tokens_counts_mask_tokens_and_sequences():
    masks = [torch.tensor([[0.0, 1.0, 1.0], [0.0, 0.0, 0.0]]), torch.tensor([[1.0, 0.0, 1.0]])]
    counts = count_loss_tokens(masks)
    assert (int(counts.num_tokens), int(counts.num_sequences)) == (4, 2)
    finite = [torch.zeros_like(mask) for mask in masks]
    reference = compute_global_counts(masks, finite)
    assert (counts.num_tokens, counts.num_sequences) == (reference.num_tokens, reference.num_sequences)


def test_count_loss_tokens_needs_a_micro_batch():
    with pytest.raises(ValueError, match="loss_masks is empty"):
        count_loss_tokens([])
