"""The RL loop. One step:

    prompts -> rollouts (G samples each) -> rewards -> overlong shaping -> group-relative advantages
    -> dynamic sampling -> old log-probs (recomputed by the training engine) -> K mini-batch updates
    with the policy loss from the registry -> metrics -> periodic checkpoint

SIGTERM (a cluster's preemption, reaching any rank directly or through torchrun) stops the run
promptly with the last completed step saved. The ranks agree on it at points every rank passes in
the same order: before each step, before every decode step of its rollouts and before its updates.
Up to its updates a step changes nothing a checkpoint holds but the sampler position and the RNG
states, so a step stopped there is abandoned (those two go back to where it began) and the previous
step is saved. Once the updates have begun the step finishes and is saved: its weights have moved.
Before the first step of a fresh run completes nothing is saved: nothing was trained.
"""

from __future__ import annotations

import contextlib
import datetime
import functools
import signal
from dataclasses import dataclass, field
from pathlib import Path
from typing import Sequence

import torch
import torch.distributed as dist
from tqdm import tqdm

from megacispo.checkpoint.distributed import (
    LORA_BASE_STATE,
    CheckpointError,
    capture_rng,
    load_checkpoint,
    restore_rng,
    save_checkpoint,
)
from megacispo.checkpoint.hf import load_start_weights
from megacispo.config import Config, to_dict
from megacispo.data.padding import pad_right, right_padding_mask
from megacispo.data.prompts import PromptRecord, PromptSampler, prompt_token_ids
from megacispo.data.rewards import RewardFailureError, RewardScores
from megacispo.data.tokenizer import Tokenizer
from megacispo.envs.turns import sum_metrics
from megacispo.evaluation.evaluator import Evaluator
from megacispo.metrics.logger import MetricsLogger, Timer, moe_load_balance, pearson_correlation
from megacispo.models.lora import base_fingerprint, same_base
from megacispo.models.routing import RoutingTargets, disagreement_metrics, route_dtype
from megacispo.parallel.layout import broadcast_from_last_stage
from megacispo.rl import adaptive_clip
from megacispo.rl.advantages import dynamic_sampling_keep_mask, group_relative_advantages, overlong_penalty
from megacispo.rl.losses import Sequences, compute_global_counts, compute_policy_loss, reduce_metrics
from megacispo.rl.metric_hooks import MetricHook, UpdateMicroBatch
from megacispo.rl.rollout_correction import correct_rollout, max_abs_logprob_diff, mismatch_metrics, mismatch_sums
from megacispo.rl.start import RunStart, checkpoint_root
from megacispo.rollout.episodes import Environments, Scoring, sample_and_score
from megacispo.rollout.generate import Generator, Samples, generate, sample_keys
from megacispo.rollout.remote import RemoteRollouts, concat_samples
from megacispo.rollout.vllm_engine import PROBE_NEW_TOKENS, PROBE_SEQUENCES, VllmRollouts, probe_sequences
from megacispo.training.balance import Balance, exchange_rows, token_spread
from megacispo.training.engine import Engine
from megacispo.training.packing import PackedRow

# The extra_state key of the adapted clip bounds in a checkpoint.
ADAPTIVE_CLIP_STATE = "adaptive_clip"
# What a SIGTERM line says when the stop comes before a fresh run's first step completes.
NOTHING_TRAINED = "nothing was trained, so nothing was saved"


@dataclass
class TrainBatch:
    """Sequences with everything the loss needs; [n, S - 1] tensors are per predicted token. A step's
    batch holds one right-padded sequence per row. A packed micro-batch (``packed``) holds this rank's
    w positions of one row of several sequences end to end (megacispo.training.packing; w = W without
    context parallelism), every tensor [1, w, ...] per position, ``targets`` the tokens predicted."""

    tokens: torch.Tensor
    """[n, S] prompt + response + padding."""
    loss_mask: torch.Tensor
    """[n, S - 1] 1.0 on response tokens."""
    advantages: torch.Tensor
    """[n] one advantage per sample."""
    rollout_logprobs: torch.Tensor
    """[n, S - 1] log-probs reported by the sampler."""
    old_logprobs: torch.Tensor | None = None
    """[n, S - 1] log-probs of pi_old as the training engine computes them."""
    padding_mask: torch.Tensor | None = None
    """[n, S] bool, True after each sequence's end; None: no padding."""
    token_weights: torch.Tensor | None = None
    """[n, S - 1] detached factors of each token's loss (rl.rollout_correction.mode = tis); None: 1."""
    routes: torch.Tensor | None = None
    """[n, S, L, k] the experts the rollout routed each token to in this stage's MoE layers (Samples.routes)."""
    packed: PackedRow | None = None
    """Where the sequences of a packed micro-batch lie in its row; None: one sequence per row."""
    targets: torch.Tensor | None = None
    """[1, w] a packed micro-batch's token predicted at each position; None: ``tokens`` shifted by one."""
    route_masks: tuple[torch.Tensor, torch.Tensor] | None = None
    """[1, w] bool a packed micro-batch's ``rollout_route_masks``; None: taken from the rows."""

    def __len__(self) -> int:
        return self.tokens.shape[0]

    def slice(self, start: int, stop: int) -> TrainBatch:
        assert self.packed is None, "a packed row holds whole sequences: slice the batch it was packed from"
        return TrainBatch(*(None if value is None else value[start:stop] for value in vars(self).values()))

    @property
    def sequences(self) -> Sequences:
        """Which sequence each predicted token belongs to, for the loss."""
        return Sequences.rows(self.loss_mask) if self.packed is None else self.packed.sequences

    @property
    def predicted(self) -> torch.Tensor:
        """The token each position of the loss tensors predicts."""
        return self.tokens[:, 1:] if self.targets is None else self.targets


@dataclass
class GroupSamples:
    """One prompt's G samples of a step, with their advantages."""

    samples: Samples
    advantages: torch.Tensor
    """[G] group-relative advantages."""


