"""What a lightning layer sends under context parallelism: its chunk states (models.lightning_cp, the
LASP-2 scheme) against all-gathering the sequence's q, k and v (what slime does for GDN layers).

Prints two markdown tables:
1. from shapes, for a model preset (default minimax-m1: 64 heads of dim 128, TP = 1): the bytes each
   CP rank sends in one layer call's forward, at each sequence length and CP size. Both are ring
   all-gathers, in which each rank sends its shard to CP - 1 ranks: 2 fp32 [h, d, d] states per rank
   for lightning CP (the attention runs in fp32), this rank's N / CP tokens of q, k and v in bf16
   for the sequence gather. The backward reduce-scatters the same sizes again. TP divides the
   heads, and so both columns, alike.
2. measured on this machine (CPU, gloo, fp32, a small shape): forward + backward of
   ``lightning_attention_cp`` on CP processes, the time of its state all-gather alone, and of an
   all-gather of q, k, v of the same shape, against ``lightning_attention`` in one process on the
   whole row and on one rank's share (its two chunks as two documents: the work CP adds to is that).
   Times are the median of the timed calls, of the slowest rank.

    .venv/bin/python benchmarks/lightning_cp.py [--model minimax-m1 --tokens 16384 32768 --cp 2 4 8]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from collections.abc import Callable

import torch

from megacispo.models.config import model_config
from megacispo.models.lightning import lightning_attention, lightning_decay_rates
from megacispo.models.lightning_cp import lightning_attention_cp, lightning_cp_state_bytes
from megacispo.parallel.context import zigzag_positions
from megacispo.testing.harness import run_distributed

STATE_BYTES = 4  # fp32: the mixer runs lightning attention in fp32 whatever the model's dtype
QKV_BYTES = 2  # bf16: the activations' dtype before that cast, the cheapest a gather could send


def sent_bytes(tokens: int, cp: int, heads: int, head_dim: int) -> tuple[int, int]:
    """(lightning CP, q/k/v all-gather) bytes one rank sends per layer call's forward."""
    states = (cp - 1) * lightning_cp_state_bytes(heads, head_dim, STATE_BYTES)
    sequence = (cp - 1) * 3 * (tokens // cp) * heads * head_dim * QKV_BYTES
    return states, sequence


def mib(num_bytes: float) -> str:
    return f"{num_bytes / 2**20:,.0f}" if num_bytes >= 2**20 else f"{num_bytes / 2**20:.2f}"


def median_s(step: Callable[[], None], repeats: int) -> float:
    step()  # warm-up: block layouts, plans, allocator
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        step()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _inputs(tokens: int, heads: int, head_dim: int) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(0)
    # Scaled like silu(projection) outputs so the fp32 states stay moderate.
    return tuple(0.1 * torch.randn(1, tokens, heads, head_dim, generator=gen) for _ in range(4))


def measure_cp(tokens: int, heads: int, head_dim: int, block_size: int, repeats: int) -> dict[str, float]:
    """One CP rank: forward + backward of lightning_attention_cp, and the two all-gathers alone."""
    from megatron.core.tensor_parallel import gather_from_sequence_parallel_region

    from megacispo.parallel.layout import ParallelConfig, init_distributed

    init_distributed(ParallelConfig(), seed=0)
    group = torch.distributed.group.WORLD
    positions = zigzag_positions(tokens, group.size(), group.rank())
    q, k, v, grad_out = (x[:, positions].contiguous() for x in _inputs(tokens, heads, head_dim))
    decay = lightning_decay_rates(heads, layer_idx=0, num_layers=80)
    cu_seqlens = torch.tensor([0, tokens])
    leaves = [x.requires_grad_(True) for x in (q, k, v)]

    def step() -> None:
        for x in leaves:
            x.grad = None
        lightning_attention_cp(*leaves, decay, cu_seqlens, group, block_size=block_size).backward(grad_out)
        torch.distributed.barrier(group)

    states = torch.zeros(2, heads, head_dim, head_dim)
    qkv = torch.zeros(q.shape[1], 3, heads, head_dim)
    return {
        "step_s": median_s(step, repeats),
        "states_s": median_s(lambda: gather_from_sequence_parallel_region(states, group=group), repeats),
        "qkv_s": median_s(lambda: gather_from_sequence_parallel_region(qkv, group=group), repeats),
    }


def measure_one_process(
    tokens: int, heads: int, head_dim: int, block_size: int, repeats: int, cu_seqlens: torch.Tensor | None = None
) -> float:
    q, k, v, grad_out = _inputs(tokens, heads, head_dim)
    leaves = [x.requires_grad_(True) for x in (q, k, v)]
    decay = lightning_decay_rates(heads, layer_idx=0, num_layers=80)

    def step() -> None:
        for x in leaves:
            x.grad = None
        lightning_attention(*leaves, decay, cu_seqlens=cu_seqlens, block_size=block_size)[0].backward(grad_out)

    return median_s(step, repeats)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="minimax-m1", help="model preset (models/config.py) for table 1")
    parser.add_argument("--tokens", type=int, nargs="+", default=[16384, 32768], help="sequence lengths of table 1")
    parser.add_argument("--cp", type=int, nargs="+", default=[2, 4, 8], help="CP sizes of table 1")
    parser.add_argument("--run-tokens", type=int, default=8192, help="sequence length of the measured run")
    parser.add_argument("--run-heads", type=int, default=8)
    parser.add_argument("--run-head-dim", type=int, default=64)
    parser.add_argument("--run-cp", type=int, default=2, help="processes of the measured run")
    parser.add_argument("--block-size", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=5, help="timed calls (after one warm-up)")
    args = parser.parse_args()

    config = model_config(args.model)
    heads, head_dim = config.num_attention_heads, config.head_dim
    print(
        f"{args.model}: {heads} heads of dim {head_dim} (TP = 1); per lightning layer call, forward "
        f"(the backward sends as much again); states fp32, q/k/v bf16\n"
    )
    print("| tokens | CP | lightning CP: states sent per rank (MiB) | q, k, v all-gather: sent per rank (MiB) "
          "| ratio |")
    print("|---:|---:|---:|---:|---:|")
    for tokens in args.tokens:
        for cp in args.cp:
            states, sequence = sent_bytes(tokens, cp, heads, head_dim)
            print(f"| {tokens:,} | {cp} | {mib(states)} | {mib(sequence)} | {sequence / states:.0f}x |")

    tokens, run_heads, run_dim, cp = args.run_tokens, args.run_heads, args.run_head_dim, args.run_cp
    threads = max(1, (os.cpu_count() or 1) // cp)
    print(
        f"\nmeasured: 1 row of {tokens} tokens, {run_heads} heads of dim {run_dim}, fp32, block {args.block_size}, "
        f"CPU, gloo, CP = {cp} processes of {threads} thread(s) (one process: the same threads), "
        f"median of {args.repeats}, torch {torch.__version__}\n"
    )
    ranks = run_distributed(measure_cp, cp, tokens, run_heads, run_dim, args.block_size, args.repeats, timeout_s=1800)
    slowest = {key: max(rank[key] for rank in ranks) for key in ranks[0]}
    torch.set_num_threads(threads)
    whole = measure_one_process(tokens, run_heads, run_dim, args.block_size, args.repeats)
    share = tokens // cp
    chunks = torch.tensor([0, share // 2, share])
    one_rank = measure_one_process(share, run_heads, run_dim, args.block_size, args.repeats, chunks)
    states, sequence = sent_bytes(tokens, cp, run_heads, run_dim)
    sequence = sequence * STATE_BYTES // QKV_BYTES  # the measured gather sends fp32
    print("| what | per rank sends (MiB) | ms |")
    print("|---|---:|---:|")
    print(f"| lightning_attention, whole row, one process, forward + backward | - | {1e3 * whole:.1f} |")
    print(f"| lightning_attention, one rank's {share} tokens, one process, forward + backward | - "
          f"| {1e3 * one_rank:.1f} |")
    print(f"| lightning_attention_cp, CP = {cp}, forward + backward | {mib(2 * states)} "
          f"| {1e3 * slowest['step_s']:.1f} |")
    print(f"| its state all-gather alone | {mib(states)} | {1e3 * slowest['states_s']:.2f} |")
    print(f"| all-gather of q, k, v (fp32) | {mib(sequence)} | {1e3 * slowest['qkv_s']:.2f} |")


if __name__ == "__main__":
    main()
