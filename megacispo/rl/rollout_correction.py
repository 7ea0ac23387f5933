"""The gap between the probabilities the rollout reported and the ones the training engine computes
for the same tokens: metrics of its size, and the importance-sampling corrections that compose with
every policy loss of the registry.

With r = pi_train / pi_rollout per response token (pi_train: the old policy as the training engine
computes it, the one the loss's ratio is taken against):
    tis           each token's loss is multiplied by min(r, threshold_high), detached (truncated IS)
    mis_token     tokens with r outside [threshold_low, threshold_high] leave the loss (masked IS)
    mis_sequence  sequences whose geometric-mean r leaves that range leave the loss whole
Dropped tokens leave the loss mask before the step's token count is taken, so the normalization of
the remaining tokens stays invariant to micro-batching and layout.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from megacispo.rl.config import CORRECTION_MODES
from megacispo.rl.losses import LOG_RATIO_CLAMP

# mismatch/ratio_out_of_range counts the tokens whose r leaves this band.
MISMATCH_RATIO_RANGE = (0.5, 2.0)


@dataclass(frozen=True)
class RolloutCorrection:
    """What a correction does to one batch of [n, T] per-token tensors."""

    loss_mask: torch.Tensor
    """[n, T] the loss mask with the dropped tokens zeroed."""
    token_weights: torch.Tensor | None
    """[n, T] detached weights of the per-token loss (tis), or None."""
    num_dropped: torch.Tensor
    """int64 scalar: response tokens the correction dropped."""


def _log_ratio(old_logprobs: torch.Tensor, rollout_logprobs: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """log(pi_train / pi_rollout), 0 outside ``valid``, clamped like the loss's ratio (an engine's -inf
    or a token sampled at a tiny probability stays finite)."""
    log_ratio = (old_logprobs.double() - rollout_logprobs.double()).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    return torch.where(valid, log_ratio, 0.0)


def _valid(old_logprobs: torch.Tensor, rollout_logprobs: torch.Tensor, loss_mask: torch.Tensor) -> torch.Tensor:
    return (loss_mask != 0) & torch.isfinite(old_logprobs) & torch.isfinite(rollout_logprobs)


def correct_rollout(
    old_logprobs: torch.Tensor,
    rollout_logprobs: torch.Tensor,
    loss_mask: torch.Tensor,
    mode: str,
    threshold_low: float,
    threshold_high: float,
) -> RolloutCorrection:
    """The correction ``mode`` (rl.rollout_correction) for [n, T] log-probs and loss mask."""
    if mode not in CORRECTION_MODES:
        raise ValueError(f"rollout correction mode {mode!r} is unknown; use one of {', '.join(CORRECTION_MODES)}")
    no_drop = torch.zeros((), dtype=torch.int64, device=loss_mask.device)
    if mode == "none":
        return RolloutCorrection(loss_mask, None, no_drop)
    valid = _valid(old_logprobs, rollout_logprobs, loss_mask)
    log_ratio = _log_ratio(old_logprobs, rollout_logprobs, valid)
    if mode == "tis":
        weights = log_ratio.exp().clamp(max=threshold_high).to(old_logprobs.dtype)
        return RolloutCorrection(loss_mask, torch.where(valid, weights, 1.0).detach(), no_drop)
    if mode == "mis_sequence":
        # [n, 1]: the geometric mean of each sequence's token ratios.
        num_tokens = valid.sum(dim=-1, keepdim=True).clamp(min=1)
        log_ratio = (log_ratio.sum(dim=-1, keepdim=True) / num_tokens).expand_as(log_ratio)
    ratio = log_ratio.exp()
    keep = (ratio >= threshold_low) & (ratio <= threshold_high)
    dropped = (loss_mask != 0) & ~keep
    return RolloutCorrection(torch.where(dropped, 0.0, loss_mask.float()).to(loss_mask.dtype), None, dropped.sum())


def mismatch_sums(old_logprobs: torch.Tensor, rollout_logprobs: torch.Tensor, loss_mask: torch.Tensor) -> torch.Tensor:
    """float64 [4] sums over the response tokens, to be added over ranks: the k3 estimate of
    KL(rollout || train) (the samples come from the rollout), |log pi_train - log pi_rollout|, tokens
    whose ratio leaves MISMATCH_RATIO_RANGE, and the token count. ``mismatch_metrics`` turns them
    into means; the largest |difference| is ``max_abs_logprob_diff``."""
    valid = _valid(old_logprobs, rollout_logprobs, loss_mask)
    log_ratio = _log_ratio(old_logprobs, rollout_logprobs, valid)
    ratio = log_ratio.exp()
    low, high = MISMATCH_RATIO_RANGE
    out_of_range = valid & ((ratio < low) | (ratio > high))
    k3 = torch.where(valid, ratio - 1 - log_ratio, 0.0)
    return torch.stack([k3.sum(), log_ratio.abs().sum(), out_of_range.sum().double(), valid.sum().double()])


def max_abs_logprob_diff(old_logprobs: torch.Tensor, rollout_logprobs: torch.Tensor, loss_mask: torch.Tensor) -> torch.Tensor:
    """float64 scalar: the largest |log pi_train - log pi_rollout| over the response tokens (0 without any)."""
    valid = _valid(old_logprobs, rollout_logprobs, loss_mask)
    return _log_ratio(old_logprobs, rollout_logprobs, valid).abs().amax() if valid.any() else valid.new_zeros((), dtype=torch.float64)


def mismatch_metrics(sums: torch.Tensor, max_abs_diff: float) -> dict[str, float]:
    """The mismatch/* metrics from ``mismatch_sums`` added over ranks and the largest difference of any rank."""
    k3, abs_diff, out_of_range, count = sums.tolist()
    count = max(count, 1.0)
    return {
        "mismatch/k3_kl": k3 / count,
        "mismatch/abs_logp_diff_mean": abs_diff / count,
        "mismatch/abs_logp_diff_max": max_abs_diff,
        "mismatch/ratio_out_of_range": out_of_range / count,
    }
