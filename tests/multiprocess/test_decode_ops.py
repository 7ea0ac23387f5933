"""A decode step launches a fixed, small number of kernels and never waits for the device.

On the lean path (benchmarks/decode_ops.py's model: tiny, 32 experts, top-2) every decoder layer of
one ``decode_step`` runs at most 30 kernel-launching ops (``OpCounter``: a CUDA build's count) in fp32
and in bf16 (a GPU's rollout dtype, with its casts), the same number at 1, 16 and 64 slots, in one
process and under TP, EP and M1's layout: the experts run as grouped products over all slots' routed
tokens, whatever the routing. The step reads nothing back to the host (no ``.item()``,
``.tolist()``, ``bool(tensor)`` or data-dependent shape), so a CUDA graph can hold it. The same holds
for a whole rollout's decode steps (the sampler's draw with top-k, top-p and early truncation, the
model's step, the routes' record): only the host's looks every rollout.host_check_every steps read
back. Planted reads (``.tolist()``, ``nonzero``, ``bool``, an ``.item()`` in the draw) are caught, so
the checks can fail. The lean step with the sampler and the cache's in-place updates traces with
torch.compile(fullgraph=True) (no graph break) and samples what the eager step samples. With
precision.fp8 set, generation runs outside FP8.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from megacispo.testing.harness import run_distributed
from megacispo.testing.op_counter import OpCounter

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import decode_ops  # noqa: E402

MAX_OPS_PER_LAYER = 30


def _lean_counts() -> list[tuple[int, int]]:
    from megacispo.models.config import model_config, transformer_config
    from megacispo.models.model import HybridModel
    from megacispo.parallel.layout import ParallelConfig, init_distributed

    config = model_config("tiny", num_experts=32, moe_router_topk=2)
    init_distributed(ParallelConfig(), seed=0)
    model = HybridModel(config, transformer_config(config, ParallelConfig(), init_method_std=0.3)).eval()
    paths = {"lean": (True, torch.float32), "lean bf16": (True, torch.bfloat16), "megatron": (False, torch.float32)}
    return {path: [decode_ops.count_ours(model, slots, lean=lean, dtype=dtype) for slots in (1, 16, 64)]
            for path, (lean, dtype) in paths.items()}


def test_lean_decode_step_ops_are_few_fixed_and_sync_free():
    """And through Megatron's modules (the path of Transformer Engine layers) the count does not grow
    with the slots either: a rollout's experts run as two grouped products there too."""
    (counts,) = run_distributed(_lean_counts, 1)
    for path in ("lean", "lean bf16"):
        ops = [count for count, _ in counts[path]]
        assert max(ops) <= MAX_OPS_PER_LAYER, f"{path}: ops per layer at 1, 16, 64 slots: {ops}"
        assert max(ops) - min(ops) <= 1, f"{path}: ops per layer grow with the slots: {ops}"
        assert [syncs for _, syncs in counts[path]] == [0, 0, 0], f"{path}: host syncs per decode step: {counts}"
    megatron = [count for count, _ in counts["megatron"]]
    assert max(megatron) - min(megatron) <= 1, f"Megatron path's ops per layer at 1, 16, 64 slots: {megatron}"


def test_lean_decode_step_under_tp_and_ep_stays_fixed_and_sync_free():
    """At TP 2 + EP 2 (benchmarks/decode_ops.py's layout, 2 processes: the EP group within the TP
    group, which holds the same tokens) the lean step's MoE layers run their own experts and all-reduce
    instead of Megatron's all-to-all: no host sync, the same count at 1, 16 and 64 slots, about half the
    Megatron path's."""
    layout, processes = decode_ops.PARALLEL_LAYOUTS["TP 2 + EP 2 (expert TP 1: the EP group within the TP group)"]
    for rank, rows in enumerate(run_distributed(decode_ops.measure_parallel, processes, [1, 16, 64], 32, layout)):
        megatron = [count for *_, (count, _) in rows]
        for dtype, counts in (("fp32", [row[1] for row in rows]), ("bf16", [row[2] for row in rows])):
            ops = [count for count, _ in counts]
            assert [syncs for _, syncs in counts] == [0, 0, 0], (rank, dtype, rows)
            assert max(ops) <= MAX_OPS_PER_LAYER and max(ops) - min(ops) <= 1, (rank, dtype, ops)
        lean = [count for _, (count, _), _, _, _ in rows]
        assert 2 * max(lean) <= min(megatron) + 5, (rank, lean, megatron)


