"""One rollout with its rewards, as the trainer and the evaluator both run it: prompts -> samples ->
rewards, single-turn (rl.reward on each response) or, with env.name, multi-turn (each sample a
conversation with its own environment; the rewards as env.reward says)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

import torch
import torch.distributed as dist
from tqdm import tqdm

from megacispo.data.chat import ReplyRenderer
from megacispo.data.prompts import PromptRecord, prompt_token_ids
from megacispo.data.rewards import RewardFn, RewardScores, get_reward_fn, score_responses
from megacispo.data.tokenizer import Tokenizer
from megacispo.envs.base import EnvFactory, get_environment_factory
from megacispo.envs.config import EnvConfig
from megacispo.envs.turns import Conversations, EnvWorkers, build_renderer, combine_rewards
from megacispo.rl.config import RLConfig
from megacispo.rollout.config import RolloutConfig
from megacispo.rollout.generate import Generator, Samples, response_token_ids


@dataclass
class Environments:
    """What a run builds once for env.name: the factory, the reply renderer and the worker threads."""

    config: EnvConfig
    factory: EnvFactory
    renderer: ReplyRenderer
    workers: EnvWorkers
    max_prompt_tokens: int
    """The longest first prompt a reset may give (Config.max_prompt_tokens); a longer one fails its sample."""

    @classmethod
    def build(cls, config: EnvConfig, tokenizer: Tokenizer, chat_template: bool,
              max_prompt_tokens: int) -> Environments | None:
        """None without env.name (single-turn rollouts)."""
        if not config.multi_turn:
            return None
        factory = get_environment_factory(config.name)
        return cls(config, factory, build_renderer(config, factory, tokenizer, chat_template),
                   EnvWorkers(config.workers), max_prompt_tokens)


@dataclass(frozen=True)
class Scoring:
    """How responses are scored: rl.reward, rl.failure_reward, rl.reward_timeout_s, rl.reward_workers,
    rl.max_reward_failure_frac (the circuit breaker of a batch) and env.reward."""

    reward_fn: RewardFn
    failure_reward: float
    timeout_s: float
    stop_pending: Callable[[], bool] = lambda: False
    """Whether this rank was told to stop, for a reward call in flight."""
    workers: int = 1
    """Reward calls at once, each in a worker process (rl.reward_workers)."""
    max_failure_frac: float = 1.0
    """The circuit breaker's fraction of failed calls (rl.max_reward_failure_frac; 1: off)."""

    @classmethod
    def from_config(cls, rl: RLConfig, stop_pending: Callable[[], bool] = lambda: False) -> Scoring:
        """The scoring of the rl section, its reward imported now."""
        return cls(get_reward_fn(rl.reward), rl.failure_reward, rl.reward_timeout_s, stop_pending, rl.reward_workers,
                   rl.max_reward_failure_frac)


def response_text(tokenizer: Tokenizer, samples: Samples, row: int) -> str:
    """The decoded response of ``row``, without the stop token that ended it."""
    ids = response_token_ids(samples, row)
    if ids and ids[-1] in tokenizer.stop_ids:
        ids = ids[:-1]
    return tokenizer.decode(ids)


def sample_and_score(
    generator: Generator, records: Sequence[PromptRecord], rollout: RolloutConfig, *, tokenizer: Tokenizer,
    keys: torch.Tensor, scoring: Scoring, environments: Environments | None,
    lockstep_group: dist.ProcessGroup | None, progress: tqdm | None = None,
    interrupt: Callable[[], None] | None = None,
) -> tuple[Samples, RewardScores, list[dict[str, float]]]:
    """One sample of each of ``records`` (repeat a record for a group) from ``generator``, its reward and
    (multi-turn) its conversation's env/* counts (an empty list single-turn). ``interrupt`` is called as the
    generator says (megacispo's engine: before every decode step) and after the scoring, on every rank alike;
    what it raises stops the rollout."""
    conversations = None
    if environments is None:
        prompts = [prompt_token_ids(tokenizer, record) for record in records]
        stop_ids = tokenizer.stop_ids
    else:
        conversations = Conversations(environments.config, environments.factory, environments.renderer, records,
                                      environments.workers, environments.max_prompt_tokens)
        prompts = conversations.prompts(lambda record: prompt_token_ids(tokenizer, record))
        stop_ids = sorted(environments.renderer.turn_stop_ids)
    samples = generator(prompts, rollout, stop_ids=stop_ids, pad_id=tokenizer.pad_id, keys=keys,
                       lockstep_group=lockstep_group, progress=progress, interrupt=interrupt,
                       conversations=conversations)
    try:
        scores = None
        if conversations is None or environments.config.reward != "env":
            texts = conversations.final_texts() if conversations is not None else \
                [response_text(tokenizer, samples, row) for row in range(len(prompts))]
            scores = score_responses(scoring.reward_fn, texts, records, scoring.failure_reward,
                                     timeout_s=scoring.timeout_s, workers=scoring.workers,
                                     max_failure_frac=scoring.max_failure_frac, interrupted=scoring.stop_pending)
    finally:
        # Every rank agrees here, after scoring: a SIGTERM that stopped one rank's scoring stops them all.
        if interrupt is not None:
            interrupt()
    if conversations is None:
        return samples, scores, []
    scores = combine_rewards(environments.config.reward, conversations, scores, scoring.failure_reward)
    env_metrics = conversations.sample_metrics()
    # The model's own tokens, beside the replies' fed_tokens (one copy to the host for all the samples).
    for counts, sampled in zip(env_metrics, samples.loss_mask.sum(dim=1).tolist()):
        counts["env/sampled_tokens"] = sampled
    return samples, scores, env_metrics
