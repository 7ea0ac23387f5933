"""Policy losses: closed forms, where the gradient flows, step-global normalization, numerics, errors."""

from __future__ import annotations

import math

import pytest
import torch

from megacispo.rl.losses import (
    GlobalCounts,
    Sequences,
    compute_global_counts,
    compute_policy_loss,
    policy_loss_names,
    reduce_metrics,
    register_policy_loss,
    validate_policy_loss_params,
)
from megacispo.rl.metric_hooks import ProbeToken, UpdateMicroBatch

TIGHT = dict(rtol=1e-12, atol=1e-12)

# ---------------------------------------------------------------------------------------------
# The hand-made case: 2 sequences x 3 tokens, the last token of sequence 1 is padding.
#   ratios r = pi / pi_old:  row 0: 1, 1.25, 6      row 1: 0.5, 1.5, (pad)
#   advantages:              row 0: +1              row 1: -0.5
#   5 loss tokens.
# ---------------------------------------------------------------------------------------------
HAND_LOGPROBS = [[-1.0, -2.0, -0.5], [-0.3, -1.5, -2.5]]
HAND_RATIOS = [[1.0, 1.25, 6.0], [0.5, 1.5, 1.0]]
HAND_MASK = [[1, 1, 1], [1, 1, 0]]
HAND_ADVANTAGES = [1.0, -0.5]


def hand_case() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    logprobs = torch.tensor(HAND_LOGPROBS, dtype=torch.float64, requires_grad=True)
    old_logprobs = logprobs.detach() - torch.tensor(HAND_RATIOS, dtype=torch.float64).log()
    return logprobs, old_logprobs, torch.tensor(HAND_ADVANTAGES, dtype=torch.float64), torch.tensor(HAND_MASK)


def run_hand_case(name: str, **params) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
    logprobs, old_logprobs, advantages, loss_mask = hand_case()
    loss, metrics = compute_policy_loss(name, logprobs, old_logprobs, advantages, loss_mask, **params)
    loss.backward()
    return loss.detach(), logprobs.grad, metrics


def expect(values: list[list[float]]) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float64)


class _OneTokenTokenizer:
    """The probe hook's view of a tokenizer: "~" is token 7."""

    def single_token_id(self, text: str) -> int:
        return 7


@pytest.mark.parametrize("name, high, low", [("cispo", 1, 0), ("dapo", 1, 1), ("grpo", 2, 1)])
def test_probe_tokens_count_their_own_clipping(name: str, high: int, low: int):
    """The probe covers the ratio-1.25, ratio-6 and ratio-0.5 tokens and the padding (not a loss
    token): the probe_token metric hook counts their clipping as the closed forms above say."""
    logprobs, old_logprobs, advantages, loss_mask = hand_case()
    probe_mask = torch.tensor([[False, True, True], [True, False, True]])
    params = validate_policy_loss_params(name, {})
    hook = ProbeToken(tokenizer=_OneTokenTokenizer(), token="~")
    micro = UpdateMicroBatch(
        targets=torch.where(probe_mask, 7, 3), loss_mask=loss_mask, logprobs=logprobs.detach(),
        old_logprobs=old_logprobs, advantages=advantages, loss_name=name, loss_params=params,
        counts=compute_global_counts([loss_mask], [old_logprobs]), sequences=Sequences.rows(loss_mask),
        logprobs_of=lambda targets, mask: torch.zeros_like(logprobs),
    )
    metrics = hook.micro_batch_metrics(micro)
    assert metrics["loss/probe_tokens"] == 3
    # cispo caps r = 6 only; dapo clips r = 6 (A > 0) and r = 0.5 (A < 0); grpo also clips r = 1.25 > 1.2.
    assert (metrics["loss/probe_clipped_high"], metrics["loss/probe_clipped_low"]) == (high, low)
    # A probability of 1 (log-prob 0) at each row's first response token, over the 2 sequences.
    assert metrics["probe/start_prob"] == 1.0


