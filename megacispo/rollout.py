"""Rollouts: G samples per prompt from the policy being trained (no second copy of the weights).

Generation uses the model's own cache (the d x d state of the lightning layers, KV for the softmax
layers): a left-padded prefill, then one decode step per token. Under tensor parallelism the model
gathers the vocabulary shards of the last position's logits, so every rank of the TP group sees the
full distribution and draws the same token from an identically seeded generator.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

import torch
import torch.distributed as dist
from tqdm import tqdm

from megacispo.config import RolloutConfig
from megacispo.data import right_padding_mask


@dataclass
class Samples:
    """A batch of generated sequences, right-padded: prompt, response, then padding.

    Position t of the [n, S - 1] tensors describes the prediction of token t + 1.
    """

    tokens: torch.Tensor
    """[n, S] int64 token ids."""
    prompt_lengths: torch.Tensor
    """[n] tokens of each prompt (BOS included)."""
    response_lengths: torch.Tensor
    """[n] generated tokens of each sample (its EOS included)."""
    rollout_logprobs: torch.Tensor
    """[n, S - 1] log-prob of each response token under the sampling policy; 0 elsewhere."""
    loss_mask: torch.Tensor
    """[n, S - 1] 1.0 where token t + 1 is a response token."""
    truncated_early: torch.Tensor
    """[n] bool: stopped by early truncation (N consecutive tokens above probability p)."""

    def select(self, rows: torch.Tensor | slice) -> Samples:
        return Samples(*(getattr(self, name)[rows] for name in self.__dataclass_fields__))

    def padding_mask(self, width: int) -> torch.Tensor:
        """[n, width] bool: True after each sequence's prompt and response (tokens right-padded to width)."""
        return right_padding_mask(self.prompt_lengths + self.response_lengths, width)


