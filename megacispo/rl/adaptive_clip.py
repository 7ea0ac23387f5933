"""Adaptive clipping bounds (rl.adaptive_clip): the loss's clip bounds follow a target capped fraction.

After every optimizer step the controller reads the step's fraction of loss tokens whose weight hit
the upper bound (``loss/clip_frac_high``, already summed over micro-batches and data-parallel ranks by
``losses.reduce_metrics``, so every rank sees the same global value) and moves eps_high one
multiplicative step: widened by (1 + rate) when more tokens were capped than the target, narrowed by
the same factor when fewer, then clamped to [min, max]. With adapt_low, eps_low follows
``loss/clip_frac_low`` the same way. A sign step, not a proportional one: the bound settles within
a factor (1 + rate) of the value whose capped fraction is the target, whatever the ratios' spread.

The bounds are the registry's own parameters, so no loss is forked: cispo, dapo and gspo have
eps_high and eps_low; grpo has one symmetric ``eps``, which the controller moves as eps_high (from
clip_frac_high) and reports as both bounds, so adapt_low does not apply to it.

A checkpoint keeps the adapted bounds with the loss they were adapted for. A resume applies a saved
bound only to the same loss's same parameter, when this run adapts it; anything else (another loss,
a bound this run does not adapt, adaptive clipping off, or a checkpoint that does not name its loss)
is dropped with one line saying so, and the configured bound applies: CISPO's eps_high of 2.7 is no
start for GRPO's eps.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping

from megacispo.rl.config import AdaptiveClipConfig, LossConfig
from megacispo.rl.losses import METRIC_PREFIX, get_policy_loss

HIGH_METRIC = METRIC_PREFIX + "clip_frac_high"
LOW_METRIC = METRIC_PREFIX + "clip_frac_low"
EPS_HIGH_METRIC = METRIC_PREFIX + "eps_high_current"
EPS_LOW_METRIC = METRIC_PREFIX + "eps_low_current"


@dataclass(frozen=True)
class BoundParams:
    """The loss parameters the controller moves: the upper bound's name, the lower's (None: the loss
    has one symmetric bound, the upper one)."""

    high: str
    low: str | None


def bound_params(loss_name: str) -> BoundParams | None:
    """Which of the registered loss ``loss_name``'s parameters are its clip bounds; None when it has
    none (reinforce)."""
    params = get_policy_loss(loss_name).param_defaults
    if "eps_high" in params and "eps_low" in params:
        return BoundParams("eps_high", "eps_low")
    if "eps" in params:
        return BoundParams("eps", None)
    return None


def step_bound(eps: float, capped_frac: float, target: float, rate: float, low: float, high: float) -> float:
    """One controller step of a bound: wider when more than ``target`` of the tokens were capped,
    narrower when fewer, unchanged when equal; clamped to [low, high]."""
    if capped_frac > target:
        eps *= 1 + rate
    elif capped_frac < target:
        eps /= 1 + rate
    return min(max(eps, low), high)


class AdaptiveClip:
    """The bounds of one run's loss, moved after every optimizer step toward the target capped fraction.

    Args:
        loss_name: a registered loss with clip bounds (``bound_params`` not None).
        loss_params: the loss's parameters completed with the defaults (validate_policy_loss_params):
            the bounds start from them.
        target: the capped fraction to track, in (0, 1).
        rate: the multiplicative step per optimizer step, > 0.
        min_eps, max_eps: the range the bounds stay in.
        adapt_low: also move eps_low (losses with two bounds only).
    """

    def __init__(self, loss_name: str, loss_params: Mapping[str, object], *, target: float, rate: float,
                 min_eps: float, max_eps: float, adapt_low: bool):
        names = bound_params(loss_name)
        if names is None:
            raise ValueError(f"policy loss {loss_name!r} has no clip bound to adapt")
        if adapt_low and names.low is None:
            raise ValueError(f"policy loss {loss_name!r} has one symmetric bound ({names.high}): it cannot adapt "
                             f"eps_low on its own")
        self.loss_name, self.names = loss_name, names
        self.loss_params = dict(loss_params)
        self.target, self.rate, self.min_eps, self.max_eps = target, rate, min_eps, max_eps
        self.adapt_low = adapt_low
        self.eps_high = float(self.loss_params[names.high])
        self.eps_low = float(self.loss_params[names.low]) if names.low is not None else self.eps_high

    def params(self) -> dict[str, object]:
        """The loss parameters of the next optimizer step: the configured ones with the current bounds."""
        current = {self.names.high: self.eps_high}
        if self.names.low is not None:
            current[self.names.low] = self.eps_low
        return {**self.loss_params, **current}

    def metrics(self) -> dict[str, float]:
        """The bounds in use: loss/eps_high_current and loss/eps_low_current (grpo: eps, twice)."""
        return {EPS_HIGH_METRIC: self.eps_high, EPS_LOW_METRIC: self.eps_low}

    def update(self, clip_frac_high: float, clip_frac_low: float) -> None:
        """One step after an optimizer step, from its global capped fractions (upper and lower)."""
        self.eps_high = step_bound(self.eps_high, clip_frac_high, self.target, self.rate, self.min_eps,
                                   self.max_eps)
        if self.adapt_low:
            self.eps_low = step_bound(self.eps_low, clip_frac_low, self.target, self.rate, self.min_eps,
                                      self.max_eps)
        elif self.names.low is None:
            self.eps_low = self.eps_high

    def adapted(self) -> dict[str, float]:
        """The parameters the controller moves, by the loss's names, with their current values."""
        bounds = {self.names.high: self.eps_high}
        if self.adapt_low:
            bounds[self.names.low] = self.eps_low
        return bounds

    def state_dict(self) -> dict[str, object]:
        """Plain JSON for a checkpoint's extra_state (floats round-trip exactly): the loss and the
        adapted bounds by parameter name, so that a resume applies them only where they belong."""
        return {"loss": self.loss_name, "bounds": self.adapted()}

    def load_state_dict(self, state: Mapping[str, object]) -> str | None:
        """Takes each saved bound that this controller moves for the same loss; a bound saved for
        another loss or parameter (or by a checkpoint that does not name its loss) is dropped, the
        configured value stays. Returns the line that says what was dropped and why; None when
        nothing was."""
        saved_loss, bounds = state.get("loss"), state.get("bounds", {})
        if saved_loss is None:
            legacy = {name: state[name] for name in ("eps_high", "eps_low") if name in state}
            return (f"the checkpoint's adapted clip bounds ({_listed(legacy)}) do not name the loss they were "
                    f"adapted for: dropped; the bounds start from rl.loss.params ({_listed(self.adapted())})")
        if saved_loss != self.loss_name:
            return (f"the checkpoint's clip bounds were adapted for {saved_loss} ({_listed(bounds)}) and "
                    f"rl.loss.name = {self.loss_name!r}: dropped; the bounds start from rl.loss.params "
                    f"({_listed(self.adapted())})")
        moved = self.adapted()
        dropped = {name: value for name, value in bounds.items() if name not in moved}
        if self.names.high in bounds:
            self.eps_high = float(bounds[self.names.high])
        if self.names.low is None:
            self.eps_low = self.eps_high
        elif self.adapt_low and self.names.low in bounds:
            self.eps_low = float(bounds[self.names.low])
        if not dropped:
            return None
        return (f"the checkpoint's adapted {_listed(dropped)} dropped: this run adapts only "
                f"{', '.join(moved)} (rl.adaptive_clip.adapt_low = {str(self.adapt_low).lower()}), so "
                f"{', '.join(dropped)} stays at rl.loss.params")