@dataclass
class RolloutTally:
    """What a step's rollout rounds add up on this rank, for its rollout/* metrics."""

    rewards: list[torch.Tensor] = field(default_factory=list)
    """Each round's rewards, before overlong shaping."""
    lengths: list[torch.Tensor] = field(default_factory=list)
    """Each round's response lengths."""
    truncated: float = 0.0
    """Samples stopped by early truncation."""
    failures: float = 0.0
    """Samples whose verifier failed."""
    late: float = 0.0
    """Of them, samples whose reward or environment call ran out of time."""
    not_called: float = 0.0
    """Of them, samples whose reward the circuit breaker left out (megacispo.data.rewards.RewardPool)."""
    first_failure: str = ""
    """The first verifier failure's text (empty: none)."""
    env_sums: dict[str, float] = field(default_factory=dict)
    """Multi-turn: the env/* counts summed over the rounds' samples (Conversations.sample_metrics)."""
    groups: float = 0.0
    """Prompt groups sampled."""
    dropped: float = 0.0
    """Groups dynamic sampling dropped."""


def rollout_route_masks(batch: TrainBatch) -> tuple[torch.Tensor, torch.Tensor]:
    """[n, S] bool, of right-padded rows: the positions the rollout routed (it fed back every token of a
    sequence but its last) and the response tokens."""
    padding = batch.padding_mask
    real = torch.ones_like(batch.tokens, dtype=torch.bool) if padding is None else ~padding
    recorded = torch.cat([real[:, 1:], torch.zeros_like(real[:, :1])], dim=1)
    # Token t + 1 is a response token where loss_mask[t] is set.
    response = torch.cat([torch.zeros_like(real[:, :1]), batch.loss_mask != 0], dim=1)
    return recorded, response


def routing_targets(micro: TrainBatch, *, compare: bool, replay: bool) -> RoutingTargets | None:
    """What a training forward of ``micro`` does with the rollout's experts (micro.routes): compare them
    with its routers' own at the response tokens (``compare``: the old-log-prob pass, for
    mismatch/router_disagreement), replay them (``replay``: rl.routing_replay). None: neither."""
    if not (compare or replay):
        return None
    recorded, response = rollout_route_masks(micro) if micro.route_masks is None else micro.route_masks
    return RoutingTargets(micro.routes, recorded, recorded & response if compare else None, replay)


class StepAbandoned(Exception):
    """Every rank agreed on SIGTERM before the step's updates: nothing of the step is kept."""


class ExpertLoadTracker:
    """Counts the tokens each expert of every MoE layer is routed during training passes.

    A forward hook on each layer's router reads its routing map [tokens, experts] (padding left
    out, as the router's load-balancing loss leaves it out); ``collect`` sums
    the counts over all ranks (each rank holds its own tokens: data-parallel shards, and
    sequence-parallel shards under TP; its pipeline stage's layers only) and resets them.
    """

    def __init__(self, model, num_layers: int, num_experts: int):
        # Beside the routers' weights: the routing maps are counted there, and collectives take them there.
        device = model.decoder.layers[0].mlp.router.weight.device
        self.counts = torch.zeros(num_layers, num_experts, dtype=torch.float64, device=device)
        for layer in model.decoder.layers:
            layer.mlp.router.register_forward_hook(self._hook(layer.layer_number - 1))

    def _hook(self, layer_index: int):
        def count(module, inputs, outputs):
            if torch.is_grad_enabled():  # the update passes, not old-logprob or rollout passes
                _, routing_map = outputs  # [s * b, experts], tokens in [s, b] order
                padding_mask = inputs[1] if len(inputs) > 1 else None  # [s, b], True at padding
                if padding_mask is not None:
                    routing_map = routing_map & ~padding_mask.reshape(-1, 1)
                self.counts[layer_index] += routing_map.sum(dim=0).double()

        return count

    def collect(self) -> dict[str, float]:
        counts = self.counts.clone()
        dist.all_reduce(counts)
        self.counts.zero_()
        return moe_load_balance(counts)


