"""Ops per layer of one decode step, by slot count: megacispo's decode paths beside transformers'
MiniMaxForCausalLM of the same shape and weights.

The model: ``tiny`` widened to 32 experts (top-2), as issue 37 measured it; its softmax layer's
rotary_dim = head_dim (HF rotates whole heads). Each side prefills ``slots`` random prompts of 9-40
tokens (left-padded), then one decode step runs under ``megacispo.testing.op_counter.OpCounter``:
the kernel-launching ops each decoder layer runs, counted as a CUDA build would launch them (views
and bare allocations left out, this project's custom ops as their composite implementations,
rms_norm as torch's one fused CUDA kernel). A GPU launches about one kernel per op counted, so the
columns are kernel launches per layer per generated token. Columns:

- lean fp32 / lean bf16: HybridModel's lean decode step (what rollouts run at these layouts, with
  local layers and with Transformer Engine's, whose weights it multiplies the same way) in fp32 (a
  CPU's rollout dtype) and bf16 (a GPU's: the casts to and from the fp32 parts, the lightning state
  and the router, count),
- compiled bf16: the lean step in bf16 through torch.compile (rollout.compile_decode), its kernels
  read from the code inductor generates (``compiled_kernels``), the whole step's over its layers
  (the embedding's and the LM head's few included); inductor's CPU code stands in for its GPU code
  (both backends share its fusion decisions, if not every one),
- megatron: the same step through Megatron's modules in fp32 (``lean_decode = False``: the path of
  EP ranks whose rows differ),
- HF: transformers' decode step with its MiniMaxCache,

each the maximum over the model's layers (lightning and softmax layers differ), with the step's host
syncs (``.item()`` / ``.tolist()`` and data-dependent shapes) as counted by the same counter. Then the
multi-process layouts, among them MiniMax-M1's (examples/configs/minimax_m1_512gpu.yaml: TP 8 with
expert TP 8, EP 32 across TP groups) at 4 processes: TP 2, expert TP 2, EP 2.

First it prints the bytes each GPU sends and receives per decode step for the MoE layers' expert
parallelism at M1's layout (``ep_bytes_per_step``: across nodes and inside a node), for the lean
step's scheme and the ones it was chosen over.

    .venv/bin/python benchmarks/decode_ops.py [--slots 1 16 64] [--experts 32]
"""

from __future__ import annotations

import argparse
import re
from pathlib import Path

import torch

from megacispo.testing.harness import run_distributed

PAD = 0
M1_CONFIG = Path(__file__).resolve().parents[1] / "examples" / "configs" / "minimax_m1_512gpu.yaml"


