"""The multi-node launch script as users copy it, run for real on one machine: two invocations of
examples/train_multi_node.sh act as two nodes (NNODES=2, one process each, c10d rendezvous on
127.0.0.1) and train two RL steps of the tiny model data-parallel across them (DP=2: gradients and
the distributed optimizer's shards span the nodes), checkpointing each; then
examples/train_single_node.sh --resume continues from step 2 in one process (DP=1, a layout the
checkpoint was not saved at)."""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
import yaml

from megacispo.checkpoint.distributed import complete_checkpoints
from megacispo.metrics.logger import read_scalars

REPO = Path(__file__).resolve().parents[2]
EXAMPLES = REPO / "examples"
LAUNCH_TIMEOUT_S = 300
# Every variable the launch scripts read: one left over in the caller's environment would change
# the run under test.
SCRIPT_VARIABLES = (
    "NNODES", "NODE_RANK", "GPUS_PER_NODE", "MASTER_ADDR", "MASTER_PORT", "RUN_ID", "CONFIG", "MODULE", "TORCHRUN",
    "TP", "PP", "CP", "EP", "ETP", "SP", "STEPS", "LOSS", "UPDATES_PER_ROLLOUT", "MICRO_BATCH", "RUN_DIR",
    "CHECKPOINT_EVERY", "LOG_DIR", "CONSOLE_RANKS",
)


@pytest.fixture
def config(tmp_path) -> Path:
    """The quick start's task and tokenizer, made small, and a config that trains on them cheaply.
    The layout, steps and run directory are left to the launch scripts' variables."""
    data = tmp_path / "data"
    subprocess.run([sys.executable, "tools/make_task_data.py", "--out", str(data), "--task", "addition", "--digits",
                    "2", "--num-train", "64", "--num-test", "8", "--seed", "0"],
                   cwd=REPO, check=True, capture_output=True)
    subprocess.run([sys.executable, "tools/train_tokenizer.py", "--input", str(data / "corpus.txt"), "--vocab-size",
                    "512", "--out", str(data / "tokenizer")], cwd=REPO, check=True, capture_output=True)
    sections = {
        "model": {"size": "tiny"},
        "data": {"train_prompts": str(data / "train.jsonl"), "test_prompts": str(data / "test.jsonl"),
                 "tokenizer": str(data / "tokenizer" / "tokenizer.model")},
        # One sampling round a step: an untrained model's groups mostly score all 0, and dynamic
        # sampling would spend its rounds refilling them.
        "rollout": {"prompts_per_step": 4, "group_size": 4, "max_new_tokens": 4, "dynamic_sampling": False},
        "rl": {"updates_per_rollout": 2},
        "train": {"micro_batch_size": 4, "keep_last": 3},
    }
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(sections))
    return path


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


class Launcher:
    """One launch script run as a subprocess, its console (torchrun's tee of the workers) in a file."""

    def __init__(self, name: str, script: str, env: dict[str, str], log: Path, *args: str) -> None:
        self.name, self.log = name, log
        with open(log, "w") as console:
            self.process = subprocess.Popen(["bash", str(EXAMPLES / script), *args], env=env, stdout=console,
                                            stderr=subprocess.STDOUT)

    def failed(self) -> bool:
        return self.process.poll() not in (None, 0)

    def stop(self) -> None:
        """Kill torchrun and its workers, which it starts in sessions of their own (a process group
        kill would leave them running)."""
        if self.process.poll() is not None:
            return
        try:
            launcher = psutil.Process(self.process.pid)
            family = [launcher, *launcher.children(recursive=True)]
        except psutil.NoSuchProcess:
            family = []
        for member in family:
            try:
                member.kill()
            except psutil.NoSuchProcess:
                pass
        self.process.wait()

    def tail(self) -> str:
        return f"--- {self.name} (exit {self.process.returncode}), end of {self.log}:\n{self.log.read_text()[-3000:]}"


def run_to_completion(launchers: list[Launcher]) -> None:
    """Wait for every launcher to exit 0. One failing would leave the others waiting for it in the
    rendezvous or a collective: at the first failure, or at the deadline, all are killed."""
    start = time.monotonic()
    try:
        while any(launcher.process.poll() is None for launcher in launchers):
            if any(launcher.failed() for launcher in launchers) or time.monotonic() - start > LAUNCH_TIMEOUT_S:
                break
            time.sleep(0.5)
    finally:
        for launcher in launchers:
            launcher.stop()
    assert all(launcher.process.returncode == 0 for launcher in launchers), "\n".join(
        [f"stopped after {time.monotonic() - start:.0f} s (limit {LAUNCH_TIMEOUT_S} s)"]
        + [launcher.tail() for launcher in launchers])


def script_env(config: Path, tmp_path: Path, **variables: str) -> dict[str, str]:
    env = {key: value for key, value in os.environ.items() if key not in SCRIPT_VARIABLES}
    env.update(CONFIG=str(config), TORCHRUN=str(Path(sys.executable).parent / "torchrun"), GPUS_PER_NODE="1",
               RUN_DIR=str(tmp_path / "run"), CHECKPOINT_EVERY="1", OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    env.update(variables)
    return env


def rl_steps_logged(console: str) -> list[int]:
    """The steps of the console lines with a policy loss (the line before training has only eval_acc)."""
    return [int(step) for step in re.findall(r"step (\d+) \|[^\n]*\bloss ", console)]


def test_two_nodes_train_and_checkpoint_then_one_node_resumes_at_another_layout(config, tmp_path):
    run_dir = tmp_path / "run"
    rendezvous = dict(NNODES="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), RUN_ID="rehearsal",
                      LOG_DIR=str(tmp_path / "logs"), EP="2", STEPS="2")
    nodes = [Launcher(f"node {rank}", "train_multi_node.sh",
                      script_env(config, tmp_path, NODE_RANK=str(rank), **rendezvous), tmp_path / f"node{rank}.log")
             for rank in (0, 1)]
    run_to_completion(nodes)

    assert [path.name for path in complete_checkpoints(run_dir / "checkpoints")] == ["step_00000001", "step_00000002"]
    assert [step for step, _ in read_scalars(run_dir)["loss/policy_loss"]] == [1, 2]
    # The rendezvous, not NODE_RANK, decides which node holds global rank 0, the one that logs.
    assert sorted(rl_steps_logged(nodes[0].log.read_text() + nodes[1].log.read_text())) == [1, 2]
    for rank in (0, 1):
        assert list((tmp_path / "logs" / f"node{rank}").glob("*/attempt_0/0/stdout.log")), f"node {rank}'s rank logs"

    single = Launcher("single node --resume", "train_single_node.sh",
                      script_env(config, tmp_path, EP="1", STEPS="3", LOG_DIR=str(tmp_path / "resume_logs")),
                      tmp_path / "resume.log", "--resume")
    run_to_completion([single])

    assert rl_steps_logged(single.log.read_text()) == [3], single.tail()
    assert [step for step, _ in read_scalars(run_dir)["loss/policy_loss"]] == [1, 2, 3]
    assert complete_checkpoints(run_dir / "checkpoints")[-1].name == "step_00000003"