def test_cispo_closed_form_and_gradient_through_capped_tokens():
    loss, grad, metrics = run_hand_case("cispo")
    # r_hat = clip(r, 0, 5) = [1, 1.25, 5], [0.5, 1.5]; loss = -sum(r_hat * A * logp) / 5
    #   = -(1*1*-1 + 1.25*1*-2 + 5*1*-0.5 + 0.5*-0.5*-0.3 + 1.5*-0.5*-1.5) / 5 = -(-4.8) / 5
    torch.testing.assert_close(loss, torch.tensor(0.96, dtype=torch.float64), **TIGHT)
    # d/dlogp = -r_hat * A * mask / N: the weight is detached, so this is the whole gradient.
    expected_grad = expect([[-1 / 5, -1.25 / 5, -5 / 5], [0.25 / 5, 0.75 / 5, 0.0]])
    torch.testing.assert_close(grad, expected_grad, **TIGHT)
    # The token whose ratio 6 passed the cap 5 still gets a gradient (PPO would drop it).
    assert grad[0, 2] != 0
    torch.testing.assert_close(metrics["loss/clip_frac_high"], torch.tensor(1 / 5))
    torch.testing.assert_close(metrics["loss/clip_frac_low"], torch.tensor(0.0))
    torch.testing.assert_close(metrics["loss/is_weight_mean"], torch.tensor((1 + 1.25 + 6 + 0.5 + 1.5) / 5))
    torch.testing.assert_close(metrics["loss/is_weight_max"], torch.tensor(6.0))
    torch.testing.assert_close(metrics["loss/advantage_mean"], torch.tensor((3 * 1.0 - 2 * 0.5) / 5))
    torch.testing.assert_close(metrics["loss/advantage_abs_mean"], torch.tensor((3 * 1.0 + 2 * 0.5) / 5))
    k3 = sum(r - 1 - math.log(r) for r in (1.0, 1.25, 6.0, 0.5, 1.5)) / 5
    torch.testing.assert_close(metrics["loss/approx_kl"], torch.tensor(k3))
    torch.testing.assert_close(metrics["loss/num_tokens"], torch.tensor(5.0))


def test_cispo_lower_bound_and_its_metric():
    # eps_low = 0.25 lifts r = 0.5 to 0.75: the weight changes, the token keeps its gradient.
    loss, grad, metrics = run_hand_case("cispo", eps_low=0.25)
    torch.testing.assert_close(grad[1, 0], torch.tensor(-0.75 * -0.5 / 5, dtype=torch.float64), **TIGHT)
    torch.testing.assert_close(metrics["loss/clip_frac_low"], torch.tensor(1 / 5))


def test_grpo_closed_form_zeroes_clipped_tokens():
    loss, grad, metrics = run_hand_case("grpo")
    # -min(r*A, clip(r, 0.8, 1.2)*A): row 0 (A=+1): [-1, -1.2 (clipped), -1.2 (clipped)]
    # row 1 (A=-0.5): r=0.5 -> 0.8*0.5 = 0.4 (clipped); r=1.5 -> 0.75 (unclipped, A<0 above the region)
    # per-sequence mean, then mean over the 2 sequences.
    expected_loss = (-3.4 / 3 + (0.4 + 0.75) / 2) / 2
    torch.testing.assert_close(loss, torch.tensor(expected_loss, dtype=torch.float64), **TIGHT)
    # Unclipped tokens: d(-r*A)/dlogp = -r*A, divided by the sequence length and the sequence count.
    expected_grad = expect([[-1.0 / 3 / 2, 0.0, 0.0], [0.0, 0.75 / 2 / 2, 0.0]])
    torch.testing.assert_close(grad, expected_grad, **TIGHT)
    assert grad[0, 2] == 0  # the ratio-6 token: PPO drops it, CISPO (above) does not
    torch.testing.assert_close(metrics["loss/clip_frac_high"], torch.tensor(2 / 5))
    torch.testing.assert_close(metrics["loss/clip_frac_low"], torch.tensor(1 / 5))


def test_grpo_k3_kl_to_reference():
    logprobs, _, _, _ = hand_case()
    # ref - logp = ln 2 on every token: k3 = 2 - ln 2 - 1, d k3 / dlogp = 1 - 2 = -1.
    ref_logprobs = logprobs.detach() + math.log(2.0)
    plain_loss, plain_grad, _ = run_hand_case("grpo")
    loss, grad, metrics = run_hand_case("grpo", kl_coef=0.1, ref_logprobs=ref_logprobs)
    k3 = 1 - math.log(2.0)
    torch.testing.assert_close(loss, plain_loss + 0.1 * k3, **TIGHT)
    kl_grad = expect([[-0.1 / 3 / 2] * 3, [-0.1 / 2 / 2] * 2 + [0.0]])
    torch.testing.assert_close(grad, plain_grad + kl_grad, **TIGHT)
    torch.testing.assert_close(metrics["loss/ref_kl"], torch.tensor(k3))


