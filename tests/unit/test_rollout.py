"""Sampling and the rollout bookkeeping on hand-made distributions (the model's own decoding is
tested in tests/multiprocess/test_model_decoding.py; here a scripted policy makes every case exact)."""

import contextlib
import math
import types

import pytest
import torch

from megacispo.models.config import model_config
from megacispo.models.layers import InferenceCache
from megacispo.rollout.config import RolloutConfig
from megacispo.rollout.generate import generate, response_token_ids, sample_keys, sample_tokens

VOCAB = 6
EOS, PAD = 2, 0


class ScriptedPolicy(torch.nn.Module):
    """Emits, at generation step t, the logits ``script[t]`` for every sequence; its cache has no layers."""

    def __init__(self, script: list[list[float]]):
        super().__init__()
        self.script = torch.tensor(script)
        self.calls = 0
        # No MoE layers: the rollout records [n, S, 0, top-k] experts.
        self.hybrid_config = model_config("tiny")
        self.decoder = types.SimpleNamespace(layers=[])

    def generation_dtype(self, dtype, keep=False):
        return contextlib.nullcontext()

    def recording_routes(self):
        return contextlib.nullcontext()

    def last_routes(self, batch, length):
        return torch.zeros(batch, length, 0, self.hybrid_config.moe_router_topk, dtype=torch.long)

    def prefill(self, input_ids, attention_mask):
        self.calls = 0
        cache = InferenceCache(valid_mask=attention_mask, next_positions=attention_mask.long().sum(-1))
        return self.script[0].expand(input_ids.shape[0], VOCAB).clone(), cache

    def decode_step(self, token_ids, cache, compiled=False):
        self.calls += 1
        cache.append_token()
        return self.script[min(self.calls, len(self.script) - 1)].expand(token_ids.shape[0], VOCAB).clone(), cache


def _keys(num: int, seed: int = 0) -> torch.Tensor:
    return sample_keys((seed,), range(num), 1, device="cpu")


def _config(**fields) -> RolloutConfig:
    return RolloutConfig(**{"max_new_tokens": 5, "temperature": 1.0, **fields})


def test_greedy_takes_argmax_and_reports_its_logprob():
    logits = torch.tensor([[0.0, 1.0, 3.0, 0.5, 0.0, 0.0]])
    tokens, logprobs, _ = sample_tokens(logits, _config(temperature=0.0), _keys(1), torch.zeros(1, dtype=torch.long))
    assert tokens.tolist() == [2]
    torch.testing.assert_close(logprobs, torch.log_softmax(logits, -1)[:, 2])


def test_temperature_logprob_is_of_the_tempered_distribution():
    logits = torch.randn(4, VOCAB, generator=torch.Generator().manual_seed(1))
    tokens, logprobs, _ = sample_tokens(logits, _config(temperature=0.7), _keys(4), torch.zeros(4, dtype=torch.long))
    expected = torch.log_softmax(logits / 0.7, -1).gather(-1, tokens[:, None]).squeeze(-1)
    torch.testing.assert_close(logprobs, expected)


def test_top_k_and_top_p_restrict_the_support():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.1, 0.05, 0.03, 0.02]])).expand(2000, VOCAB)
    keys, positions = _keys(2000), torch.zeros(2000, dtype=torch.long)
    top_k, _, _ = sample_tokens(logits, _config(top_k=2), keys, positions)
    assert set(top_k.tolist()) == {0, 1}
    # top_p = 0.85: tokens 0 and 1 hold 0.8 < 0.85, so token 2 is needed too; token 3 is not.
    top_p, _, probs = sample_tokens(logits, _config(top_p=0.85), keys, positions + 1)
    assert set(top_p.tolist()) == {0, 1, 2}
    torch.testing.assert_close(probs[top_p == 0], torch.full_like(probs[top_p == 0], 0.5 / 0.9))


