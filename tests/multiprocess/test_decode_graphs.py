"""Compiled decode steps as CUDA graphs would run them, checked on the CPU.

Inductor's cudagraph trees start a new generation at every call of a compiled function and free the
outputs of the previous one (those that do not alias its inputs): a later read raises "accessing
tensor output of CUDAGraphs that has been overwritten by a subsequent run" (pytorch#175557), or
reads what the next replay wrote there. Here ``GraphGenerations`` stands in for torch.compile with
that rule: each compiled call first overwrites the previous call's graph outputs (NaN, the most
negative integer: an index error, flipped flags), then runs dynamo's graph eagerly (the graph and its
side effects are dynamo's, without inductor's compile time; with inductor's compile in the slow
tier). A rollout with rollout.compile_decode on a fresh model then completes and samples what the
eager rollout samples: the draw and the step hand nothing to a later call but what aliases their
inputs, and nothing a module keeps is made inside a graph.

Recorded graphs stay valid only if their weights keep their addresses: two ``generation_dtype``
blocks that keep them (a compiled rollout's) give the same tensors (the parameters' copies and the
stacks), filled with the new weights after the parameters change; an eager rollout's frees them. And the compiled step is the model's own: a second model of the same
architecture and dtype, whose steps would pass the first model's guards, compiles its own graphs and
decodes with its own weights.
"""

from __future__ import annotations

import functools

import pytest
import torch
from torch._inductor.compile_fx import compile_fx

from megacispo.testing.harness import run_distributed

EOS, PAD = 2, 0
PROMPTS = [[5, 9, 11], [7] * 18, [3, 4], [8, 6, 4, 3, 9]]


class GraphGenerations:
    """torch.compile whose compiled functions overwrite the previous compiled call's outputs when called,
    as cudagraph trees free them on CUDA; dynamo's graphs run eagerly, or with ``inductor`` as inductor
    compiles them (its outputs, which alias the inputs where the graph returns a view of one)."""

    def __init__(self, inductor: bool = False) -> None:
        self._inductor = inductor
        self._compile = torch.compile
        self._outputs: list[torch.Tensor] = []
        self.calls = 0
        self.graphs = 0
        """Graphs dynamo compiled (handed to the backend)."""

    def __enter__(self) -> GraphGenerations:
        torch.compile = self.compile
        return self

    def __exit__(self, *exc) -> None:
        torch.compile = self._compile

    def compile(self, fn, *, fullgraph: bool = False, dynamic: bool | None = None, **_):
        compiled = self._compile(fn, backend=self._backend, fullgraph=fullgraph, dynamic=dynamic)

        @functools.wraps(fn)
        def call(*args, **kwargs):
            self.calls += 1
            for output in self._outputs:
                _overwrite(output)
            self._outputs = []
            return compiled(*args, **kwargs)

        return call

    def _backend(self, graph: torch.fx.GraphModule, example_inputs):
        self.graphs += 1
        compiled = compile_fx(graph, example_inputs) if self._inductor else graph

        def run(*inputs):
            outputs = compiled(*inputs)
            aliased = {t.untyped_storage().data_ptr() for t in inputs if isinstance(t, torch.Tensor)}
            self._outputs += [t for t in outputs
                              if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() not in aliased]
            return outputs

        return run


def _overwrite(tensor: torch.Tensor) -> None:
    """Values no computation should read: NaN, an index out of any range, flipped flags. (Resizing the
    storage away would be closer to a free, but CPU kernels read past an empty storage: a crash.)"""
    if tensor.dtype == torch.bool:
        tensor.logical_not_()
    elif tensor.is_floating_point():
        tensor.fill_(float("nan"))
    else:
        tensor.fill_(torch.iinfo(tensor.dtype).min)


def _init() -> None:
    from megacispo.parallel.layout import ParallelConfig, init_distributed

    init_distributed(ParallelConfig(), seed=5)


def _model():
    from megacispo.models.config import model_config, transformer_config
    from megacispo.models.model import HybridModel
    from megacispo.parallel.layout import ParallelConfig

    config = model_config("tiny")
    return HybridModel(config, transformer_config(config, ParallelConfig(), init_method_std=0.3))


def _rollout(model, compiled: bool):
    from megacispo.rollout.config import RolloutConfig
    from megacispo.rollout.generate import generate, sample_keys

    # 2 slots for 4 prompts: refills, per-row positions, and a shrink to one row at the end.
    config = RolloutConfig(max_new_tokens=6, temperature=1.0, dtype="float32", compile_decode=compiled, max_running=2)
    keys = sample_keys((3, 1), range(len(PROMPTS)), 1, device="cpu")
    return generate(model, PROMPTS, config, stop_ids=[EOS], pad_id=PAD, keys=keys)


