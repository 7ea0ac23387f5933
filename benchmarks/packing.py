"""Packed micro-batches against right-padded rows on long-tailed lengths: the trainer's old-log-prob
pass plus one update (``Trainer.compute_old_logprobs`` then ``Trainer._update_once``) of the
``small`` model, in real (non-padding) tokens per second and peak memory.

The batch: the lengths of benchmarks/rollout_engine.py (its ``workload``): 64 samples, random prompts
of 16-128 tokens, 4 responses of --long tokens (1,024), the others geometric with mean 20, under 64;
random tokens, advantages and rollout log-probs, right-padded to the longest sample as the trainer
batches a step. The rows:

- padded: train.pack_sequences = false, train.micro_batch_size rows of the batch's full width each;
- packed, default budget: train.max_tokens_per_micro_batch = 0, i.e. micro_batch_size x the longest
  sample, the padded micro-batch's own number of positions;
- packed, budget B: each --budgets value.

Each row runs in a fresh process (a world of one, gloo, fp32, one torch thread by default: on a shared
machine more threads measure the other jobs more than the trainer) that builds the Trainer
(megacispo.testing.trainers.build_trainer) from seed 0, warms up (the CPU layer caches its matmul plans
per shape: on the whole batch packed, on the first micro-batch's rows padded, whose micro-batches all
have that shape), then times --repeats passes. Real tokens / s = the batch's
non-padding tokens / seconds of one old-log-prob pass plus one update (the median of the timed
repeats), of this process's CPU time (the ratio column) and of wall clock. Peak memory: this process's
resident memory sampled every millisecond during the timed repeats, above its value just before
them (the trainer's weights, gradients and optimizer state are below that line; glibc's mmap threshold
is pinned at 64 KiB so that freed buffers leave the resident set at once). A process per row, so
that the rows' peaks and caches do not mix.

    .venv/bin/python benchmarks/packing.py [--samples 64] [--long 1024] [--micro-batch-size 8]
        [--budgets 2048] [--repeats 2] [--threads 1] [--quick]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch
from rollout_engine import PeakResident, describe_machine, workload

from megacispo.testing.harness import run_distributed

PAD = 0


def train_batch(num_samples: int, long_tokens: int, model):
    """The rollout_engine workload as a step's TrainBatch, right-padded to its longest sample, with the
    rollout's experts of every token (the old-log-prob pass compares its routers' with them)."""
    from megacispo.rl.trainer import TrainBatch

    vocab_size, experts, top_k = model.vocab_size, model.num_experts, model.moe_router_topk
    prompts, responses = workload(num_samples, long_tokens, vocab_size)
    generator = torch.Generator().manual_seed(2)
    lengths = torch.tensor([len(p) + r for p, r in zip(prompts, responses)])
    prompt_lengths = torch.tensor([len(p) for p in prompts])
    width = int(lengths.max())
    positions = torch.arange(width)
    real = positions < lengths[:, None]
    response = (positions >= prompt_lengths[:, None]) & real
    tokens = torch.randint(3, vocab_size, (num_samples, width), generator=generator)
    for row, prompt in enumerate(prompts):
        tokens[row, :len(prompt)] = torch.tensor(prompt)
    rollout_logprobs = -torch.rand(num_samples, width - 1, generator=generator)
    # Distinct experts per token: a random permutation's first top_k.
    scores = torch.rand(num_samples, width, model.num_layers, experts, generator=generator)
    routes = scores.argsort(dim=-1)[..., :top_k].to(torch.uint8)
    return TrainBatch(
        tokens=torch.where(real, tokens, PAD),
        loss_mask=response[:, 1:].float(),
        advantages=torch.randn(num_samples, generator=generator),
        rollout_logprobs=torch.where(response[:, 1:], rollout_logprobs, 0.0),
        padding_mask=~real,
        routes=torch.where(real[..., None, None], routes, 0),
    )


def measure(pack: bool, budget: int, micro_batch_size: int, num_samples: int, long_tokens: int, repeats: int,
            threads: int) -> dict:
    """One row in this (fresh) process: the pass's micro-batches and their positions, median wall and CPU
    seconds, peak MiB above the start of the timed repeats."""
    from megacispo.config import Config
    from megacispo.models.config import model_config
    from megacispo.rl.config import RLConfig
    from megacispo.testing.trainers import build_trainer
    from megacispo.training.config import OptimizerConfig, TrainConfig

    torch.set_num_threads(threads)
    config = Config(
        model=model_config("small"),
        rl=RLConfig(updates_per_rollout=1),
        train=TrainConfig(pack_sequences=pack, max_tokens_per_micro_batch=budget, micro_batch_size=micro_batch_size,
                          run_dir="runs/unused"),
        optimizer=OptimizerConfig(use_distributed_optimizer=False),
    )
    trainer = build_trainer(config)
    batch = train_batch(num_samples, long_tokens, config.model)
    micro_batches = trainer._micro_batches(batch)

    def step(rows) -> None:
        rows.old_logprobs = trainer.compute_old_logprobs(rows)
        trainer._update_once(rows)

    # Padded, every micro-batch has the first one's shape: warming up on its rows caches what the whole
    # pass uses, in an eighth of the time.
    step(batch if pack else batch.slice(0, micro_batch_size))
    seconds, cpu_seconds = [], []
    with PeakResident() as memory:
        for _ in range(repeats):
            start, cpu_start = time.perf_counter(), time.process_time()
            step(batch)
            seconds.append(time.perf_counter() - start)
            cpu_seconds.append(time.process_time() - cpu_start)
    return {
        "real_tokens": int((~batch.padding_mask).sum()), "micro_batches": len(micro_batches),
        "positions": sum(micro.tokens.numel() for micro in micro_batches),
        "row_positions": micro_batches[0].tokens.numel(),
        "seconds": statistics.median(seconds), "cpu_seconds": statistics.median(cpu_seconds),
        "peak_mib": memory.above_start_mib,
    }


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--samples", type=int, default=64)
    parser.add_argument("--long", type=int, default=1024, help="tokens of the few long responses")
    parser.add_argument("--micro-batch-size", type=int, default=8, help="padded rows per micro-batch")
    parser.add_argument("--budgets", type=int, nargs="*", default=[2048],
                        help="explicit train.max_tokens_per_micro_batch values, besides the default budget")
    parser.add_argument("--repeats", type=int, default=2, help="timed passes after the warm-up")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--quick", action="store_true", help="one timed pass (the documented table's command)")
    return parser.parse_args()


def main() -> None:
    args = parse_args()
    repeats = 1 if args.quick else args.repeats
    os.environ["MALLOC_MMAP_THRESHOLD_"] = str(64 * 1024)  # inherited by each measurement's process
    print(f"{describe_machine()}, {args.threads} threads, load average {os.getloadavg()[0]:.1f}")
    rows = [("padded", False, 0), ("packed, default budget", True, 0)]
    rows += [(f"packed, budget {budget}", True, budget) for budget in args.budgets]
    print("\n| rows | micro-batches | positions / micro-batch | positions | real tokens | CPU s | real tokens / CPU s "
          "| vs padded | wall s | real tokens / wall s | peak MiB |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    baseline = None
    for label, pack, budget in rows:
        (result,) = run_distributed(measure, 1, pack, budget, args.micro_batch_size, args.samples, args.long,
                                    repeats, args.threads, timeout_s=1800.0)
        rate = result["real_tokens"] / result["cpu_seconds"]
        baseline = baseline or rate
        print(f"| {label} | {result['micro_batches']} | {result['row_positions']:,} | {result['positions']:,} | "
              f"{result['real_tokens']:,} | {result['cpu_seconds']:.1f} | {rate:,.0f} | {rate / baseline:.2f}x | "
              f"{result['seconds']:.1f} | {result['real_tokens'] / result['seconds']:,.0f} | "
              f"{result['peak_mib']:,.0f} |", flush=True)
    print(f"\nload average at the end {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
