"""Metric hooks: what an experiment measures in the RL updates beyond the loss's own metrics, plugged
in by the config (``logging.metric_hooks``) instead of threaded through the trainer and the loss.

A hook sees each micro-batch of an update after its loss (``UpdateMicroBatch``) and returns metrics
that add up over the micro-batches and the data-parallel ranks (``losses.reduce_metrics``: SUM, or
MAX for keys ending in "_max"); after the step's K updates are averaged, ``step_metrics`` may turn
them into what is logged (ratios of the summed counts, say). Built in:

- ``probe_token`` (``{token: "~"}``): one token's probability at the response's first position and
  the loss's clip fractions on that token alone (probe/start_prob, probe/clip_frac_high,
  probe/clip_frac_low, probe/tokens): the fork task's measurement of whether a rare, decisive token
  keeps its gradient (docs/reports/cispo_vs_baselines.md).

A hook of one's own is ``module:Class``, built as ``Class(tokenizer=..., **params)``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Mapping, Protocol

import torch

from megacispo.plugins import import_object
from megacispo.rl.losses import GlobalCounts, Sequences, policy_loss_terms

# The mean over a step's responses of the probe token's probability at their first position.
PROBE_START_PROB = "probe/start_prob"


@dataclass(frozen=True)
class UpdateMicroBatch:
    """One micro-batch of an update, after its loss: [b, T] tensors, one position per predicted token."""

    targets: torch.Tensor
    """The tokens predicted (the sequence shifted by one)."""
    loss_mask: torch.Tensor
    """Nonzero on the response tokens the loss trains."""
    logprobs: torch.Tensor
    """The policy's log-probs of ``targets`` (detached)."""
    old_logprobs: torch.Tensor
    advantages: torch.Tensor
    loss_name: str
    loss_params: Mapping[str, object]
    """The loss's parameters this update used (the adapted bounds under rl.adaptive_clip)."""
    counts: GlobalCounts
    """The update's token and sequence counts over every micro-batch and data-parallel rank."""
    sequences: Sequences
    """Which sequence each position belongs to (several per row when the rows are packed)."""
    logprobs_of: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
    """(targets, mask) -> [b, T] the policy's log-probs of other targets at the same positions."""


class MetricHook(Protocol):
    def micro_batch_metrics(self, micro: UpdateMicroBatch) -> dict[str, torch.Tensor]:
        """This micro-batch's share of the update's metrics (scalars, reduced as the loss's are)."""

    def step_metrics(self, metrics: dict[str, float]) -> dict[str, float]:
        """The step's metrics (averaged over its updates) as they are to be logged."""


class ProbeToken:
    """The probe token's start probability and clip fractions (see the module docstring)."""

    def __init__(self, *, tokenizer, token: str):
        try:
            self.token_id = tokenizer.single_token_id(token)
        except ValueError as error:
            raise ValueError(f"token: {error}; choose a text that is one token of data.tokenizer") from None

    def micro_batch_metrics(self, micro: UpdateMicroBatch) -> dict[str, torch.Tensor]:
        probe = (micro.targets == self.token_id) & (micro.loss_mask != 0)
        inputs, terms = policy_loss_terms(micro.loss_name, micro.logprobs, micro.old_logprobs, micro.advantages,
                                          micro.loss_mask, micro.sequences, **micro.loss_params)
        probe = probe & inputs.valid_mask

        def count(flags: torch.Tensor | None) -> torch.Tensor:
            return (flags & probe).sum().float() if flags is not None else torch.zeros((), device=probe.device)

        return {
            "loss/probe_tokens": probe.sum().float(),
            "loss/probe_clipped_high": count(terms.clipped_high),
            "loss/probe_clipped_low": count(terms.clipped_low),
            PROBE_START_PROB: self._start_probability(micro),
        }

    def _start_probability(self, micro: UpdateMicroBatch) -> torch.Tensor:
        """This micro-batch's share of the update's mean probability of the token at the response's first
        position (pre-divided by the update's sequence count)."""
        response = micro.loss_mask != 0
        first = response & (micro.sequences.cumsum(response) == 1)  # [b, T]: one position per sequence
        logprobs = micro.logprobs_of(torch.full_like(micro.targets, self.token_id), first)
        return (logprobs.exp() * first).sum() / micro.counts.num_sequences.clamp(min=1)

    def step_metrics(self, metrics: dict[str, float]) -> dict[str, float]:
        """The clip counts (each a mean over the step's updates) as fractions of the probe tokens:
        probe/clip_frac_high, probe/clip_frac_low (left out when no probe token was sampled), and
        probe/tokens per update. Pipeline stages before the last compute no loss: nothing to turn."""
        if "loss/probe_tokens" not in metrics:
            return metrics
        metrics = dict(metrics)
        tokens = metrics.pop("loss/probe_tokens")
        clipped = {side: metrics.pop(f"loss/probe_clipped_{side}") for side in ("high", "low")}
        metrics["probe/tokens"] = tokens
        if tokens:
            metrics.update({f"probe/clip_frac_{side}": count / tokens for side, count in clipped.items()})
        return metrics


BUILT_IN: dict[str, type] = {"probe_token": ProbeToken}


def build_metric_hooks(specs: Mapping[str, Mapping[str, Any]], tokenizer) -> list[MetricHook]:
    """The hooks of logging.metric_hooks, built at start-up (a user's module imported now); ValueError
    naming the hook's field."""
    return [_build(name, params, tokenizer) for name, params in specs.items()]


def _build(name: str, params: Mapping[str, Any], tokenizer) -> MetricHook:
    field = f"logging.metric_hooks.{name}"
    if name in BUILT_IN:
        cls = BUILT_IN[name]
    elif ":" in name:
        try:
            cls = import_object(name, kind="class")
        except ValueError as error:
            raise ValueError(f"{field}: {error}") from None
    else:
        raise ValueError(f"{field}: unknown metric hook; use one of {', '.join(BUILT_IN)} or module:Class")
    try:
        return cls(tokenizer=tokenizer, **params)
    except TypeError as error:
        raise ValueError(f"{field}: {error}; give the hook's parameters, e.g. probe_token: {{token: \"~\"}}") from None
    except ValueError as error:
        raise ValueError(f"{field}.{error}") from None
