"""The lean decode step (HybridModel.decode_step without Megatron's TransformerBlock, parallel
linears and router, through each module's ``step``) computes what the Megatron path computes, on the
same model: teacher-forced decode steps after a left-padded prefill give the same logits at every
step (within 3e-5 of the logits' scale in fp32, 1e-12 in fp64: batches of up to 16 rows take their
matmuls in another summation order: the CPU layer's few-rows kernel), for a padded batch (the MoE's grouped path, masked attention, a
``cache.select`` midway) and a single sequence (the one-token MoE path, no mask); greedy rollouts
through megacispo.rollout.generate.generate's slot engine (2 slots, a refill midway) on each path give the
tokens and log-probs of the Megatron path decoding all prompts at once. The lean path is really
taken: TransformerBlock.forward is not called during its decode steps. Runs in a gloo world of one,
and in fp64 on 2 processes at TP 2 (expert TP 2 and 1), EP 2 and TP 2 + EP 2 (the lean step's
collectives against Megatron's modules); tests/multiprocess/test_rollout_layouts.py runs greedy rollouts
on the multi-process layouts against one process. The Transformer Engine backend's experts
(TEGroupedMLP's ``weight{i}``, its grouped linears twinned on the CPU) step the same way, in one
process, at EP 2 and at TP 2. The TP step's column gather (``all_gather_columns``) places and casts
each rank's columns.

The compiled step (``decode_step(compiled=True)``, torch.compile of the lean path) is checked the
same way in fp32 (the batch size changes midway and the softmax layer's cache grows: recompiles),
and runs as compiled graphs: no decoder layer's ``step`` runs eagerly during its decode steps. Its
guards leave out most checks of the modules (``_lean_step_guards``) but keep their Python values: two
models that differ only in their norms' epsilon each get their own lean step's logits. On 2 processes
(TP 2 + EP 2, EP 2) the compiled step traces whole (fullgraph), its collectives inside the graph, and
gives the Megatron path's logits: run by aot_eager in CI, by inductor in the slow tier. In a bf16
rollout (EP 2) it traces the experts' composite whole, no ``megacispo::`` op left in the graph.
"""

from __future__ import annotations

import pytest
import torch

from megacispo.testing.harness import run_distributed

# Odd lengths, one across the tiny model's lightning block of 16.
PROMPT_LENGTHS = (7, 19, 3)
NUM_STEPS = 20
KEEP_AFTER = 12  # after this many steps the padded batch keeps sequences [2, 0] (cache.select)
# Relative to the largest logit: fp32 round-off amplified over 8 layers and 20 steps.
TOLERANCE = {"float32": 3e-5, "float64": 1e-12}
GREEDY_NEW_TOKENS = 16
GREEDY_LIMITS = [5, 16, 11]
EOS, PAD = 2, 0


def _build_model(dtype: torch.dtype, layout: dict | None = None, size: str = "tiny"):
    from megacispo.models.config import model_config, transformer_config
    from megacispo.models.model import HybridModel
    from megacispo.parallel.layout import ParallelConfig, init_distributed

    model_cfg = model_config(size)
    parallel = ParallelConfig(**(layout or {}))
    init_distributed(parallel, seed=21)
    # A large init std: logits O(1), routing and attention far from uniform, greedy choices far from ties.
    model = HybridModel(model_cfg, transformer_config(model_cfg, parallel, init_method_std=0.3))
    if dtype == torch.float64:
        model.double()
        model.config.moe_router_dtype = "fp64"
    return model.eval()


