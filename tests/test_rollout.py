"""Sampling and the rollout bookkeeping on hand-made distributions (the model's own decoding is
tested in test_model_decoding.py; here a scripted policy makes every case exact)."""

import math

import torch

from megacispo.config import RolloutConfig
from megacispo.rollout import generate, response_token_ids, sample_tokens

VOCAB = 6
EOS, PAD = 2, 0


class ScriptedPolicy(torch.nn.Module):
    """Emits, at generation step t, the logits ``script[t]`` for every sequence."""

    def __init__(self, script: list[list[float]]):
        super().__init__()
        self.script = torch.tensor(script)
        self.calls = 0

    def prefill(self, input_ids, attention_mask):
        self.calls = 0
        return self.script[0].expand(input_ids.shape[0], VOCAB).clone(), {"length": input_ids.shape[1]}

    def decode_step(self, token_ids, cache, compiled=False):
        self.calls += 1
        return self.script[min(self.calls, len(self.script) - 1)].expand(token_ids.shape[0], VOCAB).clone(), cache


def _config(**fields) -> RolloutConfig:
    return RolloutConfig(**{"max_new_tokens": 5, "temperature": 1.0, **fields})


def test_greedy_takes_argmax_and_reports_its_logprob():
    logits = torch.tensor([[0.0, 1.0, 3.0, 0.5, 0.0, 0.0]])
    tokens, logprobs, _ = sample_tokens(logits, _config(temperature=0.0), torch.Generator().manual_seed(0))
    assert tokens.tolist() == [2]
    torch.testing.assert_close(logprobs, torch.log_softmax(logits, -1)[:, 2])


def test_temperature_logprob_is_of_the_tempered_distribution():
    logits = torch.randn(4, VOCAB, generator=torch.Generator().manual_seed(1))
    tokens, logprobs, _ = sample_tokens(logits, _config(temperature=0.7), torch.Generator().manual_seed(0))
    expected = torch.log_softmax(logits / 0.7, -1).gather(-1, tokens[:, None]).squeeze(-1)
    torch.testing.assert_close(logprobs, expected)


def test_top_k_and_top_p_restrict_the_support():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.1, 0.05, 0.03, 0.02]])).expand(2000, VOCAB)
    generator = torch.Generator().manual_seed(0)
    top_k, _, _ = sample_tokens(logits, _config(top_k=2), generator)
    assert set(top_k.tolist()) == {0, 1}
    # top_p = 0.85: tokens 0 and 1 hold 0.8 < 0.85, so token 2 is needed too; token 3 is not.
    top_p, _, probs = sample_tokens(logits, _config(top_p=0.85), generator)
    assert set(top_p.tolist()) == {0, 1, 2}
    torch.testing.assert_close(probs[top_p == 0], torch.full_like(probs[top_p == 0], 0.5 / 0.9))


def test_eos_ends_a_response_and_masks_line_up():
    # Step 0: token 3 for sure; step 1: EOS for sure.
    sure = lambda token: [0.0 if i == token else -1e4 for i in range(VOCAB)]  # noqa: E731
    policy = ScriptedPolicy([sure(3), sure(EOS), sure(4)])
    samples = generate(policy, [[1, 5, 5], [1, 5]], _config(), stop_ids=[EOS], pad_id=PAD,
                       generator=torch.Generator().manual_seed(0))
    assert samples.response_lengths.tolist() == [2, 2]
    assert response_token_ids(samples, 0) == [3, EOS] and response_token_ids(samples, 1) == [3, EOS]
    assert samples.tokens[1].tolist() == [1, 5, 3, EOS, PAD]
    assert samples.padding_mask(6).tolist() == [[False] * 5 + [True], [False] * 4 + [True] * 2]
    # Position t predicts token t + 1: the response of row 1 starts at token 2, so positions 1 and 2.
    assert samples.loss_mask[1].tolist() == [0.0, 1.0, 1.0, 0.0]
    assert samples.rollout_logprobs[1, 0] == 0 and samples.rollout_logprobs[1, 1] > -1e-3
    assert policy.calls == 1  # stopped as soon as every sequence had finished
    assert policy.training  # generation switches to eval mode and back


def test_early_truncation_after_n_confident_tokens():
    confident = [0.0, 0.0, -1e4, 9.0, 0.0, 0.0]  # token 3 with probability ~0.9995
    policy = ScriptedPolicy([confident] * 8)
    config = _config(max_new_tokens=8, early_truncation_tokens=3, early_truncation_prob=0.99)
    samples = generate(policy, [[1, 4]], config, stop_ids=[EOS], pad_id=PAD, generator=torch.Generator().manual_seed(0))
    assert samples.truncated_early.tolist() == [True]
    assert samples.response_lengths.tolist() == [3]
    off = generate(policy, [[1, 4]], _config(max_new_tokens=8), stop_ids=[EOS], pad_id=PAD,
                   generator=torch.Generator().manual_seed(0))
    assert off.truncated_early.tolist() == [False] and off.response_lengths.tolist() == [8]


def test_same_seed_same_samples():
    logits = [[math.log(p) for p in (0.2, 0.2, 0.1, 0.2, 0.2, 0.1)]] * 5
    runs = [generate(ScriptedPolicy(logits), [[1, 4]] * 4, _config(), stop_ids=[EOS], pad_id=PAD,
                     generator=torch.Generator().manual_seed(3)).tokens for _ in range(2)]
    assert torch.equal(runs[0], runs[1])
