"""Forward + backward time of block-wise lightning attention vs causal softmax attention (CPU, fp32).

Prints two markdown tables:
1. per sequence length: lightning ms, softmax ms (F.scaled_dot_product_attention, is_causal=True,
   same heads and head dim), softmax / lightning, then the growth lightning(longest) / lightning(2k);
2. at one length: the custom autograd.Function (hand-written backward) vs plain autograd through
   the same block-wise forward: time and the bytes autograd keeps for backward.

Times are the best of several steps: on a shared machine the minimum is the least disturbed.

    .venv/bin/python benchmarks/lightning_attention.py [--threads 1 --clock cpu]
"""

from __future__ import annotations

import argparse
import os
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

from megacispo.models import lightning
from megacispo.models.lightning import lightning_attention, lightning_decay_rates

Step = Callable[[], None]


CLOCKS = {"wall": time.perf_counter, "cpu": time.process_time}


def best_ms(step: Step, repeats: int, clock: str) -> float:
    timer = CLOCKS[clock]
    times = []
    for _ in range(repeats):
        start = timer()
        step()
        times.append((timer() - start) * 1e3)
    return min(times)


def clear_grads(*tensors: torch.Tensor) -> None:
    """As zero_grad(set_to_none=True) does each step: backward then stores, not adds, the grads."""
    for tensor in tensors:
        tensor.grad = None


def random_inputs(shape: tuple[int, ...]) -> tuple[torch.Tensor, ...]:
    """q, k, v (requiring grad) and an output gradient."""
    gen = torch.Generator().manual_seed(0)
    # Scaled like silu(projection) outputs so the fp32 states stay moderate.
    qkv = tuple((0.1 * torch.randn(shape, generator=gen)).requires_grad_(True) for _ in range(3))
    return (*qkv, torch.randn(shape, generator=gen))


def lightning_step(seq_len: int, heads: int, head_dim: int, block_size: int) -> Step:
    q, k, v, grad_out = random_inputs((1, seq_len, heads, head_dim))
    decay = lightning_decay_rates(heads, layer_idx=0, num_layers=80)

    def step() -> None:
        clear_grads(q, k, v)
        out, _ = lightning_attention(q, k, v, decay, block_size=block_size)
        out.backward(grad_out)

    return step


def softmax_step(seq_len: int, heads: int, head_dim: int) -> Step:
    q, k, v, grad_out = random_inputs((1, heads, seq_len, head_dim))

    def step() -> None:
        clear_grads(q, k, v)
        F.scaled_dot_product_attention(q, k, v, is_causal=True).backward(grad_out)

    return step


