"""Activation memory per rank of one long sequence under context parallelism (CP): the bytes autograd
saves for backward in a training forward of the ``small`` model (7 lightning layers, 1 softmax layer)
on one packed row of N tokens (one document), at CP = 1, 2, 4, as a ratio to CP = 1.

Each CP size runs in CP real processes (gloo, fp32, megacispo.testing.harness.run_distributed), each
rank on its zigzag share of the row (``parallel.context.zigzag_positions``) with the whole row's
``cu_seqlens``, as the trainer feeds the model under CP. The count is that of
tests/support/saved_activations.py: a ``saved_tensors_hooks`` pack hook records every tensor
autograd keeps for backward, each storage once, parameters left out, attributed to the layer kind
whose forward saved it (outside the layers: the embedding, the RoPE tables, the final norm). The
forward stops at the final norm's hidden states (``return_hidden_states``): the trainer's LM head is
fused and chunked (parallel.vocab_parallel), per token, so CP divides it like the rest. The largest
rank's bytes are reported; the ranks hold equal shares.

    .venv/bin/python benchmarks/context_parallel_memory.py [--tokens 8192 16384] [--cp 1 2 4]
"""

from __future__ import annotations

import argparse
import os
import time

import torch

from megacispo.models.config import model_config
from megacispo.testing.harness import run_distributed

GOALS = {2: 0.55, 4: 0.3}  # issue #36: per-rank activation memory as a fraction of CP = 1
OUTSIDE = "rest"
MASK = "mask"  # a softmax layer's saved [N / CP, N] attention mask, quadratic in the length


def saved_bytes(tokens: int, cp: int) -> dict:
    """This rank's saved bytes by layer kind ("L", "S", OUTSIDE; a softmax layer's [N / CP, N] attention
    mask apart, MASK) in a forward of its share of the row, and the forward's seconds. Runs in a worker
    process."""
    from megatron.core import parallel_state
    from megatron.core.packed_seq_params import PackedSeqParams

    from megacispo.models.config import transformer_config
    from megacispo.models.model import HybridModel
    from megacispo.parallel.context import zigzag_positions
    from megacispo.parallel.layout import ParallelConfig, init_distributed

    small = model_config("small", max_position_embeddings=max(tokens, 8192))
    parallel = ParallelConfig(context_parallel_size=cp)
    init_distributed(parallel, seed=0)
    model = HybridModel(small, transformer_config(small, parallel))
    row = torch.randint(3, small.vocab_size, (1, tokens), generator=torch.Generator().manual_seed(0))
    mine = zigzag_positions(tokens, cp, parallel_state.get_context_parallel_rank()) if cp > 1 else slice(None)
    cu_seqlens = torch.tensor([0, tokens], dtype=torch.int32)
    packed = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu_seqlens, cu_seqlens_kv=cu_seqlens,
                             max_seqlen_q=tokens, max_seqlen_kv=tokens)
    parameters = {p.untyped_storage().data_ptr() for p in model.parameters()}
    local = tokens // cp
    current_kind, saved = [OUTSIDE], {}

    def pack(tensor):
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in parameters:
            kind = MASK if tuple(tensor.shape[-2:]) == (local, tokens) and cp > 1 else current_kind[0]
            saved.setdefault(storage.data_ptr(), (kind, storage.nbytes()))
        return tensor

    for layer in model.decoder.layers:
        kind = small.layer_kind(layer.layer_number - 1)
        layer.register_forward_pre_hook(lambda module, args, kind=kind: current_kind.__setitem__(0, kind))
        layer.register_forward_hook(lambda module, args, output: current_kind.__setitem__(0, OUTSIDE))
    start = time.perf_counter()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        model(row[:, mine], packed_seq_params=packed, return_hidden_states=True)
    seconds = time.perf_counter() - start
    totals = {"L": 0, "S": 0, MASK: 0, OUTSIDE: 0}
    for kind, num_bytes in saved.values():
        totals[kind] += num_bytes
    return {"bytes": totals, "seconds": seconds}


def mib(num_bytes: float) -> str:
    return f"{num_bytes / 2**20:,.0f}"


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, nargs="+", default=[8192, 16384], help="lengths of the row")
    parser.add_argument("--cp", type=int, nargs="+", default=[1, 2, 4], help="context_parallel_size values (1 first)")
    args = parser.parse_args()
    if args.cp[0] != 1:
        parser.error(f"--cp {' '.join(map(str, args.cp))}: the first size is the ratios' baseline; start with 1")
    return args


def main() -> None:
    args = parse_args()
    small = model_config("small")
    print(f"small: {small.layer_kinds} (L lightning, S softmax), fp32; "
          f"{os.cpu_count()} cores, torch {torch.__version__}, load average {os.getloadavg()[0]:.1f}\n")
    print("| tokens | CP | tokens / rank | lightning layers MiB | softmax layer MiB | of which its [N / CP, N] mask "
          "MiB | rest MiB | total MiB / rank | vs CP = 1 | goal | without the mask vs CP = 1 | forward s |")
    print("|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for tokens in args.tokens:
        baseline = None
        for cp in args.cp:
            results = run_distributed(saved_bytes, cp, tokens, cp, timeout_s=1800.0)
            largest = max(results, key=lambda result: sum(result["bytes"].values()))["bytes"]
            total = sum(largest.values())
            baseline = baseline or total
            goal = f"<= {GOALS[cp]}x" if cp in GOALS else "-"
            print(f"| {tokens:,} | {cp} | {tokens // cp:,} | {mib(largest['L'])} | {mib(largest['S'] + largest[MASK])} "
                  f"| {mib(largest[MASK])} | {mib(largest[OUTSIDE])} | {mib(total)} | {total / baseline:.3f}x | {goal} "
                  f"| {(total - largest[MASK]) / baseline:.3f}x | {max(r['seconds'] for r in results):.1f} |",
                  flush=True)
    print(f"\nload average at the end {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
