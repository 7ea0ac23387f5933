"""The loss comparison's shared pieces (tests/multiprocess/test_compare_losses.py and
tests/slow/test_compare_losses.py): examples/compare_losses.sh run at tiny sizes, the markdown table of
tools/plot_runs.py read back, and a run's resolved config."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
LOSSES = ["cispo", "dapo", "grpo", "gspo", "reinforce"]


def table_rows(table: str) -> dict[str, dict[str, str]]:
    """The markdown table as {loss: {column: cell}}."""
    lines = [[cell.strip() for cell in line.strip("|").split("|")] for line in table.splitlines()]
    header, _separator, *rows = lines
    return {row[0]: dict(zip(header, row)) for row in rows}


def script_env(run_dir: Path, extra: str = "", **settings: str) -> dict[str, str]:
    """Tiny everything: 2 RL steps of 8 samples, after 3 SFT steps on 8 pairs."""
    return dict(os.environ, SETUP="0", SEEDS="0", STEPS="2", SFT_STEPS="3", EVAL_EVERY="1", PROMPTS="2", GROUP="4",
                NUM_TRAIN="40", NUM_TEST="4", RUN_DIR=str(run_dir),
                EXTRA=f"--set sft.batch_size=8 --set rollout.max_sampling_rounds=1 {extra}", **settings)


def run_script(env: dict[str, str], cwd: Path) -> str:
    result = subprocess.run(["bash", str(REPO / "examples" / "compare_losses.sh")], cwd=cwd, env=env,
                            capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return result.stdout


def run_config(run_dir: Path) -> dict:
    return json.loads((run_dir / "checkpoints" / "step_00000002" / "meta.json").read_text())["config"]