def autograd_lightning_step(seq_len: int, heads: int, head_dim: int, block_size: int) -> Step:
    """Plain autograd through the same block-wise forward (what the custom Function replaces)."""
    q, k, v, grad_out = random_inputs((1, seq_len, heads, head_dim))
    decay = lightning_decay_rates(heads, layer_idx=0, num_layers=80)
    blocks_per_chunk = max(1, lightning.CHUNK_TOKENS // block_size)
    layout = lightning._BlockLayout.build((seq_len,), block_size, blocks_per_chunk, q.device)
    decays = lightning._BlockDecays.build(decay, layout, q.dtype, with_initial_state=False)

    def step() -> None:
        clear_grads(q, k, v)
        out, _, _ = lightning._lightning_forward(q, k, v, None, decays, layout)
        out.backward(grad_out)

    return step


def saved_for_backward_mib(step: Step) -> float:
    """MiB autograd keeps for backward during one step (distinct storages, inputs included)."""
    storages: dict[int, int] = {}

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        storage = tensor.untyped_storage()
        storages[storage.data_ptr()] = storage.nbytes()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        step()
    return sum(storages.values()) / 2**20


def print_speed_table(args: argparse.Namespace) -> None:
    print("| length | lightning ms | softmax ms | softmax / lightning |")
    print("|---:|---:|---:|---:|")
    lightning_ms = {}
    for seq_len in args.lengths:
        step = lightning_step(seq_len, args.heads, args.head_dim, args.block_size)
        lightning_ms[seq_len] = best_ms(step, args.repeats, args.clock)
        softmax_ms = best_ms(softmax_step(seq_len, args.heads, args.head_dim), args.softmax_repeats, args.clock)
        ratio = softmax_ms / lightning_ms[seq_len]
        print(f"| {seq_len} | {lightning_ms[seq_len]:.1f} | {softmax_ms:.1f} | {ratio:.1f} |")
    longest, reference = max(args.lengths), 2048
    if reference in lightning_ms and longest != reference:
        growth = lightning_ms[longest] / lightning_ms[reference]
        print(f"\nlightning({longest}) / lightning({reference}) = {growth:.2f} (linear: {longest / reference:.0f})")


def print_backward_table(args: argparse.Namespace) -> None:
    seq_len = args.memory_length
    variants = {
        "custom autograd.Function": lightning_step(seq_len, args.heads, args.head_dim, args.block_size),
        "plain autograd through the block loop": autograd_lightning_step(
            seq_len, args.heads, args.head_dim, args.block_size
        ),
    }
    print(f"\nlength {seq_len}: hand-written backward vs autograd through the block-wise forward\n")
    print("| variant | forward + backward ms | saved for backward MiB |")
    print("|---|---:|---:|")
    for name, step in variants.items():
        print(f"| {name} | {best_ms(step, args.repeats, args.clock):.1f} | {saved_for_backward_mib(step):.1f} |")
    qkv_mib = 3 * seq_len * args.heads * args.head_dim * 4 / 2**20
    print(f"\n(q, k, v themselves: {qkv_mib:.1f} MiB)")


def print_block_size_table(args: argparse.Namespace) -> None:
    sizes = args.sweep_block_sizes
    print("lightning forward + backward ms by block size\n")
    print("| length | " + " | ".join(f"B = {size}" for size in sizes) + " |")
    print("|---:|" + "---:|" * len(sizes))
    for seq_len in args.lengths:
        steps = [lightning_step(seq_len, args.heads, args.head_dim, size) for size in sizes]
        times = [best_ms(step, args.repeats, args.clock) for step in steps]
        print(f"| {seq_len} | " + " | ".join(f"{t:.1f}" for t in times) + " |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--lengths", type=int, nargs="+", default=[1024, 2048, 4096, 8192, 16384])
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--block-size", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=7, help="best of this many lightning steps per cell")
    parser.add_argument("--softmax-repeats", type=int, default=3, help="best of this many softmax steps per cell")
    parser.add_argument(
        "--clock",
        choices=sorted(CLOCKS),
        default="wall",
        help="cpu: this process's CPU time, which with --threads 1 ignores the time spent waiting for a shared core",
    )
    parser.add_argument("--memory-length", type=int, default=4096, help="length for the Function vs autograd table")
    parser.add_argument("--threads", type=int, default=None, help="torch.set_num_threads for this run")
    parser.add_argument(
        "--sweep-block-sizes", type=int, nargs="*", default=[], help="only time lightning at these block sizes"
    )
    args = parser.parse_args()
    if args.threads is not None:
        torch.set_num_threads(args.threads)

    load = ", ".join(f"{x:.1f}" for x in os.getloadavg())
    print(
        f"batch 1, {args.heads} heads, head_dim {args.head_dim}, fp32, forward + backward, "
        f"lightning block_size {args.block_size} (chunks of {lightning.CHUNK_TOKENS} tokens), "
        f"{args.clock} clock, best of {args.repeats} (softmax {args.softmax_repeats}), torch {torch.__version__}, "
        f"{torch.get_num_threads()} threads, {os.cpu_count()} CPUs, load average at start {load}\n"
    )
    # Warm up both kernels (first-call allocations, thread pool start-up).
    lightning_step(512, args.heads, args.head_dim, args.block_size)()
    softmax_step(512, args.heads, args.head_dim)()
    if args.sweep_block_sizes:
        print_block_size_table(args)
        return
    print_speed_table(args)
    print_backward_table(args)


if __name__ == "__main__":
    main()