def test_eos_ends_a_response_and_masks_line_up():
    # Step 0: token 3 for sure; step 1: EOS for sure.
    sure = lambda token: [0.0 if i == token else -1e4 for i in range(VOCAB)]  # noqa: E731
    policy = ScriptedPolicy([sure(3), sure(EOS), sure(4)])
    samples = generate(policy, [[1, 5, 5], [1, 5]], _config(host_check_every=1), stop_ids=[EOS], pad_id=PAD,
                       keys=_keys(2))
    assert samples.response_lengths.tolist() == [2, 2]
    assert response_token_ids(samples, 0) == [3, EOS] and response_token_ids(samples, 1) == [3, EOS]
    assert samples.tokens[1].tolist() == [1, 5, 3, EOS, PAD]
    assert samples.padding_mask(6).tolist() == [[False] * 5 + [True], [False] * 4 + [True] * 2]
    # Position t predicts token t + 1: the response of row 1 starts at token 2, so positions 1 and 2.
    assert samples.loss_mask[1].tolist() == [0.0, 1.0, 1.0, 0.0]
    assert samples.rollout_logprobs[1, 0] == 0 and samples.rollout_logprobs[1, 1] > -1e-3
    assert policy.calls == 1  # the host looked after every step: stopped as soon as every sequence had finished
    assert policy.training  # generation switches to eval mode and back


def test_host_looks_every_n_steps_and_the_samples_stay_the_same():
    """With rollout.host_check_every = 4 the ended rows idle until the host's next look (decode steps
    2 and 3 here, where EOS ended both at the second draw), and nothing of theirs is recorded: the
    same samples as looking after every step."""
    sure = lambda token: [0.0 if i == token else -1e4 for i in range(VOCAB)]  # noqa: E731
    runs = {}
    for every in (1, 4):
        policy = ScriptedPolicy([sure(3), sure(EOS)] + [sure(4)] * 6)
        samples = generate(policy, [[1, 5, 5], [1, 5]], _config(host_check_every=every), stop_ids=[EOS], pad_id=PAD,
                           keys=_keys(2))
        runs[every] = (samples, policy.calls)
    (eager, eager_calls), (lazy, lazy_calls) = runs[1], runs[4]
    assert (eager_calls, lazy_calls) == (1, 3)
    for name in ("tokens", "response_lengths", "rollout_logprobs", "loss_mask", "truncated_early"):
        assert torch.equal(getattr(lazy, name), getattr(eager, name)), name


def test_early_truncation_after_n_confident_tokens():
    confident = [0.0, 0.0, -1e4, 9.0, 0.0, 0.0]  # token 3 with probability ~0.9995
    policy = ScriptedPolicy([confident] * 8)
    config = _config(max_new_tokens=8, early_truncation_tokens=3, early_truncation_prob=0.99)
    samples = generate(policy, [[1, 4]], config, stop_ids=[EOS], pad_id=PAD, keys=_keys(1))
    assert samples.truncated_early.tolist() == [True]
    assert samples.response_lengths.tolist() == [3]
    off = generate(policy, [[1, 4]], _config(max_new_tokens=8), stop_ids=[EOS], pad_id=PAD, keys=_keys(1))
    assert off.truncated_early.tolist() == [False] and off.response_lengths.tolist() == [8]


def test_same_seed_same_samples():
    logits = [[math.log(p) for p in (0.2, 0.2, 0.1, 0.2, 0.2, 0.1)]] * 5
    runs = [generate(ScriptedPolicy(logits), [[1, 4]] * 4, _config(), stop_ids=[EOS], pad_id=PAD,
                     keys=_keys(4, seed=3)).tokens for _ in range(2)]
    assert torch.equal(runs[0], runs[1])
    other_seed = generate(ScriptedPolicy(logits), [[1, 4]] * 4, _config(), stop_ids=[EOS], pad_id=PAD,
                          keys=_keys(4, seed=4))
    assert not torch.equal(runs[0], other_seed.tokens)


