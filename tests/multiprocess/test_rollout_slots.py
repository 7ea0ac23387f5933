"""The slot engine's samples do not depend on the slots: the tiny model in fp64 samples (temperature 1,
top-p 0.9) the same tokens and log-probs with rollout.max_running = 1, 3 and 0 (all at once), at
TP = 1 and at EP = 2 (two gloo processes, each decoding its data-parallel share in lockstep; the
same samples as TP = 1's, since each sample's random stream follows its place in the global batch).
Prompts of different lengths, one longer than the tiny model's lightning block of 16, and per-sample
length limits make the slots free up at different steps. Greedy slot rollouts equal transformers'
generate on the same weights.
"""

from __future__ import annotations

import pytest
import torch

from megacispo.models.config import M1, M2
from megacispo.testing.harness import run_distributed

PROMPT_LENGTHS = (3, 9, 20, 5, 11, 2)
LIMITS = (12, 3, 7, 1, 10, 5)
SLOTS = (1, 3, 0)
EOS, PAD = 2, 0


def _prompts(vocab_size: int) -> list[list[int]]:
    generator = torch.Generator().manual_seed(5)
    # Token ids from 3 up: no prompt token is EOS or PAD.
    return [torch.randint(3, vocab_size, (length,), generator=generator).tolist() for length in PROMPT_LENGTHS]


def _sampled_rollouts(layout: dict, load_dir: str | None = None, save_dir: str | None = None) -> dict:
    """{max_running: {row: (tokens, log-probs)}} of this rank's rows (its data-parallel share)."""
    from megatron.core import dist_checkpointing, parallel_state

    from megacispo.models.config import model_config, transformer_config
    from megacispo.models.model import HybridModel
    from megacispo.parallel.layout import ParallelConfig, init_distributed
    from megacispo.rollout.config import RolloutConfig
    from megacispo.rollout.generate import generate, sample_keys

    model_cfg = model_config("tiny")
    parallel = ParallelConfig(**layout)
    init_distributed(parallel, seed=7)
    model = HybridModel(model_cfg, transformer_config(model_cfg, parallel, init_method_std=0.3))
    model.double()
    model.config.moe_router_dtype = "fp64"
    if load_dir is not None:
        model.load_state_dict(dist_checkpointing.load(model.sharded_state_dict(), load_dir))
    if save_dir is not None:
        dist_checkpointing.save(model.sharded_state_dict(), save_dir)
    dp_rank = parallel_state.get_data_parallel_rank()
    dp_size = parallel_state.get_data_parallel_world_size()
    share = len(PROMPT_LENGTHS) // dp_size
    rows = list(range(dp_rank * share, (dp_rank + 1) * share))
    prompts = _prompts(model_cfg.vocab_size)
    keys = sample_keys((11, 0), rows, 1, device="cpu")
    results = {}
    for slots in SLOTS:
        config = RolloutConfig(max_new_tokens=max(LIMITS), temperature=1.0, top_p=0.9, max_running=slots)
        samples = generate(model, [prompts[row] for row in rows], config, stop_ids=[EOS], pad_id=PAD, keys=keys,
                           response_limits=[LIMITS[row] for row in rows],
                           lockstep_group=parallel_state.get_data_parallel_group())
        lengths = samples.prompt_lengths + samples.response_lengths
        results[slots] = {
            row: (samples.tokens[i, :lengths[i]], samples.rollout_logprobs[i, :lengths[i] - 1])
            for i, row in enumerate(rows)
        }
    return results


def _assert_same(actual: dict, expected: dict, what: str) -> None:
    for row, (tokens, logprobs) in actual.items():
        assert torch.equal(tokens, expected[row][0]), f"{what}: prompt {row}: {tokens} != {expected[row][0]}"
        assert logprobs.dtype == torch.float64
        torch.testing.assert_close(logprobs, expected[row][1], rtol=0, atol=1e-10)


