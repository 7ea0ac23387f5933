"""Failing well, catalog 3 (issue #56, section 4): compiled decode, the slots and the KV budget, on the tiny
model. Each row: the probe as a user gives it; what main did when this catalog started -> what it does
now. The rows are held here unless named; tests/slow/test_decode_catalog.py holds a compiled function past
the recompile limit and the compiled rollouts with inductor's compile. The compiled rollouts here run
dynamo's graphs eagerly (``GraphGenerations``): dynamo decides what compiles, inductor only takes longer.

- D1 compiled rollouts of many shapes (13 prompts of 2-37 tokens; 5, 1, 16 and 7 slots; per-sample
  limits), then greedy ones (an evaluation): traceback at the first greedy rollout, the draw past
  torch._dynamo's recompile_limit (8), FailOnRecompileLimitHit (fullgraph) -> at most 6 graphs in the
  first rollout (the lean step up to 4, the draw 2), 2 in the first greedy one (its own draw: one row
  and more), none after; with inductor (slow tier) the lean step's 3 in all (it was 8, at the limit)
- D2 the same, as said: nothing of ours (torch's recompile lines only under TORCH_LOGS) -> one warning
  line per rollout that compiled (the count, the functions, the latest reason), none for the others
- D3 a compiled function past torch._dynamo.config.recompile_limit (set to 2; slow tier): torch's 5-line
  warning, the rest eager -> the same samples, eager past the limit, and one line of ours naming the
  limit and the fix
- D4 rollout.max_running above a rank's samples (16 for 13), 1, or 7 (not a power of two), compiled:
  correct (min(max_running, samples) slots) -> same, the samples equal to the eager rollout's
- D5 rollout.host_check_every = 1000 with max_new_tokens = 6 in a lockstep group (EP): wrong success,
  3999 decode steps for 23 (idle rows stepped until the look) -> the look every min(host_check_every,
  max_new_tokens) steps: as many steps as host_check_every = 1
- D6 a prompt of 30 tokens + 10 new in a context of 32, given to generate: wrong success, 40 positions
  decoded past model.max_position_embeddings -> clean error naming the prompt, the 40 positions and
  model.max_position_embeddings = 32
- D7 a prompt exactly at the context limit (22 + 10 = 32): decodes -> same
- D8 data.max_prompt_tokens + rollout.max_new_tokens beyond model.max_position_embeddings, or
  max_new_tokens at the context: clean error at start-up (tests/unit/test_config.py) -> same
- D9 rollout.max_cache_gib below one slot: clean error, but "lower rollout.max_running (about 0 fit)",
  a fix that cannot work -> clean error: the GiB one slot needs, raise max_cache_gib to at least that
- D10 rollout.max_cache_gib that holds fewer slots than rollout.max_running: clean error, "about N
  fit" -> clean error: lower rollout.max_running to N (exact) or raise the cap to X GiB. Refused, not
  lowered: the slots set the rollout's throughput, which a week-long run plans on
- D11 rollout.compile_decode with pipeline parallel size 2: clean error at start-up
  (tests/unit/test_config.py) -> same
- D12 rollout.compile_decode on a CPU without a C++ compiler: traceback, InvalidCxxCompiler from inductor
  at the first compiled step -> clean error at start-up naming rollout.compile_decode, the compilers
  tried and the fix
- D13 rollout.compile_decode with rollout.dtype = bfloat16 on a CPU: compiles (23 s), its log-probs as
  close to fp32's as eager bf16's (slow tier) -> same
- D14 rollout.max_running = -1: clean error -> same
"""

from __future__ import annotations

import dataclasses
import logging

import pytest
import torch

from megacispo.testing.harness import run_distributed
from tests.multiprocess.test_decode_graphs import GraphGenerations

EOS, PAD = 2, 0
LENGTHS = (2, 37, 5, 11, 3, 23, 8, 14, 2, 30, 6, 19, 4)
# (prompts, max_running, temperature): odd slot counts, a batch of one, more slots than samples, then greedy.
ROLLOUTS = ((13, 5, 1.0), (13, 1, 1.0), (13, 16, 1.0), (9, 7, 1.0), (4, 4, 0.0), (11, 6, 0.0))