# MiniMax-M1's layout (examples/configs/minimax_m1_512gpu.yaml: TP 8 = expert TP 8, EP 32 across TP
# groups) at 4 processes: the EP gather and reduce-scatter beside TP's sums.
M1_LAYOUT = "M1's layout: TP 2 + expert TP 2, EP 2 across TP groups"


def test_lean_decode_step_at_m1s_layout_stays_fixed_and_sync_free():
    """The M1 config's decode steps, eager in fp32 and bf16, on each of the 4 ranks."""
    layout, processes = decode_ops.PARALLEL_LAYOUTS[M1_LAYOUT]
    for rank, rows in enumerate(run_distributed(decode_ops.measure_parallel, processes, [1, 16, 64], 32, layout)):
        for dtype, counts in (("fp32", [row[1] for row in rows]), ("bf16", [row[2] for row in rows])):
            ops = [count for count, _ in counts]
            assert [syncs for _, syncs in counts] == [0, 0, 0], (rank, dtype, rows)
            assert max(ops) <= MAX_OPS_PER_LAYER and max(ops) - min(ops) <= 1, (rank, dtype, ops)


@pytest.mark.slow
def test_lean_decode_step_at_m1s_layout_compiles_to_few_kernels():
    """About a minute on 2 cores (4 processes, a compile per slot count): compiled in bf16
    (rollout.compile_decode on a GPU), at most 30 kernels a layer."""
    layout, processes = decode_ops.PARALLEL_LAYOUTS[M1_LAYOUT]
    for rank, rows in enumerate(run_distributed(decode_ops.measure_parallel, processes, [1, 16, 64], 32, layout,
                                                True, timeout_s=1200.0)):
        compiled = [row[3] for row in rows]
        assert max(compiled) <= MAX_OPS_PER_LAYER, (rank, compiled)


def test_compiled_kernels_are_read_from_the_generated_code():
    """A compiled function's fused elementwise kernel and its GEMM; a collective's wait counts none,
    an op of this project's with a CUDA kernel of its own counts one, and one whose kernels the code
    hides is refused."""
    from torch._inductor.utils import run_and_get_code

    import megacispo.models.experts  # noqa: F401  (defines the megacispo:: ops)
    from megacispo.testing.op_counter import compiled_kernels

    weight = torch.randn(8, 8)
    _, sources = run_and_get_code(torch.compile(lambda x: torch.sigmoid(x + 1) @ weight), torch.randn(4, 8))
    assert sum(compiled_kernels(code) for code in sources) == 2
    waited = "    buf1 = torch.ops._c10d_functional.all_reduce_.default(buf0, 'sum', '0')\n" \
             "    torch.ops._c10d_functional.wait_tensor.default(buf1)\n"
    assert compiled_kernels(waited) == 1
    assert compiled_kernels("    buf2 = torch.ops.megacispo.swiglu.default(buf1, buf0)\n") == 1
    with pytest.raises(ValueError, match="megacispo.decode_experts"):
        compiled_kernels("    buf2 = torch.ops.megacispo.decode_experts.default(buf1, arg0_1)\n")


def test_project_ops_count_as_a_cuda_build_runs_them():
    """An op with a CUDA kernel of its own (swiglu's Triton kernel) counts one; one without
    (decode_experts, whose CPU kernel is the CPU layer's) counts the ops of its composite."""
    from megacispo.models.experts import decode_experts

    projected = torch.randn(4, 16)
    counter = OpCounter()
    with counter:
        torch.ops.megacispo.swiglu(projected, torch.tensor([4], dtype=torch.int32))
    assert dict(counter.by_op) == {"megacispo::swiglu": 1}
    tokens, fc1, fc2 = torch.randn(3, 8), torch.randn(4, 32, 8), torch.randn(4, 8, 16)
    args = (tokens, torch.rand(3, 2), torch.tensor([[0, 1], [1, 2], [3, 0]]), fc1, fc2, 1.0, 1.0)
    counter = OpCounter()
    with counter:
        torch.ops.megacispo.decode_experts(*args)
    assert "megacispo::decode_experts" not in counter.by_op and counter.by_op["aten::_grouped_mm"] == 2
    assert counter.by_op["megacispo::combine_pairs"] == 1
    torch.testing.assert_close(torch.ops.megacispo.decode_experts(*args), decode_experts(*args))


