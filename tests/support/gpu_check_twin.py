"""The GPU check's CPU twin (``benchmarks/gpu_check.sh --cpu``) run from the tests, and its table's
driver rows read back (tests/multiprocess/test_gpu_check.py, tests/slow/test_gpu_check.py); the check's
script imported to test its parts in-process."""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path
from types import ModuleType

REPO = Path(__file__).resolve().parents[2]
TABLE_HEADER = "| check | case | value | bound | status | note |"
DRIVER_STAGES = ["sft", "rl", "padded", "cp", "bf16-rollout", "fp8", "tp2-ep2", "rollout-ranks", "vllm", "save",
                 "resume", "score"]


def load_gpu_check() -> ModuleType:
    """benchmarks/gpu_check.py as a module, registered in sys.modules (dataclasses look their module up there)."""
    spec = importlib.util.spec_from_file_location("megacispo_benchmarks_gpu_check",
                                                  REPO / "benchmarks" / "gpu_check.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def cpu_twin(run_dir: Path, dtype: str, *extra: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHON": sys.executable}
    return subprocess.run(
        ["bash", "benchmarks/gpu_check.sh", "--cpu", "--driver-dtype", dtype, "--run-dir", str(run_dir), *extra],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=600,
    )


def table_rows(stdout: str) -> list[dict[str, str]]:
    """The check's table's rows as {column: cell}."""
    lines = stdout.splitlines()
    assert TABLE_HEADER in lines, stdout
    columns = [cell.strip() for cell in TABLE_HEADER.strip("|").split("|")]
    body = lines[lines.index(TABLE_HEADER) + 2:]
    rows = []
    for line in body:
        if not line.startswith("| "):
            break
        # A "|" inside a cell is written "\|".
        cells = (cell.strip().replace("\\|", "|") for cell in line.strip("|").split(" | "))
        rows.append(dict(zip(columns, cells)))
    return rows


def stage_rows(stdout: str) -> list[dict[str, str]]:
    """The driver's rows (check "driver", case "<stage> (<dtype>)") as {stage, dtype, result, status}."""
    rows = []
    for row in table_rows(stdout):
        if row["check"] == "driver":
            stage, dtype = re.fullmatch(r"(.+) \((.+)\)", row["case"]).groups()
            rows.append({"stage": stage, "dtype": dtype, "result": row["value"], "status": row["status"]})
    return rows


def assert_every_stage_passed(result: subprocess.CompletedProcess, dtype: str, skipped: set[str]) -> None:
    """Every driver stage of ``dtype`` passed but those in ``skipped``, which were skipped."""
    rows = stage_rows(result.stdout)
    assert [(row["stage"], row["dtype"]) for row in rows] == [("data + tokenizer", "-")] + [
        (stage, dtype) for stage in DRIVER_STAGES]
    statuses = {row["stage"]: row["status"] for row in rows}
    expected = {stage: "skip" if stage in skipped else "pass" for stage in statuses}
    assert statuses == expected, f"{rows}\n{result.stderr[-4000:]}"
    assert result.returncode == 0, result.stderr[-4000:]