def sample_tokens(
    logits: torch.Tensor, config: RolloutConfig, generator: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Draw one token per row of ``logits`` [b, V].

    Returns (tokens [b], logprobs [b], probs [b]): the log-prob of the drawn token under the
    tempered distribution (the one the trainer's ratio compares against) and its probability under
    the truncated sampling distribution (what early truncation watches).
    """
    logits = logits.float()
    if config.temperature == 0:
        logprobs = torch.log_softmax(logits, dim=-1)
        tokens = logits.argmax(dim=-1)
        chosen = logprobs.gather(-1, tokens[:, None]).squeeze(-1)
        return tokens, chosen, chosen.exp()
    logprobs = torch.log_softmax(logits / config.temperature, dim=-1)
    sampling_logits = logprobs.clone()
    if config.top_k > 0:
        kth = sampling_logits.topk(min(config.top_k, sampling_logits.shape[-1]), dim=-1).values[:, -1:]
        sampling_logits = sampling_logits.masked_fill(sampling_logits < kth, float("-inf"))
    if config.top_p < 1.0:
        sorted_logits, order = sampling_logits.sort(dim=-1, descending=True)
        sorted_probs = sorted_logits.softmax(dim=-1)
        # Drop a token when the tokens ranked above it already hold top_p of the mass.
        drop = sorted_probs.cumsum(dim=-1) - sorted_probs >= config.top_p
        sampling_logits = sampling_logits.scatter(-1, order, sorted_logits.masked_fill(drop, float("-inf")))
    sampling_probs = sampling_logits.softmax(dim=-1)
    tokens = torch.multinomial(sampling_probs, 1, generator=generator).squeeze(-1)
    chosen = logprobs.gather(-1, tokens[:, None]).squeeze(-1)
    return tokens, chosen, sampling_probs.gather(-1, tokens[:, None]).squeeze(-1)


@torch.no_grad()
def generate(
    model,
    prompts: list[list[int]],
    config: RolloutConfig,
    *,
    stop_ids: Sequence[int],
    pad_id: int,
    generator: torch.Generator,
    lockstep_group: dist.ProcessGroup | None = None,
    show_progress: bool = False,
    interrupt: Callable[[], None] | None = None,
) -> Samples:
    """Sample one response per prompt (repeat a prompt G times for a group).

    ``stop_ids``: a sample ends with the first of these it draws (EOS, and a chat template's end of turn).
    ``generator``: on the device of the model's logits (torch.multinomial draws there); the prompts
    and the samples are made on it too.
    ``lockstep_group``: ranks whose forward passes communicate with each other beyond tensor
    parallelism (expert parallelism's all-to-all spans data-parallel ranks): they all decode until
    every one of them has finished, so each runs the same number of forward passes.
    ``interrupt``: called before every decode step (so at the same steps on every rank); what it
    raises abandons the rollout (the trainer's SIGTERM check).
    """
    was_training = model.training
    # Decoding is inference: Megatron's MoE layer refuses TP without sequence parallelism in
    # training mode, and the model switches sequence parallelism off for single-token steps.
    model.eval()
    try:
        return _generate(model, prompts, config, stop_ids, pad_id, generator, lockstep_group, show_progress, interrupt)
    finally:
        model.train(was_training)


def _generate(model, prompts, config, stop_ids, pad_id, generator, lockstep_group, show_progress, interrupt) -> Samples:
    device = generator.device
    num_samples = len(prompts)
    prompt_lengths = torch.tensor([len(p) for p in prompts], device=device)
    stop_ids = torch.tensor(list(stop_ids), dtype=torch.long, device=device)
    width = max(len(p) for p in prompts)
    # Left-padded prompts [n, P]: every sequence's last prompt token sits in the last column.
    input_ids = torch.tensor([[pad_id] * (width - len(p)) + p for p in prompts], dtype=torch.long, device=device)
    attention_mask = torch.arange(width, device=device) >= width - prompt_lengths[:, None]

    next_logits, cache = model.prefill(input_ids, attention_mask)  # [n, V]
    responses = torch.full((num_samples, config.max_new_tokens), pad_id, dtype=torch.long, device=device)
    response_logprobs = torch.zeros((num_samples, config.max_new_tokens), device=device)
    finished = torch.zeros(num_samples, dtype=torch.bool, device=device)
    truncated = torch.zeros(num_samples, dtype=torch.bool, device=device)
    confident_run = torch.zeros(num_samples, dtype=torch.long, device=device)
    response_lengths = torch.zeros(num_samples, dtype=torch.long, device=device)
    steps = tqdm(range(config.max_new_tokens), desc="rollout", leave=False, disable=not show_progress)
    for t in steps:
        if interrupt is not None:
            interrupt()
        tokens, logprobs, probs = sample_tokens(next_logits, config, generator)
        active = ~finished
        responses[active, t] = tokens[active]
        response_logprobs[active, t] = logprobs[active]
        response_lengths += active.long()
        finished |= active & torch.isin(tokens, stop_ids)
        if config.early_truncation_tokens > 0:
            confident = probs > config.early_truncation_prob
            confident_run = torch.where(confident, confident_run + 1, torch.zeros_like(confident_run))
            stop = active & ~finished & (confident_run >= config.early_truncation_tokens)
            truncated |= stop
            finished |= stop
        if t + 1 == config.max_new_tokens or _all_finished(finished, lockstep_group):
            break
        # Finished rows keep decoding a pad (cheaper than reshaping the cache); their output is ignored.
        step_tokens = torch.where(finished, torch.full_like(tokens, pad_id), tokens)
        next_logits, cache = model.decode_step(step_tokens, cache, compiled=config.compile_decode)
    return _assemble(prompts, prompt_lengths, responses, response_logprobs, response_lengths, truncated, pad_id)


def _all_finished(finished: torch.Tensor, group: dist.ProcessGroup | None) -> bool:
    flag = finished.all().long()
    if group is not None:
        dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=group)
    return bool(flag)


def _assemble(prompts, prompt_lengths, responses, response_logprobs, response_lengths, truncated, pad_id) -> Samples:
    device = responses.device
    lengths = response_lengths.tolist()  # one copy to the host for all the rows
    width = max(len(prompt) + r for prompt, r in zip(prompts, lengths))
    tokens = torch.full((len(prompts), width), pad_id, dtype=torch.long, device=device)
    rollout_logprobs = torch.zeros((len(prompts), width - 1), device=device)
    loss_mask = torch.zeros((len(prompts), width - 1), device=device)
    for row, (prompt, r) in enumerate(zip(prompts, lengths)):
        p = len(prompt)
        tokens[row, :p] = torch.tensor(prompt, device=device)
        tokens[row, p:p + r] = responses[row, :r]
        # Response token p + i is predicted at position p + i - 1.
        rollout_logprobs[row, p - 1:p - 1 + r] = response_logprobs[row, :r]
        loss_mask[row, p - 1:p - 1 + r] = 1.0
    return Samples(tokens, prompt_lengths, response_lengths, rollout_logprobs, loss_mask, truncated)


def response_token_ids(samples: Samples, row: int) -> list[int]:
    start = int(samples.prompt_lengths[row])
    return samples.tokens[row, start:start + int(samples.response_lengths[row])].tolist()