class _Lines(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def _model(**fields):
    from megacispo.models.config import model_config, transformer_config
    from megacispo.models.model import HybridModel
    from megacispo.parallel.layout import ParallelConfig

    config = dataclasses.replace(model_config("tiny"), **fields)
    return HybridModel(config, transformer_config(config, ParallelConfig(), init_method_std=0.3))


def _rollout(model, prompts, slots, temperature, compiled, max_new_tokens=20):
    """Per-sample limits of 1 to max_new_tokens: the slots free up at different steps."""
    from megacispo.rollout.config import RolloutConfig
    from megacispo.rollout.generate import generate, sample_keys

    config = RolloutConfig(max_new_tokens=max_new_tokens, temperature=temperature, dtype="float32",
                           compile_decode=compiled, max_running=slots)
    keys = sample_keys((3, len(prompts)), range(len(prompts)), 1, device="cpu")
    return generate(model, prompts, config, stop_ids=[EOS], pad_id=PAD, keys=keys,
                    response_limits=[max_new_tokens - (i * 7) % max_new_tokens for i in range(len(prompts))])


def _graphs_by_function(metrics_before: list) -> dict[str, int]:
    seen = {id(m) for m in metrics_before}
    counts: dict[str, int] = {}
    for metric in torch._dynamo.utils.get_compilation_metrics():
        if id(metric) not in seen and metric.co_name and not metric.fail_reason:
            counts[metric.co_name] = counts.get(metric.co_name, 0) + 1
    return counts


def _catalog_case() -> dict:
    from megacispo.parallel.layout import ParallelConfig, init_distributed

    init_distributed(ParallelConfig(), seed=5)
    lines = _Lines()
    logging.getLogger("megacispo.rollout.generate").addHandler(lines)
    generator = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, 60, (n,), generator=generator).tolist() for n in LENGTHS]
    model = _model()
    out = {"rollouts": [], "tokens_equal": []}
    with GraphGenerations():
        for n, slots, temperature in ROLLOUTS:
            before, lines_before = torch._dynamo.utils.get_compilation_metrics(), len(lines.lines)
            compiled = _rollout(model, prompts[:n], slots, temperature, compiled=True)
            out["rollouts"].append((_graphs_by_function(before), lines.lines[lines_before:]))
            eager = _rollout(model, prompts[:n], slots, temperature, compiled=False)
            out["tokens_equal"].append(torch.equal(compiled.tokens, eager.tokens))
    out["steps"] = _lockstep_steps(model)
    out["context"] = _context_limit()
    return out


def _lockstep_steps(model) -> dict[int, int]:
    """Decode steps of 8 samples of at most 6 tokens in 2 slots, in a lockstep group, by host_check_every."""
    import torch.distributed as dist

    from megacispo.rollout.config import RolloutConfig
    from megacispo.rollout.generate import generate, sample_keys

    steps = {}
    decode_step = model.decode_step

    def counted(*args, **kwargs):
        steps[every] += 1
        return decode_step(*args, **kwargs)

    model.decode_step = counted
    for every in (1, 1000):
        steps[every] = 0
        config = RolloutConfig(max_new_tokens=6, dtype="float32", max_running=2, host_check_every=every)
        generate(model, [[5, 6, 7]] * 8, config, stop_ids=[EOS], pad_id=PAD, keys=sample_keys((1,), range(8), 1,
                 device="cpu"), lockstep_group=dist.group.WORLD)
    del model.decode_step
    return steps


def _context_limit() -> dict:
    """A context of 32: a prompt of 22 + 10 new tokens fits exactly; 30 + 10 does not."""
    model = _model(max_position_embeddings=32)
    fits = _rollout(model, [[5] * 22, [6, 7]], 2, 1.0, compiled=False, max_new_tokens=10)
    try:
        _rollout(model, [[5] * 30, [6, 7]], 2, 1.0, compiled=False, max_new_tokens=10)
        past = "no error"
    except ValueError as error:
        past = str(error)
    return {"fits": int((fits.prompt_lengths + fits.response_lengths).max()), "past": past}


@pytest.fixture(scope="module")
def catalog() -> dict:
    (out,) = run_distributed(_catalog_case, 1)
    return out


def test_compiled_rollouts_of_many_shapes_compile_a_bounded_set_once(catalog):
    """D1, D2, D4: the first rollout compiles the lean step and the draw; a new sampling setting (greedy)
    compiles its draw, one row and more; no later rollout compiles, whatever its slots and prompts."""
    graphs = [counts for counts, _ in catalog["rollouts"]]
    first, greedy = graphs[0], graphs[ROLLOUTS.index((4, 4, 0.0))]
    assert first.get("draw_tokens", 0) in (1, 2) and first.get("_lean_stage", 0) <= 4, first
    assert greedy == {"draw_tokens": 2}, greedy
    later = [counts for index, counts in enumerate(graphs) if index not in (0, ROLLOUTS.index((4, 4, 0.0)))]
    assert not any(later), graphs
    for (counts, lines) in catalog["rollouts"]:
        assert len(lines) == (1 if counts else 0), lines
        if counts:
            assert lines[0].startswith("rollout.compile_decode: ") and "latest reason" in lines[0], lines
    assert all(catalog["tokens_equal"]), catalog["tokens_equal"]


