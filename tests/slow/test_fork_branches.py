"""tools/fork_branches.py (the worked-addition fork task, issue #26) end to end on a tiny random
checkpoint: one checkpoint, one run, the three numbers it prints (about 20 s)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from megacispo.testing.harness import run_distributed
from megacispo.testing.parallel_case import save_random_tiny_checkpoint
from megacispo.testing.tool_modules import load_tool

REPO = Path(__file__).resolve().parents[2]


def test_fork_branches_prints_the_three_numbers(tmp_path, capsys):
    subprocess.run([sys.executable, "tools/make_task_data.py", "--out", str(tmp_path / "task"), "--digits", "2",
                    "--num-train", "200", "--num-test", "6", "--seed", "0", "--sft-worked", "0.1"],
                   cwd=REPO, check=True, capture_output=True)
    subprocess.run([sys.executable, "tools/train_tokenizer.py", "--input", str(tmp_path / "task" / "corpus.txt"),
                    "--vocab-size", "512", "--out", str(tmp_path / "tok")], cwd=REPO, check=True, capture_output=True)
    run_distributed(save_random_tiny_checkpoint, 1, str(tmp_path / "checkpoints"), 1, 0.3)
    settings = {
        "data.test_prompts": tmp_path / "task" / "test.jsonl", "data.tokenizer": tmp_path / "tok" / "tokenizer.model",
        "rollout.max_new_tokens": 8, "rl.reward": "numeric", "train.run_dir": tmp_path / "run",
    }
    command = [sys.executable, "tools/fork_branches.py", "--load", str(tmp_path / "checkpoints")]
    for key, value in settings.items():
        command += ["--set", f"{key}={value}"]
    result = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    numbers = {
        name: float(re.search(rf"{name}: ([0-9.]+)", result.stdout)[1])
        for name in ("worked branch accuracy", "direct branch accuracy", "marker probability at the response's start")
    }
    assert all(0.0 <= value <= 1.0 for value in numbers.values()), numbers
    # A random model puts some mass on every token, none on all of it.
    assert 0.0 < numbers["marker probability at the response's start"] < 1.0
    with pytest.raises(SystemExit) as stopped:
        load_tool("fork_branches").main(command[2:] + ["--marker", "~~~"])
    assert stopped.value.code == 2 and "--marker: '~~~' encodes to" in capsys.readouterr().err
