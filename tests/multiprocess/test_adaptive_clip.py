"""rl.adaptive_clip: the controller tracks its target on a synthetic stream of ratios, every data-parallel
rank takes the same step from the global fraction, a checkpoint's bounds apply only to the loss and
parameters they were adapted for, and the config refuses what it cannot adapt. A
3-step RL run that logs a moving bound, saves it and resumes it exactly: tests/slow/test_adaptive_clip.py."""

from __future__ import annotations

import json
import math

import pytest
import torch

from megacispo.rl.adaptive_clip import AdaptiveClip, restore, step_bound
from megacispo.rl.losses import compute_global_counts, compute_policy_loss, reduce_metrics, validate_policy_loss_params
from megacispo.startup import run_config
from megacispo.testing.harness import run_distributed

SIGMA = 0.3


def _controller(loss: str, target: float = 0.05, adapt_low: bool = False, **params: float) -> AdaptiveClip:
    return AdaptiveClip(loss, validate_policy_loss_params(loss, params), target=target, rate=0.05, min_eps=0.01,
                        max_eps=10.0, adapt_low=adapt_low)


def _step_metrics(controller: AdaptiveClip, generator: torch.Generator, num_tokens: int = 4096,
                  shift: float = 0.0, group=None) -> dict[str, float]:
    """One step's global loss metrics on lognormal ratios (log-ratio ~ N(shift, SIGMA)), advantages +-1."""
    old = torch.full((1, num_tokens), -1.0, dtype=torch.float64)
    logprobs = old + shift + SIGMA * torch.randn(1, num_tokens, generator=generator, dtype=torch.float64)
    advantages = torch.where(torch.rand(1, num_tokens, generator=generator) < 0.5, -1.0, 1.0).double()
    mask = torch.ones(1, num_tokens)
    counts = compute_global_counts([mask], [old], group=group)
    _, metrics = compute_policy_loss(controller.loss_name, logprobs, old, advantages, mask, counts,
                                     **controller.params())
    return {key: float(value) for key, value in reduce_metrics([metrics], group=group).items()}


def _run(controller: AdaptiveClip, steps: int, seed: int = 0) -> list[dict[str, float]]:
    generator = torch.Generator().manual_seed(seed)
    history = []
    for _ in range(steps):
        metrics = _step_metrics(controller, generator)
        history.append(metrics)
        controller.update(metrics["loss/clip_frac_high"], metrics["loss/clip_frac_low"])
    return history


def test_step_bound_widens_narrows_and_clamps():
    assert step_bound(1.0, 0.2, 0.1, 0.5, 0.01, 10.0) == 1.5
    assert step_bound(1.5, 0.0, 0.1, 0.5, 0.01, 10.0) == 1.0
    assert step_bound(1.0, 0.1, 0.1, 0.5, 0.01, 10.0) == 1.0
    assert step_bound(9.0, 1.0, 0.1, 0.5, 0.01, 10.0) == 10.0
    assert step_bound(0.011, 0.0, 0.1, 0.5, 0.01, 10.0) == 0.01


@pytest.mark.parametrize("loss", ["cispo", "dapo", "grpo"])
def test_converges_to_the_target_capped_fraction(loss):
    """From the loss's default bound the capped fraction settles at the target within the noise of a
    1.05 step; for cispo the bound lands on the lognormal quantile (every ratio above 1 + eps is capped)."""
    controller = _controller(loss, target=0.05)
    history = _run(controller, steps=300)
    settled = [m["loss/clip_frac_high"] for m in history[-100:]]
    assert sum(settled) / len(settled) == pytest.approx(0.05, abs=0.01)
    if loss == "cispo":
        quantile = math.exp(SIGMA * 1.6449) - 1
        assert controller.eps_high == pytest.approx(quantile, rel=0.15)
    if loss == "grpo":
        assert controller.params()["eps"] == controller.eps_high == controller.eps_low


def test_adapt_low_tracks_the_lower_side():
    controller = _controller("cispo", target=0.05, adapt_low=True)
    history = _run(controller, steps=300)
    settled = [m["loss/clip_frac_low"] for m in history[-100:]]
    assert sum(settled) / len(settled) == pytest.approx(0.05, abs=0.01)
    assert controller.eps_low == pytest.approx(1 - math.exp(-SIGMA * 1.6449), rel=0.15)


def test_state_round_trips_through_json_exactly():
    controller = _controller("dapo", adapt_low=True)
    _run(controller, steps=7)
    restored = _controller("dapo", adapt_low=True)
    assert restored.load_state_dict(json.loads(json.dumps(controller.state_dict()))) is None
    assert restored.params() == controller.params() and restored.metrics() == controller.metrics()
    assert controller.eps_high != 0.28


def _adapted_cispo(adapt_low: bool = True) -> dict:
    """A cispo run's checkpointed bounds, moved off the defaults (eps_high 4.0, eps_low 1.0)."""
    controller = _controller("cispo", adapt_low=adapt_low)
    controller.eps_high, controller.eps_low = 2.71, 0.15
    return json.loads(json.dumps(controller.state_dict()))


def test_state_names_its_loss_and_parameters():
    assert _adapted_cispo() == {"loss": "cispo", "bounds": {"eps_high": 2.71, "eps_low": 0.15}}
    grpo = _controller("grpo")
    assert grpo.state_dict() == {"loss": "grpo", "bounds": {"eps": 0.2}}


