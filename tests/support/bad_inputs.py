"""The bad-input catalog's workspace and launches (tests/multiprocess/test_bad_inputs.py, whose
docstring describes the catalog; tests/slow/test_bad_inputs.py runs rewards that always fail): the
task's files and the damaged ones, the quick-start config with the workspace's data, and a run of
megacispo.train under torchrun. The ``catalog_workspace`` fixture (tests/conftest.py) makes the
workspace once per test file."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from megacispo.testing.tool_modules import load_tool

REPO = Path(__file__).resolve().parents[2]
QUICKSTART = REPO / "examples" / "configs" / "quickstart_cpu.yaml"
TORCHRUN = Path(sys.executable).parent / "torchrun"
# The task's alphabet: the tokenizer splits digits, and gives each character here a token of its own.
CHUNK = "12+34=46 "


def _jsonl(prompts: list[str], answer: str = "1") -> str:
    return "".join(json.dumps({"prompt": prompt, "answer": answer}) + "\n" for prompt in prompts)


def make_catalog_workspace(root: Path) -> Path:
    """The task's data and tokenizer in ``root``, and the damaged files the catalog's rows name."""
    subprocess.run([sys.executable, "tools/make_task_data.py", "--out", str(root), "--num-train", "16",
                    "--num-test", "4", "--seed", "0"], cwd=REPO, check=True, capture_output=True)
    subprocess.run([sys.executable, "tools/train_tokenizer.py", "--input", str(root / "corpus.txt"), "--vocab-size",
                    "512", "--out", str(root / "tokenizer")], cwd=REPO, check=True, capture_output=True)
    files = {
        "long.jsonl": _jsonl([CHUNK * 625]),  # over 5,000 tokens
        "long8.jsonl": _jsonl([CHUNK * 625] * 8),
        "huge.jsonl": _jsonl([CHUNK * 12_500] * 8),  # 8 prompts of over 100,000 tokens
        "bad_json.jsonl": '{"prompt": "1+1=", "answer": "2"}\n{"prompt": "1+2=", "answer": "3"\n',
        "empty.jsonl": "",
        "empty.yaml": "",
        "syntax.yaml": "rollout:\n  top_k: [1\n",
        "list.yaml": "- model\n- data\n",
        "scalar_section.yaml": "rollout: 5\n",
        "duplicate_section.yaml": "rollout:\n  group_size: 4\ntrain:\n  steps: 2\nrollout:\n  top_k: 5\n",
        "duplicate_key.yaml": "rollout:\n  group_size: 4\n  top_k: 5\n  group_size: 16\n",
        "garbage.model": "not a sentencepiece model\n",
        "catalog_rewards.py": "def one_argument(response):\n    return 1.0\n",
        "catalog_broken_rewards.py": "import module_that_does_not_exist_xyz\n",
        "health_rewards.py": ("def always_raises(response, record):\n    raise KeyError(response)\n"
                              "def returns_text(response, record):\n    return '1.0'\n"),
    }
    for name, text in files.items():
        (root / name).write_text(text)
    (root / "latin1.yaml").write_bytes(b"train:\n  run_dir: caf\xe9\n")
    (root / "garbage.parquet").write_bytes(b"PAR1 not a parquet file")
    (root / "prompts.csv").write_text("prompt,answer\n1+1=,2\n")
    (root / "messages.jsonl").write_text(json.dumps({"prompt": [{"role": "user", "content": "1+1="}], "answer": "2"}))
    load_tool("make_tiny_hf").build_tokenizer(root / "hf_tokenizer", vocab_size=400)
    return root


def quick(*sets: str) -> list[str]:
    """The quick-start config with the workspace's data, and ``sets`` as --set overrides."""
    data = {"train_prompts": "{ws}/train.jsonl", "test_prompts": "{ws}/test.jsonl", "sft_pairs": "{ws}/sft.jsonl",
            "tokenizer": "{ws}/tokenizer/tokenizer.model"}
    overrides = [f"data.{name}={path}" for name, path in data.items()] + list(sets)
    return ["--config", str(QUICKSTART), *[arg for item in overrides for arg in ("--set", item)]]


def run_argv(template: list[str], workspace: Path, run_dir: Path) -> list[str]:
    argv = [arg.replace("{ws}", str(workspace)) for arg in template]
    return [*argv, "--set", f"train.run_dir={run_dir}", "--set", f"sft.out={run_dir / 'sft'}"]


def torchrun(argv: list[str], workspace: Path, timeout: int) -> subprocess.CompletedProcess:
    env = {key: value for key, value in os.environ.items() if key not in ("RANK", "LOCAL_RANK", "WORLD_SIZE")}
    env["PYTHONPATH"] = os.pathsep.join([str(workspace), env.get("PYTHONPATH", "")])
    return subprocess.run([str(TORCHRUN), "--standalone", "--nproc-per-node", "2", "-m", "megacispo.train", *argv],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)