def test_planted_host_reads_are_caught():
    values = torch.tensor([0.0, 2.0, 0.0, 3.0])
    counter = OpCounter()
    with counter:
        values.tolist()
        values.nonzero()
        bool(values.sum() > 1)
        (values * 2).sum()
    assert counter.host_syncs.count("tolist") == 1 and "aten::nonzero" in counter.host_syncs
    assert "__bool__" in counter.host_syncs
    assert counter.by_op["aten::mul"] == 1


def _decode_with_fp8_configured() -> dict:
    from megacispo.models.config import model_config, transformer_config
    from megacispo.models.model import HybridModel
    from megacispo.parallel.layout import ParallelConfig, init_distributed

    config = model_config("tiny")
    init_distributed(ParallelConfig(), seed=0)
    model = HybridModel(config, transformer_config(config, ParallelConfig())).eval()
    model.lean_decode = False  # through Megatron's TransformerBlock, which enters FP8 from the config
    model.config.fp8 = "hybrid"  # as precision.fp8 sets it (this CPU has no Transformer Engine to run it)
    input_ids, mask = decode_ops.prompts_for(3, config.vocab_size)
    seen = []  # the FP8 setting Megatron's block reads while each forward runs its layers
    model.decoder.layers[0].register_forward_pre_hook(lambda module, args: seen.append(module.config.fp8))
    model.prefill(input_ids, mask)
    outcome = {"outside": list(seen)}
    seen.clear()
    with model.generation_dtype(torch.float32):
        logits, cache = model.prefill(input_ids, mask)
        logits, _ = model.decode_step(logits.argmax(-1), cache)
        outcome["finite"] = bool(logits.isfinite().all())
    outcome["inside"], outcome["after"] = list(seen), model.config.fp8
    return outcome


def test_rollouts_run_outside_fp8():
    """With precision.fp8 set, generation (``generation_dtype``) runs the GEMMs unquantized, and the
    training config gets its FP8 back after; the same prefill outside generation sees FP8 on."""
    (outcome,) = run_distributed(_decode_with_fp8_configured, 1)
    assert outcome["outside"] == ["hybrid"]
    assert outcome["inside"] == [None, None] and outcome["finite"]
    assert outcome["after"] == "hybrid"


def _rollout_syncs(plant: bool) -> dict:
    """generate() on the tiny model, sampling with top-k, top-p and early truncation, 2 slots for 6
    samples (refills), under OpCounter: the host syncs inside each decode step (the draw, the model's
    step, the routes' record) and in the whole rollout. ``plant``: the draw also reads a value."""
    from megacispo.models.config import model_config, transformer_config
    from megacispo.models.model import HybridModel
    from megacispo.parallel.layout import ParallelConfig, init_distributed
    from megacispo.rollout.config import RolloutConfig
    from megacispo.rollout.generate import _SlotRollout, generate, sample_keys

    config = model_config("tiny")
    init_distributed(ParallelConfig(), seed=0)
    model = HybridModel(config, transformer_config(config, ParallelConfig(), init_method_std=0.3))
    counter = OpCounter()
    steps = {"decode": 0}

    def in_step(method):
        def counted(*args, **kwargs):
            with counter.counting_as("decode step"):
                if plant and method.__name__ == "_draw":
                    args[1].max().item()
                return method(*args, **kwargs)
        return counted

    decode_step = model.decode_step

    def counted_decode_step(*args, **kwargs):
        steps["decode"] += 1
        return in_step(decode_step)(*args, **kwargs)

    model.decode_step = counted_decode_step
    prefill = model.prefill

    def counted_prefill(*args, **kwargs):  # a prefill checks its inputs on the host: not a decode step
        with counter.counting_as("prefill"):
            return prefill(*args, **kwargs)

    model.prefill = counted_prefill
    draw, record = _SlotRollout._draw, _SlotRollout._record_step_routes
    _SlotRollout._draw, _SlotRollout._record_step_routes = in_step(draw), in_step(record)
    try:
        rollout = RolloutConfig(max_new_tokens=24, temperature=1.0, top_k=50, top_p=0.9, max_running=2,
                                early_truncation_tokens=6, early_truncation_prob=0.5, host_check_every=8)
        prompts = [[3 + i, 7, 11 + 2 * i] for i in range(6)]
        with counter:
            generate(model, prompts, rollout, stop_ids=[2], pad_id=0, keys=sample_keys((1,), range(6), 1, device="cpu"))
    finally:
        _SlotRollout._draw, _SlotRollout._record_step_routes = draw, record
    engine = len(counter.host_syncs) - counter.syncs_by_region["decode step"] - counter.syncs_by_region["prefill"]
    return {"in_steps": counter.syncs_by_region["decode step"], "engine": engine, "decode_steps": steps["decode"]}


