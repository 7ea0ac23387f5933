"""The MoE routers' expert choices: recorded while generating, compared with the rollout's and
replayed (routing replay, R3) in the training engine's forwards.

Each layer's Megatron TopKRouter gets a ``LayerRoutes`` as its ``router_replay``: the hook that
Megatron-Core 0.16.1's ``topk_routing_with_score_function`` calls for the top-k of every routing
(``get_replay_topk``). Megatron's own RouterReplay is not used: its instances live in one
process-wide list (every model built in a process adds its layers, a test builds several), and it
binds the indices to replay to the router by call order (a backward-recompute list popped in
order), where a pipeline schedule interleaves micro-batches. Here the indices come with each
forward call (``HybridModel.forward(routing=...)``), and a layer that recomputes itself in backward
replays what its forward replayed (``HybridDecoderLayer``).

With no targets set the hook returns the router's own top-k untouched, so a model that never
replays computes exactly what it computed before (the same function, the same values). With
targets it

- counts, over the positions ``compare`` marks, the tokens whose own top-k set differs from the
  rollout's (mismatch/router_disagreement), and
- with ``replay``, routes every recorded token to the rollout's experts: the routing weights are the
  softmax over the router's own logits at those experts (gathered, so their gradient reaches the
  router), as Megatron's REPLAY_FORWARD computes them. Positions without a record (the last token of
  each sequence, which the rollout never fed back, and padding) keep the router's own choice.

The lean decode step (models/experts.py) routes without the router module and records through
``record_step``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch


def route_dtype(num_experts: int) -> torch.dtype:
    """The compact dtype of stored expert indices: uint8 up to 256 experts, else int16 (up to 32768)."""
    return torch.uint8 if num_experts <= 256 else torch.int16


@dataclass
class RoutingTargets:
    """The rollout's expert choices for one training forward (a micro-batch of this stage's layers)."""

    experts: torch.Tensor
    """[b, S, L_stage, k] the experts each position's token was routed to during the rollout, per MoE
    layer of this pipeline stage (its layers in order), any integer dtype."""
    recorded: torch.Tensor
    """[b, S] bool: positions the rollout routed (its prompt and response tokens but the last)."""
    compare: torch.Tensor | None
    """[b, S] bool: positions counted in the disagreement (a subset of ``recorded``); None: no counting."""
    replay: bool
    """Route the recorded positions to the rollout's experts."""


class LayerRoutes:
    """One MoE layer's routing hook (its TopKRouter's ``router_replay``)."""

    def __init__(self, layer_index: int) -> None:
        self.layer_index = layer_index
        """Global 0-based layer number."""
        self.recording = False
        self.recorded: torch.Tensor | None = None
        """[T, k] int64 the experts of the last routing while ``recording`` (T tokens in [s, b] order)."""
        self.target: torch.Tensor | None = None
        """[T, k] int64 the rollout's experts for the tokens the router sees next."""
        self.target_recorded: torch.Tensor | None = None
        """[T] bool: the tokens that have a target."""
        self.compare: torch.Tensor | None = None
        """[T] bool: the tokens counted in ``counts``; None: none."""
        self.replay = False
        self.counts: torch.Tensor | None = None
        """float64 [2]: (tokens whose own top-k set differs from the target, tokens compared), summed
        until ``take_counts``."""

    def set_targets(self, target: torch.Tensor | None, recorded: torch.Tensor | None,
                    compare: torch.Tensor | None, replay: bool) -> None:
        """Targets for the tokens of the next routings ([T, k], [T], [T] or None); None: route freely."""
        self.target, self.target_recorded, self.compare = target, recorded, compare
        self.replay = replay and target is not None

    def pinned(self) -> tuple:
        """The current targets, for a layer that recomputes itself in backward (``restore``)."""
        return self.target, self.target_recorded, self.compare, self.replay

    def restore(self, pinned: tuple) -> None:
        """Targets as ``pinned`` returned them. (Only the no-grad old-log-prob forward compares, and it
        recomputes nothing: no count is taken twice.)"""
        self.target, self.target_recorded, self.compare, self.replay = pinned

    def get_replay_topk(
        self, scores: torch.Tensor, topk: int, num_groups: int | None = None, group_topk: int | None = None,
        default_compute_topk: Callable | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Megatron's hook: (top-k scores [T, k], experts [T, k]) of ``scores`` [T, E]."""
        values, experts = default_compute_topk(scores, topk, num_groups, group_topk)
        if self.recording:
            self.recorded = experts
        if self.target is None:
            return values, experts
        if self.compare is not None:
            self._count(experts, self.target, self.compare)
        if not self.replay:
            return values, experts
        chosen = torch.where(self.target_recorded[:, None], self.target, experts)
        return scores.gather(1, chosen), chosen

    def record_step(self, experts: torch.Tensor) -> None:
        """The lean decode step's choice [b, k] (it routes without the router module)."""
        if self.recording:
            self.recorded = experts

    def _count(self, experts: torch.Tensor, target: torch.Tensor, compare: torch.Tensor) -> None:
        differs = (experts.sort(dim=-1).values != target.sort(dim=-1).values).any(dim=-1) & compare
        counts = torch.stack([differs.sum(), compare.sum()]).double()
        self.counts = counts if self.counts is None else self.counts + counts

    def take_counts(self) -> torch.Tensor | None:
        """The counts since the last call (None: nothing compared), reset."""
        counts, self.counts = self.counts, None
        return counts


def local_targets(values: torch.Tensor, sequence_parallel_rank: int | None, tp_size: int) -> torch.Tensor:
    """[b, S, ...] per-position values -> [T, ...] in the router's token order: [S, b] flattened, this
    rank's contiguous S / TP slice of the sequence under sequence parallelism (``sequence_parallel_rank``)."""
    values = values.transpose(0, 1)
    if sequence_parallel_rank is not None:
        values = values.chunk(tp_size, dim=0)[sequence_parallel_rank]
    return values.reshape(-1, *values.shape[2:])


def disagreement_metrics(counts: torch.Tensor) -> dict[str, float]:
    """mismatch/router_disagreement and per layer _layer{i} from [layers, 2] (differing, compared)
    counts added over every rank; NaN where nothing was compared."""
    def fraction(differ: float, compared: float) -> float:
        return differ / compared if compared else float("nan")

    total = counts.sum(dim=0).tolist()
    metrics = {"mismatch/router_disagreement": fraction(*total)}
    for layer, (differ, compared) in enumerate(counts.tolist()):
        metrics[f"mismatch/router_disagreement_layer{layer}"] = fraction(differ, compared)
    return metrics