def _splitmix64(x: int) -> int:
    """The reference finalizer on Python integers (unsigned 64-bit arithmetic)."""
    mask = 2**64 - 1
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & mask
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & mask
    return x ^ (x >> 31)


def test_the_hash_is_splitmix64_on_signed_integers():
    from megacispo.rollout.generate import _mix64

    values = [0, 1, 2**63 - 1, 2**63, 2**64 - 1, 0x0123456789ABCDEF, 0xFEDCBA9876543210]
    signed = torch.tensor([v - 2**64 if v >= 2**63 else v for v in values], dtype=torch.long)
    assert [v % 2**64 for v in _mix64(signed).tolist()] == [_splitmix64(v) for v in values]


def test_keys_follow_the_place_in_the_global_batch():
    keys = sample_keys((7, 3), range(4), 3, device="cpu")
    assert keys.shape == (12,) and len(set(keys.tolist())) == 12
    # This rank's prompts 2 and 3 of the global batch: the keys the whole batch gives them.
    assert torch.equal(sample_keys((7, 3), range(2, 4), 3, device="cpu"), keys[6:])
    assert not torch.equal(sample_keys((7, 4), range(4), 3, device="cpu"), keys)


def test_inverse_cdf_draws_follow_the_distribution():
    probs = torch.tensor([0.5, 0.25, 0.125, 0.0, 0.0625, 0.0625])
    draws = 40_000
    logits = probs.log().expand(draws, VOCAB)
    tokens, _, _ = sample_tokens(logits, _config(), _keys(draws), torch.arange(draws))
    frequencies = torch.bincount(tokens, minlength=VOCAB).double() / draws
    assert frequencies[3] == 0
    torch.testing.assert_close(frequencies, probs.double(), rtol=0, atol=0.01)
    # The same key at the next position is a fresh draw, not the same token.
    next_tokens, _, _ = sample_tokens(logits, _config(), _keys(draws), torch.arange(draws) + 1)
    assert (next_tokens != tokens).double().mean() > 0.5


def test_slots_give_the_samples_of_all_at_once_in_prompt_order():
    logits = [[math.log(p) for p in (0.1, 0.2, 0.15, 0.25, 0.2, 0.1)]]
    prompts = [[1, 4], [1, 5, 5, 3], [1], [1, 3, 3], [1, 4, 4, 4, 4]]
    limits = [5, 1, 3, 5, 2]
    runs = {slots: generate(ScriptedPolicy(logits), prompts, _config(max_running=slots), stop_ids=[EOS], pad_id=PAD,
                            keys=_keys(len(prompts)), response_limits=limits) for slots in (1, 2, 0)}
    reference = runs[0]
    assert all(1 <= length <= limit for length, limit in zip(reference.response_lengths.tolist(), limits))
    assert len(set(reference.response_lengths.tolist())) > 1
    for row, prompt in enumerate(prompts):
        assert reference.tokens[row, :len(prompt)].tolist() == prompt
    for slots in (1, 2):
        for name in reference.__dataclass_fields__:
            assert torch.equal(getattr(runs[slots], name), getattr(reference, name)), (slots, name)


def test_memory_cap_is_checked_at_start_up():
    from megacispo.config import Config
    from megacispo.startup import check_config
    from megacispo.training.config import TrainConfig

    def config(**rollout) -> Config:
        return Config(rollout=RolloutConfig(max_new_tokens=512, **rollout), train=TrainConfig(run_dir="run"))

    check_config(config(max_running=16, max_cache_gib=1.0))
    too_many = r"rollout.max_running = 4096 slots need .* GiB .*rollout.max_cache_gib = 0.01"
    with pytest.raises(ValueError, match=too_many):
        check_config(config(max_running=4096, max_cache_gib=0.01))
    with pytest.raises(ValueError, match="rollout.max_cache_gib = 1 needs rollout.max_running > 0"):
        check_config(config(max_running=0, max_cache_gib=1.0))
