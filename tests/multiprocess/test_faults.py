"""Failing well around checkpoints and preemption (issue #27): each fault gets one ``error:`` line
naming the file and the fix, or the documented recovery.

- A bad ``--load`` (a path that does not exist, a checkpoint of another model size, a damaged
  checkpoint named explicitly) stops the run with exit code 2 and one line from rank 0; a damage
  the files show (a file missing or of another size) is found before anything is built, one inside
  a shard when it loads. Nothing is left in the run directory.
- ``--resume`` passes over a damaged newest checkpoint to the one before it, and says why.
- A save killed with SIGKILL leaves nothing that verifies.
- SIGTERM to torchrun (what a scheduler signals) inside a step far longer than torchrun's grace:
  the ranks abandon the step before its updates and save the previous one within the grace; that
  checkpoint is the uninterrupted run's, and the resumed run takes the next step as it did.
- Outputs of megacispo.score and the converter get the permissions the umask gives.

The rows share one trained checkpoint of the tiny model (2 ranks, EP 2, 2 steps, a checkpoint after
each), copied before a row damages it.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp

from megacispo.checkpoint.distributed import CheckpointError, complete_checkpoints, find_checkpoints, verify_checkpoint
from megacispo.testing.harness import run_distributed, run_entry_point

REPO = Path(__file__).resolve().parents[2]
TORCHRUN = Path(sys.executable).parent / "torchrun"
# rollout.prompts_per_step 4 x rollout.group_size 4 over 2 data-parallel ranks: the reward calls of
# one step on one rank (one rollout round per step, no held-out prompts; fault_rewards).
CALLS_PER_STEP = 8
# torchrun's wait between forwarding SIGTERM and SIGKILL: ample for a save of the tiny model (under
# 5 s on 2 busy cores), and far shorter than the step the signal lands in (fault_rewards: up to
# rollout.max_sampling_rounds rounds of rollouts).
GRACE_S = 20


def _argv(task: Path, run_dir: Path, *sets: str) -> list[str]:
    pairs = {
        "parallel.expert_model_parallel_size": 2,
        "data.train_prompts": task / "train.jsonl", "data.test_prompts": "''",
        "data.tokenizer": task / "tok" / "tokenizer.model",
        "rollout.prompts_per_step": 4, "rollout.group_size": 4, "rollout.max_new_tokens": 4,
        "rollout.max_sampling_rounds": 1000,
        "rl.updates_per_rollout": 8, "rl.reward": "megacispo.testing.fault_rewards:alternating_until_preempted",
        # The reward counts its calls in its worker's globals: one worker sees them all.
        "rl.reward_workers": 1,
        "optimizer.lr": 3e-3, "optimizer.decay_steps": 16,
        "train.run_dir": run_dir, "train.steps": 2, "train.micro_batch_size": 1, "train.checkpoint_every": 1,
        "train.keep_last": 5,
    }
    overrides = [f"{key}={value}" for key, value in pairs.items()] + list(sets)
    return [arg for item in overrides for arg in ("--set", item)]


def _main(argv: list[str]) -> dict:
    """megacispo.train's main in this process: its exit code and what it printed."""
    return run_entry_point("megacispo.train", argv)


def _plain_tensors(checkpoint: str) -> dict[str, torch.Tensor]:
    from megatron.core.dist_checkpointing import load_plain_tensors

    torch.distributed.init_process_group("gloo")
    return {key: value for key, value in load_plain_tensors(checkpoint).items() if isinstance(value, torch.Tensor)}