def test_decode_steps_read_nothing_back_and_the_host_looks_every_n_steps():
    (outcome,) = run_distributed(_rollout_syncs, 1, False)
    assert outcome["in_steps"] == 0, outcome
    # Between steps, the host's looks (every 8 steps, or at a length limit) and the final copy: far
    # fewer than one a step.
    assert outcome["decode_steps"] >= 24 and outcome["engine"] <= outcome["decode_steps"] / 4, outcome


def test_a_planted_read_in_a_decode_step_is_caught():
    (outcome,) = run_distributed(_rollout_syncs, 1, True)
    assert outcome["in_steps"] >= outcome["decode_steps"], outcome


def _compiled_step_outputs() -> dict:
    """The lean decode step with the sampler (top-k, top-p, per-sample streams), the KV append and
    the lightning states' update in place, traced by torch.compile with fullgraph=True (a graph
    break raises), against the same steps run eagerly on a copy of the cache, in fp64: eager steps run
    the CPU layer's kernels where the trace runs torch's ops, whose fp32 roundings differ."""
    import copy

    from megacispo.models.config import model_config, transformer_config
    from megacispo.models.model import HybridModel
    from megacispo.parallel.layout import ParallelConfig, init_distributed
    from megacispo.rollout.config import RolloutConfig
    from megacispo.rollout.generate import sample_keys, sample_tokens

    config = model_config("tiny")
    init_distributed(ParallelConfig(), seed=0)
    model = HybridModel(config, transformer_config(config, ParallelConfig(), init_method_std=0.3)).eval().double()
    model.config.moe_router_dtype = "fp64"
    rollout = RolloutConfig(temperature=1.0, top_k=20, top_p=0.9)
    input_ids, mask = decode_ops.prompts_for(4, config.vocab_size)
    keys = sample_keys((0,), range(4), 1, device="cpu")

    def step(tokens, drawn, cache, span):
        _, logits = model._lean_stage(tokens, cache.next_positions[:, None], cache, None, span)
        return sample_tokens(logits[:, 0], rollout, keys, drawn)

    compiled = torch.compile(step, fullgraph=True, backend="eager")
    outputs = {}
    with torch.no_grad(), model.generation_dtype(torch.float64), model.recording_routes():
        logits, prefilled = model.prefill(input_ids, mask)
        prefilled.reserve(8)
        for name, run in (("eager", step), ("compiled", compiled)):
            cache, tokens, drawn = copy.deepcopy(prefilled), logits.argmax(-1), []
            for position in range(4):
                tokens, logprobs, _ = run(tokens, torch.full((4,), position), cache, cache.step_span(bucketed=True))
                cache.count_step()
                drawn.append((tokens, logprobs))
            outputs[name] = drawn
    return outputs


