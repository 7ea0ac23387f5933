"""Policy-gradient losses (CISPO and its baselines) behind one registry, normalized per optimizer step.

Every loss takes the same inputs, all [batch, seq] aligned token by token with the labels:
``logprobs`` (the current policy, carries the gradient), ``old_logprobs`` (the policy that produced
the data), ``advantages`` ([batch] or [batch, seq]) and ``loss_mask`` (nonzero on response tokens),
and ``sequences``: which sequence each position belongs to (``Sequences``; one per row unless the
rows are packed, megacispo.training.packing), for what is taken per sequence.
A loss is selected by name (``compute_policy_loss("cispo", ...)``); ``describe_policy_losses()``
lists the names and parameters straight from the registry, so help text cannot drift from code.

Normalization invariant. The objective of one optimizer step is a sum over every loss token of the
step (all micro-batches, all data-parallel ranks) divided by a step-global count: the number of
valid tokens (``token_mean``) or of sequences (``sequence_mean``, original GRPO). The trainer calls
``compute_global_counts`` once per step with the masks of ALL its micro-batches and the
data-parallel group, and passes the result to every ``compute_policy_loss`` call of that step. Then

    sum over micro-batches m and DP ranks d of compute_policy_loss(batch[m, d], global_counts)
        == compute_policy_loss(whole step batch)                  (value and gradient)

whereas a per-micro-batch mean would weight tokens by the size of the micro-batch they landed in,
a different objective. The metrics follow the same rule (see ``reduce_metrics``).
"""

from __future__ import annotations

import dataclasses
import inspect
import math
import typing
from dataclasses import dataclass, field
from typing import Callable, Literal, Mapping, Sequence

import torch
import torch.distributed as dist
from torch.distributed.nn.functional import all_reduce as all_reduce_differentiable

# exp(88.7) overflows fp32: a token the rollout engine sampled at a tiny probability (log-ratio in
# the hundreds) would make r = inf and the loss or its gradient inf/NaN. exp(20) ~ 4.9e8 is finite
# in fp32 and bf16 and far above any clip cap (CISPO's is ~5), so the clamp never changes a clipped
# value; it only keeps unclipped ratios (reinforce, metrics) finite.
LOG_RATIO_CLAMP = 20.0

METRIC_PREFIX = "loss/"
# Metric keys ending in this suffix reduce with MAX over micro-batches and ranks; all others with SUM.
MAX_METRIC_SUFFIX = "_max"

AggregationMode = Literal["token_mean", "sequence_mean"]
AGGREGATION_MODES: tuple[str, ...] = typing.get_args(AggregationMode)


# ---------------------------------------------------------------------------------------------
# Global counts and the one aggregation function
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class GlobalCounts:
    """Denominators of one optimizer step's objective, summed over all micro-batches and DP ranks."""

    num_tokens: torch.Tensor
    """int64 scalar: loss tokens (loss_mask nonzero and old log-prob finite) of the whole step."""
    num_sequences: torch.Tensor
    """int64 scalar: sequences with at least one such token (the ``sequence_mean`` denominator)."""


