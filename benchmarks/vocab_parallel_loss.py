"""Last hidden states -> LM head -> CISPO loss, forward + backward, TP=2 on CPU: fused vs naive.

- fused: ``lm_head_logprobs`` (FP32 head, logits tile by tile, recomputed in the backward, never
  gathered) behind ``lm_head_input`` (mcore's copy_to_tensor_model_parallel_region);
- naive: mcore ColumnParallelLinear's forward (copy_to + linear) for the [tokens, V/TP] logits,
  all-gather of the vocabulary (gather_from_tensor_model_parallel_region), log_softmax over
  [tokens, V], gather of the targets;
- unfused (for reference): the same [tokens, V/TP] logits into ``vocab_parallel_logprobs``, which
  does not gather the vocabulary but holds the whole logits shard.

Both feed ``compute_policy_loss("cispo", ...)`` and backpropagate to the hidden states and the
weight shard. Each method runs in a fresh pair of processes (``run_distributed``). Peak memory is
what the method adds on top of its inputs (weights, hidden states) and process start-up: once the
inputs exist, the kernel's high-water mark of the resident set is reset (Linux: "5" into
/proc/self/clear_refs), and the peak is VmHWM after the steps minus VmRSS at the reset. The
resident set counts every page the work touched, whichever allocator handed it out and gave it
back. The table reports the larger of the two ranks. Step time is the median of the timed steps,
as wall-clock and as CPU time of the rank's process (less sensitive to other jobs on the machine).

The naive path holds several fp32 [tokens, V] tensors per rank; if they would not fit in the
machine's available memory, the comparison runs at the largest halved length that does.

    .venv/bin/python benchmarks/vocab_parallel_loss.py
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch.distributed import ProcessGroup

from megacispo.parallel.vocab_parallel import (
    default_tile,
    lm_head_input,
    lm_head_logprobs,
    vocab_parallel_logprobs,
    vocab_shard_range,
)
from megacispo.rl.losses import compute_policy_loss
from megacispo.testing.harness import run_distributed
from megacispo.testing.memory import proc_status_mib, reset_peak_rss

TP = 2
# fp32 [tokens, V] tensors alive at once per rank at the naive path's peak (the backward of
# log_softmax: its saved output, the incoming and the outgoing gradient), plus the local logits.
NAIVE_FULL_VOCAB_COPIES = 3.5
MEMORY_HEADROOM = 0.6  # use at most this share of the available memory: other jobs share the machine


def column_parallel_logits(hidden: torch.Tensor, weight: torch.Tensor, group: ProcessGroup) -> torch.Tensor:
    """mcore ColumnParallelLinear's forward without bias: [tokens, H] -> [tokens, V/TP]."""
    return F.linear(lm_head_input(hidden, group), weight)


def naive_logprobs(
    hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, group: ProcessGroup
) -> torch.Tensor:
    from megatron.core.tensor_parallel.mappings import gather_from_tensor_model_parallel_region

    logits = gather_from_tensor_model_parallel_region(column_parallel_logits(hidden, weight, group), group=group)
    return torch.log_softmax(logits, dim=-1).gather(-1, targets[:, None]).squeeze(-1)  # logits: [tokens, V]


def unfused_logprobs(
    hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, group: ProcessGroup
) -> torch.Tensor:
    return vocab_parallel_logprobs(column_parallel_logits(hidden, weight, group), targets, group)


def fused_logprobs(
    hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, group: ProcessGroup, tile: tuple[int, int]
) -> torch.Tensor:
    logprobs, _ = lm_head_logprobs(lm_head_input(hidden, group), weight, targets, group, *tile)
    return logprobs


def measure(method: str, tokens: int, vocab: int, hidden_size: int, tile: tuple[int, int], repeats: int) -> dict:
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
    weight = torch.randn(end - start, hidden_size, generator=shard_gen).div_(hidden_size**0.5).requires_grad_(True)
    old_logprobs = -10 - torch.rand(1, tokens, generator=gen)
    advantages = torch.randn(1, generator=gen)
    loss_mask = torch.ones(1, tokens)
    step_logprobs: Callable[[], torch.Tensor] = {
        "fused": lambda: fused_logprobs(hidden, weight, targets, group, tile),
        "naive": lambda: naive_logprobs(hidden, weight, targets, group),
        "unfused": lambda: unfused_logprobs(hidden, weight, targets, group),
    }[method]

    def step() -> torch.Tensor:
        hidden.grad = weight.grad = None
        loss, _ = compute_policy_loss("cispo", step_logprobs()[None], old_logprobs, advantages, loss_mask)
        loss.backward()
        return loss.detach()

    baseline_mib = reset_peak_rss()
    loss = step()
    wall_s, cpu_s = [], []
    for _ in range(repeats):
        wall_begin, cpu_begin = time.perf_counter(), time.process_time()
        step()
        wall_s.append(time.perf_counter() - wall_begin)
        cpu_s.append(time.process_time() - cpu_begin)
    return {
        "peak_mib": proc_status_mib("VmHWM") - baseline_mib,
        "step_s": statistics.median(wall_s),
        "cpu_s": statistics.median(cpu_s),
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
    parser.add_argument("--chunk-size", type=int, default=None, help="fused head tokens per tile (default: default_tile)")
    parser.add_argument("--vocab-chunk-size", type=int, default=None, help="fused head vocabulary columns per tile")
    parser.add_argument("--repeats", type=int, default=2, help="timed steps per method (after one warm-up)")
    args = parser.parse_args()

    tokens = fitting_tokens(args.tokens, args.vocab)
    if tokens != args.tokens:
        print(f"the naive path at {args.tokens} tokens would not fit in the available memory: comparing at {tokens}\n")
    default_tokens, default_columns = default_tile(tokens, args.vocab // TP, torch.device("cpu"))
    tile = (args.chunk_size or default_tokens, args.vocab_chunk_size or default_columns)
    print(
        f"TP={TP} on CPU (gloo), vocab {args.vocab}, hidden {args.hidden}, 1 sequence x {tokens} tokens, fp32, "
        f"forward + backward to the CISPO loss, fused tile {tile[0]} tokens x {tile[1]} columns, median of {args.repeats} steps, "
        f"torch {torch.__version__}, {max(1, (os.cpu_count() or 1) // TP)} thread(s) per rank\n"
    )
    results = {
        method: run_distributed(
            measure, TP, method, tokens, args.vocab, args.hidden, tile, args.repeats, timeout_s=3600
        )
        for method in ("naive", "unfused", "fused")
    }
    naive = {key: max(rank[key] for rank in results["naive"]) for key in ("peak_mib", "step_s", "cpu_s")}
    print(
        "| method | peak memory per rank (MiB) | vs naive | step wall (s) | vs naive | step CPU (s) | vs naive "
        "| loss | grad norm |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for method, ranks in results.items():
        cells = []
        for key, digits in (("peak_mib", 0), ("step_s", 2), ("cpu_s", 2)):
            value = max(rank[key] for rank in ranks)
            cells.append(f"{value:.{digits}f} | {value / naive[key]:.2f}x")
        print(f"| {method} | {' | '.join(cells)} | {ranks[0]['loss']:.6f} | {ranks[0]['grad_norm']:.6f} |")


if __name__ == "__main__":
    main()
