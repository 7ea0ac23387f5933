"""Rollouts on processes of their own (megacispo.rollout.remote): a run of 1 training and 1 rollout
process, one step off-policy and synchronous; a rollout process that dies; the staleness bound.
Resuming and SIGTERM with a rollout process: tests/slow/test_async_rollout.py."""

from __future__ import annotations

import math
import os
import subprocess
import sys

import torch

from megacispo.testing.harness import run_distributed
from megacispo.testing.rl_runs import PLACED, REPO, run_overrides, run_train


def _samples(rows: int, width: int, value: int):
    from megacispo.rollout.generate import Samples

    def full(*shape):
        return torch.full(shape, value, dtype=torch.long, device="cpu")

    return Samples(tokens=full(rows, width), prompt_lengths=full(rows), response_lengths=full(rows),
                   rollout_logprobs=full(rows, width - 1).float(), loss_mask=full(rows, width - 1).float(),
                   truncated_early=full(rows).bool(), routes=full(rows, width, 2, 1))


def test_shares_of_different_lengths_join_right_padded():
    from megacispo.rollout.remote import concat_samples

    joined = concat_samples([_samples(2, 3, 5), _samples(1, 4, 6)], pad_id=0)
    assert joined.tokens.tolist() == [[5, 5, 5, 0], [5, 5, 5, 0], [6, 6, 6, 6]]
    assert joined.loss_mask.shape == (3, 3) and joined.loss_mask[0].tolist() == [5.0, 5.0, 0.0]
    assert joined.routes.shape == (3, 4, 2, 1) and int(joined.routes[0, 3].sum()) == 0
    assert joined.prompt_lengths.tolist() == [5, 5, 6]


def test_rounds_staler_than_max_staleness_are_dropped_and_counted():
    """Step 5 with max_staleness 1: a round of version 3 is dropped (its prompts consumed, as the
    lookahead drew them), the next one, of version 4, is taken: its rows of this data-parallel rank."""
    from megacispo.data.prompts import PromptRecord, PromptSampler
    from megacispo.data.rewards import RewardScores
    from megacispo.rollout.placement import Side
    from megacispo.rollout.remote import RemoteRollouts, Round
    from megacispo.startup import run_config

    config = run_config(None, ["rollout.prompts_per_step=2", "rollout.group_size=2", "rollout.max_staleness=1",
                                "placement.rollout_ranks=1"])
    records = [PromptRecord(f"prompt {i}", str(i)) for i in range(8)]
    remote = RemoteRollouts(config, Side(False, 1, 1, None), records, pad_id=0, device=torch.device("cpu"))
    sampler, replay = PromptSampler(records, seed=config.train.seed), PromptSampler(records, seed=config.train.seed)
    rounds = []
    for version in (3, 4):
        stream = (config.train.seed, replay.epoch, replay.position)
        replay.next_batch(2)
        scores = RewardScores([1.0, 0.0, 1.0, 0.0], ("", "", "bad", ""))
        env_metrics = [{"env/turns": float(version * 10 + row)} for row in range(4)]
        rounds.append(Round(stream, version, _samples(4, 3, version), scores, env_metrics))
    remote._next_round = lambda step: rounds.pop(0)
    chosen, samples, scores, env_metrics = remote.take(sampler, step=5, dp_rank=1, quota=1)
    assert samples.tokens[:, 0].tolist() == [4, 4] and env_metrics == [{"env/turns": 42.0}, {"env/turns": 43.0}]
    assert scores.rewards == [1.0, 0.0] and scores.num_failures == 1 and scores.first_failure == "bad"
    assert sampler.position == 4 and chosen == PromptSampler(records, seed=config.train.seed).next_batch(4)[3:4]
    metrics = remote.finish_step()
    assert metrics["rollout/stale_dropped"] == 4.0
    assert metrics["rollout/staleness_mean"] == metrics["rollout/staleness_max"] == 1.0


def test_one_step_off_policy_run_writes_staleness_and_checkpoints(task_files, tmp_path):
    from megacispo.metrics.logger import read_scalars

    argv = run_overrides(task_files, tmp_path, steps=3) + PLACED + ["--set", "rollout.max_staleness=1"]
    run_distributed(run_train, 2, argv, timeout_s=600)
    scalars = read_scalars(str(tmp_path))
    staleness = dict(scalars["rollout/staleness_max"])
    # Step 1 trains on a round of the starting weights; steps 2 and 3 on rounds one step behind.
    assert staleness == {1: 0.0, 2: 1.0, 3: 1.0}
    assert all(value == 0.0 for _, value in scalars["rollout/stale_dropped"])
    assert all(value > 0.0 for _, value in scalars["perf/weight_sync_s"])
    assert all(math.isfinite(value) for _, value in scalars["loss/policy_loss"])
    assert "eval/accuracy" in scalars
    assert sorted(path.name for path in (tmp_path / "checkpoints").glob("step_*")) == [
        "step_00000001", "step_00000002", "step_00000003"]


def test_a_rollout_process_that_dies_stops_the_run_with_its_name(task_files, tmp_path):
    log = tmp_path / "train.log"
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
               "-m", "megacispo.train", *run_overrides(task_files, tmp_path, steps=3), *PLACED,
               "--set", "rl.reward=megacispo.testing.fault_rewards:exit_on_the_rollout_process",
               "--set", "placement.liveness_timeout_s=2"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    with open(log, "w") as out:
        finished = subprocess.run(command, cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT, timeout=300)
    text = log.read_text()
    assert finished.returncode != 0, text[-3000:]
    assert "rollout process 0 of 1 (rank 1 of the world) stopped answering" in text, text[-3000:]


def test_synchronous_placed_run_trains_on_policy(task_files, tmp_path):
    from megacispo.metrics.logger import read_scalars

    run_distributed(run_train, 2, run_overrides(task_files, tmp_path, steps=2) + PLACED, timeout_s=600)
    scalars = read_scalars(str(tmp_path))
    assert dict(scalars["rollout/staleness_max"]) == {1: 0.0, 2: 0.0}
    assert all(math.isfinite(value) for _, value in scalars["loss/policy_loss"])
    assert sorted(path.name for path in (tmp_path / "checkpoints").glob("step_*")) == ["step_00000001",
                                                                                       "step_00000002"]