@dataclass(frozen=True)
class Sequences:
    """Which sequence each position of a [batch, seq] micro-batch belongs to: one per row (right-padded
    rows, ``Sequences.rows``) or several (packed rows). Every per-sequence quantity goes through it.

    Under context parallelism each rank of ``group`` holds a piece of every sequence of the packed row
    (the same ids and count on each: megacispo.training.packing): ``sum`` is then taken over the group,
    so that a sequence's ratio or token count is that of the whole sequence, on every rank."""

    ids: torch.Tensor
    """[batch, seq] int64 in 0..count - 1, non-decreasing in row-major order."""
    count: int
    """Sequences of the micro-batch (a packed row's trailing padding counts as one)."""
    group: dist.ProcessGroup | None = None
    """The context-parallel ranks holding the other pieces of these sequences; None: each is whole here."""

    @classmethod
    def rows(cls, like: torch.Tensor) -> Sequences:
        """One sequence per row of ``like`` [batch, seq]."""
        batch, seq = like.shape
        return cls(torch.arange(batch, device=like.device)[:, None].expand(batch, seq), batch)

    def split_over(self, group: dist.ProcessGroup) -> Sequences:
        """These sequences with pieces on every rank of ``group`` (context parallelism); a group of one
        rank holds them whole."""
        return dataclasses.replace(self, group=group if group.size() > 1 else None)

    def sum(self, values: torch.Tensor) -> torch.Tensor:
        """[count]: the sum of [batch, seq] ``values`` over each sequence's positions on every rank of
        ``group``. Differentiable: every rank's loss depends on every rank's positions, so the backward
        sums the gradients over the group too."""
        totals = self.partial_sum(values)
        return totals if self.group is None else all_reduce_differentiable(totals, group=self.group)

    def partial_sum(self, values: torch.Tensor) -> torch.Tensor:
        """[count]: the sum of [batch, seq] ``values`` over each sequence's positions on this rank only
        (this rank's share of a sum over the group)."""
        if values.dtype == torch.bool:
            values = values.long()
        return values.new_zeros(self.count).index_add(0, self.ids.reshape(-1), values.reshape(-1))

    def count_with(self, mask: torch.Tensor) -> torch.Tensor:
        """int64 scalar: the sequences with a position in bool [batch, seq] ``mask`` on any rank of
        ``group``, counted by its first rank only (the others hold the same sequences), so that a sum
        over the ranks counts each sequence once."""
        present = (self.sum(mask) > 0).sum()
        return present if self.group is None or self.group.rank() == 0 else torch.zeros_like(present)

    def cumsum(self, values: torch.Tensor) -> torch.Tensor:
        """[batch, seq]: the running sum of ``values`` within each sequence's positions on this rank."""
        totals = self.partial_sum(values)
        running = values.reshape(-1).cumsum(0).view(values.shape)
        return running - (totals.cumsum(0) - totals)[self.ids]


def valid_token_mask(loss_mask: torch.Tensor, old_logprobs: torch.Tensor) -> torch.Tensor:
    """Tokens that enter the loss: response tokens whose old log-prob is finite. bool, [batch, seq].

    The single definition shared by the loss and the counts, so both always agree.
    """
    return (loss_mask != 0) & torch.isfinite(old_logprobs)


def compute_global_counts(
    loss_masks: Sequence[torch.Tensor],
    old_logprobs: Sequence[torch.Tensor],
    group: dist.ProcessGroup | None = None,
    sequences: Sequence[Sequences] | None = None,
) -> GlobalCounts:
    """Count the loss tokens and sequences of one optimizer step; call once per step.

    Args:
        loss_masks: the loss mask of every micro-batch of the step on this rank, each [batch, seq].
        old_logprobs: the matching old log-probs; tokens with a non-finite one are not counted,
            exactly as ``compute_policy_loss`` drops them.
        group: the data-parallel group to sum the counts over (DP x CP under context parallelism). None
            means no reduction (a single data-parallel rank); unlike torch.distributed, None does NOT mean
            the world group.
        sequences: each micro-batch's ``Sequences``; None: one sequence per row. A sequence split over
            context-parallel ranks (``Sequences.group``) is counted once.

    Every micro-batch loss divided by these counts sums, over micro-batches and DP ranks, to the
    loss of the whole step's batch (the module docstring states the invariant). Under pipeline
    parallelism call it on the ranks that compute the loss, with their data-parallel group.
    """
    if len(loss_masks) != len(old_logprobs) or not loss_masks:
        raise ValueError(
            f"loss_masks ({len(loss_masks)} tensors) and old_logprobs ({len(old_logprobs)} tensors) must be "
            "non-empty and hold one tensor per micro-batch each"
        )
    valid_masks = []
    for index, (loss_mask, old) in enumerate(zip(loss_masks, old_logprobs)):
        _check_same_shape(f"loss_masks[{index}]", loss_mask, f"old_logprobs[{index}]", old)
        valid_masks.append(valid_token_mask(loss_mask, old))
    return _sum_counts(valid_masks, group, sequences)


def count_loss_tokens(
    loss_masks: Sequence[torch.Tensor],
    group: dist.ProcessGroup | None = None,
    sequences: Sequence[Sequences] | None = None,
) -> GlobalCounts:
    """Count the loss tokens and sequences of one optimizer step of a loss without old log-probs
    (SFT's cross-entropy): every nonzero entry of the micro-batches' loss masks [batch, seq],
    summed over ``group`` as ``compute_global_counts`` sums them (None: no reduction)."""
    if not loss_masks:
        raise ValueError("loss_masks is empty: pass one loss mask per micro-batch of the step")
    return _sum_counts([loss_mask != 0 for loss_mask in loss_masks], group, sequences)


