"""examples/hf_round_trip.sh end to end, as a user runs it (about a minute on 2 cores)."""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def test_hf_round_trip_example_trains_from_and_exports_to_hugging_face(tmp_path):
    """examples/hf_round_trip.sh as a user runs it: from a Hugging Face model, tokenizer and Parquet set
    through CISPO at EP=2, pass@k, the export, and transformers generating from it."""
    run_dir = tmp_path / "run"
    env = dict(os.environ, RUN_DIR=str(run_dir), EXTRA="--set train.steps=2")
    result = subprocess.run(["bash", str(EXAMPLES / "hf_round_trip.sh")], cwd=tmp_path, env=env,
                            capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert f"Hugging Face export: {run_dir / 'export'}" in result.stdout
    assert re.search(r"^eval/pass@4 +\d\.\d{4}$", result.stdout, re.MULTILINE), result.stdout[-2000:]
    assert re.search(r"^response: '.*'$", result.stdout, re.MULTILINE), result.stdout[-2000:]
    exported = {path.name for path in (run_dir / "export").iterdir()}
    assert {"config.json", "tokenizer.json", "tokenizer_config.json"} <= exported, exported
