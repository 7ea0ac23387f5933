"""The examples: every config passes ``megacispo.train --dry-run`` at the world size it is meant for
without importing Megatron-Core; every launch script parses, keeps to the launch rules and hands
torchrun the entry point, the config and the extra arguments; a world size the layout cannot
split fails with the numbers before anything is built."""

from __future__ import annotations

import math
import os
import re
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from megacispo.startup import run_config

REPO_ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = REPO_ROOT / "examples"
CONFIGS = sorted((EXAMPLES / "configs").glob("*.yaml"))
SCRIPTS = sorted([*EXAMPLES.glob("*.sh"), *EXAMPLES.glob("*.sbatch")])
LAUNCHERS = ["train_single_node.sh", "train_multi_node.sh", "train_slurm.sbatch"]
# Importing any of these would mean the dry run builds (or is about to build) something.
HEAVY_MODULES = ("megatron", "transformer_engine", "transformers")


def intended_world_size(config: Path) -> int:
    """The config's ``# world size: N`` comment; without one, the smallest world its layout splits
    (the least common multiple of TP x PP and expert TP x EP x PP)."""
    declared = re.search(r"^# world size: (\d+)$", config.read_text(), re.MULTILINE)
    if declared:
        return int(declared.group(1))
    parallel = run_config(str(config)).parallel
    pp = parallel.pipeline_model_parallel_size
    expert_split = parallel.expert_tp * parallel.expert_model_parallel_size * pp
    return math.lcm(parallel.tensor_model_parallel_size * pp, expert_split)


def dry_run(config: Path, world_size: int, *extra: str) -> subprocess.CompletedProcess:
    """``python -m megacispo.train --config X --dry-run`` as rank 0 of ``world_size`` (import log on stderr)."""
    env = {key: value for key, value in os.environ.items() if key not in ("RANK", "LOCAL_RANK", "WORLD_SIZE")}
    env["WORLD_SIZE"] = str(world_size)
    return subprocess.run(
        [sys.executable, "-X", "importtime", "-m", "megacispo.train", "--config", str(config), "--dry-run", *extra],
        cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=300,
    )


def imported_modules(importtime_log: str) -> list[str]:
    return [line.rsplit("|", 1)[-1].strip() for line in importtime_log.splitlines() if line.startswith("import time:")]


def test_every_config_declares_or_implies_its_world_size():
    assert {path.name for path in CONFIGS} >= {"quickstart_cpu.yaml", "single_node_8gpu.yaml", "minimax_m1_512gpu.yaml"}
    assert intended_world_size(EXAMPLES / "configs" / "minimax_m1_512gpu.yaml") == 512
    assert intended_world_size(EXAMPLES / "configs" / "single_node_8gpu.yaml") == 8
    assert intended_world_size(EXAMPLES / "configs" / "quickstart_cpu.yaml") == 2  # EP 2, from the layout


@pytest.mark.parametrize("config", CONFIGS, ids=[path.name for path in CONFIGS])
def test_dry_run_prints_the_plan_and_builds_nothing(config):
    world_size = intended_world_size(config)
    result = dry_run(config, world_size)
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.startswith("model: ")
    assert f"layout: world {world_size} = TP " in result.stdout
    assert "loss: " in result.stdout and "run directory: " in result.stdout
    heavy = [name for name in imported_modules(result.stderr) if name.split(".")[0] in HEAVY_MODULES]
    assert not heavy, f"the dry run imported {heavy[:3]}"


def test_a_world_size_the_layout_cannot_split_fails_before_anything_is_built(tmp_path):
    run_dir = tmp_path / "run"
    # 264 = 33 x 8 splits into TP 8 x PP 1 but not into expert TP 8 x EP 32 x PP 1 = 256.
    result = dry_run(EXAMPLES / "configs" / "minimax_m1_512gpu.yaml", 264, "--set", f"train.run_dir={run_dir}")
    assert result.returncode != 0
    assert ("world size 264 is not divisible by expert_tensor_parallel_size * expert_model_parallel_size * "
            "pipeline_model_parallel_size = 8 * 32 * 1 = 256") in result.stderr
    assert "Traceback" not in result.stderr
    assert not run_dir.exists()
    assert not [name for name in imported_modules(result.stderr) if name.split(".")[0] in HEAVY_MODULES]


@pytest.mark.parametrize("script", SCRIPTS, ids=[path.name for path in SCRIPTS])
def test_script_parses_and_keeps_to_the_launch_rules(script):
    result = subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    text = script.read_text()
    if text.startswith("#!"):  # run as a program; a file without a shebang is sourced by one
        assert "set -euo pipefail" in text
    assert not re.search(r"\b(pkill|killall)\b", text), "no broad kills of other processes"


