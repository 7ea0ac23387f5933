"""What the CPU back-end costs on a training step of the tiny hybrid model.

megacispo's back-end patches Megatron-Core at the source (the CUDA literals of ~15 functions are
replaced once, at start-up), so a training step runs no extra Python per torch call. The peer is
the catch-all alternative MCORE_CPU.md mentions: a global TorchFunctionMode that rewrites every
``device="cuda"`` argument of every torch call. Both run in the same process, alternating, on the
same model and data; the table reports the median step time of each.

    .venv/bin/python benchmarks/cpu_backend_overhead.py [--steps 20]
"""

from __future__ import annotations

import argparse
import statistics
import time
from dataclasses import dataclass

import torch
from torch.overrides import TorchFunctionMode


class RewriteCudaDevices(TorchFunctionMode):
    """The catch-all: intercept every torch function call and move 'cuda' devices to the CPU."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        device = kwargs.get("device")
        if device is not None and "cuda" in str(device):
            kwargs = {**kwargs, "device": "cpu"}
        return func(*args, **kwargs)


@dataclass
class _MicroBatch:
    tokens: torch.Tensor  # [b, s]


def _train_step(engine, micro_batch: _MicroBatch) -> None:
    """Forward, backward (next-token cross-entropy) and an optimizer step."""
    from megacispo.parallel.vocab_parallel import vocab_parallel_logprobs

    def forward_step(batch: _MicroBatch, model):
        logits = model(batch.tokens)
        targets = batch.tokens[:, 1:]
        return logits, lambda output: (
            -vocab_parallel_logprobs(output[:, :-1].float(), targets, engine.groups.tp).mean(), {})

    engine.run_micro_batches([micro_batch], forward_step, forward_only=False)
    engine.step()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=64)
    args = parser.parse_args()

    from megacispo.parallel.layout import destroy_distributed, init_distributed
    from megacispo.startup import run_config
    from megacispo.training.engine import Engine

    config = run_config(None)
    init_distributed(config.parallel, seed=0)
    engine = Engine(config, total_steps=1000, peak_lr=1e-4)
    batch = _MicroBatch(torch.randint(0, config.model.vocab_size, (args.batch, args.seq),
                                      generator=torch.Generator().manual_seed(0)))
    times = {"narrow source patches (megacispo)": [], "catch-all TorchFunctionMode": []}
    for _ in range(3):
        _train_step(engine, batch)
    for _ in range(args.steps):
        for name in times:
            start = time.perf_counter()
            if name.startswith("catch-all"):
                with RewriteCudaDevices():
                    _train_step(engine, batch)
            else:
                _train_step(engine, batch)
            times[name].append(time.perf_counter() - start)
    narrow = statistics.median(times["narrow source patches (megacispo)"])
    print(f"tiny hybrid model, batch {args.batch} x {args.seq} tokens, {args.steps} steps each, "
          f"torch threads {torch.get_num_threads()}\n")
    print("| CPU back-end | median step (ms) | vs megacispo |")
    print("|---|---|---|")
    for name, values in times.items():
        median = statistics.median(values)
        print(f"| {name} | {median * 1e3:.1f} | {median / narrow:.2f}x |")
    destroy_distributed()


if __name__ == "__main__":
    main()