def _sum_counts(
    valid_masks: Sequence[torch.Tensor], group: dist.ProcessGroup | None, sequences: Sequence[Sequences] | None
) -> GlobalCounts:
    """Tokens and sequences with a token of the bool [batch, seq] ``valid_masks``, summed over ``group``."""
    if sequences is None:
        sequences = [Sequences.rows(valid) for valid in valid_masks]
    num_tokens = torch.zeros((), dtype=torch.int64, device=valid_masks[0].device)
    num_sequences = torch.zeros_like(num_tokens)
    for valid, members in zip(valid_masks, sequences, strict=True):
        num_tokens = num_tokens + valid.sum()
        num_sequences = num_sequences + members.count_with(valid)
    if group is not None:
        # One collective for both counts; int64 keeps them exact at any batch size.
        counts = torch.stack([num_tokens, num_sequences])
        dist.all_reduce(counts, op=dist.ReduceOp.SUM, group=group)
        num_tokens, num_sequences = counts[0], counts[1]
    return GlobalCounts(num_tokens=num_tokens, num_sequences=num_sequences)


def aggregate_loss(
    per_token_loss: torch.Tensor,
    valid_mask: torch.Tensor,
    mode: AggregationMode,
    counts: GlobalCounts,
    sequences: Sequences,
) -> torch.Tensor:
    """Reduce a [batch, seq] per-token loss to this micro-batch's share of the step objective.

    token_mean:    sum over valid tokens / counts.num_tokens  (CISPO, DAPO: every token weighs the same)
    sequence_mean: sum over sequences of (mean over the sequence's valid tokens) / counts.num_sequences
                   (original GRPO); each sequence whole in this micro-batch, or split over the context-parallel
                   ranks of ``sequences.group``: then each rank's share is its positions' sum over the whole
                   sequence's token count, and the shares sum over the ranks to the sequence's mean.
    The counts are clamped to 1 so an all-masked step gives 0, not NaN.
    """
    # where, not multiply: a NaN or inf at a masked position times 0 would still be NaN.
    masked_loss = torch.where(valid_mask, per_token_loss, 0.0)
    if mode == "token_mean":
        return masked_loss.sum() / counts.num_tokens.clamp(min=1)
    if mode == "sequence_mean":
        tokens_per_sequence = sequences.sum(valid_mask).clamp(min=1)
        return (sequences.partial_sum(masked_loss) / tokens_per_sequence).sum() / counts.num_sequences.clamp(min=1)
    raise ValueError(f"aggregation mode {mode!r} is unknown; valid modes: {', '.join(AGGREGATION_MODES)}")


# ---------------------------------------------------------------------------------------------
# Registry
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class PolicyLossInputs:
    """What every registered loss receives: [batch, seq] tensors, checked, finite and in fp32 or wider.

    Tokens outside ``valid_mask`` hold neutral values (logprobs 0, ratio 1, advantage 0), so no loss
    needs to guard against NaN; their per-token loss is discarded by ``aggregate_loss``.
    """

    logprobs: torch.Tensor
    """Current policy log-probs; the only tensor that carries a gradient."""
    advantages: torch.Tensor
    """Detached, broadcast to [batch, seq]."""
    log_ratio: torch.Tensor
    """logprobs - old_logprobs clamped to +-LOG_RATIO_CLAMP; carries the gradient."""
    ratio: torch.Tensor
    """Importance weight pi_theta / pi_old = exp(log_ratio); carries the gradient."""
    valid_mask: torch.Tensor
    """bool: response tokens with a finite old log-prob."""
    sequences: Sequences
    """Which sequence each position belongs to."""


@dataclass(frozen=True)
class TokenLossTerms:
    """What a registered loss returns: per-token loss and per-token flags for the metrics, [batch, seq]."""

    per_token_loss: torch.Tensor
    clipped_high: torch.Tensor | None = None
    """bool: the IS weight (CISPO) or the PPO clipped branch (grpo, dapo) acted above the ratio 1."""
    clipped_low: torch.Tensor | None = None
    """bool: the same below the ratio 1."""
    masked: torch.Tensor | None = None
    """bool: tokens a token mask removed from the gradient (CISPO's unified form)."""
    token_metrics: dict[str, torch.Tensor] = field(default_factory=dict)
    """Extra detached per-token quantities, reported as their mean over valid tokens."""


