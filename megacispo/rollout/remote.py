"""Rollouts generated on processes of their own (placement.rollout_ranks), overlapped with training
and at most rollout.max_staleness steps behind the weights they train.

A round is one global batch of rollout.prompts_per_step prompts x G samples; a step takes one, or
more under dynamic sampling. Training rank 0 asks for rounds ahead of need: before it takes a round
it makes sure 1 + k x R are asked for (k = rollout.max_staleness, R the rounds the previous step
took; fewer near the run's end), so while the trainer learns from step n's rounds the rollout
processes generate those of step n + k; the first are asked for before the first evaluation. A
rollout process answers the messages of the bridge in order: a round is generated with the last
weights it received, and their version (the training step they come out of) travels with its
samples. Step s trains on weights version s, so a round's staleness is s minus its version; a round
staler than k (a step took fewer rounds than the one before) is dropped and counted
(``rollout/stale_dropped``). With k = 0 each round is asked for after the weights of the step before
it are sent: the rollouts are on-policy, as colocated.

The prompts of the rounds asked for come from a second sampler (``lookahead``) that replays the
trainer's: the trainer draws each round's prompts when it takes the round, so its sampler (the one in
checkpoints) counts the rounds trained on, not those in flight. A resumed run asks again for the
rounds in flight at its checkpoint (the same prompts and sample keys, generated with the checkpoint's
weights, sent to the rollout processes before anything else). Each sample's random stream is the
round's (seed, sampler epoch, sampler position) and its place in the global batch, so the samples do
not depend on the number of rollout processes.

Rewards are computed on the rollout processes: they hold the text, and the verifier's time then
overlaps training as generation does. With env.name the rollout processes run the conversations
(``sample_and_score``, as colocated rollouts), their environments on the rollout processes' worker
threads; each sample's env/* counts travel with it.

With rl.old_logprobs = recompute, the old log-probs are the training engine's at its current weights
(version s) before the step's first update, not those of the weights that generated the round
(version s - staleness): CISPO's importance weight then measures pi_theta / pi_recomputed, and the
mismatch/* metrics measure the staleness gap together with the engines' numerical gap. With
rl.old_logprobs = rollout, the IS weight measures pi_theta against the generating weights themselves.
"""

from __future__ import annotations

import functools
import signal
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from megacispo.config import Config
from megacispo.data.padding import pad_right
from megacispo.data.prompts import PromptRecord, PromptSampler
from megacispo.data.rewards import RewardScores
from megacispo.models.config import ADAPTERS, ALL_WEIGHTS
from megacispo.parallel.layout import ParallelConfig, destroy_distributed, init_distributed
from megacispo.rollout.episodes import Environments, Scoring, sample_and_score
from megacispo.rollout.generate import Samples, generate, sample_keys
from megacispo.rollout.placement import Bridge, RolloutProcessLost, Side
from megacispo.rollout.weight_sync import WeightsHeader, publish_weights, receive_weights
from megacispo.training.engine import build_inference_model


@dataclass
class RoundRequest:
    """Training rank 0 asks the rollout processes for a round."""

    stream: tuple[int, ...]
    """The round's random stream: (seed, sampler epoch, sampler position) before its prompts were drawn."""
    records: list[PromptRecord]
    """The global batch of prompts; rollout process j takes the j-th of K equal shares."""


@dataclass
class RoundShare:
    """One rollout process's share of a round."""

    version: int
    """The training step whose weights generated it."""
    samples: Samples
    """G samples of each prompt of the share, prompt-major, on the host."""
    scores: RewardScores
    """Their rewards."""
    env_metrics: list[dict[str, float]]
    """Multi-turn: each sample's env/* counts (empty single-turn)."""


@dataclass
class StopRollouts:
    """The run is over: the rollout processes exit after the requests before this one."""


# -- the rollout processes --------------------------------------------------------------------------


def run_rollout_process(config: Config, tokenizer, bridge: Bridge) -> None:
    """A rollout process, once ``start_placement`` has started its side: Megatron-Core at TP = PP = EP = 1
    over the rollout processes, then the bridge's messages answered in order until StopRollouts.
    SIGTERM is left to the training processes, which stop after the step in flight and then send
    StopRollouts."""
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    whole = ParallelConfig(distributed_timeout_minutes=config.parallel.distributed_timeout_minutes)
    init_distributed(whole, config.train.seed, config.precision.fp32_matmul)
    model = build_inference_model(config.model, config.precision.params_dtype, whole, config.lora)
    _serve(config, tokenizer, bridge, model)
    destroy_distributed()


