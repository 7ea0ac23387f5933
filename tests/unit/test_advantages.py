"""Group-relative advantages, dynamic sampling and overlong shaping against hand values and naive loops."""

from __future__ import annotations

import statistics

import pytest
import torch

from megacispo.rl.advantages import dynamic_sampling_keep_mask, group_relative_advantages, overlong_penalty


def test_known_values_use_the_sample_std():
    # Group [1, 0, 0, 0]: mean 0.25, sample std sqrt((0.75^2 + 3 * 0.25^2) / 3) = 0.5 exactly.
    advantages = group_relative_advantages(torch.tensor([1.0, 0.0, 0.0, 0.0]), group_size=4, eps=0.0)
    torch.testing.assert_close(advantages, torch.tensor([1.5, -0.5, -0.5, -0.5]), rtol=0, atol=1e-7)
    # With the default eps the division is by 0.5 + 1e-6.
    advantages = group_relative_advantages(torch.tensor([1.0, 0.0, 0.0, 0.0]), group_size=4)
    torch.testing.assert_close(advantages, torch.tensor([0.75, -0.25, -0.25, -0.25]) / (0.5 + 1e-6))


def test_random_groups_against_a_naive_reference():
    generator = torch.Generator().manual_seed(0)
    group_size, num_prompts = 5, 7
    rewards = torch.randn(num_prompts * group_size, generator=generator, dtype=torch.float64)
    expected = []
    for start in range(0, rewards.numel(), group_size):
        group = rewards[start : start + group_size].tolist()
        mean, std = statistics.mean(group), statistics.stdev(group)
        expected += [(r - mean) / (std + 1e-6) for r in group]
    advantages = group_relative_advantages(rewards, group_size)
    torch.testing.assert_close(advantages, torch.tensor(expected, dtype=torch.float64), rtol=1e-12, atol=1e-12)
    centered = group_relative_advantages(rewards, group_size, scale_by_std=False)
    torch.testing.assert_close(centered.view(-1, group_size).sum(dim=1), torch.zeros(num_prompts, dtype=torch.float64))


@pytest.mark.parametrize("eps", [1e-6, 0.0])
def test_uniform_groups_give_exact_zeros(eps: float):
    # The mean of three 0.1s is 0.10000000000000002 and their std 1.7e-17, not 0: without the explicit
    # zero, A would be -1.4e-11 (eps = 1e-6) or -0.82 (eps = 0), a full-size signal out of rounding.
    rewards = torch.tensor([0.1, 0.1, 0.1, 1.0, 1.0, 1.0, 0.0, 1.0, 0.0], dtype=torch.float64)
    advantages = group_relative_advantages(rewards, group_size=3, eps=eps)
    assert torch.isfinite(advantages).all()
    assert (advantages[:6] == 0).all()
    assert (advantages[6:] != 0).all()
    assert (group_relative_advantages(rewards, 3, scale_by_std=False)[:6] == 0).all()


def test_integer_rewards_and_bad_arguments():
    advantages = group_relative_advantages(torch.tensor([1, 0, 1, 1]), group_size=2)
    assert advantages.dtype == torch.float32 and advantages[2:].eq(0).all()
    with pytest.raises(ValueError, match="group_size=3 must be >= 1 and divide the number of rewards \\(4\\)"):
        group_relative_advantages(torch.zeros(4), group_size=3)
    with pytest.raises(ValueError, match="group_size=1 must be >= 2"):
        group_relative_advantages(torch.zeros(4), group_size=1)
    with pytest.raises(ValueError, match="rewards must be 1-D"):
        group_relative_advantages(torch.zeros(2, 2), group_size=2)
    with pytest.raises(ValueError, match="eps=-1"):
        group_relative_advantages(torch.zeros(4), group_size=2, eps=-1)


def test_dynamic_sampling_keeps_only_groups_with_a_signal():
    rewards = torch.tensor([1.0, 1.0, 1.0, 0.0, 1.0, 0.0, 0.0, 0.0, 0.0, 0.5, 0.5, 0.25])
    keep = dynamic_sampling_keep_mask(rewards, group_size=3)
    expected = [False] * 3 + [True] * 3 + [False] * 3 + [True] * 3
    assert keep.tolist() == expected
    # Exactly the groups whose advantages are not all zero.
    advantages = group_relative_advantages(rewards, group_size=3).view(4, 3)
    assert keep.view(4, 3)[:, 0].tolist() == advantages.ne(0).any(dim=1).tolist()


def test_overlong_penalty_at_the_boundaries():
    # max_length 100, cache 20: 0 up to 80, linear to -penalty at 100, -penalty beyond.
    lengths = torch.tensor([0, 79, 80, 81, 90, 99, 100, 101, 1000])
    expected = torch.tensor([0.0, 0.0, 0.0, -0.05, -0.5, -0.95, -1.0, -1.0, -1.0])
    torch.testing.assert_close(overlong_penalty(lengths, max_length=100, cache_length=20), expected)
    torch.testing.assert_close(overlong_penalty(lengths, max_length=100, cache_length=20, penalty=2.0), 2 * expected)


def test_overlong_penalty_without_a_soft_zone_is_a_hard_cut():
    lengths = torch.tensor([99, 100, 101])
    torch.testing.assert_close(overlong_penalty(lengths, 100, cache_length=0), torch.tensor([0.0, 0.0, -1.0]))
    with pytest.raises(ValueError, match="cache_length=101 must lie in \\[0, max_length=100\\]"):
        overlong_penalty(lengths, 100, cache_length=101)
    with pytest.raises(ValueError, match="penalty=-1"):
        overlong_penalty(lengths, 100, cache_length=10, penalty=-1)
