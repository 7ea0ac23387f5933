"""Corrections for the gap between rollout and training probabilities: closed forms of each mode
(value and gradient through a policy loss), the mismatch metrics, and the step normalization still
invariant to micro-batching once tokens are weighted or dropped."""

from __future__ import annotations

import math

import pytest
import torch

from megacispo.rl.losses import compute_global_counts, compute_policy_loss, policy_loss_names
from megacispo.rl.rollout_correction import correct_rollout, max_abs_logprob_diff, mismatch_metrics, mismatch_sums

TIGHT = dict(rtol=1e-12, atol=1e-12)
# 2 sequences x 3 tokens, the last of row 1 is padding. r = pi_train / pi_rollout:
#   row 0: 1, 3, 0.25      row 1: 1.5, 0.8, (pad)
TRAIN_ROLLOUT_RATIOS = [[1.0, 3.0, 0.25], [1.5, 0.8, 1.0]]
LOSS_MASK = torch.tensor([[1, 1, 1], [1, 1, 0]], dtype=torch.float64)


def logprobs_pair() -> tuple[torch.Tensor, torch.Tensor]:
    old = torch.tensor([[-1.0, -2.0, -0.5], [-0.3, -1.5, -2.5]], dtype=torch.float64)
    rollout = old - torch.tensor(TRAIN_ROLLOUT_RATIOS, dtype=torch.float64).log()
    return old, rollout


def test_none_changes_nothing():
    old, rollout = logprobs_pair()
    correction = correct_rollout(old, rollout, LOSS_MASK, "none", 0.5, 2.0)
    assert correction.token_weights is None and correction.num_dropped == 0
    assert correction.loss_mask is LOSS_MASK


def test_tis_weights_each_token_by_its_capped_ratio_in_value_and_gradient():
    old, rollout = logprobs_pair()
    correction = correct_rollout(old, rollout, LOSS_MASK, "tis", 0.5, 2.0)
    expected = torch.tensor([[1.0, 2.0, 0.25], [1.5, 0.8, 1.0]], dtype=torch.float64)
    torch.testing.assert_close(correction.token_weights, expected, **TIGHT)
    assert correction.num_dropped == 0 and not correction.token_weights.requires_grad
    # On-policy (old == current): reinforce's loss is -sum(w * A * logp) / 5, its gradient -w * A / 5.
    logprobs = old.clone().requires_grad_(True)
    advantages = torch.tensor([1.0, -2.0], dtype=torch.float64)
    loss, _ = compute_policy_loss("reinforce", logprobs, old, advantages, LOSS_MASK,
                                  token_weights=correction.token_weights)
    loss.backward()
    a = torch.tensor([[1.0] * 3, [-2.0] * 3], dtype=torch.float64)
    torch.testing.assert_close(loss, -(expected * a * old * LOSS_MASK).sum() / 5, **TIGHT)
    torch.testing.assert_close(logprobs.grad, -(expected * a * LOSS_MASK) / 5, **TIGHT)


def test_mis_token_drops_the_tokens_outside_the_range():
    old, rollout = logprobs_pair()
    correction = correct_rollout(old, rollout, LOSS_MASK, "mis_token", 0.5, 2.0)
    # r = 3 and r = 0.25 leave [0.5, 2]; padding stays 0 and is not counted as dropped.
    torch.testing.assert_close(correction.loss_mask, torch.tensor([[1, 0, 0], [1, 1, 0]], dtype=torch.float64))
    assert correction.num_dropped == 2 and correction.token_weights is None


def test_mis_sequence_drops_whole_sequences_by_their_geometric_mean():
    old, rollout = logprobs_pair()
    # Geometric means: row 0 (1 * 3 * 0.25)^(1/3) = 0.909, row 1 (1.5 * 0.8)^(1/2) = 1.095.
    kept_both = correct_rollout(old, rollout, LOSS_MASK, "mis_sequence", 0.5, 2.0)
    torch.testing.assert_close(kept_both.loss_mask, LOSS_MASK)
    row_1_out = correct_rollout(old, rollout, LOSS_MASK, "mis_sequence", 0.5, 1.05)
    torch.testing.assert_close(row_1_out.loss_mask, torch.tensor([[1, 1, 1], [0, 0, 0]], dtype=torch.float64))
    assert row_1_out.num_dropped == 2


def test_mismatch_metrics_by_hand():
    old, rollout = logprobs_pair()
    sums = mismatch_sums(old, rollout, LOSS_MASK)
    metrics = mismatch_metrics(sums, float(max_abs_logprob_diff(old, rollout, LOSS_MASK)))
    ratios = [1.0, 3.0, 0.25, 1.5, 0.8]
    assert metrics["mismatch/k3_kl"] == pytest.approx(sum(r - 1 - math.log(r) for r in ratios) / 5, rel=1e-12)
    assert metrics["mismatch/abs_logp_diff_mean"] == pytest.approx(sum(abs(math.log(r)) for r in ratios) / 5, rel=1e-12)
    assert metrics["mismatch/abs_logp_diff_max"] == pytest.approx(math.log(4.0), rel=1e-12)
    assert metrics["mismatch/ratio_out_of_range"] == pytest.approx(2 / 5)
    agree = mismatch_metrics(mismatch_sums(old, old, LOSS_MASK), float(max_abs_logprob_diff(old, old, LOSS_MASK)))
    assert agree == {"mismatch/k3_kl": 0.0, "mismatch/abs_logp_diff_mean": 0.0, "mismatch/abs_logp_diff_max": 0.0,
                     "mismatch/ratio_out_of_range": 0.0}


@pytest.mark.parametrize("mode", ["tis", "mis_token", "mis_sequence"])
@pytest.mark.parametrize("name", policy_loss_names())
def test_micro_batches_still_sum_to_the_full_batch(name: str, mode: str):
    generator = torch.Generator().manual_seed(3)
    batch, seq = 8, 7
    old = -torch.rand(batch, seq, generator=generator, dtype=torch.float64) * 3
    rollout = old + torch.randn(batch, seq, generator=generator, dtype=torch.float64) * 0.6
    logprobs = old + torch.randn(batch, seq, generator=generator, dtype=torch.float64) * 0.3
    loss_mask = (torch.arange(seq)[None, :] >= torch.randint(1, 4, (batch, 1), generator=generator)).double()
    advantages = torch.randn(batch, generator=generator, dtype=torch.float64)
    correction = correct_rollout(old, rollout, loss_mask, mode, 0.8, 1.25)
    weights = correction.token_weights

    def run(rows_list):
        current = logprobs.clone().requires_grad_(True)
        counts = compute_global_counts([correction.loss_mask[r] for r in rows_list], [old[r] for r in rows_list])
        total = sum(compute_policy_loss(name, current[r], old[r], advantages[r], correction.loss_mask[r], counts,
                                        token_weights=None if weights is None else weights[r])[0] for r in rows_list)
        total.backward()
        return total.detach(), current.grad

    full_loss, full_grad = run([slice(0, batch)])
    parts_loss, parts_grad = run([slice(0, 3), slice(3, 4), slice(4, batch)])
    torch.testing.assert_close(parts_loss, full_loss, **TIGHT)
    torch.testing.assert_close(parts_grad, full_grad, **TIGHT)
    assert mode == "tis" or correction.num_dropped > 0
