"""Forward + backward time of block-wise lightning attention vs causal softmax attention (CPU, fp32).

Prints two markdown tables:
1. per sequence length: lightning ms, softmax ms (F.scaled_dot_product_attention, is_causal=True,
   same heads and head dim), softmax / lightning, and the growth lightning(16k) / lightning(2k);
2. at one length: the custom autograd.Function (hand-written backward) vs plain autograd through
   the same block-wise forward: time and bytes saved for backward.

    .venv/bin/python benchmarks/lightning_attention.py
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

from megacispo.models import lightning
from megacispo.models.lightning import lightning_attention, lightning_decay_rates


def median_ms(step: Callable[[], None], repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        step()
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def random_inputs(shape: tuple[int, ...], seed: int) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(seed)
    # silu(projection) outputs in the model are mostly small and positive; the scale keeps fp32 tame.
    return tuple(
        (0.1 * torch.randn(shape, generator=gen)).requires_grad_(True) for _ in range(3)
    ) + (torch.randn(shape, generator=gen),)


def lightning_step(seq_len: int, heads: int, head_dim: int, block_size: int) -> Callable[[], None]:
    q, k, v, grad_out = random_inputs((1, seq_len, heads, head_dim), seed=0)
    decay = lightning_decay_rates(heads, layer_idx=0, num_layers=80)

    def step() -> None:
        out, _ = lightning_attention(q, k, v, decay, block_size=block_size)
        out.backward(grad_out)

    return step


def softmax_step(seq_len: int, heads: int, head_dim: int) -> Callable[[], None]:
    q, k, v, grad_out = random_inputs((1, heads, seq_len, head_dim), seed=0)

    def step() -> None:
        F.scaled_dot_product_attention(q, k, v, is_causal=True).backward(grad_out)

    return step


def autograd_lightning_step(seq_len: int, heads: int, head_dim: int, block_size: int) -> Callable[[], None]:
    """Plain autograd through the same block-wise forward (what the custom Function replaces)."""
    q, k, v, grad_out = random_inputs((1, seq_len, heads, head_dim), seed=0)
    decay = lightning_decay_rates(heads, layer_idx=0, num_layers=80)
    blocks_per_chunk = max(1, lightning.CHUNK_TOKENS // block_size)
    layout = lightning._BlockLayout.build([seq_len], block_size, blocks_per_chunk, q.device)
    decays = lightning._BlockDecays.build(decay, layout, q.dtype, with_initial_state=False)

    def step() -> None:
        out, _, _ = lightning._lightning_forward(q, k, v, None, decays, layout)
        out.backward(grad_out)

    return step


def saved_for_backward_mib(step: Callable[[], None]) -> float:
    """Bytes autograd keeps for backward during one step (distinct storages), in MiB."""
    storages: dict[int, int] = {}

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        storage = tensor.untyped_storage()
        storages[storage.data_ptr()] = storage.nbytes()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        step()
    return sum(storages.values()) / 2**20


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--lengths", type=int, nargs="+", default=[1024, 2048, 4096, 8192, 16384])
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--block-size", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3, help="median of this many timed steps per cell")
    parser.add_argument("--memory-length", type=int, default=4096, help="length for the Function vs autograd table")
    args = parser.parse_args()

    print(
        f"batch 1, {args.heads} heads, head_dim {args.head_dim}, fp32, forward + backward, "
        f"lightning block_size {args.block_size}, median of {args.repeats}, "
        f"torch {torch.__version__}, {torch.get_num_threads()} threads\n"
    )
    # Warm up both kernels (first-call allocations, thread pool start-up).
    lightning_step(512, args.heads, args.head_dim, args.block_size)()
    softmax_step(512, args.heads, args.head_dim)()

    print("| length | lightning ms | softmax ms | softmax / lightning |")
    print("|---:|---:|---:|---:|")
    lightning_ms = {}
    for seq_len in args.lengths:
        lightning_ms[seq_len] = median_ms(
            lightning_step(seq_len, args.heads, args.head_dim, args.block_size), args.repeats
        )
        softmax_ms = median_ms(softmax_step(seq_len, args.heads, args.head_dim), args.repeats)
        print(f"| {seq_len} | {lightning_ms[seq_len]:.1f} | {softmax_ms:.1f} | {softmax_ms / lightning_ms[seq_len]:.1f} |")
    longest, reference = max(args.lengths), 2048
    if reference in lightning_ms and longest != reference:
        growth = lightning_ms[longest] / lightning_ms[reference]
        print(f"\nlightning({longest}) / lightning({reference}) = {growth:.2f} (linear: {longest / reference:.0f})")

    n = args.memory_length
    custom = lightning_step(n, args.heads, args.head_dim, args.block_size)
    plain = autograd_lightning_step(n, args.heads, args.head_dim, args.block_size)
    print(f"\nlength {n}: hand-written backward vs autograd through the block-wise forward\n")
    print("| variant | forward + backward ms | saved for backward MiB |")
    print("|---|---:|---:|")
    for name, step in (("custom autograd.Function", custom), ("plain autograd", plain)):
        print(f"| {name} | {median_ms(step, args.repeats):.1f} | {saved_for_backward_mib(step):.1f} |")


if __name__ == "__main__":
    main()
