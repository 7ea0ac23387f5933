"""Multi-turn rollouts in the slot engine: an environment's replies are prefilled into a sample's slot
after its turns, and the sequence the trainer gets is exactly the token stream that was sampled and fed.

The tiny model in fp64 talks to ``CountingEnv``, which answers each turn with a reply whose length
depends on the sample and the turn, after a delay that differs by sample (so rows wait different
numbers of decode steps), and ends the conversation after its third turn. Checked:

- the samples (tokens, log-probs, loss mask) are the same at max_running 1, 3 and all, and with the
  environment answering at once or late: a waiting row's state is held exactly while others decode;
- the loss mask is 1 on exactly the sampled tokens (every turn's) and 0 on the replies, which appear
  in the sequence exactly as the environment's rendered ids;
- the log-probs the model recomputes over the whole sequence (a training forward, fp64) equal the
  rollout's at every sampled token; the experts the rollout recorded for every fed token (replies
  included) are the training forward's own;
- at EP = 2 (two gloo processes in lockstep, feeding replies at different steps) the samples equal
  the single process's.
"""

from __future__ import annotations

import pytest
import torch

from megacispo.data.prompts import PromptRecord
from megacispo.testing.conversations import PAD, CharTokenizer, CountingEnv
from megacispo.testing.harness import run_distributed

PROMPT_LENGTHS = (3, 9, 20, 5, 11, 2)
MAX_NEW = 48


def _model(layout: dict):
    from megacispo.models.config import model_config, transformer_config
    from megacispo.models.model import HybridModel
    from megacispo.parallel.layout import ParallelConfig, init_distributed

    model_cfg = model_config("tiny")
    init_distributed(ParallelConfig(**layout), seed=7)
    model = HybridModel(model_cfg, transformer_config(model_cfg, ParallelConfig(**layout), init_method_std=0.3))
    model.double()
    model.config.moe_router_dtype = "fp64"
    return model


def _rollouts(layout: dict, runs: list[tuple[int, float]], load_dir: str | None = None, save_dir: str | None = None):
    """{(max_running, delay_s): {sample: (tokens, logprobs, loss_mask)}} of this rank's samples, and the
    checks of the first run: (recomputed - rollout log-prob max diff, routes equal, replies as rendered)."""
    from megatron.core import dist_checkpointing, parallel_state

    from megacispo.data.chat import ReplyRenderer
    from megacispo.envs.config import EnvConfig
    from megacispo.envs.turns import Conversations, EnvWorkers, sum_metrics
    from megacispo.models.routing import RoutingTargets
    from megacispo.rollout.config import RolloutConfig
    from megacispo.rollout.generate import generate, sample_keys

    model = _model(layout)
    if load_dir is not None:
        model.load_state_dict(dist_checkpointing.load(model.sharded_state_dict(), load_dir))
    if save_dir is not None:
        dist_checkpointing.save(model.sharded_state_dict(), save_dir)
    dp_rank, dp_size = parallel_state.get_data_parallel_rank(), parallel_state.get_data_parallel_world_size()
    share = len(PROMPT_LENGTHS) // dp_size
    rows = list(range(dp_rank * share, (dp_rank + 1) * share))
    generator = torch.Generator().manual_seed(5)
    prompts = [torch.randint(43, 512, (n,), generator=generator).tolist() for n in PROMPT_LENGTHS]
    keys = sample_keys((11, 0), rows, 1, device="cpu")
    tokenizer = CharTokenizer()
    renderer = ReplyRenderer(tokenizer, chat_template=False)
    workers = EnvWorkers(4)
    results, checks = {}, None
    for slots, delay_s in runs:
        env = EnvConfig(name="counting", params={"delay_s": delay_s}, max_turns=4, timeout_s=30.0)
        records = [PromptRecord(prompt="", answer=str(row)) for row in rows]
        conversations = Conversations(env, CountingEnv, renderer, records, workers, max_prompt_tokens=4096)
        mine = conversations.prompts(lambda record: prompts[int(record.answer)])
        config = RolloutConfig(max_new_tokens=MAX_NEW, temperature=1.0, max_running=slots)
        samples = generate(model, mine, config, stop_ids=tokenizer.stop_ids, pad_id=PAD, keys=keys,
                           lockstep_group=parallel_state.get_data_parallel_group(), conversations=conversations)
        lengths = (samples.prompt_lengths + samples.response_lengths).tolist()
        results[(slots, delay_s)] = {
            row: (samples.tokens[i, :lengths[i]], samples.rollout_logprobs[i, :lengths[i] - 1],
                  samples.loss_mask[i, :lengths[i] - 1]) for i, row in enumerate(rows)}
        if checks is None:
            checks = _check_training_view(model, samples, conversations, tokenizer, RoutingTargets)
        assert sum_metrics(conversations.sample_metrics())["env/turns"] >= 2 * len(rows)
    workers.close()
    return results, checks