def _rollout_case(inductor: bool) -> dict:
    _init()
    model = _model()
    # Compiled first, on a fresh model: what its modules compute on first use and keep (the lightning
    # layers' decay factors) would be made inside a graph, an output the next call overwrites.
    with GraphGenerations(inductor) as generations:
        compiled = _rollout(model, compiled=True)
    eager = _rollout(model, compiled=False)
    return {"eager": eager, "compiled": compiled, "calls": generations.calls}


@pytest.mark.parametrize("inductor", [False, pytest.param(True, marks=pytest.mark.slow)])
def test_compiled_rollout_reads_no_output_of_an_earlier_graph_call(inductor):
    """Inductor's compile: about 15 s on 2 cores."""
    (out,) = run_distributed(_rollout_case, 1, inductor)
    eager, compiled = out["eager"], out["compiled"]
    assert out["calls"] > 2 * len(PROMPTS), "the draws and the steps must run as compiled calls"
    assert bool((eager.response_lengths > 1).any()), "some sample must run decode steps"
    assert torch.equal(compiled.tokens, eager.tokens)
    assert torch.equal(compiled.routes, eager.routes)
    # The compiled step's attention reads a bucketed span (masked positions): another summation order.
    scale = eager.rollout_logprobs.abs().max().item()
    torch.testing.assert_close(compiled.rollout_logprobs, eager.rollout_logprobs, rtol=0, atol=3e-5 * scale)


def _rollout_weights(model) -> dict[str, torch.Tensor]:
    """Within generation_dtype: every parameter (a copy in the rollout's dtype, or a view of a stack) and
    every stack, by name."""
    from megacispo.models.experts import StacksExpertWeights

    weights = dict(model.named_parameters())
    for name, module in model.named_modules():
        if isinstance(module, StacksExpertWeights):
            weights[f"{name} fc1 stack"], weights[f"{name} fc2 stack"] = module.stacked_weights()
    return weights


def _generation_weights_case() -> dict:
    _init()
    model = _model()
    seen = []
    for rollout in range(2):
        if rollout:
            with torch.no_grad():  # an optimizer step
                for param in model.parameters():
                    param.add_(0.5)
        with model.generation_dtype(torch.bfloat16, keep=True):
            weights = _rollout_weights(model)
            seen.append({name: (w.data_ptr(), w.float().clone()) for name, w in weights.items()})
    fresh = {name: param.detach().to(torch.bfloat16).float() for name, param in model.named_parameters()}
    kept = sum("_rollout_tensors" in module.__dict__ for module in model.modules())
    with model.generation_dtype(torch.bfloat16):  # an eager rollout's: nothing kept after it
        pass
    released = sum("_rollout_tensors" in module.__dict__ for module in model.modules())
    return {"seen": seen, "fresh": fresh, "kept": kept, "released": released}


def test_generation_dtype_fills_the_same_tensors_with_the_new_weights_when_kept():
    (out,) = run_distributed(_generation_weights_case, 1)
    assert out["kept"] > 0 and out["released"] == 0, "compiled rollouts keep their weights, eager ones free them"
    first, second = out["seen"]
    assert any("stack" in name for name in first), "the experts' stacks must be compared"
    moved = [name for name in first if first[name][0] != second[name][0]]
    assert not moved, f"new addresses in the second rollout: {moved}"
    for name, expected in out["fresh"].items():
        # The routers' and the LM head's copies are fp32: compared at bf16's precision, like the rest.
        torch.testing.assert_close(second[name][1], expected, rtol=2**-7, atol=0, msg=name)
        assert not torch.equal(first[name][1], second[name][1]), f"{name}: the second rollout's weights are stale"


def _two_models_case() -> dict:
    _init()
    models = {"first": _model().eval(), "second": _model().eval()}
    input_ids = torch.tensor([[5, 9, 11, 4], [0, 7, 8, 3]])
    mask = input_ids != PAD
    logits, graphs = {}, {}
    with GraphGenerations() as generations:
        for name, model in models.items():
            for compiled in (False, True):
                graphs_before = generations.graphs
                _, cache = model.prefill(input_ids, mask)
                steps = [model.decode_step(input_ids[:, step], cache, compiled=compiled)[0] for step in range(3)]
                logits[name, compiled] = torch.stack(steps)
                graphs[name, compiled] = generations.graphs - graphs_before
    return {"logits": logits, "graphs": graphs}


def test_compiled_step_of_a_second_model_is_its_own():
    (out,) = run_distributed(_two_models_case, 1)
    logits, graphs = out["logits"], out["graphs"]
    # The second model has the first's architecture and dtype: the first's graphs would pass its guards.
    assert graphs["first", True] > 0 and graphs["second", True] > 0, graphs
    scale = logits["second", False].abs().max().item()
    assert (logits["first", False] - logits["second", False]).abs().max() > 1e-2 * scale, "the weights must differ"
    for name in ("first", "second"):
        torch.testing.assert_close(logits[name, True], logits[name, False], rtol=0, atol=3e-5 * scale, msg=name)
