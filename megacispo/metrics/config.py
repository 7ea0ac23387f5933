"""The logging section (``logging:``): where metrics go besides TensorBoard and the console, and the
metric hooks a run turns on."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(kw_only=True)
class LoggingConfig:
    """Where metrics go besides TensorBoard and the console."""

    wandb: bool = False
    """Also log to Weights & Biases (pip install -e .[wandb]; WANDB_MODE=offline works without a network)."""
    wandb_project: str = "megacispo"
    """The W&B project."""
    wandb_run_name: str = ""
    """The W&B run name (empty: the name of train.run_dir)."""
    metric_hooks: dict[str, dict[str, Any]] = field(default_factory=dict)
    """Metrics of the RL updates beyond the loss's, by hook name (probe_token) or module:Class, each with its parameters, e.g. {probe_token: {token: "~"}} (megacispo.rl.metric_hooks)."""

    def check(self) -> None:
        for name, params in self.metric_hooks.items():
            if not isinstance(params, dict):
                raise ValueError(f"logging.metric_hooks.{name} = {params!r}: give the hook's parameters as a mapping, "
                                 f"e.g. probe_token: {{token: \"~\"}}, or {{}} for none")