def test_dapo_closed_form_clip_higher():
    loss, grad, metrics = run_hand_case("dapo")
    # clip(r, 0.8, 1.28): r = 1.25 now lies inside the region (GRPO's 1.2 clipped it).
    # per token: [-1, -1.25, -1.28 (clipped)], [0.4 (clipped), 0.75]; token mean over 5.
    torch.testing.assert_close(loss, torch.tensor((-1 - 1.25 - 1.28 + 0.4 + 0.75) / 5, dtype=torch.float64), **TIGHT)
    expected_grad = expect([[-1.0 / 5, -1.25 / 5, 0.0], [0.0, 0.75 / 5, 0.0]])
    torch.testing.assert_close(grad, expected_grad, **TIGHT)
    torch.testing.assert_close(metrics["loss/clip_frac_high"], torch.tensor(1 / 5))
    torch.testing.assert_close(metrics["loss/clip_frac_low"], torch.tensor(1 / 5))


def test_reinforce_closed_form():
    loss, grad, metrics = run_hand_case("reinforce")
    # -(1*-1 + 1.25*-2 + 6*-0.5 + 0.5*-0.5*-0.3 + 1.5*-0.5*-1.5) / 5
    torch.testing.assert_close(loss, torch.tensor(5.3 / 5, dtype=torch.float64), **TIGHT)
    expected_grad = expect([[-1 / 5, -1.25 / 5, -6 / 5], [0.25 / 5, 0.75 / 5, 0.0]])
    torch.testing.assert_close(grad, expected_grad, **TIGHT)
    assert metrics["loss/clip_frac_high"] == 0 and metrics["loss/clip_frac_low"] == 0


def test_gspo_clips_whole_sequences_by_their_geometric_mean_ratio():
    # Sequence ratios: row 0 (1 * 1.25 * 6)^(1/3) = 7.5^(1/3), A = +1; row 1 (0.5 * 1.5)^(1/2) = 0.75^(1/2), A = -0.5.
    s0, s1 = 7.5 ** (1 / 3), 0.75 ** 0.5
    loss, grad, metrics = run_hand_case("gspo", eps_low=0.2, eps_high=0.28)
    # Row 0 passes 1.28 with A > 0: clipped, no gradient. Row 1 stays above 0.8: -s1 * A, and
    # d s1 / d logp_t = s1 / 2 on each of its 2 tokens; mean over the 2 sequences.
    torch.testing.assert_close(loss, torch.tensor((-1.28 + 0.5 * s1) / 2, dtype=torch.float64), **TIGHT)
    torch.testing.assert_close(grad, expect([[0.0, 0.0, 0.0], [0.5 * s1 / 2 / 2] * 2 + [0.0]]), **TIGHT)
    torch.testing.assert_close(metrics["loss/clip_frac_high"], torch.tensor(3 / 5))  # row 0's 3 tokens
    torch.testing.assert_close(metrics["loss/clip_frac_low"], torch.tensor(0.0))
    # Bounds too wide to act: -s * A for both sequences, the gradient spread evenly over each one's tokens.
    loss, grad, _ = run_hand_case("gspo", eps_low=1.0, eps_high=10.0)
    torch.testing.assert_close(loss, torch.tensor((-s0 + 0.5 * s1) / 2, dtype=torch.float64), **TIGHT)
    torch.testing.assert_close(grad, expect([[-s0 / 3 / 2] * 3, [0.5 * s1 / 2 / 2] * 2 + [0.0]]), **TIGHT)
    # The paper's default bounds clip both sequences here: the loss is constant.
    loss, grad, metrics = run_hand_case("gspo")
    torch.testing.assert_close(loss, torch.tensor((-(1 + 4e-4) + 0.5 * (1 - 3e-4)) / 2, dtype=torch.float64), **TIGHT)
    assert not grad.any()
    torch.testing.assert_close(metrics["loss/clip_frac_low"], torch.tensor(2 / 5))


# ---------------------------------------------------------------------------------------------
# Random batches with prompts, padding and ratios away from 1 (as after a few off-policy updates)
# ---------------------------------------------------------------------------------------------


def random_batch(
    seed: int, batch: int = 8, seq: int = 11, ratio_spread: float = 0.5, token_advantages: bool = False
) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    logprobs = -torch.rand(batch, seq, generator=generator, dtype=torch.float64) * 4
    old_logprobs = logprobs - torch.randn(batch, seq, generator=generator, dtype=torch.float64) * ratio_spread
    ref_logprobs = logprobs + torch.randn(batch, seq, generator=generator, dtype=torch.float64) * 0.3
    prompt_lengths = torch.randint(0, 4, (batch,), generator=generator)
    response_ends = prompt_lengths + torch.randint(1, seq - 3, (batch,), generator=generator)
    positions = torch.arange(seq)
    loss_mask = (positions >= prompt_lengths[:, None]) & (positions < response_ends[:, None])
    shape = (batch, seq) if token_advantages else (batch,)
    advantages = torch.randn(*shape, generator=generator, dtype=torch.float64)
    return dict(
        logprobs=logprobs, old_logprobs=old_logprobs, advantages=advantages, loss_mask=loss_mask.long(),
        ref_logprobs=ref_logprobs,
    )