def test_a_lockstep_group_looks_within_max_new_tokens(catalog):
    """D5: host_check_every far above max_new_tokens steps no more than looking after every step."""
    steps = catalog["steps"]
    assert steps[1000] == steps[1], steps


def test_a_generation_past_the_context_is_refused_and_one_at_it_decodes(catalog):
    """D6, D7."""
    assert catalog["context"]["fits"] == 32
    assert "prompt 0 has 30 tokens and may get 10 more: 40 positions, past model.max_position_embeddings = 32" \
        in catalog["context"]["past"], catalog["context"]["past"]


def _check(**rollout):
    from megacispo.config import Config
    from megacispo.rollout.config import RolloutConfig
    from megacispo.startup import check_config
    from megacispo.training.config import TrainConfig

    check_config(Config(rollout=RolloutConfig(max_new_tokens=512, **rollout), train=TrainConfig(run_dir="run")))


def test_a_negative_slot_count_is_refused():
    """D14."""
    from megacispo.startup import run_config

    with pytest.raises(ValueError, match=r"rollout.max_running = -1: it must be >= 0 \(0: all of a rank's samples"):
        run_config(None, ["rollout.max_running=-1"])


def test_a_cache_cap_below_one_slot_names_the_size_one_slot_needs():
    """D9."""
    with pytest.raises(ValueError, match=r"rollout.max_cache_gib = 1e-05 is below the .* GiB of rollout cache one "
                                         r"slot needs .*raise rollout.max_cache_gib to at least"):
        _check(max_running=8, max_cache_gib=1e-5)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks a machine without a GPU")
def test_a_cache_cap_checked_without_a_gpu_names_the_dtype_it_assumed():
    """A GPU config's dry run on a CPU login node: rollout.dtype auto sizes the cache in float32 here, twice
    the GPUs' bfloat16, and the error says so; with rollout.dtype = bfloat16 the same cap holds about twice
    the slots (the K/V halve; the lightning states' share of a slot stays)."""
    with pytest.raises(ValueError, match=r"in float32 \(rollout.dtype auto, on this machine without a GPU; GPUs "
                                         r"generate in bfloat16: set rollout.dtype=bfloat16") as error:
        _check(max_running=64, max_cache_gib=0.05)
    holds = int(str(error.value).split("lower rollout.max_running to ")[1].split()[0])
    _check(max_running=holds * 3 // 2, max_cache_gib=0.05, dtype="bfloat16")


def test_a_cache_cap_for_fewer_slots_is_refused_with_the_slots_it_holds():
    """D10: refused, not lowered, with the exact number of slots the cap holds (the bytes grow by slot)."""
    with pytest.raises(ValueError, match=r"rollout.max_running = 64 slots need .* GiB .* over rollout.max_cache_gib "
                                         r"= 0.05: lower rollout.max_running to (\d+) ") as error:
        _check(max_running=64, max_cache_gib=0.05)
    holds = int(str(error.value).split("lower rollout.max_running to ")[1].split()[0])
    _check(max_running=holds, max_cache_gib=0.05)
    with pytest.raises(ValueError, match=f"rollout.max_running = {holds + 1} slots"):
        _check(max_running=holds + 1, max_cache_gib=0.05)
    assert 0 < holds < 64


@pytest.mark.skipif(torch.cuda.is_available(), reason="the compiler is checked where the CPU back-end generates")
def test_compile_decode_on_a_cpu_without_a_compiler_stops_at_start_up(monkeypatch):
    """D12."""
    from torch._inductor import config as inductor_config

    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")
    _check(compile_decode=True, max_running=8)  # this machine's g++
    # inductor's own patch: monkeypatch would undo it by deleting the entry (cpp is a class of the config module).
    with inductor_config.patch({"cpp.cxx": ("/nonexistent/g++",)}), pytest.raises(
            ValueError, match=r"rollout.compile_decode = true on a CPU .* none of \['/nonexistent/g\+\+'\] "
                              r"runs here: install g\+\+ .*or set rollout.compile_decode=false"):
        _check(compile_decode=True, max_running=8)