def ep_bytes_per_step(
    hidden_size: int, slots: int, ep_size: int, expert_tp_size: int, topk: int, num_experts: int, moe_layers: int,
    element_size: int,
) -> dict[str, tuple[int, int]]:
    """Bytes one GPU sends plus receives in a lean decode step's MoE layers under EP across attention TP
    groups (``InProcessMoELayer._step_expert_parallel``; TP groups are nodes), per scheme: (across
    nodes, inside a node). ``slots``: the rows b each rank steps; tokens of ``hidden_size`` elements of
    ``element_size`` bytes. A collective moves data as a ring does: an all-gather or a reduce-scatter
    of n rows a rank over G ranks sends (G - 1) n rows and receives as many, an all-reduce twice
    (G - 1) n / G each way; a ring over EP ranks of T GPUs each, taking each node's GPUs in turn, brings
    a row into each other node once, over one of its T GPUs' links. Schemes:

    - all-gather + reduce-scatter: every GPU gathers the b rows of every EP rank (and scatters their
      sums back) over EP, then the expert-TP shards' outputs are all-reduced (the step before the shares);
    - all-to-all, fixed capacity: each token sent only to the EP ranks that hold its experts, with the
      fixed shapes a step needs (no host sync, a CUDA graph) and no dropped token, so each
      destination's buffer holds the worst case: a row per token, b (all b may choose one rank's
      experts; the receiver routes them again), or a row per (token, expert) pair, b min(k, E / EP).
      Its dispatch moves at least the all-gather's bytes, and its return the reduce-scatter's;
    - shares over expert TP: where T divides b, each expert-TP rank gives its share s = b / T of the
      rows to the all-gather and takes it from the reduce-scatter over the expert TP and EP group, and
      an all-gather over expert TP joins the shares (the lean step); elsewhere the first scheme."""
    row = hidden_size * element_size * moe_layers
    ep, tp = ep_size - 1, expert_tp_size - 1
    all_gather = (4 * ep * slots * row, 4 * tp * slots * row // expert_tp_size)
    pair_rows = slots * min(topk, num_experts // ep_size)
    share = slots // expert_tp_size
    shares = (4 * ep * share * row, (4 * ep_size + 2) * tp * share * row) if slots % expert_tp_size == 0 else all_gather
    return {
        "all-gather + reduce-scatter of b rows": all_gather,
        "all-to-all, a row per token (capacity b)": all_gather,
        "all-to-all, a row per pair (capacity b min(k, E / EP))": (4 * ep * pair_rows * row, all_gather[1]),
        "shares over expert TP (the lean step)": shares,
    }


def m1_decode_layout(path: Path = M1_CONFIG) -> dict:
    """``ep_bytes_per_step``'s arguments at the M1 config's layout: its model, its ``# world size``, its
    rollout slots (rollout.max_running, or all of a data-parallel rank's samples at once) in bf16."""
    from megacispo.config import load_config

    config = load_config(str(path))
    world_size = int(re.search(r"^# world size: (\d+)$", path.read_text(), re.MULTILINE).group(1))
    parallel, model, rollout = config.parallel, config.model, config.rollout
    data_parallel = world_size // (parallel.tensor_model_parallel_size * parallel.pipeline_model_parallel_size
                                   * parallel.context_parallel_size)
    return {
        "hidden_size": model.hidden_size,
        "slots": rollout.max_running or rollout.prompts_per_step * rollout.group_size // data_parallel,
        "ep_size": parallel.expert_model_parallel_size,
        "expert_tp_size": parallel.expert_tp,
        "topk": model.moe_router_topk,
        "num_experts": model.num_experts,
        "moe_layers": model.num_layers,
        "element_size": torch.bfloat16.itemsize,
    }


def prompts_for(slots: int, vocab_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Left-padded random prompts of 9-40 tokens: (input_ids [slots, W], attention_mask [slots, W])."""
    generator = torch.Generator().manual_seed(slots)
    lengths = torch.randint(9, 41, (slots,), generator=generator)
    width = int(lengths.max())
    input_ids = torch.randint(3, vocab_size, (slots, width), generator=generator)
    mask = torch.arange(width) >= width - lengths[:, None]
    return input_ids.masked_fill(~mask, PAD), mask


def count_ours(model, slots: int, lean: bool, dtype: torch.dtype = torch.float32) -> tuple[int, int]:
    from megacispo.testing.op_counter import OpCounter, counting_layers, layer_op_counts

    input_ids, mask = prompts_for(slots, model.vocab_size)
    model.lean_decode = lean
    with model.generation_dtype(dtype), model.recording_routes():
        logits, cache = model.prefill(input_ids, mask)
        cache.rows_agree = True  # every rank decodes `slots` rows, as a rollout's lockstep group agrees
        with OpCounter():  # the first step may make what later steps reuse, on the path the counter runs
            model.decode_step(logits.argmax(-1), cache)
        counter = OpCounter()
        with counter, counting_layers(counter, list(model.decoder.layers), "step" if lean else "forward"):
            model.decode_step(logits.argmax(-1), cache)
    return max(layer_op_counts(counter)), len(counter.host_syncs)


def count_compiled(model, slots: int) -> float:
    """Kernels per layer of the compiled lean step in bf16: a fresh compile for this slot count, whose
    generated code is read (``compiled_kernels``), the whole step's kernels over the model's layers."""
    from torch._inductor.utils import run_and_get_code

    from megacispo.testing.op_counter import compiled_kernels

    input_ids, mask = prompts_for(slots, model.vocab_size)
    model.lean_decode = True
    torch.compiler.reset()
    with model.generation_dtype(torch.bfloat16), model.recording_routes():
        logits, cache = model.prefill(input_ids, mask)
        cache.rows_agree = True
        _, sources = run_and_get_code(model.decode_step, logits.argmax(-1), cache, compiled=True)
    return sum(compiled_kernels(code) for code in sources) / len(model.decoder.layers)


def count_hf(hf_model, slots: int) -> tuple[int, int]:
    from transformers.models.minimax.modeling_minimax import MiniMaxCache

    from megacispo.testing.op_counter import OpCounter, counting_layers, layer_op_counts

    input_ids, mask = prompts_for(slots, hf_model.config.vocab_size)
    with torch.no_grad():
        cache = MiniMaxCache()
        out = hf_model(input_ids, attention_mask=mask.long(), past_key_values=cache, use_cache=True)
        mask = torch.cat([mask, torch.ones(slots, 1, dtype=torch.bool)], dim=1)
        token = out.logits[:, -1].argmax(-1, keepdim=True)
        out = hf_model(token, attention_mask=mask.long(), past_key_values=cache, use_cache=True)
        mask = torch.cat([mask, torch.ones(slots, 1, dtype=torch.bool)], dim=1)
        counter = OpCounter()
        with counter, counting_layers(counter, list(hf_model.model.layers), "forward"):
            hf_model(token, attention_mask=mask.long(), past_key_values=cache, use_cache=True)
    return max(layer_op_counts(counter)), len(counter.host_syncs)


def measure(slot_counts: list[int], experts: int) -> list[tuple]:
    from transformers import MiniMaxConfig, MiniMaxForCausalLM

    from megacispo.models import hf_names
    from megacispo.models.config import model_config, transformer_config
    from megacispo.models.model import HybridModel
    from megacispo.parallel.layout import ParallelConfig, init_distributed
    from megacispo.testing import hf_models

    tiny = model_config("tiny", num_experts=experts, moe_router_topk=2)
    config = tiny.replace(rotary_dim=tiny.head_dim)
    init_distributed(ParallelConfig(), seed=0)
    torch.manual_seed(0)
    hf_model = MiniMaxForCausalLM(MiniMaxConfig(**hf_names.config_to_hf(config))).eval()
    model = HybridModel(config, transformer_config(config, ParallelConfig()))
    tensors = {name: tensor.detach() for name, tensor in hf_model.state_dict().items()}
    model.load_state_dict(hf_models.full_to_single_process(hf_models.hf_to_full(tensors, config)), strict=False)
    model.eval()
    return [(slots, count_ours(model, slots, lean=True), count_ours(model, slots, lean=True, dtype=torch.bfloat16),
             count_compiled(model, slots), count_ours(model, slots, lean=False), count_hf(hf_model, slots))
            for slots in slot_counts]


def measure_parallel(slot_counts: list[int], experts: int, layout: dict, compiled: bool = False) -> list[tuple]:
    """Both decode paths of the same model under a multi-process ``layout`` (random weights: the counts
    do not depend on them), this rank's ops: (slots, lean fp32, lean bf16, compiled bf16 or None,
    megatron) per slot count, as ``measure`` orders them."""
    from megacispo.models.config import model_config, transformer_config
    from megacispo.models.model import HybridModel
    from megacispo.parallel.layout import ParallelConfig, init_distributed

    config = model_config("tiny", num_experts=experts, moe_router_topk=2)
    parallel = ParallelConfig(**layout)
    init_distributed(parallel, seed=0)
    model = HybridModel(config, transformer_config(config, parallel)).eval()
    return [(slots, count_ours(model, slots, lean=True), count_ours(model, slots, lean=True, dtype=torch.bfloat16),
             count_compiled(model, slots) if compiled else None, count_ours(model, slots, lean=False))
            for slots in slot_counts]


# The multi-process layouts counted beside a world of one (sequence parallelism, off in decode steps),
# with their process counts.
PARALLEL_LAYOUTS = {
    "TP 2 (expert TP 2: each rank a shard of every expert)":
        ({"tensor_model_parallel_size": 2, "sequence_parallel": True}, 2),
    "EP 2 (16 experts a rank)": ({"expert_model_parallel_size": 2}, 2),
    "TP 2 + EP 2 (expert TP 1: the EP group within the TP group)":
        ({"tensor_model_parallel_size": 2, "sequence_parallel": True, "expert_model_parallel_size": 2,
          "expert_tensor_parallel_size": 1}, 2),
    "M1's layout: TP 2 + expert TP 2, EP 2 across TP groups":
        ({"tensor_model_parallel_size": 2, "sequence_parallel": True, "expert_model_parallel_size": 2}, 4),
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--slots", type=int, nargs="+", default=[1, 16, 64])
    parser.add_argument("--experts", type=int, default=32)
    args = parser.parse_args()
    layout = m1_decode_layout()
    print(f"M1's layout: EP {layout['ep_size']} across nodes, expert TP {layout['expert_tp_size']}, {layout['slots']} "
          f"slots, hidden {layout['hidden_size']}, top-{layout['topk']} of {layout['num_experts']} experts, "
          f"{layout['moe_layers']} MoE layers, bf16; GB each GPU sends + receives per decode step\n")
    print("| scheme | across nodes | inside a node |")
    print("|---|---:|---:|")
    for scheme, (across_nodes, in_a_node) in ep_bytes_per_step(**layout).items():
        print(f"| {scheme} | {across_nodes / 1e9:.3f} | {in_a_node / 1e9:.3f} |")
    print()
    (rows,) = run_distributed(measure, 1, args.slots, args.experts, timeout_s=600.0)
    print(f"tiny model, {args.experts} experts, top-2; ops per layer per decode step (the most of any layer), "
          "host syncs per step\n")
    print("| slots | lean fp32 | lean bf16 | compiled bf16 | megatron | transformers | lean syncs | megatron syncs "
          "| transformers syncs |")
    print("|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for slots, (lean, lean_syncs), (lean_bf16, _), compiled, (megatron, megatron_syncs), (hf, hf_syncs) in rows:
        print(f"| {slots} | {lean} | {lean_bf16} | {compiled:.1f} | {megatron} | {hf} | {lean_syncs} "
              f"| {megatron_syncs} | {hf_syncs} |")
    for name, (layout, processes) in PARALLEL_LAYOUTS.items():
        rows = run_distributed(measure_parallel, processes, args.slots, args.experts, layout, True, timeout_s=1200.0)[0]
        print(f"\n{name}, {processes} processes, rank 0; collectives counted as ops\n")
        print("| slots | lean fp32 | lean bf16 | compiled bf16 | megatron | lean syncs | megatron syncs |")
        print("|---:|---:|---:|---:|---:|---:|---:|")
        for slots, (lean, lean_syncs), (lean_bf16, _), compiled, (megatron, megatron_syncs) in rows:
            print(f"| {slots} | {lean} | {lean_bf16} | {compiled:.1f} | {megatron} | {lean_syncs} | {megatron_syncs} |")


if __name__ == "__main__":
    main()
