"""The RL recipe's section (``rl:``): the policy loss, advantages, rewards, the correction of the
rollout/training gap, routing replay and adaptive clipping. The loss's parameters are checked against
the loss registry at start-up (megacispo.startup), where the registry is imported."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from megacispo.fields import AT_LEAST_0, AT_LEAST_1, FRACTION, POSITIVE, Range, check_choice, check_ranges, ranged

# rl.rollout_correction.mode's choices (megacispo.rl.rollout_correction).
CORRECTION_MODES = ("none", "tis", "mis_token", "mis_sequence")
# rl.old_logprobs' choices.
OLD_LOGPROBS = ("recompute", "rollout")


@dataclass(kw_only=True)
class LossConfig:
    """The policy loss, chosen by name from the registry in megacispo.rl.losses."""

    name: str = "cispo"
    """One of cispo, grpo, dapo, gspo, reinforce."""
    params: dict[str, Any] = field(default_factory=dict)
    """Parameters of the chosen loss (cispo: eps_low, eps_high, mask_eps_low, mask_eps_high)."""


@dataclass(kw_only=True)
class RolloutCorrectionConfig:
    """Importance-sampling correction for the gap between rollout and training probabilities (any loss)."""

    mode: str = "none"
    """none; tis (weight each token's loss by min(r, threshold_high)); mis_token or mis_sequence (drop
    tokens, or sequences by their geometric-mean r, with r outside [threshold_low, threshold_high]);
    r = pi_train / pi_rollout."""
    threshold_low: float = ranged(0.5, FRACTION)
    """The lower end of the kept range of r (mis_*)."""
    threshold_high: float = ranged(2.0, Range(1))
    """The cap of the tis weight, and the upper end of the kept range of r (mis_*)."""

    def check(self) -> None:
        check_ranges(self, "rl.rollout_correction")
        check_choice("rl.rollout_correction.mode", self.mode, CORRECTION_MODES)


@dataclass(kw_only=True)
class AdaptiveClipConfig:
    """Clip bounds that follow a target capped fraction (megacispo.rl.adaptive_clip); off unless target_capped_frac is set."""

    target_capped_frac: float | None = None
    """The fraction of an optimizer step's loss tokens, over all ranks, whose weight may hit the upper bound (null: off); above 1 / tokens per step."""
    rate: float = ranged(0.05, Range(0, 1, low_open=True))
    """After each optimizer step the bound is multiplied (more capped than the target) or divided (fewer) by 1 + rate."""
    min: float = ranged(0.01, POSITIVE)
    """The smallest an adapted bound (eps_high, eps_low) gets."""
    max: float = ranged(10.0, POSITIVE)
    """The largest an adapted bound gets."""
    adapt_low: bool = False
    """Also move eps_low so that loss/clip_frac_low tracks the target (losses with separate eps_low and eps_high)."""

    def check(self) -> None:
        """The controller's own settings; the bounds it moves are checked against the loss at start-up."""
        check_ranges(self, "rl.adaptive_clip")
        target = self.target_capped_frac
        if target is None:
            return
        if not 0 < target < 1:
            raise ValueError(f"rl.adaptive_clip.target_capped_frac = {target!r}: it must be in (0, 1), e.g. 0.01, or "
                             f"null to keep the bounds fixed")
        if self.min > self.max:
            raise ValueError(f"rl.adaptive_clip.min = {self.min} exceeds rl.adaptive_clip.max = {self.max}: the "
                             f"bounds move between them; lower min or raise max")


@dataclass(kw_only=True)
class RLConfig:
    """The CISPO recipe around the loss."""

    loss: LossConfig = field(default_factory=LossConfig)
    """The policy loss and its parameters."""
    updates_per_rollout: int = ranged(4, AT_LEAST_1)
    """K: optimizer steps on mini-batches of one rollout batch (M1 used 16)."""
    old_logprobs: str = "recompute"
    """recompute (the training engine recomputes them before the first update) or rollout."""
    reward: str = "exact_match"
    """A verifier name (exact_match, numeric, boxed_math) or module:function."""
    failure_reward: float = 0.0
    """The reward of a sample whose verifier raised or returned no number (a string, even '1.0', is none)."""
    max_reward_failure_frac: float = ranged(0.5, Range(0, 1, note="1: never stop"))
    """Stop the run when the verifier fails on more than this fraction of a step's samples, checked after each sampling round (1: never)."""
    reward_timeout_s: float = ranged(30.0, POSITIVE)
    """The most one reward call may take; a later one is stopped (its worker process killed) and counts as a failure."""
    reward_workers: int = ranged(4, AT_LEAST_1)
    """Reward calls at once, each in a worker process (per rank); a batch makes no more calls once more than max_reward_failure_frac of those decided (at least this many) failed."""
    overlong_max_length: int = ranged(0, Range(0, note="0: off"))
    """DAPO overlong shaping: responses longer than this get the full penalty (0: off)."""
    overlong_cache_length: int = ranged(0, AT_LEAST_0)
    """The penalty ramps up linearly over the last this-many tokens before overlong_max_length."""
    overlong_penalty: float = ranged(1.0, AT_LEAST_0)
    """The largest overlong penalty."""
    advantage_eps: float = ranged(1e-6, AT_LEAST_0)
    """Added to the group std when normalizing advantages."""
    rollout_correction: RolloutCorrectionConfig = field(default_factory=RolloutCorrectionConfig)
    """Importance-sampling correction between rollout and training probabilities."""
    routing_replay: bool = False
    """R3: route every token to the experts the rollout chose, in the old-log-prob and update forwards."""
    adaptive_clip: AdaptiveClipConfig = field(default_factory=AdaptiveClipConfig)
    """Adapt the loss's clip bounds to a target capped fraction."""

    def check(self) -> None:
        check_ranges(self, "rl")
        if self.old_logprobs not in OLD_LOGPROBS:
            raise ValueError(f"rl.old_logprobs = {self.old_logprobs!r}: use recompute or rollout")
        if self.overlong_max_length and self.overlong_cache_length > self.overlong_max_length:
            raise ValueError(
                f"rl.overlong_cache_length = {self.overlong_cache_length} exceeds rl.overlong_max_length = "
                f"{self.overlong_max_length}: the ramp must fit below the limit"
            )
        self.rollout_correction.check()
        self.adaptive_clip.check()
