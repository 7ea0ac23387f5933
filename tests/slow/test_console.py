"""The console of a quick run under torchrun (2 processes, EP=2, per-rank logs): SFT draws one bar with
its rate on the logging rank; RL from the SFT checkpoint draws one rollout bar per step on the logging
rank only, prints one line per step, and no checkpoint save prints Megatron's "common state dict
differs" warning (the distributed optimizer's param_state left on DP rank 1: megacispo.checkpoint.distributed)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
COMMON_STATE_WARNING = "common state dict differs"


@pytest.fixture(scope="module")
def task(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("console")
    python = sys.executable
    subprocess.run([python, "tools/make_task_data.py", "--out", str(root / "data"), "--task", "addition", "--digits",
                    "2", "--num-train", "64", "--num-test", "8", "--seed", "0"], cwd=REPO, check=True,
                   capture_output=True)
    subprocess.run([python, "tools/train_tokenizer.py", "--input", str(root / "data" / "corpus.txt"), "--vocab-size",
                    "512", "--out", str(root / "tok")], cwd=REPO, check=True, capture_output=True)
    return root


def _torchrun(root: Path, name: str, module: str, settings: dict[str, object]) -> tuple[str, list[str]]:
    """Run ``module`` on 2 processes; (everything printed, each rank's stderr) from torchrun's per-rank logs."""
    log_dir = root / f"logs_{name}"
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
               "--log-dir", str(log_dir), "--redirects", "3", "-m", module]
    for key, value in settings.items():
        command += ["--set", f"{key}={value}"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    result = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    rank_logs = [sorted(log_dir.rglob(f"{rank}/stderr.log"))[0].read_text() for rank in range(2)]
    rank_out = [sorted(log_dir.rglob(f"{rank}/stdout.log"))[0].read_text() for rank in range(2)]
    assert result.returncode == 0, (result.stderr + "".join(rank_logs))[-4000:]
    return result.stdout + result.stderr + "".join(rank_logs) + "".join(rank_out), rank_logs


def _settings(root: Path) -> dict[str, object]:
    return {
        "parallel.expert_model_parallel_size": 2, "data.tokenizer": root / "tok" / "tokenizer.model",
        "data.train_prompts": root / "data" / "train.jsonl", "data.test_prompts": root / "data" / "test.jsonl",
        "data.sft_pairs": root / "data" / "sft.jsonl", "train.run_dir": root / "rl", "train.micro_batch_size": 4,
        "sft.batch_size": 8, "sft.steps": 3, "sft.out": root / "sft", "rollout.prompts_per_step": 2,
        "rollout.group_size": 4, "rollout.max_new_tokens": 4, "rl.updates_per_rollout": 1, "train.steps": 2,
        "train.checkpoint_every": 1, "train.eval_every": 0,
    }


# 1-2 minutes on 2 cores: two torchrun launches
def test_sft_then_rl_console(task: Path):
    settings = _settings(task)
    everything, ranks = _torchrun(task, "sft", "megacispo.sft", settings)
    assert re.search(r"sft: 100%\|.*3/3 \[.*(step/s|s/step)", ranks[0]), ranks[0][-2000:]
    assert "sft:" not in ranks[1]
    assert COMMON_STATE_WARNING not in everything

    everything, ranks = _torchrun(task, "rl", "megacispo.train", {**settings, "train.load": task / "sft" / "checkpoints"})
    assert COMMON_STATE_WARNING not in everything
    bars = set(re.findall(r"(step \d+ rollout):", ranks[0]))
    assert bars == {"step 1 rollout", "step 2 rollout"}, bars
    assert not re.search(r"(?<!rollout)\brollout: ", ranks[0].replace("step 1 rollout: ", "").replace(
        "step 2 rollout: ", "")), "a rollout bar outside the step's bar"
    assert "rollout:" not in ranks[1], "a rank other than the logging rank drew a bar"
    lines = [line for line in everything.splitlines() if re.match(r"step \d+ \| loss ", line)]
    assert [line.split(" |")[0] for line in lines] == ["step 1", "step 2"]