def test_decode_step_with_sampling_traces_as_one_graph():
    (outputs,) = run_distributed(_compiled_step_outputs, 1)
    for (tokens, logprobs), (eager_tokens, eager_logprobs) in zip(outputs["compiled"], outputs["eager"]):
        assert torch.equal(tokens, eager_tokens)
        torch.testing.assert_close(logprobs, eager_logprobs, rtol=1e-10, atol=1e-10)


def _compiled_rollout() -> dict:
    """A sampled rollout (6 prompts of 3-20 tokens, 4 slots: refills, and shrinks to 2 and 1 row as the
    tail finishes) with the compiled lean step and eagerly, in fp64. The compiled step runs through a
    backend that counts its compilations (dynamo decides them; inductor would only make them slower
    to test), the draw through dynamo's eager backend, and every decode step's rows and span are
    recorded: the shapes a captured step sees, one CUDA graph each."""
    from megacispo.models.config import model_config, transformer_config
    from megacispo.models.model import HybridModel, _lean_step_guards
    from megacispo.parallel.layout import ParallelConfig, init_distributed
    from megacispo.rollout.config import RolloutConfig
    from megacispo.rollout import generate as generate_module
    from megacispo.rollout.generate import generate, sample_keys

    config = model_config("tiny")
    init_distributed(ParallelConfig(), seed=3)
    model = HybridModel(config, transformer_config(config, ParallelConfig(), init_method_std=0.3)).eval().double()
    model.config.moe_router_dtype = "fp64"
    compilations, shapes = [], []

    def counting_backend(graph, example_inputs):
        compilations.append(len(example_inputs))
        return graph.forward

    model._compiled_lean = torch.compile(model._lean_stage, backend=counting_backend, fullgraph=True,
                                         options={"guard_filter_fn": _lean_step_guards})
    draw = torch.compile(generate_module.draw_tokens, backend="eager", fullgraph=True)
    generate_module.compiled_draw = lambda cuda: draw  # inductor's draw: test_rollout_precision
    decode_forward = model._decode_forward

    def recording(input_ids, *args, lean_span=None, **kwargs):
        if lean_span is not None and kwargs.get("compiled"):
            shapes.append((input_ids.shape[0], lean_span))
        return decode_forward(input_ids, *args, lean_span=lean_span, **kwargs)

    model._decode_forward = recording
    generator = torch.Generator().manual_seed(9)
    prompts = [torch.randint(3, config.vocab_size, (length,), generator=generator).tolist()
               for length in (3, 20, 7, 12, 5, 16)]
    samples = {}
    for compiled in (False, True):
        rollout = RolloutConfig(max_new_tokens=90, temperature=1.0, top_k=50, max_running=4, compile_decode=compiled)
        result = generate(model, prompts, rollout, stop_ids=[2], pad_id=0, response_limits=[90, 12, 60, 30, 70, 8],
                          keys=sample_keys((5,), range(len(prompts)), 1, device="cpu"))
        samples[compiled] = (result.tokens, result.rollout_logprobs)
    return {"samples": samples, "compilations": len(compilations), "shapes": shapes}


def test_a_compiled_rollout_sees_a_few_shapes_and_samples_what_eager_samples():
    """The position lives on the device (InferenceCache.column), the span is a power of two and the
    rows shrink by powers of two: over a rollout of 90-token responses the compiled step sees a few
    (rows, span) shapes, each one CUDA graph to record, compiles at most four times whatever the
    rollout's length (the first shape; then the span and the rows turn dynamic; one row gets a graph
    of its own), and samples exactly what the eager step samples."""
    (result,) = run_distributed(_compiled_rollout, 1)
    eager_tokens, eager_logprobs = result["samples"][False]
    tokens, logprobs = result["samples"][True]
    assert torch.equal(tokens, eager_tokens)
    torch.testing.assert_close(logprobs, eager_logprobs, rtol=1e-10, atol=1e-10)
    shapes = result["shapes"]
    assert len(shapes) > 60
    assert {rows for rows, _ in shapes} <= {4, 2, 1} and {span & (span - 1) for _, span in shapes} == {0}
    assert len(set(shapes)) <= 6, sorted(set(shapes))
    assert result["compilations"] <= 4, result["compilations"]
