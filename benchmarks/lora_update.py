"""RL updates with LoRA against full fine-tuning: update tokens/s and peak memory, side by side in one run.

Each variant runs in a fresh process (``run_distributed``, a world of one) on the same model, data and
steps: the Engine (Megatron DDP and the distributed-optimizer-free Adam of megacispo.training.engine) is
built, a warm-up update runs, then ``--steps`` timed updates of one micro-batch of ``--batch`` x
``--seq`` random tokens each (forward, backward of the next-token cross-entropy, the optimizer step).
Peak memory is the process's resident-set high-water mark after the steps less the resident set before
the model was built (``megacispo.testing.memory``): weights, gradients, optimizer state and activations.
The table also gives the trainable parameters and the bytes of their gradients and Adam states, which
the base leaves out under LoRA.

    .venv/bin/python benchmarks/lora_update.py [--size small] [--steps 5] [--ranks 8,32]
"""

from __future__ import annotations

import argparse
import statistics
import time
import types

import torch

from megacispo.models.config import LORA_LIGHTNING_TARGETS, LORA_SOFTMAX_TARGETS
from megacispo.testing.harness import run_distributed
from megacispo.testing.memory import proc_status_mib, reset_peak_rss


ATTENTION_TARGETS = LORA_LIGHTNING_TARGETS + LORA_SOFTMAX_TARGETS


def measure(overrides: list[str], batch: int, seq: int, steps: int) -> dict:
    """One variant's run, in its own process."""
    from megacispo.parallel.layout import init_distributed
    from megacispo.parallel.vocab_parallel import vocab_parallel_logprobs
    from megacispo.startup import run_config
    from megacispo.training.engine import Engine

    config = run_config(None, ["optimizer.use_distributed_optimizer=false", *overrides])
    init_distributed(config.parallel, seed=0)
    baseline_mib = reset_peak_rss()
    engine = Engine(config, total_steps=steps + 1, peak_lr=1e-4)
    tokens = torch.randint(0, config.model.vocab_size, (batch, seq), generator=torch.Generator().manual_seed(0))
    micro_batch = types.SimpleNamespace(tokens=tokens)

    def forward_step(micro_batch, model):
        logits = model(micro_batch.tokens)
        targets = micro_batch.tokens[:, 1:]
        return logits, lambda output: (
            -vocab_parallel_logprobs(output[:, :-1].float(), targets, engine.groups.tp).mean(), {})

    step_s = []
    for step in range(steps + 1):
        start = time.perf_counter()
        engine.run_micro_batches([micro_batch], forward_step, forward_only=False)
        engine.step()
        if step:  # the first is the warm-up
            step_s.append(time.perf_counter() - start)
    trainable = sum(param.numel() for param in engine.module.parameters() if param.requires_grad)
    return {
        "tokens_per_s": batch * seq / statistics.median(step_s),
        "peak_mib": proc_status_mib("VmHWM") - baseline_mib,
        "trainable": trainable,
        "total": sum(param.numel() for param in engine.module.parameters()),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", default="small", help="model.size")
    parser.add_argument("--steps", type=int, default=5, help="timed updates per variant")
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--ranks", default="8,32", help="LoRA ranks to run beside full fine-tuning")
    args = parser.parse_args()

    variants = {"full fine-tuning": []}
    ranks = args.ranks.split(",")
    for rank in ranks:
        # train.load is the base a LoRA run starts from; this benchmark keeps the random one.
        variants[f"LoRA rank {rank}, all-linear"] = [f"lora.rank={rank}", "train.load=unused"]
    variants[f"LoRA rank {ranks[0]}, attention only"] = [
        f"lora.rank={ranks[0]}", "train.load=unused", f"lora.targets=[{','.join(ATTENTION_TARGETS)}]"]
    print(f"model.size {args.size}, fp32, batch {args.batch} x {args.seq} tokens, median of {args.steps} updates, "
          f"torch threads {torch.get_num_threads()}\n")
    print("| training | trainable params | grads + Adam state (MiB) | update tokens/s | peak memory (MiB) |")
    print("|---|---:|---:|---:|---:|")
    for name, overrides in variants.items():
        (result,) = run_distributed(measure, 1, [f"model.size={args.size}", *overrides], args.batch, args.seq,
                                    args.steps, timeout_s=1800)
        # fp32: a gradient (4 bytes) and Adam's two moments (8 bytes) per trainable parameter.
        state_mib = result["trainable"] * 12 / 2**20
        print(f"| {name} | {result['trainable']:,} ({result['trainable'] / result['total']:.1%}) | "
              f"{state_mib:,.0f} | {result['tokens_per_s']:,.0f} | {result['peak_mib']:,.0f} |")


if __name__ == "__main__":
    main()
