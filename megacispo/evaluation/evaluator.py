"""Held-out evaluation as papers report it: greedy accuracy, and pass@k and mean@k over n responses
sampled per prompt, pass@k by the unbiased estimator of Chen et al. 2021 ("Evaluating Large Language
Models Trained on Code"). The trainer (``Trainer.evaluate``) and the entry point megacispo.eval both
run an ``Evaluator``.

A response is correct when its reward is at least 1 (as rollout/accuracy counts it: rl.reward, or with
env.name the conversation's reward as env.reward makes it; megacispo.rollout.episodes). The
test prompts are split over the data-parallel ranks and the per-prompt counts summed over them. The
metrics do not depend on the DP size: sample j of test prompt i draws its tokens from a random
stream keyed by (train.seed, i, j) (megacispo.rollout.generate.sample_keys), whichever rank decodes it and
whatever it is batched with.

Sampling is eval.temperature and eval.top_p only: rollout.top_k and early truncation (training
rollouts' economies) are off, so a response is the model's own; rollout.max_new_tokens bounds it.

Rewards are called within rl.reward_timeout_s each (megacispo.data.rewards). Inside a training run
the evaluation stops on SIGTERM like a step: ``interrupt`` (the trainer's agreement of the ranks) is
called before every decode step and after the scoring, and raises to stop it.
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Sequence

import torch
import torch.distributed as dist

from megacispo.data.prompts import PromptRecord
from megacispo.data.tokenizer import Tokenizer
from megacispo.evaluation.config import EvalConfig
from megacispo.evaluation.pass_at_k import pass_at_k, pass_at_k_values
from megacispo.parallel.layout import run_device
from megacispo.rollout.config import RolloutConfig
from megacispo.rollout.episodes import Environments, Scoring, sample_and_score
from megacispo.rollout.generate import Generator, sample_keys

# The per-prompt counts every rank fills for its prompts and the ranks sum: one row per test prompt.
GREEDY_CORRECT, GREEDY_LENGTH, SAMPLED_CORRECT, SAMPLED_LENGTH = range(4)
NUM_COUNTS = 4
# Names evaluation's random streams, apart from the trainer's rollouts (megacispo.rollout.generate.sample_keys).
EVAL_STREAM = 0x4556414C


def eval_metrics(counts: Sequence[Sequence[float]], eval_config: EvalConfig) -> dict[str, float]:
    """The metrics from the per-prompt counts (one row per test prompt, columns GREEDY_CORRECT ...
    SAMPLED_LENGTH, summed over the ranks): eval/accuracy and eval/greedy_response_length_mean with
    eval.greedy; with eval.num_samples = n > 0, eval/pass@k (k in ``pass_at_k_values(n)``: each
    prompt's estimate, averaged over the prompts), eval/mean@n (the fraction of correct samples; equal
    to pass@1) and eval/response_length_mean."""
    num_prompts, n = len(counts), eval_config.num_samples
    metrics = {}
    if eval_config.greedy:
        metrics["eval/accuracy"] = sum(row[GREEDY_CORRECT] for row in counts) / num_prompts
        metrics["eval/greedy_response_length_mean"] = sum(row[GREEDY_LENGTH] for row in counts) / num_prompts
    if n:
        correct = [round(row[SAMPLED_CORRECT]) for row in counts]
        for k in pass_at_k_values(n):
            metrics[f"eval/pass@{k}"] = sum(pass_at_k(n, c, k) for c in correct) / num_prompts
        metrics[f"eval/mean@{n}"] = sum(correct) / (num_prompts * n)
        metrics["eval/response_length_mean"] = sum(row[SAMPLED_LENGTH] for row in counts) / (num_prompts * n)
    return metrics


class Evaluator:
    """Greedy and sampled evaluation of a policy on ``records`` (the test prompts), its samples from
    ``generator`` (megacispo.rollout.generate.Generator); call on every rank of the model's layout, each
    with the same records. ``dp_group``: the data-parallel group, over which the prompts are split and
    the ranks decode in lockstep. ``settings``: the eval section;
    ``rollout``: the generation settings it samples with; ``seed``: train.seed; ``scoring``: the reward
    and its limits; ``environments``: env.name's (None: single-turn); ``interrupt``: called on every
    rank at the same points, raises to stop (None: never stops)."""

    def __init__(self, generator: Generator, tokenizer: Tokenizer, records: Sequence[PromptRecord],
                 dp_group: dist.ProcessGroup, *, settings: EvalConfig, rollout: RolloutConfig, seed: int,
                 scoring: Scoring, environments: Environments | None = None,
                 interrupt: Callable[[], None] | None = None):
        self.generator = generator
        self.tokenizer = tokenizer
        self.records = list(records)
        self.dp_group = dp_group
        self.settings, self.rollout, self.seed = settings, rollout, seed
        self.scoring, self.environments, self.interrupt = scoring, environments, interrupt
        self.device = run_device()
        # Every DP-th prompt: the ranks' shares differ by one prompt at most.
        self.indices = list(range(dist.get_rank(dp_group), len(self.records), dist.get_world_size(dp_group)))

    def run(self) -> dict[str, float]:
        """The metrics of ``eval_metrics`` on every rank; empty without test prompts."""
        if not self.records:
            return {}
        counts = [[0.0] * NUM_COUNTS for _ in self.records]
        evaluation = self.settings
        if evaluation.greedy:
            correct, lengths = self._generate_and_score(1, self._sampling(temperature=0.0))
            for index, is_correct, length in zip(self.indices, correct, lengths):
                counts[index][GREEDY_CORRECT], counts[index][GREEDY_LENGTH] = is_correct, length
        if evaluation.num_samples:
            n = evaluation.num_samples
            correct, lengths = self._generate_and_score(
                n, self._sampling(temperature=evaluation.temperature, top_p=evaluation.top_p))
            for position, index in enumerate(self.indices):
                counts[index][SAMPLED_CORRECT] = sum(correct[position * n:(position + 1) * n])
                counts[index][SAMPLED_LENGTH] = sum(lengths[position * n:(position + 1) * n])
        return eval_metrics(_all_reduce_rows(counts, self.dp_group, self.device), evaluation)

    def _sampling(self, **fields) -> RolloutConfig:
        """The rollout section with ``fields`` changed, top-k and early truncation off."""
        return dataclasses.replace(self.rollout, top_k=0, early_truncation_tokens=0, **fields)

    def _generate_and_score(self, num_samples: int, sampling: RolloutConfig) -> tuple[list[float], list[int]]:
        """``num_samples`` responses to each of this rank's prompts, prompt-major: whether each is correct
        (1.0 / 0.0) and its length in tokens (the stop token included). Sample j of prompt i draws from
        the stream of (train.seed, EVAL_STREAM, i, j): the same responses at any DP size. A rank without
        a prompt (fewer prompts than ranks) decodes the first one all the same and returns nothing: the
        ranks decode in lockstep."""
        decoded = self.indices or [0]
        records = [self.records[index] for index in decoded for _ in range(num_samples)]
        keys = sample_keys((self.seed, EVAL_STREAM), decoded, num_samples, device=self.device)
        samples, scores, _ = sample_and_score(self.generator, records, sampling, tokenizer=self.tokenizer, keys=keys,
                                              scoring=self.scoring, environments=self.environments,
                                              lockstep_group=self.dp_group, interrupt=self.interrupt)
        if not self.indices:
            return [], []
        return [float(reward >= 1.0) for reward in scores.rewards], samples.response_lengths.tolist()


def _all_reduce_rows(rows: list[list[float]], group: dist.ProcessGroup, device: torch.device) -> list[list[float]]:
    """``rows`` summed over the ranks of ``group``, in float64 on the run's device (collectives take it
    there). Each rank fills only its prompts' rows, zeros elsewhere: the sum holds every prompt's counts."""
    tensor = torch.tensor(rows, dtype=torch.float64, device=device)
    dist.all_reduce(tensor, group=group)
    return tensor.tolist()