PolicyLossFn = Callable[..., TokenLossTerms]


@dataclass(frozen=True)
class PolicyLossSpec:
    """A registered loss: the function, how its per-token loss is aggregated, its parameters."""

    name: str
    fn: PolicyLossFn
    aggregation: AggregationMode
    param_defaults: dict[str, object]
    param_types: dict[str, object]

    def describe(self) -> str:
        params = ", ".join(f"{name}={default!r}" for name, default in self.param_defaults.items()) or "none"
        summary = (inspect.getdoc(self.fn) or "").split("\n", 1)[0]
        return f"{self.name} [{self.aggregation}]: {summary} Parameters: {params}."


_POLICY_LOSSES: dict[str, PolicyLossSpec] = {}


def register_policy_loss(
    name: str, aggregation: AggregationMode = "token_mean"
) -> Callable[[PolicyLossFn], PolicyLossFn]:
    """Register ``fn(inputs: PolicyLossInputs, *, param=default, ...) -> TokenLossTerms`` under ``name``.

    Parameters are keyword-only with defaults; they are what ``compute_policy_loss(**params)`` and
    the config accept. Scalar parameters are non-negative floats (None where optional); tensor
    parameters are [batch, seq] and type-annotated ``torch.Tensor | None``.
    """
    if aggregation not in AGGREGATION_MODES:
        raise ValueError(f"aggregation {aggregation!r} is unknown; valid modes: {', '.join(AGGREGATION_MODES)}")

    def decorator(fn: PolicyLossFn) -> PolicyLossFn:
        if name in _POLICY_LOSSES:
            raise ValueError(f"policy loss {name!r} is already registered")
        signature = inspect.signature(fn)
        inputs_param, *params = signature.parameters.values()
        if inputs_param.kind is not inspect.Parameter.POSITIONAL_OR_KEYWORD or any(
            p.kind is not inspect.Parameter.KEYWORD_ONLY or p.default is inspect.Parameter.empty for p in params
        ):
            raise ValueError(
                f"policy loss {name!r} must have the signature fn(inputs, *, param=default, ...), got {signature}"
            )
        hints = typing.get_type_hints(fn)
        _POLICY_LOSSES[name] = PolicyLossSpec(
            name=name,
            fn=fn,
            aggregation=aggregation,
            param_defaults={p.name: p.default for p in params},
            param_types={p.name: hints[p.name] for p in params},
        )
        return fn

    return decorator


def policy_loss_names() -> list[str]:
    """The registered loss names, sorted."""
    return sorted(_POLICY_LOSSES)


def describe_policy_losses() -> str:
    """One line per registered loss: name, aggregation, summary, parameters with defaults."""
    return "\n".join(_POLICY_LOSSES[name].describe() for name in policy_loss_names())


def get_policy_loss(name: str) -> PolicyLossSpec:
    """The registered loss ``name``; ValueError listing the valid names otherwise."""
    if name not in _POLICY_LOSSES:
        raise ValueError(
            f"policy loss {name!r} is unknown; valid names: {', '.join(policy_loss_names())}.\n"
            + describe_policy_losses()
        )
    return _POLICY_LOSSES[name]


def validate_policy_loss_params(name: str, params: Mapping[str, object]) -> dict[str, object]:
    """Check ``params`` for loss ``name`` and return them completed with the defaults.

    Called once, at start-up, with the config's parameters (megacispo.startup.check_config).
    """
    spec = get_policy_loss(name)
    unknown = sorted(set(params) - set(spec.param_defaults))
    if unknown:
        raise ValueError(f"unknown parameter(s) {', '.join(unknown)} for policy loss {name!r}. {spec.describe()}")
    for param, value in params.items():
        _check_param_value(spec, param, value)
    return {**spec.param_defaults, **params}


def _check_param_value(spec: PolicyLossSpec, param: str, value: object) -> None:
    accepted = typing.get_args(spec.param_types[param]) or (spec.param_types[param],)
    if value is None and type(None) in accepted:
        return
    if torch.Tensor in accepted and isinstance(value, torch.Tensor):
        return
    is_number = isinstance(value, (int, float)) and not isinstance(value, bool)
    if float in accepted and is_number and math.isfinite(value) and value >= 0:
        return
    raise ValueError(
        f"parameter {param}={value!r} of policy loss {spec.name!r} is invalid: expected "
        f"{_describe_accepted(accepted)}. {spec.describe()}"
    )


