"""The environment section (``env:``): what answers the model between its turns, and the limits of a
conversation. Without ``env.name`` a rollout is one turn, scored by ``rl.reward``."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from megacispo.fields import AT_LEAST_1, POSITIVE, check_choice, check_ranges, ranged

# env.reward's choices: the environment's turn rewards summed, rl.reward on the final turn, or both added.
ENV_REWARDS = ("env", "reward", "sum")


@dataclass(kw_only=True)
class EnvConfig:
    """Multi-turn rollouts: an environment replies to each model turn (megacispo.envs)."""

    name: str = ""
    """A built-in environment (python, guess_number) or module:Class; empty: single-turn rollouts."""
    params: dict[str, Any] = field(default_factory=dict)
    """Keyword arguments of the environment's constructor (one environment per sample)."""
    max_turns: int = ranged(4, AT_LEAST_1)
    """Model turns per sample; a conversation still going after them ends there."""
    timeout_s: float = ranged(30.0, POSITIVE)
    """The most one environment call (reset or step) may take; a later one fails its sample."""
    workers: int = ranged(16, AT_LEAST_1)
    """Environment calls run at once per process (threads beside the decoding)."""
    reward: str = "env"
    """A sample's reward: env (its turns' rewards summed), reward (rl.reward on the final turn) or sum (both)."""
    stop_tokens: list[str] = field(default_factory=list)
    """Texts of single tokens that end a model turn besides the tokenizer's stop ids (a tool call's closing tag)."""

    def check(self) -> None:
        check_ranges(self, "env")
        check_choice("env.reward", self.reward, ENV_REWARDS)

    @property
    def multi_turn(self) -> bool:
        return bool(self.name)
