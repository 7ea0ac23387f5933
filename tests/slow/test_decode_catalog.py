"""Failing well, catalog 3 (issue #56, section 4), the rows that compile for long: the table and the fast
rows are in tests/multiprocess/test_decode_catalog.py.

D1 with inductor's compile (what a CPU run compiles; on CUDA the same graphs run as CUDA graphs): a
compiled rollout of many shapes, then others of other shapes compile nothing and sample what the eager
rollout samples. D3: a compiled function past torch._dynamo.config.recompile_limit runs eagerly from
there on, the same samples, said in one line of ours. D13: rollout.compile_decode with rollout.dtype =
bfloat16 on a CPU compiles, and its greedy log-probs are as close to fp32's as the eager bf16 rollout's
(inductor's bf16 sums differ from eager's: a token near a tie may differ, as between bf16 and fp32).
"""

from __future__ import annotations

import logging

import torch

from megacispo.testing.harness import run_distributed
from tests.multiprocess.test_decode_catalog import LENGTHS, _graphs_by_function, _Lines, _model, _rollout
from tests.multiprocess.test_decode_graphs import GraphGenerations

# (prompts, max_running): new row counts and prompt mixes, one row and more slots than samples among them.
INDUCTOR_ROLLOUTS = ((13, 5), (9, 3), (13, 16), (7, 2), (13, 1), (11, 6))


def _prompts() -> list[list[int]]:
    generator = torch.Generator().manual_seed(3)
    return [torch.randint(3, 60, (n,), generator=generator).tolist() for n in LENGTHS]


def _init() -> None:
    from megacispo.parallel.layout import ParallelConfig, init_distributed

    init_distributed(ParallelConfig(), seed=5)


def _inductor_case() -> dict:
    _init()
    prompts, model = _prompts(), _model()
    graphs, equal = [], []
    for n, slots in INDUCTOR_ROLLOUTS:
        before = torch._dynamo.utils.get_compilation_metrics()
        compiled = _rollout(model, prompts[:n], slots, 1.0, compiled=True)
        graphs.append(_graphs_by_function(before))
        equal.append(torch.equal(compiled.tokens, _rollout(model, prompts[:n], slots, 1.0, compiled=False).tokens))
    return {"graphs": graphs, "equal": equal}


def test_inductor_compiles_a_rollouts_shapes_once():
    """About 40 s on 2 cores (inductor compiles the lean step and the draw). The lean step compiles 3
    graphs in all here (8 when a bucketed span could reach a buffer's capacity and specialize on it:
    InferenceCache.step_span stops one short), within torch._dynamo.config.recompile_limit (8), and none
    after the first rollout."""
    (out,) = run_distributed(_inductor_case, 1, timeout_s=600)
    graphs = out["graphs"]
    total = {name: sum(counts.get(name, 0) for counts in graphs) for name in ("_lean_stage", "draw_tokens")}
    assert total["_lean_stage"] <= 4 and total["draw_tokens"] <= 2, graphs
    assert not any(graphs[1:]), graphs
    assert all(out["equal"]), out["equal"]


def _limit_case() -> dict:
    _init()
    lines = _Lines()
    logging.getLogger("megacispo.rollout.generate").addHandler(lines)
    prompts, model = _prompts(), _model()
    with GraphGenerations(), torch._dynamo.config.patch(recompile_limit=2):
        compiled = _rollout(model, prompts, 5, 1.0, compiled=True)
    eager = _rollout(model, prompts, 5, 1.0, compiled=False)
    return {"lines": lines.lines, "equal": torch.equal(compiled.tokens, eager.tokens)}


def test_a_recompile_limit_reached_is_said_once_and_the_rollout_goes_on():
    """D3: the lean step compiles 4 graphs in a rollout of these shapes, 2 past the limit."""
    (out,) = run_distributed(_limit_case, 1)
    limit_lines = [line for line in out["lines"] if "recompile_limit = 2" in line]
    assert len(limit_lines) == 1, out["lines"]
    assert "rollout.compile_decode=false" in limit_lines[0]
    assert out["equal"]


def _bf16_case() -> dict:
    from megacispo.rollout.config import RolloutConfig
    from megacispo.rollout.generate import generate, sample_keys

    _init()
    prompts, model = _prompts()[:4], _model()
    runs = {}
    for name, dtype, compiled in (("compiled", "bfloat16", True), ("eager", "bfloat16", False),
                                  ("fp32", "float32", False)):
        config = RolloutConfig(max_new_tokens=8, temperature=0.0, dtype=dtype, compile_decode=compiled, max_running=3)
        keys = sample_keys((3,), range(len(prompts)), 1, device="cpu")
        runs[name] = generate(model, prompts, config, stop_ids=[2], pad_id=0, keys=keys)
    return {name: _distance_to(runs["fp32"], runs[name]) for name in ("compiled", "eager")}


def _distance_to(reference, samples) -> float:
    """The largest log-prob difference from ``reference`` over each row's tokens before the first that differs."""
    distance = 0.0
    for row, prompt in enumerate(samples.prompt_lengths.tolist()):
        width = min(samples.tokens.shape[1], reference.tokens.shape[1])
        same = (samples.tokens[row, prompt:width] == reference.tokens[row, prompt:width]).long().cumprod(0)
        agreed = int(same.sum())
        if agreed:
            logprobs = samples.rollout_logprobs[row, prompt - 1:prompt - 1 + agreed]
            expected = reference.rollout_logprobs[row, prompt - 1:prompt - 1 + agreed]
            distance = max(distance, (logprobs - expected).abs().max().item())
    return distance


def test_a_compiled_bf16_rollout_on_a_cpu_is_as_close_to_fp32_as_an_eager_one():
    """D13: about 25 s on 2 cores."""
    (out,) = run_distributed(_bf16_case, 1, timeout_s=600)
    assert 0 < out["compiled"] <= 2 * out["eager"], out