def test_bounds_of_another_loss_are_dropped_and_said():
    """Resuming an adapted cispo run as grpo starts grpo's eps from its own 0.2, not cispo's eps_high."""
    grpo = _controller("grpo")
    said = grpo.load_state_dict(_adapted_cispo())
    assert grpo.params()["eps"] == grpo.eps_high == grpo.eps_low == 0.2
    assert said == ("the checkpoint's clip bounds were adapted for cispo (eps_high = 2.71, eps_low = 0.15) and "
                    "rl.loss.name = 'grpo': dropped; the bounds start from rl.loss.params (eps = 0.2)")
    dapo = _controller("dapo")
    assert "adapted for cispo" in dapo.load_state_dict(_adapted_cispo()) and dapo.params()["eps_high"] == 0.28


def test_a_bound_this_run_does_not_adapt_is_dropped_and_said():
    controller = _controller("cispo", adapt_low=False)
    said = controller.load_state_dict(_adapted_cispo(adapt_low=True))
    assert controller.params()["eps_high"] == 2.71 and controller.params()["eps_low"] == 1.0
    assert said == ("the checkpoint's adapted eps_low = 0.15 dropped: this run adapts only eps_high "
                    "(rl.adaptive_clip.adapt_low = false), so eps_low stays at rl.loss.params")


def test_a_bound_this_run_adapts_anew_starts_from_the_config():
    controller = _controller("cispo", adapt_low=True)
    assert controller.load_state_dict(_adapted_cispo(adapt_low=False)) is None
    assert controller.params()["eps_high"] == 2.71 and controller.params()["eps_low"] == 1.0


def test_a_checkpoint_that_does_not_name_its_loss_is_dropped_and_said():
    """The bounds of a checkpoint that saved them without their loss cannot be told apart from another
    loss's: none is applied."""
    controller = _controller("cispo")
    said = controller.load_state_dict({"eps_high": 2.71, "eps_low": 0.2})
    assert controller.params()["eps_high"] == 4.0
    assert said == ("the checkpoint's adapted clip bounds (eps_high = 2.71, eps_low = 0.2) do not name the loss they "
                    "were adapted for: dropped; the bounds start from rl.loss.params (eps_high = 4)")


def test_bounds_of_a_run_with_adaptive_clipping_off_are_dropped_and_said():
    assert restore(None, _adapted_cispo()) == ("the checkpoint's adapted clip bounds (eps_high = 2.71, eps_low = 0.15) "
                                               "dropped: rl.adaptive_clip is off, so the loss uses rl.loss.params")
    controller = _controller("cispo")
    assert restore(controller, _adapted_cispo(adapt_low=False)) is None and controller.eps_high == 2.71


def _dp_step(rank_shift: float) -> tuple[float, dict[str, float], dict[str, float]]:
    """On each of 2 gloo ranks, a step whose ratios differ by rank: (local fraction, reduced metrics, new state)."""
    torch.distributed.init_process_group("gloo")
    rank = torch.distributed.get_rank()
    controller = _controller("cispo", target=0.05, eps_high=1.0)
    generator = torch.Generator().manual_seed(rank)
    local = _step_metrics(controller, generator, shift=rank_shift * rank)["loss/clip_frac_high"]
    generator = torch.Generator().manual_seed(rank)
    reduced = _step_metrics(controller, generator, shift=rank_shift * rank, group=torch.distributed.group.WORLD)
    controller.update(reduced["loss/clip_frac_high"], reduced["loss/clip_frac_low"])
    return local, reduced, controller.state_dict()


def test_dp2_ranks_take_the_same_step_from_the_global_fraction():
    """Rank 0's ratios sit below the cap (too few capped: it alone would narrow), rank 1's far above
    (it alone would widen); both widen, as the global fraction, above the target, says."""
    (local0, reduced0, state0), (local1, reduced1, state1) = run_distributed(_dp_step, 2, 0.6)
    assert local0 < 0.05 < local1
    assert reduced0["loss/clip_frac_high"] == reduced1["loss/clip_frac_high"] == pytest.approx((local0 + local1) / 2)
    assert state0 == state1 and state0["bounds"]["eps_high"] == 1.05


def _config(*overrides: str):
    return run_config(None, list(overrides))


@pytest.mark.parametrize("overrides, field", [
    (["rl.loss.name=reinforce"], "rl.loss.name"),
    (["rl.adaptive_clip.target_capped_frac=1.5"], "rl.adaptive_clip.target_capped_frac"),
    (["rl.loss.name=grpo", "rl.adaptive_clip.adapt_low=true"], "rl.adaptive_clip.adapt_low"),
    (["rl.adaptive_clip.min=5", "rl.adaptive_clip.max=2"], "rl.adaptive_clip.min"),
    (["rl.loss.params.eps_high=20.0"], "rl.loss.params.eps_high"),
    (["rl.adaptive_clip.rate=0"], "rl.adaptive_clip.rate"),
])
def test_config_refuses_what_cannot_adapt(overrides, field):
    with pytest.raises(ValueError, match=field):
        _config("rl.adaptive_clip.target_capped_frac=0.01", *overrides)


def test_off_by_default():
    from megacispo.rl.adaptive_clip import from_config

    for overrides, expected in (((), None), (("rl.adaptive_clip.target_capped_frac=0.01",), 4.0)):
        rl = _config(*overrides).rl
        controller = from_config(rl.adaptive_clip, rl.loss)
        assert (controller if expected is None else controller.eps_high) == expected