def _tensors(checkpoint: Path) -> dict[str, torch.Tensor]:
    """Every tensor of a checkpoint (weights and optimizer state), whole."""
    (tensors,) = run_distributed(_plain_tensors, 1, str(checkpoint))
    return tensors


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("faults")
    task = root / "task"
    subprocess.run([sys.executable, "tools/make_task_data.py", "--out", str(task), "--task", "addition", "--digits",
                    "2", "--num-train", "64", "--num-test", "8", "--seed", "0"], cwd=REPO, check=True,
                   capture_output=True)
    subprocess.run([sys.executable, "tools/train_tokenizer.py", "--input", str(task / "corpus.txt"), "--vocab-size",
                    "512", "--out", str(task / "tok")], cwd=REPO, check=True, capture_output=True)
    results = run_distributed(_main, 2, _argv(task, root / "run"), timeout_s=600)
    assert [result["code"] for result in results] == [0, 0], results[0]["err"][-3000:]
    return {"task": task, "run": root / "run"}


def _copy_checkpoints(trained: dict[str, Path], run_dir: Path) -> Path:
    shutil.copytree(trained["run"] / "checkpoints", run_dir / "checkpoints")
    return run_dir / "checkpoints" / "step_00000002"


# ---------------------------------------------------------------------------------------------
# Damaged checkpoints: each damage returns the text that must name it
# ---------------------------------------------------------------------------------------------


def _largest_shard(step_dir: Path) -> Path:
    return max(step_dir.glob("*.distcp"), key=lambda path: path.stat().st_size)


def _delete(name: str):
    def damage(step_dir: Path) -> str:
        (step_dir / name).unlink()
        return f"{step_dir / name} is missing"

    return damage


