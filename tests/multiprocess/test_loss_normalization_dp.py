"""Data parallelism must not change the step objective: DP=2 in real gloo processes equals 1 process.

Each rank holds half of the step's sequences, split into 2 micro-batches of uneven size; the
counts are all-reduced over the group once, each micro-batch loss is divided by them. The sum
of the ranks' losses, their gradients and the reduced metrics must equal the single-process
full-batch values, for every registered loss.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

from megacispo.rl.losses import compute_global_counts, compute_policy_loss, policy_loss_names, reduce_metrics
from megacispo.testing.harness import run_distributed

WORLD_SIZE = 2
BATCH, SEQ = 8, 9
MICRO_BATCH_ROWS = [(0, 1), (1, 4)]  # within a rank's 4 rows


def global_batch() -> dict[str, torch.Tensor]:
    """The step's whole batch, identical in every process (a seeded CPU generator)."""
    generator = torch.Generator().manual_seed(11)
    logprobs = -torch.rand(BATCH, SEQ, generator=generator, dtype=torch.float64) * 3
    old_logprobs = logprobs - torch.randn(BATCH, SEQ, generator=generator, dtype=torch.float64) * 0.7
    ref_logprobs = logprobs + torch.randn(BATCH, SEQ, generator=generator, dtype=torch.float64) * 0.3
    response_lengths = torch.randint(1, SEQ, (BATCH,), generator=generator)
    loss_mask = (torch.arange(SEQ) < response_lengths[:, None]).long()
    # Non-finite old log-probs on rank 1's rows only, so the ranks' local counts differ.
    old_logprobs[5, 0] = -math.inf
    old_logprobs[6, 0] = math.nan
    advantages = torch.randn(BATCH, generator=generator, dtype=torch.float64)
    return dict(
        logprobs=logprobs, old_logprobs=old_logprobs, advantages=advantages, loss_mask=loss_mask,
        ref_logprobs=ref_logprobs,
    )


def loss_params(name: str, data: dict[str, torch.Tensor]) -> dict[str, object]:
    if name == "cispo":
        return dict(eps_high=0.5, mask_eps_low=0.3, mask_eps_high=0.4)
    if name == "grpo":
        return dict(kl_coef=0.05, ref_logprobs=data["ref_logprobs"])
    return {}


def rows(data: dict[str, torch.Tensor], start: int, end: int) -> dict[str, torch.Tensor]:
    return {key: value[start:end] for key, value in data.items()}


def step_on_this_rank(data: dict[str, torch.Tensor], name: str, group: dist.ProcessGroup | None):
    """One optimizer step's loss on ``data`` (this rank's rows): micro-batches over global counts."""
    logprobs = data["logprobs"].clone().requires_grad_(True)
    parts = [rows(dict(data, logprobs=logprobs), start, end) for start, end in MICRO_BATCH_ROWS]
    counts = compute_global_counts([p["loss_mask"] for p in parts], [p["old_logprobs"] for p in parts], group)
    total, metrics = 0.0, []
    for part in parts:
        loss, part_metrics = compute_policy_loss(
            name, part["logprobs"], part["old_logprobs"], part["advantages"], part["loss_mask"],
            global_counts=counts, **loss_params(name, part),
        )
        total = total + loss
        metrics.append(part_metrics)
    total.backward()
    return total.detach(), logprobs.grad, reduce_metrics(metrics, group), counts


def data_parallel_worker() -> dict[str, tuple]:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    rows_per_rank = BATCH // WORLD_SIZE
    local = rows(global_batch(), rank * rows_per_rank, (rank + 1) * rows_per_rank)
    results = {}
    for name in policy_loss_names():
        loss, grad, metrics, counts = step_on_this_rank(local, name, dist.group.WORLD)
        results[name] = (loss, grad, metrics, (counts.num_tokens.item(), counts.num_sequences.item()))
    return results


def test_dp2_equals_one_process_for_every_loss():
    by_rank = run_distributed(data_parallel_worker, WORLD_SIZE, timeout_s=120)
    data = global_batch()
    for name in policy_loss_names():
        logprobs = data["logprobs"].clone().requires_grad_(True)
        full_loss, full_metrics = compute_policy_loss(
            name, logprobs, data["old_logprobs"], data["advantages"], data["loss_mask"], **loss_params(name, data)
        )
        full_loss.backward()

        losses, grads, metrics, counts = zip(*(result[name] for result in by_rank))
        torch.testing.assert_close(sum(losses), full_loss.detach(), rtol=1e-12, atol=1e-12, msg=name)
        torch.testing.assert_close(torch.cat(grads), logprobs.grad, rtol=1e-12, atol=1e-12, msg=name)
        expected_tokens = int(((data["loss_mask"] != 0) & torch.isfinite(data["old_logprobs"])).sum())
        assert counts[0] == counts[1] == (expected_tokens, BATCH)
        for rank_metrics in metrics:
            assert rank_metrics.keys() == full_metrics.keys()
            for key, value in full_metrics.items():
                torch.testing.assert_close(rank_metrics[key].float(), value, rtol=1e-6, atol=1e-6, msg=f"{name} {key}")