class Trainer:
    """Runs the RL steps of ``config`` on this rank."""

    def __init__(self, config: Config, engine: Engine, tokenizer: Tokenizer,
                 train_records: list[PromptRecord], test_records: list[PromptRecord], logger: MetricsLogger,
                 prompt_metrics: dict[str, float] | None = None, remote_rollouts: RemoteRollouts | None = None,
                 metric_hooks: Sequence[MetricHook] = ()):
        """remote_rollouts: the rollout processes' samples (placement.rollout_ranks); None: this rank generates.
        metric_hooks: what the updates measure beyond the loss (logging.metric_hooks, built at start-up)."""
        self.config = config
        self.engine = engine
        self.tokenizer = tokenizer
        self.test_records = test_records
        self.logger = logger
        # What loading did to the prompts (data/*: skipped or truncated for length), logged with the first evaluation.
        self.prompt_metrics = prompt_metrics or {}
        self.scoring = Scoring.from_config(config.rl, self._stop_pending)
        # env.name: every sample is a conversation with its own environment; None: single-turn.
        self.environments = Environments.build(config.env, tokenizer, config.data.chat_template,
                                               config.max_prompt_tokens)
        self.sampler = PromptSampler(train_records, seed=config.train.seed)
        # The one source of this rank's process groups; the world (every training rank) is torch's default group.
        self.dp_group, self.pp_group = engine.groups.dp, engine.groups.pp
        self.dp_rank, self.dp_size = dist.get_rank(self.dp_group), dist.get_world_size(self.dp_group)
        self.expert_load = ExpertLoadTracker(engine.module, config.model.num_layers, config.model.num_experts)
        self.step = 0
        self.num_skipped_updates = 0
        self.consumed_samples = 0
        self._stop_requested = False
        self.stopped_by_signal = False
        self._saved_step: int | None = None
        self.remote_rollouts = remote_rollouts
        self.rollout_progress: tqdm | None = None
        # rl.adaptive_clip: the loss's clip bounds, moved after every optimizer step; None: fixed.
        self.adaptive_clip = adaptive_clip.from_config(config.rl.adaptive_clip, config.rl.loss)
        self.metric_hooks = list(metric_hooks)
        self.train_records = train_records
        # rollout.engine = vllm: vLLM in this process (``start_vllm``); None: megacispo's engine generates.
        self.vllm: VllmRollouts | None = None

    @property
    def generator(self) -> Generator:
        """What generates this rank's rollouts and evaluations: vLLM (rollout.engine = vllm) or megacispo's engine."""
        return functools.partial(generate, self.engine.module) if self.vllm is None else self.vllm.generate

    def start_vllm(self) -> None:
        """rollout.engine = vllm, after ``start``: vLLM started in this process and given the weights the run
        starts from (checked: WeightSyncError on every rank when they are not the trainer's)."""
        config = self.config
        prompts = [prompt_token_ids(self.tokenizer, record) for record in self.train_records[:PROBE_SEQUENCES]]
        new_tokens = min(PROBE_NEW_TOKENS, config.rollout.max_new_tokens)
        probe = probe_sequences(prompts, self.tokenizer.vocab_size, new_tokens, config.train.seed)
        self.vllm = VllmRollouts.start(config.model, config.rollout, probe=probe, seed=config.train.seed,
                                       max_model_len=config.max_prompt_tokens + config.rollout.max_new_tokens,
                                       timeout=datetime.timedelta(minutes=config.parallel.distributed_timeout_minutes))
        metrics = self._sync_vllm(self.step)
        self._say(f"rollout.engine = vllm: started, weights of step {self.step} sent in "
                  f"{metrics['perf/weight_sync_s']:.2f} s (probe log-probs within "
                  f"{metrics['rollout/vllm_probe_max_abs_diff']:.2g} of the trainer's)")

    # -- the loop -------------------------------------------------------------------------------

    def fit(self) -> dict[str, float]:
        """Train to config.train.steps; returns the greedy held-out accuracy before and after (NaN without
        one). Every evaluation logs all the eval section's metrics, the first with the prompt counts."""
        signal.signal(signal.SIGTERM, self._request_stop)
        accuracy = {"before": self._log_evaluation(self.prompt_metrics)}
        while self.step < self.config.train.steps and not self._stop_agreed():
            try:
                with self._step_progress():
                    metrics = self.rl_step()
            except StepAbandoned:
                break
            self.step += 1
            self.logger.log(self.step, metrics, consumed_samples=self.consumed_samples)
            every = self.config.train.eval_every
            if every and self.step % every == 0 and self.step < self.config.train.steps:
                self._log_evaluation()
            if self.config.train.checkpoint_every and self.step % self.config.train.checkpoint_every == 0:
                self.save()
        # A fresh run stopped before its first step has trained nothing (and the distributed optimizer
        # holds no state to save before its first step).
        if self.step > 0:
            self.save()
        if self.stopped_by_signal:
            return {**accuracy, "after": float("nan")}
        accuracy["after"] = self._log_evaluation()
        return accuracy

    @contextlib.contextmanager
    def _step_progress(self):
        """The step's one progress bar, drawn on the logging rank: every rollout round of the step
        (dynamic sampling may take several) counts its samples on it; the step's line replaces it."""
        with tqdm(total=0, desc=f"step {self.step + 1} rollout", unit="sample", leave=False,
                  disable=not self.logger.enabled) as self.rollout_progress:
            yield
        self.rollout_progress = None

    def rl_step(self) -> dict[str, float]:
        """One step; StepAbandoned when SIGTERM is agreed before its updates."""
        timer = Timer(self.engine.device)
        with self._abandonable():
            with timer("rollout"):
                batch, rollout_metrics = self.collect_rollouts()
            if self.vllm is not None:
                self.vllm.release_memory()
            with timer("old_logprobs"):
                batch.old_logprobs = self.compute_old_logprobs(batch)
            self._abandon_if_stopped()
        rollout_metrics.update(self.correct_rollout_gap(batch))
        with timer("update"):
            update_metrics = self.update(batch)
        update_metrics.update(self.expert_load.collect())
        if self.remote_rollouts is not None:
            self.remote_rollouts.publish(self.engine.module, self.step + 1)
            update_metrics.update(self.remote_rollouts.finish_step())
        if self.vllm is not None:
            update_metrics.update(self._sync_vllm(self.step + 1))
        timings = timer.metrics()
        num_tokens = self._all_reduce(float(batch.loss_mask.sum()))
        timings["perf/tokens_per_s"] = num_tokens / sum(timings.values())
        self.consumed_samples += len(batch) * self.dp_size
        return {**rollout_metrics, **update_metrics, **timings}

    # -- rollouts -------------------------------------------------------------------------------

    def collect_rollouts(self) -> tuple[TrainBatch, dict[str, float]]:
        """Sample until this rank holds rollout.prompts_per_step / DP groups with informative rewards.

        Every DP rank draws the same global prompt batch and takes its slice, so the sampler state
        stays identical across ranks (and in checkpoints). If dynamic sampling has not filled the
        batch after rollout.max_sampling_rounds, dropped groups top it up: their advantages are 0,
        so they add no gradient, and every rank keeps the same batch size.
        """
        rollout = self.config.rollout
        group_size = rollout.group_size
        quota = rollout.prompts_per_step // self.dp_size
        kept: list[GroupSamples] = []
        spare: list[GroupSamples] = []
        tally = RolloutTally()
        for _ in range(rollout.max_sampling_rounds):
            if self.remote_rollouts is None:
                records = self.sampler.next_batch(quota * self.dp_size)[self.dp_rank * quota:(self.dp_rank + 1) * quota]
                samples, scores, env_metrics = self._sample(records)
            else:
                records, samples, scores, env_metrics = self.remote_rollouts.take(self.sampler, self.step,
                                                                                  self.dp_rank, quota)
            tally.env_sums = sum_metrics([tally.env_sums, *env_metrics])
            rewards = self._shape_rewards(samples, scores, tally)
            self._check_reward_health(tally)
            advantages = group_relative_advantages(rewards, group_size, eps=self.config.rl.advantage_eps)
            keep = dynamic_sampling_keep_mask(rewards, group_size) if rollout.dynamic_sampling else torch.ones_like(rewards, dtype=torch.bool)
            keep_flags = keep.tolist()  # one copy to the host for all the groups
            for group in range(len(records)):
                rows = slice(group * group_size, (group + 1) * group_size)
                group_samples = GroupSamples(samples.select(rows), advantages[rows])
                (kept if keep_flags[rows.start] else spare).append(group_samples)
            tally.groups += len(records)
            tally.dropped += keep_flags.count(False) / group_size
            if self._all_reduce(len(kept), dist.ReduceOp.MIN) >= quota:
                break
        chosen = (kept + spare)[:quota]
        metrics = self._rollout_metrics(tally, chosen)
        batch = self._to_train_batch(chosen)
        if self.config.train.pack_sequences and self.config.train.balance_data_parallel and self.dp_size > 1:
            batch, metrics["perf/dp_token_spread"] = self._balance_over_dp(batch)
        return batch, metrics

    def _sample(self, records: list[PromptRecord]) -> tuple[Samples, RewardScores, list[dict[str, float]]]:
        """This rank's samples of ``records``, their rewards and (multi-turn) each one's env/* counts. The
        CP ranks of a data-parallel rank share its records: each generates and scores its own 1/CP of
        them, as a generation replica of its own (decoding does not split sequences), and they exchange
        the samples."""
        rollout, cp = self.config.rollout, self.engine.groups.cp
        share = len(records) // cp.size()
        mine = slice(cp.rank() * share, (cp.rank() + 1) * share)
        group_rows = slice(mine.start * rollout.group_size, mine.stop * rollout.group_size)
        records = records[mine]
        repeated = [r for r in records for _ in range(rollout.group_size)]
        samples, scores, env_metrics = sample_and_score(
            self.generator, repeated, rollout, tokenizer=self.tokenizer,
            keys=self._sample_keys(share * cp.size())[group_rows], scoring=self.scoring,
            environments=self.environments, lockstep_group=self.engine.groups.dp_cp, progress=self.rollout_progress,
            interrupt=self._abandon_if_stopped,
        )
        if cp.size() > 1:
            samples, scores, env_metrics = self._gather_over_cp(samples, scores, env_metrics)
        return samples, scores, env_metrics

    def _gather_over_cp(self, samples: Samples, scores: RewardScores, env_metrics: list[dict[str, float]]
                        ) -> tuple[Samples, RewardScores, list[dict[str, float]]]:
        """Every CP rank's samples, rewards and env/* counts of the data-parallel rank's records, in CP rank order."""
        cp = self.engine.groups.cp
        parts: list = [None] * cp.size()
        dist.all_gather_object(parts, (samples.to("cpu"), scores, env_metrics), group=cp)
        gathered = concat_samples([part for part, _, _ in parts], self.tokenizer.pad_id).to(self.engine.device)
        return (gathered, RewardScores.concat([part for _, part, _ in parts]),
                [counts for _, _, part in parts for counts in part])

    def _shape_rewards(self, samples: Samples, scores: RewardScores, tally: RolloutTally) -> torch.Tensor:
        """The rewards with overlong shaping, counted in ``tally``."""
        rewards = torch.tensor(scores.rewards, dtype=torch.float32, device=self.engine.device)
        tally.rewards.append(rewards.clone())
        if self.config.rl.overlong_max_length:
            rewards = rewards + overlong_penalty(samples.response_lengths, self.config.rl.overlong_max_length,
                                                 self.config.rl.overlong_cache_length, self.config.rl.overlong_penalty)
        tally.lengths.append(samples.response_lengths.float())
        tally.truncated += float(samples.truncated_early.sum())
        tally.failures += scores.num_failures
        tally.late += scores.num_late
        tally.not_called += scores.num_not_called
        tally.first_failure = tally.first_failure or scores.first_failure
        return rewards

    def _sample_keys(self, num_prompts: int) -> torch.Tensor:
        """The random streams of this rank's samples of the prompts just drawn: from the seed, the step,
        the sampler's position (a new one for each sampling round) and each sample's place in the
        global batch. The same on the ranks of a TP group (they must draw the same tokens), the same
        samples at any data-parallel size, and a resumed run draws what the uninterrupted run would have."""
        stream = (self.config.train.seed, self.step, self.sampler.epoch, self.sampler.position)
        first = self.dp_rank * num_prompts
        return sample_keys(stream, range(first, first + num_prompts), self.config.rollout.group_size,
                           device=self.engine.device)

    def _to_train_batch(self, chosen: list[GroupSamples]) -> TrainBatch:
        width = self.engine.padded_length(max(group.samples.tokens.shape[1] for group in chosen))
        samples = [group.samples for group in chosen]
        return TrainBatch(
            tokens=torch.cat([pad_right(s.tokens, width, self.tokenizer.pad_id) for s in samples]),
            loss_mask=torch.cat([pad_right(s.loss_mask, width - 1) for s in samples]),
            advantages=torch.cat([group.advantages for group in chosen]),
            rollout_logprobs=torch.cat([pad_right(s.rollout_logprobs, width - 1) for s in samples]),
            padding_mask=torch.cat([s.padding_mask(width) for s in samples]),
            routes=torch.cat([pad_right(s.routes, width) for s in samples]),
        )

    def _balance_over_dp(self, batch: TrainBatch) -> tuple[TrainBatch, float]:
        """``batch`` with its rows moved between the data-parallel ranks so that each rank's share of every
        mini-batch holds about equal tokens (megacispo.training.balance), and the fullest rank's tokens
        over the mean rank's after the move."""
        # Each rank's sequence lengths and its batch's width (rollouts of their own may pad rows wider).
        lengths = torch.cat([(~batch.padding_mask).sum(dim=1),
                             torch.tensor([batch.tokens.shape[1]], device=self.engine.device)])
        gathered = [torch.empty_like(lengths) for _ in range(self.dp_size)]
        dist.all_gather(gathered, lengths, group=self.dp_group)
        per_rank = [part.tolist() for part in gathered]  # one copy to the host per step
        width = max(part.pop() for part in per_rank)
        balance = Balance.plan(per_rank, self.config.rl.updates_per_rollout)
        all_lengths = [length for part in per_rank for length in part]
        new_width = self.engine.padded_length(max(all_lengths[index] for index in balance.new_rows[self.dp_rank]))
        # Per field: its width short of the tokens' (per predicted token: one less), its padding value.
        fields = {"tokens": (0, self.tokenizer.pad_id), "loss_mask": (1, 0), "rollout_logprobs": (1, 0),
                  "padding_mask": (0, True), "routes": (0, 0)}
        moved = exchange_rows([*(pad_right(getattr(batch, name), width - short, fill)
                                 for name, (short, fill) in fields.items()), batch.advantages],
                              balance, self.dp_group)
        trimmed = {name: values[:, :new_width - short] for (name, (short, _)), values in zip(fields.items(), moved)}
        spread = token_spread([[all_lengths[index] for index in rows] for rows in balance.new_rows])
        return TrainBatch(advantages=moved[-1], **trimmed), spread

    def _rollout_metrics(self, tally: RolloutTally, chosen: list[GroupSamples]) -> dict[str, float]:
        rewards = torch.cat(tally.rewards)
        lengths = torch.cat(tally.lengths)
        advantages = torch.cat([group.advantages for group in chosen])
        local = torch.tensor([
            float(rewards.sum()), float((rewards ** 2).sum()), float(rewards.numel()),
            float((rewards >= 1.0).sum()), float(lengths.sum()), tally.truncated, tally.failures,
            tally.groups, tally.dropped, float(advantages.sum()), float(advantages.abs().sum()),
            float(advantages.numel()),
        ], dtype=torch.float64, device=self.engine.device)
        dist.all_reduce(local, group=self.dp_group)
        (reward_sum, reward_sq, n, correct, length_sum, truncated, failures, groups, dropped,
         adv_sum, adv_abs, n_adv) = local.tolist()
        max_length = self._all_reduce(float(lengths.max()), dist.ReduceOp.MAX)
        mean = reward_sum / n
        env_metrics = self._env_metrics(tally, n) if self.environments is not None else {}
        return {**env_metrics,
            "rollout/reward_mean": mean,
            "rollout/reward_std": max(reward_sq / n - mean ** 2, 0.0) ** 0.5,
            "rollout/accuracy": correct / n,
            "rollout/response_length_mean": length_sum / n,
            "rollout/response_length_max": max_length,
            "rollout/early_truncated_frac": truncated / n,
            "rollout/reward_failures": failures,
            "rollout/reward_failure_frac": failures / n,
            "rollout/dynamic_sampling_dropped_frac": dropped / max(groups, 1.0),
            "advantage/mean": adv_sum / n_adv,
            "advantage/abs_mean": adv_abs / n_adv,
        }

    def _env_metrics(self, tally: RolloutTally, num_samples: float) -> dict[str, float]:
        """env/*: each of the step's conversation sums over the data-parallel ranks, per sample (the
        environments' own counts have names only they know: the ranks exchange them by name)."""
        parts: list = [None] * self.dp_size
        dist.all_gather_object(parts, tally.env_sums, group=self.dp_group)
        totals = sum_metrics(parts)
        return {name: value / num_samples for name, value in sorted(totals.items())}

    def _check_reward_health(self, tally: RolloutTally) -> None:
        """Stop when the verifier failed on too many of the step's samples so far, checked after each
        sampling round: a reward that fails a round stops the run there, not rollout.max_sampling_rounds
        rounds later. The counts are reduced over the data-parallel ranks, so every rank stops at the
        same round."""
        counts = torch.tensor([tally.failures, tally.late, tally.not_called, float(sum(map(len, tally.rewards)))],
                              dtype=torch.float64, device=self.engine.device)
        dist.all_reduce(counts, group=self.dp_group)
        failures, late, not_called, samples = counts.tolist()
        failure_frac = failures / samples
        if failure_frac <= self.config.rl.max_reward_failure_frac:
            return
        first_failures: list = [None] * self.dp_size
        dist.all_gather_object(first_failures, tally.first_failure, group=self.dp_group)
        time_limits = f"rl.reward_timeout_s = {self.config.rl.reward_timeout_s:g} s"
        if self.environments is not None:
            time_limits += f" or env.timeout_s = {self.config.env.timeout_s:g} s"
        raise RewardFailureError(self.config.rl.reward, failure_frac, self.config.rl.max_reward_failure_frac,
                                 next(text for text in first_failures if text), late=round(late),
                                 not_called=round(not_called), time_limits=time_limits)

    def correct_rollout_gap(self, batch: TrainBatch) -> dict[str, float]:
        """The gap between the rollout's log-probs and the training engine's old log-probs, measured
        (mismatch/*, over every data-parallel rank) and corrected as rl.rollout_correction says: the
        batch's loss mask loses the tokens MIS drops, its token weights become TIS's."""
        old, rollout, mask = batch.old_logprobs, batch.rollout_logprobs, batch.loss_mask
        settings = self.config.rl.rollout_correction
        correction = correct_rollout(old, rollout, mask, settings.mode, settings.threshold_low,
                                     settings.threshold_high)
        sums = torch.cat([mismatch_sums(old, rollout, mask), correction.num_dropped.double()[None]])
        dist.all_reduce(sums, group=self.dp_group)
        max_abs_diff = self._all_reduce(float(max_abs_logprob_diff(old, rollout, mask)), dist.ReduceOp.MAX)
        metrics = mismatch_metrics(sums[:-1], max_abs_diff)
        metrics["mismatch/correction_masked_frac"] = float(sums[-1]) / max(float(sums[-2]), 1.0)
        response = mask.bool()
        rollout_probs, train_probs = self._gather_over_dp(rollout[response].exp(), old[response].exp())
        metrics["mismatch/train_rollout_prob_corr"] = pearson_correlation(rollout_probs, train_probs)
        if self.vllm is None:  # vLLM records no experts to compare with
            metrics.update(self._router_gap(batch))
        batch.loss_mask, batch.token_weights = correction.loss_mask, correction.token_weights
        return metrics

    def _router_gap(self, batch: TrainBatch) -> dict[str, float]:
        """mismatch/router_disagreement (overall and per layer) from the old-log-prob forward's counts,
        added over every rank (each counts its own tokens in its own stage's layers), and the memory
        the recorded experts take per sample (rollout/routes_bytes_per_sample, all layers)."""
        counts = self.engine.module.take_route_counts()
        dist.all_reduce(counts)
        metrics = disagreement_metrics(counts)
        real_tokens = self._all_reduce(float((~batch.padding_mask).sum()))
        per_token = self.config.model.num_layers * batch.routes.shape[-1] * batch.routes.element_size()
        metrics["rollout/routes_bytes_per_sample"] = real_tokens * per_token / (len(batch) * self.dp_size)
        return metrics

    def _forward(self, model, micro: TrainBatch, *, compare_routes: bool) -> torch.Tensor:
        """The model's final hidden states for ``micro``: its routing as ``routing_targets`` says under
        rl.routing_replay (``compare_routes``: the old-log-prob pass), its sequences' boundaries when packed."""
        routing = routing_targets(micro, compare=compare_routes, replay=self.config.rl.routing_replay)
        return model(micro.tokens, return_hidden_states=True, padding_mask=micro.padding_mask, routing=routing,
                     packed_seq_params=None if micro.packed is None else micro.packed.packed_seq_params)

    # -- training-engine passes ---------------------------------------------------------------------

    def _micro_batches(self, batch: TrainBatch) -> list[TrainBatch]:
        """The micro-batches of one pass over ``batch``: packed rows of train.max_tokens_per_micro_batch
        tokens, as many on every data-parallel rank (train.pack_sequences), or train.micro_batch_size
        right-padded rows."""
        train = self.config.train
        if not train.pack_sequences:
            size = train.micro_batch_size
            return [batch.slice(i, i + size) for i in range(0, len(batch), size)]
        lengths = (~batch.padding_mask).sum(dim=1).tolist()  # one copy to the host per pass
        rows = self.engine.packed_rows(lengths, batch.tokens.shape[1])
        route_masks = rollout_route_masks(batch)
        return [self._packed(batch, row, route_masks) for row in rows]

    def _packed(self, batch: TrainBatch, row: PackedRow, route_masks: tuple[torch.Tensor, torch.Tensor]) -> TrainBatch:
        """The micro-batch of ``row`` on this rank: the batch's tensors gathered into it."""

        def pack(values: torch.Tensor | None, fill: float = 0.0) -> torch.Tensor | None:
            return None if values is None else row.pack(values, fill)

        return TrainBatch(
            tokens=row.pack(batch.tokens, self.tokenizer.pad_id),
            loss_mask=pack(batch.loss_mask),
            advantages=pack(batch.advantages[:, None].expand_as(batch.loss_mask)),
            rollout_logprobs=pack(batch.rollout_logprobs),
            old_logprobs=pack(batch.old_logprobs),
            padding_mask=row.pack(batch.padding_mask, True),
            token_weights=pack(batch.token_weights, 1.0),
            routes=row.pack(batch.routes),
            packed=row,
            targets=row.pack(batch.tokens[:, 1:], self.tokenizer.pad_id),
            route_masks=(row.pack(route_masks[0]), row.pack(route_masks[1])),
        )

    def _per_token_of_batch(self, batch: TrainBatch, micro_batches: list[TrainBatch],
                            values: list[torch.Tensor]) -> torch.Tensor:
        """[n, S - 1]: the micro-batches' per-token ``values`` at their places in ``batch`` (on every CP rank
        of the replica: each wrote its own positions of the rows)."""
        if micro_batches[0].packed is None:
            return torch.cat(values)
        out = torch.zeros_like(batch.rollout_logprobs)
        for micro, micro_values in zip(micro_batches, values, strict=True):
            micro.packed.unpack(micro_values, out)
        cp = self.engine.groups.cp
        if cp.size() > 1:
            dist.all_reduce(out, group=cp)
        return out

    def compute_old_logprobs(self, batch: TrainBatch) -> torch.Tensor:
        if self.config.rl.old_logprobs == "rollout":
            return batch.rollout_logprobs.clone()
        # The rollout's experts are compared with the training routers' where it recorded them (not vLLM).
        return self._logprobs(batch, self.config.rollout.temperature, compare_routes=self.vllm is None)

    @torch.no_grad()
    def _logprobs(self, batch: TrainBatch, temperature: float, *, compare_routes: bool) -> torch.Tensor:
        """[n, S - 1] the training engine's log-probs of ``batch``'s tokens at ``temperature`` (on every rank)."""

        def forward_step(micro: TrainBatch, model):
            hidden = self._forward(model, micro, compare_routes=compare_routes)
            return hidden, lambda output: (
                output.sum() * 0,
                {"logprobs": self.engine.token_logprobs(output, micro.predicted, micro.loss_mask, temperature)[0]})

        micro_batches = self._micro_batches(batch)
        self.engine.train(False)
        outputs = self.engine.run_micro_batches(micro_batches, forward_step, forward_only=True)
        self.engine.train(True)
        if outputs:
            logprobs = self._per_token_of_batch(batch, micro_batches, [out["logprobs"] for out in outputs])
        else:
            logprobs = torch.empty_like(batch.rollout_logprobs)
        # Every stage holds the rollouts and their bookkeeping; only the last computes log-probs.
        return broadcast_from_last_stage(logprobs, self.pp_group)

    def _sync_vllm(self, version: int) -> dict[str, float]:
        """The weights of step ``version`` into vLLM, checked against this engine's log-probs of the probe."""
        probe = self.vllm.probe
        lengths = torch.tensor([len(sequence) for sequence in probe], device=self.engine.device)
        width = self.engine.padded_length(int(max(len(sequence) for sequence in probe)))
        tokens = torch.full((len(probe), width), self.tokenizer.pad_id, device=self.engine.device)
        for row, sequence in enumerate(probe):
            tokens[row, :len(sequence)] = torch.tensor(sequence, device=self.engine.device)
        padding_mask = right_padding_mask(lengths, width)
        model = self.config.model
        batch = TrainBatch(tokens=tokens, loss_mask=(~padding_mask[:, 1:]).float(),
                           advantages=torch.zeros(len(probe), device=self.engine.device),
                           rollout_logprobs=torch.zeros(len(probe), width - 1, device=self.engine.device),
                           padding_mask=padding_mask,
                           routes=torch.zeros(len(probe), width, 0, model.moe_router_topk,
                                              dtype=route_dtype(model.num_experts), device=self.engine.device))
        # vLLM's probe log-probs are of the model's own distribution: temperature 1.
        logprobs = self._logprobs(batch, 1.0, compare_routes=False)
        expected = [logprobs[row, :len(sequence) - 1] for row, sequence in enumerate(probe)]
        return self.vllm.sync(self.engine.module, version, expected)

    def update(self, batch: TrainBatch) -> dict[str, float]:
        """K optimizer steps, each on 1/K of the rollout batch (M1's off-policy updates)."""
        updates = self.config.rl.updates_per_rollout
        size = len(batch) // updates
        per_update = []
        for k in range(updates):
            per_update.append(self._update_once(batch.slice(k * size, (k + 1) * size)))
        averaged = {key: sum(m[key] for m in per_update) / updates for key in per_update[0] if not key.endswith("_max")}
        averaged.update({key: max(m[key] for m in per_update) for key in per_update[0] if key.endswith("_max")})
        for hook in self.metric_hooks:
            averaged = hook.step_metrics(averaged)
        return averaged

    def _update_once(self, mini_batch: TrainBatch) -> dict[str, float]:
        loss_config = self.config.rl.loss
        temperature = self.config.rollout.temperature
        micro_batches = self._micro_batches(mini_batch)
        # Under CP each rank holds pieces of its rows' sequences: their per-sequence sums span the CP ranks.
        cp = self.engine.groups.cp
        counts = compute_global_counts([m.loss_mask for m in micro_batches], [m.old_logprobs for m in micro_batches],
                                       group=self.engine.groups.dp_cp,
                                       sequences=[m.sequences.split_over(cp) for m in micro_batches])
        scale = self.engine.loss_scale_for_schedule(len(micro_batches))
        loss_params = loss_config.params if self.adaptive_clip is None else self.adaptive_clip.params()

        def forward_step(micro: TrainBatch, model):
            hidden = self._forward(model, micro, compare_routes=False)

            def loss_func(output):
                logprobs, entropy = self.engine.token_logprobs(output, micro.predicted, micro.loss_mask,
                                                                temperature, compute_entropy=True)
                sequences = micro.sequences.split_over(cp)
                loss, metrics = compute_policy_loss(loss_config.name, logprobs, micro.old_logprobs, micro.advantages,
                                                    micro.loss_mask, counts, micro.token_weights, sequences,
                                                    **loss_params)
                metrics["loss/entropy"] = (entropy * micro.loss_mask).sum() / counts.num_tokens.clamp(min=1)
                if self.metric_hooks:
                    view = UpdateMicroBatch(
                        targets=micro.predicted, loss_mask=micro.loss_mask, logprobs=logprobs.detach(),
                        old_logprobs=micro.old_logprobs, advantages=micro.advantages, loss_name=loss_config.name,
                        loss_params=loss_params, counts=counts, sequences=sequences,
                        logprobs_of=lambda targets, mask: self.engine.token_logprobs(output, targets, mask,
                                                                                   temperature)[0])
                    for hook in self.metric_hooks:
                        metrics.update(hook.micro_batch_metrics(view))
                return loss * scale, metrics

            return hidden, loss_func

        outputs = self.engine.run_micro_batches(micro_batches, forward_step, forward_only=False)
        # Only the last pipeline stage computes the loss and its metrics (and only it logs).
        # Each rank's tokens are its own: its data-parallel share, its CP share of every row.
        metrics = {key: float(value) for key, value in reduce_metrics(outputs, group=self.engine.groups.dp_cp).items()} if outputs else {}
        result = self.engine.step()
        if not result.applied:
            self.num_skipped_updates += 1
            if self.num_skipped_updates > self.config.train.max_nonfinite_skips:
                raise RuntimeError(
                    f"{self.num_skipped_updates} updates skipped for non-finite gradients (train.max_nonfinite_skips = "
                    f"{self.config.train.max_nonfinite_skips}): lower optimizer.lr or check the data"
                )
        metrics.update({"perf/grad_norm": result.grad_norm, "perf/lr": result.lr,
                        "perf/skipped_updates": float(self.num_skipped_updates)})
        if self.adaptive_clip is not None:
            metrics.update(self.adaptive_clip.metrics())
            self._adapt_clip(metrics)
        return metrics

    def _adapt_clip(self, metrics: dict[str, float]) -> None:
        """Move the clip bounds from this step's capped fractions, global over the data-parallel ranks
        (reduce_metrics). Only the last pipeline stage computes them: it sends them to the other stages,
        so every rank holds the same bounds (rank 0 saves them)."""
        keys = (adaptive_clip.HIGH_METRIC, adaptive_clip.LOW_METRIC)
        fractions = torch.tensor([metrics.get(key, 0.0) for key in keys], dtype=torch.float64, device=self.engine.device)
        high, low = broadcast_from_last_stage(fractions, self.pp_group).tolist()
        self.adaptive_clip.update(high, low)

    # -- evaluation -----------------------------------------------------------------------------

    def evaluate(self) -> dict[str, float]:
        """The held-out metrics of the eval section (megacispo.evaluation.evaluator): greedy accuracy, pass@k and
        mean@k; empty without data.test_prompts."""
        config = self.config
        # Over DP x CP: decoding never splits a sequence, so each CP rank takes test prompts of its own.
        return Evaluator(self.generator, self.tokenizer, self.test_records, self.engine.groups.dp_cp,
                         settings=config.eval, rollout=config.rollout, seed=config.train.seed, scoring=self.scoring,
                         environments=self.environments, interrupt=self._abandon_if_stopped).run()

    def _log_evaluation(self, extra: dict[str, float] | None = None) -> float:
        """Evaluate and log the metrics, with ``extra``, at this step; the greedy accuracy (NaN without it,
        or when SIGTERM stopped the evaluation: the loop then stops and saves this step)."""
        try:
            metrics = {**self.evaluate(), **(extra or {})}
        except StepAbandoned:
            if self.logger.enabled:
                print(f"SIGTERM: the evaluation at step {self.step} stopped; {self._what_is_saved()}", flush=True)
            return float("nan")
        if metrics:
            self.logger.log(self.step, metrics)
        return metrics.get("eval/accuracy", float("nan"))

    # -- checkpoints ----------------------------------------------------------------------------

    def save(self) -> None:
        """The checkpoint of the current step, unless it is the one just saved or resumed from."""
        if self._saved_step == self.step:
            return
        save_checkpoint(
            checkpoint_root(self.config), self.step, self.engine.module, self.engine.optimizer, self.engine.scheduler,
            extra_state={"sampler": self.sampler.state_dict(), "consumed_samples": self.consumed_samples,
                         "num_skipped_updates": self.num_skipped_updates, **self._adaptive_clip_state(),
                         **self._lora_base_state()},
            config_dict=to_dict(self.config), keep_last=self.config.train.keep_last,
        )
        self._saved_step = self.step

    def start(self, plan: RunStart) -> None:
        """Load what ``check_start`` checked: the newest of the run's checkpoints that loads (passing over
        those that do not verify, and those whose shards do not read back), or for a fresh start
        train.load's weights. CheckpointError, on every rank alike, when none loads. A LoRA run's checkpoints
        hold its adapters alone: the base (train.load) is loaded first, either way."""
        if self.config.lora.enabled:
            self.load_initial_weights()
            self._base_fingerprint = base_fingerprint(self.engine.module)
        for path, problem in reversed(plan.checkpoints.items()):
            if problem is None:
                try:
                    self._resume_from(path)
                    self._say(f"--resume: continuing from {path}")
                    return
                except CheckpointError as error:
                    problem = str(error)
            self._say(f"--resume: skipped {path.name}: {problem}")
        if plan.checkpoints:
            raise CheckpointError(f"--resume: no checkpoint under {checkpoint_root(self.config)} loads (above): move "
                                  f"them away to start afresh.")
        if plan.resuming:
            self._say(f"--resume: no checkpoint under {checkpoint_root(self.config)}; starting afresh")
        if not self.config.lora.enabled:
            self.load_initial_weights()

    def load_initial_weights(self) -> None:
        """The weights a fresh run starts from: train.load (e.g. the SFT checkpoint, or a Hugging Face
        directory), if set."""
        if self.config.train.load:
            load_start_weights("train.load", self.config.train.load, self.engine)

    def _resume_from(self, path: Path) -> None:
        meta = load_checkpoint(path, self.engine.module, self.engine.optimizer, self.engine.scheduler)
        extra = meta["extra_state"]
        if self.config.lora.enabled:
            self._check_lora_base(path, extra[LORA_BASE_STATE])
        self.step = self._saved_step = meta["step"]
        self.sampler.load_state_dict(extra["sampler"])
        self.consumed_samples = extra["consumed_samples"]
        self.num_skipped_updates = extra["num_skipped_updates"]
        # A checkpoint of a run with fixed bounds has none: the adapted bounds then start from the config's.
        if ADAPTIVE_CLIP_STATE in extra:
            dropped = adaptive_clip.restore(self.adaptive_clip, extra[ADAPTIVE_CLIP_STATE])
            if dropped is not None:
                self._say(f"--resume: {dropped}")

    def _lora_base_state(self) -> dict[str, dict[str, object]]:
        """The checkpoint's extra_state entry naming the base its adapters were trained on; empty without LoRA."""
        if not self.config.lora.enabled:
            return {}
        return {LORA_BASE_STATE: {"train.load": str(self.config.train.load), "fingerprint": self._base_fingerprint}}

    def _check_lora_base(self, path: Path, saved: dict) -> None:
        """The adapters at ``path`` were trained on the base this run loaded (train.load)."""
        if not same_base(saved["fingerprint"], self._base_fingerprint):
            raise CheckpointError(
                f"{path} holds adapters trained on another base: train.load = {self.config.train.load} has weights "
                f"of fingerprint {self._base_fingerprint}, the adapters' base {saved['train.load']} had "
                f"{saved['fingerprint']}; set train.load={saved['train.load']}"
            )

    def _adaptive_clip_state(self) -> dict[str, dict[str, object]]:
        """The checkpoint's extra_state entry of the adapted bounds; empty when they are fixed."""
        return {} if self.adaptive_clip is None else {ADAPTIVE_CLIP_STATE: self.adaptive_clip.state_dict()}

    def _say(self, line: str) -> None:
        # Rank 0: it names a damaged file (load_checkpoint) and prints the errors.
        if dist.get_rank() == 0:
            print(line, flush=True)

    def _what_is_saved(self) -> str:
        """The end of a SIGTERM line: the step the stop saves (``save``)."""
        return f"saving step {self.step}" if self.step else NOTHING_TRAINED

    def _request_stop(self, signum, frame) -> None:
        # Only a flag: the ranks act on it where they agree (_stop_agreed).
        self._stop_requested = True

    def _stop_pending(self) -> bool:
        """Whether this rank got SIGTERM: what a wait of this rank alone (a reward call) stops for."""
        return self._stop_requested

    def _stop_agreed(self) -> bool:
        """Whether any rank got SIGTERM. The signal reaches ranks at different moments: deciding on
        the flag of this rank alone would leave the others waiting in the next collective. Every rank
        calls this at the same points of the step, in the same order."""
        flag = torch.tensor(int(self._stop_requested), device=self.engine.device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        self.stopped_by_signal = bool(flag)
        return self.stopped_by_signal

    def _abandon_if_stopped(self) -> None:
        if self._stop_agreed():
            raise StepAbandoned

    @contextlib.contextmanager
    def _abandonable(self):
        """The part of a step before its updates: when SIGTERM abandons it, the sampler position and the
        RNG states go back to where the step began, so the checkpoint saved next is the previous step's
        as an uninterrupted run had it, and a resumed run takes this step as that run would."""
        sampler_state, rng_state = self.sampler.state_dict(), capture_rng()
        try:
            yield
        except StepAbandoned:
            self.sampler.load_state_dict(sampler_state)
            restore_rng(rng_state)
            if self.logger.enabled:
                print(f"SIGTERM: step {self.step + 1} abandoned before its updates; {self._what_is_saved()}",
                      flush=True)
            raise

    # -- collectives ----------------------------------------------------------------------------

    def _gather_over_dp(self, *tensors: torch.Tensor) -> list[torch.Tensor]:
        """Each tensor concatenated over the data-parallel ranks (1-D, any length per rank), on the host."""
        gathered: list = [None] * self.dp_size
        # Pickled as host copies: a GPU tensor would be unpickled onto the sending rank's GPU.
        dist.all_gather_object(gathered, [tensor.cpu() for tensor in tensors], group=self.dp_group)
        return [torch.cat(parts) for parts in zip(*gathered)]

    def _all_reduce(self, value: float, op: dist.ReduceOp = dist.ReduceOp.SUM) -> float:
        """``value`` reduced with ``op`` over the data-parallel ranks (in float64 on the run's device)."""
        tensor = torch.tensor(value, dtype=torch.float64, device=self.engine.device)
        dist.all_reduce(tensor, op=op, group=self.dp_group)
        return float(tensor)