def _describe_accepted(accepted: tuple) -> str:
    names = {float: "a finite float >= 0", torch.Tensor: "a [batch, seq] tensor", type(None): "None"}
    return " or ".join(names.get(kind, str(kind)) for kind in accepted)


# ---------------------------------------------------------------------------------------------
# Public entry
# ---------------------------------------------------------------------------------------------


def compute_policy_loss(
    name: str,
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    loss_mask: torch.Tensor,
    global_counts: GlobalCounts | None = None,
    token_weights: torch.Tensor | None = None,
    sequences: Sequences | None = None,
    **params: object,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """This micro-batch's share of the step loss of policy loss ``name``, and its metrics.

    Args:
        logprobs: [batch, seq] log-probs of the sampled tokens under the current policy (grad flows).
        old_logprobs: [batch, seq] log-probs under the policy that generated the data. Tokens where
            they are not finite (a rollout engine's -inf or NaN) are dropped and counted.
        advantages: [batch] (one per sequence) or [batch, seq].
        loss_mask: [batch, seq], nonzero on response tokens; prompt and padding are 0.
        global_counts: from ``compute_global_counts`` over the whole step. None uses this batch's
            own counts: right for a single micro-batch on a single rank only.
        token_weights: [batch, seq] detached factors of each token's loss, or None: a correction for
            the gap between rollout and training probabilities (megacispo.rl.rollout_correction, tis),
            applied the same way to every loss.
        sequences: which sequence each position belongs to (packed rows); None: one per row.
        params: the loss's parameters (``describe_policy_losses()``), e.g. eps_high=4.0, checked once
            at start-up (``validate_policy_loss_params``); those not given take the loss's defaults.

    Returns:
        loss: scalar; summed over the step's micro-batches and DP ranks it is the step objective.
        metrics: detached scalars, combined over micro-batches and ranks by ``reduce_metrics``:
            loss/policy_loss, loss/clip_frac_high, loss/clip_frac_low, loss/mask_frac,
            loss/is_weight_mean, loss/advantage_mean, loss/advantage_abs_mean, loss/approx_kl
            (token means, pre-divided by global_counts.num_tokens: they SUM to the step value),
            loss/num_tokens, loss/num_nonfinite_dropped (counts: SUM), loss/is_weight_max (MAX),
            plus the loss's own token means (grpo with ref_logprobs: loss/ref_kl).
    """
    spec = get_policy_loss(name)
    tensor_params = {key: value for key, value in params.items() if isinstance(value, torch.Tensor)}
    optional = {} if token_weights is None else {"token_weights": token_weights}
    _check_input_shapes(logprobs, old_logprobs, advantages, loss_mask, {**tensor_params, **optional})
    if sequences is None:
        sequences = Sequences.rows(logprobs)
    if global_counts is None:
        global_counts = compute_global_counts([loss_mask], [old_logprobs], sequences=[sequences])

    inputs, terms = policy_loss_terms(name, logprobs, old_logprobs, advantages, loss_mask, sequences, **params)
    per_token_loss = terms.per_token_loss
    if token_weights is not None:
        per_token_loss = per_token_loss * token_weights.detach().to(per_token_loss.dtype)
    loss = aggregate_loss(per_token_loss, inputs.valid_mask, spec.aggregation, global_counts, sequences)
    num_dropped = ((loss_mask != 0) & ~torch.isfinite(old_logprobs)).sum()
    metrics = _loss_metrics(inputs, terms, global_counts, loss, num_dropped)
    return loss, metrics


def policy_loss_terms(
    name: str,
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    loss_mask: torch.Tensor,
    sequences: Sequences | None = None,
    **params: object,
) -> tuple[PolicyLossInputs, TokenLossTerms]:
    """The per-token terms of policy loss ``name`` (the same arguments as ``compute_policy_loss``, whose
    shapes it has checked): what the step loss aggregates, and the clip flags that metric hooks count
    on tokens of their own (megacispo.rl.metric_hooks)."""
    inputs = _prepare_inputs(logprobs, old_logprobs, advantages, loss_mask,
                             Sequences.rows(logprobs) if sequences is None else sequences)
    return inputs, get_policy_loss(name).fn(inputs, **params)


def _check_same_shape(name_a: str, a: torch.Tensor, name_b: str, b: torch.Tensor) -> None:
    if a.shape != b.shape:
        raise ValueError(
            f"{name_a} has shape {tuple(a.shape)} but {name_b} has shape {tuple(b.shape)}; "
            "pass tensors aligned token by token"
        )


def _check_input_shapes(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    loss_mask: torch.Tensor,
    tensor_params: Mapping[str, torch.Tensor],
) -> None:
    if logprobs.dim() != 2:
        raise ValueError(f"logprobs must be [batch, seq], got shape {tuple(logprobs.shape)}")
    for name, tensor in {"old_logprobs": old_logprobs, "loss_mask": loss_mask, **tensor_params}.items():
        _check_same_shape(name, tensor, "logprobs", logprobs)
    if advantages.shape not in (logprobs.shape, logprobs.shape[:1]):
        raise ValueError(
            f"advantages has shape {tuple(advantages.shape)} but logprobs has shape {tuple(logprobs.shape)}; "
            f"pass advantages as [batch] = {tuple(logprobs.shape[:1])} or [batch, seq] = {tuple(logprobs.shape)}"
        )


def _prepare_inputs(
    logprobs: torch.Tensor, old_logprobs: torch.Tensor, advantages: torch.Tensor, loss_mask: torch.Tensor,
    sequences: Sequences,
) -> PolicyLossInputs:
    # bf16 log-probs would round ratios near 1 by ~0.4%: the loss math runs in fp32 at least.
    dtype = torch.promote_types(logprobs.dtype, torch.float32)
    valid = valid_token_mask(loss_mask, old_logprobs)
    # Replace invalid positions before any arithmetic: where() routes a zero gradient to them, while
    # a NaN from padding multiplied by a zero mask would poison the gradient.
    logprobs = torch.where(valid, logprobs.to(dtype), 0.0)
    old_logprobs = torch.where(valid, old_logprobs.detach().to(dtype), 0.0)
    advantages = advantages.detach().to(dtype)
    if advantages.dim() == 1:
        advantages = advantages[:, None].expand_as(logprobs)
    advantages = torch.where(valid, advantages, 0.0)
    log_ratio = (logprobs - old_logprobs).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    return PolicyLossInputs(
        logprobs=logprobs,
        advantages=advantages,
        log_ratio=log_ratio,
        ratio=torch.exp(log_ratio),
        valid_mask=valid,
        sequences=sequences,
    )


# ---------------------------------------------------------------------------------------------
# Metrics
# ---------------------------------------------------------------------------------------------


def _loss_metrics(
    inputs: PolicyLossInputs,
    terms: TokenLossTerms,
    counts: GlobalCounts,
    loss: torch.Tensor,
    num_dropped: torch.Tensor,
) -> dict[str, torch.Tensor]:
    """Per-token means pre-divided by the step's global token count, so that SUM gives the step mean."""
    valid = inputs.valid_mask
    num_tokens = counts.num_tokens.clamp(min=1)
    ratio = inputs.ratio.detach()
    log_ratio = inputs.log_ratio.detach()

    def token_mean(values: torch.Tensor) -> torch.Tensor:
        return (torch.where(valid, values.to(ratio.dtype), 0.0).sum() / num_tokens).float()

    def fraction(flags: torch.Tensor | None) -> torch.Tensor:
        return token_mean(flags & valid) if flags is not None else torch.zeros((), device=ratio.device)

    metrics = {
        "policy_loss": loss.detach().float(),
        "clip_frac_high": fraction(terms.clipped_high),
        "clip_frac_low": fraction(terms.clipped_low),
        "mask_frac": fraction(terms.masked),
        "is_weight_mean": token_mean(ratio),
        # Ratios are positive, so 0 at invalid tokens never wins the max.
        "is_weight_max": torch.where(valid, ratio, 0.0).amax().float(),
        "advantage_mean": token_mean(inputs.advantages),
        "advantage_abs_mean": token_mean(inputs.advantages.abs()),
        # k3 estimator of KL(pi_old || pi_theta) on the pi_old samples: unbiased and never negative.
        "approx_kl": token_mean(ratio - 1 - log_ratio),
        "num_tokens": valid.sum().float(),
        "num_nonfinite_dropped": num_dropped.float(),
    }
    metrics.update({key: token_mean(value.detach()) for key, value in terms.token_metrics.items()})
    return {METRIC_PREFIX + key: value for key, value in metrics.items()}


def reduce_metrics(
    per_microbatch: Sequence[Mapping[str, torch.Tensor]], group: dist.ProcessGroup | None = None
) -> dict[str, torch.Tensor]:
    """Combine the metrics of a step's micro-batches, then across ``group`` (None: this rank only).

    Keys ending in "_max" reduce with MAX, all others with SUM (means are pre-divided by the global
    token count, counts add up). Every rank of ``group`` must call it with the same keys: two
    collectives. Returns float64 scalars; call .item() once per step for logging.
    """
    if not per_microbatch:
        raise ValueError("per_microbatch is empty; pass the metrics dict of every micro-batch of the step")
    keys = list(per_microbatch[0])
    for index, metrics in enumerate(per_microbatch):
        if set(metrics) != set(keys):
            raise ValueError(
                f"micro-batch {index} has metric keys {sorted(metrics)} but micro-batch 0 has {sorted(keys)}"
            )
    sum_keys = [key for key in keys if not key.endswith(MAX_METRIC_SUFFIX)]
    max_keys = [key for key in keys if key.endswith(MAX_METRIC_SUFFIX)]
    sums = _stack_metrics(per_microbatch, sum_keys).sum(dim=0)
    maxes = _stack_metrics(per_microbatch, max_keys).amax(dim=0)
    if group is not None:
        dist.all_reduce(sums, op=dist.ReduceOp.SUM, group=group)
        dist.all_reduce(maxes, op=dist.ReduceOp.MAX, group=group)
    return {**dict(zip(sum_keys, sums.unbind())), **dict(zip(max_keys, maxes.unbind()))}


def _stack_metrics(per_microbatch: Sequence[Mapping[str, torch.Tensor]], keys: list[str]) -> torch.Tensor:
    """[num_microbatches, len(keys)] float64."""
    if not keys:
        device = next(iter(per_microbatch[0].values())).device
        return torch.zeros(len(per_microbatch), 0, dtype=torch.float64, device=device)
    return torch.stack([torch.stack([metrics[key].double() for key in keys]) for metrics in per_microbatch])


# ---------------------------------------------------------------------------------------------
# The losses
# ---------------------------------------------------------------------------------------------


def _trust_region_exits(
    ratio: torch.Tensor, advantages: torch.Tensor, eps_low: float | None, eps_high: float | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Tokens that PPO-clip with these bounds stops: (A > 0 and r > 1 + eps_high, A < 0 and r < 1 - eps_low).

    A None bound disables its side. The same sets are CISPO's unified mask and PPO's clip fraction.
    """
    no_token = torch.zeros_like(ratio, dtype=torch.bool)
    above = (advantages > 0) & (ratio > 1 + eps_high) if eps_high is not None else no_token
    below = (advantages < 0) & (ratio < 1 - eps_low) if eps_low is not None else no_token
    return above, below


@register_policy_loss("cispo")
def cispo_loss(
    inputs: PolicyLossInputs,
    *,
    eps_low: float = 1.0,
    eps_high: float = 4.0,
    mask_eps_low: float | None = None,
    mask_eps_high: float | None = None,
) -> TokenLossTerms:
    """CISPO (MiniMax-M1): -sg(clip(r, 1-eps_low, 1+eps_high)) * A * logp; mask_eps_* enable the unified token mask.

    The clipped IS weight is detached, so every token keeps the gradient -r_hat * A of log pi,
    including tokens whose ratio passed the cap. eps_low = 1.0 means no lower bound (r >= 0).
    The unified mask (off by default) removes tokens with A > 0 and r > 1 + mask_eps_high or
    A < 0 and r < 1 - mask_eps_low; they still count in the token normalization.
    """
    ratio = inputs.ratio.detach()
    is_weight = ratio.clamp(1 - eps_low, 1 + eps_high)
    above, below = _trust_region_exits(ratio, inputs.advantages, mask_eps_low, mask_eps_high)
    masked = above | below
    per_token_loss = torch.where(masked, 0.0, -is_weight * inputs.advantages * inputs.logprobs)
    return TokenLossTerms(
        per_token_loss=per_token_loss,
        clipped_high=ratio > 1 + eps_high,
        clipped_low=ratio < 1 - eps_low,
        masked=masked,
    )


def _ppo_clip_terms(inputs: PolicyLossInputs, eps_low: float, eps_high: float) -> TokenLossTerms:
    """PPO-clip: -min(r * A, clip(r, 1 - eps_low, 1 + eps_high) * A); a clipped token gets no gradient."""
    ratio, advantages = inputs.ratio, inputs.advantages
    per_token_loss = -torch.minimum(ratio * advantages, ratio.clamp(1 - eps_low, 1 + eps_high) * advantages)
    above, below = _trust_region_exits(ratio.detach(), advantages, eps_low, eps_high)
    return TokenLossTerms(per_token_loss=per_token_loss, clipped_high=above, clipped_low=below)


@register_policy_loss("grpo", aggregation="sequence_mean")
def grpo_loss(
    inputs: PolicyLossInputs,
    *,
    eps: float = 0.2,
    kl_coef: float = 0.0,
    ref_logprobs: torch.Tensor | None = None,
) -> TokenLossTerms:
    """GRPO: PPO-clip with eps, plus kl_coef * k3 KL to ref_logprobs; per-sequence mean, then mean over sequences.

    The KL term is the k3 estimator of KL(pi_theta || pi_ref): pi_ref/pi - log(pi_ref/pi) - 1,
    with the log-ratio clamped like the IS ratio. Reported as "ref_kl" when ref_logprobs is given.
    """
    terms = _ppo_clip_terms(inputs, eps, eps)
    if ref_logprobs is None:
        if kl_coef > 0:
            raise ValueError(f"grpo has kl_coef={kl_coef} but no ref_logprobs; pass ref_logprobs or set kl_coef=0")
        return terms
    ref_logprobs = torch.where(inputs.valid_mask, ref_logprobs.detach().to(inputs.logprobs.dtype), 0.0)
    ref_log_ratio = (ref_logprobs - inputs.logprobs).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    ref_kl = torch.exp(ref_log_ratio) - ref_log_ratio - 1
    return dataclasses.replace(
        terms,
        per_token_loss=terms.per_token_loss + kl_coef * ref_kl,
        token_metrics={"ref_kl": ref_kl.detach()},
    )


@register_policy_loss("dapo")
def dapo_loss(inputs: PolicyLossInputs, *, eps_low: float = 0.2, eps_high: float = 0.28) -> TokenLossTerms:
    """DAPO: PPO-clip with clip-higher (eps_low, eps_high), token-level normalization."""
    return _ppo_clip_terms(inputs, eps_low, eps_high)


@register_policy_loss("reinforce")
def reinforce_loss(inputs: PolicyLossInputs) -> TokenLossTerms:
    """REINFORCE with the IS weight, unclipped: -sg(r) * A * logp (CISPO without clipping)."""
    return TokenLossTerms(per_token_loss=-inputs.ratio.detach() * inputs.advantages * inputs.logprobs)


@register_policy_loss("gspo", aggregation="sequence_mean")
def gspo_loss(inputs: PolicyLossInputs, *, eps_low: float = 3e-4, eps_high: float = 4e-4) -> TokenLossTerms:
    """GSPO (Qwen): PPO-clip on the sequence ratio s = exp(mean log r over the sequence's tokens); mean over sequences.

    The sequence ratio is the geometric mean of the token ratios and carries the gradient
    s * mean(grad log pi): every token of a sequence gets the same weight, and a sequence whose
    ratio left [1 - eps_low, 1 + eps_high] on the side its advantage favours gets none. The paper's
    bounds are this small because s averages out the token ratios' noise. Each token carries its
    sequence's loss, so the per-sequence mean of ``sequence_mean`` is that loss. Each sequence must
    be whole in its micro-batch, as for grpo (its pieces on context-parallel ranks are summed over them:
    ``Sequences.sum``).
    """
    valid, sequences = inputs.valid_mask, inputs.sequences
    num_tokens = sequences.sum(valid).clamp(min=1)
    sequence_log_ratio = sequences.sum(torch.where(valid, inputs.log_ratio, 0.0)) / num_tokens  # [sequences]
    sequence_ratio = torch.exp(sequence_log_ratio)[sequences.ids]
    return _ppo_clip_terms(dataclasses.replace(inputs, ratio=sequence_ratio), eps_low, eps_high)