def restore(controller: AdaptiveClip | None, state: Mapping[str, object]) -> str | None:
    """A checkpoint's adapted bounds ``state`` into the run's ``controller`` (None: rl.adaptive_clip
    is off, and the configured bounds apply). Returns the line that says what was dropped and why."""
    if controller is None:
        saved = state.get("bounds", state)
        return (f"the checkpoint's adapted clip bounds ({_listed(saved)}) dropped: rl.adaptive_clip is off, "
                f"so the loss uses rl.loss.params")
    return controller.load_state_dict(state)


def _listed(bounds: Mapping[str, object]) -> str:
    return ", ".join(f"{name} = {value:g}" for name, value in bounds.items())


def check_bounds(settings: AdaptiveClipConfig, loss: LossConfig, params: Mapping[str, object]) -> None:
    """rl.adaptive_clip, when on, against the loss: a loss with the bounds it moves, and each starting
    bound (``params``: the loss's parameters with its defaults) inside [min, max]."""
    target = settings.target_capped_frac
    if target is None:
        return
    names = bound_params(loss.name)
    if names is None:
        raise ValueError(f"rl.adaptive_clip.target_capped_frac = {target} but rl.loss.name = {loss.name!r} has no "
                         f"clip bound to adapt: use cispo, dapo, grpo or gspo, or unset "
                         f"rl.adaptive_clip.target_capped_frac")
    if settings.adapt_low and names.low is None:
        raise ValueError(f"rl.adaptive_clip.adapt_low = true but rl.loss.name = {loss.name!r} has one symmetric bound "
                         f"({names.high}), adapted from the upper side: set rl.adaptive_clip.adapt_low = false")
    moved = [names.high] + ([names.low] if settings.adapt_low else [])
    for name in moved:
        value = params[name]
        if not settings.min <= value <= settings.max:
            raise ValueError(f"rl.loss.params.{name} = {value} lies outside [rl.adaptive_clip.min, rl.adaptive_clip.max]"
                             f" = [{settings.min}, {settings.max}]: the adapted bound starts from it; move it inside "
                             f"or widen the range")


def from_config(settings: AdaptiveClipConfig, loss: LossConfig) -> AdaptiveClip | None:
    """The run's controller (rl.adaptive_clip, checked at start-up by ``check_bounds``); None when it is off."""
    if settings.target_capped_frac is None:
        return None
    return AdaptiveClip(loss.name, loss.params, target=settings.target_capped_frac, rate=settings.rate,
                        min_eps=settings.min, max_eps=settings.max, adapt_low=settings.adapt_low)