def loss_params(name: str, data: dict[str, torch.Tensor]) -> dict[str, object]:
    """Non-default parameters, so the normalization tests also cover the unified mask and the KL term."""
    if name == "cispo":
        return dict(eps_high=0.5, mask_eps_low=0.3, mask_eps_high=0.4)
    if name == "grpo":
        return dict(kl_coef=0.05, ref_logprobs=data["ref_logprobs"])
    return {}


def loss_and_grad(name: str, data: dict[str, torch.Tensor], **params) -> tuple[torch.Tensor, torch.Tensor, dict]:
    logprobs = data["logprobs"].clone().requires_grad_(True)
    loss, metrics = compute_policy_loss(
        name, logprobs, data["old_logprobs"], data["advantages"], data["loss_mask"], **params
    )
    loss.backward()
    return loss.detach(), logprobs.grad, metrics


def test_cispo_with_huge_bounds_equals_reinforce():
    data = random_batch(0, ratio_spread=2.0)
    cispo = loss_and_grad("cispo", data, eps_low=1.0, eps_high=1e12)
    reinforce = loss_and_grad("reinforce", data)
    torch.testing.assert_close(cispo[0], reinforce[0], **TIGHT)
    torch.testing.assert_close(cispo[1], reinforce[1], **TIGHT)
    # And the default cap does act on this batch, so the equality above is not vacuous.
    assert not torch.allclose(loss_and_grad("cispo", data)[1], reinforce[1])


def test_unified_mask_at_ppo_values_zeroes_exactly_the_trust_region_exits():
    data = random_batch(1, batch=16, seq=13, ratio_spread=0.4, token_advantages=True)
    _, cispo_grad, metrics = loss_and_grad("cispo", data, mask_eps_low=0.2, mask_eps_high=0.2)
    _, grpo_grad, grpo_metrics = loss_and_grad("grpo", data, eps=0.2)
    valid = data["loss_mask"].bool()
    ratio = (data["logprobs"] - data["old_logprobs"]).exp()
    advantages = data["advantages"]
    exits = ((advantages > 0) & (ratio > 1.2)) | ((advantages < 0) & (ratio < 0.8))
    assert 0 < (exits & valid).sum() < valid.sum()
    assert torch.equal(cispo_grad != 0, valid & ~exits)
    assert torch.equal(grpo_grad != 0, valid & ~exits)
    hand_count = sum(
        1
        for r, a, m in zip(ratio.flatten().tolist(), advantages.flatten().tolist(), valid.flatten().tolist())
        if m and ((a > 0 and r > 1.2) or (a < 0 and r < 0.8))
    )
    torch.testing.assert_close(metrics["loss/mask_frac"], torch.tensor(hand_count / valid.sum().item()))
    torch.testing.assert_close(
        metrics["loss/mask_frac"], grpo_metrics["loss/clip_frac_high"] + grpo_metrics["loss/clip_frac_low"]
    )


def test_unified_mask_with_huge_thresholds_is_plain_cispo():
    data = random_batch(2, ratio_spread=1.0)
    plain = loss_and_grad("cispo", data)
    loose = loss_and_grad("cispo", data, mask_eps_low=1e9, mask_eps_high=1e9)
    torch.testing.assert_close(plain[0], loose[0], **TIGHT)
    torch.testing.assert_close(plain[1], loose[1], **TIGHT)


def test_advantages_per_sequence_equal_their_per_token_broadcast():
    data = random_batch(3)
    per_token = dict(data, advantages=data["advantages"][:, None].expand(-1, data["logprobs"].shape[1]))
    for name in policy_loss_names():
        a, b = loss_and_grad(name, data), loss_and_grad(name, per_token)
        torch.testing.assert_close(a[0], b[0], **TIGHT)
        torch.testing.assert_close(a[1], b[1], **TIGHT)


# ---------------------------------------------------------------------------------------------
# Normalization: micro-batching must not change the objective
# ---------------------------------------------------------------------------------------------

MICRO_BATCH_ROWS = [(0, 1), (1, 4), (4, 6), (6, 8)]  # 4 micro-batches of uneven size


