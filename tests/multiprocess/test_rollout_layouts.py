"""Greedy rollouts are layout-independent: the same weights decoded by the rollout path at TP = 2 with
sequence parallelism, EP = 2 (each data-parallel rank decoding its own prompts, in lockstep: the
prefills through the experts' all-to-all, the decode steps through the lean step's gather of the
group's tokens) and PP = 2 give the tokens of the single-process run, and log-probs equal up to
fp32 round-off (amplified by the large init: 1e-4). The single-process run decodes all its prompts at
once; the layouts decode them one slot at a time (rollout.max_running = 1: a refill prefill after every
finished sample, in lockstep, with per-sample length limits)."""

from __future__ import annotations

import pytest
import torch

from megacispo.testing.harness import run_distributed

# Prompts of several lengths (one across the tiny model's lightning block of 16), longer than
# max_new_tokens so that a layout's error would have many tokens in which to show.
PROMPT_LENGTHS = (3, 9, 17, 5)
MAX_NEW_TOKENS = 12
LIMITS = (12, 4, 9, 12)
EOS, PAD = 2, 0
LAYOUTS = {
    "tp2_sp": {"tensor_model_parallel_size": 2, "sequence_parallel": True},
    "ep2": {"expert_model_parallel_size": 2},
    "pp2": {"pipeline_model_parallel_size": 2},
}


def _prompts(vocab_size: int) -> list[list[int]]:
    generator = torch.Generator().manual_seed(5)
    # Token ids from 3 up: no prompt token is EOS or PAD.
    return [torch.randint(3, vocab_size, (length,), generator=generator).tolist() for length in PROMPT_LENGTHS]


def _greedy_rollouts(layout: dict, load_dir: str | None = None, save_dir: str | None = None, slots: int = 0) -> dict:
    from megatron.core import dist_checkpointing, parallel_state

    from megacispo.models.config import model_config, transformer_config
    from megacispo.models.model import HybridModel
    from megacispo.parallel.layout import ParallelConfig, init_distributed
    from megacispo.rollout.config import RolloutConfig
    from megacispo.rollout.generate import generate, sample_keys

    model_cfg = model_config("tiny")
    parallel = ParallelConfig(**layout)
    init_distributed(parallel, seed=7)
    # A large init std: logits O(1), so that greedy choices are far from ties.
    model = HybridModel(model_cfg, transformer_config(model_cfg, parallel, init_method_std=0.3),
                        pre_process=parallel_state.is_pipeline_first_stage(),
                        post_process=parallel_state.is_pipeline_last_stage())
    if load_dir is not None:
        model.load_state_dict(dist_checkpointing.load(model.sharded_state_dict(), load_dir))
    if save_dir is not None:
        dist_checkpointing.save(model.sharded_state_dict(), save_dir)
    dp_rank = parallel_state.get_data_parallel_rank()
    dp_size = parallel_state.get_data_parallel_world_size()
    rows = list(range(dp_rank, len(PROMPT_LENGTHS), dp_size))
    prompts = _prompts(model_cfg.vocab_size)
    config = RolloutConfig(max_new_tokens=MAX_NEW_TOKENS, temperature=0.0, max_running=slots)
    samples = generate(model, [prompts[row] for row in rows], config, stop_ids=[EOS], pad_id=PAD,
                       keys=sample_keys((0,), rows, 1, device="cpu"), response_limits=[LIMITS[row] for row in rows],
                       lockstep_group=parallel_state.get_data_parallel_group())
    # Trimmed to prompt + response: the batch's padding width depends on which prompts share it.
    lengths = samples.prompt_lengths + samples.response_lengths
    return {row: (samples.tokens[i, :lengths[i]], samples.rollout_logprobs[i, :lengths[i] - 1]) for i, row in enumerate(rows)}


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> tuple[str, dict]:
    checkpoint = str(tmp_path_factory.mktemp("greedy_weights"))
    (rollouts,) = run_distributed(_greedy_rollouts, 1, {}, save_dir=checkpoint)
    return checkpoint, rollouts


def test_reference_generates_full_responses(reference):
    _, rollouts = reference
    for row, (tokens, _) in rollouts.items():
        assert len(tokens) > PROMPT_LENGTHS[row] + 1, f"prompt {row} ended at once: nothing to compare"


@pytest.mark.parametrize("name", sorted(LAYOUTS))
def test_greedy_tokens_equal_single_process(reference, name):
    checkpoint, expected = reference
    results = run_distributed(_greedy_rollouts, 2, LAYOUTS[name], load_dir=checkpoint, slots=1)
    for rank_rollouts in results:
        for row, (tokens, logprobs) in rank_rollouts.items():
            assert torch.equal(tokens, expected[row][0]), f"{name}: prompt {row}: {tokens} != {expected[row][0]}"
            torch.testing.assert_close(logprobs, expected[row][1], rtol=1e-4, atol=1e-4)
