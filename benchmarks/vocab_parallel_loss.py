"""Last hidden states -> LM head -> CISPO loss, forward + backward, TP=2 on CPU: fused vs naive.

- fused: ``lm_head_logprobs`` (FP32 head, logits chunk by chunk, recomputed in the backward, never
  gathered) behind ``lm_head_input`` (mcore's copy_to_tensor_model_parallel_region);
- naive: mcore ColumnParallelLinear's forward (copy_to + linear) for the [tokens, V/TP] logits,
  all-gather of the vocabulary (gather_from_tensor_model_parallel_region), log_softmax over
  [tokens, V], gather of the targets.

Both feed ``compute_policy_loss("cispo", ...)`` and backpropagate to the hidden states and the
weight shard. Each method runs in a fresh pair of processes (``run_distributed``), so its peak
memory is its own: peak = ru_maxrss (the process's high-water resident set, which counts every
page the work touched, whatever allocator returned it) after the steps minus ru_maxrss once the
inputs exist. That difference is what the method adds on top of the weights, hidden states and
process start-up; the table reports the larger of the two ranks. Time is the median step.

The naive path holds several fp32 [tokens, V] tensors per rank; if they would not fit in the
machine's available memory, the comparison runs at the largest halved length that does.

    .venv/bin/python benchmarks/vocab_parallel_loss.py
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

from megacispo.losses import compute_policy_loss
from megacispo.parallel.multiprocess import run_distributed
from megacispo.parallel.vocab_parallel import default_chunk_size, lm_head_input, lm_head_logprobs, vocab_shard_range

TP = 2
# fp32 [tokens, V] tensors alive at once per rank at the naive path's peak (the backward of
# log_softmax: its saved output, the incoming and the outgoing gradient), plus the local logits.
NAIVE_FULL_VOCAB_COPIES = 3.5
MEMORY_HEADROOM = 0.6  # use at most this share of the available memory: other jobs share the machine


def naive_logprobs(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, group) -> torch.Tensor:
    from megatron.core.tensor_parallel.mappings import (
        copy_to_tensor_model_parallel_region,
        gather_from_tensor_model_parallel_region,
    )

    local_logits = F.linear(copy_to_tensor_model_parallel_region(hidden, group=group), weight)  # [tokens, V/TP]
    logits = gather_from_tensor_model_parallel_region(local_logits, group=group)  # [tokens, V]
    return torch.log_softmax(logits, dim=-1).gather(-1, targets[:, None]).squeeze(-1)


def fused_logprobs(hidden, weight, targets, group, chunk_size: int | None) -> torch.Tensor:
    logprobs, _ = lm_head_logprobs(lm_head_input(hidden, group), weight, targets, group, chunk_size)
    return logprobs


def max_rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux reports KiB


def measure(method: str, tokens: int, vocab: int, hidden_size: int, chunk_size: int | None, repeats: int) -> dict:
    """One rank's run: warm-up step plus ``repeats`` timed steps of ``method``."""
    from megatron.core import parallel_state

    from megacispo.parallel.layout import ParallelConfig, init_distributed

    init_distributed(ParallelConfig(tensor_model_parallel_size=TP), seed=0)
    group = parallel_state.get_tensor_model_parallel_group()
    tp_rank = torch.distributed.get_rank(group)
    start, end = vocab_shard_range(vocab, tp_rank, TP)
    gen = torch.Generator().manual_seed(0)
    hidden = torch.randn(tokens, hidden_size, generator=gen).requires_grad_(True)
    targets = torch.randint(0, vocab, (tokens,), generator=gen)
    # Only this rank's shard is ever materialized, so the baseline high-water mark is the inputs.
    shard_gen = torch.Generator().manual_seed(1 + tp_rank)
    weight = (torch.randn(end - start, hidden_size, generator=shard_gen) / hidden_size**0.5).requires_grad_(True)
    old_logprobs = -10 - torch.rand(1, tokens, generator=gen)
    advantages = torch.randn(1, generator=gen)
    loss_mask = torch.ones(1, tokens)
    step_logprobs: Callable[[], torch.Tensor] = {
        "fused": lambda: fused_logprobs(hidden, weight, targets, group, chunk_size),
        "naive": lambda: naive_logprobs(hidden, weight, targets, group),
    }[method]

    def step() -> torch.Tensor:
        hidden.grad = weight.grad = None
        loss, _ = compute_policy_loss("cispo", step_logprobs()[None], old_logprobs, advantages, loss_mask)
        loss.backward()
        return loss.detach()

    baseline_mib = max_rss_mib()
    loss = step()
    times = []
    for _ in range(repeats):
        begin = time.perf_counter()
        step()
        times.append(time.perf_counter() - begin)
    return {
        "peak_mib": max_rss_mib() - baseline_mib,
        "step_s": statistics.median(times),
        "loss": loss.item(),
        "grad_norm": torch.cat([hidden.grad.flatten(), weight.grad.flatten()]).norm().item(),
    }


def available_mib() -> float:
    with open("/proc/meminfo") as meminfo:
        fields = dict(line.split(":", 1) for line in meminfo)
    return int(fields["MemAvailable"].split()[0]) / 1024


def fitting_tokens(tokens: int, vocab: int) -> int:
    """The largest of tokens, tokens / 2, ... whose naive run (TP processes) fits in available memory."""
    budget = MEMORY_HEADROOM * available_mib()
    while tokens > 1 and TP * NAIVE_FULL_VOCAB_COPIES * tokens * vocab * 4 / 2**20 > budget:
        tokens //= 2
    return tokens


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=2048, help="response tokens of the one sequence")
    parser.add_argument("--vocab", type=int, default=200_064)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--chunk-size", type=int, default=None, help="fused head tokens per chunk (default ~64 MiB)")
    parser.add_argument("--repeats", type=int, default=2, help="timed steps per method (after one warm-up)")
    args = parser.parse_args()

    tokens = fitting_tokens(args.tokens, args.vocab)
    if tokens != args.tokens:
        print(f"the naive path at {args.tokens} tokens would not fit in the available memory: comparing at {tokens}\n")
    chunk_size = args.chunk_size or default_chunk_size(args.vocab // TP)
    print(
        f"TP={TP} on CPU (gloo), vocab {args.vocab}, hidden {args.hidden}, 1 sequence x {tokens} tokens, fp32, "
        f"forward + backward to the CISPO loss, fused chunk {chunk_size} tokens, median of {args.repeats} steps, "
        f"torch {torch.__version__}, {max(1, (os.cpu_count() or 1) // TP)} thread(s) per rank\n"
    )
    results = {
        method: run_distributed(
            measure, TP, method, tokens, args.vocab, args.hidden, args.chunk_size, args.repeats, timeout_s=3600
        )
        for method in ("naive", "fused")
    }
    naive_peak = max(rank["peak_mib"] for rank in results["naive"])
    naive_time = max(rank["step_s"] for rank in results["naive"])
    print("| method | peak memory per rank (MiB) | vs naive | step time (s) | vs naive | loss | grad norm |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for method, ranks in results.items():
        peak = max(rank["peak_mib"] for rank in ranks)
        step_s = max(rank["step_s"] for rank in ranks)
        print(
            f"| {method} | {peak:.0f} | {peak / naive_peak:.2f}x | {step_s:.2f} | {step_s / naive_time:.2f}x "
            f"| {ranks[0]['loss']:.6f} | {ranks[0]['grad_norm']:.6f} |"
        )


if __name__ == "__main__":
    main()
