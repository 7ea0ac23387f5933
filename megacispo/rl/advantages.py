"""Group-relative advantages (GRPO / CISPO), dynamic sampling and DAPO's overlong reward shaping.

Rewards are 1-D, ordered by group: the G responses of prompt 0, then the G responses of prompt 1, ...
"""

from __future__ import annotations

import torch


def _rewards_by_group(rewards: torch.Tensor, group_size: int) -> torch.Tensor:
    """[num_prompts * G] -> [num_prompts, G] in a floating dtype (integer rewards become fp32)."""
    if rewards.dim() != 1:
        raise ValueError(f"rewards must be 1-D [num_prompts * group_size], got shape {tuple(rewards.shape)}")
    if group_size < 1 or rewards.numel() % group_size != 0:
        raise ValueError(
            f"group_size={group_size} must be >= 1 and divide the number of rewards ({rewards.numel()}); "
            "pass all G responses of every prompt, grouped"
        )
    if not rewards.is_floating_point():
        rewards = rewards.float()
    return rewards.view(-1, group_size)


def _uniform_groups(rewards_by_group: torch.Tensor) -> torch.Tensor:
    """bool [num_prompts]: every reward of the group equals the first (exact comparison)."""
    return (rewards_by_group == rewards_by_group[:, :1]).all(dim=1)


def group_relative_advantages(
    rewards: torch.Tensor, group_size: int, eps: float = 1e-6, scale_by_std: bool = True
) -> torch.Tensor:
    """A_i = (R_i - mean_group R) / (std_group R + eps), one advantage per response. [num_prompts * G].

    std is the sample standard deviation (Bessel's correction, divisor G - 1), as torch.std and the
    GRPO implementations of TRL and verl compute it, so runs compare with theirs; for G = 16 it is
    sqrt(16/15) ~ 1.03 times the population std. scale_by_std=False returns R - mean (Dr. GRPO).

    A group whose rewards are all equal gets exactly 0, never NaN and never the rounding residue of
    R - mean (the mean of three 0.1s is not exactly 0.1). group_size must be >= 2: one response has
    no group to be relative to.
    """
    if group_size < 2:
        raise ValueError(f"group_size={group_size} must be >= 2: a lone response has no group-relative advantage")
    if eps < 0:
        raise ValueError(f"eps={eps} must be >= 0; it keeps the division finite for near-uniform groups")
    grouped = _rewards_by_group(rewards, group_size)
    advantages = grouped - grouped.mean(dim=1, keepdim=True)
    if scale_by_std:
        std = grouped.std(dim=1, correction=1, keepdim=True)
        # Uniform groups have std 0, so eps = 0 would give 0/0 there; where() discards that lane.
        advantages = advantages / (std + eps)
    advantages = torch.where(_uniform_groups(grouped)[:, None], 0.0, advantages)
    return advantages.reshape(-1)


def dynamic_sampling_keep_mask(rewards: torch.Tensor, group_size: int) -> torch.Tensor:
    """bool [num_prompts * G]: True for every response of a group whose rewards are not all equal.

    DAPO's dynamic sampling drops the other groups: their advantages are 0, so they only dilute the
    batch. Equality is exact, which suits rule-based (verifier) rewards.
    """
    grouped = _rewards_by_group(rewards, group_size)
    return (~_uniform_groups(grouped))[:, None].expand_as(grouped).reshape(-1)


def overlong_penalty(
    response_lengths: torch.Tensor, max_length: int, cache_length: int, penalty: float = 1.0
) -> torch.Tensor:
    """DAPO's soft overlong punishment, added to the reward. Same shape as response_lengths, fp32.

    0 for length <= max_length - cache_length, falling linearly to -penalty at max_length, and
    -penalty beyond. cache_length = 0 gives a hard cut at max_length.
    """
    if not 0 <= cache_length <= max_length:
        raise ValueError(
            f"cache_length={cache_length} must lie in [0, max_length={max_length}]: it is the length of the "
            "soft-penalty zone that ends at max_length"
        )
    if penalty < 0:
        raise ValueError(f"penalty={penalty} must be >= 0; it is the size of the reward cut for overlong responses")
    lengths = response_lengths.float()
    soft_limit = max_length - cache_length
    # With cache_length = 0 the ramp is never selected; max(., 1) keeps it finite anyway.
    ramp = (soft_limit - lengths) / max(cache_length, 1) * penalty
    shaped = torch.where(lengths <= soft_limit, 0.0, ramp)
    return torch.where(lengths > max_length, -penalty, shaped)