def _left_pad(prompts: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(len(p) for p in prompts)
    input_ids = torch.full((len(prompts), width), PAD, dtype=torch.long)
    mask = torch.zeros(len(prompts), width, dtype=torch.bool)
    for row, prompt in enumerate(prompts):
        input_ids[row, width - len(prompt) :] = prompt
        mask[row, width - len(prompt) :] = True
    return input_ids, mask


class _CallCounter:
    """Counts the calls of a module's forward (an instance attribute: Module.__call__ finds it first)."""

    def __init__(self, module: torch.nn.Module) -> None:
        self.calls = 0
        self._forward = module.forward
        module.forward = self

    def __call__(self, *args, **kwargs):
        self.calls += 1
        return self._forward(*args, **kwargs)


# decode_step's path: lean_decode and compiled.
PATHS = {"lean": (True, False), "megatron": (False, False), "compiled": (True, True)}


def _teacher_forced(model, prompts: list[torch.Tensor], steps: torch.Tensor, keep_after: int | None, paths,
                    rows_agree: bool = False) -> dict:
    """Prefill, then the tokens ``steps`` [b, NUM_STEPS] one step at a time, on each path (the caches'
    ``rows_agree`` set: every rank decodes the same prompts).
    Returns each path's largest logit difference to the Megatron path and the logit scale, and how
    often each path ran TransformerBlock.forward and (eagerly) a decoder layer's ``step``."""
    from megacispo.models.decoder_layer import HybridDecoderLayer

    block_counter = _CallCounter(model.decoder)
    step_calls = {"count": 0}
    eager_step = HybridDecoderLayer.step

    def counted_step(*args, **kwargs):
        # Dynamo replays a traced function's side effects after its graph: count eager runs only.
        if not torch.compiler.is_compiling():
            step_calls["count"] += 1
        return eager_step(*args, **kwargs)

    input_ids, mask = _left_pad(prompts)
    caches = {path: model.prefill(input_ids, mask)[1] for path in paths}
    rows = torch.arange(len(prompts))
    error = {path: 0.0 for path in paths}
    scale = 0.0
    block_calls = {path: 0 for path in paths}
    layer_steps = {path: 0 for path in paths}
    HybridDecoderLayer.step = counted_step
    try:
        for step in range(NUM_STEPS):
            if step == keep_after:
                rows = torch.tensor([2, 0])
                caches = {path: cache.select(rows) for path, cache in caches.items()}
            logits = {}
            for path in paths:
                caches[path].rows_agree = rows_agree
                model.lean_decode, compiled = PATHS[path]
                blocks_before, steps_before = block_counter.calls, step_calls["count"]
                logits[path], caches[path] = model.decode_step(steps[rows, step], caches[path], compiled=compiled)
                block_calls[path] += block_counter.calls - blocks_before
                layer_steps[path] += step_calls["count"] - steps_before
            for path in paths:
                error[path] = max(error[path], (logits[path] - logits["megatron"]).abs().max().item())
            scale = max(scale, logits["megatron"].abs().max().item())
    finally:
        HybridDecoderLayer.step = eager_step
        model.lean_decode = True
    return {"error": error, "scale": scale, "block_calls": block_calls, "layer_steps": layer_steps}


def _greedy(model, prompts: list[torch.Tensor], paths) -> dict:
    """Greedy rollouts on each path through the slot engine (2 slots for 3 prompts with per-sample
    length limits: a refill midway, per-row positions), and on the Megatron path all at once."""
    from megacispo.rollout.config import RolloutConfig
    from megacispo.rollout.generate import generate, sample_keys

    results = {}
    runs = [("all at once", "megatron", 0), *((path, path, 2) for path in paths)]
    for name, path, slots in runs:
        model.lean_decode, compiled = PATHS[path]
        config = RolloutConfig(max_new_tokens=GREEDY_NEW_TOKENS, temperature=0.0, compile_decode=compiled,
                               max_running=slots)
        samples = generate(
            model, [p.tolist() for p in prompts], config, stop_ids=[EOS], pad_id=PAD,
            keys=sample_keys((0,), range(len(prompts)), 1, device="cpu"), response_limits=GREEDY_LIMITS,
        )
        results[name] = (samples.tokens, samples.rollout_logprobs, samples.response_lengths)
    model.lean_decode = True
    return results


def _inputs(vocab_size: int) -> tuple[list[torch.Tensor], torch.Tensor]:
    """The prompts and the teacher-forced tokens [b, NUM_STEPS]."""
    generator = torch.Generator().manual_seed(4)
    # Token ids from 3 up: no prompt token is EOS or PAD.
    prompts = [torch.randint(3, vocab_size, (length,), generator=generator) for length in PROMPT_LENGTHS]
    return prompts, torch.randint(0, vocab_size, (len(prompts), NUM_STEPS), generator=generator)


def _compare_paths(dtype_name: str, size: str = "tiny") -> dict:
    dtype = getattr(torch, dtype_name)
    model = _build_model(dtype, size=size)
    prompts, steps = _inputs(model.vocab_size)
    # torch.compile's cost (tens of seconds on 2 cores) is paid once, in fp32.
    paths = tuple(PATHS) if dtype == torch.float32 else ("lean", "megatron")
    return {
        "paths": paths,
        "padded_batch": _teacher_forced(model, prompts, steps, KEEP_AFTER, paths),
        "single_sequence": _teacher_forced(model, prompts[1:2], steps[1:2], None, paths),
        "greedy": _greedy(model, prompts, paths) if dtype == torch.float32 else None,
        "other_constants": _other_constants(model, prompts[:2], steps[:2, :4]) if dtype == torch.float32 else None,
    }


def _other_constants(model, prompts: list[torch.Tensor], steps: torch.Tensor) -> dict:
    """A second model with ``model``'s weights whose norms' epsilon differs (a Python number in its
    modules, a constant in the compiled graph), decoded after ``model`` compiled steps on the same
    inputs: each model's compiled steps give its own lean steps' logits, not the other's graph."""
    from megacispo.models.config import transformer_config
    from megacispo.models.model import HybridModel
    from megacispo.parallel.layout import ParallelConfig

    other_cfg = model.hybrid_config.replace(norm_eps=0.5)
    other = HybridModel(other_cfg, transformer_config(other_cfg, ParallelConfig(), init_method_std=0.3)).eval()
    other.load_state_dict(model.state_dict())
    input_ids, mask = _left_pad(prompts)
    logits = {}
    # ``model`` compiles for exactly these inputs first: ``other`` then passes every guard on them.
    runs = (("model compiled", model, True), ("model", model, False), ("other", other, False),
            ("other compiled", other, True))
    for name, decoder, compiled in runs:
        _, cache = decoder.prefill(input_ids, mask)
        logits[name] = torch.stack(
            [decoder.decode_step(steps[:, step], cache, compiled=compiled)[0] for step in range(steps.shape[1])]
        )
    return {
        "compiled_error": max(
            (logits[f"{name} compiled"] - logits[name]).abs().max().item() for name in ("model", "other")
        ),
        "models_differ": (logits["other"] - logits["model"]).abs().max().item(),
        "scale": logits["other"].abs().max().item(),
    }


@pytest.fixture(scope="module", params=["float32", "float64"])
def compared(request):
    (result,) = run_distributed(_compare_paths, 1, request.param)
    return request.param, result


@pytest.mark.parametrize("case", ["padded_batch", "single_sequence"])
def test_lean_step_logits_equal_megatron_path(compared, case):
    dtype_name, result = compared
    outcome = result[case]
    assert outcome["scale"] > 1.0, "the test model must produce non-trivial logits"
    for path in result["paths"]:
        assert outcome["error"][path] <= TOLERANCE[dtype_name] * outcome["scale"], (
            f"{case} {dtype_name} {path}: max abs difference {outcome['error'][path]:.2e} "
            f"at logits up to {outcome['scale']:.1f}"
        )


@pytest.mark.parametrize("case", ["padded_batch", "single_sequence"])
def test_lean_step_skips_transformer_block(compared, case):
    _, result = compared
    calls = result[case]["block_calls"]
    for path in result["paths"]:
        expected = NUM_STEPS if path == "megatron" else 0
        assert calls[path] == expected, f"{path}: TransformerBlock.forward ran {calls[path]} times in {NUM_STEPS} steps"


@pytest.mark.parametrize("case", ["padded_batch", "single_sequence"])
def test_compiled_step_runs_no_layer_eagerly(compared, case):
    dtype_name, result = compared
    if "compiled" not in result["paths"]:
        pytest.skip("the compiled step is checked in the fp32 model")
    layer_steps = result[case]["layer_steps"]
    assert layer_steps["lean"] > 0, "the count must see the lean path's eager layer steps"
    assert layer_steps["compiled"] == 0, f"the compiled path ran a layer's step eagerly {layer_steps['compiled']} times"


def test_greedy_rollout_equal_on_all_paths(compared):
    dtype_name, result = compared
    if result["greedy"] is None:
        pytest.skip("greedy rollouts are compared in the fp32 model")
    tokens, logprobs, lengths = result["greedy"]["all at once"]
    assert bool((lengths > 1).any()), "some response must run decode steps"
    for path in result["paths"]:
        path_tokens, path_logprobs, path_lengths = result["greedy"][path]
        assert torch.equal(path_lengths, lengths) and torch.equal(path_tokens, tokens), path
        scale = max(1.0, logprobs.abs().max().item())
        torch.testing.assert_close(path_logprobs, logprobs, rtol=0, atol=TOLERANCE[dtype_name] * scale)


def test_compiled_step_of_each_model_reads_its_own_constants(compared):
    dtype_name, result = compared
    outcome = result["other_constants"]
    if outcome is None:
        pytest.skip("the compiled step is checked in the fp32 model")
    assert outcome["models_differ"] > 1e-2 * outcome["scale"], "the epsilons must change the logits"
    assert outcome["compiled_error"] <= TOLERANCE[dtype_name] * outcome["scale"], outcome


# Layouts of 2 processes. Under TP the lean step adds the row-parallel outputs over TP, gathers the
# lightning norm's rows and the vocabulary shards, and runs the experts whole (expert TP 1) or as
# expert-TP shards added over the group (expert TP 2, the default: TP's size). Under EP (its ranks
# decoding as many rows: rows_agree) it gathers the group's tokens, runs each rank's experts and
# reduce-scatters the sums; TP 2 with EP 2 has both ranks in both groups.
PARALLEL_LAYOUTS = {
    "tp2_sp": {"tensor_model_parallel_size": 2, "sequence_parallel": True},
    "tp2_etp1": {"tensor_model_parallel_size": 2, "expert_tensor_parallel_size": 1},
    "ep2": {"expert_model_parallel_size": 2},
    "tp2_ep2": {"tensor_model_parallel_size": 2, "sequence_parallel": True, "expert_model_parallel_size": 2,
                "expert_tensor_parallel_size": 1},
}


def _compare_paths_parallel(layout: dict, size: str = "tiny") -> dict:
    model = _build_model(torch.float64, layout, size)
    prompts, steps = _inputs(model.vocab_size)
    return {
        "padded_batch": _teacher_forced(model, prompts, steps, KEEP_AFTER, ("lean", "megatron"), rows_agree=True),
        "single_sequence": _teacher_forced(model, prompts[1:2], steps[1:2], None, ("lean", "megatron"),
                                           rows_agree=True),
    }


@pytest.mark.parametrize("name", sorted(PARALLEL_LAYOUTS))
def test_lean_step_of_parallel_layouts_equals_megatron_path(name):
    for rank, result in enumerate(run_distributed(_compare_paths_parallel, 2, PARALLEL_LAYOUTS[name])):
        for case, outcome in result.items():
            assert outcome["scale"] > 1.0, "the test model must produce non-trivial logits"
            assert outcome["block_calls"] == {"lean": 0, "megatron": NUM_STEPS}, (rank, case, outcome["block_calls"])
            assert outcome["error"]["lean"] <= TOLERANCE["float64"] * outcome["scale"], (
                f"{name} rank {rank} {case}: max abs difference {outcome['error']['lean']:.2e} "
                f"at logits up to {outcome['scale']:.1f}"
            )


@pytest.mark.slow
def test_m2_compiled_step_and_greedy_rollouts_equal_the_megatron_path():
    """MiniMax-M2's decode step through torch.compile (fp32, inductor: minutes on a CPU): its logits are
    the Megatron path's, no layer steps eagerly, and greedy slot rollouts give the same tokens on every
    path."""
    (result,) = run_distributed(_compare_paths, 1, "float32", "tiny-m2")
    for case in ("padded_batch", "single_sequence"):
        outcome = result[case]
        assert outcome["layer_steps"]["compiled"] == 0, outcome["layer_steps"]
        for path in result["paths"]:
            assert outcome["error"][path] <= TOLERANCE["float32"] * outcome["scale"], (case, path, outcome)
    tokens, _, lengths = result["greedy"]["all at once"]
    for path in result["paths"]:
        assert torch.equal(result["greedy"][path][0], tokens) and torch.equal(result["greedy"][path][2], lengths), path


# Megatron takes M2's sigmoid in fp32 (topk_routing_with_score_function's logits.float()), in fp64 models
# too: two summation orders of one fp64 logit may round to neighbouring fp32 scores, a routing weight's
# relative change of 6e-8 (seen: 1.6e-8 of the logits' scale, at EP 2).
M2_FP64_TOLERANCE = 1e-7


@pytest.mark.parametrize("name", ["one_process", "tp2_sp", "ep2"])
def test_m2_lean_step_equals_megatron_path(name):
    """MiniMax-M2's lean step (QK-norm of the step's q and k, gathered over TP; the pre-norm residual
    added by the layer; the sigmoid router's biased choice in the experts' step) against the Megatron
    path, fp64 (``M2_FP64_TOLERANCE``)."""
    layout = PARALLEL_LAYOUTS.get(name, {})
    for rank, result in enumerate(run_distributed(_compare_paths_parallel, 1 if name == "one_process" else 2, layout,
                                                  "tiny-m2")):
        for case, outcome in result.items():
            assert outcome["scale"] > 1.0 and outcome["block_calls"] == {"lean": 0, "megatron": NUM_STEPS}, outcome
            assert outcome["error"]["lean"] <= M2_FP64_TOLERANCE * outcome["scale"], (name, rank, case, outcome)


def _compare_compiled_bf16(layout: dict) -> dict:
    """The compiled step in a bf16 rollout, traced whole and run by an FX backend that records the
    graph's calls (eagerly)."""
    model = _build_model(torch.float32, layout)
    calls = set()

    def recording(graph_module, example_inputs):
        calls.update(str(node.target) for node in graph_module.graph.nodes if node.op == "call_function")
        return graph_module.forward

    model._compiled_lean = torch.compile(model._lean_stage, backend=recording, fullgraph=True)
    prompts, steps = _inputs(model.vocab_size)
    with model.generation_dtype(torch.bfloat16):
        outcome = _teacher_forced(model, prompts, steps, None, ("lean", "megatron", "compiled"), rows_agree=True)
    outcome["calls"] = calls
    return outcome


def test_compiled_bf16_step_traces_the_experts_composite():
    """At EP 2 in bf16 (a GPU's rollouts) the compiled step traces local_expert_products' composite, its
    grouped products and the bookkeeping ops around them (a Triton kernel each on CUDA), rather than the
    op: no graph break, the eager lean step's logits."""
    for rank, outcome in enumerate(run_distributed(_compare_compiled_bf16, 2, PARALLEL_LAYOUTS["ep2"])):
        calls = outcome["calls"]
        assert any("_grouped_mm" in call for call in calls), (rank, sorted(calls))
        project_ops = {call for call in calls if "megacispo" in call}
        assert project_ops == {f"megacispo.{name}" for name in ("permute_pairs", "swiglu", "combine_pairs")}, (
            rank, sorted(calls))
        assert outcome["block_calls"]["compiled"] == 0 and outcome["layer_steps"]["compiled"] == 0, rank
        assert outcome["error"]["compiled"] <= outcome["error"]["lean"] + 1e-2 * outcome["scale"], (rank, outcome)


def _gathered_columns() -> dict:
    from megacispo.models.layers import all_gather_columns
    from megacispo.parallel.layout import ParallelConfig, init_distributed

    init_distributed(ParallelConfig(tensor_model_parallel_size=2), seed=0)
    group = torch.distributed.group.WORLD
    out = {}
    for rows in (3, 1):
        shards = [torch.randn(rows, 5, generator=torch.Generator().manual_seed(2 * rows + rank)) for rank in range(2)]
        mine = shards[group.rank()]
        out[rows] = {"whole": torch.cat(shards, dim=1), "fp32": all_gather_columns(mine, group),
                     "bf16": all_gather_columns(mine, group, torch.bfloat16)}
    return out


def test_gathered_columns_are_placed_and_cast_in_one_copy():
    """all_gather_columns (the lightning norm's rows and the LM head's vocabulary at TP > 1): each rank's
    columns side by side in rank order, in the tensor's dtype or cast (the norm's bf16), for several rows
    and for one (where the gathered rows are already in place)."""
    for rank, result in enumerate(run_distributed(_gathered_columns, 2)):
        for rows, got in result.items():
            assert torch.equal(got["fp32"], got["whole"]), (rank, rows)
            assert got["bf16"].dtype == torch.bfloat16 and got["bf16"].is_contiguous(), (rank, rows)
            assert torch.equal(got["bf16"], got["whole"].bfloat16()), (rank, rows)


def _compare_compiled_parallel(layout: dict, backend: str) -> dict:
    from torch._dynamo.utils import counters

    model = _build_model(torch.float32, layout)
    if backend != "inductor":
        # decode_step(compiled=True) runs the model's compiled stage: here traced whole and run by ``backend``.
        model._compiled_lean = torch.compile(model._lean_stage, backend=backend, fullgraph=True)
    prompts, steps = _inputs(model.vocab_size)
    counters.clear()
    outcome = _teacher_forced(model, prompts, steps, None, ("lean", "megatron", "compiled"), rows_agree=True)
    outcome["graph_breaks"] = sum(counters["graph_break"].values())
    return outcome


# Traced whole (fullgraph) and run by aot_eager in CI: TP 2 + EP 2 (TP's all-reduces and gathers, EP's
# all-reduce within the TP group) and EP 2 (EP's gather and reduce-scatter); inductor's compile of
# each (a minute) in the slow tier.
@pytest.mark.parametrize("name, backend", [
    ("tp2_ep2", "aot_eager"), ("ep2", "aot_eager"),
    pytest.param("tp2_ep2", "inductor", marks=pytest.mark.slow), pytest.param("ep2", "inductor", marks=pytest.mark.slow),
])
def test_compiled_step_of_parallel_layouts_equals_megatron_path(name, backend):
    """The compiled lean step on 2 processes (fp32): traced without a graph break, its collectives
    nodes of the graph, no decoder layer run eagerly, the Megatron path's logits at every step."""
    results = run_distributed(_compare_compiled_parallel, 2, PARALLEL_LAYOUTS[name], backend)
    for rank, outcome in enumerate(results):
        assert outcome["graph_breaks"] == 0, (name, rank)
        assert outcome["block_calls"]["compiled"] == 0 and outcome["layer_steps"]["compiled"] == 0, (name, rank)
        for path in ("lean", "compiled"):
            assert outcome["error"][path] <= TOLERANCE["float32"] * outcome["scale"], (
                f"{name} rank {rank} {path}: max abs difference {outcome['error'][path]:.2e} "
                f"at logits up to {outcome['scale']:.1f}"
            )


# The Transformer Engine backend's MoE layer (models.decoder_layer.te_moe_spec: Megatron's TEGroupedMLP as
# StackingTEGroupedMLP, its weights ``weight{i}`` of one grouped linear per projection), its grouped
# linears twinned on the CPU (megacispo.testing.te_twins), in one process and on 2 (EP 2: gather and
# reduce-scatter; TP 2 with expert TP 2: the shards' all-reduce), within generation_dtype as rollouts
# run it: the lean step's stacks of ``weight{i}`` against Megatron's TEGroupedMLP forward on them; MiniMax-M2
# (sigmoid router, selection bias) in one process and at EP 2.
TE_EXPERT_LAYOUTS = {
    "one_process": ({}, 1),
    "ep2": ({"expert_model_parallel_size": 2}, 2),
    "tp2_sp": ({"tensor_model_parallel_size": 2, "sequence_parallel": True}, 2),
}


def _compare_te_experts(layout: dict, size: str = "tiny") -> dict:
    from megacispo.models.experts import StackingTEGroupedMLP
    from megacispo.testing.te_twins import te_experts_twinned

    with te_experts_twinned():
        model = _build_model(torch.float64, layout, size)
    experts = [layer.mlp.experts for layer in model.decoder.layers]
    parameters = dict(model.named_parameters())
    prompts, steps = _inputs(model.vocab_size)
    with model.generation_dtype(torch.float64):
        stacked = all(expert._stacked is not None for expert in experts)
        outcome = _teacher_forced(model, prompts, steps, KEEP_AFTER, ("lean", "megatron"), rows_agree=True)
    outcome["te_experts"] = all(isinstance(expert, StackingTEGroupedMLP) for expert in experts)
    outcome["stacked"] = stacked
    outcome["parameters_back"] = all(param is parameters[name] for name, param in model.named_parameters())
    return outcome


@pytest.mark.parametrize("name, size", [*((name, "tiny") for name in sorted(TE_EXPERT_LAYOUTS)),
                                        ("one_process", "tiny-m2"), ("ep2", "tiny-m2")])
def test_lean_step_of_transformer_engine_experts_equals_megatron_path(name, size):
    layout, world_size = TE_EXPERT_LAYOUTS[name]
    tolerance = M2_FP64_TOLERANCE if size == "tiny-m2" else TOLERANCE["float64"]
    for rank, outcome in enumerate(run_distributed(_compare_te_experts, world_size, layout, size)):
        assert outcome["te_experts"] and outcome["stacked"] and outcome["parameters_back"], (name, rank)
        assert outcome["scale"] > 1.0, "the test model must produce non-trivial logits"
        assert outcome["block_calls"] == {"lean": 0, "megatron": NUM_STEPS}, (name, rank, outcome["block_calls"])
        assert outcome["error"]["lean"] <= tolerance * outcome["scale"], (
            f"{name} rank {rank}: max abs difference {outcome['error']['lean']:.2e} "
            f"at logits up to {outcome['scale']:.1f}"
        )