def _fake_command(directory: Path, name: str, body: str) -> None:
    path = directory / name
    path.write_text(f"#!/bin/sh\n{body}\n")
    path.chmod(path.stat().st_mode | stat.S_IXUSR)


@pytest.mark.parametrize("launcher", LAUNCHERS)
def test_launcher_hands_torchrun_the_entry_point_config_and_extra_arguments(launcher, tmp_path):
    """TORCHRUN=echo prints the command line instead of starting processes (srun and scontrol are
    stand-ins for Slurm's)."""
    _fake_command(tmp_path, "scontrol", "printf 'gpu001\\ngpu002\\n'")
    _fake_command(tmp_path, "srun", 'shift; exec "$@"')  # drop --kill-on-bad-exit=1
    env = dict(os.environ, TORCHRUN="echo", LOG_DIR=str(tmp_path / "logs"), TP="4", STEPS="3",
               PATH=f"{tmp_path}:{os.environ['PATH']}", SLURM_JOB_NODELIST="gpu[001-002]", SLURM_NNODES="2",
               SLURM_JOB_ID="77", SLURM_SUBMIT_DIR=str(REPO_ROOT))
    result = subprocess.run(["bash", str(EXAMPLES / launcher), "--resume", "--set", "rollout.top_p=0.9"],
                            cwd=tmp_path, env=env, capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    command = result.stdout.strip().splitlines()[-1].split()
    config = command[command.index("--config") + 1]
    assert (REPO_ROOT / config).is_file() and config.startswith("examples/configs/")
    assert command[command.index("-m") + 1] == "megacispo.train"
    assert command[-3:] == ["--resume", "--set", "rollout.top_p=0.9"]
    assert "parallel.tensor_model_parallel_size=4" in command and "train.steps=3" in command
    assert {"--log-dir", "--redirects", "--tee", "--nproc-per-node"} <= set(command)
    if launcher != "train_single_node.sh":
        assert command[command.index("--rdzv-backend") + 1] == "c10d" and "--rdzv-endpoint" in command
    if launcher == "train_slurm.sbatch":
        assert command[command.index("--rdzv-endpoint") + 1] == "gpu001:29500"
        assert command[command.index("--nnodes") + 1] == "2"


def test_rl_queue_keeps_finished_runs_bounds_the_jobs_and_reports_a_failure(tmp_path):
    """examples/rl_queue.sh with stand-in runs: a finished run is kept, an unfinished one is
    started over, at most JOBS run at once, a slot frees when any run ends (not only the oldest),
    and a failed run makes wait_runs fail."""
    (tmp_path / "done" / "checkpoints" / "step_00000003").mkdir(parents=True)
    (tmp_path / "stale" / "old_events").mkdir(parents=True)
    script = f"""
        set -euo pipefail
        RUN_DIR={tmp_path} STEPS=3 JOBS=2
        source {EXAMPLES / "rl_queue.sh"}
        run() {{  # a stand-in run: notes the runs alive beside it, lasts $3 s, then fails if asked to
            mkdir "$RUN_DIR/running_$1"; sleep 0.3; ls "$RUN_DIR" | grep running_ >"$RUN_DIR/alive_$1"
            sleep "$3"; rmdir "$RUN_DIR/running_$1"; [ "$2" = ok ]
        }}
        for name in done stale a b c; do queue_run "$name" run "$name" ok 0.3; done
        wait_runs
        queue_run slow run slow ok 3; queue_run e run e ok 0.3; queue_run f run f ok 0.3
        wait_runs
        queue_run d run d fail 0
        wait_runs || echo "wait_runs failed"
    """
    result = subprocess.run(["bash", "-c", script], capture_output=True, text=True, timeout=60)
    assert "   kept done (finished earlier)" in result.stdout
    assert [line for line in result.stdout.splitlines() if line.startswith("   start")] == [
        f"   start {name}" for name in ("stale", "a", "b", "c", "slow", "e", "f", "d")]
    assert not (tmp_path / "stale" / "old_events").exists(), "an unfinished run starts over"
    alive = {name: (tmp_path / f"alive_{name}").read_text().split() for name in ("stale", "a", "b", "c", "e", "f")}
    assert max(len(names) for names in alive.values()) <= 2
    assert "running_slow" in alive["f"], "f starts when e ends, while the slow run goes on"
    assert result.stdout.rstrip().endswith("wait_runs failed")
    assert "some RL runs failed" in result.stderr