def _truncate_shard(step_dir: Path) -> str:
    shard = _largest_shard(step_dir)
    size = shard.stat().st_size
    os.truncate(shard, size // 2)
    return f"{shard} has {size // 2} bytes, {size} when it was saved"


def _zero_shard(step_dir: Path) -> str:
    shard = _largest_shard(step_dir)
    shard.write_bytes(bytes(shard.stat().st_size))
    return f"{shard} at byte 0 does not load"


DAMAGES = {
    "metadata.json-deleted": _delete("metadata.json"),
    ".metadata-deleted": _delete(".metadata"),
    "shard-truncated": _truncate_shard,
    "shard-zeroed": _zero_shard,
}


@pytest.mark.parametrize("damage", DAMAGES)
def test_resume_passes_over_a_damaged_newest_checkpoint(damage, trained, tmp_path):
    run_dir = tmp_path / "run"
    reason = DAMAGES[damage](_copy_checkpoints(trained, run_dir))
    results = run_distributed(_main, 2, _argv(trained["task"], run_dir, "train.steps=1") + ["--resume"],
                              timeout_s=300)
    assert [result["code"] for result in results] == [0, 0], results[0]["err"][-3000:]
    skipped = [line for line in results[0]["out"].splitlines() if line.startswith("--resume: skipped step_00000002: ")]
    assert len(skipped) == 1 and reason in skipped[0], results[0]["out"]
    assert f"--resume: continuing from {run_dir / 'checkpoints' / 'step_00000001'}\n" in results[0]["out"]
    assert re.search(r"^step 1$", results[0]["out"], re.MULTILINE), "the run is not at step 1"
    assert "--resume" not in results[1]["out"], "rank 1 printed too"


def _missing(trained: dict[str, Path], run_dir: Path) -> tuple[list[str], str]:
    path = run_dir.parent / "no_such_checkpoint"
    return ["--load", str(path)], f"train.load: {path} does not exist: pass a step_* checkpoint directory"


def _another_model(trained: dict[str, Path], run_dir: Path) -> tuple[list[str], str]:
    step_dir = trained["run"] / "checkpoints" / "step_00000002"
    return (["--load", str(step_dir), "--set", "model.size=small"],
            f"{step_dir / 'meta.json'} holds another model: model.hidden_size = 256 (checkpoint: 64)")


def _damaged(damage: str):
    def row(trained: dict[str, Path], run_dir: Path) -> tuple[list[str], str]:
        step_dir = _copy_checkpoints(trained, run_dir.parent / "copy")
        return ["--load", str(step_dir)], DAMAGES[damage](step_dir)

    return row


BAD_LOADS = {"missing": _missing, "another-model": _another_model} | {
    f"named-{damage}": _damaged(damage) for damage in DAMAGES}


# Three rows of the same kind (a damaged shard's or index's named error) run in the slow tier only.
SLOW_BAD_LOADS = {"named-metadata.json-deleted", "named-.metadata-deleted", "named-shard-zeroed"}


@pytest.mark.parametrize("row", [pytest.param(row, marks=pytest.mark.slow) if row in SLOW_BAD_LOADS else row
                                 for row in BAD_LOADS])
def test_a_bad_load_is_one_error_line_from_rank_0(row, trained, tmp_path):
    """Found before the model is built, but for damage inside a shard, found when it loads; either
    way no tensorboard event file or checkpoint is left in the run directory."""
    run_dir = tmp_path / "run"
    load, fragment = BAD_LOADS[row](trained, run_dir)
    results = run_distributed(_main, 2, _argv(trained["task"], run_dir) + load, timeout_s=300)
    assert [result["code"] for result in results] == [2, 2], results[0]["err"][-3000:]
    errors = [line for line in results[0]["err"].splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and fragment in errors[0], results[0]["err"][-3000:]
    assert "weights_only" not in errors[0] and "Traceback" not in results[0]["err"]
    assert "error: " not in results[1]["err"], "rank 1 printed too"
    assert not run_dir.exists()


# ---------------------------------------------------------------------------------------------
# Killed saves and preemption
# ---------------------------------------------------------------------------------------------


def _train_until_killed(argv: list[str]) -> None:
    os.setpgrp()  # the test kills this process and any helper process of the checkpoint writer together
    _main(argv)


def test_a_save_killed_midway_leaves_nothing_that_verifies(trained, tmp_path):
    """One process trains and saves after every step; SIGKILL comes once the save of step 2 has
    written shards into its temporary directory, before it commits: step 1 stays the only checkpoint,
    and what the killed save left is never read."""
    checkpoints = tmp_path / "run" / "checkpoints"
    interrupted = checkpoints / ".tmp_step_00000002"
    argv = _argv(trained["task"], tmp_path / "run", "parallel.expert_model_parallel_size=1", "train.steps=3")
    # Forked from the server that run_distributed's workers come from, which has imported Megatron-Core.
    process = mp.get_context("forkserver").Process(target=_train_until_killed, args=(argv,))
    process.start()
    try:
        deadline = time.monotonic() + 300
        while not (next(interrupted.glob("*.distcp"), None) and not (interrupted / "meta.json").exists()):
            assert process.is_alive() and time.monotonic() < deadline, "no save was caught midway"
            time.sleep(0.001)
    finally:
        os.killpg(process.pid, signal.SIGKILL)
        process.join()
    with pytest.raises(CheckpointError, match="no meta.json"):
        verify_checkpoint(interrupted)
    assert find_checkpoints(checkpoints) == {checkpoints / "step_00000001": None}


def _same(saved, expected) -> bool:
    """Equal nested RNG states (dicts, lists and tuples of tensors and numbers)."""
    if isinstance(expected, dict):
        return saved.keys() == expected.keys() and all(_same(saved[key], expected[key]) for key in expected)
    if isinstance(expected, (list, tuple)):
        return len(saved) == len(expected) and all(_same(a, b) for a, b in zip(saved, expected))
    if isinstance(expected, torch.Tensor):
        return torch.equal(saved, expected)
    return saved == expected


def test_sigterm_to_the_launcher_mid_step_saves_the_last_step_and_resumes_exactly(trained, tmp_path):
    """SIGTERM reaches torchrun while step 2 scores its first rollout round (rank 0's reward sends it),
    and the step would go on for up to 999 more rounds; torchrun forwards it and SIGKILLs the workers
    GRACE_S later. The ranks abandon step 2 at the first decode step of its next round and save step 1
    (periodic checkpoints are off) within the grace: its weights, optimizer, LR schedule, sampler
    position and RNG states are the uninterrupted run's step 1, and the resumed run's step 2 is that
    run's step 2."""
    from megacispo.metrics.logger import read_scalars
    from megacispo.testing.fault_rewards import SIGTERM_AT_CALL

    run_dir = tmp_path / "run"
    env = {**os.environ, "OMP_NUM_THREADS": "1", SIGTERM_AT_CALL: str(CALLS_PER_STEP + 1)}
    command = [str(TORCHRUN), "--standalone", "--nproc-per-node", "2", "--shutdown-timeout", str(GRACE_S),
               "-m", "megacispo.train", *_argv(trained["task"], run_dir, "train.checkpoint_every=0")]
    result = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    output = result.stdout + result.stderr
    assert "SIGTERM: step 2 abandoned before its updates; saving step 1" in output, output[-3000:]
    assert "SIGTERM: stopped after step 1 and saved its checkpoint" in output, output[-3000:]
    assert "forcefully exiting" not in output, output[-3000:]  # torchrun's word for its SIGKILL

    (saved,) = complete_checkpoints(run_dir / "checkpoints")
    straight = trained["run"] / "checkpoints" / "step_00000001"
    assert saved.name == straight.name
    meta, expected_meta = (json.loads((path / "meta.json").read_text()) for path in (saved, straight))
    for key in ("step", "extra_state", "scheduler"):
        assert meta[key] == expected_meta[key], key
    for rank in (0, 1):
        saved_rng, expected_rng = (torch.load(path / "rng" / f"rank_{rank}.pt", weights_only=True)
                                   for path in (saved, straight))
        # The run seeds torch's generator and Megatron's tracker; Python's and numpy's it neither seeds
        # nor draws from, so each process has its own.
        for name in ("torch", "tracker"):
            assert _same(saved_rng[name], expected_rng[name]), (rank, name)
    expected, actual = _tensors(straight), _tensors(saved)
    assert expected.keys() == actual.keys()
    for key in expected:
        assert torch.equal(actual[key], expected[key]), key

    results = run_distributed(_main, 2, _argv(trained["task"], run_dir) + ["--resume"], timeout_s=300)
    assert [result["code"] for result in results] == [0, 0], results[0]["err"][-3000:]
    loss_resumed = dict(read_scalars(run_dir)["loss/policy_loss"])[2]
    loss_straight = dict(read_scalars(trained["run"])["loss/policy_loss"])[2]
    assert loss_resumed == loss_straight


# ---------------------------------------------------------------------------------------------
# Permissions of what the tools write
# ---------------------------------------------------------------------------------------------


def _write_outputs(step_dir: str, out_dir: str) -> dict[str, int]:
    """megacispo.score's output and a converted HF directory, written under umask 027."""
    from megacispo import score
    from megacispo.checkpoint.to_hf import megatron_to_hf

    os.umask(0o027)
    out = Path(out_dir)
    (out / "tokens.jsonl").write_text(json.dumps({"tokens": [1, 5, 9, 2]}) + "\n")
    score.main(["--load", step_dir, "--tokens", str(out / "tokens.jsonl"), "--out", str(out / "scores.jsonl")])
    megatron_to_hf(step_dir, out / "hf", progress=False)
    paths = [out / "scores.jsonl", out / "hf", *(out / "hf").iterdir()]
    return {str(path.relative_to(out)): stat.S_IMODE(path.stat().st_mode) for path in paths}


def test_score_and_converter_outputs_follow_the_umask(trained, tmp_path):
    (modes,) = run_distributed(_write_outputs, 1, str(trained["run"] / "checkpoints" / "step_00000002"),
                               str(tmp_path), timeout_s=300)
    expected = {name: 0o750 if name == "hf" else 0o640 for name in modes}
    assert modes == expected