def with_nonfinite_old_logprobs(data: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    old = data["old_logprobs"].clone()
    response = data["loss_mask"].nonzero()
    for (row, col), bad in zip(response[[0, 7, 15]].tolist(), (-math.inf, math.nan, math.inf)):
        old[row, col] = bad
    return dict(data, old_logprobs=old)


def micro_batch(data: dict[str, torch.Tensor], rows: tuple[int, int]) -> dict[str, torch.Tensor]:
    """Rows [start, end), trimmed to their last response token: micro-batches differ in length."""
    start, end = rows
    width = int(data["loss_mask"][start:end].nonzero()[:, 1].max()) + 1
    return {key: value[start:end, :width] if value.dim() == 2 else value[start:end] for key, value in data.items()}


@pytest.mark.parametrize("name", policy_loss_names())
def test_micro_batches_with_global_counts_equal_the_full_batch(name: str):
    data = with_nonfinite_old_logprobs(random_batch(4, ratio_spread=0.6))
    full_loss, full_grad, full_metrics = loss_and_grad(name, data, **loss_params(name, data))

    logprobs = data["logprobs"].clone().requires_grad_(True)
    parts = [micro_batch(dict(data, logprobs=logprobs), rows) for rows in MICRO_BATCH_ROWS]
    counts = compute_global_counts([p["loss_mask"] for p in parts], [p["old_logprobs"] for p in parts])
    total, all_metrics = 0.0, []
    for part in parts:
        loss, metrics = compute_policy_loss(
            name, part["logprobs"], part["old_logprobs"], part["advantages"], part["loss_mask"],
            global_counts=counts, **loss_params(name, part),
        )
        total = total + loss
        all_metrics.append(metrics)
    total.backward()

    torch.testing.assert_close(total.detach(), full_loss, **TIGHT)
    torch.testing.assert_close(logprobs.grad, full_grad, **TIGHT)
    reduced = reduce_metrics(all_metrics)
    assert reduced.keys() == full_metrics.keys()
    for key, value in full_metrics.items():
        torch.testing.assert_close(reduced[key].float(), value, rtol=1e-6, atol=1e-6, msg=key)


def test_per_micro_batch_mean_is_a_different_objective():
    """The control for the test above: without global counts the micro-batched loss differs."""
    data = random_batch(4)
    full_loss = loss_and_grad("cispo", data)[0]
    local_means = [loss_and_grad("cispo", micro_batch(data, rows))[0] for rows in MICRO_BATCH_ROWS]
    assert not torch.isclose(sum(local_means) / len(local_means), full_loss, rtol=1e-3)


def test_global_counts_by_hand():
    loss_masks = [torch.tensor([[0, 1, 1], [0, 0, 0]]), torch.tensor([[1, 1, 0, 1]])]
    old_logprobs = [
        torch.tensor([[0.0, -1.0, -math.inf], [0.0, 0.0, 0.0]]),
        torch.tensor([[-1.0, math.nan, 0.0, -2.0]]),
    ]
    counts = compute_global_counts(loss_masks, old_logprobs)
    # Tokens: 1 (row 0, the -inf dropped) + 2 (row 2, the NaN dropped); the all-padding row has no sequence.
    assert counts.num_tokens.item() == 3 and counts.num_sequences.item() == 2
    assert counts.num_tokens.dtype == torch.int64
    with pytest.raises(ValueError, match="one tensor per micro-batch"):
        compute_global_counts(loss_masks, old_logprobs[:1])
    shape_error = r"loss_masks\[1\] has shape \(1, 4\) but old_logprobs\[1\] has shape \(1, 3\)"
    with pytest.raises(ValueError, match=shape_error):
        compute_global_counts(loss_masks, [old_logprobs[0], old_logprobs[1][:, :3]])


# ---------------------------------------------------------------------------------------------
# Off-policy updates: the clip only acts once the policy has moved
# ---------------------------------------------------------------------------------------------


def hand_clip_fractions(data: dict[str, torch.Tensor], high: float, low: float, ppo: bool) -> tuple[float, float]:
    """Naive loop: fraction of loss tokens with r above 1 + high / below 1 - low (PPO: only when A pushes outward)."""
    num_tokens = num_high = num_low = 0
    columns = (data[key].tolist() for key in ("logprobs", "old_logprobs", "loss_mask", "advantages"))
    for lp_row, old_row, mask_row, a in zip(*columns):
        for lp, old, m in zip(lp_row, old_row, mask_row):
            if not m:
                continue
            r = math.exp(lp - old)
            num_tokens += 1
            num_high += r > 1 + high and (a > 0 or not ppo)
            num_low += r < 1 - low and (a < 0 or not ppo)
    return num_high / num_tokens, num_low / num_tokens


@pytest.mark.parametrize(
    "name, params, high, low, ppo",
    [
        ("cispo", dict(eps_low=0.5), 4.0, 0.5, False),
        ("grpo", {}, 0.2, 0.2, True),
        ("dapo", {}, 0.28, 0.2, True),
    ],
)
def test_clip_metrics_with_old_logprobs_from_another_policy(name, params, high, low, ppo):
    data = random_batch(5, batch=16, seq=13, ratio_spread=1.2)
    _, _, metrics = loss_and_grad(name, data, **params)
    expected_high, expected_low = hand_clip_fractions(data, high, low, ppo)
    assert expected_high > 0 and expected_low > 0
    torch.testing.assert_close(metrics["loss/clip_frac_high"], torch.tensor(expected_high))
    torch.testing.assert_close(metrics["loss/clip_frac_low"], torch.tensor(expected_low))


def test_several_updates_on_one_generation_batch_move_the_ratios():
    """M1 takes many optimizer steps per generation batch: the first sees r == 1, later ones do not."""
    generator = torch.Generator().manual_seed(6)
    logits = torch.randn(4, 9, 5, generator=generator, dtype=torch.float64, requires_grad=True)
    tokens = torch.randint(0, 5, (4, 9), generator=generator)
    advantages = torch.tensor([1.0, -1.0, 0.5, -0.5], dtype=torch.float64)
    loss_mask = torch.ones(4, 9)

    def token_logprobs() -> torch.Tensor:
        return torch.log_softmax(logits, dim=-1).gather(-1, tokens[..., None])[..., 0]

    old_logprobs = token_logprobs().detach()
    optimizer = torch.optim.SGD([logits], lr=20.0)
    history = []
    for _ in range(4):
        logprobs = token_logprobs()
        loss, metrics = compute_policy_loss("dapo", logprobs, old_logprobs, advantages, loss_mask)
        history.append(metrics)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        data = dict(logprobs=logprobs.detach(), old_logprobs=old_logprobs, loss_mask=loss_mask, advantages=advantages)
        expected = hand_clip_fractions(data, 0.28, 0.2, ppo=True)
        torch.testing.assert_close(metrics["loss/clip_frac_high"], torch.tensor(expected[0]))
        torch.testing.assert_close(metrics["loss/clip_frac_low"], torch.tensor(expected[1]))
    assert history[0]["loss/clip_frac_high"] == 0 and history[0]["loss/clip_frac_low"] == 0
    assert history[0]["loss/is_weight_max"] == 1
    assert history[-1]["loss/clip_frac_high"] + history[-1]["loss/clip_frac_low"] > 0


# ---------------------------------------------------------------------------------------------
# Numerics
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", policy_loss_names())
def test_nonfinite_old_logprobs_are_dropped_and_counted(name: str):
    data = random_batch(7)
    bad = with_nonfinite_old_logprobs(data)
    # Garbage outside the loss mask is neither counted nor allowed to reach the gradient.
    padding = (data["loss_mask"] == 0).nonzero()[0].tolist()
    bad["old_logprobs"][tuple(padding)] = math.nan
    bad["logprobs"] = data["logprobs"].clone()
    bad["logprobs"][tuple(padding)] = math.nan
    dropped = bad["loss_mask"].bool() & ~torch.isfinite(bad["old_logprobs"])

    loss, grad, metrics = loss_and_grad(name, bad, **loss_params(name, bad))
    assert torch.isfinite(loss) and torch.isfinite(grad).all()
    assert (grad[dropped] == 0).all() and grad[tuple(padding)] == 0
    assert metrics["loss/num_nonfinite_dropped"] == 3
    assert all(torch.isfinite(value) for value in metrics.values())

    # The same as removing those tokens from the mask by hand.
    clean = dict(data, loss_mask=data["loss_mask"] * ~dropped)
    reference_loss, reference_grad, _ = loss_and_grad(name, clean, **loss_params(name, clean))
    torch.testing.assert_close(loss, reference_loss, **TIGHT)
    torch.testing.assert_close(grad, reference_grad, **TIGHT)


def test_huge_log_ratios_stay_finite():
    # A rollout engine's tiny old probability: log-ratio 300 would overflow exp in fp32.
    logprobs = torch.tensor([[-0.1, -0.2]], requires_grad=True)
    old_logprobs = torch.tensor([[-300.0, -0.2]])
    for name in policy_loss_names():
        loss, metrics = compute_policy_loss(name, logprobs, old_logprobs, torch.tensor([-1.0]), torch.ones(1, 2))
        (grad,) = torch.autograd.grad(loss, logprobs)
        assert torch.isfinite(loss) and torch.isfinite(grad).all(), name
        torch.testing.assert_close(metrics["loss/is_weight_max"], torch.tensor(math.exp(20.0)))


@pytest.mark.parametrize("name", policy_loss_names())
def test_all_masked_batch_gives_zero_not_nan(name: str):
    data = dict(random_batch(8), loss_mask=torch.zeros(8, 11))
    loss, grad, metrics = loss_and_grad(name, data, **loss_params(name, data))
    assert loss == 0 and (grad == 0).all()
    assert all(torch.isfinite(value) for value in metrics.values())


def test_bf16_logprobs_are_computed_in_fp32_and_get_a_gradient():
    data = random_batch(9)
    logprobs = data["logprobs"].to(torch.bfloat16).requires_grad_(True)
    old_logprobs = data["old_logprobs"].float()
    loss, _ = compute_policy_loss("cispo", logprobs, old_logprobs, data["advantages"], data["loss_mask"])
    loss.backward()
    assert loss.dtype == torch.float32
    assert logprobs.grad.dtype == torch.bfloat16 and logprobs.grad.abs().sum() > 0


# ---------------------------------------------------------------------------------------------
# Errors and metric reduction
# ---------------------------------------------------------------------------------------------


def test_mismatched_shapes_raise_naming_the_tensors():
    logprobs, old_logprobs, advantages, loss_mask = hand_case()
    with pytest.raises(ValueError, match=r"old_logprobs has shape \(2, 2\) but logprobs has shape \(2, 3\)"):
        compute_policy_loss("cispo", logprobs, old_logprobs[:, :2], advantages, loss_mask)
    with pytest.raises(ValueError, match=r"loss_mask has shape \(1, 3\)"):
        compute_policy_loss("cispo", logprobs, old_logprobs, advantages, loss_mask[:1])
    with pytest.raises(ValueError, match=r"advantages has shape \(3,\)"):
        compute_policy_loss("cispo", logprobs, old_logprobs, torch.ones(3), loss_mask)
    with pytest.raises(ValueError, match=r"ref_logprobs has shape \(2, 4\)"):
        compute_policy_loss("grpo", logprobs, old_logprobs, advantages, loss_mask, ref_logprobs=torch.zeros(2, 4))
    with pytest.raises(ValueError, match=r"logprobs must be \[batch, seq\], got shape \(6,\)"):
        compute_policy_loss("cispo", logprobs.flatten(), old_logprobs.flatten(), advantages, loss_mask.flatten())


def test_unknown_name_lists_every_registered_loss():
    logprobs, old_logprobs, advantages, loss_mask = hand_case()
    with pytest.raises(ValueError, match="'ppo_typo' is unknown") as error:
        compute_policy_loss("ppo_typo", logprobs, old_logprobs, advantages, loss_mask)
    for name in policy_loss_names():
        assert name in str(error.value)
    assert set(policy_loss_names()) == {"cispo", "grpo", "dapo", "gspo", "reinforce"}


def test_unknown_and_bad_params_list_the_valid_ones():
    with pytest.raises(ValueError, match="unknown parameter.*eps for policy loss 'cispo'.*eps_low=1.0, eps_high=4.0"):
        validate_policy_loss_params("cispo", {"eps": 0.2})
    for bad in (-0.1, math.nan, math.inf, True, "0.2"):
        with pytest.raises(ValueError, match="eps_high=.* is invalid.*eps_low=0.2, eps_high=0.28"):
            validate_policy_loss_params("dapo", {"eps_high": bad})
    with pytest.raises(ValueError, match="ref_logprobs=.* is invalid"):
        validate_policy_loss_params("grpo", {"ref_logprobs": [0.0]})
    with pytest.raises(ValueError, match="Parameters: none"):
        validate_policy_loss_params("reinforce", {"eps_high": 1.0})
    assert validate_policy_loss_params("cispo", {"mask_eps_high": 0.2}) == dict(
        eps_low=1.0, eps_high=4.0, mask_eps_low=None, mask_eps_high=0.2
    )
    with pytest.raises(ValueError, match="kl_coef=0.1 but no ref_logprobs"):
        run_hand_case("grpo", kl_coef=0.1)


def test_reduce_metrics_sums_means_and_maxes_maxima():
    first = {"loss/clip_frac_high": torch.tensor(0.25), "loss/is_weight_max": torch.tensor(3.0)}
    second = {"loss/clip_frac_high": torch.tensor(0.5), "loss/is_weight_max": torch.tensor(2.0)}
    reduced = reduce_metrics([first, second])
    assert reduced["loss/clip_frac_high"].item() == 0.75 and reduced["loss/is_weight_max"].item() == 3.0
    with pytest.raises(ValueError, match="micro-batch 1 has metric keys"):
        reduce_metrics([first, {"loss/clip_frac_high": torch.tensor(0.5)}])


def test_explicit_counts_of_a_larger_step_scale_the_loss():
    """A micro-batch holding a quarter of the step's tokens contributes a quarter of its own mean."""
    data = random_batch(10)
    own = loss_and_grad("dapo", data)[0]
    num_tokens = int(data["loss_mask"].sum())
    counts = GlobalCounts(num_tokens=torch.tensor(4 * num_tokens), num_sequences=torch.tensor(32))
    scaled = loss_and_grad("dapo", data, global_counts=counts)[0]
    torch.testing.assert_close(scaled, own / 4, **TIGHT)


def test_registry_rejects_duplicates_and_malformed_losses():
    with pytest.raises(ValueError, match="'cispo' is already registered"):
        register_policy_loss("cispo")(lambda inputs: None)

    def positional_param(inputs, eps=0.2):
        return None

    with pytest.raises(ValueError, match="must have the signature fn\\(inputs, \\*, param=default"):
        register_policy_loss("malformed")(positional_param)
    with pytest.raises(ValueError, match="aggregation 'per_prompt' is unknown; valid modes: token_mean, sequence_mean"):
        register_policy_loss("malformed", aggregation="per_prompt")
    assert "malformed" not in policy_loss_names()


@pytest.mark.parametrize("name", ["grpo", "gspo", "cispo"])
def test_sequences_packed_in_one_row_give_the_loss_and_gradient_of_one_per_row(name: str):
    """Three sequences of a [3, 6] batch laid end to end in one [1, 18] row (with Sequences naming
    them) give the same loss, gradient, counts and metrics: sequence_mean and gspo's sequence ratio
    are taken per sequence, not per row."""
    generator = torch.Generator().manual_seed(11)
    logprobs = -torch.rand(3, 6, generator=generator, dtype=torch.float64)
    old_logprobs = logprobs + 0.3 * torch.randn(3, 6, generator=generator, dtype=torch.float64)
    loss_mask = torch.tensor([[0, 1, 1, 1, 1, 0], [0, 0, 1, 0, 0, 0], [1, 1, 1, 1, 1, 1]], dtype=torch.float64)
    advantages = torch.tensor([0.5, -1.0, 2.0], dtype=torch.float64)
    params = validate_policy_loss_params(name, {})
    rows = logprobs.clone().requires_grad_(True)
    loss, metrics = compute_policy_loss(name, rows, old_logprobs, advantages, loss_mask, **params)
    loss.backward()
    packed = logprobs.reshape(1, 18).clone().requires_grad_(True)
    sequences = Sequences(torch.arange(3).repeat_interleave(6)[None], 3)
    packed_counts = compute_global_counts([loss_mask.reshape(1, 18)], [old_logprobs.reshape(1, 18)],
                                          sequences=[sequences])
    assert int(packed_counts.num_sequences) == 3
    packed_loss, packed_metrics = compute_policy_loss(
        name, packed, old_logprobs.reshape(1, 18), advantages.repeat_interleave(6)[None], loss_mask.reshape(1, 18),
        packed_counts, sequences=sequences, **params)
    packed_loss.backward()
    torch.testing.assert_close(packed_loss, loss, rtol=1e-12, atol=0)
    torch.testing.assert_close(packed.grad.reshape(3, 6), rows.grad, rtol=1e-12, atol=1e-15)
    for key, value in metrics.items():
        torch.testing.assert_close(packed_metrics[key], value, rtol=1e-6, atol=1e-9, msg=key)


def test_sequences_cumsum_restarts_at_each_sequence():
    sequences = Sequences(torch.tensor([[0, 0, 0, 1, 1, 2, 2, 2]]), 3)
    values = torch.tensor([[1, 0, 1, 1, 1, 0, 1, 1]])
    assert sequences.cumsum(values).tolist() == [[1, 1, 2, 1, 2, 0, 1, 2]]
    assert sequences.sum(values).tolist() == [2, 2, 2]