def _serve(config: Config, tokenizer, bridge: Bridge, model) -> None:
    """Weights into ``model``, rounds generated with the last weights received, until StopRollouts."""
    scoring = Scoring.from_config(config.rl)
    environments = Environments.build(config.env, tokenizer, config.data.chat_template, config.max_prompt_tokens)
    version = -1
    while True:
        message = bridge.broadcast_object(what="the next message (a round's request, the weights or the stop)")
        if isinstance(message, WeightsHeader):
            receive_weights(model, bridge, message)
            version = message.version
        elif isinstance(message, RoundRequest):
            share = _generate_share(config, tokenizer, model, scoring, environments, bridge, message, version)
            bridge.send_object(share)
        else:
            break
    bridge.flush()


def _generate_share(config: Config, tokenizer, model, scoring: Scoring, environments: Environments | None,
                    bridge: Bridge, request: RoundRequest, version: int) -> RoundShare:
    group_size = config.rollout.group_size
    share = len(request.records) // bridge.num_rollout
    first = (bridge.rank - 1) * share
    repeated = [record for record in request.records[first:first + share] for _ in range(group_size)]
    samples, scores, env_metrics = sample_and_score(
        functools.partial(generate, model), repeated, config.rollout, tokenizer=tokenizer, scoring=scoring,
        environments=environments,
        keys=sample_keys(request.stream, range(first, first + share), group_size, device=bridge.device),
        lockstep_group=None)
    return RoundShare(version, samples.to("cpu"), scores, env_metrics)


# -- the training processes -------------------------------------------------------------------------


@dataclass
class Round:
    """A whole round, as every training rank receives it: the shares of the rollout processes in order."""

    stream: tuple[int, ...]
    """The RoundRequest's stream."""
    version: int
    """The training step whose weights generated it."""
    samples: Samples
    """G samples of each prompt of the global batch, prompt-major, on the training device."""
    scores: RewardScores
    """Their rewards."""
    env_metrics: list[dict[str, float]]
    """Multi-turn: each sample's env/* counts (empty single-turn)."""