def _check_training_view(model, samples, conversations, tokenizer, routing_targets_cls):
    """What the trainer would see: (max |recomputed - rollout| log-prob at sampled tokens, whether the
    recorded routes equal the training forward's at every fed token, replies found as rendered)."""
    width = samples.tokens.shape[1]
    real = ~samples.padding_mask(width)
    with torch.no_grad():
        model.eval()
        logits = model(samples.tokens)  # [n, S, V] fp64
    logprobs = torch.log_softmax(logits[:, :-1], dim=-1).gather(-1, samples.tokens[:, 1:, None])[..., 0]
    sampled = samples.loss_mask.bool()
    diff = float((logprobs - samples.rollout_logprobs)[sampled].abs().max())
    # Routing comparison: replay nothing, compare the rollout's experts at every fed position.
    recorded = torch.cat([real[:, 1:], torch.zeros_like(real[:, :1])], dim=1)
    model.take_route_counts()
    with torch.no_grad():
        model(samples.tokens, routing=routing_targets_cls(samples.routes, recorded, recorded, False))
    counts = model.take_route_counts()
    # Every reply is in the sequence where the loss mask is 0 inside the response, as the renderer made it.
    replies_ok = True
    for i in range(len(samples.tokens)):
        start = int(samples.prompt_lengths[i])
        end = start + int(samples.response_lengths[i])
        mask = samples.loss_mask[i, start - 1:end - 1].bool().tolist()
        tokens = samples.tokens[i, start:end].tolist()
        fed = [t for t, m in zip(tokens, mask) if not m]
        replies_ok &= all(t == tokenizer.encode("x")[0] for t in fed)
        replies_ok &= conversations.conversations[i].fed_tokens == len(fed)
    return diff, counts, replies_ok


def _assert_same(actual: dict, expected: dict, what: str) -> None:
    for row, (tokens, logprobs, mask) in actual.items():
        assert torch.equal(tokens, expected[row][0]), f"{what}: sample {row}: {tokens} != {expected[row][0]}"
        torch.testing.assert_close(logprobs, expected[row][1], rtol=0, atol=1e-10)
        assert torch.equal(mask, expected[row][2]), f"{what}: sample {row}: loss mask differs"


RUNS = [(0, 0.0), (1, 0.0), (3, 0.05), (0, 0.05)]


@pytest.fixture(scope="module")
def single_process(tmp_path_factory):
    checkpoint = str(tmp_path_factory.mktemp("multi_turn_weights"))
    ((results, checks),) = run_distributed(_rollouts, 1, {}, RUNS, save_dir=checkpoint)
    return checkpoint, results, checks


def test_multi_turn_samples_do_not_depend_on_slots_or_timing(single_process):
    _, results, _ = single_process
    reference = results[RUNS[0]]
    assert any(not mask.all() for _, _, mask in reference.values()), "no reply was fed"
    for run in RUNS[1:]:
        _assert_same(results[run], reference, f"max_running={run[0]}, delay={run[1]}")


def test_multi_turn_tokens_trained_are_tokens_sampled(single_process):
    _, results, (diff, counts, replies_ok) = single_process
    assert diff < 1e-10, f"recomputed log-probs differ from the rollout's by {diff}"
    assert replies_ok, "the fed tokens are not the rendered replies"
    disagree, compared = float(counts[..., 0].sum()), float(counts[..., 1].sum())
    assert compared > 0 and disagree == 0, f"routes: {disagree} of {compared} fed tokens routed differently"


def test_multi_turn_ep2_lockstep_matches_single_process(single_process):
    checkpoint, results, _ = single_process
    per_rank = run_distributed(_rollouts, 2, {"expert_model_parallel_size": 2}, [RUNS[0], RUNS[2]],
                               load_dir=checkpoint)
    for rank_results, _ in per_rank:
        for run, samples in rank_results.items():
            _assert_same(samples, results[run], f"EP=2 rank, run {run}")
