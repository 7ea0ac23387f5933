"""The lean decode step (HybridModel.decode_step without Megatron's TransformerBlock, parallel
linears and router, through each module's ``step``) computes what the Megatron path computes, on the
same model: teacher-forced decode steps after a left-padded prefill give the same logits at every
step (within 3e-5 of the logits' scale in fp32, 1e-12 in fp64: batches of up to 16 rows take their
matmuls in another summation order, few_rows_linear), for a padded batch (the MoE's grouped path, masked attention, a
``cache.select`` midway) and a single sequence (the one-token MoE path, no mask); greedy rollouts
through megacispo.rollout.generate give the same tokens and log-probs. The lean path is really
taken: TransformerBlock.forward is not called during its decode steps. Runs in a gloo world of one;
tests/test_rollout_layouts.py covers the multi-process layouts (TP with sequence parallelism: the
Megatron path; EP = 2: the MoE's dispatcher; PP = 2: the lean path stage by stage).
"""

from __future__ import annotations

import pytest
import torch

from megacispo.parallel.multiprocess import run_distributed

# Odd lengths, one across the tiny model's lightning block of 16.
PROMPT_LENGTHS = (7, 19, 3)
NUM_STEPS = 20
KEEP_AFTER = 12  # after this many steps the padded batch keeps sequences [2, 0] (cache.select)
# Relative to the largest logit: fp32 round-off amplified over 8 layers and 20 steps.
TOLERANCE = {"float32": 3e-5, "float64": 1e-12}
GREEDY_NEW_TOKENS = 16
EOS, PAD = 2, 0


def _build_model(dtype: torch.dtype):
    from megacispo.models.config import model_config, transformer_config
    from megacispo.models.model import HybridModel
    from megacispo.parallel.layout import ParallelConfig, init_distributed

    model_cfg = model_config("tiny")
    init_distributed(ParallelConfig(), seed=21)
    # A large init std: logits O(1), routing and attention far from uniform, greedy choices far from ties.
    model = HybridModel(model_cfg, transformer_config(model_cfg, ParallelConfig(), init_method_std=0.3))
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


def _teacher_forced(model, prompts: list[torch.Tensor], steps: torch.Tensor, keep_after: int | None) -> dict:
    """Prefill, then the tokens ``steps`` [b, NUM_STEPS] one step at a time, on both paths.
    Returns the largest logit difference and the logit scale, and how often each path ran
    TransformerBlock.forward during its decode steps."""
    counter = _CallCounter(model.decoder)
    input_ids, mask = _left_pad(prompts)
    caches = {}
    for lean in (True, False):
        _, caches[lean] = model.prefill(input_ids, mask)
    rows = torch.arange(len(prompts))
    error = scale = 0.0
    block_calls = {True: 0, False: 0}
    for step in range(NUM_STEPS):
        if step == keep_after:
            rows = torch.tensor([2, 0])
            caches = {lean: cache.select(rows) for lean, cache in caches.items()}
        logits = {}
        for lean in (True, False):
            model.lean_decode = lean
            before = counter.calls
            logits[lean], caches[lean] = model.decode_step(steps[rows, step], caches[lean])
            block_calls[lean] += counter.calls - before
        error = max(error, (logits[True] - logits[False]).abs().max().item())
        scale = max(scale, logits[False].abs().max().item())
    model.lean_decode = True
    return {"error": error, "scale": scale, "block_calls": block_calls}


def _greedy(model, prompts: list[torch.Tensor]) -> dict:
    from megacispo.config import RolloutConfig
    from megacispo.rollout import generate

    results = {}
    for lean in (True, False):
        model.lean_decode = lean
        samples = generate(
            model, [p.tolist() for p in prompts], RolloutConfig(max_new_tokens=GREEDY_NEW_TOKENS, temperature=0.0),
            eos_id=EOS, pad_id=PAD, generator=torch.Generator().manual_seed(0),
        )
        results[lean] = (samples.tokens, samples.rollout_logprobs, samples.response_lengths)
    model.lean_decode = True
    return results


def _compare_paths(dtype_name: str) -> dict:
    dtype = getattr(torch, dtype_name)
    model = _build_model(dtype)
    generator = torch.Generator().manual_seed(4)
    # Token ids from 3 up: no prompt token is EOS or PAD.
    prompts = [torch.randint(3, model.vocab_size, (length,), generator=generator) for length in PROMPT_LENGTHS]
    steps = torch.randint(0, model.vocab_size, (len(prompts), NUM_STEPS), generator=generator)
    return {
        "padded_batch": _teacher_forced(model, prompts, steps, KEEP_AFTER),
        "single_sequence": _teacher_forced(model, prompts[1:2], steps[1:2], None),
        "greedy": _greedy(model, prompts) if dtype == torch.float32 else None,
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
    assert outcome["error"] <= TOLERANCE[dtype_name] * outcome["scale"], (
        f"{case} {dtype_name}: max abs difference {outcome['error']:.2e} at logits up to {outcome['scale']:.1f}"
    )


@pytest.mark.parametrize("case", ["padded_batch", "single_sequence"])
def test_lean_step_skips_transformer_block(compared, case):
    _, result = compared
    calls = result[case]["block_calls"]
    assert calls[True] == 0, f"the lean path called TransformerBlock.forward {calls[True]} times"
    assert calls[False] == NUM_STEPS, "the Megatron path runs TransformerBlock.forward once per step"


def test_greedy_rollout_equal_on_both_paths(compared):
    dtype_name, result = compared
    if result["greedy"] is None:
        pytest.skip("greedy rollouts are compared in the fp32 model")
    lean_tokens, lean_logprobs, lean_lengths = result["greedy"][True]
    tokens, logprobs, lengths = result["greedy"][False]
    assert torch.equal(lean_lengths, lengths) and torch.equal(lean_tokens, tokens)
    assert bool((lengths > 1).any()), "some response must run decode steps"
    torch.testing.assert_close(lean_logprobs, logprobs, rtol=0, atol=TOLERANCE[dtype_name])