class RemoteRollouts:
    """The training side of the rollout processes: asks for rounds ahead, takes them in order within
    rollout.max_staleness, and sends the weights after each step. Every training rank makes the same
    calls; only training rank 0 talks to the rollout processes."""

    def __init__(self, config: Config, side: Side, records: list[PromptRecord], pad_id: int, device: torch.device):
        self.config = config
        self.bridge = side.bridge
        self.pad_id = pad_id
        self.device = device
        self.lookahead = PromptSampler(records, seed=config.train.seed)
        self.requested: list[tuple[int, ...]] = []
        """The streams of the rounds asked for and not yet taken, oldest first (training rank 0)."""
        self._staleness: list[int] = []
        self._rounds_per_step = 1
        self._dropped = 0
        self._sync_s = 0.0
        self._base_published = False

    def start(self, module: torch.nn.Module, version: int, sampler_state: dict) -> None:
        """Before the first step: the rounds are asked for from the trainer's sampler position, after the
        weights of ``version`` (the step the trainer starts from) reach the rollout processes."""
        self.lookahead.load_state_dict(sampler_state)
        self.publish(module, version)
        if self.bridge is not None:
            self._ask_ahead(version)

    def publish(self, module: torch.nn.Module, version: int) -> None:
        """Send the weights of step ``version`` (every training rank; see weight_sync.publish_weights): with LoRA,
        after the first sync, the adapters alone (the base is frozen)."""
        start = time.perf_counter()
        weights = ADAPTERS if self.config.lora.enabled and self._base_published else ALL_WEIGHTS
        publish_weights(module, self.bridge, version, weights=weights)
        self._base_published = True
        self._sync_s += time.perf_counter() - start

    def take(self, sampler: PromptSampler, step: int, dp_rank: int, quota: int) -> tuple[
            list[PromptRecord], Samples, RewardScores, list[dict[str, float]]]:
        """This data-parallel rank's share (``quota`` prompts) of the next round within staleness, its
        prompts drawn from the trainer's ``sampler`` as the round's were: their samples, rewards and
        (multi-turn) env/* counts."""
        group_size, max_staleness = self.config.rollout.group_size, self.config.rollout.max_staleness
        while True:
            round_ = self._next_round(step)
            stream = (self.config.train.seed, sampler.epoch, sampler.position)
            records = sampler.next_batch(self.config.rollout.prompts_per_step)
            assert stream == round_.stream, "the lookahead sampler replays the trainer's"
            staleness = step - round_.version
            if staleness <= max_staleness:
                break
            self._dropped += len(round_.scores.rewards)
        self._staleness.append(staleness)
        rows = slice(dp_rank * quota * group_size, (dp_rank + 1) * quota * group_size)
        return (records[dp_rank * quota:(dp_rank + 1) * quota], round_.samples.select(rows),
                round_.scores.select(rows), round_.env_metrics[rows])

    def finish_step(self) -> dict[str, float]:
        """After a step: its metrics (the staleness of the rounds it took, the samples dropped as too
        stale and the time the training ranks spent sending weights); the rounds it took set how far
        ahead the next steps ask."""
        self._rounds_per_step = max(len(self._staleness), 1)
        metrics = {
            "rollout/staleness_mean": sum(self._staleness) / max(len(self._staleness), 1),
            "rollout/staleness_max": float(max(self._staleness, default=0)),
            "rollout/stale_dropped": float(self._dropped),
            "perf/weight_sync_s": self._sync_s,
        }
        self._staleness, self._dropped, self._sync_s = [], 0, 0.0
        return metrics

    def close(self) -> None:
        """After the last step (or SIGTERM): the rollout processes stop once they have answered what was
        asked of them (at most 1 + k x R rounds, what a stop waits for), which is received and dropped
        so that no send is left waiting."""
        if self.bridge is None:
            return
        self.bridge.broadcast_object(StopRollouts())
        for _ in self.requested:
            self._receive_shares()
        self.requested = []
        self.bridge.flush()

    def _next_round(self, step: int) -> Round:
        """The oldest round asked for (asking for more first), on every training rank."""
        outcome: list = [None]
        if self.bridge is not None:
            try:
                self._ask_ahead(step)
                outcome[0] = self._receive_round()
            except RolloutProcessLost as error:
                outcome[0] = error
        dist.broadcast_object_list(outcome, src=0)
        if isinstance(outcome[0], RolloutProcessLost):
            raise outcome[0]
        round_ = outcome[0]
        round_.samples = round_.samples.to(self.device)
        return round_

    def _ask_ahead(self, step: int) -> None:
        """Ask for rounds until 1 + rollout.max_staleness x (the previous step's rounds) are in flight,
        none for steps beyond the run's last."""
        ahead = min(self.config.rollout.max_staleness, self.config.train.steps - step - 1) * self._rounds_per_step
        while len(self.requested) < 1 + ahead:
            stream = (self.config.train.seed, self.lookahead.epoch, self.lookahead.position)
            records = self.lookahead.next_batch(self.config.rollout.prompts_per_step)
            self.bridge.broadcast_object(RoundRequest(stream, records))
            self.requested.append(stream)

    def _receive_round(self) -> Round:
        shares = self._receive_shares()
        versions = {share.version for share in shares}
        assert len(versions) == 1, "every rollout process answers the same messages in the same order"
        return Round(self.requested.pop(0), versions.pop(), concat_samples([s.samples for s in shares], self.pad_id),
                     RewardScores.concat([s.scores for s in shares]), [m for s in shares for m in s.env_metrics])

    def _receive_shares(self) -> list[RoundShare]:
        return [self.bridge.receive_object(rank, "its share of a round")
                for rank in range(1, self.bridge.num_rollout + 1)]


def concat_samples(parts: list[Samples], pad_id: int) -> Samples:
    """The rows of ``parts`` in order, right-padded to the longest (tokens with ``pad_id``, the rest with 0)."""
    width = max(part.tokens.shape[1] for part in parts)
    fields = {}
    for name in Samples.__dataclass_fields__:
        tensors = []
        for part in parts:
            tensor = getattr(part, name)
            if tensor.dim() > 1:
                # [n, S] and [n, S - 1] alike: the columns the part's tokens lack.
                extra = width - part.tokens.shape[1]
                tensor = pad_right(tensor, tensor.shape[1] + extra, pad_id if name == "tokens" else 0)
            tensors.append(tensor)
        fields[name] = torch.cat(tensors)
    return Samples(**fields)
