"""The tiers and the fixtures that more than one test file uses.

tests/unit/ runs in one process; tests/multiprocess/ starts real processes (harness workers,
torchrun, the entry points and scripts as subprocesses); tests/slow/ takes minutes a test. Every test
under tests/slow/ is marked slow here, so ``-m slow`` and ``-m "not slow"`` (tests/run.sh) pick the
tiers whatever a file says; a parametrized test may also mark some of its rows slow in place. Every test
under tests/vllm/ is marked vllm: it runs in .venv-vllm, vLLM's CPU build (``tests/run.sh --vllm``). The
fixtures' helpers live in tests/support (``megacispo.testing``).
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parent
REPO = TESTS.parent
SLOW = TESTS / "slow"
VLLM = TESTS / "vllm"


@pytest.hookimpl(tryfirst=True)  # before -m deselects by marker
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if item.path.resolve().is_relative_to(SLOW):
            item.add_marker(pytest.mark.slow)
        if item.path.resolve().is_relative_to(VLLM):
            item.add_marker(pytest.mark.vllm)


# ---------------------------------------------------------------------------------------------
# The addition task of the end-to-end RL runs (megacispo.testing.rl_runs)


@pytest.fixture(scope="module")
def task_files(tmp_path_factory) -> Path:
    data = tmp_path_factory.mktemp("task")
    python = sys.executable
    subprocess.run([python, "tools/make_task_data.py", "--out", str(data), "--task", "addition", "--digits", "2",
                    "--num-train", "64", "--num-test", "8", "--seed", "0"], cwd=REPO, check=True, capture_output=True)
    subprocess.run([python, "tools/train_tokenizer.py", "--input", str(data / "corpus.txt"), "--vocab-size", "512",
                    "--out", str(data / "tok")], cwd=REPO, check=True, capture_output=True)
    return data


# ---------------------------------------------------------------------------------------------
# The bad-input catalog's workspace (megacispo.testing.bad_inputs)


@pytest.fixture(scope="module")
def catalog_workspace(tmp_path_factory) -> Path:
    """The task's data and tokenizer, and the damaged files the catalog's rows name."""
    from megacispo.testing.bad_inputs import make_catalog_workspace

    return make_catalog_workspace(tmp_path_factory.mktemp("catalog"))


# ---------------------------------------------------------------------------------------------
# The layout matrix's runs (megacispo.testing.layout_matrix)


@pytest.fixture(scope="module")
def layout_workspace(tmp_path_factory) -> Path:
    """Task prompts, a tokenizer and the start weights, shared by every layout."""
    from megacispo.testing.layout_matrix import make_layout_workspace

    return make_layout_workspace(tmp_path_factory.mktemp("layout_matrix"))


@pytest.fixture(scope="module")
def layout_reference(layout_workspace):
    """The single-process run: one RL step, and the scoring of its own checkpoint."""
    from megacispo.testing.layout_matrix import SINGLE_PROCESS, run_layout

    return run_layout(layout_workspace, "single", SINGLE_PROCESS, scored_checkpoints=None)


@pytest.fixture(scope="module")
def layout_hub(layout_workspace, layout_reference):
    """The hub layout (DP 2 x EP 2): its step, and its scoring of the single-process checkpoint."""
    from megacispo.testing.layout_matrix import HUB, LAYOUTS, run_layout

    return run_layout(layout_workspace, HUB, LAYOUTS[HUB], scored_checkpoints=layout_reference.checkpoints)


@pytest.fixture(scope="module")
def hub_checkpoint_scores(layout_workspace, layout_hub):
    """What one process scores from the hub's checkpoint: its weights differ from the single-process
    run's where Adam's first step went the other way (``assert_same_update``), which moves log-probs
    by up to 5e-3."""
    from megacispo.testing.layout_matrix import score_in_one_process

    return score_in_one_process(layout_workspace, layout_hub.checkpoints)
