"""Rollouts on processes of their own (megacispo.async_rollout): a run of 1 training and 1 rollout
process, one step off-policy and synchronous; a rollout process that dies; the staleness bound."""

from __future__ import annotations

import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from multiprocess_harness import run_distributed
from test_train_e2e import REPO, _overrides, _train, _train_until_sigterm, task_files  # noqa: F401 - task_files is a fixture

PLACED = ["--set", "parallel.expert_model_parallel_size=1", "--set", "placement.rollout_ranks=1"]


def _samples(rows: int, width: int, value: int):
    from megacispo.rollout import Samples

    def full(*shape):
        return torch.full(shape, value, dtype=torch.long, device="cpu")

    return Samples(tokens=full(rows, width), prompt_lengths=full(rows), response_lengths=full(rows),
                   rollout_logprobs=full(rows, width - 1).float(), loss_mask=full(rows, width - 1).float(),
                   truncated_early=full(rows).bool(), routes=full(rows, width, 2, 1))


def test_shares_of_different_lengths_join_right_padded():
    from megacispo.async_rollout import concat_samples

    joined = concat_samples([_samples(2, 3, 5), _samples(1, 4, 6)], pad_id=0)
    assert joined.tokens.tolist() == [[5, 5, 5, 0], [5, 5, 5, 0], [6, 6, 6, 6]]
    assert joined.loss_mask.shape == (3, 3) and joined.loss_mask[0].tolist() == [5.0, 5.0, 0.0]
    assert joined.routes.shape == (3, 4, 2, 1) and int(joined.routes[0, 3].sum()) == 0
    assert joined.prompt_lengths.tolist() == [5, 5, 6]


def test_rounds_staler_than_max_staleness_are_dropped_and_counted():
    """Step 5 with max_staleness 1: a round of version 3 is dropped (its prompts consumed, as the
    lookahead drew them), the next one, of version 4, is taken: its rows of this data-parallel rank."""
    from megacispo.async_rollout import RemoteRollouts, Round
    from megacispo.config import load_config
    from megacispo.data import PromptRecord, PromptSampler
    from megacispo.placement import Side

    config = load_config(None, ["rollout.prompts_per_step=2", "rollout.group_size=2", "rollout.max_staleness=1",
                                "placement.rollout_ranks=1"])
    records = [PromptRecord(f"prompt {i}", str(i)) for i in range(8)]
    remote = RemoteRollouts(config, Side(False, 1, 1, None), records, pad_id=0, device=torch.device("cpu"))
    sampler, replay = PromptSampler(records, seed=config.train.seed), PromptSampler(records, seed=config.train.seed)
    rounds = []
    for version in (3, 4):
        stream = (config.train.seed, replay.epoch, replay.position)
        replay.next_batch(2)
        rounds.append(Round(stream, version, _samples(4, 3, version), [1.0, 0.0, 1.0, 0.0], ["", "", "bad", ""]))
    remote._next_round = lambda step: rounds.pop(0)
    chosen, samples, scores = remote.take(sampler, step=5, dp_rank=1, quota=1)
    assert samples.tokens[:, 0].tolist() == [4, 4]
    assert scores.rewards == [1.0, 0.0] and scores.num_failures == 1 and scores.first_failure == "bad"
    assert sampler.position == 4 and chosen == PromptSampler(records, seed=config.train.seed).next_batch(4)[3:4]
    metrics = remote.finish_step()
    assert metrics["rollout/stale_dropped"] == 4.0
    assert metrics["rollout/staleness_mean"] == metrics["rollout/staleness_max"] == 1.0


def test_one_step_off_policy_run_writes_staleness_and_checkpoints(task_files, tmp_path):
    from megacispo.metrics import read_scalars

    argv = _overrides(task_files, tmp_path, steps=3) + PLACED + ["--set", "rollout.max_staleness=1"]
    run_distributed(_train, 2, argv, timeout_s=600)
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


def exit_on_the_rollout_process(response: str, record) -> float:
    """A reward (``test_async_rollout:exit_on_the_rollout_process``) that kills the rollout process (rank 1)
    at its first call, as a crash would; the training process's evaluation scores 0."""
    if os.environ.get("RANK") == "1":
        os._exit(3)
    return 0.0


def test_a_rollout_process_that_dies_stops_the_run_with_its_name(task_files, tmp_path):
    log = tmp_path / "train.log"
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
               "-m", "megacispo.train", *_overrides(task_files, tmp_path, steps=3), *PLACED,
               "--set", "rl.reward=test_async_rollout:exit_on_the_rollout_process"]
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).parent), "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    with open(log, "w") as out:
        finished = subprocess.run(command, cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT, timeout=300)
    text = log.read_text()
    assert finished.returncode != 0, text[-3000:]
    assert "rollout process 0 of 1 (rank 1 of the world) stopped answering" in text, text[-3000:]


def test_synchronous_placed_run_trains_on_policy(task_files, tmp_path):
    from megacispo.metrics import read_scalars

    run_distributed(_train, 2, _overrides(task_files, tmp_path, steps=2) + PLACED, timeout_s=600)
    scalars = read_scalars(str(tmp_path))
    assert dict(scalars["rollout/staleness_max"]) == {1: 0.0, 2: 0.0}
    assert all(math.isfinite(value) for _, value in scalars["loss/policy_loss"])
    assert sorted(path.name for path in (tmp_path / "checkpoints").glob("step_*")) == ["step_00000001",
                                                                                       "step_00000002"]


@pytest.mark.slow  # 15-40 s (two placed runs, on a quiet or a loaded machine)
def test_resume_sends_the_checkpoints_weights_first(task_files, tmp_path):
    """Resumed after step 2, the rollout process generates step 3's round with the weights of step 2
    (staleness 0: the round in flight at the checkpoint is asked for again), not with its fresh weights."""
    from megacispo.metrics import read_scalars

    off_policy = PLACED + ["--set", "rollout.max_staleness=1"]
    run_distributed(_train, 2, _overrides(task_files, tmp_path, steps=2) + off_policy, timeout_s=600)
    run_distributed(_train, 2, _overrides(task_files, tmp_path, steps=3) + off_policy + ["--resume"], timeout_s=600)
    staleness = dict(read_scalars(str(tmp_path))["rollout/staleness_max"])
    assert staleness[2] == 1.0 and staleness[3] == 0.0
    assert (tmp_path / "checkpoints" / "step_00000003").is_dir()


@pytest.mark.slow  # 12-35 s under torchrun
def test_sigterm_stops_both_sides_after_the_step_in_flight(task_files, tmp_path):
    step = _train_until_sigterm([*_overrides(task_files, tmp_path, steps=1000), *PLACED, "--set",
                                 "rollout.max_staleness=1", "--set", "train.checkpoint_every=0"], tmp_path / "train.log")
    assert (tmp_path / "checkpoints" / f"step_{step:08d}").is_dir()