@pytest.fixture(scope="module")
def single_process(tmp_path_factory) -> tuple[str, dict]:
    checkpoint = str(tmp_path_factory.mktemp("slot_weights"))
    (rollouts,) = run_distributed(_sampled_rollouts, 1, {}, save_dir=checkpoint)
    return checkpoint, rollouts


def test_samples_do_not_depend_on_the_slots(single_process):
    _, rollouts = single_process
    for row, limit in enumerate(LIMITS):
        tokens, _ = rollouts[0][row]
        response = len(tokens) - PROMPT_LENGTHS[row]
        assert 1 <= response <= limit
        assert response == limit or tokens[-1] == EOS
    assert len({len(tokens) - PROMPT_LENGTHS[row] for row, (tokens, _) in rollouts[0].items()}) > 2
    for slots in SLOTS[:-1]:
        _assert_same(rollouts[slots], rollouts[0], f"max_running {slots}")


def test_expert_parallel_lockstep_gives_the_same_samples(single_process):
    checkpoint, expected = single_process
    results = run_distributed(_sampled_rollouts, 2, {"expert_model_parallel_size": 2}, load_dir=checkpoint)
    for rank, rank_rollouts in enumerate(results):
        for slots in SLOTS:
            _assert_same(rank_rollouts[slots], expected[0], f"EP 2, rank {rank}, max_running {slots}")


def _greedy_against_transformers(family: str) -> dict:
    """Greedy slot rollouts (2 slots, per-sample lengths, no stop ids) of an HF MiniMax model's
    weights (M1, or M2: the lean step's QK-norm, pre-norm residual and biased sigmoid routing), and
    transformers' generate of each prompt alone; fp32 (transformers' grouped expert matmul takes no
    fp64), with large random weights: greedy choices far from ties."""
    from megacispo.models import hf_names
    from megacispo.models.config import transformer_config
    from megacispo.models.model import HybridModel
    from megacispo.parallel.layout import ParallelConfig, init_distributed
    from megacispo.rollout.config import RolloutConfig
    from megacispo.rollout.generate import generate, sample_keys
    from megacispo.testing import hf_models

    hf_model = hf_models.hf_model(family)
    hf_config = hf_model.config
    config = hf_names.config_from_hf(hf_config)
    init_distributed(ParallelConfig(), seed=0)
    model = HybridModel(config, transformer_config(config, ParallelConfig()))
    model.load_state_dict(hf_models.full_to_single_process(hf_models.hf_to_full(hf_model.state_dict(), config)),
                          strict=False)
    prompts = _prompts(hf_config.vocab_size)
    rollout = RolloutConfig(max_new_tokens=max(LIMITS), temperature=0.0, max_running=2)
    keys = sample_keys((0,), range(len(prompts)), 1, device="cpu")
    samples = generate(model, prompts, rollout, stop_ids=[], pad_id=PAD, keys=keys, response_limits=list(LIMITS))
    ours, theirs = [], []
    for row, (prompt, limit) in enumerate(zip(prompts, LIMITS)):
        start = len(prompt)
        ours.append(samples.tokens[row, start:start + int(samples.response_lengths[row])])
        input_ids = torch.tensor([prompt])
        with torch.no_grad():
            output = hf_model.generate(input_ids, attention_mask=torch.ones_like(input_ids), max_new_tokens=limit,
                                       min_new_tokens=limit, do_sample=False, pad_token_id=PAD)
        theirs.append(output[0, start:])
    return {"ours": ours, "theirs": theirs}


@pytest.mark.parametrize("family", [M1, M2])
def test_greedy_slot_rollouts_equal_transformers_generate(family):
    pytest.importorskip("transformers")
    (result,) = run_distributed(_greedy_against_transformers, 1, family)
    for row, (ours, theirs) in enumerate(zip(result["ours"], result["theirs"])):
        assert len(ours) == LIMITS[row]
        assert torch.equal(ours, theirs), f"prompt {row}: {ours} != transformers' {theirs}"
